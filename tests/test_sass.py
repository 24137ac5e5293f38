"""The SASS reader (prism_dsl/backend/sass.py) on a hand-written listing, and on the compiled code of a
generated prefill kernel: its hot loop runs on tensor cores (wgmma, or mma.sync fed by ldmatrix), with async
copies, no spills."""

import re
import shutil

import pytest

from prism_dsl.backend import sass
from test_codegen import H100, ROOT, BuildOptions, build, load

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
        /*0020*/                   LDSM.16.M88.4 R8, [R6] ;
        /*0030*/                   HMMA.16816.F32 R12, R8, R10, R12 ;
        /*0040*/                   HMMA.16816.F32 R16, R8, R11, R16 ;
        /*0050*/               @P0 BRA 0x20 ;
        /*0060*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0070*/              @!P1 BRA 0x10 ;
        /*0080*/                   EXIT ;
"""


def test_loops_are_found_from_backward_branches_and_counted_by_class():
    found = sass.loops(LISTING)
    assert [(l.start, l.end) for l in found] == [(2, 5), (1, 7)]
    inner = found[0].counts
    assert (inner["LDSM"], inner["HMMA"], inner["LDGSTS"], inner["total"]) == (1, 2, 0, 4)
    hot = sass.hot_loop(LISTING)
    assert (hot.start, hot.counts["LDGSTS"], hot.counts["BAR"], hot.counts["HMMA"]) == (1, 1, 1, 2)
    assert sass.hot_loop("no code") is None


def test_an_epilogue_loop_of_many_ffma_does_not_outrank_the_loop_that_streams_the_tiles():
    epilogue = "".join(f"        /*{0x90 + 16 * i:04x}*/                   FFMA R1, R2, R3, R1 ;\n" for i in range(8))
    listing = LISTING.replace("        /*0080*/                   EXIT ;\n",
                              epilogue + "        /*0110*/               @P2 BRA 0x90 ;\n        /*0120*/   EXIT ;\n")
    assert max(l.counts["FFMA"] for l in sass.loops(listing)) == 8
    hot = sass.hot_loop(listing)
    assert (hot.start, hot.counts["HMMA"], hot.counts["FFMA"]) == (1, 2, 0)


def test_a_retry_laid_out_after_the_exit_is_not_a_loop():
    """ptxas puts the retry of an mbarrier's try-wait after the kernel's EXIT, branching back into the loop:
    that range holds the loop's tail and the code after it, and is not a loop."""
    stub = ("        /*0090*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2], R3 ;\n"
            "        /*00a0*/              @!P0 BRA 0x90 ;\n"
            "        /*00b0*/                   BRA 0x30 ;\n")
    listing = LISTING + stub
    assert [(l.start, l.end) for l in sass.loops(listing)] == [(2, 5), (1, 7), (9, 10)]
    assert (sass.hot_loop(listing).start, sass.hot_loop(listing).end) == (1, 7)
    # a predicated EXIT inside a loop (threads leaving early) is not the kernel's end
    some = listing.replace("        /*0060*/                   BAR.SYNC", "        /*0060*/               @P2 EXIT ;\n"
                           "        /*0068*/                   BAR.SYNC")
    assert [(l.start, l.end) for l in sass.loops(some)] == [(2, 5), (1, 8), (10, 11)]


def test_instructions_predicated_never_to_run_are_not_counted():
    filler = "        /*0025*/                  @!PT LDS RZ, [RZ] ;\n"
    listing = LISTING.replace("        /*0030*/", filler + "        /*0030*/")
    inner = sass.loops(listing)[0].counts
    assert (inner["LDS"], inner["HMMA"], inner["total"]) == (0, 2, 4)


@pytest.mark.skipif(shutil.which("nvcc") is None or not sass.available(),
                    reason="needs nvcc on the PATH and cuobjdump (pip install -e '.[sass]')")
