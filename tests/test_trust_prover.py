"""The prover trusts no text a user writes: conditions mean what they say, and names stay names.

Each test is an attack that would give a false proof if the prover let it: a `shape(a) != shape(b)`
condition read as `==`, a `size(a, -1) != 1` condition taken as true for a symbolic dim that a user may
bind to 1, a rules file whose name carries egglog commands into the generated program.
"""

from __future__ import annotations

import ast as python_ast
from pathlib import Path

import pytest
import sympy

from prism_dsl.prove import egglog_runner
from prism_dsl.lang.check import load
from prism_dsl.cli.main import main
from prism_dsl.prove.egglog_runner import Limits
from prism_dsl.prove.egraph import compile_library, conditions, dim_term, escape, string
from prism_dsl.prove.prover import prove
from prism_dsl.prove.rules import Library, load_library

EXIT_OK, EXIT_NOT_PROVED = 0, 3
FAST = Limits(iterations=10, seconds=10.0)


def program_file(path: Path, name: str, signature: str, expr: str) -> Path:
    path.write_text(f"dims m = 3, n = 5\nprogram {name}({signature}) {{\n    Y = {expr}\n    return Y\n}}\n")
    return path


def pair(tmp_path: Path, signature: str, lhs: str, rhs: str) -> tuple[Path, Path]:
    return (program_file(tmp_path / "a.prism", "a", signature, lhs),
            program_file(tmp_path / "b.prism", "b", signature, rhs))


def rules_file(tmp_path: Path, rules: str, name: str = "mine.rules") -> Path:
    path = tmp_path / name
    path.write_text("ruleset mine {\n" + rules + "\n}\n")
    return path


# -- shape(a) != shape(b) ----------------------------------------------------------------------------

# Sound: where the shapes differ in the last dim only, a + b broadcasts one side along it, so that side
# is constant along the dim the max runs over. Where the shapes are equal it is false.
SHAPES_DIFFER = "    rule max_add_split: max(a + b, -1) => max(a, -1) + max(b, -1) if shape(a) != shape(b), " + ", ".join(
    f"size(a, {d}) == size(b, {d})" for d in range(-2, -10, -1))


def test_a_shape_inequality_rule_passes_the_soundness_check(tmp_path, capsys):
    assert main(["check", "--no-default-rules", str(rules_file(tmp_path, SHAPES_DIFFER))]) == EXIT_OK
    assert "ok: 1 rule" in capsys.readouterr().out


def test_shape_inequality_does_not_fire_where_the_shapes_are_equal(tmp_path, capsys):
    mine = rules_file(tmp_path, SHAPES_DIFFER)
    a, b = pair(tmp_path, "X: f32[m, n], Z: f32[m, n]", "max(X + Z, -1)", "max(X, -1) + max(Z, -1)")
    assert main(["prove", str(a), str(b), "--no-default-rules", "--rules", str(mine)]) == EXIT_NOT_PROVED
    assert "a vs b: not proved" in capsys.readouterr().out
    # The e-graph itself refuses, not only the numeric guard behind it.
    pa, pb = load(a).program(), load(b).program()
    assert not prove(pa, pb, load_library([mine]), FAST, numeric=False).proved


def test_shape_inequality_fires_where_literal_sizes_differ(tmp_path, capsys):
    mine = rules_file(tmp_path, SHAPES_DIFFER)
    a, b = pair(tmp_path, "X: f32[m, 1], Z: f32[m, 4]", "max(X + Z, -1)", "max(X, -1) + max(Z, -1)")
    assert main(["prove", str(a), str(b), "--no-default-rules", "--rules", str(mine)]) == EXIT_OK
    assert "a == b: proved" in capsys.readouterr().out


def test_a_symbolic_size_is_not_provably_different_from_a_literal(tmp_path):
    # shape [m, n] against [m, 1]: different unless n = 1, so the condition must not hold.
    mine = rules_file(tmp_path, "    rule mark: relu(a + b) => sigmoid(a + b) if shape(a) != shape(b)")
    a, b = pair(tmp_path, "X: f32[m, n], Z: f32[m, 1]", "relu(X + Z)", "sigmoid(X + Z)")
    assert not prove(load(a).program(), load(b).program(), load_library([mine]), FAST, numeric=False).proved


