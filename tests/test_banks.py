"""The shared-memory wavefronts counted in the emulation (`backend.banks`, templates/prism_banks.cc): the rules on
a kernel whose accesses have known costs, a conflict planted in a generated kernel, every hand-written kernel
counted, and `prismc verify --banks`."""

from __future__ import annotations

import re
import shutil
from dataclasses import replace

import pytest

from prism_dsl.backend import banks, emulate
from prism_dsl.cli.main import main
from prism_dsl.ir.nodes import DTYPES
from prism_dsl.pipeline.build import check_inputs, plan_of, shared_wavefronts
from test_codegen import FUSED, GOLDEN_PARAMS, ROOT, build_of

pytestmark = [pytest.mark.skipif(emulate.compiler() is None, reason="no C++ compiler (g++ or clang++) for the emulation"),
              pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None,
                                 reason="the count needs g++'s or clang's kernel-address instrumentation")]

# A kernel in place of rmsnorm_linear's (its signature, one block of 128 threads, 4 warps): each marked line's
# warp accesses and what the GPU's 32 banks make of them, per warp.
KNOWN = r"""#include "prism.cuh"

extern "C" __global__ void __launch_bounds__(128) prism_rmsnorm_matmul(
    const half* __restrict__ g_X,
    const half* __restrict__ g_W,
    half* __restrict__ g_Y)
{
    PRISM_SMEM(20480);
    float* const s_f = PRISM_SHARED_IN(float, 0, 16384, 0, 0);
    half* const s_h = PRISM_SHARED_IN(half, 16384, 4096, 0, 0);
    const int t = PRISM_TID;
    prism::cp_async<8>(s_h + t * 8, g_X + t * 8);  // @copy 16 bytes a lane, adjacent: 4 phases, 4 wavefronts
    prism::cp_async_commit();
    prism::cp_async_wait<0>();
    for (int i = t; i < 4096; i += 128) s_f[i] = 1.0f;  // @floats 32 times, a word a lane: 1 each
    __syncthreads();
    float acc = s_f[t % 32 * 32];  // @column one bank, 32 words: 32
    acc += s_f[t % 32 * 2];  // @pairs two words a bank: 2
    acc += s_f[7];  // @broadcast one word: 1
    float v[8];
    prism::load8(v, s_h + t % 32 * 8);  // @rows 16 bytes a lane, adjacent: 4 phases, 4
    acc += v[0];
    prism::load8(v, s_h + t % 32 * 64);  // @strided 128 bytes apart: 8 lanes a phase on 4 banks, 8 each, 32
    acc += v[1];
    uint32_t r[4];
    prism::ldmatrix<4>(r, s_h + t % 32 * 8);  // @ldmatrix 4 matrices of 8 adjacent 16-byte rows: 4
    acc += float(r[0] & 1u);
    prism::ldmatrix<4>(r, s_h + t % 32 * 64);  // @ldmatrix_strided rows 128 bytes apart: 8 a matrix, 32
    acc += float(r[1] & 1u);
    if (t < 8) g_Y[t] = half(acc);
}
"""
EXPECTED = {  # per warp: (wavefronts, conflict-free)
    "copy": (4, 4), "floats": (32, 32), "column": (32, 1), "pairs": (2, 1), "broadcast": (1, 1), "rows": (4, 4),
    "strided": (32, 4), "ldmatrix": (4, 4), "ldmatrix_strided": (32, 4),
}


def test_the_count_follows_the_banks_rules():
    """Each access of a kernel written to known costs, counted per place: a word a lane across 32 banks is one
    wavefront, one bank's 32 words are 32, a shared word is one for all; 16-byte accesses go 8 lanes a phase;
    ldmatrix a phase per 8x8 matrix; cp.async's writes as the lanes' 16-byte stores."""
    built, _ = build_of(ROOT / "programs" / "fused" / "rmsnorm_linear.prism", *GOLDEN_PARAMS["rmsnorm_linear"])
    kernel = replace(built.kernels[0], source=KNOWN)
    plan = plan_of(built)
    shapes = {n: tuple(t["shape"]) for n, t in plan["tensors"].items()}
    dtypes = {n: DTYPES[t["dtype"]] for n, t in plan["tensors"].items()}
    got = banks.count([kernel], dtypes, shapes, check_inputs(built, 0), blocks={kernel.name: [(0, 0, 0)]})[kernel.name]
    lines = {m.group(1): f"{kernel.file}:{i + 1}" for i, line in enumerate(KNOWN.splitlines())
             if (m := re.search(r"// @(\w+)", line))}
    warps = 4
    assert got.blocks == 1
    assert got.wavefronts == warps * sum(w for w, _ in EXPECTED.values())
    assert got.ideal == warps * sum(i for _, i in EXPECTED.values())
    conflicted = {p.where: (p.wavefronts, p.ideal) for p in got.conflicted}
    assert conflicted == {lines[k]: (warps * w, warps * i) for k, (w, i) in EXPECTED.items() if w > i}
    assert [p.where for p in got.conflicted][0] in (lines["column"], lines["strided"], lines["ldmatrix_strided"])


