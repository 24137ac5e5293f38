"""How fast hand-written kernels are proved equal to their programs: one row per file of programs/fused/.

    python benchmarks/prove_kernels.py [--repeat N]

Each fused program is proved against its counterpart in programs/ with the default rules and limits
(the numeric guard included: both sides run on random inputs, the kernels in the block interpreter).
The table gives the answer, the median wall-clock time of the whole query (worker start included), the
e-graph time alone, the iterations and the e-graph size when it stopped. Every file must be proved: the script
exits 1 where one is not.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from importlib.metadata import version

from prism_dsl.lang.check import load
from prism_dsl.prove.prover import prove
from prism_dsl.prove.rules import load_library
from prism_dsl.prove.soundness import check_library

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs per file; the median is shown")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    unproved = 0
    library = load_library([], defaults=True)
    check_library(library)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"egglog {version('egglog')}")
    print("| kernel file | answer | seconds | e-graph seconds | iterations | rows |")
    print("|---|---|---:|---:|---:|---:|")
    for path in sorted((REPO / "programs" / "fused").glob("*.prism")):
        plain = load(REPO / "programs" / (path.name.split(".")[0] + ".prism")).program()
        fused = load(path).program()
        times, proof = [], None
        for _ in range(args.repeat):
            start = time.perf_counter()
            proof = prove(plain, fused, library)
            times.append(time.perf_counter() - start)
        answer = "proved" if proof.proved else f"not proved ({proof.reason})"
        unproved += not proof.proved
        print(f"| {path.name} | {answer} | {statistics.median(times):.2f} | {proof.seconds:.2f} | "
              f"{proof.iterations} | {proof.nodes:,} |")
    return 1 if unproved else 0


if __name__ == "__main__":
    sys.exit(main())
