"""`prismc verify DIR` as a user runs it, and what `compile` reports of its emulation: a directory as
compiled passes; an edited .cu that is wrong, races or no longer compiles is reported with the kernel, the
element or the line; bad directories and dims are messages with exit 1, never a traceback; large dims are
checked on a sample of blocks."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from prism_dsl.backend import emulate
from test_cli import PROGRAMS, prismc

pytestmark = pytest.mark.skipif(emulate.compiler() is None, reason="no C++ compiler (g++ or clang++) for the emulation")
FUSED_RMSNORM = PROGRAMS / "fused" / "rmsnorm_linear.prism"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """An output directory of `prismc compile` (fused rmsnorm_linear at small dims), copied per test."""
    out = tmp_path_factory.mktemp("compiled") / "out"
    from prism_dsl.cli.main import main

    assert main(["compile", str(FUSED_RMSNORM), "--search", "none", "--arch", "none", "--dims", "n=8,d=256",
                 "-o", str(out)]) == 0
    return out


@pytest.fixture
def out(compiled, tmp_path):
    copy = tmp_path / "out"
    shutil.copytree(compiled, copy)
    return copy


def test_compile_reports_which_emulation_ran(out):
    e = json.loads((out / "report.json").read_text())["checked"]["emulation"]
    assert e["passed"] and e["finding"] is None
    ran = e["emulation"]
    assert ran["threads_per_block"] == 128 and ran["sanitizer"] is None and ran["dims"] == {"n": 8, "d": 256}
    assert ran["whole_grid"] and all(b["emulated"] == b["grid"] for b in ran["blocks"].values())


def test_verify_passes_a_directory_as_compiled(capsys, out):
    code, text, _ = prismc(capsys, "verify", out)
    assert code == 0 and "the .cu files on disk" in text and "verified: yes" in text


def test_verify_under_a_sanitizer(capsys, out):
    """(ThreadSanitizer under verify: test_verify_maps_a_race_to_the_edited_line.)"""
    code, text, _ = prismc(capsys, "verify", out, "--sanitize", "address")
    assert code == 0 and "address sanitizer" in text, text


def test_verify_finds_an_edited_kernel_wrong_with_the_first_wrong_element(capsys, out):
    cu = out / "rmsnorm_matmul.cu"
    cu.write_text(cu.read_text().replace("/ prism::sqrt_(", "/ real(2) / prism::sqrt_("))
    code, text, _ = prismc(capsys, "verify", out)
    assert code == 1 and "Y (" in text and "DIFFERS" in text and "kernel rmsnorm_matmul" in text
    assert re.search(r"first wrong element Y\[\d+, \d+\] = \S+, expected \S+", text)
    edited = next(i for i, line in enumerate(cu.read_text().splitlines(), 1) if "real(2)" in line)
    assert f"rmsnorm_matmul.cu: edited since it was compiled (from line {edited}); checked as it is on disk" in text


def test_a_kernel_cut_short_is_named_before_the_compilers_errors(capsys, out):
    """A .cu cut short (an editor's crash, a copy stopped) fails to compile in the harness that includes it: the
    errors named only harness.cpp, a file the user does not have."""
    cu = out / "rmsnorm_matmul.cu"
    text = cu.read_text()
    cu.write_text(text[: len(text) // 2])
    code, _, err = prismc(capsys, "verify", out)
    assert code == 1 and re.match(r"\S*rmsnorm_matmul\.cu: edited since it was compiled \(from line \d+\)\n", err), err
    assert "do not compile for the CPU emulation" in err


def test_a_kernel_with_other_line_endings_is_checked_as_it_is_and_said_edited(capsys, out):
    cu = out / "rmsnorm_matmul.cu"
    cu.write_bytes(cu.read_bytes().replace(b"\n", b"\r\n"))
    code, text, _ = prismc(capsys, "verify", out)
    assert code == 0 and "rmsnorm_matmul.cu: edited since it was compiled (in its line endings" in text, text


def test_an_f32_program_is_held_to_f32s_tolerance(capsys, tmp_path):
    """The same kernel in f32, 0.1% off: within the 1e-2 of a 16-bit program, wrong for one that stores f32
    (`compare.FLOOR`); as compiled it passes at 2e-4."""
    path = tmp_path / "f32.prism"
    path.write_text(FUSED_RMSNORM.read_text().replace("f16", "f32"))
    out = tmp_path / "out"
    code, text, _ = prismc(capsys, "compile", path, "--search", "none", "--arch", "none", "--dims", "n=8,d=256", "-o", out)
    assert code == 0 and "verified: yes" in text
    assert json.loads((out / "report.json").read_text())["checked"]["emulation"]["rtol"] == 2e-4
    cu = out / "rmsnorm_matmul.cu"
    cu.write_text(cu.read_text().replace("/ prism::sqrt_(", "/ real(1.001) / prism::sqrt_("))
    code, text, _ = prismc(capsys, "verify", out)
    assert code == 1 and re.search(r"DIFFERS with the reference, max rel err \S+ \(tolerance 2\.00e-04\)", text), text


def test_verify_maps_a_race_to_the_edited_line(capsys, out):
    cu = out / "rmsnorm_matmul.cu"
    lines = cu.read_text().splitlines(keepends=True)
    at = next(i for i, l in enumerate(lines) if "prism::cp_async_wait" in l and "for (int it" in "".join(lines[:i]))
    del lines[at + 1]  # the barrier after the wait for the loop's tiles (pipelined or not)
    cu.write_text("".join(lines))
    code, text, _ = prismc(capsys, "verify", out, "--sanitize", "thread")
    assert code == 1 and "data race in kernel 'rmsnorm_matmul'" in text and "rmsnorm_matmul.cu:" in text
    assert "block (" in text and "thread" in text


def test_verify_at_other_dims_generates_the_kernels_again(capsys, out):
    code, text, _ = prismc(capsys, "verify", out, "--dims", "n=16,d=512", "--grid", "x=8")
    assert code == 0 and "generated again" in text and "n=16, d=512" in text
    assert "(the .cu files on disk hold other kernel parameters)" in text  # --grid given: the reason said
    code, text, _ = prismc(capsys, "verify", out, "--dims", "n=16,d=512")
    assert code == 0 and "(the .cu files on disk hold other sizes)" in text


def test_verify_at_sizes_no_tile_divides_builds_as_compile_would(capsys, tmp_path):
    """1009 keys (a prime): built for 1024 with the folds past 1009 masked, as `compile --dims kv=1009` builds it,
    where the kernels generated at 1009 would take one key a tile and the block interpreter's reference ages."""
    out = tmp_path / "out"
    assert prismc(capsys, "compile", PROGRAMS / "fused" / "attention.decoding.prism", "--search", "none", "--arch",
                  "none", "--no-emulate", "--dims", "b=1,h=2,q=1,kv=128,dh=64", "-o", out)[0] == 0
    code, text, _ = prismc(capsys, "verify", out, "--dims", "kv=1009")
    assert code == 0 and "at b=1, h=2, q=1, kv=1024, dh=64 (given kv=1009: " in text and "verified: yes" in text


def test_verify_sampled_blocks_compare_what_they_write(capsys, out):
    code, text, _ = prismc(capsys, "verify", out, "--emulate-blocks", "1")
    assert code == 0 and "(sampled, seed 0)" in text
    blocks, total = map(int, re.search(r"(\d+) of (\d+) blocks", text).groups())
    elements = int(re.search(r"Y \((\d+) elements", text).group(1))
    assert blocks < total and elements == 8 * 256 * blocks // total
    # a count past the grid's blocks is every block, at once (it was a loop of that many random draws)
    code, text, _ = prismc(capsys, "verify", out, "--emulate-blocks", str(10**20))
    assert code == 0 and "every block" in text


@pytest.mark.parametrize("setup, message", [
    (lambda d: (d / "report.json").unlink(), "has no report.json"),
    (lambda d: (d / "report.json").write_text("{"), "is not valid JSON"),
    (lambda d: (d / "report.json").write_text("{}"), "is not a report of prismc compile"),
    (lambda d: _edit_report(d, dims={"n": "eight"}), "(missing or malformed: dims)"),
    (lambda d: _edit_report(d, kernels=[{"file": 3}]), "(missing or malformed: kernels)"),
    (lambda d: _edit_report(d, hardware={"name": "b200"}), "unknown hardware 'b200'"),
    # a hand-edited launch: what the emulation or its harness would take, refused in words
    (lambda d: _edit_kernel(d, block=[0, 1, 1]), "(missing or malformed: kernels)"),
    (lambda d: _edit_kernel(d, block=[128]), "(missing or malformed: kernels)"),
    (lambda d: _edit_kernel(d, block=[128, "a", 1]), "(missing or malformed: kernels)"),
    (lambda d: _edit_kernel(d, smem_bytes=None), "(missing or malformed: kernels)"),
    (lambda d: _edit_kernel(d, smem_bytes=1.5), "(missing or malformed: kernels)"),
    (lambda d: _edit_kernel(d, smem_bytes=-5), "(missing or malformed: kernels)"),
    (lambda d: _edit_kernel(d, smem_bytes=10**15), "bytes of shared memory, more than the H100 takes"),
    (lambda d: _edit_kernel(d, block=[1024, 2, 1]), "with 2048 threads"),
    (lambda d: _edit_report(d, parameters={"gx": 0}), "(missing or malformed: parameters)"),
    (lambda d: _edit_report(d, parameters={"zz": 3}), "names what its program does not have (zz)"),
    (lambda d: _edit_report(d, padded={"n": "x"}), "(missing or malformed: padded)"),
    (lambda d: _edit_kernel(d, grid=[64, 4, 1]), "report.json' says of rmsnorm_matmul.cu: grid [64, 4, 1] (the program's:"),
    (lambda d: _edit_kernel(d, function="prism_foo"), "function 'prism_foo' (the program's: 'prism_rmsnorm_matmul')"),
    (lambda d: _edit_kernel(d, name="foo"), "name 'foo' (the program's: 'rmsnorm_matmul')"),
    (lambda d: _edit_report(d, dims={"n": 16, "d": 256}), "bytes of shared memory', where report.json's parameters"),
    (lambda d: _edit_report(d, files="all"), "(missing or malformed: files)"),
    (lambda d: _edit_codegen(d, threads=0), "not what prismc compiles with: threads=0"),
    (lambda d: _edit_codegen(d, ends=[5]), "not what prismc compiles with: ends=(5,)"),
    (lambda d: _edit_codegen(d, threads=-32, stages=0), "not what prismc compiles with: threads=-32, stages=0"),
    # what the report says of the code and the hardware, and the files it lists: each as compiled, or said
    (lambda d: _edit_codegen(d, smem_limit=10**30), "not those of its hardware: smem_limit=10000000000000000000000000"
     "00000 (the H100's: 232448)"),
    (lambda d: _edit_codegen(d, sms=64, arch="sm_80"), "arch='sm_80' (the H100's: 'sm_90'), sms=64 (the H100's: 132)"),
    (lambda d: _edit_report(d, codegen=None), "(missing or malformed: codegen)"),
    (lambda d: _edit_report(d, parameters={}), "report.json' does not give its program's kernel parameters F, gx"),
    (lambda d: _edit_report(d, parameters={"gx": 128}), "does not give its program's kernel parameters F:"),
    (lambda d: _edit_report(d, hardware={"name": "V100"}), "report.json': unknown hardware 'V100'"),
    (lambda d: _edit_report(d, files=[*json.loads((d / "report.json").read_text())["files"], "ghost.cu"]),
     "ghost.cu' is missing: report.json lists it among the files prismc wrote"),
    (lambda d: _edit_report(d, files=["../rmsnorm_linear.prism"]), "lists '../rmsnorm_linear.prism' among the files"),
    # the report's parameters and options against what each .cu file says it was compiled for (its first lines)
    (lambda d: _edit_report(d, parameters={"F": 2, "gx": 128}),
     "rmsnorm_matmul.cu' says at line 2 that it was compiled for 'grid x=128, 8 loop iterations, 128 threads per "
     "block, 5376 bytes of shared memory', where report.json's parameters and options give 'grid x=128, 2 loop"),
    (lambda d: _edit_codegen(d, threads=256), "options give 'grid x=128, 8 loop iterations, 256 threads per block"),
    (lambda d: _edit(d / "rmsnorm_matmul.cu", "// rmsnorm_linear: kernel", "// kernel"),
     "says at line 1 that it was compiled for 'kernel rmsnorm_matmul, generated by prismc.'"),
    # the search's choice, which the report names for `prismc prove`: the program in the directory, lowered
    (lambda d: _as_best(d, lambda text: text), None),
    (lambda d: _as_best(d, lambda text: text.replace("acc / rms", "acc")), "best.prism' is not the program"),
    (lambda d: (_as_best(d, lambda text: text), (d / "best.prism").unlink()), "best.prism' is missing"),
    # the files the GPU runs besides the kernels: as prismc writes them for these kernels, or said
    (lambda d: _edit(d / "launcher.py", "'block': [128, 1, 1]", "'block': [64, 1, 1]"),
     "launcher.py' is not what prismc writes for the kernels"),
    (lambda d: (d / "prism_runtime.py").write_text("garbage("), "prism_runtime.py' is not what prismc writes"),
    (lambda d: (d / "cuda_plan.py").unlink(), "cuda_plan.py' is missing"),
    (lambda d: (d / "rmsnorm_matmul.cu").unlink(), "is missing"),
    (lambda d: (d / "rmsnorm_matmul.cu").write_text("this is not C++\n"), "does not begin with the lines prismc writes"),
    (lambda d: _keep_header(d / "rmsnorm_matmul.cu", "this is not C++\n"), "do not compile for the CPU emulation"),
    (lambda d: (d / "rmsnorm_linear.prism").write_text("program ("), "rmsnorm_linear.prism:1:"),
    (lambda d: _edit_header(d, "PRISM_EMU_INTERFACE == 2", "PRISM_EMU_INTERFACE == 1"),
     "is from another version of prismc (its emulated forms are written for interface 1 of the emulation's"),
    (lambda d: _edit_header(d, "static_assert(PRISM_EMU_INTERFACE == 2", "static_assert(true"),
     "written for an interface from before version 2 of the emulation's runtime"),
])
def test_verify_bad_directories_are_messages(capsys, out, setup, message):
    setup(out)
    code, _, err = prismc(capsys, "verify", out)
    assert (code, err) == (0, "") if message is None else code == 1 and message in err, err


def _edit_codegen(directory: Path, **changes) -> None:
    report = json.loads((directory / "report.json").read_text())
    _edit_report(directory, codegen={**report["codegen"], **changes})


def _as_best(directory: Path, edit) -> None:
    """The directory as a search that chose its program writes it: `best.prism` (edited by `edit`), named."""
    report = json.loads((directory / "report.json").read_text())
    (directory / "best.prism").write_text(edit((directory / "rmsnorm_linear.prism").read_text()))
    _edit_report(directory, best="best.prism", files=[*report["files"], "best.prism"])


def _edit_header(directory: Path, old: str, new: str) -> None:
    path = directory / "prism.cuh"
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new))


