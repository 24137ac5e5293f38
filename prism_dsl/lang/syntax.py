"""Text to syntax tree: reading source files and parsing them with the lark grammars.

`read_source` turns every file-system problem (missing, a directory, a device or FIFO, too large, not
UTF-8) into a PrismError.
`parse_prism` runs the LALR parser from `grammar/prism.lark` and builds `syntax_tree` nodes with positions.
Syntax errors are classified by `SYNTAX_ERRORS`, a table of (message, bad examples) matched by parser
state the way lark's `match_examples` does; a test walks the same table. The `.rules` front end
(`prove.rules`) reuses `parse_with` (so its expressions are `ExprBuilder`'s), `LocatedBuilder` and the same
error machinery.
"""

from __future__ import annotations

import difflib
import functools
import re
from pathlib import Path

from lark import Lark, Token, Transformer, Tree, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError
from lark.visitors import merge_transformers

from . import syntax_tree as ast
from ..base.errors import Loc, PrismError
from ..base.files import MAX_TEXT_BYTES, describe, read_regular
from ..ir.ops import resolve

GRAMMAR_DIR = Path(__file__).parent / "grammar"

# Source files (programs, rules, their imports) larger than this are refused unread: real ones are a few KiB.
MAX_SOURCE_BYTES = MAX_TEXT_BYTES

# Deeper trees than this are refused before any recursive pass walks them. Real programs stay below 30.
MAX_DEPTH = 200

# Integer literals (sizes, dims) above this are refused where they are written: no tensor comes near, and
# Python will not even convert an integer of 4,300 digits or more.
MAX_INT = 2**63 - 1

# How the examples below end a statement: LALR fails in a different state after each.
_ENDS = ["X", "exp(X)", "(X)", "1", "X;"]

