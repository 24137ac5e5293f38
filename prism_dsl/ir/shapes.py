"""Shape and dtype rules, one per operator kind, over symbolic sizes.

`infer(op, operands, params)` gives the result's (dtype, shape) or raises `ShapeError` with a message for
people. Sizes are SymPy expressions; two sizes agree only if they are equal for every binding of the dims
(`same`), so a program that checks here is well shaped at every size.
"""

from __future__ import annotations

import weakref
from typing import Callable, Sequence

import sympy

from .accumulators import ACCUMULATORS
from .nodes import DType, Node, Shape
from .ops import LOOP_DIM, OPS, Kind


class ShapeError(Exception):
    """A shape or dtype mismatch; the checker attaches the location."""


def same(a: sympy.Expr, b: sympy.Expr) -> bool:
    return a == b or sympy.expand(a - b) == 0


def same_shape(a: Shape, b: Shape) -> bool:
    """The same rank and the same size in every dim, for every binding of the dims."""
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def fmt_shape(shape: Shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


# Mixed storage types compute in the narrowest type that holds both (numpy's rule, with bf16 beside f16).
_RANK = {DType.F16: 1, DType.BF16: 1, DType.F32: 2, DType.F64: 3}


def promote(a: DType | None, b: DType | None) -> DType | None:
    if a is None or a == b:
        return b
    if b is None:
        return a
    if _RANK[a] == _RANK[b]:  # f16 with bf16: neither holds the other
        return DType.F32
    return a if _RANK[a] > _RANK[b] else b


def broadcast(a: Shape, b: Shape) -> Shape:
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else sympy.Integer(1)
        y = b[-i] if i <= len(b) else sympy.Integer(1)
        if same(x, y) or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            raise ShapeError(f"shapes {fmt_shape(a)} and {fmt_shape(b)} do not broadcast: {x} vs {y}")
    return tuple(reversed(out))


def _unary(args: Sequence[Node], params) -> tuple[DType | None, Shape]:
    return args[0].dtype, args[0].shape


def _binary(args: Sequence[Node], params) -> tuple[DType | None, Shape]:
    a, b = args
    return promote(a.dtype, b.dtype), broadcast(a.shape, b.shape)


def _matmul(args: Sequence[Node], params) -> tuple[DType | None, Shape]:
    a, b = args
    if a.rank < 2 or b.rank < 2:
        bad = a if a.rank < 2 else b
        raise ShapeError(f"operands need rank 2 or more, got {fmt_shape(bad.shape)}")
    if not same(a.shape[-1], b.shape[-2]):
        raise ShapeError(
            f"inner dims differ: {a.shape[-1]} (last of {fmt_shape(a.shape)}) "
            f"vs {b.shape[-2]} (second to last of {fmt_shape(b.shape)})"
        )
    try:
        batch = broadcast(a.shape[:-2], b.shape[:-2])
    except ShapeError as e:
        raise ShapeError(f"batch dims: {e}") from None
    return promote(a.dtype, b.dtype), batch + (a.shape[-2], b.shape[-1])


def normalize_dim(dim: int, rank: int) -> int:
    if not -rank <= dim < rank:
        valid = f"{-rank}..{rank - 1}" if rank else "none"
        raise ShapeError(f"dim {dim} is out of range for a rank-{rank} tensor (valid: {valid})")
    return dim % rank


def _reduce(args: Sequence[Node], params) -> tuple[DType | None, Shape]:
    (x,), (dim,) = args, params
    axis = normalize_dim(dim, x.rank)
    return x.dtype, x.shape[:axis] + (sympy.Integer(1),) + x.shape[axis + 1 :]


def _rowwise(args: Sequence[Node], params) -> tuple[DType | None, Shape]:
    """The shape of the first operand (what it works along), the others (an epsilon, rope's tables)
    broadcast against it."""
    x = args[0]
    if x.rank < 1:
        raise ShapeError("needs a tensor of rank 1 or more (it works along the last dim)")
    shape, dtype = x.shape, x.dtype
    for a in args[1:]:
        shape, dtype = broadcast(shape, a.shape), promote(dtype, a.dtype)
    return dtype, shape


def _transpose(args: Sequence[Node], params) -> tuple[DType | None, Shape]:
    (x,), (i, j) = args, params
    i, j = normalize_dim(i, x.rank), normalize_dim(j, x.rank)
    shape = list(x.shape)
    shape[i], shape[j] = shape[j], shape[i]
    return x.dtype, tuple(shape)


def _mask(args: Sequence[Node], params) -> tuple[DType | None, Shape]:
    if args[0].rank < 2:
        raise ShapeError(f"needs a tensor of rank 2 or more (rows and columns), got {fmt_shape(args[0].shape)}")
    shape = args[0].shape
    for a in args[1:]:  # causal_at's places
        shape = broadcast(shape, a.shape)
    return args[0].dtype, shape


def _position(args: Sequence[Node], params) -> tuple[DType | None, Shape]:
    (x,), (dim,) = args, params
    if not -x.rank <= dim < 0:
        raise ShapeError(f"dim {dim} is not a dim of a rank-{x.rank} tensor counted from the end")
    return None, (x.shape[dim],) + (sympy.Integer(1),) * (-dim - 1)


def _accumulate(args: Sequence[Node], params) -> tuple[DType | None, Shape]:
    """At block level the result has the shape of one iteration's value (the rule of the op kind the
    accumulator is `like`), with the last dim folded to 1 for a row accumulator; in a tile family (rank
    above KERNEL_RANK, see `prove.layout`) the loop dim also folds to 1."""
    acc = ACCUMULATORS[params[0]]
    dtype, shape = RULES[Kind(acc.like)](args, ())
    if acc.row:
        if not shape:
            raise ShapeError("needs a tile of rank 1 or more (it works along the last dim)")
        shape = shape[:-1] + (sympy.Integer(1),)
    if len(shape) >= -LOOP_DIM:
        shape = shape[:LOOP_DIM] + (sympy.Integer(1),) + (shape[LOOP_DIM + 1 :] if LOOP_DIM + 1 else ())
    return dtype, shape


def padded(shape: Shape, *dims: int) -> Shape:
    """`shape` with leading 1s so that every (negative) dim in `dims` exists."""
    rank = max(len(shape), *(-d for d in dims))
    return (sympy.Integer(1),) * (rank - len(shape)) + tuple(shape)


def _split(args: Sequence[Node], params) -> tuple[DType | None, Shape]:
    dim, block, count = params
    shape = list(padded(args[0].shape, dim, block))
    shape[dim], shape[block] = shape[dim] / count, sympy.sympify(count)
    return args[0].dtype, tuple(shape)


def _concat(args: Sequence[Node], params) -> tuple[DType | None, Shape]:
    dim, block = params
    shape = list(padded(args[0].shape, dim, block))
    shape[dim], shape[block] = shape[dim] * shape[block], sympy.Integer(1)
    return args[0].dtype, tuple(shape)


RULES: dict[Kind, Callable] = {
    Kind.ACCUMULATE: _accumulate,
    Kind.SPLIT: _split,
    Kind.CONCAT: _concat,
    Kind.UNARY: _unary,
    Kind.BINARY: _binary,
    Kind.MATMUL: _matmul,
    Kind.REDUCE: _reduce,
    Kind.ROWWISE: _rowwise,
    Kind.TRANSPOSE: _transpose,
    Kind.MASK: _mask,
    Kind.POSITION: _position,
}


def infer(op: str, args: Sequence[Node], params: Sequence[int] = ()) -> tuple[DType | None, Shape]:
    if OPS[op].kind is Kind.ACCUMULATE:
        params = (op,)
    dtype, shape = RULES[OPS[op].kind](args, params)
    if op == "rope":
        _rope(args[0].shape, shape)
    return dtype, shape


def _rope(x: Shape, shape: Shape) -> None:
    """rope rotates the halves of x's last dim, and its tables only scale x's elements."""
    half = x[-1] / 2
    if half.is_integer is False:
        raise ShapeError(f"needs an even last dim (it rotates its two halves), got {fmt_shape(x)}")
    if len(shape) != len(x) or not all(same(a, b) for a, b in zip(shape, x)):
        raise ShapeError(f"its tables must broadcast to the shape of x, {fmt_shape(x)}; together they make {fmt_shape(shape)}")


_BUILT: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (op, args, params) -> node, while it lives


def build(op: str, args: Sequence[Node], params: Sequence[int] = ()) -> Node:
    """The node for `op(args, params)` with its inferred type; reductions store the normalized dim. Nodes are
    interned, so one built before from the same operands is that node: its shape is not inferred again (the
    search builds the same terms many times)."""
    key = (op, tuple(args), tuple(params))
    node = _BUILT.get(key)
    if node is None:
        node = _BUILT[key] = _build(op, args, params)
    return node


def _build(op: str, args: Sequence[Node], params: Sequence[int]) -> Node:
    dtype, shape = infer(op, args, params)
    attr = None
    if OPS[op].kind is Kind.REDUCE:
        attr = normalize_dim(params[0], args[0].rank)
    elif OPS[op].kind is Kind.TRANSPOSE:
        attr = tuple(normalize_dim(p, args[0].rank) for p in params)
    elif OPS[op].kind in (Kind.SPLIT, Kind.CONCAT):
        attr = tuple(params)
    elif OPS[op].kind is Kind.POSITION:
        attr = params[0]
    return Node(op, tuple(args), attr, dtype, shape)


def dim_params(n: Node) -> list[int]:
    """The dims `n`'s op takes as parameters (a reduction's, a transpose's), counted from the end."""
    kind = OPS[n.op].kind
    if kind is Kind.REDUCE:
        return [n.attr - n.rank]
    if kind is Kind.TRANSPOSE:
        return [d - n.rank for d in n.attr]
    if kind is Kind.POSITION:
        return [n.attr]
    return []


def rebuild(n: Node, args: Sequence[Node]) -> Node:
    """`n`'s op (and a reduction's dim) over other operands."""
    kind = OPS[n.op].kind
    return build(n.op, args, [n.attr] if kind in (Kind.REDUCE, Kind.POSITION) else list(n.attr) if kind is Kind.TRANSPOSE else [])


def independent_dims(nodes: Sequence[Node]) -> set[sympy.Symbol]:
    """The dims along which every value of a program (its `nodes`) is computed element by element: no product
    contracts them, no reduction or row-wise op (a norm, a softmax, RoPE's partners) works along them, no mask
    places by them. Such a dim indexes independent rows: computed over more of them, the first ones are as
    before, which lets a compile round it up to a size its tiles divide (`pipeline.padding`). Empty where the
    program has custom kernels (their tiles and loops are not looked into)."""
    seen: set[sympy.Symbol] = set()
    bound: set[sympy.Symbol] = set()

    def along(n: Node, *dims: int) -> None:
        bound.update(*(n.shape[d].free_symbols for d in dims if -n.rank <= d < n.rank))

    for n in nodes:
        seen.update(*(s.free_symbols for s in n.shape if isinstance(s, sympy.Basic)))
        kind = OPS[n.op].kind
        if kind in (Kind.ACCUMULATE, Kind.TILE, Kind.KERNEL, Kind.SPLIT, Kind.CONCAT, Kind.POSITION):
            return set()
        if any(isinstance(s, sympy.Basic) and not isinstance(s, sympy.Symbol) and s.free_symbols for s in n.shape):
            bound.update(*(s.free_symbols for s in n.shape if isinstance(s, sympy.Basic)))  # a size made of dims
        if kind is Kind.MATMUL:
            a, b = n.args
            along(a, -1)
            along(b, -2 if b.rank > 1 else -1)
        elif kind is Kind.REDUCE:
            along(n.args[0], n.attr)
        elif kind is Kind.ROWWISE:
            for a in n.args:
                along(a, -1)
        elif kind is Kind.MASK:
            for a in n.args:
                along(a, -1, -2)
    return seen - bound
