"""CUDA code generation: golden files, nvcc compile checks, the CPU emulation against the reference, the
cost model's ranking, and `prismc compile` / `prismc bench` as a user runs them (no GPU needed)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from prism_dsl.pipeline.build import BuildOptions, build, emulate, nvcc_check
from prism_dsl.lang.check import load
from prism_dsl.cli.main import main
from prism_dsl.cli.values import parse_dims
from prism_dsl.backend.codegen import CodegenConfig, comment, ident
from prism_dsl.backend.cost import estimate
from prism_dsl.backend.tuning import tune
from prism_dsl.backend.emulate import compiler
from prism_dsl.kernels.constraints import instantiate_program
from prism_dsl.kernels.hardware import load_hardware
from prism_dsl.kernels.kernel import free_symbols, kernels_of
from prism_dsl.kernels.lower import lower
from test_kernels import ROPED_KEYS

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).parent / "golden"
H100 = load_hardware("h100")
FUSED = sorted((ROOT / "programs" / "fused").glob("*.prism"))
PROGRAMS = sorted((ROOT / "programs").glob("*.prism"))

# Small sizes keep every test quick; each program's dims by name.
SMALL = {"n": 8, "d": 256, "b": 1, "h": 2, "q": 1, "kv": 128, "dh": 64, "g": 1, "s": 16, "m": 256, "r": 16, "f": 512}
# Fixed kernel parameters for the golden files, so that a change to the cost model does not move them.
GOLDEN_PARAMS = {
    "rmsnorm_linear": ({"gx": 8}, {"F": 4}), "rmsnorm_mlp": ({"gx": 8}, {"F": 4}), "swiglu": ({"gx": 8}, {"F": 4}),
    "attention": ({"gb": 1, "gh": 2, "gq": 1}, {"F": 2}),
    "attention.decoding": ({"gb": 1, "gh": 2, "S": 4}, {"F": 2}),
    "gpt2_mlp": ({"gx": 8, "gx_Y": 4, "gy_Y": 1}, {"F": 4, "F_Y": 4}),  # the second product is pre-defined
    "causal_attention": ({"gq": 2, "gh": 2}, {"F": 4}),  # 32 rows a block, 32 keys an iteration: the first
    # block stops after 3 of 4 (the keys start 64 before the queries' first row)
}

# Dims besides SMALL for the hand-written kernels: 32 query rows, so attention's online softmax runs in
# registers on tensor cores (2 warps of 16 rows) in the golden file, the emulation and the sanitizer runs.
FUSED_DIMS = {"attention": {"q": 32}, "causal_attention": {"q": 64}}

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on the PATH")
needs_cxx = pytest.mark.skipif(compiler() is None, reason="no C++ compiler (g++ or clang++) for the CPU emulation")


def small_dims(program) -> dict[str, int]:
    return {d.name: SMALL[d.name] for d in program.dims if d.name in SMALL}


def build_of(path: Path, grid=None, loop=None, **kw):
    program = load(path).program()
    dims = small_dims(program) | (FUSED_DIMS.get(path.stem, {}) if path.parent.name == "fused" else {})
    options = BuildOptions(dims=dims, grid=grid or {}, loop=loop or {}, **kw)
    return build(program, H100, options), options


# -- golden files ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", FUSED, ids=lambda p: p.stem)
def test_rendered_cuda_matches_the_golden_file(path):
    grid, loop = GOLDEN_PARAMS[path.stem]
    built, _ = build_of(path, grid, loop)
    for k in built.kernels:
        check_golden(GOLDEN / path.stem / k.file, k.source)


def check_golden(golden: Path, source: str) -> None:
    """Generated code against its golden file (written instead where PRISM_REGEN_GOLDEN is set)."""
    if os.environ.get("PRISM_REGEN_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(source)
    assert golden.is_file(), f"no golden file {golden}; run with PRISM_REGEN_GOLDEN=1 to write it"
    assert source == golden.read_text(), f"{golden} differs; if the change is meant, PRISM_REGEN_GOLDEN=1"


@pytest.mark.parametrize("warp", [True, False], ids=["copy-warp", "thread0"])
def test_rendered_tma_kernel_matches_the_golden_file(warp):
    """Attention at tiles wgmma takes (128 query rows on two warpgroups taking turns, 64-key tiles, dh = 64): its
    loop tiles copied by TMA, each stage's boxes issued after the expect_tx of their bytes by a copy warp's lane 0
    (32 threads after the 256), once the stage's empty mbarrier has every computing thread's arrival; with
    --no-copy-warp by thread 0, in the loop and before it."""
    program = load(ROOT / "programs/fused/attention.prism").program()
    options = BuildOptions(dims={"b": 1, "h": 2, "q": 128, "kv": 256, "dh": 64}, grid={"gb": 1, "gh": 2, "gq": 1},
                           loop={"F": 4}, archs=(), codegen=CodegenConfig(tma=True, copy_warp=warp))
    k = build(program, H100, options).kernels[0]
    assert [m.tensor for m in k.maps] == ["K", "V"] and k.source.count("prism::tma_load(") == (2 if warp else 4)
    assert k.block == ((288 if warp else 256), 1, 1)
    check_golden(GOLDEN / ("attention.tma" if warp else "attention.tma.thread0") / k.file, k.source)


@needs_cxx
def test_a_copy_warp_fills_an_rmsnorm_projections_stages(tmp_path):
    """RMSNorm's projection on wgmma with --tma (128 x 128 tiles, 8 k steps of 64): its batch in flight, its sum of
    squares in registers, so a copy warp of 32 threads after the 256 computing ones issues every stage's boxes, each
    once the stage's empty mbarrier has every computing thread's arrival; the loop has no block-wide barrier. It
    matches the reference under AddressSanitizer. `--no-copy-warp`: thread 0, behind the block's barrier."""
    program = load(ROOT / "programs/fused/rmsnorm_linear.prism").program()
    options = BuildOptions(dims={"n": 128, "d": 512}, grid={"gx": 4}, loop={"F": 8}, archs=(), sanitize="address",
                           codegen=CodegenConfig(tma=True))
    built = build(program, H100, options)
    k = built.kernels[0]
    assert k.block == (288, 1, 1) and "__syncthreads" not in k.source and k.source.count("prism::tma_load(") == 3
    check_golden(GOLDEN / "rmsnorm_linear.copy_warp" / k.file, k.source)
    check = emulate(built, options)
    assert check.passed, check
    plain = build(program, H100, replace(options, codegen=CodegenConfig(tma=True, copy_warp=False))).kernels[0]
    assert plain.block == (256, 1, 1) and "empty" not in plain.source and "__syncthreads();  // and every" in plain.source


def test_generated_code_names_the_program_and_uses_tensor_cores_where_tiles_allow():
    built, _ = build_of(ROOT / "programs/fused/rmsnorm_linear.prism", {"gx": 8}, {"F": 4})
    src = built.kernels[0].source
    assert "// rmsnorm_linear: kernel rmsnorm_matmul" in src
    assert "// acc = acc_sum((xt @ wt))" in src and "store Y[:, x] = (acc / rms)" in src
    # the product folded into acc_sum: register-tiled mma.sync (sm_80 or later: older targets are told so)
    assert "prism::mma_m16n8k16<half>(r_a3[i][j]" in src and "prism::ldmatrix<" in src
    assert "#error \"this kernel keeps a product's accumulators in tensor-core registers (sm_80 or later)" in src
    assert "float r_a3[" in src and "the accumulators, from registers into s_a3" in src
    # written only after the loop: no start value, and its bytes shared with the loop's tiles
    assert "// state a3: [8, 32] f32, after the loop" in src and "// acc: acc starts at" not in src
    assert "prism::cp_async<8>" in src and "prism::cp_async_wait" in src  # 16-byte async copies
    assert built.kernels[0].tensor_cores


@needs_cxx
def test_the_gated_products_load_x_once_per_k_step():
    """A gated MLP's gate and up projections read the same tile of x: one step loads x's fragments once per k
    step for both mma.sync (at decode, x^T's 8 rows; at 128 x 128 tiles on 8 warps, x's 16-row blocks), with
    the products after the loop's other steps, and the emulated code still matches the reference."""
    decode, _ = build_of(ROOT / "programs/fused/rmsnorm_mlp.prism", {"gx": 8}, {"F": 4})
    src = decode.kernels[0].source
    assert src.count("prism::ldmatrix<2>(fb[j], s_xt") == 1 and src.count("ldmatrix<4, true>(fa[i]") == 2
    assert "the 2 products share s_xt's fragments" in src
    assert src.index("// rms = acc_rms_last(xt)") < src.index("// up = acc_sum((xt @ ut))  [8, 32]: mma.sync")
    path = ROOT / "programs/fused/swiglu.prism"
    options = BuildOptions(dims={"n": 128, "d": 512}, grid={"gx": 4}, loop={"F": 8}, archs=(),
                           codegen=CodegenConfig(wgmma=False))  # sm_80's form (on sm_90a: wgmma, below)
    prefill = build(load(path).program(), H100, options)
    src = prefill.kernels[0].source
    assert prefill.kernels[0].block == (256, 1, 1) and src.count("ldmatrix<4>(fa[i], s_xt") == 1
    assert src.count("prism::mma_m16n8k16<half>") == 2
    check = emulate(prefill, options)
    assert check.passed, check


WGMMA_PRODUCTS = """# Register-tiled products on wgmma: an operand computed in the loop (gain * x, stored in the swizzle), a
# gated pair sharing x, and K-major B (the right operand stored transposed).
dims n = 128, d = 128, e = 128
program wg(X: f16[n, d], G: f16[d], W: f16[d, e], U: f16[d, e], V: f16[e, d]) {
    kernel gain grid(x = g1) loop(F1) {
        xt = load X[:, loop]
        gt = load G[loop]
        wt = load W[loop, x]
        store Y1[:, x] = acc_sum(gt * xt @ wt)
    }
    kernel gated grid(x = g2) loop(F2) {
        xt = load X[:, loop]
        wt = load W[loop, x]
        ut = load U[loop, x]
        a = acc_sum(xt @ wt)
        b = acc_sum(xt @ ut)
        store Y2[:, x] = silu(a) * b
    }
    kernel kmajor grid(x = g3) loop(F3) {
        xt = load X[:, loop]
        vt = load V[x, loop]
        store Y3[:, x] = acc_sum(xt @ transpose(vt, 0, 1))
    }
    return Y1, Y2, Y3
}
"""


