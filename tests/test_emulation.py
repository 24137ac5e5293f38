"""The thread-faithful emulation: its primitives against the PTX ISA's layouts and a plain matmul, what it
reports about hand-written faulty kernels (barriers, warp collectives, cp.async, atomics, races, bad
accesses), and the sampled check at large dims."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from prism_dsl.backend import emulate, sass
from prism_dsl.backend.codegen import RenderedKernel, header_source
from prism_dsl.ir.nodes import DType
from test_trust_paths import dead_pid

needs_cxx = pytest.mark.skipif(emulate.compiler() is None, reason="no C++ compiler (g++ or clang++) for the emulation")
pytestmark = needs_cxx


def kernel(body: str, args: dict[str, str], stores: int, grid=(1, 1, 1), threads=32, smem=1024, zero=()) -> RenderedKernel:
    """A hand-written kernel: `args` maps each tensor to its C parameter type (inputs first, then `stores` outputs)."""
    params = ",\n    ".join(f"{ctype} g_{name}" for name, ctype in args.items())
    source = (f'#include "prism.cuh"\nextern "C" __global__ void prism_t(\n    {params})\n{{\n'
              f"    PRISM_SMEM({smem});\n{body}\n}}\n")
    return RenderedKernel("t", "prism_t", "t.cu", source, grid, (threads, 1, 1), smem, tuple(args), stores,
                          tuple(zero), False)


def run(k: RenderedKernel, dtypes, shapes, inputs, tmp_path, **kw) -> emulate.Result:
    return emulate.run([k], dtypes, shapes, inputs, tmp_path, **kw)


# -- primitives, lane by lane -----------------------------------------------------------------------------------

LDMATRIX = """
    half* const s = PRISM_SHARED(half, 0, 512);
    const int l = threadIdx.x;
    prism::cp_async<8>(s + l * 8, g_M + l * 8);  // 32 lanes x 16 bytes: the 16x16 tile
    prism::cp_async_wait_all();
    __syncthreads();
    uint32_t r[4];
    prism::ldmatrix<4, TRANS>(r, s + (l % 16) * 16 + (l / 16) * 8);
    for (int j = 0; j < 4; ++j) std::memcpy(&g_R[l * 4 + j], &r[j], 4);  // the register's bits
"""


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_gives_each_lane_the_elements_the_ptx_isa_assigns(trans, tmp_path):
    k = kernel(LDMATRIX.replace("TRANS", "true" if trans else "false"),
               {"M": "const half* __restrict__", "R": "float* __restrict__"}, 1)
    m = np.arange(256, dtype=np.float64).reshape(16, 16)  # exact in f16
    got = run(k, {"M": DType.F16, "R": DType.F32}, {"M": (16, 16), "R": (32, 4)}, {"M": m}, tmp_path)
    assert got.finding is None
    bits = got.outputs["R"].astype(np.float32).view(np.uint32)  # each float holds the .b32 register's bits
    halves = np.stack([bits & 0xFFFF, bits >> 16], -1).astype(np.uint16).view(np.float16).astype(np.float64)
    for lane in range(32):
        for j in range(4):  # matrix j: rows 8 (j % 2).., columns 8 (j // 2)..
            sub = m[8 * (j % 2): 8 * (j % 2) + 8, 8 * (j // 2): 8 * (j // 2) + 8]
            sub = sub.T if trans else sub
            row, col = lane // 4, 2 * (lane % 4)
            assert list(halves[lane, j]) == [sub[row, col], sub[row, col + 1]], (lane, j)


MMA = """
    const int l = threadIdx.x, g = l / 4, t = l % 4;
    auto pair = [](const T* p) { uint32_t lo, hi; uint16_t a, b; std::memcpy(&a, p, 2); std::memcpy(&b, p + 1, 2);
                                 lo = a; hi = b; return lo | hi << 16; };
    auto col = [](const T* p, int stride) { uint16_t a, b; std::memcpy(&a, p, 2); std::memcpy(&b, p + stride, 2);
                                            return uint32_t(a) | uint32_t(b) << 16; };
    // fragments read straight from global memory by the documented layout (no ldmatrix)
    const uint32_t a[4] = {pair(g_A + g * 16 + 2 * t), pair(g_A + (g + 8) * 16 + 2 * t),
                           pair(g_A + g * 16 + 2 * t + 8), pair(g_A + (g + 8) * 16 + 2 * t + 8)};
    const uint32_t b[2] = {col(g_B + (2 * t) * 8 + g, 8), col(g_B + (2 * t + 8) * 8 + g, 8)};
    const float c[4] = {g_C[g * 8 + 2 * t], g_C[g * 8 + 2 * t + 1], g_C[(g + 8) * 8 + 2 * t], g_C[(g + 8) * 8 + 2 * t + 1]};
    float d[4];
    prism::mma_m16n8k16<T>(d, a, b, c);
    g_D[g * 8 + 2 * t] = d[0]; g_D[g * 8 + 2 * t + 1] = d[1];
    g_D[(g + 8) * 8 + 2 * t] = d[2]; g_D[(g + 8) * 8 + 2 * t + 1] = d[3];
"""


@pytest.mark.parametrize("dtype", [DType.F16, DType.BF16], ids=["f16", "bf16"])
def test_mma_m16n8k16_with_the_documented_fragments_is_a_matmul(dtype, tmp_path):
    ctype = "half" if dtype is DType.F16 else "__nv_bfloat16"
    k = kernel(f"    using T = {ctype};\n" + MMA, {"A": f"const {ctype}* __restrict__", "B": f"const {ctype}* __restrict__",
                                                 "C": "const float* __restrict__", "D": "float* __restrict__"}, 1)
    rng = np.random.default_rng(0)
    a, b, c = rng.integers(-4, 5, (16, 16)) / 4, rng.integers(-4, 5, (16, 8)) / 4, rng.standard_normal((16, 8))
    got = run(k, {"A": dtype, "B": dtype, "C": DType.F32, "D": DType.F32},
              {"A": (16, 16), "B": (16, 8), "C": (16, 8), "D": (16, 8)}, {"A": a, "B": b, "C": c}, tmp_path)
    assert got.finding is None
    np.testing.assert_allclose(got.outputs["D"], a @ b + c.astype(np.float32), rtol=1e-6, atol=1e-6)


def test_ldmatrix_and_mma_together_compute_a_tile_product(tmp_path):
    body = """
    half* const sa = PRISM_SHARED(half, 0, 512);
    half* const sb = PRISM_SHARED(half, 512, 256);
    const int l = threadIdx.x, g = l / 4, t = l % 4;
    prism::cp_async<8>(sa + l * 8, g_A + l * 8);
    if (l < 16) prism::cp_async<8>(sb + l * 8, g_B + l * 8);
    prism::cp_async_wait_all();
    __syncthreads();
    uint32_t a[4], b[2];
    prism::ldmatrix<4>(a, sa + (l % 16) * 16 + (l / 16) * 8);
    prism::ldmatrix<2, true>(b, sb + (l % 16) * 8);  // B is k x n, row-major: its transpose is the col operand
    const float c[4] = {0, 0, 0, 0};
    float d[4];
    prism::mma_m16n8k16<half>(d, a, b, c);
    for (int i = 0; i < 4; ++i) g_D[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2] = d[i];
