"""Dims a program reduces along, built past the size given: their elements past the end masked.

Where it sits: beside `pipeline.padding`, which rounds dims up for tiles. A dim along which every value is
computed element by element (a projection's rows) may be built larger as it is. A dim the program reduces
along (attention's keys at 4099: the loop folds them) may not: the keys past the caller's would enter each
query's softmax. Such a dim is built rounded up only where the program computes the caller's values anyway,
its inputs zero past the size given (the kernels read them so where they can, `read_in_place`: each copy past
the caller's end writes zeros and reads nothing; the launcher pads the others), which `refusal` checks, and
these hold:

- every fold along the dim in a custom kernel's loop (or in one pass over its tile) takes each element past
  the end as its identity (`Accumulator.past_end`: 0 for a sum, -inf for a max and for online softmax's
  scores), which the generated code (`backend.codegen`) and the block interpreter (`semantics.blocks`) put
  there by the element's place in the whole tensor (`given_end`); a fold that counts its elements (a mean's
  divisor would be the size built) is refused;
- every product that contracts the dim reads zeros past the end on both sides (`zero`: what the ops between the
  inputs and it make of zeros, broadcasting followed), so the extra terms add 0; a value past the end that is not
  zero may be anything the caller's values broadcast there make (exp(X + B) is exp(B): it may overflow where no
  caller's element does), so 0 times it is not counted on (`finite`); a per-element sum over loop iterations
  that walk the dim likewise adds zeros;
- nothing else works along it: no norm, mean, max or softmax step outside custom kernels, no reduction or
  row-wise op inside one, no mask or position placing by it.

What is checked against what: the emulation runs the kernels at the size built on inputs zero past the size
given (those read in place given as the caller has them, so that a read past the end is outside the array: the
address sanitizer reports it), and compares the caller's part of every tensor with the float64 reference of the
input program at the size given; an input program written with custom kernels runs in the block interpreter at
the size built, its folds masked as here (`pipeline.build.reference_outputs`). Where the check fails, the compile
builds at the sizes given (`pipeline.compile`).
"""

from __future__ import annotations

from typing import Mapping

import sympy

from ..ir.accumulators import ACCUMULATORS
from ..ir.nodes import Node, Program
from ..ir.ops import OPS, Kind
from .kernel import Kernel, kernels_of
from .position import Origin, origin

KEEPS_ZERO = frozenset({"neg", "relu", "silu", "gelu", "gelu_tanh", "tanh", "square", "sqrt", "transpose"})
NORMS = frozenset({"rms_norm_eps", "layer_norm"})  # 0 for a row of zeros, their epsilon positive


class _Refused(Exception):
    pass


def refusal(program: Program, given: Mapping[str, int], built: Mapping[str, int] | None = None) -> str | None:
    """Why `program` would not compute its caller's values built with the dims of `given` (by name, with the sizes
    the caller gives) past those sizes, their inputs zero past them and the folds along them masked; None where
    it would. `built`: every dim's size as built, which a causal mask placing by such a dim needs (`diagonal`)."""
    symbols = frozenset(d.symbol for d in program.dims if d.name in given)
    if not symbols:
        return None
    try:
        _Facts(program, symbols, given, built).check()
    except _Refused as e:
        return str(e)
    return None


def given_end(kernel: Kernel, node: Node, dim: int, ends: Mapping[str, int]) -> int | None:
    """The size the caller gave of the whole dim that places dim `dim` of the body value `node`, where that dim
    was built past it (`ends`: such dims by name, with the sizes given); None where it was not."""
    found = source_dim(kernel, node, dim) if ends else None
    return None if found is None else ends.get(found[1].name)


def read_in_place(tensor: Node, ends: Mapping[str, int]) -> bool:
    """Whether the kernels read program input `tensor`, which has a dim built past the size given (`ends`), as the
    caller passes it, at the sizes given: each copy of its tiles guarded by the index past the caller's end, zeros
    in its place (`backend.copies.load_step`; a TMA box reaching past it gets the hardware's zeros there, its map
    at the caller's dims), so that the launcher passes it without padding it (a copy of the whole tensor each
    call: at decode, a key cache's). It is where no such dim is its innermost (every row starts as aligned as it
    does built) and every size of it is a dim or a number. False for a tensor built at the size given."""
    if tensor.op != "input" or not ends:
        return False
    names = {sym.name for size in tensor.shape for sym in sympy.sympify(size).free_symbols}
    if not names & ends.keys():
        return False
    last = tensor.shape[-1]
    return all(isinstance(size, (sympy.Symbol, sympy.Integer, int)) for size in tensor.shape) and not (
        isinstance(last, sympy.Symbol) and last.name in ends)


