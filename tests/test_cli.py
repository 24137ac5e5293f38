"""`prismc check` and `prismc run`, driven in-process through `main(argv)`, and once as a real process;
the flags every command shares, and what `prismc compile` reports.

Exit codes: 0 success, 1 an error in the user's input, 2 a command-line usage error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from prism_dsl.backend import emulate
from prism_dsl.lang.check import load
from prism_dsl.cli.main import main
from prism_dsl.semantics.blocks import evaluate

REPO = Path(__file__).resolve().parent.parent
PROGRAMS = REPO / "programs"
RMSNORM = str(PROGRAMS / "rmsnorm_linear.prism")
ATTENTION = str(PROGRAMS / "attention.prism")
LORA_PAIR = str(PROGRAMS / "proofs" / "lora_merged.prism")


def prismc(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def outputs(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def leftovers(directory: Path) -> list[str]:
    """Files a failed run must not leave: the output itself or a temporary file beside it."""
    return sorted(p.name for p in directory.iterdir() if "out" in p.name)


# -- check ---------------------------------------------------------------------------------------------------


def test_check_prints_one_summary_line_per_file(capsys):
    files = [RMSNORM, ATTENTION, LORA_PAIR]
    code, out, err = prismc(capsys, "check", *files)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert len(lines) == 3
    assert lines[0].endswith(": ok: program rmsnorm_linear (2 inputs, 1 output, 2 ops, dims n=8, d=4096)")
    assert "program attention (3 inputs, 1 output" in lines[1]
    assert "program lora (" in lines[2] and "program lora_merged (" in lines[2]


def test_check_every_program_file(capsys):
    files = sorted(PROGRAMS.glob("**/*.prism"))
    code, out, _ = prismc(capsys, "check", *files)
    assert code == 0 and out.count(": ok: ") == len(files)


def test_check_bad_file(capsys, tmp_path):
    bad = tmp_path / "bad.prism"
    bad.write_text("dims n = 4\nprogram p(X: f16[n]) {\n    Y = expp(X) @ Z\n    return Y\n}\n")
    code, out, err = prismc(capsys, "check", bad)
    assert code == 1 and out == ""
    assert "bad.prism:3:9: unknown function 'expp'" in err
    assert "bad.prism:3:19: undefined name 'Z'" in err
    assert "    Y = expp(X) @ Z\n" in err and "2 errors" in err


def test_check_good_and_bad_file(capsys, tmp_path):
    bad = tmp_path / "bad.prism"
    bad.write_text("program p(X: f16[n]) { return X }\n")
    code, _, err = prismc(capsys, "check", RMSNORM, bad)
    assert code == 1 and "undeclared dim 'n'" in err


def test_check_refuses_rule_files_given_together_that_name_a_rule_twice(capsys, tmp_path):
    """As `prove --rules a.rules --rules b.rules` would: each file alone is sound, together they clash."""
    for name in ("a", "b"):
        (tmp_path / f"{name}.rules").write_text(f"ruleset {name} {{\n    rule add_self: x + x => 2 * x\n}}\n")
    code, out, err = prismc(capsys, "check", tmp_path / "a.rules", tmp_path / "b.rules")
    assert code == 1 and "a.rules: ok: 1 rule" in out
    assert "b.rules:2:10: duplicate rule name 'add_self'" in err and "also defined at " in err and "a.rules:2:10" in err
    (tmp_path / "p.prism").write_text("dims n = 4\nprogram a(X: f32[n]) {\n    Y = X + X\n    return Y\n}\n"
                                      "program b(X: f32[n]) {\n    Y = 2 * X\n    return Y\n}\n")
    code, _, err = prismc(capsys, "prove", tmp_path / "p.prism", "--rules", tmp_path / "a.rules", "--rules",
                          tmp_path / "b.rules")
    assert code == 1 and "duplicate rule name 'add_self'" in err


@pytest.mark.parametrize("target, message", [("nope.prism", "no such file"), (".", "it is a directory")])
def test_check_unreadable(capsys, tmp_path, target, message):
    code, _, err = prismc(capsys, "check", tmp_path / target)
    assert code == 1 and message in err


def test_check_not_utf8(capsys, tmp_path):
    bad = tmp_path / "bin.prism"
    bad.write_bytes(b"dims n = 4\n\xfe\xff\n")
    code, _, err = prismc(capsys, "check", bad)
    assert code == 1 and "bin.prism:2:1: file is not valid UTF-8 text" in err


# -- run -----------------------------------------------------------------------------------------------------


def test_run_with_inputs_matches_reference(capsys, tmp_path):
    rng = np.random.default_rng(0)
    given = {"X": rng.standard_normal((3, 5)).astype(np.float16), "W": rng.standard_normal((5, 5)).astype(np.float16)}
    np.savez(tmp_path / "in.npz", **given)
    code, out, _ = prismc(capsys, "run", RMSNORM, "--inputs", tmp_path / "in.npz", "--out", tmp_path / "out.npz")
    assert code == 0
    assert "rmsnorm_linear: Y[3, 5]" in out and "dims n=3, d=5" in out  # the dims come from the arrays
    result = outputs(tmp_path / "out.npz")
    assert list(result) == ["Y"] and result["Y"].dtype == np.float64
    expected = evaluate(load(RMSNORM).program(), given)["Y"]
    np.testing.assert_array_equal(result["Y"], expected)
    x, w = (given[k].astype(np.float64) for k in "XW")
    np.testing.assert_allclose(result["Y"], (x / np.sqrt((x * x).mean(-1, keepdims=True))) @ w, rtol=1e-12)


def test_run_rounds_given_inputs_to_their_storage_types(capsys, tmp_path):
    """X and W are f16: float64 values given for them are what a GPU would store, rounded to f16."""
    rng = np.random.default_rng(1)
    given = {"X": rng.standard_normal((3, 5)), "W": rng.standard_normal((5, 5)) + 1e-7}
    np.savez(tmp_path / "in.npz", **given)
    assert prismc(capsys, "run", RMSNORM, "--inputs", tmp_path / "in.npz", "--out", tmp_path / "out.npz")[0] == 0
    stored = {k: v.astype(np.float16).astype(np.float64) for k, v in given.items()}
    np.testing.assert_array_equal(outputs(tmp_path / "out.npz")["Y"], evaluate(load(RMSNORM).program(), stored)["Y"])


def test_run_random_inputs_follow_the_seed(capsys, tmp_path):
    runs = {}
    for name, seed in [("a", 7), ("b", 7), ("c", 8)]:
        out = tmp_path / f"{name}.npz"
        code, text, _ = prismc(capsys, "run", ATTENTION, "--dims", "b=1,kv=32", "--seed", seed, "--out", out)
        assert code == 0 and "O[1, 8, 1, 128]" in text and "kv=32" in text
        runs[name] = outputs(out)["O"]
    assert np.array_equal(runs["a"], runs["b"])
    assert not np.allclose(runs["a"], runs["c"])


def test_run_save_inputs_reproduces_outputs(capsys, tmp_path):
    code, _, _ = prismc(capsys, "run", ATTENTION, "--dims", "b=1,h=2,kv=8,dh=4", "--seed", 3,
                        "--out", tmp_path / "out.npz", "--save-inputs", tmp_path / "in.npz")
    assert code == 0
    inputs = outputs(tmp_path / "in.npz")
    assert list(inputs) == ["Q", "K", "V"] and inputs["K"].shape == (1, 2, 4, 8)
    expected = evaluate(load(ATTENTION).program(), inputs)["O"]
    np.testing.assert_allclose(outputs(tmp_path / "out.npz")["O"], expected, rtol=1e-12)


def test_run_writes_tensors_named_as_numpy_savez_names_its_own_arguments(capsys, tmp_path):
    """An input `file` and an output `allow_pickle` are a program's names like any other."""
    path = tmp_path / "names.prism"
    path.write_text("dims n = 4, d = 8\n\nprogram names(file: f32[n, d]) {\n    allow_pickle = file * 2\n"
                    "    return allow_pickle\n}\n")
    out, given = tmp_path / "out.npz", tmp_path / "in.npz"
    assert prismc(capsys, "run", path, "--out", out, "--save-inputs", given)[0] == 0
    inputs = outputs(given)
    assert list(inputs) == ["file"] and np.array_equal(outputs(out)["allow_pickle"], 2 * inputs["file"])


