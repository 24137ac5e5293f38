"""Fuzzing both languages: seeded mutations of every file in programs/ and rules/, through `prismc check`.

Each case mutates one shipped source a few times with `random.Random` (a line or a token deleted, doubled,
swapped or replaced, the text cut short, a bracket, an odd number or an odd character put in, an arrow
flipped), writes it and runs `prismc check` on it in-process. Whatever the text, the front end must answer
with an exit code from 0 to 3, never a traceback, and every error it prints must name the file and a
line:col inside that file, followed by that line and a caret. A failure shows the call that makes the
case again (`mutate(path, seed)`), the mutations and the mutated text.

Rule files are longer, and `check` also tests every rule that parses numerically (tens of milliseconds a
rule). So a rule case mutates a window of a few lines of a file, inside its `ruleset` braces, and most
load it with the front end alone (`load_library`: the parse and the static checks); a few run the whole
`check`, the numeric test included, on one mutated rule.
"""

from __future__ import annotations

import contextlib
import io
import random
import re
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

from prism_dsl.cli.main import main
from prism_dsl.base.errors import PrismError
from prism_dsl.ir.ops import OPS
from prism_dsl.prove.rules import load_library

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = sorted((ROOT / "programs").rglob("*.prism"))
RULES = sorted((ROOT / "rules").glob("*.rules"))

PROGRAM_CASES = 14  # per .prism file
RULES_CASES = 16  # per .rules file, a window of WINDOW lines, front end only
RULES_CLI_CASES = 3  # per .rules file, one rule, the whole `check` with the numeric soundness test
WINDOW = 10

# Messages that name no place in a file, because there is none: empty so far. (A top-level file that cannot
# be read at all names only its path, but every case here writes its file first.)
UNLOCATED: tuple[str, ...] = ()

# -- the mutations ---------------------------------------------------------------------------------------

_TOKEN = re.compile(
    r'\s+|#[^\n]*|"[^"\n]*"|<=>|=>|==|!=|\+=|(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?|[A-Za-z_]\w*|.', re.S
)

PUNCTUATION = ["+", "-", "*", "/", "@", "=", "==", "!=", "=>", "<=>", "+=", ":", ",", ";", "(", ")", "[", "]",
               "{", "}", '"', "#", ".", "$", "'", "\\", "-->", "**"]
KEYWORDS = ["dims", "def", "program", "return", "import", "ruleset", "rule", "if", "and", "kernel", "grid",
            "loop", "load", "store", "size", "shape", "x", "y", "z", "w", "f16", "bf16", "f32", "f64", "f8"]
NUMBERS = ["0", "1", "-1", "-9", "-10", "-64", "2", "3", "7", "64", "00", "007", "-0", "0.5", "1.", ".5",
           "1e3", "1e400", "1e-400", "1E-5", str(2**63 - 1), str(2**63), str(10**30), "9" * 5000, "0" * 5000 + "7", "\u0663", "\uff13"]
ODD_TEXT = ["\x00", "\t", "\r", "\r\n", "\x0c", "\x1b", "\u00a0", "\u2028", "\ufeff", "é", "λ", "Ω", "𝔁", "日本",
            "\u0301", "ﬁ"]
STRINGS = ['""', '"."', '".."', '"nope.prism"', '"nope.rules"', '"a\\b"', '"\t"']
# What an inserted `import` names: a missing file, a directory, or a source's own name (a file imports
# itself when that source is the one being mutated).
IMPORTS = STRINGS + [f'"{p.name}"' for p in PROGRAMS + RULES]
VOCABULARY = PUNCTUATION + KEYWORDS + NUMBERS + ODD_TEXT + STRINGS + sorted(OPS)
BRACKETS = ["(", ")", "[", "]", "{", "}", "((((", "))))", "(" * 250, ")" * 250]
SWAPS = [("=>", "<=>"), ("==", "!="), ("=", "+="), ("=", "=="), ("{", "}"), ("(", "["), (",", ";")]


def tokens(text: str) -> list[str]:
    """The text cut into tokens, whitespace and comments included, so that "".join gives it back."""
    return _TOKEN.findall(text) or [""]


def _solid(toks: list[str]) -> list[int]:
    """Indices of the tokens that are not whitespace."""
    return [i for i, t in enumerate(toks) if not t.isspace()] or [0]


