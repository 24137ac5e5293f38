"""The CUDA runtime: plan validation, input marshalling, bf16 bits, timing, the generated launcher.

Everything but the `gpu`-marked tests runs without a GPU; those compile and launch small hand-written kernels.
"""

from __future__ import annotations

import ast
import ctypes
import importlib.util
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from prism_dsl.backend import cuda_runtime as rt
from prism_dsl.backend import sass
from prism_dsl.backend.compare import check
from prism_dsl.backend.cuda_runtime import GpuUnavailable, Launcher, PlanError, marshal, validate_plan
from prism_dsl.backend.nvcc import nvcc_path
from prism_dsl.pipeline.output import format_plan, launcher_source



def make_plan(**changes) -> dict:
    """Y = X + W on 8 x 64 floats, one kernel; `changes` replace top-level keys."""
    plan = {
        "program": "add",
        "inputs": ["X", "W"],
        "outputs": ["Y"],
        "tensors": {
            "X": {"shape": [8, 64], "dtype": "f16"},
            "W": {"shape": [8, 64], "dtype": "f16"},
            "Y": {"shape": [8, 64], "dtype": "f32"},
        },
        "kernels": [{"name": "add", "file": "add.cu", "function": "add", "grid": [2, 1, 1], "block": [256, 1, 1],
                     "smem": 0, "args": ["X", "W", "Y"], "zero": []}],
    }
    plan.update(changes)
    return plan


def with_kernel(**changes) -> dict:
    plan = make_plan()
    plan["kernels"][0].update(changes)
    return plan


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setenv("PRISM_NO_GPU", "1")
    rt.gpu_status.cache_clear()
    yield
    rt.gpu_status.cache_clear()


# --------------------------------------------------------------------------------------------------- plans

def test_good_plan_is_accepted():
    validate_plan(make_plan())


def _drop(key):
    plan = make_plan()
    del plan[key]
    return plan


def _tensor(name, **spec):
    plan = make_plan()
    plan["tensors"][name] = spec
    return plan


BAD_PLANS = [
    (_drop("kernels"), "plan needs 'kernels' (list)"),
    (_drop("tensors"), "plan needs 'tensors' (dict)"),
    (make_plan(inputs=["X", "Z"]), "input 'Z' is not in 'tensors'"),
    (make_plan(outputs=["Q"]), "output 'Q' is not in 'tensors'"),
    (make_plan(inputs=["X", "X", "W"]), "input 'X' is listed twice"),
    (make_plan(outputs=["Y", "X"]), "'X' is both an input and an output"),
    (_tensor("Y", shape=[8, 0], dtype="f32"), "tensor 'Y': shape must be a list of positive ints, not [8, 0]"),
    (_tensor("Y", shape=[8, 64], dtype="f8"), "tensor 'Y': dtype must be one of f16, bf16, f32, f64, not 'f8'"),
    (with_kernel(args=["X", "Q", "Y"]), "kernel 0 ('add'): args names unknown tensor 'Q'"),
    (with_kernel(zero=["Q"]), "kernel 0 ('add'): zero names unknown tensor 'Q'"),
    (with_kernel(zero=["X"]), "kernel 0 ('add'): zeroes input 'X', which the program must not write"),
    (with_kernel(grid=[2, 1]), "kernel 0 ('add'): 'grid' must be 3 positive ints, not [2, 1]"),
    (with_kernel(grid=[0, 1, 1]), "'grid' must be 3 positive ints, not [0, 1, 1]"),
    (with_kernel(block=[256, 1.0, 1]), "'block' must be 3 positive ints"),
    (with_kernel(block=[64, 32, 1]), "a block of [64, 32, 1] has 2048 threads; CUDA allows at most 1024"),
    (with_kernel(smem=-1), "'smem' must be a non-negative int (bytes), not -1"),
    (with_kernel(tickets=0), "'tickets' must be a positive int (tiles whose pieces it combines), not 0"),
    (with_kernel(sums=8), "'sums' must be a positive int (f32 elements its blocks add into), with 'tickets', not 8"),
    (with_kernel(tickets=2, sums=0), "'sums' must be a positive int (f32 elements its blocks add into), with 'tickets'"),
    (with_kernel(function=None), "kernel 0 ('add'): 'function' must be a string"),
    (make_plan(kernels=[with_kernel()["kernels"][0]] * 2), "kernel name 'add' is used twice"),
    (make_plan(kernels=["add"]), "kernel 0 is a str, not a dict"),
    (with_kernel(maps={"tensor": "X"}), "kernel 0 ('add'): 'maps' must be a list of tensor maps"),
    (with_kernel(maps=[{"tensor": "X"}]), "a tensor map is {'tensor': NAME, 'box': [...]}, not {'tensor': 'X'}"),
    (with_kernel(maps=[{"tensor": "Q", "box": [8, 64]}]), "a tensor map's tensor 'Q' is not one of its args"),
    (with_kernel(maps=[{"tensor": "X", "box": [64]}]), "needs a box of one size per dim of the tensor (1 to 5), not [64]"),
    (with_kernel(maps=[{"tensor": "X", "box": [0, 64]}]), "each box size is 1 to 256 and at most the tensor's, not [0, 64]"),
    (with_kernel(maps=[{"tensor": "X", "box": [8, 32]}]), "its box's rows are 128 bytes (the swizzle's)"),
    (make_plan(tensors={"X": {"shape": [8, 64], "dtype": "f16", "used": [9, 64]}, "W": {"shape": [8, 64], "dtype": "f16"},
                        "Y": {"shape": [8, 64], "dtype": "f32"}}),
     "tensor 'X': used (its first rows, as the caller passes it) must be a list of positive ints, one a dim, none past "
     "its shape [8, 64], not [9, 64]"),
]


@pytest.mark.parametrize("plan, message", BAD_PLANS, ids=[m for _, m in BAD_PLANS])
def test_bad_plans_are_refused_with_a_message(plan, message):
    with pytest.raises(PlanError) as err:
        validate_plan(plan)
    assert message in str(err.value)


def test_every_problem_of_a_plan_is_reported_at_once():
    plan = with_kernel(grid=[0, 1, 1], smem=-5, args=["Q"])
    with pytest.raises(PlanError) as err:
        Launcher(plan, ".")
    text = str(err.value)
    assert text.startswith("plan for 'add' is malformed")
    assert "'grid'" in text and "'smem'" in text and "unknown tensor 'Q'" in text


class FakeEncoder:
    """cuTensorMapEncodeTiled's stand-in: records what it is asked (the map's address aligned, and the arrays as
    the driver reads them: `rank` entries, strides one fewer) and writes a map it can recognise."""

    def __init__(self, status: int = 0):
        self.calls, self.status = [], status

    def cuTensorMapEncodeTiled(self, at, dtype, rank, pointer, dims, strides, box, elements, *modes):
        n = rank.value
        self.calls.append({"aligned": at.value % 64 == 0, "dtype": dtype, "pointer": pointer.value, "dims": list(dims)[:n],
                           "strides": list(strides)[:n - 1], "box": list(box)[:n], "elements": list(elements)[:n],
                           "modes": modes})
        ctypes.memmove(at.value, bytes([len(self.calls)]) * 128, 128)
        return self.status


