"""Whether what a kernel computes depends on how many pieces its loop or a grid axis cuts its tiles into.

Where it sits: the kernel checker (`lang.check_kernel`) asks it of every accumulator and every store. A kernel's
loop range and grid sizes are parameters the tuner chooses, so its result must not depend on them. The checker
refuses the plainest cases itself (an accumulator of a value the loop does not change; a store that no tile split
by a grid axis reaches); what is left is a value that mixes what is split with what is not, or takes a piece for
the whole:

    acc_sum(xt @ wt + bt)                bt is added once an iteration: F times
    store Y[...] += acc_sum(...) + bt    bt is added once a block: gx times
    store R[...] += acc_max_last(xt)     the blocks add their pieces' maxima, which is no maximum
    store Y[y, x] = softmax(xt)          each block's piece of a row, as if it were the row

Each value is classed by how it depends on the tiles a parameter `sym` splits (`Piece`). A dim is split where its
size holds `sym` (d/F, d/(gx*F)): a loop that walks a dim one element at a time (a split's combining kernel walking
the pieces, S/S = 1) leaves no split dim, and folding that tile folds the whole dim.

What one kernel cannot see is left to the prover and the checks against the reference: what a tensor of pieces
another kernel stored holds (a combining kernel that adds online softmax's pieces without rescaling them).
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
    PARTIAL = "sum"  # linear in sums over a split dim (a product contracting it, a sum over it): adding completes it
    PARTIAL_MAX = "max"  # a max over a split dim, which the pieces' max completes
    PARTIAL_MEAN = "mean"  # a mean over a split dim, which the mean of the (equal) pieces' means completes
    MIXED = "mixed"  # none of these: it depends on how many pieces there are


PARTIALS = (Piece.PARTIAL, Piece.PARTIAL_MAX, Piece.PARTIAL_MEAN)


def split_dims(node: Node, sym: sympy.Symbol) -> set[int]:
    """The dims of `node` split by `sym` (those whose size holds it), counted from the end."""
    return {i - node.rank for i, s in enumerate(node.shape) if sym in sympy.sympify(s).free_symbols}


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

    def reason(self, n: Node) -> str:
        """What made `n` MIXED, in words (the first place below it that was)."""
        return next((self.why[m] for m in n.walk() if m in self.why), "a value that depends on the pieces")

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
        if kind is Kind.TRANSPOSE:
            return args[0]
        if kind is Kind.REDUCE:
            return self._reduce(n, args[0])
        if any(a in (Piece.PARTIAL_MAX, Piece.PARTIAL_MEAN) for a in args) and kind is not Kind.ACCUMULATE:
            what = next(a for a in args if a in PARTIALS).value
            return self.mixed(n, f"{n.op} of a {what} over a piece of a split dim, which only a {what} of the pieces "
                                 "completes")
        if kind is Kind.ACCUMULATE:
            return self._accumulator(n, args)
        if kind is Kind.BINARY:
            return self._binary(n, *args)
        if kind is Kind.MATMUL:
            if self.sym in sympy.sympify(n.args[0].shape[-1]).free_symbols:  # it contracts the split dim
                return Piece.PARTIAL if Piece.PARTIAL not in args else self.mixed(n, "a product of partial sums")
            if Piece.PARTIAL in args:
                return Piece.PARTIAL if Piece.WHOLE in args else self.mixed(n, "a product of partial sums")
            return Piece.PIECE
        if kind is Kind.UNARY:
            if args[0] is Piece.PARTIAL and n.op not in LINEAR:
                return self.mixed(n, f"{n.op} of a partial sum, which is not the {n.op} of the whole sum")
            return args[0]
        if Piece.PARTIAL in args:  # a function of whole rows, a mask by position: of pieces, not of partial sums
            return self.mixed(n, f"{n.op} of a partial sum, which is not the {n.op} of the whole sum")
        if kind is Kind.ROWWISE and -1 in split_dims(n.args[0], self.sym):
            return self.mixed(n, f"{n.op} of each piece of a row, as if it were the row")
        return Piece.PIECE

    def _binary(self, n: Node, a: Piece, b: Piece) -> Piece:
        if Piece.PARTIAL not in (a, b):  # element-wise work on pieces, whole values broadcast against them once each
            x, y = (split_dims(m, self.sym) if self(m) is Piece.PIECE else set() for m in n.args)
            if x and y and x != y:
                return self.mixed(n, f"a {n.op} of pieces of two split dims broadcast against each other")
            return Piece.PIECE
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
        done = Piece(n.op)  # (sum, max, mean: what a reduce over the split dim leaves)
        if a is Piece.PIECE:
            return done if over_split else Piece.PIECE
        if a is done or a is Piece.PARTIAL and n.op == "mean":  # (a mean of partial sums over another dim: linear)
            return a
        return self.mixed(n, f"the {n.op} of a {a.value} over a piece of a split dim, which is not the {n.op} over "
                             "the whole dim")

    def _accumulator(self, n: Node, args: list[Piece]) -> Piece:
        """An accumulator's value as the pieces see it (where the loop's tiles are not what `sym` splits): folding
        the loop's iterations keeps a block's partial result partial where the fold completes that reduction
        (`Accumulator.completes`), and makes one of a split dim it folds; any other fold of either depends on
        the pieces."""
        a = ACCUMULATORS[n.op]
        partial = next((c for c in args if c in PARTIALS), None)
        if partial is not None:
            return partial if partial.value == a.completes else self.mixed(
                n, f"{n.op} of partial {partial.value}s, which is not the {n.op} of the whole")
        if any(d in split_dims(x, self.sym) for i, x in enumerate(n.args) for d in folded_dims(n, i)):
            return Piece(a.completes) if a.completes else self.mixed(
                n, f"{n.op} of each piece of a dim that is split, which is not the {n.op} of the whole dim")
        return Piece.PIECE


def over_the_loop(acc: Node, classes: Classes) -> str | None:
    """Why accumulator `acc` gives a value that depends on the loop's range, `classes` being for the loop's tiles
    and symbol; None where it does not. One iteration's operand must be a partial result that the fold completes
    (a sum, a max, a mean: `Accumulator.completes`), or pieces whose split dims are all dims the fold reduces."""
    a = ACCUMULATORS[acc.op]
    for i, x in enumerate(acc.args):
        c = classes(x)
        if c is Piece.MIXED:
            return classes.reason(x)
        if c in PARTIALS and c.value != a.completes:
            return f"{acc.op} of partial {c.value}s over the loop's pieces, which is not the {acc.op} of the whole"
        if c is Piece.PIECE and not split_dims(x, classes.sym) <= folded_dims(acc, i):
            return ("tiles of different parts of a dim the loop splits, folded together: the fold keeps the dim one "
                    "piece long (to fold it too, fold its rows: acc_sum_last)")
    return None


def added_by_blocks(value: Node, classes: Classes) -> str | None:
    """Why blocks that add `value` (a `+=` store over the grid axis `classes` is for) add what depends on how many
    blocks there are; None where the sum of their values is a whole one: a partial sum, or pieces with no split dim
    (each block's piece one element of the dim: the blocks add the whole dim)."""
    c = classes(value)
    if c is Piece.PARTIAL or c is Piece.PIECE and not split_dims(value, classes.sym):
        return None
    if c is Piece.MIXED:
        return classes.reason(value)
    if c is not Piece.PIECE:
        return f"each block's {c.value} over its piece of a split dim, which adding does not complete"
    return "tiles of different parts of a dim the axis splits, added together (the sum keeps the dim, one piece long)"


def stored_by_blocks(value: Node, classes: Classes) -> str | None:
    """Why blocks that each store `value` on their own part of a dim (a `=` store whose grid axis writes a dim of
    whole-tensor positions) store what depends on how many blocks there are: only a value that mixes a piece with
    the whole (a softmax over each block's piece of a row); None otherwise (a per-piece partial result is stored
    where the axis writes a dim of the pieces themselves, which `stored_by_blocks` is not asked of)."""
    return classes.reason(value) if classes(value) is Piece.MIXED else None


def combined_by(state: Node, axis: str, kernel) -> frozenset[str] | None:
    """The folds that combine what `kernel` (a `kernels.kernel.Kernel`) stores as `state`, one result for each block
    along grid axis `axis`, where that axis cuts what the accumulator `state` folds (a split's per-piece states:
    FlashDecoding's maxima, sums and outputs, split-K's partial sums): a partial sum, max or mean is completed by any
    fold of that kind (`Accumulator.completes`), another state by its own combining fold only (`Accumulator.combine`:
    online softmax's by acc_rescaled_sum), a state with none by no fold. None where `state` is no accumulator, or the
    axis cuts nothing it folds (its blocks' results are parts of the whole, not pieces of it)."""
    a = ACCUMULATORS.get(state.op)
    size = dict(kernel.grid).get(axis)
    if a is None or not isinstance(size, sympy.Symbol):
        return None
    c = Classes(size, lambda t: axis in kernel.load(t.attr).map.axes())(state)
    if c in PARTIALS:
        return frozenset(name for name, b in ACCUMULATORS.items() if b.completes == c.value)
    if c is Piece.MIXED:
        return frozenset([a.combine[0]] if a.combine else [])
    return None
