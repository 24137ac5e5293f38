"""`prismc compile` with the search: checkpoint, parameter instantiation, ranking, the chosen program.

    checkpoint   the verified sGraphs of a program, in the user cache (`cache`), keyed by the program's
                 structure (printed without its dim values), the rules' text and the search limits; a
                 new binding of the dims reuses them and only re-instantiates
    search       levels 1 and 2 (`search`), when there is no usable checkpoint
    tune         per verified program, kernel parameters for the dims chosen by the cost model; on a GPU
                 (`--target cuda`) the best few by the model, and the best of each other shape, are then
                 built, checked against the float64 reference and timed (`gpu_timer`). Both go into the
                 tuning database (user cache): the model's choice keyed by structure, dims, target and the
                 model's code; a measured time also by the GPU, its driver and the generated code's sources
    choose       the fastest; the program as written (pre-defined kernels) competes too, so the answer is
                 never worse than it and is it when nothing better was found

The checkpoint holds only complete searches (a search cut short by the time limit is not reused).
Every cache record is written atomically; a record that cannot be read or parsed is reported once and
ignored (`cache`).
"""

from __future__ import annotations

import json
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

SEARCH_VERSION = "2"  # bump when the search's meaning changes: old checkpoints are then ignored
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


@dataclass(frozen=True)
class Measurement:
    """One program timed on the GPU, its outputs checked against the float64 reference first."""

    us: float | None  # None: not usable (it disagreed with the reference, or could not be built or run)
    note: str  # "checked", or what went wrong
    lasting: bool = True  # worth keeping in the tuning database (a failure to build or launch is not)


Measure = Callable[[Program, dict[str, int]], Measurement]


@dataclass
class Ranked:
    program: Program
    params: dict[str, int]
    estimated_us: float
    measured: Measurement | None = None
    as_written: bool = False

    @property
    def measured_us(self) -> float | None:
        return None if self.measured is None else self.measured.us


@dataclass
class Outcome:
    best: Ranked
    ranked: list[Ranked]
    search: dict  # what report.json says of the search
    from_checkpoint: bool


def _code_version(*modules: str, templates: bool = False) -> str:
    """A digest of the code a cached figure came from: a figure made by other code is stale."""
    from pathlib import Path

    from .codegen import TEMPLATES

    here = Path(__file__).parent
    parts = [(here / f).read_text() for f in modules]
    parts += [p.read_text() for p in sorted((here / "targets").glob("*.toml"))]
    if templates:
        parts += [p.read_text() for p in sorted(Path(TEMPLATES).iterdir()) if p.is_file()]
    return cache.digest(*parts)


MODEL_FILES = ("cost.py", "kernel.py", "lower.py", "fusion.py")  # what the cost model's estimates come from


def _model_version() -> str:
    """The cost model's code (and what it reads): its estimates depend on nothing else."""
    return _code_version(*MODEL_FILES)


def _codegen_version() -> str:
    """The generated code's sources: a time measured on other code is stale."""
    return _code_version(*MODEL_FILES, "codegen.py", "cuda_runtime.py", "build.py", templates=True)


def _dims(binding: dict) -> str:
    return json.dumps(sorted((str(k), int(v)) for k, v in binding.items()))


def tuning_key(program: Program, binding: dict, target: Target) -> str:
    """The model's parameters and estimate for a program at some dims on a target."""
    return cache.digest("tuning", SEARCH_VERSION, _model_version(), structure(program), _dims(binding), target.name)


def measured_key(program: Program, binding: dict, target: Target, device: str, params: dict[str, int]) -> str:
    """A time measured on a GPU: the device string names the GPU, its compute capability and driver."""
    return cache.digest("measured", SEARCH_VERSION, _codegen_version(), structure(program), _dims(binding),
                        target.name, device, json.dumps(sorted(params.items())))


