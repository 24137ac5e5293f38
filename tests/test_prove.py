"""Proving programs equal: the e-graph translation, bounded saturation, `prismc prove` and `--explain`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from prism_dsl.lang.check import load
from prism_dsl.cli.main import main
from prism_dsl.prove.egglog_runner import Limits
from prism_dsl.prove.egraph import compile_library
from prism_dsl.base.errors import PrismError
from prism_dsl.prove.prover import pair_outputs, prove
from prism_dsl.prove.rules import Library, load_library

REPO = Path(__file__).resolve().parent.parent
DEFAULT = load_library([], defaults=True)
NONE = Library((), (), ())

HEADER = "dims n = 8, d = 64, m = 32, k = 16\n"
SIGNATURE = "X: f32[n, d], W: f32[d, m], V: f32[d, m], U: f32[m, k], A: f32[n, d], B: f32[n, d]"


def programs(tmp_path: Path, lhs: str, rhs: str, header: str = HEADER, signature: str = SIGNATURE):
    """Two one-output programs over the same inputs, written to files and checked."""
    out = []
    for side, expr in (("a", lhs), ("b", rhs)):
        path = tmp_path / f"{side}.prism"
        path.write_text(f"{header}program {side}({signature}) {{\n    Y = {expr}\n    return Y\n}}\n")
        out.append(load(path).program())
    return out


EQUAL = [
    ("rmsnorm_matmul", "rms_norm(X) @ W", "(X @ W) / sqrt(mean(square(X), -1))"),
    ("matmul_assoc", "(X @ W) @ U", "X @ (W @ U)"),
    ("matmul_distrib", "X @ W + X @ V", "X @ (W + V)"),
    ("silu", "silu(X)", "X * sigmoid(X)"),
    ("gelu_tanh", "gelu_tanh(X @ W)",
     "0.5 * (X @ W) * (1 + tanh(0.7978845608028654 * ((X @ W) + 0.044715 * (X @ W) * (X @ W) * (X @ W))))"),
    ("softmax_unstable", "softmax(X)", "exp(X) / sum(exp(X), -1)"),
    ("softmax_stable_written_out", "softmax(X)", "exp(X - max(X, -1)) / sum(exp(X - max(X, -1)), -1)"),
    ("gated_rmsnorm", "(rms_norm(X) @ W) * (rms_norm(X) @ V)",
     "((X @ W) * (X @ V)) / square(sqrt(mean(square(X), -1)))"),
    ("attention_late_div", "softmax(X @ W) @ U",
     "(exp(X @ W - max(X @ W, -1)) @ U) / sum(exp(X @ W - max(X @ W, -1)), -1)"),
    ("sum_linear", "sum(A + B, -1)", "sum(B, -1) + sum(A, -1)"),
    ("mean_scale", "mean(A * sum(B, -1), -1)", "mean(A, -1) * sum(B, -1)"),
    ("rsqrt", "A * rsqrt(sum(square(B), -1))", "A / sqrt(sum(B * B, -1))"),
    ("double_negation", "-(-A)", "A"),
    ("sub_as_add", "A - B", "A + -1 * B"),
    ("fraction_sum", "A / sum(B, -1) + B / sum(B, -1)", "(A + B) / sum(B, -1)"),
    ("exp_sub", "exp(A - B)", "exp(A) / exp(B)"),
    ("add_twice", "X @ W + X @ W", "(X * 2) @ W"),
    ("add_twice_inside", "sum(A, -1) + sum(A, -1)", "sum(2 * A, -1)"),
]

NOT_EQUAL = [
    ("exp_add", "exp(A + B)", "exp(A) + exp(B)"),
    ("rmsnorm_after_matmul", "rms_norm(X) @ W", "rms_norm(X @ W)"),
    ("sub_order", "A - B", "B - A"),
    ("sum_of_product", "sum(A * B, -1)", "sum(A, -1) * sum(B, -1)"),
    ("softmax_wrong_dim", "softmax(A)", "exp(A) / sum(exp(A), -2)"),
    ("doubled", "(X @ W) @ U", "X @ W @ U + X @ W @ U"),
    ("tripled", "A + A + A", "2 * A"),
]


@pytest.mark.parametrize("name, lhs, rhs", EQUAL, ids=[p[0] for p in EQUAL])
def test_equal_pairs_are_proved(tmp_path, name, lhs, rhs):
    a, b = programs(tmp_path, lhs, rhs)
    proof = prove(a, b, DEFAULT)
    assert proof.proved, proof.reason
    assert proof.reason == "proved" and all(p.proved for p in proof.pairs)
    assert proof.numeric_gap is not None and proof.numeric_gap < 1e-9


@pytest.mark.parametrize("name, lhs, rhs", NOT_EQUAL, ids=[p[0] for p in NOT_EQUAL])
def test_unequal_pairs_are_not_proved(tmp_path, name, lhs, rhs):
    a, b = programs(tmp_path, lhs, rhs)
    proof = prove(a, b, DEFAULT)
    assert not proof.proved
    assert proof.reason and proof.reason != "proved"
    assert proof.numeric_gap > 1e-3  # the pairs really differ: "not proved" is the right answer


@pytest.mark.parametrize("path", sorted((REPO / "programs" / "proofs").glob("*.prism")), ids=lambda p: p.stem)
def test_every_proof_file_is_proved(path, capsys):
    assert main(["prove", str(path)]) == 0
    assert re.search(r"== \w+: proved", capsys.readouterr().out)


def test_explain_lists_the_rules_a_proof_needs(capsys):
    assert main(["prove", str(REPO / "programs" / "proofs" / "rmsnorm_linear.prism"), "--explain"]) == 0
    out = capsys.readouterr().out
    used = dict(re.findall(r"^\s+(\w+)\s+\S+\s+(\S+:\d+:\d+)$", out, re.M))
    assert set(used) == {"rms_norm_def", "matmul_div_left"}
    assert used["rms_norm_def"].endswith("definitions.rules:7:10")
    # The explained set alone proves the pair again.
    subset = Library(tuple(DEFAULT.rule(n) for n in used), DEFAULT.files, DEFAULT.texts)
    a, b = load(REPO / "programs" / "proofs" / "rmsnorm_linear.prism").programs.values()
    assert prove(a, b, subset).proved


def test_outputs_pair_by_name_and_each_is_reported(tmp_path):
    sig = "A: f32[n, d], B: f32[n, d]"
    text = HEADER + f"""
