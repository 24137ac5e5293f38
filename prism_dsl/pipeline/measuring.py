"""Timing on a GPU for the choice (`--rank measure`): which programs and which of their kernel parameters are
timed, the tuning database's measured times, and the timer itself (`gpu_timer`: built, checked against the float64
reference, timed).

Where it sits: under `optimize` (the search's programs) and `compile` (a program compiled as written). What is
timed:

- programs (`to_measure`): the best MEASURED by the model, each with the parameters the model chose for it, and
  the best of each other shape (number of custom kernels; the program as written), since the model may misjudge
  a whole shape (a split reduction's second launch, say);
- parameters (`time_parameters`): the fastest of those, once timed, again with the model's next best choices of
  its kernel parameters (`tuning.choices`: other numbers of blocks first) and with its own choice at twice the
  threads per block, PARAMETER_CHOICES in all. The GPU runs of `benchmarks/RESULTS.md` found the model off by
  1.1x to 4.3x at decode, by different factors for different kernels, and a ranking by a model that far off is
  settled only by the clock. Threads are among them because what an SM takes in grew with a block's warps there
  (`benchmarks/gpu_probe.py`: 7.3 bytes a clock for a block of 128 threads, 12.4 for 256), which the model's
  bandwidth ceiling hides at decode: it prices 128 and 256 threads alike. `--threads` is a least count, so more
  threads are a choice it allows.

A time measured on a GPU is kept in the tuning database, keyed by the device, its driver and the generated code's
sources (`measured_key`), so a repeated compile times nothing again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Callable

from ..backend import cost, cuda_runtime, tuning
from ..backend.codegen import TEMPLATES, CodegenConfig
from ..backend.launch import layout
from ..base import cache
from ..base.errors import PrismError
from ..ir.nodes import Program
from ..kernels.hardware import Hardware
from ..kernels.kernel import free_symbols, kernels_of
from ..kernels.lower import lowered_forms
from ..lang.syntax import clip
from ..search.checkpoint import SEARCH_VERSION, is_time, structure
from . import build

MEASURED = 3  # programs timed on a GPU, best by the model first
PARAMETER_CHOICES = 4  # choices of the fastest program's kernel parameters timed, the model's own among them

# What the cost model's choices come from: its code, what it reads (the hardware files), and the ranking that
# prices twice the threads (`optimize.rank`), nothing else.
MODEL_CODE = ("ir", "kernels", "backend/cost.py", "backend/intake.py", "backend/launch.py", "backend/copies.py",
              "backend/warp_mma.py", "backend/sums.py", "backend/tuning.py", "pipeline/optimize.py")


@dataclass(frozen=True)
class Measurement:
    """One program timed on the GPU, its outputs checked against the float64 reference first."""

    us: float | None  # None: not usable (it disagreed with the reference, or could not be built or run)
    note: str  # "checked", or what went wrong
    lasting: bool = True  # worth keeping in the tuning database (a failure to build or launch is not, nor a
    # time the host's queueing is in)


Measure = Callable[[Program, dict[str, int], CodegenConfig], Measurement]  # built with these params and this code


@dataclass
class Ranked:
    program: Program
    params: dict[str, int]
    estimated_us: float
    busy: int = 0  # the SMs its kernels keep busy, on average over its time: between equal estimates, more first
    work: int = 0  # the flops its kernels do (f32 and tensor cores): then, between those, fewer first
    measured: Measurement | None = None
    as_written: bool = False
    proved: bool = False  # proved equal to the input in this run (by the search or again), or the input itself
    timed: list[dict] = field(default_factory=list)  # its kernel parameters timed (`time_parameters`), as reported
    threads: int | None = None  # threads per block where not the code generator's (`parameter_choices`)

    def codegen(self, config: CodegenConfig) -> CodegenConfig:
        """The code it is built as: `config`, with its own threads per block where it has them."""
        return config if self.threads is None else replace(config, threads=self.threads)

    @property
    def measured_us(self) -> float | None:
        return None if self.measured is None else self.measured.us


@dataclass(frozen=True)
class Timing:
    """What a time is measured on and kept by: the dims, the hardware file, the code asked for, the GPU's timer
    and its name (GPU, compute capability, driver), and whether the tuning database is read and written."""

    binding: dict
    hardware: Hardware
    codegen: CodegenConfig
    measure: Measure
    device: str
    use_cache: bool = True


def usable(kind: str, key: str, problem: Callable[[object], str | None], entry: str, redo: str):
    """The database's `kind` entry under `key` when `problem` finds nothing wrong with it, else None; an
    entry that is there but unusable is reported once ("not a valid <entry> (<problem>); <redo> again")."""
    hit = cache.read(kind, key)
    why = None if hit is None else problem(hit)
    if why is not None:
        cache.warn(cache.path_for(kind, key), f"not a valid {entry} ({why}); {redo} again")
    return None if why is not None else hit


def measured_key(program: Program, binding: dict, hardware: Hardware, device: str, params: dict[str, int],
                 codegen: CodegenConfig = CodegenConfig()) -> str:
    """A time measured on a GPU: the device string names the GPU, its compute capability and driver; the
    generated code's sources and templates are in the key too, since a time measured on other code is stale,
    and so are the code generator's options."""
    code = cache.code_digest(*MODEL_CODE, "backend", "pipeline/build.py", extra=TEMPLATES)
    return cache.digest("measured", SEARCH_VERSION, code, structure(program, names=True), dims_key(binding),
                        hardware.name, device, json.dumps(sorted(params.items())),
                        json.dumps(sorted(vars(codegen).items())))


