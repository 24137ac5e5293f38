"""How fast the prover answers: one row per pair of programs, proved or (correctly) not proved.

    python benchmarks/prove_pairs.py [--timeout S] [--repeat N]

Each pair is written to a temporary .prism file, checked, and handed to `prove` with the default
rules and limits; the table gives the answer, the wall-clock time of the whole query (worker start
included) and the e-graph size when it stopped. Pairs marked "=" must be proved, "≠" must not be: a wrong
answer is marked, and the script then exits 1.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from prism_dsl.lang.check import load
from prism_dsl.prove.egglog_runner import Limits
from prism_dsl.prove.prover import prove
from prism_dsl.prove.rules import load_library
from prism_dsl.prove.soundness import check_library

HEADER = "dims n = 8, d = 64, m = 32, k = 16\n"
SIGNATURE = "X: f32[n, d], W: f32[d, m], V: f32[d, m], U: f32[m, k], A: f32[n, d], B: f32[n, d]"

# (name, expected equal?, expression A, expression B): both programs read every input of SIGNATURE.
PAIRS = [
    ("rmsnorm_matmul", True, "rms_norm(X) @ W", "(X @ W) / sqrt(mean(square(X), -1))"),
    ("matmul_assoc", True, "(X @ W) @ U", "X @ (W @ U)"),
    ("matmul_distrib", True, "X @ W + X @ V", "X @ (W + V)"),
    ("silu", True, "silu(X)", "X * sigmoid(X)"),
    ("softmax_unstable", True, "softmax(X)", "exp(X) / sum(exp(X), -1)"),
    ("gated_rmsnorm", True, "rms_norm(X) @ W * (rms_norm(X) @ V)",
     "((X @ W) * (X @ V)) / square(sqrt(mean(square(X), -1)))"),
    ("attention_late_div", True, "softmax(X @ W) @ U",
     "(exp(X @ W - max(X @ W, -1)) @ U) / sum(exp(X @ W - max(X @ W, -1)), -1)"),
    ("sum_linear", True, "sum(A + B, -1)", "sum(B, -1) + sum(A, -1)"),
    ("add_twice", True, "X @ W + X @ W", "(X * 2) @ W"),
    ("exp_add", False, "exp(A + B)", "exp(A) + exp(B)"),
    ("rmsnorm_after", False, "rms_norm(X) @ W", "rms_norm(X @ W)"),
    ("sub_order", False, "A - B", "B - A"),
    ("sum_product", False, "sum(A * B, -1)", "sum(A, -1) * sum(B, -1)"),
    ("binomial_4", False, "(A + B) * (A + B) * (A + B) * (A + B)", "A * A * A * A + B * B * B * B"),
]


def program(name: str, expr: str) -> str:
    return f"program {name}({SIGNATURE}) {{\n    Y = {expr}\n    return Y\n}}\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=Limits.seconds)
    ap.add_argument("--repeat", type=int, default=3, help="runs per pair; the median is shown")
    args = ap.parse_args()
    if args.repeat < 1 or not args.timeout > 0:
        ap.error("--repeat and --timeout must be at least 1 and above 0")
    wrong = 0
    library = load_library([], defaults=True)
    check_library(library)
    limits = Limits(seconds=args.timeout)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"limits: {limits}")
    print(f"{'pair':<18} {'expect':<6} {'answer':<10} {'median s':>9} {'iters':>5} {'rows':>9}  reason")
    with tempfile.TemporaryDirectory() as tmp:
        for name, equal, lhs, rhs in PAIRS:
            files = []
            for side, expr in (("a", lhs), ("b", rhs)):
                path = Path(tmp) / f"{name}_{side}.prism"
                path.write_text(HEADER + program(name, expr))
                files.append(load(path).program())
            times = []
            for _ in range(args.repeat):
                t = time.perf_counter()
                proof = prove(*files, library, limits)
                times.append(time.perf_counter() - t)
            answer = "proved" if proof.proved else "not proved"
            flag = "" if proof.proved == equal else "  <-- WRONG"
            wrong += bool(flag)
            print(f"{name:<18} {'=' if equal else '≠':<6} {answer:<10} {statistics.median(times):>9.2f} "
                  f"{proof.iterations:>5} {proof.nodes:>9,}  {proof.reason}{flag}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
