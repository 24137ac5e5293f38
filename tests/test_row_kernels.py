"""Softmax and the norms as a program writes them, each a kernel of rows (prism_dsl/backend/row_parts.py `rowwise`,
prism_dsl/kernels/fusion.py `Place.STORED`, prism_dsl/kernels/lower.py): the pass that writes a row stores it
straight to the output, 16 bytes at a time, with no shared buffer of the result and no store step after it; a row
that a block takes alone is shared by all its warps, their parts combined through a small scratch; the element-wise
chain that makes the row (softmax(x / t + y)) and the one after the op (rms_norm(x) * g) are computed in the same
kernel. Each form is emulated against the float64 reference, under a sanitizer where it adds barriers."""

from __future__ import annotations

import json
import shutil

import pytest

from prism_dsl.backend import sass
from prism_dsl.backend.launch import CodegenConfig
from prism_dsl.kernels.fusion import Place, plan
from prism_dsl.kernels.kernel import kernels_of
from prism_dsl.kernels.lower import lower
from test_cli import prismc
from test_codegen import H100, ROOT, BuildOptions, build, emulate, load, needs_cxx
from test_row_parts import sass_of

ROWS = """dims n = 4, d = 4096
program rows(X: {t}[n, d], G: {t}[d], B: {t}[d], Y: {t}[n, d]) {{
    P = softmax(X / 0.7 + Y)
    L = layer_norm(X, 0.00001)
    R = rms_norm(X, 0.000001) * G + B
    return P, L, R
}}
"""


@needs_cxx
@pytest.mark.parametrize("dtype, dims, threads, sanitizer, spans", [
    # a row of 4096 f16 a block: 128 threads a row, 4 warps combined through the scratch
    ("f16", {"n": 4, "d": 4096}, 128, "thread", True),
    # 256 threads, bf16: 8 warps a row
    ("bf16", {"n": 2, "d": 2048}, 256, "address", True),
    # rows of 200: 25 groups of 8, 16 lanes a row, the last sweep cut short; no warp spans
    ("f16", {"n": 3, "d": 200}, 128, "address", False),
    # f32 rows of 1000: read and written element by element, 128 threads a row
    ("f32", {"n": 2, "d": 1000}, 128, "thread", True),
], ids=["f16-4096", "bf16-256-threads", "ragged", "f32"])
def test_row_kernels_write_their_rows_straight_to_the_output(write, dtype, dims, threads, sanitizer, spans):
    """Three kernels, not five: the softmax with the chain that makes its row, the LayerNorm, the RMSNorm with its
    gain and bias after it. None keeps its result in shared memory or has a store step after the row's pass; a
    16-bit row whose length is a multiple of 8 is stored 16 bytes a thread."""
    program = load(write(ROWS.format(t=dtype))).program()
    lowered = lower(program)
    kernels = kernels_of(lowered)
    assert sorted(k.name for k in kernels) == ["layer_norm_L", "rms_norm_eps_add_R", "softmax_P"]
    for k in kernels:
        assert [p for n, p in plan(k).place.items() if n.op in ("softmax", "layer_norm", "rms_norm_eps")] \
            == [Place.STORED], k.name
    params = {f"gx_{o}": dims["n"] for o in "PLR"}  # a row a block
    options = BuildOptions(dims=dims, params=params, archs=(), sanitize=sanitizer, emulate_blocks="all",
                           codegen=CodegenConfig(threads=threads))
    built = build(program, H100, options)
    for k in built.kernels:
        assert "value v" not in k.source and "// store " not in k.source, k.name
        assert ("_warps[0 + PRISM_TID / PRISM_WARP] = " in k.source) == spans, k.name  # the warps' combine
        assert ("prism::store16(g_" in k.source) == (dtype != "f32" and dims["d"] % 8 == 0), k.name
    softmax = next(k for k in built.kernels if k.name == "softmax_P")
    assert ("prism::load8(v1, s_y_" in softmax.source) == (dtype != "f32" and dims["d"] % 8 == 0)
    norm = next(k for k in built.kernels if k.name == "rms_norm_eps_add_R")
    if dtype != "f32" and dims["d"] % 8 == 0:  # the gain and bias read 8 at a time, in the pass that writes
        assert "prism::load8(u0, s_g_" in norm.source and "prism::load8(u1, s_b_" in norm.source
    check = emulate(built, options)
    assert check.passed, check


@pytest.mark.parametrize("dtype, held", [("f16", True), ("f32", False)])
def test_a_thread_holds_its_elements_of_the_row_only_where_they_stay_in_registers(write, dtype, held):
    """A row of 4096 on 128 threads: in f16, 4 sweeps of 8 elements a thread, held in registers through the passes;
    in f32, read one at a time, 32 sweeps, which are not unrolled whole, so an array of them would be a stack
    frame: read from shared memory in each pass instead."""
    program = load(write(f"dims n = 4, d = 4096\nprogram p(X: {dtype}[n, d]) {{\n    P = softmax(X)\n"
                         "    return P\n}\n")).program()
    source = build(program, H100, BuildOptions(params={"gx_P": 4}, archs=())).kernels[0].source
    assert ("real xr[32];" in source) == held and ("PRISM_UNROLL_BY(4)" in source) != held


