"""The `prismc` console script and `python -m prism_dsl`: `main` imported, then run. Its modules take most of a
second to load (SymPy); a Ctrl-C meanwhile is said as one during the command is, not as a traceback."""

from __future__ import annotations

import os
import signal
import sys


def run() -> int:
    # While the modules load, a Ctrl-C ends the process from the signal handler itself: raised as a
    # KeyboardInterrupt it can land in an extension module's initialisation, which reports it as an ImportError of
    # its own (NumPy's: "PyCapsule_Import could not import module datetime").
    loading = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if loading:
        signal.signal(signal.SIGINT, lambda signum, frame: _interrupted())
    try:
        from .main import main
    except KeyboardInterrupt:
        _interrupted()
    finally:
        if loading:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return main()  # which says an interrupted command itself
    except KeyboardInterrupt:  # while its command line was read
        _interrupted()


def _interrupted():
    """Nothing was done yet: out at once. Through the interpreter's shutdown, with modules half imported (NumPy's),
    the process could still die of the signal."""
    print("prismc: interrupted", file=sys.stderr, flush=True)
    os._exit(130)
