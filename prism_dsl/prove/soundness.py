"""Soundness checking of axioms, independent of egglog: numerically for every rule, symbolically where SymPy can.

Every rule is instantiated with random float64 tensors at many random shapes that make its left side well
formed and satisfy its conditions, and both sides are evaluated with the reference semantics
(`reference.NUMPY`). A rule whose sides differ, or whose right side is ill formed or differently shaped
where its left side is fine, is rejected with its name and location. The draws are wide on purpose, since
a rule that is false only somewhere is still false: sizes from 1 up to 64 (primes among them, at most two
large dims per instance and a cap on elements), every dim down to the deepest the prover tracks for dim
variables, and values at magnitudes from 1e-3 to 1e3 of both signs where the operators' domains allow.
A draw that overflows float64 is compared only where both sides stay finite, and drawn again at half the
scale, so that overflow is never taken for a difference.

A rule that passes is then given to SymPy (`symbolic`): if SymPy shows both sides equal, the rule is
*proved symbolically*; if it shows they differ, the rule is rejected; otherwise it stays *tested
numerically*. The verdict of each rule is cached by content in the user cache.

Shapes in rules follow numpy broadcasting to the end: a tensor is viewed as having as many leading
size-1 dims as an operation needs (a reduction over dim -3 of a matrix reduces a size-1 dim; a vector
in a matmul is a 1-row matrix), and two shapes are the same if they differ only by leading 1s. This is
what lets one rule with negative dims serve tensors of every rank, and it agrees with the e-graph's shape
facts, where a dim beyond a tensor's rank has size 1.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from ..lang import syntax_tree as ast

from ..base import cache
from ..base.errors import Collector
from ..ir.ops import DIMS, LOOP_DIM, MAX_RANK, OPS, Kind
from ..semantics.reference import NUMPY
from .rules import DimVar, Library, Lit, Rule, ShapeOf, SizeOf, default_files, literal_dim

SHAPE_TRIES = 4000  # random shape draws per direction of a rule
SHAPE_INSTANCES = 40  # well-formed shape instances whose result shapes are compared, per direction
SPLIT_INSTANCES = 150  # for rules over splits, whose wrong cases need particular dims and sizes
INSTANCES = 12  # of those, instances whose values are compared (more when the dims need them)
RTOL, ATOL = 1e-7, 1e-9
OVERFLOW_RETRIES = 9  # a draw that overflows or underflows float64 is halved in scale, this many times at most

SMALL_SIZES = (2, 3, 4, 5)
LARGE_SIZES = (6, 7, 8, 11, 13, 16, 17, 23, 32, 64)  # primes and powers of two beyond the small sizes
MAX_LARGE = 2  # large dims per instance, so that a tensor stays small
SAMPLE_MAX_ELEMENTS = 4096  # per tensor
DIM_WEIGHTS = (5, 4, 3, 2, 2, 2, 2, 2, 2)  # the last dims matter most (matmul and row-wise ops treat them apart)

# Value draws, each at every instance whose values are compared: standard normal (or 0.5 .. 2 where a
# domain says so), magnitudes spread over 1e-3 .. 1e3 within one tensor, all large, all small, all positive;
# signs at random except where a domain says positive.
MAGNITUDES = {"normal": (0.5, 2.0), "wide": (1e-3, 1e3), "large": (1e2, 1e3), "small": (1e-3, 1e-2),
              "positive": (0.5, 2.0)}
DRAW_KINDS = tuple(MAGNITUDES)


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


FLOAT64 = Semantics(NUMPY, lambda n: np.float64(n.value), np.asarray)


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
    if kind is Kind.REDUCE:
        (x,), (dim,) = args, params
        return fn(_pad(x, -dim), dim)
    if kind is Kind.ROWWISE:
        args = [_pad(args[0], 1)]
    return fn(*args)


@dataclass(frozen=True)
class Instance:
    shapes: dict[str, tuple[int, ...]]
    dims: dict[str, int]

    def describe(self) -> str:
        parts = [f"{v}{list(s)}" for v, s in sorted(self.shapes.items())]
        parts += [f"{d} = {v}" for d, v in sorted(self.dims.items())]
        return ", ".join(parts)

    def key(self) -> tuple:
        return tuple(sorted(self.shapes.items())), tuple(sorted(self.dims.items()))


def _size(shape: tuple[int, ...], dim: int) -> int:
    return shape[dim] if -len(shape) <= dim < 0 else 1


def _operand(o, inst: Instance):
    match o:
        case SizeOf(var=v, dim=d):
            return _size(inst.shapes[v], inst.dims[d] if isinstance(d, str) else d)
        case ShapeOf(var=v):
            return strip_ones(inst.shapes[v])
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


# -- drawing shape instances -------------------------------------------------------------------------


def named_dims(rule: Rule) -> list[int]:
    """Every literal dim the rule names, in its patterns and conditions."""
    found = [o.dim for c in rule.conditions for o in (c.lhs, c.rhs) if isinstance(o, SizeOf) and isinstance(o.dim, int)]
    stack = [rule.lhs, rule.rhs]
    while stack:
        e = stack.pop()
        if isinstance(e, ast.Call):
            spec = OPS[e.fn]
            found += [d for a in e.args[spec.operands :] if (d := literal_dim(a)) is not None and d < 0]
            stack.extend(e.args[: spec.operands])
            if spec.kind in (Kind.ACCUMULATE, Kind.SPLIT, Kind.CONCAT):
                found.append(LOOP_DIM)  # tile families reach the loop dim (see `layout`)
    return found


def _depth(rule: Rule) -> int:
    """How many dims from the end an instance draws: as deep as the rule's literal dims reach, and every
    dim the prover tracks when the rule has dim variables (the prover binds them to any of those)."""
    if rule.dim_vars or rule.count_vars:
        return MAX_RANK
    return max([3] + [-d for d in named_dims(rule)])


@dataclass(frozen=True)
class _Sizes:
    """Where an instance's sizes come from: `small` sizes, up to MAX_LARGE `large` ones, an element cap."""

    small: tuple[int, ...] = SMALL_SIZES
    large: tuple[int, ...] = LARGE_SIZES
    max_elements: int = SAMPLE_MAX_ELEMENTS


