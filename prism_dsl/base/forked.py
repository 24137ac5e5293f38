"""Independent work spread over processes forked from this one: the tuning of each proved program
(`pipeline.optimize.rankers`) and the soundness check of each rule (`prove.soundness.check_library`).

A forked process starts with everything the parent holds (the program, the library, compiled size
functions), so nothing is pickled on the way in but an index. Forking is safe only where no other thread
runs (one could hold a lock the child inherits held) and on Linux (macOS forks, but its system libraries
are not safe in a forked child); elsewhere, and where there is too little to spread, the caller does the
work itself (`usable`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
from concurrent.futures import ProcessPoolExecutor
from typing import Iterator


def cores() -> int:
    """The cores this process may run on (its affinity where the platform says, else the machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def usable(jobs: int, tasks: int) -> bool:
    """Whether `tasks` pieces of work may go to forked processes, up to `jobs` at once: at least two of each, on
    Linux, with no other thread running here."""
    return jobs >= 2 and tasks >= 2 and sys.platform.startswith("linux") and threading.active_count() == 1


@contextlib.contextmanager
def pool(processes: int) -> Iterator[ProcessPoolExecutor]:
    """A pool of `processes` forked processes that leave Ctrl-C to this one (`_ignore_interrupt`). With fork, the
    first submit forks every process, before the pool starts its own thread. Where the body raises (Ctrl-C, an
    error), the processes are killed at once, not waited for."""
    executor = ProcessPoolExecutor(processes, multiprocessing.get_context("fork"), initializer=_ignore_interrupt)
    try:
        yield executor
    except BaseException:
        for process in list((getattr(executor, "_processes", None) or {}).values()):
            process.kill()  # SIGKILL: nothing of it runs on, whatever lock of the pool's queues it holds
        raise
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


def _ignore_interrupt() -> None:
    """In a forked process: Ctrl-C is the parent's to handle, not each process's; SIGTERM (SIGHUP) ends it at once.
    The handler the command line sets (`cli.main`: SIGTERM raises SystemExit) would otherwise come with the fork:
    raised inside a task, the pool's worker catches it as the task's error and waits for the next task, on a
    queue whose lock a process killed with it may hold, and the parent's shutdown waits for that worker forever."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for signum in (signal.SIGTERM, getattr(signal, "SIGHUP", signal.SIGTERM)):
        signal.signal(signum, signal.SIG_DFL)
