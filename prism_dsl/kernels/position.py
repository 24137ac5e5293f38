"""Where a block's values sit in the whole tensors: what position-dependent ops (`causal`) need in a kernel.

A custom kernel's body works on tiles, but `causal(s)` masks by an element's row and column in the whole
tensor. Inside a kernel, a value's dim takes its place from the loaded tile it comes from: `origin`
follows the dim down the body (element-wise ops keep it from an operand that is not broadcast along it,
a product takes its rows from the left operand and its columns from the right one, a transpose swaps two
dims) to a tile's dim, whose place is its load's map: the block's slice along a grid axis, plus the
iteration's step where the loop splits it. The block interpreter (`semantics.blocks`) and the code
generator compute the same offsets from what `origin` returns. A dim that comes from no tile (a reduced
one, or a value built from constants) sits at 0, with its own size as the whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..ir.accumulators import ACCUMULATORS
from ..ir.nodes import Node
from ..ir.ops import OPS, Kind
from ..ir.shapes import same
from .kernel import DimMap, Kernel, Load


@dataclass(frozen=True)
class Origin:
    """Dim `dim` (counted from the end) of the tile that `load` loads gives a value's dim its place."""

    load: Load
    dim: int

    def map(self, rank: int) -> DimMap:
        return self.load.map.dims[rank + self.dim]


def origin(kernel: Kernel, node: Node, dim: int) -> Origin | None:
    """The loaded tile dim that places dim `dim` (counted from the end) of the body value `node`, if any."""
    while True:
        if -dim > node.rank:
            return None
        if node.op == "tile":
            return Origin(kernel.load(node.attr), dim)
        kind = OPS[node.op].kind
        if kind is Kind.TRANSPOSE:
            i, j = (d - node.rank for d in node.attr)
            dim = j if dim == i else i if dim == j else dim
            node = node.args[0]
            continue
        like = ACCUMULATORS[node.op].like if kind is Kind.ACCUMULATE else kind.value
        if kind is Kind.ACCUMULATE and ACCUMULATORS[node.op].row and dim == -1:
            return None  # folded
        if kind is Kind.REDUCE and dim == node.attr - node.rank:
            return None  # reduced
        if like == "matmul" and dim in (-1, -2):
            node = node.args[1 if dim == -1 else 0]  # columns from the right operand, rows from the left
            continue
        operand = _unbroadcast(node, dim) if node.args else None
        if operand is None:
            return None
        node = operand


def _unbroadcast(node: Node, dim: int) -> Node | None:
    """The first operand of `node` that is not broadcast along `dim`."""
    for a in node.args:
        if -dim <= a.rank and same(a.shape[dim], node.shape[dim]):
            return a
    return None


def start(dm: DimMap, full: int, grid: Mapping[str, int], loop: int, block: Mapping[str, int], i: int) -> int:
    """Where a tile dim of map `dm` over a dim of size `full` starts, in block `block` at iteration `i`."""
    piece = full // grid[dm.axis] if dm.axis else full
    return (block[dm.axis] * piece if dm.axis else 0) + (i * (piece // loop) if dm.loop else 0)