def dims_key(binding: dict) -> str:
    """The dims of a binding as the database's keys hold them."""
    return json.dumps(sorted((str(k), int(v)) for k, v in binding.items()))


def to_measure(ranked: list[Ranked]) -> list[Ranked]:
    """The best MEASURED by the model, and the best of each other shape (number of custom kernels; the
    program as written): the model may misjudge a whole shape (a split reduction's second launch, say),
    and timing its best is how that is caught."""
    def shape(r: Ranked) -> tuple:
        return r.as_written, len(kernels_of(r.program))

    first: dict[tuple, int] = {}  # each shape's best, by its place in `ranked`
    for i, r in enumerate(ranked):
        first.setdefault(shape(r), i)
    return ranked[:MEASURED] + [ranked[i] for i in first.values() if i >= MEASURED]


def timed(r: Ranked, timing: Timing) -> bool:
    """`r` timed (`r.measured`), from the tuning database where it holds a usable time; whether it was timed now."""
    codegen = r.codegen(timing.codegen)
    key = measured_key(r.program, timing.binding, timing.hardware, timing.device, r.params, codegen)
    hit = usable("measured", key, measured_problem, "measurement", "timing") if timing.use_cache else None
    if hit is not None:
        r.measured = Measurement(None if hit["us"] is None else float(hit["us"]), hit["note"])
        return False
    r.measured = timing.measure(r.program, r.params, codegen)
    if r.measured.lasting and timing.use_cache:
        cache.write("measured", key, {"us": r.measured.us, "note": r.measured.note})
    return True


def measure_best(ranked: list[Ranked], timing: Timing) -> dict:
    """Time the programs `to_measure` picks (the tuning database first); what report.json says of it."""
    now = before = 0
    failures: list[str] = []
    by_model = {id(r): i + 1 for i, r in enumerate(ranked)}
    for r in to_measure(ranked):
        if timed(r, timing):
            now += 1
        else:
            before += 1
        if r.measured.us is None:
            what = "the program as written" if r.as_written else f"the model's number {by_model[id(r)]}"
            failures.append(f"{what}: {r.measured.note}")
    return {"device": timing.device, "timed": now, "from_database": before, "failed": failures}