def test_a_tensor_map_is_encoded_for_the_driver_innermost_dim_first(monkeypatch):
    """What the runtime asks the CUDA driver for a TMA copy's map: the tensor's dims innermost first, the byte
    strides of the others, the box likewise, every element taken, no interleave, the 128-byte swizzle wgmma reads,
    128-byte L2 promotion, no fill; the map's 128 bytes as written, its address 64-byte aligned."""
    from prism_dsl.backend import cuda_plan

    fake = FakeEncoder()
    monkeypatch.setattr(cuda_plan, "_driver", lambda: fake)
    assert cuda_plan.encode_map(0x7000, "f16", [2, 16, 4096, 128], [1, 1, 64, 64]) == bytes([1]) * 128
    assert cuda_plan.encode_map(0x9000, "bf16", [4096, 64], [128, 64]) == bytes([2]) * 128
    assert fake.calls == [
        {"aligned": True, "dtype": 6, "pointer": 0x7000, "dims": [128, 4096, 16, 2], "strides": [256, 256 * 4096, 256 * 4096 * 16],
         "box": [64, 64, 1, 1], "elements": [1, 1, 1, 1], "modes": (0, 3, 2, 0)},
        {"aligned": True, "dtype": 9, "pointer": 0x9000, "dims": [64, 4096], "strides": [128], "box": [64, 128],
         "elements": [1, 1], "modes": (0, 3, 2, 0)}]
    fake.status = 1  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(RuntimeError, match=r"refuses the tensor map of a f16 tensor \[8, 64\] at 0x100 with box \[8, 64\] "
                                           r"\(cuTensorMapEncodeTiled: CUresult 1\)"):
        cuda_plan.encode_map(0x100, "f16", [8, 64], [8, 64])


def cubin_with_parameters(function: str, layout: list[tuple[int, int]]) -> bytes:
    """A 64-bit ELF image as nvcc's cubins hold a kernel's parameters: a `.nv.info.FUNCTION` section of attributes,
    one EIATTR_KPARAM_INFO (format 4: a sized value) per parameter, last one first as nvcc writes them, after an
    attribute of another format (a 16-bit value) that the reader steps over."""
    info = struct.pack("<BBH", 0x03, 0x1B, 0x00FF) + b"".join(
        struct.pack("<BBHIHHI", 0x04, 0x17, 12, 0, i, offset, size << 18 | 0x1F000)
        for i, (offset, size) in reversed(list(enumerate(layout))))
    names = b"\0.shstrtab\0.nv.info." + function.encode() + b"\0"
    at_names, at_info = 64, 64 + len(names) + (-len(names) % 4)
    at_sections = at_info + len(info) + (-(at_info + len(info)) % 8)

    def section(name: int, kind: int, offset: int, size: int) -> bytes:
        return struct.pack("<IIQQQQIIQQ", name, kind, 0, 0, offset, size, 0, 0, 1, 0)
    header = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9) + struct.pack(
        "<HHIQQQIHHHHHH", 2, 190, 1, 0, 0, at_sections, 0, 64, 0, 0, 64, 3, 1)
    image = header + names + bytes(at_info - at_names - len(names)) + info + bytes(at_sections - at_info - len(info))
    return image + section(0, 0, 0, 0) + section(1, 3, at_names, len(names)) + section(11, 0x70000000, at_info, len(info))


def test_a_kernels_parameters_are_read_from_its_cubin():
    """Where the compiled code reads each parameter (`cuda_plan.parameter_layout`), and the struct format that puts
    them there (`argument_format`): a tensor map 0x70 bytes in, as nvcc places the first one on sm_90."""
    from prism_dsl.backend import cuda_plan

    layout = [(0x70, 128), (0xF0, 128), (0x170, 8), (0x178, 8)]
    cubin = cubin_with_parameters("prism_k", layout)
    assert cuda_plan.parameter_layout(cubin, "prism_k") == layout
    assert cuda_plan.parameter_layout(cubin, "prism") is None  # another kernel's section, not a prefix of one
    assert cuda_plan.parameter_layout(b"a cubin", "prism_k") is None and cuda_plan.parameter_layout(cubin[:90], "prism_k") is None
    form = cuda_plan.argument_format(layout, [128, 128, 8, 8])
    assert form == "112x128s128sPP" and struct.calcsize(form) == 0x180
    packed = struct.pack(form, b"A" * 128, b"B" * 128, 0x1234, 0x5678)
    assert packed[0x70:0xF0] == b"A" * 128 and struct.unpack_from("<Q", packed, 0x178) == (0x5678,)
    assert cuda_plan.argument_format(layout, [128, 8, 8, 8]) is None and cuda_plan.argument_format(None, [8]) is None
    assert cuda_plan.argument_format([(0, 8), (8, 8)], [8, 8]) == "PP"
    assert cuda_plan.parameter_layout(cubin_with_parameters("k", [(0, 8), (0x10, 8)])[:-64], "k") is None  # no section