WIDE = _Sizes()
TINY = _Sizes((2, 3), (), 24)  # for the symbolic check: every entry becomes a symbol


def _draw(rule: Rule, rng: np.random.Generator, n: int, depth: int, sizes: _Sizes) -> list[Instance]:
    """`n` random instances: dims first, then sizes per dim position shared by the variables (so that most
    instances broadcast), each variable taking a size-1 dim or a neighbour's size at random, then the
    conditions and the splits of the rule made to hold where that is a matter of one size."""
    tvars, dvars, cvars = sorted(rule.tensor_vars), sorted(rule.dim_vars), sorted(rule.count_vars)
    weights = np.array(DIM_WEIGHTS[:depth], dtype=float)
    dims = rng.choice(np.array(DIMS[:depth]), size=(n, len(dvars)), p=weights / weights.sum())
    counts = rng.choice(np.array((1, 2, 2, 3, 4)), size=(n, len(cvars)))
    env = _Env(dims, counts, dvars, cvars)
    base = _base_sizes(rule, rng, n, depth, sizes, env)
    var_count = len(tvars)
    pick = rng.random((n, var_count, depth))
    neighbour = np.concatenate([base[:, 1:], base[:, -2:-1]], axis=1) if depth > 1 else base
    sizes_of = np.where(pick < 0.15, 1, np.where(pick < 0.23, neighbour[:, None, :], base[:, None, :]))
    # Ranks reach the dims the rule and its dim variables name, most of the time.
    named = max([1] + [-d for d in named_dims(rule)])
    needed = np.max(-dims, axis=1, initial=named) if dvars else np.full(n, named)
    ranks = rng.choice(np.arange(min(depth, 4) + 1), size=(n, var_count), p=_rank_weights(min(depth, 4)))
    ranks = np.where(rng.random((n, var_count)) < 0.6, np.maximum(ranks, needed[:, None]), ranks)
    sizes_of[np.arange(depth)[None, None, :] >= ranks[:, :, None]] = 1
    index = {v: k for k, v in enumerate(tvars)}
    _repair_splits(rule, sizes_of, index, env)
    _repair_conditions(rule, sizes_of, index, env)
    elements = np.prod(sizes_of.astype(np.int64), axis=2)
    ok = np.all(elements <= sizes.max_elements, axis=1) if var_count else np.ones(n, dtype=bool)
    out = []
    for t in np.flatnonzero(ok):
        shapes = {}
        for v, k in index.items():
            row = sizes_of[t, k]
            nonone = np.flatnonzero(row != 1)
            rank = max(int(ranks[t, k]), int(nonone[-1]) + 1 if len(nonone) else 0)
            shapes[v] = tuple(int(s) for s in row[:rank][::-1])
        bound = {d: int(dims[t, k]) for k, d in enumerate(dvars)}
        bound.update({c: int(counts[t, k]) for k, c in enumerate(cvars)})
        out.append(Instance(shapes, bound))
    return out


