"""Translation to egglog: rules become an egglog program, programs become terms with shape facts.

The generated program has three parts, all derived from data:
- sorts: `Dim` (a size: a dim symbol or a number) and `T` (tensor terms), with one constructor per
  operator of `ops.OPS` (`rms_norm` -> `RmsNorm`; reductions carry their dim, counted from the end);
- the `shapes` ruleset: for every term, `(size t i)` for i = -1 .. -MAX_RANK, propagated by one rule
  family per operator kind; sizes beyond a tensor's rank are 1 (the broadcasting view of `soundness`);
- the `fold` ruleset: arithmetic on two literals is a literal (evaluation, not an axiom: without it
  `-1 * (-1 * x)` would open an endless tower of distinct terms);
- one egglog ruleset per `.rules` ruleset, each rule a `rewrite` whose conditions are `:when` queries
  over `size`. Every emitted rule is preceded by a comment naming its source rule and file:line.

Nothing here runs egglog; `egglog_runner` does, in a separate process.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import sympy

from . import ast
from .ir import Node, Program
from .ops import MAX_RANK, OPS, Kind
from .rules import DimVar, Library, Lit, Rule, ShapeOf, SizeOf, literal_dim

DIMS = tuple(range(-1, -MAX_RANK - 1, -1))
SHAPES = "shapes"
FOLD = "fold"
PRELUDE = (SHAPES, FOLD)  # rulesets that always terminate; they run to saturation between rule passes

# Constant folding: the egglog f64 primitive of each binary op, and of negation.
FOLDS = {"add": "+", "sub": "-", "mul": "*", "div": "/"}


def constructor(op: str) -> str:
    return "".join(part.capitalize() for part in op.split("_"))


def ruleset_name(name: str) -> str:
    return f"rs_{name}"


# -- the fixed part: sorts and shape propagation -----------------------------------------------------


def declarations() -> str:
    ctors = ['(Input String)', '(Num f64)']
    for name, spec in OPS.items():
        if spec.kind in (Kind.INPUT, Kind.CONST):
            continue
        ctors.append(f"({constructor(name)}{' T' * spec.operands}{' i64' * len(spec.params)})")
    lines = [
        "(datatype Dim (DSym String) (DNum i64))",
        "(datatype T\n    " + "\n    ".join(ctors) + ")",
        "; (size t i): the size of dim i (counted from the end) of t; 1 beyond t's rank.",
        "(function size (T i64) Dim :merge old)",
        f"(ruleset {SHAPES})",
        f"(ruleset {FOLD})",
    ]
    return "\n".join(lines) + "\n" + shape_rules() + fold_rules()


def _rule(query: str, action: str) -> str:
    return f"(rule ({query}) ({action}) :ruleset {SHAPES})"


def _broadcast(e: str, a: str, b: str, i: str) -> list[str]:
    """size(e, i) from size(a, i) and size(b, i) under broadcasting (equal, or one of them is 1)."""
    return [
        _rule(f"(= {e}) (= s (size {a} {i})) (= s (size {b} {i}))", f"(set (size e {i}) s)"),
        _rule(f"(= {e}) (= (DNum 1) (size {a} {i})) (= s (size {b} {i}))", f"(set (size e {i}) s)"),
        _rule(f"(= {e}) (= s (size {a} {i})) (= (DNum 1) (size {b} {i}))", f"(set (size e {i}) s)"),
    ]


def shape_rules() -> str:
    out = [_rule("(= e (Num x))", " ".join(f"(set (size e {i}) (DNum 1))" for i in DIMS))]
    for name, spec in OPS.items():
        c = constructor(name)
        if spec.kind in (Kind.UNARY, Kind.ROWWISE):
            out.append(_rule(f"(= e ({c} a)) (= s (size a i))", "(set (size e i) s)"))
        elif spec.kind is Kind.BINARY:
            out += _broadcast(f"e ({c} a b)", "a", "b", "i")
        elif spec.kind is Kind.REDUCE:
            out.append(_rule(f"(= e ({c} a k)) (= s (size a i)) (!= i k)", "(set (size e i) s)"))
            out.append(_rule(f"(= e ({c} a k))", "(set (size e k) (DNum 1))"))
        elif spec.kind is Kind.MATMUL:
            out.append(_rule(f"(= e ({c} a b)) (= s (size a -2))", "(set (size e -2) s)"))
            out.append(_rule(f"(= e ({c} a b)) (= s (size b -1))", "(set (size e -1) s)"))
            for i in DIMS[2:]:
                out += _broadcast(f"e ({c} a b)", "a", "b", str(i))
    return "\n".join(out) + "\n"


def fold_rules() -> str:
    out = [f"(rewrite (Neg (Num a)) (Num (neg a)) :ruleset {FOLD})"]
    for op, prim in FOLDS.items():
        guard = " :when ((!= b 0.0))" if op == "div" else ""
        out.append(f"(rewrite ({constructor(op)} (Num a) (Num b)) (Num ({prim} a b)){guard} :ruleset {FOLD})")
    return "\n".join(out) + "\n"


# -- rules -------------------------------------------------------------------------------------------


def pattern(e: ast.Expr) -> str:
    match e:
        case ast.Num():
            return f"(Num {_float(e.value)})"
        case ast.Name():
            return var(e.id)
        case ast.Call():
            spec = OPS[e.fn]
            parts = [pattern(a) for a in e.args[: spec.operands]]
            for a in e.args[spec.operands :]:
                parts.append(var(a.id) if isinstance(a, ast.Name) else str(literal_dim(a)))
            return f"({constructor(e.fn)} {' '.join(parts)})"
    raise TypeError(e)


def var(name: str) -> str:
    """Pattern variables get a prefix so no user name can collide with an egglog primitive (min, log...)."""
    return f"v_{name}"


def _float(value: float) -> str:
    text = repr(float(value))
    return text if any(ch in text for ch in ".en") else text + ".0"


def _operand(o) -> str:
    match o:
        case SizeOf(var=v, dim=d):
            return f"(size {var(v)} {var(d) if isinstance(d, str) else d})"
        case Lit(value=v):
            return f"(DNum {v})"
        case DimVar(name=n):
            return var(n)
    raise TypeError(o)


def conditions(rule: Rule) -> list[str]:
    facts = []
    for c in rule.conditions:
        if isinstance(c.lhs, ShapeOf):
            # Same shape: every dim's size agrees (sizes beyond a rank are 1, so leading 1s don't count).
            facts += [f"(= (size {var(c.lhs.var)} {i}) (size {var(c.rhs.var)} {i}))" for i in DIMS]
        elif c.op == "==":
            facts.append(f"(= {_operand(c.lhs)} {_operand(c.rhs)})")
        else:
            facts.append(f"(!= {_operand(c.lhs)} {_operand(c.rhs)})")
    return facts


@dataclass(frozen=True)
class Emitted:
    """One egglog rewrite and the source rule it came from (a `<=>` rule emits two)."""

    rule: Rule
    direction: str  # "->" or "<-"
    text: str


def emit_rule(rule: Rule, ruleset: str) -> list[Emitted]:
    sides = [("->", rule.lhs, rule.rhs)]
    if rule.both_ways:
        sides.append(("<-", rule.rhs, rule.lhs))
    out = []
    for direction, lhs, rhs in sides:
        when = conditions(rule)
        clause = f" :when ({' '.join(when)})" if when else ""
        text = f"(rewrite {pattern(lhs)} {pattern(rhs)}{clause} :ruleset {ruleset})"
        out.append(Emitted(rule, direction, text))
    return out


def compile_library(library: Library, *, per_rule: bool = False) -> tuple[str, list[Emitted]]:
    """The whole egglog program for a rule library, and its emitted rules in order.

    With `per_rule`, each rule gets an egglog ruleset of its own (named after the rule), so a schedule
    can run any subset of the rules; that is how `--explain` finds the rules a proof needs.
    """
    parts = [declarations()]
    emitted: list[Emitted] = []
    groups = [r.name for r in library.rules] if per_rule else list(library.rulesets)
    parts += [f"(ruleset {ruleset_name(g)})" for g in groups]
    for rule in library.rules:
        target = ruleset_name(rule.name if per_rule else rule.ruleset)
        for em in emit_rule(rule, target):
            parts.append(f"; rule {rule.name} {em.direction} ({rule.ruleset}, {rule.loc})")
            parts.append(em.text)
            emitted.append(em)
    return "\n".join(parts) + "\n", emitted


# -- terms from programs -----------------------------------------------------------------------------


_SAFE = re.compile(r"^[A-Za-z_][A-Za-z_0-9]*$")


def dim_term(size) -> str:
    size = sympy.sympify(size)
    if size.is_Integer:
        return f"(DNum {int(size)})"
    return f'(DSym "{size}")'


class TermWriter:
    """Writes IR nodes as egglog `let` bindings (shared nodes once) plus the shape facts of inputs."""

    def __init__(self, prefix: str = "n") -> None:
        self.prefix = prefix
        self.names: dict[Node, str] = {}
        self.lines: list[str] = []
        self.inputs: dict[str, Node] = {}

    def term(self, root: Node) -> str:
        for node in root.walk():
            if node not in self.names:
                self._bind(node)
        return self.names[root]

    def _bind(self, node: Node) -> None:
        spec = OPS[node.op]
        if node.op == "input":
            assert _SAFE.match(node.attr), node.attr  # input names are identifiers by the grammar
            expr = f'(Input "{node.attr}")'
            self.inputs[node.attr] = node
        elif node.op == "const":
            expr = f"(Num {_float(node.attr)})"
        else:
            args = [self.names[a] for a in node.args]
            if spec.kind is Kind.REDUCE:
                args.append(str(node.attr - node.rank))  # dims count from the end in the e-graph
            expr = f"({constructor(node.op)} {' '.join(args)})"
        name = f"${self.prefix}{len(self.names)}"
        self.names[node] = name
        self.lines.append(f"(let {name} {expr})")

    def shape_facts(self) -> list[str]:
        facts = []
        for name, node in self.inputs.items():
            for i in DIMS:
                size = node.shape[i] if -node.rank <= i else 1
                facts.append(f'(set (size (Input "{name}") {i}) {dim_term(size)})')
        return facts


def program_terms(program: Program, writer: TermWriter) -> dict[str, str]:
    """Each output's egglog global, by output name."""
    return {name: writer.term(node) for name, node in program.outputs}
