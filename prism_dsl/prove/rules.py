"""Axioms as data: the `.rules` language, parsed and checked.

A rule is two patterns over the shared expression syntax, `LHS => RHS` (one way) or `LHS <=> RHS`
(both ways), with optional side conditions over shape facts. Names that are not operators are pattern
variables: a tensor variable where a tensor is expected, a dim variable where a reduction's dim is.
This module reads rule files (with their imports) into a `Library` and reports, with file:line:col,
every rule that is malformed. Whether a rule is *true* is `soundness.py`'s job; turning rules into an
egglog program is `egraph.py`'s.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
from dataclasses import dataclass, field
from pathlib import Path

from lark import Lark, v_args

from ..lang import syntax_tree as ast
from ..base.errors import Collector, Loc, PrismError
from ..base.resources import data_dir
from ..ir.ops import MAX_RANK, OPS, RULE_CALLABLE, arity_words, written
from ..lang.syntax import GRAMMAR_DIR, LocatedBuilder, parse_with, read_source, suggest


RULE_SYNTAX_ERRORS: dict[str, list[str]] = {
    "a rule is 'rule NAME: LHS => RHS' or 'rule NAME: LHS <=> RHS'": [
        "ruleset r { rule x a * b => b * a }",
        "ruleset r { rule x: a * b }",
        "ruleset r { rule x: a * b rule y: a => a }",
        "ruleset r { rule x: exp(a) }",
    ],
    "rules live inside 'ruleset NAME { ... }'": [
        "rule x: a => a",
        "ruleset { rule x: a => a }",
    ],
    "missing ')'": [
        "ruleset r { rule x: exp(a => a }",
        "ruleset r { rule x: (a + b => a }",
    ],
    "missing operand": [
        "ruleset r { rule x: a + => a }",
        "ruleset r { rule x: a => }",
    ],
    "a condition is 'size(VAR, DIM) == size(VAR, DIM)', 'size(VAR, DIM) == INT', 'shape(VAR) == shape(VAR)' or 'DIM != DIM'": [
        "ruleset r { rule x: a => a if }",
        "ruleset r { rule x: a => a if size(a) == 1 }",
        "ruleset r { rule x: a => a if size(a, -1) }",
        "ruleset r { rule x: a => a if size(a, -1) == }",
    ],
    "missing '}' at the end of the ruleset": [
        "ruleset r { rule x: a * b => b * a",
    ],
}


# `shape(a) != shape(b)` holds where some dim differs: the prover gets one rewrite per dim for each such
# condition. egglog loads 81 rewrites of one rule in about a second; 729 take it over a minute.
MAX_SHAPE_INEQUALITIES = 2


# -- the data model ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SizeOf:
    """`size(var, dim)`: the size of one dim (counted from the end when negative) of a tensor variable."""

    var: str
    dim: int | str  # a negative literal or a dim variable


@dataclass(frozen=True)
class ShapeOf:
    """`shape(var)`: a tensor variable's whole shape (compared up to leading size-1 dims)."""

    var: str


@dataclass(frozen=True)
class DimVar:
    name: str


@dataclass(frozen=True)
class Lit:
    value: int


Operand = SizeOf | ShapeOf | DimVar | Lit


@dataclass(frozen=True)
class Condition:
    lhs: Operand
    op: str  # "==" or "!="
    rhs: Operand
    loc: Loc = field(compare=False)


@dataclass(frozen=True)
class Rule:
    name: str
    ruleset: str
    lhs: ast.Expr
    rhs: ast.Expr
    both_ways: bool
    conditions: tuple[Condition, ...]
    loc: Loc = field(compare=False)
    tensor_vars: frozenset[str] = frozenset()
    dim_vars: frozenset[str] = frozenset()
    count_vars: frozenset[str] = frozenset()  # sizes a split cuts a dim into (symbolic, like a grid size)

    @property
    def arrow(self) -> str:
        return "<=>" if self.both_ways else "=>"

    def where(self) -> str:
        return f"{self.name} ({self.loc})"

    def canonical(self) -> str:
        """The rule's meaning as text, free of names and positions (a cache key for its soundness)."""
        conds = ", ".join(f"{c.lhs} {c.op} {c.rhs}" for c in self.conditions)
        return f"{sexpr(self.lhs)} {self.arrow} {sexpr(self.rhs)} if {conds}"