def _rank_weights(top: int) -> np.ndarray:
    w = np.array((1, 2, 4, 3, 2)[: top + 1], dtype=float)
    return w / w.sum()


@dataclass(frozen=True)
class _Env:
    dims: np.ndarray  # (n, dim variables)
    counts: np.ndarray  # (n, count variables)
    dvars: list[str]
    cvars: list[str]

    def dim(self, d) -> np.ndarray:
        """A dim argument (literal or variable) per instance, as the position from the end (0 is the last)."""
        n = len(self.dims)
        if isinstance(d, str):
            return -self.dims[:, self.dvars.index(d)] - 1
        return np.full(n, -d - 1)

    def count(self, g) -> np.ndarray:
        if isinstance(g, str):
            return self.counts[:, self.cvars.index(g)]
        return np.full(len(self.dims), g)


def _base_sizes(rule: Rule, rng: np.random.Generator, n: int, depth: int, sizes: _Sizes, env: _Env) -> np.ndarray:
    """A size per dim position and instance: mostly small, some large (at most MAX_LARGE), deep dims mostly 1
    except those the rule or its dim variables name."""
    shallow = np.arange(depth) < 3
    one = rng.random((n, depth)) < np.where(shallow, 0.15, 0.75)
    small = rng.choice(np.array(sizes.small), size=(n, depth))
    if sizes.large:
        large_here = rng.random((n, depth)) < np.where(shallow, 0.3, 0.1)
        large_here &= np.cumsum(large_here, axis=1) <= MAX_LARGE
        base = np.where(large_here, rng.choice(np.array(sizes.large), size=(n, depth)), small)
    else:
        base = small
    named = np.zeros((n, depth), dtype=bool)
    for d in named_dims(rule):
        if -d <= depth:
            named[:, -d - 1] = True
    for k in range(len(env.dvars)):
        named[np.arange(n), -env.dims[:, k] - 1] = True
    one &= ~(named & (rng.random((n, depth)) < 0.85))
    return np.where(one, 1, base)


def _split_args(e: ast.Expr):
    """(variable, dim, block dim, count) of every split applied directly to a variable in `e`."""
    if isinstance(e, ast.Call):
        if e.fn == "split" and isinstance(e.args[0], ast.Name):
            dim, block, count = (a.id if isinstance(a, ast.Name) else literal_dim(a) for a in e.args[1:])
            yield e.args[0].id, dim, block, count
        for a in e.args:
            yield from _split_args(a)


