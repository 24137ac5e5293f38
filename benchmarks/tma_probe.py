"""Where a TMA copy goes wrong on a GPU. On an H200 (2026-11-28) every generated kernel that copies its loop tiles by
TMA (`prismc compile --tma`) stopped at its first copy (`cp.async.bulk.tensor`, UTMALDG in its SASS) with "an illegal
instruction was encountered", while the same programs compiled for cp.async ran and matched the reference. This runs
two TMA copies through two maps passed as the first parameters, as those kernels take them (benchmarks/tma_probe.cu,
on prism.cuh's mbarrier and tma_load), in five ways, each in a process of its own since a fault ends its CUDA
context:

    program   the reference way: nvcc builds a program that encodes the map on the host and launches with <<<>>>
    encode    no launch: the bytes `cuda_plan.encode_map` writes for an address beside the program's for the same one
    packed    the runtime's way until 2026-11-30: pycuda compiles the kernel, `encode_map` encodes the map, and
              `prepared_call` packs it with the other parameters one after another into one buffer
    runtime   the runtime's way now: the same, each parameter packed at the offset the cubin gives it
              (`cuda_plan.parameter_layout`: the first map 0x70 bytes in on sm_90, not at 0)
    params    the same kernel and map, launched through the driver with a pointer per parameter

    python benchmarks/tma_probe.py          # needs a CUDA GPU of sm_90, nvcc and pycuda

`program` failing says the kernel (prism.cuh's TMA path) is wrong; `program` passing and `encode` differing says the
runtime's encoding is; `packed` failing where `runtime` and `params` pass says the packed parameter buffer was, as
the kernels' cubins say (their maps are not where `packed` puts them).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prism_dsl.backend import cuda_plan  # noqa: E402
from prism_dsl.backend.cuda_runtime import NVCC_OPTIONS, device_target, gpu_status  # noqa: E402
from prism_dsl.backend.nvcc import nvcc_path  # noqa: E402

SOURCE = Path(__file__).with_name("tma_probe.cu")
TEMPLATES = ROOT / "templates"
ROWS, COLS, ROW0, COL0 = 256, 512, 64, 128  # as the program's own check
SMEM = 16384 + 64
ADDRESS = 0x7F0000000000  # any 16-byte aligned address: encoding reads no memory
VARIANTS = ("program", "encode", "packed", "runtime", "params")


def build_program(workdir: Path) -> Path:
    exe = workdir / "tma_probe"
    done = subprocess.run([nvcc_path(), "-gencode=arch=compute_90a,code=sm_90a", *NVCC_OPTIONS, "-I", str(TEMPLATES),
                           "-DTMA_PROBE_MAIN", str(SOURCE), "-o", str(exe)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"nvcc: {done.stderr.strip()[-800:]}")
    return exe


def tensor() -> np.ndarray:
    return (np.arange(ROWS * COLS) % 2039 / 2039.0 - 0.5).astype(np.float16).reshape(ROWS, COLS)


def launch(how: str) -> str:
    """One launch the pycuda way or with a pointer per parameter; what it found."""
    import pycuda.driver as drv

    drv.init()
    dev = drv.Device(0)
    context = dev.retain_primary_context()
    context.push()
    try:
        host = tensor()
        src, out = drv.to_device(host), drv.mem_alloc(128 * 64 * 2)
        drv.memset_d16(out, 0xFFFF, 128 * 64)  # NaN: every element must be written
        tmap = cuda_plan.encode_map(int(src), "f16", [ROWS, COLS], [64, 64])
        source, target = SOURCE.read_text(), device_target(dev.compute_capability())
        if how in ("packed", "runtime"):
            from pycuda.compiler import compile as to_cubin

            cubin = to_cubin(source, no_extern_c=True, options=NVCC_OPTIONS, include_dirs=[str(TEMPLATES)], **target)
            fn = drv.module_from_buffer(cubin).get_function("tma_probe")
            form, at = "", 0  # each parameter where the cubin has it: two maps, a pointer, two ints
            for (offset, size), code in zip(cuda_plan.parameter_layout(cubin, "tma_probe"), ("128s", "128s", "P", "i", "i")):
                form, at = form + (f"{offset - at}x" if offset > at else "") + code, offset + size
            fn.prepare(form if how == "runtime" else "%ds" % cuda_plan.MAP_BYTES * 2 + "Pii")
            fn.prepared_call((1, 1, 1), (128, 1, 1), tmap, tmap, int(out), np.int32(ROW0), np.int32(COL0),
                             shared_size=SMEM)
        else:
            from pycuda.compiler import compile as to_cubin

            cubin = to_cubin(source, no_extern_c=True, options=NVCC_OPTIONS, include_dirs=[str(TEMPLATES)], **target)
            lib = ctypes.CDLL("libcuda.so.1")
            module, fn = ctypes.c_void_p(), ctypes.c_void_p()
            for call, args in (("cuModuleLoadData", (ctypes.byref(module), cubin)),
                               ("cuModuleGetFunction", (ctypes.byref(fn), module, b"tma_probe"))):
                if status := getattr(lib, call)(*args):
                    return f"{call}: CUresult {status}"
            held = [ctypes.create_string_buffer(tmap, len(tmap)), ctypes.create_string_buffer(tmap, len(tmap)),
                    ctypes.c_uint64(int(out)), ctypes.c_int(ROW0), ctypes.c_int(COL0)]
            params = (ctypes.c_void_p * len(held))(*(ctypes.addressof(h) for h in held))
            if status := lib.cuLaunchKernel(fn, 1, 1, 1, 128, 1, 1, SMEM, None, params, None):
                return f"cuLaunchKernel: CUresult {status}"
        drv.Context.synchronize()
        got = drv.from_device(out, (128, 64), np.float16)
        wrong = int(np.sum(got != host[ROW0:ROW0 + 128, COL0:COL0 + 64]))
        return f"{wrong} of 8192 elements wrong"
    except Exception as err:  # pycuda's errors (a fault at the synchronize) derive from Exception alone
        return f"{type(err).__name__}: {err}"
    finally:
        context.pop()


def variant(name: str, exe: Path) -> str:
    if name == "program":
        done = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
        return (done.stdout + done.stderr).strip()
    if name == "encode":
        done = subprocess.run([str(exe), "encode", hex(ADDRESS), str(ROWS), str(COLS)], capture_output=True, text=True,
                              timeout=60)
        theirs = done.stdout.strip()
        import pycuda.driver as drv

        drv.init()  # the driver encodes a map only in a current context
        context = drv.Device(0).retain_primary_context()
        context.push()
        try:
            ours = cuda_plan.encode_map(ADDRESS, "f16", [ROWS, COLS], [64, 64]).hex()
        finally:
            context.pop()
        if ours == theirs:
            return "the same 128 bytes"
        return f"differ: program {theirs}, encode_map {ours}"
    return launch(name)


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--variant":  # a child: one variant, its finding on stdout
        print(variant(sys.argv[2], Path(sys.argv[3])))
        return 0
    if len(sys.argv) > 1:  # (it takes no arguments: --help and anything else get the docstring)
        print(__doc__.strip())
        return 0 if sys.argv[1] in ("-h", "--help") else 2
    usable, why = gpu_status()
    if not usable:
        print(f"tma_probe.py needs a usable CUDA GPU: {why}", file=sys.stderr)
        return 1
    workdir = Path(tempfile.mkdtemp(prefix="tma_probe"))
    try:
        exe = build_program(workdir)
        print("| variant | found |\n|---|---|")
        for name in VARIANTS:
            try:
                done = subprocess.run([sys.executable, __file__, "--variant", name, str(exe)], capture_output=True,
                                      text=True, timeout=120)
                found = (done.stdout.strip() or done.stderr.strip()[-400:]).replace("\n", " ")
            except subprocess.TimeoutExpired:
                found = "did not finish in 120 s"
            print(f"| {name} | {found} |", flush=True)
    except RuntimeError as err:
        print(f"tma_probe.py: {err}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