@dataclass(frozen=True)
class Library:
    """Every rule loaded, in file order, and the files they came from (for cache keys and messages)."""

    rules: tuple[Rule, ...]
    files: tuple[str, ...] = ()
    texts: tuple[str, ...] = field(default=(), repr=False)

    @property
    def rulesets(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.ruleset for r in self.rules))

    def rule(self, name: str) -> Rule:
        return next(r for r in self.rules if r.name == name)

    def __add__(self, other: "Library") -> "Library":
        return Library(self.rules + other.rules, self.files + other.files, self.texts + other.texts)


# -- parsing -----------------------------------------------------------------------------------------


@functools.cache
def rules_parser() -> Lark:
    return Lark.open(str(GRAMMAR_DIR / "rules.lark"), parser="lalr", propagate_positions=True, cache=False)


@dataclass(frozen=True)
class _RawRule:
    name: str
    lhs: ast.Expr
    arrow: str
    rhs: ast.Expr
    conditions: tuple[Condition, ...]
    loc: Loc


@dataclass(frozen=True)
class _RawRuleset:
    name: str
    rules: tuple[_RawRule, ...]
    loc: Loc


class RulesBuilder(LocatedBuilder):
    def start(self, items):
        return items

    def ruleset(self, children):
        name, *rules = children
        return _RawRuleset(str(name), tuple(rules), self.loc(name))

    @v_args(inline=True)
    def rule(self, name, lhs, arrow, rhs, conditions):
        return _RawRule(str(name), lhs, str(arrow), rhs, tuple(conditions or ()), self.loc(name))

    def conditions(self, children):
        return children

    @v_args(meta=True)
    def condition(self, meta, children):
        lhs, op, rhs = children
        return Condition(lhs, str(op), rhs, self.loc(meta))

    @v_args(inline=True)
    def size_of(self, var, dim):
        return SizeOf(str(var), self.integer(dim) if dim.type == "SIGNED_INT" else str(dim))

    @v_args(inline=True)
    def shape_of(self, var):
        return ShapeOf(str(var))

    @v_args(inline=True)
    def dim_var(self, tok):
        return DimVar(str(tok))

    @v_args(inline=True)
    def literal(self, tok):
        return Lit(self.integer(tok))


def parse_rules(text: str, path: str) -> list:
    return parse_with(rules_parser(), RulesBuilder, text, path, RULE_SYNTAX_ERRORS)


# -- loading and checking ----------------------------------------------------------------------------


def default_files() -> list[Path]:
    """The default axiom library: the repository's `rules/`, installed as the package `prism_dsl.library`."""
    folder = data_dir("library", "rules")
    files = sorted(folder.glob("*.rules"))
    if not files:
        raise PrismError(f"the default axiom library is missing: no .rules files in {folder}")
    return files


def load_library(paths, *, defaults: bool = False) -> Library:
    """Read rule files (and their imports, each once) into one Library; raise every error found."""
    errors = Collector()
    given = [Path(p) for p in paths]
    library = default_files() if defaults else []
    # A copy of a default file given by name (the repository's rules/ beside an installed prismc, whose library is
    # the package's own copy) stands in for it, rather than clash with it rule by rule.
    copies = {d: g for d in library for g in given if g.name == d.name and same_bytes(d, g)}
    files = [copies.get(d, d) for d in library] + [g for g in given if g not in copies.values()]
    seen: dict[Path, None] = {}
    rules: list[Rule] = []
    texts: list[str] = []
    for f in files:
        _load_file(f, errors, seen, rules, texts, stack=(), at=None)
    _check_unique(rules, errors)
    errors.raise_if_any()
    return Library(tuple(rules), tuple(str(p) for p in seen), tuple(texts))