def test_run_and_show_refuse_to_write_over_what_they_read_or_twice_to_one_file(capsys, tmp_path):
    program = tmp_path / "p.prism"
    program.write_text(Path(RMSNORM).read_text())
    same = ("--out", tmp_path / "a.npz", "--save-inputs", tmp_path / "." / "a.npz")
    for argv, message in [(("run", program, *same), "--out and --save-inputs name the same file"),
                          (("run", program, "--out", program), "(--out): it is the program's file"),
                          (("show", program, "-o", program), "(-o): it is the program's file")]:
        code, _, err = prismc(capsys, *argv)
        assert code == 1 and message in err, err
    assert program.read_text() == Path(RMSNORM).read_text() and not (tmp_path / "a.npz").exists()
    (tmp_path / "lib.prism").write_text("def sq(x) = x * x\n")
    (tmp_path / "uses.prism").write_text('import "lib.prism"\ndims n = 4\nprogram u(X: f32[n]) {\n    Y = sq(X)\n'
                                         "    return Y\n}\n")
    code, _, err = prismc(capsys, "show", tmp_path / "uses.prism", "-o", tmp_path / "lib.prism")
    assert code == 1 and "(-o): it is a file it imports (lib.prism)" in err
    assert prismc(capsys, "run", program, "--dims", "n=2,d=4", "--out", os.devnull, "--save-inputs", os.devnull)[0] == 0


def test_run_program_selection(capsys, tmp_path):
    code, _, err = prismc(capsys, "run", LORA_PAIR, "--dims", "d=4,m=4", "--out", tmp_path / "out.npz")
    assert code == 1 and "defines several programs (lora, lora_merged); choose one with --program" in err
    assert leftovers(tmp_path) == []
    code, out, _ = prismc(capsys, "run", LORA_PAIR, "--program", "lora_merged", "--dims", "d=4,m=4",
                          "--out", tmp_path / "out.npz")
    assert code == 0 and out.startswith("lora_merged: Y[16, 4]")
    code, _, err = prismc(capsys, "run", LORA_PAIR, "--program", "lora_merge", "--out", tmp_path / "out2.npz")
    assert code == 1 and "no program 'lora_merge'; did you mean 'lora_merged'?" in err