# Syntax errors worth a specific message, with examples that put the parser in the same state.
# Order matters: the first label whose examples match the failing state wins.
SYNTAX_ERRORS: dict[str, list[str]] = {
    "missing ')'": [
        "program p(X: f16[n]) { Y = exp(X\n return Y }",
        "program p(X: f16[n]) { Y = (X + X\n return Y }",
        "program p(X: f16[n]) { Y = sum(X, 0\n return Y }",
        "def f(x) = (x * x",
        "def f(x) = exp(x",
        "def f(x) = exp((x)",
    ],
    "unbalanced ')'": [
        "program p(X: f16[n]) { Y = X) return Y }",
        "program p(X: f16[n]) { Y = exp(X)) return Y }",
        "def f(x) = x)",
    ],
    "missing operand": [
        "program p(X: f16[n]) { Y = X + \n return Y }",
        "program p(X: f16[n]) { Y = X * }",
        "program p(X: f16[n]) { Y = \n return Y }",
        "def f(x) = x +",
        "def f(x) = x *",
        "def f(x) = ",
        "program p(X: f16[n]) { store = \n return X }",
        "program p(X: f16[n]) { kernel = \n return X }",
    ],
    "a program must end with 'return NAME, ...'": [
        "program p(X: f16[n]) { Y = X }",
        "program p(X: f16[n]) { Y = exp(X) }",
        "program p(X: f16[n]) { Y = (X) }",
        "program p(X: f16[n]) { Y = 1 }",
        "program p(X: f16[n]) { Y = X; }",
        "program p(X: f16[n]) { }",
        "program p(X: f16[n]) { Y = X\n",
        "program p(X: f16[n]) { Y = exp(X)\n",
        "program p(X: f16[n]) { Y = X;\n",
        "program p(X: f16[n]) {",
    ],
    "one ';' at most ends a statement or declaration": [
        "dims n = 1;;",
        "program p(X: f16[n]) { Y = X;; return Y }",
    ],
    "a kernel is 'kernel NAME grid(x = SIZE, ...) [loop(SIZE)] { ... }'": [
        "program p(X: f16[n]) { kernel k { } return X }",
        "program p(X: f16[n]) { kernel k grid() { } return X }",
        "program p(X: f16[n]) { kernel k grid(x) { } return X }",
        "program p(X: f16[n]) { kernel k grid(x = 1) loop { } return X }",
        "program p(X: f16[n]) { kernel grid(x = 1) { } return X }",
    ],
    "a map lists one entry per dim: ':' (whole), an axis (x, y, z), 'loop', or 'AXIS*loop'": [
        "program p(X: f16[n]) { kernel k grid(x = 1) { t = load X[1] } return X }",
        "program p(X: f16[n]) { kernel k grid(x = 1) { t = load X[x,] } return X }",
        "program p(X: f16[n]) { kernel k grid(x = 1) { t = load X[x*] } return X }",
        "program p(X: f16[n]) { kernel k grid(x = 1) { store Y[1] = X } return X }",
    ],
    "a kernel statement is 'NAME = load TENSOR[map]', 'NAME = expression' or 'store NAME[map] = expression'": [
        "program p(X: f16[n]) { kernel k grid(x = 1) { load X[:] } return X }",
        "program p(X: f16[n]) { kernel k grid(x = 1) { t = load X } return X }",
        "program p(X: f16[n]) { kernel k grid(x = 1) { store Y = X } return X }",
        "program p(X: f16[n]) { kernel k grid(x = 1) { return X } return X }",
    ],
    "outside a kernel, 'store' is a name ('store = expression'); 'store NAME[map] = ...' is written in a kernel": [
        "program p(X: f16[n]) { store Y[:] = X\n return X }",
        "program p(X: f16[n]) { store Y = X\n return X }",
        "program p(X: f16[n]) { A = X\n store Y[:] = X\n return A }",
        "program p(X: f16[n]) { store\n return X }",
    ],
    "a statement is 'NAME = expression'": [
        "program p(X: f16[n]) { exp(X) return X }",
        "program p(X: f16[n]) { Y + X return Y }",
        "program p(X: f16[n]) { = X\n return X }",
        *(f"program p(X: f16[n]) {{ Y = {e}\n = X\n return Y }}" for e in _ENDS),
    ],
    "missing '}' at the end of the program": [
        "program p(X: f16[n]) { Y = X return Y",
    ],
    "an input is 'NAME: dtype[dims]', e.g. 'X: f16[n, d]'": [
        "program p(X) { return X }",
        "program p(X: f16) { return X }",
        "program p(X: f16[n], Y) { return X }",
        "program p(X f16[n]) { return X }",
    ],
    "outside a program, a file holds only 'dims', 'def', 'program' and 'import' declarations": [
        "Y = X",
        "return X",
        "lora(X: f16[n]) { return X }",
        "kernel k grid(x = 1) { store Y[x] = X }",
        "}",
    ],
    "a dim is 'NAME = INTEGER', e.g. 'dims n = 8'": [
        "dims n",
        "dims n = x",
        "dims n = 1.5",
        "dims n = 8, d",
    ],
    # Last, so that it only adds (state, keyword) pairs: inside a program, after '{' or any statement.
    "'dims', 'def', 'program' and 'import' declarations go outside a program's braces": [
        f"program p(X: f16[n]) {{ {before}\n {keyword} }}"
        for before in ["", *(f"Y = {e}" for e in _ENDS), "kernel k grid(x = 1) { store Y[x] = X }"]
        for keyword in ["dims m = 1", "def f(x) = x", 'import "a.prism"', "program q(X: f16[n]) { return X }"]
    ],
}


@functools.cache
def prism_parser() -> Lark:
    return Lark.open(str(GRAMMAR_DIR / "prism.lark"), parser="lalr", propagate_positions=True, cache=False)


def read_source(path: str | Path, *, at: Loc | None = None, what: str = "file") -> str:
    """Read a UTF-8 source file or raise a PrismError that says why it cannot be read.

    Only a regular file of at most MAX_SOURCE_BYTES is read (`base.files.read_regular`): `import "/dev/zero"`
    or a FIFO is refused at once, not read until memory runs out or forever."""
    where = at or Loc(str(path))
    try:
        data = read_regular(path, MAX_SOURCE_BYTES)
    except (OSError, ValueError) as e:
        raise PrismError(f"cannot read {what} '{path}': {describe(e)}", where) from None
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")  # a byte order mark is not text
    except UnicodeDecodeError as e:
        line_start = data.rfind(b"\n", 0, e.start) + 1
        line = data.count(b"\n", 0, e.start) + 1
        col = len(data[line_start : e.start].decode("utf-8")) + 1  # in characters, like parser positions
        shown = data.decode("utf-8", errors="replace")  # so the message can show the line with a caret
        raise PrismError(
            f"{what} is not valid UTF-8 text (byte 0x{data[e.start]:02x})", Loc(str(path), line, col, shown)
        ) from None
    return re.sub("\r(?!\n)", "\n", text)  # a lone CR ends a line, as in files of the classic Mac OS (CRLF kept)


