"""Random sizes and options: every program compiled as a user would, and checked against the reference.

    python benchmarks/sweep.py                      # f16, small odd sizes, seed 1 (about 15 minutes on 2 cores)
    python benchmarks/sweep.py --bf16 --options     # the same programs in bf16, with random codegen options
    python benchmarks/sweep.py --large --seed 2     # sizes that take tensor-core tiles (q, n of 64 to 256)

Each program of `programs/` is compiled with `prismc compile` (searched, `--time-limit 30`) and each fused
form of `programs/fused/` as written (`--search none`), at sizes drawn per program (causal attention with no
more queries than keys), emulated plain and, for a second run of the searched programs, under a sanitizer
drawn at random; `--options` adds one of `--threads 64/256`, `--stages 2/4`, `--no-wgmma`, `--no-tensor-cores`,
`--no-pingpong`, `--tma`, `--no-split` to each run. A row passes when the exit code is 0 and the summary says
"verified: yes"; a failing row prints the summary's last lines. The exit code is 1 when any row failed.
"""

from __future__ import annotations

import argparse
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SMALL = {  # sizes off every tile: odd, prime-ish, one
    "attention": dict(b=[1, 2], h=[1, 3], q=[1, 5, 16, 33], kv=[40, 128, 200, 520], dh=[64, 80, 128]),
    "causal_attention": dict(b=[1], h=[1, 2], q=[1, 7, 32, 64], kv=[64, 130, 256], dh=[64, 128]),
    "gpt2_mlp": dict(n=[1, 3, 8, 16, 40], d=[64, 96, 200], f=[128, 264, 400]),
    "gqa": dict(g=[1, 2], s=[1, 9, 64], dh=[64, 128], kv=[100, 256, 600]),
    "gqa_decode": dict(b=[1], hk=[1, 2], g=[2, 3, 4], kv=[128, 300, 1000], dh=[64, 128]),
    "llama_mlp": dict(n=[1, 5, 8], d=[64, 128, 256], f=[128, 344]),
    "llama_qkv": dict(n=[1, 8, 24], d=[128, 256], e=[192, 384]),
    "lora": dict(n=[1, 16, 48], d=[64, 256], m=[128, 520], r=[8, 16]),
    "ntrans": dict(n=[1, 8, 33], d=[96, 1000, 4096]),
    "qk_norm_attention": dict(b=[1], h=[1, 2], q=[1, 16, 48], kv=[64, 300, 1024], dh=[64, 128]),
    "rmsnorm_linear": dict(n=[1, 8, 16, 72, 160], d=[64, 264, 512]),
    "rmsnorm_mlp": dict(n=[1, 8, 64], d=[64, 256]),
    "swiglu": dict(n=[1, 8, 16, 96], d=[64, 136, 256]),
}
LARGE = {  # tensor-core tiles
    "attention": dict(b=[1], h=[1, 2], q=[1, 64, 128], kv=[128, 192, 256], dh=[64, 128]),
    "causal_attention": dict(b=[1], h=[1, 2], q=[64, 128], kv=[128, 256], dh=[64, 128]),
    "gpt2_mlp": dict(n=[16, 64, 128], d=[128, 256], f=[256, 512]),
    "gqa": dict(g=[1, 2], s=[64, 128], dh=[64, 128], kv=[128, 256]),
    "gqa_decode": dict(b=[1], hk=[1, 2], g=[4, 8], kv=[256, 512, 2048], dh=[64, 128]),
    "llama_mlp": dict(n=[16, 64], d=[128, 256], f=[256, 344]),
    "llama_qkv": dict(n=[16, 64, 128], d=[128, 256], e=[384, 768]),
    "lora": dict(n=[64, 128], d=[128, 256], m=[256, 512], r=[16, 32]),
    "ntrans": dict(n=[64, 128], d=[1024, 4096]),
    "qk_norm_attention": dict(b=[1], h=[1, 2], q=[64, 128], kv=[128, 256], dh=[64, 128]),
    "rmsnorm_linear": dict(n=[64, 128, 256], d=[128, 256, 512]),
    "rmsnorm_mlp": dict(n=[64, 128], d=[128, 256]),
    "swiglu": dict(n=[64, 128, 256], d=[128, 256]),
}
OPTIONS = [[], ["--threads", "64"], ["--threads", "256"], ["--stages", "2"], ["--stages", "4"], ["--no-wgmma"],
           ["--no-tensor-cores"], ["--no-pingpong"], ["--tma"], ["--no-split"]]