def _edit_report(directory: Path, **changes) -> None:
    path = directory / "report.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _edit_kernel(directory: Path, **changes) -> None:
    """The first kernel's entry in report.json changed (None: the key removed)."""
    report = json.loads((directory / "report.json").read_text())
    kernel = {**report["kernels"][0], **changes}
    report["kernels"][0] = {k: v for k, v in kernel.items() if v is not None}
    (directory / "report.json").write_text(json.dumps(report))


def _keep_header(path: Path, body: str) -> None:
    """`path`'s first comment lines (what it was compiled for) kept, the rest `body`."""
    from prism_dsl.cli.verify import built_for
    path.write_text("".join(f"{line}\n" for line in built_for(path.read_text())) + body)


def _edit(path: Path, old: str, new: str) -> None:
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new))


def test_verify_a_missing_directory_and_dims_the_kernels_cannot_take(capsys, tmp_path, out):
    code, _, err = prismc(capsys, "verify", tmp_path / "nowhere")
    assert code == 1 and "is not a directory" in err
    code, _, err = prismc(capsys, "verify", out, "--dims", "d=100", "--grid", "x=7")
    assert code == 1 and err.strip() and "Traceback" not in err
    code, _, err = prismc(capsys, "verify", out, "--grid", "x=8")
    assert code == 2 and "give --dims too" in err
    code, _, err = prismc(capsys, "verify", out, "--dims", "n=65536,d=65536")
    assert code == 1 and "shared memory per block" in err
    code, _, err = prismc(capsys, "verify", out, "--dims", "d=1048576")  # fits a GPU, not the float64 reference
    assert code == 1 and "rmsnorm_linear.prism:" in err and "elements" in err