def test_a_tile_without_its_padding_shows_its_conflicts():
    """rmsnorm_linear's x tile loses its row padding (72 elements a row to 64: rows 128 bytes apart): the
    ldmatrix of its 8 rows lands on 4 banks, 8 times the wavefronts where the padding had none over 1."""
    built, _ = build_of(ROOT / "programs" / "fused" / "rmsnorm_linear.prism", *GOLDEN_PARAMS["rmsnorm_linear"])
    padded = shared_wavefronts(built, extra="all")["rmsnorm_matmul"]
    unpadded = replace(built, kernels=tuple(replace(k, source=k.source.replace(" * 72", " * 64")) for k in built.kernels))
    bare = shared_wavefronts(unpadded, extra="all")["rmsnorm_matmul"]
    ldmatrix = [i + 1 for i, line in enumerate(built.kernels[0].source.splitlines()) if "ldmatrix<2>(fb" in line]
    assert len(ldmatrix) == 1
    where = f"{built.kernels[0].file}:{ldmatrix[0]}"
    assert where not in {p.where for p in padded.conflicted}
    place = next(p for p in bare.conflicted if p.where == where)
    assert place.wavefronts == 8 * place.ideal
    assert bare.wavefronts > padded.wavefronts and bare.ideal == padded.ideal


@pytest.mark.parametrize("name, wide, bare", [("rmsnorm_linear", 36, 32), ("attention", 72, 64)])
def test_accumulators_written_back_from_registers_fall_on_distinct_banks(name, wide, bare):
    """After the loop the register-tiled products (rmsnorm_linear's, mma.sync's transposed layout: a lane a
    float of rows 0, 2, 4, 6) and online softmax's outputs (attention's, the accumulators' layout: a lane 2
    floats of one of 4 rows a half warp) go to their f32 states with rows padded (`launch.written_back`: 32 to
    36 and 64 to 72 floats), so that the lanes of each write fall on distinct banks; unpadded, 4 share each."""
    built, _ = build_of(ROOT / "programs" / "fused" / f"{name}.prism", *GOLDEN_PARAMS[name])
    k = built.kernels[0]
    back = [i + 1 for i, line in enumerate(k.source.splitlines()) if re.search(r"\bc\[0\] \+?= d\[0\]", line)]
    assert back and f") * {wide} + " in k.source
    where = {f"{k.file}:{n}" for n in back}
    padded = shared_wavefronts(built, extra="all")[k.name]
    assert not where & {p.where for p in padded.conflicted}, padded.conflicted[:4]
    source = re.sub(rf"\b{wide}\b", str(bare), k.source)  # the stride back to the rows' length, reads and writes
    unpadded = shared_wavefronts(replace(built, kernels=(replace(k, source=source),) + built.kernels[1:]), extra="all")
    worst = [p for p in unpadded[k.name].conflicted if p.where in where]
    assert worst and all(p.wavefronts == 4 * p.ideal for p in worst), worst


@pytest.mark.parametrize("path", FUSED, ids=lambda p: p.stem)
def test_every_hand_written_kernel_is_counted(path):
    """Every kernel of programs/fused at the golden files' parameters, counted over its whole grid: no copy into
    a tile, no ldmatrix from one and no dot product's 16-byte load of one (`dot8`) takes more than its
    conflict-free wavefronts (rows of 128 bytes or more padded, of 32 or 64 bytes with their chunks permuted:
    `launch.xor_rows`), and the whole kernel at most 1.3x
    (reading the accumulators back, and the row sums' shuffles' words)."""
    built, _ = build_of(path, *GOLDEN_PARAMS[path.stem])
    counted = shared_wavefronts(built, extra="all")
    for k in built.kernels:
        w = counted[k.name]
        assert w.blocks == k.grid[0] * k.grid[1] * k.grid[2] and w.accesses > 0
        assert 1.0 <= w.over_ideal <= 1.3, (k.name, w.over_ideal, w.conflicted[:3])
        assert all(re.fullmatch(r"[\w.]+\.(cu|cuh):\d+", p.where) for p in w.conflicted), w.conflicted
        lines = k.source.splitlines()
        tiles = [p.where for p in w.conflicted if p.where.startswith(k.file + ":")
                 and re.search(r"cp_async|ldmatrix|load8\(w", lines[int(p.where.split(":")[1]) - 1])]
        assert not tiles, tiles


