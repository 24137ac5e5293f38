"""Row sums held in registers through a kernel's loop (prism_dsl/backend/row_parts.py): an RMSNorm folded
into a projection sums its squares without shuffles, shared-memory writes or a barrier in the loop, adds
the threads' parts once after it, and agrees with the reference at ragged and tensor-core-sized tiles."""

import re
import shutil
import subprocess

import pytest

from prism_dsl.backend import sass
from test_codegen import H100, ROOT, BuildOptions, build, emulate, load, needs_cxx
from test_kernels import GAIN_BEFORE_PRODUCT

FUSED = ROOT / "programs/fused/rmsnorm_linear.prism"
SEARCHED = ROOT / "programs/rmsnorm_linear.prism"  # the search's form: acc_mean_last(xt * xt)
SEARCHED_FORM = """
dims n = 8, d = 256
program rmsnorm_linear(X: f16[n, d], W: f16[d, d]) {
    kernel fused grid(x = gx) loop(F) {
        xt = load X[:, loop]
        wt = load W[loop, x]
        store Y[:, x] = acc_sum(xt @ wt) / sqrt(acc_mean_last(xt * xt))
    }
    return Y
}
"""


def loop_of(source: str) -> str:
    """The kernel's main loop, from its first line to its end (a pipelined loop: the barrier after it)."""
    start = source.index("for (int it = 0;")
    end = source.find("__syncthreads();  // every thread is done with the loop's buffers", start)
    return source[start:end if end > 0 else source.index("PRISM_PHASE(2)", start)]


def test_the_loop_folds_each_threads_part_of_the_rows_and_adds_them_once_after_it(write):
    """At n = 8 with 128 threads, 16 threads share a row, each reading 8 elements by one 16-byte load per
    pass; the loop has one barrier (its top), no shuffle and no write to the sum's state; after it, 4
    shuffles add a row's parts. The search's form, acc_mean_last(xt * xt), squares in place: no buffer of
    squares."""
    for path in (FUSED, write(SEARCHED_FORM)):
        program = load(path).program()
        options = BuildOptions(dims={"n": 8, "d": 4096}, grid={"gx": 256}, loop={"F": 8}, archs=())
        source = build(program, H100, options).kernels[0].source
        body = loop_of(source)
        assert body.count("__syncthreads()") == 1 and "shfl" not in body and "warp_sum" not in body, body
        assert re.search(r"r_a\d+\[q\] \+= \(?v0\[c\] \* v0\[c\]\)?;", body) and "prism::load8(v0, s_xt + " in body
        assert "16 threads a row" in body and not re.search(r"s_a\d+\[row\] \+=", body)
        after = source[source.index("PRISM_PHASE(2)"):]
        assert [int(o) for o in re.findall(r"part \+= prism::shfl_xor\(part, (\d+)\)", after)] == [8, 4, 2, 1]
        assert "value v" not in source  # x * x is never stored


@needs_cxx
@pytest.mark.parametrize("dims, grid, loop, sanitizer, expect", [
    # 3 rows of 200 (8 of them at once, 16 threads a row over 25 groups of 8: a ragged last pass); one iteration,
    # no pipeline: the barrier after the fold keeps the next iteration's tiles from its reads
    ({"n": 3, "d": 200}, {"gx": 8}, {"F": 1}, "thread", ["if (row >= 3) break;", "if (j8 >= 200) break;", "load8"]),
    # rows of 36 columns: no 16-byte groups, one element at a time, 32 threads a row
    ({"n": 3, "d": 72}, {"gx": 4}, {"F": 2}, "address", ["32 threads a row", "if (j8 >= 36) break;", "scalar"]),
    # 64 rows of a [64, 64] tile on 256 threads (the products' warps): 4 threads a row, 8 adjacent rows per
    # quarter warp, shuffles 16 and 8 lanes apart
    ({"n": 64, "d": 256}, {"gx": 2}, {"F": 4}, "thread", ["PRISM_TID / 8 % 4", "prism::shfl_xor(part, 16);"]),
], ids=["ragged", "scalar", "down-rows"])
def test_row_parts_agree_with_the_reference_under_the_sanitizers(dims, grid, loop, sanitizer, expect):
    program = load(FUSED).program()
    options = BuildOptions(dims=dims, grid=grid, loop=loop, archs=(), sanitize=sanitizer, emulate_blocks="all")
    built = build(program, H100, options)
    source = built.kernels[0].source
    for text in expect:
        assert text == "scalar" or text in source, text
    assert ("prism::load8" in loop_of(source)) == ("scalar" not in expect)
    check = emulate(built, options)
    assert check.passed, check


