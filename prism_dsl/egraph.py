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
from .ops import LOOP_DIM, MAX_RANK, OPS, Kind
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
        if spec.kind in (Kind.TILE, Kind.KERNEL):
            continue  # kernels are translated to layout terms (`layout`) before they reach the e-graph
        params = "".join(" Dim" if p == "count" else " i64" for p in spec.params)
        ctors.append(f"({constructor(name)}{' T' * spec.operands}{params})")
    lines = [
        "; sizes: symbols, numbers, and the products and exact quotients that splitting dims makes",
        "(datatype Dim (DSym String) (DNum i64) (DMul Dim Dim) (DDiv Dim Dim))",
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


# Accumulators whose result keeps one value per row (the last dim folds to 1 as well as the loop dim).
_ROW_ACCUMULATORS = {"acc_sum_last", "acc_mean_last", "acc_rms_last", "acc_max_last", "acc_softmax_sum"}


def _except(dims: tuple[int, ...]) -> str:
    return " ".join(f"(!= i {d})" for d in dims)


def _accumulate_rules(name: str, c: str) -> list[str]:
    L = LOOP_DIM
    if name == "acc_softmax_out":  # a matrix product folded over the loop
        out = [_rule(f"(= e ({c} a b)) (= s (size a -2))", "(set (size e -2) s)"),
               _rule(f"(= e ({c} a b)) (= s (size b -1))", "(set (size e -1) s)")]
        for i in DIMS[2:]:
            if i != L:
                out += _broadcast(f"e ({c} a b)", "a", "b", str(i))
    elif name == "acc_rescaled_sum":
        out = [r for i in DIMS if i != L for r in _broadcast(f"e ({c} a b)", "a", "b", str(i))]
    else:
        folded = (-1, L) if name in _ROW_ACCUMULATORS else (L,)
        out = [_rule(f"(= e ({c} a)) (= s (size a i)) {_except(folded)}", "(set (size e i) s)")]
        out += [_rule(f"(= e ({c} a))", f"(set (size e {d}) (DNum 1))") for d in folded if d != L]
    args = " a b" if OPS[name].operands == 2 else " a"
    out.append(_rule(f"(= e ({c}{args}))", f"(set (size e {L}) (DNum 1))"))
    return out


def _layout_rules() -> list[str]:
    return [
        # split(a, k, j, g): dim k shrinks by g; the block dim j holds the g pieces.
        _rule("(= e (Split a k j g)) (= s (size a i)) (!= i k) (!= i j)", "(set (size e i) s)"),
        _rule("(= e (Split a k j g)) (= s (size a k))", "(set (size e k) (DDiv s g))"),
        _rule("(= e (Split a k j g))", "(set (size e j) g)"),
        # concat(a, k, j): the pieces along j go back side by side in k.
        _rule("(= e (Concat a k j)) (= s (size a i)) (!= i k) (!= i j)", "(set (size e i) s)"),
        _rule("(= e (Concat a k j)) (= s (size a k)) (= g (size a j))", "(set (size e k) (DMul s g))"),
        _rule("(= e (Concat a k j))", "(set (size e j) (DNum 1))"),
        # Exact division undoes multiplication (every split divides exactly: instantiation checks it).
        f"(rewrite (DMul (DDiv x g) g) x :ruleset {SHAPES})",
        f"(rewrite (DDiv (DMul x g) g) x :ruleset {SHAPES})",
        f"(rewrite (DMul x (DNum 1)) x :ruleset {SHAPES})",
        f"(rewrite (DDiv x (DNum 1)) x :ruleset {SHAPES})",
    ]


def shape_rules() -> str:
    out = [_rule("(= e (Num x))", " ".join(f"(set (size e {i}) (DNum 1))" for i in DIMS))]
    out += _layout_rules()
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
        elif spec.kind is Kind.ACCUMULATE:
            out += _accumulate_rules(name, c)
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
            for a, role in zip(e.args[spec.operands :], spec.params):
                if isinstance(a, ast.Name):
                    parts.append(var(a.id))
                elif role == "count":
                    parts.append(f"(DNum {literal_dim(a)})")
                else:
                    parts.append(str(literal_dim(a)))
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
        if any(isinstance(o, DimVar) and o.name in rule.dim_vars for o in (c.lhs, c.rhs)):
            # A dim compared with a dim or a literal dim: plain integers, not sizes.
            a, b = (var(o.name) if isinstance(o, DimVar) else str(o.value) for o in (c.lhs, c.rhs))
            facts.append(f"({'=' if c.op == '==' else '!='} {a} {b})")
            continue
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
            elif spec.kind is Kind.SPLIT:
                dim, block, count = node.attr
                args += [str(dim), str(block), dim_term(count)]
            elif spec.kind is Kind.CONCAT:
                args += [str(d) for d in node.attr]
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