DOT = """dims d = {d}, m = {m}
program dot(Q: f16[1, d], K: f16[d, m]) {{
    kernel k grid(x = gx) {{
        qt = load Q[:, :]
        kt = load K[:, x]
        store S[:, x] = qt @ kt
    }}
    return S
}}
"""


@pytest.mark.parametrize("d, m, lanes", [(512, 8, 32), (512, 64, 16), (128, 128, 8), (64, 256, 4), (64, 512, 2)])
def test_a_dot_product_reading_8_columns_a_load_is_free_of_conflicts_at_every_lane_count(write, d, m, lanes):
    """One query row against a tile of keys (`dot8`, the product off the tensor cores at decode) with 2 to 32 lanes
    sharing each 8 outputs: a quarter warp's 16-byte loads of the padded tile fall on 8 distinct bank groups (a
    group's lanes adjacent from 8 lanes up, spread over the warp below: with adjacent lanes at every count, 4 and 2
    lanes took 1.43x and 1.44x their conflict-free wavefronts; with spread lanes at every count, 16 took 1.44x)."""
    from prism_dsl.lang.check import load
    from prism_dsl.pipeline.build import BuildOptions, build
    from test_codegen import H100

    from prism_dsl.backend.launch import CodegenConfig

    program = load(write(DOT.format(d=d, m=m))).program()  # the plain path: with tensor cores, "mmarows"
    built = build(program, H100, BuildOptions(grid={"gx": 1}, archs=(), codegen=CodegenConfig(tensor_cores=False)))
    k = built.kernels[0]
    assert f"8 outputs per {lanes} lanes" in k.source
    w = shared_wavefronts(built, extra="all")[k.name]
    lines = k.source.splitlines()
    assert not [p for p in w.conflicted if p.where.startswith(k.file + ":")
                and "load8(w" in lines[int(p.where.split(":")[1]) - 1]], w.conflicted
    assert w.over_ideal <= 1.05, (w.over_ideal, w.conflicted)


ROWS = """dims d = {d}, m = {m}
program scores(Q: f16[1, d], K: f16[m, d]) {{
    kernel k grid(x = gx) {{
        qt = load Q[:, :]
        kt = load K[x, :]
        store S[:, x] = qt @ transpose(kt, 1, 0)
    }}
    return S
}}
"""


@pytest.mark.parametrize("d, m, lanes", [(128, 128, 1), (128, 64, 2), (128, 32, 4), (256, 16, 8)])
def test_scores_reading_a_key_row_16_bytes_a_load_are_free_of_conflicts_at_every_lane_count(write, d, m, lanes):
    """One query row against a tile of keys read transposed (`dotrows`, the scores at decode): a lane alone on a
    padded key row, so a quarter warp's 16-byte loads start 8 rows on 8 distinct bank groups; 2 and 4 lanes
    spread over the warp, which keeps that; 8 reading one row's adjacent chunks."""
    from prism_dsl.lang.check import load
    from prism_dsl.pipeline.build import BuildOptions, build
    from test_codegen import H100

    from prism_dsl.backend.launch import CodegenConfig

    program = load(write(ROWS.format(d=d, m=m))).program()  # the plain path: with tensor cores, "mmarows"
    built = build(program, H100, BuildOptions(grid={"gx": 1}, archs=(), codegen=CodegenConfig(tensor_cores=False)))
    k = built.kernels[0]
    assert ("one output a lane" if lanes == 1 else f"one output per {lanes} lanes") in k.source
    w = shared_wavefronts(built, extra="all")[k.name]
    lines = k.source.splitlines()
    assert not [p for p in w.conflicted if p.where.startswith(k.file + ":")
                and "load8(" in lines[int(p.where.split(":")[1]) - 1]], w.conflicted
    assert w.over_ideal <= 1.05, (w.over_ideal, w.conflicted)