def _lines(text: str) -> list[str]:
    return text.split("\n")


def _delete_line(rng, text):
    lines = _lines(text)
    i = rng.randrange(len(lines))
    return "\n".join(lines[:i] + lines[i + 1 :]), f"delete line {i + 1}"


def _duplicate_line(rng, text):
    lines = _lines(text)
    i = rng.randrange(len(lines))
    return "\n".join(lines[: i + 1] + lines[i:]), f"duplicate line {i + 1}"


def _swap_lines(rng, text):
    lines = _lines(text)
    i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
    lines[i], lines[j] = lines[j], lines[i]
    return "\n".join(lines), f"swap lines {i + 1} and {j + 1}"


def _delete_token(rng, text):
    toks = tokens(text)
    i = rng.choice(_solid(toks))
    return "".join(toks[:i] + toks[i + 1 :]), f"delete token {i} {toks[i]!r}"


def _duplicate_token(rng, text):
    toks = tokens(text)
    i = rng.choice(_solid(toks))
    return "".join(toks[: i + 1] + toks[i:]), f"duplicate token {i} {toks[i]!r}"


def _swap_tokens(rng, text):
    toks = tokens(text)
    solid = _solid(toks)
    k = rng.randrange(len(solid))
    i, j = solid[k], solid[min(k + 1, len(solid) - 1)]
    toks[i], toks[j] = toks[j], toks[i]
    return "".join(toks), f"swap tokens {i} and {j}"


def _replace_from_file(rng, text):
    toks = tokens(text)
    solid = _solid(toks)
    i, new = rng.choice(solid), toks[rng.choice(solid)]
    old, toks[i] = toks[i], new
    return "".join(toks), f"replace token {i} {old!r} by {new!r} (from the file)"


def _replace_from_vocabulary(rng, text):
    toks = tokens(text)
    i, new = rng.choice(_solid(toks)), rng.choice(VOCABULARY)
    old, toks[i] = toks[i], new
    return "".join(toks), f"replace token {i} {old!r} by {_short(new)}"


def _insert_from_vocabulary(rng, text):
    toks = tokens(text)
    i, new = rng.randrange(len(toks) + 1), rng.choice(VOCABULARY)
    sep = rng.choice(["", " "])
    return "".join(toks[:i] + [sep + new + sep] + toks[i:]), f"insert {_short(new)} before token {i}"


def _insert_bracket(rng, text):
    toks = tokens(text)
    i, new = rng.randrange(len(toks) + 1), rng.choice(BRACKETS)
    return "".join(toks[:i] + [new] + toks[i:]), f"insert {_short(new)} before token {i}"


def _replace_name(rng, text):
    """A name by another name of the file, an operator or a keyword: mistakes the parser lets through."""
    toks = tokens(text)
    names = [i for i, t in enumerate(toks) if t[:1].isalpha() or t[:1] == "_"] or _solid(toks)
    pool = sorted({toks[i] for i in names}) + sorted(OPS) + KEYWORDS
    i, new = rng.choice(names), rng.choice(pool)
    old, toks[i] = toks[i], new
    return "".join(toks), f"replace name {i} {old!r} by {new!r}"


def _change_number(rng, text):
    toks = tokens(text)
    numbers = [i for i, t in enumerate(toks) if t[:1].isdigit()] or _solid(toks)
    i, new = rng.choice(numbers), rng.choice(NUMBERS)
    old, toks[i] = toks[i], new
    return "".join(toks), f"replace number {i} {old!r} by {_short(new)}"


def _flip(rng, text):
    toks = tokens(text)
    a, b = rng.choice(SWAPS)
    hits = [i for i, t in enumerate(toks) if t in (a, b)]
    if not hits:
        return text, f"flip {a!r}/{b!r}: none"
    i = rng.choice(hits)
    old = toks[i]
    toks[i] = b if old == a else a
    return "".join(toks), f"flip token {i} {old!r} to {toks[i]!r}"


def _insert_import(rng, text):
    lines = _lines(text)
    i, new = rng.randrange(len(lines) + 1), f"import {rng.choice(IMPORTS)}"
    return "\n".join(lines[:i] + [new] + lines[i:]), f"insert {new!r} before line {i + 1}"