def test_nvcc_places_a_tensor_map_where_the_runtime_packs_it(tmp_path):
    """The parameters of a generated kernel that TMA copies for, as nvcc compiles it for sm_90a: the maps at offsets
    that packing them one after another would miss (0x70, not 0), which the runtime reads from the cubin."""
    from prism_dsl.backend import cuda_plan
    from prism_dsl.cli.main import main

    nvcc = nvcc_path()
    if nvcc is None:
        pytest.skip("nvcc is missing: no cubin to read")
    out = tmp_path / "out"
    assert main(["compile", str(Path(__file__).resolve().parents[1] / "programs" / "fused" / "rmsnorm_linear.prism"),
                 "--search", "none", "--dims", "n=256,d=1024", "--grid", "x=16", "--tma", "--arch", "none", "--no-emulate",
                 "-o", str(out)]) == 0  # 64 columns a block: wide enough for wgmma, whose tiles TMA copies
    (kernel,) = import_file(out / "launcher.py", "tma_launcher").PLAN["kernels"]
    assert kernel["maps"], "the kernel copies its loop tiles by TMA"
    cubin = tmp_path / "k.cubin"
    done = subprocess.run([nvcc, "-cubin", "-gencode=arch=compute_90a,code=sm_90a", *rt.NVCC_OPTIONS, "-I", str(out),
                           "-o", str(cubin), str(out / kernel["file"])], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    layout = cuda_plan.parameter_layout(cubin.read_bytes(), kernel["function"])
    maps, pointers = len(kernel["maps"]), len(kernel["args"])
    assert [size for _, size in layout] == [128] * maps + [8] * pointers
    assert layout[0][0] == 0x70 and all(b[0] >= a[0] + a[1] for a, b in zip(layout, layout[1:]))
    form = cuda_plan.argument_format(layout, [128] * maps + [8] * pointers)
    assert struct.calcsize(form) == layout[-1][0] + 8


def test_a_kernel_with_tensor_maps_takes_them_first_encoded_for_its_tensors(fake_gpu, tmp_path, monkeypatch):
    """A kernel whose loop tiles TMA copies takes a 128-byte map per tile before its pointers (`__grid_constant__`
    parameters), each packed at the offset its cubin gives, encoded for the tensor's buffer once and again only
    where a call passes another buffer."""
    fake = FakeEncoder()
    monkeypatch.setattr(rt._plan, "_driver", lambda: fake)  # the runtime's own copy of the plan module
    seen = []
    fake_gpu.kernels["add"] = lambda drv, threads, *args: seen.append(args[0])
    fake_gpu.cubin = cubin_with_parameters("add", [(0x70, 128), (0xF0, 8), (0xF8, 8), (0x100, 8), (0x108, 8)])
    plan = gpu_plan(tmp_path)
    plan["kernels"][0]["maps"] = [{"param": "tm_x", "tensor": "X", "box": [8, 64]}]
    launcher = Launcher(plan, tmp_path)
    launcher(**gpu_inputs(0))
    launcher(**gpu_inputs(1))  # the same buffers
    function = fake_gpu.functions[0]
    assert function.fmt == "112x128sPPPP" and seen == [bytes([1]) * 128] * 2
    assert function.buffers[0][0x70:0xF0] == bytes([1]) * 128 and len(function.buffers[0]) == 0x110
    assert len(fake.calls) == 1 and fake.calls[0]["dims"] == [64, 8] and fake.calls[0]["box"] == [64, 8]
    assert launcher.time([gpu_inputs(0), gpu_inputs(1)], warmup=0, repeat=2)["repeat"] == 2  # two buffers of X: two maps
    assert len(fake.calls) == 3 and {c["pointer"] for c in fake.calls[1:]} != {fake.calls[0]["pointer"]}
    fake.status = 1
    plan["kernels"][0]["maps"][0]["box"] = [4, 64]
    with pytest.raises(PlanError, match="kernel 'add': the CUDA driver refuses the tensor map"):
        Launcher(plan, tmp_path)(**gpu_inputs(0))


def test_a_plan_whose_parameters_the_kernel_does_not_take_is_refused(fake_gpu, tmp_path):
    """Parameters the compiled kernel does not take as the plan passes them, or a kernel with tensor maps whose cubin
    does not say where its parameters are, are plan errors before any launch: a map packed at the wrong offset
    is a descriptor of garbage, which faults the GPU at the first copy."""
    plan = gpu_plan(tmp_path)
    fake_gpu.cubin = cubin_with_parameters("add", [(0, 8), (8, 8), (16, 8)])
    with pytest.raises(PlanError, match=r"kernel 'add': the compiled add.cu takes 3 parameters of 8, 8, 8 bytes; "
                                        r"the plan passes 0 tensor map\(s\) of 128 bytes, then 4 pointer\(s\)"):
        Launcher(plan, tmp_path).compile()
    plan["kernels"][0]["maps"] = [{"param": "tm_x", "tensor": "X", "box": [8, 64]}]
    fake_gpu.cubin = b"a cubin"
    with pytest.raises(PlanError, match="the compiled add.cu does not say where its parameters are"):
        Launcher(plan, tmp_path).compile()
    assert fake_gpu.log == []


def test_dims_rounded_up_for_tiles_are_padded_in_and_cut_out(fake_gpu, tmp_path):
    """A plan whose rows were rounded up for the kernels' tiles (`used`: the caller's shapes): the caller passes its
    rows, the kernels see them followed by zero rows, and the outputs come back cut to the caller's rows; inputs
    at the size built (padded by the caller) go in as they are; any other shape is refused, naming both."""
    seen = []

    def add(drv, threads, x, w, y, s):
        seen.append(drv.view(x, np.float16).reshape(8, 64).copy())
        fake_add(drv, threads, x, w, y, s)
    fake_gpu.kernels["add"] = add
    plan = gpu_plan(tmp_path)
    for name in ("X", "W", "Y"):
        plan["tensors"][name]["used"] = [5, 64]
    inputs = {n: a[:5] for n, a in gpu_inputs().items()}
    out = Launcher(plan, tmp_path)(**inputs)
    assert out["Y"].shape == (5, 64) and out["Y"].flags.c_contiguous and out["S"].shape == (1,)
    x, w = (inputs[n].astype(np.float64) for n in ("X", "W"))
    assert check(out["Y"], x + 2 * w)["passed"]
    assert np.array_equal(seen[0][:5], inputs["X"]) and not seen[0][5:].any()  # zeros past the caller's rows
    padded = {n: np.concatenate([a[:5], np.zeros_like(a[5:])]) for n, a in gpu_inputs().items()}
    out = Launcher(plan, tmp_path)(**padded)  # at the size built, zeros past the caller's rows: used as it is
    assert np.array_equal(seen[1], padded["X"]) and check(out["Y"], x + 2 * w)["passed"]
    with pytest.raises(PlanError, match=r"input 'X' has shape \(6, 64\); the program expects \(5, 64\) \(or "
                                        r"\(8, 64\), the size built, zeros past it\)"):
        Launcher(plan, tmp_path)(**{n: a[:6] for n, a in gpu_inputs().items()})
    assert rt.random_inputs(plan)["X"].shape == (5, 64)


def test_a_bf16_array_of_ml_dtypes_is_padded_too():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed")
    plan = make_plan(tensors={"X": {"shape": [4, 192], "dtype": "bf16", "used": [4, 130]},
                              "W": {"shape": [4, 192], "dtype": "bf16", "used": [4, 130]},
                              "Y": {"shape": [4, 192], "dtype": "f32", "used": [4, 130]}})
    x = np.arange(520, dtype=np.float32).reshape(4, 130)
    got = marshal(plan, {"X": x.astype(ml_dtypes.bfloat16), "W": x}, cast=True)
    assert got["X"].shape == got["W"].shape == (4, 192) and np.array_equal(got["X"], got["W"])
    assert not got["X"][:, 130:].any()


def test_plan_literal_round_trips():
    plan = make_plan()
    assert ast.literal_eval(format_plan(plan)) == plan


# ---------------------------------------------------------------------------------------------- marshalling

def f16(*shape):
    return np.ones(shape, np.float16)


@pytest.mark.parametrize("inputs, message", [
    ({"X": f16(8, 64)}, "missing input 'W'"),
    ({"X": f16(8, 64), "W": f16(8, 64), "Z": f16(1)}, "unknown input 'Z'; 'add' takes X, W"),
    ({"X": f16(8, 64), "w": f16(8, 64)}, "unknown input 'w' (did you mean 'W'?)"),
    ({"X": f16(8, 63), "W": f16(8, 64)}, "input 'X' has shape (8, 63); the program expects (8, 64)"),
    ({"X": f16(8, 64), "W": np.ones((8, 64), np.float32)},
     "input 'W' is float32; the program stores it as f16: pass float16, or any float array with cast=True (a "
     "launcher's get_launcher(cast=True))"),
    ({"X": f16(8, 64), "W": np.ones((8, 64), np.int32)},
     "input 'W' is int32; the program expects real floating-point data (f16)"),
    ({"X": f16(8, 64), "W": "abc"}, "input 'W' is a str, not an array of numbers"),
])
def test_bad_inputs_are_refused_with_a_message(inputs, message):
    with pytest.raises(PlanError) as err:
        marshal(make_plan(), inputs)
    assert message in str(err.value)


def test_missing_and_unknown_inputs_are_reported_together():
    with pytest.raises(PlanError) as err:
        marshal(make_plan(), {"X": f16(8, 64), "Z": f16(8, 64)})
    assert "missing input 'W'" in str(err.value) and "unknown input 'Z'" in str(err.value)


def test_inputs_in_storage_dtype_pass_unchanged():
    x = np.arange(8 * 64, dtype=np.float16).reshape(8, 64)
    out = marshal(make_plan(), {"X": x, "W": x})
    assert out["X"].dtype == np.float16 and np.array_equal(out["X"], x)


def test_cast_converts_other_float_dtypes_but_never_integers():
    w = np.full((8, 64), 1.5, np.float64)
    out = marshal(make_plan(), {"X": f16(8, 64), "W": w}, cast=True)
    assert out["W"].dtype == np.float16 and out["W"][0, 0] == 1.5
    with pytest.raises(PlanError, match="int64"):
        marshal(make_plan(), {"X": f16(8, 64), "W": w.astype(np.int64)}, cast=True)


def test_a_cast_that_would_make_an_infinity_is_refused_with_the_element():
    """cast=True rounds to the storage type; a finite value past its range would be an infinity, which the GPU then
    computes with, silently: refused as `prismc run` refuses it. Lists convert as with cast=True, so the same."""
    w = np.full((8, 64), 1.5)
    w[2, 5] = 1e6
    for given in (w, w.tolist()):
        with pytest.raises(PlanError, match=r"input 'W'\[2, 5\] = 1e\+06 does not fit f16 \(largest 65504\): stored, it "
                                            r"would be an infinity"):
            marshal(make_plan(), {"X": f16(8, 64), "W": given}, cast=True)
    w[2, 5] = np.inf  # an infinity given stays one: that is the caller's value, not a rounding
    assert np.isinf(marshal(make_plan(), {"X": f16(8, 64), "W": w}, cast=True)["W"][2, 5])
    bf16 = _tensor("W", shape=[8, 64], dtype="bf16")
    w[2, 5] = 1e39
    with pytest.raises(PlanError, match=r"input 'W'\[2, 5\] = 1e\+39 does not fit bf16"):
        marshal(bf16, {"X": f16(8, 64), "W": w}, cast=True)


def test_lists_are_converted_and_layouts_made_contiguous():
    plan = _tensor("W", shape=[2, 2], dtype="f32")
    x = np.ones((64, 8), np.float16).T  # a transposed view
    out = marshal(plan, {"X": x, "W": [[1, 2], [3, 4]]})
    assert out["X"].flags.c_contiguous and out["W"].dtype == np.float32 and out["W"][1, 0] == 3


def test_bf16_inputs_take_float32_and_become_bits():
    plan = _tensor("W", shape=[3], dtype="bf16")
    out = marshal(plan, {"X": f16(8, 64), "W": np.array([1.0, -2.5, 0.0], np.float32)})
    assert out["W"].dtype == np.uint16 and list(out["W"]) == [0x3F80, 0xC020, 0x0000]
    with pytest.raises(PlanError, match=r"stores it as bf16: pass float32 \(rounded to bf16 on the way in\)"):
        marshal(plan, {"X": f16(8, 64), "W": np.ones(3, np.float16)})


def test_cpu_torch_tensors_are_treated_like_numpy():
    torch = pytest.importorskip("torch")
    plan = _tensor("W", shape=[2], dtype="bf16")
    out = marshal(plan, {"X": torch.ones(8, 64, dtype=torch.float16), "W": torch.tensor([1.0, 3.0]).bfloat16()})
    assert out["X"].dtype == np.float16 and list(out["W"]) == [0x3F80, 0x4040]


# ------------------------------------------------------------------------------------------------------ bf16

def test_bf16_round_trip_is_exact_for_bf16_values():
    bits = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)
    values = rt.from_bf16_bits(bits)
    finite = np.isfinite(values)
    assert np.array_equal(rt.to_bf16_bits(values)[finite], bits[finite])
    assert np.isnan(rt.from_bf16_bits(rt.to_bf16_bits(values[~finite & np.isnan(values)]))).all()


