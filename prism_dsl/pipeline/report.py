"""What `prismc compile` found, typed and frozen: built by the pipeline's passes, serialised once to
report.json (`Report.to_json`) and said in words (`summary`).

Three words, three meanings:

    proved    the emitted program is the input program itself (compiled as written, or nothing faster was
              found), or an e-graph proof in this run showed it equal to the input program
    checked   what ran against the float64 reference of the input program: the generated code emulated on
              the CPU, and run on the GPU when ranking by measurement; each with its errors and tolerance
    verified  both: proved, and at least one check ran and every check that ran agreed
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping

from ..backend.emulate import Finding

MARGIN = 0.1  # the share of the estimate a size rounded up must save to be built (`padding.fastest`)


@dataclass(frozen=True)
class Skipped:
    """A check that could not run here, and why."""

    skipped: str


@dataclass(frozen=True)
class Check:
    """The generated code run on random inputs, each output compared with the float64 reference
    (`compare.check`: |got - ref| <= rtol * (|ref| + rms(ref)) everywhere, NaN never passes)."""

    passed: bool
    rtol: float
    seed: int
    checked_against: str  # "input program": never the program the search chose
    outputs: Mapping[str, Mapping]  # per output: passed, max_rel_err, max_abs_err, nan, worst_index, reason, rtol

    def errors(self) -> str:
        """Per output its max relative error, the tolerance where it was widened (`compare.Tolerance`), and for
        one that failed, why (`compare.check`'s reason)."""
        return ", ".join(f"{o}: max rel err {v['max_rel_err']:.2e}" + widened(v, self.rtol) + overflowed(v)
                         + (f": {v['reason']}" if v.get("reason") else "") for o, v in self.outputs.items())


def overflowed(output: Mapping) -> str:
    """For an output with elements its storage type rounds to an infinity in the reference (`compare.check`), the
    words that say so; else ""."""
    if not output.get("overflow"):
        return ""
    return (f" ({output['overflow']} element(s) past {output['dtype']}'s range in the reference, stored as its "
            f"infinities: the inputs' scale, not the kernels)")


def widened(output: Mapping, rtol: float) -> str:
    """For an output judged at a wider tolerance than `rtol`, the words that say so and why; else ""."""
    if output.get("rtol", rtol) <= rtol:
        return ""
    what = (f"the {output['rounding']:.2e} that its kernels' own roundings alone make: their arithmetic in f32, and "
            f"products' operands and stored tensors in their storage types")
    if output["rtol"] >= 2 * output["rounding"] * (1 - 1e-12):
        return f" (tolerance {output['rtol']:.2e}: twice {what})"
    lost = "" if output.get("passed") else ": they lose this output"
    return f" (tolerance {output['rtol']:.2e}, the widest a check allows, short of twice {what}{lost})"


@dataclass(frozen=True)
class EmulationCheck(Check):
    """A check in the thread-faithful CPU emulation (`pipeline.emulation`), with what ran and what it found."""

    emulation: Mapping  # threads_per_block (the largest), block_sizes, sanitizer, dims, blocks (emulated / grid per kernel), ...
    finding: Mapping | None = None  # what the emulation or a sanitizer reported (`backend.emulate.Finding`)

    def errors(self) -> str:
        if self.finding:
            return Finding.from_dict(self.finding).text().replace("\n  ", "; ")
        return super().errors()

    def describe(self) -> str:
        e = self.emulation
        blocks = e["blocks"]
        emulated, total = sum(b["emulated"] for b in blocks.values()), sum(b["grid"] for b in blocks.values())
        how = "every block" if e["whole_grid"] else f"{emulated} of {total} blocks (sampled, seed {e['sample_seed']})"
        sizes = e.get("block_sizes") or [e["threads_per_block"]]
        return (f"{' and '.join(map(str, sizes))} threads per block, {how}, "
                + (f"{e['sanitizer']} sanitizer" if e["sanitizer"] else "no sanitizer") + f", {e['seconds']} s")


@dataclass(frozen=True)
class GpuCheck(Check):
    """A check on the GPU, with the program's times there (CUDA-event medians of rotated input sets)."""

    device: str
    timing_ms: Mapping[str, float]  # the whole program: median_ms, min_ms, mean_ms, repeat, host_bound
    kernels_ms: Mapping[str, Mapping[str, float]]  # the same per kernel, its zeroing included


@dataclass(frozen=True)
class Checked:
    emulation: Check | Skipped | None = None  # None: not asked for
    gpu: GpuCheck | None = None  # None: not ranked by measurement

    def ran(self) -> list[Check]:
        return [c for c in (self.emulation, self.gpu) if isinstance(c, Check)]

    @property
    def passed(self) -> bool:
        """At least one check ran, and every one agreed."""
        return bool(self.ran()) and all(c.passed for c in self.ran())

    @property
    def failed(self) -> bool:
        return not all(c.passed for c in self.ran())


@dataclass(frozen=True)
class NvccCheck:
    """Every kernel compiled by nvcc for every architecture (a rejection is an error, not a report)."""

    archs: tuple[str, ...]
    wgmma: tuple[str, ...] = ()  # kernels on wgmma: compiled as sm_90a, for sm_90 only
    passed: bool = True
    warnings: tuple[str, ...] = ()  # nvcc's, on the kernels' files (the generated code has none: tests/test_codegen.py)


@dataclass(frozen=True)
class KernelReport:
    name: str
    function: str
    file: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int
    tensor_cores: bool
    estimate: Mapping  # `cost.Estimate`'s fields
    nvcc: Mapping[str, Mapping]  # per architecture: ok and ptxas's figures; empty when not compiled
    measured_us: float | None = None
    tma: tuple[str, ...] = ()  # the tensors whose loop tiles TMA copies (`backend.copies`), one map each
    shared: Mapping | None = None  # its shared-memory wavefronts counted in the emulation (`--banks`; `banks.Wavefronts`)


@dataclass(frozen=True)
class HardwareUsed:
    """The hardware a report is for (report.json's `hardware`)."""
    name: str
    arch: str


@dataclass(frozen=True)
class Alternative:
    """One of the best programs the search ranked."""

    rank: int
    as_written: bool
    kernels: int
    estimated_us: float
    measured_us: float | None
    measurement: str | None  # "checked", or why a time is not usable; None: not timed
    proved: bool | None  # True: proved in this run (or the input itself); None: from the checkpoint, not again
    program: str


@dataclass(frozen=True)
class Searched:
    """The search's part of the report (written at report.json's top level)."""

    best: str  # the file the chosen program is written to
    best_is_input: bool
    kernels_in_best: int
    search: Mapping  # what `optimize` says of the search
    search_seconds: float
    alternatives: tuple[Alternative, ...]


@dataclass(frozen=True)
class Report:
    program: str
    hardware: HardwareUsed
    rank: str  # how launch parameters were ranked: "model" or "measure"
    dims: Mapping[str, int]
    parameters: Mapping[str, int]
    kernels: tuple[KernelReport, ...]
    estimated_us: float
    roofline: Mapping
    measured_us: float | None  # on the GPU, when ranking by measurement
    nvcc: NvccCheck | Skipped | None  # None: no architecture asked for
    checked: Checked
    proved: bool
    compile_seconds: float
    files: tuple[str, ...]  # what prismc wrote into the output directory
    searched: Searched | None = None  # None: compiled as written
    codegen: Mapping | None = None  # the code generator's options (`CodegenConfig`: --threads, --stages, ...)
    priced: str = "the code's structure"  # what the estimates were priced from (`build.pricing`)
    banks: Skipped | None = None  # why the count `--banks` asked for did not run
    padded: Mapping[str, int] = field(default_factory=dict)  # dims built rounded up (`padding`): the sizes given
    padded_inputs: bool = False  # the caller passes the inputs at the sizes built (`padding.copy_us`)
    padding_failed: str | None = None  # built past the sizes given, its check failed: built at them (`compile`)
    in_place: tuple[str, ...] = ()  # with `padded`: inputs the kernels read at the sizes given (`masking.read_in_place`)
    launcher_pads: tuple[str, ...] = ()  # and those the launcher pads (or the caller passes padded: `padded_inputs`)
    padding_copies_us: float | None = None  # with `padded`: what the copies that pad and cut cost a call, by the model
    kept: bool = False  # its check failed and the output directory, an earlier verified compile's, was kept (`files` empty)
    parameters_timed: tuple[Mapping, ...] = ()  # with --rank measure: choices of the kernel parameters timed on the
    # GPU (`measuring.time_parameters`): params, threads (the least count, as --threads), estimated_us, measured_us,
    # measurement
    idle: tuple[str, ...] = ()  # options given that the chosen program leaves with nothing to change, each said why
    padding_tried: tuple[Mapping, ...] = ()  # each rounding of the dims no tile divides (`padding.fastest`): its dims,
    # and the model's time there with the copies (`estimated_us`, `copies_us`), or why it cannot be built (`refused`)

    @property
    def verified(self) -> bool:
        return self.proved and self.checked.passed

    def to_json(self) -> str:
        """Standard JSON, which has no infinity or NaN: an error that is one (the output of sqrt(X) on negative
        inputs) is written as the string "inf", "-inf" or "nan"."""
        fields = asdict(self)
        searched = fields.pop("searched") or {}
        if searched:  # its time once, at the top (`optimize` keeps it with the rest)
            searched["search"] = {k: v for k, v in searched["search"].items() if k != "search_seconds"}
        return json.dumps(json_finite({**fields, **searched, "verified": self.verified}), indent=2,
                          allow_nan=False) + "\n"


def json_finite(value):
    """`value` with every float that JSON cannot hold replaced by its name (`Report.to_json`, `prismc bench --json`)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: json_finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_finite(v) for v in value]
    return value


def _host(timing: Mapping) -> str:
    """What a measured time says where the host's time to queue its launches is in it (`cuda_runtime.Ahead`)."""
    return " (host-bound: the host's time to queue the launches is in it)" if timing.get("host_bound") else ""


def summary(report: Report, out: Path) -> str:
    """The report in words, for the terminal."""
    lines = [f"{report.program} -> {out}/ (hardware {report.hardware.name}, "
             f"dims {', '.join(f'{k}={v}' for k, v in report.dims.items()) or 'none'})"]
    if report.padded:  # `padding`
        copies = report.padding_copies_us
        pads = ", ".join(report.launcher_pads)
        them = "it" if len(report.in_place) == 1 else "them"
        how = ([f"the kernels read {', '.join(report.in_place)} as the caller passes {them} (zeros past the end, nothing"
                " read there)"] if report.in_place else []) + ([
            f"the caller passes {pads} at the sizes built, zeros past its own (--padded-inputs)" if report.padded_inputs
            else f"the launcher pads {pads} with zeros"] if report.launcher_pads else [])
        how = "; ".join(how) or "no input has such a dim"
        lines.append("  built for " + ", ".join(f"{k}={report.dims[k]} (given {v})" for k, v in report.padded.items())
                     + f": tiles divide that; {how}, and the outputs come back cut to the sizes given"
                     + (f" (copies: {copies} us by the model, beside the estimate below)" if copies else ""))
    if report.padding_failed:  # `compile.compile_program`
        lines.append(f"  built at the sizes given: {report.padding_failed}")
    elif report.padding_tried and not report.padded:  # rounding up was tried, and saves less than MARGIN
        lines.append(f"  built at the sizes given, no tile dividing them (a rounding up must save {MARGIN:.0%} of the "
                     f"time): by the model, {report.estimated_us} us, "
                     "against " + "; ".join(
                         ", ".join(f"{k}={v}" for k, v in t["dims"].items()) + " (rounded up) "
                         + (f"{t['estimated_us']} us with the copies that pad the call ({t['copies_us']} us)"
                            if "refused" not in t else f"refused: {t['refused']}") for t in report.padding_tried))
    lines += [f"  {said}" for said in report.idle]
    gpu = report.checked.gpu  # where a time was measured
    for k in report.kernels:
        nv = k.nvcc.get(report.hardware.arch) or next(iter(k.nvcc.values()), {})
        res = f", {nv['registers']} registers, {nv['spill_stores']} B spilled" if nv else ""
        res += ", its wgmma serialized by ptxas" if nv.get("wgmma_serialized") else ""
        if k.shared:
            res += (f", {k.shared['wavefronts'] / max(1, k.shared['blocks']):,.0f} shared-memory wavefronts a block "
                    f"({k.shared['over_conflict_free']:.2f}x conflict-free, {k.estimate.get('shared_us', 0.0)} us)")
        measured = f", measured {k.measured_us} us{_host(gpu.kernels_ms[k.name])}" if k.measured_us is not None else ""
        tail = k.estimate.get("combines")
        also = f" (and {tail['kernel']} in its launch, {tail['time_us']} us)" if tail else ""
        lines.append(f"  kernel {k.name}{also}: grid {'x'.join(map(str, k.grid))}, {k.block[0]} threads, "
                     f"{k.smem_bytes} B shared{res}{', tensor cores' if k.tensor_cores else ''}"
                     f"{', TMA copies of ' + ', '.join(k.tma) if k.tma else ''}; "
                     f"estimated {k.estimate['time_us']} us ({k.estimate['bound']}){measured}")
    roof = report.roofline
    lines.append(f"  estimated {report.estimated_us} us; roofline floor {roof['floor_us']} us ({roof['bound']})"
                 + (f"; measured {report.measured_us} us{_host(gpu.timing_ms)}" if report.measured_us is not None
                    else ""))
    lines.append(f"    estimates priced from {report.priced}")
    if report.parameters_timed:
        lines.append("  kernel parameters timed (the fastest that agreed is built):")
        lines += [f"    {', '.join(f'{k}={v}' for k, v in t['params'].items()) or 'no parameters'}, "
                  f"--threads {t['threads']}: estimated {t['estimated_us']} us, "
                  + (f"measured {t['measured_us']} us" if t["measured_us"] is not None else t["measurement"])
                  for t in report.parameters_timed]
    if report.banks is not None:
        lines.append(f"  shared-memory count (--banks): skipped ({report.banks.skipped})")
    checks = {"nvcc": report.nvcc, "emulation": report.checked.emulation, "gpu": report.checked.gpu}
    for name, c in ((n, c) for n, c in checks.items() if c is not None):
        if isinstance(c, Skipped):
            lines.append(f"  {name}: skipped ({c.skipped})")
        elif isinstance(c, NvccCheck):
            lines.append(f"  nvcc: every kernel compiles for {', '.join(c.archs)}" if not c.wgmma else
                         f"  nvcc: the kernels compile for {', '.join(c.archs)}, those on wgmma for sm_90a only: "
                         + ", ".join(c.wgmma))
            lines += [f"    warning: {w}" for w in c.warnings]
        else:
            lines.append(f"  {name}: {'passed' if c.passed else 'FAILED'} against the float64 reference of the "
                         f"{c.checked_against} ({c.errors()})")
            if isinstance(c, EmulationCheck):
                lines.append(f"    emulated: {c.describe()}")
    if report.searched is not None:
        lines += _search_lines(report.searched)
    lines.append("  verified: " + ("yes: proved and checked" if report.verified else "NO: " + (
        "not proved equal to the input program" if not report.proved else
        "the outputs did not agree" if report.checked.failed else "the outputs were not checked")))
    if report.kept:  # `compile.compile_program`
        lines.append(f"  {out}/ left as it was: it holds an earlier compile that was verified, which this one's files "
                     "would replace; nothing was written (give another -o to keep them)")
    return "\n".join(lines)


def _search_lines(s: Searched) -> list[str]:
    sr = s.search
    found = f"{sr['proved_programs']} proved programs (" + (
        "complete" if sr["complete"] else f"cut short ({sr['stopped']}): best so far") + ")"
    if sr["from_checkpoint"]:  # this run proved the chosen one again; the rest were proved by the run that saved them
        found = (f"{sr['proved_programs']} programs from the checkpoint (proved when it was saved"
                 + ("" if s.best_is_input else "; the chosen one again now") + ")")
    took = f"{s.search_seconds} s"  # the search (which --time-limit bounds), then the tuning of what it proved
    if not sr["from_checkpoint"] and "seconds" in sr:
        took = f"{sr['seconds']} s searching, {s.search_seconds - sr['seconds']:.3g} s tuning what it proved"
    lines = [f"  search: {found}, {sr['jobs']} prover processes, "
             f"{took}; best: {s.best} with {s.kernels_in_best} kernel(s)"
             + (" (the program as written" + ("" if sr.get("failed_check") else ": nothing faster was found") + ")"
                if s.best_is_input else "")]
    for f in sr.get("failed_check", ()):  # built, checked and passed over (`compile.FALLBACKS`)
        lines.append(f"  program {f['rank']} of the search's ranking{' (as written)' if f['as_written'] else ''} was "
                     f"passed over: {f['why']}")
    if unsteady := sr.get("pruned", {}).get("unsteady"):
        lines.append(f"  {unsteady} program(s) left out as unsteady: they lose accuracy the input keeps on inputs far "
                     "from zero (--unsteady offers them)")
    if sr.get("errors"):
        lines.append(f"  {len(sr['errors'])} proofs could not run (errors, not failed proofs): "
                     + "; ".join(dict.fromkeys(sr["errors"])))
    if sr.get("as_written_fits") is False:
        lines.append("  the program as written cannot run at these dims (its pre-defined kernels do not fit)")
    if why := sr.get("as_written_refused"):  # `padding.retuned`
        lines.append(f"  the program as written is not built past the sizes given: {why}")
    if m := sr.get("measured"):
        lines.append(f"  tuning on {m['device']}: {m['timed']} programs timed, {m['from_database']} from the "
                     "tuning database" + "".join(f"\n    not used: {f}" for f in m["failed"]))
    return lines
