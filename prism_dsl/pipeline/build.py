"""`prismc compile --search none`: a program as written, instantiated, rendered, checked and written out.

The driver is a short list of named passes:

    lower        every op outside custom kernels becomes a pre-defined kernel (`lower`)
    parameters   kernel parameters from the command line, the rest chosen by the cost model (`cost.tune`)
    instantiate  every kernel concrete; constraint violations are errors (`kernel.instantiate_program`)
    render       CUDA C per kernel through the templates (`codegen`)
    nvcc         each kernel compiled for every requested architecture; ptxas figures kept (`nvcc_check`)
    emulate      the generated code run as C++ on the CPU and compared with the float64 reference (`emulate`)
    gpu          with `--target cuda`: run on the GPU, checked against the reference, timed (`cuda_runtime`)
    write        .cu files, prism.cuh, launcher.py and prism_runtime.py, the program as .prism,
                 report.json; built in a scratch directory that replaces the output whole when complete

A result that was not checked is never called verified: `report["verified"]` is true only when every
output agreed with the reference (in the emulation, or on the GPU with `--target cuda`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import stat
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np

from ..backend import cost

from ..backend import cuda_runtime

from ..backend import emulate

from ..base import files
from ..backend.codegen import HEADER, CodegenConfig, RenderedKernel, header_source, render_kernel
from ..base.errors import PrismError
from ..ir.nodes import Program
from ..kernels.kernel import Concrete, Target, free_symbols, kernels_of, resolve_params
from ..kernels.lower import lower
from ..lang.printer import print_program
from ..prove.prover import check_signatures, pair_outputs
from ..semantics.reference import bind_dims, check_sizes, concrete_shape, evaluate, random_inputs

ARCHS = ("sm_90", "sm_80")
RTOL = 1e-2  # f16 storage: about three decimal digits


@dataclass(frozen=True)
class BuildOptions:
    dims: Mapping[str, int] = field(default_factory=dict)
    grid: Mapping[str, int] = field(default_factory=dict)
    loop: Mapping[str, int] = field(default_factory=dict)
    params: Mapping[str, int] = field(default_factory=dict)  # by symbol name, as the search's tuning chose them
    mode: str = "cost"  # "cost": rank by the model; "cuda": run and time on the GPU
    archs: tuple[str, ...] = ARCHS
    emulate: bool = True
    seed: int = 0
    codegen: CodegenConfig = CodegenConfig()


@dataclass
class Build:
    program: Program  # as compiled: pre-defined kernels lowered
    source: Program  # as given
    binding: dict
    params: dict[str, int]
    kernels: list[RenderedKernel]
    report: dict  # what report.json holds, filled in as the checks run
    concrete: dict[str, Concrete]
    target: str  # the target file's name, for the block interpreter
    reference: Program | None = None  # the input program the outputs are checked against (None: `source`)


def plan_of(build: Build) -> dict:
    """The runtime plan (`cuda_runtime`): tensors, kernels, launch shapes."""
    tensors = {n.attr: {"shape": list(concrete_shape(n.shape, build.binding)), "dtype": n.dtype.value}
               for n in build.program.inputs}
    for k in kernels_of(build.program):
        c = build.concrete[k.name]
        for i, s in enumerate(k.stores):
            tensors[s.name] = {"shape": list(c.output_shape(i)), "dtype": (s.value.dtype.value if s.value.dtype else "f32")}
    return {
        "program": build.program.name,
        "inputs": [n.attr for n in build.program.inputs],
        "outputs": [name for name, _ in build.program.outputs],
        "tensors": tensors,
        "kernels": [{"name": r.name, "file": r.file, "function": r.function, "grid": list(r.grid),
                     "block": list(r.block), "smem": r.smem, "args": list(r.args), "zero": list(r.zero)}
                    for r in build.kernels],
    }


def compile_program(source: Program, target: Target, options: BuildOptions, *,
                    reference: Program | None = None) -> Build:
    """`source` built at the options' dims. `reference` is the program the user gave, when `source` is
    one the search proved equal to it: the numeric checks compare with `reference`, never with `source`,
    so that they do not depend on the proof."""
    started = time.perf_counter()
    if reference is not None:
        check_signatures(reference, source)
        pair_outputs(source, reference)
    program = lower(source)
    binding = bind_dims(program, dict(options.dims))
    given = {**resolve_params(program, options.grid, options.loop), **options.params}
    params, concrete, estimates = cost.parameters(program, binding, given, target, options.codegen.threads)
    symbols = {s.name: s for s in free_symbols(program)}
    full = {**binding, **{symbols[n]: v for n, v in params.items()}}
    kernels = [render_kernel(concrete[k.name], program, options.codegen) for k in kernels_of(program)]
    report = {
        "program": program.name,
        "target": {"name": target.name, "arch": target.arch, "mode": options.mode},
        "dims": {d.name: int(binding[d.symbol]) for d in program.dims},
        "parameters": params,
        "kernels": [],
        "estimated_us": round(sum(e.time_us for e in estimates), 3),
        "roofline": cost.roofline(source, binding, target),
        "measured_us": None,
        "checks": {},
        "verified": False,
    }
    for r, e in zip(kernels, estimates):
        report["kernels"].append({"name": r.name, "function": r.function, "file": r.file, "grid": list(r.grid),
                                  "block": list(r.block), "smem_bytes": r.smem, "tensor_cores": r.tensor_cores,
                                  "estimate": e.as_dict(), "nvcc": {}})
    report["compile_seconds"] = round(time.perf_counter() - started, 3)
    return Build(program, source, full, params, kernels, report, concrete, target.name.lower(), reference)


# -- nvcc -------------------------------------------------------------------------------------------------

_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "static_smem": re.compile(r"(\d+) bytes smem"),
    "stack_frame": re.compile(r"(\d+) bytes stack frame"),
}


def nvcc_path() -> str | None:
    return shutil.which("nvcc")


def ptxas_figures(text: str) -> dict:
    out = {}
    for key, pattern in _PTXAS.items():
        m = pattern.search(text)
        out[key] = int(m.group(1)) if m else 0
    return out


def nvcc_check(kernels: list[RenderedKernel], workdir: Path, archs: tuple[str, ...]) -> dict[str, dict[str, dict]]:
    """Compile every kernel for every arch (`nvcc -cubin -Xptxas -v`); per kernel and arch: ok, the ptxas
    figures, and nvcc's messages when it failed."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise PrismError("nvcc is not on the PATH")
    (workdir / HEADER).write_text(header_source())
    for k in kernels:
        (workdir / k.file).write_text(k.source)

    def one(job):
        k, arch = job
        cmd = [nvcc, "-cubin", f"-arch={arch}", *cuda_runtime.NVCC_OPTIONS, "-Xptxas", "-v",
               "-o", os.devnull, k.file]
        done = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True)
        result = {"ok": done.returncode == 0, **ptxas_figures(done.stderr)}
        if done.returncode != 0:
            result["stderr"] = done.stderr[-4000:]
        return k.name, arch, result

    results: dict[str, dict[str, dict]] = {k.name: {} for k in kernels}
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        for name, arch, result in pool.map(one, [(k, a) for k in kernels for a in archs]):
            results[name][arch] = result
    return results


