"""Sums across blocks finished in their launch (`backend.sums`): a `+=` store kept in its own type, its blocks'
f32 additions in a workspace that the tile's last block stores and zeroes; the plan and the runtime that carry the
workspace; what the thread sanitizer finds where the tickets do not order the additions; and the search, which
now offers such a store for f16 outputs (GPT-2's MLP without LayerNorm in one kernel)."""

from __future__ import annotations

from prism_dsl.backend.codegen import header_source
from prism_dsl.ir.nodes import DType
from prism_dsl.kernels.kernel import kernels_of, stored_dtype
from prism_dsl.lang.check import load
from prism_dsl.lang.printer import print_program
from prism_dsl.pipeline import emulation
from prism_dsl.pipeline.build import BuildOptions, build, check_inputs, emulate, plan_of, reference_outputs, rtol_of
from prism_dsl.prove.rules import default_files, load_library
from prism_dsl.search.driver import search
from test_codegen import H100, needs_cxx

MLP = """dims n = 8, d = 32, f = 128

program mlp(X: {t}[n, d], W1: {t}[d, f], W2: {t}[f, d]) {{
    kernel fused grid(x = gx, y = gy, z = gz) loop(F) {{
        xt = load X[y, :]
        w1t = load W1[:, z*loop]
        w2t = load W2[z*loop, x]
        store Y[y, x] += acc_sum(gelu_tanh(xt @ w1t) @ w2t)
    }}
    return Y
}}
"""
PARAMS = {"grid": {"gx": 2, "gy": 2, "gz": 4}, "loop": {"F": 2}}  # 4 tiles of Y, each added to by 4 blocks


def mlp(tmp_path, dtype: str = "f16"):
    path = tmp_path / f"mlp_{dtype}.prism"
    path.write_text(MLP.format(t=dtype))
    return load(path).program()


@needs_cxx
def test_a_sum_across_blocks_is_stored_once_in_its_own_type(tmp_path):
    """The f16 output stays f16 (no memset before the launch); the blocks add into an f32 workspace through the
    kernel's last two parameters, one ticket per tile of Y; the emulation under ThreadSanitizer agrees with the
    reference (the tickets order every block's additions before the last block's reads)."""
    program = mlp(tmp_path)
    (kernel,) = kernels_of(program)
    assert stored_dtype(kernel, 0) is DType.F16
    options = BuildOptions(dims={}, archs=(), sanitize="thread", emulate_blocks="all", **PARAMS)
    built = build(program, H100, options)
    (k,) = built.kernels
    assert (k.zero, k.tickets, k.sums) == ((), 4, 8 * 32)
    assert "unsigned* __restrict__ prism_tickets,\n    float* __restrict__ prism_sums)" in k.source
    assert "if (prism::last_of(&prism_tickets[(int)blockIdx.x + (int)blockIdx.y * 2], 4)) {" in k.source
    plan = plan_of(built)
    assert plan["tensors"]["Y"]["dtype"] == "f16" and (plan["kernels"][0]["tickets"], plan["kernels"][0]["sums"]) == (4, 256)
    check = emulate(built, options)
    assert check.passed and check.emulation["sanitizer"] == "thread", check.errors()
    assert 1e-4 < check.outputs["Y"]["max_rel_err"] < 2e-3  # rounded once to f16, not summed in it


@needs_cxx
def test_tickets_that_do_not_order_the_sums_are_a_race_under_the_thread_sanitizer(tmp_path):
    """Taken with a relaxed atomic, the ticket no longer orders the other blocks' additions before the last block's
    reads of the sums: ThreadSanitizer reports the race, in the kernel's own lines."""
    built = build(mlp(tmp_path), H100, BuildOptions(dims={}, archs=(), **PARAMS))
    relaxed = header_source().replace("__ATOMIC_ACQ_REL) == pieces - 1", "__ATOMIC_RELAXED) == pieces - 1")
    inputs = check_inputs(built, 0)
    check = emulation.check(built, plan_of(built), inputs, reference_outputs(built, inputs), seed=0,
                            rtol=rtol_of(built.reference), checked_against="input program", sanitizer="thread",
                            extra="all", header=relaxed)
    assert not check.passed and check.finding["kind"] == "data race", check.finding
    assert any(w.startswith("fused.cu:") for w in check.finding["where"]), check.finding


def test_f64_sums_and_grids_that_sum_nothing_keep_the_plain_store(tmp_path):
    """f64 adds in f64 into the output, zeroed before the launch; a summed axis of one block adds nothing: a plain
    store, no tickets. The model prices the f32 additions and the last blocks' pass over the sums."""
    f64 = build(mlp(tmp_path, "f64"), H100, BuildOptions(dims={}, archs=(), emulate=False, **PARAMS))
    assert [(k.zero, k.tickets, k.sums) for k in f64.kernels] == [(("Y",), 0, 0)]
    one = build(mlp(tmp_path), H100, BuildOptions(dims={}, archs=(), emulate=False, grid={"gx": 2, "gy": 2, "gz": 1},
                                                  loop={"F": 8}))
    assert [(k.zero, k.tickets, k.sums) for k in one.kernels] == [((), 0, 0)] and "prism_sums" not in one.kernels[0].source
    summed = build(mlp(tmp_path), H100, BuildOptions(dims={}, archs=(), emulate=False, **PARAMS))
    plain, added = (b.estimates[0] for b in (one, summed))
    y = 8 * 32  # Y's elements: 2 bytes stored once, against 4 added by each of 4 blocks, read and zeroed (8)
    assert added.dram_bytes - plain.dram_bytes == y * (4 * 4 + 8), (added, plain)


def test_the_search_offers_a_sum_across_blocks_for_sixteen_bit_outputs(tmp_path):
    """GPT-2's MLP without its LayerNorm, in f16: the up-projection's columns across blocks, each block's part of
    the down-projection added into Y, is proved (it was refused where Y is f16, for the type it would change)."""
    path = tmp_path / "plain.prism"
    path.write_text("dims n = 8, d = 64, f = 256\nprogram mlp(X: f16[n, d], W1: f16[d, f], W2: f16[f, d]) {\n"
                    "    Y = gelu_tanh(X @ W1) @ W2\n    return Y\n}\n")
    program = load(path).program()
    result = search(program, load_library(default_files(), defaults=True), H100, jobs=1)
    assert result.complete
    summed = [p for p in result.proved if "store Y[y, x] += acc_sum(gelu_tanh(" in print_program(p)]
    assert summed and all(stored_dtype(kernels_of(p)[0], 0) is DType.F16 for p in summed)