@needs_cxx
def test_products_on_wgmma_read_their_swizzled_tiles(write, tmp_path):
    """At H100 and tiles in multiples of 64, register-tiled products run on wgmma (2 warpgroups): every write of
    an operand tile (the copies, gain * x) lands in the 128-byte swizzle its descriptors describe, the gated
    pair shares A's descriptor, B is read N-major as stored or K-major where stored transposed, no ldmatrix;
    where both operands are pipelined loop tiles (3 stages), each iteration's batch stays in flight into the
    next. Where every loop tile is one wgmma reads (the gated pair, kmajor), TMA copies them, into the same
    swizzle (--tma). The emulated code matches the float64 reference under ThreadSanitizer (the emulation itself
    reports a descriptor that reads outside shared memory), and a copy written unswizzled (cp.async, the default)
    is caught, as is a stage refilled while a batch in flight still reads it, and code without the fences that
    hand the threads' writes and registers to the tensor cores."""
    out = tmp_path / "out"
    assert main(["compile", str(write(WGMMA_PRODUCTS)), "--search", "none", "-o", str(out), "--arch", "none", "--tma",
                 "--sanitize", "thread", "--dims", "d=256", "--grid", "g1=2,g2=1,g3=2", "--loop", "F1=4,F2=4,F3=2"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["checked"]["emulation"]["passed"], report["checked"]
    src = {name: (out / f"{name}.cu").read_text() for name in ("gain", "gated", "kmajor")}
    assert all("ldmatrix" not in s and "nvcc -c -gencode arch=compute_90a,code=sm_90a" in s for s in src.values())
    # the gain's 8 elements a thread, one 16-byte store into the swizzle (a 16-byte group stays whole in it)
    assert re.search(r"prism::store16\(s_\w+ \+ i0 \* 64 \+ \(i1 / 8 % 8 \^ i0 % 8\) \* 8 \+ i1 % 8, w\);", src["gain"])
    assert src["gain"].count("prism::wgmma<64, half, true>") == 1
    assert src["gated"].count("prism::wgmma<128, half, true>") == 2 and src["gated"].count("WgmmaDesc da") == 1
    assert src["kmajor"].count("prism::wgmma<64, half, false>") == 1
    # in flight: the gated pair (loop tiles only, 4 iterations: 4 stages, the batch's one besides); not gain * x
    # (computed in the loop) nor kmajor (2 iterations: 2 stages). The gated pair's copies are a warp's of their own,
    # launched after the 256 computing threads: no block-wide barrier in its loop, each stage released at its empty
    # mbarrier once the batch that read it is done
    assert [k["block"][0] for k in report["kernels"]] == [256, 288, 256]
    assert "wgmma_wait<1>" in src["gated"] and "mbarrier_wait(&full[it % 4], it / 4 % 2);  // this iteration's" in src["gated"]
    assert "if (warpgroup == kThreads / 128) {" in src["gated"] and "__syncthreads" not in src["gated"]
    assert "if (it > 0) prism::mbarrier_arrive(&empty[(it - 1) % 4]);" in src["gated"]
    assert "__launch_bounds__(288)" in src["gated"] and "warpgroup == kThreads" not in src["kmajor"]
    assert "wgmma_wait<1>" not in src["gain"] + src["kmajor"]
    assert "tma_load(" in src["gated"] and "tma_load(" in src["kmajor"] and "tma_load(" not in src["gain"]
    sm80 = tmp_path / "sm80"  # --no-wgmma: the same products on mma.sync, for sm_80 and later
    assert main(["compile", str(write(WGMMA_PRODUCTS)), "--search", "none", "-o", str(sm80), "--arch", "none",
                 "--no-emulate", "--no-wgmma", "--dims", "d=256", "--grid", "g1=2,g2=1,g3=2", "--loop", "F1=4,F2=4,F3=2"]) == 0
    assert all("wgmma" not in (sm80 / f"{n}.cu").read_text() for n in src)
    # one tile's copies written row-major (the chunk not XORed with the row): the products read other values
    program = load(write(WGMMA_PRODUCTS)).program()
    options = BuildOptions(dims={"d": 256}, grid={"g1": 2, "g2": 1, "g3": 2}, loop={"F1": 4, "F2": 4, "F3": 2}, archs=(),
                           codegen=CodegenConfig(tma=True))
    built = build(program, H100, options)
    copied = build(program, H100, replace(options, codegen=CodegenConfig(tma=False)))
    k = copied.kernels[2]
    wrong = k.source.replace("(i1 / 8 % 8 ^ i0 % 8) * 8", "i1 / 8 % 8 * 8", 1)
    assert wrong != k.source and "prism::cp_async<8>(s_vt" in k.source
    assert not emulate(replace(copied, kernels=copied.kernels[:2] + (replace(k, source=wrong),)), options).passed
    # two batches left in flight where the pipeline refills the stage of the older one (8 iterations: with the
    # copies two ahead, the 4 stages come round to the older batch's from the fourth)
    longer = replace(options, dims={"d": 512}, loop={"F1": 4, "F2": 8, "F3": 2})
    for warp in (True, False):  # the copy warp's, or thread 0's behind the block's barrier (--no-copy-warp)
        config = replace(longer, codegen=CodegenConfig(tma=True, copy_warp=warp))
        deep = build(program, H100, config)
        k = deep.kernels[1]
        assert "4-stage TMA pipeline" in k.source and ("ahead = it + 2;" in k.source) != warp
        wrong = k.source.replace("wgmma_wait<1>", "wgmma_wait<2>")
        found = emulate(replace(deep, kernels=(deep.kernels[0], replace(k, source=wrong), deep.kernels[2])), config)
        assert found.finding and "changed before the wgmma.wait_group" in found.finding["message"], found.errors()
    # the fences removed: gain * x, stored by the threads, read by a wgmma with no fence.proxy.async since; a
    # batch with no wgmma.fence before it
    for at, fence, message in ((0, "prism::fence_async_shared();", "as written since the last fence.proxy.async"),
                               (1, "prism::wgmma_fence();", "with no wgmma.fence")):
        k = built.kernels[at]
        wrong = k.source.replace(fence, "")
        assert wrong != k.source
        kernels = built.kernels[:at] + (replace(k, source=wrong),) + built.kernels[at + 1:]
        found = emulate(replace(built, kernels=kernels), options)
        assert found.finding and message in found.finding["message"], found.errors()



@needs_cxx
@pytest.mark.parametrize("name, dims, grid, loop, sanitizer, turns, tma", [
    ("attention", "b=1,h=2,q=128,kv=256,dh=128", "gb=1,gh=2,gq=1", "F=4", "address", False, False),  # kt N-major, 2 warpgroups
    ("attention", "b=1,h=2,q=128,kv=256,dh=128", "gb=1,gh=2,gq=1", "F=4", "thread", True, True),  # taking turns, TMA
    ("causal_attention", "b=1,h=2,q=128,kv=128,dh=64", "gq=2,gh=2", "F=2", "address", False, False),  # K-major, RoPE, mask
])
def test_online_softmax_on_wgmma(name, dims, grid, loop, sanitizer, turns, tma, tmp_path):
    """Query tiles of 64 rows or more, key tiles and head dims of 64 or 128: s = q @ kt by wgmma from the
    swizzled tiles, p @ v by wgmma with p's fragments from registers; no ldmatrix; emulated under a
    sanitizer against the float64 reference. With 3 stages (attention here), p @ v runs one iteration
    late, beside the next scores' softmax, and the last one after the loop (`launch.overlap`); p's
    fragments written before that batch's wait are reported. With 2 (causal here), each iteration waits
    for both batches. The two warpgroups of attention take turns on the tensor cores with a stage more
    (`launch.takes_turns`), their tiles copied by TMA (--tma), and in step with --no-pingpong (here with
    cp.async, the default). Causal attention's key tile is RoPE'd before wgmma reads it: cp.async copies it."""
    out = tmp_path / "out"
    assert main(["compile", str(ROOT / f"programs/fused/{name}.prism"), "--search", "none", "-o", str(out), "--arch",
                 "none", "--dims", dims, "--grid", grid, "--loop", loop, "--sanitize", sanitizer]
                + (["--tma"] if tma else []) + ([] if turns or name != "attention" else ["--no-pingpong"])) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["checked"]["emulation"]["passed"], report["checked"]
    src = (out / f"{report['kernels'][0]['name']}.cu").read_text()
    assert "ldmatrix" not in src and "mma_m16n8k16" not in src
    assert re.search(r"prism::wgmma<\d+, half, (true|false)>\(reinterpret_cast<float \(&\)\[\d+\]>\(sc\[0\]\)", src)
    late = name == "attention"
    p = r"f_\w+_p\[kk\]" if late else r"pa\[kk\]"
    assert len(re.findall(r"prism::wgmma<\d+, half, true>\(reinterpret_cast<float \(&\)\[\d+\]>\(f_\w+\[0\]\), " + p, src)) == 1 + late
    assert ("wgmma_wait<1>" in src) == late and ("4 stages" in src) == late  # as many as the 4 iterations
    assert ("named_sync(1 + PRISM_TID / 128, 256)" in src) == turns and ("mbarrier_wait(&full" in src) == turns
    assert ("prism::tma_load(" in src) == tma and ("cp_async<8>(s_kt_stages" in src) != tma
    assert ("K-major" in src) == (name == "causal_attention")
    if late:  # p's next fragments packed before the wait for the p @ v that reads the current ones
        program = load(ROOT / f"programs/fused/{name}.prism").program()
        options = BuildOptions(dims=parse_dims(dims), grid=parse_dims(grid), loop=parse_dims(loop), archs=(),
                               codegen=CodegenConfig(pingpong=turns, tma=tma))
        built = build(program, H100, options)
        k = built.kernels[0]
        pack = re.search(r"\n *PRISM_UNROLL\n *for \(int kk = 0; kk < \d+; \+\+kk\) \{  // p's A fragments.*?\n *\}\n", k.source, re.S)
        wait = re.search(r"\n *prism::wgmma_wait<0>\([^\n]*// p @ v of iteration it - 1 has landed", k.source)
        wrong = k.source[:wait.start()] + pack.group(0)[:-1] + k.source[wait.start():pack.start()] + k.source[pack.end() - 1:]
        found = emulate(replace(built, kernels=(replace(k, source=wrong),)), options)
        assert found.finding and "changed before the wgmma.wait_group" in found.finding["message"], found.errors()


# the RoPE'd-keys causal program (tests/test_kernels.py) at dh = 128, in one 128-row query tile
ROPED_KEYS_128 = ROPED_KEYS.replace("dims b = 1, h = 2, q = 64, kv = 96, dh = 16",
                                    "dims b = 1, h = 1, q = 128, kv = 512, dh = 128").replace("/ 4.0", "/ 11.313708498984761")


@needs_cxx
def test_a_kernel_over_its_bound_is_held_to_the_shared_memory_its_code_takes(write, tmp_path):
    """Causal attention over RoPE'd keys in 128-row query tiles and 64-key tiles (dh = 128): the kernel's
    shared-memory bound, which holds however its code is generated (the scores and probabilities in
    shared memory, as the plain path keeps them), is over the limit, but the code generated with online
    softmax in registers keeps 164 KB. The backend instantiates it by the latter (`tuning.fits`), the tuner
    chooses it at prefill dims, and it compiles and emulates under a sanitizer against the reference."""
    from prism_dsl.backend.cost import for_hardware
    from prism_dsl.backend.tuning import fits, parameters
    from prism_dsl.backend.launch import layout
    from prism_dsl.kernels.constraints import instantiate, valid
    from prism_dsl.semantics.reference import bind_dims

    path = write(ROPED_KEYS_128)
    program = lower(load(path).program())
    k = next(k for k in kernels_of(program) if k.name == "fused1")
    syms = {s.name: s for s in free_symbols(program)}
    dims = bind_dims(program, dict(b=1, h=1, q=128, kv=512, dh=128))
    binding = {**dims, syms["gx"]: 1, syms["gy"]: 1, syms["gz"]: 1, syms["F"]: 8}
    assert not valid(k, binding, H100) and valid(k, binding, H100, smem=False)
    assert any("above the limit" in p for p in instantiate(k, binding, H100))
    config = for_hardware(None, H100)
    c = fits(k, binding, H100, config)
    laid = layout(c, config)
    assert c.smem_bytes == laid.smem < H100.smem_per_block and laid.pingpong and laid.threads == 256
    assert fits(k, binding, H100, replace(config, tensor_cores=False)) is None  # scores in shared memory: over
    # at prefill dims the model's choice is the 128-row tiles on two warpgroups taking turns
    big = bind_dims(program, dict(b=1, h=16, q=4096, kv=4096, dh=128))
    params, concrete, _ = parameters(program, big, {}, H100)
    assert (params["gx"], params["gy"]) == (1, 32) and layout(concrete["fused1"], config).pingpong, params
    out = tmp_path / "out"
    assert main(["compile", str(path), "--search", "none", "-o", str(out), "--arch", "none", "--grid",
                 "gx=1,gy=1,gz=1", "--loop", "F=8", "--sanitize", "address"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["checked"]["emulation"]["passed"], report["checked"]
    fused = next(r for r in report["kernels"] if r["name"] == "fused1")
    assert fused["smem_bytes"] == laid.smem and fused["block"][0] == 256


@needs_cxx
def test_warpgroups_taking_turns_are_paced_by_their_barriers():
    """Attention on two warpgroups that take turns on the tensor cores (`launch.takes_turns`), with 5 stages
    so that the copies run 2 iterations ahead and a stage is refilled while the later warpgroup may still
    be reading it: the emulation passes the code as generated, its tiles copied by TMA (a copy warp's lane 0,
    after the stage's last readers have arrived at its empty mbarrier; with --no-copy-warp thread 0, in the
    loop), and reports each barrier taken out, a copy whose bytes its stage does not wait for, and an mbarrier
    the TMA unit was not shown. With cp.async (the default) every thread copies, and the fence that hands the
    landed tiles to the tensor cores is needed."""
    program = load(ROOT / "programs/fused/attention.prism").program()
    options = BuildOptions(dims=parse_dims("b=1,h=1,q=128,kv=512,dh=64"), grid=parse_dims("gb=1,gh=1,gq=1"),
                           loop=parse_dims("F=8"), archs=(), codegen=CodegenConfig(tma=True))
    built = build(program, H100, options)
    k = built.kernels[0]
    assert "5-stage TMA pipeline paced by mbarriers" in k.source and "if (warpgroup == kThreads / 128) {" in k.source
    assert emulate(built, options).passed
    by_thread0 = build(program, H100, replace(options, codegen=CodegenConfig(tma=True, copy_warp=False)))
    assert "ahead = it + 2;" in by_thread0.kernels[0].source and emulate(by_thread0, options).passed

    def found(old: str, new: str, *more: str, within=built) -> str:
        k = within.kernels[0]
        wrong = re.sub(old, new, k.source)
        if more:
            wrong = re.sub(*more, wrong)
        assert wrong != k.source, old
        result = emulate(replace(within, kernels=(replace(k, source=wrong),)), options)
        assert not result.passed and result.finding, result.errors()
        return result.finding["message"]
    # a stage refilled before the other warpgroup's p @ v of it has landed (thread 0's copies, one an iteration; the
    # copy warp's run ahead over stages no thread has read yet: their scores are NaN)
    assert "changed before the wgmma.wait_group" in found(r"prism::mbarrier_wait\(&empty", "if (0) prism::mbarrier_wait(&empty",
                                                          within=by_thread0)
    unpaced = k.source.replace("prism::mbarrier_wait(&empty", "if (0) prism::mbarrier_wait(&empty")
    assert "are NaN" in emulate(replace(built, kernels=(replace(k, source=unpaced),)), options).errors()
    give_back = "if (it > 0) prism::mbarrier_arrive(&empty[(it - 1) % 5]);"
    assert "changed before the wgmma.wait_group" in found(  # the stage given back when p @ v is issued, not landed
        re.escape(give_back), ";", r"(prism::named_arrive\(2 - PRISM_TID / 128, 256\);)", r"\1 " + give_back)
    assert "for arrivals that never come" in found(re.escape(give_back), ";")  # nor ever
    # a stage read before its copies have landed (the last ones never do: nothing waits for them)
    assert "never landed" in found(r"prism::mbarrier_wait\(&full", "if (0) prism::mbarrier_wait(&full")
    # the stage's bytes not expected: its phase completes at the issuing thread's arrival, before they land
    assert "mbarrier.expect_tx" in found(r"prism::mbarrier_expect_tx\((&full\[ahead % 5\]), \d+\)", r"prism::mbarrier_arrive(\1)")
    assert "not made visible to the async proxy" in found(re.escape("prism::mbarrier_init_fence();"), "")
    # warpgroup 0's first turn never given, and warpgroup 1's last never taken
    assert "bar.sync) for arrivals that never come" in found(r"if \(PRISM_TID / 128 == 1\) prism::named_arrive", "if (0) prism::named_arrive")
    assert "a bar.arrive no bar.sync waited for" in found(r"if \(PRISM_TID / 128 == 0\) prism::named_sync", "if (0) prism::named_sync")
    # cp.async: the tiles landed at the mbarrier, read by wgmma with no fence.proxy.async after them
    copied = build(program, H100, replace(options, codegen=CodegenConfig(tma=False)))
    assert "5-stage cp.async pipeline paced by mbarriers" in copied.kernels[0].source and emulate(copied, options).passed
    landed = re.escape("prism::fence_async_shared();  // and wgmma sees them")
    assert "since the last fence.proxy.async" in found(landed, "", within=copied)


SHARED_WITH_WMMA = """dims n = 128, d = 128, e = 128
program mix(X: f16[n, d], W: f16[d, e], U: f16[d, e]) {
    kernel k grid(x = g) loop(F) {
        xt = load X[:, loop]
        wt = load W[loop, x]
        ut = load U[loop, :]
        a = acc_sum(xt @ wt)
        m = acc_sum_last(xt @ ut)
        store Y[:, x] = a / m
    }
    return Y
}
"""


def test_a_tile_that_another_product_reads_as_padded_rows_keeps_mma_sync(write):
    """xt feeds a wgmma-sized register-tiled product and a wmma product (`xt @ ut`, folded by a row sum): wmma
    reads padded rows, so xt is not swizzled and the register-tiled product stays on mma.sync."""
    program = load(write(SHARED_WITH_WMMA)).program()
    built = build(program, H100, BuildOptions(grid={"g": 2}, loop={"F": 2}, archs=()))
    src = built.kernels[0].source
    assert not built.kernels[0].wgmma and "wgmma" not in src and "(i1 / 8 % 8 ^" not in src
    assert "prism::mma_m16n8k16<half>" in src and "wmma::mma_sync" in src

PREFILL_PROJECTION = """dims n = 4096, d = 4096
program rmsnorm_linear(X: f16[n, d], W: f16[d, d]) {
    kernel fused grid(x = gx, y = gy) loop(F) {
        xt = load X[y, loop]
        wt = load W[loop, x]
        store Y[y, x] = acc_sum(xt @ wt) / acc_rms_last(xt)
    }
    return Y
}
"""


def test_parameters_are_tuned_for_the_code_asked_for(write):
    """The model tunes and prices the path the code generator will write: wgmma by default on H100, mma.sync
    with --no-wgmma, the plain path with --no-tensor-cores (other tiles, an honest time), and the tuning
    database keeps them apart."""
    from prism_dsl.backend import tuning
    from prism_dsl.pipeline.optimize import tuning_key

    program = load(write(PREFILL_PROJECTION)).program()
    lowered, dims = lower(program), program.default_binding()
    runs = {name: tuning.parameters(lowered, dims, {}, H100, cfg) for name, cfg in
            (("wgmma", None), ("mma.sync", CodegenConfig(wgmma=False)), ("plain", CodegenConfig(tensor_cores=False)))}
    (t_wg,), (t_mma,), (t_plain,) = ([e.time_us for e in est] for _, _, est in runs.values())
    assert t_wg < t_mma < t_plain / 4
    assert runs["plain"][0] != runs["wgmma"][0]  # tiles for the plain path
    keys = {tuning_key(program, dims, H100, cfg) for cfg in (CodegenConfig(), CodegenConfig(wgmma=False))}
    assert len(keys) == 2


def test_the_choices_to_time_on_a_gpu_are_the_models_best_then_other_numbers_of_blocks():
    """`tuning.choices`: `tune`'s choice first, then the model's next best that launch other numbers of blocks, each
    valid, none twice; a FlashDecoding pair (two kernels sharing the split) varied together; never more than
    asked for."""
    from prism_dsl.backend import tuning
    from prism_dsl.kernels.constraints import valid

    for name, dims in (("rmsnorm_linear", dict(n=8, d=4096)), ("attention.decoding", dict(b=2, h=8, q=1, kv=4096,
                                                                                          dh=128))):
        lowered = lower(load(ROOT / "programs" / "fused" / f"{name}.prism").program())
        binding = lowered.default_binding() | {s: dims[s.name] for s in lowered.default_binding() if s.name in dims}
        picks = tuning.choices(lowered, binding, {}, H100, count=4)
        assert picks[0] == tuning.tune(lowered, binding, {}, H100) and len(picks) == 4
        assert len({tuple(sorted((str(s), v) for s, v in p.items())) for p in picks}) == 4
        times = [sum(e.time_us for e in tuning.parameters(lowered, binding, {s.name: v for s, v in p.items()},
                                                          H100)[2]) for p in picks]
        assert times[0] == min(times)
        blocks = [tuple(c.blocks() for c in tuning.parameters(lowered, binding, {s.name: v for s, v in p.items()},
                                                               H100)[1].values()) for p in picks]
        assert len(set(blocks)) == 4, blocks  # each launches other numbers of blocks
        assert all(valid(k, {**binding, **p}, H100, smem=False) for p in picks for k in kernels_of(lowered))
        assert len(tuning.choices(lowered, binding, {}, H100, count=1)) == 1


def test_strips_of_rows_are_priced_by_the_lines_they_fill_and_the_tuner_gives_them_more_warps(tmp_path,
                                                                                                 monkeypatch):
    """A copy fills 128-byte lines however few of their bytes a tile uses (`intake.tile_lines`): a decode
    projection's weights read 16 columns (32 bytes) of each 8 KB row fill a line a row. Priced so, rmsnorm_linear
    at n = 8 on the H200 file takes 32 columns a block (128 blocks), and twice the threads, whose copies take in
    more (`optimize.rank`); asked for 256, it stays there (at 512 the bandwidth binds as before); at prefill,
    where the products bind, the threads stay as asked."""
    from prism_dsl.backend.intake import tile_lines
    from prism_dsl.pipeline.optimize import rank
    from prism_dsl.semantics.reference import bind_dims

    assert tile_lines((512, 16), (4096, 4096), 2) == 512  # 32 bytes of each row: a line each
    assert tile_lines((8, 512), (8, 4096), 2) == 64  # 1 KB of each row: 8 lines each
    assert tile_lines((64, 4096), (4096, 4096), 2) == 4096  # whole rows, one run
    assert tile_lines((1, 1, 128, 16), (2, 8, 128, 4096), 2) == 128  # keys stored transposed: 16 keys a line
    assert tile_lines((3, 40), (10, 40), 4) == 4  # 480 contiguous bytes
    monkeypatch.setenv("PRISM_CACHE_DIR", str(tmp_path))
    program = load(ROOT / "programs" / "fused" / "rmsnorm_linear.prism").program()
    h200 = load_hardware("h200")
    decode = rank(program, bind_dims(program, {"n": 8, "d": 4096}), h200, CodegenConfig())
    assert decode.params["gx"] == 128 and decode.threads == 256
    again = rank(program, bind_dims(program, {"n": 8, "d": 4096}), h200, CodegenConfig())  # the tuning database
    assert (again.params, again.threads) == (decode.params, decode.threads)
    asked = rank(program, bind_dims(program, {"n": 8, "d": 4096}), h200, CodegenConfig(threads=256))
    assert asked.threads is None and asked.estimated_us == decode.estimated_us  # 512 takes in no more by the model
    prefill = rank(program, bind_dims(program, {"n": 4096, "d": 4096}), h200, CodegenConfig())
    assert prefill.threads is None


@needs_cxx
def test_a_decode_projection_of_32_columns_on_256_threads_passes_the_thread_sanitizer(tmp_path, capsys):
    """The shape the tuner now gives the decode projections (32 columns a block, 256 threads: each product's
    mma.sync tiles over 2 column groups and 4 slices of the contraction, 1x2x4 warps), two products sharing X's
    tile, emulated under the thread sanitizer."""
    from prism_dsl.cli.main import main

    out = tmp_path / "out"
    assert main(["compile", str(ROOT / "programs" / "fused" / "rmsnorm_mlp.prism"), "--search", "none", "--dims",
                 "n=8,d=512", "--grid", "x=16", "--threads", "256", "--arch", "none", "--sanitize", "thread",
                 "-o", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verified"] and report["checked"]["emulation"]["emulation"]["sanitizer"] == "thread"
    assert report["kernels"][0]["block"][0] == 256 and "1x2x4 warps" in (out / f"{report['kernels'][0]['file']}").read_text()


GEMV = """dims n = 2, k = 256, m = 512
program gemv(A: f16[n, k], B: f16[k, m]) {
    kernel mv grid(x = gx) loop(F) {
        at = load A[:, loop]
        bt = load B[loop, x]
        store C[:, x] = acc_sum(at @ bt)
    }
    return C
}
"""


@needs_cxx
@pytest.mark.parametrize("gx, lanes, sanitizer", [(1, 1, None), (2, 2, "address"), (16, 16, "thread")],
                         ids=["1-lane", "2-lanes", "16-lanes"])
def test_a_product_with_too_few_rows_for_tensor_cores_reads_8_columns_per_load(gx, lanes, sanitizer, tmp_path):
    """Two rows: no mma shape takes them, so each group of lanes computes 8 adjacent outputs from 16-byte
    loads of the weight tile, the contraction split over the lanes where the outputs are fewer than the
    threads; the emulated code matches the reference (the split contraction's shuffles under each sanitizer)."""
    path = tmp_path / "gemv.prism"
    path.write_text(GEMV)  # the plain path: with tensor cores the two rows take "mmarows" (the scores' tests below)
    options = BuildOptions(grid={"gx": gx}, loop={"F": 2}, archs=(), sanitize=sanitizer,
                           codegen=CodegenConfig(tensor_cores=False))
    built = build(load(path).program(), H100, options)
    src = built.kernels[0].source
    assert f"8 outputs per {lanes} lane" in src and "prism::load8(w, s_bt + k * " in src and "mma" not in src
    assert ("prism::shfl_xor(part[c], o)" in src) == (lanes > 1)
    check = emulate(built, options)
    assert check.passed, check


ROWDOT = """dims d = {d}, m = {m}
program rowdot(Q: {q}[2, d], K: f16[m, d]) {{
    kernel k grid(x = gx) {{
        qt = load Q[:, :]
        kt = load K[x, :]
        store S[:, x] = {a} @ transpose(kt, 1, 0)
    }}
    return S
}}
"""


@needs_cxx
@pytest.mark.parametrize("d, m, gx, q, a, lanes, sanitizer", [
    (128, 256, 2, "f16", "qt", 1, "address"), (64, 32, 2, "f16", "qt * 0.125", 4, "thread"),
    (256, 8, 1, "f32", "exp(qt)", 8, "thread"), (512, 4, 1, "f16", "qt", 16, None),
    (40, 16, 1, "f16", "qt", 4, "thread")],
    ids=["1-lane", "4-lanes", "8-lanes-f32-queries", "16-lanes", "rows-of-5-chunks"])
def test_a_product_with_a_transposed_tile_reads_its_rows_16_bytes_a_load(d, m, gx, q, a, lanes, sanitizer, tmp_path):
    """Scores at decode (`q @ transpose(kt)`, two rows: no mma shape takes them): each output's row of q and of
    the key tile run along the contraction, so a lane reads 8 elements of each by one 16-byte load ("dotrows",
    `dots.row_lanes`), one lane a row where the outputs fill the threads, up to 16 sharing one by shuffles
    where they are few; the left operand element by element where it is no 16-bit buffer (f32 queries); unpadded
    rows of 40 elements (5 chunks: a lane a row, then doubled to a power of two, never 5). The emulated code
    matches the reference, the shuffles under each sanitizer. (Without tensor cores: with them, the f16 cases take
    the next test's path.)"""
    path = tmp_path / "rowdot.prism"
    path.write_text(ROWDOT.format(d=d, m=m, q=q, a=a))
    options = BuildOptions(grid={"gx": gx}, archs=(), sanitize=sanitizer, codegen=CodegenConfig(tensor_cores=False))
    built = build(load(path).program(), H100, options)
    src = built.kernels[0].source
    per = f"per {lanes} lanes" if lanes > 1 else "a lane"
    assert f"one output {per}, rows by 16-byte loads" in src and "prism::load8(w, s_kt + " in src, src
    assert "real dot = real(0)" not in src and "mma" not in src
    assert ("prism::shfl_xor(dot, o)" in src) == (lanes > 1)
    assert ("prism::load8(x, " in src) == (q == "f16")  # f32 queries: read element by element
    check = emulate(built, options)
    assert check.passed, check


SCORES = """dims h = {h}, m = {m}, d = {d}, n = {n}
program scores(Q: {t}[h, m, d], K: {t}[h, n, d]) {{
    kernel k grid(x = gx) {{
        qt = load Q[:, :, :]
        kt = load K[:, x, :]
        store S[:, :, x] = qt @ transpose(kt, 2, 1)
    }}
    return S
}}
"""
SCORES_KT = """dims h = {h}, m = {m}, d = {d}, n = {n}
program scores(Q: {t}[h, m, d], K: {t}[h, d, n]) {{
    kernel k grid(x = gx) {{
        qt = load Q[:, :, :]
        kt = load K[:, :, x]
        store S[:, :, x] = qt @ kt
    }}
    return S
}}
"""


@needs_cxx
@pytest.mark.parametrize("h, m, d, n, t, keys, sanitizer", [
    (1, 1, 128, 64, "f16", "rows", "thread"), (2, 2, 64, 48, "bf16", "rows", "address"),
    (2, 4, 32, 32, "f16", "rows", None), (2, 1, 64, 32, "f16", "cols", "thread")],
    ids=["one-query", "two-heads-bf16", "four-queries", "keys-as-columns"])
def test_scores_of_a_few_queries_run_on_tensor_cores_with_the_queries_as_an_mma_s_columns(h, m, d, n, t, keys,
                                                                                           sanitizer, tmp_path):
    """`q @ transpose(kt)` with 1 to 4 rows of q (decode: one query, or a group sharing its keys): no mma shape takes
    q's rows, so the keys are the m16n8k16 tile's 16 rows (ldmatrix from the padded tile; ldmatrix.trans where the
    keys are the tile's columns, `q @ kt`) and the queries its 8 columns ("mmarows", `dots.row_mma`), each warp taking 16 keys of a head at a time (48 keys: 3 tiles over 4
    warps); the plain path ("dotrows") stays for targets without tensor cores. The emulated mma.sync matches the
    reference, under each sanitizer; the cost model counts the product on tensor cores at 8 columns."""
    from prism_dsl.backend.cost import kernel_work
    from prism_dsl.backend.dots import row_mma

    path = tmp_path / "scores.prism"
    path.write_text((SCORES if keys == "rows" else SCORES_KT).format(h=h, m=m, d=d, n=n, t=t))
    options = BuildOptions(grid={"gx": 1}, archs=(), sanitize=sanitizer)
    built = build(load(path).program(), H100, options)
    k = built.kernels[0]
    assert "on tensor cores, 16 keys a warp's m16n8k16 tiles" in k.source and k.tensor_cores
    assert f"prism::mma_m16n8k16<{'half' if t == 'f16' else '__nv_bfloat16'}>(d, a, b, d);" in k.source
    assert f"prism::ldmatrix<4{'' if keys == 'rows' else ', true'}>(a, s_kt + " in k.source
    plain = "rows by 16-byte loads" if keys == "rows" else "8 outputs per"
    assert "#else" in k.source and plain in k.source  # the plain path, for older targets
    check = emulate(built, options)
    assert check.passed, check
    (c,) = built.concrete.values()
    work = kernel_work(c, H100)
    assert work.flops == 0 and work.rows == work.tensor_core_flops == 2 * h * n * 8 * d
    product = next(x for x in c.kernel.body() if x.op == "matmul")
    assert not row_mma(c, *product.args, (h, m, n), d, 128, CodegenConfig(tensor_cores=False))


def test_a_product_computed_on_its_own_stays_on_wmma(tmp_path):
    path = tmp_path / "product.prism"
    path.write_text("""dims n = 64, k = 32, m = 64
program product(A: f16[n, k], B: f16[k, m]) {
    kernel mm grid(x = gx) {
        at = load A[x, :]
        bt = load B[:, :]
        store C[x, :] = at @ bt
    }
    return C
}
""")
    kernel = build(load(path).program(), H100, BuildOptions(grid={"gx": 2}, archs=())).kernels[0]
    assert "wmma::mma_sync" in kernel.source and kernel.tensor_cores


@needs_cxx
def test_tanh_and_its_gelu_run_in_a_fused_kernel(tmp_path):
    """GPT-2's MLP activation (`gelu_tanh`) and `tanh`, fused into registers, against the reference."""
    path = tmp_path / "mlp.prism"
    path.write_text("""dims n = 16, d = 64, f = 128
program mlp(X: f16[n, d], W1: f16[d, f], W2: f16[f, d]) {
    kernel fused grid(x = gx) loop(F) {
        xt = load X[x, :]
        w1t = load W1[:, loop]
        w2t = load W2[loop, :]
        store Y[x, :] = acc_sum(gelu_tanh(xt @ w1t) @ w2t) + tanh(xt)
    }
    return Y
}
""")
    options = BuildOptions(grid={"gx": 1}, loop={"F": 2}, archs=())
    built = build(load(path).program(), H100, options)
    assert "prism::gelu_tanh_(" in built.kernels[0].source and "prism::tanh_(" in built.kernels[0].source
    check = emulate(built, options)
    assert check.passed, check


# q tile 64 x 64, key tiles of 64 (dh 64), of 48 (dh 32), of 32 with 8 warps of 16 query rows (q tile 128)
FLASH_SHAPES = [({"q": 64, "kv": 128, "dh": 64}, 1, 2), ({"q": 128, "kv": 96, "dh": 32}, 2, 2),
                ({"q": 128, "kv": 64, "dh": 64}, 1, 2)]


def flash_build(dims: dict, gq: int, loop: int, dtype: str = "f16", tmp_path=None, **kw):
    path = ROOT / "programs/fused/attention.prism"
    if dtype != "f16":
        path, text = tmp_path / "attention.prism", path.read_text().replace("f16", dtype)
        path.write_text(text)
    program = load(path).program()
    options = BuildOptions(dims={"b": 1, "h": 2, **dims}, grid={"gb": 1, "gh": 2, "gq": gq}, loop={"F": loop},
                           archs=(), **kw)
    return build(program, H100, options), options


def test_online_softmax_keeps_scores_and_probabilities_in_registers():
    """FlashAttention-2's dataflow: s = q @ kt on mma.sync into registers, exp(s - max) packed to f16 in
    registers and fed to p @ v; no shared buffer for s, p or the rescaling factors."""
    built, _ = flash_build(*FLASH_SHAPES[0], codegen=CodegenConfig(wgmma=False))  # on wgmma: test_online_softmax_on_wgmma
    src = built.kernels[0].source
    assert "s and p in registers" in src and "prism::pack2<half>(lo[0], lo[1])" in src
    assert src.count("prism::mma_m16n8k16<half>") == 4 and "wmma" not in src
    assert "s_v2" not in src and "s_a4_p" not in src and "s_a4_scale" not in src
    assert "float f_v2_o0[1][8][4] = {};" in src and "prism::shfl_xor(mx, 2)" in src
    assert "#error" in src  # no plain form without the buffers: older GPUs take --no-tensor-cores
    plain, _ = flash_build(*FLASH_SHAPES[0], codegen=CodegenConfig(tensor_cores=False))
    assert "s_a4_p" in plain.kernels[0].source and "mma_m16n8k16" not in plain.kernels[0].source
    eight, _ = flash_build(*FLASH_SHAPES[2], codegen=CodegenConfig(wgmma=False))
    assert eight.kernels[0].block == (256, 1, 1) and "8 warps of 16 rows" in eight.kernels[0].source


@needs_cxx
@pytest.mark.parametrize("shape, dtype", [(FLASH_SHAPES[0], "f16"), (FLASH_SHAPES[1], "bf16")],
                         ids=["64x64-f16", "128x48-bf16"])
def test_online_softmax_in_registers_agrees_with_the_reference(shape, dtype, tmp_path):
    """Beside the fused attention program at the suite's dims (32 x 64 tiles, golden file, sanitizers)."""
    built, options = flash_build(*shape, dtype=dtype, tmp_path=tmp_path)
    assert "prism::pack2<" in built.kernels[0].source
    check = emulate(built, options)
    assert check.passed and check.outputs["O"]["max_rel_err"] < 5e-3, check



# -- nvcc -----------------------------------------------------------------------------------------------


@needs_nvcc
@pytest.mark.nvcc
@pytest.mark.parametrize("path", FUSED + PROGRAMS, ids=lambda p: p.parent.name + "/" + p.stem)
def test_every_rendered_kernel_compiles_with_nvcc(path, tmp_path):
    built, _ = build_of(path)
    archs = ("sm_90", "sm_80") if path.parent.name == "fused" else ("sm_90",)
    results = nvcc_check(built.kernels, tmp_path, archs, read=("sm_90",))  # the SASS: the arch the model prices
    for kernel, per_arch in results.items():
        for arch, r in per_arch.items():
            assert r["ok"], f"{kernel} ({arch}): {r.get('stderr')}"
            assert r["registers"] > 0 and r["spill_stores"] == 0
            assert r["warnings"] == [], f"{kernel} ({arch}): {r['warnings']}"  # a -Werror build takes it as it is


@needs_nvcc
def test_each_kernel_names_the_command_that_builds_it_alone(tmp_path):
    """The line "Compiles on its own:" of a kernel's .cu is a command that makes an object file of it beside
    prism.cuh: for a kernel on wgmma the arch-specific target named apart (`-arch=sm_90a` with `-c` also runs a
    plain sm_90 pass, where the kernel's #error stops it), for the others sm_90 and sm_80."""
    from prism_dsl.backend.nvcc import write_sources

    wgmma = build(load(ROOT / "programs/fused/rmsnorm_linear.prism").program(), H100,
                  BuildOptions(dims={"n": 256, "d": 1024}, archs=())).kernels
    plain, _ = build_of(ROOT / "programs/fused/swiglu.prism", archs=())
    assert [k.wgmma for k in wgmma] == [True] and not any(k.wgmma for k in plain.kernels)
    write_sources([*wgmma, *plain.kernels], tmp_path)
    for k in [*wgmma, *plain.kernels]:
        (line,) = [line for line in k.source.splitlines() if line.startswith("// Compiles on its own: ")]
        command, _, other = line.removeprefix("// Compiles on its own: ").partition(" (or ")
        for cmd in [command] + ([command.replace("-arch=sm_90", other.strip("()"))] if other else []):
            done = subprocess.run([*cmd.split(), "-o", "k.o"], cwd=tmp_path, capture_output=True, text=True)
            assert done.returncode == 0 and (tmp_path / "k.o").is_file(), (cmd, done.stderr)
            (tmp_path / "k.o").unlink()


def test_offsets_into_tensors_past_an_ints_range_are_64_bit(monkeypatch):
    """A long-context key cache (b = 64, h = 8, kv = 131072, dh = 128: 2^33 elements) is indexed in 64-bit
    arithmetic, each dim's index widened before it meets its stride (in int the offset wraps and the GPU
    reads elsewhere); a tensor an int counts keeps int offsets. The emulation cannot hold such tensors, so
    the widened offsets are emulated at small dims, every tensor taken as past the range."""
    from prism_dsl.backend import ctext
    from prism_dsl.backend.ctext import address

    assert address([["b"], ["t", "j"]], (2**16, 2**16)) == "(long long)(b) * 65536 + (long long)(t + j)"
    assert address([["b"], ["t", "j"]], (2**15, 2**16)) == "b * 65536 + t + j"
    program = load(ROOT / "programs/fused/attention.decoding.prism").program()
    options = BuildOptions(dims={"b": 64, "h": 8, "q": 1, "kv": 131072, "dh": 128}, archs=(), emulate=False)
    partial = next(k for k in build(program, H100, options).kernels if k.name == "partial").source
    # the first iteration's element, then the iteration's step on it (`copies.load_step`), each widened
    assert "g_K + ((long long)(blockIdx.x * 1) * 134217728 + (long long)(blockIdx.y * 1) * 16777216" in partial
    assert "g_V + ((long long)(blockIdx.x * 1) * 134217728" in partial
    assert re.search(r"\+ \(long long\)\(ahead \* \d+\) \* 128\);", partial)
    assert "g_Q + blockIdx.x * 1 * 1024 + " in partial and "g_M[blockIdx" in partial  # small: int
    if compiler():
        monkeypatch.setattr(ctext, "INT_MAX", 100)
        small = BuildOptions(dims={"b": 2, "h": 2, "q": 1, "kv": 256, "dh": 64}, archs=())
        built = build(program, H100, small)
        assert all("(long long)(" in k.source for k in built.kernels)
        check = emulate(built, small)
        assert check.passed, check


SUM_OF_SQUARES = """dims d = 8589934592
program sumsq(X: f32[1, d]) {
    kernel k grid(y = 256) loop(4096) {
        xt = load X[:, y*loop]
        store Y[:, :] += acc_sum_last(xt * xt)
    }
    return Y
}
"""


def test_a_dim_past_an_ints_range_is_indexed_in_64_bit_before_each_product(monkeypatch):
    """A vector of 2^33 elements: a block's start along it (`blockIdx.y * 33554432`) and a loop step
    (`ahead * 8192`) wrap in 32 bits (block 128 read block 0's elements again) however their sum is cast
    after, so each is widened before its own product; a causal mask's positions along such a dim likewise.
    Emulated at small dims with every dim taken as past the range."""
    from prism_dsl.backend import codegen, ctext
    from prism_dsl.backend.ctext import address

    assert address([["blockIdx.y * 33554432", "i1"]], (2**33,)) == "(long long)blockIdx.y * 33554432 + (long long)i1"
    assert address([["b"], ["t * 4", "j"]], (2, 2**32)) == "(long long)(b) * 4294967296 + (long long)t * 4 + (long long)j"
    program = load("sumsq.prism", SUM_OF_SQUARES).program()
    source = build(program, H100, BuildOptions(archs=(), emulate=False)).kernels[0].source
    assert "g_X + ((long long)blockIdx.y * 33554432 + (long long)i1) + k * 512 + (long long)ahead * 8192);" in source
    if compiler():
        for module in (ctext, codegen):
            monkeypatch.setattr(module, "INT_MAX", 7)
        program = load(ROOT / "programs/fused/causal_attention.prism").program()
        small = BuildOptions(dims={"b": 1, "h": 2, "q": 64, "kv": 64, "dh": 64}, archs=())
        built = build(program, H100, small)
        assert "(long long)blockIdx" in built.kernels[0].source or "(long long)blk_" in built.kernels[0].source
        check = emulate(built, small)
        assert check.passed, check


def test_a_tile_past_an_ints_range_of_elements_is_refused_where_it_is_stored():
    """A block's threads walk a tile by one flat int index: an outer product whose block computes 57344 x 57344
    elements (the grid pinned to one block) is refused at its store, not rendered to wrap."""
    text = """dims n = 57344, m = 57344
program outer(A: f16[n, 1], B: f16[1, m]) {
    kernel k grid(x = gx) {
        at = load A[x, :]
        bt = load B[:, :]
        store Y[x, :] = at * bt
    }
    return Y
}
"""
    from prism_dsl.base.errors import PrismError

    program = load("outer.prism", text).program()
    gx = next(s for s in free_symbols(program) if s.name == "gx")
    with pytest.raises(PrismError) as e:
        instantiate_program(program, {**program.default_binding(), gx: 1}, H100)
    assert "elements of one block's tile (m*n/gx) is 3288334336, above the limit of 2147483647" in str(e.value)


def test_a_threads_copies_fall_a_fixed_distance_apart_where_the_tile_allows():
    """`copies.apart`: a thread's copies of a tile, one pass of the block's threads apart, written as its first
    copy's addresses plus k times one distance at each end; not where a pass carries into another dim, the
    swizzle differs from one copy to the next, or the threads do not all make the same number."""
    from prism_dsl.backend.copies import Apart, apart

    swizzled = "i0 * 64 + (i1 / 8 % 8 ^ i0 % 8) * 8 + i1 % 8"  # a [rows, 64] tile in wgmma's 128-byte swizzle
    # 128 x 64 of a 4096-wide tensor, 256 threads of 8: a pass is 32 rows
    assert apart((128, 64), (4096, 4096), 8, 256, swizzled) == Apart(4, 32 * 4096, 32 * 64)
    assert apart((128, 64), (4096, 4096), 8, 256, "i0 * 72 + i1") == Apart(4, 32 * 4096, 32 * 72)
    # 4 rows a pass: the swizzle's row % 8 differs between a thread's copies
    assert apart((16, 64), (4096, 4096), 8, 32, swizzled) is None
    assert apart((16, 64), (4096, 4096), 8, 32, "i0 * 64 + i1") == Apart(4, 4 * 4096, 256)
    # half rows of 2048 in passes of 1024: the third copy carries into the tile's next row, which is not the
    # tensor's next 1024 elements (whole rows are: there the carry changes nothing)
    assert apart((2, 2048), (8, 4096), 8, 128, "i0 * 2048 + i1") is None
    assert apart((2, 4096), (8, 4096), 8, 256, "i0 * 4096 + i1") == Apart(4, 2048, 2048)
    # 3 copies' worth for 2 threads' passes: not every thread makes the same number
    assert apart((24, 64), (4096, 64), 8, 128, "i0 * 64 + i1") is None
    assert apart((8, 64), (4096, 64), 8, 64, "i0 * 64 + i1") is None  # one copy a thread: nothing apart
    assert apart((128, 64), (4096, 4096), 8, 256, "s_x[i0]") is None  # not index arithmetic: not evaluated


def test_past_the_warps_that_fill_an_sms_intake_the_tuner_takes_fewer_iterations():
    """Decode attention over a long cache (b = 64, h = 8, kv = 131072), device memory binding: loops of 2048 and
    4096 iterations give the same estimate (within 0.01%: the queries' tile, loaded once a block, is all that
    differs) and keep at least the 17 warps whose copies fill an SM's intake, so the tuner takes the fewer
    iterations, each with its barriers. (At 8192 the key tiles would be 8 keys wide or the warps fewer: the keys
    are stored transposed, and a narrower tile reads 16 bytes of each 128-byte line, `intake.line_seconds`.)"""
    from prism_dsl.backend.tuning import INTAKE_WARPS

    program = load(ROOT / "programs/fused/attention.decoding.prism").program()
    dims = {"b": 64, "h": 8, "q": 1, "kv": 131072, "dh": 128}
    chosen = build(program, H100, BuildOptions(dims=dims, archs=(), emulate=False))
    partial = next(e for e in chosen.estimates if e.kernel == "partial")
    assert chosen.params["F"] == 2048 and partial.warps >= INTAKE_WARPS
    other = build(program, H100, BuildOptions(dims=dims, archs=(), emulate=False, loop={"F": 4096}))
    alike = next(e for e in other.estimates if e.kernel == "partial")
    assert alike.time_us == pytest.approx(partial.time_us, rel=1e-4) and alike.warps >= INTAKE_WARPS


@needs_nvcc
@pytest.mark.nvcc
def test_shared_memory_starts_on_a_swizzle_atom(tmp_path):
    """wgmma's 128-byte swizzle is of absolute shared-memory address bits 7-9 (its descriptors say base offset
    0), and launch.py places swizzled tiles at multiples of 1024 bytes from the dynamic shared memory: that
    must itself start on a multiple of 1024, which the declaration asks for rather than leaving to where ptxas
    happens to put it: at 0x400 in every kernel here, but at 0x480 with a static `int[5]` before it and a
    128-byte alignment (nvcc 13, sm_90a; 0x800 with the 1024-byte one)."""
    (tmp_path / "prism.cuh").write_text((ROOT / "templates/prism.cuh").read_text())
    (tmp_path / "k.cu").write_text(
        '#include "prism.cuh"\nextern "C" __global__ void k(int* out) {\n    __shared__ int before[5];\n'
        '    PRISM_SMEM(4096);\n    before[threadIdx.x % 5] = 1;\n'
        '    out[0] = static_cast<int>(__cvta_generic_to_shared(prism_smem)) + before[0];\n}\n')
    done = subprocess.run(["nvcc", "--ptx", "-arch=sm_90a", "k.cu", "-o", "k.ptx"], cwd=tmp_path, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert re.search(r"\.extern \.shared \.align 1024 \.b8 prism_smem\[\]", (tmp_path / "k.ptx").read_text())


# -- the generated code, run on the CPU --------------------------------------------------------------------


@needs_cxx
@pytest.mark.parametrize("path", FUSED + PROGRAMS, ids=lambda p: p.parent.name + "/" + p.stem)
def test_generated_code_agrees_with_the_reference_in_the_cpu_emulation(path, tmp_path):
    built, options = build_of(path, archs=())
    check = emulate(built, options)
    assert check.passed, check


def test_tiles_too_narrow_for_16_bytes_are_copied_by_narrower_cp_async_and_pipelined():
    """FlashDecoding's combining loop reads one f32 max and sum per piece: 4-byte copies, so the loop is
    pipelined like the others (a load waited for every iteration would cost a memory latency each)."""
    grid, loop = GOLDEN_PARAMS["attention.decoding"]
    built, _ = build_of(ROOT / "programs/fused/attention.decoding.prism", grid, loop, archs=())
    combine = next(k for k in built.kernels if k.combines == "combine")  # in the pieces' launch
    assert "prism::cp_async<1>(s_mt_stages" in combine.source and "prism::cp_async<4>(s_pt_stages" in combine.source
    assert "prism::cp_async_wait<" in combine.source and "s_mt[0] = g_M" not in combine.source


@needs_cxx
@pytest.mark.parametrize("sanitizer", [None, "address"], ids=["plain", "address"])
def test_per_thread_loops_show_their_trip_count_and_stop_a_ragged_last_pass_at_the_tile_end(sanitizer):
    """Every loop of a thread (warp, lane) over a tile counts passes from 0, so nvcc sees the trip count and
    hoists the index arithmetic; at n=3, d=200 the row of 200 (25 groups of 8 for its 16 lanes) takes two
    sweeps, the second cut short (its last pass stores the row straight to the output, 16 bytes a store), and
    tiles under 128 groups take one guarded pass. The emulation checks both."""
    program = load(ROOT / "programs/rmsnorm_linear.prism").program()
    options = BuildOptions(dims={"n": 3, "d": 200}, archs=(), sanitize=sanitizer, emulate_blocks="all")
    built = build(program, H100, options)
    sources = "\n".join(k.source for k in built.kernels)
    assert not re.search(r"for \(int \w+ = (PRISM_TID|lane)", sources)  # no loop starting at the thread's index
    assert "for (int s = 0; s < 2; ++s) {" in sources and "if (j8 >= 200) break;" in sources
    assert "if (const int v = PRISM_TID; v < 25) {" in sources and "prism::store16(g_t0 + blockIdx.x * 1 * 200 + j8, w);" in sources
    check = emulate(built, options)
    assert check.passed, check


def test_a_loop_of_small_tiles_runs_deep_enough_to_keep_the_latency_covered():
    """FlashDecoding's combining loop brings a max, a sum and a 128-wide row per piece (520 bytes): 3 stages
    keep about 1 KB in flight, a DRAM latency per two pieces. It goes as deep as its pieces (at most 16), so
    the bytes an SM needs are in flight (`launch.deepened`), and the model prices the shorter wait; the
    pieces' loop, whose tiles are large, keeps the configured depth, and --stages 1 still turns it off."""
    from prism_dsl.backend.cost import for_hardware
    from prism_dsl.backend.launch import MAX_STAGES, deepened, layout

    program = load(ROOT / "programs/fused/attention.decoding.prism").program()
    syms = {s.name: s for s in [*free_symbols(program), *program.default_binding()]}

    def shaped(kv, pieces, name, flight=None, **options):
        dims = dict(b=2, h=8, q=1, kv=kv, dh=128, gb=2, gh=8, S=pieces, F=kv // pieces // 64)
        c = instantiate_program(program, {syms[k]: v for k, v in dims.items()}, H100)[name]
        config = for_hardware(CodegenConfig(**options), H100)
        config = config if flight is None else replace(config, flight=flight)
        return layout(c, config), estimate(c, H100, config=config).time_us

    assert for_hardware(CodegenConfig(), H100).flight == 13636  # 3000 GB/s x 600 ns over 132 SMs
    (deep, t_deep), (three, t_three) = shaped(4096, 16, "combine"), shaped(4096, 16, "combine", flight=0)
    assert (deep.stages, three.stages) == (16, 3) and t_deep < t_three - 1.0
    assert shaped(4096, 8, "combine")[0].stages == 8  # no deeper than the loop
    assert shaped(32768, 64, "combine")[0].stages == MAX_STAGES
    assert shaped(4096, 16, "combine", stages=1)[0].stages == 1
    assert shaped(4096, 16, "combine", stages=2)[0].stages == 16  # --stages 2 is the depth for large tiles
    assert shaped(4096, 16, "partial")[0].stages == 3  # 36 KB of keys and values per iteration
    assert shaped(4096, 16, "partial", stages=2)[0].stages == 2
    assert deepened(520, 64, CodegenConfig()) == MAX_STAGES and deepened(4096, 64, CodegenConfig()) == 5
    assert deepened(64 << 10, 64, CodegenConfig()) == 2  # below --stages: the configured depth decides


@needs_cxx
@pytest.mark.parametrize("sanitizer", [None, "thread", "address"])
def test_a_sixteen_stage_combine_agrees_with_the_reference_under_each_sanitizer(sanitizer):
    """FlashDecoding over 16 pieces: the combine's loop runs 16 stages deep (every piece in flight before the
    first is read, `cp.async.wait_group 14`), and the emulated code matches the reference, the stages'
    refills and reads ordered as the sanitizers require; it runs in the pieces' launch, so the sanitizers also
    check the tickets that order each tile's pieces before its combining block (`tails`)."""
    program = load(ROOT / "programs/fused/attention.decoding.prism").program()
    options = BuildOptions(dims={"b": 1, "h": 2, "kv": 1024, "dh": 64}, grid={"gb": 1, "gh": 2, "S": 16},
                           loop={"F": 1}, archs=(), sanitize=sanitizer)
    built = build(program, H100, options)
    assert [(k.name, k.combines, k.tickets) for k in built.kernels] == [("partial", "combine", 2)]
    combine = built.kernels[0].source.split("prism::last_of(")[1]
    assert "16-stage cp.async pipeline" in combine and "prism::cp_async_wait<14>()" in combine
    check = emulate(built, options)
    assert check.passed, check


@needs_cxx
def test_bf16_flash_decoding_keeps_its_partial_states_in_f32_and_meets_the_tolerance(tmp_path):
    """Rounded to bf16, the per-piece states of this shape miss the 1e-2 tolerance (5e-2 measured); in f32
    only the final rounding is left."""
    path = tmp_path / "decoding.prism"
    path.write_text((ROOT / "programs/fused/attention.decoding.prism").read_text().replace("f16", "bf16"))
    program = load(path).program()
    options = BuildOptions(dims={"b": 1, "kv": 2048}, archs=())
    built = build(program, H100, options)
    partial = next(k for k in built.kernels if k.name == "partial")
    assert partial.source.count("float* __restrict__ g_") == 3  # M, L, P
    check = emulate(built, options)
    assert check.passed and check.outputs["O"]["max_rel_err"] < 5e-3, check


@needs_cxx
def test_bf16_causal_attention_is_checked_at_the_tolerance_of_bf16(tmp_path):
    """RoPE'd queries and keys and the probabilities go to the tensor cores in bf16, as they must: the result
    misses f16's 1e-2 (so do those roundings made exactly, `compare.tolerance`) and meets bf16's 0.078."""
    path = tmp_path / "causal.prism"
    path.write_text((ROOT / "programs/fused/causal_attention.prism").read_text().replace("f16", "bf16"))
    options = BuildOptions(dims={"b": 1, "h": 1, "q": 32, "kv": 64, "dh": 64}, archs=(),
                           codegen=CodegenConfig(threads=256))
    check = emulate(build(load(path).program(), H100, options), options)
    assert check.rtol == 20 * 2.0**-8 and check.passed, check
    assert 1e-2 < check.outputs["O"]["max_rel_err"] < 3e-2


@needs_cxx
def test_emulation_catches_a_wrong_kernel(tmp_path, monkeypatch):
    import prism_dsl.backend.codegen as codegen

    monkeypatch.setitem(codegen.C_OPS, "mul", "({0} + {1})")  # a code generator bug: * rendered as +
    built, options = build_of(ROOT / "programs/fused/swiglu.prism", archs=())
    assert emulate(built, options).passed is False


# -- the cost model ---------------------------------------------------------------------------------------


def _tuned(program):
    dims = program.default_binding()
    params = tune(program, dims, {}, H100)
    return sum(estimate(c, H100).time_us for c in instantiate_program(program, {**dims, **params}, H100).values())


@pytest.mark.parametrize("name", ["rmsnorm_linear", "rmsnorm_mlp"])
def test_cost_model_ranks_the_fused_kernel_above_the_unfused_sequence(name):
    fused = _tuned(load(ROOT / f"programs/fused/{name}.prism").program())
    unfused = _tuned(lower(load(ROOT / f"programs/{name}.prism").program()))
    assert fused < unfused


def test_the_lowering_computes_products_in_the_kernel_of_the_element_wise_value_they_feed():
    """swiglu as written lowers to the fused form's one kernel: both products' running sums, silu and the product
    of the two after the loop (an epilogue), priced alike; the product of a LayerNorm is stored, as are products
    whose contracted dims differ from the first's (lora's low-rank one) or that have another user."""
    program = lower(load(ROOT / "programs/swiglu.prism").program())
    (kernel,) = kernels_of(program)
    assert [n.op for n in kernel.body() if n.op in ("acc_sum", "silu", "mul")].count("acc_sum") == 2
    assert _tuned(program) == _tuned(load(ROOT / "programs/fused/swiglu.prism").program())
    lora = lower(load(ROOT / "programs/lora.prism").program())
    assert [k.name for k in kernels_of(lora)] == ["matmul_t0", "matmul_t1", "matmul_add_Y"]
    gpt2 = lower(load(ROOT / "programs/gpt2_mlp.prism").program())
    assert [k.name for k in kernels_of(gpt2)] == ["layer_norm_t0", "matmul_gelu_tanh_H", "matmul_Y"]
    shared = lower(load("p.prism", "dims n = 8, d = 64\nprogram p(X: f32[n, d], W: f32[d, d]) {\n"
                                "    T = X @ W\n    A = exp(T) + T\n    B = T * 2\n    return A, B\n}\n").program())
    assert len(kernels_of(shared)) == 3  # T has two users: stored once, read by both
    wider = lower(load("p.prism", "dims n = 8, d = 64\nprogram p(X: f32[n, d], W: f32[d, d], Z: f32[2, n, d]) {\n"
                               "    Y = (X @ W) + Z\n    return Y\n}\n").program())
    assert len(kernels_of(wider)) == 2  # the sum is larger than the product: its kernel reads the product


def test_cost_model_ranks_a_grid_that_fills_the_sms_above_one_that_leaves_them_idle():
    program = load(ROOT / "programs/fused/rmsnorm_linear.prism").program()
    syms = {s.name: s for s in free_symbols(program)}
    dims = program.default_binding()

    def time(gx):
        c = instantiate_program(program, {**dims, syms["gx"]: gx, syms["F"]: 64}, H100)["rmsnorm_matmul"]
        return estimate(c, H100).time_us

    assert time(128) < time(4)


def test_two_warpgroups_taking_turns_hide_one_softmax_behind_the_other_products():
    """Attention at prefill with 128 query rows a block (two warpgroups): they take turns on the tensor cores
    with two stages more than --stages (the later warpgroup may read the stage of two iterations before), so
    the copies still run two iterations ahead, and the model prices one's softmax beside the other's
    products. One warpgroup, --stages 2 or --no-pingpong: in step, as before."""
    from prism_dsl.backend.cost import for_hardware
    from prism_dsl.backend.launch import layout

    program = load(ROOT / "programs/fused/attention.prism").program()
    syms = {s.name: s for s in [*free_symbols(program), *program.default_binding()]}
    dims = {syms[k]: v for k, v in dict(b=1, h=16, q=4096, kv=4096, dh=128, gb=1, gh=16, F=64).items()}

    def kernel(gq):
        return instantiate_program(program, {**dims, syms["gq"]: gq}, H100)["flash_attention"]

    def shaped(c, **options):
        config = for_hardware(CodegenConfig(**options), H100)
        return layout(c, config), estimate(c, H100, config=config).time_us
    (turns, t_turns), (step, t_step) = shaped(kernel(32)), shaped(kernel(32), pingpong=False)
    assert turns.pingpong and turns.threads == 256 and (turns.stages, turns.lead) == (5, 2)
    assert not step.pingpong and step.overlap and (step.stages, step.lead) == (4, 2)
    assert turns.mbarriers >= turns.smem - 16 * turns.stages and turns.smem > step.smem + 32768  # a stage of kt and vt more
    assert t_turns < 0.8 * t_step
    assert not shaped(kernel(32), stages=2)[0].pingpong and not shaped(kernel(64))[0].pingpong  # one warpgroup


NORMED = """dims n = 4096, d = 4096
program normed(X: f16[n, d], W: f16[d, d]) {
    kernel fused grid(x = gx, y = gy) loop(F) {
        xt = load X[y, loop]
        wt = load W[loop, x]
        store Y[y, x] = acc_sum(xt @ wt)EXTRA
    }
    return Y
}
"""


def test_a_batch_in_flight_holds_a_stage_more_so_the_copies_run_two_iterations_ahead(write):
    """A projection at prefill on wgmma: each iteration's batch still reads its stage through the next, so the
    pipeline gets a stage more than --stages (4 for the default 3) and the copies run two iterations ahead, as
    in any loop at 3 stages. Not where shared memory lacks the stage, nor where it would leave fewer blocks
    per SM, nor at --stages 2 (no batch in flight). The model's pipeline floor (`intake.pipeline_seconds`)
    halves with the lead, and one iteration ahead leaves the kernel waiting for its tiles."""
    from dataclasses import replace as changed
    from prism_dsl.backend.cost import for_hardware
    from prism_dsl.backend.intake import pipeline_seconds
    from prism_dsl.backend.launch import layout

    program = load(write(NORMED.replace("EXTRA", ""))).program()
    syms = {s.name: s for s in [*free_symbols(program), *program.default_binding()]}

    def kernel(gx, gy):
        return instantiate_program(program, {**program.default_binding(), syms["gx"]: gx, syms["gy"]: gy,
                                             syms["F"]: 64}, H100)["fused"]
    c, config = kernel(16, 32), for_hardware(CodegenConfig(), H100)  # 128 x 256 tiles, 48 KB an iteration
    deep, two = layout(c, config), layout(c, changed(config, stages=2))
    short = layout(c, changed(config, smem_limit=170 * 1024))  # 3 stages fit, 4 do not
    assert deep.in_flight and (deep.stages, deep.lead) == (4, 2)
    assert short.in_flight and (short.stages, short.lead) == (3, 1)
    assert not two.in_flight and (two.stages, two.lead) == (2, 1)
    small = kernel(32, 64)  # 64 x 128 tiles: 3 stages leave 3 blocks per SM by shared memory, 4 would leave 2
    kept = layout(small, config)
    assert (kept.stages, kept.lead) == (3, 1) and H100.smem_per_sm // kept.smem == 3

    def floor(shape):
        return pipeline_seconds(c, shape, H100, 1, shape.threads / 32, 64)
    assert floor(short) == pytest.approx(2 * floor(deep)) and floor(two) == pytest.approx(floor(short))
    at = {shape.stages: estimate(c, H100, config=changed(config, smem_limit=limit))
          for shape, limit in ((deep, config.smem_limit), (short, 170 * 1024))}
    assert at[4].bound == "math" and at[3].bound == "memory" and at[3].time_us > 1.3 * at[4].time_us


def test_an_iterations_f32_work_runs_beside_the_wgmma_batch_left_in_flight(write):
    """RMSNorm then a projection at prefill: each iteration's sum of squares is computed while the batch of the
    iteration before runs on the tensor cores (`Layout.in_flight`), so the model counts only the longer of
    the two; with 2 stages the batch is waited for within its iteration, and the two add up."""
    from prism_dsl.backend.cost import SCALAR_REACH, _math_seconds, for_hardware, kernel_work
    from prism_dsl.backend.launch import layout

    def priced(extra, **options):
        program = load(write(NORMED.replace("EXTRA", extra))).program()
        syms = {s.name: s for s in [*free_symbols(program), *program.default_binding()]}
        c = instantiate_program(program, {**program.default_binding(), syms["gx"]: 16, syms["gy"]: 32,
                                          syms["F"]: 64}, H100)["fused"]
        config = for_hardware(CodegenConfig(**options), H100)
        return layout(c, config), kernel_work(c, H100), estimate(c, H100, config=config).time_us, c

    (flying, work, t_rms, c), (_, plain, t_plain, _) = priced(" / acc_rms_last(xt)"), priced("")
    assert flying.in_flight and work.looped > 0 and plain.looped == 0
    f32_us = H100.peak_tflops["f32"] * 1e6 * SCALAR_REACH  # f32 flops per us
    after = (work.flops - work.looped) / f32_us  # the division after the loop
    first = work.looped / f32_us / 64  # the first of 64 iterations has no batch beside it
    assert t_rms - t_plain <= (after + first) * 4 * 132 / 512 * 1.001  # 512 blocks in 4 waves of 132
    (waited, _, _, c2), (plain2, _, _, c3) = priced(" / acc_rms_last(xt)", stages=2), priced("", stages=2)
    assert not waited.in_flight

    def math_us(cc, shape, w):  # (the estimates themselves wait for the tiles one iteration ahead: memory-bound)
        return _math_seconds(cc, shape, H100, w.flops, w.tensor_core_flops, 1, w.vector, w.looped) * 1e6
    assert math_us(c2, waited, work) - math_us(c3, plain2, plain) > after + work.looped / f32_us * 0.9
    # f32 work longer than the products is the longer of the two: it counts whole, less what the batches hide
    more = 10**15
    alone = _math_seconds(c, flying, H100, work.flops + more, work.tensor_core_flops, 1, work.vector, work.looped + more)
    assert alone >= more / (f32_us * 1e6)


def test_a_copy_warp_is_priced_at_its_own_rate_and_tmas_copies_at_the_sms_intake(write):
    """RMSNorm's projection at prefill on wgmma: with --tma its copies are a copy warp's (`Layout.copy_warp`, 288
    threads launched), its products priced at WGMMA_COPY_WARP where the barrier's form has WGMMA_IN_FLIGHT (`cost`),
    and TMA's copies taken in at the SM's own rate, not its 8 computing warps' (which would bind them: 48 KB an
    iteration a block at 8 x 3.7 bytes a clock); --no-copy-warp, thread 0 behind the barrier, the latter rate."""
    from prism_dsl.backend.cost import WGMMA_COPY_WARP, WGMMA_IN_FLIGHT, for_hardware
    from prism_dsl.backend.launch import layout

    program = load(write(NORMED.replace("EXTRA", " / acc_rms_last(xt)"))).program()
    syms = {s.name: s for s in [*free_symbols(program), *program.default_binding()]}
    c = instantiate_program(program, {**program.default_binding(), syms["gx"]: 16, syms["gy"]: 32, syms["F"]: 64},
                            H100)["fused"]
    us = {}
    for name, options in (("cp.async", {}), ("thread 0", {"tma": True, "copy_warp": False}), ("warp", {"tma": True})):
        config = for_hardware(CodegenConfig(**options), H100)
        laid = layout(c, config)
        assert laid.copy_warp == (name == "warp") and laid.launched == (288 if name == "warp" else 256)
        us[name] = estimate(c, H100, config=config)
    assert us["cp.async"].bound == us["warp"].bound == "math"  # (1.61 GB from L2 at 8 warps' intake: 235 us)
    assert us["cp.async"].time_us == pytest.approx(us["thread 0"].time_us)
    flops = us["warp"].tensor_core_flops / (H100.peak_tflops["f16"] * 1e6)  # us at the peak
    assert us["cp.async"].time_us - us["warp"].time_us == pytest.approx(
        flops * (1 / WGMMA_IN_FLIGHT - 1 / WGMMA_COPY_WARP) * 4 * 132 / 512, rel=0.05)  # 512 blocks in 4 waves


def test_a_copy_warp_only_where_its_block_stays_within_cudas_threads(write):
    """A copy warp's 32 threads come after the computing ones: at 1024 of them the block would have 1056, which no
    launch takes, so the copies are thread 0's there (`copies.copy_warp`); at 512, 544 are launched."""
    from prism_dsl.backend.cost import for_hardware
    from prism_dsl.backend.launch import layout

    program = load(write(NORMED.replace("EXTRA", " / acc_rms_last(xt)"))).program()
    syms = {s.name: s for s in [*free_symbols(program), *program.default_binding()]}
    c = instantiate_program(program, {**program.default_binding(), syms["gx"]: 16, syms["gy"]: 32, syms["F"]: 64},
                            H100)["fused"]
    wide = layout(c, for_hardware(CodegenConfig(tma=True, threads=512), H100))
    widest = layout(c, for_hardware(CodegenConfig(tma=True, threads=1024), H100))
    assert wide.copy_warp and wide.launched == 544
    assert widest.tma and not widest.copy_warp and widest.launched == 1024


def test_every_barrier_the_emitters_write_is_the_computing_threads_own():
    """With a copy warp, which waits at named barrier 4 before the loop and leaves after it, a `__syncthreads()`
    among the computing threads' code would wait for 288 threads before the loop (a deadlock) or count on the
    copy warp's exit after it: every barrier the code generator writes is `Emitter.sync` (named barrier 3 with a
    copy warp), in the templates as `k.sync`. A row spread over several warps wrote its own `__syncthreads()`."""
    backend = ROOT / "prism_dsl" / "backend"
    found = {p.name: p.read_text().count('__syncthreads()"') + p.read_text().count('__syncthreads();"')
             for p in backend.glob("*.py")}
    assert {name: n for name, n in found.items() if n} == {"codegen.py": 1}  # `Emitter.sync`'s own
    for template in (ROOT / "templates").glob("*.j2"):  # outside their comments
        assert "__syncthreads" not in re.sub(r"\{#.*?#\}", "", template.read_text(), flags=re.S), template.name


def test_pre_defined_kernels_cover_every_op_outside_custom_kernels():
    program = lower(load(ROOT / "programs/attention.prism").program())
    assert [k.name for k in kernels_of(program)] == ["matmul_t0", "softmax_t1", "matmul_O"]
    assert all(n.op in ("input", "kernel") for n in program.nodes())


# -- prismc compile ---------------------------------------------------------------------------------------


@needs_nvcc
def test_compile_writes_kernels_launcher_program_and_report(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["compile", str(ROOT / "programs/fused/rmsnorm_linear.prism"), "--search", "none", "-o", str(out),
            "--dims", "n=4,d=256"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "verified: yes" in text and "nvcc: every kernel compiles for sm_90, sm_80" in text
    names = sorted(p.name for p in out.iterdir())
    assert names == ["cuda_plan.py", "launcher.py", "prism.cuh", "prism_runtime.py", "report.json",
                     "rmsnorm_linear.prism", "rmsnorm_matmul.cu"]
    report = json.loads((out / "report.json").read_text())
    assert report["program"] == "rmsnorm_linear" and report["hardware"]["name"] == "H100"
    assert report["verified"] is True and report["measured_us"] is None and report["estimated_us"] > 0
    k = report["kernels"][0]
    assert k["nvcc"]["sm_90"]["registers"] > 0 and k["smem_bytes"] > 0 and set(report["parameters"]) == {"gx", "F"}
    # each .cu compiles on its own beside the header written with it
    done = subprocess.run(["nvcc", "--ptx", "-arch=sm_90", "rmsnorm_matmul.cu", "-o", os.devnull], cwd=out,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    # the program written back parses, checks and runs
    assert main(["run", str(out / "rmsnorm_linear.prism"), "--dims", "n=4,d=256", "--out", str(tmp_path / "y.npz")]) == 0


def test_pieces_whose_shape_holds_a_grid_size_are_compiled_and_the_floor_priced_from_the_outputs(write, tmp_path,
                                                                                                   capsys):
    """`V` is [n, gx]: its blocks' row sums side by side. Returned, its shape would follow the tuning (an error at the
    return, `lang.check`); summed by a plain op, it is compiled, and the roofline counts the program's inputs and
    outputs, whose shapes the dims give (it took the dims alone and stopped on the grid size with a TypeError)."""
    body = ("dims n = 16, d = 64\nprogram p(X: f32[n, d]) {\n    kernel k grid(x = gx) loop(F) {\n"
            "        xt = load X[:, x*loop]\n        store V[:, x] = acc_sum_last(xt)\n    }\n")
    assert main(["check", str(write(body + "    return V\n}\n", "returned.prism"))]) == 1
    assert "'V' has shape [n, gx], which depends on kernel parameters (gx)" in capsys.readouterr().err
    src = write(body + "    R = sum(V, -1)\n    return R\n}\n")
    out = tmp_path / "o"
    assert main(["compile", str(src), "--search", "none", "--arch", "none", "--no-emulate", "-o", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parameters"]["gx"] > 1 and report["roofline"]["bytes"] == 4 * (16 * 64 + 16)


def planted_failure(check):
    """An emulation's check failed by plan: every output marked as missing its tolerance."""
    planted = {name: {**o, "passed": False, "reason": "planted"} for name, o in check.outputs.items()}
    return dataclasses.replace(check, passed=False, outputs=planted)


def test_a_program_that_fails_its_check_gives_way_to_the_next_fastest(tmp_path, capsys, monkeypatch):
    """The search's fastest program that fails its own check (a rewrite that loses accuracy at the magnitudes a
    program's values reach: `layer_norm(X + 10000, eps) @ W` in f32 lost 1.4e-2 in one kernel) is not the result:
    the next is built and checked (one that cannot be built is passed over too), and the summary and
    report.json say which failed and why."""
    from prism_dsl.base.errors import PrismError
    from prism_dsl.pipeline import compile as pipeline

    real, built = pipeline.emulate, []

    def emulate(b, options):
        built.append(b.source)
        if len(built) == 2:
            raise PrismError("planted: the second cannot be built")
        check = real(b, options)
        return check if len(built) > 1 else planted_failure(check)

    monkeypatch.setattr(pipeline, "emulate", emulate)
    out = tmp_path / "o"
    assert main(["compile", str(ROOT / "programs/rmsnorm_linear.prism"), "-o", str(out), "--dims", "n=4,d=256",
                 "--arch", "none"]) == 0
    text = capsys.readouterr().out
    assert "program 1 of the search's ranking was passed over: its check failed: Y: max rel err" in text
    assert "program 2 of the search's ranking was passed over: it could not be built: planted: the second" in text
    assert "verified: yes" in text and len(built) == 3
    report = json.loads((out / "report.json").read_text())
    assert report["verified"] and [f["rank"] for f in report["search"]["failed_check"]] == [1, 2]
    third = report["alternatives"][2]
    assert (out / "best.prism").read_text().endswith(third["program"]) and built[0] is not built[2]


def first_build_fails(monkeypatch, error: Exception) -> list[str]:
    """The compile's first build raises `error` (in its emulation), the others run as they would: the sources
    built, in order."""
    from prism_dsl.pipeline import compile as pipeline

    real, built = pipeline.emulate, []

    def emulate(b, options):
        built.append(b.source)
        if len(built) == 1:
            raise error
        return real(b, options)

    monkeypatch.setattr(pipeline, "emulate", emulate)
    return built


def test_a_fastest_program_that_cannot_be_built_gives_way_too(tmp_path, capsys, monkeypatch):
    """The search's fastest program that cannot be built (its emulation's compiler refuses it, say) is passed over
    like one that fails its check; where none can be, the first one's error is the compile's, and nothing is
    written."""
    from prism_dsl.base.errors import PrismError
    from prism_dsl.pipeline import compile as pipeline

    built = first_build_fails(monkeypatch, PrismError("planted: the first cannot be built"))
    args = ["compile", str(ROOT / "programs/rmsnorm_linear.prism"), "--dims", "n=4,d=256", "--arch", "none"]
    assert main([*args, "-o", str(tmp_path / "o")]) == 0
    text = capsys.readouterr().out
    assert "program 1 of the search's ranking was passed over: it could not be built: planted: the first" in text
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["verified"] and [f["rank"] for f in report["search"]["failed_check"]] == [1] and len(built) == 2

    def refuse(b, options):
        built.append(b.source)
        raise PrismError(f"planted: program {len(built)} cannot be built")

    monkeypatch.setattr(pipeline, "emulate", refuse)
    built.clear()
    assert main([*args, "-o", str(tmp_path / "none")]) == 1
    assert "planted: program 1 cannot be built" in capsys.readouterr().err and len(built) > 1
    assert not (tmp_path / "none").exists()


def test_a_found_program_the_generator_fails_on_gives_way_and_is_named(tmp_path, capsys, monkeypatch):
    """A fault of the code generator's on a program the search found (an internal error, not a refusal of the
    user's input) passes that program over like one that cannot be built, the fault named in the summary, rather
    than ending the compile with a traceback; on the program as written it is raised."""
    built = first_build_fails(monkeypatch, AssertionError("planted fault"))
    args = ["compile", str(ROOT / "programs/rmsnorm_linear.prism"), "--dims", "n=4,d=256", "--arch", "none"]
    assert main([*args, "-o", str(tmp_path / "o")]) == 0
    text = capsys.readouterr().out
    assert "passed over: it could not be built: an internal error building it: AssertionError: planted fault" in text
    built.clear()
    with pytest.raises(AssertionError, match="planted fault"):
        main([*args, "--search", "none", "-o", str(tmp_path / "written")])


def test_compile_json_report_on_stdout(tmp_path, capsys):
    assert main(["compile", str(ROOT / "programs/swiglu.prism"), "--search", "none", "-o", str(tmp_path / "o"), "--dims", "n=4,d=256",
                 "--arch", "none", "--no-emulate", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [k["name"] for k in report["kernels"]] == ["matmul_mul_Y"]  # both products in the epilogue's kernel
    assert report["verified"] is False  # nothing checked the numbers
    assert report["roofline"]["floor_us"] > 0


def test_written_launcher_says_why_it_cannot_run_without_a_gpu(tmp_path, monkeypatch):
    out = tmp_path / "o"
    assert main(["compile", str(ROOT / "programs/fused/swiglu.prism"), "-o", str(out), "--dims", "n=4,d=256",
                 "--arch", "none", "--no-emulate"]) == 0
    env = {**os.environ, "PRISM_NO_GPU": "1"}
    done = subprocess.run([sys.executable, "launcher.py"], cwd=out, capture_output=True, text=True, env=env)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "PRISM_NO_GPU" in done.stderr


@pytest.mark.parametrize("argv,message,code", [
    (["--rank", "measure"], "--rank measure needs a usable CUDA GPU", 1),
    (["--grid", "x=3"], "is not a whole number", 1),
    (["--arch", "volta"], "argument --arch: expected names like sm_90 or sm_80, or none, got 'volta'", 2),
    (["--arch", ""], "argument --arch: expected names like sm_90 or sm_80, or none, got ''", 2),
    (["--arch", "sm_90,"], "argument --arch: expected names like sm_90 or sm_80, or none, got ''", 2),
    (["--arch", "sm_80,none"], "argument --arch: 'none' skips the compile check: give it alone, got 'sm_80,none'", 2),
    (["--threads", "100"], "argument --threads: expected a multiple of 32 up to 1024, got '100'", 2),
    (["--threads", "2048"], "argument --threads: expected a multiple of 32 up to 1024, got '2048'", 2),
    (["--hardware", "b200"], "argument --hardware: unknown hardware 'b200' (known: a100, h100, h200)", 2),
    (["--no-emulate", "--sanitize", "thread"], "--sanitize thread runs the emulation, which --no-emulate leaves out", 2),
    (["--no-emulate", "--emulate-blocks", "3"], "--emulate-blocks 3 runs the emulation, which --no-emulate leaves out", 2),
    (["--no-emulate", "--banks"], "--banks counts in the emulation, which --no-emulate leaves out: give one", 2),
    (["--no-pingpong", "--hardware", "a100"], "--no-pingpong sets how online softmax takes turns on wgmma, which the "
                                             "hardware's sm_80 does not have (sm_90): drop --no-pingpong", 2),
    (["--no-pingpong", "--no-wgmma"], "--no-pingpong sets how online softmax takes turns on wgmma, which --no-wgmma", 2),
    (["--search", "none", "--time-limit", "5", "--no-split"],
     "--time-limit, --no-split limit the search, which --search none leaves out: give one of them", 2),
    (["--search", "none", "--unsteady"], "--unsteady limits the search, which --search none leaves out", 2),
    (["--tma", "--no-wgmma"], "--tma copies the loop tiles of wgmma products, which --no-wgmma leaves out", 2),
    (["--no-copy-warp"], "--no-copy-warp says who issues the TMA copies, which only --tma asks for", 2),
    # the program has custom kernels: compiled as written, with no search to limit (it did not say so)
    (["--time-limit", "5"], "--time-limit limits the search, which a program with custom kernels of its own leaves "
                            "out (it is compiled as written)", 2),
    (["--max-kernels", "2", "--unsteady"], "--max-kernels, --unsteady limit the search, which a program with", 2),
    # the A100 has neither wgmma nor TMA (the report said both were asked for, and the code had neither)
    (["--tma", "--hardware", "a100"], "--tma copies the loop tiles of wgmma products, which the hardware's sm_80 "
                                      "does not have (sm_90)", 2),
    # and where nothing built has wgmma products: an --arch list without sm_90, or no tensor cores at all
    (["--tma", "--arch", "sm_80"], "--tma copies the loop tiles of wgmma products, which --arch sm_80 does not build "
                                   "(sm_90): drop --tma", 2),
    (["--no-wgmma", "--hardware", "a100"], "--no-wgmma puts the products on mma.sync, not wgmma, which the hardware's "
                                           "sm_80 does not have (sm_90): drop --no-wgmma", 2),
    (["--no-wgmma", "--no-tensor-cores"], "--no-wgmma puts the products on mma.sync, not wgmma, which "
                                          "--no-tensor-cores leaves out", 2),
    pytest.param(["--arch", "sm_12"], "this nvcc does not compile for sm_12 (--arch)", 1, marks=needs_nvcc),
])
def test_compile_refuses_bad_requests_and_writes_nothing(tmp_path, capsys, monkeypatch, argv, message, code):
    """A flag's value that is wrong whatever the program is a usage error (exit 2); one wrong for this program, this
    machine or this nvcc, exit 1."""
    monkeypatch.setenv("PRISM_NO_GPU", "1")
    from prism_dsl.backend.cuda_runtime import gpu_status

    gpu_status.cache_clear()
    out = tmp_path / "out"
    got = main(["compile", str(ROOT / "programs/fused/rmsnorm_linear.prism"), "-o", str(out), *argv])
    gpu_status.cache_clear()
    assert got == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


@needs_nvcc
def test_sm_90a_is_the_h100s_arch_for_pricing_and_an_arch_given_twice_is_compiled_once(tmp_path, capsys):
    """`--arch sm_90a` compiled the kernels for the H100's SMs, but the estimates were priced from the code's
    structure, "sm_90, the hardware's architecture, not among --arch"; `--arch sm_90,sm_90` compiled twice."""
    out = tmp_path / "o"
    assert main(["compile", str(ROOT / "programs/fused/swiglu.prism"), "-o", str(out), "--dims", "n=256,d=1024",
                 "--search", "none", "--no-emulate", "--arch", "sm_90a,sm_90a"]) == 0
    text = capsys.readouterr().out
    assert "priced from the compiled code (sm_90: ptxas's registers, the instructions in its SASS)" in text
    assert "nvcc: the kernels compile for sm_90a, those on wgmma for sm_90a only: swiglu" in text
    assert json.loads((out / "report.json").read_text())["nvcc"]["archs"] == ["sm_90a"]


def test_measuring_on_a_gpu_the_hardware_file_does_not_describe_is_refused(tmp_path, capsys, monkeypatch):
    """An A100 cannot run kernels made for the H100 (sm_90, 227 KiB of shared memory): refused before the
    search, naming the file to give; an H200 runs them (its file's limits are the H100's); a GPU no file
    names is measured as it is."""
    from prism_dsl.base.errors import PrismError
    from prism_dsl.pipeline import compile as pipeline_compile

    monkeypatch.setattr(pipeline_compile.cuda_runtime, "gpu_status", lambda: (True, "NVIDIA A100-SXM4-80GB"))
    out = tmp_path / "out"
    code = main(["compile", str(ROOT / "programs/fused/rmsnorm_linear.prism"), "-o", str(out), "--rank", "measure"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err and not out.exists()
    assert ("this GPU (NVIDIA A100-SXM4-80GB) is not the hardware the kernels are made for (H100: sm_90, 232448 "
            "bytes of shared memory per block; it has sm_80, 166912): give --hardware a100") in err
    pipeline_compile.check_device(load_hardware("a100"))  # what it asks for is accepted
    monkeypatch.setattr(pipeline_compile.cuda_runtime, "gpu_status", lambda: (True, "NVIDIA H100 80GB HBM3"))
    pipeline_compile.check_device(load_hardware("a100"))  # sm_80 kernels in 163 KiB run on an H100
    monkeypatch.setattr(pipeline_compile.cuda_runtime, "gpu_status", lambda: (True, "NVIDIA A100-SXM4-80GB"))
    with pytest.raises(PrismError, match="^prismc bench: this GPU"):  # bench's own words
        pipeline_compile.check_device(H100, "prismc bench")
    for device in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "Some Future GPU"):
        monkeypatch.setattr(pipeline_compile.cuda_runtime, "gpu_status", lambda d=device: (True, d))
        pipeline_compile.check_device(H100)
    monkeypatch.setattr(pipeline_compile.cuda_runtime, "gpu_status", lambda: (False, "no CUDA device found"))
    with pytest.raises(PrismError, match="needs a usable CUDA GPU: no CUDA device found; use --rank model"):
        pipeline_compile.check_device(H100)


@needs_nvcc
def test_a_kernel_on_wgmma_is_not_said_to_compile_for_archs_it_was_not_compiled_for(tmp_path, capsys):
    """`--arch sm_80` alone: a wgmma kernel compiles for no arch asked, so nvcc checked nothing; said, exit 1."""
    args = ["compile", str(ROOT / "programs/fused/attention.prism"), "--dims", "b=1,h=2,q=128,kv=256,dh=64", "--grid",
            "z=1", "--no-emulate", "-o", str(tmp_path / "out")]
    assert main([*args, "--arch", "sm_80"]) == 1
    assert "flash_attention runs on wgmma, which needs sm_90 (compiled as sm_90a), and --arch sm_80" in capsys.readouterr().err
    assert main([*args, "--arch", "sm_80", "--no-wgmma"]) == 0
    assert "nvcc: every kernel compiles for sm_80" in capsys.readouterr().out


def test_bench_needs_a_gpu(capsys, monkeypatch):
    monkeypatch.setenv("PRISM_NO_GPU", "1")
    from prism_dsl.backend.cuda_runtime import gpu_status

    gpu_status.cache_clear()
    code = main(["bench", str(ROOT / "programs/rmsnorm_linear.prism")])
    assert code == 1 and "prismc bench needs a usable CUDA GPU: disabled by PRISM_NO_GPU" in capsys.readouterr().err
    # the user's own mistakes come first: they need no GPU to be found
    assert main(["bench", str(ROOT / "programs/rmsnorm_linear.prism"), "--dims", "zz=3"]) == 1
    assert "has no dim 'zz'" in capsys.readouterr().err
    assert main(["bench", str(ROOT / "programs/no_such.prism")]) == 1
    assert "cannot read file" in capsys.readouterr().err
    rmsnorm = str(ROOT / "programs/rmsnorm_linear.prism")
    assert main(["bench", rmsnorm, "--baseline", str(ROOT / "programs/swiglu.prism")]) == 1
    assert "'rmsnorm_linear' reads inputs (X, W) but 'swiglu'" in capsys.readouterr().err
    assert main(["bench", rmsnorm, "--baseline", str(ROOT / "programs/fused/swiglu.prism")]) == 1
    assert "the baseline 'swiglu' (" in capsys.readouterr().err
    # where --json would write is checked before the GPU is asked for, too
    assert main(["bench", rmsnorm, "--json", rmsnorm]) == 1
    assert "(--json): it is the program's file, which this command reads" in capsys.readouterr().err
    assert main(["bench", rmsnorm, "--json", str(ROOT / "no_such_dir" / "t.json")]) == 1
    assert "no_such_dir' does not exist" in capsys.readouterr().err
    gpu_status.cache_clear()


def test_bench_times_its_own_kernels_as_many_times_as_pytorchs(monkeypatch):
    """`prismc bench --repeat N` timed PyTorch N times and the program's kernels 100 times whatever N was: the
    count reaches the launcher's timings of the whole program and of each kernel."""
    from prism_dsl.backend import cuda_runtime
    from prism_dsl.pipeline import build as builder

    asked = []

    class Launcher:  # the GPU's launcher, as far as `check_gpu` uses it
        def __init__(self, plan, directory, cast):
            pass

        def __call__(self, **inputs):
            return {}

        def time(self, sets, repeat=100):
            asked.append(("program", repeat))
            return {"median_ms": 0.01}

        def time_kernels(self, sets, repeat=100):
            asked.append(("kernels", repeat))
            return {}

        def close(self):
            pass

    monkeypatch.setattr(cuda_runtime, "Launcher", Launcher)
    monkeypatch.setattr(cuda_runtime, "gpu_status", lambda: (True, "a GPU"))
    monkeypatch.setattr(builder, "_compared", lambda *a: {"passed": True, "rtol": 0.01, "seed": 0,
                                                          "checked_against": "input program", "outputs": {}})
    built, _ = build_of(ROOT / "programs/rmsnorm_linear.prism", emulate=False, archs=())
    assert builder.measure(built, 0, 7).timing_ms == {"median_ms": 0.01}
    assert asked == [("program", 7), ("kernels", 7)]
    import inspect
    from prism_dsl.cli import bench
    assert "measure(built, options.seed, args.repeat)" in inspect.getsource(bench.bench)
    # and it builds what `prismc compile --search none` builds: the parameters and threads `optimize.rank` chose
    assert "rank(program, bind_dims(program, dict(args.dims)), hardware, options.codegen)" in inspect.getsource(bench.bench)


# -- names from user text ---------------------------------------------------------------------------------


def test_identifiers_and_comments_are_sanitized():
    assert ident("x-y z") == "x_y_z" and ident("9a") == "_9a" and ident("int") == "int"
    assert comment("a */ b\n#include <evil>\\") == "a */ b?#include <evil>/"


@needs_nvcc
def test_names_that_are_cuda_keywords_compile(tmp_path):
    path = tmp_path / "kw.prism"
    path.write_text("dims n = 256\nprogram half(int: f16[4, n], float: f16[4, n]) {\n"
                    "    kernel double grid(x = gx) {\n        half = load int[:, x]\n        f = load float[:, x]\n"
                    "        store void[:, x] = exp(half) * f\n    }\n    return void\n}\n")
    built, _ = build_of(path)
    results = nvcc_check(built.kernels, tmp_path, ("sm_90",))
    assert all(r["ok"] for per in results.values() for r in per.values()), results
    assert "g_int" in built.kernels[0].source and "prism_double" in built.kernels[0].source


@needs_nvcc
def test_a_kernel_nvcc_rejects_is_named_alone_where_its_program_compiles_as_one_unit(tmp_path):
    """nvcc compiles a program's kernels in one call; where that fails, each is compiled alone, so the verdict,
    the figures and nvcc's messages are each kernel's own."""
    built, _ = build_of(ROOT / "programs" / "gpt2_mlp.prism")
    first, *rest = built.kernels
    broken = replace(first, source=first.source.replace("{", "{ this_is_not_cuda;", 1))
    results = nvcc_check([broken, *rest], tmp_path, ("sm_90",))
    assert not results[first.name]["sm_90"]["ok"] and "this_is_not_cuda" in results[first.name]["sm_90"]["stderr"]
    assert all(results[k.name]["sm_90"]["ok"] and results[k.name]["sm_90"]["registers"] > 0 for k in rest)
    # nvcc's warnings on a kernel that compiles are that kernel's (the rendered kernels have none: the test above)
    unused = replace(first, source=first.source.replace("{", "{ const int never_read = 3;", 1))
    (tmp_path / "warned").mkdir()
    rest[0] = replace(rest[0], file=first.file[1:])  # a file whose name ends another's: not given its warnings
    results = nvcc_check([unused, *rest], tmp_path / "warned", ("sm_90",))
    (warning,) = results[first.name]["sm_90"]["warnings"]
    assert results[first.name]["sm_90"]["ok"] and '"never_read" was declared but never referenced' in warning
    assert all(results[k.name]["sm_90"]["warnings"] == [] for k in rest)


def test_an_nvcc_that_exits_0_without_a_cubin_is_not_taken_for_a_compile(tmp_path, monkeypatch):
    """A wrapper named nvcc that exits 0 and writes nothing was reported as "every kernel compiles", 0 registers."""
    from prism_dsl.backend import nvcc

    fake = tmp_path / "bin" / "nvcc"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setattr(nvcc, "nvcc_path", lambda: str(fake))
    built, _ = build_of(ROOT / "programs" / "gpt2_mlp.prism")
    results = nvcc_check(built.kernels, tmp_path, ("sm_90",))
    assert all(not r["sm_90"]["ok"] and "exited 0 but wrote no" in r["sm_90"]["stderr"] for r in results.values())


def test_an_nvcc_out_of_disk_space_is_said_as_the_machines_not_the_codes(tmp_path, monkeypatch):
    """A temporary directory nearly full made nvcc fail writing its intermediate files, said as "nvcc rejected the
    generated code"."""
    from prism_dsl.backend import nvcc
    from prism_dsl.base.errors import PrismError
    from prism_dsl.pipeline import build as build_module

    fake = tmp_path / "bin" / "nvcc"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho '<built-in>: fatal error: when writing output to x.ii: No space left on device' >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(nvcc, "nvcc_path", lambda: str(fake))
    monkeypatch.setattr(build_module, "nvcc_path", lambda: str(fake))
    built, _ = build_of(ROOT / "programs" / "gpt2_mlp.prism")
    with pytest.raises(PrismError, match="nvcc could not write its files: no space left on device .*set TMPDIR"):
        build_module.compile_check(built.kernels, ("sm_80",), "sm_80")


@needs_cxx
def test_a_broadcast_row_is_read_where_its_copy_put_it(tmp_path):
    """A bias of one row (B: [1, m]) added to a product whose output tiles have rows of 16 16-bit elements: those
    tiles' chunks are permuted by the row (`launch.xor_rows`), but the bias has one row, which its copy stores as it
    is; each output row reads it there (it read it permuted by the output's row: rows 4-7 of each 16 wrong)."""
    path = tmp_path / "bias.prism"
    path.write_text("dims n = 192, d = 256, m = 256\nprogram bias(X: f16[n, d], W: f16[d, m], B: f16[1, m]) {\n"
                    "    Y = X @ W + B\n    return Y\n}\n")
    options = BuildOptions()
    built = build(load(path).program(), H100, options)
    text = "\n".join(k.source for k in built.kernels)
    assert re.search(r"s_b_\w+\[\(?\(?i1 \+ c\)?\)?\]", text) and not re.search(r"s_b_\w+\[[^]]*\^", text), text
    assert emulate(built, options).passed