# -- checks -----------------------------------------------------------------------------------------------


CHECKED_AGAINST = "input program"  # what the numeric checks compare with, as report.json says


def reference_outputs(build: Build, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The float64 oracle: the input program (`build.reference`, else the program as given; custom kernels
    through the block interpreter, with the parameters the rendered code uses when it is the program built),
    its outputs under the built program's names (paired by name, else by position: `prove.pair_outputs`)."""
    if build.reference is None or build.reference is build.source:
        own = {s.name for s in free_symbols(build.source)}
        return evaluate(build.source, inputs, {k: v for k, v in build.params.items() if k in own}, build.target)
    values = evaluate(build.reference, inputs, {}, build.target)
    return {mine: values[theirs] for mine, theirs in pair_outputs(build.source, build.reference)}


def check_emulated(build: Build, seed: int) -> dict:
    dims = {d.name: int(build.binding[d.symbol]) for d in build.source.dims}
    inputs = random_inputs(build.source, bind_dims(build.source, dims), seed)
    plan = plan_of(build)
    from ..ir.nodes import DTYPES

    dtypes = {n: DTYPES[t["dtype"]] for n, t in plan["tensors"].items()}
    shapes = {n: tuple(t["shape"]) for n, t in plan["tensors"].items()}
    got = emulate.run(build.kernels, dtypes, shapes, inputs)
    ref = reference_outputs(build, inputs)
    outputs = {name: cuda_runtime.check(got[name], ref[name], RTOL) for name in plan["outputs"]}
    return {"passed": all(o["passed"] for o in outputs.values()), "rtol": RTOL, "seed": seed,
            "checked_against": CHECKED_AGAINST, "outputs": {n: _plain(o) for n, o in outputs.items()}}


def check_gpu(build: Build, directory: Path, seed: int) -> dict:
    """Run on the GPU through the written launcher files, check every output, time the whole program."""
    plan = plan_of(build)
    dims = {d.name: int(build.binding[d.symbol]) for d in build.source.dims}
    binding = bind_dims(build.source, dims)
    inputs = random_inputs(build.source, binding, seed)
    launcher = cuda_runtime.Launcher(plan, directory, cast=True)
    try:
        got = launcher(**inputs)
        ref = reference_outputs(build, inputs)
        outputs = {name: cuda_runtime.check(got[name], ref[name], RTOL) for name in plan["outputs"]}
        sets = [random_inputs(build.source, binding, seed + i) for i in range(3)]
        timing = launcher.time(sets)
        per_kernel = launcher.time_kernels(sets)
        return {"passed": all(o["passed"] for o in outputs.values()), "rtol": RTOL, "device": cuda_runtime.gpu_status()[1],
                "checked_against": CHECKED_AGAINST, "outputs": {n: _plain(o) for n, o in outputs.items()},
                "timing_ms": timing, "kernels_ms": per_kernel}
    finally:
        launcher.close()


def _plain(d: dict) -> dict:
    return {k: (float(v) if isinstance(v, (np.floating, float)) else [int(i) for i in v] if isinstance(v, tuple)
                else int(v) if isinstance(v, (np.integer,)) else v) for k, v in d.items()}


# -- writing ----------------------------------------------------------------------------------------------


_LEGACY = re.compile(r"[^/]+\.cu|prism\.cuh|launcher\.py|prism_runtime\.py|[^/]+\.prism|report\.json")
_SCRATCH = files.scratch_pattern(r"\.(?P<name>.+)\.")  # `.DIR.prismc-<pid>-XXXXXXXX` beside DIR


def check_output(out: Path) -> None:
    """Refuse an output directory prismc may not write, before any work (and again before the swap).

    `-o DIR` is replaced whole, so DIR must be new, empty, or one that prismc wrote: its report.json is
    prismc's (the keys prismc writes), and DIR holds only the files that report lists under "files" (a
    report without that list, from an older prismc: the names prismc gives its files), and Python's
    `__pycache__`. Anything else (a file of the user's, a directory where prismc writes a file) makes
    prismc refuse and touch nothing.
    """
    shown = str(out)
    if os.path.lexists(out) and not os.path.isdir(out):
        raise PrismError(f"cannot write to '{shown}': it exists and is not a directory "
                         "(-o names the directory the results go into)")
    probe = out.parent
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    if not os.path.isdir(probe):
        raise PrismError(f"cannot write to '{shown}': '{probe}' is not a directory")
    here, target = Path.cwd().resolve(), out.resolve()
    if target == here or target in here.parents:
        raise PrismError(f"cannot write to '{shown}': it holds the current directory, and prismc replaces its "
                         "output directory whole; give a directory inside it, e.g. -o out")
    if os.path.isdir(out):
        foreign = _foreign(target)
        if foreign:
            listed = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise PrismError(f"cannot write to '{shown}': it holds what prismc did not write ({listed}); prismc "
                             "replaces its output directory whole, so give a new or empty directory, or one "
                             "an earlier compile wrote")


def _foreign(directory: Path) -> list[str]:
    """What in an existing directory prismc did not write (sorted; directories end with '/')."""
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError as e:
        raise PrismError(f"cannot write to '{directory}': {files.describe(e)}") from None
    if not entries:
        return []
    mine = _listed(directory)
    return [e.name + ("/" if e.is_dir(follow_symlinks=False) else "") for e in entries
            if not (mine is not None and _regular(e) and e.name in mine)
            and not (e.name == "__pycache__" and _bytecode_only(e))]


def _listed(directory: Path) -> set[str] | _AnyLegacy | None:
    """The names prismc wrote in `directory`, as its report.json lists them (the names an older prismc gave
    its files, when it lists none); None when there is no report.json of prismc's form."""
    try:
        report = json.loads(files.read_regular(directory / "report.json", files.MAX_TEXT_BYTES))
    except (OSError, ValueError, RecursionError):
        return None
    if not (isinstance(report, dict) and {"program", "target", "kernels", "checks", "verified"} <= report.keys()):
        return None
    listed = report.get("files")
    if isinstance(listed, list) and all(isinstance(n, str) for n in listed):
        return set(listed) | {"report.json"}
    return _AnyLegacy()


class _AnyLegacy:
    """The names an output of an older prismc (whose report.json lists no files) could hold."""

    def __contains__(self, name: str) -> bool:
        return _LEGACY.fullmatch(name) is not None


def _regular(entry: os.DirEntry) -> bool:
    return entry.is_file(follow_symlinks=False)


def _bytecode_only(entry: os.DirEntry) -> bool:
    """A `__pycache__` that Python made when launcher.py was imported: only .pyc files."""
    if not entry.is_dir(follow_symlinks=False):
        return False
    try:
        return all(_regular(e) and e.name.endswith(".pyc") for e in os.scandir(entry.path))
    except OSError:
        return False


def _sweep(parent: Path) -> None:
    """Scratch directories that killed compiles left beside their outputs: removed, except a directory set
    aside during a swap whose output is missing (killed between the two renames), which is put back."""
    for path in files.abandoned(parent, _SCRATCH):
        m = _SCRATCH.fullmatch(path.name)
        home = parent / m.group("name")
        if m.group("old") and not os.path.lexists(home):
            try:
                os.rename(path, home)
                continue
            except OSError:
                pass
        shutil.rmtree(path, ignore_errors=True)


def _swap_in(scratch: Path, out: Path) -> None:
    """`scratch` becomes `out`: renamed into place, an existing `out` set aside first and removed after."""
    if not os.path.lexists(out):
        os.rename(scratch, out)
        return
    aside = out.parent / (files.scratch_prefix(f".{out.name}.") + "old-" + secrets.token_hex(4))
    os.rename(out, aside)
    try:
        os.rename(scratch, out)
    except OSError:
        os.rename(aside, out)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def write(build: Build, out: Path, options: BuildOptions, extra: Mapping[str, str] | None = None) -> dict:
    """Everything into `out`, checked on the way, and `out` replaced whole: the files are built in a scratch
    directory beside it (`.DIR.prismc-<pid>-XXXXXXXX`), which takes `out`'s place only when everything
    succeeded; an earlier `out` (only one that `check_output` allows) is then removed, so no stale file of
    an earlier compile remains. `extra` files (name -> text) go beside the rest (the search's best.prism)."""
    shown = str(out)
    check_output(out)
    out = out.resolve()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _sweep(out.parent)
        scratch = Path(tempfile.mkdtemp(prefix=files.scratch_prefix(f".{out.name}."), dir=out.parent))
    except OSError as e:
        raise PrismError(f"cannot write to '{shown}': {files.describe(e)}") from None
    try:
        report = _fill(build, scratch, options, extra or {})
        mode = out.stat().st_mode if os.path.isdir(out) else 0o777 & ~files.umask()
        os.chmod(scratch, stat.S_IMODE(mode))  # mkdtemp's directory is private; keep the usual mode
        check_output(Path(shown))  # the user may have put something there while the checks ran
        _swap_in(scratch, out)
        return report
    except OSError as e:
        raise PrismError(f"cannot write to '{shown}': {files.describe(e)}") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _fill(build: Build, scratch: Path, options: BuildOptions, extra: Mapping[str, str]) -> dict:
    """Write every output file into `scratch` and run the checks; the report, as written there."""
    report = build.report
    report["files"] = list(dict.fromkeys([HEADER, *(k.file for k in build.kernels), "prism_runtime.py",
                                          "launcher.py", f"{build.program.name}.prism", *extra, "report.json"]))
    (scratch / HEADER).write_text(header_source())
    for k in build.kernels:
        (scratch / k.file).write_text(k.source)
    plan = plan_of(build)
    shutil.copyfile(Path(cuda_runtime.__file__), scratch / "prism_runtime.py")
    from ..backend.codegen import _env

    launcher = _env().get_template("launcher.py.j2").render(plan=plan, program=build.program.name,
                                                            plan_literal=cuda_runtime.format_plan(plan))
    (scratch / "launcher.py").write_text(launcher)
    (scratch / f"{build.program.name}.prism").write_text(print_program(build.program))
    for name, text in extra.items():
        (scratch / name).write_text(text)
    if options.archs and nvcc_path():
        nvcc_dir = Path(tempfile.mkdtemp(prefix="nvcc-", dir=scratch))
        figures = nvcc_check(build.kernels, nvcc_dir, options.archs)
        shutil.rmtree(nvcc_dir, ignore_errors=True)
        for entry in report["kernels"]:
            entry["nvcc"] = figures[entry["name"]]
        bad = [f"{k} ({a})" for k, per in figures.items() for a, r in per.items() if not r["ok"]]
        report["checks"]["nvcc"] = {"archs": list(options.archs), "passed": not bad}
        if bad:
            first = next(r["stderr"] for per in figures.values() for r in per.values() if not r["ok"])
            raise PrismError(f"nvcc rejected the generated code for {', '.join(bad)}:\n{first}")
    elif options.archs:
        report["checks"]["nvcc"] = {"skipped": "nvcc is not on the PATH"}
    if options.emulate and emulate.compiler():
        too_large = _too_large(build)
        report["checks"]["emulation"] = {"skipped": too_large} if too_large else check_emulated(build, options.seed)
    elif options.emulate:
        report["checks"]["emulation"] = {"skipped": "no C++ compiler (g++ or clang++)"}
    if options.mode == "cuda":
        gpu = check_gpu(build, scratch, options.seed)
        report["checks"]["gpu"] = gpu
        report["measured_us"] = round(gpu["timing_ms"]["median_ms"] * 1000, 3)
        for entry in report["kernels"]:
            entry["measured_us"] = round(gpu["kernels_ms"][entry["name"]]["median_ms"] * 1000, 3)
    numeric = [c for key, c in report["checks"].items() if key in ("emulation", "gpu") and "passed" in c]
    # Verified: proved equal to the input (when a search chose it) and checked numerically.
    report["verified"] = bool(numeric) and all(c["passed"] for c in numeric) and report.get("proved", True)
    (scratch / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _too_large(build: Build) -> str | None:
    """Why the float64 reference cannot run at these sizes (then the CPU run is skipped), or None."""
    programs = [p for p in (build.source, build.reference) if p is not None]
    try:
        for program in programs:
            check_sizes(program, build.binding)
    except PrismError as e:
        return e.diagnostics[0].message
    return None


def summary(report: dict, out: Path) -> str:
    lines = [f"{report['program']} -> {out}/ (target {report['target']['name']}, "
             f"dims {', '.join(f'{k}={v}' for k, v in report['dims'].items()) or 'none'})"]
    for k in report["kernels"]:
        nv = k["nvcc"].get(report["target"]["arch"]) or next(iter(k["nvcc"].values()), {})
        res = f", {nv['registers']} registers, {nv['spill_stores']} B spilled" if nv else ""
        measured = f", measured {k['measured_us']} us" if k.get("measured_us") is not None else ""
        lines.append(f"  kernel {k['name']}: grid {'x'.join(map(str, k['grid']))}, {k['block'][0]} threads, "
                     f"{k['smem_bytes']} B shared{res}{', tensor cores' if k['tensor_cores'] else ''}; "
                     f"estimated {k['estimate']['time_us']} us ({k['estimate']['bound']}){measured}")
    roof = report["roofline"]
    lines.append(f"  estimated {report['estimated_us']} us; roofline floor {roof['floor_us']} us ({roof['bound']})"
                 + (f"; measured {report['measured_us']} us" if report["measured_us"] is not None else ""))
    for name, c in report["checks"].items():
        if "skipped" in c:
            lines.append(f"  {name}: skipped ({c['skipped']})")
        elif name == "nvcc":
            lines.append(f"  nvcc: every kernel compiles for {', '.join(c['archs'])}")
        else:
            errs = ", ".join(f"{o}: max rel err {v['max_rel_err']:.2e}" for o, v in c["outputs"].items())
            lines.append(f"  {name}: {'passed' if c['passed'] else 'FAILED'} against the float64 reference of the {c.get('checked_against', 'program')} ({errs})")
    if "search" in report:
        sr = report["search"]
        how = "from the checkpoint" if sr["from_checkpoint"] else (
            "complete" if sr["complete"] else f"cut short ({sr['stopped']}): best so far")
        lines.append(f"  search: {sr['verified_sgraphs']} proved programs ({how}), {sr['jobs']} prover processes, "
                     f"{report['search_seconds']} s; best: {report['best']} with {report['kernels_in_best']} kernel(s)"
                     + (" (the program as written: nothing faster was found)" if report["best_is_input"] else ""))
        if sr.get("as_written_fits") is False:
            lines.append("  the program as written cannot run at these dims (its pre-defined kernels do not fit)")
        if "measured" in sr:
            m = sr["measured"]
            lines.append(f"  tuning on {m['device']}: {m['timed']} programs timed, {m['from_database']} from the "
                         "tuning database" + "".join(f"\n    not used: {f}" for f in m["failed"]))
    lines.append("  verified: " + ("yes" if report["verified"] else "NO: the outputs were not checked or did not agree"))
    return "\n".join(lines)