def test_run_file_without_programs(capsys, tmp_path):
    (tmp_path / "lib.prism").write_text("dims n = 4\ndef sq(x) = x * x\n")
    code, _, err = prismc(capsys, "run", tmp_path / "lib.prism", "--out", tmp_path / "out.npz")
    assert code == 1 and "defines no program" in err


@pytest.mark.parametrize("dims, code, message", [
    ("foo=3", 1, "program 'attention' has no dim 'foo' (its dims: b, h, q, kv, dh)"),
    ("b=0", 2, "argument --dims: 'b' must be at least 1, got 0"),  # whatever the program: a usage error
    ("b=-2", 2, "argument --dims: 'b' must be at least 1, got -2"),
    ("b=x", 2, "expected NAME=INT[,NAME=INT...], got 'b=x'"),
    ("b=1.5", 2, "expected NAME=INT"),
    ("b", 2, "expected NAME=INT"),
    ("b=1,b=2", 2, "dim 'b' is given twice"),
])
def test_run_bad_dims(capsys, tmp_path, dims, code, message):
    got, _, err = prismc(capsys, "run", ATTENTION, "--dims", dims, "--out", tmp_path / "out.npz")
    assert got == code and message in err
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("command, path, line, col", [
    ("run", PROGRAMS / "causal_attention.prism", 8, 9),
    ("compile", PROGRAMS / "causal_attention.prism", 8, 9),
    ("compile", PROGRAMS / "fused" / "causal_attention.prism", 19, 13),  # the kernel's mask, in the whole scores
])
def test_a_causal_mask_over_more_rows_than_columns_is_refused_at_its_call(capsys, tmp_path, command, path, line, col):
    """The query rows are the last of the key positions: with q > kv the first q - kv rows would have every
    column masked (their softmax has no value), so such dims are an error where `causal` is written."""
    where = ["--out", tmp_path / "out.npz"] if command == "run" else ["-o", tmp_path / "out", "--search", "none"]
    code, _, err = prismc(capsys, command, path, "--dims", "b=1,h=1,q=100,kv=64,dh=64", *where)
    assert code == 1 and f"causal_attention.prism:{line}:{col}: causal needs at least as many columns as rows" in err
    assert "the scores are 100 x 64, so their first 36 rows would have every column masked" in err
    assert leftovers(tmp_path) == []
    # as many rows as columns, or fewer, is the mask of a cache
    code, _, err = prismc(capsys, "run", path, "--dims", "b=1,h=1,q=64,kv=64,dh=64", "--out", tmp_path / "out.npz")
    assert code == 0, err


def test_a_kernels_mask_over_a_reduced_tile_is_judged_by_its_sizes_not_skipped(capsys, tmp_path):
    """causal(sum(xt, -1)) is n x 1 whatever the kernel's parameters, which name only its rows' piece: `check`
    refuses it as it refuses causal(sum(X, -1)) (it skipped every mask whose shape names a parameter)."""
    path = tmp_path / "reduced.prism"
    path.write_text("dims n = 8, d = 16\nprogram r(X: f16[n, d]) {\n    kernel k grid(x = gx) {\n"
                    "        xt = load X[x, :]\n        store Y[x, :] = causal(sum(xt, -1))\n    }\n    return Y\n}\n")
    code, _, err = prismc(capsys, "check", path)
    assert code == 1 and "reduced.prism:5:25: causal needs at least as many columns as rows" in err
    assert "the scores are 8 x 1, so their first 7 rows would have every column masked" in err


def test_check_finds_a_causal_mask_over_more_rows_than_columns_at_the_declared_dims(capsys, tmp_path):
    path = tmp_path / "wide.prism"
    path.write_text("dims q = 8, kv = 4\nprogram p(X: f32[q, kv]) {\n    A = causal(X)\n    return A\n}\n")
    code, _, err = prismc(capsys, "check", path)
    assert code == 1 and "wide.prism:3:9: causal needs at least as many columns as rows" in err
    path.write_text(path.read_text().replace("q = 8", "q = 4"))
    assert prismc(capsys, "check", path)[0] == 0


def test_run_input_missing_from_npz(capsys, tmp_path):
    np.savez(tmp_path / "in.npz", X=np.zeros((3, 5)))
    code, _, err = prismc(capsys, "run", RMSNORM, "--inputs", tmp_path / "in.npz", "--out", tmp_path / "out.npz")
    assert code == 1 and "lack 'W' (it has: X)" in err
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("arrays, message", [
    ({"X": np.ones((3, 5)), "W": np.ones((4, 4))}, "input 'W' should have shape [5, 5] ([d, d]), got [4, 4]"),
    ({"X": np.ones((3, 5, 1)), "W": np.ones((5, 5))}, "input 'X' should have 2 dims [n, d], got shape [3, 5, 1]"),
    ({"X": np.ones((3, 5), np.int32), "W": np.ones((5, 5))}, "input 'X' should hold floats, got int32"),
    # a value past f16's range, which the GPU would read as inf: said where, with no numpy warning
    ({"X": np.ones((3, 5)), "W": np.where(np.eye(5) > 0, 7e4, 1.0)},
     "input 'W'[0, 0] = 70000 does not fit f16 (largest 65504; 5 value(s) past it)"),
])
@pytest.mark.filterwarnings("error::RuntimeWarning")  # numpy's overflow warning is no message for a user
def test_run_bad_input_arrays(capsys, tmp_path, arrays, message):
    np.savez(tmp_path / "in.npz", **arrays)
    code, _, err = prismc(capsys, "run", RMSNORM, "--inputs", tmp_path / "in.npz", "--out", tmp_path / "out.npz")
    assert code == 1 and message in err
    assert leftovers(tmp_path) == []


