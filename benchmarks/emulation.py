"""How long the thread-faithful emulation takes: every suite program at the tests' small dims, plain and
under each sanitizer (compiling the emulation included), and a prefill-sized check where blocks are sampled.

    python benchmarks/emulation.py              # the table (about 13 minutes on 2 cores)
    python benchmarks/emulation.py --prefill    # and the sampled check at n=4096, d=4096 (about 1 more)

Seconds are wall-clock for one `pipeline.emulation.check` (build + run + compare); "blocks" are those
emulated of all the grids' blocks; "threads" the threads per block (each one a fiber).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from prism_dsl.backend import emulate  # noqa: E402
from prism_dsl.kernels.hardware import load_hardware  # noqa: E402
from prism_dsl.lang.check import load  # noqa: E402
from prism_dsl.pipeline import emulation  # noqa: E402
from prism_dsl.pipeline.build import (BuildOptions, build, check_inputs, plan_of,  # noqa: E402
                                      reference_outputs, rtol_of)
from test_codegen import FUSED, PROGRAMS, build_of  # noqa: E402


def timed(built, sanitizer, extra="all"):
    inputs = check_inputs(built, 0)
    ref = reference_outputs(built, inputs)
    started = time.perf_counter()
    result = emulation.check(built, plan_of(built), inputs, ref, seed=0, rtol=rtol_of(built.reference),
                             checked_against="input program", sanitizer=sanitizer, extra=extra)
    return time.perf_counter() - started, result


def machine() -> str:
    cxx = emulate.compiler() or "none"
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0] if cxx != "none" else ""
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, {version}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", action="store_true", help="also the sampled check of rmsnorm_linear at n=4096, d=4096")
    args = ap.parse_args()
    print(f"machine: {machine()}\n")
    print("| program | kernels | threads | blocks | plain s | thread s | address s | passed |")
    print("|---|---|---|---|---|---|---|---|")
    for path in FUSED + PROGRAMS:
        built, _ = build_of(path, archs=())
        times, ok = [], True
        for sanitizer in (None, *emulate.SANITIZERS):
            seconds, result = timed(built, sanitizer)
            times.append(seconds)
            ok = ok and result.passed
        blocks = sum(b["emulated"] for b in result.emulation["blocks"].values())
        print(f"| {path.parent.name}/{path.stem} | {len(built.kernels)} | {result.emulation['threads_per_block']} | "
              f"{blocks} | {times[0]:.1f} | {times[1]:.1f} | {times[2]:.1f} | {'yes' if ok else 'NO'} |", flush=True)
    if args.prefill:
        program = load(ROOT / "programs/fused/rmsnorm_linear.prism").program()
        built = build(program, load_hardware("h100"), BuildOptions(dims={"n": 4096, "d": 4096}, archs=()))
        seconds, result = timed(built, None, "auto")
        e = result.emulation
        blocks = ", ".join(f"{k}: {v['emulated']} of {v['grid']}" for k, v in e["blocks"].items())
        print(f"\nprefill rmsnorm_linear (fused) n=4096, d=4096: {seconds:.1f} s, blocks {blocks}, "
              f"work {emulation.work(built):.3g} (whole grid below {emulation.WHOLE_GRID_WORK:.3g}), "
              f"passed {result.passed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
