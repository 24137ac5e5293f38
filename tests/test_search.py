"""The superoptimizer: search, proofs, checkpoint, tuning database, time limit, and `prismc compile`."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import sympy

from prism_dsl.backend import tuning

from prism_dsl.backend import emulate
from prism_dsl.lang.check import load
from prism_dsl.cli.main import main
from prism_dsl.backend.cuda_runtime import gpu_status
from prism_dsl.kernels.hardware import load_hardware
from prism_dsl.kernels.kernel import free_symbols, kernels_of
from prism_dsl.kernels.position import causal_loop
from prism_dsl.kernels.lower import lower
from prism_dsl.lang.printer import print_program
from prism_dsl.semantics.blocks import evaluate
from prism_dsl.semantics.reference import bind_dims, random_inputs
from prism_dsl.prove.rules import load_library
from prism_dsl.prove.soundness import check_library
from prism_dsl.search.checkpoint import checkpoint_key, save_checkpoint
from prism_dsl.search.config import Rejection, SearchConfig, Stats
from prism_dsl.search.driver import search
from prism_dsl.search.reach import loop_ops
from prism_dsl.search.maps import hoisted_scales
from prism_dsl.ir.nodes import DType, Node, const
from prism_dsl.ir.shapes import build
from prism_dsl.pipeline.measuring import MEASURED, PARAMETER_CHOICES, Measurement, to_measure
from prism_dsl.pipeline.optimize import optimize
from prism_dsl.backend.launch import CodegenConfig

ROOT = Path(__file__).resolve().parent.parent
H100 = load_hardware("h100")
GPU = gpu_status()
# Two bindings per program (one for QK-norm attention), small so that the checks stay quick.
BINDINGS = {
    "rmsnorm_linear": [dict(n=4, d=64), dict(n=8, d=128)],
    "rmsnorm_mlp": [dict(n=4, d=64), dict(n=8, d=32)],
    "swiglu": [dict(n=4, d=64), dict(n=2, d=128)],
    "attention": [dict(b=1, h=2, q=2, kv=64, dh=16), dict(b=2, h=1, q=1, kv=32, dh=8)],
    "qk_norm_attention": [dict(b=1, h=2, q=2, kv=64, dh=16)],  # attention's second binding stands for both
}


@pytest.fixture(scope="module")
def verdicts():
    """The default library's soundness verdicts, checked once in the session's cache (tests/conftest.py)."""
    check_library(load_library([], defaults=True))
    return Path(os.environ["PRISM_CACHE_DIR"]) / "sound"


@pytest.fixture(scope="module")
def searched_before():
    """The search checkpoints that this module's tests have saved so far, beside the session's cache: shared by
    the test run's processes (pytest-xdist's workers), as that cache is (tests/conftest.py)."""
    store = Path(os.environ["PRISM_CACHE_DIR"]).parent / "searched"
    store.mkdir(exist_ok=True)
    return store


@pytest.fixture(autouse=True)
def cache_dir(request, tmp_path, monkeypatch, verdicts, searched_before):
    """A fresh cache per test (no tuning record carries over), holding the default rules' soundness verdicts,
    as a second run of prismc would (their checking is tested in test_trust_soundness.py; here it would cost
    every command seconds), and the searches earlier tests finished (a search takes 5-10 s, and most of these
    tests search the same few programs): what they find is what a search would find, and the programs are
    proved again where chosen (`optimize._from_checkpoint`). A test marked `fresh` starts with no search and
    leaves none."""
    cache = tmp_path / "cache"
    shutil.copytree(verdicts, cache / "sound")
    fresh = request.node.get_closest_marker("fresh") is not None
    if not fresh:
        shutil.copytree(searched_before, cache / "search", ignore=shutil.ignore_patterns(".*"))  # not one half-copied
    monkeypatch.setenv("PRISM_CACHE_DIR", str(cache))
    yield cache
    if not fresh:
        for entry in (cache / "search").glob("*.json"):
            if not (searched_before / entry.name).exists():  # whole or not at all: another process may read it
                part = searched_before / f".{entry.name}.{os.getpid()}"
                shutil.copy(entry, part)
                os.replace(part, searched_before / entry.name)


_SEARCHES: dict = {}


def searched(src, library, config: SearchConfig = SearchConfig()):
    """`search(src, library, H100, config, jobs=2)`, run once in this process, and saved as its checkpoint for the
    tests after it (`cache_dir`): for tests that read what a search finds, not how it runs."""
    key = checkpoint_key(src, library, config, H100)
    if key not in _SEARCHES:
        _SEARCHES[key] = search(src, library, H100, config, jobs=2)
    result = _SEARCHES[key]
    if result.complete and not result.stats.errors:
        save_checkpoint(key, result)
    return result


@pytest.fixture(scope="module")
def library():
    return load_library([], defaults=True)


def program(name: str):
    return load(ROOT / "programs" / f"{name}.prism").program()


def custom_kernels(p) -> int:
    return len({id(n.attr[0]) for n in p.nodes() if n.op == "kernel"})


@pytest.mark.parametrize("name", list(BINDINGS))
def test_each_program_gets_one_fused_proved_kernel(name, library):
    src = program(name)
    for dims in BINDINGS[name]:
        out = optimize(src, library, H100, bind_dims(src, dims), time_limit=120)
        best = out.best
        if name == "swiglu":  # as written, its two products lower into one kernel, their epilogue silu(a) * b:
            # the search's one fused kernel ties with it, and a tie goes to the program as written
            assert best.as_written and len(kernels_of(lower(best.program))) == 1
        else:
            assert not best.as_written, f"{name}: nothing better than the program as written"
            assert custom_kernels(best.program) == 1 and len(kernels_of(best.program)) == 1
        # Numerically equal to the reference at these dims (block interpreter, the chosen parameters).
        inputs = random_inputs(src, bind_dims(src, dims), seed=3)
        want = evaluate(src, inputs)
        got = evaluate(best.program, inputs, params=best.params)
        for k, v in want.items():
            assert np.allclose(got[k], v, rtol=1e-9, atol=1e-9 * np.abs(v).max())
        assert out.search["proved_programs"] >= 1
    # At the suite's dims (the checkpoint is reused: only ranking runs) the loop-fused form wins; attention at
    # decode (16 heads of one query) split over the keys (FlashDecoding, the combine in the same launch): one
    # block per head would keep 16 SMs busy, and an SM takes in only what its warps copy (`intake.sm_intake`).
    out = optimize(src, library, H100, src.default_binding())
    chosen = lower(out.best.program)
    assert out.from_checkpoint and custom_kernels(chosen) == (2 if "attention" in name else 1)
    text = print_program(chosen)
    if "attention" in name:
        assert "acc_softmax_out" in text and "acc_softmax_sum" in text and "exp" not in text  # online softmax
        assert "acc_rescaled_sum" in text  # the pieces' states combined
    else:
        assert "acc_sum" in text  # the projections accumulate over the loop


def test_a_constant_with_an_exponent_reaches_the_fused_kernel(library, write):
    """RMSNorm with its epsilon written out: egglog prints the constant 1e-05 as 1e-5, and the search must
    still find the input program's terms in the saturated e-graph (it once stopped with an internal error)."""
    src = load(write("""dims n = 8, d = 256
program rmsnorm_eps(X: f16[n, d], W: f16[d, d]) {
    Y = (X * rsqrt(mean(X * X, -1) + 0.00001)) @ W
    return Y
}
""")).program()
    out = optimize(src, library, H100, src.default_binding())
    assert custom_kernels(out.best.program) == 1 and not out.best.as_written
    assert "acc_mean_last(xt * xt) + 1e-05" in print_program(out.best.program)


