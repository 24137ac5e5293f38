"""Random instances of a rule: shapes at which its patterns are well formed and its conditions hold,
and values for its variables. `soundness` compares both sides there with float64 numbers, `symbolic`
(with the small sizes of TINY) with SymPy formulas.

The draws are wide on purpose, since a rule that is false only somewhere is still false: sizes from 1 up
to 64 (primes among them, at most two large dims per instance and a cap on elements), every dim down to
the deepest the prover tracks for dim variables, and values at magnitudes from 1e-8 to 1e8 of both signs
where the operators' domains allow. Every draw is seeded by the rule's name (`rule_seed`), so a verdict
is the same on every run.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass

import numpy as np

from ..ir.ops import DIMS, LOOP_DIM, MAX_RANK, OPS, Kind
from ..lang import syntax_tree as ast
from .patterns import IllFormed, evaluate, strip_ones
from .rules import DimVar, Lit, Rule, ShapeOf, SizeOf, literal_dim

SHAPE_TRIES = 4000  # random shape draws per direction of a rule
SHAPE_INSTANCES = 40  # well-formed shape instances whose result shapes are compared, per direction
SPLIT_INSTANCES = 150  # for rules over splits, whose wrong cases need particular dims and sizes
INSTANCES = 12  # of those, instances whose values are compared (more when the dims need them)
BROADCAST_INSTANCES = 16  # and at most this many more, one for each way of broadcasting not among them
SMALL_SIZES = (2, 3, 4, 5)
LARGE_SIZES = (6, 7, 8, 11, 13, 16, 17, 23, 32, 64)  # primes and powers of two beyond the small sizes
MAX_LARGE = 2  # large dims per instance, so that a tensor stays small
SAMPLE_MAX_ELEMENTS = 4096  # per tensor
DIM_WEIGHTS = (5, 4, 3, 2, 2, 2, 2, 2, 2)  # the last dims matter most (matmul and row-wise ops treat them apart)

# Value draws, each at every instance whose values are compared: standard normal (or 0.5 .. 2 where a
# domain says so), magnitudes spread over 1e-3 .. 1e3 within one tensor, all large, all small, all positive,
# and far beyond those both ways, log-uniform (a rule wrong only past a threshold, relu(a - 5000) => a * 0, or
# only near 0, tanh(a * 1e5) => a / sqrt(a * a), passed the others); signs at random except where a domain
# says positive.
MAGNITUDES = {"normal": (0.5, 2.0), "wide": (1e-3, 1e3), "large": (1e2, 1e3), "small": (1e-3, 1e-2),
              "positive": (0.5, 2.0), "huge": (1e3, 1e8), "tiny": (1e-8, 1e-3)}
DRAW_KINDS = tuple(MAGNITUDES)


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
        if isinstance(d, str):
            return -self.dims[:, self.dvars.index(d)] - 1
        return np.full(len(self.dims), -d - 1)

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


def oversized(rule: Rule) -> int | None:
    """A size a condition of `rule` fixes past what a sampled tensor holds (`size(x, -1) == 8192`), or None."""
    for c in rule.conditions:
        for a, b in ((c.lhs, c.rhs), (c.rhs, c.lhs)):
            if c.op == "==" and isinstance(a, SizeOf) and isinstance(b, Lit) and b.value > SAMPLE_MAX_ELEMENTS:
                return b.value
    return None


def shape_of(e: ast.Expr, inst: Instance) -> tuple[int, ...]:
    zeros = {v: np.ones(s) for v, s in inst.shapes.items()}  # ones: no division by zero warnings
    with np.errstate(all="ignore"):
        return np.shape(evaluate(e, zeros, inst.dims))


def instances(rule: Rule, first: ast.Expr, seed: int, sizes: _Sizes = WIDE, want: int | None = None) -> list[Instance]:
    """Distinct shape instances where `first` is well formed and the conditions hold, largest first."""
    rng = np.random.default_rng(seed)
    want = want or (SPLIT_INSTANCES if rule.count_vars else SHAPE_INSTANCES)
    depth = _depth(rule)
    found: dict[tuple, Instance] = {}
    # Batches of 250 draws, each drawn only when the one before is used up.
    for inst in itertools.chain.from_iterable(_draw(rule, rng, 250, depth, sizes) for _ in range(0, SHAPE_TRIES, 250)):
        key = inst.key()
        if key in found or not holds(rule, inst):
            continue
        try:
            shape_of(first, inst)
        except IllFormed:
            continue
        found[key] = inst
        if len(found) >= want:
            break
    return sorted(found.values(), key=lambda i: -sum(math.prod(s) for s in i.shapes.values()))


def ones(rule: Rule, inst: Instance) -> int:
    """How many size-1 dims the instance has where the rule looks: the last two dims and those it names.
    Fewer is more informative: a size-1 dim hides the difference between a sum of products and a
    product of sums, and a reduction over a size-1 dim does nothing."""
    looked = {-1, -2} | set(named_dims(rule)) | {v for d, v in inst.dims.items() if d in rule.dim_vars}
    return sum(_size(shape, d) == 1 for shape in inst.shapes.values() for d in looked)


def broadcast_pattern(inst: Instance) -> tuple:
    """Which dims of each variable are 1: where broadcasting happens, and the only thing about a shape that can
    make a rule true at one instance and false at another of the same ranks (causal(a + b) against
    causal(a) + b differs only where a has one row and b more)."""
    return tuple((v, tuple(s == 1 for s in shape)) for v, shape in sorted(inst.shapes.items()))


def for_values(rule: Rule, found: list[Instance], limit: int = INSTANCES) -> list[Instance]:
    """The instances whose values are compared.

    First one for every value each dim variable takes among the instances (a rule false only at a deep
    dim shows), then those with the fewest size-1 dims and scalars, where a wrong rule shows (a size-1
    factor hides the difference between a sum of products and a product of sums), and the two smallest;
    then one of every way the variables broadcast (`broadcast_pattern`) not among those yet, up to
    BROADCAST_INSTANCES more, where a rule wrong only when one operand broadcasts shows.
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
    chosen += [i for i in found[-2:] if i not in chosen]
    seen = {broadcast_pattern(i) for i in chosen}
    for inst in reversed(found):  # the smallest first: they cost least
        if len(chosen) >= limit + BROADCAST_INSTANCES:
            break
        if broadcast_pattern(inst) not in seen:
            chosen.append(inst)
            seen.add(broadcast_pattern(inst))
    return chosen


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


def draw_values(inst: Instance, domains: dict[str, str], rng: np.random.Generator, kind: str, scale: float) -> dict:
    """Values for every variable of the instance: one draw of `kind` (see MAGNITUDES), times `scale`."""
    values = {}
    for v, shape in inst.shapes.items():
        dom = "positive" if kind == "positive" else domains.get(v, "")
        if kind == "normal" and not dom:
            values[v] = rng.standard_normal(shape)
            continue
        low, high = MAGNITUDES[kind]
        if kind in ("wide", "huge", "tiny"):  # log-uniform: every magnitude in between as likely
            magnitude = 10.0 ** rng.uniform(np.log10(low), np.log10(high), shape)
        else:
            magnitude = rng.uniform(low, high, shape)
        sign = 1.0 if dom == "positive" else rng.choice((-1.0, 1.0), shape)
        values[v] = magnitude * sign * scale
    return values


def rule_seed(rule: Rule) -> int:
    return int.from_bytes(hashlib.sha256(rule.name.encode()).digest()[:8], "little")
