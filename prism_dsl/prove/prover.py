"""Proving two programs equal with the e-graph: the trust base of everything the tool reports.

`prove(a, b, library, limits)` pairs the two programs' outputs, writes both as terms into one e-graph
loaded with the library's rules, and saturates under the limits. An output pair is *proved* only when
egglog puts both terms in one e-class; a limit reached is "not proved", with the reason; a proof that could
not run (egglog's child failed) is an error, never taken for either answer.
As a guard on the axioms themselves, both programs are also evaluated with the reference interpreter,
at several bindings of the dims (size-1 dims and primes among them) with a new random seed each: a
proof of two programs that differ numerically means an unsound rule, and is reported as such, never
as a proof. `explain` finds a small set of rules that still proves the pair, by dropping rules one at
a time (egglog keeps no proof objects to read it from).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

import numpy as np

from . import egglog_runner
from .egglog_runner import Limits
from .egraph import TermWriter, compile_library, program_terms, ruleset_name
from ..base.errors import PrismError
from ..ir.nodes import Program
from .layout import to_terms
from .patterns import unlike_non_finite
from ..ir.ops import MAX_RANK
from ..semantics.blocks import evaluate
from ..semantics.reference import concrete_shape, random_inputs
from .rules import Library, Rule, in_default_library
from ..ir.shapes import fmt_shape, same_shape

NUMERIC_DIM_CAP = 24  # numeric evidence is taken at small sizes: it is a guard, not the proof
GUARD_PRIMES = (5, 3, 7, 2, 11, 13, 17, 19, 23)
GUARD_SINGLE_ONES = 6  # programs with at most this many dims are also compared with each dim alone at 1
GUARD_ELEMENTS = 1 << 18  # the declared sizes are compared when the inputs hold at most this many elements
GUARD_HALVINGS = 8  # an element defined differently on the two sides is looked at again at inputs halved, to 1/256
SHAPES_DIFFER = "not needed: the outputs' shapes differ"  # `Proof.numeric_why` where no numbers were compared so


@dataclass(frozen=True)
class Pair:
    name: str  # the output's name in the first program
    other: str  # its partner's name in the second
    proved: bool


@dataclass(frozen=True)
class Proof:
    proved: bool
    pairs: tuple[Pair, ...]
    reason: str
    iterations: int = 0
    nodes: int = 0
    seconds: float = 0.0
    numeric_gap: float | None = None  # largest relative difference seen numerically; None: not computed
    numeric_at: str = ""  # the dim binding where that difference was seen, "n=1, d=7"
    numeric_bindings: int = 0  # how many dim bindings the numeric guard compared at
    numeric_why: str = ""  # where it compared none: why the first binding could not be evaluated
    used: tuple[Rule, ...] | None = field(default=None)  # with explain: a set of rules that proves it
    unexplained: str | None = None  # with explain: why no such set was found within the limits


def pair_outputs(a: Program, b: Program) -> list[tuple[str, str]]:
    """Outputs matched by name where both programs have the name, the others in the order each returns them
    (`return A, B` against `return B, C`: B with B, A with C); the programs must have as many outputs."""
    names_a, names_b = [n for n, _ in a.outputs], [n for n, _ in b.outputs]
    if len(names_a) == len(names_b):
        rest = iter(n for n in names_b if n not in names_a)
        return [(n, n if n in names_b else next(rest)) for n in names_a]
    def outputs(names: list[str]) -> str:
        return f"{len(names)} output{'' if len(names) == 1 else 's'}: {', '.join(names)}"
    raise PrismError(f"cannot compare '{a.name}' ({outputs(names_a)}) with '{b.name}' ({b.loc}, {outputs(names_b)}): "
                     "their outputs are paired by name, the others by position", a.loc)


def check_signatures(a: Program, b: Program) -> None:
    """Both programs must read the same inputs, with the same symbolic shapes and storage types (inputs are
    rounded to theirs: X * 2 of an f16 X is not X * 2 of an f32 X)."""
    ins_a = {n.attr: n for n in a.inputs}
    ins_b = {n.attr: n for n in b.inputs}
    if set(ins_a) != set(ins_b):
        raise PrismError(
            f"'{a.name}' reads inputs ({', '.join(ins_a)}) but '{b.name}' ({b.loc}) reads ({', '.join(ins_b)}); "
            "programs are compared on the same inputs", a.loc)
    for name, node in ins_a.items():
        other = ins_b[name]
        if not same_shape(node.shape, other.shape):
            raise PrismError(
                f"input '{name}' has shape {fmt_shape(node.shape)} in '{a.name}' but {fmt_shape(other.shape)} "
                f"in '{b.name}' ({b.locs.get(other, b.loc)})", a.locs.get(node, a.loc))
        if node.dtype is not other.dtype:
            raise PrismError(
                f"input '{name}' is {node.dtype.value} in '{a.name}' but {other.dtype.value} in '{b.name}' "
                f"({b.locs.get(other, b.loc)}); programs are compared on the same inputs", a.locs.get(node, a.loc))


def check_ranks(program: Program) -> None:
    """The e-graph knows the sizes of the last MAX_RANK dims only; a deeper tensor cannot be reasoned about."""
    for node in program.nodes():
        if len(node.shape) > MAX_RANK:
            loc = program.locs.get(node)
            raise PrismError(
                f"'{program.name}' has a tensor of rank {len(node.shape)} ({fmt_shape(node.shape)}); "
                f"the prover handles ranks up to {MAX_RANK}", loc)


def _shape_mismatch(a: Program, b: Program, pairs) -> str | None:
    outs_a, outs_b = dict(a.outputs), dict(b.outputs)
    for x, y in pairs:
        sa, sb = outs_a[x].shape, outs_b[y].shape
        if not same_shape(sa, sb):
            return f"output '{x}' has shape {fmt_shape(sa)} but '{y}' has {fmt_shape(sb)}"
    return None


@dataclass(frozen=True)
class Evidence:
    """What the numeric guard saw: the largest relative difference over every binding of the dims tried
    (None: no binding could be evaluated), where it was largest, and how many bindings were compared."""

    gap: float | None
    at: str = ""
    bindings: int = 0
    why: str = ""  # with no binding compared: why the first one could not be


def guard_bindings(a: Program, b: Program) -> list[dict]:
    """The dim bindings the guard compares at, each a different way for a false proof to show.

    The declared sizes capped at NUMERIC_DIM_CAP; every dim 1 (broadcasting, one-element reductions);
    distinct small primes (no split divides them by accident, no two dims alike); each dim alone at 1
    with the others at primes (a rule whose condition fails only there); and last the declared sizes,
    which `numeric_evidence` skips when their inputs are large and another binding was compared.
    """
    declared = {d.symbol: d.default for d in b.dims + a.dims}  # a's defaults win
    symbols = list(declared)
    capped = {s: min(v, NUMERIC_DIM_CAP) for s, v in declared.items()}
    primes = {s: p for s, p in zip(symbols, itertools.cycle(GUARD_PRIMES))}
    bindings = [capped, {s: 1 for s in symbols}, primes]
    if len(symbols) <= GUARD_SINGLE_ONES:
        bindings += [{**primes, s: 1} for s in symbols]
    unique: dict[tuple, dict] = {}
    for binding in bindings + [declared]:
        unique.setdefault(tuple(sorted((s.name, v) for s, v in binding.items())), binding)
    return list(unique.values())


def numeric_evidence(a: Program, b: Program, pairs) -> Evidence:
    """Paired outputs compared on random inputs (a new seed each) at every binding of `guard_bindings`.
    A binding where the program's kernels have no valid parameters is skipped; the declared sizes are
    skipped too when their inputs hold more than GUARD_ELEMENTS elements, unless nothing else could be
    compared (a literal grid size that divides the declared sizes only)."""
    worst, at, compared, why = 0.0, "", 0, ""
    for seed, binding in enumerate(guard_bindings(a, b)):
        if compared and _input_elements(a, binding) > GUARD_ELEMENTS:
            continue
        try:
            gap = _gap_at(a, b, pairs, binding, seed)
        except (PrismError, ValueError) as e:
            # no valid kernel parameters at these sizes, tensors too large to evaluate, or sizes the program
            # is not defined at (RoPE over an odd dim)
            why = why or (e.diagnostics[0].message if isinstance(e, PrismError) else str(e))
            continue
        compared += 1
        if gap > worst or not at:
            worst, at = gap, ", ".join(f"{s}={v}" for s, v in binding.items())
        if math.isinf(gap):
            break
    return Evidence(worst if compared else None, at, compared, "" if compared else why)


def _input_elements(program: Program, binding) -> int:
    return sum(math.prod(concrete_shape(n.shape, binding)) for n in program.inputs)


def _gap_at(a: Program, b: Program, pairs, binding, seed: int) -> float:
    """The largest relative difference of the paired outputs on random inputs at `binding`, where both are finite;
    inf where their shapes differ or an element is finite on one side only, or not finite on both but not the same
    (NaN against -inf: `causal(x) - causal(x)` against `causal(x - x)`). Float overflow can make such a difference
    where the programs agree (exp(1000 * a) / exp(1000 * b) is inf / inf where exp(1000 * (a - b)) is finite), so
    the inputs are halved, up to GUARD_HALVINGS times, while it shows: a difference that stays at every scale is
    no overflow (a division by a tensor of zeros, a mask's -inf subtracted from itself). Raises PrismError or
    ValueError where the programs cannot be evaluated at `binding`."""
    inputs = random_inputs(a, binding, seed)  # refuses tensors too large for the reference
    for halvings in range(GUARD_HALVINGS + 1):
        scaled = {k: v * 0.5**halvings for k, v in inputs.items()}
        # Kernel parameters that split every dim they can: a kernel wrong only across pieces shows.
        out_a, out_b = evaluate(a, scaled, prefer="split"), evaluate(b, scaled, prefer="split")
        gap = _gap(out_a, out_b, pairs)
        if gap is not None:
            return gap
    return float("inf")


def _gap(out_a, out_b, pairs) -> float | None:
    """`_gap_at`'s difference of one evaluation; None where an element is defined differently on the two sides."""
    worst = 0.0
    for x, y in pairs:
        va, vb = out_a[x], out_b[y]
        if va.shape != vb.shape:
            return float("inf")
        fa, fb = np.isfinite(va), np.isfinite(vb)
        if (fa != fb).any() or unlike_non_finite(va, vb).any():
            return None
        both = fa & fb
        if both.any():
            scale = max(float(np.abs(va[both]).max()), 1e-30)
            worst = max(worst, float(np.abs(va[both] - vb[both]).max()) / scale)
    return worst


# The layout axioms move a split one op toward the whole tensors per pass; a kernel's tiles carry a split
# per grid axis and the loop, so its terms need many passes. Three per iteration (the other rulesets run
# once) reach the stores in a third of the iterations, before the algebra's rewrites have grown the
# e-graph: causal attention's kernel proves in 5 iterations and 2,200 rows, where one pass took 11
# iterations and 27,000 rows (5 s against 0.2 s).
LAYOUT_PASSES = 3


def schedule(groups: list[str]) -> list[str]:
    """The egglog rulesets that one iteration runs, in order: each once, the layout axioms LAYOUT_PASSES times."""
    return [ruleset_name(g) for g in groups for _ in range(LAYOUT_PASSES if g == "layout" else 1)]


def prove(a: Program, b: Program, library: Library, limits: Limits = Limits(), *, explain: bool = False,
          numeric: bool = True) -> Proof:
    check_signatures(a, b)
    check_ranks(a)
    check_ranks(b)
    pairs = pair_outputs(a, b)
    mismatch = _shape_mismatch(a, b, pairs)
    if mismatch:
        return Proof(False, tuple(Pair(x, y, False) for x, y in pairs), f"not equal: {mismatch}",
                     numeric_why=SHAPES_DIFFER)
    evidence = numeric_evidence(a, b, pairs) if numeric else Evidence(None)
    program, _ = compile_library(library)
    # Custom kernels become terms over whole tensors with layout operators (`layout`); the layout
    # ruleset relates those to the plain program, for every size the symbols can take.
    setup, goals = proof_terms(to_terms(a), to_terms(b), pairs)
    outcome = egglog_runner.run(program, setup, goals, schedule(list(library.rulesets)), limits)
    proved = all(outcome.proved)
    result = Proof(
        proved,
        tuple(Pair(x, y, p) for (x, y), p in zip(pairs, outcome.proved)),
        outcome.reason,
        outcome.iterations,
        outcome.nodes,
        outcome.seconds,
        evidence.gap,
        evidence.at,
        evidence.bindings,
        numeric_why=evidence.why,
    )
    if proved and evidence.gap is not None and evidence.gap > 1e-6:
        differ = ("one is not finite where the other is, at every scale of the inputs tried" if math.isinf(evidence.gap)
                  else f"relative difference {evidence.gap:.3g}")
        raise PrismError(f"the rules prove '{a.name}' equal to '{b.name}', but they differ numerically at "
                         f"{evidence.at} ({differ}): {_suspects(library, setup, goals, limits)}")
    if proved and explain:
        used = explain_rules(library, setup, goals, limits)
        if isinstance(used, str):
            result = replace(result, unexplained=used)
        else:
            result = replace(result, used=used)
    return result


def _suspects(library: Library, setup: str, goals, limits: Limits) -> str:
    """What a proof of two programs that differ numerically rests on: the rules it uses (`explain_rules`) that are
    not the default library's, which the suite checks, or, where it uses only those, float64's own limits."""
    used = explain_rules(library, setup, goals, limits)
    rules = library.rules if isinstance(used, str) else used
    theirs = [r for r in rules if not in_default_library(r.loc.path)]
    float64 = ("one of the two programs is not defined, or loses to float64, where the other is (a division by zero "
               "that a rule cancels; exp of a large negative number, 0, divided by a sum of such; a large constant "
               "added and taken away again)")
    if not theirs:
        return f"the proof uses only the default library's axioms, true wherever both sides are defined: {float64}"
    named = ", ".join(f"'{r.name}' ({r.loc.path}:{r.loc.line}:{r.loc.col})" for r in theirs)
    return (f"some axiom in use is unsound (of the rules the proof uses, these are not the default library's: "
            f"{named}), or {float64}")


def proof_terms(a: Program, b: Program, pairs) -> tuple[str, list[tuple[str, str]]]:
    """Both programs as terms in one e-graph's setup, and the goals: the term pairs of `pairs` (output
    names) that a proof puts in one e-class."""
    writer = TermWriter()
    terms_a = program_terms(a, writer)
    terms_b = program_terms(b, writer)
    setup = "\n".join(writer.lines + writer.shape_facts())
    return setup, [(terms_a[x], terms_b[y]) for x, y in pairs]


def explain_rules(library: Library, setup: str, goals, limits: Limits) -> tuple[Rule, ...] | str:
    """A set of rules that still proves every goal: of the rules that matched anything in a proof with
    one egglog ruleset per rule, drop each in turn and keep it out when the goals are still proved.

    Every set tried is checked by a full query, so the answer always proves the goals. A trial that
    fails can run long (fewer rules, no proof: it saturates or reaches a limit), so trials get a few
    more iterations than the first proof took and a short time limit; one that runs out counts as
    needing the rule, which may leave in a rule that is not strictly needed, never leave one out.
    When the proof with one ruleset per rule itself runs out (its schedule differs from the grouped
    one), the answer is the reason, in words, not a list.
    """
    program, _ = compile_library(library, per_rule=True)
    with egglog_runner.Session(program) as session:
        first = session.run(setup, goals, schedule([r.name for r in library.rules]), limits)
        if not all(first.proved):  # one rule at a time reached a limit that all of them at once did not
            return f"the search with one ruleset per rule stopped first ({first.reason})"
        needed = [r.name for r in library.rules if ruleset_name(r.name) in first.matched]
        short = replace(limits, iterations=min(limits.iterations, 2 * first.iterations + 2),
                        seconds=min(limits.seconds, 1.0 + 4 * first.seconds))
        for name in list(needed):
            trial = [n for n in needed if n != name]
            if all(session.run(setup, goals, schedule(trial), short).proved):
                needed = trial
    return tuple(library.rule(n) for n in needed)