def same_bytes(a: Path, b: Path) -> bool:
    """Whether regular file `b` holds what `a` does (a default file and a copy of it)."""
    with contextlib.suppress(OSError):
        return b.is_file() and a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()
    return False


def in_default_library(path: str | Path) -> bool:
    """Whether a rule from `path` is the default library's: one of its files, or a copy of one under its name
    (`load_library`: the repository's beside an installed prismc)."""
    return _in_library(Path(path).resolve(), tuple(default_files()))


@functools.cache
def _in_library(path: Path, files: tuple[Path, ...]) -> bool:
    return any(path == f.resolve() or path.name == f.name and same_bytes(f, path) for f in files)


def _load_file(path: Path, errors: Collector, seen: dict, rules: list, texts: list, stack: tuple, at) -> None:
    key = path.resolve()
    if key in stack:
        cycle = " -> ".join(p.name for p in stack[stack.index(key) :] + (key,))
        errors.error(at, f"import cycle: {cycle}")
        return
    if key in {p.resolve() for p in seen}:
        return
    if path.suffix == ".prism":
        errors.error(at, f"'{path}' is a .prism program; axioms come from .rules files")
        return
    try:
        text = read_source(path, at=at, what="import" if at else "rules file")
        items = parse_rules(text, str(path))
    except PrismError as e:
        errors.extend(e)
        return
    for item in items:
        if isinstance(item, ast.Import):
            _load_file(path.parent / item.path, errors, seen, rules, texts, stack + (key,), item.loc)
    seen[path] = None
    texts.append(text)
    for item in items:
        if isinstance(item, _RawRuleset):
            for raw in item.rules:
                rule = check_rule(raw, item.name, errors)
                if rule is not None:
                    rules.append(rule)


def _check_unique(rules: list[Rule], errors: Collector) -> None:
    first: dict[str, Rule] = {}
    for r in rules:
        if r.name in first:
            errors.error(r.loc, f"duplicate rule name '{r.name}'", f"first defined at {first[r.name].loc}")
        else:
            first[r.name] = r


class _Vars:
    """The pattern variables of one side, by role, with the first place each appears."""

    def __init__(self) -> None:
        self.tensor: dict[str, Loc] = {}
        self.dim: dict[str, Loc] = {}
        self.count: dict[str, Loc] = {}


def check_rule(raw: _RawRule, ruleset: str, errors: Collector) -> Rule | None:
    """Static checks of one rule: operators, arities, variable roles and binding, conditions."""
    before = len(errors.diagnostics)
    lhs_vars, rhs_vars = _Vars(), _Vars()
    _check_pattern(raw.lhs, lhs_vars, errors)
    _check_pattern(raw.rhs, rhs_vars, errors)
    if isinstance(raw.lhs, ast.Name) or isinstance(raw.lhs, ast.Num):
        errors.error(raw.lhs.loc, "the left side of a rule must be an operator application, not a lone variable or number")
    both = raw.arrow == "<=>"
    if both and (isinstance(raw.rhs, ast.Name) or isinstance(raw.rhs, ast.Num)):
        errors.error(raw.rhs.loc, "the right side of a '<=>' rule is also a left side; it cannot be a lone variable or number (use '=>')")
    roles = ("tensor", "dim", "count")
    for role in roles:
        left, right = getattr(lhs_vars, role), getattr(rhs_vars, role)
        for name, loc in right.items():
            other = next((o for o in roles if o != role and name in getattr(lhs_vars, o)), None)
            if other:
                errors.error(loc, f"'{name}' is a {other} on the left; here it is used as a {role}")
            elif name not in left:
                errors.error(loc, f"'{name}' is used on the right but not bound on the left{suggest(name, left)}")
        if both:
            for name, loc in left.items():
                if name not in right:
                    errors.error(loc, f"'{name}' is not used on the right, so '<=>' cannot rewrite right to left; use '=>'")
    for name in set(lhs_vars.tensor) & set(lhs_vars.dim):
        errors.error(lhs_vars.dim[name], f"'{name}' is used both as a tensor and as a dim")
    for name in (set(lhs_vars.tensor) | set(lhs_vars.dim)) & set(lhs_vars.count):
        errors.error(lhs_vars.count[name], f"'{name}' is used both as a count and as a tensor or dim")
    for cond in raw.conditions:
        _check_condition(cond, lhs_vars, errors)
    unequal_shapes = [c for c in raw.conditions if isinstance(c.lhs, ShapeOf) and c.op == "!="]
    if len(unequal_shapes) > MAX_SHAPE_INEQUALITIES:
        errors.error(unequal_shapes[MAX_SHAPE_INEQUALITIES].loc,
                     f"too many 'shape(..) != shape(..)' conditions: at most {MAX_SHAPE_INEQUALITIES} a rule "
                     f"(each holds in one of {MAX_RANK} dims, so each multiplies the rewrites the prover "
                     f"loads by {MAX_RANK})")
    if len(errors.diagnostics) > before:
        return None
    return Rule(
        raw.name, ruleset, raw.lhs, raw.rhs, both, raw.conditions, raw.loc,
        frozenset(lhs_vars.tensor), frozenset(lhs_vars.dim), frozenset(lhs_vars.count),
    )