def test_a_search_that_cannot_start_compiles_the_program_as_written_and_says_why(tmp_path, capsys, monkeypatch):
    from prism_dsl.search import abstract

    def lost(*_):
        raise abstract.SaturationFailed("the saturated e-graph lost output 'Y' (egglog: iteration limit)")
    monkeypatch.setattr(abstract, "_run", lost)
    path = ROOT / "programs" / "swiglu.prism"
    assert main(["compile", str(path), "-o", str(tmp_path / "out"), "--dims", "n=4,d=64", "--arch", "none",
                 "--no-emulate", "--no-cache"]) == 0
    out = capsys.readouterr().out
    assert "cut short (the search could not start: the saturated e-graph lost output 'Y'" in out
    assert "(the program as written: nothing faster was found)" in out


def test_no_cache_neither_reads_nor_writes_the_checkpoint_or_the_tuning_database(tmp_path, capsys, monkeypatch):
    """Damaged entries of every kind are not even read (no warning), and nothing is written beside them."""
    monkeypatch.setenv("PRISM_CACHE_DIR", str(tmp_path / "cache"))
    argv = ["compile", str(ROOT / "programs" / "swiglu.prism"), "--dims", "n=4,d=64", "--arch", "none", "--no-emulate"]
    assert main([*argv, "-o", str(tmp_path / "a")]) == 0
    entries = sorted(p for p in (tmp_path / "cache").rglob("*.json") if p.parent.name in ("tuning", "search"))
    assert any(p.parent.name == "tuning" for p in entries)
    for p in entries:
        p.write_text("junk")
    capsys.readouterr()
    assert main([*argv, "-o", str(tmp_path / "b"), "--no-cache"]) == 0
    assert "ignoring cache entry" not in capsys.readouterr().err
    after = sorted(p for p in (tmp_path / "cache").rglob("*.json") if p.parent.name in ("tuning", "search"))
    assert after == entries and all(p.read_text() == "junk" for p in after)
    # As written (--search none) too: the tuning of the program itself neither reads the database nor adds to it.
    assert main([*argv, "-o", str(tmp_path / "c"), "--search", "none", "--no-cache"]) == 0
    assert "ignoring cache entry" not in capsys.readouterr().err
    assert sorted(p for p in (tmp_path / "cache").rglob("*.json") if p.parent.name == "tuning") == \
        [p for p in entries if p.parent.name == "tuning"]
    assert main([*argv, "-o", str(tmp_path / "d"), "--search", "none"]) == 0  # (and without it, it does both)
    assert "ignoring cache entry" in capsys.readouterr().err
    assert any(p.read_text() != "junk" for p in (tmp_path / "cache").rglob("tuning/*.json"))


def test_lora_reaches_one_kernel_with_the_adapter_product_after_the_loop(library):
    """X @ W + (X @ A) @ B: the base product and the adapter's first product accumulated in the same loop,
    the adapter's second product after it (B loaded for it), equal to the reference in the interpreter. At these
    small dims the model prefers the adapter merged into each block's slice of W, the blocks' parts of the
    contraction summed across a grid axis (`+=`, stored once in f16: backend/sums.py): one launch too."""
    src = program("lora")
    dims = dict(n=4, d=64, m=128, r=16)
    out = optimize(src, library, H100, bind_dims(src, dims))
    inputs = random_inputs(src, bind_dims(src, dims), seed=3)
    want = evaluate(src, inputs)["Y"]
    after = next(r for r in out.ranked if "acc_sum(xt @ wt) + acc_sum(xt @ at) @ bt" in print_program(r.program))
    for ranked in (after, out.best):
        text = print_program(ranked.program)
        assert custom_kernels(ranked.program) == 1 and len(kernels_of(ranked.program)) == 1, text
        got = evaluate(ranked.program, inputs, params=ranked.params)["Y"]
        assert np.allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())
    assert out.best.estimated_us <= after.estimated_us


@pytest.mark.parametrize("inputs, body", [  # (a residual alone: tests/test_sums.py, lowered as the search proves it)
    (", B1: f16[f], B2: f16[d]", "X + gelu_tanh(layer_norm(X, 1e-5) @ W1 + B1) @ W2 + B2"),  # GPT-2's MLP block
    ("", "tanh(relu(X + silu(X @ W1) @ W2))"),
], ids=["gpt2-block", "three-ops-after"])
def test_an_mlp_with_its_residual_is_one_launch(library, tmp_path, inputs, body):
    """An MLP and the element-wise work after it at decode: the MLP in one kernel, its blocks' parts of the
    down-projection summed across a grid axis, the work after it done as the sum is stored (`kernels.finishing`):
    one launch, where the program as written takes two or three. GPT-2's block (LayerNorm, biases) takes a kernel
    without a loop storing the intermediate sum (`Generator._no_loop`); three ops after the sum take a step past
    the limits (`reach.chain`). Equal to the reference."""
    path = tmp_path / "residual.prism"
    path.write_text(f"dims n = 4, d = 64, f = 256\nprogram res(X: f16[n, d], W1: f16[d, f], W2: f16[f, d]{inputs}) {{\n"
                    f"    Y = {body}\n    return Y\n}}\n")
    src = load(path).program()
    binding = bind_dims(src, {})
    out = optimize(src, library, H100, binding)
    lowered = lower(out.best.program)
    (kernel,) = kernels_of(lowered)
    assert [s.then is not None for s in kernel.stores] == [True], print_program(out.best.program)
    assert out.best.estimated_us < next(r for r in out.ranked if r.as_written).estimated_us
    inputs = random_inputs(src, binding, seed=3)
    got, want = evaluate(lowered, inputs, params=out.best.params)["Y"], evaluate(src, inputs)["Y"]
    assert np.allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())


@pytest.mark.parametrize("inputs, body", [
    ("", "rms_norm(X) @ W1 + rms_norm(X)"),
    (", W2: f16[d, d]", "relu(rms_norm(X) @ W1) * (rms_norm(X) @ W2) + rms_norm(X)"),
], ids=["linear", "gated"])
def test_a_residual_of_the_normalised_input_loads_the_input_again_in_one_kernel(library, tmp_path, inputs, body):
    """The normalised input added to its projection: the loop walks X's slices for the products and the norm, and
    the block's own columns of X are loaded again after it, divided by the accumulated norm (`_read_again`): one
    launch, where the program as written takes two; equal to the reference. A tile loaded again is read by
    element-wise work only: SwiGLU finds no program that redoes a product in every block over a piece of it."""
    path = tmp_path / "resnorm.prism"
    path.write_text(f"dims n = 4, d = 64\nprogram res(X: f16[n, d], W1: f16[d, d]{inputs}) {{\n"
                    f"    Y = {body}\n    return Y\n}}\n")
    src = load(path).program()
    binding = bind_dims(src, {})
    out = optimize(src, library, H100, binding, use_cache=False)
    (kernel,) = kernels_of(lower(out.best.program))
    text = print_program(out.best.program)
    assert not out.best.as_written, text
    xs = [load for load in kernel.loads if kernel.inputs[load.source].attr == "X"]
    assert len(xs) == 2 and sum(load.map.loop_dim() is not None for load in xs) == 1, text
    assert out.best.estimated_us < next(r for r in out.ranked if r.as_written).estimated_us
    inputs = random_inputs(src, binding, seed=3)
    got, want = evaluate(out.best.program, inputs, params=out.best.params)["Y"], evaluate(src, inputs)["Y"]
    assert np.allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())