"""
    k = kernel(body, {"A": "const half* __restrict__", "B": "const half* __restrict__", "D": "float* __restrict__"}, 1)
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((16, 16)), rng.standard_normal((16, 8))
    got = run(k, {"A": DType.F16, "B": DType.F16, "D": DType.F32}, {"A": (16, 16), "B": (16, 8), "D": (16, 8)},
              {"A": a, "B": b}, tmp_path)
    assert got.finding is None
    expected = a.astype(np.float16).astype(np.float64) @ b.astype(np.float16).astype(np.float64)
    np.testing.assert_allclose(got.outputs["D"], expected, rtol=1e-5, atol=1e-5)



WGMMA = """
    T* const sa = PRISM_SHARED(T, 0, 8192);
    T* const sb = PRISM_SHARED(T, 8192, 16384);
    const int tid = threadIdx.x, w = tid / 32, l = tid % 32;
    // A 64 x 64, K-major with the 128-byte swizzle: row r's 16-byte chunk c at chunk c ^ r % 8
    for (int v = tid; v < 64 * 8; v += 128)
        prism::cp_async<8>(sa + v / 8 * 64 + (v % 8 ^ v / 8 % 8) * 8, g_A + v * 8);
    // B 64 x 128 stored as given: N-major, two blocks of 64 columns (k rows of 128 bytes each); K-major: 128 x 64
    for (int v = tid; v < 64 * 16; v += 128) {
        const int r = NMAJOR ? v / 16 : v / 8, c = NMAJOR ? v % 16 : v % 8;
        prism::cp_async<8>(sb + c / 8 * 4096 * NMAJOR + r * 64 + (c % 8 ^ r % 8) * 8, g_B + v * 8);
    }
    prism::cp_async_wait_all();
    prism::fence_async_shared();
    __syncthreads();
    float d[64] = {};
    prism::wgmma_fence();
    for (int s = 0; s < 4; ++s)  // k steps of 16: A's start 32 bytes on; B's 16 rows (N-major) or 32 bytes on
        prism::wgmma<128, T, NMAJOR>(d, prism::wgmma_desc(sa + s * 16, 16, 1024),
                                     prism::wgmma_desc(sb + s * 16 * (NMAJOR ? 64 : 1), 8192, 1024));
    prism::wgmma_commit();
    prism::wgmma_wait<0>(d);
    for (int i = 0; i < 64; ++i)
        g_D[(16 * w + l / 4 + 8 * (i >> 1 & 1)) * 128 + 8 * (i / 4) + 2 * (l % 4) + (i & 1)] = d[i];
"""


@pytest.mark.parametrize("dtype, n_major", [(DType.F16, True), (DType.BF16, False)], ids=["f16-b-n-major", "bf16-b-k-major"])
def test_wgmma_reads_the_swizzled_operands_its_descriptors_describe(dtype, n_major, tmp_path):
    """A warpgroup's 64 x 64 @ 64 x 128 by four k16 steps of wgmma, both operands in the 128-byte swizzle and
    the accumulators in the documented layout: the product, whichever way B is stored."""
    ctype = "half" if dtype is DType.F16 else "__nv_bfloat16"
    body = f"    using T = {ctype};\n" + WGMMA.replace("NMAJOR", "true" if n_major else "false")
    k = kernel(body, {"A": f"const {ctype}* __restrict__", "B": f"const {ctype}* __restrict__",
                      "D": "float* __restrict__"}, 1, threads=128, smem=24576)
    rng = np.random.default_rng(2)
    a, b = rng.integers(-4, 5, (64, 64)) / 4, rng.integers(-4, 5, (64, 128)) / 4  # exact in both types
    stored = b if n_major else np.ascontiguousarray(b.T)
    got = run(k, {"A": dtype, "B": dtype, "D": DType.F32}, {"A": (64, 64), "B": stored.shape, "D": (64, 128)},
              {"A": a, "B": stored}, tmp_path)
    assert got.finding is None, got.finding
    np.testing.assert_allclose(got.outputs["D"], a @ b, rtol=0, atol=1e-6)


WGMMA_REGISTER_A = """
    half* const sb = PRISM_SHARED(half, 0, 2048);
    const int tid = threadIdx.x, w = tid / 32, l = tid % 32, g = l / 4, t = l % 4;
    if (tid < 128) prism::cp_async<8>(sb + tid / 8 * 64 + (tid % 8 ^ tid / 8 % 8) * 8, g_B + tid * 8);  // B 16 x 64
    prism::cp_async_wait_all();
    prism::fence_async_shared();
    __syncthreads();
    auto pair = [](const half* p) { uint16_t a, b; std::memcpy(&a, p, 2); std::memcpy(&b, p + 1, 2);
                                    return uint32_t(a) | uint32_t(b) << 16; };
    const half* const row = g_A + (16 * w + g) * 16 + 2 * t;  // this warp's 16 rows, mma.sync's A layout
    const uint32_t a[4] = {pair(row), pair(row + 8 * 16), pair(row + 8), pair(row + 8 * 16 + 8)};
    float d[32] = {};
    prism::wgmma_fence();
    prism::wgmma<64, half, true>(d, a, prism::wgmma_desc(sb, 8192, 1024));
    prism::wgmma_commit();
    prism::wgmma_wait<0>(d);
    for (int i = 0; i < 32; ++i)
        g_D[(16 * w + g + 8 * (i >> 1 & 1)) * 64 + 8 * (i / 4) + 2 * t + (i & 1)] = d[i];