def _truncate(rng, text):
    n = rng.randrange(len(text) + 1)
    return text[:n], f"truncate to {n} characters"


def _insert_character(rng, text):
    n, new = rng.randrange(len(text) + 1), rng.choice(ODD_TEXT)
    return text[:n] + new + text[n:], f"insert {new!r} at character {n}"


def _nest(rng, text):
    toks = tokens(text)
    i, depth = rng.choice(_solid(toks)), rng.choice([2, 199, 201, 600])
    old, toks[i] = toks[i], "(" * depth + toks[i] + ")" * depth
    return "".join(toks), f"wrap token {i} {old!r} in {depth} parentheses"


# Drawn with equal chances; the mutations that leave a file that parses (names, numbers, lines) come more
# than once, so that the checks after the parser see as many cases as the parser itself.
MUTATIONS = [_delete_line, _delete_line, _duplicate_line, _duplicate_line, _swap_lines, _delete_token,
             _duplicate_token, _swap_tokens, _replace_from_file, _replace_from_vocabulary, _insert_from_vocabulary,
             _insert_bracket, _replace_name, _replace_name, _replace_name, _replace_name, _change_number,
             _change_number, _change_number, _flip, _flip, _truncate, _insert_character, _nest, _insert_import]


def _short(s: str) -> str:
    return repr(s) if len(s) <= 24 else f"{s[:10]!r}... ({len(s)} characters)"


@dataclass(frozen=True)
class Case:
    replay: str  # the call that makes this case again, e.g. "mutate(ROOT / 'programs/gqa.prism', 3)"
    text: str
    steps: tuple[str, ...]

    def describe(self) -> str:
        return f"{self.replay}: {'; '.join(self.steps)}\n--- mutated text ---\n{self.text}\n---"


def mutate(path: Path, seed: int, excerpt=None) -> Case:
    """One to three mutations of `path`'s text (or of `excerpt(path, seed)`), drawn by a generator seeded
    with the file's name and `seed`, so a case is the same on every machine and every run."""
    rng = random.Random(f"{path.name}:{seed}")
    text = path.read_text() if excerpt is None else excerpt(path, seed)
    steps = []
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3])):
        text, step = rng.choice(MUTATIONS)(rng, text)
        steps.append(step)
    how = f", {excerpt.__name__}" if excerpt else ""
    return Case(f"mutate(ROOT / {str(path.relative_to(ROOT))!r}, {seed}{how})", text, tuple(steps))


def window(path: Path, seed: int, width: int = WINDOW) -> str:
    """`width` lines of `path`'s ruleset, drawn by `seed`, inside the ruleset's braces: a rule file's
    grammar and checks at a tenth of the cost of its whole text."""
    text = path.read_text()
    head = re.search(r"ruleset\s+\w+\s*\{\n", text)
    body = text[head.end() :].rsplit("}", 1)[0].split("\n")
    start = random.Random(f"{path.name}:{seed}:window").randrange(max(1, len(body) - width))
    return head[0] + "\n".join(body[start : start + width]) + "\n}\n"


def one_rule(path: Path, seed: int) -> str:
    """One rule of `path`, drawn by `seed`, alone in its ruleset: a file whose numeric test is quick."""
    text = path.read_text()
    rules = [line for line in text.split("\n") if line.strip().startswith("rule ")]
    head = re.search(r"ruleset\s+\w+\s*\{", text)[0]
    return f"{head}\n{random.Random(f'{path.name}:{seed}:rule').choice(rules)}\n}}\n"


# -- the oracle ------------------------------------------------------------------------------------------

_HEAD = re.compile(r"^(?P<path>.+?):(?P<line>\d+):(?P<col>\d+): ")


def unlocated(stderr: str) -> list[str]:
    """The errors in `stderr` that do not point at a real line:col of a real file, with its line and a caret."""
    bad = []
    lines = stderr.split("\n")
    for i, line in enumerate(lines):
        if not line or line.startswith(" ") or re.fullmatch(r"\d+ errors", line):
            continue  # a source line, a caret, a note, or the count of errors
        if any(fragment in line for fragment in UNLOCATED):
            continue
        m = _HEAD.match(line)
        if m is None or not _inside(Path(m["path"]), int(m["line"]), int(m["col"])):
            bad.append(line)
        elif not re.fullmatch(r" {4}.*\n {4,}\^", "\n".join(lines[i + 1 : i + 3])):
            bad.append(f"{line}  [not followed by the source line and a caret]")
    return bad