def test_layer_norm_before_a_projection_reaches_one_kernel_with_four_accumulators(library):
    """GPT-2's MLP: LayerNorm, the first projection and GELU in one loop kernel (the product, the row means of X,
    their variance about the running mean, W1's column sums), storing the activation the second projection
    reads; equal to the reference in the interpreter, and estimated faster than the program as written. The
    variance as E[x^2] - E[x]^2 (the row means of X * X), which cancels on rows far from zero, is offered only
    where unsteady programs are asked for."""
    src = program("gpt2_mlp")
    dims = dict(n=4, d=64, f=128)
    inputs = random_inputs(src, bind_dims(src, dims), seed=3)
    want = evaluate(src, inputs)["Y"]
    for steady, variance in ((True, "acc_var_last(xt)"), (False, "acc_mean_last(xt * xt)")):
        out = optimize(src, library, H100, bind_dims(src, dims), config=SearchConfig(steady=steady))
        texts = [print_program(r.program) for r in out.ranked]
        assert any(variance in t for t in texts) is True, texts
        assert steady is not any("acc_mean_last(xt * xt)" in t for t in texts), texts
        four = next(r for r in out.ranked if variance in print_program(r.program))
        text = print_program(four.program)
        assert custom_kernels(four.program) == 1 and "Y = t3 @ W2" in text, text  # then a plain product
        for part in ("acc_sum(xt @ w1t)", "acc_mean_last(xt)", "acc_sum(sum(w1t, 0))", "gelu_tanh("):
            assert part in text, text
        written = next(r for r in out.ranked if r.as_written)
        assert four.estimated_us < written.estimated_us
        # faster still: the whole MLP in one kernel, each block's columns of the activation multiplied by its rows
        # of W2 and summed across blocks into Y (`+=`, in f16: backend/sums.py)
        (kernel,) = kernels_of(out.best.program)
        assert [s.add for s in kernel.stores] == [True], print_program(out.best.program)
        got = evaluate(lower(out.best.program), inputs, params=out.best.params)["Y"]
        assert np.allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())


def test_causal_attention_reaches_one_kernel_with_rope_and_the_mask_inside(library):
    """Prefill attention with RoPE on Q and K, K in its natural layout and a causal mask: one loop
    kernel (7 tiles) applies RoPE to the query and key tiles, masks the scaled scores by their places in
    the whole scores and folds them with online softmax, stopping at each block's last kept key tile;
    proved, equal to the reference in the interpreter, and estimated faster than the program as written."""
    src = program("causal_attention")
    dims = dict(b=1, h=2, q=32, kv=48, dh=16)  # keys past the queries: the diagonal is offset
    out = optimize(src, library, H100, bind_dims(src, dims), time_limit=120)
    text = print_program(out.best.program)
    assert custom_kernels(out.best.program) == 1 and len(kernels_of(out.best.program)) == 1, text
    for part in ("causal(", "rope(qt", "rope(kt", "transpose(rope(kt", "acc_softmax_out(", "acc_softmax_sum("):
        assert part in text, text
    inputs = random_inputs(src, bind_dims(src, dims), seed=3)
    got, want = evaluate(out.best.program, inputs, params=out.best.params)["O"], evaluate(src, inputs)["O"]
    assert np.allclose(got, want, rtol=1e-9, atol=1e-9)
    out = optimize(src, library, H100, src.default_binding())  # the suite's dims, from the checkpoint
    written = next(r for r in out.ranked if r.as_written)
    assert out.best.estimated_us < written.estimated_us / 2
    assert causal_loop(kernels_of(out.best.program)[0]) is not None  # it stops early
    # At prefill (64 query tiles per head), RoPE'd keys are made once by a kernel of their own rather than
    # in every query tile's loop, and the scale moved onto the query tile, computed before the loop.
    out = optimize(src, library, H100, bind_dims(src, dict(b=1, h=16, q=4096, kv=4096)))
    text = print_program(out.best.program)
    assert "t7 = rope(K, CK, SK)" in text and custom_kernels(out.best.program) == 1, text
    assert "causal(rope(qt, cqt, sqt) / 11.313708498984761 @ transpose(t7t, 3, 2))" in text, text
    one_kernel = min(r.estimated_us for r in out.ranked if len(kernels_of(lower(r.program))) == 1)
    assert out.best.estimated_us < 0.7 * one_kernel


def test_a_constant_scale_moves_onto_the_product_operand_the_loop_does_not_walk():
    """`q @ (transpose(k) / c)` with k walked by the loop becomes `(q / c) @ transpose(k)` (q is scaled once,
    before the loop), through transposes and products by a constant on either side; nothing moves where
    both operands or neither change with the loop, nor after the loop."""
    q = Node("tile", (), "qt", DType.F16, (sympy.Integer(64), sympy.Integer(16)))
    k = Node("tile", (), "kt", DType.F16, (sympy.Integer(32), sympy.Integer(16)))
    c = const(4.0)
    kt = build("transpose", [k], [0, 1])
    scaled = build("matmul", [q, build("div", [kt, c])])
    assert hoisted_scales(scaled, {k}, {}) is build("matmul", [build("div", [q, c]), kt])
    assert hoisted_scales(scaled, {q, k}, {}) is scaled
    assert hoisted_scales(scaled, set(), {}) is scaled
    assert hoisted_scales(scaled, {q}, {}) is scaled  # the scale is on q's partner already
    twice = build("matmul", [q, build("transpose", [build("mul", [c, build("div", [k, const(2.0)])])], [0, 1])])
    want = build("matmul", [build("mul", [c, build("div", [q, const(2.0)])]), kt])
    assert hoisted_scales(twice, {k}, {}) is want
    qt = build("transpose", [q], [0, 1])
    left = build("matmul", [build("mul", [k, c]), qt])  # the walked operand on the left
    hoisted = hoisted_scales(build("exp", [left]), {k}, {})
    assert hoisted is build("exp", [build("matmul", [k, build("mul", [qt, c])])])
    # After the loop an accumulator's value no longer changes: a product of it is left as it is.
    w = Node("tile", (), "wt", DType.F16, (sympy.Integer(32), sympy.Integer(8)))  # read after the loop
    after = build("matmul", [build("div", [build("acc_sum", [build("matmul", [q, kt])]), c]), w])
    assert hoisted_scales(after, {k}, {}) is after


def test_loop_values_may_be_as_long_as_the_program_writes_them():
    """Causal attention's scores (RoPE on both operands, a transpose, the scale, the product, the mask) are
    one loop value of 6 ops; programs with shorter values keep the floor of 3."""
    assert loop_ops(program("causal_attention")) == 6
    assert loop_ops(program("attention")) == loop_ops(program("rmsnorm_linear")) == 3


def test_a_single_row_still_gets_the_layer_norm_kernel(library, write):
    """With one row, a row's mean and its mean square are single numbers, always proportional: the
    pruning of proportional accumulators must not take them for one another."""
    src = load(write((ROOT / "programs" / "gpt2_mlp.prism").read_text()
                     .replace("dims n = 8, d = 768, f = 3072", "dims n = 1, d = 64, f = 128"))).program()
    out = optimize(src, library, H100, src.default_binding(), config=SearchConfig(steady=False))
    texts = [print_program(r.program) for r in out.ranked]
    assert any("acc_mean_last(xt * xt)" in t and "acc_sum(sum(w1t, 0))" in t for t in texts), texts


def test_a_program_that_loses_accuracy_the_input_keeps_is_left_out(library):
    """LayerNorm's variance as E[x^2] - E[x]^2 (the unsteady one-kernel form above): on rows of values around 1000 (f32; in
    f16 around 300) the kernel missed the reference by 6e-2 (1.3e-2) where the program as written kept 3e-5, and
    its check on standard-normal inputs passed. The search leaves such programs out (`Assembly.steady`: in float64
    on rows 1e6 from zero they lose 3.8e-5, the steady ones of every benchmark program at most 6e-14) and says so."""
    from prism_dsl.search.assembly import Assembly, far_inputs

    src = program("gpt2_mlp")
    result = searched(src, library)
    every = [print_program(p) for p in searched(src, library, SearchConfig(steady=False)).proved]
    moments = [t for t in every if "acc_mean_last(xt * xt)" in t]
    assert result.stats.pruned[Rejection.UNSTEADY] == len(moments) > 0
    assert sorted(map(print_program, result.proved)) == sorted(t for t in every if t not in moments)
    rows = far_inputs(src, {d.symbol: 4 for d in src.dims}, seed=2)["X"]
    spread = rows - rows.mean(axis=-1, keepdims=True)
    assert np.abs(rows).min() > 4e5 and np.abs(spread).max() < 10
    steady = Assembly(program("rmsnorm_linear"), library, H100, SearchConfig(), result.stats, 1)
    try:
        assert all(steady.steady(p) for p in searched(program("rmsnorm_linear"), library).proved)
    finally:
        steady.close()


