"""The `prismc` console script and `python -m prism_dsl`: `main` imported, then run. Its modules take most of a
second to load (SymPy); a Ctrl-C meanwhile is said as one during the command is, not as a traceback."""

from __future__ import annotations

import os
import sys


def run() -> int:
    try:
        from .main import main
    except KeyboardInterrupt:
        _interrupted()
    try:
        return main()  # which says an interrupted command itself
    except KeyboardInterrupt:  # while its command line was read
        _interrupted()


def _interrupted():
    """Nothing was done yet: out at once. Through the interpreter's shutdown, with modules half imported (NumPy's),
    the process could still die of the signal."""
    print("prismc: interrupted", file=sys.stderr, flush=True)
    os._exit(130)
