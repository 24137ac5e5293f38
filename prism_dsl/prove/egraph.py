"""Translation to egglog: rules become an egglog program, programs become terms with shape facts.

The generated program has three parts, all derived from data:
- sorts: `Dim` (a size: a dim symbol or a number) and `T` (tensor terms), with one constructor per
  operator of `ir.ops.OPS` (`rms_norm` -> `RmsNorm`; reductions carry their dim, counted from the end);
- the `shapes` ruleset: for every term, `(size t i)` for i = -1 .. -MAX_RANK, propagated by one rule
  family per operator kind; sizes beyond a tensor's rank are 1 (the broadcasting view of `patterns`);
- the `fold` ruleset: arithmetic on two literals is a literal (evaluation, not an axiom: without it
  `-1 * (-1 * x)` would open an endless tower of distinct terms), where float64 gives the real result to
  its precision: a result is folded only inside the normal range (`FOLD_RANGE`), so that no product of
  two nonzero constants becomes 0 or inf (1e-200 * 1e-200 is not 0: folded, it made `(X * 1e-200) *
  1e-200` and `(X * 1e-300) * 1e-300` one term, `X * 0`), and a zero operand folds a product or quotient
  to 0;
- one egglog ruleset per `.rules` ruleset, each rule a `rewrite` whose conditions are `:when` queries
  over `size` (a condition holds only where it holds for every binding of the symbolic sizes; see
  `conditions`). Every emitted rule is preceded by a comment naming its source rule and file:line.

Text from a user (a file's path, an input's or a dim's name) reaches the program only through `escape`,
so no name can end a comment or a string early and add commands of its own.

Nothing here runs egglog; `egglog_runner` does, in a separate process.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import sympy

from ..lang import syntax_tree as ast
from ..base.errors import PrismError
from ..ir.accumulators import ACCUMULATORS
from ..ir.nodes import Node, Program
from ..ir.ops import DIMS, LOOP_DIM, MAX_RANK, OPS, Kind
from ..ir.shapes import dim_params
from .rules import MAX_SHAPE_INEQUALITIES, DimVar, Library, Lit, Rule, ShapeOf, SizeOf, literal_dim

SHAPES = "shapes"
FOLD = "fold"
PRELUDE = (SHAPES, FOLD)  # rulesets that always terminate; they run to saturation between rule passes

# Rewrites one rule may emit for its conditions' alternatives (`rules.MAX_SHAPE_INEQUALITIES`; a rule
# built by hand, not read from a file, meets the limit here).
MAX_ALTERNATIVES = MAX_RANK ** MAX_SHAPE_INEQUALITIES

# Constant folding: the egglog f64 primitive of each binary op, and of negation.
FOLDS = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
FOLD_RANGE = ("1e-300", "1e300")  # the magnitudes a folded nonzero result must lie between (float64's normal range)


def constructor(op: str) -> str:
    return "".join(part.capitalize() for part in op.split("_"))


def ruleset_name(name: str) -> str:
    return f"rs_{_identifier(name)}"


# -- user text ---------------------------------------------------------------------------------------

_SAFE = re.compile(r"^[A-Za-z_][A-Za-z_0-9]*$")
_NAMED_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape(text: str) -> str:
    """User text as one line of printable ASCII, the body of a Python string literal that reads back as
    `text` (so distinct texts stay distinct).

    egglog ends a comment at a newline and a string at an unescaped quote, and other lexers end lines
    at more (CR, U+2028, NEL): every character outside printable ASCII, a backslash and a quote are
    escaped (`\\n`, `\\x00`, `\\u2028`, `\\"`, `\\\\`), so nothing a user names can leave the comment or
    string it is written into. Identifiers and ordinary paths come out unchanged.
    """
    out = []
    for ch in text:
        if ch in _NAMED_ESCAPES:
            out.append(_NAMED_ESCAPES[ch])
        elif " " <= ch <= "~":
            out.append(ch)
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


def string(text: str) -> str:
    """An egglog string literal holding `escape(text)`: the e-graph compares names, never reads them."""
    # egglog's string syntax escapes `\` and `"` with a backslash; escaped text has no other special character.
    return '"' + escape(text).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _identifier(name: str) -> str:
    """Rule, ruleset and variable names are identifiers by the grammar; one built by hand must be too."""
    if not _SAFE.match(name):
        raise ValueError(f"not an identifier, so it cannot name anything in egglog: {name!r}")
    return name


# -- the fixed part: sorts and shape propagation -----------------------------------------------------


def declarations() -> str:
    ctors = ['(Input String)', '(Num f64)']
    for name, spec in OPS.items():
        # Inputs and numbers have the constructors above; kernels are translated to layout terms (`layout`)
        # before they reach the e-graph.
        if spec.kind in (Kind.INPUT, Kind.CONST, Kind.TILE, Kind.KERNEL):
            continue
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


def _broadcast(e: str, operands: str, i: str) -> list[str]:
    """size(e, i) under broadcasting of the operands (one letter each): for each set of operands that have
    the size, the others having 1."""
    out = []
    for mask in range(1, 2 ** len(operands)):
        facts = " ".join(f"(= s (size {x} {i}))" if mask >> k & 1 else f"(= (DNum 1) (size {x} {i}))"
                         for k, x in enumerate(operands))
        out.append(_rule(f"(= {e}) {facts}", f"(set (size e {i}) s)"))
    return out


def _matmul(e: str, folded: tuple[int, ...] = ()) -> list[str]:
    """A matrix product's sizes: the rows of a, the columns of b, the other dims (but `folded`) broadcast."""
    out = [_rule(f"(= {e}) (= s (size a -2))", "(set (size e -2) s)"),
           _rule(f"(= {e}) (= s (size b -1))", "(set (size e -1) s)")]
    return out + [r for i in DIMS[2:] if i not in folded for r in _broadcast(e, "ab", str(i))]


