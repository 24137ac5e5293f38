"""Every error the .prism front end reports: the message, its location, the source line and the caret.

`BAD` is one table of (source, message fragment, line, column). Each source is written to a file and
loaded; the error must render as `path:line:col: message`, then the line, then a caret under the column.
File-system problems, imports across files and absurd nesting have their own tests below.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from prism_dsl.lang.check import load
from prism_dsl.cli.main import main
from prism_dsl.base.errors import PrismError
from prism_dsl.lang.syntax import SYNTAX_ERRORS
from prism_dsl.prove.rules import load_library

DIMS = "dims n = 4, d = 8\n"


def prog(body: str, params: str = "X: f16[n, d]", head: str = DIMS) -> str:
    """A program `p` on line 2 (after the dims); `body` starts on line 3."""
    return f"{head}program p({params}) {{\n{body}}}\n"


BAD = [
    # syntax
    ("dims n = 4 d = 8\n", "a dim is 'NAME = INTEGER'", 1, 12),
    # after a complete item, a line that starts no declaration is the mistake, not the item above it
    ("dims n = 4\n    return X\n", "unexpected 'return': outside a program, a file holds only 'dims', 'def', "
     "'program' and 'import' declarations", 2, 5),
    ("dims n = 4\nprog p(X: f16[n]) {\n    return X\n}\n", "unexpected 'prog': outside a program", 2, 1),
    (prog("    Y = exp(X)\n    import \"a.prism\"\n    return Y\n"),
     "unexpected 'import': 'dims', 'def', 'program' and 'import' declarations go outside a program's braces", 4, 5),
    (prog("    = exp(X)\n    return X\n"), "unexpected '=': a statement is 'NAME = expression'", 3, 5),
    ("dims n = 1.5\n", "a dim is 'NAME = INTEGER'", 1, 11),
    (prog("    Y = exp(X);;\n    return Y\n"), "one ';' at most", 3, 16),
    (prog("    Y = exp((X)\n    return Y\n"), "missing ')'", 4, 5),
    (prog("    Y = exp(X))\n    return Y\n"), "unbalanced ')'", 3, 15),
    (prog("    Y = X $ X\n    return Y\n"), "unexpected character '$'", 3, 11),
    (prog("    Y = exp(X)\n"), "a program must end with 'return NAME, ...'", 4, 1),
    (prog("    Y = X + \n    return Y\n"), "missing operand", 4, 5),
    (prog("    exp(X)\n    return X\n"), "a statement is 'NAME = expression'", 3, 8),
    (DIMS + "program p(X: f16[n, d]) {\n    return X\n", "missing '}'", 3, 13),
    (DIMS + "program p(X) {\n    return X\n}\n", "an input is 'NAME: dtype[dims]'", 2, 12),
    (DIMS + "program p(X: f16[n, d]) {\n    return = X\n}\n", "unexpected '='", 3, 12),
    (prog("    Y = X * 1e999\n    return Y\n"), "number 1e999 is too large", 3, 13),
    (prog("    Y = X * 1e-400\n    return Y\n"), "number 1e-400 is too small: it is 0 in float64; write 0", 3, 13),
    ("dims n = 99999999999999999999\n", "integer 99999999999999999999 is too large (at most 2^63 - 1)", 1, 10),
    (prog("    return X\n", params="X: f16[n, 10000000000000000000]"), "integer 10000000000000000000 is too large", 2, 21),
    ("dims n = \u0663\n", "syntax error: unexpected character '\u0663'", 1, 10),
    (prog("    kernel k grid(x = gx) {\n        xt = load X[:, x]\n        store Y[:, x] + = xt\n    }\n"
          "    return Y\n"), "syntax error: unexpected '+'; expected '=' or '+='", 5, 23),
    # names
    (prog("    Y = expp(X)\n    return Y\n"), "unknown function 'expp'; did you mean 'exp'?", 3, 9),
    (prog("    Y = exp(Z)\n    return Y\n"), "undefined name 'Z'", 3, 13),
    (prog("    return Y\n"), "cannot return undefined name 'Y'", 3, 12),
    (prog("    Y = exp(X)\n    return Y, Y\n"), "'Y' is returned twice", 4, 15),
    (prog("    Y = X * n\n    return Y\n"), "'n' is a dim; dims appear only in input shapes", 3, 13),
    (prog("    Y = X * exp\n    return Y\n"), "'exp' is a function; call it as exp(...)", 3, 13),
    (prog("    exp = X\n    return exp\n"), "'exp' is a function name; choose another name", 3, 5),
    (prog("    C = 2\n    return C\n"), "'C' is a constant; a program returns tensors", 4, 12),
    # a store that puts a tile of the whole rows side by side per block: the output grows with the blocks
    (prog("    kernel k grid(x = gx) {\n        xt = load X[:, x]\n        store Y[:, x] = xt @ transpose(xt, 0, 1)\n"
          "    }\n    return Y\n"),
     "'Y' has shape [n, gx*n], which depends on kernel parameters (gx): a returned tensor's shape must follow from "
     "the dims alone, whatever the parameters", 7, 12),
    # arity and integer parameters
    (prog("    Y = exp(X, X)\n    return Y\n"), "exp takes 1 tensor operand, got 2 arguments", 3, 9),
    (prog("    Y = sum(X)\n    return Y\n"), "sum takes 1 tensor operand and an integer dim, got 1 argument", 3, 9),
    (prog("    Y = X @ W()\n    return Y\n"), "unknown function 'W'", 3, 13),
    (prog("    Y = sum(X, 1.0)\n    return Y\n"), "the dim of sum must be an integer literal", 3, 16),
    (prog("    Y = max(X, X)\n    return Y\n"), "the dim of max must be an integer literal", 3, 16),
    ("dims n = 4\ndef f(x, y) = x * y\nprogram p(X: f16[n]) {\n    Y = f(X)\n    return Y\n}\n",
     "f takes 2 argument(s), got 1 argument", 4, 9),
    # duplicates
    (prog("    return X\n", params="X: f16[n, d], X: f16[n, d]"), "duplicate input 'X'", 2, 25),
    (prog("    Y = exp(X)\n    Y = exp(Y)\n    return Y\n"), "'Y' is already defined", 4, 5),
    (prog("    X = exp(X)\n    return X\n"), "'X' is already defined", 3, 5),
    ("dims n = 4\ndims n = 5\n", "duplicate dim 'n'", 2, 6),
    ("dims n = 0\n", "dim 'n' must be at least 1, got 0", 1, 6),
    ("def f(x) = x\ndef f(y) = y\n", "duplicate def 'f'", 2, 5),
    ("def exp(x) = x\n", "def 'exp' would hide the built-in operator 'exp'", 1, 5),
    (prog("    return X\n") + "program p(X: f16[n]) {\n    return X\n}\n", "duplicate program 'p'", 5, 9),
    # dtypes and dims
    (prog("    return X\n", params="X: f17[n, d]"), "unknown dtype 'f17' (expected one of f16, bf16, f32, f64)", 2, 14),
    (prog("    return X\n", params="X: f16[n, k]"), "undeclared dim 'k'", 2, 21),
    (prog("    return X\n", params="X: f16[n, dd]"), "undeclared dim 'dd'; did you mean 'd'?", 2, 21),
    (prog("    return X\n", params="X: f16[0, d]"), "a size must be at least 1, got 0", 2, 18),
    # shapes
    (prog("    Y = X + W\n    return Y\n", params="X: f16[n, d], W: f16[d, n]"),
     "add: shapes [n, d] and [d, n] do not broadcast: d vs n", 3, 9),
    (prog("    Y = X @ W\n    return Y\n", params="X: f16[n, d], W: f16[n, d]"),
     "matmul: inner dims differ: d (last of [n, d]) vs n (second to last of [n, d])", 3, 9),
    (prog("    Y = X @ W\n    return Y\n", params="X: f16[n, d], W: f16[d]"),
     "operands need rank 2 or more, got [d]", 3, 9),
    (prog("    Y = A @ B\n    return Y\n", params="A: f16[2, n, d], B: f16[3, d, n]"),
     "matmul: batch dims: shapes [2] and [3] do not broadcast", 3, 9),
    (prog("    Y = sum(X, 2)\n    return Y\n"), "sum: dim 2 is out of range for a rank-2 tensor (valid: -2..1)", 3, 9),
    (prog("    Y = mean(X, -3)\n    return Y\n"), "dim -3 is out of range", 3, 9),
    (prog("    Y = sum(X, 100000000000000000000000)\n    return Y\n"),
     "sum: dim 100000000000000000000000 is out of range", 3, 9),
    (prog("    Y = X * (1 / 0)\n    return Y\n"), "this constant expression has no finite value", 3, 14),
    # the decoder-layer operators
    (prog("    Y = rms_norm(X, 1e-5, 2)\n    return Y\n"),
     "rms_norm takes 1 tensor operand, or 1 tensor operand and a constant eps, got 3 arguments", 3, 9),
    (prog("    Y = rms_norm(X, X)\n    return Y\n"), "the eps of rms_norm must be a constant such as 1e-5", 3, 21),
    (prog("    Y = layer_norm(X, -1e-5)\n    return Y\n"), "the eps of layer_norm must be at least 0, got -1e-05", 3, 23),
    (prog("    Y = layer_norm(X)\n    return Y\n"), "layer_norm takes 1 tensor operand and a constant eps, got 1 argument", 3, 9),
    (prog("    Y = transpose(X, 0, 2)\n    return Y\n"),
     "transpose: dim 2 is out of range for a rank-2 tensor (valid: -2..1)", 3, 9),
    (prog("    Y = transpose(X, -1)\n    return Y\n"),
     "transpose takes 1 tensor operand and an integer dim and an integer other dim, got 2 arguments", 3, 9),
    (prog("    Y = transpose(X, 0, 1.5)\n    return Y\n"), "the other dim of transpose must be an integer literal", 3, 25),
    (prog("    Y = causal(X)\n    return Y\n", params="X: f16[n]"),
     "causal: needs a tensor of rank 2 or more (rows and columns), got [n]", 3, 9),
    (prog("    Y = rope(X, C, S)\n    return Y\n", params="X: f16[n, 7], C: f16[n, 7], S: f16[n, 7]"),
     "rope: needs an even last dim (it rotates its two halves), got [n, 7]", 3, 9),
    (prog("    Y = rope(X, C, S)\n    return Y\n", params="X: f16[n, d], C: f16[2, n, d], S: f16[n, d]"),
     "rope: its tables must broadcast to the shape of x, [n, d]; together they make [2, n, d]", 3, 9),
    (prog("    Y = rope(X, C, S)\n    return Y\n", params="X: f16[n, d], C: f16[n, 4], S: f16[n, d]"),
     "rope: shapes [n, d] and [n, 4] do not broadcast", 3, 9),
    # defs
    ("dims n = 4\ndef f(x) = f(x) + 1\nprogram p(X: f16[n]) {\n    Y = f(X)\n    return Y\n}\n",
     "recursive call to 'f' (f -> f)", 2, 12),
    ("dims n = 4\ndef f(x) = g(x)\ndef g(x) = f(x) * 2\nprogram p(X: f16[n]) {\n    Y = f(X)\n    return Y\n}\n",
     "recursive call to 'f' (f -> g -> f)", 3, 12),
    ("dims n = 4, d = 8\ndef f(x) = x @ x\nprogram p(X: f16[n, d]) {\n    Y = f(X)\n    return Y\n}\n",
     "matmul: inner dims differ", 2, 12),
    # a def's names, functions and arities are checked where it is declared, called or not
    ("def f(x) = y + x\n", "undefined name 'y'", 1, 12),
    ("def f(x) = expp(x)\n", "unknown function 'expp'; did you mean 'exp'?", 1, 12),
    ("def f(x) = exp(x, 1)\n", "exp takes 1 tensor operand, got 2 arguments", 1, 12),
    ("def f(x) = x\ndef g(x) = f(x, x)\n", "f takes 1 argument(s), got 2 arguments", 2, 12),
    ("def f(x, x) = x\n", "def 'f' repeats a parameter name", 1, 5),
    ("def f(exp) = exp + 1\n", "def 'f' has a parameter named 'exp', a function name", 1, 5),
    (prog("    return f\n", params="f: f16[n]", head="dims n = 4\ndef f(x) = x\n"), "input 'f' has a function name", 3, 11),
    ("dims n = 4\ndef f(x) = x * n\n", "'n' is a dim; dims appear only in input shapes", 2, 16),
    ("def f(x) = x + exp\n", "'exp' is a function; call it as exp(...)", 1, 16),
    # imports
    ('import "nope.prism"\n' + prog("    return X\n"), "cannot read import", 1, 8),
]


def rendered(path: Path) -> str:
    with pytest.raises(PrismError) as info:
        load(path)
    text = info.value.render()
    assert "Traceback" not in text
    return text


def assert_located(text: str, path: Path, fragment: str, line: int, col: int) -> None:
    """`path:line:col: ...fragment...`, then the source line, then a caret under `col`."""
    lines = text.splitlines()
    head = re.compile(rf"(^|/){re.escape(path.name)}:{line}:{col}: .*{re.escape(fragment)}")
    hits = [i for i, s in enumerate(lines) if head.search(s)]
    assert hits, f"no '{path.name}:{line}:{col}: ...{fragment}' in:\n{text}"
    i = hits[0]
    source = path.read_text().splitlines()[line - 1]
    assert lines[i + 1] == "    " + source.expandtabs(4), text
    assert lines[i + 2] == "    " + " " * len(source[: col - 1].expandtabs(4)) + "^", text


@pytest.mark.parametrize("source, fragment, line, col", BAD, ids=[f"{i:02}-{b[1][:40]}" for i, b in enumerate(BAD)])
def test_bad_input(write, source, fragment, line, col):
    path = write(source)
    assert_located(rendered(path), path, fragment, line, col)


@pytest.mark.parametrize("label", list(SYNTAX_ERRORS))
def test_syntax_error_table(write, label):
    """Each example of the table that classifies syntax errors gets its own label, with a location."""
    for example in SYNTAX_ERRORS[label]:
        path = write("dims n = 4\n" + example)
        with pytest.raises(PrismError) as info:
            load(path)
        (diag,) = info.value.diagnostics
        assert diag.message.startswith("syntax error: ") and diag.message.endswith(label), (example, diag.message)
        assert diag.loc.line >= 1 and diag.loc.col >= 1


def test_several_errors_are_reported_at_once(write):
    path = write(prog("    Y = expp(X)\n    Z = X @ X\n    return W\n", params="X: f16[n, k]")
                 + "program q(A: f99[n]) {\n    B = sum(A, 5)\n    return B\n}\n")
    text = rendered(path)
    for fragment, line, col in [
        ("undeclared dim 'k'", 2, 21),
        ("unknown function 'expp'", 3, 9),
        ("cannot return undefined name 'W'", 5, 12),
        ("unknown dtype 'f99'", 7, 14),
    ]:
        assert_located(text, path, fragment, line, col)
    assert text.rstrip().endswith("4 errors")


def test_errors_in_independent_statements_are_all_reported(write):
    path = write(prog("    A = X @ X\n    B = sum(X, 9)\n    C = exp(Z)\n    return A, B, C\n"))
    text = rendered(path)
    assert_located(text, path, "inner dims differ", 3, 9)
    assert_located(text, path, "dim 9 is out of range", 4, 9)
    assert_located(text, path, "undefined name 'Z'", 5, 13)
    assert "3 errors" in text  # and no follow-on errors for A, B and C


def test_a_kernel_that_loads_what_a_failed_kernel_stores_adds_no_error_of_its_own(write):
    """The first kernel's error is said once; the second kernel, which loads its output, stores names that stay
    known (no 'undefined name U' at the return)."""
    path = write("dims n = 64, d = 128\nprogram p(X: f16[n, d], W: f16[d, d]) {\n"
                 "    kernel k grid(x = gx) loop(F) {\n        xt = load X[x, loop]\n"
                 "        s = acc_sum_last(xt * foo)\n        store Y[x, :] = s\n    }\n    Z = Y @ W\n"
                 "    kernel k2 grid(x = gx) {\n        yt = load Y[x, :]\n        store U[x, :] = yt * 2\n    }\n"
                 "    return Z, U\n}\n")
    text = rendered(path)
    assert_located(text, path, "undefined name 'foo'", 5, 31)
    assert "errors" not in text and "'U'" not in text


def test_error_inside_a_def_says_which_call_led_there(write):
    path = write("dims n = 4, d = 8\ndef f(x) = x @ x\nprogram p(X: f16[n, d]) {\n    Y = f(X)\n    return Y\n}\n")
    assert re.search(r"note: in the call to 'f' at \S*t\.prism:4:9", rendered(path))


def test_a_broken_def_is_reported_once_however_often_it_is_called(write):
    path = write("dims n = 4\ndef f(x) = y * x\nprogram p(X: f16[n]) {\n    A = f(X)\n    B = f(A)\n    return B\n}\n")
    text = rendered(path)
    assert text.count("undefined name 'y'") == 1 and "errors" not in text


def test_caret_under_tabs(write):
    path = write(prog("\tY = expp(X)\n\treturn Y\n"))
    text = rendered(path)
    assert_located(text, path, "unknown function 'expp'", 3, 6)
    assert text.splitlines()[1:3] == ["        Y = expp(X)", "            ^"]  # a tab is 4 columns on both lines


@pytest.mark.parametrize("source", [
    "dims n = 4, d = 8 # caf\u00e9\u2028 \x0c\nprogram p(X: f16[n, d]) {\n    Y = expp(X)\n    return Y\n}\n",
    prog("    Y = expp(X)\n    return Y\n").replace("\n", "\r\n"),
    prog("    Y = expp(X)\n    return Y\n").replace("\n", "\r"),
], ids=["line-separator-in-comment", "crlf", "cr"])
def test_shown_line_is_the_parsers_line(write, source):
    """Only '\\n' ends a line for the parser (a lone CR, the classic Mac OS's, is read as one: its comment line
    swallowed the whole file, "ok: no programs"); the shown source line must be the same one."""
    path = write(source.encode())
    text = rendered(path)
    assert re.search(r"t\.prism:3:9: unknown function 'expp'", text), text
    assert text.splitlines()[1:3] == ["        Y = expp(X)", "            ^"], text


def test_end_of_file_error_points_after_the_last_text(write):
    path = write(b"dims n = 4 # \xe2\x80\xa8\r\nprogram p(X: f16[n]) {\r\n    Y = exp(X\r\n")
    text = rendered(path)
    assert re.search(r"t\.prism:3:14: syntax error: unexpected end of file: missing '\)'", text), text
    assert text.splitlines()[1:3] == ["        Y = exp(X", "                 ^"], text


# -- files -------------------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(PrismError, match=r"cannot read file '.*nope\.prism': no such file"):
        load(tmp_path / "nope.prism")


def test_directory_given_as_a_file(tmp_path):
    with pytest.raises(PrismError, match="it is a directory"):
        load(tmp_path)


def test_directory_given_as_an_import(write, tmp_path):
    (tmp_path / "sub").mkdir()
    path = write('import "sub"\n')
    assert_located(rendered(path), path, "cannot read import", 1, 8)
    assert "it is a directory" in rendered(path)


def test_a_rules_file_given_as_an_import(write):
    """Axioms imported into a program: said at the import, not as a syntax error deep in the .rules file."""
    write("ruleset r {\n    # a rule\n    rule twice: a + a => 2 * a\n}\n", "mine.rules")
    path = write('import "mine.rules"\ndims n = 4\nprogram p(X: f16[n]) {\n    return X\n}\n')
    text = rendered(path)
    assert_located(text, path, "'mine.rules' is a .rules file: it holds axioms, which a program cannot import", 1, 8)
    assert "syntax error" not in text


def test_not_utf8(write):
    path = write(b"dims n = 4\n# caf\xc3\xa9 \xff\n")
    text = rendered(path)
    assert re.match(r"\S*t\.prism:2:8: file is not valid UTF-8 text \(byte 0xff\)", text), text
    assert text.splitlines()[2] == "    " + " " * 7 + "^"


def test_empty_file_has_no_programs(write):
    assert load(write("")).programs == {}
    assert load(write("# only a comment\n")).programs == {}
    with pytest.raises(PrismError, match="defines no program"):
        load(write("")).program()


def test_cyclic_import(write):
    a = write('import "b.prism"\ndims n = 4\nprogram p(X: f16[n]) {\n    return X\n}\n', "a.prism")
    b = write('# b imports a back\nimport "a.prism"\ndef f(x) = x\n', "b.prism")
    text = rendered(a)
    assert_located(text, b, "import cycle: a.prism -> b.prism -> a.prism", 2, 8)


def test_a_failed_import_causes_no_follow_on_errors(write):
    lib = write("dims n = 4\ndef f(x) = x +\n", "lib.prism")
    main_file = write('import "lib.prism"\ndef g(x) = f(x)\nprogram p(X: f16[n]) {\n    Y = g(X)\n    return Y\n}\n', "m.prism")
    text = rendered(main_file)
    assert_located(text, lib, "missing operand", 2, 15)
    assert "m.prism" not in text and "errors" not in text


def test_file_importing_itself(write):
    path = write('import "t.prism"\n')
    assert_located(rendered(path), path, "import cycle: t.prism -> t.prism", 1, 8)


def test_error_in_an_imported_file_is_located_there(write):
    write("dims n = 4\ndef f(x) = x +\n", "lib.prism")
    path = write('import "lib.prism"\nprogram p(X: f16[n]) {\n    return X\n}\n')
    lib = path.parent / "lib.prism"
    assert_located(rendered(path), lib, "missing operand", 2, 15)


def test_conflicting_dims_across_imports(write):
    write("dims n = 3\n", "lib.prism")
    path = write('import "lib.prism"\ndims n = 5\nprogram p(X: f16[n]) {\n    return X\n}\n')
    text = rendered(path)
    assert_located(text, path, "duplicate dim 'n'", 2, 6)
    assert re.search(r"note: first declared at \S*lib\.prism:1:6", text)


# -- absurd nesting: a clean error or success, never a RecursionError -----------------------------------------

DEEP = {
    "parens": "(" * 5000 + "X" + ")" * 5000,
    "unary_minus": "-" * 5000 + "X",
    "calls": "exp(" * 5000 + "X" + ")" * 5000,
    "long_sum": " + ".join(["X"] * 5000),
    "unclosed_parens": "(" * 5000 + "X",
}


@pytest.mark.parametrize("name", list(DEEP))
def test_absurd_nesting(write, capsys, default_recursion_limit, name):
    path = write(prog(f"    Y = {DEEP[name]}\n    return Y\n"))
    try:
        source = load(path)
    except PrismError as e:
        assert re.search(r"t\.prism:\d+:\d+: ", e.render())
    else:
        assert list(source.programs) == ["p"]
    code = main(["check", str(path)])
    err = capsys.readouterr().err
    assert code in (0, 1) and "Traceback" not in err and "RecursionError" not in err


def test_deep_nesting_is_refused_with_advice(write, default_recursion_limit):
    path = write(prog(f"    Y = {DEEP['unary_minus']}\n    return Y\n"))
    assert "nested more than 200 levels deep; split it into statements" in rendered(path)
    rules = path.with_name("deep.rules")
    rules.write_text(f"ruleset r {{\n    rule deep: a => {DEEP['unary_minus'].replace('X', 'a')}\n}}\n")
    with pytest.raises(PrismError, match="nested more than 200 levels deep; split it into rules"):
        load_library([rules], defaults=False)


def test_long_chain_of_defs(write, default_recursion_limit):
    """Each def is shallow, but inlining 1000 of them would nest 1000 deep."""
    defs = "".join(f"def f{i}(x) = f{i + 1}(x) + x\n" for i in range(1000)) + "def f1000(x) = x\n"
    path = write(f"dims n = 4\n{defs}program p(X: f16[n]) {{\n    Y = f0(X)\n    return Y\n}}\n")
    message = "'f0' nests more than 200 levels deep once the defs it calls are inlined"
    assert_located(rendered(path), path, message, 1004, 9)


def test_defs_that_double_at_every_level_are_refused_at_the_call():
    """Each level calls the one below twice on different values: 40 levels would be 2^41 operations."""
    defs = "def f0(x) = x * 1.5 + x\n" + "".join(f"def f{i}(x) = f{i - 1}(f{i - 1}(x))\n" for i in range(1, 41))
    text = f"dims n = 4\n{defs}program p(X: f32[n]) {{\n    Y = f40(X) + f2(X)\n    return Y\n}}\n"
    message = "'f40' makes the program more than 10,000 operations once the defs it calls are inlined"
    with pytest.raises(PrismError) as err:
        load("big.prism", text)
    assert len(err.value.diagnostics) == 1 and f"big.prism:44:9: {message}" in str(err.value)


def test_a_def_called_again_on_the_same_values_is_inlined_once():
    """Twice a level on the same value: the program is one operation a level (nodes are interned)."""
    defs = "def g0(x) = x * x\n" + "".join(f"def g{i}(x) = g{i - 1}(x) + g{i - 1}(x)\n" for i in range(1, 41))
    program = load("wide.prism", f"dims n = 4\n{defs}program p(X: f32[n]) {{\n    Y = g40(X)\n    return Y\n}}\n").program()
    assert len([n for n in program.nodes() if n.op != "input"]) == 41


def test_the_words_that_begin_a_kernel_and_a_store_are_names_where_a_name_is_assigned():
    """`store = ...` was a syntax error after a program's first statement (the kernel body's `store` keyword)."""
    text = ("dims n = 8, d = 64\nprogram k(X: f32[n, d], W: f32[d, d]) {\n    A = X + 1\n    store = A * 2\n"
            "    kernel kernel grid(x = gx) loop(F) {\n        xt = load X[:, loop]\n        wt = load W[loop, x]\n"
            "        store = xt @ wt\n        kernel = acc_sum(store)\n        store Y[:, x] = kernel * 2\n    }\n"
            "    Z = Y + store\n    return Z\n}\n")
    program = load("words.prism", text).program()
    assert program.outputs[0][0] == "Z" and [k.op for k in program.nodes() if k.op == "kernel"] == ["kernel"]
    tiles = ("dims n = 8, d = 64\nprogram k(X: f32[n, d], W: f32[d, d]) {\n    kernel k grid(x = gx) loop(F) {\n"
             "        store = load X[:, loop]\n        kernel = load W[loop, x]\n"
             "        store Y[:, x] = acc_sum(store @ kernel)\n    }\n    return Y\n}\n")
    assert load("tiles.prism", tiles).program().outputs[0][0] == "Y"


def test_a_def_called_in_two_kernels_places_each_kernels_errors_where_the_def_writes_them():
    """The value of a def on the same tile is remembered per statement, so that the second kernel's errors are placed
    where the first's are, in the def's body, not at the kernel's name."""
    kernel = ("    kernel {0} grid(x = 1) loop(F) {{\n        xt = load X[:, loop]\n        store {1}[:, :] += h(xt)\n"
              "    }}\n")
    text = ("dims n = 8, d = 64\ndef h(a) = acc_sum(a) * a\nprogram p(X: f32[n, d]) {\n" + kernel.format("k1", "Y")
            + kernel.format("k2", "Z") + "    return Y, Z\n}\n")
    with pytest.raises(PrismError) as err:
        load("two.prism", text)
    assert {(d.loc.line, d.loc.col) for d in err.value.diagnostics} == {(2, 12)}, str(err.value)
    assert "'Y' stores a value that changes" in str(err.value) and "'Z' stores a value that changes" in str(err.value)


