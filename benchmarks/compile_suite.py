"""Compiles every program of the suite (as written, and the hand-fused kernels: `prismc compile --search none
--no-cache`) at its default dims, without a GPU, and prints a table: kernels, the cost model's estimate against the roofline floor, nvcc's figures,
the CPU emulation's error against the float64 reference, and the time the compile took.

    python benchmarks/compile_suite.py [--only NAME]

Exits 1 where a program does not compile or is not verified.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="programs whose file name contains this")
    args = ap.parse_args()
    files = [f for f in sorted((ROOT / "programs").glob("*.prism")) + sorted((ROOT / "programs" / "fused").glob("*.prism"))
             if args.only in f.name]
    if not files:
        ap.error(f"--only {args.only!r} names no program of programs/")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    failed = 0
    print("| program | kernels | estimated (us) | floor (us) | max registers | spills | emulation max rel err | verified | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for f in files:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "prism_dsl", "compile", str(f), "-o", tmp + "/o", "--json",
                                   "--search", "none", "--no-cache"],  # as written, whatever the cache holds
                                  capture_output=True, text=True)
            secs = time.perf_counter() - t0
            name = f.relative_to(ROOT / "programs")
            if not done.stdout.strip().startswith("{"):
                failed += 1
                print(f"| {name} | error: {' / '.join(done.stderr.strip().splitlines()) or done.returncode} |")
                continue
            r = json.loads(done.stdout)
            failed += r["verified"] is not True
            regs = max((a["registers"] for k in r["kernels"] for a in k["nvcc"].values()), default=0)
            spills = sum(a["spill_stores"] for k in r["kernels"] for a in k["nvcc"].values())
            emu = r["checked"]["emulation"] or {}
            err = max((o["max_rel_err"] for o in emu.get("outputs", {}).values()), default=float("nan"))
            print(f"| {name} | {len(r['kernels'])} | {r['estimated_us']:.1f} | {r['roofline']['floor_us']:.1f} | {regs} "
                  f"| {spills} | {err:.1e} | {'yes' if r['verified'] else 'no'} | {secs:.1f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
