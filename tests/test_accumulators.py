"""The accumulator table (`ir.accumulators`): every row agrees with itself (its fold with its closed form
and shape, its CUDA strings with the placeholders the code generator fills in, its combining form with
the table), the operator table takes its `acc_*` entries from it, and the generated CUDA of the row
accumulators the golden files do not cover agrees with NumPy in the CPU emulation."""

from __future__ import annotations

import numpy as np
import pytest
import sympy

from prism_dsl.backend import emulate, tuning
from prism_dsl.backend.codegen import render_kernel
from prism_dsl.ir.accumulators import ACCUMULATORS, ONLINE_SOFTMAX, RUNNING_MAX, fold
from prism_dsl.ir.nodes import DType, Node
from prism_dsl.ir.ops import OPS, Kind
from prism_dsl.ir.shapes import build, same_shape
from prism_dsl.kernels.hardware import load_hardware
from prism_dsl.kernels.kernel import kernels_of
from prism_dsl.kernels.lower import lower
from prism_dsl.lang.check import load
from prism_dsl.semantics.reference import evaluate_nodes, random_inputs

ROWS = list(ACCUMULATORS.values())
# Operand shapes per shape rule: one row of 6 elements in 4 rows; s @ v; a running max beside its values.
OPERANDS = {"unary": [(4, 6)], "matmul": [(4, 6), (6, 3)], "binary": [(4, 1), (4, 3)]}


def _inputs(acc) -> list[Node]:
    return [Node("input", (), f"x{i}", DType.F32, tuple(sympy.Integer(d) for d in shape))
            for i, shape in enumerate(OPERANDS[acc.like])]


def test_the_operator_table_takes_the_accumulators_from_their_table():
    assert [n for n, s in OPS.items() if s.kind is Kind.ACCUMULATE] == list(ACCUMULATORS)
    for acc in ROWS:
        spec = OPS[acc.name]
        assert (spec.operands, spec.doc, spec.where) == (acc.operands, acc.doc, "block")
        assert len(OPERANDS[acc.like]) == acc.operands


@pytest.mark.parametrize("acc", ROWS, ids=lambda a: a.name)
def test_one_iteration_of_the_fold_is_the_closed_form(acc):
    """The search's abstract expression (`closed`) is the fold's value when the loop runs once, with the
    shape the shape rule gives."""
    nodes = _inputs(acc)
    closed = acc.closed(build, *nodes)
    assert same_shape(closed.shape, build(acc.name, nodes).shape)
    rng = np.random.default_rng(0)
    env = {n: rng.standard_normal([int(d) for d in n.shape]) for n in nodes}
    want = evaluate_nodes([closed], env)[closed]
    np.testing.assert_allclose(fold(acc.name, [[env[n] for n in nodes]]), want, rtol=1e-12)


@pytest.mark.parametrize("acc", ROWS, ids=lambda a: a.name)
def test_cuda_strings_use_only_the_placeholders_the_code_generator_fills(acc):
    names = {"acc": "s_a", "m": "s_m", "scale": "s_scale"}
    assert set(acc.state) <= {"acc", "m"} and acc.state[-1] in ("acc", "m") and acc.cuda_fold
    if acc.row:
        assert acc.cuda_reduce in ("sum", "max", "welford")
        acc.cuda_term.format("x0")
        assert all("part" in line for line in acc.cuda_fold)
        [line.format(**names) for line in acc.cuda_fold]
    elif acc.like == "matmul":
        assert len(acc.cuda_fold) == 1 and acc.cuda_fold[0].format(row="r", **names)
    else:
        [line.format(*[f"x{i}" for i in range(acc.operands)], **names) for line in acc.cuda_fold]
    acc.cuda_finish.format("v", count=8)


def test_split_pieces_combine_through_rows_of_the_table():
    for acc in ROWS:
        if acc.combine:
            combining = ACCUMULATORS[acc.combine[0]]
            assert combining.combine is not None or combining.combining_only
            # two operands: the combining kernel passes the pieces' running max first
            assert combining.operands == 1 or combining.like == "binary"
    assert [n for n, a in ACCUMULATORS.items() if a.online == "max"] == [RUNNING_MAX]
    assert ONLINE_SOFTMAX and all(ACCUMULATORS[n].state[0] == "m" for n in ONLINE_SOFTMAX)


ROW_FOLDS = """dims n = 8, d = 256
program rows(X: f32[n, d], Y: f32[n, d], W: f16[d, d]) {
    kernel rows grid(x = gx) loop(F) {
        xt = load X[x, loop]
        yt = load Y[x, loop]
        store A[x, :] = acc_mean_last(xt) + acc_sum_last(xt * yt)
        store B[x, :] = acc_max_last(exp(xt)) * acc_rms_last(xt) + acc_sum_last(silu(yt))
    }
    kernel product grid(x = gy) loop(G) {
        xt = load X[:, loop]
        wt = load W[loop, x]
        store C[:, x] = acc_sum(xt @ wt) / acc_mean_last(square(xt))
    }
    return A, B, C
}
"""


