"""The user cache is never trusted: a checkpoint's programs are proved again before they are emitted or
timed, the final numeric check compares with the input program, and tuning or measured entries that are
not valid at these dims (or not times) are reported once, ignored and computed again.

Each test is the attack: a cache entry edited (or damaged) so that it still reads."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from prism_dsl.base import cache

from prism_dsl.backend import emulate

from prism_dsl.pipeline import optimize as superopt
from prism_dsl.pipeline.build import BuildOptions, build, check_emulated
from prism_dsl.lang.check import load
from prism_dsl.cli.main import main
from prism_dsl.kernels.hardware import load_hardware
from prism_dsl.lang.printer import print_program
from prism_dsl.semantics.reference import bind_dims
from prism_dsl.prove.rules import load_library
from prism_dsl.search.config import SearchConfig
from prism_dsl.prove.soundness import check_library
from prism_dsl.backend.launch import CodegenConfig
from prism_dsl.pipeline.measuring import Measurement
from prism_dsl.pipeline.optimize import optimize, rank, tuning_key
from prism_dsl.search.checkpoint import checkpoint_key, load_checkpoint

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "programs" / "rmsnorm_linear.prism"
H100 = load_hardware("h100")
SMALL = dict(n=4, d=64)  # the dims of the saved search
OTHER = dict(n=8, d=128)
EMULATION = emulate.compiler() is not None


@pytest.fixture(scope="module")
def library():
    return load_library([], defaults=True)


@pytest.fixture(scope="module")
def source():
    return load(SOURCE).program()


@pytest.fixture(scope="module")
def saved_search(tmp_path_factory, library, source):
    """A cache directory holding a complete search of rmsnorm_linear (checkpoint and tuning entries), and
    the verdicts of the default rules' soundness check (made once in the session's cache)."""
    root = tmp_path_factory.mktemp("saved")
    old = os.environ.get("PRISM_CACHE_DIR")
    if old:
        check_library(library)
        for entry in Path(old).iterdir():
            if entry.is_dir() and entry.name not in ("search", "tuning", "measured"):
                shutil.copytree(entry, root / entry.name)
    os.environ["PRISM_CACHE_DIR"] = str(root)
    try:
        optimize(source, library, H100, bind_dims(source, SMALL))
    finally:
        os.environ["PRISM_CACHE_DIR"] = old if old is not None else ""
        if old is None:
            del os.environ["PRISM_CACHE_DIR"]
    return root


@pytest.fixture
def cache_dir(saved_search, tmp_path, monkeypatch):
    """This test's own copy of the saved search, as the user cache."""
    here = tmp_path / "cache"
    shutil.copytree(saved_search, here)
    monkeypatch.setenv("PRISM_CACHE_DIR", str(here))
    return here


def checkpoint_file(cache_dir: Path) -> Path:
    (path,) = (cache_dir / "search").glob("*.json")
    return path


def edit_checkpoint(cache_dir: Path, edit) -> Path:
    path = checkpoint_file(cache_dir)
    record = json.loads(path.read_text())
    record["value"]["programs"] = [edit(t) for t in record["value"]["programs"]]
    path.write_text(json.dumps(record))
    return path


def doubled(text: str) -> str:
    """The same program with its output doubled: it still parses and checks, and computes something else."""
    return re.sub(r"(store Y\[[^\]]*\] \+?= )(.*)", r"\g<1>2.0 * (\2)", text)


def edit_entries(cache_dir: Path, kind: str, edit) -> int:
    files = sorted((cache_dir / kind).glob("*.json"))
    for i, path in enumerate(files):
        record = json.loads(path.read_text())
        record["value"] = edit(i, record["value"])
        path.write_text(json.dumps(record))
    return len(files)


def compile_json(capsys, out: Path, dims: dict, *extra: str) -> tuple[int, dict, str]:
    code = main(["compile", str(SOURCE), "-o", str(out), "--dims", ",".join(f"{k}={v}" for k, v in dims.items()),
                 "--arch", "none", "--json", *extra])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if captured.out else {}, captured.err