def _check_pattern(e: ast.Expr, vars: _Vars, errors: Collector) -> None:
    match e:
        case ast.Num():
            return
        case ast.Name():
            if _variable_ok(e.id, e.loc, errors):
                vars.tensor.setdefault(e.id, e.loc)
        case ast.Call():
            spec = OPS.get(e.fn)
            if spec is None or e.fn not in RULE_CALLABLE or len(e.args) != spec.arity:
                if spec is None or e.fn not in RULE_CALLABLE:
                    errors.error(e.loc, f"unknown operator '{e.fn}'{suggest(e.fn, RULE_CALLABLE)}")
                else:
                    errors.error(e.loc, f"{written(e.fn)} takes {arity_words(spec)}, got {len(e.args)} argument{'s' * (len(e.args) != 1)}")
                for a in e.args:  # still learn its variables, so no second error follows from this one
                    if isinstance(a, ast.Name):
                        vars.tensor.setdefault(a.id, a.loc)
                    else:
                        _check_pattern(a, vars, errors)
                return
            for a in e.args[: spec.operands]:
                _check_pattern(a, vars, errors)
            for a, role in zip(e.args[spec.operands :], spec.params):
                _check_param(a, "count" if role == "count" else "dim", vars, errors, e.fn)


def _check_param(a: ast.Expr, role: str, vars: _Vars, errors: Collector, op: str) -> None:
    """A dim (or block dim) or count argument: a variable of that role, or an integer literal in range."""
    if isinstance(a, ast.Name):
        if _variable_ok(a.id, a.loc, errors):
            getattr(vars, role).setdefault(a.id, a.loc)
        return
    value = literal_dim(a)
    if role == "count":
        if value is None or value < 1:
            errors.error(a.loc, f"the count of {op} must be a variable or a positive integer")
    elif value is None:
        errors.error(a.loc, f"the dim of {op} must be a dim variable or a negative integer literal")
    elif value >= 0:
        errors.error(a.loc, "dims in rules count from the end so that one rule fits every rank: write a negative dim such as -1 (the last)")
    elif value < -MAX_RANK:
        errors.error(a.loc, f"dim {value} is beyond the {MAX_RANK} dims the prover tracks; use -1 .. -{MAX_RANK}")


def sexpr(e: ast.Expr) -> str:
    match e:
        case ast.Num():
            return repr(e.value)
        case ast.Name():
            return e.id
        case ast.Call():
            return f"({e.fn} {' '.join(sexpr(a) for a in e.args)})"
    raise TypeError(e)


