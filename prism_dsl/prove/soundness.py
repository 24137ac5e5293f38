"""Soundness checking of axioms, independent of egglog: numerically for every rule, symbolically where SymPy can.

Every rule is instantiated with random float64 tensors at many random shapes that make its left side well
formed and satisfy its conditions, and both sides are evaluated with the reference semantics
(`semantics.reference.NUMPY`, with the rule shape semantics of `patterns`; the draws are `sampling`'s).
A rule whose sides differ, or whose right side is ill formed or differently shaped where its left side is
fine, is rejected with its name and location. A draw that overflows float64 is compared only where both
sides stay finite, and drawn again at half the scale, so that overflow is never taken for a difference.

A rule that passes is then given to SymPy (`symbolic`): if SymPy shows both sides equal, the rule is
*proved symbolically*; if it shows they differ, the rule is rejected; otherwise it stays *tested
numerically*. The verdict of each rule is cached by content in the user cache.
"""

from __future__ import annotations

import functools
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import numpy as np

from . import symbolic
from ..base import cache, forked
from ..base.errors import Collector
from ..lang import syntax_tree as ast
from .patterns import IllFormed, distinct_digits, sides, strip_ones, unlike_non_finite
from .rules import Library, Rule, in_default_library
from .sampling import (DRAW_KINDS, SAMPLE_MAX_ELEMENTS, SHAPE_TRIES, Instance, draw_values, for_values, instances,
                       oversized, rule_domains, rule_seed, shape_of)

RTOL, ATOL = 1e-7, 1e-9
OVERFLOW_RETRIES = 9  # a draw that overflows or underflows float64 is halved in scale, this many times at most


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


class Unchecked(str):
    """Why a rule could not be checked at all (no shapes found, or no finite values): not a counterexample."""


def check_numerically(rule: Rule) -> str | None:
    """None if the rule holds on every instance and value draw tried; otherwise why not, in words (an `Unchecked`
    where nothing could be compared)."""
    seed = rule_seed(rule)
    nrng = np.random.default_rng(seed)
    domains = rule_domains(rule)
    evaluated = 0
    for n, way in enumerate(_directions(rule)):
        found = instances(rule, way.first, seed + n)
        if not found:
            return Unchecked(f"no shapes make its {way.fname} side well formed (tried {SHAPE_TRIES} random shapes): "
                             "it could never apply, or only at shapes too rare to draw")
        problem = _compare_shapes(way, found)
        if problem:
            return problem
        # Splits need size-1 dims (where the pieces go), which `for_values` avoids: rules over splits
        # compare values at every instance found, with two kinds of draw each (the kinds in turn).
        if rule.count_vars:
            plan = [(inst, kind) for k, inst in enumerate(found)
                    for kind in ("normal", DRAW_KINDS[1 + k % (len(DRAW_KINDS) - 1)])]
        else:
            plan = [(inst, kind) for inst in for_values(rule, found) for kind in DRAW_KINDS]
        for inst, kind in plan:
            problem, finite = _compare_draw(way, inst, domains, nrng, kind)
            if problem:
                return problem
            evaluated += finite
    if not evaluated:
        return Unchecked("no instance gave finite values on both sides")
    return None


def _compare_shapes(way: _Direction, found: list[Instance]) -> str | None:
    for inst in found:
        try:
            shape1, shape2 = shape_of(way.first, inst), shape_of(way.second, inst)
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
        values = draw_values(inst, domains, rng, kind, 0.5**halvings)
        try:
            with np.errstate(over="raise", under="raise", invalid="ignore", divide="ignore"):
                a, b = np.broadcast_arrays(*sides(way.first, way.second, values, inst.dims))
        except FloatingPointError:
            continue
        return _compare(way, inst, a, b)
    return None, False