def test_steadiness_puts_the_rows_of_a_transposed_tensor_far_from_zero_too(library, write):
    """LayerNorm over a transposed input: its rows are X's columns, which rows offset along X's last dim leave
    spread over both signs, so E[x^2] - E[x]^2 passed the screen, and on f32 columns around 1000 the kernel missed
    the reference by 8.8e-2 where the program as written kept 1.1e-4. A second set offsets each tensor as a whole
    (a product's right operand, a weight, kept as drawn: an offset there makes the input itself cancel)."""
    from prism_dsl.search.assembly import Assembly, far_inputs

    text = ("dims n = 4, d = 8, f = 4\nprogram p(X: f32[d, n], W: f32[d, f]) {{\n    T = transpose(X, -1, -2)\n"
            "    Y = {}\n    return Y\n}}\n")
    src = load(write(text.format("layer_norm(T, 1e-5) @ W"), "p.prism")).program()
    moments = load(write(text.format("(T - mean(T, -1)) / sqrt(mean(T * T, -1) - mean(T, -1) * mean(T, -1) + 1e-5) @ W"),
                         "m.prism")).program()
    deviations = load(write(text.format("(T - mean(T, -1)) / sqrt(mean(square(T - mean(T, -1)), -1) + 1e-5) @ W"),
                            "v.prism")).program()
    whole = far_inputs(src, {d.symbol: 4 for d in src.dims}, seed=2, whole=True)
    columns = whole["X"] - whole["X"].mean()
    assert np.abs(whole["X"]).min() > 4e5 and np.abs(columns).max() < 10 and np.abs(whole["W"]).max() < 10
    steady = Assembly(src, library, H100, SearchConfig(), Stats(), 1)
    try:
        assert not steady.steady(moments) and steady.steady(deviations)
    finally:
        steady.close()


@pytest.mark.parametrize("dtype, weights, steady", [("f32", "f32", False), ("f32", "f16", False), ("f16", "f16", True)])
def test_layer_norms_centring_moved_through_the_product_is_unsteady_in_f32_only(library, write, dtype, weights, steady):
    """X @ W - mean(X) * colsum(W) (GPT-2's fused form) loses 1.5e-10 in float64 on rows 1e6 from zero: under the
    1e-8 a program may lose, but in f32 arithmetic the kernel then missed an f32 check (2e-4) at rows 100 times
    their spread from zero where the program as written met it; and the check's widening for the kernels' own
    roundings counted that loss as theirs, passing it at 3000 where the program as written failed. f16 tensors
    cannot sit that far from zero and their checks allow 50 times more: the form stays steady there. An f32 input
    beside f16 weights can, under the f16 check (1e-2 over 2^29): unsteady too."""
    from prism_dsl.search.assembly import Assembly

    text = ("dims n = 4, d = 16, f = 8\nprogram p(X: {0}[n, d], W: " + weights + "[d, f]) {{\n    Y = {1}\n"
            "    return Y\n}}\n")
    src = load(write(text.format(dtype, "layer_norm(X, 1e-5) @ W"), "p.prism")).program()
    moved = load(write(text.format(dtype, "(X @ W - mean(X, -1) * sum(W, -2)) / sqrt(mean(square(X - mean(X, -1)), -1) "
                                          "+ 1e-5)"), "m.prism")).program()
    centred = load(write(text.format(dtype, "((X - mean(X, -1)) @ W) / sqrt(mean(square(X - mean(X, -1)), -1) + 1e-5)"),
                         "c.prism")).program()
    judge = Assembly(src, library, H100, SearchConfig(), Stats(), 1)
    try:
        assert judge.steady(moved) is steady and judge.steady(centred)
    finally:
        judge.close()


def test_rms_norm_with_a_gain_reaches_one_kernel_on_tensor_cores(library):
    """Llama's `(rms_norm(X, eps) * G) @ W`: the gain is applied to x's tile inside the loop, the product
    read from a 16-bit buffer on tensor cores, and the model ranks that kernel above the program as written."""
    src = program("llama_qkv")
    dims = dict(n=8, d=256, e=384)
    out = optimize(src, library, H100, bind_dims(src, dims))
    text = print_program(out.best.program)
    assert custom_kernels(out.best.program) == 1 and len(kernels_of(out.best.program)) == 1, text
    assert "acc_sum(gt * xt @ wt) / sqrt(acc_mean_last(xt * xt) + 1e-05)" in text, text
    written = next(r for r in out.ranked if r.as_written)
    assert out.best.estimated_us < written.estimated_us


LLAMA_MLP = """dims n = 8, d = 256, f = 384
program llama_mlp(X: f16[n, d], G: f16[d], Wg: f16[d, f], Wu: f16[d, f], Wd: f16[f, d]) {
    H = rms_norm(X, 1e-6) * G
    Y = X + (silu(H @ Wg) * (H @ Wu)) @ Wd
    return Y
}
"""


def test_a_residual_after_the_down_projection_runs_in_its_kernel_and_the_mlp_before_it_is_fused(library, write):
    """Llama's MLP with its residual: the norm, gain, gate and up products and SiLU in one loop kernel storing the
    intermediate, then the down projection with the residual added in its store. Under the default limits (one
    custom kernel, one pre-defined) that is three steps, the residual a step of the pre-defined kernel before it
    (`generate._epilogue`); and the intermediate kernel, found at two steps, is extended again at three (its
    dedupe is per depth: `Generator.stored`). Before either, the search found nothing to prove."""
    src = load(write(LLAMA_MLP)).program()
    result = searched(src, library)
    assert result.complete and result.proved, result.stats.as_dict()
    texts = [print_program(p) for p in result.proved]
    assert any("Y = X + t5 @ Wd" in t and custom_kernels(p) == 1 and len(kernels_of(p)) == 1
               and "silu(acc_sum(t0 @ wgt) / t1) * (acc_sum(t0 @ wut) / t1)" in t for p, t in zip(result.proved, texts)), texts
    out = optimize(src, library, H100, bind_dims(src, {}))
    written = next(r for r in out.ranked if r.as_written)
    assert not out.best.as_written and out.best.estimated_us < written.estimated_us


def test_accumulators_over_proportional_values_are_not_combined(library):
    """A product and its negation (or twice it) accumulated side by side is one accumulator scaled after
    the loop: the generator drops such pairs, so no candidate of QK-norm attention holds two sums."""
    from prism_dsl.search.abstract import saturate
    from prism_dsl.search.config import Stats
    from prism_dsl.search.generate import Generator, Sketch

    src = program("qk_norm_attention")
    stats = Stats()
    candidates = list(Generator(src, saturate(src, library), SearchConfig(), stats).candidates())
    assert candidates and stats.pruned[Rejection.DUPLICATE] > 0
    for cand in candidates:
        for step in cand.steps:
            if isinstance(step, Sketch):
                sums = [n for out in step.outputs for n in out.walk() if n.op == "acc_sum"]
                assert len(set(sums)) <= 1, step.outputs


def test_pruning_loses_nothing(library):
    """With expression-guided pruning off (small limits), every proved program is also found with it on."""
    src = program("rmsnorm_linear")
    small = dict(max_kernels=1, max_predefined=0, max_accumulators=2, max_block_ops=4)
    on = searched(src, library, SearchConfig(**small))
    off = search(src, library, H100, SearchConfig(**small, expression_pruning=False), jobs=2)
    assert on.complete and off.complete
    found_on = {print_program(p) for p in on.proved}
    found_off = {print_program(p) for p in off.proved}
    assert found_off and found_off <= found_on
    assert on.stats.pruned[Rejection.EXPRESSION] > 0 and off.stats.pruned[Rejection.EXPRESSION] == 0
    assert off.stats.generated > on.stats.generated - on.stats.pruned[Rejection.EXPRESSION]