def parameter_choices(r: Ranked, binding: dict, hardware: Hardware, codegen: CodegenConfig,
                      count: int | None = None) -> list[Ranked]:
    """`r`, the model's next best choices of its kernel parameters (`tuning.choices`), and `r`'s own parameters at
    twice the threads per block where its kernels then take more (the last), up to `count` in all, each with the
    model's estimate; `r` alone where its parameters name no lowered form's (none to choose)."""
    count = PARAMETER_CHOICES if count is None else count
    names = set(r.params)
    forms = [f for f in lowered_forms(r.program, binding) if {s.name for s in free_symbols(f)} == names]
    if not forms or count < 2:
        return [r]
    form, config = forms[0], r.codegen(codegen)

    def priced(params: dict[str, int], threads: int | None) -> Ranked | None:
        """The choice with the model's estimate; None where it is no valid choice, or (with other threads) where
        the kernels take as many threads as with the code generator's."""
        other = replace(config, threads=threads) if threads else config
        try:
            _, concrete, estimates = tuning.parameters(form, binding, params, hardware, other)
        except PrismError:
            return None
        wider = [layout(c, cost.for_hardware(other, hardware)).threads for c in concrete.values()]
        if threads and wider == [layout(c, cost.for_hardware(config, hardware)).threads for c in concrete.values()]:
            return None
        return Ranked(r.program, params, sum(e.time_us for e in estimates), as_written=r.as_written, proved=r.proved,
                      threads=threads or r.threads)

    wide = priced(r.params, 2 * config.threads) if 2 * config.threads <= hardware.max_threads_per_block else None
    try:
        picks = tuning.choices(form, binding, {}, hardware, cost.for_hardware(config, hardware), count)
    except ValueError:
        picks = []
    out = [r]
    for pick in picks:
        params = {s.name: v for s, v in pick.items()}
        if params != r.params and len(out) < count - (wide is not None) and (c := priced(params, None)) is not None:
            out.append(c)
    return out + ([wide] if wide is not None else [])


def time_parameters(r: Ranked, timing: Timing, count: int | None = None) -> tuple[Ranked, dict]:
    """`r` (timed already) with the fastest of its `parameter_choices` that agreed with the reference, each timed
    (the tuning database first); and what report.json says of them (`Ranked.timed`: each choice's parameters,
    estimate and time, in the model's order), with how many were timed now and how many came from the database.
    `count`: PARAMETER_CHOICES unless given."""
    choices = parameter_choices(r, timing.binding, timing.hardware, timing.codegen, count)
    now = sum(timed(c, timing) for c in choices[1:])
    listed = [{"params": c.params, "threads": c.codegen(timing.codegen).threads,
               "estimated_us": round(c.estimated_us, 3),
               "measured_us": None if c.measured_us is None else round(c.measured_us, 3),
               "measurement": c.measured.note} for c in choices]
    agreed = [c for c in choices if c.measured_us is not None]
    fastest = min(agreed, key=lambda c: c.measured_us) if agreed else r
    chosen = fastest if fastest is r else replace(fastest, busy=r.busy, work=r.work)
    chosen.timed = listed
    return chosen, {"timed": now, "from_database": len(choices) - 1 - now}


def measured_problem(hit) -> str | None:
    """What makes a measured entry unusable, or None: a note in words, and a time that is a finite
    positive number or null (the program was not usable)."""
    if not isinstance(hit, dict) or not isinstance(hit.get("note"), str) or "us" not in hit:
        return "not a time with a note"
    if hit["us"] is not None and not is_time(hit["us"]):
        return f"the time {clip(repr(hit['us']))} is not a finite positive number"
    return None


def gpu_timer(hardware: Hardware, options: build.BuildOptions, reference: Program) -> Measure:
    """`measure` on a GPU: builds a program with the given parameters (`options` say how), runs it, checks every
    output against the float64 reference of `reference` (the input program) and times it (`build.measure`). A
    program that disagrees is never timed into a result."""
    def measure(program: Program, params: dict[str, int], codegen: CodegenConfig) -> Measurement:
        try:
            gpu = build.measure(build.build(program, hardware, replace(options, params=dict(params), codegen=codegen),
                                            reference), options.seed)
        except (PrismError, cuda_runtime.PlanError, cuda_runtime.KernelCompileError) as e:
            return Measurement(None, f"could not be built or run: {str(e).splitlines()[0]}", lasting=False)
        if not gpu.passed:
            return Measurement(None, f"disagreed with the reference ({gpu.errors()})")
        if gpu.timing_ms["host_bound"]:  # ranked as measured, but not kept: a later run may time the GPU alone
            return Measurement(gpu.timing_ms["median_ms"] * 1000, "checked; host-bound (the host's time to queue "
                               "its launches is in it)", lasting=False)
        return Measurement(gpu.timing_ms["median_ms"] * 1000, "checked")

    return measure
