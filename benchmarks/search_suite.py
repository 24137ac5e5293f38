"""The search on the suite's five workloads, LoRA and the decoder layers, CPU only: time to search and prove, proved programs found,
the chosen program, and the time to re-instantiate from the checkpoint at other dims.

    python benchmarks/search_suite.py            # prints a Markdown table (paste it into NOTES.md)
    python benchmarks/search_suite.py --only attention   # the programs whose name contains it, no decoding table
    python benchmarks/search_suite.py --jobs-compare     # the recompile tuned in one process and in two, twice each

`--jobs-compare` searches each program at its default dims, then recompiles it from the checkpoint at the other
dims with `jobs=1` and `jobs=2` in turn (twice each, the tuning database emptied before each, so every proved
program is tuned again), checks the two rankings are the same figure for figure, and prints the seconds.

Uses a fresh cache directory, so the first compile of each program searches.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = {
    "rmsnorm_linear": dict(n=16, d=1024),
    "rmsnorm_mlp": dict(n=16, d=1024),
    "swiglu": dict(n=16, d=4096),
    "attention": dict(b=4, h=8, q=1, kv=1024, dh=128),
    "qk_norm_attention": dict(b=2, h=8, q=128, kv=1024, dh=128),
    "lora": dict(n=8, d=4096, m=4096, r=32),
    "llama_qkv": dict(n=16, d=4096, e=6144),
    "gpt2_mlp": dict(n=16, d=768, f=3072),
    "llama_mlp": dict(n=16, d=4096, f=11008),
    "causal_attention": dict(b=1, h=8, q=512, kv=512, dh=128),
    "gqa_decode": dict(b=1, hk=8, g=4, kv=8192, dh=128),
}
DECODING = [dict(b=1, h=8, q=1, kv=8192, dh=128), dict(b=1, h=8, q=1, kv=32768, dh=128),
            dict(b=1, h=4, q=1, kv=65536, dh=128)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="programs whose name contains this (and no decoding table)")
    parser.add_argument("--jobs-compare", action="store_true", help="time the recompile in one process and in two")
    args = parser.parse_args()
    only = args.only
    if only and not any(only in name for name in PROGRAMS):
        parser.error(f"--only {only!r} names no program (they are: {', '.join(PROGRAMS)})")
    os.environ["PRISM_CACHE_DIR"] = tempfile.mkdtemp(prefix="prism-bench-")  # (a fresh one, left for a look after)
    if args.jobs_compare:
        return jobs_compare(only)
    from prism_dsl.lang.check import load
    from prism_dsl.kernels.hardware import load_hardware
    from prism_dsl.kernels.kernel import kernels_of
    from prism_dsl.kernels.lower import lower
    from prism_dsl.lang.printer import print_program
    from prism_dsl.semantics.reference import bind_dims
    from prism_dsl.prove.rules import load_library
    from prism_dsl.base.forked import cores
    from prism_dsl.pipeline.optimize import optimize

    library = load_library([], defaults=True)
    hardware = load_hardware("h100")
    print(f"machine: {platform.processor() or platform.machine()}, {cores()} cores, Python {platform.python_version()}")
    print()
    print("| program | search + proofs (s) | candidates | proofs | proved sGraphs | of which split | pruned (top reasons) | "
          "best: kernels | best uses | est. us (default dims) | best split us | as written us | recompile at other dims (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, other in PROGRAMS.items():
        if only and only not in name:
            continue
        program = load(ROOT / "programs" / f"{name}.prism").program()
        start = time.perf_counter()
        out = optimize(program, library, hardware, program.default_binding(), time_limit=600)
        first = time.perf_counter() - start
        s = out.search
        start = time.perf_counter()
        optimize(program, library, hardware, bind_dims(program, other))
        again = time.perf_counter() - start
        text = print_program(out.best.program)
        uses = ", ".join(a for a in ("acc_softmax_out", "acc_sum", "acc_rms_last", "acc_mean_last") if a in text) or "no loop"
        written = next(r for r in out.ranked if r.as_written)
        pruned = ", ".join(f"{k} {v}" for k, v in sorted(s["pruned"].items(), key=lambda kv: -kv[1])[:3])
        splits = [r for r in out.ranked if _split(r.program)]
        best_split = f"{splits[0].estimated_us:.1f}" if splits else "-"
        print(f"| {name} | {first:.1f} | {s['candidates']} | {s['proofs']} | {s['proved_programs']} | {len(splits)} | "
              f"{pruned} | {len(kernels_of(out.best.program))} | {uses} | {out.best.estimated_us:.1f} | {best_split} | "
              f"{written.estimated_us:.1f} | {again:.1f} |")
    if only:
        return
    # Decoding with long keys: where the split reduction stands in the model's ranking.
    print()
    print("| attention at | best (model) | est. us | best split est. us | as written us |")
    print("|---|---|---|---|---|")
    program = load(ROOT / "programs" / "attention.prism").program()
    for dims in DECODING:
        out = optimize(program, library, hardware, bind_dims(program, dims))
        splits = [r for r in out.ranked if _split(r.program)]
        written = next((r for r in out.ranked if r.as_written), None)
        custom, total = len(kernels_of(out.best.program)), len(kernels_of(lower(out.best.program)))
        kind = "split" if _split(out.best.program) else "as written" if out.best.as_written else \
            f"{custom} custom + {total - custom} pre-defined kernel(s)"
        print(f"| {', '.join(f'{k}={v}' for k, v in dims.items())} | {kind} | {out.best.estimated_us:.1f} | "
              f"{splits[0].estimated_us:.1f} | {f'{written.estimated_us:.1f}' if written else 'does not fit'} |")


def _split(program) -> bool:
    from prism_dsl.kernels.kernel import kernels_of

    return any(k.name.endswith("_combine") for k in kernels_of(program))



def jobs_compare(only: str | None) -> None:
    """The recompile at the other dims, tuned in one process and in two (`optimize.rankers`), twice each."""
    import shutil

    from prism_dsl.kernels.hardware import load_hardware
    from prism_dsl.lang.check import load
    from prism_dsl.lang.printer import print_program
    from prism_dsl.pipeline.optimize import optimize
    from prism_dsl.prove.rules import load_library
    from prism_dsl.semantics.reference import bind_dims

    library, hardware = load_library([], defaults=True), load_hardware("h100")
    tuning = Path(os.environ["PRISM_CACHE_DIR"]) / "tuning"
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print("\n| program | recompile, one process (s) | two processes (s) |\n|---|---|---|")
    for name, other in PROGRAMS.items():
        if only and only not in name:
            continue
        program = load(ROOT / "programs" / f"{name}.prism").program()
        optimize(program, library, hardware, program.default_binding(), time_limit=600)
        seconds, rankings = {1: [], 2: []}, set()
        for jobs in (1, 2, 1, 2):
            shutil.rmtree(tuning, ignore_errors=True)
            start = time.perf_counter()
            out = optimize(program, library, hardware, bind_dims(program, other), jobs=jobs)
            seconds[jobs].append(time.perf_counter() - start)
            rankings.add(tuple((print_program(r.program), tuple(sorted(r.params.items())), r.estimated_us, r.busy)
                               for r in out.ranked))
        assert len(rankings) == 1, f"{name}: the rankings differ"
        print(f"| {name} | {', '.join(f'{t:.1f}' for t in seconds[1])} | {', '.join(f'{t:.1f}' for t in seconds[2])} |")


if __name__ == "__main__":
    main()
