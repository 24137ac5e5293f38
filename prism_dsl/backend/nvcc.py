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
from .sass import available, disassemble, issued


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
    figures, nvcc's messages when it failed, and `issued` (`sass.Issued` as a dict, None where the SASS's
    loops do not match the source's) where cuobjdump is there, for the archs in `read` (all when None: reading
    one cubin's SASS takes most of a second, as long as compiling it, so the pipeline reads only the arch it
    prices for)."""
    read = tuple(archs if read is None else read) if available() else ()
    nvcc = nvcc_path()
    if nvcc is None:
        raise PrismError("nvcc is not on the PATH")
    write_sources(kernels, workdir)

    def one(job):
        k, arch = job
        cubin = f"{k.name}.{arch}.cubin"
        cmd = [nvcc, "-cubin", f"-arch={kernel_arch(k, arch)}", *NVCC_OPTIONS, "-Xptxas", "-v", "-o", cubin, k.file]
        done = files.run_in(cmd, workdir)
        result = {"ok": done.returncode == 0, **ptxas_figures(done.stderr)}
        if done.returncode != 0:
            result["stderr"] = done.stderr[-4000:]
        elif arch in read:
            found = issued(disassemble(workdir / cubin), k.source)
            result["issued"] = None if found is None else found.as_dict()
        return k.name, arch, result

    results: dict[str, dict[str, dict]] = {k.name: {} for k in kernels}
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        for name, arch, result in pool.map(one, [(k, a) for k in kernels for a in archs if kernel_arch(k, a)]):
            results[name][arch] = result
    return results


def kernel_arch(k: RenderedKernel, arch: str) -> str | None:
    """What nvcc compiles kernel k as for `arch`: a kernel on wgmma needs sm_90a (the arch-specific features of
    sm_90) and runs on no other; None where it cannot run."""
    if not k.wgmma:
        return arch
    return "sm_90a" if arch in WGMMA_ARCHS else None