def test_run_inputs_disagreeing_with_dims(capsys, tmp_path):
    np.savez(tmp_path / "in.npz", X=np.ones((3, 5)), W=np.ones((5, 5)))
    code, _, err = prismc(capsys, "run", RMSNORM, "--inputs", tmp_path / "in.npz", "--dims", "n=4",
                          "--out", tmp_path / "out.npz")
    assert code == 1 and "input 'X' should have shape [4, 5] ([n, d]), got [3, 5]" in err


@pytest.mark.parametrize("make, message", [
    (lambda p: None, "no such file"),
    (lambda p: p.mkdir(), "it is a directory"),
    (lambda p: p.write_text("not an archive"), "not a .npz archive"),
    (lambda p: np.savez(p, X=np.array([1, "a", None], dtype=object), W=np.ones((2, 3))), "arrays of Python objects"),
    (lambda p: np.savez(p, X=np.array([["a", "b"]]), W=np.ones((2, 3))), "'X' must hold numbers"),
])
def test_run_unreadable_inputs(capsys, tmp_path, make, message):
    make(tmp_path / "in.npz")
    code, _, err = prismc(capsys, "run", RMSNORM, "--inputs", tmp_path / "in.npz", "--out", tmp_path / "out.npz")
    assert code == 1 and message in err
    assert leftovers(tmp_path) == []


def test_run_refuses_empty_inputs(capsys, tmp_path):
    np.savez(tmp_path / "in.npz", X=np.zeros((0, 3)), W=np.zeros((3, 3)))
    code, _, err = prismc(capsys, "run", RMSNORM, "--inputs", tmp_path / "in.npz", "--out", tmp_path / "out.npz")
    assert code == 1 and "input 'X' has shape [0, 3]: dim n must be at least 1" in err


def test_run_out_of_memory_is_a_clear_error(capsys, tmp_path):
    code, _, err = prismc(capsys, "run", RMSNORM, "--dims", "n=99999999999", "--out", tmp_path / "out.npz")
    assert code == 1 and "dims d = 4096, n = 99999999999 are too large: input 'X' would have" in err
    assert leftovers(tmp_path) == []


def test_run_output_has_the_usual_file_mode(capsys, tmp_path):
    mask = os.umask(0o022)
    try:
        code, _, _ = prismc(capsys, "run", RMSNORM, "--dims", "n=2,d=3", "--out", tmp_path / "out.npz")
    finally:
        os.umask(mask)
    assert code == 0 and (tmp_path / "out.npz").stat().st_mode & 0o777 == 0o644


def test_main_leaves_the_recursion_limit_as_it_found_it(capsys):
    before = sys.getrecursionlimit()
    prismc(capsys, "check", RMSNORM)
    assert sys.getrecursionlimit() == before


def test_run_bad_program_leaves_no_output(capsys, tmp_path):
    bad = tmp_path / "bad.prism"
    bad.write_text("dims n = 4\nprogram p(X: f16[n]) {\n    Y = X @ X\n    return Y\n}\n")
    code, _, err = prismc(capsys, "run", bad, "--out", tmp_path / "out.npz")
    assert code == 1 and "bad.prism:3:9: matmul: operands need rank 2 or more" in err
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("target, message", [("missing/out.npz", "does not exist"), (".", "it is a directory")])
def test_run_unwritable_output(capsys, tmp_path, target, message):
    code, _, err = prismc(capsys, "run", RMSNORM, "--dims", "n=2,d=3", "--out", tmp_path / target)
    assert code == 1 and message in err


def test_run_failing_save_inputs_leaves_no_output(capsys, tmp_path):
    code, _, err = prismc(capsys, "run", RMSNORM, "--dims", "n=2,d=3", "--out", tmp_path / "out.npz",
                          "--save-inputs", tmp_path / "missing" / "in.npz")
    assert code == 1 and "does not exist" in err
    assert leftovers(tmp_path) == []


# -- usage errors --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    ([], "required: COMMAND"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["compile", RMSNORM, "-o", "out", "--jobs", "x"], "(see 'prismc compile --help')"),
    (["compile", RMSNORM, "-o", "out", "--grid", "x=4", "--grid", "x=8"], "argument --grid: 'x' given twice"),
    (["run", RMSNORM, "--out", "x.npz", "--loop", "4", "--loop", "8"], "every kernel's loop range given twice"),
    (["check"], "required: FILE"),
    (["run", RMSNORM], "required: --out"),
    (["run", RMSNORM, "--out", "x.npz", "--seed", "x"], "expected a non-negative integer, got 'x'\n(see 'prismc run --help')"),
    (["run", RMSNORM, "--out", "x.npz", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["run", RMSNORM, "--out", "x.npz", "--inputs", "in.npz", "--seed", "3"], "not allowed with argument --inputs"),
    (["run", RMSNORM, "--out", "x.npz", "--seed", "-5"], "expected a non-negative integer, got '-5'"),
    (["prove", RMSNORM, RMSNORM, "--timeout", "1e12"], "at most 1e+06"),
    (["prove", RMSNORM, RMSNORM, "--nodes", "\u0663"], "expected a positive integer"),
])
def test_usage_errors(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)  # nothing may be written to the working directory either
    code, out, err = prismc(capsys, *argv)
    assert code == 2 and message in err and out == ""
    assert list(tmp_path.iterdir()) == []