def literal_dim(a: ast.Expr) -> int | None:
    """The integer a dim argument spells (`-1` parses as neg(1)), or None."""
    if isinstance(a, ast.Num) and a.value == int(a.value) and a.text.isdigit():
        return int(a.value)
    if isinstance(a, ast.Call) and a.fn == "neg" and isinstance(a.args[0], ast.Num) and a.args[0].text.isdigit():
        return -int(a.args[0].value)
    return None


# Names that a pattern variable may not take, or resemble: every operator, and `size` of conditions.
_RESERVED = frozenset(RULE_CALLABLE) | {"size", "shape"}


def _variable_ok(name: str, loc: Loc, errors: Collector) -> bool:
    if name in _RESERVED:
        errors.error(loc, f"'{name}' is an operator, not a pattern variable; call it as {name}(...)")
        return False
    close = _misspelt(name)
    if close:
        errors.error(
            loc,
            f"'{name}' would become a pattern variable, but it looks like a misspelling of '{close}'",
            "pattern variables should be short names that resemble no operator (a, b, s, x, i, j)",
        )
        return False
    return True


@functools.lru_cache(maxsize=4096)
def _misspelt(name: str) -> str | None:
    """The reserved name that `name` looks like a misspelling of (cached: a file repeats its variables)."""
    close = difflib.get_close_matches(name, _RESERVED, n=1, cutoff=0.75) if len(name) >= 3 else []
    return close[0] if close else None


def _check_condition(c: Condition, vars: _Vars, errors: Collector) -> None:
    kinds = [_operand_kind(o, vars, c.loc, errors) for o in (c.lhs, c.rhs)]
    if None in kinds:
        return
    literal_dim = {kinds[0], kinds[1]} == {"dim", "size"} and (isinstance(c.lhs, Lit) or isinstance(c.rhs, Lit))
    if kinds[0] != kinds[1] and not literal_dim:  # `i != -1` compares a dim variable with a literal dim
        errors.error(c.loc, "a condition compares a size with a size or an integer, a shape with a shape, or a dim with a dim")
    elif kinds == ["size", "size"] and any(isinstance(o, Lit) and o.value < 1 for o in (c.lhs, c.rhs)):
        never = c.op == "=="
        errors.error(c.loc, f"a size is at least 1: this condition {'never' if never else 'always'} holds"
                            + ("; the rule could never apply" if never else "; leave it out"))
    elif c.lhs == c.rhs:  # `i != i`, `shape(a) == shape(a)`
        errors.error(c.loc, f"a condition compares an operand with itself: it {'always' if c.op == '==' else 'never'}"
                            " holds")


def _operand_kind(o: Operand, vars: _Vars, loc: Loc, errors: Collector) -> str | None:
    """A condition operand's kind ("size", "shape" or "dim"), or None once what is wrong with it is reported."""
    match o:
        case SizeOf(var=v) if v not in vars.tensor:
            problem = f"size({v}, ...): '{v}' is not a tensor variable of the left side{suggest(v, vars.tensor)}"
        case SizeOf(dim=str(d)) if d not in vars.dim:
            problem = f"size(..., {d}): '{d}' is not a dim variable of the left side"
        case SizeOf(dim=int(d)) if d >= 0:
            problem = f"size(..., {d}): dims in rules count from the end; use a negative dim such as -1"
        case SizeOf(dim=int(d)) if d < -MAX_RANK:
            problem = f"size(..., {d}): the prover tracks the last {MAX_RANK} dims; use -1 .. -{MAX_RANK}"
        case ShapeOf(var=v) if v not in vars.tensor:
            problem = f"shape({v}): '{v}' is not a tensor variable of the left side{suggest(v, vars.tensor)}"
        case DimVar(name=n) if n not in vars.count and n not in vars.dim:
            problem = f"'{n}' is not a dim variable of the left side{suggest(n, vars.dim)}"
        case SizeOf() | Lit():
            return "size"
        case ShapeOf():
            return "shape"
        case DimVar(name=n):
            return "size" if n in vars.count else "dim"
        case _:
            raise TypeError(o)
    errors.error(loc, problem)
    return None
