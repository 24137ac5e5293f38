"""A rule's patterns evaluated at concrete shapes, with the rule shape semantics.

Shapes in rules follow numpy broadcasting to the end: a tensor is viewed as having as many leading
size-1 dims as an operation needs (a reduction over dim -3 of a matrix reduces a size-1 dim; a vector
in a matmul is a 1-row matrix), and two shapes are the same if they differ only by leading 1s. This is
what lets one rule with negative dims serve tensors of every rank, and it agrees with the e-graph's shape
facts, where a dim beyond a tensor's rank has size 1.

The operators mean what `semantics.reference.NUMPY` says over float64 arrays (`FLOAT64`, for
`soundness`) or what `symbolic.FORMULAS` says over arrays of SymPy formulas (`symbolic.SYMPY`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from ..ir.ops import OPS, Kind
from ..lang import syntax_tree as ast
from ..semantics.reference import NUMPY
from .rules import literal_dim


class IllFormed(Exception):
    """The pattern does not make sense at these shapes (a broadcast or matmul mismatch)."""


def strip_ones(shape: tuple[int, ...]) -> tuple[int, ...]:
    i = 0
    while i < len(shape) and shape[i] == 1:
        i += 1
    return shape[i:]


def _pad(x: np.ndarray, rank: int) -> np.ndarray:
    return x.reshape((1,) * (rank - x.ndim) + x.shape) if x.ndim < rank else x


@dataclass(frozen=True)
class Semantics:
    """What the operators mean over one kind of array: float64 numbers here, SymPy formulas in `symbolic`."""

    ops: Mapping[str, Callable]
    number: Callable[[ast.Num], Any]
    asarray: Callable[[Any], np.ndarray]


FLOAT64 = Semantics(NUMPY, lambda n: np.float64(n.value), lambda x: np.asarray(x, dtype=np.float64))


def evaluate(e: ast.Expr, values: dict[str, np.ndarray], dims: dict[str, int], sem: Semantics = FLOAT64) -> np.ndarray:
    """A pattern's value for the given variable values, with rule shape semantics (see module doc)."""
    match e:
        case ast.Num():
            return sem.number(e)
        case ast.Name():
            return values[e.id]
        case ast.Call():
            spec = OPS[e.fn]
            args = [sem.asarray(evaluate(a, values, dims, sem)) for a in e.args[: spec.operands]]
            params = [dims[a.id] if isinstance(a, ast.Name) else literal_dim(a) for a in e.args[spec.operands :]]
            try:
                if spec.kind in (Kind.SPLIT, Kind.CONCAT, Kind.ACCUMULATE):
                    return sem.ops[e.fn](*args, *params)
                return _apply(sem.ops[e.fn], spec.kind, args, params)
            except ValueError as err:
                raise IllFormed(str(err)) from None
    raise TypeError(e)


def _apply(fn: Callable, kind: Kind, args: list[np.ndarray], params: list[int]) -> np.ndarray:
    if kind is Kind.MATMUL:
        a, b = (_pad(x, 2) for x in args)
        if a.shape[-1] != b.shape[-2]:
            raise ValueError("matmul inner dims differ")
        np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        return np.matmul(a, b)
    if kind is Kind.BINARY:
        np.broadcast_shapes(args[0].shape, args[1].shape)
    if kind in (Kind.REDUCE, Kind.POSITION):
        (x,), (dim,) = args, params
        return fn(_pad(x, -dim), dim)
    if kind is Kind.MASK:
        np.broadcast_shapes(*(a.shape for a in args))
        args = [_pad(args[0], 2), *args[1:]]
    if kind is Kind.ROWWISE:
        np.broadcast_shapes(*(a.shape for a in args))
        args = [_pad(args[0], 1), *args[1:]]
    if kind is Kind.TRANSPOSE:
        (x,), (i, j) = args, params
        return fn(_pad(x, max(-i, -j)), i, j)
    return fn(*args)


def sides(first: ast.Expr, second: ast.Expr, values: dict, dims: dict[str, int], sem: Semantics = FLOAT64):
    """Both patterns' values, each without its leading size-1 dims (shapes equal up to leading 1s)."""
    out = [sem.asarray(evaluate(e, values, dims, sem)) for e in (first, second)]
    return tuple(x.reshape(strip_ones(x.shape) or ()) for x in out)


def unlike_non_finite(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Where neither side is finite and they still differ: NaN against an inf (a causal mask's -inf subtracted from
    itself is NaN), or +inf against -inf. NaN on both sides, or the same inf, is alike."""
    return ~np.isfinite(a) & ~np.isfinite(b) & ~(np.isnan(a) & np.isnan(b)) & (a != b)


def distinct_digits(x: float, y: float) -> tuple[str, str]:
    """Two different numbers written with as few digits as show that they differ (6 at least)."""
    for digits in range(6, 18):
        if f"{x:.{digits}g}" != f"{y:.{digits}g}":
            break
    return f"{x:.{digits}g}", f"{y:.{digits}g}"