# -- the checkpoint ------------------------------------------------------------------------------------


def test_edited_checkpoint_program_is_proved_again_and_replaced(cache_dir, capsys, tmp_path):
    path = edit_checkpoint(cache_dir, doubled)
    assert "2.0 * (" in path.read_text()
    code, report, err = compile_json(capsys, tmp_path / "out", OTHER)
    assert code == 0
    assert err.count("failed its proof; searching again") == 1 and str(path) in err
    assert report["proved"] is True and not report["search"]["from_checkpoint"]
    assert "2.0 *" not in (tmp_path / "out" / "best.prism").read_text()
    if EMULATION:
        emulation = report["checked"]["emulation"]
        assert report["verified"] and emulation["passed"] and emulation["checked_against"] == "input program"
    # The search's result replaced the entry: the next compile takes it, proves its choice, says nothing.
    assert "2.0 *" not in path.read_text()
    code, again, err = compile_json(capsys, tmp_path / "again", SMALL, "--no-emulate")
    assert code == 0 and err == "" and again["search"]["from_checkpoint"] and again["proved"] is True


def test_a_checkpoints_programs_are_not_said_to_be_proved_by_this_run(cache_dir, capsys, tmp_path):
    """The summary says where the count comes from: the run that saved the checkpoint proved them; this one
    proved its choice again (a program appended to the entry by hand is never counted as proved here)."""
    code = main(["compile", str(SOURCE), "-o", str(tmp_path / "out"), "--dims", "n=8,d=128", "--arch", "none",
                 "--no-emulate"])
    out = capsys.readouterr().out
    assert code == 0 and "programs from the checkpoint (proved when it was saved; the chosen one again now)" in out
    assert "proved programs (from the checkpoint)" not in out


def test_checkpoint_choice_is_proved_in_this_run(cache_dir, library, source):
    out = optimize(source, library, H100, bind_dims(source, OTHER))
    assert out.from_checkpoint and out.best.proved
    assert out.search["reproved"] == (0 if out.best.as_written else 1)
    # The others were not proved again: nothing says they were.
    assert sum(r.proved and not r.as_written for r in out.ranked) == out.search["reproved"]


def test_false_proof_is_caught_by_the_check_against_the_input(cache_dir, capsys, tmp_path, monkeypatch):
    """Should a proof ever be wrong, the numeric check still compares with the program the user gave: the wrong
    programs it built fail it, and what is written is one that passed (the program as written, where every
    program of the checkpoint was edited), with the failures in the summary and report.json."""
    if not EMULATION:
        pytest.skip("no C++ compiler (g++ or clang++) to emulate the generated code")

    def trusting(ranked, prover):
        for r in ranked:
            r.proved = True
        return None

    monkeypatch.setattr(superopt, "confirm", trusting)
    edit_checkpoint(cache_dir, doubled)
    code, report, _ = compile_json(capsys, tmp_path / "out", OTHER)
    failed = report["search"]["failed_check"]  # the edited programs were built, checked and caught...
    assert failed and failed[0]["rank"] == 1 and "its check failed: Y: max rel err" in failed[0]["why"]
    assert "2.0 *" not in (tmp_path / "out" / "best.prism").read_text()  # ...and none of them written
    emulation = report["checked"]["emulation"]
    assert code == 0 and emulation["passed"] and report["verified"] and report["best_is_input"]
    assert emulation["checked_against"] == "input program"


