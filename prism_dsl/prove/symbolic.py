"""Symbolic checking of axioms with SymPy: each operator as a formula, and a decision per rule.

`soundness` tests every rule numerically; this module then tries to decide it exactly. Both sides are
evaluated over arrays of SymPy symbols, with the rule shape semantics of `patterns.evaluate` and the
formulas in `FORMULAS` (what each operator means, as `ir.ops` documents it): an element-wise rule at scalar
symbols, which decides it for every shape; a rule with reductions, matrix products or row-wise ops at
small concrete shapes (sizes 1 to 3) whose every entry is a symbol, one shape for each way the rule's dim
variables can coincide with one another and with the dims it names, since that is all its meaning depends
on. Symbols are real, and positive or nonzero where the operators need it (`sampling.rule_domains`).

Each element of the difference of the two sides is decided by cheap means only (SymPy's automatic
simplification, `expand`, `cancel`; never `simplify`), under a size cap and a time limit:

- zero: that element is equal; when every element of every shape is, the rule is *proved symbolically*;
- clearly nonzero at some point of the domain, evaluated to 30 digits from exact rationals: the rule is
  *refuted*, with the point, the shape and the difference;
- neither (a `Max` that SymPy cannot order, an identity beyond `cancel`, a size or time limit): the rule
  stays *tested numerically*.

Layout operators (split, concat) and loop accumulators have no formula here: rules over them are tested
numerically only.
"""

from __future__ import annotations

import itertools
import math
import operator
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import sympy
from sympy.polys.polyerrors import BasePolynomialError

from ..ir.ops import DIMS, GELU_TANH_CUBIC, GELU_TANH_SCALE, OPS, Kind
from ..semantics.reference import rotate_half
from ..lang import syntax_tree as ast
from .patterns import IllFormed, Semantics, distinct_digits, sides
from .rules import DimVar, Lit, Rule
from .sampling import TINY, Instance, instances, named_dims, ones, rule_domains, rule_seed

MAX_SHAPES = 8  # symbolic shape instances per rule
PER_CLASS = 2  # of those, for one way the dims coincide (with different size-1 dims)
MAX_NODES = 2000  # a difference larger than this (in SymPy nodes) is not expanded
MAX_TERMS = 20000  # nor one whose expansion could have more terms than this (`_expanded_terms`)
SECONDS = 5.0  # CPU seconds per rule (the default library's slowest takes under 1); past it, tested numerically
REFUTE_RTOL = 1e-12  # a difference this large (relative to the sides) at 30 digits is not rounding
POINT_MAGNITUDES = (1, 10, 300)  # the points of the domain where an undecided rule is evaluated exactly


def _max(x, y):
    """max(x, y) with terms common to both taken out, so max(a + s, b + s) is max(a, b) + s."""
    common = Counter(sympy.Add.make_args(x)) & Counter(sympy.Add.make_args(y))
    if not common:
        return sympy.Max(x, y)
    c = sympy.Add(*common.elements())
    return sympy.Max(x - c, y - c) + c


_max_ufunc = np.frompyfunc(_max, 2, 1)


def _elementwise(f, nin: int = 1):
    u = np.frompyfunc(f, nin, 1)
    return lambda *xs: np.asarray(u(*xs), dtype=object)


def _sigmoid(x):
    return 1 / (1 + sympy.exp(-x))


def _sum(x, axis):
    return np.asarray(np.sum(x, axis=axis, keepdims=True), dtype=object)


def _mean(x, axis):
    return _sum(x, axis) * sympy.Rational(1, x.shape[axis])


def _rowwise(f):
    return lambda *xs: np.asarray(f(*xs), dtype=object)



_sqrt = _elementwise(sympy.sqrt)
_exp = _elementwise(sympy.exp)

