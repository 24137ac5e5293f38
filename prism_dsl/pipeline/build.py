"""The passes that turn one program into checked CUDA C, each a function with typed inputs and outputs:

    lower          every op outside custom kernels becomes a pre-defined kernel (`kernels.lower`)
    tune           kernel parameters as given (by the command line, or as the search tuned them), the rest
                   chosen by the cost model (`tuning.parameters`); every kernel concrete -> `Tuned`
    render         CUDA C per kernel through the templates (`codegen`) -> `Build`
    compile-check  each kernel compiled by nvcc for every requested architecture; ptxas figures kept, and
                   what each warp issues where cuobjdump reads the SASS (`nvcc`)
    price          each kernel's estimate again from its compiled code for the hardware's arch (`cost.estimate`)
    emulate        the generated code run as C++ on the CPU, every output compared with the float64
                   reference (`backend.emulate`)
    count banks    with `banks`, each kernel's shared-memory wavefronts counted in the emulation
                   (`backend.banks`), and the estimates priced again with them (price)
    measure        on the GPU: run, compared the same way, timed (`cuda_runtime`)

The numeric checks compare with the float64 reference of the *input program* (`Tuned.reference`), never
with the program the search chose, so that they do not depend on the proof (`report` says what they found).
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import sympy

from ..backend import banks, compare, cost, cuda_runtime, sass, tuning
from ..backend import emulate as emulator
from ..backend.codegen import CodegenConfig, RenderedKernel, render_kernel
from ..backend.copies import in_place
from ..backend.cost import Estimate
from ..backend.nvcc import kernel_arch, nvcc_check, nvcc_path, write_sources
from ..backend.tails import in_launch, render_launch
from ..base import files
from ..base.errors import PrismError
from ..ir.nodes import Program
from ..kernels.constraints import Concrete
from ..kernels.hardware import Hardware
from ..kernels.kernel import free_symbols, kernels_of, stored_dtype
from ..kernels.params import resolve_params
from ..kernels.lower import lower, lowered_forms
from ..prove.prover import check_signatures, pair_outputs
from ..semantics.blocks import evaluate
from ..semantics.reference import bind_dims, check_sizes, concrete_shape
from ..semantics.reference import check_inputs as reference_inputs
from . import emulation
from .report import EmulationCheck, GpuCheck, NvccCheck, Skipped

ARCHS = ("sm_90", "sm_80")
CHECKED_AGAINST = "input program"  # what the numeric checks compare with, as report.json says


@dataclass(frozen=True)
class BuildOptions:
    dims: Mapping[str, int] = field(default_factory=dict)
    grid: Mapping[str, int] = field(default_factory=dict)
    loop: Mapping[str, int] = field(default_factory=dict)
    params: Mapping[str, int] = field(default_factory=dict)  # by symbol name, as the search's tuning chose them
    rank: str = "model"  # how launch parameters are ranked: "model" (the cost model) or "measure" (on the GPU)
    archs: tuple[str, ...] = ARCHS
    emulate: bool = True
    sanitize: str | None = None  # the emulation under a sanitizer: "thread" or "address"
    emulate_blocks: str | int = "auto"  # "all"; "auto": all when quick, else sampled; N: sampled, N at random per kernel
    seed: int = 0
    banks: bool = False  # count the shared-memory wavefronts in the emulation, and price them (`count_banks`)
    codegen: CodegenConfig = CodegenConfig()
    padded: Mapping[str, int] = field(default_factory=dict)  # dims built rounded up (`padding`): the sizes given
    padded_inputs: bool = False  # the caller passes inputs at the sizes built: padding's copies of them not counted

    def __post_init__(self):  # the code masks the folds along dims built past the sizes given (`kernels.masking`)
        object.__setattr__(self, "codegen", replace(self.codegen, ends=tuple(sorted(self.padded.items())),
                                                    in_place=self.codegen.in_place and not self.padded_inputs))


@dataclass(frozen=True)
class Tuned:
    """A lowered program with every kernel parameter chosen."""

    program: Program  # lowered: pre-defined kernels for every op outside custom kernels
    source: Program  # as given to `lower`
    reference: Program  # the input program the outputs are checked against (`source` itself, or proved equal)
    hardware: Hardware
    binding: Mapping  # dims and kernel parameters, by symbol
    params: Mapping[str, int]
    concrete: Mapping[str, Concrete]
    estimates: tuple[Estimate, ...]
    padded: Mapping[str, int] = field(default_factory=dict)  # dims built rounded up: the sizes the caller gives
    in_place: frozenset[str] = frozenset()  # of the inputs with such a dim, those the kernels read at the caller's
    # sizes, guarded past them (`masking.read_in_place`); the launcher pads the others


@dataclass(frozen=True)
class Build(Tuned):
    """A tuned program with the CUDA C of each kernel."""

    kernels: tuple[RenderedKernel, ...] = ()


def fastest_form(forms: list[Program], binding: dict, hardware: Hardware, codegen: CodegenConfig,
                 given: Callable[[Program], dict] = lambda form: {}) -> tuple[tuple | None, list[PrismError]]:
    """The fastest by the model of a program's lowered `forms` (`kernels.lower.lowered_forms`: a softmax's rows may
    fit one block and spill), each tuned at `binding` with the parameters `given` for it (`tuning.parameters`):
    (form, params, concrete, estimates), or None where none fits; and why those that do not fit do not."""
    tuned, errors = [], []
    for form in forms:
        try:
            tuned.append((form, *tuning.parameters(form, binding, given(form), hardware, codegen)))
        except PrismError as e:
            errors.append(e)
    return (min(tuned, key=lambda t: sum(e.time_us for e in t[3])) if tuned else None), errors


def tune(lowered: Program, source: Program, hardware: Hardware, options: BuildOptions,
         reference: Program | None = None) -> Tuned:
    """`lowered` (`source` lowered) at the options' dims: the given parameters kept, the rest chosen by the
    model. `reference` is the program the user gave, when `source` is one the search proved equal to it."""
    reference = source if reference is None else reference
    if reference is not source:
        check_signatures(reference, source)
        pair_outputs(source, reference)
    bind_dims(reference, dict(options.dims))  # a binding the program refuses, reported where the user wrote it
    def names(form: Program) -> set[str]:
        return {s.name for s in free_symbols(form)}

    # and the other form (for long rows, where there is one): forms differ in their parameters' names
    forms = [lowered] + [f for f in lowered_forms(source, bind_dims(source, dict(options.dims)))
                         if names(f) != names(lowered)]
    # parameters tuned before (`options.params`) name one form's kernels: the form they name all of (the usual
    # form's names are a subset of the long form's, where a grid size means another thing), else one they fit
    if given := set(options.params):  # (none given: every form, one without parameters among them)
        forms = [f for f in forms if given == names(f)] or [f for f in forms if given <= names(f)] or forms[:1]
    binding = bind_dims(lowered, dict(options.dims))
    best, errors = fastest_form(forms, binding, hardware, options.codegen,
                                lambda form: {**resolve_params(form, options.grid, options.loop), **options.params})
    if best is None:
        if len(errors) > 1:  # the form for long rows was tried too
            raise PrismError(f"{errors[0]}\n(nor in two kernels for its long rows: {errors[1]})")
        if "'softmax_" in str(errors[0]) and any(n.op == "softmax" and n.rank > 3 for n in source.nodes()):
            raise PrismError(f"{errors[0]}\n(a softmax whose rows no block holds is lowered in two kernels at rank 3 "
                             "or less: fold its leading dims into one)")
        raise errors[0]
    lowered, params, concrete, estimates = best
    symbols = {s.name: s for s in free_symbols(lowered)}
    full = {**binding, **{symbols[n]: v for n, v in params.items()}}
    return Tuned(lowered, source, reference, hardware, full, params, concrete, tuple(estimates), dict(options.padded),
                 frozenset(n.attr for n in lowered.inputs if in_place(n, options.codegen)))


def render(tuned: Tuned, config: CodegenConfig) -> Build:
    """The CUDA C of each launch: a kernel's own, or a kernel's with the combining kernel that runs in its
    launch (`tails.in_launch`)."""
    config = cost.for_hardware(config, tuned.hardware)  # what the pipeline stages may fill; whether wgmma is there
    tails = in_launch(tuned.program, tuned.concrete, config)
    firsts = {first: second for second, first in tails.items()}
    kernels = tuple(
        render_launch(tuned.concrete[k.name], tuned.concrete[firsts[k.name]], tuned.program, config) if k.name in firsts
        else render_kernel(tuned.concrete[k.name], tuned.program, config)
        for k in kernels_of(tuned.program) if k.name not in tails)
    return Build(**vars(tuned), kernels=kernels)


def build(source: Program, hardware: Hardware, options: BuildOptions, reference: Program | None = None) -> Build:
    """lower, tune and render one program (what the search times, `prismc bench` runs, tests read)."""
    return render(tune(lower(source), source, hardware, options, reference), options.codegen)


def dims_of(built: Tuned) -> dict[str, int]:
    return {d.name: int(built.binding[d.symbol]) for d in built.source.dims}


def plan_of(built: Build) -> dict:
    """The runtime plan (`cuda_runtime`): tensors, kernels, launch shapes."""
    tensors = {n.attr: {"shape": list(concrete_shape(n.shape, built.binding)), "dtype": n.dtype.value}
               for n in built.program.inputs}
    for k in kernels_of(built.program):
        c = built.concrete[k.name]
        for i, s in enumerate(k.stores):
            tensors[s.name] = {"shape": list(c.output_shape(i)), "dtype": stored_dtype(k, i).value}
    if built.padded:  # the program's own tensors as the caller passes and gets them (`padding`)
        ref = built.reference
        given = bind_dims(ref, callers_dims(built))
        theirs = dict(ref.outputs)
        shapes = {n.attr: n.shape for n in ref.inputs} | {
            mine: theirs[other].shape for mine, other in pair_outputs(built.source, ref)}
        for name, shape in shapes.items():
            if (used := list(concrete_shape(shape, given))) == tensors[name]["shape"]:
                continue
            if name in built.in_place:  # the kernels take it as the caller passes it: nothing to pad
                tensors[name] |= {"shape": used, "in_place": True}
            else:
                tensors[name]["used"] = used
    return {
        "program": built.program.name,
        "inputs": [n.attr for n in built.program.inputs],
        "outputs": [name for name, _ in built.program.outputs],
        "tensors": tensors,
        "kernels": [{"name": r.name, "file": r.file, "function": r.function, "grid": list(r.grid),
                     "block": list(r.block), "smem": r.smem, "args": list(r.args), "zero": list(r.zero)}
                    | ({"tickets": r.tickets} if r.tickets else {}) | ({"sums": r.sums} if r.sums else {}) | ({"maps": [m.as_plan() for m in r.maps]} if r.maps else {})
                    for r in built.kernels],
    }


# -- compile-check -----------------------------------------------------------------------------------------


def compile_check(kernels: Sequence[RenderedKernel], archs: tuple[str, ...], priced: str | None = None
                  ) -> tuple[NvccCheck | Skipped | None, dict[str, dict[str, dict]]]:
    """nvcc's verdict and its figures per kernel and arch, the SASS read for `priced` (the arch the estimates are
    priced for; every arch when None); a kernel nvcc rejects is an error."""
    if not archs:
        return None, {}
    if not nvcc_path():
        return Skipped("nvcc is not on the PATH"), {}
    if none := [k.name for k in kernels if all(kernel_arch(k, a) is None for a in archs)]:  # nothing would be checked
        raise PrismError(f"{', '.join(none)} {'runs' if len(none) == 1 else 'run'} on wgmma, which needs sm_90 (compiled "
                         f"as sm_90a), and --arch {','.join(archs)} has no such arch: add sm_90, or compile with --no-wgmma")
    with files.temp_scratch("nvcc") as workdir:
        figures = nvcc_check(kernels, workdir, archs, None if priced is None else (priced, f"{priced}a"))
    bad = [(f"{k} ({a})", r["stderr"]) for k, per in figures.items() for a, r in per.items() if not r["ok"]]
    unknown = sorted({a for per in figures.values() for a, r in per.items()
                      if not r["ok"] and "Unsupported gpu architecture" in r["stderr"]})
    if unknown:  # the flag's value, not the code
        raise PrismError(f"this nvcc does not compile for {', '.join(unknown)} (--arch): see `nvcc --list-gpu-arch`")
    full = next((text for _, text in bad if "No space left on device" in text), None)
    if full is not None:  # the machine's, not the code's
        raise PrismError(f"nvcc could not write its files: no space left on device (the temporary directory, "
                         f"{tempfile.gettempdir()}: set TMPDIR to a folder with room):\n{full}")
    if bad:
        raise PrismError(f"nvcc rejected the generated code for {', '.join(w for w, _ in bad)}:\n{bad[0][1]}")
    warned = dict.fromkeys(w for per in figures.values() for r in per.values() for w in r.get("warnings", ()))
    return NvccCheck(tuple(archs), tuple(k.name for k in kernels if k.wgmma), warnings=tuple(warned)), figures


def price(built: Build, figures: Mapping[str, Mapping], config: CodegenConfig,
          counted: Mapping[str, banks.Wavefronts] | None = None) -> Build:
    """`built` with each kernel's estimate priced again, from its compiled code where the compile check has figures
    for the hardware's arch (`cost.estimate`'s `compiled`), else from its structure as before; and from the
    shared-memory wavefronts `counted` in the emulation (`count_banks`), where given."""
    config, arch = cost.for_hardware(config, built.hardware), built.hardware.arch
    compiled = {name: per.get(arch) or per[f"{arch}a"] for name, per in figures.items()  # (--arch sm_90a: the same SMs)
                if arch in per or f"{arch}a" in per}
    for name, w in (counted or {}).items():
        compiled[name] = {**compiled.get(name, {}), "wavefronts": w.per_block}
    estimates = tuning.estimates(built.program, built.concrete, built.hardware, config, compiled)
    return replace(built, estimates=tuple(estimates))


def pricing(built: Build, nvcc: NvccCheck | Skipped | None, archs: tuple[str, ...]) -> str:
    """What the estimates were priced from, in words (the report's `priced`). A combining kernel run in another's
    launch is priced from its structure, whatever the launch's is (`tuning.estimates`), and said so apart."""
    own = [e for e in built.estimates if e.launched_by is None]
    arch, kinds = built.hardware.arch, [e.priced for e in own]
    tails = [e.kernel for e in built.estimates if e.launched_by is not None]
    aside = f" ({', '.join(tails)}, run in another kernel's launch: from its structure)" if tails else ""
    counted = ("; shared-memory wavefronts counted in the emulation" if any(e.wavefronts for e in own) else "")
    if all(k == "sass" for k in kinds):
        return f"the compiled code ({arch}: ptxas's registers, the instructions in its SASS)" + aside + counted
    why = ("no architecture compiled (--arch none)" if nvcc is None else nvcc.skipped if isinstance(nvcc, Skipped)
           else f"{arch}, the hardware's architecture, not among --arch" if arch not in archs and f"{arch}a" not in archs
           else "cuobjdump not found (pip install 'prism-dsl[sass]')" if not sass.available()
           else "the SASS's loops not matched to the source's main loop for "
           + ", ".join(e.kernel for e in own if e.priced != "sass"))
    return ("the code's structure" + (", registers from ptxas" if "ptxas" in kinds else "") + f": {why}" + aside
            + counted)


# -- emulate and measure ----------------------------------------------------------------------------------


def reference_outputs(built: Tuned, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The float64 oracle: the input program (custom kernels through the block interpreter, with the
    parameters the rendered code uses when it is the program built), its outputs under the built program's
    names (paired by name, the others by position: `prove.prover.pair_outputs`)."""
    hardware = built.hardware.name.lower()
    if _at_sizes_given(built):  # on the caller's part of each input, then zeros past it (`padding`)
        parts = callers_part(built)
        theirs = evaluate(built.reference, {k: a[parts.get(k, ())] for k, a in inputs.items()}, {}, hardware)
        values = {mine: theirs[other] for mine, other in pair_outputs(built.source, built.reference)}
        at = {name: concrete_shape(n.shape, built.binding) for name, n in built.source.outputs}
        return {name: _zeros_past(v, at[name]) for name, v in values.items()}
    if built.reference is built.source:  # past the sizes given, the folds masked as its kernels mask them (`masking`)
        own = {s.name for s in free_symbols(built.source)}
        # the build's own parameters: it has held its kernels to the shared memory their generated code takes
        return evaluate(built.source, inputs, {k: v for k, v in built.params.items() if k in own}, hardware,
                        smem=False, ends=built.padded)
    values = evaluate(built.reference, inputs, {}, hardware, ends=built.padded)
    return {mine: values[theirs] for mine, theirs in pair_outputs(built.source, built.reference)}


def _at_sizes_given(built: Tuned) -> bool:
    """Whether the reference runs at the sizes the caller gives: where dims were built past them (`padding`) and the
    input program is plain ops (one of custom kernels, which may not divide the sizes given, runs in the block
    interpreter at the sizes built, its folds masked past the end as its kernels' are: `kernels.masking`)."""
    return bool(built.padded) and not any(n.op == "kernel" for n in built.reference.nodes())


def rtol_of(program: Program) -> float:
    """The checks' relative tolerance for `program` (the input program): by the types it stores its inputs
    and outputs in (`compare.tolerance`)."""
    return compare.tolerance({n.dtype.value for n in program.inputs} | {n.dtype.value for _, n in program.outputs
                                                                         if n.dtype is not None})


def tolerance_of(built: Tuned, inputs: Mapping[str, np.ndarray]) -> compare.Tolerance:
    """The checks' tolerance for `built` on `inputs`: `rtol_of` its input program, widened for an output that
    the roundings its kernels make (products' operands, stored tensors) alone move further, measured within the
    program built (`compare.Tolerance`); each output's storage type, which may round the reference past its range
    to an infinity (`compare.check`)."""
    exact = None if built.reference is built.source and not _at_sizes_given(built) else (
        lambda: emulation.stored_values(built, inputs))
    stored = {s.name: stored_dtype(k, i).value for k in kernels_of(built.program) for i, s in enumerate(k.stores)}
    return compare.Tolerance(rtol_of(built.reference), lambda: emulation.stored_values(built, inputs, rounded=True),
                             exact, {name: stored[name] for name, _ in built.program.outputs if name in stored})


def check_inputs(built: Tuned, seed: int) -> dict[str, np.ndarray]:
    """The inputs the checks run `built` on (`reference.check_inputs`: the weights of the program the user gave
    scaled as a layer's are, so that every program the search proved is checked on the same arrays); where dims
    were built past the sizes given (`padding`), drawn at those sizes and zero past them, as the launcher pads
    the caller's."""
    return padded_inputs(built, reference_inputs(built.reference, bind_dims(built.reference, callers_dims(built)), seed))


def callers_dims(built: Tuned) -> dict[str, int]:
    """The dims as the caller gives them: those `built` was built at, or the sizes given where it was built past
    them (`padding`)."""
    return {**dims_of(built), **built.padded}


def padded_inputs(built: Tuned, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The caller's inputs (at `callers_dims`) as the kernels take them: zeros past the sizes given (`padding`)."""
    return {n.attr: _zeros_past(np.asarray(arrays[n.attr]), concrete_shape(n.shape, built.binding))
            for n in built.reference.inputs}


def _zeros_past(a: np.ndarray, shape) -> np.ndarray:
    """`a` in the first elements of an array of zeros of `shape` (`a` itself where it has that shape)."""
    if a.shape == tuple(shape):
        return a
    out = np.zeros(tuple(shape), dtype=a.dtype)
    out[tuple(slice(0, n) for n in a.shape)] = a
    return out


def callers_part(built: Tuned) -> dict[str, tuple[slice, ...]]:
    """Per tensor with a dim built past the size given (`padding`), the slices of the caller's part of it: the
    program's inputs and outputs as the caller passes and gets them, and the tensors kernels pass on alike (past
    the end they hold what zeros make: a row of zeros normalised without an epsilon is NaN there)."""
    parts = {}
    for n in built.program.nodes():
        if n.op in ("input", "kernel"):
            cut = tuple(slice(0, built.padded[size.name]) if isinstance(size, sympy.Symbol) and size.name in built.padded
                        else slice(None) for size in n.shape)
            if any(c.stop is not None for c in cut):
                parts[n.attr if n.op == "input" else n.attr[0].stores[n.attr[1]].name] = cut
    return parts


def _compared(built: Build, got: Mapping, inputs: Mapping, seed: int, cut: Mapping = {}) -> dict:
    """A check's common fields: every output of `got` against the reference on `inputs` (only the caller's rows of
    the reference, `cut`, where the build's dims were rounded up: `got` holds what the caller gets)."""
    ref = reference_outputs(built, inputs)
    tolerance = tolerance_of(built, inputs)
    outputs = {name: tolerance.judge(name, got[name], ref[name][cut.get(name, ())]) for name, _ in built.program.outputs}
    return {"passed": all(o["passed"] for o in outputs.values()), "rtol": tolerance.base, "seed": seed,
            "checked_against": CHECKED_AGAINST, "outputs": outputs}


def check_emulated(built: Build, seed: int, sanitizer: str | None = None, extra: str | int = "auto") -> EmulationCheck:
    """The generated code in the thread-faithful emulation, against the input program's reference."""
    inputs, plan = check_inputs(built, seed), plan_of(built)
    return emulation.check(built, plan, inputs, reference_outputs(built, inputs), seed=seed,
                           rtol=tolerance_of(built, inputs), checked_against=CHECKED_AGAINST, sanitizer=sanitizer,
                           extra=extra, callers=callers_part(built))


def count_banks(built: Build, options: BuildOptions, checked) -> dict | Skipped | None:
    """The shared-memory count `options.banks` asks for (`shared_wavefronts`: the first and last block along
    every grid axis, or the blocks `emulate_blocks` names), or why it was skipped; None when not asked for."""
    if not options.banks:
        return None
    if not isinstance(checked, EmulationCheck):
        return Skipped("the emulation did not run" + (f" ({checked.skipped})" if isinstance(checked, Skipped) else ""))
    if not checked.passed:
        return Skipped("the emulation's check failed")
    return shared_wavefronts(built, options.seed, 0 if options.emulate_blocks == "auto" else options.emulate_blocks)


def shared_wavefronts(built: Build, seed: int = 0, extra: str | int = 0) -> dict:
    """Per kernel, its shared-memory wavefronts in the emulation (`backend.banks.Wavefronts`), over the blocks
    `emulation.wavefronts` samples."""
    return emulation.wavefronts(built, plan_of(built), check_inputs(built, seed), seed=seed, extra=extra)


def emulate(built: Build, options: BuildOptions) -> EmulationCheck | Skipped | None:
    """The CPU emulation's check, or why it was skipped; None when not asked for."""
    if not options.emulate:
        return None
    if not emulator.compiler():
        return Skipped("no C++ compiler (g++ or clang++)")
    try:  # the float64 reference must fit in memory at these sizes
        for program in {id(p): p for p in (built.source, built.reference)}.values():
            check_sizes(program, built.binding)
    except PrismError as e:
        return Skipped(e.diagnostics[0].message)
    return check_emulated(built, options.seed, options.sanitize, options.emulate_blocks)


def check_gpu(built: Build, directory: Path, seed: int, repeat: int = 100) -> GpuCheck:
    """Run on the GPU the kernels written in `directory`, check every output, time the whole program (`repeat`
    timed runs, and as many of each kernel)."""
    plan = plan_of(built)
    with contextlib.closing(cuda_runtime.Launcher(plan, directory, cast=True)) as launcher:
        full = [check_inputs(built, seed + i) for i in range(3)]  # the first is the one checked
        cut = callers_part(built)
        sets = [{name: a[cut.get(name, ())] for name, a in s.items()} for s in full]  # as the caller passes them
        checked = _compared(built, launcher(**sets[0]), full[0], seed, cut)
        return GpuCheck(**checked, device=cuda_runtime.gpu_status()[1], timing_ms=launcher.time(sets, repeat=repeat),
                        kernels_ms=launcher.time_kernels(sets, repeat=repeat))


def measure(built: Build, seed: int, repeat: int = 100) -> GpuCheck:
    """The GPU's check and times of the program, its kernels written to a scratch directory."""
    with files.temp_scratch("measure") as directory:  # removes those of killed runs too
        write_sources(built.kernels, directory)
        return check_gpu(built, directory, seed, repeat)
