"""Numeric soundness checking of axioms, independent of egglog.

Every rule is instantiated with random float64 tensors at several random shapes that make its left side
well formed and satisfy its conditions, and both sides are evaluated with the reference semantics
(`reference.NUMPY`). A rule whose sides differ, or whose right side is ill formed or differently shaped
where its left side is fine, is rejected with its name and location.

Shapes in rules follow numpy broadcasting to the end: a tensor is viewed as having as many leading
size-1 dims as an operation needs (a reduction over dim -3 of a matrix reduces a size-1 dim; a vector
in a matmul is a 1-row matrix), and two shapes are the same if they differ only by leading 1s. This is
what lets one rule with negative dims serve tensors of every rank, and it agrees with the e-graph's shape
facts, where a dim beyond a tensor's rank has size 1.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import numpy as np

from . import ast, cache
from .errors import Collector
from .ops import LOOP_DIM, OPS, Kind
from .reference import NUMPY
from .rules import DimVar, Library, Lit, Rule, ShapeOf, SizeOf, literal_dim

SHAPE_TRIES = 4000  # random shape draws per direction of a rule
SHAPE_INSTANCES = 40  # well-formed shape instances whose result shapes are compared, per direction
SPLIT_INSTANCES = 150  # for rules over splits, whose wrong cases need particular dims and sizes
INSTANCES = 8  # of those, instances whose values are compared
DRAWS = 2  # value draws per instance
RTOL, ATOL = 1e-7, 1e-9


class _IllFormed(Exception):
    """The pattern does not make sense at these shapes (a broadcast or matmul mismatch)."""


def _strip(shape: tuple[int, ...]) -> tuple[int, ...]:
    i = 0
    while i < len(shape) and shape[i] == 1:
        i += 1
    return shape[i:]


def _pad(x: np.ndarray, rank: int) -> np.ndarray:
    return x.reshape((1,) * (rank - x.ndim) + x.shape) if x.ndim < rank else x


def evaluate(e: ast.Expr, values: dict[str, np.ndarray], dims: dict[str, int]) -> np.ndarray:
    """A pattern's value for the given variable values, with rule shape semantics (see module doc)."""
    match e:
        case ast.Num():
            return np.float64(e.value)
        case ast.Name():
            return values[e.id]
        case ast.Call():
            spec = OPS[e.fn]
            args = [np.asarray(evaluate(a, values, dims)) for a in e.args[: spec.operands]]
            params = [dims[a.id] if isinstance(a, ast.Name) else literal_dim(a) for a in e.args[spec.operands :]]
            if spec.kind in (Kind.SPLIT, Kind.CONCAT, Kind.ACCUMULATE):
                try:
                    return NUMPY[e.fn](*args, *params)
                except ValueError as err:
                    raise _IllFormed(str(err)) from None
            try:
                return _apply(e.fn, spec.kind, args, params)
            except ValueError as err:
                raise _IllFormed(str(err)) from None
    raise TypeError(e)


def _apply(op: str, kind: Kind, args: list[np.ndarray], params: list[int]) -> np.ndarray:
    if kind is Kind.MATMUL:
        a, b = (_pad(x, 2) for x in args)
        if a.shape[-1] != b.shape[-2]:
            raise ValueError("matmul inner dims differ")
        np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        return np.matmul(a, b)
    if kind is Kind.BINARY:
        np.broadcast_shapes(args[0].shape, args[1].shape)
    if kind is Kind.REDUCE:
        (x,), (dim,) = args, params
        return NUMPY[op](_pad(x, -dim), dim)
    if kind is Kind.ROWWISE:
        args = [_pad(args[0], 1)]
    return NUMPY[op](*args)


@dataclass(frozen=True)
class Instance:
    shapes: dict[str, tuple[int, ...]]
    dims: dict[str, int]

    def describe(self) -> str:
        parts = [f"{v}{list(s)}" for v, s in sorted(self.shapes.items())]
        parts += [f"{d} = {v}" for d, v in sorted(self.dims.items())]
        return ", ".join(parts)


def _size(shape: tuple[int, ...], dim: int) -> int:
    return shape[dim] if -len(shape) <= dim < 0 else 1


def _operand(o, inst: Instance):
    match o:
        case SizeOf(var=v, dim=d):
            return _size(inst.shapes[v], inst.dims[d] if isinstance(d, str) else d)
        case ShapeOf(var=v):
            return _strip(inst.shapes[v])
        case DimVar(name=n):
            return inst.dims[n]
        case Lit(value=v):
            return v
    raise TypeError(o)


def holds(rule: Rule, inst: Instance) -> bool:
    for c in rule.conditions:
        a, b = _operand(c.lhs, inst), _operand(c.rhs, inst)
        if (a == b) != (c.op == "=="):
            return False
    return True