@pytest.mark.parametrize("value, expected", [
    (1 + 2**-8, 1.0),                  # halfway between 1 and 1 + 2^-7: to the even one
    (1 + 3 * 2**-8, 1 + 2**-6),        # halfway between 1 + 2^-7 and 1 + 2^-6: to the even one
    (1 + 2**-8 + 2**-20, 1 + 2**-7),   # just above halfway: up
    (-(1 + 2**-8 + 2**-20), -(1 + 2**-7)),
    (3.4e38, np.inf),                  # beyond the largest bf16: overflows to inf
    (np.inf, np.inf),
])
def test_bf16_rounds_to_nearest_even(value, expected):
    assert rt.from_bf16_bits(rt.to_bf16_bits(np.float32(value)))[()] == np.float32(expected)


def test_bf16_keeps_every_nan_a_nan():
    # A NaN whose payload sits only in the low 16 bits would round into inf if rounded naively.
    nan = np.array([0x7F800001, 0xFF800001, 0x7FC00000], np.uint32).view(np.float32)
    assert np.isnan(rt.from_bf16_bits(rt.to_bf16_bits(nan))).all()


def test_bf16_error_is_at_most_half_a_unit():
    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
    y = rt.from_bf16_bits(rt.to_bf16_bits(x)).astype(np.float64)
    assert np.all(np.abs(y - x) <= np.abs(x) * 2.0**-8)


# ------------------------------------------------------------------------------------------------ no GPU here