def test_a_crashing_prover_is_an_error_not_a_failed_proof(library, monkeypatch):
    """A proof that raises (its egglog worker died, say) is reported with its message, is not counted as
    "unproved", and the search goes on: every other program is still proved and returned."""
    from prism_dsl.search.assembly import Prover

    src = program("rmsnorm_linear")
    config = SearchConfig(max_kernels=1, max_predefined=0, max_accumulators=2, max_block_ops=4)
    clean = searched(src, library, config)
    assert len(clean.proved) >= 2 and not clean.stats.errors
    victim, real = print_program(clean.proved[0]), Prover.prove

    def prove(self, candidate):
        if print_program(candidate) == victim:
            raise RuntimeError("the egglog worker stopped (exit code -9)")
        return real(self, candidate)

    monkeypatch.setattr(Prover, "prove", prove)
    crashed = search(src, library, H100, config, jobs=2)
    assert crashed.complete and crashed.stats.errors == ["RuntimeError: the egglog worker stopped (exit code -9)"]
    assert crashed.stats.as_dict()["errors"] == crashed.stats.errors  # report.json's search section shows it
    assert crashed.stats.pruned[Rejection.UNPROVED] == clean.stats.pruned[Rejection.UNPROVED]
    assert crashed.stats.proved == clean.stats.proved - 1
    assert [print_program(p) for p in crashed.proved] == [print_program(p) for p in clean.proved[1:]]


def test_search_is_deterministic(library):
    src = program("swiglu")
    a = searched(src, library)  # jobs=2
    b = search(src, library, H100, jobs=1)
    assert [print_program(p) for p in a.proved] == [print_program(p) for p in b.proved]


@pytest.mark.fresh
def test_checkpoint_and_tuning_database_are_reused(library, monkeypatch, tmp_path, capsys):
    src = program("rmsnorm_linear")
    binding = bind_dims(src, dict(n=4, d=64))
    first = optimize(src, library, H100, binding)
    assert not first.from_checkpoint and first.search["complete"]

    def no_search(*a, **k):
        raise AssertionError("searched again")

    def no_tuning(*a, **k):
        raise AssertionError("tuned again")

    with monkeypatch.context() as m:
        m.setattr("prism_dsl.pipeline.optimize.search", no_search)
        m.setattr(tuning, "tune", no_tuning)
        again = optimize(src, library, H100, binding)
    assert again.from_checkpoint
    assert print_program(again.best.program) == print_program(first.best.program)
    # report.json's search record has the same keys either way (a reader of one reads the other)
    assert set(again.search) == set(first.search), set(again.search) ^ set(first.search)
    assert again.search["errors"] == [] and again.search["input_egraph"] == {} and first.search["input_egraph"]
    assert again.best.params == first.best.params
    # New dims: the checkpoint is reused, only tuning runs, and a terminal's status line says how far it is.
    with monkeypatch.context() as m:
        m.setattr("prism_dsl.pipeline.optimize.search", no_search)
        m.setattr(sys.stderr, "isatty", lambda: True)
        other = optimize(src, library, H100, bind_dims(src, dict(n=8, d=128)), progress=True)
    assert other.from_checkpoint
    line = capsys.readouterr().err
    assert re.search(r"\r\x1b\[2Ktuning: 0 of [1-9][0-9]* programs; [0-9.]+ s", line) and line.endswith("\r\x1b[2K"), line
    # Other rules: the checkpoint no longer applies.
    extra = tmp_path / "extra.rules"
    extra.write_text("ruleset algebra {\n    rule mul_one_right: a * 1 => a\n}\n")
    changed = optimize(src, library + load_library([extra]), H100, binding)
    assert not changed.from_checkpoint


@pytest.mark.fresh
def test_corrupt_cache_entries_are_reported_once_and_ignored(library, cache_dir, capsys):
    src = program("rmsnorm_linear")
    binding = bind_dims(src, dict(n=4, d=64))
    optimize(src, library, H100, binding)
    for f in (cache_dir / "search").glob("*.json"):
        f.write_text("{not json")
    for f in (cache_dir / "tuning").glob("*.json"):
        f.write_text(json.dumps({"key": "someone else's", "value": 1}))
    out = optimize(src, library, H100, binding)
    assert not out.from_checkpoint and not out.best.as_written
    err = capsys.readouterr().err
    assert "ignoring cache entry" in err and "unreadable" in err


def test_time_limit_and_interruption_return_the_best_so_far(library):
    src = program("attention")
    binding = bind_dims(src, BINDINGS["attention"][0])
    # Stopped before anything is proved: the program as written, reported as such, never a guess.
    stop = threading.Event()
    stop.set()
    out = optimize(src, library, H100, binding, stop_event=stop, use_cache=False)
    assert out.best.as_written and not out.search["complete"] and out.search["stopped"] == "interrupted"
    # A limit that lets some proofs finish: whatever is returned was proved.
    cut = searched(src, library)
    assert cut.complete and cut.proved
    calls = []

    def stop_after_first(phase, stats):
        calls.append(stats.proved)
        if stats.proved:
            stop.set()

    stop.clear()
    part = search(src, library, H100, jobs=2, stop_event=stop, progress=stop_after_first)
    assert part.proved and all(print_program(p) in {print_program(q) for q in cut.proved} for p in part.proved)