def test_help(capsys):
    code, out, _ = prismc(capsys, "--help")
    assert code == 0 and "check" in out and "run" in out


# -- as a real process ---------------------------------------------------------------------------------------


def test_subprocess_check():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "prism_dsl", "check", "programs/rmsnorm_linear.prism"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("programs/rmsnorm_linear.prism: ok: program rmsnorm_linear")
    assert proc.stderr == ""


def test_subprocess_user_error_exit_code(tmp_path):
    bad = tmp_path / "bad.prism"
    bad.write_text("program p(X: f16[n]) { return X }\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "prism_dsl", "check", str(bad)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "bad.prism:1:18: undeclared dim 'n'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see what the process has loaded")
@pytest.mark.parametrize("when", ["loading", "working"])
def test_subprocess_interrupted_while_loading_or_running(when, tmp_path):
    """Ctrl-C while prismc's modules load (once NumPy's library is mapped: SymPy and the rest take most of a second
    more) or while it works (judging the layout axioms in an empty cache: seconds): said, exit 130."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PRISM_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", "prism_dsl", "check", "rules/layout.rules"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # (a job run with `&`
    # from a script, the suite among them, starts with Ctrl-C ignored, and so would prismc)
    maps, deadline = Path(f"/proc/{proc.pid}/maps"), time.monotonic() + 60
    while "_multiarray_umath" not in maps.read_text() and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(0 if when == "loading" else 1.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.strip() == "prismc: interrupted", err


def test_interrupt_inside_code_that_c_called_is_an_interruption(capsys, monkeypatch):
    """A Ctrl-C in a __hash__ that a C function called (SymPy's, while np.matmul multiplies symbols) reaches
    Python as a SystemError caused by the KeyboardInterrupt: said as an interruption; other SystemErrors are not."""
    import prism_dsl.cli.main as cli

    def interrupted_in_c(args):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise SystemError("<function Basic.__hash__> returned a result with an exception set") from e

    monkeypatch.setattr(cli, "cmd_check", interrupted_in_c)
    code, _, err = prismc(capsys, "check", "programs/attention.prism")
    assert code == 130 and err.strip() == "prismc: interrupted"

    def broken(args):
        raise SystemError("something else")

    monkeypatch.setattr(cli, "cmd_check", broken)
    with pytest.raises(SystemError, match="something else"):
        prismc(capsys, "check", "programs/attention.prism")


# -- one flag for the hardware; renamed flags --------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["compile", RMSNORM, "-o", "out", "--target", "cuda"],
     "--target is no longer an option: use --rank model|measure to choose how programs are ranked, "
     "--hardware NAME for the hardware"),
    (["compile", RMSNORM, "-o", "out", "--target"], "--target is no longer an option"),
    (["run", RMSNORM, "--out", "x.npz", "--target", "h100"], "--target is no longer an option: use --hardware NAME"),
    (["show", RMSNORM, "--target", "a100"], "--target is no longer an option: use --hardware NAME"),
    (["compile", RMSNORM, "-o", "out", "--rank", "cuda"], "argument --rank: invalid choice: 'cuda'"),
])
def test_renamed_flags_are_refused_with_what_to_use(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    code, out, err = prismc(capsys, *argv)
    assert code == 2 and message in err and out == ""
    assert list(tmp_path.iterdir()) == []


def test_hardware_is_one_flag_on_every_command(capsys, tmp_path):
    assert "--target" not in prismc(capsys, "compile", "--help")[1]
    code, out, _ = prismc(capsys, "show", PROGRAMS / "fused" / "rmsnorm_linear.prism", "--dims", "n=4,d=256",
                          "--hardware", "a100")
    assert code == 0 and "hardware A100" in out and "on A100" in out
    assert prismc(capsys, "run", RMSNORM, "--dims", "n=2,d=8", "--hardware", "a100", "--out", tmp_path / "y.npz")[0] == 0
    code, out, _ = prismc(capsys, "compile", RMSNORM, "--search", "none", "--arch", "none", "--no-emulate",
                          "--dims", "n=2,d=8", "--hardware", "a100", "-o", tmp_path / "out", "--json")
    report = json.loads(out)
    assert code == 0 and report["hardware"]["name"] == "A100" and report["rank"] == "model"
    code, _, err = prismc(capsys, "run", RMSNORM, "--hardware", "b200", "--out", tmp_path / "z.npz")
    assert code == 2 and "unknown hardware 'b200'" in err


# -- compile's report: typed, written once; proved, checked, verified ----------------------------------------


def test_compile_report_is_a_frozen_dataclass_written_once(tmp_path, monkeypatch):
    from prism_dsl.kernels.hardware import load_hardware
    from prism_dsl.pipeline import compile as pipeline
    from prism_dsl.pipeline.build import BuildOptions

    writes = []
    monkeypatch.setattr(pipeline, "write", lambda out, texts: writes.append((out, dict(texts))))
    request = pipeline.Request(load(RMSNORM).program(), tmp_path / "out", load_hardware("h100"),
                               BuildOptions(dims={"n": 2, "d": 8}, archs=(), emulate=False), search=None)
    report = pipeline.compile_program(request)
    assert dataclasses.is_dataclass(report) and isinstance(report, pipeline.Report)
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.proved = False
    ((out, texts),) = writes  # one write, every file at once, report.json among them
    assert out == tmp_path / "out" and list(texts)[-1] == "report.json"
    assert texts["report.json"] == report.to_json() and json.loads(report.to_json())["files"] == list(texts)


def compile_report(capsys, tmp_path, *extra) -> tuple[int, dict, str]:
    out = tmp_path / "out"
    code, text, err = prismc(capsys, "compile", PROGRAMS / "fused" / "rmsnorm_linear.prism", "--search", "none",
                             "--arch", "none", "--dims", "n=4,d=256", "-o", out, *extra)
    return code, json.loads((out / "report.json").read_text()), text


def test_compiled_as_written_unchecked_is_proved_not_verified(capsys, tmp_path):
    code, report, text = compile_report(capsys, tmp_path, "--no-emulate")
    assert code == 0 and report["proved"] is True
    assert report["checked"] == {"emulation": None, "gpu": None} and report["verified"] is False
    assert "verified: NO: the outputs were not checked" in text
    assert not {"target", "checks"} & report.keys() and report["nvcc"] is None


@pytest.mark.skipif(not emulate.compiler(), reason="no C++ compiler (g++ or clang++) to emulate the generated code")
def test_compiled_as_written_and_checked_is_verified(capsys, tmp_path):
    code, report, text = compile_report(capsys, tmp_path)
    emulation = report["checked"]["emulation"]
    assert code == 0 and report["proved"] is True and emulation["passed"] and report["verified"] is True
    assert emulation["rtol"] == 0.01 and emulation["checked_against"] == "input program"
    assert all(o["max_rel_err"] <= 0.01 for o in emulation["outputs"].values())
    assert "verified: yes" in text


@pytest.mark.skipif(not emulate.compiler(), reason="no C++ compiler (g++ or clang++) to emulate the generated code")
def test_a_program_undefined_on_the_random_inputs_says_so(capsys, tmp_path):
    """sqrt of inputs drawn around 0: the float64 reference is NaN, so nothing can agree with it; the summary
    says why, not only that the outputs did not agree."""
    source = tmp_path / "sq.prism"
    source.write_text("dims n = 2, d = 16\nprogram sq(X: f16[n, d], W: f16[d, d]) {\n    Y = sqrt(X) @ W\n"
                      "    return Y\n}\n")
    code, out, _ = prismc(capsys, "compile", source, "-o", tmp_path / "out", "--search", "none", "--arch", "none")
    assert code == 1 and "verified: NO: the outputs did not agree" in out
    assert "(Y: max rel err inf: the reference itself holds NaN (32 of 32 elements, the first at (0, 0))" in out
    code, out, _ = prismc(capsys, "verify", tmp_path / "out")
    assert code == 1 and "NOT VERIFIED with the reference, max rel err inf; the reference itself holds NaN" in out


@pytest.mark.parametrize("params, body, message", [
    ("X: f32[n, d]", "    Y = X + 1\n    return X, Y\n", "output 'X' is input 'X' itself: there is nothing to compute"),
    ("s: f32[], X: f32[n, d]", "    Y = X * s\n    return Y\n",
     "input 's' has no dims, which kernels cannot load; declare it f32[1], which broadcasts the same way"),
    ("X: f32[n, d]", "    Y = X + 1\n    Z = Y\n    return Y, Z\n",
     "output 'Z' is the value of output 'Y', which its kernel stores once; return each value once"),
    ("X: f32[2, 1, 3, 1, n, d], W: f32[d, 4]", "    Y = softmax(X @ W)\n    return Y\n",
     "'X' has rank 6; the kernels take tensors of rank 5 at most (`prismc run` evaluates it)"),
    ("X: f32[n, d]", "    Y = rms_norm(X, 1e-50)\n    return Y\n",
     "the constant 1e-50 is 0 in the kernels' f32 arithmetic, which holds magnitudes from 1.4e-45 to 3.4e38"),
    ("X: f16[n, d]", "    Y = X * 1e39\n    return Y\n", "the constant 1e+39 is infinite in the kernels' f32 arithmetic"),
], ids=["input-returned", "no-dims", "returned-twice", "rank-6-input", "eps-under-f32", "past-f32"])
def test_compile_refuses_what_no_kernel_takes_where_the_program_is_declared_before_any_search(
        params, body, message, capsys, tmp_path, monkeypatch):
    """`prismc run` evaluates such a program; the kernels cannot take it (an output no kernel computes, an input
    of rank 0 whose tile no map addresses, a value returned under two names). Said at once, with the program's place, before the search (which
    used to run first: then a traceback from the code generator, or a hang where its forked rankers were
    stopped)."""
    from prism_dsl.pipeline import compile as driver
    path = tmp_path / "p.prism"
    path.write_text(f"dims n = 8, d = 16\nprogram p({params}) {{\n{body}}}\n")
    monkeypatch.setattr(driver, "search", lambda *a: pytest.fail("searched"))
    assert main(["compile", str(path), "-o", str(tmp_path / "out"), "--arch", "none"]) == 1
    err = capsys.readouterr().err
    col = 9 if "output" in message else 11 if "input" in message or "rank" in message else 9
    assert f"p.prism:{3 if 'constant' in message else 2}:{col}: program 'p': {message}" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
    assert main(["run", str(path), "--out", str(tmp_path / "y.npz")]) == 0  # a program all the same


def test_a_constant_f32_cannot_hold_in_a_kernel_written_by_hand_is_said_where_it_is_written(capsys, tmp_path):
    """The kernel's body is checked as the program's ops are: `xt * 1e-50` used to be rendered `1e-50f` (0), and
    the emulation then blamed the kernels' roundings."""
    path = tmp_path / "p.prism"
    path.write_text("dims n = 64, d = 128\nprogram p(X: f16[n, d]) {\n    kernel k grid(x = gx) loop(F) {\n"
                    "        xt = load X[x, loop]\n        s = acc_sum_last(xt * 1e-50)\n"
                    "        store Y[x, :] = s\n    }\n    return Y\n}\n")
    assert main(["compile", str(path), "-o", str(tmp_path / "out"), "--arch", "none"]) == 1
    err = capsys.readouterr().err
    assert "p.prism:5:26: program 'p': the constant 1e-50 is 0 in the kernels' f32 arithmetic" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
    path.write_text(path.read_text().replace("1e-50", "1e-30"))
    assert main(["compile", str(path), "-o", str(tmp_path / "out"), "--arch", "none", "--no-emulate"]) == 0


def test_a_grid_size_written_in_the_program_that_does_not_divide_its_dim_is_said_at_the_load(capsys, tmp_path):
    """`prismc check` cannot know (`--dims` may rebind n to a multiple of 3); compile says where the tile is."""
    path = tmp_path / "p.prism"
    path.write_text("dims n = 8, d = 64\nprogram p(X: f32[n, d]) {\n    kernel k grid(x = 3) {\n"
                    "        xt = load X[x, :]\n        store Y[x, :] = xt\n    }\n    return Y\n}\n")
    assert main(["check", str(path)]) == 0
    assert main(["compile", str(path), "-o", str(tmp_path / "out"), "--arch", "none"]) == 1
    err = capsys.readouterr().err
    assert ("p.prism:4:9: the kernel parameters are not valid: kernel 'k': tile 'xt' splits dim 0 of size n by grid "
            "axis x (3): n/3 = 8/3 is not a whole number") in err and "Traceback" not in err
    assert main(["compile", str(path), "-o", str(tmp_path / "out"), "--arch", "none", "--dims", "n=9"]) == 0


@pytest.mark.skipif(not emulate.compiler(), reason="no C++ compiler (g++ or clang++) to emulate the generated code")
def test_report_json_is_standard_json_when_an_error_is_infinite(capsys, tmp_path):
    """sqrt of negative inputs: the reference is NaN there, the error infinite. JSON has no Infinity or NaN: the
    report says "inf" (a strict parser, as in a browser, reads it)."""
    path = tmp_path / "p.prism"
    path.write_text("dims n = 4, d = 64\nprogram p(X: f16[n, d], W: f16[d, d]) {\n    Y = sqrt(X) @ W\n    return Y\n}\n")
    assert main(["compile", str(path), "-o", str(tmp_path / "out"), "--arch", "none", "--search", "none",
                 "--json"]) == 1
    text = capsys.readouterr().out
    assert text == (tmp_path / "out" / "report.json").read_text()

    def refuse(constant):
        raise ValueError(f"not standard JSON: {constant}")

    report = json.loads(text, parse_constant=refuse)
    assert report["checked"]["emulation"]["outputs"]["Y"]["max_rel_err"] == "inf"


def test_an_output_place_that_cannot_be_written_is_said_before_any_work(capsys, tmp_path, monkeypatch):
    """A read-only file system (or a directory without write permission): refused at once, not after the search."""
    import errno

    from prism_dsl.pipeline import compile as driver
    from prism_dsl.pipeline import output

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(output.tempfile, "mkdtemp", read_only)
    monkeypatch.setattr(driver, "search", lambda *a: pytest.fail("searched"))
    assert main(["compile", RMSNORM, "-o", str(tmp_path / "ro" / "out"), "--arch", "none"]) == 1
    err = capsys.readouterr().err
    assert f"cannot write to '{tmp_path / 'ro' / 'out'}'" in err and "read-only" in err.lower()
    assert "Traceback" not in err and not (tmp_path / "ro").exists()


def test_jobs_are_at_most_the_machines_cores():
    """Each prover process holds about half a gigabyte: --jobs 1000 on a small machine is its cores."""
    from prism_dsl.cli.main import build_parser
    from prism_dsl.base.forked import cores

    args = build_parser().parse_args(["compile", RMSNORM, "-o", "out", "--jobs", "1000"])
    assert args.jobs == cores()
    assert build_parser().parse_args(["compile", RMSNORM, "-o", "out", "--jobs", "1"]).jobs == 1


def test_a_program_named_best_keeps_its_compiled_form_beside_the_search_choice(capsys, tmp_path):
    path = tmp_path / "best.prism"
    path.write_text((PROGRAMS / "swiglu.prism").read_text().replace("program swiglu", "program best"))
    out = tmp_path / "out"
    assert main(["compile", str(path), "-o", str(out), "--arch", "none", "--dims", "n=4,d=64", "--no-emulate"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["best"] == "best_found.prism" and {"best.prism", "best_found.prism"} <= set(report["files"])
    assert "kernel " in (out / "best.prism").read_text()  # the program compiled, its kernels written out


def test_show_to_dash_writes_to_stdout(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = prismc(capsys, "show", PROGRAMS / "fused" / "rmsnorm_linear.prism", "--dims", "n=4,d=256",
                          "-o", "-")
    assert code == 0 and out.startswith("program rmsnorm_linear") and not (tmp_path / "-").exists()


def test_repeated_size_flags_are_merged():
    """`--grid x=4 --grid z=2` is `--grid x=4,z=2`: a repeated flag kept only its last value."""
    from prism_dsl.cli.main import build_parser

    args = build_parser().parse_args(["compile", RMSNORM, "-o", "out", "--grid", "x=4", "--grid", "gz=2",
                                      "--dims", "n=3", "--dims", "d=5", "--loop", "F=2", "--loop", "G=4"])
    assert args.grid == {"x": 4, "gz": 2} and args.dims == {"n": 3, "d": 5} and args.loop == {"F": 2, "G": 4}
    assert build_parser().parse_args(["compile", RMSNORM, "-o", "out"]).grid == {}


@pytest.mark.skipif(not hasattr(__import__("signal"), "SIGHUP"), reason="SIGHUP is POSIX's")
def test_sigterm_and_sighup_end_a_command_in_order():
    """`timeout`'s SIGTERM and a closed terminal's SIGHUP end a command as an exception does (the workers
    stopped, the scratch removed), with the shell's status for the signal; not as the default kill, which
    leaves them."""
    import signal
    import time

    from prism_dsl.cli import main as cli

    replaced = cli._exit_on_signals()
    try:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            with pytest.raises(SystemExit) as e:
                os.kill(os.getpid(), signum)
                time.sleep(5)  # the handler runs here, in the main thread
            assert e.value.code == 128 + signum
    finally:
        for signum, handler in replaced.items():
            signal.signal(signum, handler)


def test_compile_with_stdout_closed_writes_its_directory_and_exits_0(tmp_path, monkeypatch):
    """`prismc compile ... >&-` (a cron job, a daemon): the summary went to `sys.stdout.write` on None, an
    AttributeError after every file was written."""
    monkeypatch.setattr(sys, "stdout", None)
    assert main(["compile", str(REPO / "programs/fused/rmsnorm_linear.prism"), "--search", "none", "--dims",
                 "n=8,d=256", "--arch", "none", "--no-emulate", "-o", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "report.json").is_file()


def test_a_file_system_refusal_with_no_file_named_says_what_it_was(capsys, tmp_path, monkeypatch):
    """`ulimit -f`, a full stdout: the OSError names no file, and the message was 'prismc: cannot use: File too
    large'. Where prismc's own directory was removed under it, that is said too."""
    import errno

    from prism_dsl.cli import main as cli

    def refuse(*args):
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(cli, "build_parser", lambda: _parser_running(refuse))
    assert main(["rules"]) == 1
    assert capsys.readouterr().err == "prismc: a file system call failed: File too large\n"
    monkeypatch.setattr(os, "getcwd", lambda: refuse())
    assert main(["rules"]) == 1
    assert capsys.readouterr().err == ("prismc: a file system call failed: File too large (the current directory "
                                       "was removed)\n")


def _parser_running(command):
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("name")
    parser.set_defaults(run=command)
    return parser


def test_a_compiled_directorys_programs_declare_the_sizes_compiled_for(capsys, tmp_path):
    """best.prism and the copy of the program kept the source file's dims (n = 8, d = 4096) after `--dims
    n=16,d=64`, so `prismc run DIR/best.prism` ran another problem than the one compiled."""
    out = tmp_path / "out"
    assert main(["compile", str(REPO / "programs/rmsnorm_linear.prism"), "--dims", "n=16,d=64", "--arch", "none",
                 "--no-emulate", "--time-limit", "20", "-o", str(out)]) == 0
    for name in ("best.prism", "rmsnorm_linear.prism"):
        assert (out / name).read_text().startswith("dims n = 16, d = 64\n"), name
    capsys.readouterr()
    assert main(["run", str(out / "best.prism"), "--out", str(tmp_path / "y.npz")]) == 0
    assert "Y[16, 64]" in capsys.readouterr().out
    assert main(["verify", str(out)]) == 0


def test_prismc_says_its_version(capsys):
    from prism_dsl import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"prismc {__version__}\n"


def test_every_field_of_a_report_is_described_in_its_reference(tmp_path, capsys):
    """docs/report-json.md names every key report.json has (a searched compile, its kernels, their estimates and
    nvcc figures, the emulation's check): a user reading a report finds each field there."""
    import re

    assert main(["compile", str(REPO / "programs" / "swiglu.prism"), "--dims", "n=4,d=64", "-o", str(tmp_path / "o"),
                 "--arch", "sm_90", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    named = {part for name in re.findall(r"`([a-z0-9_.]+)`", (REPO / "docs" / "report-json.md").read_text())
             for part in name.split(".")}
    (kernel,) = report["kernels"]
    output = next(iter(report["checked"]["emulation"]["outputs"].values()))
    keys = {*report, *report["search"], *report["roofline"], *report["codegen"], *report["nvcc"], *kernel,
            *kernel["estimate"], *kernel["nvcc"]["sm_90"], *kernel["nvcc"]["sm_90"]["issued"],
            *report["checked"]["emulation"], *output, *report["checked"]["emulation"]["emulation"],
            *report["search"]["input_egraph"], *report["alternatives"][0]}
    assert not keys - named - {"sm_90"}, sorted(keys - named)