def parse_prism(text: str, path: str) -> ast.Module:
    return parse_with(prism_parser(), ModuleBuilder, text, path)


def parse_with(parser: Lark, builder: type[LocatedBuilder], text: str, path: str,
               table: dict[str, list[str]] = SYNTAX_ERRORS):
    """Parse and build the syntax tree with `builder` (expressions with `ExprBuilder`), turning lark's
    exceptions into one located PrismError; an absurdly deep tree is refused before it is built."""
    try:
        tree = parser.parse(text)
    except UnexpectedInput as u:
        raise PrismError(syntax_message(parser, u, text, table), Loc(path, *_position(u, text), text)) from None
    check_depth(tree, path, text)
    try:
        return merge_transformers(builder(path, text), expr=ExprBuilder(path, text)).transform(tree)
    except VisitError as e:  # a PrismError raised inside a transformer method arrives wrapped
        if isinstance(e.orig_exc, PrismError):
            raise e.orig_exc from None
        raise


def _position(u: UnexpectedInput, text: str) -> tuple[int, int]:
    if isinstance(u, UnexpectedToken) and u.token.type == "$END" or isinstance(u, UnexpectedEOF):
        lines = text.removesuffix("\n").split("\n")  # "\n" only, as the lexer counts lines
        return len(lines), len(lines[-1].rstrip("\r")) + 1
    return u.line, u.column


def _key(u: UnexpectedInput) -> tuple[int | None, str | None]:
    """Where the parser was (its LALR state) and what it met (the token type) when it failed."""
    state = getattr(getattr(u, "state", None), "position", None)
    token = getattr(u, "token", None)
    return state, getattr(token, "type", None)


@functools.cache
def _labels(parser: Lark, table_id: int) -> dict:
    """(state, token type) -> message and state -> message, learned by parsing each example once.

    Like lark's `match_examples`, but without comparing the depth of the parse stack (which makes an
    example stop matching as soon as a file has one more item before it). The token type separates
    states that LALR shares, such as "just read a name" on either side of a rule's arrow. An example that
    fails at its first token also says what a top-level line may not start with: ("line", token type).
    """
    labels: dict = {}
    for label, examples in _TABLES[table_id].items():
        for example in examples:
            try:
                parser.parse(example)
            except UnexpectedInput as u:
                state, token = _key(u)
                labels.setdefault((state, token), label)
                labels.setdefault(state, label)
                if getattr(getattr(u, "token", None), "start_pos", None) == 0:
                    labels.setdefault(("line", token), label)
            else:
                raise AssertionError(f"syntax error example parses: {example!r}")
    return labels


_TABLES: dict[int, dict[str, list[str]]] = {}


def classify(parser: Lark, u: UnexpectedInput, table: dict[str, list[str]], text: str = "") -> str | None:
    """The label of `table` whose examples fail in the same parser state as `u`, if any.

    When the file could have ended just before the unexpected token and that token starts a line, the
    item above is complete and the new line is what is wrong: `return Y` or a misspelt `program` after
    a `dims` line is not a malformed dim. Such a line is judged as the first line of a file.
    """
    _TABLES[id(table)] = table
    labels = _labels(parser, id(table))
    state, token = _key(u)
    if state is None:
        return None
    if _may_end(u) and _starts_line(u, text):
        return labels.get(("line", token))
    return labels.get((state, token)) or labels.get(state)


def _may_end(u: UnexpectedInput) -> bool:
    """Whether the file could have ended where `u` happened: the parse so far, fed the end of file, is
    accepted. (Not "$END is in the state's table": LALR merges states, so the table's lookaheads can
    belong to another context, such as a def's body at the top level.)"""
    parser = getattr(u, "interactive_parser", None)
    if parser is None:
        return False
    try:
        parser.copy().feed_eof()
    except UnexpectedInput:
        return False
    return True