def _except(dims: tuple[int, ...]) -> str:
    return " ".join(f"(!= i {d})" for d in dims)


def _accumulate_rules(name: str, c: str) -> list[str]:
    """An accumulator's sizes: those of one iteration's value (the op kind it is `like`), with the loop
    dim, and for a row accumulator the last dim, folded to 1."""
    acc, L = ACCUMULATORS[name], LOOP_DIM
    e = f"e ({c} a b)" if acc.operands == 2 else f"e ({c} a)"
    folded = (-1, L) if acc.row else (L,)
    if acc.like == "matmul":
        out = _matmul(e, folded)
    elif acc.like == "binary":
        out = [r for i in DIMS if i not in folded for r in _broadcast(e, "ab", str(i))]
    else:
        out = [_rule(f"(= {e}) (= s (size a i)) {_except(folded)}", "(set (size e i) s)")]
    return out + [_rule(f"(= {e})", f"(set (size e {d}) (DNum 1))") for d in folded]


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
        if spec.kind is Kind.UNARY or (spec.kind in (Kind.ROWWISE, Kind.MASK) and spec.operands == 1):
            out.append(_rule(f"(= e ({c} a)) (= s (size a i))", "(set (size e i) s)"))
        elif spec.kind in (Kind.ROWWISE, Kind.MASK):  # the operands after the first broadcast against it
            names = "abcdefgh"[: spec.operands]
            out += _broadcast(f"e ({c} {' '.join(names)})", names, "i")
        elif spec.kind is Kind.TRANSPOSE:
            out.append(_rule(f"(= e ({c} a j k)) (= s (size a i)) (!= i j) (!= i k)", "(set (size e i) s)"))
            out.append(_rule(f"(= e ({c} a j k)) (= s (size a j))", "(set (size e k) s)"))
            out.append(_rule(f"(= e ({c} a j k)) (= s (size a k))", "(set (size e j) s)"))
        elif spec.kind is Kind.BINARY:
            out += _broadcast(f"e ({c} a b)", "ab", "i")
        elif spec.kind is Kind.POSITION:  # the dim's size; 1 in every other dim
            out.append(_rule(f"(= e ({c} a k)) (= s (size a k))", "(set (size e k) s)"))
            out.append(_rule(f"(= e ({c} a k)) (= s (size a i)) (!= i k)", "(set (size e i) (DNum 1))"))
        elif spec.kind is Kind.REDUCE:
            out.append(_rule(f"(= e ({c} a k)) (= s (size a i)) (!= i k)", "(set (size e i) s)"))
            out.append(_rule(f"(= e ({c} a k))", "(set (size e k) (DNum 1))"))
        elif spec.kind is Kind.MATMUL:
            out += _matmul(f"e ({c} a b)")
        elif spec.kind is Kind.ACCUMULATE:
            out += _accumulate_rules(name, c)
    return "\n".join(out) + "\n"


