"""The roofline floor of a program: the time no program computing it can beat on given hardware.

Where it sits: reports (`pipeline.compile`, `cli.bench`) set every estimate and timing beside it.

    floor = max(bytes / peak bandwidth, flops / peak)

with bytes = the inputs read once and the outputs written once, and flops = every product's, those inside
custom kernels included; of products under a causal mask, only the kept elements' share (`masked_share`). The
peaks are the datasheet's (`datasheet_bandwidth_gbs`, `datasheet_tflops` in the hardware file: H100 SXM 3.35 TB/s
and 989 TFLOP/s dense f16), not the rates the cost model takes kernels to reach (`bandwidth_gbs`, `peak_tflops`:
3.0 TB/s copied, 800 TFLOP/s): a floor at those would be beaten by a copy at 3.2 TB/s, and would make every
estimate look 1.1-1.24 times nearer to it than it is.
"""

from __future__ import annotations

import math
from typing import Mapping

import sympy

from ..ir.accumulators import ACCUMULATORS
from ..ir.nodes import DType, Node, Program
from ..ir.ops import OPS, Kind
from ..kernels.hardware import Hardware
from ..kernels.kernel import kernels_of
from ..kernels.position import causal_loop, whole
from ..kernels.sizes import bind


def roofline(program: Program, binding: Mapping[sympy.Symbol, int], hardware: Hardware) -> dict:
    """The program's floor on `hardware`: its inputs read once, its outputs written once, its math at peak
    (the products a causal mask makes of its kept elements only: `masked_share`)."""
    def size(n: Node) -> int:
        return math.prod(int(bind(s, binding)) for s in n.shape) * (n.dtype or DType.F32).bytes

    moved = sum(size(n) for n in program.inputs) + sum(size(n) for _, n in program.outputs)
    flops = 0
    share = masked_share(program, binding)
    for n in program.nodes():
        if n.op == "matmul":
            work = 2 * math.prod(int(bind(s, binding)) for s in n.shape) * int(bind(n.args[0].shape[-1], binding))
            flops += round(work * share.get(n, 1.0))
    for k in kernels_of(program):  # products inside custom kernels: per block and iteration, times both
        runs = sympy.Mul(*[g for _, g in k.grid]) * k.loop_range
        # a product that blocks along an axis recompute (the scores of attention split along the output's
        # columns), or a loop recomputes, counts once: that parameter at 1
        once = {s: 1 for s in runs.free_symbols}
        cl = causal_loop(k)
        if cl is not None:  # of a causal loop's products, only the kept elements' share is needed
            def bound(n: Node) -> tuple[int, ...]:
                return tuple(int(bind(d, binding)) for d in n.shape)
            cols = whole(bound, k, cl.cols)
            rows = whole(bound, k, cl.rows) if cl.rows else bound(cl.mask)[-2]
            runs = runs * sympy.Rational(round(kept_share(rows, cols) * 2**20), 2**20)
        for n in k.body():
            if n.op == "matmul" or (n.op in ACCUMULATORS and ACCUMULATORS[n.op].like == "matmul"):
                depth = n.args[0].shape[-1]  # the contraction: a's columns (s's for exp(s) @ v)
                total = sympy.simplify(2 * sympy.Mul(*n.shape) * depth * runs)
                if not (value := bind(total, binding).subs(once)).free_symbols:
                    flops += int(value)
    dtype = next((n.dtype.value for n in program.inputs if n.dtype), "f16")
    t_mem = moved / (hardware.datasheet_bandwidth_gbs * 1e9) * 1e6
    t_math = flops / (hardware.datasheet_tflops[dtype] * 1e12) * 1e6
    return {"bytes": moved, "flops": flops, "floor_us": round(max(t_mem, t_math), 3),
            "bound": "memory" if t_mem >= t_math else "math"}


def masked_share(program: Program, binding: Mapping[sympy.Symbol, int]) -> dict[Node, float]:
    """The share of each product's work a causal mask keeps: the scores under the mask (through
    element-wise ops), and the products whose left operand is made from the masked scores (softmax's
    probabilities times V). The masked elements are -inf scores and zero probabilities, which a kernel
    that skips the key tiles past the diagonal never computes."""
    share: dict[Node, float] = {}
    masks = {n: kept_share(*(int(bind(d, binding)) for d in n.shape[-2:])) for n in program.nodes() if n.op == "causal"}
    for c, kept in masks.items():
        todo = [c.args[0]]
        while todo:  # the scores' products, under element-wise ops of the same rows and columns
            n = todo.pop()
            if n.op == "matmul":
                share[n] = kept
            elif OPS[n.op].kind in (Kind.UNARY, Kind.BINARY):
                todo += [a for a in n.args if a.rank >= 2 and a.shape[-2:] == n.shape[-2:]]
    for m in program.nodes():
        if m.op == "matmul" and m not in share:
            n = m.args[0]  # the probabilities: element-wise and row-wise ops down to a mask
            while n not in masks and OPS[n.op].kind in (Kind.UNARY, Kind.BINARY, Kind.ROWWISE) and n.args:
                n = n.args[0]
            if n in masks:
                share[m] = masks[n]
    return share


def kept_share(rows: int, cols: int) -> float:
    """The share of a causal mask's elements it keeps: row i keeps the columns up to i + cols - rows."""
    return sum(min(cols, max(0, i + cols - rows + 1)) for i in range(rows)) / (rows * cols)