def _starts_line(u: UnexpectedInput, text: str) -> bool:
    start = getattr(getattr(u, "token", None), "start_pos", None)
    return start is not None and not text[text.rfind("\n", 0, start) + 1 : start].strip()


def syntax_message(parser: Lark, u: UnexpectedInput, text: str, table: dict[str, list[str]] = SYNTAX_ERRORS) -> str:
    # A bad character says nothing about the grammar state; only token errors get a specific message.
    label = None if isinstance(u, UnexpectedCharacters) else classify(parser, u, table, text)
    if isinstance(u, UnexpectedCharacters):
        found = f"unexpected character {text[u.pos_in_stream]!r}"
    elif isinstance(u, UnexpectedToken) and u.token.type != "$END":
        found = f"unexpected {clip(repr(u.token.value))}"
    else:
        found = "unexpected end of file"
    msg = f"syntax error: {found}"
    if label:
        return f"{msg}: {label}"
    expected = _expected(parser, u)
    return f"{msg}; expected {expected}" if expected else msg


_SHOWN = {"STORE_OP": "'=' or '+='"}  # terminals of alternatives, as the text would write them


def _expected(parser: Lark, u: UnexpectedInput) -> str:
    names = getattr(u, "expected", None) or ()
    shown = []
    for name in sorted(names):
        if name.startswith("__ANON") or name == "$END":
            continue
        try:
            pattern = parser.get_terminal(name).pattern
        except KeyError:
            continue
        shown.append(repr(pattern.value) if pattern.type == "str" else _SHOWN.get(name, name.lower().split("__")[-1]))
    return " or ".join(sorted(set(shown)))


def check_depth(tree: Tree, path: str, text: str) -> None:
    """Iteratively measure the tree depth so no recursive pass can overflow Python's stack."""
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            meta = node.meta
            loc = Loc(path, getattr(meta, "line", 0), getattr(meta, "column", 0), text)
            advice = "split it into rules" if path.endswith(".rules") else "split it into statements"
            raise PrismError(f"expression is nested more than {MAX_DEPTH} levels deep; {advice}", loc)
        stack.extend((c, depth + 1) for c in node.children if isinstance(c, Tree))


def clip(text: str, limit: int = 40) -> str:
    """`text` for a message: a 5,000-digit number or name is shown by its ends and its length."""
    return text if len(text) <= limit else f"{text[:16]}...{text[-8:]} ({len(text)} characters)"


def suggest(name: str, candidates) -> str:
    close = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


class LocatedBuilder(Transformer):
    """The base of the tree-to-AST builders (`.prism` here, `.rules` in `prove.rules`): locations as
    file:line:col, and the items both languages share (imports, integer literals)."""

    def __init__(self, path: str, text: str):
        super().__init__()
        self.path, self.text = path, text

    def loc(self, x) -> Loc:
        """Where a token or a tree's meta starts."""
        return Loc(self.path, getattr(x, "line", 0), getattr(x, "column", 0), self.text)

    @v_args(inline=True)
    def import_decl(self, tok: Token) -> ast.Import:
        """`import "NAME"`: NAME names a file, and no file name holds a NUL (the OS would refuse it)."""
        name = str(tok)[1:-1]
        if "\0" in name:
            raise PrismError("cannot import a file whose name contains a NUL character", self.loc(tok))
        return ast.Import(name, self.loc(tok))

    def integer(self, tok: Token) -> int:
        """An integer literal's value, or a located error when it is beyond any size or dim."""
        digits = str(tok).lstrip("-").lstrip("0") or "0"  # 5,000 zeros are still too many for int()
        if len(digits) > len(str(MAX_INT)) or int(digits) > MAX_INT:
            raise PrismError(f"integer {clip(str(tok))} is too large (at most 2^63 - 1)", self.loc(tok))
        return -int(digits) if str(tok).startswith("-") else int(digits)


def _binary(fn: str):
    @v_args(meta=True)
    def build(self, meta, children):
        lhs, rhs = children
        return ast.Call(fn, (lhs, rhs), self.loc(meta), "infix")

    return build