def _compare(way: _Direction, inst: Instance, a: np.ndarray, b: np.ndarray) -> tuple[str | None, bool]:
    fname, sname = way.fname, way.sname
    fa, fb = np.isfinite(a), np.isfinite(b)
    if (fa != fb).any():
        # One side is defined where the other is not (sqrt(a * b) against sqrt(a) * sqrt(b) at negative
        # a and b): the rule would change a program's value.
        idx = tuple(int(i) for i in np.argwhere(fa != fb)[0])
        return (f"at {inst.describe()} one side is finite and the other is not: "
                f"{fname} {a[idx]:.6g}, {sname} {b[idx]:.6g} at index {idx}", False)
    unlike = unlike_non_finite(a, b)
    if unlike.any():
        # Not finite on both sides, but not the same: NaN against a mask's -inf (causal(x) - causal(y) against
        # causal(x - y)), or +inf against -inf. A draw that overflowed was drawn again above, so this is the rule's.
        idx = tuple(int(i) for i in np.argwhere(unlike)[0])
        return (f"at {inst.describe()} its sides are not finite and differ: {fname} {a[idx]:.6g}, {sname} "
                f"{b[idx]:.6g} at index {idx}", False)
    both = fa & fb  # NaN on both sides, out of an operator's domain: no evidence either way
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


# -- verdicts ------------------------------------------------------------------------------------------

SYMBOLIC, NUMERIC_ONLY, UNSOUND, UNCHECKED = "symbolic", "numeric", "unsound", "unchecked"
STATUS_WORDS = {SYMBOLIC: "proved symbolically", NUMERIC_ONLY: "tested numerically"}


@dataclass(frozen=True)
class Verdict:
    status: str  # SYMBOLIC, NUMERIC_ONLY, UNSOUND, or UNCHECKED (refused like UNSOUND: nothing could be compared)
    why: str = ""  # UNSOUND, UNCHECKED: why, in words; NUMERIC_ONLY: why SymPy did not decide it


def judge(rule: Rule) -> Verdict:
    """Test the rule numerically, then try to decide it with SymPy."""
    problem = check_numerically(rule)
    if problem:
        return Verdict(UNCHECKED if isinstance(problem, Unchecked) else UNSOUND, problem)
    outcome = symbolic.decide(rule)
    if outcome.refuted:
        return Verdict(UNSOUND, outcome.why)
    return Verdict(SYMBOLIC if outcome.proved else NUMERIC_ONLY, "" if outcome.proved else outcome.why)


def check_rule(rule: Rule) -> str | None:
    """None if the rule is sound as far as the checks can tell; otherwise why not, in words."""
    verdict = judge(rule)
    return verdict.why if verdict.status in (UNSOUND, UNCHECKED) else None


# Bump when the check's meaning changes in a way its code does not show (the code is in the key too).
CHECK_VERSION = "5"


@functools.cache
def _code() -> str:
    """A digest of the code a verdict comes from: a verdict of other code is judged again."""
    return cache.code_digest("prove/soundness.py", "prove/patterns.py", "prove/sampling.py", "prove/symbolic.py",
                             "ir", "semantics")


def verdict_key(rule: Rule) -> str:
    return cache.digest("soundness", CHECK_VERSION, _code(), rule.name, rule.canonical())


def cacheable(rule: Rule) -> bool:
    """Whether a verdict on `rule` may come from the cache: only for the default library's rules.

    A cached verdict is a claim anyone who can write the cache can make: for a rule of the default
    library (sound, and tested by the suite) an edited "unsound" is judged again (`_cached`), and an edited
    "symbolic" can at worst say a rule proved that was tested, while for a user's rule an edited "sound" would
    let a false rule into proofs. A user's rules are judged on every load.
    """
    return in_default_library(rule.loc.path)