@pytest.mark.parametrize("name, dims, grid, loop, wgmma, tma", [
    ("rmsnorm_linear", {"n": 128, "d": 1024}, {"gx": 8}, {"F": 16}, True, False),
    ("rmsnorm_linear", {"n": 128, "d": 1024}, {"gx": 8}, {"F": 16}, True, True),
    ("rmsnorm_linear", {"n": 128, "d": 1024}, {"gx": 8}, {"F": 16}, False, False),
    ("attention", {"b": 1, "h": 2, "q": 128, "kv": 512, "dh": 128}, {"gb": 1, "gh": 2, "gq": 1}, {"F": 8}, True, True),
], ids=["wgmma", "wgmma-tma", "mma.sync", "attention-tma"])
def test_a_prefill_kernel_runs_its_hot_loop_on_tensor_cores_with_async_copies(name, dims, grid, loop, wgmma, tma,
                                                                              tmp_path):
    """On wgmma (sm_90a) the hot loop issues HGMMA with no ldmatrix and no HMMA, and waits while one batch
    is still pending without ptxas serializing the instructions: the products' batch of the iteration
    before, or online softmax's p @ v beside the next scores' softmax (attention's two warpgroups taking
    turns at named barriers, the stages paced by mbarriers); its tiles come by cp.async (LDGSTS), or with
    --tma by TMA (UTMALDG, no LDGSTS; one thread's, at an mbarrier that counts their bytes: a copy warp's, in a
    loop of its own). On mma.sync, 4
    HMMA or more per LDSM, and cp.async."""
    import subprocess

    from prism_dsl.backend.cuda_runtime import NVCC_OPTIONS
    from prism_dsl.backend.launch import CodegenConfig
    from prism_dsl.backend.nvcc import kernel_arch, nvcc_path, write_sources

    program = load(ROOT / f"programs/fused/{name}.prism").program()
    options = BuildOptions(dims=dims, grid=grid, loop=loop, archs=(), codegen=CodegenConfig(wgmma=wgmma, tma=tma))
    kernel = build(program, H100, options).kernels[0]  # 128 x 128 output tiles or 128 query rows, k steps of 64
    assert kernel.wgmma == wgmma
    write_sources([kernel], tmp_path)
    done = subprocess.run([nvcc_path(), "-cubin", f"-arch={kernel_arch(kernel, 'sm_90')}", *NVCC_OPTIONS, "-Xptxas",
                           "-v", "-o", "k.cubin", kernel.file], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "0 bytes spill stores" in done.stderr
    listing = sass.disassemble(tmp_path / "k.cubin")
    hot = sass.hot_loop(listing).counts
    if wgmma:
        assert hot["HGMMA"] > 0 and hot["HMMA"] == hot["LDSM"] == 0, hot
        assert "serialized" not in done.stderr and "WARPGROUP.DEPBAR.LE gsb0, 0x1" in listing
        # each wgmma's descriptors made in uniform registers (`prism::warp_uniform`, `wgmma_desc_plus`): not
        # moved into them one by one (R2UR), as they were from a warpgroup index nvcc took to differ by thread
        ops, _, _ = sass.instructions(listing)
        loop = sass.hot_loop(listing)
        assert sum(op.startswith("R2UR") for op in ops[loop.start: loop.end + 1]) <= 1
    if tma:
        assert hot["LDGSTS"] == hot["UTMALDG"] == 0 and "UTMALDG" in listing, hot
        assert "SYNCS.ARRIVE.TRANS64 RZ" in listing and "SYNCS.PHASECHK.TRANS64.TRYWAIT" in listing  # expect_tx, wait
        # the copies are a copy warp's, in a loop of their own: rmsnorm_linear's products' loop passes no barrier,
        # and is matched to the source's by its mbarrier wait (`sass.issued`); attention's, its warpgroups' turns
        assert (hot["BAR"] == 0) == (name == "rmsnorm_linear") and sass.issued(listing, kernel.source).loop > 0
    else:
        assert hot["LDGSTS"] > 0 and hot["UTMALDG"] == 0, hot
    if name == "attention":  # two warpgroups taking turns: named barriers, the stages paced by mbarriers
        assert hot["HGMMA"] == 13 and hot["BAR"] == 2, hot
        assert all(op in listing for op in ("BAR.SYNC.DEFER_BLOCKING R", "BAR.ARV R", "UTMALDG.4D",
                                            "SYNCS.PHASECHK.TRANS64.TRYWAIT", "SYNCS.ARRIVE.TRANS64.A1T0"))
    if not wgmma:
        assert hot["HMMA"] >= 4 * hot["LDSM"] > 0, hot


def test_ptxas_serializing_wgmma_is_kept_in_the_figures():
    """ptxas's note that it made each wgmma wait for the one before is kept with the kernel's figures (the
    summary and the static report print it): the batch then runs one product at a time."""
    from prism_dsl.backend.nvcc import ptxas_figures

    text = ("ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
            "to program dependence on compiler-inserted WG.DP in divergent path in the function 'prism_fused'\n"
            "ptxas info    : Used 208 registers, used 1 barriers\n")
    figures = ptxas_figures(text)
    assert figures["registers"] == 208 and figures["wgmma_serialized"].endswith("'prism_fused'")
    assert "wgmma_serialized" not in ptxas_figures("ptxas info    : Used 40 registers\n")



def test_one_compile_of_several_kernels_gives_each_its_own_figures_and_sass():
    """A program's kernels go through nvcc and cuobjdump once (`nvcc_check`'s translation units): ptxas's lines
    and the listing are split by function, and a note that names its function goes to it wherever it sits."""
    from prism_dsl.backend.nvcc import ptxas_by_function

    text = ("ptxas info    : 0 bytes gmem\n"
            "ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
            "to program dependence on compiler-inserted WG.DP in divergent path in the function 'prism_b'\n"
            "ptxas info    : Compiling entry function 'prism_a' for 'sm_90a'\n"
            "    0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\n"
            "ptxas info    : Used 40 registers, used 1 barriers\n"
            "ptxas info    : Compiling entry function 'prism_b' for 'sm_90a'\n"
            "ptxas info    : Used 168 registers, used 1 barriers, 1024 bytes smem\n")
    figures = ptxas_by_function(text)
    assert (figures["prism_a"]["registers"], figures["prism_a"]["spill_stores"], figures["prism_b"]["registers"],
            figures["prism_b"]["static_smem"], figures["prism_b"]["spill_stores"]) == (40, 8, 168, 1024, 0)
    assert "wgmma_serialized" not in figures["prism_a"] and figures["prism_b"]["wgmma_serialized"].endswith("'prism_b'")
    listing = ("\n\tcode for sm_90\n\t\tFunction : prism_a\n" + LISTING + "\t\t..........\n\n\t\tFunction : prism_b\n"
               "        /*0000*/                   EXIT ;\n")
    each = sass.functions(listing)
    assert list(each) == ["prism_a", "prism_b"] and sass.hot_loop(each["prism_a"]).counts["HMMA"] == 2
    assert sass.count(sass.instructions(each["prism_b"])[0])["total"] == 1


# A loop of one barrier per pass (instructions 1-7) with a branch forward over two of its instructions.
SKIPPING = LISTING.replace("        /*0060*/                   BAR.SYNC",
                           "        /*0058*/               @P3 BRA 0x68 ;\n"
                           "        /*005c*/                   FFMA R1, R2, R3, R1 ;\n"
                           "        /*0060*/                   BAR.SYNC").replace(
                           "        /*0070*/              @!P1 BRA 0x10 ;",
                           "        /*0068*/                   IADD3 R1, R1, 0x1, RZ ;\n"
                           "        /*0070*/              @!P1 BRA 0x10 ;")
MAIN_LOOP = """    for (int it = 0; it < {n}; ++it) {{
        prism::cp_async_wait<1>();
        {barriers}
        for (int e = PRISM_TID; e < 64; e += kThreads) {{ s_x[e] = 0; }}
    }}
    __syncthreads();  // after the loop: not one of its barriers
"""


def test_the_fewest_instructions_a_warp_issues_skip_what_a_branch_jumps_over_and_take_a_nested_loop_once():
    assert sass.fewest(LISTING) == 9  # straight through: back branches not taken, EXIT counted
    hot = sass.hot_loop(SKIPPING)
    assert (hot.start, hot.counts["total"], hot.counts["BAR"]) == (1, 10, 1)
    assert sass.fewest(SKIPPING, hot.start, hot.end) == 8  # the branch over FFMA and BAR is taken
    assert sass.fewest(SKIPPING.replace("@P3 BRA 0x68", "@!PT BRA 0x68")) == 11  # never taken, never issued
    # a branch that always jumps: what it jumps over is not on any path
    assert sass.fewest(SKIPPING.replace("@P3 BRA 0x68", "BRA 0x68")) == 10
    # a branch that also tests a predicate of its own (`@!P0 BRA P1, target`, `BRA !P1, target`) may fall through
    for form in ("@!P0 BRA P1, 0x68", "BRA !P1, 0x68", "@P3 BRA !UP0, 0x68"):
        assert sass.fewest(SKIPPING.replace("@P3 BRA 0x68", form), hot.start, hot.end) == 8, form
    assert sass.fewest(SKIPPING.replace("@P3 BRA 0x68", "BRA PT, 0x68")) == 10  # always taken


@pytest.mark.parametrize("n, barriers, expected", [
    (16, 1, sass.Issued(8, 2, 8)),  # one pass per iteration: the loop's fewest, and the rest once
    (16, 2, None),                  # the SASS loop passes fewer barriers than an iteration has: not matched
    (1, 1, sass.Issued(0, 10)),     # one iteration: no loop in the source, everything once
])
def test_what_a_warp_issues_is_matched_to_the_sources_main_loop_by_its_barriers(n, barriers, expected):
    source = MAIN_LOOP.format(n=n, barriers=" ".join(["__syncthreads();"] * barriers))
    assert sass.main_loop_barriers(source) == (None if n == 1 else barriers)
    assert sass.issued(SKIPPING, source) == expected
    twice = SKIPPING.replace("        /*0068*/", "        /*0064*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;\n"
                             "        /*0068*/")
    if n > 1 and barriers == 1:  # two barriers per pass where an iteration has one: nvcc unrolled it twice
        assert sass.issued(twice, source) == sass.Issued(4, 2, 4)


def test_a_loop_paced_by_mbarriers_alone_is_matched_by_its_waits():
    """A copy warp's computing threads pass no barrier in their main loop (`launch.Layout.copy_warp`): its SASS loop is
    matched to the source's by the mbarrier waits a pass holds (SYNCS.PHASECHK), against the source's per iteration;
    two a pass where an iteration has one: nvcc unrolled it twice. A loop with neither stays unmatched."""
    source = MAIN_LOOP.format(n=16, barriers="prism::mbarrier_wait(&full[it % 4], it / 4 % 2);")
    assert sass.main_loop_barriers(source) == 0
    wait = "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2+URZ], R3 ;"
    paced = SKIPPING.replace("BAR.SYNC.DEFER_BLOCKING 0x0 ;", wait)
    assert sass.issued(paced, source) == sass.Issued(8, 2, 8)
    twice = paced.replace("IADD3 R1, R1, 0x1, RZ ;", wait)
    assert sass.issued(twice, source) == sass.Issued(4, 2, 4)
    assert sass.issued(SKIPPING.replace("BAR.SYNC.DEFER_BLOCKING 0x0 ;", "NOP ;"), source) is None


# A pipelined loop: the copies of the iteration ahead behind a branch (`if (ahead < N)`, not taken on the last
# iterations), then an FFMA behind a guard on the thread index
COPIES_AHEAD = """
        /*0000*/                   MOV R1, R2 ;
        /*0010*/                   FFMA R1, R2, R3, R1 ;
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0030*/               @P2 BRA 0x60 ;
        /*0040*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
        /*0050*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R6.64] ;
        /*0060*/               @P3 BRA 0x80 ;
        /*0070*/                   FFMA R1, R2, R3, R1 ;
        /*0080*/              @!P1 BRA 0x10 ;
        /*0090*/                   EXIT ;
"""


def test_an_iteration_that_copies_ahead_issues_its_copies():
    """The fewest a warp issues skips both branches' code; an iteration that copies tiles ahead issues the
    copies, and still skips the guarded FFMA (the shortest of the paths with the most LDGSTS)."""
    source = MAIN_LOOP.format(n=16, barriers="__syncthreads();")
    assert sass.issued(COPIES_AHEAD, source) == sass.Issued(5, 2, 7)
    assert sass.issued(COPIES_AHEAD, source).as_dict() == {"loop": 5, "once": 2, "copying": 7, "spare": 0}
    assert sass.fewest(COPIES_AHEAD, 1, 8, copying=True) == 7 and sass.fewest(COPIES_AHEAD, 1, 8) == 5
    # a loop whose every path copies: the same both ways
    always = COPIES_AHEAD.replace("@P2 BRA 0x60", "NOP")
    assert sass.issued(always, source).as_dict() == {"loop": 7, "once": 2, "copying": 7, "spare": 0}


# Online softmax's loop on wgmma: the first iteration branches past `p @ v` (no probabilities yet), the
# others issue it; then an FFMA behind a guard on the thread index
PRODUCTS_LATER = """
        /*0000*/                   MOV R1, R2 ;
        /*0010*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0020*/               @P2 BRA 0x60 ;
        /*0030*/                   WARPGROUP.ARRIVE ;
        /*0040*/                   HGMMA.64x64x16.F32 R88, gdesc[UR20].tnspB, RZ, !UPT ;
        /*0050*/                   HGMMA.64x64x16.F32 R88, gdesc[UR20].tnspB, R88 ;
        /*0060*/               @P3 BRA 0x80 ;
        /*0070*/                   FFMA R1, R2, R3, R1 ;
        /*0080*/              @!P1 BRA 0x10 ;
        /*0090*/                   EXIT ;
"""


def test_an_iteration_issues_the_products_a_branch_skips_only_on_the_first():
    """A warp that runs a loop's products runs them on every iteration: the path priced issues the most HGMMA
    (or HMMA), the shortest of those, so the guarded FFMA is still skipped; on the copying iterations too.
    A warp with no product takes the branch past them: `spare` is what it leaves out."""
    source = MAIN_LOOP.format(n=16, barriers="__syncthreads();")
    # BAR, 2 BRA, the batch (arrive and 2 HGMMA), the back branch; 3 of them for the warps with products only
    assert sass.issued(PRODUCTS_LATER, source) == sass.Issued(7, 2, 7, 3)
    assert sass.fewest(PRODUCTS_LATER, 1, 8) == 7 and sass.fewest(PRODUCTS_LATER, 1, 8, products=False) == 4
    mma = PRODUCTS_LATER.replace("HGMMA.64x64x16.F32 R88, gdesc[UR20].tnspB,", "HMMA.16816.F32 R88, R8, R10,")
    assert sass.issued(mma, source) == sass.Issued(7, 2, 7, 3)
    # without the products on that path, the branch past it is the shorter way
    plain = PRODUCTS_LATER.replace("HGMMA.64x64x16.F32 R88, gdesc[UR20].tnspB,", "FFMA R88, R8, R10,")
    assert sass.issued(plain, source) == sass.Issued(4, 2, 4)


# The copies of the iterations ahead as a loop of their own before the main loop, with more LDGSTS than it
AHEAD = """
        /*0000*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
        /*0010*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R6.64] ;
        /*0020*/               @P2 BRA 0x0 ;
        /*0030*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
        /*0040*/                   FFMA R1, R2, R3, R1 ;
        /*0050*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0060*/              @!P1 BRA 0x30 ;
        /*0070*/                   EXIT ;
"""


def test_the_hot_loop_is_one_that_passes_a_barrier_where_any_does():
    """A loop of the copies ahead has more LDGSTS than the main loop but passes no barrier, so it is not the
    main loop; where no loop passes one, nvcc unrolled the main loop whole and the loop left counts once."""
    source = MAIN_LOOP.format(n=16, barriers="__syncthreads();")
    assert sass.hot_loop(AHEAD).start == 3
    assert sass.issued(AHEAD, source) == sass.Issued(4, 4, 4)  # the main loop's 4, and the copies' loop and EXIT once
    unrolled = AHEAD.replace("BAR.SYNC.DEFER_BLOCKING 0x0", "FFMA R1, R2, R3, R1").replace("@!P1 BRA 0x30", "NOP")
    assert sass.issued(unrolled, source) == sass.Issued(0, 8)


def test_the_model_prices_a_kernel_from_its_compiled_code_where_it_has_it():
    """ptxas's registers decide the blocks per SM in place of the estimate, and the instructions a warp issues
    bound the time where they take longer than the rest; `priced` says which was done."""
    from prism_dsl.backend.cost import estimate, for_hardware
    from prism_dsl.backend.launch import CodegenConfig, layout

    program = load(ROOT / "programs/fused/rmsnorm_linear.prism").program()
    built = build(program, H100, BuildOptions(dims={"n": 8, "d": 4096}, archs=()))
    c = built.concrete[built.kernels[0].name]
    plain = estimate(c, H100)
    assert plain.priced == "structure" and plain.bound != "issue"
    ptxas = estimate(c, H100, compiled={"registers": 40})
    assert (ptxas.priced, ptxas.registers) == ("ptxas", 40) and plain.registers > 32  # the base, the products', the copies'
    busy = estimate(c, H100, compiled={"registers": 40, "issued": {"loop": 0, "once": 10}})
    assert (busy.priced, busy.time_us) == ("sass", plain.time_us)  # a floor far below: nothing changes
    slow = estimate(c, H100, compiled={"registers": 40, "issued": {"loop": 1e5, "once": 0}})
    assert slow.bound == "issue" and slow.time_us > 10 * plain.time_us
    # the iterations that copy tiles ahead (all but the pipeline's last) issue the copies too
    copying = estimate(c, H100, compiled={"registers": 40, "issued": {"loop": 1e5, "once": 0, "copying": 2e5}})
    shape = layout(c, for_hardware(CodegenConfig(threads=128), H100))
    n, lead = c.loop, shape.lead
    assert shape.stages > 1 and 0 < lead < n
    assert copying.time_us - 3 == pytest.approx((slow.time_us - 3) * (2 * (n - lead) + lead) / n, rel=1e-3)
    # 255 registers a thread: 65536 / (255 * 128) = 2 blocks of 128 threads at most
    assert estimate(c, H100, compiled={"registers": 255}).occupancy <= 2


def test_the_warps_a_small_product_leaves_out_issue_less():
    """Where a product's layout takes 4 of the block's 8 warps (a 16-column slice, k = 64 per iteration),
    the other 4 skip the products: half the block issues `spare` fewer per iteration; where every warp
    runs them (k = 4096 / 2 at 128 threads), `spare` changes nothing."""
    from prism_dsl.backend.cost import estimate, for_hardware, _product_warps
    from prism_dsl.backend.launch import CodegenConfig, layout

    program = load(ROOT / "programs/fused/rmsnorm_linear.prism").program()
    built = build(program, H100, BuildOptions(dims={"n": 8, "d": 4096}, grid={"x": 256}, loop={"F": 64}, archs=()))
    c = built.concrete[built.kernels[0].name]
    assert _product_warps(layout(c, for_hardware(CodegenConfig(threads=256), H100)), 8) == 4
    issued = {"loop": 1e4, "once": 0, "copying": 1e4}
    full = estimate(c, H100, threads=256, compiled={"registers": 40, "issued": issued})
    spared = estimate(c, H100, threads=256, compiled={"registers": 40, "issued": {**issued, "spare": 5e3}})
    assert full.bound == spared.bound == "issue"
    assert spared.time_us - 3 == pytest.approx((full.time_us - 3) * 0.75, rel=1e-3)  # (1e4 + 0.5e4) / 2 per warp
    every = build(program, H100, BuildOptions(dims={"n": 8, "d": 4096}, grid={"x": 256}, loop={"F": 2}, archs=()))
    c = every.concrete[every.kernels[0].name]
    assert estimate(c, H100, compiled={"registers": 40, "issued": {**issued, "spare": 5e3}}) == \
        estimate(c, H100, compiled={"registers": 40, "issued": issued})


@pytest.mark.skipif(shutil.which("nvcc") is None or not sass.available(),
                    reason="needs nvcc on the PATH and cuobjdump (pip install -e '.[sass]')")
def test_prismc_compile_prices_the_chosen_program_from_its_compiled_code_and_says_so(tmp_path, capsys):
    import json

    from prism_dsl.cli.main import main

    path = str(ROOT / "programs/fused/rmsnorm_linear.prism")
    common = [path, "--search", "none", "--dims", "n=8,d=512", "--no-emulate"]
    assert main(["compile", *common, "--arch", "sm_90,sm_80", "-o", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "estimates priced from the compiled code (sm_90: ptxas's registers" in out
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    kernel = report["kernels"][0]
    assert kernel["estimate"]["priced"] == "sass" and report["priced"].startswith("the compiled code")
    assert kernel["nvcc"]["sm_90"]["issued"]["loop"] > 0
    assert kernel["nvcc"]["sm_80"]["ok"] and "issued" not in kernel["nvcc"]["sm_80"]  # SASS read for the priced arch only
    assert main(["compile", *common, "--arch", "none", "-o", str(tmp_path / "b")]) == 0
    assert "priced from the code's structure: no architecture compiled (--arch none)" in capsys.readouterr().out
    assert main(["compile", *common, "--arch", "sm_80", "-o", str(tmp_path / "c")]) == 0
    assert ("the code's structure: sm_90, the hardware's architecture, not among --arch"
            in capsys.readouterr().out)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on the PATH")
@pytest.mark.parametrize("name, dims, params, threads", [
    ("attention.decoding", {"b": 2, "h": 8, "q": 1, "dh": 128, "kv": 32768}, {}, 128),
    ("attention.decoding", {"b": 2, "h": 8, "q": 1, "dh": 128, "kv": 32768}, {}, 256),
    ("swiglu", {"n": 8, "d": 4096}, {"F": 4, "gx": 256}, 128),  # 40 copies a thread and iteration, rows permuted
    ("swiglu", {"n": 8, "d": 4096}, {"F": 16, "gx": 256}, 128),  # 10: the model said 100 with rows in order, ptxas 56
    ("attention", {"b": 1, "h": 16, "q": 4096, "kv": 4096, "dh": 128}, {}, 256),
], ids=["flash-decoding-128", "flash-decoding-256", "swiglu-decode", "swiglu-decode-short-copies",
        "attention-prefill"])
def test_the_models_registers_are_near_what_ptxas_gives(name, dims, params, threads):
    """The model's guess of registers per thread (`cost.REGISTERS_BASE`, the products' accumulators and
    fragments, `REGISTERS_PER_COPY` per copy of the loop's tiles) against ptxas's count, within 1.6x either
    way: the blocks per SM it decides must not be far off for the candidates the search never compiles."""
    from prism_dsl.backend.codegen import CodegenConfig
    from prism_dsl.pipeline.build import compile_check

    program = load(ROOT / "programs" / "fused" / f"{name}.prism").program()
    built = build(program, H100, BuildOptions(dims=dims, params=params, codegen=CodegenConfig(threads=threads)))
    _, figures = compile_check(built.kernels, ("sm_90",))
    estimates = {e.kernel: e for e in built.estimates}
    for k in built.kernels:  # a launch that also combines its pieces: the first kernel's guess (the more registers)
        e = estimates[k.name]
        if k.name == "combine":
            continue  # 32 registers against the base's 64: a loop of one copy per thread, too small to matter
        ptxas = figures[k.name]["sm_90"]["registers"]
        assert ptxas / 1.6 <= e.registers <= ptxas * 1.6, (k.name, e.registers, ptxas)


@pytest.mark.skipif(shutil.which("nvcc") is None and not sass.available(), reason="nvcc or cuobjdump is missing")
def test_sums_across_blocks_add_16_bytes_an_atomic_on_sm_90_and_4_floats_before(tmp_path):
    """A block's part of a sum across blocks goes into its f32 workspace 4 adjacent sums a thread: on sm_90 one
    vector reduction (REDG.E.ADD.F32x4) and no scalar add (RED or ATOMG: nvcc 13 writes a scalar atomicAdd as
    ATOMG there), on sm_80, which has none, four scalar ones (tests/test_sums.py: the
    same code under the emulation)."""
    import subprocess

    from prism_dsl.backend.cuda_runtime import NVCC_OPTIONS
    from prism_dsl.backend.nvcc import nvcc_path, write_sources
    from test_sums import PARAMS, mlp

    if nvcc_path() is None or not sass.available():
        pytest.skip("nvcc or cuobjdump is missing")
    (kernel,) = build(mlp(tmp_path), H100, BuildOptions(dims={}, archs=(), **PARAMS)).kernels
    write_sources([kernel], tmp_path)
    found = {}
    for arch in ("sm_90", "sm_80"):
        done = subprocess.run([nvcc_path(), "-cubin", f"-arch={arch}", *NVCC_OPTIONS, "-o", f"{arch}.cubin",
                               kernel.file], cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        listing = sass.disassemble(tmp_path / f"{arch}.cubin")
        found[arch] = (listing.count("REDG.E.ADD.F32x4"), len(re.findall(r"\b(REDG?|ATOMG)\.E\.ADD\.F32\.FTZ\.RN", listing)))
    assert found["sm_90"][0] >= 1 and found["sm_90"][1] == 0, found
    assert found["sm_80"][0] == 0 and found["sm_80"][1] >= 4, found
