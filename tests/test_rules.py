"""The .rules language: parsing, static checks, the numeric soundness check, the default library."""

from __future__ import annotations

from pathlib import Path

import pytest

from prism_dsl.base.errors import PrismError
from prism_dsl.prove.rules import RULE_SYNTAX_ERRORS, default_files, load_library
from prism_dsl.prove import soundness
from prism_dsl.prove.soundness import check_library, check_rule

REPO = Path(__file__).resolve().parent.parent
DEFAULT = load_library([], defaults=True)


def write(tmp_path: Path, text: str, name: str = "t.rules") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def errors_of(path: Path) -> list[str]:
    with pytest.raises(PrismError) as info:
        load_library([path])
    return [f"{d.loc.line}:{d.loc.col}: {d.message}" for d in info.value.diagnostics]


def test_default_library_is_the_rules_folder():
    assert [p.name for p in default_files()] == sorted(p.name for p in (REPO / "rules").glob("*.rules"))
    assert {"algebra", "definitions"} <= set(DEFAULT.rulesets)
    assert len({r.name for r in DEFAULT.rules}) == len(DEFAULT.rules)


def test_every_default_rule_has_a_comment_above_it():
    for path in default_files():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip().startswith("rule "):
                above = [ln.strip() for ln in lines[:i] if ln.strip()]
                assert above and (above[-1].startswith("#") or above[-1].startswith("rule ")), (path, i + 1)


@pytest.mark.parametrize("rule", DEFAULT.rules, ids=lambda r: r.name)
def test_default_rule_is_sound(rule):
    assert check_rule(rule) is None


UNSOUND = [
    ("exp_add_wrong", "exp(a + b) => exp(a) + exp(b)", "sides differ"),
    ("sum_add_no_condition", "sum(a + b, i) <=> sum(a, i) + sum(b, i)", "sides differ"),
    ("matmul_add_no_condition", "a @ (b + c) <=> a @ b + a @ c", "ill formed"),
    ("cancel_widens", "(a / c) / (b / c) => a / b", "different shapes"),
    ("reduce_swap_same_dim", "mean(sum(a, i), j) <=> sum(mean(a, j), i)", "sides differ"),
    ("relu_is_identity", "relu(x) => x", "sides differ"),
    # layout rules that hold only when the pieces are laid along a block dim, not the last dim
    ("split_rms_norm_any_dim", "rms_norm(split(a, i, j, g)) => split(rms_norm(a), i, j, g) if i != -1", "sides differ"),
    ("split_rows_any_dim", "split(a, -2, j, g) @ b => split(a @ b, -2, j, g) if size(b, j) == 1", "ill formed"),
    ("split_concat_other_count", "split(concat(a, i, j), i, j, g) => a", "differ"),
    ("acc_sum_is_max", "acc_sum(a) => max(a, -9)", "sides differ"),
    ("sub_commutes", "a - b => b - a", "sides differ"),
    ("sum_of_product", "sum(a * b, -1) => sum(a, -1) * sum(b, -1)", "sides differ"),
    ("sum_drops_dim", "sum(a, -1) => a", "different shapes"),
    ("matmul_commutes", "a @ b => b @ a", ""),
    ("sqrt_of_sum", "sqrt(a + b) => sqrt(a) + sqrt(b)", "one side is finite and the other is not"),
    # defined on one side only: at negative a and b the left side is a number and the right is not
    ("sqrt_of_product", "sqrt(a * b) => sqrt(a) * sqrt(b)", "one side is finite and the other is not"),
    ("sqrt_squared", "sqrt(x) * sqrt(x) => x", "one side is finite and the other is not"),
    # right for tensors of rank 3 or less only: instances reach as deep as the rule's dims
    ("sum_deep_dim", "sum(a, -4) => a", "different shapes"),
]


def test_dims_beyond_what_the_prover_tracks_are_errors(tmp_path):
    path = write(tmp_path, "ruleset r {\n    rule deep: sum(a, -10) => sum(a, -10) if size(a, -11) == 1\n}\n")
    with pytest.raises(PrismError) as info:
        load_library([path])
    text = info.value.render()
    assert ":2:23: dim -10 is beyond the 9 dims the prover tracks" in text
    assert "size(..., -11): the prover tracks the last 9 dims" in text