def check_library(library: Library, *, use_cache: bool = True, jobs: int | None = None) -> dict[str, str]:
    """Each rule's status by name, SYMBOLIC or NUMERIC_ONLY; raise one PrismError naming every unsound rule.

    A rule of the default library judged before (same meaning, same code) is not judged again: loading
    it on every `prove` would otherwise cost seconds. A user's rules are judged every time (`cacheable`).
    Verdicts are kept in the cache and, within one process, in memory too (a cache directory without them).
    The rules to judge are judged in up to `jobs` processes at once (default: every core; `base.forked`):
    each rule's check is independent and seeded by the rule alone, so the verdicts are those of one process.
    """
    errors = Collector()
    statuses: dict[str, str] = {}
    keys: dict[str, str] = {}  # rule name -> its verdict key, "" where the cache is not used for it
    verdicts: dict[str, Verdict] = {}
    for rule in library.rules:
        size = oversized(rule)
        if size is not None:
            errors.error(rule.loc, f"rule '{rule.name}' cannot be checked: a condition fixes a size of {size}, past the "
                         f"{SAMPLE_MAX_ELEMENTS} elements of the tensors its check draws; state it for any size, or for "
                         "one of at most that")
            continue
        key = keys[rule.name] = verdict_key(rule) if use_cache and cacheable(rule) else ""
        if key and (verdict := _cached(key)) is not None:
            verdicts[rule.name] = verdict
        elif key and (verdict := _JUDGED.get(key)) is not None:  # judged here, for another cache directory
            verdicts[rule.name] = verdict
            cache.write("sound", key, {"status": verdict.status, "why": verdict.why})
    todo = [rule for rule in library.rules if rule.name in keys and rule.name not in verdicts]
    for rule, verdict in zip(todo, _judge_all(todo, jobs or forked.cores())):
        verdicts[rule.name] = verdict
        if keys[rule.name]:
            cache.write("sound", keys[rule.name], {"status": verdict.status, "why": verdict.why})
    for rule in library.rules:
        if rule.name not in keys:
            continue
        verdict = verdicts[rule.name]
        if verdict.status in (UNSOUND, UNCHECKED):
            errors.error(rule.loc, f"rule '{rule.name}' {'is unsound' if verdict.status == UNSOUND else 'cannot be checked'}"
                         f": {verdict.why}")
        else:
            statuses[rule.name] = verdict.status
            if keys[rule.name]:
                _JUDGED[keys[rule.name]] = verdict
    errors.raise_if_any()
    return statuses


_TO_JUDGE: list[Rule] = []  # the rules `_judge_all` gives its forked processes, set before they are forked


def _judge_all(rules: list[Rule], jobs: int) -> list[Verdict]:
    """`judge` of each rule, in order: in up to `jobs` forked processes where that is safe and there are rules
    enough, else here. A rule whose process died (the pool is then broken) is judged here."""
    global _TO_JUDGE
    if not forked.usable(jobs, len(rules)):
        return [judge(rule) for rule in rules]
    _TO_JUDGE = rules
    try:
        with forked.pool(min(jobs, len(rules))) as pool:
            futures = [pool.submit(_judge_forked, i) for i in range(len(rules))]
            out = []
            for rule, future in zip(rules, futures):
                try:
                    out.append(future.result())
                except BrokenProcessPool:
                    out.append(judge(rule))
            return out
    finally:
        _TO_JUDGE = []


def _judge_forked(i: int) -> Verdict:
    return judge(_TO_JUDGE[i])


_JUDGED: dict[str, Verdict] = {}  # the verdicts that a default-library rule is sound this process judged or read, by
# `verdict_key`: a cache directory that lacks them (another one, none at all) does not have them judged again


def _cached(key: str) -> Verdict | None:
    """A cached verdict that the rule is sound (how: symbolically or numerically). One that it is unsound (or could
    not be checked) is judged again: the default library's rules are sound (the suite checks them), so such an entry
    is an edited one, and a cache may make prismc faster, never stop it."""
    value = cache.read("sound", key, lambda v: isinstance(v, dict) and isinstance(v.get("why"), str)
                       and v.get("status") in (SYMBOLIC, NUMERIC_ONLY, UNSOUND, UNCHECKED))
    return None if value is None or value["status"] in (UNSOUND, UNCHECKED) else Verdict(value["status"], value["why"])