def fold_rules() -> str:
    """The `fold` ruleset: a result folded only where float64 holds it (the docstring's range); 0 * b, a * 0
    and 0 / b are 0 (b nonzero: a literal is finite, the parser refuses what is not)."""
    lo, hi = FOLD_RANGE
    out = [f"(rewrite (Neg (Num a)) (Num (neg a)) :ruleset {FOLD})"]
    for op, prim in FOLDS.items():
        r = f"({prim} a b)"
        ranged = f"(< (abs {r}) {hi})" + (f" (> (abs {r}) {lo})" if op in ("mul", "div") else "")
        nonzero = " (!= a 0.0) (!= b 0.0)" if op in ("mul", "div") else ""
        out.append(f"(rewrite ({constructor(op)} (Num a) (Num b)) (Num {r}) :when ({ranged}{nonzero}) "
                   f":ruleset {FOLD})")
    mul, div = constructor("mul"), constructor("div")
    out += [f"(rewrite ({mul} (Num 0.0) (Num b)) (Num 0.0) :ruleset {FOLD})",
            f"(rewrite ({mul} (Num a) (Num 0.0)) (Num 0.0) :ruleset {FOLD})",
            f"(rewrite ({div} (Num 0.0) (Num b)) (Num 0.0) :when ((!= b 0.0)) :ruleset {FOLD})"]
    return "\n".join(out) + "\n"


# -- rules -------------------------------------------------------------------------------------------


def pattern(e: ast.Expr) -> str:
    match e:
        case ast.Num():
            return f"(Num {_float(e.value)})"
        case ast.Call(fn="neg", args=(ast.Num() as n, *_)):
            # A negative literal, as a program's constant is in the e-graph (`TermWriter`: a const node holds
            # its sign); (Neg (Num 2.0)) would match only a negation written around a literal.
            return f"(Num {_float(-n.value)})"
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
    return f"v_{_identifier(name)}"


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


def conditions(rule: Rule) -> list[list[str]]:
    """The rule's `:when` facts as alternatives: the rule may fire where all the facts of one hold.

    A size in the e-graph stands for every value its symbols can take (dims and kernel parameters are
    integers >= 1 that a user binds later, `--dims n=1` included), so a condition holds only where it
    holds for all of them:
    - `==` on sizes: one e-class, which is equal under every binding;
    - `!=` on sizes: both sides are literals (`DNum`) that differ. Nothing else is known to differ for
      every binding: `n` and `1` are equal at n = 1, `n` and `m` at n = m (`n` against `2 * n` would
      need arithmetic on symbols, which no rule has needed);
    - `shape(a) != shape(b)`: some dim whose sizes differ as above (the shapes are compared up to leading
      1s, and sizes beyond a rank are 1). egglog has no `or` in a query, so each dim is an alternative,
      and a rule emits one rewrite per combination of its conditions' alternatives.
    Dims (`i != j` over reduction dims) are plain integers, compared as such.
    """
    alternatives: list[list[str]] = [[]]
    for k, c in enumerate(rule.conditions):
        options = _condition(rule, c, f"c{k}")
        if len(alternatives) * len(options) > MAX_ALTERNATIVES:
            raise PrismError(
                f"rule '{rule.name}' has too many 'shape(..) != shape(..)' conditions for the prover: each holds "
                f"in one of {len(DIMS)} dims, so each multiplies the rule's rewrites by {len(DIMS)} "
                f"(at most {MAX_ALTERNATIVES} rewrites: two such conditions)", c.loc)
        alternatives = [alt + option for alt in alternatives for option in options]
    return alternatives


