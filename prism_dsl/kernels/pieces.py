"""Whether what a kernel computes depends on how many pieces its loop or a grid axis cuts its tiles into.

Where it sits: the kernel checker (`lang.check_kernel`) asks it of every accumulator and of every store whose
blocks add their results (`+=`). A kernel's loop range and grid sizes are parameters the tuner chooses, so its
result must not depend on them. The checker refuses the plainest cases itself (an accumulator of a value the
loop does not change; a store that no tile split by a grid axis reaches); what is left is a value that mixes
what is split with what is not, or treats a piece as the whole:

    acc_sum(xt @ wt + bt)             bt is added once an iteration: F times
    store Y[...] += acc_sum(...) + bt   bt is added once a block: gx times
    store R[...] += acc_max_last(xt)    the blocks add their pieces' maxima, which is no maximum

Each value is classed by how it depends on the tiles a parameter `sym` splits (`Piece`). A dim is split where
its size holds `sym` (d/F, d/(gx*F)): a tile whose loop walks a dim one element at a time (a split's combining
kernel walking the pieces, d/d = 1) holds no split dim, and folding it over the loop folds that whole dim.
"""

from __future__ import annotations

from enum import Enum
from typing import Callable

import sympy

from ..ir.accumulators import ACCUMULATORS
from ..ir.nodes import Node
from ..ir.ops import OPS, Kind

LINEAR = {"neg"}  # element-wise ops of one operand that are linear: a partial sum's stays partial


class Piece(Enum):
    WHOLE = "whole"  # none of its inputs is split: the same for every piece
    PIECE = "piece"  # at each position of the split dims, a function of that position (element-wise work)
    PARTIAL = "partial"  # linear in sums over a split dim (a product contracting it), which adding pieces completes
    MIXED = "mixed"  # none of these: it depends on how many pieces there are


def split_dims(node: Node, sym: sympy.Symbol) -> list[int]:
    """The dims of `node` split by `sym` (those whose size holds it), counted from the end."""
    return [i - node.rank for i, s in enumerate(node.shape) if sym in sympy.sympify(s).free_symbols]


def folded_dims(acc: Node, operand: int) -> set[int]:
    """The dims (from the end) of operand `operand` of accumulator `acc` that one iteration's fold reduces: a row
    fold's last dim; online softmax's product, the scores' last dim and the values' rows; none element-wise."""
    a = ACCUMULATORS[acc.op]
    if a.like == "matmul":
        return {-1} if operand == 0 else {-2}
    return {-1} if a.row else set()