def test_a_checkpoints_fallback_is_proved_before_it_is_built(cache_dir, capsys, tmp_path, monkeypatch):
    """Where the checkpoint's choice fails its check, the next programs it holds are proved in this run before one
    is built, as the choice was: edited ones fail their proof and are passed over, never built nor written."""
    if not EMULATION:
        pytest.skip("no C++ compiler (g++ or clang++) to emulate the generated code")
    from prism_dsl.pipeline import compile as pipeline
    from test_codegen import planted_failure

    code, first, _ = compile_json(capsys, tmp_path / "first", OTHER, "--no-emulate")
    chosen = first["alternatives"][0]["program"]
    assert code == 0 and not first["best_is_input"]
    edit_checkpoint(cache_dir, lambda text: text if text == chosen else doubled(text))
    real, built = pipeline.emulate, []

    def emulate(b, options):  # the choice fails its check
        built.append(b.source)
        check = real(b, options)
        return check if len(built) > 1 else planted_failure(check)

    monkeypatch.setattr(pipeline, "emulate", emulate)
    code, report, err = compile_json(capsys, tmp_path / "out", OTHER)
    first_failed, *others = report["search"]["failed_check"]
    assert first_failed["rank"] == 1 and "its check failed" in first_failed["why"]
    assert others and all(f["why"] == "it failed its proof" for f in others)
    # the entry is removed, as where its choice fails its proof: no later run meets it again
    assert err.count("failed its proof; removed") == 1 and "program 2 failed its proof; removed" in err
    assert not list((cache_dir / "search").glob("*.json"))
    assert len(built) == 2 and report["best_is_input"] and report["verified"]  # the choice, then as written
    assert "2.0 *" not in (tmp_path / "out" / "best.prism").read_text()


def test_a_choice_not_proved_in_this_run_is_not_verified(cache_dir, capsys, tmp_path, monkeypatch):
    """`proved` means a proof ran: a checkpoint's program used without its proof again is reported as not
    proved, and so not verified, however well its numbers agree (`checked`)."""
    if not EMULATION:
        pytest.skip("no C++ compiler (g++ or clang++) to emulate the generated code")
    monkeypatch.setattr(superopt, "confirm", lambda ranked, prover: None)  # no proof runs
    code, report, _ = compile_json(capsys, tmp_path / "out", OTHER)
    assert report["search"]["from_checkpoint"] and not report["best_is_input"]
    assert report["proved"] is False and report["alternatives"][0]["proved"] is None
    assert report["checked"]["emulation"]["passed"] and report["verified"] is False and code == 0


def test_build_checks_against_the_reference_program(source):
    """`build(..., reference=input)`: the outputs are compared with the input, paired by position
    when the names differ; a program with other inputs cannot stand in for it."""
    if not EMULATION:
        pytest.skip("no C++ compiler (g++ or clang++) to emulate the generated code")
    text = "dims n = 4, d = 64\nprogram rmsnorm_linear(X: f16[n, d], W: f16[d, d]) {\n    Z = {}\n    return Z\n}\n"
    same = load("<same>", text.replace("{}", "rms_norm(X) @ W")).program()
    other = load("<other>", text.replace("{}", "rms_norm(X) @ W * 2.0")).program()
    options = BuildOptions(dims=SMALL, archs=())
    assert check_emulated(build(same, H100, options, reference=source), 0).passed
    assert not check_emulated(build(other, H100, options, reference=source), 0).passed
    assert check_emulated(build(other, H100, options), 0).passed  # against itself: --search none
    stranger = load("<x>", text.replace("X: f16[n, d]", "A: f16[n, d]").replace("rms_norm(X)", "rms_norm(A)")
                    .replace("{}", "rms_norm(A) @ W")).program()
    with pytest.raises(Exception, match="reads inputs"):
        build(stranger, H100, options, reference=source)