def test_short_chain_of_defs_is_fine(write, default_recursion_limit):
    defs = "".join(f"def f{i}(x) = f{i + 1}(x) * 2\n" for i in range(60)) + "def f60(x) = x\n"
    path = write(f"dims n = 4\n{defs}program p(X: f16[n]) {{\n    Y = f0(X)\n    return Y\n}}\n")
    assert list(load(path).programs) == ["p"]


def test_byte_order_mark_is_not_text(write):
    path = write(b"\xef\xbb\xbf" + prog("    Y = expp(X)\n    return Y\n").encode())
    assert_located(rendered(path), path, "unknown function 'expp'", 3, 9)


@pytest.mark.parametrize("command", [["compile", "-o", "OUT", "--arch", "none", "--no-emulate"], ["show"],
                                     ["run", "--out", "OUT.npz"]])
def test_an_odd_last_dim_under_rope_inside_a_kernel_is_located(command, tmp_path, capsys):
    """`--dims dh=63` for causal attention written with its kernel: RoPE's tiles hold the odd last dim; refused at
    the rope in the kernel's body, as at one outside kernels (it was a ValueError's traceback)."""
    path = Path(__file__).resolve().parent.parent / "programs" / "fused" / "causal_attention.prism"
    args = [a.replace("OUT", str(tmp_path / "out")) for a in command]
    assert main([args[0], str(path), *args[1:], "--dims", "dh=63"]) == 1
    err = capsys.readouterr().err
    assert "causal_attention.prism:19:20: rope needs an even last dim (it rotates its two halves); under this binding the last " \
           "dim of [b, h/gh, q/gq, dh] is 63" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.npz").exists()