def test_each_shape_inequality_is_one_rewrite_per_dim(tmp_path):
    rule = _rule(tmp_path, "rule two: a + b + c => c + b + a if shape(a) != shape(b), shape(b) != shape(c)")
    alternatives = conditions(rule)
    assert len(alternatives) == 9 * 9 and len(set(map(tuple, alternatives))) == 81
    program, emitted = compile_library(Library((rule,)))
    assert len(emitted) == 1 and program.count("(rewrite (Add (Add v_a v_b) v_c)") == 81


def test_more_shape_inequalities_than_the_prover_can_load_are_an_error(tmp_path, capsys):
    three = "rule three: a + b + c + d => d + c + b + a if shape(a) != shape(b), shape(b) != shape(c), shape(c) != shape(d)"
    mine = rules_file(tmp_path, "    " + three)
    assert main(["rules", "--emit-egglog", "--no-default-rules", "--rules", str(mine)]) == 1
    err = capsys.readouterr().err
    assert f"{mine}:2:" in err and "too many 'shape(..) != shape(..)' conditions" in err and "Traceback" not in err
    assert main(["check", "--no-default-rules", str(mine)]) == 1  # found when the file is read, before any proof
    err = capsys.readouterr().err
    assert f"{mine}:2:" in err and "too many 'shape(..) != shape(..)' conditions" in err


# -- size(a, d) != ... -------------------------------------------------------------------------------

# Markers: false axioms on purpose (never checked here, and proved with the numeric guard off), so
# that a proof shows exactly whether the e-graph let the condition hold.
NOT_ONE = "    rule mark: relu(a) => sigmoid(a) if size(a, -1) != 1"
SIZES_DIFFER = "    rule mark: relu(a + b) => sigmoid(a + b) if size(a, -1) != size(b, -1)"


def _proved(tmp_path: Path, rules: str, signature: str, lhs: str, rhs: str) -> bool:
    a, b = pair(tmp_path, signature, lhs, rhs)
    library = load_library([rules_file(tmp_path, rules)])
    return prove(load(a).program(), load(b).program(), library, FAST, numeric=False).proved


@pytest.mark.parametrize("size, fires", [("n", False), ("1", False), ("4", True)])
def test_size_not_one_holds_only_for_a_literal_other_than_one(tmp_path, size, fires):
    # With n symbolic, `prismc run --dims n=1` may bind it to 1: the condition is not known to hold.
    assert _proved(tmp_path, NOT_ONE, f"X: f32[m, {size}]", "relu(X)", "sigmoid(X)") is fires


@pytest.mark.parametrize("sizes, fires", [(("n", "1"), False), (("n", "n"), False), (("4", "1"), True)])
def test_sizes_differ_only_when_both_are_different_literals(tmp_path, sizes, fires):
    signature = f"X: f32[m, {sizes[0]}], Z: f32[m, {sizes[1]}]"
    assert _proved(tmp_path, SIZES_DIFFER, signature, "relu(X + Z)", "sigmoid(X + Z)") is fires


@pytest.mark.parametrize("count, fires", [('(DSym "g")', False), ("(DNum 1)", False), ("(DNum 4)", True)])
def test_a_count_is_not_one_only_when_it_is_a_literal_other_than_one(tmp_path, count, fires):
    rule = _rule(tmp_path, "rule mark: relu(split(a, i, j, g)) => sigmoid(split(a, i, j, g)) if g != 1")
    program, _ = compile_library(Library((rule,)))
    setup = "\n".join([
        '(let $x (Input "X"))',
        '(set (size (Input "X") -1) (DNum 8))',
        *(f'(set (size (Input "X") {d}) (DNum 1))' for d in range(-2, -10, -1)),
        f"(let $s (Split $x -1 -6 {count}))",
        "(let $l (Relu $s))",
        "(let $r (Sigmoid $s))",
    ])
    outcome = egglog_runner.run(program, setup, [("$l", "$r")], ["rs_mine"], FAST)
    assert outcome.proved == (fires,)