@needs_cxx
def test_row_parts_read_wgmmas_swizzled_tile_and_agree_with_the_reference():
    """At 128 rows the products run on wgmma, which reads x's tile in its 128-byte swizzle; the row sums read
    the same tile 16 bytes at a time through the swizzle (2 threads a row, 8 rows per quarter warp)."""
    from prism_dsl.backend.launch import CodegenConfig

    program = load(FUSED).program()
    options = BuildOptions(dims={"n": 128, "d": 512}, grid={"gx": 4}, loop={"F": 8}, archs=(), sanitize="address",
                           codegen=CodegenConfig(wgmma=True), emulate_blocks="all")
    built = build(program, H100, options)
    kernel = built.kernels[0]
    assert kernel.wgmma and "^ i0 % 8) * 8" in loop_of(kernel.source) and "prism::load8(v0" in loop_of(kernel.source)
    check = emulate(built, options)
    assert check.passed, check


@pytest.mark.skipif(shutil.which("nvcc") is None or not sass.available(),
                    reason="needs nvcc on the PATH and cuobjdump (pip install -e '.[sass]')")
@pytest.mark.parametrize("dims, grid, loop", [
    ({"n": 8, "d": 4096}, {"gx": 256}, {"F": 8}),
    ({"n": 128, "d": 1024}, {"gx": 8}, {"F": 16}),
], ids=["decode", "prefill"])
def test_the_compiled_loop_sums_squares_from_16_byte_loads_with_no_shuffle_and_one_barrier(dims, grid, loop,
                                                                                          tmp_path):
    from prism_dsl.backend.cuda_runtime import NVCC_OPTIONS
    from prism_dsl.backend.nvcc import kernel_arch, nvcc_path, write_sources

    program = load(FUSED).program()
    kernel = build(program, H100, BuildOptions(dims=dims, grid=grid, loop=loop, archs=())).kernels[0]
    write_sources([kernel], tmp_path)
    done = subprocess.run([nvcc_path(), "-cubin", f"-arch={kernel_arch(kernel, 'sm_90')}", *NVCC_OPTIONS,
                           "-o", "k.cubin", kernel.file], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    listing = sass.disassemble(tmp_path / "k.cubin")
    hot = sass.hot_loop(listing)
    ops = sass.instructions(listing)[0][hot.start:hot.end + 1]
    assert hot.counts["SHFL"] == 0 and hot.counts["STS"] == 0 and hot.counts["BAR"] == 1, hot.counts
    assert hot.counts["FFMA"] >= 32 and ops.count("LDS.128") * 8 >= hot.counts["FFMA"], (ops, hot.counts)
    assert "warning" not in done.stderr, done.stderr


@needs_cxx
def test_online_softmax_sums_its_row_in_registers_rescaled_each_iteration():
    """FlashDecoding's partial kernel at one query: each thread rescales its part of the row sum by the
    iteration's factor and adds its share of exp(s - max), with no shuffle and no barrier after it; the parts
    are added once after the loop, into the sum the piece stores. The warp that finds a row's new max writes
    its exp(s - max) too, with no barrier between. Emulated against the reference under ThreadSanitizer
    (test_codegen's sixteen-stage combine runs the same kernel under each sanitizer)."""
    sanitizer = "thread"
    program = load(ROOT / "programs/fused/attention.decoding.prism").program()
    options = BuildOptions(dims={"b": 1, "h": 2, "kv": 1024, "dh": 64}, grid={"gb": 1, "gh": 2, "S": 4},
                           loop={"F": 4}, archs=(), sanitize=sanitizer, emulate_blocks="all")
    built = build(program, H100, options)
    source = next(k for k in built.kernels if k.name == "partial").source
    body = loop_of(source)
    assert re.search(r"r_a\d+\[q\] \*= s_a\d+_scale\[row\];", body) and "warp_sum" not in body
    assert re.search(r"s_a\d+_p\[j\] = prism::exp_minus\(s_v\d+\[j\], part\);", body) and "p = exp(" not in body
    assert body.count("__syncthreads()") == 3  # the loop's top, after the scores, and after the max and p
    check = emulate(built, options)
    assert check.passed, check


ROWWISE = """
dims n = 96, d = 128
program rows(X: f16[n, d]) {
    A = rms_norm(X)
    B = softmax(X)
    C = layer_norm(X, 0.00001)
    D = rms_norm(X, 0.001)
    return A, B, C, D
}
"""


@needs_cxx
@pytest.mark.parametrize("dims, blocks, sanitizer, expect", [
    # 12 rows a block of 128 threads: 16 lanes a row over its 16 groups of 8, 8 rows at once, so the second
    # round of rows is half past the last (those lanes read row 0, take part in the shuffles, write nothing)
    ({"n": 96, "d": 128}, 8, "thread", ["16 threads a row, 8 elements a load", "for (int q = 0; q < 2; ++q)",
                                        "const bool live = g + q * 8 < 12;", "load8"]),
    # 3 rows of 200 a block: 25 groups of 8 for 16 lanes, the second sweep cut short
    ({"n": 6, "d": 200}, 2, "address", ["16 threads a row", "if (j8 >= 200) break;", "g + q * 8 < 3", "load8"]),
    # 5 rows of 36 a block: no 16-byte groups, element by element, 32 lanes a row, 4 rows at once
    ({"n": 5, "d": 36}, 1, "address", ["32 threads a row", "if (j8 >= 36) break;", "g + q * 4 < 5"]),
], ids=["rows-past-the-last", "ragged", "scalar"])
def test_row_wise_ops_take_a_row_by_a_group_of_threads_and_agree_with_the_reference(write, dims, blocks, sanitizer,
                                                                                    expect):
    """rms_norm, softmax, layer_norm and rms_norm with an epsilon, each a kernel of its own: every pass over a row
    is shared by its lanes, their parts added by shuffles (`row_parts.rowwise`), and the rows stored 16 bytes
    a thread where they are multiples of 8 elements."""
    program = load(write(ROWWISE)).program()
    options = BuildOptions(dims=dims, params={f"gx_{o}": blocks for o in "ABCD"}, archs=(), sanitize=sanitizer,
                           emulate_blocks="all")
    built = build(program, H100, options)
    assert len(built.kernels) == 4, [k.name for k in built.kernels]
    for kernel in built.kernels:
        for text in expect:
            assert text in kernel.source, (kernel.name, text)
        assert ("load8" in kernel.source) == ("load8" in expect), kernel.name
        assert ("prism::store16" in kernel.source) == (dims["d"] % 8 == 0), kernel.name
        assert "prism::shfl_xor(" in kernel.source, kernel.name
    check = emulate(built, options)
    assert check.passed, check


@needs_cxx
def test_the_emulation_refuses_a_16_byte_store_that_is_not_16_byte_aligned(write, tmp_path, capsys):
    """A store16 moved by one element (as a kernel whose rows were not multiples of 8 would make it) is
    stopped with the line and thread, where the GPU would fault."""
    from prism_dsl.cli.main import main

    out = tmp_path / "out"
    assert main(["compile", str(write(ROWWISE)), "--search", "none", "-o", str(out), "--arch", "none",
                 "--dims", "n=8,d=64", "--no-emulate"]) == 0
    cu = next(out.glob("rms_norm_A*.cu"))
    text = cu.read_text()
    assert text.count("prism::store16(g_A + ") == 1
    cu.write_text(text.replace("prism::store16(g_A + ", "prism::store16(g_A + 1 + "))
    capsys.readouterr()
    assert main(["verify", str(out)]) == 1
    said = capsys.readouterr().out
    assert "a 16-byte store to" in said and "must be 16-byte aligned" in said and cu.name in said, said


def sass_of(kernel, tmp_path) -> list[str]:
    """A built kernel's SASS for sm_90 (its main function's instructions), compiled as the runtime compiles it,
    with no warning."""
    from prism_dsl.backend.cuda_runtime import NVCC_OPTIONS
    from prism_dsl.backend.nvcc import kernel_arch, nvcc_path, write_sources

    write_sources([kernel], tmp_path)
    done = subprocess.run([nvcc_path(), "-cubin", f"-arch={kernel_arch(kernel, 'sm_90')}", *NVCC_OPTIONS,
                           "-o", "k.cubin", kernel.file], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr
    return sass.instructions(sass.disassemble(tmp_path / "k.cubin"))[0]


@pytest.mark.skipif(shutil.which("nvcc") is None or not sass.available(),
                    reason="needs nvcc on the PATH and cuobjdump (pip install -e '.[sass]')")
def test_the_compiled_rms_norm_reads_and_writes_16_bytes_at_a_time(write, tmp_path):
    """The queries' RMSNorm ahead of attention at prefill (rows of 128): its SASS reads the tile by LDS.128,
    adds a row's lanes by shuffles, and stores by STG.E.128, with no 16-bit shared load or global store."""
    program = load(write("dims b = 1, h = 16, q = 4096, dh = 128\nprogram norm(Q: f16[b, h, q, dh]) {\n"
                         "    O = rms_norm(Q)\n    return O\n}\n")).program()
    ops = sass_of(build(program, H100, BuildOptions(archs=())).kernels[0], tmp_path)
    assert "LDS.U16" not in ops and "STG.E.U16" not in ops, sorted(set(ops))
    assert ops.count("LDS.128") >= 2 and ops.count("SHFL.BFLY") >= 4 and ops.count("STG.E.128") >= 1, sorted(set(ops))




@needs_cxx
@pytest.mark.parametrize("dims, loop, sanitizer, vector", [
    ({"n": 8, "d": 512, "e": 256}, {"F": 2}, "thread", True),  # rows of 256: 8 elements a thread
    ({"n": 3, "d": 96, "e": 64}, {"F": 2}, "address", True),  # 3 rows of 48: 18 groups of 8 for 128 threads
    ({"n": 3, "d": 36, "e": 64}, {"F": 3}, None, False),  # rows of 12: no 16-byte groups (the form as before)
], ids=["wide", "ragged", "scalar"])
def test_an_element_wise_value_takes_8_elements_a_thread_from_16_byte_loads(write, dims, loop, sanitizer, vector):
    """A gain applied to x's tile in the loop (llama's QKV projection): both 16-bit tiles read 16 bytes at a time
    (the gain's [d] tile broadcast over the rows) and the 16-bit result stored 16 bytes at a time, where the
    rows are multiples of 8; element by element where they are not. The emulation agrees under a sanitizer."""
    program = load(write(GAIN_BEFORE_PRODUCT)).program()
    options = BuildOptions(dims=dims, grid={"gx": 2}, loop=loop, archs=(), sanitize=sanitizer, emulate_blocks="all")
    built = build(program, H100, options)
    body = loop_of(built.kernels[0].source)
    step = body[body.index("// (gt * xt)"):]
    step = step[:step.index("__syncthreads()")]
    assert ("8 elements a thread, 16-byte loads" in step) == vector, step
    if vector:
        assert "prism::load8(v0, s_gt + i1);" in step and "prism::store16(s_v" in step, step
    check = emulate(built, options)
    assert check.passed, check


@needs_cxx
@pytest.mark.parametrize("dh, sanitizer, vector", [(48, "address", True), (40, None, False)],
                         ids=["dh48", "half-row-of-20"])
def test_rope_reads_its_partner_half_as_a_16_byte_group(dh, sanitizer, vector):
    """Causal attention's RoPE of the query and key tiles, 8 elements a thread: x, the two tables and x's
    partner group half a row away (a whole 16-byte group where the half row is a multiple of 8), each by one
    16-byte load (at dh = 48 too: half rows of 24 are 3 groups); at dh = 40 (half rows of 20, so a group would
    straddle the halves) element by element. The emulation agrees, under AddressSanitizer where the partner
    group is read."""
    program = load(ROOT / "programs/fused/causal_attention.prism").program()
    options = BuildOptions(dims={"b": 1, "h": 1, "q": 64, "kv": 64, "dh": dh}, archs=(), sanitize=sanitizer,
                           emulate_blocks="all")
    built = build(program, H100, options)
    source = built.kernels[0].source
    half = dh // 2
    partner = f"prism::load8(p0, s_kt + i2 * {dh + 8} + (i3 < {half} ? i3 + {half} : i3 - {half}));"
    assert (partner in loop_of(source)) == vector, source
    assert ("((i3 + c) < %d ? -p0[c] : p0[c])" % half in source) == vector
    check = emulate(built, options)
    assert check.passed, check
