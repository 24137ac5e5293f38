"""The compile check: the generated kernels compiled by nvcc for each architecture, ptxas's figures kept, and
where cuobjdump is there (`sass.available`), what one warp of each issues (`sass.issued`), for the cost model.

Where it sits: after codegen, beside the CPU emulation (`emulate`); the pipeline's compile-check pass
(`pipeline.build.compile_check`) turns a rejection into an error and the figures into the report.
"""

from __future__ import annotations

import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from ..base import files
from ..base.errors import PrismError
from .codegen import HEADER, RenderedKernel, header_source
from .cuda_runtime import NVCC_OPTIONS
from .launch import WGMMA_ARCHS
from .sass import available, disassemble, functions, issued


def write_sources(kernels: Sequence[RenderedKernel], directory: Path) -> None:
    """prism.cuh and each kernel's .cu into `directory`: each .cu compiles there on its own."""
    (directory / HEADER).write_text(header_source())
    for k in kernels:
        (directory / k.file).write_text(k.source)


_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "static_smem": re.compile(r"(\d+) bytes smem"),
    "stack_frame": re.compile(r"(\d+) bytes stack frame"),
}


def nvcc_path() -> str | None:
    return shutil.which("nvcc")


# ptxas's note that it made wgmma wait for each instruction (C7510-C7520: accumulators touched, or a batch left
# in flight across a branch some threads skip): the products then run one at a time.
_SERIALIZED = re.compile(r"wgmma\.mma_async instructions are serialized[^\n]*")


def ptxas_figures(text: str) -> dict:
    figures = {key: int(m.group(1)) if (m := pattern.search(text)) else 0 for key, pattern in _PTXAS.items()}
    if m := _SERIALIZED.search(text):
        figures["wgmma_serialized"] = m.group(0)
    return figures


def nvcc_check(kernels: Sequence[RenderedKernel], workdir: Path, archs: tuple[str, ...],
               read: tuple[str, ...] | None = None) -> dict[str, dict[str, dict]]:
    """Compile every kernel for every arch (`nvcc -cubin -Xptxas -v`); per kernel and arch: ok, the ptxas
    figures, nvcc's messages when it failed (its warnings on the kernel's file where it did not), and `issued`
    (`sass.Issued` as a dict, None where the SASS's loops do not match the source's) where cuobjdump is there,
    for the archs in `read` (all when None: reading a cubin's SASS takes most of a second, however small, so the
    pipeline reads only the arch it prices for).

    The kernels nvcc compiles alike for an arch (`kernel_arch`) go through one nvcc call and one cuobjdump
    call, as one translation unit that includes each kernel's .cu (`units`): each call's start costs as much
    as compiling a kernel. Where that unit fails, each of its kernels is compiled alone, so that each one's
    verdict and messages are its own."""
    read = tuple(archs if read is None else read) if available() else ()
    nvcc = nvcc_path()
    if nvcc is None:
        raise PrismError("nvcc is not on the PATH")
    write_sources(kernels, workdir)

    def compile_unit(job: tuple[int, str, tuple[RenderedKernel, ...], bool]) -> dict[str, dict]:
        unit, target, members, reading = job
        file = members[0].file if len(members) == 1 else f"unit{unit}.{target}.cu"
        if len(members) > 1:
            (workdir / file).write_text("".join(f'#include "{k.file}"\n' for k in members))
        cubin = f"unit{unit}.{target}.cubin"  # (each kernel alone, where a unit failed: in turn)
        cmd = [nvcc, "-cubin", f"-arch={target}", *NVCC_OPTIONS, "-Xptxas", "-v", "-o", cubin, file]
        done = files.run_in(cmd, workdir)
        if done.returncode == 0 and not (workdir / cubin).is_file():  # (an nvcc that is not one, or a wrapper)
            done.returncode, done.stderr = 1, f"{done.stderr}{nvcc} exited 0 but wrote no {cubin}\n"
        if done.returncode != 0:
            if len(members) > 1:  # each kernel alone: its own verdict and messages
                return {name: r for k in members for name, r in compile_unit((unit, target, (k,), reading)).items()}
            return {members[0].name: {"ok": False, **ptxas_figures(done.stderr), "stderr": done.stderr[-4000:]}}
        figures = ptxas_by_function(done.stderr)
        try:
            listings = functions(disassemble(workdir / cubin)) if reading else {}
        except RuntimeError:  # cuobjdump failed on it: the kernels are priced from their structure
            reading, listings = False, {}
        warned = [line for line in done.stderr.splitlines() if ": warning #" in line]  # nvcc's own, by file and line
        results = {}
        for k in members:
            result = {"ok": True, **figures.get(k.function, ptxas_figures("")),
                      "warnings": [line for line in warned if Path(line.split("(", 1)[0]).name == k.file]}
            if reading:
                found = issued(listings.get(k.function, ""), k.source)
                result["issued"] = None if found is None else found.as_dict()
            results[k.name] = result
        return results

    jobs = units(kernels, archs)
    results: dict[str, dict[str, dict]] = {k.name: {} for k in kernels}
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        done = pool.map(compile_unit, [(unit, target, members, any(a in read for a in for_archs))
                                       for unit, ((target, members), for_archs) in enumerate(jobs.items())])
        for for_archs, per_kernel in zip(jobs.values(), done):
            for name, result in per_kernel.items():
                results[name].update((arch, result) for arch in for_archs)
    return results


def units(kernels: Sequence[RenderedKernel], archs: tuple[str, ...]
          ) -> dict[tuple[str, tuple[RenderedKernel, ...]], tuple[str, ...]]:
    """The translation units to compile: per target nvcc compiles for (`kernel_arch`: sm_90a for the kernels on
    wgmma) and the kernels compiled as it, the archs the unit's figures stand for (one unit where two archs
    compile the same kernels as the same target)."""
    out: dict[tuple[str, tuple[RenderedKernel, ...]], tuple[str, ...]] = {}
    for arch in archs:
        by_target: dict[str, list[RenderedKernel]] = {}
        for k in kernels:
            if target := kernel_arch(k, arch):
                by_target.setdefault(target, []).append(k)
        for target, members in by_target.items():
            key = (target, tuple(members))
            out[key] = (*out.get(key, ()), arch)
    return out


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_IN_FUNCTION = re.compile(r"in the function '([^']+)'")


def ptxas_by_function(text: str) -> dict[str, dict]:
    """ptxas's figures per entry function of one compile (`-Xptxas -v`): each function's lines follow the line
    that names it. A note that wgmma was serialized goes to the function it names, else to the one whose lines
    hold it (the first, where it comes before them all)."""
    entries = list(_ENTRY.finditer(text))
    figures = {}
    for m, end in zip(entries, [e.start() for e in entries[1:]] + [len(text)]):
        own = ptxas_figures(text[m.end():end])
        figures[m.group(1)] = {key: v for key, v in own.items() if key != "wgmma_serialized"}
    for note in _SERIALIZED.finditer(text):
        named = _IN_FUNCTION.search(note.group(0))
        before = [m.group(1) for m in entries if m.start() < note.start()] or [m.group(1) for m in entries[:1]]
        if (name := named.group(1) if named and named.group(1) in figures else (before[-1] if before else None)):
            figures[name]["wgmma_serialized"] = note.group(0)
    return figures


def kernel_arch(k: RenderedKernel, arch: str) -> str | None:
    """What nvcc compiles kernel k as for `arch`: a kernel on wgmma needs sm_90a (the arch-specific features of
    sm_90) and runs on no other; None where it cannot run."""
    if not k.wgmma:
        return arch
    return "sm_90a" if arch in WGMMA_ARCHS else None