def test_compile_searches_by_default(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["compile", str(ROOT / "programs" / "rmsnorm_mlp.prism"), "-o", str(out), "--dims", "n=4,d=64",
                 "--arch", "none", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verified"] and report["proved"] and report["best"] == "best.prism"
    assert report["kernels_in_best"] == 1 and not report["best_is_input"]
    assert report["search"]["proved_programs"] >= 1 and "pruned" in report["search"]
    assert report["alternatives"][0]["rank"] == 1 and isinstance(report["search_seconds"], float)
    assert "search_seconds" not in report["search"]  # the report's own key, not the search record's too
    best = (out / "best.prism").read_text()
    # prove and run accept the chosen program
    assert main(["prove", str(ROOT / "programs" / "rmsnorm_mlp.prism"), str(out / "best.prism")]) == 0
    assert main(["run", str(out / "best.prism"), "--dims", "n=4,d=64", "--out", str(tmp_path / "y.npz")]) == 0
    assert "kernel fused" in best


def test_compile_rejects_grid_with_search(tmp_path, capsys):
    code = main(["compile", str(ROOT / "programs" / "swiglu.prism"), "-o", str(tmp_path / "o"), "--grid", "x=2"])
    assert code != 0
    assert "--search none" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_between_equal_estimates_the_program_that_keeps_more_sms_busy_is_chosen(monkeypatch):
    """FlashDecoding forms that split the keys over 32 blocks or over 256 are priced alike where both stream
    at the model's bandwidth; the one with more blocks is ranked first, then the program as written. Sums of
    kernel times that differ only in their last bits (30.3 - 20.2 - 0.1) are equal."""
    from prism_dsl.pipeline import optimize as opt

    fast, few, many, same, written = "fast", "few", "many", "same", "written"
    table = {fast: (9.0, 8), few: (10.0, 40), many: (30.3 - 20.2 - 0.1, 132), same: (10.0, 64), written: (10.0, 64)}
    monkeypatch.setattr(opt, "rank", lambda p, *_: opt.Ranked(p, {}, *table[p]))
    ranked, _ = opt.choose_ranked(written, [few, same, many, fast], opt.Choosing({}, H100), None)
    assert [r.program for r in ranked] == [fast, many, written, same, few]


def test_measured_tuning_picks_the_fastest_checked_program_and_is_remembered(library):
    """On a GPU the best few by the model (and the best of each other shape) are timed; a program that
    disagrees is never chosen; the fastest is timed again with the model's next choices of its kernel
    parameters, and the fastest of those is kept; a repeated compile on the same GPU does no timing. (The GPU is
    stood in for by a function here.)"""
    src = program("rmsnorm_linear")
    binding = bind_dims(src, dict(n=4, d=64))
    by_model = optimize(src, library, H100, binding).ranked
    assert len(by_model) >= MEASURED
    first, second, third = (print_program(r.program) for r in by_model[:MEASURED])
    modelled = by_model[2].params  # the model's parameters for the third
    calls = []

    def fake_gpu(prog, params, codegen):
        text = print_program(prog)
        calls.append((text, dict(params), codegen.threads))
        if text == first:
            return Measurement(None, "disagreed with the reference (y: max rel err 1.00e+00)")
        if text == third:  # the fastest program, and faster still with other parameters than the model's
            return Measurement(5.0 if params == modelled else 4.0 + 0.1 * len(calls), "checked")
        return Measurement(9.0, "checked")

    # The best three by the model, and the best of every other shape (here the program as written).
    picked = to_measure(by_model)
    assert [print_program(r.program) for r in picked[:MEASURED]] == [first, second, third]
    assert any(r.as_written for r in picked[MEASURED:])
    out = optimize(src, library, H100, binding, measure=fake_gpu, device="Fake GPU, sm_90, driver 1")
    mine = [c for c in calls if c[0] == third]  # its own parameters first, then the choices
    assert sorted(c[0] for c in calls if c not in mine[1:]) == sorted(print_program(r.program) for r in picked)
    threads = {print_program(r.program): r.codegen(CodegenConfig()).threads for r in by_model}  # the model's
    assert all(c[2] == threads[c[0]] for c in calls if c[0] != third)
    own = threads[third]
    assert mine[0] == (third, modelled, own)
    others = [c[1] for c in mine if c[1] != modelled]  # other parameters, each timed once
    assert mine[-1] == (third, modelled, 2 * own)  # and its own at twice the threads, last
    assert len(mine) == PARAMETER_CHOICES and len(others) == PARAMETER_CHOICES - 2
    assert all(others.count(p) == 1 for p in others)
    assert print_program(out.best.program) == third and out.best.params == others[0]
    assert out.best.codegen(CodegenConfig()).threads == own
    assert out.best.measured_us == min(4.0 + 0.1 * (calls.index((third, p, own)) + 1) for p in others)
    assert [(t["params"], t["threads"]) for t in out.best.timed] == [(modelled, own), *((p, own) for p in others),
                                                                     (modelled, 2 * own)]
    assert out.best.timed[0]["measured_us"] == 5.0 and all(t["measurement"] == "checked" for t in out.best.timed)
    assert print_program(out.ranked[-1].program) == first  # the one that disagreed comes last
    assert out.search["measured"]["timed"] == len(calls) and len(out.search["measured"]["failed"]) == 1
    timed = len(calls)
    calls.clear()
    again = optimize(src, library, H100, binding, measure=fake_gpu, device="Fake GPU, sm_90, driver 1")
    assert calls == [] and again.search["measured"]["from_database"] == timed
    assert print_program(again.best.program) == third and again.best.params == out.best.params
    # Another GPU or driver is timed afresh; a failure to build or run is not remembered (nor, with no program
    # timed, are other parameters tried).
    optimize(src, library, H100, binding, device="Fake GPU, sm_90, driver 2",
             measure=lambda p, q, c: calls.append(1) or Measurement(None, "could not be built", lasting=False))
    assert len(calls) == len(picked)
    calls.clear()
    optimize(src, library, H100, binding, device="Fake GPU, sm_90, driver 2", measure=fake_gpu)
    assert len(calls) == timed


@pytest.fixture
def emulated_gpu(monkeypatch):
    """`--rank measure` on a CPU: the GPU check is the C++ emulation of the generated code, timed as the
    model estimates. Everything around it (search, tuning database, report) is the real path."""
    from prism_dsl.pipeline import build
    from prism_dsl.pipeline.report import Check
    from prism_dsl.pipeline.compile import launch_estimate
    from prism_dsl.backend import cuda_runtime

    if not emulate.compiler():
        pytest.skip("no C++ compiler (g++ or clang++) to emulate the generated code")
    seen = []

    def check_gpu(built, directory, seed, repeat=100):
        seen.append(sorted(p.name for p in Path(directory).iterdir()))
        checked = build.check_emulated(built, seed)
        result = {f: getattr(checked, f) for f in Check.__dataclass_fields__}
        us = sum(e.time_us for e in built.estimates)
        return build.GpuCheck(**result, device="emulated", timing_ms={"median_ms": us / 1000, "host_bound": False},
                              kernels_ms={k.name: {"median_ms": launch_estimate(built, k)["time_us"] / 1000}
                                          for k in built.kernels})

    monkeypatch.setattr(cuda_runtime, "gpu_status", lambda: (True, "Emulated GPU"))
    monkeypatch.setattr(cuda_runtime, "device_identity", lambda: "Emulated GPU, sm_90, driver 0")
    monkeypatch.setattr(build, "check_gpu", check_gpu)
    return seen


def test_compile_rank_measure_times_the_best_few(tmp_path, capsys, emulated_gpu, monkeypatch):
    from prism_dsl.pipeline import measuring

    monkeypatch.setattr(measuring, "PARAMETER_CHOICES", 1)  # the programs alone (their parameters: tests below)
    out = tmp_path / "out"
    args = ["compile", str(ROOT / "programs" / "swiglu.prism"), "-o", str(out), "--dims", "n=4,d=64",
            "--arch", "none", "--rank", "measure", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    measured = report["search"]["measured"]
    assert measured["device"] == "Emulated GPU, sm_90, driver 0" and measured["timed"] >= MEASURED
    assert not measured["failed"] and report["verified"] and report["checked"]["gpu"]["passed"]
    timed = [a for a in report["alternatives"] if a["measured_us"] is not None]
    assert len(timed) >= MEASURED and all(a["measurement"] == "checked" for a in timed)
    assert report["alternatives"][0]["measured_us"] == min(a["measured_us"] for a in timed)
    # every measurement built the kernels it ran
    assert all("prism.cuh" in files and any(f.endswith(".cu") for f in files) for files in emulated_gpu)
    # The same compile again: the tuning database answers, nothing is timed but the final check.
    emulated_gpu.clear()
    assert main(args) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["search"]["measured"]["timed"] == 0
    assert again["search"]["measured"]["from_database"] == measured["timed"]
    assert len(emulated_gpu) == 1 and again["alternatives"][0]["program"] == report["alternatives"][0]["program"]


def test_a_host_bound_time_ranks_its_program_but_is_not_kept(tmp_path, capsys, emulated_gpu, monkeypatch):
    """A time the host's queueing is in (`cuda_runtime.Ahead` could not get ahead) still ranks its program, says so,
    and stays out of the tuning database, so that the next compile times it again."""
    import dataclasses

    from prism_dsl.pipeline import build, measuring

    monkeypatch.setattr(measuring, "PARAMETER_CHOICES", 1)  # the programs alone (their parameters: tests below)
    emulated = build.check_gpu

    def host_bound(*args):
        gpu = emulated(*args)
        return dataclasses.replace(gpu, timing_ms={**gpu.timing_ms, "host_bound": True})

    monkeypatch.setattr(build, "check_gpu", host_bound)
    monkeypatch.setenv("PRISM_CACHE_DIR", str(tmp_path / "cache"))  # no time of another test's to reuse
    assert main(["compile", str(ROOT / "programs" / "swiglu.prism"), "-o", str(tmp_path / "out"), "--dims",
                 "n=4,d=64", "--arch", "none", "--rank", "measure", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    timed = [a for a in report["alternatives"] if a["measured_us"] is not None]
    assert report["search"]["measured"]["timed"] >= MEASURED and report["checked"]["gpu"]["timing_ms"]["host_bound"]
    assert timed and all(a["measurement"].startswith("checked; host-bound") for a in timed)
    assert report["alternatives"][0]["measured_us"] == min(a["measured_us"] for a in timed)
    assert (tmp_path / "cache" / "search").is_dir() and not (tmp_path / "cache" / "measured").exists()


def test_compile_as_written_rank_measure_builds_its_fastest_parameters(tmp_path, capsys, monkeypatch):
    """With --search none, --rank measure times the model's choices of the program's kernel parameters (its own
    first, then other numbers of blocks, then its own at twice the threads) and builds the fastest that agreed;
    one that disagreed is listed, never built. The GPU is stood in for: first a program built with fewer blocks
    runs faster and one with 32 disagrees; then (on another driver) one of 256 threads runs fastest."""
    from prism_dsl.pipeline import build
    from prism_dsl.backend import cuda_runtime

    fastest_by = {"blocks": lambda blocks, threads: blocks / 1000,
                  "threads": lambda blocks, threads: 1.0 if threads == 128 else 0.5}
    by = "blocks"

    def check_gpu(built, directory, seed, repeat=100):
        blocks, threads = sum(e.blocks for e in built.estimates), built.kernels[0].block[0]
        ok = blocks != 32 or by != "blocks"
        ms = fastest_by[by](blocks, threads)
        return build.GpuCheck(ok, 0.01, seed, "input program", {"Y": {"passed": ok, "max_rel_err": 1e-4 if ok else 1.0}},
                              "Fake GPU", {"median_ms": ms, "host_bound": False},
                              {k.name: {"median_ms": ms} for k in built.kernels})

    monkeypatch.setattr(cuda_runtime, "gpu_status", lambda: (True, "Fake GPU"))
    monkeypatch.setattr(cuda_runtime, "device_identity", lambda: f"Fake GPU, sm_90, {by}")
    monkeypatch.setattr(build, "check_gpu", check_gpu)
    monkeypatch.setenv("PRISM_CACHE_DIR", str(tmp_path / "cache"))
    args = ["compile", str(ROOT / "programs" / "fused" / "rmsnorm_linear.prism"), "-o", str(tmp_path / "out"),
            "--dims", "n=4,d=256", "--search", "none", "--arch", "none", "--no-emulate", "--rank", "measure"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    timed = report["parameters_timed"]
    assert len(timed) == PARAMETER_CHOICES and len({json.dumps(t) for t in timed}) == len(timed)
    assert [t["threads"] for t in timed] == [128] * (PARAMETER_CHOICES - 1) + [256]
    assert timed[-1]["params"] == timed[0]["params"]  # the model's own, at twice the threads
    agreed = [t for t in timed if t["measured_us"] is not None]
    fastest = min(agreed, key=lambda t: t["measured_us"])
    assert report["parameters"] == fastest["params"] != timed[0]["params"] and report["checked"]["gpu"]["passed"]
    assert report["measured_us"] == fastest["measured_us"] and report["verified"]
    assert report["codegen"]["threads"] == 128 and report["kernels"][0]["block"][0] == 128
    assert timed[0]["estimated_us"] == min(t["estimated_us"] for t in timed[:-1])  # the model's first
    assert any(t["measured_us"] is None and t["measurement"].startswith("disagreed") for t in timed)  # 32 blocks
    # In words; and a repeated compile times nothing but the chosen program's own check.
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "kernel parameters timed (the fastest that agreed is built):" in out
    assert f"measured {fastest['measured_us']} us" in out and ", --threads 256: estimated" in out
    # Where the wider blocks run fastest, they are built.
    by = "threads"
    assert main([*args, "--json"]) == 0
    wide = json.loads(capsys.readouterr().out)
    assert wide["parameters"] == wide["parameters_timed"][0]["params"] and wide["measured_us"] == 500.0
    assert wide["codegen"]["threads"] == 256 and wide["kernels"][0]["block"][0] == 256
    # Parameters given are built as given: nothing else is timed.
    assert main([*args, "--json", "--grid", "x=4"]) == 0
    given = json.loads(capsys.readouterr().out)
    assert given["parameters_timed"] == [] and given["parameters"]["gx"] == 4


@pytest.mark.gpu
@pytest.mark.skipif(not GPU[0], reason=GPU[1])
def test_compile_rank_measure_on_the_gpu(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["compile", str(ROOT / "programs" / "attention.prism"), "-o", str(out), "--dims",
                 "b=1,h=2,q=2,kv=64,dh=16", "--rank", "measure", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verified"] and report["checked"]["gpu"]["passed"] and report["measured_us"] > 0
    assert report["search"]["measured"]["timed"] >= MEASURED and not report["search"]["measured"]["failed"]


def test_flash_decoding_split_is_generated_proved_and_compiles(library, tmp_path, capsys, monkeypatch):
    """A loop kernel with online softmax is also split in two (partial results over S pieces of the keys,
    then a combining kernel with acc_rescaled_sum); every such program is proved, agrees with the
    reference with the pieces above 1, and its generated code passes the emulation."""
    from prism_dsl.kernels.params import complete

    src = program("attention")
    dims = BINDINGS["attention"][0]
    result = searched(src, library)
    splits = [p for p in result.proved if custom_kernels(p) == 2]
    assert splits and len(splits) < len(result.proved)
    inputs = random_inputs(src, bind_dims(src, dims), seed=5)
    want = evaluate(src, inputs)["O"]
    for p in splits:
        text = print_program(p)
        assert "acc_rescaled_sum" in text and "acc_max_last" in text and "exp" not in text
        partial, combine = kernels_of(p)
        pieces = partial.grid[-1][1]
        assert combine.loop == pieces  # the combining loop walks the pieces the first kernel's grid made
        params = complete(p, bind_dims(p, dims), {pieces.name: 4}, H100, prefer="split")
        got = evaluate(p, inputs, params=params)["O"]
        assert np.allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())
    # Keys too long for the pre-defined softmax's row in shared memory (131072 f16 scores, 256 KiB): the
    # program as written cannot run (its scores are of rank 4, which no softmax in two kernels takes:
    # `lower._long`), the proved programs can.
    with monkeypatch.context() as m:
        m.setattr("prism_dsl.pipeline.optimize.search", lambda *a, **k: result)
        long = optimize(src, library, H100, bind_dims(src, dict(b=1, h=1, q=1, kv=131072, dh=8)))
    assert long.search["as_written_fits"] is False and not long.best.as_written
    path = tmp_path / "split.prism"
    path.write_text(print_program(splits[0]))
    pieces = kernels_of(splits[0])[0].grid[-1][1].name
    assert main(["compile", str(path), "-o", str(tmp_path / "out"), "--search", "none", "--arch", "none",
                 "--dims", ",".join(f"{k}={v}" for k, v in dims.items()), "--grid", f"{pieces}=4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # one launch: each tile's last block combines its pieces (`tails`)
    assert report["parameters"][pieces] == 4 and len(report["kernels"]) == 1
    assert report["kernels"][0]["estimate"]["combines"]["kernel"] == kernels_of(splits[0])[1].name
    if emulate.compiler():
        assert report["checked"]["emulation"]["passed"] and report["verified"]


def test_split_only_where_pieces_combine(library):
    from prism_dsl.kernels.params import complete

    src = program("rmsnorm_linear")
    found = searched(src, library).proved
    splits = [p for p in found if custom_kernels(p) == 2]
    # The fused kernel splits too: each piece's mean of squares (or root mean square) is combined by the
    # same accumulator over the pieces (equal pieces: the mean of means is the mean); the kernel that
    # accumulates the product alone (after a pre-defined rms_norm) splits as split-K with a combining
    # kernel instead of += stores.
    texts = [print_program(p) for p in splits]
    assert any("acc_mean_last(t2_meant)" in t for t in texts) and any("acc_rms_last(t2_rmst)" in t for t in texts)
    assert any("rms_norm(X)" in t for t in texts)
    dims = BINDINGS["rmsnorm_linear"][0]
    inputs = random_inputs(src, bind_dims(src, dims), seed=2)
    want = evaluate(src, inputs)["Y"]
    for p in splits:
        assert "= acc_sum(t" in print_program(p)  # the combining loop sums the partial products
        pieces = kernels_of(p)[0].grid[-1][1].name
        got = evaluate(p, inputs, params=complete(p, bind_dims(p, dims), {pieces: 4}, H100, prefer="split"))["Y"]
        assert np.allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())
    off = searched(program("attention"), library, SearchConfig(split_reductions=False))
    assert off.proved and all(custom_kernels(p) == 1 for p in off.proved)


def test_compile_no_split(library, tmp_path, capsys):
    dims = ",".join(f"{k}={v}" for k, v in BINDINGS["attention"][1].items())
    assert main(["compile", str(ROOT / "programs" / "attention.prism"), "-o", str(tmp_path / "o"), "--dims", dims,
                 "--arch", "none", "--no-split", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verified"] and not any("combine" in a["program"] for a in report["alternatives"])
    # the search it saved is the one without splits
    src = program("attention")
    again = optimize(src, library, H100, bind_dims(src, BINDINGS["attention"][1]),
                     config=SearchConfig(split_reductions=False))
    assert again.from_checkpoint and again.search["proved_programs"] == report["search"]["proved_programs"]


def test_forked_rankers_give_the_ranking_one_process_gives(library, monkeypatch, capsys):
    """`--jobs 2` tunes the proved programs in two forked processes (`optimize.rankers`): the same programs,
    parameters and estimates, in the same order, as one process, and the same warnings, printed by this one.
    (A test runner's own threads would make it rank in one process, as it must with other threads running;
    they are out of this child's way.)"""
    from prism_dsl.pipeline import optimize as opt

    src = program("rmsnorm_linear")
    binding = bind_dims(src, dict(n=8, d=128))
    optimize(src, library, H100, bind_dims(src, dict(n=4, d=64)), jobs=1)  # the checkpoint
    shutil.rmtree(Path(os.environ["PRISM_CACHE_DIR"]) / "tuning")  # from here, the entries of these dims only
    one = optimize(src, library, H100, binding, jobs=1, use_cache=True)
    # every tuning entry broken: tuned again in the forked processes, each warning printed here, once
    entries = sorted((Path(os.environ["PRISM_CACHE_DIR"]) / "tuning").rglob("*.json"))
    for entry in entries:
        entry.write_text("{")
    pools = []
    rankers = opt.rankers

    @contextlib.contextmanager
    def spy(programs, how, jobs):
        with rankers(programs, how, jobs) as futures:
            pools.append(futures)
            yield futures

    monkeypatch.setattr(opt.threading, "active_count", lambda: 1)
    monkeypatch.setattr(opt, "rankers", spy)
    capsys.readouterr()
    two = optimize(src, library, H100, binding, jobs=2)
    assert pools and None not in pools and two.from_checkpoint

    def ranking(outcome):
        return [(print_program(r.program), r.params, r.estimated_us, r.busy, r.as_written) for r in outcome.ranked]

    assert ranking(two) == ranking(one)
    err = capsys.readouterr().err
    assert entries and all(err.count(f"ignoring cache entry {entry}:") == 1 for entry in entries), err
    # A program whose tuning raises in a forked process is ranked again in this one.
    parent, real = os.getpid(), opt.rank

    def raising_there(p, *rest):
        if os.getpid() != parent:
            raise RuntimeError("only in a forked ranker")
        return real(p, *rest)

    monkeypatch.setattr(opt, "rank", raising_there)
    shutil.rmtree(Path(os.environ["PRISM_CACHE_DIR"]) / "tuning")
    assert ranking(optimize(src, library, H100, binding, jobs=2)) == ranking(one)
    monkeypatch.setattr(opt, "rank", real)
    # A forked process that dies breaks the pool: what it had not given back is ranked in this one.
    monkeypatch.setattr(opt, "_rank_forked", _die)
    shutil.rmtree(Path(os.environ["PRISM_CACHE_DIR"]) / "tuning")
    assert ranking(optimize(src, library, H100, binding, jobs=2)) == ranking(one)
    monkeypatch.setattr(opt.threading, "active_count", lambda: 3)
    with opt.rankers([src, src], opt.Choosing(binding, H100), 2) as futures:
        assert futures is None  # other threads: one process ranks


def test_an_error_while_the_rankers_run_stops_them_at_once(monkeypatch):
    """An error in this process while forked rankers tune (the input program refused by its own ranking, say, or
    Ctrl-C) stops every ranker and is raised, never a wait: the handler `prismc` sets for SIGTERM (raise
    SystemExit), which a fork inherits, does not keep a ranker alive."""
    from prism_dsl.pipeline import optimize as opt
    src = load(ROOT / "programs" / "rmsnorm_linear.prism").program()
    binding = bind_dims(src, {"n": 64, "d": 512})
    monkeypatch.setattr(opt, "rank", lambda *a: time.sleep(60))  # rankers busy far past the test
    def stop(signum, frame):
        raise SystemExit(128 + signum)

    def too_long(signum, frame):
        raise TimeoutError("the rankers were not stopped")

    old_term, old_alarm = signal.signal(signal.SIGTERM, stop), signal.signal(signal.SIGALRM, too_long)
    signal.alarm(30)
    try:
        started = time.perf_counter()
        with pytest.raises(ValueError, match="refused here"):
            with opt.rankers([src, src, src], opt.Choosing(binding, H100), 2) as futures:
                assert futures is not None
                time.sleep(0.5)  # every ranker inside `rank`
                raise ValueError("refused here")
        assert time.perf_counter() - started < 20 and not multiprocessing.active_children()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGALRM, old_alarm)


def _die(i: int) -> None:
    """A forked ranker that dies (pickled by name, as the real one is)."""
    os._exit(3)


@pytest.mark.parametrize("body, stable", [
    ("Y = softmax(X) @ V", True),
    ("E = exp(X - max(X, -1))\n    Y = (E / sum(E, -1)) @ V", True),  # a softmax written out: its exp is shifted
    ("Y = exp(X) @ V", False),  # the input overflows where its exp does: nothing is asked
    ("E = exp(X - max(X, -1))\n    Y = (E / sum(E, -1)) @ V + exp(X) @ V", False),
    ("Y = sigmoid(X) @ V", False),
])
def test_a_softmax_written_out_asks_for_the_stable_form_as_softmax_does(body, stable):
    """`exp_sub` turns exp(x - max(x)) / sum(...) back into exp(x) / sum(exp(x)): chosen so, a kernel gave NaN for
    rows of values around 100 where the program as written gave its softmax (f32; f16 alike), and its check on
    standard-normal inputs passed. A program whose every exp is of a max-shifted value asks for the stable form."""
    from prism_dsl.search.generate import asks_stable

    text = f"dims n = 16, d = 256, m = 64\nprogram p(X: f32[n, d], V: f32[d, m]) {{\n    {body}\n    return Y\n}}\n"
    assert asks_stable(load("p.prism", text).program()) is stable


def test_dims_named_as_kernel_parameters_are_not_taken_for_them(library):
    """A dim named F (or gx, gy) was the loop range (the grid size) of every kernel the search or the lowering
    built: the search kept 2 of its 13 programs, and `--search none` found no valid parameters ('d/F_Y = 64/3')
    for a matmul whose loop range took a dim's value. Kernel parameters are named apart from the dims."""
    def program(dims: str, x: str, w: str):
        return load("r.prism", f"dims {dims}\nprogram r(X: f16[{x}], W: f16[{w}]) {{\n"
                    "    Y = rms_norm(X) @ W\n    return Y\n}\n").program()

    clash = searched(program("gy = 8, gx = 256, F = 3", "gy, gx", "gx, gx"), library)
    plain = searched(program("n = 8, d = 256, f = 3", "n, d", "d, d"), library)
    assert len(clash.proved) == len(plain.proved) >= 10
    dims = {"gy", "gx", "F"}
    assert all(s.name not in dims for p in clash.proved for s in free_symbols(p))
    lowered = lower(program("n = 8, d = 64, F_Y = 3", "n, d", "d, F_Y"))  # matmul_Y's loop range was F_Y
    assert [d.name for d in lowered.dims] == ["n", "d", "F_Y"] and "F_Y" not in {s.name for s in free_symbols(lowered)}
    assert "loop(F_Y_2)" in print_program(lowered)