DEEP = 100_000
BAD_CHECKPOINTS = {
    "programs not a list": {"programs": "program rmsnorm_linear", "stats": {}},
    "a program not a text": {"programs": [1], "stats": {}},
    "stats not a record": {"programs": [], "stats": [1, 2]},
    "a count not a number": {"programs": [], "stats": {"generated": "many", "candidates": 1, "maps": 1,
                                                       "proofs": 1, "proved": 1, "pruned": {}, "seconds": 1.0}},
    "a count that is a bool": {"programs": [], "stats": {"generated": True, "candidates": 1, "maps": 1,
                                                        "proofs": 1, "proved": 1, "pruned": {}, "seconds": 1.0}},
    "seconds NaN": {"programs": [], "stats": {"generated": 1, "candidates": 1, "maps": 1, "proofs": 1,
                                             "proved": 1, "pruned": {}, "seconds": math.nan}},
    "seconds a bool": {"programs": [], "stats": {"generated": 1, "candidates": 1, "maps": 1, "proofs": 1,
                                                "proved": 1, "pruned": {}, "seconds": False}},
    "not a record": ["programs"],
    "an import": {"programs": ['import "/dev/zero"\n']},
    "two programs": {"programs": ["program a(X: f16[n, d]) {\n return X\n}\n"
                                 "program b(X: f16[n, d]) {\n return X\n}\n"]},
    "another program's signature": {"programs": ["program rmsnorm_linear(X: f16[n, d]) {\n    return X\n}\n"]},
    "another name": {"programs": ["program other(X: f16[n, d], W: f16[d, d]) {\n    Y = X @ W\n    return Y\n}\n"]},
    "another output": {"programs": ["program rmsnorm_linear(X: f16[n, d], W: f16[d, d]) {\n    Z = X @ W\n"
                                    "    return Z\n}\n"]},
    "nested expression": {"programs": ["program rmsnorm_linear(X: f16[n, d], W: f16[d, d]) {\n    Y = "
                                       + "exp(" * 5000 + "X" + ")" * 5000 + " @ W\n    return Y\n}\n"]},
}
GOOD_STATS = {"generated": 1, "candidates": 1, "maps": 1, "proofs": 1, "proved": 1, "pruned": {"numeric": 2},
              "seconds": 0.5}


@pytest.mark.parametrize("name", [*BAD_CHECKPOINTS, "nested too deeply"])
def test_checkpoint_of_the_wrong_form_is_reported_once_and_ignored(name, library, source, tmp_path, monkeypatch,
                                                                   capsys, default_recursion_limit):
    monkeypatch.setenv("PRISM_CACHE_DIR", str(tmp_path))
    key = checkpoint_key(source, library, SearchConfig(), H100)
    if name == "nested too deeply":
        path = cache.path_for("search", key)
        path.parent.mkdir(parents=True)
        path.write_text(f'{{"key": "{key}", "value": ' + "[" * DEEP + "]" * DEEP + "}")
    else:
        value = BAD_CHECKPOINTS[name]
        value = {"stats": GOOD_STATS, **value} if isinstance(value, dict) and "stats" not in value else value
        path = cache.path_for("search", key)  # written as a damaged file would be: NaN included
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"key": key, "value": value}))
    assert load_checkpoint(source, key) is None
    assert load_checkpoint(source, key) is None
    err = capsys.readouterr().err
    assert err.count("ignoring cache entry") == 1 and str(cache.path_for("search", key)) in err


def test_checkpoint_figures_cannot_change_what_the_report_says(library, source, tmp_path, monkeypatch):
    """Extra keys in the saved figures are dropped: they cannot overwrite the report's own fields."""
    monkeypatch.setenv("PRISM_CACHE_DIR", str(tmp_path))
    key = checkpoint_key(source, library, SearchConfig(), H100)
    cache.write("search", key, {"programs": [], "stats": {**GOOD_STATS, "from_checkpoint": False, "jobs": "all"}})
    programs, stats = load_checkpoint(source, key)
    assert programs == [] and stats == GOOD_STATS


