"""Sums across blocks finished in their launch (`backend.sums`): a `+=` store kept in its own type, its blocks'
f32 additions in a workspace that the tile's last block stores and zeroes; what the thread sanitizer finds where
the tickets do not order the additions; and the element-wise work after such a sum done as it is stored
(`kernels.finishing`: a residual after an MLP), guarded where it reads an input in place. The search's use of
them: tests/test_search.py (GPT-2's MLP, an MLP with its residual); the runtime's: tests/test_runtime.py."""

from __future__ import annotations

from prism_dsl.cli.main import main
from prism_dsl.ir.nodes import DType, Node
from prism_dsl.ir.shapes import build as build_node
from prism_dsl.kernels.kernel import kernels_of, stored_dtype
from prism_dsl.kernels.lower import lower
from prism_dsl.lang.check import load
from prism_dsl.lang.printer import print_program
from prism_dsl.pipeline.build import BuildOptions, build, emulate, plan_of
from prism_dsl.search.generate import Sketch
from prism_dsl.search.maps import index_classes, sums_over
from test_codegen import H100, needs_cxx
from test_tails import race_with_relaxed_tickets

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
    kernel's last two parameters, 4 sums a thread at once, one ticket per tile of Y; the emulation under ThreadSanitizer agrees with the
    reference (the tickets order every block's additions before the last block's reads)."""
    program = mlp(tmp_path)
    (kernel,) = kernels_of(program)
    assert stored_dtype(kernel, 0) is DType.F16
    options = BuildOptions(dims={}, archs=(), sanitize="thread", emulate_blocks="all", **PARAMS)
    built = build(program, H100, options)
    (k,) = built.kernels
    assert (k.zero, k.tickets, k.sums) == ((), 4, 8 * 32)
    assert "unsigned* __restrict__ prism_tickets,\n    float* __restrict__ prism_sums)" in k.source
    assert "if (prism::last_of(&prism_tickets[blockIdx.x + blockIdx.y * 2], 4)) {" in k.source
    # 4 adjacent sums a thread by one 16-byte reduction (REDG.E.ADD.F32x4 on sm_90), each element atomic on its own
    assert "4 sums a thread, one 16-byte atomic add" in k.source and "prism::atomic_add4(&prism_sums[" in k.source
    plan = plan_of(built)
    assert plan["tensors"]["Y"]["dtype"] == "f16" and (plan["kernels"][0]["tickets"], plan["kernels"][0]["sums"]) == (4, 256)
    check = emulate(built, options)
    assert check.passed and check.emulation["sanitizer"] == "thread", check.errors()
    assert 1e-4 < check.outputs["Y"]["max_rel_err"] < 2e-3  # rounded once to f16, not summed in it


@needs_cxx
def test_tickets_that_do_not_order_the_sums_are_a_race_under_the_thread_sanitizer(tmp_path):
    """Taken with a relaxed atomic, the ticket no longer orders the other blocks' additions before the last block's
    reads of the sums: ThreadSanitizer reports the race, in the kernel's own lines."""
    race_with_relaxed_tickets(build(mlp(tmp_path), H100, BuildOptions(dims={}, archs=(), **PARAMS)), "fused.cu")


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


RESIDUAL = MLP.format(t="f16").replace("X: f16[n, d], W1", "X: f16[n, d], B: f16[d], W1").replace(
    "store Y[y, x] +=", "store T[y, x] +=").replace("    return Y", "    Y = (X + T) * 0.5 + B\n    return Y")


@needs_cxx
def test_the_work_after_a_sum_across_blocks_is_done_as_it_is_stored(tmp_path):
    """`(X + T) * 0.5 + B` after the sum T: one kernel, whose last block of each tile applies the chain to the
    finished sum (B broadcast along the rows), checked under ThreadSanitizer; the model reads X and B once more."""
    path = tmp_path / "residual.prism"
    path.write_text(RESIDUAL)
    program = load(path).program()
    (kernel,) = kernels_of(lower(program))
    (store,) = kernel.stores
    assert store.name == "Y" and store.add and store.then is not None
    assert [n.attr for n in kernel.inputs] == ["X", "W1", "W2", "B"]  # X loaded already; B for the chain alone
    options = BuildOptions(dims={}, archs=(), sanitize="thread", emulate_blocks="all", **PARAMS)
    built = build(program, H100, options)
    (k,) = built.kernels
    assert "then (((X + sum) * 0.5) + B)" in k.source and "prism::to_f(g_B[blockIdx.x * 16 + i1])" in k.source
    check = emulate(built, options)
    assert check.passed, check.errors()


@needs_cxx
def test_an_input_the_chain_reads_in_place_is_guarded_past_the_callers_rows(tmp_path):
    """Rows built past the caller's 13 (16): X, read as the caller passes it, is read only where its rows are;
    AddressSanitizer finds no read past its end."""
    path = tmp_path / "residual.prism"
    path.write_text(RESIDUAL)
    options = BuildOptions(dims={"n": 16}, archs=(), grid={"gx": 1, "gy": 2, "gz": 4}, loop={"F": 2}, padded={"n": 13},
                           sanitize="address", emulate_blocks="all")
    built = build(load(path).program(), H100, options)
    assert "(blockIdx.y * 8 + i0 < 13 ? prism::to_f(g_X[(blockIdx.y * 8 + i0) * 32 + i1]) : real(0))" in \
        built.kernels[0].source
    check = emulate(built, options)
    assert check.passed, check.errors()


