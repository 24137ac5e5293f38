"""Times the fused kernels of programs/fused/ on a GPU at the suite's shapes, against PyTorch eager and
torch.compile, and writes the table to benchmarks/RESULTS.md.

    python benchmarks/gpu_fused.py            # needs a CUDA GPU, pycuda and torch

Each row comes from `prismc bench` (every implementation checked against the float64 reference first).
"""

import json
import sys
import tempfile
from pathlib import Path

from prism_dsl.cli.main import main
from prism_dsl.backend.cuda_runtime import gpu_status

ROOT = Path(__file__).resolve().parent.parent
NK = ["n=8,d=1024", "n=8,d=2048", "n=8,d=4096", "n=16,d=1024", "n=16,d=4096"]
ATT = ["b=2,h=8,q=1,kv=1024,dh=128", "b=2,h=8,q=128,kv=1024,dh=128", "b=2,h=32,q=1,kv=1024,dh=128",
       "b=4,h=8,q=1,kv=1024,dh=128"]
CASES = [("rmsnorm_linear", "rmsnorm_linear", NK), ("rmsnorm_mlp", "rmsnorm_mlp", NK), ("swiglu", "swiglu", NK),
         ("attention", "attention", ATT), ("attention.decoding", "attention", ATT)]


def run() -> int:
    ok, device = gpu_status()
    if not ok:
        print(f"no GPU: {device}", file=sys.stderr)
        return 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fused, baseline, shapes in CASES:
            for dims in shapes:
                out = Path(tmp) / "t.json"
                code = main(["bench", str(ROOT / f"programs/fused/{fused}.prism"), "--baseline",
                             str(ROOT / f"programs/{baseline}.prism"), "--dims", dims, "--json", str(out)])
                table = json.loads(out.read_text()) if out.exists() else None
                rows.append((fused, dims, code, table))
                out.unlink(missing_ok=True)
    lines = [f"# GPU results ({device})", "", "Written by `python benchmarks/gpu_fused.py`; times are CUDA-event medians.", "",
             "| program | dims | ours (us) | eager (us) | torch.compile (us) | roofline floor (us) | ours / floor | max rel err | checks |",
             "|---|---|---|---|---|---|---|---|---|"]
    for fused, dims, code, t in rows:
        if t is None:
            lines.append(f"| {fused} | {dims} | failed (exit {code}) | | | | | | |")
            continue
        r = {row["impl"]: row for row in t["rows"]}
        ours = r["prism-dsl"]
        lines.append(f"| {fused} | {dims} | {ours['us']:.2f} | {r['torch eager']['us']:.2f} | {r['torch.compile']['us']:.2f} "
                     f"| {t['roofline_us']:.2f} | {ours['us'] / t['roofline_us']:.2f} | {ours['max_rel_err']:.1e} "
                     f"| {'ok' if all(x['passed'] for x in t['rows']) else 'FAILED'} |")
    (ROOT / "benchmarks" / "RESULTS.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(run())