FORMULAS = {
    "add": _elementwise(operator.add, 2),
    "sub": _elementwise(operator.sub, 2),
    "mul": _elementwise(operator.mul, 2),
    "div": _elementwise(operator.truediv, 2),
    "matmul": np.matmul,  # on object arrays: sums of products of the entries
    "neg": _elementwise(operator.neg),
    "exp": _exp,
    "sqrt": _sqrt,
    "rsqrt": _elementwise(lambda x: 1 / sympy.sqrt(x)),
    "square": _elementwise(lambda x: x**2),
    "sigmoid": _elementwise(_sigmoid),
    "silu": _elementwise(lambda x: x * _sigmoid(x)),
    "gelu": _elementwise(lambda x: x / 2 * (1 + sympy.erf(x / sympy.sqrt(2)))),
    "relu": _elementwise(lambda x: _max(x, sympy.Integer(0))),
    "tanh": _elementwise(sympy.tanh),
    # sqrt(2 / pi) as the reference and the GPU hold it (a double), so the axiom that writes it out is exact
    "gelu_tanh": _elementwise(lambda x: x / 2 * (1 + sympy.tanh(sympy.Rational(repr(GELU_TANH_SCALE))
                                                                  * (x + sympy.Rational(repr(GELU_TANH_CUBIC)) * x**3)))),
    "sum": _sum,
    "mean": _mean,
    "max": lambda x, axis: np.asarray(_max_ufunc.reduce(x, axis=axis, keepdims=True), dtype=object),
    "rms_norm": _rowwise(lambda x: x / _sqrt(_mean(x * x, -1))),
    "rms_norm_eps": _rowwise(lambda x, e: x / _sqrt(_mean(x * x, -1) + e)),
    "layer_norm": _rowwise(lambda x, e: (x - _mean(x, -1)) / _sqrt(_mean((x - _mean(x, -1)) ** 2, -1) + e)),
    "softmax": _rowwise(lambda x: _exp(x) / _sum(_exp(x), -1)),
    "rope": _rowwise(lambda x, c, s: x * c + rotate_half(x) * s),
    "transpose": lambda x, i, j: np.swapaxes(x, i, j),
}
SYMPY = Semantics(FORMULAS, lambda n: sympy.Rational(n.text) if _exact(n.text) else sympy.Float(n.value),
                  lambda x: np.asarray(x, dtype=object))


class _OutOfTime(Exception):
    """The rule's CPU time ran out while SymPy built a side (`_timed`)."""


def _timed(deadline: float) -> Semantics:
    """SYMPY, each operator first checking the rule's deadline: a side SymPy takes long to build (softmax nested
    15 deep, each level's automatic simplification longer than the last) stops at the first operator past it,
    where a check between the elements of the built sides would come only after it was built."""
    def timed(f):
        def within(*args):
            if time.process_time() > deadline:
                raise _OutOfTime
            return f(*args)
        return within
    return Semantics({name: timed(f) for name, f in FORMULAS.items()}, SYMPY.number, SYMPY.asarray)


def _exact(text: str) -> bool:
    try:
        sympy.Rational(text)
    except (TypeError, ValueError, SyntaxError):
        return False
    return True


@dataclass(frozen=True)
class Outcome:
    proved: bool = False
    refuted: bool = False
    why: str = ""  # refuted: where the sides differ; otherwise, when not proved: why not decided


def decide(rule: Rule) -> Outcome:
    """Decide the rule with SymPy where cheap means can (see the module doc)."""
    ops = _ops(rule.lhs) | _ops(rule.rhs)
    missing = sorted(op for op in ops if op not in FORMULAS)
    if missing:
        return Outcome(why=f"SymPy has no formula for {', '.join(missing)}")
    elementwise = all(OPS[op].kind in (Kind.UNARY, Kind.BINARY) for op in ops)
    if elementwise:
        shapes = [Instance({v: () for v in rule.tensor_vars}, {})]
    else:
        shapes = _shapes(rule)
        if isinstance(shapes, str):
            return Outcome(why=shapes)
    domains = rule_domains(rule)
    rng = np.random.default_rng(rule_seed(rule))
    deadline = time.process_time() + SECONDS
    for inst in shapes:
        try:
            outcome = _decide_at(rule, inst, domains, rng, deadline, scalar=elementwise)
        except _OutOfTime:
            return Outcome(why=f"SymPy did not decide it within {SECONDS:g} s of CPU time")
        except (ArithmeticError, TypeError, ValueError, RecursionError, NotImplementedError, BasePolynomialError) as e:
            # SymPy's own errors on formulas it cannot handle (a Max of terms it cannot order, a
            # polynomial it cannot build): not a verdict on the rule, which stays tested numerically.
            return Outcome(why=f"SymPy failed on it ({e.__class__.__name__})")
        if not outcome.proved:
            return outcome
    return Outcome(proved=True)


def _ops(e: ast.Expr) -> set[str]:
    if isinstance(e, ast.Call):
        return {e.fn}.union(*(_ops(a) for a in e.args[: OPS[e.fn].operands]))
    return set()


