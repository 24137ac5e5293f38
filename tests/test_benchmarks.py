"""The GPU benchmark scripts' parts that run without a GPU: the probes' kernels compile to what they claim to
measure, and the arithmetic that turns measurements into the model's constants recovers those constants
from figures the model itself would give."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from prism_dsl.backend import cuda_plan, cuda_runtime, intake, sass
from prism_dsl.backend.compare import check
from prism_dsl.backend.cuda_runtime import NVCC_OPTIONS
from prism_dsl.backend.nvcc import nvcc_path
from prism_dsl.kernels.hardware import load_hardware

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


probe = script("gpu_probe")


@pytest.mark.parametrize("name", ["h100", "h200", "a100"])
def test_the_probe_summary_gives_back_the_models_own_constants(name):
    hardware = load_hardware(name)
    points = [probe.Point(b, s, t, 0.0) for b, s, t in probe.configurations(hardware.sms)]
    points = [probe.Point(p.blocks, p.stages, p.tile, probe.model_gbs(p, hardware)) for p in points]
    l2 = [probe.Point(b, s, t, 0.0) for b, s, t in probe.l2_configurations(hardware.sms)]
    l2 = [probe.Point(p.blocks, p.stages, p.tile, probe.model_l2_gbs(p, hardware)) for p in l2]
    threads = [probe.Point(b, s, t, 0.0, n) for b, s, t, n in probe.thread_configurations(hardware.sms)]
    threads = [probe.Point(p.blocks, p.stages, p.tile, probe.model_gbs(p, hardware), p.threads) for p in threads]
    summary = probe.summarize(points, hardware, l2, threads)
    assert summary["warp_fill_bytes_per_clock"] == {n: pytest.approx(intake.WARP_FILL_BYTES_PER_CLOCK, abs=0.01)
                                                    for n in (128, 256, 512)}
    assert summary["l2_peak_gbs"] == pytest.approx(hardware.l2_bandwidth_gbs, rel=1e-3)
    assert summary["l2_fill_bytes_per_clock"] == pytest.approx(intake.sm_intake(probe.THREADS / 32), rel=1e-3)
    assert summary["peak_gbs"] == pytest.approx(hardware.bandwidth_gbs * intake.BANDWIDTH_REACH, rel=1e-3)
    assert summary["fill_bytes_per_clock"] == pytest.approx(intake.sm_intake(probe.THREADS / 32), rel=1e-3)
    assert summary["latency_ns"] == pytest.approx(hardware.dram_latency_ns, rel=1e-3)
    assert summary["half_over_full"] == pytest.approx(probe.model_half_over_full(hardware), rel=1e-3)
    # the configurations span every regime: some bound by the bytes in flight, some by the peak, some by few SMs
    regimes = {min(("peak", hardware.bandwidth_gbs * intake.BANDWIDTH_REACH),
                   ("latency", probe.per_sm_flight(p, hardware)[0] * probe.per_sm_flight(p, hardware)[1]
                    / hardware.dram_latency_ns),
                   ("fill", min(p.blocks, hardware.sms) * intake.sm_intake(probe.warps(p, hardware)) * intake.CLOCK_GHZ),
                   key=lambda r: r[1])[0] for p in points}
    assert regimes == {"peak", "latency", "fill"}


def test_the_probe_summary_reads_a_slower_machine_as_slower():
    """Measured figures off the model's: the summary reports them, not the model's constants."""
    hardware = load_hardware("h100")
    points = [probe.Point(b, s, t, 0.0) for b, s, t in probe.configurations(hardware.sms)]
    # a machine whose latency is twice the model's and whose SMs take in half as much
    slow = [probe.Point(p.blocks, p.stages, p.tile, min(
        2000.0, min(p.blocks, hardware.sms) * 56.0,
        probe.per_sm_flight(p, hardware)[0] * probe.per_sm_flight(p, hardware)[1] / 1200.0)) for p in points]
    # and whose L2 serves 5.5 TB/s at most, 45 GB/s to one SM
    l2 = [probe.Point(b, s, t, min(5500.0, min(b, hardware.sms) * 45.0)) for b, s, t in
          probe.l2_configurations(hardware.sms)]
    summary = probe.summarize(slow, hardware, l2)
    assert summary["peak_gbs"] == 2000.0
    assert summary["fill_bytes_per_clock"] == pytest.approx(56.0 / intake.CLOCK_GHZ, rel=1e-3)
    assert summary["latency_ns"] == pytest.approx(1200.0, rel=1e-3)
    assert summary["l2_peak_gbs"] == 5500.0
    assert summary["l2_fill_bytes_per_clock"] == pytest.approx(45.0 / intake.CLOCK_GHZ, rel=1e-3)
    table = probe.report(slow, {"alone_us": 4.0, "back_to_back_us": 2.0}, {"l2_ns": 250.0, "dram_ns": 700.0},
                         hardware, "a test device", l2)
    assert "| 1200.0 | 600 (dram_latency_ns) |" in table and "a test device" in table
    assert "| streaming from L2, peak (GB/s) | 5500.0 | 10000 (l2_bandwidth_gbs) |" in table
    assert "From L2 (8 MB streamed over and over, 4 MB per block)" in table


def test_the_l2_probe_expects_the_xor_of_the_words_its_blocks_read():
    """Each block reads `count` words from its own place in the footprint, wrapping around at its end, tile by
    tile as probe.cu addresses them: the host's expected XORs are those of exactly those words."""
    words = np.random.default_rng(0).integers(0, 2**32, 1 << 12, dtype=np.uint32)
    wrap, tile = 1 << 12, 64  # words
    for blocks in (3, 7, 64):
        start = wrap // blocks // tile * tile
        count = wrap // 2
        read = [np.concatenate([words[(b * start + t * tile) % wrap:][:tile] for t in range(count // tile)])
                for b in range(blocks)]
        want = [np.bitwise_xor.reduce(r) for r in read]
        assert list(probe.block_xors(words, blocks, start, count, wrap)) == want
        assert len(set(want)) == blocks  # distinct: a block that read the wrong place would be found


def test_the_strip_probe_expects_the_xor_of_the_words_its_blocks_read():
    """probe_strips's block b reads `width` bytes of every row of its range (b / strips) from column b % strips,
    tile by tile, as probe.cu addresses its 16-byte units: the host's XORs are those of exactly those words,
    and every word is read once."""
    sizes = {"row": 256, "rows": 64, "blocks": 16, "tile": 512}
    words = np.random.default_rng(0).integers(0, 2**32, 64 * 256 // 4, dtype=np.uint32)
    units = words.reshape(-1, 4)
    for width in (32, 64, 128, 256):
        strips, ranges, rows, tile_rows = probe.strip_layout(width, **sizes)
        row16, width16 = 256 // 16, width // 16
        want, seen = [], []
        for b in range(strips * ranges):
            row0, col0 = b // strips * rows, b % strips * width16
            read = [(row0 + t * tile_rows + i // width16) * row16 + col0 + i % width16
                    for t in range(rows // tile_rows) for i in range(tile_rows * width16)]
            want.append(np.bitwise_xor.reduce(units[read].reshape(-1)))
            seen += read
        assert sorted(seen) == list(range(len(units)))
        assert list(probe.strip_xors(words, width, **sizes)) == want
    table = probe.strip_table([probe.Strip(32, 256, 800.0), probe.Strip(512, 256, 3200.0)])
    assert "| 32 | 256 | 800 | 0.25 |" in table and "| 512 | 256 | 3200 | 1.00 |" in table


def test_the_probe_refuses_to_run_without_a_gpu():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_probe.py")], capture_output=True, text=True,
                          env={**os.environ, "PRISM_NO_GPU": "1"})
    assert done.returncode == 1 and "needs a usable CUDA GPU: disabled by PRISM_NO_GPU" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.nvcc
@pytest.mark.skipif(nvcc_path() is None, reason="nvcc is not on the PATH")
def test_the_probe_kernels_compile_and_stream_by_cp_async(tmp_path):
    for arch in ("sm_90a", "sm_80"):
        cubin = tmp_path / f"probe_{arch}.cubin"
        done = subprocess.run([nvcc_path(), "-cubin", f"-arch={arch}", *NVCC_OPTIONS, f"-I{probe.HEADERS}", "-o",
                               str(cubin), str(BENCHMARKS / "probe.cu")], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    if not sass.available():
        pytest.skip("cuobjdump is missing (pip install -e '.[sass]'): the SASS is not read")
    listing = sass.disassemble(tmp_path / "probe_sm_90a.cubin")
    for stages in probe.STAGES:
        body = listing.split(f"Function : probe_stream_{stages}")[1].split("Function :")[0]
        assert "LDGSTS" in body and "LDGDEPBAR" in body, stages  # cp.async and its commit, no register round trip
    strips = listing.split("Function : probe_strips")[1].split("Function :")[0]
    assert "LDGSTS" in strips and "LDGDEPBAR" in strips
    chase = listing.split("Function : probe_chase")[1].split("Function :")[0]
    assert "LDG" in chase  # the chain of loads is there, not folded away


@pytest.mark.nvcc
@pytest.mark.skipif(nvcc_path() is None, reason="nvcc is not on the PATH")
def test_the_tma_probe_builds_both_ways_and_copies_by_tma(tmp_path):
    """tma_probe.cu as a program of its own (the host encodes and launches) and as the kernel pycuda compiles:
    two UTMALDG (one per map) at an mbarrier that counts their bytes. Without a GPU the script says so."""
    done = subprocess.run([nvcc_path(), "-gencode=arch=compute_90a,code=sm_90a", *NVCC_OPTIONS, "-I",
                           str(probe.HEADERS), "-DTMA_PROBE_MAIN", str(BENCHMARKS / "tma_probe.cu"), "-o",
                           str(tmp_path / "tma_probe")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    cubin = tmp_path / "tma_probe.cubin"
    done = subprocess.run([nvcc_path(), "-cubin", *NVCC_OPTIONS, "-I", str(probe.HEADERS),
                           *(f"-{k}={v}" for k, v in cuda_runtime.device_target((9, 0)).items()),
                           "-o", str(cubin), str(BENCHMARKS / "tma_probe.cu")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    # its maps where the cubin has them, 0x70 and 0xF0 bytes into the parameters: not at 0 and 128, where the
    # probe's `packed` variant (the runtime's packing until 2026-11-30) puts them
    assert cuda_plan.parameter_layout(cubin.read_bytes(), "tma_probe") == [(0x70, 128), (0xF0, 128), (0x170, 8),
                                                                           (0x178, 4), (0x17C, 4)]
    if sass.available():
        listing = sass.disassemble(cubin)
        assert listing.count("UTMALDG.2D") == 2 and "SYNCS.ARRIVE.TRANS64" in listing
    done = subprocess.run([sys.executable, str(BENCHMARKS / "tma_probe.py")], capture_output=True, text=True,
                          env={**os.environ, "PRISM_NO_GPU": "1"})
    assert done.returncode == 1 and "needs a usable CUDA GPU: disabled by PRISM_NO_GPU" in done.stderr
    assert "Traceback" not in done.stderr


class ProbeDriver:
    """A stand-in for pycuda.driver that runs probe.cu's kernels in numpy, on a clock: each kernel takes
    KERNEL_MS, a memset MEMSET_MS and the spin SPIN_MS, so a time says which of them fell between its events."""
    KERNEL_MS, MEMSET_MS, SPIN_MS = 0.01, 0.5, 1.0

    class function_attribute:
        MAX_DYNAMIC_SHARED_SIZE_BYTES = "max_dynamic_smem"

    def __init__(self):
        self.memory, self.clock, self.launches, self.blocks = {}, 0.0, [], []
        driver = self

        class Allocation(int):
            def free(self):
                del driver.memory[int(self)]

        class Event:
            def record(self):
                self.at = driver.clock

            def synchronize(self):
                pass

            def time_till(self, other):
                return other.at - self.at

        self.Allocation, self.Event = Allocation, Event

    def mem_alloc(self, nbytes):
        address = (len(self.memory) + 1) << 40
        self.memory[address] = np.zeros(nbytes, np.uint8)
        return self.Allocation(address)

    def to_device(self, array):
        allocation = self.mem_alloc(array.nbytes)
        self.memory[int(allocation)][:] = np.ascontiguousarray(array).view(np.uint8).ravel()
        return allocation

    def words(self, ptr):
        return self.memory[int(ptr)].view(np.uint32)

    def memset_d32_async(self, ptr, value, count):
        self.words(ptr)[:count] = value
        self.clock += self.MEMSET_MS

    def memcpy_dtoh(self, host, ptr):
        host.reshape(-1).view(np.uint8)[:] = self.memory[int(ptr)][:host.nbytes]

    def get_function(self, name):  # the module's: probe.cu's kernels by name
        driver = self

        class Function:
            attributes = {}

            def prepare(self, fmt):
                self.fmt = fmt

            def set_attribute(self, attribute, value):
                self.attributes[attribute] = value

            def prepared_call(self, grid, block, *args, shared_size=0):
                assert len(args) == len(self.fmt), (name, self.fmt, args)
                if shared_size > 48 * 1024:
                    assert self.attributes.get("max_dynamic_smem", 0) >= shared_size, "no opt-in to the shared memory"
                driver.launches.append((name, grid, shared_size))
                driver.blocks.append(block)
                getattr(driver, name.rstrip("0123456789").rstrip("_"))(grid, *args)
                driver.clock += driver.SPIN_MS if name == "probe_spin" else driver.KERNEL_MS
        return Function()

    def probe_empty(self, grid):
        pass

    def probe_spin(self, grid, cycles):
        assert cycles >= 0

    def probe_chase(self, grid, chain, stride, at, steps, sink):
        words = self.words(chain)
        for _ in range(steps):
            at = int(words[at * stride])
        self.words(sink)[0] = at

    def probe_stream(self, grid, src, tiles, tile16, step16, wrap16, out):
        words, xors = self.words(src), self.words(out)
        for b in range(grid[0]):  # block b: `tiles` tiles of tile16 16-byte units from unit b * step16, wrapping
            for t in range(tiles):
                first = (b * step16 + t * tile16) % wrap16 * 4
                xors[b] ^= np.bitwise_xor.reduce(words[first:first + tile16 * 4])  # atomicXor: out must start at 0


def test_the_probe_drives_its_kernels_as_probe_cu_defines_them(monkeypatch):
    """The host side of every probe, run against probe.cu's kernels emulated in numpy (small buffers): the
    arguments match the kernels' parameters, shared memory past 48 KiB is opted into, each block's XOR is
    zeroed before every run so the host's check holds, and neither that memset nor the spin queued ahead of
    a streaming run lies between its events."""
    monkeypatch.setattr(probe, "STREAM_BYTES", 1 << 21)
    monkeypatch.setattr(probe, "L2_FOOTPRINT", 1 << 20)
    monkeypatch.setattr(probe, "L2_READ", 1 << 18)
    monkeypatch.setattr(cuda_runtime, "host_seconds", lambda: 0.0)  # a host that queues at once: no spin retried
    drv = ProbeDriver()
    launch = probe.probe_launch(drv, drv)
    assert launch["alone_us"] == pytest.approx(drv.KERNEL_MS * 1e3)
    assert launch["back_to_back_us"] == pytest.approx(drv.KERNEL_MS * 1e3)
    assert probe.probe_chase(drv, drv, 1 << 16, 1000) == pytest.approx(drv.KERNEL_MS * 1e6 / 1000)
    runs = 0
    for l2 in (False, True):
        points = probe.probe_stream(drv, drv, 8, 232448, l2=l2)  # raises where a block's XOR is not the host's
        runs += len(points)
        assert [(p.blocks, p.stages, p.tile) for p in points] == (probe.l2_configurations if l2 else
                                                                   probe.configurations)(8)
        for p in points:  # the bytes streamed over one kernel's time: no spin, no memset in it
            tiles = probe.L2_READ // p.tile if l2 else probe.STREAM_BYTES // (p.blocks * p.tile)
            assert p.gbs == pytest.approx(p.blocks * tiles * p.tile / (drv.KERNEL_MS * 1e-3) / 1e9)
    threads = probe.probe_stream(drv, drv, 8, 232448, threads=True)  # one block per SM, of more threads
    runs += len(threads)
    assert [(p.blocks, p.stages, p.tile, p.threads) for p in threads] == probe.thread_configurations(8)
    sizes = [block for (name, _, _), block in zip(drv.launches, drv.blocks) if name.startswith("probe_stream")]
    assert sizes[-18:] == [(n, 1, 1) for n in (128, 256, 512) for _ in range(6)]  # a warm-up and 5 timed, each
    assert {s for name, _, s in drv.launches if name == "probe_stream_17"} == {17 * 8192}
    names = [name for name, _, _ in drv.launches]
    streams = [i for i, name in enumerate(names) if name.startswith("probe_stream")]
    assert len(streams) == 6 * runs  # a warm-up, then 5 timed, per run
    assert all(names[i - 1] == "probe_spin" for i in streams)  # each right after a spin (the warm-up's of 0 clocks)
    assert set(drv.memory) == set()  # every buffer freed


fused = script("gpu_fused")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """One small workload compiled by `gpu_fused.py prepare`, as the GPU step finds it."""
    directory = tmp_path_factory.mktemp("gpu")
    args = type("Args", (), {"dir": str(directory), "only": None, "time_limit": 10.0, "hardware": "h100",
                             "options": "", "choices": 0})
    assert fused.prepare(args, [("rmsnorm_mlp small", "rmsnorm_mlp", "n=8,d=256")]) == 0
    return directory / "rmsnorm_mlp_small"


@pytest.fixture
def compiles(monkeypatch):
    """`prismc compile` stood in for in `gpu_fused.py`: each command line kept (the list given), its output directory
    made empty."""
    seen = []

    def compile_run(cmd, **kw):
        seen.append(cmd)
        Path(cmd[cmd.index("-o") + 1]).mkdir(parents=True)
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(fused.subprocess, "run", compile_run)
    return seen


def test_prepare_writes_what_the_gpu_step_reads(prepared):
    for name in ("case.json", "baseline.prism", "report.json", "launcher.py", "prism_runtime.py", "cuda_plan.py",
                 "prism.cuh"):
        assert (prepared / name).is_file(), name
    assert json.loads((prepared / "case.json").read_text()) == {"workload": "rmsnorm_mlp small",
                                                                "program": "rmsnorm_mlp", "dims": "n=8,d=256",
                                                                "hardware": "h100", "options": []}
    assert (prepared / "baseline.prism").read_text() == (BENCHMARKS.parent / "programs/rmsnorm_mlp.prism").read_text()


def test_prepare_compiles_the_chosen_program_with_other_choices_of_parameters(prepared, compiles):
    """`prepare --choices`: the chosen program compiled again as written with each other choice of
    `measuring.parameter_choices` (its kernel parameters by --grid and --loop, its threads by --threads: the chosen
    program's, which may be twice the default, or twice those) into
    choices/<k>/, with the program as written beside it and the choice named in its case.json. (prismc's compile
    is stood in for: its options are what is checked.)"""
    seen = compiles
    report = json.loads((prepared / "report.json").read_text())
    case = json.loads((prepared / "case.json").read_text())
    try:
        assert fused.prepare_choices(prepared, case, 4) == []
        assert sorted(p.name for p in (prepared / "choices").iterdir()) == ["1", "2", "3"]
        cases = [json.loads((prepared / "choices" / k / "case.json").read_text()) for k in "123"]
        assert all(c["choice_of"] == c["workload"] == "rmsnorm_mlp small" for c in cases)
        built = report["codegen"]["threads"]  # the chosen program's, which each choice starts from
        assert [c["threads"] for c in cases] == [built, built, 2 * built] and cases[2]["params"] == report["parameters"]
        assert len({json.dumps(c["params"]) for c in cases[:2]} | {json.dumps(report["parameters"])}) == 3
        for cmd, c in zip(seen, cases):
            assert cmd[cmd.index("--search") + 1] == "none" and "n=8,d=256" in cmd and "--no-emulate" in cmd
            given = {a.split("=", 1)[1] for a in cmd if a.startswith(("--grid=", "--loop="))}
            assert given == {f"{n}={v}" for n, v in c["params"].items()}
            assert all(a.startswith("--loop=F") for a in cmd if a.startswith("--loop="))  # the loop by --loop
            assert cmd[cmd.index("--threads") + 1] == str(c["threads"])
        assert (prepared / "choices" / "1" / "baseline.prism").read_text() == (prepared / "baseline.prism").read_text()
        assert fused.prepare_choices(prepared, case, 0) == [] and not (prepared / "choices").exists()
    finally:
        shutil.rmtree(prepared / "choices", ignore_errors=True)


def test_the_gpu_steps_oracle_is_the_program_as_written_on_inputs_of_their_dtype(prepared):
    """What the chosen program computes (its kernels in the block interpreter, with the parameters compiled)
    on the same inputs agrees with the oracle the GPU step checks every implementation against, and the
    inputs hold values of their dtype, which the launcher and torch take without rounding."""
    from prism_dsl.lang.check import load
    from prism_dsl.semantics.blocks import evaluate

    launcher, baseline, sets, reference, pairs, _ = fused.oracle(prepared, "h100")
    report = json.loads((prepared / "report.json").read_text())
    assert len(sets) == 16 and set(sets[0]) == {"X", "Wu", "Wg"}  # small inputs: many sets to span the L2 cache
    assert len({float(s["X"][0, 0]) for s in sets}) == 16
    again = fused.oracle(prepared, "h100")  # made once for a workload and the choices run after it
    assert again[2] is sets and again[3] is reference and again[5] is _
    first = fused.oracle(prepared, "h100", one_set=True)  # a profiler's one call
    assert len(first[2]) == 1 and first[2][0] is sets[0]
    assert all(np.array_equal(s[n], s[n].astype(np.float16)) for s in sets for n in s)  # f16 values
    chosen = load(prepared / f"{report['program']}.prism").program()
    got = evaluate(chosen, sets[0], report["parameters"], "h100", smem=False)
    for mine, theirs in pairs:
        result = check(got[mine], reference[theirs], 1e-6)
        assert result["passed"], result


def test_the_gpu_step_refuses_cleanly_without_a_gpu(prepared):
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_fused.py"), "run", "--dir", str(prepared.parent)],
                          capture_output=True, text=True, env={**os.environ, "PRISM_NO_GPU": "1"})
    assert done.returncode == 1 and "needs a usable CUDA GPU: disabled by PRISM_NO_GPU" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_gpu_step_records_a_failed_workload_and_stops_at_a_launch_failure(tmp_path, monkeypatch, capsys):
    """A workload that raises (pycuda's errors derive from Exception alone) is reported and the next one runs;
    after a fault that leaves the CUDA context unusable, which the error's class does not tell, the step stops."""
    for name in ("rmsnorm_linear decode", "rmsnorm_mlp decode", "swiglu decode"):
        (tmp_path / fused.slug(name)).mkdir()
        (tmp_path / fused.slug(name) / "case.json").write_text("{}")

    class LogicError(Exception):  # pycuda's, for an illegal memory access among others
        pass
    raised = iter([ValueError("a plan error"), LogicError("an illegal memory access"), AssertionError("never reached")])
    usable = iter([True, False])  # the context after each: the plan error leaves it working, the fault does not

    def run_case(out, baselines=True):
        raise next(raised)
    monkeypatch.setattr(fused, "run_case", run_case)
    monkeypatch.setattr(fused, "gpu_usable", lambda: next(usable))
    monkeypatch.setattr(cuda_runtime, "gpu_status", lambda: (True, "a GPU"))
    args = type("Args", (), {"dir": str(tmp_path), "only": None, "again": False, "results": str(tmp_path / "r.md")})
    assert fused.run(args) == 1
    err = capsys.readouterr().err
    assert "rmsnorm_linear decode: ValueError: a plan error" in err
    assert "rmsnorm_mlp decode: LogicError: an illegal memory access\nstopping: the CUDA context" in err
    assert "never reached" not in err and "swiglu" not in err


def test_the_profile_step_runs_our_kernels_once_and_checks_them(prepared, monkeypatch, capsys):
    """`gpu_fused.py profile` (what a profiler wraps): each prepared workload's own launcher called once on its
    first input set, no timing and no PyTorch, its outputs checked against the oracle."""
    from types import SimpleNamespace

    from prism_dsl.lang.check import load
    from prism_dsl.semantics.blocks import evaluate

    launcher, baseline, sets, reference, pairs, tol = fused.oracle(prepared, "h100")
    report = json.loads((prepared / "report.json").read_text())
    chosen = load(prepared / f"{report['program']}.prism").program()
    calls = []

    class Launcher:  # the GPU runtime's: the chosen program in the block interpreter here
        def __init__(self, plan, out, cast):
            calls.append((out, cast))

        def __call__(self, **inputs):
            calls.append(sorted(inputs))
            return evaluate(chosen, inputs, report["parameters"], "h100", smem=False)

        def close(self):
            calls.append("closed")
    fake = SimpleNamespace(PLAN=launcher.PLAN, prism_runtime=SimpleNamespace(Launcher=Launcher))
    monkeypatch.setattr(fused, "oracle", lambda out, hardware, one_set: (fake, baseline, sets[:1], reference, pairs, tol))
    monkeypatch.setattr(cuda_runtime, "gpu_status", lambda: (True, "a GPU"))
    assert fused.profile(type("Args", (), {"dir": str(prepared.parent), "only": None})) == 0
    assert calls == [(prepared, True), ["Wg", "Wu", "X"], "closed"]
    assert "rmsnorm_mlp small: ok (max rel err" in capsys.readouterr().out
    assert fused.profile(type("Args", (), {"dir": str(prepared.parent), "only": "attention"})) == 0
    assert len(calls) == 3  # none of the others


def test_the_results_table_names_every_implementation_and_every_failure():
    rows = {"prism-dsl": {"passed": True, "max_rel_err": 3e-4, "us": 12.0, "alone_us": 15.0},
            "torch eager": {"passed": True, "max_rel_err": 1e-3, "us": 40.0},
            "torch.compile": {"passed": True, "max_rel_err": 1e-3, "us": 24.0},
            "sdpa": {"passed": False, "max_rel_err": 2e-2, "us": 10.0}}
    text = fused.table([{"workload": "attention decode", "dims": "b=2", "device": "a GPU", "hardware": "h100",
                         "sets": 3, "floor_us": 10.0, "model_us": 13.0, "kernels": 1, "rows": rows}])
    assert text.startswith("# GPU results (a GPU)")
    assert ("| attention decode (b=2) | 1 | 12.0 | 15.0 | 40.0 | 24.0 | 10.0 (wrong) | 13.0 | 10.0 | 1.20 | 0.50 "
            "| 0.50 (torch.compile) | 3.0e-04 | FAILED: sdpa |") in text  # SDPA's wrong 10.0 is not the best
    rows["torch.compile"] = {"passed": False, "error": "BackendCompilerFailed: no C compiler"}
    text = fused.table([{"workload": "w", "dims": "d", "device": "a GPU", "hardware": "h100", "sets": 3,
                         "floor_us": 10.0, "model_us": 13.0, "kernels": 2, "rows": rows}])
    assert ("| 40.0 | did not run | 10.0 (wrong) | 13.0 | 10.0 | 1.20 | - | 0.30 (torch eager) | 3.0e-04 "
            "| FAILED: torch.compile, sdpa |") in text
    rows["torch.compile"] = {"passed": False, "max_rel_err": 5e-2, "us": 6.0}  # faster, and wrong: said so
    text = fused.table([{"workload": "w", "dims": "d", "device": "a GPU", "hardware": "h100", "sets": 3,
                         "floor_us": 10.0, "model_us": 13.0, "kernels": 1, "rows": rows}])
    assert "| 6.0 (wrong) | 10.0 (wrong) | 13.0 | 10.0 | 1.20 | 2.00 (wrong) | 0.30 (torch eager) |" in text
    rows["torch.compile"] = {"passed": False, "error": "BackendCompilerFailed: no C compiler"}
    text = fused.table([{"workload": "w", "dims": "d", "device": "a GPU", "hardware": "h100", "sets": 3,
                         "floor_us": 10.0, "model_us": 13.0, "kernels": 2, "rows": rows}])
    assert text.endswith("Baselines that did not run:\n- w, torch.compile: BackendCompilerFailed: no C compiler\n")
    assert "both for the hardware file H100, which" in text
    assert "- w: tuned and modelled for H100, measured on a GPU\n" in text  # a device no file names
    assert "measured / model" not in text  # results without kernel times (written before they were kept)
    per_kernel = [{"name": "fused_partial", "grid": [16, 8, 2], "block": [128, 1, 1], "model_us": 10.0,
                   "bound": "memory", "us": 14.0},
                  {"name": "fused_combine", "grid": [8, 2, 1], "block": [128, 1, 1], "model_us": 3.7, "bound": "launch",
                   "us": 1.85, "host_bound": True}]
    text = fused.table([{"workload": "w", "dims": "d", "device": "a GPU", "hardware": "h100", "sets": 3,
                         "floor_us": 10.0, "model_us": 13.0, "kernels": 2, "per_kernel": per_kernel, "rows": rows}])
    assert ("| w | fused_partial | 16x8x2 x 128 | 10.0 (memory) | 14.0 | 1.40 |\n"
            "| w | fused_combine | 8x2x1 x 128 | 3.7 (launch) | 1.9 (host-bound) | 0.50 |\n") in text


def test_prepare_passes_its_options_to_prismc_and_the_table_names_them(tmp_path, compiles):
    """A second directory compiled another way (the products on mma.sync) beside the first: prismc gets the
    options, case.json keeps them, and the table, written where `--results` says, names them."""
    seen = compiles
    args = type("Args", (), {"dir": str(tmp_path / "mma"), "only": "swiglu decode", "time_limit": 5.0,
                             "hardware": "h100", "options": "--no-wgmma --stages 2", "choices": 0})
    assert fused.prepare(args) == 0
    assert len(seen) == 1 and seen[0][-3:] == ["--no-wgmma", "--stages", "2"] and "n=8,d=4096" in seen[0]
    case = json.loads((tmp_path / "mma" / "swiglu_decode" / "case.json").read_text())
    assert case["options"] == ["--no-wgmma", "--stages", "2"]
    rows = {"prism-dsl": {"passed": True, "max_rel_err": 3e-4, "us": 12.0, "alone_us": 15.0},
            "torch.compile": {"passed": True, "max_rel_err": 1e-3, "us": 24.0}}
    result = {"workload": "swiglu decode", "dims": "n=8,d=4096", "options": case["options"], "device": "NVIDIA H100",
              "hardware": "h100", "sets": 3, "floor_us": 10.0, "model_us": 13.0, "kernels": 1, "rows": rows}
    (tmp_path / "mma" / "swiglu_decode" / "gpu.json").write_text(json.dumps(result))
    assert fused.write_table(tmp_path / "mma", tmp_path / "mma.md") == 0
    written = (tmp_path / "mma.md").read_text()
    assert "| swiglu decode (n=8,d=4096) [--no-wgmma --stages 2] | 1 | 12.0 | 15.0 |" in written


@pytest.mark.parametrize("options", ["", "--search none", "--search=none --stages 2", "--no-split --max-kernels 2",
                                     "--time-limit=5 --unsteady --tma", "--jobs 1"])
def test_the_scripts_options_are_ones_prismc_takes_searched_or_as_written(options):
    """`static_report.py` and `gpu_fused.py prepare` add the search's time limit unless --options leave the search
    out (prismc refuses a limit of a search it does not run: every workload failed), and `prepare --choices` compiles
    the chosen program as written without the options that limit the search."""
    import shlex

    from prism_dsl.cli.main import build_parser
    from prism_dsl.cli.values import ignored

    report = script("static_report")
    path = str(BENCHMARKS.parent / "programs" / "rmsnorm_linear.prism")
    for argv in (report.searched(shlex.split(options), 30.0), report.as_written(shlex.split(options)) +
                 ["--search", "none"]):
        args = build_parser().parse_args(["compile", path, "-o", "out", *argv])
        assert ignored(args, False, "sm_90") is None, argv
    searched = report.searched(shlex.split(options), 30.0)
    assert ("--time-limit" in searched) == ("none" not in options)
    assert [o for o in report.as_written(shlex.split(options)) if o.startswith("--")] == \
        [o for o in shlex.split(options) if o.startswith(("--search", "--stages", "--tma", "--jobs"))]


def test_a_failed_prepare_keeps_what_the_directory_held_and_says_prismcs_message(tmp_path, monkeypatch, capsys):
    """The workload's directory was removed before the compile, so a compile that failed (a flag mistyped in
    --options) took a gpu.json brought back from the GPU with it, and only prismc's last line was shown."""
    out = tmp_path / "swiglu_decode"
    out.mkdir()
    (out / "gpu.json").write_text("{}")

    def failing(cmd, **kw):
        Path(cmd[cmd.index("-o") + 1]).mkdir(parents=True)  # (a scratch directory prismc would not leave)
        return subprocess.CompletedProcess(cmd, 2, "", "prismc: unrecognized arguments: --no-such-flag\n(see help)\n")
    monkeypatch.setattr(fused.subprocess, "run", failing)
    args = type("Args", (), {"dir": str(tmp_path), "only": "swiglu decode", "time_limit": 5.0, "hardware": "h100",
                             "options": "--no-such-flag", "choices": 0})
    assert fused.prepare(args) == 1
    assert (out / "gpu.json").read_text() == "{}" and sorted(p.name for p in tmp_path.iterdir()) == ["swiglu_decode"]
    assert "prismc: unrecognized arguments: --no-such-flag\n(see help)" in capsys.readouterr().err


def test_run_choices_times_ours_alone_in_each_choice_and_the_table_sets_them_beside_the_models(tmp_path, monkeypatch,
                                                                                              capsys):
    """`run --choices`: each prepared choice of a workload's parameters checked and timed, ours alone (no
    baselines), its gpu.json in its own directory; the table lists them under the model's own choice, marks the
    fastest that agreed and says by how much it beat the model's."""
    out = tmp_path / fused.slug("swiglu decode")
    for k in ("1", "2"):
        (out / "choices" / k).mkdir(parents=True)
        (out / "choices" / k / "case.json").write_text("{}")
    (out / "case.json").write_text("{}")
    seen = []

    def result(us, passed, params, grid):
        return {"workload": "swiglu decode", "dims": "n=8,d=4096", "device": "a GPU", "hardware": "h100", "sets": 3,
                "floor_us": 10.0, "model_us": 13.0 + len(params), "kernels": 1, "params": params,
                "per_kernel": [{"name": "fused", "grid": grid, "block": [128, 1, 1], "model_us": 13.0, "bound": "memory",
                                "us": us}],
                "rows": {"prism-dsl": {"passed": passed, "max_rel_err": 3e-4, "us": us, "alone_us": us + 1}}}

    def run_case(there, baselines=True):
        seen.append((there.relative_to(tmp_path).as_posix(), baselines))
        return {"1": result(15.0, True, {"gx": 128}, [128, 1, 1]),
                "2": result(11.0, False, {"gx": 64}, [64, 1, 1])}[there.name]
    monkeypatch.setattr(fused, "run_case", run_case)
    monkeypatch.setattr(cuda_runtime, "gpu_status", lambda: (True, "a GPU"))
    (out / "gpu.json").write_text(json.dumps(result(20.0, True, {"gx": 256}, [256, 1, 1])))
    args = type("Args", (), {"dir": str(tmp_path), "only": None, "again": False, "results": str(tmp_path / "r.md"),
                             "choices": True})
    assert fused.run(args) == 0
    assert seen == [("swiglu_decode/choices/1", False), ("swiglu_decode/choices/2", False)]
    assert (out / "choices" / "1" / "gpu.json").is_file()
    text = (tmp_path / "r.md").read_text()
    assert "The model's own choice was the fastest in 0 of 1; elsewhere the fastest was 1.33x to 1.33x faster" in text
    assert "| swiglu decode | gx=256 (the model's) | 256x1x1 x 128 | 14.0 | 20.0 | 21.0 | 1.00 |  |" in text
    assert "|  | gx=128 | 128x1x1 x 128 | 14.0 | 15.0 | 21.0 | 0.75 | fastest |".replace("21.0", "16.0") in text
    assert "|  | gx=64 | 64x1x1 x 128 | 14.0 | 11.0 (wrong) | 12.0 | 0.55 |  |" in text  # fastest, but wrong
    assert fused.run(args) == 0 and len(seen) == 2  # measured already
    capsys.readouterr()


def test_the_table_names_the_prepared_workloads_not_measured(tmp_path):
    """A workload prepared (its directory) but with no gpu.json (the GPU session's time ran out, or it failed) is
    named under the table, not left out silently; one never prepared is not named."""
    rows = {"prism-dsl": {"passed": True, "max_rel_err": 3e-4, "us": 12.0, "alone_us": 15.0},
            "torch.compile": {"passed": True, "max_rel_err": 1e-3, "us": 24.0}}
    for name in ("swiglu decode", "attention prefill"):
        (tmp_path / fused.slug(name)).mkdir()
    (tmp_path / fused.slug("swiglu decode") / "gpu.json").write_text(json.dumps(
        {"workload": "swiglu decode", "dims": "d", "device": "a GPU", "hardware": "h100", "sets": 3, "floor_us": 10.0,
         "model_us": 13.0, "kernels": 1, "rows": rows}))
    assert fused.write_table(tmp_path, tmp_path / "r.md") == 0
    text = (tmp_path / "r.md").read_text()
    assert "Prepared but not measured (no gpu.json in the directory): attention prefill.\n" in text
    assert "rmsnorm_linear decode" not in text


calibrate = script("calibrate")


def test_calibrate_prices_the_measured_kernels_again_and_with_other_constants(prepared, capsys, monkeypatch):
    """benchmarks/calibrate.py: each kernel the GPU timed (gpu.json) beside the model's estimate as the model is now,
    built again from the workload's program, dims and parameters; with --set, the constant changed for the run
    (a tenth of the warps' intake makes the memory-bound decode kernel slower by the model); a name that is no
    constant of the model is refused by argparse."""
    report = json.loads((prepared / "report.json").read_text())
    (kernel,) = report["kernels"]
    (prepared / "gpu.json").write_text(json.dumps({"hardware": "h100", "per_kernel": [
        {"name": kernel["name"], "us": 20.0}]}))
    try:
        def run(*args):
            monkeypatch.setattr(sys, "argv", ["calibrate.py", "--dir", str(prepared.parent), "--structure", *args])
            assert calibrate.main() == 0
            row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| rmsnorm_mlp_small |")]
            (cells,) = [[c.strip() for c in line.strip("|").split("|")] for line in row]
            return float(cells[2].split()[0]), cells
        model, cells = run()
        assert cells[:2] == ["rmsnorm_mlp_small", kernel["name"]] and cells[3:5] == ["structure", "20.0"]
        assert float(cells[5]) == pytest.approx(20.0 / model, rel=0.03)  # the model us printed to 0.1
        if shutil.which("nvcc"):  # without --structure: compiled, and priced from its code as `prepare` priced it
            (row,) = calibrate.priced(prepared, False)
            assert row[1].priced != "structure" and row[1].priced == report["kernels"][0]["estimate"]["priced"]
        monkeypatch.setattr(calibrate.intake, "WARP_FILL_BYTES_PER_CLOCK", calibrate.intake.WARP_FILL_BYTES_PER_CLOCK)
        slower, _ = run("--set", f"intake.WARP_FILL_BYTES_PER_CLOCK={calibrate.intake.WARP_FILL_BYTES_PER_CLOCK / 10}")
        assert slower > model
        monkeypatch.setattr(sys, "argv", ["calibrate.py", "--set", "intake.bandwidth=2"])
        with pytest.raises(SystemExit) as stop:
            calibrate.main()
        assert stop.value.code == 2 and "no numeric constant of intake or cost" in capsys.readouterr().err
    finally:
        (prepared / "gpu.json").unlink()


def test_calibrate_takes_each_workloads_choices_of_parameters_too(tmp_path):
    for path in ("swiglu_decode/gpu.json", "swiglu_decode/choices/1/gpu.json", "gqa_decode/gpu.json",
                 "gqa_decode/choices/2/gpu.json", "gqa_decode/choices/3/case.json"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("{}")
    found = calibrate.measured_workloads(tmp_path, None)
    assert [calibrate.label(w) for w in found] == ["gqa_decode", "gqa_decode, choice 2", "swiglu_decode",
                                                   "swiglu_decode, choice 1"]
    assert [calibrate.label(w) for w in calibrate.measured_workloads(tmp_path, "choice 1")] == ["swiglu_decode, choice 1"]


def test_calibrate_reads_the_last_gpu_runs_kept_measurements(capsys, monkeypatch):
    """The measurements kept in the repository (benchmarks/measured/) still build and price with the code as it is."""
    monkeypatch.setattr(sys, "argv", ["calibrate.py", "--only", "rmsnorm_linear_decode", "--structure"])
    assert calibrate.main() == 0
    assert "| rmsnorm_linear_decode | fused | " in capsys.readouterr().out


def test_table_takes_only_the_workloads_named(tmp_path):
    rows = {"prism-dsl": {"passed": True, "max_rel_err": 3e-4, "us": 12.0, "alone_us": 15.0},
            "torch.compile": {"passed": True, "max_rel_err": 1e-3, "us": 24.0}}
    for name in ("swiglu decode", "rmsnorm_linear decode"):
        (tmp_path / fused.slug(name)).mkdir()
        (tmp_path / fused.slug(name) / "gpu.json").write_text(json.dumps(
            {"workload": name, "dims": "d", "device": "a GPU", "hardware": "h100", "sets": 3, "floor_us": 10.0,
             "model_us": 13.0, "kernels": 1, "rows": rows}))
    assert fused.write_table(tmp_path, tmp_path / "r.md", "swiglu") == 0
    text = (tmp_path / "r.md").read_text()
    assert "| swiglu decode (d) |" in text and "rmsnorm_linear" not in text
    assert fused.write_table(tmp_path, tmp_path / "r.md", "swiglu, rmsnorm_linear") == 0  # several, by commas
    text = (tmp_path / "r.md").read_text()
    assert "| swiglu decode (d) |" in text and "| rmsnorm_linear decode (d) |" in text
    assert [w for w, _, _ in fused.WORKLOADS if fused.wanted("attention decode,gqa", w)] == [
        "attention decode kv=4096", "attention decode kv=32768", "qk_norm_attention decode kv=4096",
        "qk_norm_attention decode kv=32768", "gqa_decode", "gqa_decode kv=4099"]
    assert not fused.wanted(",", "gqa_decode") and fused.wanted(None, "gqa_decode")


@pytest.mark.parametrize("damage", ["{bad json", "{}"])
def test_a_damaged_gpu_json_is_said_and_no_table_written(tmp_path, capsys, damage):
    """A gpu.json cut short, or not `run`'s, stops the table with a message naming what to do, not a traceback."""
    shutil.copytree(BENCHMARKS / "measured" / "h200-2026-11-30", tmp_path / "m")
    (tmp_path / "m" / "gpt2_mlp_decode" / "gpu.json").write_text(damage)
    assert fused.write_table(tmp_path / "m", tmp_path / "r.md") == 1 and not (tmp_path / "r.md").exists()
    err = capsys.readouterr().err
    assert "is not what `run` writes" in err and "nothing was written" in err
    assert "gpt2_mlp_decode/gpu.json" in err if damage.startswith("{b") else "KeyError: 'device'" in err
    assert [w for w, _, _ in fused.WORKLOADS if fused.wanted("=attention decode kv=4096", w)] == ["attention decode kv=4096"]


def test_the_results_table_says_where_the_device_is_not_the_one_tuned_for():
    rows = {"prism-dsl": {"passed": True, "max_rel_err": 3e-4, "us": 12.0, "alone_us": 15.0},
            "torch eager": {"passed": True, "max_rel_err": 1e-3, "us": 40.0},
            "torch.compile": {"passed": True, "max_rel_err": 1e-3, "us": 24.0}}
    result = {"dims": "d", "sets": 3, "floor_us": 10.0, "model_us": 13.0, "kernels": 1, "rows": rows}
    h100, h200 = {"hardware": "h100"}, {"hardware": "h200"}
    text = fused.table([result | h100 | {"workload": "a", "device": "NVIDIA H100 80GB HBM3"},
                        result | h100 | {"workload": "b", "device": "NVIDIA H200"},
                        result | h200 | {"workload": "c", "device": "NVIDIA H200"}])
    assert "# GPU results (NVIDIA H100 80GB HBM3, NVIDIA H200)" in text
    assert "both for the hardware files H100, H200, which" in text
    assert text.endswith("(`prepare --hardware NAME` tunes for it):\n"
                         "- b: tuned and modelled for H100, measured on NVIDIA H200\n")


@pytest.mark.parametrize("program, dims", [
    ("attention", {"b": 1, "h": 2, "q": 3, "kv": 40, "dh": 16}),
    ("qk_norm_attention", {"b": 2, "h": 1, "q": 1, "kv": 24, "dh": 32}),
    ("gqa_decode", {"b": 1, "hk": 2, "g": 4, "kv": 48, "dh": 16}),
    ("causal_attention", {"b": 1, "h": 2, "q": 20, "kv": 20, "dh": 16}),
    ("llama_qkv", {"n": 3, "d": 32, "e": 48}),  # rms_norm with its epsilon, a constant argument
    ("gpt2_mlp", {"n": 3, "d": 32, "f": 64}),  # layer_norm with its epsilon
])
def test_the_pytorch_baselines_compute_the_program_as_written(program, dims):
    """Op by op (`prismc bench`'s translation, rope and the causal mask included) and through
    scaled_dot_product_attention with the keys laid out as it takes them, on the CPU in float64."""
    torch = pytest.importorskip("torch")
    from prism_dsl.cli.bench import torch_function
    from prism_dsl.lang.check import load
    from prism_dsl.semantics.blocks import evaluate
    from prism_dsl.semantics.reference import bind_dims, random_inputs

    source = load(BENCHMARKS.parent / "programs" / f"{program}.prism").program()
    inputs = random_inputs(source, bind_dims(source, dims), seed=3)
    want = next(iter(evaluate(source, inputs, {}, "h100").values()))
    tensors = {k: torch.tensor(v, dtype=torch.float64) for k, v in inputs.items()}
    results = [torch_function(source)(**tensors)[0]]
    if (attention := fused.sdpa(torch, program, dims)) is not None:
        attend, arrange = attention
        results.append(attend(*arrange(*(tensors[n.attr] for n in source.inputs))))
    for got in results:
        assert np.allclose(got.numpy(), want, rtol=1e-9, atol=1e-9)
    assert fused.sdpa(torch, "causal_attention", {**dims, "q": 1, "kv": 20}) is None  # corners apart
    assert fused.sdpa(torch, "rmsnorm_linear", {}) is None


@pytest.mark.parametrize("device, name", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                          ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA H200 NVL", "h200"),
                                          ("NVIDIA GeForce RTX 4090", None), ("NVIDIA H1000", None)])
def test_a_device_name_names_its_hardware_file(device, name):
    from prism_dsl.kernels.hardware import for_device
    assert for_device(device) == name


def test_the_sweep_draws_sizes_every_program_accepts(tmp_path):
    """Every program of `programs/` has sizes in both tables; each draw binds (causal attention never has more
    queries than keys), and the bf16 copies store every f16 tensor as bf16."""
    import random

    from prism_dsl.cli.main import build_parser
    from prism_dsl.cli.values import ignored, parse_dims
    from prism_dsl.lang.check import load
    from prism_dsl.semantics.reference import bind_dims

    sweep = script("sweep")
    names = {p.stem for p in (BENCHMARKS.parent / "programs").glob("*.prism")}
    assert set(sweep.SMALL) == set(sweep.LARGE) == names
    source = sweep.in_bf16(tmp_path / "programs")
    assert "f16[" not in (source / "fused" / "attention.prism").read_text().replace("bf16[", "")
    for table in (sweep.SMALL, sweep.LARGE):
        for seed in range(4):
            for path, dims, extra in sweep.runs(random.Random(seed), table, source, True, ""):
                program = load(path).program()
                bind_dims(program, parse_dims(dims))  # refuses what the program cannot take
                assert ("--search" in extra) == (path.parent.name == "fused")
                args = build_parser().parse_args(["compile", str(path), "-o", "out", "--dims", dims, *extra])
                assert ignored(args, any(n.op == "kernel" for n in program.nodes()), "sm_90") is None, extra


def test_a_sweep_under_only_makes_the_runs_of_the_whole_sweep():
    """Only the programs named drew sizes, so `--only NAME --seed S`, the way to rerun a row that failed, drew
    other sizes and other sanitizers than the whole sweep with seed S had."""
    import random

    sweep = script("sweep")
    source = BENCHMARKS.parent / "programs"
    for only in ("rmsnorm_linear", "attention", "gqa"):
        whole = [r for r in sweep.runs(random.Random(3), sweep.SMALL, source, True, "") if only in r[0].stem]
        assert list(sweep.runs(random.Random(3), sweep.SMALL, source, True, only)) == whole != []


def test_the_prover_benchmark_exits_1_on_a_wrong_answer(monkeypatch, capsys):
    """It marked the pair "<-- WRONG" and exited 0: a regression of the prover passed any script that ran it."""
    pairs = script("prove_pairs")
    monkeypatch.setattr(pairs, "PAIRS", [("sub_order", True, "A - B", "B - A")])
    monkeypatch.setattr(pairs, "check_library", lambda library: None)  # (the suite checks the library elsewhere)
    monkeypatch.setattr(sys, "argv", ["prove_pairs.py", "--repeat", "1"])
    assert pairs.main() == 1 and "<-- WRONG" in capsys.readouterr().out
    monkeypatch.setattr(pairs, "PAIRS", [("sub_order", False, "A - B", "B - A")])
    assert pairs.main() == 0


def test_the_results_table_lists_the_workloads_whose_tolerance_was_widened():
    rows = {"prism-dsl": {"passed": True, "max_rel_err": 1.6e-2, "rtol": 3.3e-2, "rounding": 1.64e-2, "us": 380.0,
                          "alone_us": 382.0},
            "torch eager": {"passed": False, "max_rel_err": 5e-2, "rtol": 3.3e-2, "rounding": 1.64e-2, "us": 1280.0},
            "torch.compile": {"passed": True, "max_rel_err": 1.7e-2, "rtol": 3.3e-2, "rounding": 1.64e-2, "us": 930.0}}
    plain = {"prism-dsl": {"passed": True, "max_rel_err": 3e-4, "rtol": 1e-2, "us": 12.0, "alone_us": 15.0},
             "torch.compile": {"passed": True, "max_rel_err": 1e-3, "rtol": 1e-2, "us": 24.0}}
    common = {"device": "a GPU", "hardware": "h200", "sets": 3, "floor_us": 10.0, "model_us": 13.0, "kernels": 1}
    text = fused.table([{"workload": "qk_norm_attention prefill", "dims": "q=4096", "rows": rows, **common},
                        {"workload": "attention decode", "dims": "b=2", "rows": plain, **common}])
    assert "| 1.6e-02 | FAILED: torch eager |" in text
    assert ("Tolerances widened:\n- qk_norm_attention prefill: rounding its products' operands to f16, and nothing "
            "else, moves the output by 1.6e-02; every implementation judged at 3.3e-02") in text
    assert "- attention decode: rounding" not in text


def test_roundings_says_what_a_programs_own_roundings_alone_cost_as_written():
    roundings = script("roundings")
    done = subprocess.run([sys.executable, str(BENCHMARKS / "roundings.py"), "--program",
                           str(BENCHMARKS.parent / "programs/qk_norm_attention.prism"), "--dims", "q=8,kv=64"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    e = float(re.search(r"qk_norm_attention O: its kernels' roundings alone (\S+);", done.stdout).group(1))
    # as written, the unscaled scores of unit-RMS queries go to device memory in f16 between two kernels
    assert 1e-2 < e < 5e-2 and f"judged at {max(1e-2, 2 * e):.2e} (base 0.01)" in done.stdout
    assert roundings.SHAPES  # the table's shapes are still there
    missing = subprocess.run([sys.executable, str(BENCHMARKS / "roundings.py"), "--program", "no/such.prism"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no such file" in missing.stderr and "Traceback" not in missing.stderr
