"""The GPU benchmark scripts' parts that run without a GPU: the probes' kernels compile to what they claim to
measure, and the arithmetic that turns measurements into the model's constants recovers those constants
from figures the model itself would give."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prism_dsl.backend import cost, sass
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


@pytest.mark.parametrize("name", ["h100", "a100"])
def test_the_probe_summary_gives_back_the_models_own_constants(name):
    hardware = load_hardware(name)
    points = [probe.Point(b, s, t, 0.0) for b, s, t in probe.configurations(hardware.sms)]
    points = [probe.Point(p.blocks, p.stages, p.tile, probe.model_gbs(p, hardware)) for p in points]
    summary = probe.summarize(points, hardware)
    assert summary["peak_gbs"] == pytest.approx(hardware.bandwidth_gbs * cost.BANDWIDTH_REACH, rel=1e-3)
    assert summary["fill_bytes_per_clock"] == pytest.approx(cost.SM_FILL_BYTES_PER_CLOCK, rel=1e-3)
    assert summary["latency_ns"] == pytest.approx(hardware.dram_latency_ns, rel=1e-3)
    assert summary["half_over_full"] == pytest.approx(probe.model_half_over_full(hardware), rel=1e-3)
    # the configurations span every regime: some bound by the bytes in flight, some by the peak, some by few SMs
    regimes = {min(("peak", hardware.bandwidth_gbs * cost.BANDWIDTH_REACH),
                   ("latency", probe.per_sm_flight(p, hardware)[0] * probe.per_sm_flight(p, hardware)[1]
                    / hardware.dram_latency_ns),
                   ("fill", min(p.blocks, hardware.sms) * cost.SM_FILL_BYTES_PER_CLOCK * cost.CLOCK_GHZ),
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
    summary = probe.summarize(slow, hardware)
    assert summary["peak_gbs"] == 2000.0
    assert summary["fill_bytes_per_clock"] == pytest.approx(56.0 / cost.CLOCK_GHZ, rel=1e-3)
    assert summary["latency_ns"] == pytest.approx(1200.0, rel=1e-3)
    table = probe.report(slow, {"alone_us": 4.0, "back_to_back_us": 2.0}, {"l2_ns": 250.0, "dram_ns": 700.0},
                         hardware, "a test device")
    assert "| 1200.0 | 600 (dram_latency_ns) |" in table and "a test device" in table


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
        done = subprocess.run([nvcc_path(), "-cubin", f"-arch={arch}", "-O3", "-std=c++17", "-o", str(cubin),
                               str(BENCHMARKS / "probe.cu")], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    if not sass.available():
        pytest.skip("cuobjdump is missing (pip install -e '.[sass]'): the SASS is not read")
    listing = sass.disassemble(tmp_path / "probe_sm_90a.cubin")
    for stages in probe.STAGES:
        body = listing.split(f"Function : probe_stream_{stages}")[1].split("Function :")[0]
        assert "LDGSTS" in body and "LDGDEPBAR" in body, stages  # cp.async and its commit, no register round trip
    chase = listing.split("Function : probe_chase")[1].split("Function :")[0]
    assert "LDG" in chase  # the chain of loads is there, not folded away