def runs(rng: random.Random, table: dict, source: Path, options: bool, only: str):
    """(file, sizes, extra arguments) of every run: each searched program twice (plain, then a sanitizer),
    its fused form once as written; the programs whose name contains `only`. Every program's draws are made, those
    not run too, so that a run of the whole sweep is the same run under `--only` with the same seed."""
    for name, choices in table.items():
        dims = ",".join(f"{k}={rng.choice(v)}" for k, v in choices.items())
        for path, searched in ((source / f"{name}.prism", True), (source / "fused" / f"{name}.prism", False)):
            if not path.exists():
                continue
            for sanitizer in ([], ["--sanitize", rng.choice(["thread", "address"])]) if searched else ([],):
                drawn = rng.choice(OPTIONS) if options else []  # (a limit of the search: not where there is none)
                extra = [o for o in drawn if searched or o != "--no-split"] + sanitizer
                if only in name:  # the search's limit where there is a search (prismc refuses it elsewhere)
                    yield path, dims, extra + (["--time-limit", "30"] if searched else ["--search", "none"])


def in_bf16(directory: Path) -> Path:
    """Every program of `programs/` (and its fused forms) with its f16 tensors stored as bf16."""
    for path in (ROOT / "programs").rglob("*.prism"):
        target = directory / path.relative_to(ROOT / "programs")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(re.sub(r"\bf16\[", "bf16[", path.read_text()))
    return directory


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bf16", action="store_true", help="the programs with their f16 tensors in bf16")
    ap.add_argument("--options", action="store_true", help="a random code generator option on each run")
    ap.add_argument("--large", action="store_true", help="sizes that take tensor-core tiles")
    ap.add_argument("--only", default="", help="programs whose name contains this")
    args = ap.parse_args()
    if not any(args.only in name for name in (LARGE if args.large else SMALL)):
        ap.error(f"--only {args.only!r} names no program (they are: {', '.join(LARGE if args.large else SMALL)})")
    rng = random.Random(args.seed)
    print(f"machine: {platform.machine()}, Python {platform.python_version()}; seed {args.seed}"
          f"{', bf16' if args.bf16 else ''}{', options' if args.options else ''}\n")
    print("| program | sizes | arguments | verdict | max rel err | seconds |")
    print("|---|---|---|---|---|---|")
    failed = 0
    with tempfile.TemporaryDirectory() as scratch:
        source = in_bf16(Path(scratch) / "programs") if args.bf16 else ROOT / "programs"
        for path, dims, extra in runs(rng, LARGE if args.large else SMALL, source, args.options, args.only):
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "prism_dsl", "compile", str(path), "--dims", dims,
                                   "-o", str(Path(scratch) / "out"), *extra],
                                  capture_output=True, text=True, cwd=ROOT)
            seconds = time.perf_counter() - started
            ok = done.returncode == 0 and "verified: yes" in done.stdout
            errors = ", ".join(re.findall(r"max rel err ([0-9.e+-]+|inf)", done.stdout)) or "-"
            name = str(path.relative_to(source)).removesuffix(".prism")
            print(f"| {name} | {dims} | {' '.join(extra) or '-'} | {'passed' if ok else 'FAILED'} | {errors} | "
                  f"{seconds:.1f} |", flush=True)
            if not ok:
                failed += 1
                for line in (done.stdout + done.stderr).strip().splitlines()[-4:]:
                    print(f"    {line}")
    print(f"\n{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