def _shapes(rule: Rule) -> list[Instance] | str:
    """Small shapes, a few for each way the dim variables coincide with each other and with the dims the
    rule names (and -1, -2 where matmul or row-wise ops treat them apart), the most informative first."""
    found = instances(rule, rule.lhs, rule_seed(rule), TINY, want=60)
    if not found:
        return "no small shapes make its left side well formed"
    kinds = {OPS[op].kind for op in _ops(rule.lhs) | _ops(rule.rhs)}
    special = {-1, -2} if Kind.MATMUL in kinds else {-1} if Kind.ROWWISE in kinds else set()
    items = sorted(rule.dim_vars) + sorted(set(named_dims(rule)) | special)

    def pattern(dims: dict[str, int]) -> tuple[bool, ...]:
        value = [dims[x] if isinstance(x, str) else x for x in items]
        return tuple(x == y for x, y in itertools.combinations(value, 2))

    groups: dict[tuple, list[Instance]] = {}
    for inst in sorted(found, key=lambda inst: ones(rule, inst)):
        groups.setdefault(pattern(inst.dims), []).append(inst)
    if len(groups) > MAX_SHAPES:
        return f"its dims coincide in {len(groups)} ways, more than the {MAX_SHAPES} shapes SymPy is given"
    dvars = sorted(rule.dim_vars)
    if len(dvars) > 3:
        return f"it has {len(dvars)} dim variables; SymPy is given rules with 3 at most"
    for values in itertools.product(DIMS, repeat=len(dvars)):
        dims = dict(zip(dvars, values))
        if _dims_allowed(rule, dims) and pattern(dims) not in groups:
            shown = ", ".join(f"{d} = {v}" for d, v in dims.items())
            return f"no small shape was found with its dims as at {shown}"
    patterns = [_distinct_patterns(members) for members in groups.values()]
    chosen = [inst for rank in range(PER_CLASS) for found_here in patterns for inst in found_here[rank : rank + 1]]
    return chosen[:MAX_SHAPES]


def _dims_allowed(rule: Rule, dims: dict[str, int]) -> bool:
    """Whether the conditions between dims alone (`i != j`, `i != -1`) allow this binding."""
    for c in rule.conditions:
        sides = [dims.get(o.name) if isinstance(o, DimVar) else o.value if isinstance(o, Lit) else None
                 for o in (c.lhs, c.rhs)]
        if None not in sides and (sides[0] == sides[1]) != (c.op == "=="):
            return False
    return True


def _distinct_patterns(members: list[Instance]) -> list[Instance]:
    """Instances whose size-1 dims differ (broadcasting shows only where a size is 1), first of each."""
    out: dict[tuple, Instance] = {}
    for inst in members:
        pattern = tuple((v, tuple(s == 1 for s in shape)) for v, shape in sorted(inst.shapes.items()))
        out.setdefault(pattern, inst)
    return list(out.values())


def _symbols(inst: Instance, domains: dict[str, str]) -> dict[str, np.ndarray]:
    values = {}
    for v, shape in inst.shapes.items():
        dom = domains.get(v, "")
        assume = {"real": True, "positive": dom == "positive" or None, "nonzero": dom == "nonzero" or None}
        assume = {k: a for k, a in assume.items() if a}
        cells = np.empty(shape, dtype=object)
        for idx in np.ndindex(*shape):
            cells[idx] = sympy.Symbol(f"{v}[{', '.join(map(str, idx))}]" if shape else v, **assume)
        values[v] = cells
    return values


def _decide_at(rule: Rule, inst: Instance, domains, rng, deadline: float, scalar: bool) -> Outcome:
    """Every element of the difference zero (proved), or a point where one clearly is not (refuted)."""
    values = _symbols(inst, domains)
    try:
        left, right = sides(rule.lhs, rule.rhs, values, inst.dims, _timed(deadline))
    except IllFormed:
        return Outcome(why="its right side is ill formed at a small shape")  # the numeric check says more
    if left.shape != right.shape:
        return Outcome(why="its sides have different shapes")  # the numeric check rejects it first
    for idx in np.ndindex(*left.shape):
        if time.process_time() > deadline:
            return Outcome(why=f"SymPy did not decide it within {SECONDS:g} s of CPU time")
        if _zero(sympy.sympify(left[idx]) - sympy.sympify(right[idx])):
            continue
        refuted = _refute(rule, inst, values, domains, rng, deadline)
        if refuted:
            return Outcome(refuted=True, why=f"SymPy shows its sides differ at {refuted}")
        where = "" if scalar else f" at {inst.describe()}, element {list(idx)}"
        return Outcome(why=f"SymPy could not show its sides equal{where}")
    return Outcome(proved=True)


