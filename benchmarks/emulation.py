"""How long the thread-faithful emulation takes: every suite program at the tests' small dims, plain and
under each sanitizer (compiling the emulation included), then some built past the sizes a caller gives (their
folds masked, their inputs read in place past the caller's end: `kernels.masking`), and a prefill-sized check
where blocks are sampled.

    python benchmarks/emulation.py              # the table (about 13 minutes on 2 cores)
    python benchmarks/emulation.py --prefill    # and the sampled check at n=4096, d=4096 (about 1 more)

Seconds are wall-clock for one `pipeline.emulation.check` (build + run + compare); "blocks" are those
emulated of all the grids' blocks; "threads" the threads per block (each one a fiber). Exits 1 where a row did
not pass.
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
from prism_dsl.kernels.masking import refusal  # noqa: E402
from prism_dsl.lang.check import load  # noqa: E402
from prism_dsl.pipeline import emulation  # noqa: E402
from prism_dsl.pipeline.build import (BuildOptions, build, callers_part, check_inputs, plan_of,  # noqa: E402
                                      reference_outputs, tolerance_of)
from test_codegen import FUSED, PROGRAMS, build_of  # noqa: E402


def timed(built, sanitizer, extra="all"):
    inputs = check_inputs(built, 0)
    ref = reference_outputs(built, inputs)
    started = time.perf_counter()
    result = emulation.check(built, plan_of(built), inputs, ref, seed=0, rtol=tolerance_of(built, inputs),
                             checked_against="input program", sanitizer=sanitizer, extra=extra,
                             callers=callers_part(built))
    return time.perf_counter() - started, result


# (program, the dims a caller gives, the dims built past them): rows of a projection, keys folded by online
# softmax (one query, split; a block of queries under a causal mask), each input read in place where it can be
RAGGED = [
    ("programs/rmsnorm_linear.prism", {"n": 70, "d": 64}, {"n": 128}),
    ("programs/fused/attention.decoding.prism", {"b": 1, "h": 2, "q": 1, "kv": 100, "dh": 64}, {"kv": 128}),
    ("programs/fused/attention.prism", {"b": 1, "h": 2, "q": 64, "kv": 100, "dh": 64}, {"kv": 128}),
    ("programs/fused/causal_attention.prism", {"b": 1, "h": 2, "q": 100, "kv": 100, "dh": 64}, {"q": 128, "kv": 128}),
]


def machine() -> str:
    cxx = emulate.compiler() or "none"
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0] if cxx != "none" else ""
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, {version}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", action="store_true", help="also the sampled check of rmsnorm_linear at n=4096, d=4096")
    args = ap.parse_args()
    print(f"machine: {machine()}\n")
    print("| program | kernels | threads | blocks | plain s | thread s | address s | passed |")
    print("|---|---|---|---|---|---|---|---|")
    failed = 0
    ragged = [(ROOT / name, given, built) for name, given, built in RAGGED]
    for path, given, past in [(p, None, None) for p in FUSED + PROGRAMS] + ragged:
        if given is None:
            built, _ = build_of(path, archs=())
        else:
            program = load(path).program()
            assert refusal(program, {k: given[k] for k in past}, {**given, **past}) is None, path
            options = BuildOptions(dims={**given, **past}, padded={k: given[k] for k in past}, archs=())
            built = build(program, load_hardware("h100"), options)
        times, ok = [], True
        for sanitizer in (None, *emulate.SANITIZERS):
            seconds, result = timed(built, sanitizer)
            times.append(seconds)
            ok = ok and result.passed
        failed += not ok
        blocks = sum(b["emulated"] for b in result.emulation["blocks"].values())
        at = "" if given is None else " " + ",".join(f"{k}={given[k]}->{v}" for k, v in past.items()) + (
            f" (in place: {', '.join(sorted(built.in_place))})" if built.in_place else "")
        print(f"| {path.parent.name}/{path.stem}{at} | {len(built.kernels)} | {result.emulation['threads_per_block']} | "
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
        failed += not result.passed
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