def test_runtime_is_standalone():
    """Copied beside generated kernels, the module can import only the standard library and numpy."""
    tree = ast.parse(Path(rt.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    modules = {a.name.split(".")[0] for n in top if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module.split(".")[0] for n in top if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert all(n.level == 0 for n in top if isinstance(n, ast.ImportFrom))
    assert modules - sys.stdlib_module_names == {"numpy"}


def test_launcher_without_gpu_raises_with_the_reason(no_gpu, tmp_path):
    launcher = Launcher(make_plan(), tmp_path)  # building one needs no GPU
    assert rt.gpu_status() == (False, "disabled by PRISM_NO_GPU")
    with pytest.raises(GpuUnavailable, match="cannot run 'add' without a usable CUDA GPU: disabled by PRISM_NO_GPU"):
        launcher(X=f16(8, 64), W=f16(8, 64))
    with pytest.raises(GpuUnavailable, match="PRISM_NO_GPU"):
        launcher.time([{"X": f16(8, 64), "W": f16(8, 64)}])


def test_bad_inputs_are_reported_before_the_missing_gpu(no_gpu, tmp_path):
    with pytest.raises(PlanError, match="missing input 'W'"):
        Launcher(make_plan(), tmp_path)(X=f16(8, 64))


def render_launcher(directory: Path, plan: dict) -> Path:
    text = launcher_source(plan)
    shutil.copy(rt.__file__, directory / "prism_runtime.py")
    shutil.copy(Path(rt.__file__).with_name("cuda_plan.py"), directory / "cuda_plan.py")
    path = directory / "launcher.py"
    path.write_text(text)
    return path


def import_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rendered_launcher_imports_and_refuses_cleanly_without_gpu(no_gpu, tmp_path):
    path = render_launcher(tmp_path, make_plan())
    text = path.read_text()
    assert "launcher.run(X=..., W=...)" in text and "'add'" in text.splitlines()[0]
    assert "Inputs, as the caller passes them: X: f16[8, 64], W: f16[8, 64].\nOutputs: Y: f32[8, 64].\n" in text
    module = import_file(path, "generated_launcher")
    assert module.PLAN == make_plan()
    with pytest.raises(module.GpuUnavailable, match="disabled by PRISM_NO_GPU"):
        module.run(X=f16(8, 64), W=f16(8, 64))
    # other float dtypes, converted on the way in: the launcher the message names
    assert module.get_launcher(cast=True).cast and not module.get_launcher().cast
    assert module.get_launcher(cast=True) is module.get_launcher(cast=True)


def test_rendered_launcher_script_exits_1_with_the_reason(tmp_path):
    path = render_launcher(tmp_path, make_plan())
    result = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, cwd=tmp_path,
                            env={**os.environ, "PRISM_NO_GPU": "1"}, timeout=60)
    assert result.returncode == 1
    assert "launcher.py: cannot run 'add' without a usable CUDA GPU: disabled by PRISM_NO_GPU" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_inputs_named_as_pythons_words_are_passed_and_shown(no_gpu, tmp_path):
    """An input named `self` reaches the plan (it was the launcher's own argument), and one named `lambda` is shown
    in the docstring's call as a dict, the only way Python can pass it."""
    plan = make_plan()
    names = {"X": "self", "W": "lambda"}
    plan = {**plan, "inputs": [names[n] for n in plan["inputs"]],
            "tensors": {names.get(n, n): t for n, t in plan["tensors"].items()},
            "kernels": [{**k, "args": [names.get(a, a) for a in k["args"]]} for k in plan["kernels"]]}
    module = import_file(render_launcher(tmp_path, plan), "words_launcher")
    assert "launcher.run(**{'self': ..., 'lambda': ...})" in module.__doc__
    with pytest.raises(module.PlanError, match="missing input 'lambda'"):
        module.run(self=f16(8, 64))
    with pytest.raises(module.GpuUnavailable):
        module.run(**{"self": f16(8, 64), "lambda": f16(8, 64)})


def test_a_launcher_without_its_runtime_says_so(tmp_path):
    path = render_launcher(tmp_path, make_plan())
    (tmp_path / "cuda_plan.py").unlink()
    result = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"launcher.py: cuda_plan.py missing from {tmp_path}: the launcher runs the kernels" in result.stderr
    with pytest.raises(ImportError, match="cuda_plan.py missing from"):
        import_file(path, "runtimeless_launcher")


# ------------------------------------------------------------------------------------------------- on a GPU

ADD_CU = r"""
#include <cuda_fp16.h>
#include "scale.cuh"

// Y = X + W over n elements; S = sum of all of X (atomics, so S must start at zero).
extern "C" __global__ void add(const __half* X, const __half* W, float* Y, float* S) {
    extern __shared__ float staged[];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    staged[threadIdx.x] = __half2float(X[i]);
    __syncthreads();
    Y[i] = staged[threadIdx.x] + scale(__half2float(W[i]));
    atomicAdd(S, staged[threadIdx.x]);
}
"""


def gpu_plan(tmp_path: Path, smem: int = 256 * 4, block: int = 256) -> dict:
    (tmp_path / "add.cu").write_text(ADD_CU)
    (tmp_path / "scale.cuh").write_text("__device__ inline float scale(float w) { return 2.0f * w; }\n")
    plan = make_plan(outputs=["Y", "S"])
    plan["tensors"]["S"] = {"shape": [1], "dtype": "f32"}
    plan["kernels"][0].update(args=["X", "W", "Y", "S"], zero=["S"], smem=smem, block=[block, 1, 1],
                              grid=[8 * 64 // block, 1, 1])
    return plan


def gpu_inputs(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal((8, 64)).astype(np.float16) for n in ("X", "W")}


# ------------------------------------------------------------------------------------- a stand-in driver
# The launcher's bookkeeping (buffers, poison, zeroing, launch order, timing) checked on the CPU: a fake
# pycuda.driver whose memory is bytearrays and whose "kernels" are Python functions.

class FakeDriver:
    class CompileError(Exception):
        stderr = "add.cu(3): error: identifier \"undeclared\" is undefined"

    class LogicError(Exception):
        pass

    class device_attribute:
        MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = "optin"

    class function_attribute:
        MAX_DYNAMIC_SHARED_SIZE_BYTES = "max_dynamic_smem"

    KERNEL_MS = 0.25  # each kernel's time on the GPU
    CYCLES_PER_MS = 1 << 20  # the spin's clock: SPIN_CYCLES[0] clocks take 1/16 ms

    def __init__(self, kernels: dict, issue_ms: float = 0.0):
        """`issue_ms`: the host's time for each call that queues work (launch, memset, event)."""
        self.kernels, self.memory, self.log, self.issue_ms = kernels, {}, [], issue_ms
        self.cubin = b"a cubin"  # not an ELF image: the runtime packs pointers one after another
        self.host_ms = self.gpu_ms = 0.0  # the host's clock, and when the GPU is done with what is queued
        self.depth = self.allocated = self.retained = self.detached = 0
        drv = self

        class Allocation(int):
            def free(self):
                drv.memory.pop(int(self))

        class Context:
            def push(self):
                drv.depth += 1

            @staticmethod
            def pop():
                drv.depth -= 1

            @staticmethod
            def synchronize():
                drv.host_ms = max(drv.host_ms, drv.gpu_ms)

            def detach(self):
                drv.detached += 1

        class Device:
            def __init__(self, index):
                pass

            def retain_primary_context(self):
                drv.retained += 1
                return Context()

            def compute_capability(self):
                return (9, 0)

            def get_attribute(self, attribute):
                return 227 * 1024

        class Event:
            def record(self):
                self.at = drv.queue(0.0)

            def synchronize(self):  # the host waits for the GPU to get to the event
                drv.host_ms = max(drv.host_ms, self.at)

            def time_till(self, other):
                return other.at - self.at

        self.Allocation, self.Context, self.Device, self.Event = Allocation, Context, Device, Event

    def mem_alloc(self, nbytes):
        self.allocated += 1
        address = self.allocated << 20
        self.memory[address] = bytearray(nbytes)
        return self.Allocation(address)

    def queue(self, gpu_ms: float) -> float:
        """Work taking `gpu_ms` on the GPU, queued by the host now: it starts once both have got to it."""
        start = max(self.gpu_ms, self.host_ms)
        self.host_ms += self.issue_ms
        self.gpu_ms = start + gpu_ms
        return start

    def host_seconds(self) -> float:
        return self.host_ms / 1e3

    def memset_d8(self, ptr, value, count):
        self.log.append(("memset", ptr, value))
        self.memory[ptr][:count] = bytes([value]) * count

    def memset_d32(self, ptr, value, count):
        self.log.append(("memset32", ptr, value))
        self.memory[int(ptr)][:4 * count] = np.full(count, value, np.uint32).tobytes()

    def memset_d8_async(self, ptr, value, count):
        self.queue(0.0)
        self.memset_d8(ptr, value, count)

    def memcpy_htod(self, dest, array):
        self.memory[int(dest)][:] = np.ascontiguousarray(array).tobytes()

    def memcpy_dtoh(self, array, ptr):
        array.reshape(-1).view(np.uint8)[:] = np.frombuffer(self.memory[ptr], np.uint8)[:array.nbytes]

    def view(self, ptr, dtype):
        return np.frombuffer(self.memory[ptr], dtype)

    def compile(self, source, **options):
        """pycuda's `compiler.compile`: the cubin of `source` (`self.cubin`, a stand-in where a test sets none)."""
        # H100: wgmma needs the arch-specific target, named as -gencode names it (`cuda_runtime.device_target`)
        assert options["no_extern_c"] and (options["arch"], options["code"]) == ("compute_90a", "sm_90a"), options
        assert Path(options["include_dirs"][0]).is_absolute(), "nvcc runs elsewhere: relative -I paths break"
        if "undeclared" in source:
            raise self.CompileError()
        return self.cubin

    def source_module(self, source, **options):
        assert source == rt.SPIN_CU and options["no_extern_c"], "only the spin is compiled as a SourceModule"
        return self.spin_module()

    def module_from_buffer(self, cubin):
        assert cubin == self.cubin
        drv = self

        class Function:
            def __init__(self, body):
                self.body, self.attributes, self.buffers = body, {}, []

            def set_attribute(self, attribute, value):
                self.attributes[attribute] = value

            def prepare(self, fmt):
                # pycuda packs by its own struct module, native layout only: a byte-order prefix is "bad char"
                assert not fmt or fmt[0] not in "<>!=@", f"pycuda cannot pack {fmt!r}"
                self.fmt = fmt

            def prepared_call(self, grid, block, *ptrs, shared_size):
                assert drv.depth > 0, "launched outside the context"
                self.buffers.append(struct.pack(self.fmt, *ptrs))  # as pycuda packs them: a wrong count raises
                drv.log.append(("launch", grid, block, shared_size))
                drv.queue(drv.KERNEL_MS)
                self.body(drv, grid[0] * block[0], *ptrs)

        class Module:
            def get_function(self, name):
                if name not in drv.kernels:
                    raise drv.LogicError("named symbol not found")
                function = Function(drv.kernels[name])
                drv.functions.append(function)
                return function

        self.functions = []
        return Module()

    def spin_module(self):
        drv = self

        class Spin:
            def prepare(self, fmt):
                assert fmt == "q"

            def prepared_call(self, grid, block, cycles):
                assert drv.depth > 0 and grid == block == (1, 1, 1) and isinstance(cycles, int)
                drv.spins.append(cycles)
                drv.queue(cycles / drv.CYCLES_PER_MS)

        class Module:
            def get_function(self, name):
                assert name == "prism_spin"
                return Spin()

        self.spins = []
        return Module()


def fake_add(drv, threads, x, w, y, s):
    """The ADD_CU kernel below, in numpy: the first `threads` elements of Y, and S += sum of those X."""
    xv, wv = drv.view(x, np.float16).astype(np.float32), drv.view(w, np.float16).astype(np.float32)
    drv.view(y, np.float32)[:threads] = xv[:threads] + 2 * wv[:threads]
    drv.view(s, np.float32)[0] += xv[:threads].sum()


@pytest.fixture
def fake_gpu(monkeypatch):
    drv = FakeDriver({"add": fake_add})
    monkeypatch.setattr(rt, "gpu_status", lambda: (True, "fake device"))
    monkeypatch.setattr(rt, "_import_driver", lambda: drv)
    monkeypatch.setattr(rt, "host_seconds", drv.host_seconds)
    compiler = type(sys)("pycuda.compiler")
    compiler.SourceModule, compiler.compile = drv.source_module, drv.compile
    monkeypatch.setitem(sys.modules, "pycuda", type(sys)("pycuda"))
    monkeypatch.setitem(sys.modules, "pycuda.compiler", compiler)
    return drv


def test_launch_poisons_zeroes_and_reads_back(fake_gpu, tmp_path, monkeypatch):
    plan = gpu_plan(tmp_path, block=128)
    plan["kernels"][0]["grid"] = [3, 1, 1]  # 384 of the 512 elements are written
    monkeypatch.chdir(tmp_path)
    launcher = Launcher(plan, ".")
    inputs = gpu_inputs()
    x, w = (inputs[n].astype(np.float64) for n in ("X", "W"))
    for _ in range(2):  # the second run must zero S again
        out = launcher(**inputs)
        assert out["Y"].dtype == np.float32 and out["Y"].shape == (8, 64)
        assert check(out["Y"].ravel()[:384], (x + 2 * w).ravel()[:384])["passed"]
        assert np.isnan(out["Y"].ravel()[384:]).all()
        assert check(out["S"], np.array([x.ravel()[:384].sum()]))["passed"]
    assert fake_gpu.depth == 0
    kinds = [entry[0] if entry[0] == "launch" else entry[2] for entry in fake_gpu.log]
    assert kinds == [0xFF, 0xFF, 0, "launch"] * 2  # poison Y and S, zero S, launch
    assert fake_gpu.log[3] == ("launch", (3, 1, 1), (128, 1, 1), 1024)
    assert fake_gpu.functions[0].fmt == "PPPP" and fake_gpu.functions[0].attributes == {}
    launcher.close()
    assert fake_gpu.memory == {} and fake_gpu.depth == 0


def test_the_tickets_and_sums_of_a_kernel_are_zeroed_once_and_passed_after_its_tensors(fake_gpu, tmp_path):
    """A kernel that finishes its sums across blocks in its launch (`backend.sums`) takes its tiles' counters and its
    f32 workspaces after its tensors; the runtime zeroes them once, when it compiles, and keeps them between launches
    (the last block of each tile puts them back to zero), and frees them on close."""
    def finished_add(drv, threads, x, w, y, s, tickets, sums):  # the workspace and counters must be back at zero
        assert not drv.view(tickets, np.uint32).any() and not drv.view(sums, np.float32).any()
        fake_add(drv, threads, x, w, y, s)
        drv.view(sums, np.float32)[:3] = 1.0  # used, then put back by the fake "last block"
        drv.view(sums, np.float32)[:] = 0.0
    fake_gpu.kernels["add"] = finished_add
    plan = gpu_plan(tmp_path)
    plan["kernels"][0].update(tickets=4, sums=64)
    launcher = Launcher(plan, tmp_path)
    for _ in range(2):
        launcher(**gpu_inputs())
    assert [e[0] for e in fake_gpu.log].count("memset32") == 2 and fake_gpu.functions[0].fmt == "PPPPPP"
    launched = [struct.unpack("6Q", b)[4:] for b in fake_gpu.functions[0].buffers]
    assert launched[0] == launched[1] and {len(fake_gpu.memory[p]) for p in launched[0]} == {16, 256}
    launcher.close()
    assert fake_gpu.memory == {}


def test_the_primary_context_is_retained_once_and_never_released(fake_gpu, tmp_path):
    """Releasing a primary context's last reference resets it while pycuda leaves it current, where PyTorch would
    then find it destroyed: every launcher of the process shares one retained context, and closing releases none."""
    first, second = Launcher(gpu_plan(tmp_path), tmp_path), Launcher(gpu_plan(tmp_path), tmp_path)
    first(**gpu_inputs())
    first.close()
    second(**gpu_inputs())
    second.close()
    assert fake_gpu.retained == 1 and fake_gpu.detached == 0 and fake_gpu.depth == 0 and fake_gpu.memory == {}


def test_large_shared_memory_is_opted_into(fake_gpu, tmp_path):
    Launcher(gpu_plan(tmp_path, smem=100 * 1024), tmp_path).compile()
    assert fake_gpu.functions[0].attributes == {"max_dynamic_smem": 100 * 1024}
    with pytest.raises(PlanError, match="needs 240000 bytes of shared memory; this device allows 232448"):
        Launcher(gpu_plan(tmp_path, smem=240000), tmp_path).compile()


def test_bf16_outputs_come_back_as_float32(fake_gpu, tmp_path):
    def fill(drv, threads, y):
        drv.view(y, np.uint16)[:] = rt.to_bf16_bits(np.arange(4, dtype=np.float32))

    fake_gpu.kernels["fill"] = fill
    (tmp_path / "add.cu").write_text("// stands in for a kernel that fills Y\n")
    plan = make_plan(inputs=[], outputs=["Y"], tensors={"Y": {"shape": [4], "dtype": "bf16"}})
    plan["kernels"][0].update(function="fill", args=["Y"], grid=[1, 1, 1], block=[4, 1, 1])
    out = Launcher(plan, tmp_path)()
    assert out["Y"].dtype == np.float32 and list(out["Y"]) == [0, 1, 2, 3]


def test_timing_rotates_input_sets(fake_gpu, tmp_path):
    launcher = Launcher(gpu_plan(tmp_path), tmp_path)
    seen = []
    fake_gpu.kernels["add"] = lambda drv, threads, x, *rest: seen.append(x)
    stats = launcher.time([gpu_inputs(seed) for seed in range(3)], warmup=2, repeat=6)
    assert stats == {"median_ms": 0.25, "min_ms": 0.25, "mean_ms": 0.25, "repeat": 6, "host_bound": False}
    assert len(set(seen)) == 3 and seen[2:] == [seen[0], seen[1], seen[4]] * 2  # 2 warm-ups, then 0 1 2 0 1 2
    assert list(launcher.time_kernels([gpu_inputs()], warmup=0, repeat=2)) == ["add"]
    assert fake_gpu.depth == 0


def test_batched_timing_divides_back_to_back_sequences(fake_gpu, tmp_path):
    launcher = Launcher(gpu_plan(tmp_path), tmp_path)
    seen = []
    fake_gpu.kernels["add"] = lambda drv, threads, x, *rest: seen.append(x)
    stats = launcher.time([gpu_inputs(seed) for seed in range(3)], warmup=0, repeat=2, batch=4)
    assert stats == {"median_ms": 0.25, "min_ms": 0.25, "mean_ms": 0.25, "repeat": 2, "host_bound": False}  # 4 over 4
    assert len(seen) == 8 and seen == [seen[0], seen[1], seen[2]] * 2 + [seen[0], seen[1]]  # rotating on
    with pytest.raises(PlanError, match="batch >= 1"):
        launcher.time([gpu_inputs()], batch=0)


def test_timing_leaves_out_the_hosts_time_to_queue_the_launches(fake_gpu, tmp_path):
    """A host slower to queue a launch (0.4 ms) than the GPU to run it (0.25 ms): events around the launches
    alone would time the host. The spin queued ahead of them is doubled until the host has queued them all
    before the GPU reaches the first event; only then does a sample count, and it times the GPU alone."""
    fake_gpu.issue_ms = 0.4
    launcher = Launcher(gpu_plan(tmp_path), tmp_path)
    stats = launcher.time([gpu_inputs(seed) for seed in range(3)], warmup=1, repeat=3, batch=4)
    assert stats == {"median_ms": 0.25, "min_ms": 0.25, "mean_ms": 0.25, "repeat": 3, "host_bound": False}
    # 12 calls a sample (the lead event, the spin, the 2 timed events, per sequence a memset and a launch): 4.8 ms
    # of queueing, more than the spins of 1/16 ... 4 ms, less than the 8 ms one kept for every later sample
    first, kept = rt.SPIN_CYCLES[0], rt.SPIN_CYCLES[0] << 7
    assert fake_gpu.spins == [0] + [first << k for k in range(8)] + [kept] * 2  # 0: loaded before timing
    per_kernel = launcher.time_kernels([gpu_inputs()], warmup=0, repeat=2)
    assert per_kernel["add"]["median_ms"] == 0.25 and not per_kernel["add"]["host_bound"]


def test_a_host_that_cannot_get_ahead_is_said_to_bound_the_times(fake_gpu, tmp_path, monkeypatch):
    monkeypatch.setattr(rt, "SPIN_CYCLES", (rt.SPIN_CYCLES[0], rt.SPIN_CYCLES[0] * 2))
    fake_gpu.issue_ms = 0.4
    stats = Launcher(gpu_plan(tmp_path), tmp_path).time([gpu_inputs()], warmup=0, repeat=2)
    assert stats["host_bound"] and stats["median_ms"] > 0.25  # the events around the launch time the host
    assert fake_gpu.spins == [0, rt.SPIN_CYCLES[0], rt.SPIN_CYCLES[1], rt.SPIN_CYCLES[1]]  # the longest kept


@pytest.mark.nvcc
@pytest.mark.skipif(nvcc_path() is None, reason="nvcc is not on the PATH")
def test_the_spin_compiles_to_a_loop_on_the_clock(tmp_path):
    (tmp_path / "spin.cu").write_text(rt.SPIN_CU)
    done = subprocess.run([nvcc_path(), "-cubin", "-arch=sm_90a", *rt.NVCC_OPTIONS, "-o", str(tmp_path / "spin.cubin"),
                           str(tmp_path / "spin.cu")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    if not sass.available():
        pytest.skip("cuobjdump is missing (pip install -e '.[sass]'): the SASS is not read")
    listing = sass.disassemble(tmp_path / "spin.cubin")
    loop, ops = sass.hot_loop(listing), sass.instructions(listing)[0]
    assert loop is not None and "CS2R" in ops[loop.start: loop.end + 1]  # the clock read on every turn


def test_compile_errors_carry_nvcc_stderr(fake_gpu, tmp_path):
    plan = gpu_plan(tmp_path)
    (tmp_path / "add.cu").write_text(ADD_CU.replace("staged[threadIdx.x] +", "undeclared +"))
    with pytest.raises(rt.KernelCompileError) as err:
        Launcher(plan, tmp_path).compile()
    assert "undeclared" in err.value.stderr and "nvcc failed on kernel 'add'" in str(err.value)


def test_missing_source_and_function_are_plan_errors(fake_gpu, tmp_path):
    with pytest.raises(PlanError, match="kernel 'add': cannot read .*add.cu"):
        Launcher(make_plan(), tmp_path).compile()
    plan = gpu_plan(tmp_path)
    plan["kernels"][0]["function"] = "sub"
    with pytest.raises(PlanError, match="add.cu defines no extern \"C\" __global__ function 'sub'"):
        Launcher(plan, tmp_path).compile()


class TestOnGpu:
    """Hand-written kernels compiled and launched through the runtime."""

    pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not rt.gpu_status()[0], reason=rt.gpu_status()[1])]

    @pytest.mark.parametrize("smem", [256 * 4, 64 * 1024], ids=["small-smem", "opt-in-smem"])
    def test_runs_a_kernel_and_checks(self, tmp_path, smem):
        launcher = Launcher(gpu_plan(tmp_path, smem), tmp_path)
        inputs = gpu_inputs()
        x, w = (inputs[n].astype(np.float64) for n in ("X", "W"))
        for _ in range(2):  # the second run must zero S again
            out = launcher(**inputs)
            assert check(out["Y"], x + 2 * w)["passed"]
            assert check(out["S"], np.array([x.sum()]))["passed"]
        launcher.close()

    def test_a_kernel_copying_by_tma_matches_the_reference(self, tmp_path, capsys):
        """A generated kernel whose loop tiles TMA copies, through maps the runtime packs where its cubin reads
        them (`cuda_plan.parameter_layout`), checked against the float64 reference on the GPU."""
        import json

        from prism_dsl.cli.main import main

        if rt._import_driver().Device(0).compute_capability() != (9, 0):
            pytest.skip(f"TMA copies on wgmma kernels need sm_90: {rt.gpu_status()[1]}")
        out = tmp_path / "out"
        assert main(["compile", str(Path(__file__).resolve().parents[1] / "programs" / "fused" / "rmsnorm_linear.prism"),
                     "--search", "none", "--dims", "n=256,d=1024", "--tma", "--rank", "measure", "--arch", "none",
                     "--no-emulate", "-o", str(out), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert "prism::TensorMap" in (out / report["kernels"][0]["file"]).read_text()
        assert report["checked"]["gpu"]["passed"], report["checked"]["gpu"]

    def test_inputs_read_in_place_past_the_callers_end_match_the_reference(self, tmp_path, capsys):
        """Keys built for 4160 where the caller has 4099 (causal attention at one query, as written): the kernel reads
        K, V and the keys' RoPE tables as the caller's tensors are, each copy past the 4099th key filling zeros
        (cp.async reading 0 bytes); checked against the float64 reference on the GPU, and run again through the
        launcher with numpy inputs and with torch tensors of the caller's shape (passed without a copy)."""
        import json

        from prism_dsl.cli.main import main

        torch = pytest.importorskip("torch")
        out = tmp_path / "out"
        source = Path(__file__).resolve().parents[1] / "programs" / "fused" / "causal_attention.prism"
        assert main(["compile", str(source), "--search", "none", "--dims", "b=1,h=16,q=1,kv=4099,dh=128", "--rank",
                     "measure", "--arch", "none", "--no-emulate", "-o", str(out), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["padded"] == {"kv": 4099} and {"K", "V"} <= set(report["in_place"]), report["in_place"]
        assert report["checked"]["gpu"]["passed"], report["checked"]["gpu"]
        spec = importlib.util.spec_from_file_location("launcher", out / "launcher.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        launcher = module.get_launcher()
        inputs = rt.random_inputs(launcher.plan)
        assert inputs["K"].shape == (1, 16, 4099, 128)
        got = launcher(**inputs)["O"]
        again = launcher(**{k: torch.from_numpy(v).cuda() for k, v in inputs.items()})["O"]
        assert got.shape == (1, 16, 1, 128) and check(again.float().cpu().numpy(), got.astype(np.float64), 1e-3)["passed"]

    def test_a_sum_across_blocks_with_its_residual_matches_the_reference_launch_after_launch(self, tmp_path, capsys):
        """An MLP whose blocks add their parts of Y in f32 and whose tiles' last blocks store Y + X in f16
        (`backend.sums`, `kernels.finishing`), run four times through its launcher: each time the float64 reference
        (a workspace or ticket left from the launch before would add its sums again, or store before every block
        has added)."""
        from prism_dsl.cli.main import main
        from prism_dsl.lang.check import load
        from prism_dsl.semantics.blocks import evaluate

        source = tmp_path / "residual.prism"
        source.write_text("dims n = 8, d = 768, f = 3072\nprogram res(X: f16[n, d], W1: f16[d, f], W2: f16[f, d]) {\n"
                          "    kernel mlp grid(x = gx, y = gy, z = gz) loop(F) {\n        xt = load X[y, :]\n"
                          "        w1t = load W1[:, z*loop]\n        w2t = load W2[z*loop, x]\n"
                          "        store T[y, x] += acc_sum(gelu_tanh(xt @ w1t) @ w2t)\n    }\n    Y = X + T\n"
                          "    return Y\n}\n")
        out = tmp_path / "out"
        assert main(["compile", str(source), "--search", "none", "--arch", "none", "--no-emulate", "-o", str(out)]) == 0
        spec = importlib.util.spec_from_file_location("launcher", out / "launcher.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        launcher = module.get_launcher()
        assert [k.get("sums", 0) > 0 for k in launcher.plan["kernels"]] == [True]
        inputs = rt.random_inputs(launcher.plan)
        inputs = {**inputs, **{w: inputs[w] / np.float16(np.sqrt(inputs[w].shape[0])) for w in ("W1", "W2")}}
        plain = tmp_path / "plain.prism"  # the same program as written, for its float64 reference
        plain.write_text("dims n = 8, d = 768, f = 3072\nprogram res(X: f16[n, d], W1: f16[d, f], W2: f16[f, d]) {\n"
                         "    Y = X + gelu_tanh(X @ W1) @ W2\n    return Y\n}\n")
        want = evaluate(load(plain).program(), {k: v.astype(np.float64) for k, v in inputs.items()})["Y"]
        for _ in range(4):
            got = launcher(**inputs)["Y"]
            assert got.dtype == np.float16 and check(got.astype(np.float64), want, 1e-2)["passed"]
        launcher.close()

    def test_unwritten_output_is_poisoned(self, tmp_path):
        plan = gpu_plan(tmp_path, block=128)
        plan["kernels"][0]["grid"] = [2, 1, 1]  # half the elements are never written
        out = Launcher(plan, tmp_path)(**gpu_inputs())
        assert np.isnan(out["Y"].ravel()[256:]).all() and not check(out["Y"], np.zeros((8, 64)))["passed"]

    def test_timing_gives_positive_medians(self, tmp_path):
        launcher = Launcher(gpu_plan(tmp_path), tmp_path)
        sets = [gpu_inputs(seed) for seed in range(3)]
        stats = launcher.time(sets, warmup=2, repeat=10)
        assert stats["repeat"] == 10 and 0 < stats["min_ms"] <= stats["median_ms"]
        per_kernel = launcher.time_kernels(sets, warmup=2, repeat=10)
        assert set(per_kernel) == {"add"} and per_kernel["add"]["median_ms"] > 0

    def test_compile_error_carries_nvcc_stderr(self, tmp_path):
        plan = gpu_plan(tmp_path)
        (tmp_path / "add.cu").write_text(ADD_CU.replace("staged[threadIdx.x] +", "undeclared +"))
        with pytest.raises(rt.KernelCompileError) as err:
            Launcher(plan, tmp_path).compile()
        assert "undeclared" in err.value.stderr and "add.cu" in str(err.value)

    def test_torch_tensors_stay_on_the_device(self, tmp_path):
        torch = pytest.importorskip("torch")
        launcher = Launcher(gpu_plan(tmp_path), tmp_path)
        inputs = {n: torch.from_numpy(a).cuda() for n, a in gpu_inputs().items()}
        out = launcher(**inputs)
        assert out["Y"].is_cuda and out["Y"].dtype == torch.float32
        expected = (inputs["X"].double() + 2 * inputs["W"].double()).cpu().numpy()
        assert check(out["Y"], expected)["passed"]
        with pytest.raises(PlanError, match="not 16-byte aligned"):
            launcher(X=torch.zeros(8 * 64 + 1, dtype=torch.float16, device="cuda")[1:].view(8, 64), W=inputs["W"])
        with pytest.raises(PlanError, match="is not contiguous"):
            launcher(X=inputs["X"].t().contiguous().t(), W=inputs["W"])

    def test_torch_tensors_of_the_callers_size_are_padded_on_the_device(self, tmp_path):
        """Dims rounded up past the caller's (the plan's `used`) along the rows and along the columns: the caller's
        tensors padded with zeros on the device (torch's constant pad), the outputs cut to the caller's part."""
        torch = pytest.importorskip("torch")
        plan = gpu_plan(tmp_path)
        for name in ("X", "W", "Y"):
            plan["tensors"][name]["used"] = [5, 40]
        launcher = Launcher(plan, tmp_path)
        inputs = {n: torch.from_numpy(a[:5, :40].copy()).cuda() for n, a in gpu_inputs().items()}
        out = launcher(**inputs)
        assert out["Y"].shape == (5, 40) and out["Y"].is_contiguous()
        assert check(out["Y"], (inputs["X"].double() + 2 * inputs["W"].double()).cpu().numpy())["passed"]


def test_the_standalone_runtime_knows_the_storage_ranges_the_package_does():
    """cuda_plan, copied beside the kernels, keeps its own table of each dtype's largest value: the same as the
    one `prismc run` and `verify --inputs` refuse a user's values by."""
    from prism_dsl.backend.cuda_plan import LARGEST
    from prism_dsl.semantics.reference import _LARGEST

    assert {d.value: v for d, v in _LARGEST.items()} == LARGEST