@pytest.mark.parametrize("cols", [16, 32])
def test_permuted_rows_keep_chunks_whole_and_spread_them_over_the_banks(cols):
    """`ctext.xor_column` for rows of 32 and 64 bytes, evaluated as C would: each row's columns map onto that
    row's columns one to one with each 16-byte chunk whole; the chunk an ldmatrix reads from 8 rows in a row, and
    the chunks a quarter warp's 16-byte copies fill (128 bytes of rows), land in 8 distinct bank groups."""
    from prism_dsl.backend.ctext import xor_column

    expr = xor_column("r", "c", cols).replace("/", "//")

    def at(r, c):  # element offset in the tile, rows `cols` elements apart
        return r * cols + eval(expr, {"r": r, "c": c})

    for r in range(64):
        row = [at(r, c) for c in range(cols)]
        assert sorted(row) == list(range(r * cols, (r + 1) * cols))
        assert all(row[c + 1] == row[c] + 1 for c in range(cols - 1) if (c + 1) % 8)
    groups = lambda offsets: {o * 2 // 16 % 8 for o in offsets}  # 16-byte units of a 128-byte bank line
    for first in range(0, 64, 8):
        for c in range(0, cols, 8):
            assert len(groups(at(first + i, c) for i in range(8))) == 8
    per_line = 64 // cols  # rows in 128 bytes
    for first in range(0, 64, per_line):
        assert len(groups(at(first + i, c) for i in range(per_line) for c in range(0, cols, 8))) == 8


def test_the_model_prices_the_counted_wavefronts_as_a_floor():
    """A block's wavefronts (`compiled["wavefronts"]`) take the busy SMs' shared memory one a clock each: a count
    far below the kernel's other terms changes nothing, one above them decides its time (bound "shared")."""
    from prism_dsl.backend.cost import estimate
    from prism_dsl.backend.intake import CLOCK_GHZ
    from prism_dsl.pipeline.build import BuildOptions, build
    from test_codegen import H100, load

    program = load(ROOT / "programs/fused/rmsnorm_linear.prism").program()
    built = build(program, H100, BuildOptions(dims={"n": 8, "d": 4096}, archs=()))
    c = built.concrete[built.kernels[0].name]
    plain = estimate(c, H100)
    few = estimate(c, H100, compiled={"wavefronts": 100})
    assert (few.time_us, few.bound, few.priced, few.wavefronts) == (plain.time_us, plain.bound, "structure", 100)
    clocks = c.blocks() / (min(c.blocks(), H100.sms) * CLOCK_GHZ * 1e3)  # us a wavefront of every block takes
    assert few.shared_us == pytest.approx(100 * clocks, abs=1e-3)
    many = estimate(c, H100, compiled={"wavefronts": 1e6})
    assert many.bound == "shared" and many.shared_us == pytest.approx(1e6 * clocks, rel=1e-5)
    assert many.time_us == pytest.approx(H100.launch_overhead_us + many.shared_us, rel=1e-3)


def test_compile_and_verify_banks_count_and_price_the_wavefronts(tmp_path, capsys):
    """`prismc compile --banks` counts each kernel's wavefronts after its check, prices them (report.json's
    `shared` and the estimate's `wavefronts` and `shared_us`) and says so; without the emulation it says why
    not (refused with --no-emulate). `prismc verify --banks` prints the same count and what the model makes of it."""
    import json

    fused = str(ROOT / "programs" / "fused" / "rmsnorm_linear.prism")
    common = ["compile", fused, "--search", "none", "--dims", "n=8,d=256", "--arch", "none", "--banks"]
    assert main([*common, "-o", str(tmp_path / "o")]) == 0
    text = capsys.readouterr().out
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    kernel = report["kernels"][0]
    assert kernel["shared"]["blocks"] == 2 and kernel["shared"]["wavefronts"] >= kernel["shared"]["conflict_free"] > 0
    assert kernel["estimate"]["wavefronts"] == kernel["shared"]["wavefronts"] / 2 and kernel["estimate"]["shared_us"] > 0
    assert "shared-memory wavefronts counted in the emulation" in report["priced"] and report["banks"] is None
    assert re.search(r"rmsnorm_matmul: .*, [\d,]+ shared-memory wavefronts a block \([\d.]+x conflict-free, [\d.]+ us\)",
                     text), text
    assert main([*common, "-o", str(tmp_path / "n"), "--no-emulate"]) == 2  # it counts in the emulation: refused
    assert "--banks counts in the emulation, which --no-emulate leaves out" in capsys.readouterr().err
    assert main([*(a for a in common if a != "--banks"), "-o", str(tmp_path / "n"), "--no-emulate"]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "n" / "report.json").read_text())["kernels"][0]["shared"] is None
    assert main(["verify", str(tmp_path / "n"), "--banks", "--emulate-blocks", "0"]) == 0
    text = capsys.readouterr().out
    assert "verified: yes" in text
    m = re.search(r"rmsnorm_matmul: ([\d,]+) wavefronts a block \((\d+) emulated\), ([\d.]+)x conflict-free; "
                  r"([\d.]+) us of the busy SMs' shared memory, against an estimate of ([\d.]+) us", text)
    assert m and int(m.group(2)) >= 2 and float(m.group(3)) >= 1.0 and 0 < float(m.group(4)) < float(m.group(5)), text
    # the same blocks, the same count (printed to the wavefront, kept to a tenth)
    assert int(m.group(1).replace(",", "")) == pytest.approx(kernel["estimate"]["wavefronts"], abs=0.5)
