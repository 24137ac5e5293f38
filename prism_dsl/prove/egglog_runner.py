"""Running egglog programs under hard limits, in a child process (`egglog_worker.py`).

Equality saturation can blow up inside one iteration (an e-graph that goes from 0.4 M to 3 M rows
takes seconds, the next step minutes), and an egglog run cannot be interrupted from Python. So egglog
runs in a child process: the worker checks the iteration, size and time limits between rounds of a
few iterations (under egglog's back-off scheduler, which bounds what one iteration can add), and
the parent kills it when the wall-clock limit passes mid-round. Progress arrives after every round,
so a goal proved before a kill stays proved.

`run(program, setup, goals, rulesets, limits)` answers one query; a `Session` loads the program
once and answers many (each query inside egglog's push/pop), restarting the worker after a kill.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .egraph import PRELUDE
from ..base.errors import PrismError

WORKER = Path(__file__).with_name("egglog_worker.py")
LOAD_LIMIT_S = 60.0  # starting Python, importing egglog and loading the rules; not part of a query's limit


@dataclass(frozen=True)
class Limits:
    """When to stop saturating: whichever comes first."""

    iterations: int = 40
    nodes: int = 200_000  # rows in the e-graph's tables, as egglog's print-size counts them
    seconds: float = 10.0
    # The back-off scheduler: a rule with more matches than this in one iteration is banned for
    # `ban_length` iterations (both double each time; the limit also doubles every round).
    match_limit: int = 1000
    ban_length: int = 5


@dataclass(frozen=True)
class Outcome:
    proved: tuple[bool, ...]  # one per goal
    reason: str  # "proved", or why the search stopped
    iterations: int
    nodes: int
    seconds: float
    matched: tuple[str, ...] = ()  # the rulesets whose rules matched at least once
    table: tuple | None = None  # with dump: the e-graph's tensor e-nodes (see egglog_worker)


class EgglogError(PrismError):
    """egglog rejected a generated program: a bug in the translation, reported without a traceback."""


class Session:
    """One worker process with one program loaded; answers queries until closed."""

    def __init__(self, program: str) -> None:
        self.program = program
        self._proc: subprocess.Popen | None = None
        self._lines: queue.Queue = queue.Queue()
        self._stderr: list[str] = []

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def run(self, setup: str, goals: list[tuple[str, str]], rulesets: list[str], limits: Limits,
            dump: bool = False) -> Outcome:
        """Add `setup` (egglog commands), then saturate: each iteration runs each ruleset once. With
        `dump`, the outcome carries the saturated e-graph's tensor e-nodes (`Outcome.table`); a run
        killed at the time limit has none."""
        self._start()
        start = time.perf_counter()
        self._send({"op": "query", "setup": setup, "goals": goals, "prelude": list(PRELUDE),
                    "rulesets": rulesets, "limits": asdict(limits), "dump": dump})
        last = {"proved": [False] * len(goals), "iteration": 0, "nodes": 0, "matched": []}
        while True:
            msg = self._receive(deadline=start + limits.seconds)
            if msg is None:  # the limit passed inside an iteration: the worker is killed
                self.close()
                return self._outcome(last, f"time limit ({limits.seconds:g} s) reached", start)
            if "error" in msg:
                raise EgglogError(f"egglog rejected a query: {msg['error']}")
            if msg.get("done"):
                out = self._outcome({**msg, "iteration": msg["iterations"]}, msg["reason"], start)
                return replace(out, table=tuple(map(tuple, msg["table"]))) if "table" in msg else out
            last = msg

    @staticmethod
    def _outcome(msg: dict, reason: str, start: float) -> Outcome:
        return Outcome(tuple(msg["proved"]), reason, msg["iteration"], msg["nodes"],
                       time.perf_counter() - start, tuple(msg["matched"]))

    # -- the worker process --------------------------------------------------------------------------

    def _start(self) -> None:
        if self._proc is not None:
            return
        self._proc = subprocess.Popen(
            # -P keeps the worker's folder off sys.path, where a module of ours could shadow a standard one.
            [sys.executable, "-P", str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, bufsize=1, env={**os.environ, "PRISM_PARENT": str(os.getpid())},
        )
        self._lines = queue.Queue()
        self._stderr = []
        threading.Thread(target=_pump, args=(self._proc.stdout, self._lines), daemon=True).start()
        threading.Thread(target=_pump, args=(self._proc.stderr, self._stderr), daemon=True).start()
        self._send({"op": "load", "program": self.program})
        msg = self._receive(deadline=time.perf_counter() + LOAD_LIMIT_S)
        if msg is None or "error" in msg:
            self.close()
            why = msg["error"] if msg else "it did not answer"
            raise EgglogError(f"egglog could not load the generated program: {why}")

    def _send(self, obj: dict) -> None:
        try:
            self._proc.stdin.write(json.dumps(obj) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            self._died()

    def _receive(self, deadline: float) -> dict | None:
        """The worker's next message, or None when the deadline passes first."""
        try:
            line = self._lines.get(timeout=max(0.0, deadline - time.perf_counter()))
        except queue.Empty:
            return None
        if line is None:
            self._died()
        return json.loads(line)

    def _died(self):
        self._proc.wait()
        detail = "".join(self._stderr).strip().splitlines()[-5:]
        code = self._proc.returncode
        self._proc = None
        raise EgglogError(f"the egglog worker stopped (exit code {code})" + (": " + " | ".join(detail) if detail else ""))


def _pump(stream, sink) -> None:
    """Copy a pipe's lines into a queue (stdout) or a list (stderr); None marks the end of stdout."""
    for line in stream:
        sink.put(line) if isinstance(sink, queue.Queue) else sink.append(line)
    if isinstance(sink, queue.Queue):
        sink.put(None)


def run(program: str, setup: str, goals: list[tuple[str, str]], rulesets: list[str], limits: Limits) -> Outcome:
    with Session(program) as session:
        return session.run(setup, goals, rulesets, limits)