class ExprBuilder(LocatedBuilder):
    """The shared expression layer: `expr.lark` rules to `ast.Num | ast.Name | ast.Call`."""

    add, sub, mul, div, matmul = _binary("add"), _binary("sub"), _binary("mul"), _binary("div"), _binary("matmul")

    @v_args(meta=True)
    def neg(self, meta, children):
        return ast.Call("neg", (children[0],), self.loc(meta), "prefix")

    @v_args(inline=True)
    def number(self, tok):
        value = float(tok)
        if value == float("inf"):
            raise PrismError(f"number {clip(str(tok))} is too large", self.loc(tok))
        if value == 0 and any(c in "123456789" for c in str(tok).lower().partition("e")[0]):
            # float64 would make it 0, while the symbolic check of axioms reads the text exactly
            raise PrismError(f"number {clip(str(tok))} is too small: it is 0 in float64; write 0", self.loc(tok))
        return ast.Num(value, str(tok), self.loc(tok))

    @v_args(inline=True)
    def var(self, tok):
        return ast.Name(str(tok), self.loc(tok))

    @v_args(inline=True)
    def call(self, name, args):
        args = tuple(args or ())
        return ast.Call(resolve(str(name), len(args)), args, self.loc(name))

    def args(self, children):
        return children


class ModuleBuilder(LocatedBuilder):
    """`prism.lark` items to `ast` items."""

    def start(self, items):
        return ast.Module(self.path, tuple(items))

    def dims_decl(self, children):
        return children

    @v_args(inline=True)
    def dim_binding(self, name, value):
        return ast.DimDecl(str(name), self.integer(value), self.loc(name))

    @v_args(inline=True)
    def def_decl(self, name, params, body):
        return ast.Def(str(name), tuple(params or ()), body, self.loc(name))

    def names(self, toks):
        return [str(t) for t in toks]

    @v_args(inline=True)
    def param(self, name, dtype, shape):
        return ast.Param(str(name), str(dtype), tuple(shape or ()), self.loc(name), self.loc(dtype))

    def shape(self, toks):
        return [ast.ShapeDim(self.integer(t) if t.type == "INT" else str(t), self.loc(t)) for t in toks]

    def params(self, children):
        return children

    @v_args(inline=True)
    def stmt(self, name, expr):
        return ast.Stmt(str(name), expr, self.loc(name))

    @v_args(meta=True)
    def return_stmt(self, meta, toks):
        return ast.Return(tuple((str(t), self.loc(t)) for t in toks), self.loc(meta))

    def kernel(self, children):
        _, name, *rest = children  # the word `kernel`, then its name
        grid = [c for c in rest if isinstance(c, tuple)]
        loop = next((c for c in rest if isinstance(c, ast.Size)), None)
        body = [c for c in rest if not isinstance(c, (tuple, ast.Size)) and c is not None]
        return ast.KernelDecl(str(name), tuple(grid), loop, tuple(body), self.loc(name))

    @v_args(inline=True)
    def axis_size(self, axis, size):
        return (str(axis), self._size(size), self.loc(axis))

    @v_args(inline=True)
    def loop_range(self, size):
        return self._size(size)

    def _size(self, tok) -> ast.Size:
        return ast.Size(self.integer(tok) if tok.type == "INT" else str(tok), self.loc(tok))

    @v_args(inline=True)
    def load(self, tile, source, entries):
        return ast.LoadStmt(str(tile), str(source), tuple(entries or ()), self.loc(tile), self.loc(source))

    @v_args(inline=True)
    def store(self, _, name, entries, op, expr):  # the word `store` first
        return ast.StoreStmt(str(name), tuple(entries or ()), str(op) == "+=", expr, self.loc(name))

    def entries(self, children):
        return children

    @v_args(meta=True)
    def whole(self, meta, children):
        return ast.MapEntry((), self.loc(meta))

    @v_args(meta=True)
    def split(self, meta, toks):
        return ast.MapEntry(tuple(str(t) for t in toks if t is not None), self.loc(meta))

    def program(self, children):
        name, params, *body = children
        *stmts, ret = body
        return ast.ProgramDecl(str(name), tuple(params or ()), tuple(stmts), ret, self.loc(name))

    def transform(self, tree):
        module = super().transform(tree)
        # `dims a = 1, b = 2` yields a list; flatten so a module is a flat tuple of items.
        items = []
        for item in module.items:
            items.extend(item if isinstance(item, list) else [item])
        return ast.Module(module.path, tuple(items))