@pytest.mark.parametrize("name,text,why", UNSOUND, ids=[u[0] for u in UNSOUND])
def test_unsound_rule_is_rejected_and_named(tmp_path, name, text, why):
    path = write(tmp_path, f"ruleset bad {{\n    rule {name}: {text}\n}}\n")
    library = load_library([path])
    with pytest.raises(PrismError) as info:
        check_library(library, use_cache=False)
    (d,) = info.value.diagnostics
    assert (d.loc.line, d.loc.col) == (2, 10)
    assert f"rule '{name}' is unsound" in d.message and why in d.message


BAD_RULES = [
    ("rule r: exq(a) => a", "2:13: unknown operator 'exq'; did you mean 'exp'?"),
    ("rule r: a * b => a * c", "2:26: 'c' is used on the right but not bound on the left"),
    ("rule r: a * expp => a", "2:17: 'expp' would become a pattern variable, but it looks like a misspelling of 'exp'"),
    ("rule r: a => a * 1", "2:13: the left side of a rule must be an operator application"),
    ("rule r: sum(a, 0) => sum(a, -1)", "2:20: dims in rules count from the end"),
    ("rule r: sum(a, i) <=> a if size(a, i) == 1", "'i' is not used on the right, so '<=>' cannot rewrite"),
    ("rule r: a * b => b * a if size(z, -1) == 1", "size(z, ...): 'z' is not a tensor variable of the left side"),
    ("rule r: exp => a", "2:13: 'exp' is an operator, not a pattern variable"),
    ("rule r: sum(a, i) * i => a", "'i' is used both as a tensor and as a dim"),
    ("rule r: exp(a, b) => a", "2:13: exp takes 1 tensor operand, got 2 arguments"),
    ("rule r: sum(a, i) => exp(i)", "2:30: 'i' is a dim on the left; here it is used as a tensor"),
    ("rule r: a * b => b * a if i != j", "'i' is not a dim variable of the left side"),
    ("rule r: a * b => b * a if size(a, -1) == shape(b)", "a condition compares a size with a size or an integer"),
    ("rule r: a * b => b * a if size(a, -1) == -3", "2:31: a size is at least 1: this condition never holds"),
    ("rule r: a * b => b * a if 0 != size(a, -1)", "2:31: a size is at least 1: this condition always holds"),
    ("rule r: sum(a, i) => sum(a, i) * 1 if i != i", "compares an operand with itself: it never holds"),
    ("rule r: a * b => b * a if shape(a) == shape(a)", "compares an operand with itself: it always holds"),
]


@pytest.mark.parametrize("text,expected", BAD_RULES, ids=[b[0] for b in BAD_RULES])
def test_bad_rule_is_reported_with_location(tmp_path, text, expected):
    path = write(tmp_path, f"ruleset r {{\n    {text}\n}}\n")
    assert any(expected in e for e in errors_of(path)), errors_of(path)


def test_all_errors_of_a_file_at_once_and_duplicate_names(tmp_path):
    path = write(tmp_path, "ruleset r {\n  rule x: exq(a) => a\n  rule y: a + b => b + c\n  rule z: a * b => b * a\n  rule z: a + b => b + a\n}\n")
    errs = errors_of(path)
    assert len(errs) == 3, errs
    assert any("5:8: duplicate rule name 'z'" in e for e in errs)


@pytest.mark.parametrize("label", list(RULE_SYNTAX_ERRORS))
def test_syntax_error_table(tmp_path, label):
    for example in RULE_SYNTAX_ERRORS[label]:
        path = write(tmp_path, example)
        errs = errors_of(path)
        assert len(errs) == 1 and "syntax error" in errs[0] and label in errs[0], (example, errs)


def test_import_relative_and_cycle(tmp_path):
    (tmp_path / "sub").mkdir()
    write(tmp_path, 'import "sub/b.rules"\nruleset a { rule a1: a * b => b * a }\n', "a.rules")
    write(tmp_path, "ruleset b { rule b1: a + b => b + a }\n", "sub/b.rules")
    library = load_library([tmp_path / "a.rules"])
    assert [r.name for r in library.rules] == ["b1", "a1"]
    write(tmp_path, 'import "../a.rules"\nruleset b { rule b1: a + b => b + a }\n', "sub/b.rules")
    assert any("import cycle" in e for e in errors_of(tmp_path / "a.rules"))