def _repair_splits(rule: Rule, sizes: np.ndarray, index: dict[str, int], env: _Env) -> None:
    """Make a split of a variable well formed: its block dim of size 1, its dim a multiple of the count."""
    rows = np.arange(len(sizes))
    depth = sizes.shape[2]
    for var, dim, block, count in _split_args(rule.lhs):
        i, j, g = env.dim(dim), env.dim(block), env.count(count)
        ok = (i != j) & (i < depth) & (j < depth)
        r, k = rows[ok], index[var]
        sizes[r, k, j[ok]] = 1
        sizes[r, k, i[ok]] = g[ok] * np.maximum(1, sizes[r, k, i[ok]] // g[ok])


def _repair_conditions(rule: Rule, sizes: np.ndarray, index: dict[str, int], env: _Env) -> None:
    """Make `==` conditions hold where one size (or one dim variable) decides them; `holds` checks the rest."""
    rows = np.arange(len(sizes))
    for c in rule.conditions:
        if c.op != "==":
            continue
        lhs, rhs = (c.lhs, c.rhs) if isinstance(c.lhs, SizeOf) or not isinstance(c.rhs, SizeOf) else (c.rhs, c.lhs)
        match lhs, rhs:
            case SizeOf(var=v, dim=d), SizeOf(var=w, dim=e):
                sizes[rows, index[w], env.dim(e)] = sizes[rows, index[v], env.dim(d)]
            case SizeOf(var=v, dim=d), Lit(value=value) if 1 <= value <= SAMPLE_MAX_ELEMENTS:
                sizes[rows, index[v], env.dim(d)] = value
            case SizeOf(var=v, dim=d), DimVar(name=g) if g in env.cvars:
                sizes[rows, index[v], env.dim(d)] = env.count(g)
            case ShapeOf(var=v), ShapeOf(var=w):
                sizes[:, index[w]] = sizes[:, index[v]]
            case DimVar(name=i), DimVar(name=j) if i in env.dvars and j in env.dvars:
                env.dims[:, env.dvars.index(j)] = env.dims[:, env.dvars.index(i)]


def _shape_of(e: ast.Expr, inst: Instance) -> tuple[int, ...]:
    zeros = {v: np.ones(s) for v, s in inst.shapes.items()}  # ones: no division by zero warnings
    with np.errstate(all="ignore"):
        return np.shape(evaluate(e, zeros, inst.dims))


def instances(rule: Rule, first: ast.Expr, seed: int, sizes: _Sizes = WIDE, want: int | None = None) -> list[Instance]:
    """Distinct shape instances where `first` is well formed and the conditions hold, largest first."""
    rng = np.random.default_rng(seed)
    want = want or (SPLIT_INSTANCES if rule.count_vars else SHAPE_INSTANCES)
    depth = _depth(rule)
    found: dict[tuple, Instance] = {}
    for _ in range(0, SHAPE_TRIES, 250):
        for inst in _draw(rule, rng, 250, depth, sizes):
            key = inst.key()
            if key in found or not holds(rule, inst):
                continue
            try:
                _shape_of(first, inst)
            except IllFormed:
                continue
            found[key] = inst
            if len(found) >= want:
                break
        if len(found) >= want:
            break
    return sorted(found.values(), key=lambda i: -sum(math.prod(s) for s in i.shapes.values()))


def ones(rule: Rule, inst: Instance) -> int:
    """How many size-1 dims the instance has where the rule looks: the last two dims and those it names.
    Fewer is more informative: a size-1 dim hides the difference between a sum of products and a
    product of sums, and a reduction over a size-1 dim does nothing."""
    looked = {-1, -2} | set(named_dims(rule)) | {v for d, v in inst.dims.items() if d in rule.dim_vars}
    return sum(_size(shape, d) == 1 for shape in inst.shapes.values() for d in looked)


def for_values(rule: Rule, found: list[Instance], limit: int = INSTANCES) -> list[Instance]:
    """The instances whose values are compared.

    First one for every value each dim variable takes among the instances (a rule false only at a deep
    dim shows), then those with the fewest size-1 dims and scalars, where a wrong rule shows (a size-1
    factor hides the difference between a sum of products and a product of sums), and the two smallest,
    where broadcasting by size-1 dims is exercised.
    """
    if len(found) <= limit:
        return found
    ranked = sorted(found, key=lambda inst: ones(rule, inst))
    chosen: list[Instance] = []
    covered: set[tuple[str, int]] = set()
    for inst in ranked:
        new = {(d, v) for d, v in inst.dims.items() if d in rule.dim_vars} - covered
        if new:
            chosen.append(inst)
            covered |= new
    for inst in ranked:
        if len(chosen) >= limit - 2:
            break
        if inst not in chosen:
            chosen.append(inst)
    return chosen + [i for i in found[-2:] if i not in chosen]


# -- values --------------------------------------------------------------------------------------------


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


def rule_domains(rule: Rule) -> dict[str, str]:
    """The domain ("positive" or "nonzero") of each variable that an operator on both sides restricts.

    A variable is drawn from an operator's domain only where both sides need it there: a rule that is
    defined on one side and not on the other (sqrt(a) * sqrt(b) against sqrt(a * b)) must show it.
    """
    left, right = _domains(rule.lhs, {}), _domains(rule.rhs, {})
    return {v: ("positive" if d == right[v] == "positive" else "nonzero") for v, d in left.items() if v in right}


def _values(inst: Instance, domains: dict[str, str], rng: np.random.Generator, kind: str, scale: float) -> dict:
    values = {}
    for v, shape in inst.shapes.items():
        dom = "positive" if kind == "positive" else domains.get(v, "")
        if kind == "normal" and not dom:
            values[v] = rng.standard_normal(shape)
            continue
        low, high = MAGNITUDES[kind]
        if kind == "wide":  # log-uniform: every magnitude in between as likely
            magnitude = 10.0 ** rng.uniform(np.log10(low), np.log10(high), shape)
        else:
            magnitude = rng.uniform(low, high, shape)
        sign = 1.0 if dom == "positive" else rng.choice((-1.0, 1.0), shape)
        values[v] = magnitude * sign * scale
    return values


# -- the numeric check ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Direction:
    first: ast.Expr
    second: ast.Expr
    fname: str
    sname: str


def _directions(rule: Rule) -> list[_Direction]:
    out = [_Direction(rule.lhs, rule.rhs, "left", "right")]
    if rule.both_ways:
        out.append(_Direction(rule.rhs, rule.lhs, "right", "left"))
    return out


def rule_seed(rule: Rule) -> int:
    return int.from_bytes(hashlib.sha256(rule.name.encode()).digest()[:8], "little")


def check_numerically(rule: Rule) -> str | None:
    """None if the rule holds on every instance and value draw tried; otherwise why not, in words."""
    seed = rule_seed(rule)
    nrng = np.random.default_rng(seed)
    domains = rule_domains(rule)
    evaluated = 0
    for n, way in enumerate(_directions(rule)):
        found = instances(rule, way.first, seed + n)
        if not found:
            return f"no shapes make its {way.fname} side well formed (tried {SHAPE_TRIES} random shapes)"
        problem = _compare_shapes(way, found)
        if problem:
            return problem
        # Splits need size-1 dims (where the pieces go), which `for_values` avoids: rules over splits
        # compare values at every instance found, with two kinds of draw each (the kinds in turn).
        if rule.count_vars:
            plan = [(inst, kind) for k, inst in enumerate(found) for kind in ("normal", DRAW_KINDS[1 + k % 4])]
        else:
            plan = [(inst, kind) for inst in for_values(rule, found) for kind in DRAW_KINDS]
        for inst, kind in plan:
            problem, finite = _compare_draw(way, inst, domains, nrng, kind)
            if problem:
                return problem
            evaluated += finite
    if not evaluated:
        return "no instance gave finite values on both sides, so it could not be checked"
    return None


def _compare_shapes(way: _Direction, found: list[Instance]) -> str | None:
    for inst in found:
        try:
            shape1, shape2 = _shape_of(way.first, inst), _shape_of(way.second, inst)
        except IllFormed as e:
            return f"its {way.sname} side is ill formed where the {way.fname} side is fine, at {inst.describe()} ({e})"
        if strip_ones(shape1) != strip_ones(shape2):
            return (f"its sides have different shapes at {inst.describe()}: "
                    f"{way.fname} {list(shape1)}, {way.sname} {list(shape2)}")
    return None


def _compare_draw(way: _Direction, inst: Instance, domains, rng, kind: str) -> tuple[str | None, bool]:
    """Compare both sides on one value draw; (why they differ or None, whether anything was compared).

    float64 loses what overflows or underflows (exp(a) * exp(b) is 0 where exp(a + b) is 1e-225), so a
    draw whose evaluation does either is drawn again at half the scale, until it does not: the values
    compared are the largest this rule's float64 evaluation can take. A draw that still does at 1/256 of
    its scale is no evidence: it could only show float64's limits, not the rule's.
    """
    for halvings in range(OVERFLOW_RETRIES):
        values = _values(inst, domains, rng, kind, 0.5**halvings)
        try:
            with np.errstate(over="raise", under="raise", invalid="ignore", divide="ignore"):
                a, b = _sides(way, inst, values)
        except FloatingPointError:
            continue
        return _compare(way, inst, a, b)
    return None, False


def _sides(way: _Direction, inst: Instance, values) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(evaluate(way.first, values, inst.dims), dtype=np.float64)
    b = np.asarray(evaluate(way.second, values, inst.dims), dtype=np.float64)
    return np.broadcast_arrays(a.reshape(strip_ones(a.shape) or ()), b.reshape(strip_ones(b.shape) or ()))


def _compare(way: _Direction, inst: Instance, a: np.ndarray, b: np.ndarray) -> tuple[str | None, bool]:
    fname, sname = way.fname, way.sname
    fa, fb = np.isfinite(a), np.isfinite(b)
    if (fa != fb).any():
        # One side is defined where the other is not (sqrt(a * b) against sqrt(a) * sqrt(b) at negative
        # a and b): the rule would change a program's value.
        idx = tuple(int(i) for i in np.argwhere(fa != fb)[0])
        return (f"at {inst.describe()} one side is finite and the other is not: "
                f"{fname} {a[idx]:.6g}, {sname} {b[idx]:.6g} at index {idx}", False)
    both = fa & fb  # out of an operator's domain on both sides: no evidence either way
    if not both.any():
        return None, False
    a, b = a[both], b[both]
    # The absolute tolerance follows the values' scale: values of 1e-3 are compared as closely as values of 1.
    scale = max(float(np.abs(a).max(initial=0)), float(np.abs(b).max(initial=0)), 1e-300)
    bad = ~np.isclose(a, b, rtol=RTOL, atol=ATOL * scale)
    if bad.any():
        i = int(np.argmax(bad))  # the first disagreement among the positions finite on both sides
        idx = tuple(int(k) for k in np.argwhere(both)[i])
        x, y = distinct_digits(float(a[i]), float(b[i]))
        return f"its sides differ at {inst.describe()}: {fname} {x}, {sname} {y} at index {idx}", True
    return None, True


def distinct_digits(x: float, y: float) -> tuple[str, str]:
    """Two different numbers written with as few digits as show that they differ (6 at least)."""
    for digits in range(6, 18):
        if f"{x:.{digits}g}" != f"{y:.{digits}g}":
            break
    return f"{x:.{digits}g}", f"{y:.{digits}g}"


# -- verdicts ------------------------------------------------------------------------------------------

SYMBOLIC, NUMERIC_ONLY, UNSOUND = "symbolic", "numeric", "unsound"
STATUS_WORDS = {SYMBOLIC: "proved symbolically", NUMERIC_ONLY: "tested numerically"}


@dataclass(frozen=True)
class Verdict:
    status: str  # SYMBOLIC, NUMERIC_ONLY or UNSOUND
    why: str = ""  # UNSOUND: why, in words; NUMERIC_ONLY: why SymPy did not decide it


def judge(rule: Rule) -> Verdict:
    """Test the rule numerically, then try to decide it with SymPy."""
    problem = check_numerically(rule)
    if problem:
        return Verdict(UNSOUND, problem)
    from . import symbolic  # SymPy's formulas build on this module's evaluation

    outcome = symbolic.decide(rule)
    if outcome.refuted:
        return Verdict(UNSOUND, outcome.why)
    return Verdict(SYMBOLIC if outcome.proved else NUMERIC_ONLY, "" if outcome.proved else outcome.why)


def check_rule(rule: Rule) -> str | None:
    """None if the rule is sound as far as the checks can tell; otherwise why not, in words."""
    verdict = judge(rule)
    return verdict.why if verdict.status == UNSOUND else None


# Bump when the check's meaning changes in a way its code does not show (the code is in the key too).
CHECK_VERSION = "5"


@functools.cache
def _code() -> str:
    """A digest of the code a verdict comes from: a verdict of other code is judged again."""
    return cache.code_digest("prove/soundness.py", "prove/symbolic.py", "ir", "semantics")


def verdict_key(rule: Rule) -> str:
    return cache.digest("soundness", CHECK_VERSION, _code(), rule.name, rule.canonical())


def cacheable(rule: Rule) -> bool:
    """Whether a verdict on `rule` may come from the cache: only for the default library's rules.

    A cached verdict is a claim anyone who can write the cache can make: for a rule of the default
    library (sound, and tested by the suite) it can at worst refuse a sound rule, while for a user's rule
    an edited "sound" would let a false rule into proofs. A user's rules are judged on every load.
    """
    return Path(rule.loc.path).resolve() in _default_paths(tuple(default_files()))


@functools.cache
def _default_paths(files: tuple[Path, ...]) -> frozenset[Path]:
    return frozenset(f.resolve() for f in files)


def check_library(library: Library, *, use_cache: bool = True) -> dict[str, str]:
    """Each rule's status by name, SYMBOLIC or NUMERIC_ONLY; raise one PrismError naming every unsound rule.

    A rule of the default library judged before (same meaning, same code) is not judged again: loading
    it on every `prove` would otherwise cost seconds. A user's rules are judged every time (`cacheable`).
    """
    errors = Collector()
    statuses: dict[str, str] = {}
    for rule in library.rules:
        use = use_cache and cacheable(rule)
        key = verdict_key(rule) if use else ""
        verdict = _cached(key) if use else None
        if verdict is None:
            verdict = judge(rule)
            if use:
                cache.write("sound", key, {"status": verdict.status, "why": verdict.why})
        if verdict.status == UNSOUND:
            errors.error(rule.loc, f"rule '{rule.name}' is unsound: {verdict.why}")
        else:
            statuses[rule.name] = verdict.status
    errors.raise_if_any()
    return statuses


def _cached(key: str) -> Verdict | None:
    value = cache.read("sound", key)
    if not isinstance(value, dict) or value.get("status") not in (SYMBOLIC, NUMERIC_ONLY, UNSOUND):
        return None
    why = value.get("why")
    return Verdict(value["status"], why) if isinstance(why, str) else None