def test_a_checkpoint_is_not_reused_where_the_search_would_prune_otherwise(library, source):
    """The search fits the smallest tiles at the dims the file declares in the hardware's shared memory per block:
    either changed, the entry is another; a binding given at compile time (`--dims`) is not part of it."""
    key = checkpoint_key(source, library, SearchConfig(), H100)
    assert key == checkpoint_key(source, library, SearchConfig(), load_hardware("h200"))  # the same 227 KiB
    assert key != checkpoint_key(source, library, SearchConfig(), load_hardware("a100"))
    wider = replace(source, dims=tuple(replace(d, default=2 * d.default) for d in source.dims))
    assert key != checkpoint_key(wider, library, SearchConfig(), H100)


# -- the tuning database -------------------------------------------------------------------------------


def test_tuning_entry_that_breaks_the_kernel_constraints_is_ignored(cache_dir, capsys, tmp_path):
    """gx = 3 divides nothing here: every later compile used to fail until the cache was deleted."""
    def three(i, value):
        return {**value, "params": {n: 3 for n in value["params"]}} if value["params"] else value

    edit_entries(cache_dir, "tuning", three)
    code, report, err = compile_json(capsys, tmp_path / "out", SMALL, "--no-emulate")
    assert code == 0 and report["proved"] is True and "not a valid tuning entry" in err
    assert "break the constraints" in err
    assert len(set(re.findall(r"ignoring cache entry (\S+):", err))) == err.count("ignoring cache entry")
    # Tuned again and overwritten: the next compile is quiet.
    code, _, err = compile_json(capsys, tmp_path / "again", SMALL, "--no-emulate")
    assert code == 0 and err == ""


FUSED = """dims n = 4, d = 64
program rmsnorm_linear(X: f16[n, d], W: f16[d, d]) {
    kernel fused grid(x = gx, y = gy) {
        xt = load X[y, :]
        wt = load W[:, x]
        store Y[y, x] = rms_norm(xt) @ wt
    }
    return Y
}
"""


@pytest.mark.parametrize("params", [
    {"gx": 3, "gy": 1}, {"gx": "2", "gy": 1}, {"gx": 2.0, "gy": 1}, {"gx": True, "gy": 1}, {"gx": 0, "gy": 1},
    {"gx": -2, "gy": 1}, {"gx": 2}, {"gx": 2, "gy": 1, "F": 2}, {"gx": 2, "gy": 1, "nope": 1}, {"gx": 10**400, "gy": 1},
    [2, 1], None])