def test_a_compiled_edit_that_breaks_compilation_names_the_cu_line(capsys, out):
    cu = out / "rmsnorm_matmul.cu"
    cu.write_text(cu.read_text().replace("__syncthreads();", "__syncthreads(;", 1))
    code, _, err = prismc(capsys, "verify", out)
    assert code == 1 and re.search(r"rmsnorm_matmul\.cu:\d+:\d+: error", err), err


def test_verify_launches_the_kernels_on_disk_as_they_were_compiled(capsys, tmp_path):
    """A directory compiled with --no-wgmma at sizes where the default is wgmma: its mma.sync kernel is
    launched with the block and shared memory it was written for."""
    from prism_dsl.cli.main import main
    out = tmp_path / "out"
    assert main(["compile", str(FUSED_RMSNORM), "--search", "none", "--arch", "none", "--no-emulate", "--no-wgmma",
                 "--dims", "n=128,d=256", "--grid", "gx=2", "--loop", "F=4", "-o", str(out)]) == 0
    assert "wgmma" not in (out / "rmsnorm_matmul.cu").read_text()
    code, text, _ = prismc(capsys, "verify", out)
    assert code == 0 and "the .cu files on disk" in text and "agrees" in text, text
    # generated again at other dims, with the options the directory was compiled with (report.json keeps them)
    from prism_dsl.backend.launch import CodegenConfig
    from prism_dsl.cli.verify import codegen_of
    report = json.loads((out / "report.json").read_text())
    assert codegen_of(report) == CodegenConfig(wgmma=False)
    assert codegen_of({"kernels": [{"block": [256, 1, 1]}]}) == CodegenConfig(threads=256)  # an older report
    report["codegen"]["stages"] = "3"
    (out / "report.json").write_text(json.dumps(report))
    code, _, err = prismc(capsys, "verify", out, "--dims", "n=64")
    assert code != 0 and "codegen options in report.json are not prismc's" in err and "Traceback" not in err