@pytest.mark.skipif(emulate.compiler() is None, reason="no C++ compiler (g++ or clang++) for the CPU emulation")
def test_generated_row_folds_agree_with_numpy_in_the_cpu_emulation(write, tmp_path):
    program = lower(load(write(ROW_FOLDS)).program())
    binding = program.default_binding()
    _, concrete, _ = tuning.parameters(program, binding, {"F": 4, "G": 2}, load_hardware("h100"))
    kernels = [render_kernel(concrete[k.name], program) for k in kernels_of(program)]
    inputs = random_inputs(program, binding, seed=1)
    dtypes = {n.attr: n.dtype for n in program.inputs} | {"A": DType.F32, "B": DType.F32, "C": DType.F32}
    result = emulate.run(kernels, dtypes, {"A": (8, 1), "B": (8, 1), "C": (8, 256)}, inputs, tmp_path)
    assert result.finding is None, result.finding
    got = result.outputs
    x, y, w = inputs["X"], inputs["Y"], inputs["W"]
    mean, rms = x.mean(-1, keepdims=True), np.sqrt((x * x).mean(-1, keepdims=True))
    want = {"A": mean + (x * y).sum(-1, keepdims=True),
            "B": np.exp(x).max(-1, keepdims=True) * rms + (y / (1 + np.exp(-y))).sum(-1, keepdims=True),
            "C": (x @ w) / (x * x).mean(-1, keepdims=True)}
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-4, err_msg=name)


def test_the_variance_fold_keeps_its_accuracy_on_rows_far_from_zero():
    """`acc_var_last` merges each tile's mean and deviations (Chan's formula): on rows 1e6 from zero, in float64,
    it keeps the variance to 1e-9 over tiles of unequal sizes, where E[x^2] - E[x]^2 loses it."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 37)) * 2 + 1e6
    tiles = [(x[:, a:b],) for a, b in ((0, 8), (8, 9), (9, 30), (30, 37))]
    want = x.var(-1, keepdims=True)
    np.testing.assert_allclose(fold("acc_var_last", tiles), want, rtol=1e-9)
    moments = (x * x).mean(-1, keepdims=True) - x.mean(-1, keepdims=True) ** 2
    assert np.max(np.abs(moments - want) / want) > 1e-6


VARIANCE = """dims n = 6, d = 200, e = 640
program variance(X: f32[n, d], Z: f16[n, e], W: f16[e, e]) {
    kernel rows grid(x = gx) loop(F) {
        xt = load X[x, loop]
        store V[x, :] = acc_var_last(xt)
    }
    kernel product grid(x = gy) loop(G) {
        zt = load Z[:, loop]
        wt = load W[loop, x]
        store Y[:, x] = (acc_sum(zt @ wt) - acc_mean_last(zt) * acc_sum(sum(wt, 0))) / sqrt(acc_var_last(zt) + 1e-5)
    }
    return V, Y
}
"""


@pytest.mark.skipif(emulate.compiler() is None, reason="no C++ compiler (g++ or clang++) for the CPU emulation")
@pytest.mark.parametrize("sanitizer", [None, "thread"])
def test_generated_variance_fold_agrees_on_rows_far_from_zero(write, tmp_path, sanitizer):
    """The CUDA of `acc_var_last`: element by element over f32 tiles of 50 (rows of 50 over 32 lanes, so lanes hold
    unequal counts), by 16-byte loads over f16 tiles of 320 (40 groups over 16 lanes): each group merged into a
    thread's count, mean and deviations (Chan's formula, means held less the thread's first value), then the
    lanes' merged by shuffles. On f32 rows 1e4 from zero with a spread of 1, where E[x^2] - E[x]^2 keeps nothing
    and a mean rounded at 1e4 costs 1e-4, it keeps the variance to 1e-6 (7e-8 measured, as two passes over the
    row in f32 do), an element 300 deviations from the rest as the first a thread reads included; the
    LayerNorm-then-projection kernel too, on f16 rows around 300."""
    program = lower(load(write(VARIANCE)).program())
    binding = program.default_binding()
    _, concrete, _ = tuning.parameters(program, binding, {"F": 4, "G": 2, "gx": 2, "gy": 4}, load_hardware("h100"))
    kernels = [render_kernel(concrete[k.name], program) for k in kernels_of(program)]
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 200)) + 1e4
    x[3:, 0] += 300  # the first element a thread reads of the row, 300 deviations from the rest
    inputs = {"X": x.astype(np.float32),
              "Z": (rng.standard_normal((6, 640)) + 300).astype(np.float16),
              "W": (rng.standard_normal((640, 640)) / 16).astype(np.float16)}
    dtypes = {n.attr: n.dtype for n in program.inputs} | {"V": DType.F32, "Y": DType.F16}
    result = emulate.run(kernels, dtypes, {"V": (6, 1), "Y": (6, 640)}, inputs, tmp_path, sanitizer=sanitizer)
    assert result.finding is None, result.finding
    x, z, w = (inputs[k].astype(np.float64) for k in "XZW")
    np.testing.assert_allclose(result.outputs["V"], x.var(-1, keepdims=True), rtol=1e-6)  # measured: 7e-8
    mu = z.mean(-1, keepdims=True)
    want = (z - mu) / np.sqrt(z.var(-1, keepdims=True) + 1e-5) @ w
    np.testing.assert_allclose(result.outputs["Y"], want, rtol=0, atol=2e-2 * np.abs(want).max())