"""


def test_wgmma_with_a_from_registers_takes_mma_syncs_a_layout(tmp_path):
    """A 64 x 16 operand given as each warp's mma.sync A fragment of its 16 rows (online softmax's p) times a
    swizzled 16 x 64 B: the product."""
    k = kernel(WGMMA_REGISTER_A, {"A": "const half* __restrict__", "B": "const half* __restrict__",
                                  "D": "float* __restrict__"}, 1, threads=128, smem=2048)
    rng = np.random.default_rng(3)
    a, b = rng.integers(-4, 5, (64, 16)) / 4, rng.integers(-4, 5, (16, 64)) / 4
    got = run(k, {"A": DType.F16, "B": DType.F16, "D": DType.F32}, {"A": (64, 16), "B": (16, 64), "D": (64, 64)},
              {"A": a, "B": b}, tmp_path)
    assert got.finding is None, got.finding
    np.testing.assert_allclose(got.outputs["D"], a @ b, rtol=0, atol=1e-6)

def test_a_wgmma_operand_outside_shared_memory_is_reported(tmp_path):
    body = """
    half* const s = PRISM_SHARED(half, 0, 1024);
    float d[32] = {};
    prism::wgmma<64, half, true>(d, prism::wgmma_desc(s, 16, 1024), prism::wgmma_desc(s, 8192, 1024));
    g_D[threadIdx.x] = d[0];
