"""A split's combining kernel run in the launch of the kernel whose pieces it combines (`backend.tails`): which
kernel pairs qualify, the code and plan of the one launch, its emulation under both sanitizers against the two
launches, what the thread sanitizer finds where the tickets do not order the pieces, the fences in the SASS,
and what the model prices."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from prism_dsl.backend import sass
from prism_dsl.backend.codegen import CodegenConfig, header_source
from prism_dsl.backend.tails import pairs
from prism_dsl.kernels.lower import lower
from prism_dsl.lang.check import load
from prism_dsl.pipeline import emulation
from prism_dsl.pipeline.build import (BuildOptions, build, check_inputs, emulate, plan_of, reference_outputs,
                                      rtol_of)
from test_codegen import H100, ROOT, needs_cxx, needs_nvcc

DECODING = ROOT / "programs/fused/attention.decoding.prism"
DIMS = {"b": 2, "h": 2, "q": 1, "kv": 512, "dh": 64}
PARAMS = {"grid": {"gb": 2, "gh": 1, "S": 4}, "loop": {"F": 2}}


def variant(tmp_path, old: str, new: str):
    path = tmp_path / "decoding.prism"
    text = DECODING.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    return load(path).program()


def test_a_combining_kernel_of_the_pieces_of_each_tile_qualifies(tmp_path):
    """FlashDecoding written by hand pairs its kernels; not where another reader needs the pieces, nor where the
    combining kernel's tile reads pieces of other tiles (its grid is not the first's without the split)."""
    assert pairs(load(DECODING).program()) == {"combine": "partial"}
    # the pieces have another reader (returned as they are, their shape would name S: refused)
    assert pairs(lower(variant(tmp_path, "    return O\n", "    R = sum(M, 0)\n    return O, R\n"))) == {}
    text = DECODING.read_text()
    whole = text[text.index("    kernel combine"):text.index("    return O")]
    heads = whole.replace("grid(x = gb, y = gh)", "grid(x = gb)").replace("x, y, :, :]", "x, :, :, :]")
    assert pairs(variant(tmp_path, whole, heads)) == {}  # a tile of every head: the pieces of several of the first's


@needs_cxx
def test_one_launch_agrees_with_two_and_with_the_reference():
    """The pair is one launch whose last parameter is the tiles' tickets (the plan says how many); it agrees
    with the reference as the two launches `--two-launches` keeps do (under both sanitizers:
    `test_codegen.test_a_sixteen_stage_combine_agrees_with_the_reference_under_each_sanitizer`)."""
    program = load(DECODING).program()
    one = build(program, H100, BuildOptions(dims=DIMS, archs=(), **PARAMS))
    assert [(k.name, k.combines, k.tickets) for k in one.kernels] == [("partial", "combine", 2)]
    assert one.kernels[0].args[-1] == "O" and "unsigned* __restrict__ prism_tickets)" in one.kernels[0].source
    assert plan_of(one)["kernels"][0]["tickets"] == 2
    options = BuildOptions(dims=DIMS, archs=(), codegen=CodegenConfig(one_launch=False), **PARAMS)
    two = build(program, H100, options)
    assert [k.name for k in two.kernels] == ["partial", "combine"] and not any(k.tickets for k in two.kernels)
    checks = [emulate(b, options) for b in (one, two)]
    assert all(c.passed for c in checks), checks
    # the same code computes each tile's combination: the same numbers, in either launch
    assert checks[0].outputs["O"]["max_rel_err"] == checks[1].outputs["O"]["max_rel_err"]


@needs_cxx
def test_tickets_that_do_not_order_the_pieces_are_a_race_under_the_thread_sanitizer():
    """Taken with a relaxed atomic, the ticket no longer orders the other pieces' stores before the combining
    block's reads: ThreadSanitizer reports the race, in the kernel's own lines."""
    race_with_relaxed_tickets(build(load(DECODING).program(), H100, BuildOptions(dims=DIMS, archs=(), **PARAMS)),
                              "partial.cu")


def race_with_relaxed_tickets(built, file: str) -> None:
    """The emulation of `built` under ThreadSanitizer with its tickets taken by a relaxed atomic: a data race, in
    the lines of `file` (a kernel's .cu)."""
    header = header_source()
    assert header.count("__ATOMIC_ACQ_REL) == pieces - 1") == 1
    relaxed = header.replace("__ATOMIC_ACQ_REL) == pieces - 1", "__ATOMIC_RELAXED) == pieces - 1")
    inputs = check_inputs(built, 0)
    check = emulation.check(built, plan_of(built), inputs, reference_outputs(built, inputs), seed=0,
                            rtol=rtol_of(built.reference), checked_against="input program", sanitizer="thread",
                            extra="all", header=relaxed)
    assert not check.passed and check.finding["kind"] == "data race", check.finding
    assert any(w.startswith(f"{file}:") for w in check.finding["where"]), check.finding


@needs_cxx
def test_a_sampled_launch_runs_every_piece_of_its_sampled_tiles():
    """Sampled (as at large dims), the launch runs every piece of each tile the combining kernel's sample holds,
    so each of those tiles is combined; the pieces' states are compared with the block interpreter."""
    dims = {"b": 4, "h": 4, "q": 1, "kv": 1024, "dh": 64}
    built = build(load(DECODING).program(), H100, BuildOptions(dims=dims, archs=(), grid={"gb": 4, "gh": 4, "S": 4},
                                                               loop={"F": 2}))
    blocks = emulation.choose_blocks(built, 0, 1)
    tiles = blocks["combine"]
    assert len(tiles) < 16 and sorted(blocks["partial"]) == sorted((x, y, z) for x, y, _ in tiles for z in range(4))
    inputs = check_inputs(built, 1)
    check = emulation.check(built, plan_of(built), inputs, reference_outputs(built, inputs), seed=1,
                            rtol=rtol_of(built.reference), checked_against="input program", extra=0)
    assert check.passed and not check.emulation["whole_grid"], check.errors()
    assert check.outputs["M"]["against"] == "block interpreter" and check.outputs["O"]["elements"] == len(tiles) * 64


@needs_nvcc
@pytest.mark.nvcc
def test_the_combining_block_fences_and_empties_its_l1_before_it_reads_the_pieces(tmp_path):
    """In the SASS (nvcc, sm_90): the block's stores fenced at gpu scope before the ticket's atomic, and after it
    a second fence that also invalidates the SM's L1 (CCTL.IVALL) before the barrier the block's threads pass
    to read the other pieces: no line cached before the pieces were stored answers them."""
    if not sass.available():
        pytest.skip("cuobjdump not found (pip install 'prism-dsl[sass]')")
    built = build(load(DECODING).program(), H100, BuildOptions(dims=DIMS, archs=(), **PARAMS))
    (tmp_path / "prism.cuh").write_text(header_source())
    (tmp_path / "partial.cu").write_text(built.kernels[0].source)
    done = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-o", "p.cubin", "partial.cu"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    ops = sass.instructions(sass.disassemble(tmp_path / "p.cubin"))[0]
    add = next(i for i, op in enumerate(ops) if op.startswith("ATOMG.E.ADD"))
    vote = next(i for i, op in enumerate(ops) if op.startswith("BAR.RED.OR") and i > add)
    assert "MEMBAR.SC.GPU" in ops[add - 6:add] and "CCTL.IVALL" in ops[add + 1:vote], ops[add - 6:vote + 1]


def test_the_model_prices_the_combining_kernel_without_a_launch_of_its_own():
    """In one launch, the combining kernel costs what it does in two less the launch overhead, on the first
    kernel's threads, and says in whose launch it runs."""
    program = load(DECODING).program()
    one = build(program, H100, BuildOptions(dims=DIMS, archs=(), emulate=False, **PARAMS))
    two = build(program, H100, BuildOptions(dims=DIMS, archs=(), emulate=False,
                                            codegen=CodegenConfig(one_launch=False), **PARAMS))
    e1, e2 = ({e.kernel: e for e in b.estimates} for b in (one, two))
    assert e1["combine"].launched_by == "partial" and e2["combine"].launched_by is None
    assert e1["partial"] == e2["partial"]
    assert np.isclose(e1["combine"].time_us, e2["combine"].time_us - H100.launch_overhead_us, atol=2e-3)


def test_prismc_compile_writes_one_launch_and_two_with_two_launches(tmp_path, capsys):
    """As a user runs it: one .cu for the pair, its report entry holding the combining kernel's estimate, the
    summary naming both; `--two-launches` writes a .cu per kernel."""
    from prism_dsl.cli.main import main

    args = ["compile", str(DECODING), "--search", "none", "--arch", "none", "--no-emulate",
            "--dims", ",".join(f"{k}={v}" for k, v in DIMS.items())]
    assert main([*args, "-o", str(tmp_path / "one")]) == 0
    assert "kernel partial (and combine in its launch, " in capsys.readouterr().out
    report = json.loads((tmp_path / "one" / "report.json").read_text())
    assert [k["file"] for k in report["kernels"]] == ["partial.cu"] and report["codegen"]["one_launch"] is True
    assert report["kernels"][0]["estimate"]["combines"]["launched_by"] == "partial"
    assert not (tmp_path / "one" / "combine.cu").exists()
    assert main([*args, "-o", str(tmp_path / "two"), "--two-launches", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [k["file"] for k in report["kernels"]] == ["partial.cu", "combine.cu"]
    assert report["codegen"]["one_launch"] is False and "combines" not in report["kernels"][0]["estimate"]
    assert report["idle"] == []
    # where nothing is split (a program with one kernel), the option changes nothing, and the summary says so
    plain = ["compile", str(DECODING.parent / "rmsnorm_linear.prism"), "--search", "none", "--arch", "none",
             "--no-emulate", "--dims", "n=8,d=256"]
    assert main([*plain, "-o", str(tmp_path / "plain"), "--two-launches", "--padded-inputs", "--tma",
                 "--no-pingpong"]) == 0
    text = capsys.readouterr().out
    for flag in ("--two-launches", "--tma", "--no-pingpong"):  # (each kernel rendered again without it: the same)
        assert f"  {flag}: the kernels built are the same without it\n" in text
    assert "  --padded-inputs: nothing is built past the sizes given" in text
    assert len(json.loads((tmp_path / "plain" / "report.json").read_text())["idle"]) == 4
    # searched, the option may have chosen the program though its kernels are the same without it: said so
    assert main(["compile", str(ROOT / "programs" / "attention.prism"), "-o", str(tmp_path / "searched"), "--arch", "none",
                 "--no-emulate", "--two-launches",
                 "--dims", ",".join(f"{k}={v}" for k, v in DIMS.items())]) == 0
    assert "  --two-launches: the kernels built are the same without it; the search ranked its programs with it, " \
           "which may have chosen this one" in capsys.readouterr().out