def _inside(path: Path, line: int, col: int) -> bool:
    """Whether line:col is in the file, or just after its last character, as the parser counts lines."""
    try:
        text = path.read_bytes().decode("utf-8", errors="replace").removeprefix("\ufeff")
        lines = re.sub("\r(?!\n)", "\n", text).split("\n")  # (a lone CR ends a line: `syntax.read_source`)
    except OSError:
        return False
    return 1 <= line <= len(lines) and 1 <= col <= len(lines[line - 1]) + 1


def run_check(path: Path, *options: str) -> tuple[int | None, str, str]:
    """`prismc check` in-process: (exit code or None, stderr, the traceback of what escaped main)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(["check", *options, str(path)])
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - a SystemExit is a failure too
        return None, err.getvalue(), traceback.format_exc()
    return code, err.getvalue(), ""


def load_front_end(path: Path) -> tuple[int | None, str, str]:
    """A rule file through the front end alone, reported as `check` would report it."""
    try:
        load_library([path])
    except PrismError as e:
        return 1, e.render(), ""
    except Exception:  # noqa: BLE001
        return None, "", traceback.format_exc()
    return 0, "", ""


def problem(code: int | None, stderr: str, escaped: str) -> str | None:
    """What is wrong with one run's outcome, or None: the properties every case must have."""
    if code is None:
        return f"an exception escaped:\n{escaped}"
    if code not in (0, 1, 2, 3):
        return f"exit code {code}"
    if "Traceback" in stderr:
        return f"a traceback was printed:\n{stderr}"
    if code == 1 and not stderr.strip():
        return "exit code 1 without a message"
    bad = unlocated(stderr) if code == 1 else []
    if bad:
        return "errors without a file:line:col inside the file:\n" + "\n".join(bad) + f"\nstderr:\n{stderr}"
    return None


def fuzz(cases, tmp_path: Path, run) -> list[str]:
    """Run each case as a file named like its source; the failures, described so they can be replayed."""
    failures = []
    for case, name in cases:
        path = tmp_path / name
        path.write_text(case.text, newline="")
        why = problem(*run(path))
        if why:
            failures.append(f"{case.describe()}\n{why}")
    return failures


def _report(failures: list[str], total: int) -> str:
    shown = "\n\n".join(failures[:3])
    return f"{len(failures)} of {total} fuzz cases failed (first {min(3, len(failures))} shown):\n\n{shown}"


# -- the tests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", PROGRAMS, ids=lambda p: str(p.relative_to(ROOT / "programs")))
def test_fuzz_program(tmp_path, source):
    cases = [(mutate(source, seed), source.name) for seed in range(PROGRAM_CASES)]
    failures = fuzz(cases, tmp_path, run_check)
    assert not failures, _report(failures, len(cases))


@pytest.mark.parametrize("source", RULES, ids=lambda p: p.name)
def test_fuzz_rules_front_end(tmp_path, source):
    cases = [(mutate(source, seed, window), source.name) for seed in range(RULES_CASES)]
    failures = fuzz(cases, tmp_path, load_front_end)
    assert not failures, _report(failures, len(cases))


@pytest.mark.parametrize("source", RULES, ids=lambda p: p.name)
def test_fuzz_rules_check(tmp_path, source):
    """The whole `check` of a mutated rule, so that a rule that still parses meets the numeric test too."""
    cases = [(mutate(source, seed, one_rule), source.name) for seed in range(RULES_CLI_CASES)]
    failures = fuzz(cases, tmp_path, lambda p: run_check(p, "--no-default-rules"))
    assert not failures, _report(failures, len(cases))


# -- what the fuzzing found, kept as named cases ----------------------------------------------------------

HUGE = "9" * 5000  # Python refuses to convert an integer of 4,300 digits or more: it was a traceback
ZEROS = "0" * 5000
KERNEL = (ROOT / "programs" / "fused" / "rmsnorm_linear.prism").read_text()