def test_tuning_parameters_are_checked_against_the_kernels(params, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PRISM_CACHE_DIR", str(tmp_path))
    program = load("<fused>", FUSED).program()
    binding = bind_dims(program, SMALL)
    key = tuning_key(program, binding, H100)
    cache.write("tuning", key, {"params": params, "us": 1.0, "busy": 1})
    r = rank(program, binding, H100, CodegenConfig())
    assert r is not None and set(r.params) == {"gx", "gy"} and all(type(v) is int for v in r.params.values())
    assert 64 % r.params["gx"] == 0 and 4 % r.params["gy"] == 0
    assert "not a valid tuning entry" in capsys.readouterr().err
    stored = cache.read("tuning", key)["params"]  # overwritten
    assert stored == r.params and all(type(v) is int for v in stored.values())
    assert rank(program, binding, H100, CodegenConfig()).params == r.params
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("threads", [64, 512, 256.0, "256", True, -256, [256]])
def test_a_tuning_entry_whose_threads_are_not_the_two_counts_tried_is_tuned_again(threads, tmp_path, monkeypatch,
                                                                                  capsys):
    """The threads a program was tuned at are `--threads` (null) or twice that (`optimize.rank`): anything else
    in an entry is reported once and tuned again, never built."""
    monkeypatch.setenv("PRISM_CACHE_DIR", str(tmp_path))
    program = load("<fused>", FUSED).program()
    binding = bind_dims(program, SMALL)
    clean = rank(program, binding, H100, CodegenConfig())
    key = tuning_key(program, binding, H100)
    cache.write("tuning", key, {**cache.read("tuning", key), "threads": threads})
    r = rank(program, binding, H100, CodegenConfig())
    assert "not a valid tuning entry (the threads" in capsys.readouterr().err
    assert (r.params, r.threads) == (clean.params, clean.threads) and cache.read("tuning", key)["threads"] == clean.threads


@pytest.mark.parametrize("busy", [None, 0, -1, True, 2.0, "4", [1], 133, 10**6])
def test_a_tuning_entry_without_a_count_of_busy_sms_is_tuned_again(busy, tmp_path, monkeypatch, capsys):
    """The SMs a program keeps busy break ties between equal estimates: an entry must say how many."""
    monkeypatch.setenv("PRISM_CACHE_DIR", str(tmp_path))
    program = load("<fused>", FUSED).program()
    binding = bind_dims(program, SMALL)
    clean = rank(program, binding, H100, CodegenConfig())
    key = tuning_key(program, binding, H100)
    cache.write("tuning", key, {"params": clean.params, "us": clean.estimated_us}
                | ({} if busy is None else {"busy": busy}))
    r = rank(program, binding, H100, CodegenConfig())
    assert "not a valid tuning entry (the busy SMs" in capsys.readouterr().err
    assert (r.params, r.estimated_us, r.busy) == (clean.params, clean.estimated_us, clean.busy) and r.busy >= 1
    assert cache.read("tuning", key)["busy"] == clean.busy


def test_tuning_times_that_are_not_times_do_not_change_the_choice(cache_dir, library, source, capsys):
    """NaN, inf, a negative time, zero, a string, a bool: ignored (reported once each) and estimated again.
    The worst program's entry claims 1 us (as `true`), which would make it the choice if it were believed."""
    binding = bind_dims(source, SMALL)
    clean = optimize(source, library, H100, binding)
    worst = tuning_key(clean.ranked[-1].program, binding, H100)[:32]
    bad = [math.nan, math.inf, -math.inf, -1.0, 0, 0.0, "3.5", None, 10**400, [1.0]]
    count = edit_entries(cache_dir, "tuning", lambda i, v: {**v, "us": bad[i % len(bad)]})
    path = cache_dir / "tuning" / f"{worst}.json"
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "value": {"params": clean.ranked[-1].params, "us": True}}))
    capsys.readouterr()
    out = optimize(source, library, H100, binding)
    assert print_program(out.best.program) == print_program(clean.best.program)
    assert [round(r.estimated_us, 6) for r in out.ranked] == [round(r.estimated_us, 6) for r in clean.ranked]
    assert all(math.isfinite(r.estimated_us) and r.estimated_us > 0 for r in out.ranked)
    err = capsys.readouterr().err
    assert err.count("ignoring cache entry") == count and "not a valid tuning entry" in err


def test_measured_times_that_are_not_times_are_timed_again(cache_dir, library, source, capsys):
    binding = bind_dims(source, SMALL)
    calls = []

    def fake_gpu(program, params, codegen):
        calls.append(print_program(program))
        return Measurement(10.0 + len(calls), "checked")

    device = "Fake GPU, sm_90, driver 1"
    clean = optimize(source, library, H100, binding, measure=fake_gpu, device=device)
    timed = len(calls)
    assert timed >= 1 and all(r.proved for r in clean.ranked if r.measured is not None)
    # The slowest measured program claims the best time in every way a damaged entry could.
    bad = [math.nan, True, -1.0, 0, "1", math.inf]
    count = edit_entries(cache_dir, "measured", lambda i, v: {**v, "us": bad[i % len(bad)]})
    assert count == timed
    calls.clear()
    capsys.readouterr()
    out = optimize(source, library, H100, binding, measure=fake_gpu, device=device)
    assert len(calls) == timed and out.search["measured"]["timed"] == timed
    assert all(r.measured_us is None or math.isfinite(r.measured_us) and r.measured_us > 0 for r in out.ranked)
    assert print_program(out.best.program) == calls[0]  # the first timed again is the fastest now
    err = capsys.readouterr().err
    assert err.count("ignoring cache entry") == count and "not a valid measurement" in err