program first({sig}) {{
    P = A + B
    Q = exp(A + B)
    return P, Q
}}
program second({sig}) {{
    Q = exp(A) + exp(B)
    P = B + A
    return Q, P
}}
"""
    path = tmp_path / "two.prism"
    path.write_text(text)
    a, b = load(path).programs.values()
    proof = prove(a, b, DEFAULT)
    assert not proof.proved
    assert {(p.name, p.proved) for p in proof.pairs} == {("P", True), ("Q", False)}


def test_outputs_pair_by_the_names_they_share_and_the_rest_by_position(tmp_path):
    """`return A, B` against `return B, C`: B with B, then A with C (not A with B by position)."""
    path = tmp_path / "some.prism"
    path.write_text(HEADER + """
program a(X: f32[n, d]) {
    A = X + 1
    B = X * 2
    return A, B
}
program b(X: f32[n, d]) {
    B = X * 2
    C = 1 + X
    return B, C
}
""")
    a, b = load(path).programs.values()
    assert pair_outputs(a, b) == [("A", "C"), ("B", "B")] and prove(a, b, DEFAULT).proved


def test_signature_and_shape_mismatches_are_user_errors(tmp_path):
    a, _ = programs(tmp_path, "A + B", "A")
    (tmp_path / "c.prism").write_text(HEADER + "program c(A: f32[n, d]) {\n    Y = A\n    return Y\n}\n")
    with pytest.raises(PrismError, match="reads inputs"):
        prove(a, load(tmp_path / "c.prism").program(), DEFAULT)
    x, y = programs(tmp_path, "sum(A, -1)", "A")
    proof = prove(x, y, DEFAULT)
    assert not proof.proved and "shape" in proof.reason
    (tmp_path / "h.prism").write_text(HEADER + "program h(" + SIGNATURE.replace("A: f32", "A: f16") + ") {\n"
                                      "    Y = A + B\n    return Y\n}\n")
    with pytest.raises(PrismError, match="input 'A' is f32 in 'a' but f16 in 'h'"):
        prove(a, load(tmp_path / "h.prism").program(), DEFAULT)


def test_a_negative_literal_in_a_rule_matches_a_programs_negative_constant(tmp_path):
    """A program's `-2` is one constant in the e-graph; a rule's `-2` must be that too, not a negation of 2."""
    mine = tmp_path / "mine.rules"
    mine.write_text("ruleset mine {\n    rule negtwo: x * -2 => -(x + x)\n}\n")
    a, b = programs(tmp_path, "A * -2", "-(A + A)")
    library = load_library([mine], defaults=False)
    assert prove(a, b, library).proved
    assert "(Mul v_x (Num -2.0))" in compile_library(library)[0]


def test_outputs_of_different_shapes_are_not_equal_with_no_note_on_numbers(tmp_path, capsys):
    path = tmp_path / "p.prism"
    path.write_text("dims n = 4, d = 6\n" + "".join(
        f"program {p}(X: f32[2, n, d], Y: f32[2, n, d]) {{\n    Z = sum({e})\n    return Z\n}}\n"
        for p, e in (("a", "X + Y, 0"), ("b", "Y + X, -2"))))
    assert main(["prove", str(path)]) == 3
    out = capsys.readouterr().out
    assert "not equal: output 'Z' has shape [1, n, d] but 'Z' has [2, 1, d]" in out and "note:" not in out


def test_a_proof_of_numerically_different_programs_is_refused(tmp_path):
    # An unsound axiom smuggled past the soundness check (it is never run here) proves a wrong pair;
    # the numeric guard in prove catches it and blames the axioms.
    bad = tmp_path / "bad.rules"
    bad.write_text("ruleset bad {\n    # wrong on purpose\n    rule exp_add_wrong: exp(a + b) => exp(a) + exp(b)\n}\n")
    a, b = programs(tmp_path, "exp(A + B)", "exp(A) + exp(B)")
    with pytest.raises(PrismError, match="unsound") as e:
        prove(a, b, load_library([bad]))
    # the user's rules the proof used are named, where they are
    assert f"these are not the default library's: 'exp_add_wrong' ({bad}:3:10)" in str(e.value)


def test_a_proof_that_float64_cannot_follow_is_not_blamed_on_a_users_rule(tmp_path):
    """exp(X - 1000) is 0 in float64, so the unstable form is 0 / 0 where softmax is defined: the proof rests
    on the default library alone, and the message says float64 is the likelier cause."""
    a, b = programs(tmp_path, "softmax(A - 1000.0)", "exp(A - 1000.0) / sum(exp(A - 1000.0), -1)")
    with pytest.raises(PrismError) as e:
        prove(a, b, DEFAULT)
    message = str(e.value)
    assert "one is not finite where the other is" in message and "uses only the default library's axioms" in message


def test_unsound_rules_file_is_rejected_by_prove(tmp_path, capsys):
    bad = tmp_path / "bad.rules"
    bad.write_text("ruleset bad {\n    # wrong on purpose\n    rule exp_add_wrong: exp(a + b) => exp(a) + exp(b)\n}\n")
    a = REPO / "programs" / "proofs" / "rmsnorm_linear.prism"
    assert main(["prove", str(a), "--rules", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "exp_add_wrong" in err and f"{bad}:3:" in err and "Traceback" not in err


def test_extension_without_python(tmp_path, capsys):
    """One new axiom in a user file makes a pair provable that is not provable without it."""
    a, b = tmp_path / "a.prism", tmp_path / "b.prism"
    a.write_text("dims n = 4\nprogram p(X: f32[n, n]) {\n    Y = relu(relu(X))\n    return Y\n}\n")
    b.write_text("dims n = 4\nprogram p(X: f32[n, n]) {\n    Y = relu(X)\n    return Y\n}\n")
    mine = tmp_path / "mine.rules"
    mine.write_text("ruleset mine {\n    # relu is idempotent\n    rule relu_relu: relu(relu(x)) => relu(x)\n}\n")
    assert main(["prove", str(a), str(b)]) == 3  # the default library knows nothing of relu
    assert main(["prove", str(a), str(b), "--no-default-rules"]) == 3
    assert "not proved" in capsys.readouterr().out
    assert main(["prove", str(a), str(b), "--no-default-rules", "--rules", str(mine), "--explain"]) == 0
    out = capsys.readouterr().out
    assert "p == p: proved" in out and "relu_relu" in out and "mine.rules:3:" in out
    assert main(["prove", str(a), str(b), "--rules", str(mine)]) == 0


def test_without_rules_only_identical_programs_are_proved(tmp_path):
    a, b = programs(tmp_path, "A + B", "A + B")
    assert prove(a, b, NONE).proved
    a, b = programs(tmp_path, "A + B", "B + A")
    proof = prove(a, b, NONE)
    assert not proof.proved and proof.reason.startswith("saturated")


def test_pathological_pair_stops_within_its_limits(tmp_path):
    lhs = "(A + B) * (A + B) * (A + B) * (A + B) * (A + B)"
    rhs = "A * A * A * A * A + B * B * B * B * B"
    a, b = programs(tmp_path, lhs, rhs)
    by_nodes = prove(a, b, DEFAULT, Limits(nodes=5_000, seconds=30))
    assert not by_nodes.proved and "size limit" in by_nodes.reason
    by_iterations = prove(a, b, DEFAULT, Limits(iterations=3, seconds=30))
    assert not by_iterations.proved and "iteration limit (3)" in by_iterations.reason
    assert by_iterations.iterations == 3
    by_time = prove(a, b, DEFAULT, Limits(seconds=1.0, nodes=10**9, match_limit=10**6))
    assert not by_time.proved and "time limit" in by_time.reason
    assert by_time.seconds < 3.0  # the limit holds inside one long egglog call: the worker is killed


def test_cli_limits_and_exit_codes(tmp_path, capsys):
    a, b = tmp_path / "a.prism", tmp_path / "b.prism"
    for path, expr in ((a, "(A + B) * (A + B) * (A + B) * (A + B)"), (b, "A * A * A * A + B * B * B * B")):
        path.write_text("dims n = 4\nprogram p(A: f32[n, n], B: f32[n, n]) {\n    Y = " + expr + "\n    return Y\n}\n")
    assert main(["prove", str(a), str(b), "--iterations", "2"]) == 3
    assert "iteration limit (2) reached" in capsys.readouterr().out
    assert main(["prove", str(a), str(b), "--nodes", "0"]) == 2
    assert "positive integer" in capsys.readouterr().err
    assert main(["prove", str(a), str(b), "--timeout", "-1"]) == 2
    assert main(["prove", str(tmp_path / "missing.prism"), str(b)]) == 1
    assert "missing.prism" in capsys.readouterr().err
    assert main(["prove", str(a)]) == 1  # one file must hold two programs
    assert "exactly two" in capsys.readouterr().err


def test_emitted_egglog_maps_every_rule_to_its_source(capsys):
    assert main(["rules", "--emit-egglog"]) == 0
    text = capsys.readouterr().out
    for rule in DEFAULT.rules:
        assert re.search(rf"^; rule {rule.name} -> \({rule.ruleset}, .*:{rule.loc.line}:\d+\)$", text, re.M), rule.name
    program, emitted = compile_library(DEFAULT)
    assert len(emitted) == sum(2 if r.both_ways else 1 for r in DEFAULT.rules)
    assert main(["rules"]) == 0
    assert "ruleset algebra" in capsys.readouterr().out


def test_float_overflow_is_not_taken_for_an_unsound_axiom(tmp_path):
    # exp overflows on both sides at different places; where both are finite they agree
    a, b = programs(tmp_path, "exp(1000 * A - 1000 * B)", "exp(1000 * A) / exp(1000 * B)")
    proof = prove(a, b, DEFAULT)
    assert proof.proved and proof.numeric_gap < 1e-9


@pytest.mark.parametrize("lhs, rhs, rules", [
    # div_cancel holds where the divisor is not zero; here it is zero everywhere, and the -inf of the mask made
    # the guard take every NaN against a finite value for float overflow
    ("causal((X / (A - A)) / (B / (A - A)))", "causal(X / B)", ""),
    # a user's rule sympy proves (it cancels a / a) and the sampler never meets at a = 0
    ("causal((A - A) / (A - A))", "causal(1 + 0 * (A - A))",
     "ruleset mine {\n    rule div_self: a / a => 1 + 0 * a\n}\n"),
], ids=["div_cancel at zero", "user rule at zero"])
def test_a_difference_no_smaller_inputs_remove_is_not_taken_for_overflow(tmp_path, lhs, rhs, rules):
    """Proved by rules true but where a divisor is zero, the programs differ: NaN against finite values at every
    scale of the inputs (overflow's differences go at smaller inputs), so the proof is refused."""
    library = DEFAULT
    if rules:
        (tmp_path / "mine.rules").write_text(rules)
        library = load_library([tmp_path / "mine.rules"], defaults=True)
    a, b = programs(tmp_path, lhs, rhs, signature="X: f32[n, d], A: f32[n, d], B: f32[n, d]",
                    header="dims n = 8, d = 8\n")
    words = "some axiom in use is unsound .*'div_self'" if rules else "uses only the default library's axioms"
    with pytest.raises(PrismError, match=f"differ numerically .*{words}.*a division by zero that a rule cancels"):
        prove(a, b, library)


@pytest.mark.parametrize("lhs, rhs", [
    ("(A * 1e-200) * 1e-200", "(A * 1e-300) * 1e-300"),  # each folded to A * 0 they were one term
    ("(A * 1e200) * 1e200", "(A * 1e300) * 1e300"),  # and to A * inf
    ("(A * 1e-200) * 1e-200", "A * 0"),
], ids=["underflow", "overflow", "underflow-to-zero"])
def test_constants_fold_only_where_float64_holds_the_result(tmp_path, lhs, rhs):
    """The two sides differ (A = 1e300 tells them apart); the standard-normal inputs of the numeric guard do
    not, so only the folding stands between these pairs and a false proof. Folding within range still proves."""
    a, b = programs(tmp_path, lhs, rhs)
    assert not prove(a, b, DEFAULT).proved
    a, b = programs(tmp_path, "(A * 2) * 3 - B * (0 * 1e-200)", "A * 6 - B * 0")
    assert prove(a, b, DEFAULT).proved


def test_tensors_deeper_than_the_e_graph_tracks_are_refused(tmp_path):
    shape = "f32[k, 1, 1, 1, 1, 1, 1, 1, 1, 1]"
    a, b = programs(tmp_path, "sum(A / C, 0)", "sum(A, 0) / C", header="dims k = 3\n",
                    signature=f"A: {shape}, C: {shape}")
    with pytest.raises(PrismError, match="rank 10 .* the prover handles ranks up to 9"):
        prove(a, b, DEFAULT)


def test_program_options_pick_programs_from_files(capsys, tmp_path):
    plain, fused = REPO / "programs" / "rmsnorm_linear.prism", REPO / "programs" / "proofs" / "rmsnorm_linear.prism"
    assert main(["prove", str(plain), str(fused), "--program", "rmsnorm_linear", "--program", "rmsnorm_linear_fused"]) == 0
    assert "rmsnorm_linear == rmsnorm_linear_fused: proved" in capsys.readouterr().out
    assert main(["prove", str(fused), "--program", "rmsnorm_linear_fused", "--program", "rmsnorm_linear"]) == 0
    capsys.readouterr()
    assert main(["prove", str(plain)]) == 1
    assert "defines 1 program (rmsnorm_linear); to prove with one file" in capsys.readouterr().err
    assert main(["prove", str(fused), "--program", "rmsnorm_linear"]) == 2
    assert main(["prove", str(plain), str(fused), "--program", "a", "--program", "b", "--program", "c"]) == 2


def test_explain_says_so_when_it_cannot_narrow_the_rules_down(tmp_path):
    from prism_dsl.prove.prover import explain_rules, pair_outputs, proof_terms

    a, b = programs(tmp_path, "(rms_norm(X) @ W) * (rms_norm(X) @ V)",
                    "((X @ W) * (X @ V)) / square(sqrt(mean(square(X), -1)))")
    setup, goals = proof_terms(a, b, pair_outputs(a, b))
    why = explain_rules(DEFAULT, setup, goals, Limits(iterations=1))
    assert isinstance(why, str) and "iteration limit (1) reached" in why


def test_checking_a_rules_file_finds_clashes_with_the_default_library(capsys, tmp_path):
    mine = tmp_path / "mine.rules"
    mine.write_text("ruleset mine {\n    # relu is idempotent\n    rule matmul_assoc: relu(relu(x)) => relu(x)\n}\n")
    assert main(["check", str(mine)]) == 1
    assert "mine.rules:3:10: duplicate rule name 'matmul_assoc'" in capsys.readouterr().err
    assert main(["check", "--no-default-rules", str(mine)]) == 0


def test_a_rules_file_given_as_a_program_is_said_to_be_one(capsys):
    assert main(["prove", str(REPO / "rules" / "algebra.rules"), str(REPO / "programs" / "rmsnorm_linear.prism")]) == 1
    err = capsys.readouterr().err
    assert "algebra.rules: a .rules file holds axioms, not programs" in err and "--rules" in err


def test_programs_with_different_numbers_of_outputs_are_refused_at_their_lines(tmp_path):
    path = tmp_path / "p.prism"
    path.write_text("dims n = 8\nprogram a(X: f32[n]) {\n    Y = X * 2\n    Z = X * 3\n    return Y, Z\n}\n"
                    "program b(X: f32[n]) {\n    Y = X * 2\n    return Y\n}\n")
    a, b = load(path).programs.values()
    with pytest.raises(PrismError) as e:
        prove(a, b, DEFAULT)
    assert str(e.value).startswith(
        f"{path}:2:9: cannot compare 'a' (2 outputs: Y, Z) with 'b' ({path}:7:9, 1 output: Y)")


def test_no_numeric_cross_check_says_why(tmp_path, capsys):
    """Sizes written as numbers, too large for the float64 reference at every binding the guard tries."""
    path = tmp_path / "p.prism"
    path.write_text("program a(X: f32[100000, 100000]) {\n    Y = X * 2\n    return Y\n}\n"
                    "program b(X: f32[100000, 100000]) {\n    Y = X + X\n    return Y\n}\n")
    main(["prove", str(path)])
    out = capsys.readouterr().out
    assert "note: no numeric cross-check at any of the sizes tried: these sizes are too large: input 'X'" in out