def test_work_that_another_reader_or_value_needs_keeps_its_kernel(tmp_path):
    """The sum also returned, read twice, or the chain reading a computed value: the chain stays a kernel of its
    own, and so does an f64 sum's (added in the output itself)."""
    for old, new in (("    return Y", "    return Y, T"), ("(X + T) * 0.5 + B", "(X + T) * T"),
                     ("(X + T) * 0.5 + B", "(X * X + T) * 0.5")):
        path = tmp_path / "variant.prism"
        path.write_text(RESIDUAL.replace(old, new))
        lowered = lower(load(path).program())
        assert len(kernels_of(lowered)) == 2 and not any(s.then for k in kernels_of(lowered) for s in k.stores), new
    path.write_text(RESIDUAL.replace("f16", "f64"))
    assert len(kernels_of(lower(load(path).program()))) == 2


def test_only_sums_over_the_blocks_pieces_are_summed_across_them():
    """`search.maps.sums_over`, the search's screen before its numeric check: gelu_tanh(x @ w1) @ w2 adds up across
    blocks that split f (the second product contracts it), not across blocks that split d (gelu of a partial product);
    a term the pieces do not split (+ x @ w3, added again by every block), or a partial mean, never."""
    x, w1, w2, w3 = (Node("tile", (), name, DType.F16, shape)
                     for name, shape in (("x", (8, 64)), ("w1", (64, 256)), ("w2", (256, 64)), ("w3", (64, 64))))
    mlp = build_node("matmul", [build_node("gelu_tanh", [build_node("matmul", [x, w1])]), w2])
    plus = build_node("add", [mlp, build_node("matmul", [x, w3])])
    mean = build_node("mean", [build_node("matmul", [x, w1])], [1])
    for out, tiles in ((mlp, (x, w1, w2)), (plus, (x, w1, w2, w3)), (mean, (x, w1))):
        uf, _ = index_classes(Sketch((), tiles, (out,), False))
        f, d = uf.find((w1, -1)), uf.find((w1, -2))
        assert (sums_over(out, f, uf), sums_over(out, d, uf)) == ((True, False) if out is mlp else (False, False))


def test_a_lowered_chain_is_printed_after_its_kernel_and_verifies_from_its_directory(tmp_path, capsys):
    """The language has no `then`: the lowered program is printed with the chain after its kernel, over the sum
    stored as Y_sum, and reads back to the same kernel; a compiled directory's program copy so written is what
    `prismc verify` rebuilds and checks its .cu files against."""
    path = tmp_path / "residual.prism"
    path.write_text(RESIDUAL)
    lowered = lower(load(path).program())
    text = print_program(lowered)
    assert "store Y_sum[y, x] += acc_sum(" in text and "    Y = (X + Y_sum) * 0.5 + B\n" in text, text
    again = tmp_path / "again.prism"
    again.write_text(text)
    assert kernels_of(lower(load(again).program())) == kernels_of(lowered)
    out = tmp_path / "out"
    assert main(["compile", str(path), "--search", "none", "--arch", "none", "-o", str(out)]) == 0
    assert main(["verify", str(out)]) == 0
    assert "Y (256 elements, kernel fused): agrees with the reference" in capsys.readouterr().out


TWO_SUMS = """dims n = 8, d = 64, e = 64
program two(X: f16[n, d], W: f16[d, e], A: f16[n, e], M: f16[e, d], B: f16[e]) {
    kernel k grid(x = gx, y = gy, z = gz) {
        xt = load X[y, z]
        wt = load W[z, x]
        at = load A[y, x]
        mt = load M[x, z]
        store T[y, x] += xt @ wt
        store U[y, z] += at @ mt
    }
    Y = T + B
    Z = relu(U)
    return Y, Z
}
"""


@needs_cxx
def test_two_sums_over_different_axes_each_finish_when_blocks_are_sampled(tmp_path):
    """T summed over z, U over x, in one kernel (two groups of tickets, each with its chain): sampled, the emulation
    runs every block along both axes for the places of y it takes, so every tile it checks is finished."""
    path = tmp_path / "two.prism"
    path.write_text(TWO_SUMS)
    options = BuildOptions(dims={}, archs=(), grid={"gx": 2, "gy": 4, "gz": 4}, emulate_blocks=1)
    built = build(load(path).program(), H100, options)
    (k,) = built.kernels
    assert (k.tickets, k.sums) == (2 * 4 + 4 * 4, 8 * 64 * 2)
    check = emulate(built, options)
    assert check.passed and not check.emulation["whole_grid"], check.errors()


def test_a_chain_of_f64_stays_a_kernel_of_its_own(tmp_path):
    """An f64 bias makes the chain's result f64, which blocks add in the output itself: the chain is not taken into
    the store (it was, and dropped there: the raw sum was stored)."""
    path = tmp_path / "f64.prism"
    path.write_text(RESIDUAL.replace("B: f16[d]", "B: f64[d]").replace("(X + T) * 0.5 + B", "T + B"))
    kernels = kernels_of(lower(load(path).program()))
    assert len(kernels) == 2 and not any(s.then for k in kernels for s in k.stores)