def _size_within(d, cap: int) -> bool:
    """Whether `d` has at most `cap` nodes (counting stops there)."""
    return next(itertools.islice(sympy.preorder_traversal(d), cap, None), None) is None


def _expanded_terms(e) -> int:
    """An upper bound of the terms `sympy.expand` would make of `e` (and of any argument of a function in
    it), capped just above MAX_TERMS: a small expression such as square(square(...(a + b + c)...)) expands
    to millions of terms, which no time check between elements could stop."""
    if e.is_Atom:
        return 1
    if e.is_Add:
        return min(sum(_expanded_terms(a) for a in e.args), MAX_TERMS + 1)
    if e.is_Mul:
        return min(math.prod(_expanded_terms(a) for a in e.args), MAX_TERMS + 1)
    if e.is_Pow and e.exp.is_Integer and e.exp > 1:
        k = _expanded_terms(e.base)
        return MAX_TERMS + 1 if k > MAX_TERMS or int(e.exp) > MAX_TERMS else min(math.comb(k + int(e.exp) - 1, int(e.exp)), MAX_TERMS + 1)
    return 1 if all(_expanded_terms(a) <= MAX_TERMS for a in e.args) else MAX_TERMS + 1  # a function: one term


def _zero(d) -> bool:
    """Whether cheap SymPy means show `d` to be zero."""
    if d == 0:
        return True
    if not _size_within(d, MAX_NODES) or _expanded_terms(d) > MAX_TERMS:
        return False
    d = sympy.expand(d)
    if d == 0:
        return True
    if not _size_within(d, MAX_NODES):
        return False
    return sympy.cancel(sympy.together(d)) == 0


def _refute(rule: Rule, inst: Instance, symbols: dict[str, np.ndarray], domains, rng, deadline: float) -> str:
    """The first point found where the sides clearly differ, or only one is a real number, in words."""
    for magnitude in POINT_MAGNITUDES:
        point = {v: _point(cells, domains.get(v, ""), rng, magnitude) for v, cells in symbols.items()}
        left, right = sides(rule.lhs, rule.rhs, point, inst.dims, _timed(deadline))
        for idx in np.ndindex(*left.shape):
            why = _differ(sympy.sympify(left[idx]), sympy.sympify(right[idx]))
            if why:
                return f"{_show(inst, point)}{f', element {list(idx)}' if idx else ''}: {why}"
    return ""


def _point(cells: np.ndarray, domain: str, rng, magnitude: int) -> np.ndarray:
    """Exact rationals of the domain's sign, near `magnitude` in size, one per cell."""
    out = np.empty(cells.shape, dtype=object)
    for idx in np.ndindex(*cells.shape):
        x = sympy.Rational(int(rng.integers(1, 1000)), int(rng.integers(1, 1000))) * magnitude
        out[idx] = x if domain == "positive" or rng.random() < 0.5 else -x
    return out


def _differ(l, r) -> str:
    lv, rv = _value(l), _value(r)
    if lv is None or rv is None:
        return ""
    real_l, real_r = _is_real(lv), _is_real(rv)
    if real_l != real_r:
        side, other = ("left", "right") if real_l else ("right", "left")
        return f"its {side} side is a real number ({(lv if real_l else rv).real:.6g}) and its {other} side is not"
    diff = _value(l - r)
    if not real_l or diff is None:
        return ""
    if abs(diff) > REFUTE_RTOL * max(1.0, abs(lv), abs(rv)):
        left, right = distinct_digits(lv.real, rv.real)
        return f"left {left}, right {right} (difference {diff.real:.3g})"
    return ""


def _value(expr) -> complex | None:
    """A number's value to 30 digits; None where it is undefined (a pole, a NaN)."""
    try:
        z = complex(sympy.N(expr, 30))
    except (TypeError, ValueError, ArithmeticError, AttributeError):
        return None
    return z if np.isfinite(z) else None


def _is_real(z: complex) -> bool:
    return abs(z.imag) <= 1e-20 * max(1.0, abs(z.real))


def _show(inst: Instance, point: dict[str, np.ndarray]) -> str:
    """The point, in words: each variable's value (the first few of a tensor, after its shape), each dim's."""
    parts = []
    for v in sorted(point):
        x = point[v]
        if x.shape == ():
            parts.append(f"{v} = {x[()]}")
        else:
            flat = [str(c) for c in x.flat]
            parts.append(f"{v}{list(x.shape)} = [{', '.join(flat[:3])}{', ...' if len(flat) > 3 else ''}]")
    parts += [f"{d} = {value}" for d, value in sorted(inst.dims.items())]
    return ", ".join(parts)