class Classes:
    """Each node's `Piece` for the tiles `split` (a predicate on tile nodes) cut by `sym`, worked out once; `why`
    holds, for each node first found MIXED, what made it so (in words)."""

    def __init__(self, sym: sympy.Symbol, split: Callable[[Node], bool]):
        self.sym, self.split = sym, split
        self.known: dict[Node, Piece] = {}
        self.why: dict[Node, str] = {}

    def __call__(self, n: Node) -> Piece:
        if n not in self.known:
            self.known[n] = self._class(n)
        return self.known[n]

    def mixed(self, n: Node, why: str) -> Piece:
        self.why[n] = why
        return Piece.MIXED

    def _class(self, n: Node) -> Piece:
        if n.op == "tile":
            return Piece.PIECE if self.split(n) else Piece.WHOLE
        if n.op == "const":
            return Piece.WHOLE
        args = [self(a) for a in n.args]
        if Piece.MIXED in args:
            return Piece.MIXED
        if all(a is Piece.WHOLE for a in args):
            return Piece.WHOLE
        kind = OPS[n.op].kind
        if kind is Kind.ACCUMULATE:
            return self._accumulator(n, args)
        if kind is Kind.BINARY:
            return self._binary(n, *args)
        if kind is Kind.MATMUL:
            a, b = args
            if self.sym in sympy.sympify(n.args[0].shape[-1]).free_symbols:  # it contracts the split dim
                return Piece.PARTIAL if Piece.PARTIAL not in args else self.mixed(n, "a product of partial sums")
            if Piece.PARTIAL in args:
                return Piece.PARTIAL if Piece.WHOLE in args else self.mixed(n, "a product of partial sums")
            return Piece.PIECE
        if kind is Kind.REDUCE:
            return self._reduce(n, args[0])
        if kind is Kind.UNARY:
            if args[0] is Piece.PARTIAL and n.op not in LINEAR:
                return self.mixed(n, f"{n.op} of a partial sum, which is not the {n.op} of the whole sum")
            return args[0]
        if kind is Kind.TRANSPOSE:
            return args[0]
        if Piece.PARTIAL in args:  # a function of whole rows, a mask by position: of pieces, not of partial sums
            return self.mixed(n, f"{n.op} of a partial sum, which is not the {n.op} of the whole sum")
        if kind is Kind.ROWWISE and -1 in split_dims(n.args[0], self.sym):
            return self.mixed(n, f"{n.op} of each piece of rows that are split")
        return Piece.PIECE

    def _binary(self, n: Node, a: Piece, b: Piece) -> Piece:
        if Piece.PARTIAL not in (a, b):
            return Piece.PIECE  # element-wise work on pieces, whole values broadcast against them once each
        if a is b:  # both partial
            return Piece.PARTIAL if n.op in ("add", "sub") else self.mixed(n, f"a {n.op} of two partial sums")
        if Piece.PIECE in (a, b):
            return self.mixed(n, "a partial sum with a value at each position of the split dim")
        if n.op == "mul" or n.op == "div" and a is Piece.PARTIAL:
            return Piece.PARTIAL  # scaled by what is not split
        if n.op in ("add", "sub"):
            return self.mixed(n, "a partial sum plus a value that is not split, which is then added once a piece")
        return self.mixed(n, f"a {n.op} of a partial sum and a value that is not split")

    def _reduce(self, n: Node, a: Piece) -> Piece:
        over_split = n.attr - n.args[0].rank in split_dims(n.args[0], self.sym)
        if n.op == "sum":
            return Piece.PARTIAL if a is Piece.PARTIAL or over_split else Piece.PIECE
        if over_split:
            return self.mixed(n, f"the {n.op} of each piece of a dim that is split")
        if a is Piece.PARTIAL and n.op != "mean":
            return self.mixed(n, f"the {n.op} of partial sums, which is not the {n.op} of the whole sums")
        return a

    def _accumulator(self, n: Node, args: list[Piece]) -> Piece:
        """An accumulator's value as the pieces see it (where the loop's tiles are not what `sym` splits): one
        whose fold adds (`Accumulator.adds_pieces`) keeps a partial sum partial, and completes one over a split
        dim it folds; any other of a partial sum, or of pieces of a dim it folds, depends on the pieces."""
        a = ACCUMULATORS[n.op]
        folds_split = any(d in split_dims(x, self.sym) for i, x in enumerate(n.args) for d in folded_dims(n, i))
        if a.adds_pieces:
            return Piece.PARTIAL if Piece.PARTIAL in args or folds_split else Piece.PIECE
        if Piece.PARTIAL in args:
            return self.mixed(n, f"{n.op} of partial sums, which is not the {n.op} of the whole sums")
        if folds_split:
            return self.mixed(n, f"{n.op} of each piece of a dim that is split, which is not the {n.op} of the "
                                 "whole dim")
        return Piece.PIECE


def over_the_loop(acc: Node, classes: Classes) -> str | None:
    """Why accumulator `acc` gives a value that depends on the loop's range, `classes` being for the loop's tiles
    and symbol; None where it does not. One iteration's operand must be a partial sum that the fold adds, or
    pieces whose split dims are all dims the fold reduces."""
    a = ACCUMULATORS[acc.op]
    for i, x in enumerate(acc.args):
        c = classes(x)
        if c is Piece.MIXED:
            culprit = next((m for m in x.walk() if m in classes.why), None)
            return classes.why.get(culprit, "a value that depends on the pieces")
        if c is Piece.PARTIAL and not a.adds_pieces:
            return f"{acc.op} of partial sums over the loop's pieces, which is not the {acc.op} of the whole sums"
        if c is Piece.PIECE and not set(split_dims(x, classes.sym)) <= folded_dims(acc, i):
            return ("tiles of different parts of a dim the loop splits, folded together (the fold keeps the dim, "
                    "one piece long)")
    return None


def added_by_blocks(value: Node, classes: Classes) -> str | None:
    """Why blocks that add `value` (a `+=` store over the grid axis `classes` is for) add what depends on how many
    blocks there are; None where the sum of their values is a whole one."""
    c = classes(value)
    if c is Piece.PARTIAL:
        return None
    if c is Piece.MIXED:
        culprit = next((m for m in value.walk() if m in classes.why), None)
        return classes.why.get(culprit, "a value that depends on the pieces")
    return "tiles of different parts of a dim the axis splits, added together (the sum keeps the dim, one piece long)"