@needs_cxx
def test_a_norm_also_returned_keeps_its_buffer_and_the_chain_after_it_its_own_kernel(write):
    """Where the norm is an output as well as the chain's operand, its kernel stores it and the chain's kernel
    reads it back; in a kernel written by hand that stores both, the norm keeps its shared buffer and both stores
    are made by store steps. Both agree with the reference."""
    src = write("dims n = 4, d = 256\nprogram p(X: f16[n, d], G: f16[d]) {\n    N = rms_norm(X)\n"
                "    R = N * G\n    return N, R\n}\n")
    program = load(src).program()
    assert sorted(k.name for k in kernels_of(lower(program))) == ["mul_R", "rms_norm_N"]
    options = BuildOptions(archs=(), sanitize="address", emulate_blocks="all")
    assert emulate(build(program, H100, options), options).passed
    hand = write("dims n = 4, d = 256\nprogram p(X: f16[n, d], G: f16[d]) {\n    kernel k grid(x = gx) {\n"
                 "        xt = load X[x, :]\n        gt = load G[:]\n        r = rms_norm(xt)\n"
                 "        store N[x, :] = r\n        store R[x, :] = r * gt\n    }\n    return N, R\n}\n")
    program = load(hand).program()
    k = kernels_of(program)[0]
    assert [p for n, p in plan(k).place.items() if n.op == "rms_norm"] == [Place.SMEM] and not plan(k).writes
    built = build(program, H100, options)
    assert built.kernels[0].source.count("// store ") == 2
    assert emulate(built, options).passed


@needs_cxx
def test_a_softmax_over_a_vocabulary_of_f16_logits_is_one_kernel_that_holds_its_row(write, tmp_path, capsys):
    """A row of 50257 f16 logits is 100 KiB: held once in shared memory (its f32 result was 200 KiB more, so the
    row needed two kernels that read the logits twice). At 4096 rows the model takes the one kernel, two blocks
    an SM; at rank 4 it compiles too, where the two-kernel form cannot. Emulated whole at 2 x 2 rows."""
    src = write("dims a = 2, s = 2, v = 50257\nprogram p(X: f16[a, s, v]) {\n    P = softmax(X)\n    return P\n}\n")
    out = tmp_path / "o"
    code, _, err = prismc(capsys, "compile", src, "--search", "none", "--arch", "none", "--dims", "a=1,s=4096",
                          "--no-emulate", "-o", out)
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert [k["name"] for k in report["kernels"]] == ["softmax_P"] and report["kernels"][0]["smem_bytes"] < 113 * 1024
    rank4 = write("dims a = 2, b = 1, s = 2, v = 50257\nprogram p(X: f16[a, b, s, v]) {\n    P = softmax(X)\n"
                  "    return P\n}\n")
    code, text, err = prismc(capsys, "compile", rank4, "--search", "none", "--arch", "none", "--sanitize", "address",
                             "-o", tmp_path / "o4")
    assert code == 0 and "verified: yes" in text, err + text


@pytest.mark.skipif(shutil.which("nvcc") is None or not sass.available(),
                    reason="needs nvcc on the PATH and cuobjdump (pip install -e '.[sass]')")
def test_the_compiled_softmax_stores_its_row_from_registers(write, tmp_path):
    """A row of 4096 f16 a block: its SASS reads the row by LDS.128 and stores it by STG.E.128; the only shared
    stores are the warps' max and sum (no f32 row written and read back)."""
    program = load(write("dims n = 4096, d = 4096\nprogram p(X: f16[n, d]) {\n    P = softmax(X)\n"
                         "    return P\n}\n")).program()
    ops = sass_of(build(program, H100, BuildOptions(archs=(), params={"gx_P": 4096})).kernels[0], tmp_path)
    assert ops.count("LDS.128") >= 3 and ops.count("STG.E.128") >= 1, sorted(set(ops))
    assert sum(op.startswith("STS") for op in ops) == 2, sorted(set(ops))