@pytest.mark.parametrize("name, text, literal", [
    ("t.prism", f"dims n = {HUGE}\n", HUGE),
    ("t.prism", f"dims n = 8\nprogram p(X: f16[n, {HUGE}]) {{\n    return X\n}}\n", HUGE),
    ("t.prism", KERNEL.replace("grid(x = gx)", f"grid(x = {HUGE})"), HUGE),
    ("t.prism", KERNEL.replace("loop(F)", f"loop({HUGE})"), HUGE),
    ("t.rules", f"ruleset r {{\n    rule x: exp(a) => exp(a) if size(a, -{HUGE}) == 1\n}}\n", f"-{HUGE}"),
    ("t.rules", f"ruleset r {{\n    rule x: exp(a) => exp(a) if size(a, -1) == {HUGE}\n}}\n", HUGE),
    ("t.prism", "dims n = 9223372036854775808\n", "9223372036854775808"),
    ("t.prism", f"dims n = 8\nprogram p(X: f16[n]) {{\n    return X\n}}\ndims m = {HUGE}\n", HUGE),
], ids=["dims", "shape", "grid", "loop", "rule-dim", "rule-size", "2^63", "after-a-program"])
def test_integer_beyond_any_size_is_a_located_error(tmp_path, name, text, literal):
    path = tmp_path / name
    path.write_text(text)
    code, stderr, escaped = run_check(path, "--no-default-rules") if name.endswith(".rules") else run_check(path)
    assert problem(code, stderr, escaped) is None and code == 1, stderr or escaped
    before = text[: text.index(literal)].split("\n")
    where = f"{path}:{len(before)}:{len(before[-1]) + 1}: integer "
    assert where in stderr and "is too large (at most 2^63 - 1)" in stderr, stderr
    assert len(stderr) < 1000, "a 5,000-digit number is shown by its ends, not whole"


@pytest.mark.parametrize("text", [
    f"dims n = {ZEROS}7\n",
    f"dims n = 8\nprogram p(X: f16[n, {ZEROS}3]) {{\n    return X\n}}\n",
    f"dims n = 8\nprogram p(X: f16[n]) {{\n    Y = sum(X, -{ZEROS}1) * {ZEROS}2.5\n    return Y\n}}\n",
], ids=["dims", "shape", "reduction-dim"])
def test_leading_zeros_do_not_count_as_digits(tmp_path, text):
    """5,000 zeros before a small number: the value is small, and converting the text whole was a traceback."""
    path = tmp_path / "t.prism"
    path.write_text(text)
    code, stderr, escaped = run_check(path)
    assert code == 0 and problem(code, stderr, escaped) is None, stderr or escaped


def test_digits_of_other_scripts_are_not_numbers(tmp_path):
    """The grammar's digits are 0-9: Python's `\\d` also takes U+0663 and float() reads it as 3."""
    path = tmp_path / "t.prism"
    path.write_text("dims n = 8\nprogram p(X: f16[n]) {\n    Y = X * \u0663\n    return Y\n}\n")
    code, stderr, _ = run_check(path)
    assert code == 1 and f"{path}:3:13: syntax error: unexpected character '\u0663'" in stderr, stderr


def test_control_characters_are_shown_as_symbols(tmp_path):
    """A stray ESC or NUL in the line shown under an error would move the terminal's cursor. (A CR ends a line.)"""
    path = tmp_path / "t.prism"
    path.write_text("dims n = 8\nprogram p(X: f16[n]) {\n    Y = expp(X)  # \x1b[31m red\x00\x07\n    return Y\n}\n", newline="")
    code, stderr, _ = run_check(path)
    assert code == 1 and f"{path}:3:9: unknown function 'expp'" in stderr, stderr
    shown = stderr.split("\n")[1:3]
    assert shown == ["        Y = expp(X)  # \u241b[31m red\u2400\u2407", "            ^"], shown


def test_a_rule_after_its_ruleset_is_told_where_rules_live(tmp_path):
    """After a complete item, a line that cannot start one is the mistake: not a malformed item above."""
    path = tmp_path / "t.rules"
    path.write_text("ruleset r {\n    rule a: exp(x) => exp(x)\n}\n    rule b: exp(x) => exp(x)\n")
    code, stderr, _ = run_check(path, "--no-default-rules")
    assert code == 1 and f"{path}:4:5: syntax error: unexpected 'rule': rules live inside 'ruleset NAME {{ ... }}'" in stderr, stderr
