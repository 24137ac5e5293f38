"""Syntax tree to checked IR: name resolution, imports, inline functions, symbolic shapes.

`load(path)` reads a `.prism` file with everything it imports and returns a `Source`: its dims, defs and
checked programs. Every error found in the files is collected and raised at the end as one PrismError,
so a user sees them all at once. Calls to `def` functions are inlined here; literals are folded; the
result is the kernel-level graph of `ir.Node`s the rest of the pipeline works on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import sympy

from . import syntax_tree as ast
from ..base.errors import Collector, Loc, PrismError
from ..ir.nodes import DTYPES, Dim, Node, Program, const, dim_symbol
from ..ir.ops import BLOCK_CALLABLE, CALLABLE, OPS, Kind, arity_words, written
from ..ir.shapes import ShapeError, build, fmt_shape
from ..semantics.reference import NUMPY
from .check_kernel import check_kernel
from .scope import POISON, Poison, Scope, unknown_function, unknown_name
from .syntax import MAX_DEPTH, parse_prism, read_source, suggest


@dataclass(frozen=True)
class Source:
    path: str
    dims: tuple[Dim, ...]
    programs: Mapping[str, Program]
    files: tuple[str, ...] = ()  # every file read: this one and what it imports, resolved

    def program(self, name: str | None = None) -> Program:
        """The named program, or the only one when no name is given."""
        if name is None:
            if len(self.programs) == 1:
                return next(iter(self.programs.values()))
            if not self.programs:
                raise PrismError(f"{self.path} defines no program")
            names = ", ".join(self.programs)
            raise PrismError(f"{self.path} defines several programs ({names}); choose one with --program")
        if name not in self.programs:
            raise PrismError(f"{self.path} has no program '{name}'{suggest(name, self.programs)}")
        return self.programs[name]


def load(path: str | Path, text: str | None = None) -> Source:
    """Parse and check a .prism file (or `text`, named `path` in messages)."""
    errors = Collector()
    read: dict = {}  # by resolved path: each file's syntax tree and scope
    module, scope = _load_module(Path(path), errors, stack=(), at=None, cache=read, text=text)
    programs: dict[str, Program] = {}
    if module is not None and not scope.incomplete:  # after a failed import, every name could be a follow-on error
        for item in module.items:
            if isinstance(item, ast.ProgramDecl):
                if item.name in programs:
                    errors.error(item.loc, f"duplicate program '{item.name}'")
                    continue
                prog = Checker(scope, errors).program(item)
                if prog is not None:
                    programs[item.name] = prog
    if errors and Path(path).suffix == ".rules":  # read as a program by mistake
        errors.error(Loc(str(path)), "a .rules file holds axioms, not programs: commands read programs from .prism "
                                     "files, and `prismc prove` takes rules with --rules")
    errors.raise_if_any()
    dims = tuple(Dim(dim_symbol(d.name), d.value) for d in scope.dims.values())
    return Source(str(path), dims, programs, tuple(str(f) for f in read))


def _load_module(path: Path, errors: Collector, stack: tuple[Path, ...], at: Loc | None, cache: dict,
                 text: str | None = None):
    """Parse `path` and its imports (depth first) into a Scope; cycles and bad files become errors."""
    key = path.resolve()
    if key in stack:
        cycle = " -> ".join(p.name for p in stack[stack.index(key) :] + (key,))
        errors.error(at, f"import cycle: {cycle}")
        return None, Scope()
    if key in cache:
        return cache[key]
    if at is not None and path.suffix == ".rules":  # axioms: not a program's to import
        errors.error(at, f"'{path.name}' is a .rules file: it holds axioms, which a program cannot import "
                         "(`prismc prove` takes them with --rules)")
        return None, Scope()
    try:
        if text is None:
            text = read_source(path, at=at, what="import" if at else "file")
        module = parse_prism(text, str(path))
    except PrismError as e:
        errors.extend(e)
        return None, Scope()
    scope = Scope()
    for item in module.items:
        if isinstance(item, ast.Import):
            target = path.parent / item.path
            imported_module, imported = _load_module(target, errors, stack + (key,), item.loc, cache)
            _merge(scope, imported, errors, item.loc)
            scope.incomplete |= imported_module is None or imported.incomplete
    for item in module.items:
        if isinstance(item, ast.DimDecl):
            if item.value < 1:
                errors.error(item.loc, f"dim '{item.name}' must be at least 1, got {item.value}")
            _declare(scope.dims, item, errors, "dim", same=lambda a, b: a.value == b.value)
        elif isinstance(item, ast.Def):
            if item.name in CALLABLE:
                errors.error(item.loc, f"def '{item.name}' would hide the built-in operator '{item.name}'")
            else:
                _declare(scope.defs, item, errors, "def", same=lambda a, b: a is b)
    for item in module.items if not scope.incomplete else ():
        if isinstance(item, ast.Def) and scope.defs.get(item.name) is item and not _check_def(item, scope, errors):
            scope.broken.add(item.name)
    cache[key] = (module, scope)
    return module, scope


def _declare(table: dict, item, errors: Collector, what: str, same) -> None:
    old = table.get(item.name)
    if old is not None and not same(old, item):
        errors.error(item.loc, f"duplicate {what} '{item.name}'", f"first declared at {old.loc}")
    elif old is None:
        table[item.name] = item


def _merge(scope: Scope, imported: Scope, errors: Collector, at: Loc) -> None:
    for d in imported.dims.values():
        old = scope.dims.get(d.name)
        if old is not None and old.value != d.value:
            errors.error(at, f"imported dim '{d.name}' = {d.value} conflicts with {d.name} = {old.value} at {old.loc}")
        scope.dims.setdefault(d.name, d)
    for f in imported.defs.values():
        old = scope.defs.get(f.name)
        if old is not None and old is not f:
            errors.error(at, f"imported def '{f.name}' conflicts with the one at {old.loc}")
        scope.defs.setdefault(f.name, f)
    scope.broken |= imported.broken


def _check_def(f: ast.Def, scope: Scope, errors: Collector) -> bool:
    """Check what a def's body can be checked for without its arguments: names, functions, arities.

    Done where the def is declared, so a mistake in a def is reported even when nothing calls it, and
    once, not once per call. Shapes depend on the arguments and are checked at each call.
    """
    before = len(errors.diagnostics)
    if len(set(f.params)) != len(f.params):
        errors.error(f.loc, f"def '{f.name}' repeats a parameter name")
    for name in f.params:
        if name in CALLABLE or name in scope.defs:
            errors.error(f.loc, f"def '{f.name}' has a parameter named '{name}', a function name; choose another name")
    stack = [f.body]
    while stack:
        e = stack.pop()
        if isinstance(e, ast.Name) and e.id not in f.params:
            errors.error(e.loc, unknown_name(e.id, f.params, scope))
        elif isinstance(e, ast.Call):
            if e.fn in scope.defs or e.fn in BLOCK_CALLABLE:  # accumulators: for defs used in kernels
                _bad_arity(e, scope, errors)
            else:
                errors.error(e.loc, unknown_function(e.fn, scope))
            stack.extend(e.args)
    return len(errors.diagnostics) == before


def _bad_arity(e: ast.Call, scope: Scope, errors: Collector) -> bool:
    """Whether a call to a def or an operator has the wrong number of arguments; if so, it is reported."""
    if e.fn in scope.defs:
        wanted = len(scope.defs[e.fn].params)
        takes = f"{wanted} argument(s)"
    else:
        wanted, takes = OPS[e.fn].arity, arity_words(OPS[e.fn])
    if len(e.args) != wanted:
        errors.error(e.loc, f"{written(e.fn)} takes {takes}, got {len(e.args)} argument{'s' * (len(e.args) != 1)}")
    return len(e.args) != wanted


class _TooDeep(Exception):
    """Inlining made an expression deeper than MAX_DEPTH; unwinds to the outermost call, which reports it."""


class _TooLarge(Exception):
    """Inlining made a program larger than MAX_INLINED; unwinds to the outermost call, which reports it."""


# The most operations the defs of one program may inline to (each call inlines its def's body again, so defs
# that call each other twice a level double at every level: 40 levels would be 2^40). Programs of tens of
# operations are what the search handles; checking takes about a millisecond an operation.
MAX_INLINED = 10_000


class Checker:
    """Checks one program declaration in a scope, reporting into a shared Collector."""

    def __init__(self, scope: Scope, errors: Collector):
        self.scope, self.errors = scope, errors
        self.locs: dict[Node, Loc] = {}
        self.names: dict[Node, str] = {}
        self.used_dims: set[str] = set()
        # How deep the expression being checked is, inlined def bodies included. The parser bounds each
        # written expression; a chain of defs calling defs could still nest deep enough to overflow the
        # Python stack, so inlining stops at the same bound.
        self.depth = 0
        self.body_depth: dict[str, int] = {}  # each def's body depth, measured once
        self.body_size: dict[str, int] = {}  # and its operations
        self.inlined = 0  # operations inlined so far (at most MAX_INLINED)
        self.calls: dict[tuple, Node] = {}  # a def's value by its name and arguments: inlined once
        self.callable = CALLABLE  # the operators an expression may call here (more inside a kernel)
        self.kernel_names: dict[str, Loc] = {}

    def program(self, decl: ast.ProgramDecl) -> Program | None:
        before = len(self.errors.diagnostics)
        env: dict[str, Node | Poison] = {}
        inputs = []
        for p in decl.params:
            node = self.input(p)
            if p.name in env:
                self.errors.error(p.loc, f"duplicate input '{p.name}'")
                continue
            if p.name in CALLABLE or p.name in self.scope.defs:
                self.errors.error(p.loc, f"input '{p.name}' has a function name; choose another name")
            env[p.name] = node
            if node is not POISON:
                inputs.append(node)
        for stmt in decl.body:
            if isinstance(stmt, ast.KernelDecl):
                check_kernel(self, stmt, env)
                continue
            value = self.expr(stmt.expr, env, defs_stack=())
            if stmt.name in env:
                self.errors.error(stmt.loc, f"'{stmt.name}' is already defined; every name is assigned once")
                continue
            if stmt.name in CALLABLE or stmt.name in self.scope.defs:
                self.errors.error(stmt.loc, f"'{stmt.name}' is a function name; choose another name")
            env[stmt.name] = value
            if isinstance(value, Node) and value.op != "input":
                self.names.setdefault(value, stmt.name)
                self.locs.setdefault(value, stmt.expr.loc)
        outputs = []
        for name, loc in decl.ret.names:
            if name not in env:
                self.errors.error(loc, f"cannot return undefined name '{name}'{suggest(name, env)}")
            elif any(name == n for n, _ in outputs):
                self.errors.error(loc, f"'{name}' is returned twice")
            elif isinstance(env[name], Node):
                if env[name].op == "const":
                    self.errors.error(loc, f"'{name}' is a constant; a program returns tensors")
                sizes = {str(x) for s in env[name].shape for x in sympy.sympify(s).free_symbols}
                if params := sorted(sizes - set(self.scope.dims)):  # a store whose tile and map miss the whole
                    self.errors.error(loc, f"'{name}' has shape {fmt_shape(env[name].shape)}, which depends on kernel "
                                      f"parameters ({', '.join(params)}): a returned tensor's shape must follow from "
                                      "the dims alone, whatever the parameters")
                outputs.append((name, env[name]))
        if len(self.errors.diagnostics) > before:
            return None
        dims = tuple(Dim(dim_symbol(d.name), d.value) for d in self.scope.dims.values() if d.name in self.used_dims)
        return Program(decl.name, dims, tuple(inputs), tuple(outputs), self.locs, self.names, decl.loc)

    def input(self, p: ast.Param) -> Node | Poison:
        dtype = DTYPES.get(p.dtype)
        ok = True
        if dtype is None:
            self.errors.error(p.dtype_loc, f"unknown dtype '{p.dtype}' (expected one of {', '.join(DTYPES)})")
            ok = False
        shape = []
        for d in p.shape:
            if isinstance(d.value, int):
                if d.value < 1:
                    self.errors.error(d.loc, f"a size must be at least 1, got {d.value}")
                    ok = False
                shape.append(d.value)
            elif d.value in self.scope.dims:
                self.used_dims.add(d.value)
                shape.append(dim_symbol(d.value))
            else:
                hint = suggest(d.value, self.scope.dims) or f"; declare it with 'dims {d.value} = ...'"
                self.errors.error(d.loc, f"undeclared dim '{d.value}'{hint}")
                ok = False
        if not ok:
            return POISON
        node = Node("input", (), p.name, dtype, tuple(sympy.Integer(s) if isinstance(s, int) else s for s in shape))
        self.locs.setdefault(node, p.loc)
        return node

    def expr(self, e: ast.Expr, env: Mapping, defs_stack: tuple) -> Node | Poison:
        self.depth += 1
        try:
            match e:
                case ast.Num():
                    return const(e.value)
                case ast.Name():
                    return self.name(e, env)
                case ast.Call():
                    return self.call(e, env, defs_stack)
            raise TypeError(e)
        finally:
            self.depth -= 1

    def name(self, e: ast.Name, env: Mapping) -> Node | Poison:
        if e.id in env:
            return env[e.id]
        self.errors.error(e.loc, unknown_name(e.id, env, self.scope))
        return POISON

    def call(self, e: ast.Call, env: Mapping, defs_stack: tuple) -> Node | Poison:
        if e.fn in self.scope.defs:
            return self.inline(e, env, defs_stack)
        spec = OPS.get(e.fn)
        if spec is None or e.fn not in self.callable:
            if spec is not None and spec.where == "block":
                self.errors.error(e.loc, f"{e.fn} is a loop accumulator; it can only be used inside a kernel")
            elif spec is not None and spec.where == "rules":
                self.errors.error(e.loc, f"{e.fn} is a layout operator of the prover; it can only be used in rules")
            else:
                self.errors.error(e.loc, unknown_function(e.fn, self.scope))
            for a in e.args:  # still report errors inside the arguments
                self.expr(a, env, defs_stack)
            return POISON
        if _bad_arity(e, self.scope, self.errors):
            return POISON
        operands = [self.expr(a, env, defs_stack) for a in e.args[: spec.operands]]
        params = [self.int_param(a, written(spec.name), pname) for a, pname in zip(e.args[spec.operands :], spec.params)]
        if any(x is POISON for x in operands + params):
            return POISON
        for a, o in zip(e.args[spec.operands - spec.constants : spec.operands], operands[spec.operands - spec.constants :]):
            if o.op != "const" or o.attr < 0:
                what = "a constant such as 1e-5" if o.op != "const" else f"at least 0, got {o.attr:g}"
                self.errors.error(a.loc, f"the eps of {written(spec.name)} must be {what}")
                return POISON
        if all(o.op == "const" for o in operands) and spec.kind in (Kind.UNARY, Kind.BINARY):
            return self.fold(e, operands)
        try:
            node = build(e.fn, operands, params)
        except ShapeError as err:
            self.errors.error(e.loc, f"{written(e.fn)}: {err}", *self.operand_notes(e, operands))
            return POISON
        self.locs.setdefault(node, e.loc)
        return node

    def int_param(self, a: ast.Expr, op: str, pname: str) -> int | Poison:
        value = a.value if isinstance(a, ast.Num) else None
        if isinstance(a, ast.Call) and a.fn == "neg" and isinstance(a.args[0], ast.Num):
            value = -a.args[0].value
        if value is None or value != int(value) or "." in _text(a) or "e" in _text(a).lower():
            self.errors.error(a.loc, f"the {pname} of {op} must be an integer literal such as -1")
            return POISON
        # Not int(value): a float keeps 53 bits. The text has at most ~309 digits past its leading zeros.
        return int(_text(a).lstrip("0") or "0") * (-1 if value < 0 else 1)

    def fold(self, e: ast.Call, operands: list[Node]) -> Node | Poison:
        with np.errstate(all="ignore"):
            value = float(NUMPY[e.fn](*[np.float64(o.attr) for o in operands]))
        if not np.isfinite(value):
            self.errors.error(e.loc, f"this constant expression has no finite value ({value})")
            return POISON
        return const(value)

    def operand_notes(self, e: ast.Call, operands: list[Node]) -> list[str]:
        notes = []
        for arg, node in zip(e.args, operands):
            if node.op != "const":
                notes.append(f"{_describe(arg)} has shape {fmt_shape(node.shape)}")
        return notes

    def inline(self, e: ast.Call, env: Mapping, defs_stack: tuple) -> Node | Poison:
        f = self.scope.defs[e.fn]
        if e.fn in defs_stack:
            chain = " -> ".join(defs_stack[defs_stack.index(e.fn) :] + (e.fn,))
            self.errors.error(e.loc, f"recursive call to '{e.fn}' ({chain}); defs are inlined and cannot recurse")
            return POISON
        if _bad_arity(e, self.scope, self.errors):
            return POISON
        args = [self.expr(a, env, defs_stack) for a in e.args]
        if any(a is POISON for a in args) or e.fn in self.scope.broken:  # a broken body is reported at its def
            return POISON
        if (known := self.calls.get((e.fn, *args))) is not None:  # nodes are interned: the same call, the same value
            return known
        try:
            if f.name not in self.body_depth:
                self.body_depth[f.name], self.body_size[f.name] = _ast_depth(f.body), _ast_size(f.body)
            if self.depth + self.body_depth[f.name] > MAX_DEPTH:
                raise _TooDeep
            self.inlined += self.body_size[f.name]
            if self.inlined > MAX_INLINED:
                raise _TooLarge
            before = len(self.errors.diagnostics)
            value = self.expr(f.body, dict(zip(f.params, args)), defs_stack + (e.fn,))
        except (_TooDeep, _TooLarge) as too:
            if defs_stack:
                raise
            message = (f"'{e.fn}' nests more than {MAX_DEPTH} levels deep once the defs it calls are inlined"
                       if isinstance(too, _TooDeep) else
                       f"'{e.fn}' makes the program more than {MAX_INLINED:,} operations once the defs it calls are "
                       "inlined (each call inlines its def again)")
            self.inlined = 0
            self.errors.error(e.loc, message)
            return POISON
        if value is not POISON:
            self.calls[(e.fn, *args)] = value
        # Errors inside the body are reported where the body is written; say which call led there.
        for i in range(before, len(self.errors.diagnostics)):
            d = self.errors.diagnostics[i]
            self.errors.diagnostics[i] = type(d)(d.loc, d.message, d.notes + (f"in the call to '{e.fn}' at {e.loc}",))
        return value


def _ast_depth(e: ast.Expr) -> int:
    depth, stack = 0, [(e, 1)]
    while stack:
        node, d = stack.pop()
        depth = max(depth, d)
        if isinstance(node, ast.Call):
            stack.extend((a, d + 1) for a in node.args)
    return depth


def _ast_size(e: ast.Expr) -> int:
    """The operations (calls) written in `e`."""
    size, stack = 0, [e]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Call):
            size += 1
            stack.extend(node.args)
    return size


def _text(a: ast.Expr) -> str:
    if isinstance(a, ast.Num):
        return a.text
    if isinstance(a, ast.Call) and a.args:
        return _text(a.args[0])
    return ""


def _describe(a: ast.Expr) -> str:
    if isinstance(a, ast.Name):
        return f"'{a.id}'"
    if isinstance(a, ast.Call):
        return f"the operand at {a.loc.line}:{a.loc.col}"
    return "the operand"