@needs_cxx
@pytest.mark.parametrize("declare, body, grid", [
    # two row-wise ops in one stored chain: neither writes the output itself (each chain would read the other)
    ("X: f16[n, d], G: f16[d]", "xt = load X[x, :]\n        store Z[x, :] = softmax(xt) + rms_norm(xt)", "gx"),
    # a store map of more dims than the value: the row's indices do not name the output's
    ("X: f16[n, d], G: f16[d]", "xt = load X[x, :]\n        gt = load G[:]\n        store Z[:, x, :] = rms_norm(xt) * gt",
     "gx"),
    # and of fewer
    ("X: f16[1, n, d], G: f16[d]", "xt = load X[:, y, :]\n        gt = load G[:]\n        store Z[y, :] = rms_norm(xt) * gt",
     "gy"),
    # the chain reads an accumulator's value after the loop, which the op (before the loop) cannot wait for
    ("X: f16[n, d], Y: f16[n, d]", "xt = load X[x, :]\n        yt = load Y[x, loop]\n"
     "        store Z[x, :] = rms_norm(xt) * acc_sum_last(yt)", "gx"),
    # a value a later step computes
    ("X: f16[n, d], Y: f16[n, d]", "xt = load X[x, :]\n        yt = load Y[x, :]\n"
     "        store Z[x, :] = softmax(xt) * sum(yt, -1)", "gx"),
    # the row's own tile read transposed (not at the element the pass holds)
    ("X: f16[d, d]", "xt = load X[:, :]\n        store Z[:, :] = softmax(xt) * transpose(xt, 0, 1)", "1"),
], ids=["two-row-ops", "more-dims", "fewer-dims", "accumulator", "later-value", "transposed"])
def test_a_row_op_the_pass_that_writes_cannot_store_keeps_its_buffer(write, declare, body, grid):
    """Where the pass that writes could not store the row itself, the op is computed into its buffer and the store
    step writes the output; each agrees with the reference under AddressSanitizer (each wrote out of bounds, read
    what was not yet computed, or failed to render, when it was taken for stored)."""
    axis = "x" if grid == "1" else grid[1]
    loop = " loop(F)" if "loop" in body else ""
    program = load(write(f"dims n = 8, d = 64\nprogram p({declare}) {{\n    kernel k grid({axis} = {grid}){loop} {{\n"
                         f"        {body}\n    }}\n    return Z\n}}\n")).program()
    k = kernels_of(program)[0]
    assert not plan(k).writes and all(p is Place.SMEM for n, p in plan(k).place.items()
                                      if n.op in ("softmax", "rms_norm"))
    params = ({} if grid == "1" else {grid: 2}) | ({"F": 4} if loop else {})
    options = BuildOptions(params=params, archs=(), sanitize="address", emulate_blocks="all")
    built = build(program, H100, options)
    assert "// store Z" in built.kernels[0].source
    assert emulate(built, options).passed


@needs_cxx
def test_a_norm_in_the_row_another_works_on_is_computed_in_that_ones_kernel(write):
    """A softmax or norm whose value, through element-wise ops, is the row another one works on is computed in that
    one's kernel, into its buffer: each output below is one kernel (they were five), and programs/ntrans.prism as
    written, `rms_norm(rms_norm(H) + X) * alpha + X`, one (it was four). Emulated at rows of 200."""
    src = write("dims n = 6, d = 200\nprogram p(X: f16[n, d], H: f16[n, d], G: f16[d]) {\n"
                "    A = softmax(rms_norm(X) * 4.0)\n    B = layer_norm(softmax(H), 0.001) * G\n"
                "    C = rms_norm(layer_norm(X, 0.001) + rms_norm(H, 0.0001))\n    return A, B, C\n}\n")
    program = load(src).program()
    assert sorted(k.name for k in kernels_of(lower(program))) == ["layer_norm_mul_B", "rms_norm_C", "softmax_A"]
    assert [k.name for k in kernels_of(lower(load(ROOT / "programs/ntrans.prism").program()))] == ["rms_norm_add_Y"]
    options = BuildOptions(archs=(), sanitize="thread", emulate_blocks="all")
    assert emulate(build(program, H100, options), options).passed


@needs_cxx
@pytest.mark.parametrize("source", [
    # five nested norms: the usual form's one kernel holds five rows of f32 and four buffers (298 KB)
    "dims n = 8, d = 8192\nprogram p(H: f32[n, d], X: f32[n, d], Z: f32[n, d], W: f32[n, d], V: f32[n, d]) {\n"
    "    Y = rms_norm(rms_norm(rms_norm(rms_norm(rms_norm(H) + X) + Z) + W) + V)\n    return Y\n}\n",
    # a softmax of a chain of eight f32 rows: its one kernel holds the eight (263 KB)
    "dims n = 8, d = 8192\nprogram p(H: f32[n, d], X: f32[n, d], Z: f32[n, d], W: f32[n, d], V: f32[n, d], "
    "U: f32[n, d], T: f32[n, d], S: f32[n, d]) {\n    Y = softmax(H + X + Z + W + V + U + T + S)\n    return Y\n}\n",
], ids=["nested", "wide-chain"])
def test_where_the_fused_row_kernel_does_not_fit_each_op_takes_a_kernel_of_its_own(write, source):
    """Rows of 8192 (no form for long rows is offered there): the usual form's one kernel is past the shared
    memory's limit, and the form with each softmax and norm in a kernel of its own, and each chain in one of
    its own, is taken (both had no valid parameters before it was offered). Verified."""
    from prism_dsl.kernels.lower import lowered_forms

    program = load(write(source)).program()
    usual, apart = lowered_forms(program)[:2]
    assert len(kernels_of(usual)) == 1 and len(kernels_of(apart)) > 1
    options = BuildOptions(archs=(), emulate_blocks="all")
    built = build(program, H100, options)
    assert len(built.kernels) == len(kernels_of(apart)) and emulate(built, options).passed