"""
    k = kernel(body, {"D": "float* __restrict__"}, 1, threads=128)
    got = run(k, {"D": DType.F32}, {"D": (128,)}, {}, tmp_path)
    assert got.finding is not None and "wgmma reads" in got.finding.message

IN_FLIGHT = {  # how the batch of WGMMA is waited for: (what replaces its commit and wait, what is found)
    # two batches, the first completed by wait<1> while the second is in flight: the product
    "two batches": ("", None),
    "never waited": ("prism::wgmma_commit();", "never waited for"),
    "not committed": ("prism::wgmma_wait<0>(d);", "before it is committed"),
    # an operand written while the batch is in flight
    "written in flight": ("prism::wgmma_commit();\n    if (tid == 0) sa[0] = T(7.0f);\n    prism::wgmma_wait<0>(d);",
                          "changed before the wgmma.wait_group"),
    # the accumulators read before the wait: undefined (NaN in the emulation)
    "read early": ("prism::wgmma_commit();\n    const float early = d[0];\n    prism::wgmma_wait<0>(d);\n    d[0] = early;", None),
    # the warps of the warpgroup disagree on A's descriptor, or one of them issues no product
    "warps disagree": ("prism::wgmma_desc(sa + s * 16 + (w == 2) * 64, 16, 1024)",
                       "warp 2 passes other descriptors, or issues another shape or type, than warp 0"),
    "a warp left out": ("if (w != 3) prism::wgmma<128, T, NMAJOR>", "issued by 3 of its 4 warps (warp 0 first)"),
    # the fences removed: the copies' data not handed to the async proxy; the batch not ordered after the
    # threads' register writes
    "no proxy fence": ("prism::fence_async_shared();", "as written since the last fence.proxy.async"),
    "no wgmma fence": ("prism::wgmma_fence();", "with no wgmma.fence (prism::wgmma_fence)"),
}


@pytest.mark.parametrize("case", list(IN_FLIGHT))
def test_a_wgmma_batch_completes_at_the_wait_that_covers_it(case, tmp_path):
    """wgmma is asynchronous: the emulation completes a batch only at the wgmma_wait that covers it, and reports
    a batch never waited for, a wait before the commit, and shared memory written while a batch may read it;
    the accumulators are NaN until then. The four warps of the warpgroup issue each product together: one that
    passes other descriptors, or a warp that issues none, is reported. So is a batch with no wgmma.fence before
    it, and one that reads copies no fence.proxy.async has handed to the tensor cores."""
    replaced, finding = IN_FLIGHT[case]
    body = WGMMA.replace("NMAJOR", "true")
    if case == "two batches":
        body = body.replace("for (int s = 0; s < 4; ++s)", "for (int s = 0; s < 2; ++s)")
        body = body.replace("prism::wgmma_wait<0>(d);", """prism::wgmma_fence();
    for (int s = 2; s < 4; ++s)
        prism::wgmma<128, T, true>(d, prism::wgmma_desc(sa + s * 16, 16, 1024), prism::wgmma_desc(sb + s * 16 * 64, 8192, 1024));
    prism::wgmma_commit();
    prism::wgmma_wait<1>(d);
    prism::wgmma_wait<0>(d);""")
    elif case == "warps disagree":
        body = body.replace("prism::wgmma_desc(sa + s * 16, 16, 1024)", replaced)
    elif case == "a warp left out":
        body = body.replace("prism::wgmma<128, T, true>", replaced.replace("NMAJOR", "true"))
    elif case.endswith("fence"):
        assert body.count(replaced) == 1
        body = body.replace(replaced, "")
    else:
        body = body.replace("prism::wgmma_commit();\n    prism::wgmma_wait<0>(d);", replaced)
    k = kernel("    using T = half;\n" + body, {"A": "const half* __restrict__", "B": "const half* __restrict__",
                                                "D": "float* __restrict__"}, 1, threads=128, smem=24576)
    rng = np.random.default_rng(2)
    a, b = rng.integers(-4, 5, (64, 64)) / 4, rng.integers(-4, 5, (64, 128)) / 4
    got = run(k, {"A": DType.F16, "B": DType.F16, "D": DType.F32}, {"A": (64, 64), "B": (64, 128), "D": (64, 128)},
              {"A": a, "B": b}, tmp_path)
    if finding:
        assert got.finding is not None and finding in got.finding.message, got.finding
        return
    assert got.finding is None, got.finding
    expected = a @ b
    if case == "read early":  # each thread's first accumulator: row 16 w + l / 4, column 2 (l % 4)
        early = np.zeros_like(expected, bool)
        rows = [16 * w + g for w in range(4) for g in range(8)]
        early[np.array(rows)[:, None], 2 * np.arange(4)[None, :]] = True
        assert np.isnan(got.outputs["D"][early]).all() and not np.isnan(got.outputs["D"][~early]).any()
        return
    np.testing.assert_allclose(got.outputs["D"], expected, rtol=0, atol=1e-6)


# -- what the emulation reports -------------------------------------------------------------------------------------

F32_IO = {"X": "const float* __restrict__", "Y": "float* __restrict__"}
F32_TYPES = {"X": DType.F32, "Y": DType.F32}


def finding_of(body: str, tmp_path, threads=64, grid=(1, 1, 1), n=64, **kw) -> emulate.Finding | None:
    k = kernel(body, F32_IO, 1, grid=grid, threads=threads)
    return run(k, F32_TYPES, {"X": (n,), "Y": (n,)}, {"X": np.ones(n)}, tmp_path, **kw).finding


def _running(pid: int) -> bool:
    """Whether process `pid` runs (neither gone nor a zombie left for its new parent to reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_the_emulation_dies_with_the_process_that_started_it(tmp_path):
    """A prismc killed outright (SIGKILL, which no handler sees) leaves no emulation running on under init for the
    minutes its timeout allows: the kernel kills it with its parent. Here it waits at its commands, a FIFO that
    no one writes, under a parent that is killed; and one whose parent is already gone (PRISM_PARENT, the pid it
    was started by, is not its parent's) stops at once."""
    k = kernel("    g_Y[threadIdx.x] = g_X[threadIdx.x];", F32_IO, 1)
    exe = emulate.build([k], F32_TYPES, {"X": (32,), "Y": (32,)}, tmp_path)
    os.mkfifo(tmp_path / "commands.txt")
    starter = ("import os, subprocess, sys, time\n"
               f"child = subprocess.Popen([{str(exe)!r}, 'commands.txt'], cwd={str(tmp_path)!r}, "
               "env={**os.environ, 'PRISM_PARENT': str(os.getpid())})\n"
               "print(child.pid, flush=True)\ntime.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    emulation = int(parent.stdout.readline())
    time.sleep(0.5)  # past its request for the signal: it waits to open the FIFO
    assert _running(emulation)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while _running(emulation) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(emulation)
    orphan = subprocess.run([str(exe), "commands.txt"], cwd=tmp_path, capture_output=True, timeout=30,
                            env={**os.environ, "PRISM_PARENT": str(dead_pid())})
    assert orphan.returncode == 2


def test_a_barrier_some_threads_skip_is_reported_not_a_hang(tmp_path):
    f = finding_of("    if (threadIdx.x < 32) __syncthreads();\n    g_Y[threadIdx.x] = 1;", tmp_path)
    assert f.kind == "emulation" and "not reached by every thread" in f.message
    assert "threads 0-31 wait at the barrier" in f.message and "32-63 have finished" in f.message
    assert f.where == ("t.cu:7",)


def test_threads_at_two_different_barriers_are_a_divergent_barrier(tmp_path):
    f = finding_of("    if (threadIdx.x < 32)\n        __syncthreads();\n    else\n        __syncthreads();\n"
                   "    g_Y[threadIdx.x] = 1;", tmp_path)
    assert f.kind == "emulation" and "divergent barrier" in f.message


def test_a_shuffle_only_some_lanes_reach_is_a_divergent_collective(tmp_path):
    f = finding_of("    float v = g_X[threadIdx.x];\n    if (threadIdx.x % 32 < 16) v = prism::warp_sum(v);\n"
                   "    g_Y[threadIdx.x] = v;", tmp_path)
    assert f.kind == "emulation" and "__shfl_xor_sync" in f.message and "t.cu:8" in f.where


def test_warp_sum_exchanges_between_lanes(tmp_path):
    k = kernel("    g_Y[threadIdx.x] = prism::warp_sum(g_X[threadIdx.x]);", F32_IO, 1, threads=64)
    x = np.arange(64.0)
    got = run(k, F32_TYPES, {"X": (64,), "Y": (64,)}, {"X": x}, tmp_path)
    assert list(got.outputs["Y"]) == [x[:32].sum()] * 32 + [x[32:].sum()] * 32


FIBERS = """
    float v = g_X[blockIdx.x * 128 + threadIdx.x];
    for (int i = 0; i < 3; ++i) {  // each thread switched away at every collective and barrier
        v = prism::warp_sum(v) / 32 + threadIdx.x;
        float* const s = PRISM_SHARED(float, 0, 512);
        s[threadIdx.x] = v;
        __syncthreads();
        v += s[127 - threadIdx.x];
        __syncthreads();
    }
    g_Y[blockIdx.x * 128 + threadIdx.x] = v;
"""


def _undefined_and_notes(exe: Path) -> str:
    """The symbols `exe` takes from shared libraries and its ELF notes (the x86 features it is marked fit for)."""
    return "".join(subprocess.run(cmd, capture_output=True, text=True).stdout
                   for cmd in (["nm", "-u", str(exe)], ["readelf", "-n", str(exe)]))


@pytest.mark.parametrize("sanitizer", [None, "thread", "address"])
def test_the_fiber_switch_and_glibcs_ucontext_run_the_threads_alike(sanitizer, monkeypatch, tmp_path):
    """On x86-64 a fiber switches by the runtime's own few instructions (no system call: glibc's swapcontext sets the
    signal mask at each switch), in an executable not marked fit for CET shadow stacks; elsewhere by ucontext.
    PRISM_EMU_UCONTEXT takes the ucontext path on x86-64 too: both run 9 blocks (two waves, the second on the
    first's fibers and stacks) to the reference's outputs, and report a divergent barrier."""
    blocks = 9
    k = kernel(FIBERS, F32_IO, 1, grid=(blocks, 1, 1), threads=128)
    x = np.random.default_rng(0).standard_normal(blocks * 128)
    v, t = x.astype(np.float32).reshape(blocks, 128), np.arange(128, dtype=np.float32)
    for _ in range(3):
        v = np.repeat(v.reshape(blocks, 4, 32).sum(-1), 32, -1) / 32 + t
        v = v + v[:, ::-1]
    inspect = sys.platform.startswith("linux") and os.uname().machine == "x86_64" and shutil.which("nm") \
        and shutil.which("readelf")
    for path in ("own", "ucontext"):
        if path == "ucontext":
            monkeypatch.setitem(emulate._FLAGS, sanitizer, [*emulate._FLAGS[sanitizer], "-DPRISM_EMU_UCONTEXT"])
        (tmp_path / path).mkdir()
        got = run(k, F32_TYPES, {"X": (blocks * 128,), "Y": (blocks * 128,)}, {"X": x}, tmp_path / path,
                  sanitizer=sanitizer)
        assert got.finding is None and np.allclose(got.outputs["Y"], v.reshape(-1), rtol=1e-6)
        if inspect:
            linked = _undefined_and_notes(tmp_path / path / f"emulate-{sanitizer or 'plain'}")
            assert ("swapcontext" in linked) is (path == "ucontext") and "SHSTK" not in linked
        (tmp_path / path / "skip").mkdir()
        f = finding_of("    if (threadIdx.x < 32) __syncthreads();\n    g_Y[threadIdx.x] = 1;", tmp_path / path / "skip",
                       sanitizer=sanitizer)
        assert f.kind == "emulation" and "not reached by every thread" in f.message


def test_a_max_is_nan_where_either_operand_is(tmp_path):
    """As the float64 reference's maximum: a NaN read from memory never written (the emulation starts outputs
    and shared memory as NaN) must not be dropped by a max, whichever side it comes in on."""
    k = kernel("    g_Y[threadIdx.x] = prism::max_(g_X[threadIdx.x], g_X[(threadIdx.x + 1) % 32]);", F32_IO, 1)
    x = np.arange(32.0)
    x[3] = np.nan
    y = run(k, F32_TYPES, {"X": (32,), "Y": (32,)}, {"X": x}, tmp_path).outputs["Y"]
    rest = [i for i in range(32) if i not in (2, 3)]
    assert np.isnan(y[2]) and np.isnan(y[3]) and list(y[rest]) == list(np.maximum(x, np.roll(x, -1))[rest])


def test_cp_async_data_appears_only_at_its_wait(tmp_path):
    body = """
    float* const s = PRISM_SHARED(float, 0, 1024);
    const int i = threadIdx.x * 4;
    prism::cp_async<4>(s + i, g_X + i);
    g_Y[i] = s[i];  // before the wait: undefined (the emulation's NaN pattern)
    prism::cp_async_wait_all();
    g_Y[i + 1] = s[i];
    g_Y[i + 2] = 0; g_Y[i + 3] = 0;
"""
    k = kernel(body, F32_IO, 1, threads=64)
    got = run(k, F32_TYPES, {"X": (256,), "Y": (256,)}, {"X": np.full(256, 5.0)}, tmp_path)
    assert np.isnan(got.outputs["Y"][0::4]).all() and (got.outputs["Y"][1::4] == 5).all()


@pytest.mark.parametrize("width", [1, 2], ids=["4-byte", "8-byte"])
def test_narrow_cp_async_copies_their_bytes_at_the_wait(width, tmp_path):
    body = f"""
    float* const s = PRISM_SHARED(float, 0, 1024);
    const int i = threadIdx.x * {width};
    prism::cp_async<{width}>(s + i, g_X + i);
    prism::cp_async_wait_all();
    for (int j = 0; j < {width}; ++j) g_Y[i + j] = s[i + j] + 1;
"""
    k = kernel(body, F32_IO, 1, threads=64)
    x = np.arange(64.0 * width)
    got = run(k, F32_TYPES, {"X": (64 * width,), "Y": (64 * width,)}, {"X": x}, tmp_path)
    assert list(got.outputs["Y"]) == list(x + 1)


@pytest.mark.parametrize("sanitizer", [None, "thread"])
def test_cp_async_never_waited_for_is_reported(sanitizer, tmp_path):
    """Under ThreadSanitizer too, in the emulation's words (its exit at a finding went through the sanitizer's, which
    took the finding's ignored bookkeeping for an error of its own)."""
    body = "    float* const s = PRISM_SHARED(float, 0, 1024);\n    prism::cp_async<4>(s + threadIdx.x * 4, g_X + threadIdx.x * 4);"
    f = finding_of(body, tmp_path, n=256, sanitizer=sanitizer)
    assert f.kind == "emulation" and "never waited for" in f.message and f.where == ("t.cu:8",)


# -- TMA: a box of a tensor map, landed in the 128-byte swizzle when its mbarrier's phase is waited for ----------

TMA = """
    half* const s = PRISM_SHARED(half, 0, 4096);  // room for a box at 128 bytes in, misaligned
    uint64_t* const bar = PRISM_SHARED(uint64_t, 4096, 8);
    const int l = threadIdx.x;
    if (l == 0) {
        prism::mbarrier_init(bar, 1);
        prism::mbarrier_init_fence();
    }
    __syncthreads();
    if (l == 0) {
        prism::mbarrier_expect_tx(bar, 2048);
        prism::tma_load(s, tm_M, bar, {64, 16});  // rows 16..31, columns 64..127 (innermost first)
    }
    __syncthreads();
    g_B[l] = prism::to_f(s[l]);  // before any thread waits: undefined
    __syncthreads();
    prism::mbarrier_wait(bar, 0);
    for (int i = l; i < 1024; i += 32) g_R[i] = prism::to_f(s[i]);  // the shared bytes as they are
"""
TMA_FAULTS = {
    "no init fence": (("prism::mbarrier_init_fence();", ""), "not made visible to the async proxy"),
    "no expect_tx": (("prism::mbarrier_expect_tx(bar, 2048);", "prism::mbarrier_arrive(bar);"), "expect_tx is missing"),
    "short expect_tx": (("expect_tx(bar, 2048)", "expect_tx(bar, 1024)"), "more than the phase of the mbarrier"),
    "box past the end": (("{64, 16}", "{96, 16}"), "reads elements 96..159 of dim 0"),
    "misaligned destination": (("tma_load(s,", "tma_load(s + 64,"), "swizzled box is 1024-byte aligned"),
    "never waited for": (("prism::mbarrier_wait(bar, 0);", ""), "never landed: no thread waited for"),
}


def tma_run(tmp_path, edit=("", "")):
    from prism_dsl.backend.copies import TensorMap

    source = ('#include "prism.cuh"\nextern "C" __global__ void prism_t(\n    const __grid_constant__ prism::TensorMap tm_M,\n'
              '    const half* __restrict__ g_M,\n    float* __restrict__ g_B,\n    float* __restrict__ g_R)\n{\n'
              f"    PRISM_SMEM(4104);\n{TMA.replace(*edit)}\n}}\n")
    k = RenderedKernel("t", "prism_t", "t.cu", source, (1, 1, 1), (32, 1, 1), 4104, ("M", "B", "R"), 2, (), False,
                       maps=(TensorMap("tm_M", "M", DType.F16, (16, 64)),))
    m = np.array([[r % 16 * 128 + c for c in range(128)] for r in range(32)], dtype=np.float64)  # exact, unique per 16 rows
    return m, run(k, {"M": DType.F16, "B": DType.F32, "R": DType.F32}, {"M": (32, 128), "B": (32,), "R": (1024,)},
                  {"M": m}, tmp_path)


def test_a_tma_box_lands_in_the_128_byte_swizzle_when_its_phase_is_waited_for(tmp_path):
    """One thread's cp.async.bulk.tensor of a 16 x 64 box of f16: undefined (NaN) until the mbarrier phase whose
    bytes it completes is waited for, then in the 128-byte swizzle, row r's 16-byte chunk c at chunk c ^ r % 8:
    the layout the cp.async path writes for wgmma (`ctext.swizzled`)."""
    m, got = tma_run(tmp_path)
    assert got.finding is None, got.finding
    assert np.isnan(got.outputs["B"]).all()
    want = np.full(1024, np.nan)
    for r in range(16):
        for c in range(64):
            want[r * 64 + (c // 8 % 8 ^ r % 8) * 8 + c % 8] = m[16 + r, 64 + c]
    assert np.array_equal(got.outputs["R"], want)


@pytest.mark.parametrize("case", list(TMA_FAULTS))
def test_a_tma_copy_the_hardware_would_not_deliver_as_written_is_reported(case, tmp_path):
    edit, message = TMA_FAULTS[case]
    assert edit[0] in TMA
    _, got = tma_run(tmp_path, edit)
    assert got.finding and message in got.finding.message, got.finding
    assert got.finding.where and got.finding.where[0].startswith("t.cu:")


def test_a_misaligned_cp_async_is_reported(tmp_path):
    body = ("    float* const s = PRISM_SHARED(float, 0, 1024);\n"
            "    prism::cp_async<4>(s + threadIdx.x * 4 + 1, g_X + threadIdx.x * 4);\n    prism::cp_async_wait_all();")
    f = finding_of(body, tmp_path, n=260)
    assert f.kind == "emulation" and "16-byte aligned" in f.message


def test_a_misaligned_16_byte_shared_load_is_reported(tmp_path):
    body = ("    half* const s = PRISM_SHARED(half, 0, 1024);\n    float w[8];\n"
            "    prism::load8(w, s + threadIdx.x * 8 + 4);\n    g_Y[threadIdx.x] = w[0];")
    f = finding_of(body, tmp_path)
    assert f.kind == "emulation" and "16-byte shared-memory load" in f.message and f.where == ("t.cu:9",)


def test_f16_atomics_round_each_addition_as_the_gpu_does(tmp_path):
    # Past 2048 the f16 spacing is 2, so 2048 + 1 rounds back to 2048: on a GPU, 2100 blocks each adding 1
    # leave 2048, where adding in float and rounding once would give 2100.
    k = kernel("    if (threadIdx.x == 0) prism::atomic_add(g_Y, 1.0f);",
               {"X": "const half* __restrict__", "Y": "half* __restrict__"}, 1, grid=(2100, 1, 1), zero=("Y",))
    got = run(k, {"X": DType.F16, "Y": DType.F16}, {"X": (1,), "Y": (1,)}, {"X": np.zeros(1)}, tmp_path)
    assert got.finding is None and got.outputs["Y"][0] == 2048.0


def test_the_thread_sanitizer_reports_a_missing_barrier_with_the_line_and_threads(tmp_path):
    body = ("    float* const s = PRISM_SHARED(float, 0, 256);\n    s[threadIdx.x] = g_X[threadIdx.x];\n"
            "    g_Y[threadIdx.x] = s[63 - threadIdx.x];")
    f = finding_of(body, tmp_path, sanitizer="thread")
    assert f.kind == "data race" and f.kernel == "t"
    assert set(f.where) == {"t.cu:8", "t.cu:9"} and all("block (0,0,0) thread" in t for t in f.threads)


def test_the_thread_sanitizer_reports_blocks_writing_the_same_elements(tmp_path):
    f = finding_of("    g_Y[threadIdx.x] = g_X[threadIdx.x] + blockIdx.x;", tmp_path, grid=(4, 1, 1), sanitizer="thread")
    assert f.kind == "data race" and "t.cu:7" in f.where


def test_the_address_sanitizer_reports_a_read_past_a_shared_buffer(tmp_path):
    body = ("    float* const s = PRISM_SHARED(float, 0, 256);\n    float* const u = PRISM_SHARED(float, 256, 256);\n"
            "    s[threadIdx.x] = 1; u[threadIdx.x] = 2;\n    __syncthreads();\n    g_Y[threadIdx.x] = s[threadIdx.x + 1];")
    f = finding_of(body, tmp_path, sanitizer="address")
    assert f.kind == "memory error" and "heap-buffer-overflow" in f.message and "t.cu:11" in f.where
    assert f.threads == ("block (0,0,0) thread 63 (warp 1, lane 31)",)


# Two buffers at the same bytes, one in use before the loop (phase 0), the other in and after it (1..2).
SHARED_BYTES = """
    float* const s = PRISM_SHARED_IN(float, 0, 256, 0, 0);
    float* const u = PRISM_SHARED_IN(float, 0, 256, FIRST, 2);
    s[threadIdx.x] = g_X[threadIdx.x];
    __syncthreads();
    const float t = s[63 - threadIdx.x];
    __syncthreads();
    PRISM_PHASE(1);
    u[threadIdx.x] = t * 2;
    __syncthreads();
    PRISM_PHASE(2);
    g_Y[threadIdx.x] = READ;
"""


def test_buffers_never_in_use_at_once_may_share_bytes(tmp_path):
    body = SHARED_BYTES.replace("FIRST", "1").replace("READ", "u[63 - threadIdx.x]")
    x = np.arange(64.0)
    for sanitizer in (None, "address"):  # the address sanitizer poisons each buffer outside its phases
        got = run(kernel(body, F32_IO, 1, threads=64), F32_TYPES, {"X": (64,), "Y": (64,)}, {"X": x}, tmp_path,
                  sanitizer=sanitizer)
        assert got.finding is None and list(got.outputs["Y"]) == list(2 * x), sanitizer


def test_buffers_sharing_bytes_while_both_in_use_are_reported(tmp_path):
    f = finding_of(SHARED_BYTES.replace("FIRST", "0").replace("READ", "u[threadIdx.x]"), tmp_path)
    assert f.kind == "emulation" and "shared buffers overlap while both are in use" in f.message
    assert "phases 0..2" in f.message and "in 0..0" in f.message


def test_a_buffer_read_after_its_use_ends_is_found(tmp_path):
    """On the GPU its bytes hold another buffer's data by then: the emulation gives NaN there, and the
    address sanitizer names the read."""
    body = SHARED_BYTES.replace("FIRST", "1").replace("READ", "s[threadIdx.x]")
    got = run(kernel(body, F32_IO, 1, threads=64), F32_TYPES, {"X": (64,), "Y": (64,)}, {"X": np.ones(64)}, tmp_path)
    assert got.finding is None and np.isnan(got.outputs["Y"]).all()
    f = finding_of(body, tmp_path, sanitizer="address")
    assert f.kind == "memory error" and "use-after-poison" in f.message and "t.cu:18" in f.where


def test_the_address_sanitizer_reports_a_write_past_an_output(tmp_path):
    f = finding_of("    g_Y[threadIdx.x + 1] = g_X[threadIdx.x];", tmp_path, sanitizer="address")
    assert f.kind == "memory error" and "t.cu:7" in f.where


def test_unmutated_kernels_pass_both_sanitizers(tmp_path):
    body = ("    float* const s = PRISM_SHARED(float, 0, 256);\n    s[threadIdx.x] = g_X[threadIdx.x];\n    __syncthreads();\n"
            "    g_Y[threadIdx.x] = s[63 - threadIdx.x] + prism::warp_sum(s[threadIdx.x]);")
    for sanitizer in emulate.SANITIZERS:
        assert finding_of(body, tmp_path, sanitizer=sanitizer) is None, sanitizer


@pytest.mark.nvcc
@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="nvcc is not on the PATH")
def test_the_gpu_forms_of_the_primitives_compile_with_nvcc(tmp_path):
    """Every primitive's GPU form instantiated once (the generated code does not use them all yet)."""
    (tmp_path / "prism.cuh").write_text(header_source())
    (tmp_path / "t.cu").write_text(NVCC_PRIMITIVES)
    for arch in ("sm_90a", "sm_90", "sm_80"):  # wgmma: sm_90a only; TMA: sm_90 and later
        done = __import__("subprocess").run(["nvcc", "-cubin", f"-arch={arch}", "-o", "t.cubin", "t.cu"],
                                            cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        if arch == "sm_90a" and sass.available():
            listing = sass.disassemble(tmp_path / "t.cubin")
            assert all(f"UTMALDG.{n}D" in listing for n in range(1, 6)) and "SYNCS.ARRIVE.TRANS64 RZ" in listing


NVCC_PRIMITIVES = """#include "prism.cuh"
#if PRISM_WGMMA
// every wgmma form: N = 64, 128, 256; f16 and bf16; B N-major and K-major; A from shared memory or registers
template <int N, class T> __device__ void wgmma_forms(float* out, const void* s, const uint32_t (&r)[4]) {
    float d[N / 2] = {};
    prism::wgmma_fence();
    prism::wgmma<N, T, true>(d, prism::wgmma_desc(s, 16, 1024), prism::wgmma_desc(s, 8192, 1024));
    prism::wgmma<N, T, false>(d, prism::wgmma_desc(s, 16, 1024), prism::wgmma_desc(s, 16, 1024));
    prism::wgmma<N, T, true>(d, r, prism::wgmma_desc(s, 8192, 1024));
    prism::wgmma_commit();
    prism::wgmma_wait<0>(d);
    for (int i = 0; i < N / 2; ++i) out[threadIdx.x * N + i] += d[i];
}
extern "C" __global__ void w(float* out, const uint32_t* g) {
    extern __shared__ __align__(1024) unsigned char sm[];
    const uint32_t r[4] = {g[0], g[1], g[2], g[threadIdx.x]};
    wgmma_forms<64, half>(out, sm, r), wgmma_forms<128, half>(out, sm, r), wgmma_forms<256, half>(out, sm, r);
    wgmma_forms<64, __nv_bfloat16>(out, sm, r), wgmma_forms<128, __nv_bfloat16>(out, sm, r);
    wgmma_forms<256, __nv_bfloat16>(out, sm, r);
}
#endif
// TMA: a box of every rank at an mbarrier that expects their bytes
extern "C" __global__ void m(const __grid_constant__ prism::TensorMap map, float* out) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // mbarrier.try_wait: sm_90
    extern __shared__ __align__(1024) unsigned char sm[];
    uint64_t* const bar = reinterpret_cast<uint64_t*>(sm + 8192);
    if (threadIdx.x == 0) {
        prism::mbarrier_init(bar, 1);
        prism::mbarrier_init_fence();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        prism::mbarrier_expect_tx(bar, 5 * 128);
        prism::tma_load(sm, map, bar, {0});
        prism::tma_load(sm + 1024, map, bar, {0, 1});
        prism::tma_load(sm + 2048, map, bar, {0, 1, 2});
        prism::tma_load(sm + 3072, map, bar, {0, 1, 2, 3});
        prism::tma_load(sm + 4096, map, bar, {0, 1, 2, 3, 4});
    }
    prism::mbarrier_wait(bar, 0);
    out[threadIdx.x] = sm[threadIdx.x];
#endif
}
extern "C" __global__ void t(const half* a, float* out, unsigned* tickets) {
    __shared__ __align__(128) half s[256];
    prism::cp_async<8>(s + threadIdx.x * 8, a + threadIdx.x * 8);
    prism::cp_async<4>(s + threadIdx.x * 4, a + threadIdx.x * 4);
    prism::cp_async<2>(s + threadIdx.x * 2, a + threadIdx.x * 2);
    prism::cp_async_wait_all();
    __syncthreads();
    uint32_t r4[4], r2[2], r1[1];
    prism::ldmatrix<4>(r4, s + (threadIdx.x % 16) * 16);
    prism::ldmatrix<2, true>(r2, s + (threadIdx.x % 16) * 8);
    prism::ldmatrix<1>(r1, s);
    float c[4] = {0, 0, 0, 0}, d[4], e[4];
    prism::mma_m16n8k16<half>(d, r4, r2, c);
    prism::mma_m16n8k16<__nv_bfloat16>(e, r4, r2, d);
    float w[8];
    prism::load8(w, s + threadIdx.x % 16 * 8);
    float g[32] = {};
#if PRISM_WGMMA
    prism::fence_async_shared();
#endif
    prism::load8(w, reinterpret_cast<const __nv_bfloat16*>(s) + threadIdx.x % 16 * 8);
    for (int i = 0; i < 4; ++i) out[threadIdx.x * 4 + i] = e[i] + prism::warp_sum(d[i]) + r1[0] + w[i] + w[i + 4] + g[i]
                                                         + prism::max_(d[i], e[i]);
    if (prism::last_of(tickets, gridDim.x)) out[threadIdx.x] += 1.0f;
}
"""


def test_sampled_blocks_of_a_program_of_several_kernels():
    """Each kernel reads the block interpreter's values of what others store; exactly the elements the
    sampled blocks write are compared, intermediates with the block interpreter."""
    from prism_dsl.pipeline import emulation
    from prism_dsl.pipeline.build import check_inputs, plan_of, reference_outputs, rtol_of
    from test_codegen import ROOT, build_of

    built, _ = build_of(ROOT / "programs" / "rmsnorm_mlp.prism", grid={"x": 4}, archs=())
    inputs = check_inputs(built, 3)
    check = emulation.check(built, plan_of(built), inputs, reference_outputs(built, inputs), seed=3,
                            rtol=rtol_of(built.reference), checked_against="input program", extra=0)
    assert check.passed and not check.emulation["whole_grid"] and check.emulation["sample_seed"] == 3, check.errors()
    assert any(b["emulated"] < b["grid"] for b in check.emulation["blocks"].values())
    intermediates = [o for o in check.outputs.values() if o.get("against") == "block interpreter"]
    assert intermediates and all(0 < o["elements"] for o in check.outputs.values())


def test_each_build_has_its_optimizer_level_and_the_runtime_the_same_flags(monkeypatch, tmp_path):
    """The plain build at -O1, ThreadSanitizer's at -O1, AddressSanitizer's at -O0 (`emulate._FLAGS` says why),
    and the runtime each links compiled with the same flags as the kernels."""
    commands, runtimes = [], []
    monkeypatch.setattr(emulate.subprocess, "run", lambda cmd, **kw: commands.append(cmd) or
                        type("Done", (), {"returncode": 0, "stderr": ""})())
    monkeypatch.setattr(emulate, "runtime_object", lambda cxx, flags, workdir: runtimes.append(flags) or
                        workdir / "prism_emu.o")
    k = kernel("", {"A": "float*"}, 1)
    for sanitizer in (None, "thread", "address"):
        emulate.build([k], {"A": DType.F32}, {"A": (1,)}, tmp_path, sanitizer)
    levels = [[f for f in cmd if f.startswith("-O")] for cmd in commands]
    assert levels == [["-O1"], ["-O1"], ["-O0"]]
    assert runtimes == [cmd[1:cmd.index("-x")] for cmd in commands]
    assert all(cmd[-3:-1] == ["prism_emu.o", "-o"] for cmd in commands)  # linked


def test_the_runtime_is_compiled_once_per_set_of_flags_and_checked_where_it_is_kept(monkeypatch, tmp_path, capsys,
                                                                                     request):
    """prism_emu.cc is compiled once per set of flags into the cache, and a later build takes it from there; an
    object that is not what its record says is compiled again, with a warning; a cache that cannot be written
    costs the compile, nothing else; old objects are pruned. (The compiler is stood in for: every emulation
    test links the real runtime.)"""
    cache = tmp_path / "cache"
    monkeypatch.setenv("PRISM_CACHE_DIR", str(cache))
    compiled = []

    def compiler(cmd, cwd=None, **kw):
        if "-c" in cmd:  # the runtime: an "object" that says which flags made it
            compiled.append(cmd)
            (Path(cwd) / cmd[cmd.index("-o") + 1]).write_bytes(" ".join(cmd).encode())
        return type("Done", (), {"returncode": 0, "stdout": "c++ 1.0", "stderr": ""})()

    monkeypatch.setattr(emulate.subprocess, "run", compiler)
    emulate._compiler_identity.cache_clear()
    request.addfinalizer(emulate._compiler_identity.cache_clear)  # the stand-in's identity is not kept

    def runtime(flags: list[str]) -> list[list[str]]:
        compiled.clear()
        work = tmp_path / f"build{len(list(tmp_path.glob('build*')))}"
        work.mkdir()
        obj = emulate.runtime_object("c++", flags, work)
        assert obj == work / "prism_emu.o" and obj.read_bytes().decode().startswith(" ".join(["c++", *flags]))
        return compiled[:]

    plain, thread = ["-O0"], ["-O1", "-fsanitize=thread"]
    assert len(runtime(plain)) == 1
    assert runtime(plain) == []  # from the cache
    assert len(runtime(thread)) == 1 and runtime(thread) == []  # other flags, another object
    kept = cache / "emulation"
    assert len(list(kept.glob("*.o"))) == len(list(kept.glob("*.json"))) == 2
    for obj in kept.glob("*.o"):
        obj.write_bytes(obj.read_bytes() + b" and more")  # not the object the record names
    assert len(runtime(plain)) == 1
    assert "not the object its record names" in capsys.readouterr().err
    assert runtime(plain) == []  # stored again
    named = {o.name for o in kept.glob("*.o")}
    other = kept / (sorted(named)[0][:33] + "0" * 16 + ".o")
    other.write_bytes(b"another process's object of the same runtime")  # stored at once with this one
    assert runtime(plain) == []  # the record names its own object
    other.unlink()
    for n in range(emulate.RUNTIME_OBJECTS_KEPT + 3):
        (kept / f"{n:032x}.o").write_bytes(b"")
    monkeypatch.setattr(emulate, "_compiler_identity", lambda cxx: ("another", "compiler"))
    assert len(runtime(plain)) == 1 and runtime(plain) == []
    assert len(list(kept.glob("*.o"))) == emulate.RUNTIME_OBJECTS_KEPT
    monkeypatch.setenv("PRISM_CACHE_DIR", str(tmp_path / "build0" / "prism_emu.o"))  # a file: no cache there
    assert len(runtime(plain)) == 1 and len(runtime(plain)) == 1


def test_a_compiler_that_fails_saying_nothing_is_said_so():
    """`CXX=false`: the message ended at "does not compile:" with nothing after it."""
    done = subprocess.CompletedProcess(["false"], 1, "", "")
    assert emulate._compiler_errors(done) == "(it exited 1, saying nothing)"
    done = subprocess.CompletedProcess(["g++"], 1, "", "a.cc:1: warning: w\nt.cu:3:1: error: e\n")
    assert emulate._compiler_errors(done) == "t.cu:3:1: error: e"


def test_an_emulation_the_scratch_directory_cannot_run_says_why(tmp_path, monkeypatch):
    """A TMPDIR on a file system mounted noexec: 'prismc: cannot use ...emulate-plain: Permission denied' named no
    cause and no way out."""
    from prism_dsl.base.errors import PrismError

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied", args[0][0])

    monkeypatch.setattr(emulate.subprocess, "run", refused)
    with pytest.raises(PrismError, match=r"cannot run the emulation's program .*emulate-plain \(permission denied\): "
                       r"is its file system mounted noexec\? Set TMPDIR to a directory programs may run from"):
        emulate._execute(tmp_path / "emulate-plain", tmp_path, [], 1.0)


def test_a_scratch_directory_whose_name_is_not_utf8_still_runs(tmp_path):
    """TMPDIR=$'/tmp/t\\xe9mp': the commands file, which names the data files by their paths, was written as UTF-8
    text and failed on the name's undecodable byte (a UnicodeEncodeError's traceback)."""
    odd = Path(os.fsdecode(bytes(tmp_path) + b"/t\xe9mp"))
    odd.mkdir()
    k = kernel("    g_Y[threadIdx.x] = g_X[threadIdx.x];", {"X": "const float*", "Y": "float*"}, 1)
    got = run(k, {"X": DType.F32, "Y": DType.F32}, {"Y": (32,)}, {"X": np.arange(32.0)}, odd)
    assert got.finding is None and (got.outputs["Y"] == np.arange(32.0)).all()
