"""What a storage type costs causal attention with RoPE, whatever the kernel: the error of the roundings a
kernel on tensor cores cannot avoid, made exactly, against the float64 reference (`compare.check`'s measure).

    python benchmarks/roundings.py            # the table in benchmarks/NOTES.md (a few seconds)
    python benchmarks/roundings.py --program programs/qk_norm_attention.prism --dims b=1,h=16,q=4096,kv=4096,dh=128

With `--program`, any program instead, at its dims, compiled as written (each operator outside a custom kernel
a kernel of its own, `kernels.lower`): what its kernels' roundings, and nothing else, cost each output on the
compiler's check inputs (seed 0, as `prismc compile` and the GPU check take them): every product's operands and
every tensor a kernel stores rounded to their storage types, and every operation in f32 as the kernels compute
(`reference.arithmetic`); and the tolerance the checks then judge it at (`compare.Tolerance`). A program the
search fuses differently is measured on its own form by `prismc compile`.

The RoPE'd queries and keys go to the tensor cores in the storage type, and so do online softmax's
probabilities; the output is stored in it. Everything else is float64 here. Inputs are the compiler's own
random inputs (`reference.random_inputs`, seeds 0-29) of `programs/causal_attention.prism` with its f16
tensors in the type. The largest of these errors is what `compare.tolerance` must leave room for.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prism_dsl.backend.compare import Tolerance, check, tolerance, widest  # noqa: E402
from prism_dsl.base.errors import PrismError  # noqa: E402
from prism_dsl.cli.values import parse_dims  # noqa: E402
from prism_dsl.pipeline.build import rtol_of  # noqa: E402
from prism_dsl.semantics.blocks import evaluate  # noqa: E402
from prism_dsl.ir.nodes import DType  # noqa: E402
from prism_dsl.kernels.lower import lower  # noqa: E402
from prism_dsl.lang.check import load  # noqa: E402
from prism_dsl.semantics.reference import bind_dims, quantize, random_inputs, rotate_half  # noqa: E402

SHAPES = [dict(q=7, kv=130, dh=128), dict(q=32, kv=64, dh=64), dict(q=64, kv=256, dh=128), dict(q=1, kv=256, dh=64)]


def attention(i: dict, rounded) -> np.ndarray:
    """The program's causal attention, `rounded` applied where a tensor-core kernel must round."""
    q = rounded(i["Q"] * i["CQ"] + rotate_half(i["Q"]) * i["SQ"])
    k = rounded(i["K"] * i["CK"] + rotate_half(i["K"]) * i["SK"])
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(128)
    rows, cols = s.shape[-2:]
    s = np.where(np.arange(cols)[None, :] > np.arange(rows)[:, None] + (cols - rows), -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    return rounded(rounded(p) @ i["V"] / p.sum(-1, keepdims=True))


def errors(dtype: DType, shape: dict, seeds: int, scratch: Path) -> list[float]:
    path = scratch / f"{dtype.value}.prism"
    path.write_text(re.sub(r"\bf16\[", f"{dtype.value}[", (ROOT / "programs/causal_attention.prism").read_text()))
    program = load(path).program()
    binding = bind_dims(program, {"b": 1, "h": 1, **shape})
    out = []
    for seed in range(seeds):
        inputs = random_inputs(program, binding, seed)
        exact = attention(inputs, lambda x: x)
        out.append(check(attention(inputs, lambda x: quantize(np.asarray(x), dtype)), exact)["max_rel_err"])
    return out


def program_roundings(path: str, dims: dict) -> None:
    """Per output of the program in `path`: the roundings' own error and the tolerance it is judged at."""
    program = load(Path(path)).program()
    inputs = random_inputs(program, bind_dims(program, dims), 0)
    exact = evaluate(program, inputs)
    tol = Tolerance(rtol_of(program), lambda: evaluate(lower(program), inputs, rounded=True))
    for name in exact:
        e = tol.rounding(name, exact[name])
        print(f"{program.name} {name}: its kernels' roundings alone {e:.2e}; judged at "
              f"{max(tol.base, min(2 * e, widest(tol.base))):.2e} (base {tol.base:g})", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--program", help="a .prism file: its own roundings instead of the table")
    ap.add_argument("--dims", type=parse_dims, default={}, help="sizes for --program, e.g. q=4096,kv=4096")
    args = ap.parse_args()
    if args.seeds < 1:
        ap.error("--seeds must be at least 1")
    if args.dims and not args.program:
        ap.error("--dims sizes the program of --program; the table's programs have sizes of their own")
    if args.program:
        try:
            program_roundings(args.program, args.dims)
        except PrismError as err:  # a missing or malformed file, a dim the program lacks: said, not a traceback
            print(f"roundings.py: {err}", file=sys.stderr)
            return 2
        return 0
    print(f"| causal attention, dims | bf16: median / max (tolerance {tolerance({'bf16'}):.3g}) | "
          f"f16: median / max (tolerance {tolerance({'f16'}):.3g}) |")
    print("|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for shape in SHAPES:
            cells = []
            for dtype in (DType.BF16, DType.F16):
                e = errors(dtype, shape, args.seeds, Path(scratch))
                cells.append(f"{np.median(e):.2g} / {max(e):.2g}")
            print(f"| {', '.join(f'{k}={v}' for k, v in shape.items())} | {cells[0]} | {cells[1]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
