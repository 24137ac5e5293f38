"""`prismc compile` with the search: checkpoint, parameter instantiation, ranking, the chosen program.

    checkpoint   the verified sGraphs of a program, in the user cache (`cache`), keyed by the program's
                 structure (printed without its dim values), the rules' text and the search limits; a
                 new binding of the dims reuses them and only re-instantiates
    search       levels 1 and 2 (`search`), when there is no usable checkpoint
    tune         per verified program, kernel parameters for the dims: ranked by the cost model, or on a
                 GPU (`--target cuda`) the best few by the model compiled, checked and timed; results go
                 into the tuning database (user cache), keyed by structure, dims, target, GPU and driver
    choose       the fastest; the program as written (pre-defined kernels) competes too, so the answer is
                 never worse than it and is it when nothing better was found

The checkpoint holds only complete searches (a search cut short by the time limit is not reused).
Every cache record is written atomically; a record that cannot be read or parsed is reported once and
ignored (`cache`).
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from . import cache
from .errors import PrismError
from .ir import Program
from .kernel import Target
from .printer import print_program
from .rules import Library
from .search import Result, SearchConfig, Stats, default_jobs, search

SEARCH_VERSION = "1"  # bump when the search's meaning changes: old checkpoints are then ignored
TOP = 5  # alternatives listed in report.json
MEASURED = 3  # programs timed on a GPU, best by the model first


def structure(program: Program) -> str:
    return print_program(program, with_dims=False)


def checkpoint_key(program: Program, library: Library, config: SearchConfig) -> str:
    return cache.digest("search", SEARCH_VERSION, structure(program), *library.texts,
                        json.dumps(config.key(), sort_keys=True))


def _dims_line(program: Program) -> str:
    return ("dims " + ", ".join(f"{d.name} = {d.default}" for d in program.dims) + "\n") if program.dims else ""


def load_checkpoint(program: Program, key: str) -> tuple[list[Program], dict] | None:
    """The saved verified programs (with this program's dims), or None; a bad entry is reported once."""
    from .check import load

    record = cache.read("search", key)
    if record is None:
        return None
    try:
        programs = [load("<checkpoint>", _dims_line(program) + text).program() for text in record["programs"]]
        return programs, record["stats"]
    except (PrismError, KeyError, TypeError) as e:
        cache.warn(cache.path_for("search", key), f"not a valid checkpoint ({str(e).splitlines()[0]})")
        return None


def save_checkpoint(key: str, result: Result) -> None:
    cache.write("search", key, {"programs": [structure(p) for p in result.verified],
                                "stats": {**result.stats.as_dict(), "seconds": round(result.seconds, 3)}})


@dataclass
class Ranked:
    program: Program
    params: dict[str, int]
    estimated_us: float
    measured_us: float | None = None
    as_written: bool = False

    @property
    def time_us(self) -> float:
        return self.measured_us if self.measured_us is not None else self.estimated_us


@dataclass
class Outcome:
    best: Ranked
    ranked: list[Ranked]
    search: dict  # what report.json says of the search
    from_checkpoint: bool


def _model_version() -> str:
    """The cost model's own code and the target files: an estimate made by other code is stale."""
    from pathlib import Path

    here = Path(__file__).parent
    parts = [(here / f).read_text() for f in ("cost.py", "kernel.py", "lower.py", "fusion.py")]
    parts += [p.read_text() for p in sorted((here / "targets").glob("*.toml"))]
    return cache.digest(*parts)


def tuning_key(program: Program, binding: dict, target: Target, mode: str, device: str) -> str:
    dims = json.dumps(sorted((str(k), int(v)) for k, v in binding.items()))
    return cache.digest("tuning", SEARCH_VERSION, _model_version(), print_program(program, with_dims=False), dims,
                        target.name, mode, device)


def rank(program: Program, binding: dict, target: Target, threads: int, mode: str, device: str) -> Ranked | None:
    """Parameters and time for one program at these dims, from the tuning database when it has them."""
    from . import cost
    from .lower import lower

    key = tuning_key(program, binding, target, mode, device)
    hit = cache.read("tuning", key)
    if isinstance(hit, dict) and isinstance(hit.get("params"), dict) and isinstance(hit.get("us"), (int, float)):
        return Ranked(program, {str(k): int(v) for k, v in hit["params"].items()}, float(hit["us"]))
    try:
        params, _, estimates = cost.parameters(lower(program), binding, {}, target, threads)
    except PrismError:
        return None  # no valid parameters at these dims (a tile that does not fit, say)
    us = sum(e.time_us for e in estimates)
    cache.write("tuning", key, {"params": params, "us": us})
    return Ranked(program, params, us)


class Progress:
    """One status line on stderr, rewritten in place; silent when stderr is not a terminal."""

    def __init__(self, enabled: bool, started: float) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.started = started
        self.last = 0.0

    def __call__(self, phase: str, stats: Stats) -> None:
        now = time.perf_counter()
        if not self.enabled or now - self.last < 0.2:
            return
        self.last = now
        sys.stderr.write(f"\r\x1b[2Ksearch: {phase}; {stats.candidates} candidates, {stats.proofs} proofs, "
                         f"{stats.verified} verified; {now - self.started:.1f} s")
        sys.stderr.flush()

    def done(self) -> None:
        if self.enabled:
            sys.stderr.write("\r\x1b[2K")
            sys.stderr.flush()


def optimize(program: Program, library: Library, target: Target, binding: dict, *, config: SearchConfig = SearchConfig(),
             time_limit: float | None = None, jobs: int | None = None, threads: int = 128, mode: str = "cost",
             device: str = "", use_cache: bool = True, progress: bool = False,
             stop_event: threading.Event | None = None,
             measure: Callable[[Program, dict], float | None] | None = None) -> Outcome:
    """Search (or reuse the checkpoint), tune every verified program, and choose the fastest."""
    started = time.perf_counter()
    key = checkpoint_key(program, library, config)
    saved = load_checkpoint(program, key) if use_cache else None
    jobs = jobs or default_jobs()
    if saved is not None:
        verified, stats = saved
        info = {"from_checkpoint": True, "complete": True, "stopped": None, "jobs": jobs, **stats}
    else:
        show = Progress(progress, started)
        deadline = started + time_limit if time_limit else None
        try:
            result = search(program, library, target, config, jobs=jobs, deadline=deadline, progress=show,
                            stop_event=stop_event)
        finally:
            show.done()
        verified = result.verified
        if result.complete and use_cache:
            save_checkpoint(key, result)
        info = {"from_checkpoint": False, "complete": result.complete, "stopped": result.stopped, "jobs": jobs,
                **result.stats.as_dict(), "seconds": round(result.seconds, 3), "target_egraph": result.target_egraph}
    ranked: list[Ranked] = []
    unfit = 0
    for p in verified:
        r = rank(p, binding, target, threads, mode, device)
        if r is None:
            unfit += 1
        else:
            ranked.append(r)
    written = rank(program, binding, target, threads, mode, device)
    if written is None:
        raise PrismError(f"'{program.name}' has no valid kernel parameters at these dims, even as written")
    written.as_written = True
    ranked.append(written)
    ranked.sort(key=lambda r: (r.estimated_us, not r.as_written))  # stable: search order breaks ties
    if measure is not None:
        for r in ranked[:MEASURED]:
            r.measured_us = measure(r.program, r.params)
        ranked.sort(key=lambda r: (r.time_us if r.measured_us is not None else math.inf, r.estimated_us))
    info["verified_sgraphs"] = len(verified)
    info["no_parameters_at_these_dims"] = unfit
    info["search_seconds"] = round(time.perf_counter() - started, 3)
    return Outcome(ranked[0], ranked, info, saved is not None)