def _condition(rule: Rule, c, tag: str) -> list[list[str]]:
    """One condition's alternatives, each a list of facts; `tag` names the variables it introduces."""
    if any(isinstance(o, DimVar) and o.name in rule.dim_vars for o in (c.lhs, c.rhs)):
        # A dim compared with a dim or a literal dim: plain integers, not sizes.
        a, b = (var(o.name) if isinstance(o, DimVar) else str(o.value) for o in (c.lhs, c.rhs))
        return [[f"({'=' if c.op == '==' else '!='} {a} {b})"]]
    if isinstance(c.lhs, ShapeOf):
        a, b = var(c.lhs.var), var(c.rhs.var)
        if c.op == "==":  # every dim's size agrees
            return [[f"(= (size {a} {i}) (size {b} {i}))" for i in DIMS]]
        return [_differ(f"(size {a} {i})", f"(size {b} {i})", f"{tag}_{-i}") for i in DIMS]
    if isinstance(c.lhs, Lit) and isinstance(c.rhs, Lit):  # decided here: always or never
        return [[]] if (c.lhs.value == c.rhs.value) == (c.op == "==") else []
    if c.op == "==":
        return [[f"(= {_operand(c.lhs)} {_operand(c.rhs)})"]]
    return [_differ(_literal_or_term(c.lhs), _literal_or_term(c.rhs), tag)]


def _literal_or_term(o) -> int | str:
    return o.value if isinstance(o, Lit) else _operand(o)


def _differ(a: int | str, b: int | str, tag: str) -> list[str]:
    """Facts that hold where two sizes are different literals: a term counts only through a `DNum` in
    its e-class, an int is compared as it is."""
    facts, values = [], []
    for side, x in (("l", a), ("r", b)):
        if isinstance(x, int):
            values.append(str(x))
        else:
            values.append(f"{tag}{side}")
            facts.append(f"(= (DNum {tag}{side}) {x})")
    return facts + [f"(!= {values[0]} {values[1]})"]


@dataclass(frozen=True)
class Emitted:
    """One direction of a source rule (a `<=>` rule has two) and its egglog text: one `rewrite` per
    alternative of its conditions (see `conditions`), one per line; none if they can never hold."""

    rule: Rule
    direction: str  # "->" or "<-"
    text: str


def emit_rule(rule: Rule, ruleset: str) -> list[Emitted]:
    sides = [("->", rule.lhs, rule.rhs)]
    if rule.both_ways:
        sides.append(("<-", rule.rhs, rule.lhs))
    alternatives = conditions(rule)
    out = []
    for direction, lhs, rhs in sides:
        rewrites = []
        for when in alternatives:
            clause = f" :when ({' '.join(when)})" if when else ""
            rewrites.append(f"(rewrite {pattern(lhs)} {pattern(rhs)}{clause} :ruleset {ruleset})")
        out.append(Emitted(rule, direction, "\n".join(rewrites)))
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
            parts.append(f"; rule {escape(rule.name)} {em.direction} ({escape(rule.ruleset)}, {escape(str(rule.loc))})")
            if em.text:
                parts.append(em.text)
            emitted.append(em)
    return "\n".join(parts) + "\n", emitted


# -- terms from programs -----------------------------------------------------------------------------


def dim_term(size) -> str:
    size = sympy.sympify(size)
    if size.is_Integer:
        return f"(DNum {int(size)})"
    return f"(DSym {string(str(size))})"


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
            expr = f"(Input {string(node.attr)})"
            self.inputs[node.attr] = node
        elif node.op == "const":
            expr = f"(Num {_float(node.attr)})"
        else:
            args = [self.names[a] for a in node.args]
            args += [str(d) for d in dim_params(node)]  # dims count from the end in the e-graph
            if spec.kind is Kind.SPLIT:
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
                facts.append(f"(set (size (Input {string(name)}) {i}) {dim_term(size)})")
        return facts


def program_terms(program: Program, writer: TermWriter) -> dict[str, str]:
    """Each output's egglog global, by output name."""
    return {name: writer.term(node) for name, node in program.outputs}