def test_missing_file_and_directory_and_binary(tmp_path):
    with pytest.raises(PrismError, match="no such file"):
        load_library([tmp_path / "nope.rules"])
    with pytest.raises(PrismError, match="is a directory"):
        load_library([tmp_path])
    bad = tmp_path / "bin.rules"
    bad.write_bytes(b"ruleset r {\xff}")
    with pytest.raises(PrismError, match="not valid UTF-8"):
        load_library([bad])


def test_conditions_restrict_instances(tmp_path):
    # Sound only because of its condition: the check must draw shapes that satisfy it.
    path = write(tmp_path, "ruleset r {\n  rule ok: sum(a * s, i) <=> sum(a, i) * s if size(s, i) == 1\n}\n")
    check_library(load_library([path]), use_cache=False)


def test_a_condition_on_a_size_the_check_cannot_draw_is_said_so(tmp_path):
    """Sound at 8192, but the sampled tensors hold at most 4096 elements: it cannot be checked (it was called
    unsound, no shape making its left side well formed); at 4096 it is checked."""
    text = "ruleset r {\n  rule m: mean(x, -1) => sum(x, -1) / N if size(x, -1) == N\n}\n"
    path = write(tmp_path, text.replace("N", "8192"))
    with pytest.raises(PrismError) as e:
        check_library(load_library([path]), use_cache=False)
    assert "t.rules:2:8: rule 'm' cannot be checked: a condition fixes a size of 8192, past the 4096" in str(e.value)
    check_library(load_library([write(tmp_path, text.replace("N", "4096"))]), use_cache=False)


def test_a_rule_no_drawn_shape_makes_well_formed_cannot_be_checked_and_is_not_called_unsound(tmp_path):
    """`a @ b` with a's last dim 1 and b's rows 4 never holds: nothing is compared, so nothing is shown false; the
    rule is refused all the same, for what it is."""
    path = write(tmp_path, "ruleset r {\n  rule never: a @ b => b @ a if size(a, -1) == 1 and size(b, -2) == 4\n}\n")
    with pytest.raises(PrismError) as e:
        check_library(load_library([path]), use_cache=False)
    assert ("t.rules:2:8: rule 'never' cannot be checked: no shapes make its left side well formed (tried 4000 "
            "random shapes): it could never apply") in str(e.value) and "unsound" not in str(e.value)


def test_soundness_cache_is_keyed_by_meaning(tmp_path, monkeypatch):
    monkeypatch.setenv("PRISM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(soundness, "cacheable", lambda rule: True)  # as the default library's rules are
    path = write(tmp_path, "ruleset r {\n  rule r1: a * b => b * a\n}\n")
    check_library(load_library([path]))
    assert list((tmp_path / "cache" / "sound").glob("*.json"))
    # Same name, different (wrong) meaning: checked again, and rejected.
    write(tmp_path, "ruleset r {\n  rule r1: a - b => b - a\n}\n")
    with pytest.raises(PrismError, match="unsound"):
        check_library(load_library([path]))


def test_a_program_given_as_rules_is_refused(tmp_path):
    path = write(tmp_path, "dims n = 4\n", name="p.prism")
    with pytest.raises(PrismError, match=r"is a \.prism program; axioms come from \.rules files"):
        load_library([path])


def test_the_repositorys_rules_beside_an_installed_library_are_that_library(tmp_path, monkeypatch, capsys):
    """Installed, prismc's default library is its package's copy of rules/; `prismc check rules/algebra.rules` in the
    repository then names a copy of a default file, which stands in for it instead of clashing with it rule by
    rule. An edited copy is another file: its rules clash, as any file's of the same names would."""
    import shutil

    from prism_dsl.cli.main import main
    from prism_dsl.prove import rules as rules_module

    installed = tmp_path / "installed"
    shutil.copytree(REPO / "rules", installed)
    monkeypatch.setattr(rules_module, "default_files", lambda: sorted(installed.glob("*.rules")))
    given = REPO / "rules" / "algebra.rules"
    library = load_library([given], defaults=True)
    assert {r.loc.path for r in library.rules if r.ruleset == "algebra"} == {str(given)}
    assert len(library.rules) == len(load_library([], defaults=True).rules)
    assert main(["check", str(given)]) == 0
    assert f"{given}: ok: {sum(r.ruleset == 'algebra' for r in library.rules)} rules" in capsys.readouterr().out
    edited = tmp_path / "algebra.rules"
    edited.write_text(given.read_text() + "\n")
    with pytest.raises(PrismError, match="duplicate rule name 'add_comm'"):
        load_library([edited], defaults=True)
