"""`prismc compile` as one function: `compile_program(request) -> Report`, the pipeline's passes in order.

    search         the input program's proved equivalents, each tuned by the cost model (or timed on the
                   GPU), ranked (`optimize`); not run when compiling the program as written
    size           the dims built: as given, or independent dims no tile divides rounded up (`padding`)
    choose         the program to build: the fastest found, or the input as written
    lower          pre-defined kernels for every op outside custom kernels (`kernels.lower`)
    tune, render, compile-check, price, emulate, measure, count banks          (`build`)
    write          every file, report.json last, into the output directory, replaced whole (`output`)

Nothing is written before the last pass, and the output is checked before the first, so that minutes of
search never end in "cannot write".
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Mapping

from ..backend import cost, cuda_runtime, roofline
from ..backend.codegen import RenderedKernel
from ..base.errors import PrismError
from ..ir.nodes import Program
from ..kernels.hardware import Hardware, for_device, load_hardware
from ..kernels.kernel import kernels_of
from ..kernels.lower import check_compilable, lowered_for
from ..kernels.masking import refusal
from ..lang.printer import print_program
from ..prove.rules import load_library
from ..prove.soundness import check_library
from ..search.assembly import Prover
from ..search.checkpoint import checkpoint_key, discard, has_checkpoint
from ..search.config import SearchConfig
from ..semantics.reference import bind_dims
from .build import (Build, BuildOptions, callers_dims, compile_check, count_banks, dims_of, emulate, measure, plan_of,
                    price, pricing, render, tune, Tuned)
from . import optimize as optimize_
from . import padding
from .measuring import Timing, gpu_timer, time_parameters, timed
from .optimize import TOP, Outcome, optimize
from .output import check_output, contents, verified_before, write
from .report import Alternative, Checked, HardwareUsed, KernelReport, NvccCheck, Report, Searched, Skipped


@dataclass(frozen=True)
class Searching:
    """How the search runs: its limits, and what it may spend (`optimize`'s arguments of those names)."""

    config: SearchConfig = SearchConfig()
    time_limit: float | None = 60.0  # seconds; then the best proved program so far
    jobs: int | None = None  # processes checking the rules, proving, then tuning (None: one per core)
    progress: bool = False  # a status line on stderr (a terminal only)


@dataclass(frozen=True)
class Request:
    program: Program  # the input program
    output: Path  # the directory the results replace
    hardware: Hardware
    options: BuildOptions = BuildOptions()
    search: Searching | None = Searching()  # None: compile the program as written
    use_cache: bool = True  # read and write the search's checkpoint and the tuning database (`--no-cache`)


@dataclass(frozen=True)
class Choice:
    program: Program
    options: BuildOptions  # with the parameters the search tuned (or measured) for the program
    proved: bool  # the input itself, or proved equal to it in this run
    searched: Searched | None = None
    timed: tuple[dict, ...] = ()  # with --rank measure: its kernel parameters timed (`measuring.time_parameters`)


# Programs tried past the first when the chosen one fails its check (its own emulation against the reference):
# the next fastest, then the program as written.
FALLBACKS = 3


def compile_program(request: Request) -> Report:
    """The input program compiled, checked and written to `request.output`; what was found. Where the search's
    fastest program fails its check (a rewrite that loses accuracy at the inputs' magnitudes, say), the next is
    built, up to FALLBACKS of them and then the program as written, and the report says what failed and why."""
    if request.options.rank == "measure":
        check_device(request.hardware)
    check_output(request.output)
    check_compilable(request.program)  # before minutes of search
    sized, outcome, at_given, tried = sized_request(request)
    report, texts = _first_passing(sized, outcome)
    if sized is not request and report.checked.failed:  # built past the sizes given, nothing passed: built at them
        why = "; ".join(c.errors() for c in report.checked.ran() if not c.passed)
        report, texts = _first_passing(request, at_given)
        report = replace(report, padding_failed=f"built for {_sizes(sized.options)}, its check failed: {why}")
    report = replace(report, padding_tried=tuple(tried))
    if report.checked.failed and verified_before(request.output):  # a verified result is not lost to a failed one
        return replace(report, files=(), kept=True)
    write(request.output, {**texts, "report.json": report.to_json()})
    return report


def _sizes(options: BuildOptions) -> str:
    """The dims built past the sizes given, in words."""
    return ", ".join(f"{name}={options.dims[name]} (given {n})" for name, n in options.padded.items())


def _first_passing(request: Request, outcome: Outcome | None) -> tuple[Report, dict[str, str]]:
    """The first of `outcome`'s programs (`_tries`) built that passes its check, with its files; where none does,
    the first built, as it was checked; where none could be built, the first one's error."""
    tries = [0] if outcome is None else _tries(outcome)
    failed: list[dict] = []
    built: tuple[int, Report, dict[str, str]] | None = None  # the first program built, should none pass its check
    error: PrismError | None = None  # why the first that could not be built could not, should none be built
    for rank in tries:
        if why := _unproved(request, outcome, rank):  # a checkpoint's program, proved before it is built
            failed.append({"rank": rank + 1, "as_written": False, "why": why})
            continue
        try:
            report, texts = _build(request, choose(request, outcome, rank))
        except Exception as e:  # passed over, as one that fails its check is (as written: the compile's error)
            if outcome is None or not isinstance(e, PrismError) and outcome.ranked[rank].as_written:
                raise
            if not isinstance(e, PrismError):  # a fault of the code generator's on a found program: the next is
                # built, and the report names the fault
                e = PrismError(f"an internal error building it: {type(e).__name__}: {e}")
            error = error or e
            failed.append({"rank": rank + 1, "as_written": outcome.ranked[rank].as_written,
                           "why": f"it could not be built: {e}"})
            continue
        built = built or (rank, report, texts)
        if report.verified or not report.checked.failed or outcome is None:  # as written: nothing to fall back to
            break
        why = "; ".join(c.errors() for c in report.checked.ran() if not c.passed)
        failed.append({"rank": rank + 1, "as_written": outcome.ranked[rank].as_written,
                       "why": f"its check failed: {why}"})
    else:
        if built is None:  # none could be built
            raise error or PrismError(f"'{request.program.name}': none of the programs found could be proved "
                                      "again or built")
        rank, report, texts = built  # none passed: the first built, as it was checked
        failed = [f for f in failed if f["rank"] != rank + 1]
    if failed:
        outcome.search["failed_check"] = failed  # report.json's search, and the summary, say so
    return report, texts


def sized_request(request: Request) -> tuple[Request, Outcome | None, Outcome | None, list[dict]]:
    """The request at the dims it is built for, and its search's outcome there: the dims given, or dims no tile
    divides rounded up where that is faster by the model, copies included (`padding`); the outcome at the
    dims given; and what each rounding tried gave (`padding.fastest`)."""
    outcome = search(request)
    binding = bind_dims(request.program, dict(request.options.dims))
    given = {d.name: int(binding[d.symbol]) for d in request.program.dims}
    found = [] if outcome is None else [r.program for r in outcome.ranked]
    tries = [] if request.options.grid or request.options.loop else padding.candidates(request.program, given, found)
    if not tries:
        return request, outcome, outcome, []

    def sized(rounded: dict[str, int]) -> Request:
        padded = {name: given[name] for name in rounded}
        return replace(request, options=replace(request.options, dims={**request.options.dims, **rounded},
                                                padded=padded))

    def estimate(rounded: dict[str, int], masking: dict[str, int]) -> tuple[float, Outcome | None]:
        at = sized(rounded)  # the search's programs ranked again there, not searched again
        found = None if outcome is None else padding.retuned(
            outcome, request.program, bind_dims(request.program, dict(at.options.dims)), request.hardware,
            at.options.codegen, request.use_cache, request.search.jobs, masking)
        if found is None and (why := refusal(request.program, masking, {**given, **rounded})):
            raise PrismError(why)
        return _estimate(at, found), found
    tried: list[dict] = []
    rounded, found = padding.fastest(request.program, given, tries, request.hardware, _estimate(request, outcome),
                                     estimate, not request.options.padded_inputs, request.options.codegen, tried)
    return (sized(rounded), found, outcome, tried) if rounded else (request, outcome, outcome, tried)


def _estimate(request: Request, outcome: Outcome | None) -> float:
    """The model's time for what `request` would build: the search's fastest, or the program as written tuned."""
    if outcome is not None:
        return outcome.ranked[0].estimated_us
    try:
        tuned = tune(lowered_for(request.program, {}), request.program, request.hardware, request.options)
    except PrismError:
        return math.inf
    return sum(e.time_us for e in tuned.estimates)


def _tries(outcome: Outcome) -> list[int]:
    """The ranks to build, in order: the fastest, the next FALLBACKS found (a checkpoint's proved again first:
    `_unproved`), then the program as written."""
    found = [i for i, r in enumerate(outcome.ranked) if i == 0 or not r.as_written]
    written = next((i for i, r in enumerate(outcome.ranked) if r.as_written), None)
    tries = found[:FALLBACKS + 1]
    return tries + ([written] if written is not None and written not in tries else [])


def _unproved(request: Request, outcome: Outcome | None, rank: int) -> str | None:
    """Why the program of `rank` may not be built: a checkpoint's that fails its proof in this run (or whose proof
    cannot run); None for one proved already (the search's, the chosen one, the input) or proved now. A checkpoint
    is trusted for nothing, its fallbacks no more than its choice (`optimize.confirm`)."""
    if outcome is None or outcome.ranked[rank].proved:
        return None
    library = load_library([], defaults=True)
    prover = Prover(request.program, library, 1)
    try:
        why = optimize_.confirm([outcome.ranked[rank]], prover)
    finally:
        prover.close()
    if why is None:
        outcome.search["reproved"] = outcome.search.get("reproved", 0) + 1
        return None
    key = checkpoint_key(request.program, library, request.search.config, request.hardware)
    if why == "failed its proof" and has_checkpoint(key):  # as when its choice fails (`optimize`): removed, once
        discard(key, f"checkpoint entry for '{request.program.name}': program {rank + 1} failed its proof; removed")
    return f"it {why}"


def _build(request: Request, chosen: Choice) -> tuple[Report, dict[str, str]]:
    """`chosen` lowered, tuned, rendered, compile-checked, priced and checked: its report and the files to write."""
    started = time.perf_counter()
    lowered = lowered_for(chosen.program, chosen.options.params)
    tuned = tune(lowered, chosen.program, request.hardware, chosen.options, request.program)
    built = render(tuned, chosen.options.codegen)
    nvcc, figures = compile_check(built.kernels, chosen.options.archs, built.hardware.arch)
    built = price(built, figures, chosen.options.codegen)
    checked = Checked(emulate(built, chosen.options),
                      measure(built, chosen.options.seed) if chosen.options.rank == "measure" else None)
    counted = count_banks(built, chosen.options, checked.emulation)
    if isinstance(counted, dict):
        built = price(built, figures, chosen.options.codegen, counted)
    texts = contents(built, {} if chosen.searched is None else
                     {chosen.searched.best: print_program(chosen.program.at(callers_dims(built)))})
    seconds = round(time.perf_counter() - started, 3)  # the chosen program's build, from lowering to its checks
    report = _report(chosen, built, seconds, nvcc, figures, checked, (*texts, "report.json"), counted)
    return report, texts


def check_device(hardware: Hardware, what: str = "--rank measure") -> None:
    """For `what` (`--rank measure`, `prismc bench`): a usable GPU, which can run what `hardware` lets the
    kernels use where a hardware file names that GPU (`hardware.for_device`): an arch no newer than the GPU's
    (sm_80 kernels run on sm_90; sm_90's wgmma on nothing older) and no more shared memory per block than it
    has. A GPU no file names is measured as it is."""
    usable, device = cuda_runtime.gpu_status()
    if not usable:
        raise PrismError(f"{what} needs a usable CUDA GPU: {device}; use --rank model without one")
    if (own := for_device(device)) is None:
        return
    theirs = load_hardware(own)
    def number(arch: str) -> int:  # sm_90a -> 90
        return int("".join(filter(str.isdigit, arch)))
    newer = number(hardware.arch) > number(theirs.arch)
    if newer or theirs.smem_per_block < hardware.smem_per_block:
        raise PrismError(f"{what}: this GPU ({device}) is not the hardware the kernels are made for "
                         f"({hardware.name}: {hardware.arch}, {hardware.smem_per_block} bytes of shared memory per "
                         f"block; it has {theirs.arch}, {theirs.smem_per_block}): give --hardware {own}")


def search(request: Request) -> Outcome | None:
    """The proved programs, ranked, the fastest first; None when compiling as written."""
    if request.search is None:
        return None
    library = load_library([], defaults=True)
    s, o = request.search, request.options
    check_library(library, jobs=s.jobs)  # every axiom a proof may use is checked sound first
    measure = gpu_timer(request.hardware, o, request.program) if o.rank == "measure" else None
    return optimize(request.program, library, request.hardware, bind_dims(request.program, dict(o.dims)),
                    **vars(s), use_cache=request.use_cache, codegen=o.codegen, measure=measure,
                    device=cuda_runtime.device_identity() if measure else "")


def choose(request: Request, outcome: Outcome | None, rank: int = 0) -> Choice:
    """The program of `rank` (0: the fastest) among the search's, or the input itself without a search."""
    if outcome is None:
        return _as_written(request)
    best = outcome.ranked[rank]
    alternatives = tuple(
        Alternative(i + 1, r.as_written, len(kernels_of(lowered_for(r.program, r.params))), round(r.estimated_us, 3),
                    None if r.measured_us is None else round(r.measured_us, 3),
                    None if r.measured is None else r.measured.note, True if r.proved else None,
                    print_program(r.program, with_dims=False))
        for i, r in enumerate(outcome.ranked[:TOP]))
    file = "best.prism" if request.program.name != "best" else "best_found.prism"  # not the compiled best.prism
    kernels = len(kernels_of(lowered_for(best.program, best.params)))
    searched = Searched(file, best.as_written, kernels, outcome.search, outcome.search["search_seconds"], alternatives)
    options = replace(request.options, params=best.params, codegen=best.codegen(request.options.codegen))
    return Choice(best.program, options, best.proved, searched, tuple(best.timed))


def _as_written(request: Request) -> Choice:
    """The input itself, with the parameters and threads per block the model chose for it (`optimize.rank`, which
    may take twice `--threads`); with --rank measure, the fastest of the model's choices of them on the GPU
    (`measuring.time_parameters`), the model's own first. Where none of them agrees with the reference (or none
    can be built or run), the model's choice is built, and its check says why. Parameters given (`--grid`,
    `--loop`) are kept, and the rest tuned by the model at `--threads`."""
    o = request.options
    if o.grid or o.loop or o.params:
        return Choice(request.program, o, proved=True)
    binding = bind_dims(request.program, dict(o.dims))
    ranked = optimize_.rank(request.program, binding, request.hardware, o.codegen, request.use_cache)
    if ranked is None:  # no valid parameters: the build says why
        return Choice(request.program, o, proved=True)
    if o.rank != "measure":
        return Choice(request.program, replace(o, params=ranked.params, codegen=ranked.codegen(o.codegen)), proved=True)
    ranked.as_written = ranked.proved = True
    timing = Timing(binding, request.hardware, o.codegen, gpu_timer(request.hardware, o, request.program),
                    cuda_runtime.device_identity(), request.use_cache)
    timed(ranked, timing)
    best, _ = time_parameters(ranked, timing)
    return Choice(request.program, replace(o, params=best.params, codegen=best.codegen(o.codegen)), proved=True,
                  timed=tuple(best.timed))


def _report(chosen: Choice, built: Build, seconds: float, nvcc: NvccCheck | Skipped | None, figures: Mapping,
            checked: Checked, files: tuple[str, ...], counted: dict | Skipped | None = None) -> Report:
    gpu = checked.gpu
    shared = counted if isinstance(counted, dict) else {}
    tensors = plan_of(built)["tensors"]  # which inputs the launcher pads (`padding`)
    kernels = tuple(
        KernelReport(r.name, r.function, r.file, r.grid, r.block, r.smem, r.tensor_cores, launch_estimate(built, r),
                     figures.get(r.name, {}), None if gpu is None else _us(gpu.kernels_ms[r.name]),
                     tuple(m.tensor for m in r.maps), shared[r.name].as_dict() if r.name in shared else None)
        for r in built.kernels)
    return Report(built.program.name, HardwareUsed(built.hardware.name, built.hardware.arch), chosen.options.rank,
                  dims_of(built), built.params, kernels, round(sum(e.time_us for e in built.estimates), 3),
                  roofline.roofline(built.reference, {**built.binding, **bind_dims(built.reference, {  # the sizes given
                                                          **dims_of(built), **built.padded})},
                                    built.hardware),  # the parameters too: an output's shape may hold a grid size
                  None if gpu is None else _us(gpu.timing_ms), nvcc, checked, chosen.proved, seconds, files,
                  chosen.searched, dict(vars(cost.for_hardware(chosen.options.codegen, built.hardware))),  # as applied
                  pricing(built, nvcc, chosen.options.archs),
                  counted if isinstance(counted, Skipped) else None, dict(built.padded),
                  bool(built.padded) and chosen.options.padded_inputs, None, tuple(sorted(built.in_place)),
                  tuple(n.attr for n in built.program.inputs if "used" in tensors[n.attr]),
                  round(padding.copy_us(built.reference, callers_dims(built), {k: dims_of(built)[k] for k in built.padded},
                                        built.hardware, not chosen.options.padded_inputs, chosen.options.codegen), 3)
                  if built.padded else None, parameters_timed=chosen.timed, idle=_idle(chosen, built))


# The code generation's options, each with its default: one given is said where the kernels built are the same without it
CODEGEN_FLAGS = (("--two-launches", "one_launch", True), ("--no-tensor-cores", "tensor_cores", True),
                 ("--no-wgmma", "wgmma", True), ("--no-pingpong", "pingpong", True), ("--tma", "tma", False),
                 ("--no-copy-warp", "copy_warp", True))


def _idle(chosen: Choice, built: Build) -> tuple[str, ...]:
    """The options that change nothing in the program built, said: whether they would is for the search and the
    tuning to decide, so they are not refused (`cli.values.ignored` refuses those that never would). A code
    generation option changes nothing where each kernel rendered again without it, at the same parameters, is the
    same text; where a search ranked its programs with it, it may still have chosen the program, which is said."""
    options, idle = chosen.options, []
    for flag, name, default in CODEGEN_FLAGS:
        if getattr(options.codegen, name) == default:
            continue
        try:
            again = render(Tuned(**{f.name: getattr(built, f.name) for f in fields(Tuned)}),
                           replace(options.codegen, **{name: default}))
        except PrismError:  # (it cannot be built without the option: it did change something)
            continue
        if [k.source for k in again.kernels] == [k.source for k in built.kernels]:
            idle.append(f"{flag}: the kernels built are the same without it" + (
                "; the search ranked its programs with it, which may have chosen this one" if chosen.searched else ""))
    if options.padded_inputs and not built.padded:
        idle.append("--padded-inputs: nothing is built past the sizes given, so the inputs are passed at those")
    return tuple(idle)


def launch_estimate(built: Build, r: RenderedKernel) -> dict:
    """The estimate of launch `r` (report.json's `estimate`): its kernel's; for a launch that also runs a combining
    kernel (`r.combines`), the time of both, that kernel's own estimate under `combines`."""
    by_name = {e.kernel: e for e in built.estimates}
    e = by_name[r.name].as_dict()
    if r.combines:
        tail = by_name[r.combines]
        e |= {"time_us": round(e["time_us"] + tail.time_us, 3), "combines": tail.as_dict()}
    return e


def _us(timing_ms: Mapping[str, float]) -> float:
    return round(timing_ms["median_ms"] * 1000, 3)
