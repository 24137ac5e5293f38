"""The `prismc` console script and `python -m prism_dsl`: `main` imported, then run. Its modules take most of a
second to load (SymPy); a Ctrl-C meanwhile is said as one during the command is, not as a traceback."""

from __future__ import annotations

import sys


def run() -> int:
    try:
        from .main import main
    except KeyboardInterrupt:
        print("prismc: interrupted", file=sys.stderr)
        return 130
    return main()
