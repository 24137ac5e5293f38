"""The SASS reader (prism_dsl/backend/sass.py) on a hand-written listing, and on the compiled code of a
generated prefill kernel: its hot loop runs on tensor cores (wgmma, or mma.sync fed by ldmatrix), with async
copies, no spills."""

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
@pytest.mark.parametrize("name, dims, grid, loop, wgmma", [
    ("rmsnorm_linear", {"n": 128, "d": 1024}, {"gx": 8}, {"F": 16}, True),
    ("rmsnorm_linear", {"n": 128, "d": 1024}, {"gx": 8}, {"F": 16}, False),
    ("attention", {"b": 1, "h": 2, "q": 128, "kv": 512, "dh": 128}, {"gb": 1, "gh": 2, "gq": 1}, {"F": 8}, True),
], ids=["wgmma", "mma.sync", "attention"])
def test_a_prefill_kernel_runs_its_hot_loop_on_tensor_cores_with_async_copies(name, dims, grid, loop, wgmma, tmp_path):
    """On wgmma (sm_90a) the hot loop issues HGMMA with no ldmatrix and no HMMA, and waits while one batch
    is still pending without ptxas serializing the instructions: the products' batch of the iteration
    before, or online softmax's p @ v beside the next scores' softmax (attention's two warpgroups taking
    turns at named barriers, the stages paced by mbarriers); on mma.sync, 4 HMMA or more per LDSM."""
    import subprocess

    from prism_dsl.backend.cuda_runtime import NVCC_OPTIONS
    from prism_dsl.backend.launch import CodegenConfig
    from prism_dsl.backend.nvcc import kernel_arch, nvcc_path, write_sources

    program = load(ROOT / f"programs/fused/{name}.prism").program()
    options = BuildOptions(dims=dims, grid=grid, loop=loop, archs=(), codegen=CodegenConfig(wgmma=wgmma))
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
        assert hot["HGMMA"] > 0 and hot["HMMA"] == hot["LDSM"] == 0 and hot["LDGSTS"] > 0, hot
        assert "serialized" not in done.stderr and "WARPGROUP.DEPBAR.LE gsb0, 0x1" in listing
    if name == "attention":  # two warpgroups taking turns: named barriers, the stages paced by mbarriers
        assert hot["HGMMA"] == 13 and hot["BAR"] == 2, hot
        assert all(op in listing for op in ("BAR.SYNC.DEFER_BLOCKING R", "BAR.ARV R", "ARRIVES.LDGSTSBAR.64.ARVCNT",
                                            "SYNCS.PHASECHK.TRANS64.TRYWAIT", "SYNCS.ARRIVE.TRANS64.A1T0"))
    if not wgmma:
        assert hot["HMMA"] >= 4 * hot["LDSM"] > 0 and hot["LDGSTS"] > 0, hot


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
