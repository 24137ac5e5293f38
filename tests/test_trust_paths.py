"""Bad paths and resources: every one is a clear message (exit 1, or 2 for a bad command-line value), never a
traceback, a hang or memory without bound; outputs are replaced whole, and what killed runs leave is
cleaned by the next one.

Each test is the attack: the hostile path, archive, cache entry, import or size."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from prism_dsl.pipeline import output

from prism_dsl.base import cache

from prism_dsl.backend import emulate
from prism_dsl.base import files
from prism_dsl.cli.main import main
from prism_dsl.kernels.params import divisors
from prism_dsl.semantics.reference import MAX_ELEMENTS

ROOT = Path(__file__).resolve().parent.parent
RMSNORM = ROOT / "programs" / "rmsnorm_linear.prism"
FUSED = ROOT / "programs" / "fused" / "rmsnorm_linear.prism"
FAST = ["--search", "none", "--arch", "none", "--no-emulate", "--dims", "n=2,d=8"]
DEEP = 100_000


def prismc(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def dead_pid() -> int:
    """The pid of a process that has exited (its number is not reused this soon)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def sparse(path: Path, size: int) -> None:
    """A file of `size` zero bytes that costs nothing to make."""
    with open(path, "wb") as f:
        f.truncate(size)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def scratch_beside(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if "prismc-" in p.name)


# -- compile -o ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make, message", [
    (lambda p: p.write_text("mine"), "it exists and is not a directory"),
    (lambda p: os.symlink(p.parent / "nowhere", p), "it exists and is not a directory"),
])
def test_compile_output_that_is_not_a_directory(capsys, tmp_path, make, message):
    out = tmp_path / "out"
    make(out)
    code, _, err = prismc(capsys, "compile", RMSNORM, *FAST, "-o", out)
    assert code == 1 and f"cannot write to '{out}': {message}" in err
    assert os.path.islink(out) or out.read_text() == "mine"
    assert scratch_beside(tmp_path) == []


def test_compile_output_dev_null(capsys):
    code, _, err = prismc(capsys, "compile", RMSNORM, *FAST, "-o", "/dev/null")
    assert code == 1 and "cannot write to '/dev/null': it exists and is not a directory" in err
    assert Path("/dev/null").is_char_device()


def test_compile_output_under_a_regular_file(capsys, tmp_path):
    (tmp_path / "somefile").write_text("mine")
    code, _, err = prismc(capsys, "compile", RMSNORM, *FAST, "-o", tmp_path / "somefile" / "out")
    assert code == 1 and f"'{tmp_path / 'somefile'}' is not a directory" in err
    assert (tmp_path / "somefile").read_text() == "mine"


@pytest.mark.parametrize("make, shown", [
    (lambda d: (d / "report.json").mkdir(), "report.json/"),  # a directory where prismc writes a file
    (lambda d: (d / "notes.txt").write_text("mine"), "notes.txt"),  # not an output of prismc at all
])
def test_compile_refuses_a_directory_it_did_not_write(capsys, tmp_path, make, shown):
    out = tmp_path / "out"
    out.mkdir()
    make(out)
    before = sorted(p.name for p in out.iterdir())
    code, _, err = prismc(capsys, "compile", RMSNORM, *FAST, "-o", out)
    assert code == 1 and f"cannot write to '{out}': it holds what prismc did not write ({shown})" in err
    assert sorted(p.name for p in out.iterdir()) == before and scratch_beside(tmp_path) == []