def rank(program: Program, binding: dict, target: Target, threads: int) -> Ranked | None:
    """Parameters and estimated time for one program at these dims, from the tuning database when it has them."""
    from . import cost
    from .lower import lower

    key = tuning_key(program, binding, target)
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
             time_limit: float | None = None, jobs: int | None = None, threads: int = 128, use_cache: bool = True,
             progress: bool = False, stop_event: threading.Event | None = None,
             measure: Measure | None = None, device: str = "") -> Outcome:
    """Search (or reuse the checkpoint), tune every verified program by the model, and choose the fastest;
    with `measure` (on a GPU named by `device`), the programs `_to_measure` picks are timed and the fastest
    of those that agreed with the reference is chosen."""
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
        r = rank(p, binding, target, threads)
        if r is None:
            unfit += 1
        else:
            ranked.append(r)
    written = rank(program, binding, target, threads)
    if written is not None:
        written.as_written = True
        ranked.append(written)
    elif not ranked:
        raise PrismError(f"'{program.name}' has no valid kernel parameters at these dims, neither as written "
                         f"nor in any of the {len(verified)} proved programs")
    info["as_written_fits"] = written is not None  # False: its pre-defined kernels cannot run at these dims
    ranked.sort(key=lambda r: (r.estimated_us, not r.as_written))  # stable: search order breaks ties
    if measure is not None:
        info["measured"] = _measure_best(ranked, binding, target, device, measure, use_cache)
        # The fastest that agreed with the reference; then the rest, by the model.
        ranked.sort(key=lambda r: (r.measured_us is None, r.measured_us or 0.0, r.measured is not None,
                                   r.estimated_us))
    info["verified_sgraphs"] = len(verified)
    info["no_parameters_at_these_dims"] = unfit
    info["search_seconds"] = round(time.perf_counter() - started, 3)
    return Outcome(ranked[0], ranked, info, saved is not None)


def _to_measure(ranked: list[Ranked]) -> list[Ranked]:
    """The best MEASURED by the model, and the best of each other shape (number of custom kernels; the
    program as written): the model may misjudge a whole shape (a split reduction's second launch, say),
    and timing its best is how that is caught."""
    from .kernel import kernels_of

    def shape(r: Ranked) -> tuple:
        return r.as_written, len(kernels_of(r.program))

    chosen = ranked[:MEASURED]
    seen = {shape(r) for r in chosen}
    for r in ranked[MEASURED:]:
        if shape(r) not in seen:
            seen.add(shape(r))
            chosen.append(r)
    return chosen


def _measure_best(ranked: list[Ranked], binding: dict, target: Target, device: str, measure: Measure,
                  use_cache: bool) -> dict:
    """Time the programs `_to_measure` picks (the tuning database first); what report.json says of it."""
    timed = reused = 0
    failures: list[str] = []
    by_model = {id(r): i + 1 for i, r in enumerate(ranked)}
    for r in _to_measure(ranked):
        key = measured_key(r.program, binding, target, device, r.params)
        hit = cache.read("measured", key) if use_cache else None
        if isinstance(hit, dict) and isinstance(hit.get("note"), str) and (
                hit.get("us") is None or isinstance(hit.get("us"), (int, float))):
            r.measured = Measurement(None if hit["us"] is None else float(hit["us"]), hit["note"])
            reused += 1
        else:
            r.measured = measure(r.program, r.params)
            timed += 1
            if r.measured.lasting and use_cache:
                cache.write("measured", key, {"us": r.measured.us, "note": r.measured.note})
        if r.measured.us is None:
            what = "the program as written" if r.as_written else f"the model's number {by_model[id(r)]}"
            failures.append(f"{what}: {r.measured.note}")
    return {"device": device, "timed": timed, "from_database": reused, "failed": failures}


def gpu_timer(target: Target, options) -> Measure:
    """`measure` for `optimize` on a GPU: builds a program with the given parameters (`build.BuildOptions`
    say how), runs it, checks every output against the float64 reference and times it (median of many
    runs between CUDA events). A program that disagrees is never timed into a result."""
    from dataclasses import replace
    from pathlib import Path
    import tempfile

    from . import build, cuda_runtime
    from .codegen import HEADER, header_source

    def measure(program: Program, params: dict[str, int]) -> Measurement:
        try:
            built = build.compile_program(program, target, replace(options, params=dict(params), mode="cuda"))
            with tempfile.TemporaryDirectory(prefix="prism-measure-") as scratch:
                directory = Path(scratch)
                (directory / HEADER).write_text(header_source())
                for k in built.kernels:
                    (directory / k.file).write_text(k.source)
                gpu = build.check_gpu(built, directory, options.seed)
        except (PrismError, cuda_runtime.PlanError, cuda_runtime.KernelCompileError) as e:
            return Measurement(None, f"could not be built or run: {str(e).splitlines()[0]}", lasting=False)
        if not gpu["passed"]:
            worst = ", ".join(f"{o}: max rel err {v['max_rel_err']:.2e}" for o, v in gpu["outputs"].items())
            return Measurement(None, f"disagreed with the reference ({worst})")
        return Measurement(gpu["timing_ms"]["median_ms"] * 1000, "checked")

    return measure