def _rule(tmp_path: Path, text: str):
    """One rule, read through the loader users go through."""
    (rule,) = load_library([rules_file(tmp_path, "    " + text, name="one.rules")]).rules
    return rule


# -- names reaching egglog ---------------------------------------------------------------------------

HOSTILE = [
    "", "plain", 'a"b', "a\\b", '\\"', '"\\', "\\n", "a\nb", "\r\n", "\x00", "tab\there", "\x1b[31m", "\x7f",
    "\x85", "\u2028", "\u2029", "\ufeff", "\ud800", "é中", "; (fail)", 'x")) (union (Num 1.0) (Num 2.0)) ; ',
    "".join(chr(c) for c in range(0x00, 0x20)), "".join(chr(c) for c in range(0x7f, 0xa0)),
    *(f"x{chr(c)}y" for c in [*range(0x00, 0x20), *range(0x7f, 0xa0)]),  # every control character alone
]


def _parse(text: str) -> list:
    from egglog.bindings import EGraph

    egraph = EGraph()
    return egraph.parse_program(text)


def test_escape_gives_one_printable_line_that_decodes_back():
    for text in HOSTILE:
        out = escape(text)
        assert out.isprintable() and out.isascii(), repr(text)
        assert python_ast.literal_eval(f'"{out}"') == text  # a Python string body: nothing is lost or merged
    assert escape("plain_name-1.rules") == "plain_name-1.rules"
    assert len({escape(t) for t in HOSTILE}) == len(HOSTILE)


def test_hostile_text_stays_inside_its_comment_and_its_string():
    head = "(datatype T (Input String))\n"
    for text in HOSTILE:
        commands = _parse(head + f"; {escape(text)}\n(let $a (Input {string(text)}))\n")
        assert len(commands) == 2, repr(text)  # the datatype and the let: no command smuggled in
    # The e-graph holds the escaped text: distinct names stay distinct terms.
    literals = [string(t) for t in HOSTILE]
    assert len(set(literals)) == len(literals)
    assert string("X") == '"X"' and dim_term(sympy.Symbol("n")) == '(DSym "n")'
    assert dim_term(sympy.Symbol('n") (union')) == f'(DSym {string(chr(110) + chr(34) + ") (union")})'


INJECTED = '(union (Sigmoid (Sub (Input "X") (Num 100.0))) (Relu (Sub (Input "X") (Num 100.0))))'
EVIL_NAMES = [
    f"evil\n{INJECTED}\n;.rules",  # the rest of the comment line after the injection stays a comment
    f"evil\r\n{INJECTED}\r\n;.rules",
    'quote"back\\slash\ttab\x1b.rules',
]


@pytest.mark.parametrize("name", EVIL_NAMES, ids=["newline", "crlf", "quote-backslash"])
def test_a_rules_file_name_cannot_inject_egglog(tmp_path, capsys, name):
    mine = rules_file(tmp_path, "    rule relu_relu: relu(relu(x)) => relu(x)", name=name)
    signature = "X: f32[m, n]"
    a, b = pair(tmp_path, signature, "sigmoid(X - 100)", "relu(X - 100)")
    assert main(["prove", str(a), str(b), "--no-default-rules", "--rules", str(mine)]) == EXIT_NOT_PROVED
    assert "a vs b: not proved" in capsys.readouterr().out
    # The file's rules still work.
    a, b = pair(tmp_path, signature, "relu(relu(X))", "relu(X)")
    assert main(["prove", str(a), str(b), "--no-default-rules", "--rules", str(mine)]) == EXIT_OK
    capsys.readouterr()
    assert main(["rules", "--emit-egglog", "--no-default-rules", "--rules", str(mine)]) == EXIT_OK
    text = capsys.readouterr().out
    assert f"{escape(str(mine))}:2:10)" in text
    assert not any(line.startswith("(union") for line in text.splitlines())
    assert "(union (Sigmoid" not in text.replace(escape(str(mine)), "")
