"""The superoptimizer's search: programs of fused custom kernels, each proved equal to the input program.

`search` runs the two phases as a stream: kernel generation (`generate`) yields candidates whose maps
and sizes are still symbols, pruned by the input program's saturated e-graph (`abstract`); program
assembly (`assembly`) gives each candidate's kernels concrete maps (`maps`, `split`), checks them and
sends every program that survives to the pool of provers; proofs are collected as they finish, in the
order they were sent. A proof that could not run is an error kept with its message (`Stats.errors`),
never a "not proved", and the search goes on without that candidate.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Callable

from ..base import forked
from ..ir.nodes import Program
from ..kernels.hardware import Hardware
from ..prove.rules import Library
from .abstract import SaturationFailed, saturate
from .assembly import Assembly, proof_error
from .config import Rejection, SearchConfig, Stats, Stop
from .generate import Generator


@dataclass
class Result:
    proved: list[Program]  # in the order found (deterministic for the same inputs when not cut short)
    stats: Stats
    seconds: float
    complete: bool  # False: stopped by the time limit or an interruption
    stopped: str | None = None  # why it stopped early
    input_egraph: dict = field(default_factory=dict)  # the saturated e-graph's rows, why it stopped, seconds
    jobs: int = 1


def search(program: Program, library: Library, hardware: Hardware, config: SearchConfig = SearchConfig(), *,
           jobs: int | None = None, deadline: float | None = None, progress: Callable[[str, Stats], None] | None = None,
           stop_event: threading.Event | None = None) -> Result:
    """Kernel generation and program assembly for `program`: every proved program found within the
    limits (see the module doc)."""
    started = time.perf_counter()
    jobs = jobs or forked.cores()
    stats = Stats()
    stop_event = stop_event or threading.Event()
    reason: list[str] = []
    show = progress or (lambda phase, stats: None)

    def should_stop() -> bool:
        if stop_event.is_set():
            reason[:] = reason or ["interrupted"]
            return True
        if deadline is not None and time.perf_counter() > deadline:
            reason[:] = reason or ["time limit"]
            return True
        return False

    try:
        graph = saturate(program, library)
    except SaturationFailed as e:  # nothing to search from: the program as written stands
        return Result([], stats, time.perf_counter() - started, False, f"the search could not start: {e}", {}, jobs)
    generator = Generator(program, graph, config, stats, should_stop)
    assembly = Assembly(program, library, hardware, config, stats, jobs)
    pending: list[tuple[Program, Future]] = []
    proved: list[Program] = []
    complete = True

    def settle(prog: Program, proof: Future) -> None:
        """Count one finished proof: proved, not proved, or an error (it could not run)."""
        error = proof_error(proof)
        if error is not None:
            stats.errors.append(error)
        elif proof.result():
            stats.proved += 1
            proved.append(prog)
        else:
            stats.prune(Rejection.UNPROVED)

    def collect() -> None:
        while pending and pending[0][1].done():
            settle(*pending.pop(0))

    try:
        show("kernel generation", stats)
        for cand in generator.candidates():
            for prog in assembly.programs(cand):
                if config.steady and not assembly.steady(prog):
                    stats.prune(Rejection.UNSTEADY)
                    continue
                pending.append((prog, assembly.prove(prog)))
                if should_stop():
                    raise Stop
            collect()
            show("program assembly", stats)
        show("proving", stats)
        while pending:
            if should_stop():
                raise Stop
            wait([pending[0][1]], timeout=0.2)
            collect()
            show("proving", stats)
    except (Stop, KeyboardInterrupt) as e:
        complete = False
        if isinstance(e, KeyboardInterrupt):
            reason[:] = reason or ["interrupted"]
        # Keep what is already proved; what is still in flight is dropped.
        for prog, proof in pending:
            if proof.done():
                settle(prog, proof)
        pending.clear()
    finally:
        assembly.close()
    return Result(proved, stats, time.perf_counter() - started, complete, reason[0] if reason else None,
                  {"rows": graph.nodes, "stopped": graph.reason, "seconds": round(graph.seconds, 3)}, jobs)