def test_verify_on_inputs_of_ones_own(capsys, out, tmp_path):
    """A user's own activations (an outlier of 300 among standard normal values) instead of random ones: the
    archive's arrays must have the shapes the kernels take, checked before its data is read."""
    import numpy as np

    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 256))
    x[3, 17] = 300.0
    np.savez(tmp_path / "mine.npz", X=x, W=rng.standard_normal((256, 256)) * 0.05)
    code, text, _ = prismc(capsys, "verify", out, "--inputs", tmp_path / "mine.npz")
    assert code == 0 and f"on the inputs of {tmp_path / 'mine.npz'}" in text and "agrees" in text, text
    np.savez(tmp_path / "other.npz", X=x[:, :128], W=rng.standard_normal((256, 256)))
    code, _, err = prismc(capsys, "verify", out, "--inputs", tmp_path / "other.npz")
    assert code == 1 and "input 'X' should have shape [8, 256]" in err and "Traceback" not in err


def test_inputs_where_the_program_is_undefined_in_one_row_still_tell_a_right_kernel_from_a_wrong_one(
        capsys, out, tmp_path):
    """A row of zeros makes rms_norm 0 / 0 there: that row cannot be verified, so neither can the directory, but the
    other rows are compared, and an edited kernel shows in them with its first wrong element."""
    import numpy as np

    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 256))
    x[3] = 0.0
    np.savez(tmp_path / "zero_row.npz", X=x, W=rng.standard_normal((256, 256)) * 0.05)
    code, text, _ = prismc(capsys, "verify", out, "--inputs", tmp_path / "zero_row.npz")
    held = "the reference itself holds NaN (256 of 2048 elements, the first at (3, 0))"
    assert code == 1 and "NOT VERIFIED" in text and held in text, text
    assert "where it is defined (1792 elements) the output agrees with it" in text and "verified: NO" in text
    cu = out / "rmsnorm_matmul.cu"
    cu.write_text(cu.read_text().replace("/ prism::sqrt_(", "/ real(2) / prism::sqrt_("))
    code, text, _ = prismc(capsys, "verify", out, "--inputs", tmp_path / "zero_row.npz")
    assert code == 1 and held in text
    assert re.search(r"where it is defined \(1792 elements\) the output differs from it: the first wrong element "
                     r"at \(0, \d+\) is \S+, expected \S+", text), text


def test_a_cxx_with_flags_in_it_is_said_as_such(capsys, out, monkeypatch):
    monkeypatch.setenv("CXX", "g++ -fPIC")
    code, _, err = prismc(capsys, "verify", out)
    assert code == 1 and "CXX is 'g++ -fPIC', which is not a program that can be run" in err and "Traceback" not in err