def _random_instance(rule: Rule, rng: random.Random, deepest: int) -> Instance:
    """Random shapes (ranks 0 .. 3, and up to the deepest dim the rule names) and dim values."""
    ranks = tuple(range(max(3, deepest) + 1))
    shapes = {}
    for v in sorted(rule.tensor_vars):
        rank = rng.choices(ranks, weights=(1, 2, 4, 3) + (3,) * (len(ranks) - 4))[0]
        shapes[v] = tuple(1 if rng.random() < 0.2 else rng.randint(2, 5 if rank <= 3 else 3) for _ in range(rank))
    # Rules over splits range over every dim a tile family has (data and block dims alike), so a rule
    # that is only true when its dims are of one kind shows; other rules over the dims most programs use.
    # The last two dims matter most (matmul and row-wise ops treat them apart), so they are drawn more.
    choices = (-1, -1, -1, -2, -2) + tuple(range(-1, -deepest - 1, -1)) if rule.count_vars else (-1, -1, -2, -3)
    dims = {d: rng.choice(choices) for d in sorted(rule.dim_vars)}
    dims.update({c: rng.choice((1, 2, 2, 3)) for c in sorted(rule.count_vars)})
    if deepest > 3:
        # Rules about tile families (`layout`) split a data dim (-1 .. -5) into a block dim (-6 .. -9) that
        # must have size 1: draw such shapes often, so that enough instances are well formed.
        for v, shape in shapes.items():
            if len(shape) > 5 and rng.random() < 0.7:
                shapes[v] = tuple(1 if i < len(shape) - 5 and rng.random() < 0.8 else s for i, s in enumerate(shape))
    return Instance(shapes, dims)


def _deepest_dim(rule: Rule) -> int:
    """How far back from the end the rule's literal dims reach (3 for `sum(a, -3)`)."""
    deepest = [-d for c in rule.conditions for o in (c.lhs, c.rhs) if isinstance(o, SizeOf) and isinstance(d := o.dim, int)]
    stack = [rule.lhs, rule.rhs]
    while stack:
        e = stack.pop()
        if isinstance(e, ast.Call):
            spec = OPS[e.fn]
            deepest += [-d for a in e.args[spec.operands :] if (d := literal_dim(a)) is not None]
            stack.extend(e.args[: spec.operands])
            if spec.kind in (Kind.ACCUMULATE, Kind.SPLIT, Kind.CONCAT):
                deepest.append(-LOOP_DIM)  # tile families reach the loop dim (see `layout`)
    return max(deepest, default=1)


def _shape_of(e: ast.Expr, inst: Instance) -> tuple[int, ...]:
    zeros = {v: np.ones(s) for v, s in inst.shapes.items()}  # ones: no division by zero warnings
    with np.errstate(all="ignore"):
        return np.shape(evaluate(e, zeros, inst.dims))


def _instances(rule: Rule, first: ast.Expr, rng: random.Random) -> list[Instance]:
    """Distinct shape instances where `first` is well formed and the conditions hold, largest first."""
    found: dict[tuple, Instance] = {}
    deepest = _deepest_dim(rule)
    for _ in range(SHAPE_TRIES):
        inst = _random_instance(rule, rng, deepest)
        key = (tuple(sorted(inst.shapes.items())), tuple(sorted(inst.dims.items())))
        if key in found or not holds(rule, inst):
            continue
        try:
            _shape_of(first, inst)
        except _IllFormed:
            continue
        found[key] = inst
        if len(found) >= (SPLIT_INSTANCES if rule.count_vars else SHAPE_INSTANCES):
            break
    return sorted(found.values(), key=lambda i: -sum(np.prod(s) for s in i.shapes.values()))


def _for_values(instances: list[Instance]) -> list[Instance]:
    """The instances whose values are compared.

    Mostly those with the fewest size-1 dims and scalars, where a wrong rule shows (a size-1 factor
    hides the difference between a sum of products and a product of sums), plus the smallest ones,
    where broadcasting by size-1 dims is exercised.
    """
    if len(instances) <= INSTANCES:
        return instances
    def ones(i: Instance) -> int:
        return sum(s.count(1) + (len(s) == 0) for s in i.shapes.values())
    informative = sorted(instances, key=ones)[: INSTANCES - 2]
    return informative + [i for i in instances[-2:] if i not in informative]


def _domains(e: ast.Expr, out: dict[str, str]) -> dict[str, str]:
    """Variables that an operator needs in a domain (sqrt's operand positive, a divisor nonzero)."""
    if isinstance(e, ast.Call):
        spec = OPS[e.fn]
        for a, dom in zip(e.args, spec.domains):
            if dom and isinstance(a, ast.Name) and out.get(a.id) != "positive":
                out[a.id] = dom
        for a in e.args:
            _domains(a, out)
    return out