def callers_shape(tensor: Node, binding: Mapping[sympy.Symbol, int], ends: Mapping[str, int]) -> tuple[int, ...]:
    """`tensor`'s shape at the sizes built (`binding`), the dims built past the size given (`ends`) at that size."""
    return tuple(ends[size.name] if isinstance(size, sympy.Symbol) and size.name in ends
                 else int(sympy.sympify(size).subs(binding)) for size in tensor.shape)


def source_dim(kernel: Kernel, node: Node, dim: int) -> tuple[Origin, sympy.Symbol] | None:
    """The loaded tile dim that places dim `dim` of the body value `node` (`position.origin`), and the program dim
    its tensor has there; None where no tile places it or that dim is not a program dim."""
    o = origin(kernel, node, dim)
    if o is None:
        return None
    shape = kernel.inputs[o.load.source].shape
    size = shape[o.dim] if -o.dim <= len(shape) else None
    return (o, size) if isinstance(size, sympy.Symbol) else None


class _Facts:
    """The checks of `refusal` over one program, with what each value holds past the end."""

    def __init__(self, program: Program, symbols: frozenset[sympy.Symbol], given: Mapping[str, int],
                 built: Mapping[str, int] | None):
        self.program, self.symbols, self.given, self.built = program, symbols, given, built
        self.kernel: Kernel | None = None  # the kernel whose body is being looked at
        self.known: dict[tuple, bool] = {}  # (what, kernel, node): `zero` and `finite` worked out

    def refuse(self, node: Node, why: str) -> None:
        where = f"in kernel '{self.kernel.name}'" if self.kernel is not None else "outside custom kernels"
        names = ", ".join(sorted(str(s) for s in self.symbols))
        raise _Refused(f"{node.op} {where} {why} ({names} built past the size given)")

    def past(self, n: Node) -> set[int]:
        """The dims of `n` (counted from the end) that reach past the end."""
        if self.kernel is None:
            out = set()
            for i, size in enumerate(n.shape):
                free = getattr(size, "free_symbols", set()) & self.symbols
                if free and size not in self.symbols:
                    self.refuse(n, f"has a size made of the dim ({size})")
                if free:
                    out.add(i - n.rank)
            return out
        return {d for d in range(-n.rank, 0) if self._walked(n, d) is not None}

    def symbol(self, n: Node, d: int) -> sympy.Symbol | None:
        """The program dim that dim `d` of `n` is (inside a kernel: that its tile dim is loaded from), if one."""
        if self.kernel is not None:
            found = source_dim(self.kernel, n, d)
            return None if found is None else found[1]
        size = n.shape[d] if -d <= n.rank else None
        return size if isinstance(size, sympy.Symbol) else None

    def _walked(self, n: Node, d: int) -> Origin | None:
        """The tile dim placing dim `d` of the body value `n`, where it is loaded from a dim past the end."""
        found = source_dim(self.kernel, n, d)
        return found[0] if found is not None and found[1] in self.symbols else None

    def zero(self, n: Node) -> bool:
        """Whether `n` holds zeros past the end (False where it reaches no dim past it)."""
        return self._known(self._zero, n)

    def finite(self, n: Node) -> bool:
        """Whether `n` holds values past the end that 0 times them is 0 of (True where it reaches no dim past it)."""
        return self._known(self._finite, n)

    def _known(self, f, n: Node) -> bool:
        key = (f.__name__, self.kernel, n)
        if key not in self.known:
            self.known[key] = f(n)
        return self.known[key]

    def _zero(self, n: Node) -> bool:
        past = self.past(n)
        if not past:
            return False
        if n.op == "input":
            return True
        if n.op == "tile":
            return self._outside(self.zero, self._source(n))
        if n.op in KEEPS_ZERO:
            return self.zero(n.args[0])

        def covers(a: Node, dims=past) -> bool:  # zero at every element of `n` past the end along `dims`
            return self.zero(a) and dims <= self.past(a)
        finite = all(self.finite(a) for a in n.args)  # 0 * inf is NaN
        if n.op == "mul":  # zero where an operand is: each dim past the end must be one a zero operand reaches
            return finite and all(any(covers(a, {d}) for a in n.args) for d in past)
        if OPS[n.op].kind is Kind.MATMUL:  # a row of zeros in a, a column of zeros in b
            a, b = n.args
            return finite and all(covers(b, {d}) if d == -1 else covers(a, {d}) if d == -2 or b.rank < 2 else
                                  covers(a, {d}) or covers(b, {d}) for d in past)
        if n.op in ("add", "sub"):
            return all(covers(a) for a in n.args)
        if n.op == "div":  # the divisor is the caller's values (not zero, as the program needs them)
            return covers(n.args[0]) and not self.past(n.args[1])
        if n.op == "rope":
            return covers(n.args[0]) and finite
        if n.op in NORMS:
            return covers(n.args[0]) and _epsilon(n)
        return False

    def _finite(self, n: Node) -> bool:
        """Past the end a value not zero holds what the ops make of zeros and of the caller's values broadcast
        there (exp(X + B) is exp(B), which the caller's elements never take: it may overflow where they do not), so
        it is taken as finite only where it is zero."""
        return not self.past(n) or self.zero(n)

    def _source(self, tile: Node) -> Node:
        """The tensor a body tile is loaded from."""
        return self.kernel.inputs[self.kernel.load(tile.attr).source]

    def _outside(self, f, n: Node) -> bool:
        """`f(n)` for a tensor outside the kernel being looked at."""
        kernel, self.kernel = self.kernel, None
        try:
            return f(n)
        finally:
            self.kernel = kernel

    def check(self) -> None:
        for n in self.program.nodes():
            if n.op != "kernel":
                self.node(n)
        for k in kernels_of(self.program):
            self.kernel = k
            for n in k.body():
                self.node(n)
            self.kernel = None

    def node(self, n: Node) -> None:
        """Refuses `n` where it works along a dim past the end in a way the masking does not cover."""
        past = {d for a in n.args for d in self.past(a)} | self.past(n)
        if not past:
            return
        kind = OPS[n.op].kind
        if kind is Kind.MATMUL:
            a, b = n.args
            if -1 in self.past(a) or (-2 if b.rank > 1 else -1) in self.past(b):
                if not (self.zero(a) and self.finite(b) or self.zero(b) and self.finite(a)):
                    self.refuse(n, "contracts the dim without zeros past the end on both sides")
        elif kind is Kind.REDUCE:
            if n.attr - n.args[0].rank in self.past(n.args[0]):
                self.refuse(n, "reduces along the dim")
        elif kind is Kind.ROWWISE:
            if -1 in self.past(n.args[0]) or -1 in self.past(n):
                self.refuse(n, "works along the dim")
        elif kind is Kind.ACCUMULATE:
            self.fold(n)
        elif kind is Kind.MASK and past & {-1, -2}:
            self.diagonal(n)
        elif kind in (Kind.POSITION, Kind.SPLIT, Kind.CONCAT):
            self.refuse(n, "places its elements by the dim")

    def diagonal(self, mask: Node) -> None:
        """A causal mask placing by a dim past the end: kept where each row the caller has keeps the columns before
        the end it kept at the sizes given (the columns past it are the folds' to mask, as every value's are).
        Row i keeps the columns up to i + (columns - rows): at both sizes alike where rows and columns are rounded
        up alike (attention at prefill), or where both diagonals reach the last column from the first row on
        (one query: the step of decoding); refused where the diagonal would move."""
        rows, cols = self.symbol(mask, -2), self.symbol(mask, -1)
        if mask.op != "causal" or self.built is None or rows is None or cols is None:
            self.refuse(mask, "places its elements by the dim")
        built = {s: self.built[s.name] for s in (rows, cols)}
        given = {s: self.given.get(s.name, built[s]) for s in (rows, cols)}
        offsets = built[cols] - built[rows], given[cols] - given[rows]
        if offsets[0] != offsets[1] and min(offsets) < given[cols] - 1:
            self.refuse(mask, f"places its elements by the dim, and would move its diagonal ({rows} and {cols} "
                              "rounded up unlike)")

    def fold(self, acc: Node) -> None:
        """An accumulator whose operands reach past the end: its folded dim masked (row folds, online softmax's
        scores), its operands' other such dims kept apart (not walked by the loop) or zero."""
        a = ACCUMULATORS[acc.op]
        x = acc.args[0]
        for d in self.past(x):
            folded = d == -1 and (a.row or a.online == "softmax")
            if folded and a.past_end is None:
                self.refuse(acc, "counts the elements it folds along the dim")
            if not folded and self._walked(x, d).dm.loop and not (a.per_element and self.zero(x)):
                self.refuse(acc, "folds the loop's iterations along the dim into one element")
        for v in acc.args[1:]:  # online softmax's values: their rows meet the scores' masked columns
            for d in self.past(v):
                if d == -2 and -1 in self.past(x):
                    if not self.finite(v):
                        self.refuse(acc, "reads values that are not zero past the end")
                elif self._walked(v, d).dm.loop:
                    self.refuse(acc, "reads values past the end that its scores do not mask")


def _epsilon(norm: Node) -> bool:
    """Whether a norm's epsilon is a positive constant: a row of equal values (zeros) is then 0, not 0 / 0."""
    eps = norm.args[-1]
    return eps.op == "const" and eps.attr > 0