def test_compile_replaces_its_output_whole(capsys, tmp_path):
    """No stale file of an earlier compile remains; a user's file in an output refuses the next compile."""
    out = tmp_path / "out"
    assert prismc(capsys, "compile", FUSED, *FAST, "-o", out)[0] == 0
    assert (out / "rmsnorm_matmul.cu").is_file()
    (out / "__pycache__").mkdir()  # as importing launcher.py makes it
    (out / "__pycache__" / "launcher.cpython-311.pyc").write_bytes(b"")
    assert prismc(capsys, "compile", RMSNORM, *FAST, "-o", out)[0] == 0
    report = json.loads((out / "report.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == sorted(report["files"])
    assert not (out / "rmsnorm_matmul.cu").exists() and scratch_beside(tmp_path) == []
    (out / "mine.txt").write_text("keep me")
    code, _, err = prismc(capsys, "compile", FUSED, *FAST, "-o", out)
    assert code == 1 and "(mine.txt)" in err and (out / "mine.txt").read_text() == "keep me"


def test_compile_refuses_to_replace_the_current_directory(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = prismc(capsys, "compile", RMSNORM, *FAST, "-o", ".")
    assert code == 1 and "cannot write to '.': it holds the current directory" in err
    assert list(tmp_path.iterdir()) == []


def test_compile_through_a_link_keeps_the_link(capsys, tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    assert prismc(capsys, "compile", RMSNORM, *FAST, "-o", tmp_path / "link")[0] == 0
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real" / "report.json").is_file()
    assert prismc(capsys, "compile", FUSED, *FAST, "-o", tmp_path / "link")[0] == 0
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real" / "rmsnorm_matmul.cu").is_file()


def test_compile_into_an_empty_directory(capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert prismc(capsys, "compile", RMSNORM, *FAST, "-o", out)[0] == 0
    assert (out / "report.json").is_file()


def test_compile_of_an_older_prismc_output_is_replaced(capsys, tmp_path):
    """An output whose report.json lists no files (an older prismc): its own names may be replaced."""
    out = tmp_path / "out"
    assert prismc(capsys, "compile", FUSED, *FAST, "-o", out)[0] == 0
    report = json.loads((out / "report.json").read_text())
    del report["files"]
    (out / "report.json").write_text(json.dumps(report))
    assert prismc(capsys, "compile", RMSNORM, *FAST, "-o", out)[0] == 0
    assert not (out / "rmsnorm_matmul.cu").exists()


@pytest.mark.parametrize("keys", [("program", "kernels", "verified"), ("program", "hardware", "kernels", "verified")])
def test_a_folder_with_a_lookalike_report_is_not_replaced(capsys, tmp_path, keys):
    """A user's report.json with a few of prismc's keys (and a files list naming their own files) does not
    make their folder prismc's: every key a report of prismc has, today's or an older prismc's, is needed."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "report.json").write_text(json.dumps({**dict.fromkeys(keys, 1), "files": ["notes.txt"]}))
    code, _, err = prismc(capsys, "compile", RMSNORM, *FAST, "-o", out)
    assert code == 1 and "it holds what prismc did not write" in err and (out / "notes.txt").read_text() == "mine"
    assert "(its report.json, which would say what prismc wrote, is not a report of prismc's: damaged, or " in err


def test_an_output_whose_report_was_cut_short_is_said_as_such(capsys, tmp_path):
    """An earlier compile's output whose report.json was cut short (an editor's crash, a copy stopped) was refused as
    holding what prismc did not write, naming every file prismc had written, and not why."""
    out = tmp_path / "out"
    assert prismc(capsys, "compile", RMSNORM, *FAST, "-o", out)[0] == 0
    (out / "report.json").write_text((out / "report.json").read_text()[:100])
    code, _, err = prismc(capsys, "compile", RMSNORM, *FAST, "-o", out)
    assert code == 1 and "its report.json, which would say what prismc wrote, is not a report of prismc's" in err


def test_failed_compile_leaves_the_earlier_output_untouched(capsys, tmp_path, monkeypatch):
    """The output is checked again just before the swap (a user may have put a file there meanwhile): a
    refusal then, with every file already written into the scratch directory, leaves the old output."""
    out = tmp_path / "out"
    assert prismc(capsys, "compile", FUSED, *FAST, "-o", out)[0] == 0
    before = snapshot(out)
    written = []

    def refuse(path):  # the check before the swap (the first, before any work, passed)
        (scratch,) = scratch_beside(tmp_path)
        written.append(sorted(p.name for p in (tmp_path / scratch).iterdir()))
        raise output.PrismError("the check failed on purpose")

    monkeypatch.setattr(output, "check_output", refuse)
    code, _, err = prismc(capsys, "compile", RMSNORM, *FAST, "-o", out)
    assert code == 1 and "the check failed on purpose" in err
    assert len(written) == 1 and "report.json" in written[0] and "launcher.py" in written[0]
    assert snapshot(out) == before and scratch_beside(tmp_path) == []


@pytest.mark.skipif(emulate.compiler() is None, reason="no C++ compiler (g++ or clang++) for the emulation")
def test_a_compile_whose_check_fails_does_not_replace_a_verified_one(capsys, tmp_path):
    """It writes its files for inspection where nothing verified would be lost (a new directory, or an earlier
    failed compile's), and says so where it leaves a verified output as it was (exit 1 either way)."""
    undefined = tmp_path / "sq.prism"  # NaN in the reference on standard-normal inputs: the check fails
    undefined.write_text("dims n = 2, d = 8\n\nprogram sq(X: f32[n, d]) {\n    Y = sqrt(X)\n    return Y\n}\n")
    checked = ["--search", "none", "--arch", "none", "--dims", "n=2,d=8"]
    out, failed = tmp_path / "out", tmp_path / "failed"
    assert prismc(capsys, "compile", RMSNORM, *checked, "-o", out)[0] == 0
    before = snapshot(out)
    code, text, _ = prismc(capsys, "compile", undefined, "--search", "none", "--arch", "none", "-o", out, "--json")
    assert code == 1 and json.loads(text)["kept"] and json.loads(text)["files"] == []
    code, text, _ = prismc(capsys, "compile", undefined, "--search", "none", "--arch", "none", "-o", out)
    assert code == 1 and f"{out}/ left as it was: it holds an earlier compile that was verified" in text
    assert snapshot(out) == before and scratch_beside(tmp_path) == []
    for _ in range(2):  # into a new directory, then over that failed compile
        code, text, _ = prismc(capsys, "compile", undefined, "--search", "none", "--arch", "none", "-o", failed)
        assert code == 1 and "left as it was" not in text and (failed / "sqrt_Y.cu").is_file()


def test_an_output_another_process_makes_during_the_swap_is_left_as_it_is(tmp_path, monkeypatch):
    """Two compiles into one new directory: the second finds none, something makes it, the second's rename then
    meets it. What it holds was never checked, so it is not replaced: a message, the scratch removed."""
    out = tmp_path / "out"
    swap, looked = output._swap_in, os.path.lexists

    def meanwhile(scratch, target):  # made after the swap looked for it
        monkeypatch.setattr(output.os.path, "lexists", lambda path: Path(path) != target and looked(path))
        target.mkdir()
        (target / "thesis.tex").write_text("mine")
        swap(scratch, target)

    monkeypatch.setattr(output, "_swap_in", meanwhile)
    with pytest.raises(output.PrismError, match="it was made while this compile ran"):
        output.write(out, {"report.json": "{}"})
    assert [p.name for p in out.iterdir()] == ["thesis.tex"] and scratch_beside(tmp_path) == []


def test_a_ctrl_c_during_the_swap_takes_effect_once_the_new_output_is_in_and_the_old_gone(tmp_path, monkeypatch):
    """A Ctrl-C (or SIGTERM) while the old DIR was removed stopped the removal half done: exit 130, the new DIR in
    place and the old one left beside it. It is held until the swap is done, then takes effect."""
    out = tmp_path / "out"
    report = dict.fromkeys(("program", "hardware", "kernels", "checked", "verified"))  # the keys of prismc's own
    output.write(out, {"report.json": json.dumps({**report, "files": ["old.cu"]}), "old.cu": "old"})
    rmtree = shutil.rmtree

    def interrupted(path, *args, **kw):  # the signal arrives as the old copy is removed
        if "-old-" in Path(path).name:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # (delivered here, were it not held)
        rmtree(path, *args, **kw)
    monkeypatch.setattr(output.shutil, "rmtree", interrupted)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # (Python's own, whatever the runner set)
    try:
        with pytest.raises(KeyboardInterrupt):
            output.write(out, {"report.json": json.dumps(report), "new.cu": "new"})
    finally:
        signal.signal(signal.SIGINT, before)
    assert sorted(p.name for p in out.iterdir()) == ["new.cu", "report.json"] and scratch_beside(tmp_path) == []


def test_abandoned_scratch_directories_are_swept(capsys, tmp_path):
    """Killed compiles leave `.DIR.prismc-<pid>-XXXXXXXX`; the next compile beside them removes those of
    processes that are gone, puts back an output set aside mid-swap, and leaves everything else."""
    dead, alive = dead_pid(), os.getpid()
    left = tmp_path / f".out.prismc-{dead}-abcd1234"
    live = tmp_path / f".out.prismc-{alive}-abcd1234"
    aside = tmp_path / f".gone.prismc-{dead}-old-abcd1234"
    unrelated = tmp_path / f".notes.prismc-{dead}-not-ours"
    for d in (left, live, aside, unrelated):
        d.mkdir()
        (d / "report.json").write_text("{}")
    code, _, _ = prismc(capsys, "compile", RMSNORM, *FAST, "-o", tmp_path / "out")
    assert code == 0
    assert not left.exists() and live.exists() and unrelated.exists()
    assert not aside.exists() and (tmp_path / "gone" / "report.json").is_file()


def test_abandoned_temporary_directories_are_swept(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = dead_pid()
    left = tmp_path / f"prism-emulate-prismc-{dead}-abcd1234"
    other = tmp_path / f"prism-emulate-{dead}-abcd1234"  # not a name prismc gives: never touched
    left.mkdir()
    other.mkdir()
    (tmp_path / f"prism-emulate-prismc-{dead}-fileabcd").write_text("a file, not a scratch directory")
    with files.temp_scratch("emulate") as fresh:
        assert fresh.name.startswith(f"prism-emulate-prismc-{os.getpid()}-") and fresh.is_dir()
    assert not fresh.exists() and not left.exists() and other.exists()
    assert (tmp_path / f"prism-emulate-prismc-{dead}-fileabcd").exists()


@pytest.mark.skipif(emulate.compiler() is None, reason="no C++ compiler (g++ or clang++) for the emulation")
def test_a_full_temporary_directory_is_said_with_its_place(tmp_path, monkeypatch, capsys):
    """A write's refusal names no file ("cannot use: no space left on device" said nothing of where): said with the
    temporary directory, and how to give another."""
    from prism_dsl.backend import nvcc

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(nvcc, "write_sources", full)
    monkeypatch.setattr(emulate, "write_sources", full)
    monkeypatch.setattr(files, "run_in", full)
    code, _, err = prismc(capsys, "compile", FUSED, "--search", "none", "--dims", "n=2,d=8", "-o", tmp_path / "out")
    assert code == 1 and f"cannot write in the temporary directory {tmp_path}: no space left on device" in err, err
    assert "Traceback" not in err


def test_a_compiler_keeps_its_temporary_files_in_the_scratch_directory(tmp_path):
    """g++ and nvcc, killed on an interrupt before they remove their temporary files (a megabyte of assembly),
    leave them in the build's scratch directory, which goes, not in the system's temporary directory."""
    done = files.run_in([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"], tmp_path)
    assert done.returncode == 0 and Path(done.stdout.strip()) == tmp_path.resolve()


@pytest.mark.skipif(files.fcntl is None, reason="file locks (flock) are POSIX's")
def test_a_scratch_directory_whose_process_another_pid_namespace_hides_is_kept(tmp_path, monkeypatch):
    """A compile in another container sharing the temporary directory: its pid is none here, but it holds its
    scratch directory's lock, so a compile here leaves the directory alone; once the lock is free, it is swept."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with files.temp_scratch("emulate") as theirs:  # held as the other process would hold it
        hidden = theirs.rename(tmp_path / f"prism-emulate-prismc-{dead_pid()}-abcd1234")
        with files.temp_scratch("emulate"):
            assert hidden.is_dir() and (hidden / ".prismc-lock").is_file()
        hidden.rename(theirs)
    script = ("import sys, time\nfrom prism_dsl.base import files\nwith files.temp_scratch('emulate') as d:\n"
              "    print(d, flush=True)\n    time.sleep(60)\n")
    other = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        held = Path(other.stdout.readline().strip())
        hidden = held.rename(tmp_path / f"prism-emulate-prismc-{dead_pid()}-efgh5678")
        with files.temp_scratch("emulate"):
            assert hidden.is_dir()
    finally:
        other.kill()
        other.wait()
    with files.temp_scratch("emulate"):  # its process gone, the lock with it
        assert not hidden.exists()


# -- run --inputs: hostile archives -----------------------------------------------------------------------


def _archive(path: Path, members: dict[str, bytes], method=zipfile.ZIP_DEFLATED) -> Path:
    with zipfile.ZipFile(path, "w", method) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def _npy(array: np.ndarray) -> bytes:
    import io

    f = io.BytesIO()
    np.save(f, array)
    return f.getvalue()


def _patch(data: bytes, offset_in_header: int, fmt: str, value, *signatures: bytes) -> bytes:
    """`data` with one field of every zip header of the given signatures set to `value`."""
    out = bytearray(data)
    for sig in signatures:
        at = 0
        while (at := out.find(sig, at)) >= 0:
            struct.pack_into(fmt, out, at + offset_in_header[sig], value)
            at += 4
    return bytes(out)


X, W = np.ones((2, 8), np.float16), np.ones((8, 8), np.float16)
LOCAL, CENTRAL = b"PK\x03\x04", b"PK\x01\x02"


def _encrypted(p):
    data = _archive(p, {"X.npy": _npy(X), "W.npy": _npy(W)}).read_bytes()
    p.write_bytes(_patch(data, {LOCAL: 6, CENTRAL: 8}, "<H", 1, LOCAL, CENTRAL))


def _method_97(p):
    data = _archive(p, {"X.npy": _npy(X), "W.npy": _npy(W)}).read_bytes()
    p.write_bytes(_patch(data, {LOCAL: 8, CENTRAL: 10}, "<H", 97, LOCAL, CENTRAL))


def _bad_deflate(p):
    data = bytearray(_archive(p, {"X.npy": _npy(np.random.default_rng(0).standard_normal((2, 8)).astype(np.float16)),
                                  "W.npy": _npy(W)}).read_bytes())
    start = data.find(LOCAL) + 30 + len("X.npy")
    data[start:start + 40] = b"\xff" * 40  # not a deflate stream any more
    p.write_bytes(bytes(data))


def _bad_crc(p):
    data = bytearray(_archive(p, {"X.npy": _npy(X), "W.npy": _npy(W)}, zipfile.ZIP_STORED).read_bytes())
    at = data.find(b"\x00\x3c", data.find(b"X.npy"))  # a float16 1.0 in X's data
    data[at] ^= 1
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("make, message", [
    (_encrypted, "member 'X.npy' is encrypted"),
    (_method_97, "member 'X.npy' uses compression method 97, which cannot be read"),
    (_bad_deflate, "member 'X.npy' is"),
    (_bad_crc, "member 'X.npy' is damaged (Bad CRC-32"),
    (lambda p: _archive(p, {"X.npy": _npy(X)[:-4], "W.npy": _npy(W)}),
     "member 'X.npy' is damaged: its header says [2, 8] float16 (32 bytes of data), but it holds 28"),
    (lambda p: _archive(p, {"X.npy": b"not an array", "W.npy": _npy(W)}), "member 'X.npy' is not a readable NumPy array"),
    (lambda p: _archive(p, {"X.npy": _npy(X), "X": _npy(X), "W.npy": _npy(W)}), "it holds 'X' more than once"),
    (lambda p: _archive(p, {"X.npy": _npy(X.astype("V2")), "W.npy": _npy(W)}), "'X' must hold numbers"),
    (lambda p: p.write_bytes(_archive(p, {"X.npy": _npy(X), "W.npy": _npy(W)}).read_bytes()[:-30]),
     "not a .npz archive"),
    (lambda p: os.mkfifo(p), "it is a FIFO (named pipe), not a regular file"),
    (lambda p: _archive(p, {"X.npy": _npy(X).replace(b"(2, 8)", b"(-2,-8)"), "W.npy": _npy(W)}),
     "member 'X.npy' is not a readable NumPy array (its header's shape is (-2, -8))"),
])
def test_run_refuses_hostile_archives(capsys, tmp_path, make, message):
    path = tmp_path / "in.npz"
    make(path)
    code, _, err = prismc(capsys, "run", RMSNORM, "--inputs", path, "--out", tmp_path / "out.npz")
    assert code == 1 and message in err
    assert not (tmp_path / "out.npz").exists()


def test_run_reads_only_the_members_it_needs(capsys, tmp_path):
    """A damaged member the program never reads does not matter, and is not read."""
    path = tmp_path / "in.npz"
    _archive(path, {"X.npy": _npy(X), "W.npy": _npy(W), "junk.npy": b"\x93NUMPY garbage"})
    assert prismc(capsys, "run", RMSNORM, "--inputs", path, "--out", tmp_path / "out.npz")[0] == 0


def test_run_checks_shapes_before_loading_the_data(capsys, tmp_path, monkeypatch):
    """A 40 KB archive that expands to 32 MiB, of the wrong shape: refused from its header alone."""
    path = tmp_path / "in.npz"
    np.savez_compressed(path, X=np.zeros((2048, 2048)), W=W)
    assert path.stat().st_size < 100_000

    def no_load(*args, **kwargs):
        raise AssertionError("loaded before the shapes were checked")

    monkeypatch.setattr(np.lib.format, "read_array", no_load)
    code, _, err = prismc(capsys, "run", RMSNORM, "--dims", "n=2,d=8", "--inputs", path, "--out", tmp_path / "o.npz")
    assert code == 1 and "input 'X' should have shape [2, 8] ([n, d]), got [2048, 2048]" in err


def test_run_refuses_a_member_beyond_the_reference_from_its_header(capsys, tmp_path, monkeypatch):
    from prism_dsl.cli import npz

    monkeypatch.setattr(npz, "MAX_ELEMENTS", 8)  # X has 16: as a 2^31-element member, without 16 GiB of test data
    path = _archive(tmp_path / "in.npz", {"X.npy": _npy(X), "W.npy": _npy(W)})
    code, _, err = prismc(capsys, "run", RMSNORM, "--inputs", path, "--out", tmp_path / "o.npz")
    assert code == 1 and "'X' has shape [2, 8]; the float64 reference evaluates tensors of at most 8" in err


# -- sizes ---------------------------------------------------------------------------------------------


def test_dim_of_5000_digits_on_the_command_line(capsys, tmp_path):
    code, _, err = prismc(capsys, "run", RMSNORM, "--dims", "n=" + "9" * 5000, "--out", tmp_path / "o.npz")
    assert code == 2 and "n = 9999999999999999...99999999 (5000 characters) is too large: sizes are at most 2^63 - 1" in err


@pytest.mark.parametrize("option", ["--dims", "--grid", "--loop"])
def test_size_beyond_int64_on_the_command_line(capsys, tmp_path, option):
    value = ("F=" if option == "--loop" else "n=" if option == "--dims" else "x=") + str(2**63)
    code, _, err = prismc(capsys, "show", FUSED, option, value)
    assert code == 2 and f"{2**63} is too large: sizes are at most 2^63 - 1" in err


def test_dim_of_5000_digits_in_a_program(capsys, write):
    path = write("dims n = " + "9" * 5000 + "\nprogram p(X: f16[n]) {\n    return X\n}\n")
    code, _, err = prismc(capsys, "check", path)
    assert code == 1 and f"{path}:1:10:" in err and "is too large" in err


def test_run_with_a_dim_too_large_for_the_reference(capsys, tmp_path):
    code, _, err = prismc(capsys, "run", RMSNORM, "--dims", f"n={2**62}", "--out", tmp_path / "o.npz")
    assert code == 1
    assert (f"dims d = 4096, n = {2**62} are too large: input 'X' would have {2**62 * 4096:,} elements; "
            f"the float64 reference evaluates tensors of at most {MAX_ELEMENTS:,} (2^30) elements") in err


def test_run_with_an_intermediate_too_large_for_the_reference(capsys, tmp_path, write):
    """Inputs of 100,000 elements whose sum by broadcasting would have 10^10: refused before any is made."""
    path = write("program p(X: f16[n, 1], Y: f16[1, n]) {\n    Z = X + Y\n    return Z\n}\ndims n = 4\n")
    code, _, err = prismc(capsys, "run", path, "--dims", "n=100000", "--out", tmp_path / "o.npz")
    assert code == 1 and f"{path}:2:9: dim n = 100000 is too large: a tensor of shape [n, n] would have" in err


def test_run_with_a_rank_beyond_numpy(capsys, tmp_path, write):
    path = write("program p(X: f16[" + ", ".join(["1"] * 65) + "]) {\n    return X\n}\n")
    code, _, err = prismc(capsys, "run", path, "--out", tmp_path / "o.npz")
    assert code == 1 and "input 'X' has 65 dims; the float64 reference handles at most 64 (NumPy's limit)" in err


def test_divisors_by_factoring():
    assert divisors(4096) == [2**i for i in range(13)]
    assert divisors(2**32) == [2**i for i in range(33)]
    assert divisors(2**61 - 1) == [1, 2**61 - 1]  # a prime: no loop to 2^61
    many = divisors(897612484786617600)  # 103,680 divisors: a geometric spread of them
    assert len(many) <= 65 and many[0] == 1 and many[-1] == 897612484786617600
    assert all(897612484786617600 % d == 0 for d in many) and many == sorted(set(many))


def test_show_at_a_dim_of_two_to_the_32(capsys):
    code, out, _ = prismc(capsys, "show", FUSED, "--dims", f"d={2**32}")
    assert code == 0 and "Y [n, d] = [8, 4294967296]" in out


# -- sources and imports -------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".prism", ".rules"])
def test_import_of_a_name_with_nul(capsys, write, suffix):
    path = write('import "a\0b' + suffix + '"\n', "t" + suffix)
    code, _, err = prismc(capsys, "check", path)
    assert code == 1 and f"{path}:1:8: cannot import a file whose name contains a NUL character" in err


@pytest.mark.parametrize("suffix", [".prism", ".rules"])
@pytest.mark.parametrize("target, message", [
    ("/dev/zero", "it is a device, not a regular file"),
    ("fifo", "it is a FIFO (named pipe), not a regular file"),
    ("big", "it is larger than 16 MiB (17 MiB)"),
])
def test_import_of_what_is_not_a_source_file(capsys, write, tmp_path, suffix, target, message):
    """`import "/dev/zero"` took 11.7 GB in 30 s; a FIFO hung. Both are refused unread, as is a huge file."""
    if target == "fifo":
        os.mkfifo(tmp_path / target)
    elif target == "big":
        sparse(tmp_path / target, 17 << 20)
    path = write(f'import "{target}"\n', "t" + suffix)
    code, _, err = prismc(capsys, "check", path)
    assert code == 1 and f"{path}:1:8: cannot read import '{tmp_path / target if target != '/dev/zero' else target}'" in err
    assert message in err


# -- the cache -----------------------------------------------------------------------------------------


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("PRISM_CACHE_DIR", str(root))
    return root


KEY = "k" * 64


@pytest.mark.parametrize("name, make", [
    ("nested 100,000 deep", lambda p: p.write_text(f'{{"key": "{KEY}", "value": ' + "[" * DEEP + "]" * DEEP + "}")),
    ("NaN", lambda p: p.write_text(f'{{"key": "{KEY}", "value": NaN}}')),
    ("an infinite number", lambda p: p.write_text(f'{{"key": "{KEY}", "value": 1e400}}')),
    ("an integer of 5000 digits", lambda p: p.write_text(f'{{"key": "{KEY}", "value": {"9" * 5000}}}')),
    ("a list", lambda p: p.write_text(f'["{KEY}", 1]')),
    ("a key of the wrong type", lambda p: p.write_text(f'{{"key": ["{KEY}"], "value": 1}}')),
    ("not UTF-8", lambda p: p.write_bytes(b'{"key": "\xff"}')),
    ("a FIFO", lambda p: os.mkfifo(p)),
    ("a link to /dev/zero", lambda p: os.symlink("/dev/zero", p)),
    ("a directory", lambda p: p.mkdir()),
    ("larger than the limit", lambda p: sparse(p, cache.MAX_RECORD_BYTES + 1)),
])
def test_cache_entry_that_cannot_be_trusted(own_cache, capsys, name, make, default_recursion_limit):
    path = cache.path_for("kind", KEY)
    path.parent.mkdir(parents=True)
    make(path)
    assert cache.read("kind", KEY) is None
    assert cache.read("kind", KEY) is None
    err = capsys.readouterr().err
    assert err.count("prismc: warning: ignoring cache entry") == 1 and str(path) in err


def test_cache_value_of_the_wrong_form(own_cache, capsys):
    cache.write("kind", KEY, {"params": {"gx": "three"}})
    assert cache.read("kind", KEY, valid=lambda v: all(isinstance(x, int) for x in v["params"].values())) is None
    assert cache.read("kind", KEY, valid=lambda v: v["missing"]) is None  # a KeyError is a wrong form too
    err = capsys.readouterr().err
    assert err.count("its fields are not of the expected types") == 1


def test_cache_directory_that_is_a_file_warns_once(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("PRISM_CACHE_DIR", str(tmp_path / "file"))
    for i in range(20):
        assert cache.read("sound", f"{i:064}") is None
        cache.write("sound", f"{i:064}", True)
    err = capsys.readouterr().err
    assert err.count("warning") == 1
    assert f"the cache directory {tmp_path / 'file'} cannot be read" in err


def test_unwritable_cache_directory_warns_once(own_cache, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    for i in range(20):
        cache.write("sound", f"{i:064}", True)
    err = capsys.readouterr().err
    assert err.count("warning") == 1
    assert f"the cache directory {own_cache} cannot be written (permission denied); going on without saving" in err


def test_a_full_disk_under_the_cache_warns_once(own_cache, monkeypatch, capsys):
    """Every entry would fail alike where the disk is full: one warning, then no more tries (it was one a record)."""
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache, "rename_filled", full)
    for i in range(20):
        cache.write("sound", f"{i:064}", True)
    err = capsys.readouterr().err
    assert err.count("warning") == 1
    assert f"the cache directory {own_cache} cannot be written (no space left on device)" in err


def test_a_relative_cache_home_is_ignored(monkeypatch, tmp_path):
    """XDG_CACHE_HOME must be absolute (the XDG spec): a relative one would put the cache in the current directory."""
    monkeypatch.delenv("PRISM_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "relcache")
    assert cache.cache_dir() == tmp_path / ".cache" / "prism-dsl"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "prism-dsl"


@pytest.mark.parametrize("home", [None, "", "rel"], ids=["unset-no-passwd-entry", "empty", "relative"])
def test_without_a_home_prismc_goes_on_without_a_cache(monkeypatch, tmp_path, capsys, home):
    """`docker run --user N` with no HOME and no passwd entry for N: Path.home() raised a RuntimeError, a traceback
    on every command (`--no-cache` too); an empty or relative HOME put the cache at /.cache or in the current
    directory. Now: one warning, nothing read or written, and the command runs."""
    import os

    for name in ("PRISM_CACHE_DIR", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)
    if home is None:
        monkeypatch.setattr(os.path, "expanduser", lambda path: path)  # no passwd entry: '~' stays '~'
    else:
        monkeypatch.setenv("HOME", home)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cache, "_said", {})
    monkeypatch.setattr(cache, "_off", {})
    assert cache.cache_dir() == cache.NOWHERE
    cache.write("kind", KEY, {"a": 1})
    assert cache.read("kind", KEY) is None and list(tmp_path.iterdir()) == []
    assert main(["check", str(ROOT / "rules" / "algebra.rules")]) == 0
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "prismc: warning: no cache directory: HOME is " in err
    assert "going on without a cache" in err and "Traceback" not in err


def test_entries_another_user_owns_are_said_once_per_directory(monkeypatch, tmp_path, capsys):
    """A cache shared with another user (a 1777 directory, or one root wrote into under sudo): each entry of theirs
    is private, and every read and every write gave a warning of its own (150 lines a run)."""
    import errno

    monkeypatch.setenv("PRISM_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setattr(cache, "_said", {})
    monkeypatch.setattr(cache, "_off", {})
    keys = [str(i) * 64 for i in range(5)]
    for key in keys:
        cache.write("kind", key, {"a": 1})

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(cache, "read_regular", denied)
    monkeypatch.setattr(os, "replace", denied)
    for key in keys:
        assert cache.read("kind", key) is None
        cache.write("kind", key, {"a": 2})
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(str(tmp_path / "c" / "kind") in line for line in err), err
    assert "ignoring the cache entries in" in err[0] and "that this user cannot read (permission denied" in err[0]
    assert "not replacing the cache entries in" in err[1]
    assert not [p for p in (tmp_path / "c" / "kind").iterdir() if p.name.startswith(".tmp")]


def test_a_relative_cache_dir_is_ignored_and_a_tilde_is_home(monkeypatch, tmp_path, capsys):
    """PRISM_CACHE_DIR='~/pc' (quoted, so no shell expanded it) is the home's; 'pc' would be wherever prismc runs."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("PRISM_CACHE_DIR", "~/pc")
    assert cache.cache_dir() == tmp_path / "pc"
    monkeypatch.setenv("PRISM_CACHE_DIR", "rel/pc")
    assert cache.cache_dir() == tmp_path / ".cache" / "prism-dsl"
    assert "ignoring PRISM_CACHE_DIR='rel/pc': not an absolute path" in capsys.readouterr().err


def test_compile_refuses_an_output_that_holds_the_cache(capsys, tmp_path, monkeypatch):
    """Said before the search, not after it (the whole directory is replaced, so it would take the cache along)."""
    monkeypatch.setenv("PRISM_CACHE_DIR", str(tmp_path / "out" / "cache"))
    code, _, err = prismc(capsys, "compile", RMSNORM, *FAST, "-o", tmp_path / "out")
    assert code == 1 and f"cannot write to '{tmp_path / 'out'}': it holds prismc's cache" in err
    assert not (tmp_path / "out").exists()
    # inside the cache: refused as early (it used to search, write its checkpoint there, then call it foreign)
    monkeypatch.setenv("PRISM_CACHE_DIR", str(tmp_path / "cache"))
    code, _, err = prismc(capsys, "compile", RMSNORM, *FAST, "-o", tmp_path / "cache" / "search")
    assert code == 1 and f"cannot write to '{tmp_path / 'cache' / 'search'}': it is inside prismc's cache" in err
    assert not (tmp_path / "cache" / "search").exists()


def test_compile_refuses_an_output_it_cannot_write(capsys, tmp_path, monkeypatch):
    """A read-only output directory: refused before any work, rather than replaced with its old files left in a
    copy beside it that could not be removed (one more each compile)."""
    out = tmp_path / "out"
    assert prismc(capsys, "compile", RMSNORM, *FAST, "-o", out)[0] == 0
    out.chmod(0o555)
    if os.geteuid() == 0:  # root writes there whatever the mode says: as a user who may not
        access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != out and access(path, mode, **kw))
    try:
        code, _, err = prismc(capsys, "compile", RMSNORM, *FAST, "-o", out)
    finally:
        out.chmod(0o755)
    assert code == 1 and "it is not writable" in err and scratch_beside(tmp_path) == []


def test_cache_temporary_files_of_killed_runs_are_removed(own_cache):
    (own_cache / "kind").mkdir(parents=True)
    left = own_cache / "kind" / f".tmp-prismc-{dead_pid()}-abcd1234.json"
    left.write_text("{")
    cache.write("kind", KEY, 1)
    assert not left.exists() and cache.read("kind", KEY) == 1


def test_prove_does_not_hang_on_a_fifo_in_the_cache(own_cache, capsys, write, monkeypatch):
    """A FIFO where the soundness verdict of a rule is cached used to hang `prove` and `check`."""
    from prism_dsl.prove import soundness

    monkeypatch.setattr(soundness, "cacheable", lambda rule: True)  # as the default library's rules are
    rules = write("ruleset algebra {\n    rule twice: x + x => 2 * x\n}\n", "mine.rules")
    assert prismc(capsys, "check", "--no-default-rules", rules)[0] == 0
    (entry,) = (own_cache / "sound").iterdir()
    entry.unlink()
    os.mkfifo(entry)
    code, out, err = prismc(capsys, "check", "--no-default-rules", rules)
    assert code == 0 and "1 rule" in out and err.count("ignoring cache entry") == 1


# -- run and show outputs ------------------------------------------------------------------------------


def test_run_writes_into_a_fifo_without_replacing_it(capsys, tmp_path):
    """A FIFO (or /dev/null, /dev/stdout) is written, not replaced by a regular file."""
    fifo = tmp_path / "out.npz"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    code, _, _ = prismc(capsys, "run", RMSNORM, "--dims", "n=2,d=8", "--out", fifo)
    reader.join(10)
    assert code == 0 and got and got[0][:2] == b"PK" and not fifo.is_file()


def test_run_output_under_a_regular_file(capsys, tmp_path):
    (tmp_path / "somefile").write_text("mine")
    code, _, err = prismc(capsys, "run", RMSNORM, "--dims", "n=2,d=8", "--out", tmp_path / "somefile" / "o.npz")
    assert code == 1 and f"'{tmp_path / 'somefile'}' is not a directory" in err


def test_run_removes_partial_outputs_of_killed_runs(capsys, tmp_path):
    left = tmp_path / f".o.npz.prismc-{dead_pid()}-abcd1234.tmp"
    left.write_bytes(b"PK")
    assert prismc(capsys, "run", RMSNORM, "--dims", "n=2,d=8", "--out", tmp_path / "o.npz")[0] == 0
    assert not left.exists() and re.fullmatch(r"o\.npz", " ".join(p.name for p in tmp_path.iterdir()))


def test_an_unforeseen_file_system_refusal_is_a_message_not_a_traceback(capsys, tmp_path, monkeypatch):
    """Whatever OSError escapes a command (a permission a root test cannot take away, say) ends as exit 1."""
    from prism_dsl.cli import main as cli

    def refuse(args):
        raise PermissionError(13, "Permission denied", str(tmp_path / "private"))

    monkeypatch.setattr(cli, "cmd_check", refuse)
    assert main(["check", str(RMSNORM)]) == 1
    err = capsys.readouterr().err
    assert f"prismc: cannot use '{tmp_path / 'private'}': Permission denied" in err and "Traceback" not in err