def _values(inst: Instance, domains: dict[str, str], rng: np.random.Generator, all_positive: bool) -> dict:
    values = {}
    for v, shape in inst.shapes.items():
        dom = "positive" if all_positive else domains.get(v, "")
        if dom == "positive":
            values[v] = rng.uniform(0.5, 2.0, shape)
        elif dom == "nonzero":
            values[v] = rng.uniform(0.5, 2.0, shape) * rng.choice((-1.0, 1.0), shape)
        else:
            values[v] = rng.standard_normal(shape)
    return values


def check_rule(rule: Rule) -> str | None:
    """None if the rule holds on every instance tried; otherwise why not, in words."""
    seed = int.from_bytes(hashlib.sha256(rule.name.encode()).digest()[:8], "little")
    rng, nrng = random.Random(seed), np.random.default_rng(seed)
    directions = [(rule.lhs, rule.rhs, "left", "right")]
    if rule.both_ways:
        directions.append((rule.rhs, rule.lhs, "right", "left"))
    # A variable is drawn from an operator's domain only where both sides need it there: a rule that is
    # defined on one side and not on the other (sqrt(a) * sqrt(b) against sqrt(a * b)) must show it.
    left, right = _domains(rule.lhs, {}), _domains(rule.rhs, {})
    domains = {v: ("positive" if d == right[v] == "positive" else "nonzero") for v, d in left.items() if v in right}
    evaluated = 0
    for first, second, fname, sname in directions:
        instances = _instances(rule, first, rng)
        if not instances:
            return f"no shapes make its {fname} side well formed (tried {SHAPE_TRIES} random shapes)"
        for inst in instances:
            try:
                shape1, shape2 = _shape_of(first, inst), _shape_of(second, inst)
            except _IllFormed as e:
                return f"its {sname} side is ill formed where the {fname} side is fine, at {inst.describe()} ({e})"
            if _strip(shape1) != _strip(shape2):
                return (
                    f"its sides have different shapes at {inst.describe()}: "
                    f"{fname} {list(shape1)}, {sname} {list(shape2)}"
                )
        # Splits need size-1 dims (where the pieces go), which `_for_values` avoids: rules over splits
        # compare values at every instance found.
        for inst in instances if rule.count_vars else _for_values(instances):
            for draw in range(DRAWS + 1):
                problem, finite = _compare(first, second, fname, sname, inst, domains, nrng, all_positive=draw == DRAWS)
                if problem:
                    return problem
                evaluated += finite
    if not evaluated:
        return "no instance gave finite values on both sides, so it could not be checked"
    return None


def _compare(first, second, fname, sname, inst, domains, rng, all_positive) -> tuple[str | None, bool]:
    values = _values(inst, domains, rng, all_positive)
    with np.errstate(all="ignore"):
        a = np.asarray(evaluate(first, values, inst.dims), dtype=np.float64)
        b = np.asarray(evaluate(second, values, inst.dims), dtype=np.float64)
    a, b = np.broadcast_arrays(a.reshape(_strip(a.shape) or ()), b.reshape(_strip(b.shape) or ()))
    fa, fb = np.isfinite(a), np.isfinite(b)
    if (fa != fb).any():
        # One side is defined where the other is not (sqrt(a * b) against sqrt(a) * sqrt(b) at negative
        # a and b): the rule would change a program's value.
        idx = tuple(int(i) for i in np.argwhere(fa != fb)[0])
        return (
            f"at {inst.describe()} one side is finite and the other is not: "
            f"{fname} {a[idx]:.6g}, {sname} {b[idx]:.6g} at index {idx}",
            False,
        )
    both = fa & fb  # out of an operator's domain on both sides: no evidence either way
    if not both.any():
        return None, False
    a, b = a[both], b[both]
    bad = ~np.isclose(a, b, rtol=RTOL, atol=ATOL * max(1.0, float(np.abs(a).max(initial=0))))
    if bad.any():
        i = int(np.argmax(bad))  # the first disagreement among the positions finite on both sides
        idx = tuple(int(k) for k in np.argwhere(both)[i])
        return (
            f"its sides differ at {inst.describe()}: {fname} {a[i]:.6g}, {sname} {b[i]:.6g} at index {idx}",
            True,
        )
    return None, True


# Bump when the check itself changes, so that rules passed by an older check are checked again.
CHECK_VERSION = "4"


def check_library(library: Library, *, use_cache: bool = True) -> None:
    """Raise one PrismError naming every rule of the library that fails the numeric check.

    A rule that passed before (same meaning, same check) is not checked again: loading the default
    library on every `prove` would otherwise cost about a second.
    """
    errors = Collector()
    for rule in library.rules:
        key = cache.digest("soundness", CHECK_VERSION, rule.name, rule.canonical())
        if use_cache and cache.read("sound", key) is True:
            continue
        why = check_rule(rule)
        if why:
            errors.error(rule.loc, f"rule '{rule.name}' is unsound: {why}")
        elif use_cache:
            cache.write("sound", key, True)
    errors.raise_if_any()
