"""Custom kernels: the fused programs (checked, proved, run by the block interpreter), the layout
translation, constraints and instantiation, kernel errors, and `prismc show`."""

from __future__ import annotations

import json

import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import sympy

from prism_dsl.backend import emulate
from prism_dsl.base.errors import PrismError
from prism_dsl.lang.check import load
from prism_dsl.cli.main import main
from prism_dsl.prove.egglog_runner import Limits
from prism_dsl.kernels.constraints import _bound, instantiate, shared_memory, shared_memory_at
from prism_dsl.kernels.hardware import load_hardware
from prism_dsl.ir.nodes import DType, Node
from prism_dsl.kernels.kernel import (SUM, WHOLE, SymbolicMap, free_symbols, kernels_of, output_shape, storage, stored_dtype,
                                     tile_shape)
from prism_dsl.kernels.params import choose
from prism_dsl.kernels.sizes import int_value, value
from prism_dsl.kernels.position import _end, causal_loop, ends_sum, floor_sum, loop_end, mean_iterations
from prism_dsl.prove.layout import bind_counts, to_terms
from prism_dsl.lang.printer import print_program
from prism_dsl.prove.prover import prove
from prism_dsl.semantics.blocks import evaluate
from prism_dsl.semantics.reference import bind_dims, evaluate_nodes, random_inputs
from prism_dsl.prove.rules import load_library

REPO = Path(__file__).resolve().parent.parent
FUSED = sorted((REPO / "programs" / "fused").glob("*.prism"))
DEFAULT = load_library([], defaults=True)
H100 = load_hardware("h100")

# Per fused program: small shapes and kernel parameters at which the block interpreter is run.
CASES = {
    "rmsnorm_linear": ([dict(n=4, d=64), dict(n=3, d=96)], [{}, dict(gx=4, F=2), dict(gx=1, F=8), dict(gx=8, F=1)]),
    "rmsnorm_mlp": ([dict(n=4, d=64), dict(n=2, d=48)], [{}, dict(gx=2, F=4), dict(gx=16, F=2)]),
    "swiglu": ([dict(n=4, d=64), dict(n=5, d=32)], [{}, dict(gx=4, F=4), dict(gx=2, F=1)]),
    "gpt2_mlp": ([dict(n=4, d=64, f=128), dict(n=3, d=32, f=64)], [{}, dict(gx=4, F=2), dict(gx=1, F=8)]),
    # keys past the queries (kv > q: the mask's diagonal is offset), tiles crossing it and stopping early
    "causal_attention": ([dict(b=1, h=2, q=8, kv=24, dh=8), dict(b=2, h=1, q=16, kv=16, dh=4)],
                         [{}, dict(gq=2, F=4), dict(gq=4, F=2), dict(gq=1, gh=1, F=8)]),
    "attention": ([dict(kv=64, dh=8), dict(b=2, h=3, q=4, kv=48, dh=4)],
                  [{}, dict(gb=1, gh=1, F=4), dict(gb=2, gh=1, F=2)]),
}


def counterpart(path: Path) -> Path:
    return REPO / "programs" / (path.name.split(".")[0] + ".prism")


def cases(path: Path):
    dims, params = CASES[path.name.split(".")[0]]
    return [(d, p) for d in dims for p in params]


@pytest.mark.parametrize("path", FUSED, ids=[p.name for p in FUSED])
def test_fused_program_has_its_counterparts_name_and_signature(path):
    fused, plain = load(path).program(), load(counterpart(path)).program()
    assert fused.name == plain.name
    assert [(n.attr, n.dtype, n.shape) for n in fused.inputs] == [(n.attr, n.dtype, n.shape) for n in plain.inputs]
    assert [(n, v.shape) for n, v in fused.outputs] == [(n, v.shape) for n, v in plain.outputs]
    assert kernels_of(fused)


@pytest.mark.parametrize("path", FUSED, ids=[p.name for p in FUSED])
def test_fused_program_round_trips(path, tmp_path):
    program = load(path).program()
    text = print_program(program)
    again = tmp_path / "again.prism"
    again.write_text(text)
    assert load(again).program().same_as(program)
    assert print_program(load(again).program()) == text


@pytest.mark.parametrize("path", FUSED, ids=[p.name for p in FUSED])
def test_fused_program_agrees_with_its_counterpart_in_the_block_interpreter(path):
    fused, plain = load(path).program(), load(counterpart(path)).program()
    runs = 0
    for dims, params in cases(path):
        if path.name.startswith("attention.decoding"):
            params = {k: v for k, v in params.items() if k != "F"} | ({"S": 2} if params else {})
        binding = bind_dims(plain, dims)
        inputs = random_inputs(plain, binding, seed=runs)
        want = evaluate(plain, inputs)
        got = evaluate(fused, inputs, params)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-12)
        runs += 1
    assert runs >= 3


@pytest.mark.parametrize("path", FUSED, ids=[p.name for p in FUSED])
def test_layout_terms_mean_what_the_kernel_computes(path):
    """The translated program, evaluated with NumPy, equals the block interpreter's result."""
    fused = load(path).program()
    binding = bind_dims(fused, CASES[path.name.split(".")[0]][0][0])
    inputs = random_inputs(fused, binding, seed=3)
    chosen = choose(fused, binding, {}, H100)
    got = evaluate(fused, inputs, {s.name: v for s, v in chosen.items()})
    terms = bind_counts(to_terms(fused), {**binding, **chosen})
    env = {n: inputs[n.attr] for n in terms.inputs}
    values = evaluate_nodes([n for _, n in terms.outputs], env)
    for name, node in terms.outputs:
        np.testing.assert_allclose(values[node].reshape(got[name].shape), got[name], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("params", [dict(gq=1, gh=1, F=1), dict(gq=2, gh=2, F=4), dict(gq=4, gh=1, F=2)])
def test_a_causal_kernels_terms_place_its_mask_as_the_kernel_does(params):
    """The prover's causal_at over the tiles' places (rows split by the grid, columns by the loop, keys
    past the queries) means what the block interpreter computes."""
    fused = load(REPO / "programs" / "fused" / "causal_attention.prism").program()
    binding = bind_dims(fused, dict(b=1, h=2, q=8, kv=24, dh=4))
    inputs = random_inputs(fused, binding, seed=5)
    got = evaluate(fused, inputs, params)["O"]
    chosen = {sym(k): v for k, v in params.items()}
    terms = bind_counts(to_terms(fused), {**binding, **chosen})
    assert "causal_at" in {n.op for n in terms.nodes()}
    values = evaluate_nodes([n for _, n in terms.outputs], {n: inputs[n.attr] for n in terms.inputs})
    np.testing.assert_allclose(values[terms.outputs[0][1]].reshape(got.shape), got, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("q, kv, ends", [(64, 64, [1, 2, 3, 4]), (64, 96, [2, 3, 4, 4]), (64, 16, [1, 1, 1, 4])])
def test_a_causal_loop_stops_after_each_blocks_last_kept_key_tile(q, kv, ends):
    """Four blocks of 16 query rows, four iterations over the keys: block b keeps keys up to its last row
    plus kv - q, so it stops after the iteration holding that key (at least one: a block whose rows are
    masked whole, q > kv, still runs the first)."""
    k = kernels_of(load(REPO / "programs" / "fused" / "causal_attention.prism").program())[0]
    c = instantiate(k, binding(b=1, h=2, q=q, kv=kv, dh=16, gq=4, gh=2, F=4), H100)
    assert not isinstance(c, list), c
    cl = causal_loop(k)
    assert cl is not None
    assert [loop_end(c.shape, k, dict(c.grid), c.loop, cl, {"x": b}) for b in range(4)] == ends
    assert mean_iterations(c.shape, k, dict(c.grid), c.loop) == sum(ends) / 4
    plain = kernels_of(load(REPO / "programs" / "fused" / "attention.prism").program())[0]
    assert causal_loop(plain) is None  # no mask: every iteration


@pytest.mark.parametrize("path", FUSED, ids=[p.name for p in FUSED])
def test_fused_program_is_proved_equal_to_its_counterpart(path):
    proof = prove(load(counterpart(path)).program(), load(path).program(), DEFAULT)
    assert proof.proved, proof.reason
    assert proof.numeric_gap is not None and proof.numeric_gap < 1e-9


def test_prove_command_on_a_fused_kernel(capsys):
    plain, fused = REPO / "programs" / "rmsnorm_linear.prism", REPO / "programs" / "fused" / "rmsnorm_linear.prism"
    assert main(["prove", str(plain), str(fused), "--explain"]) == 0
    out = capsys.readouterr().out
    assert "rmsnorm_linear == rmsnorm_linear: proved" in out
    for rule in ("matmul_of_pieces", "acc_rms_last_def", "concat_split"):
        assert rule in out


# -- constraints and instantiation --------------------------------------------------------------------


def rmsnorm_kernel():
    return kernels_of(load(REPO / "programs" / "fused" / "rmsnorm_linear.prism").program())[0]


def sym(name):
    return sympy.Symbol(name, integer=True, positive=True)


def binding(**values):
    return {sym(k): v for k, v in values.items()}


def test_instantiate_gives_a_concrete_kernel():
    c = instantiate(rmsnorm_kernel(), binding(n=16, d=4096, gx=64, F=64), H100)
    assert not isinstance(c, list)
    assert c.grid == (("x", 64),) and c.loop == 64 and c.blocks() == 64
    assert c.output_shape(0) == (16, 4096)
    # xt [16, 64] f16 + wt [64, 64] f16 (rows padded by 8 elements) + acc state [16, 64] f32 (the product adds
    # into it) + rms [16, 1] f32, each buffer 128-byte aligned
    assert c.smem_bytes == 2 * 16 * 72 + 2 * 64 * 72 + 4 * 16 * 64 + 4 * 16 + 4 * 128


def test_a_tile_that_does_not_divide_is_reported():
    problems = instantiate(rmsnorm_kernel(), binding(n=16, d=4096, gx=96, F=64), H100)
    assert problems == ["kernel 'rmsnorm_matmul': tile 'wt' splits dim 1 of size d by grid axis x (gx): "
                        "d/gx = 4096/96 = 128/3 is not a whole number"]


def test_too_much_shared_memory_is_reported():
    problems = instantiate(rmsnorm_kernel(), binding(n=1024, d=8192, gx=1, F=1), H100)
    assert any("shared memory per block (bytes) is" in p and "above the limit of 232448" in p for p in problems)


def test_too_many_blocks_is_reported(tmp_path):
    path = tmp_path / "wide.prism"
    path.write_text("dims n = 70000\nprogram p(X: f32[4, n]) {\n    kernel k grid(y = n) {\n"
                    "        t = load X[:, y]\n        store Y[:, y] = exp(t)\n    }\n    return Y\n}\n")
    k = kernels_of(load(path).program())[0]
    problems = instantiate(k, binding(n=70000), H100)
    assert problems == ["kernel 'k': grid axis y (n blocks) is 70000, above the limit of 65535"]
    out = tmp_path / "out.npz"
    assert main(["run", str(path), "--out", str(out)]) == 1
    assert not out.exists()


def test_every_violation_is_listed_at_once():
    problems = instantiate(rmsnorm_kernel(), binding(n=1024, d=8192, gx=3, F=5), H100)
    assert len(problems) == 4  # xt's and wt's loop split, wt's grid split, shared memory


@pytest.mark.parametrize("argv,message", [
    (["--grid", "x=96", "--loop", "64"], "d/gx = 4096/96 = 128/3 is not a whole number"),
    (["--dims", "n=1024,d=8192", "--grid", "x=1", "--loop", "1"], "above the limit of 232448"),
    (["--grid", "z=4"], "no kernel has a grid axis z of free size (kernel parameters of 'rmsnorm_linear': F, gx)"),
    (["--grid", "d=4"], "'d' is a dim of the program; set it with --dims"),
    (["--loop", "d=4"], "'d' is a dim of the program; set it with --dims"),
    (["--loop", "gx=4"], "'gx' is a grid size; set it with --grid"),
    (["--grid", "F=4"], "'F' is a loop range; set it with --loop"),
    (["--loop", "G=4"], "--loop G=...: no loop symbol 'G'"),
])
def test_run_refuses_invalid_kernel_parameters(capsys, tmp_path, argv, message):
    out = tmp_path / "out.npz"
    path = REPO / "programs" / "fused" / "rmsnorm_linear.prism"
    assert main(["run", str(path), "--out", str(out), *argv]) == 1
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("argv,message", [(["--grid", "x=0"], "'x' must be at least 1, got 0"),
                                          (["--loop", "0"], "a loop range must be at least 1, got 0"),
                                          (["--loop", "F=-3"], "'F' must be at least 1, got -3")])
def test_a_kernel_parameter_below_1_is_a_usage_error(capsys, tmp_path, argv, message):
    """Wrong whatever the program: exit 2, as for every flag's value that is."""
    path = REPO / "programs" / "fused" / "rmsnorm_linear.prism"
    assert main(["run", str(path), "--out", str(tmp_path / "out.npz"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out.npz").exists()


def test_run_chooses_valid_parameters_and_matches_the_reference(tmp_path):
    fused, plain = tmp_path / "fused.npz", tmp_path / "plain.npz"
    assert main(["run", str(REPO / "programs" / "fused" / "swiglu.prism"), "--dims", "d=256", "--out", str(fused)]) == 0
    assert main(["run", str(REPO / "programs" / "swiglu.prism"), "--dims", "d=256", "--out", str(plain)]) == 0
    np.testing.assert_allclose(np.load(fused)["Y"], np.load(plain)["Y"], rtol=1e-10, atol=1e-12)
    assert main(["run", str(REPO / "programs" / "fused" / "swiglu.prism"), "--dims", "d=256",
                 "--grid", "x=4", "--loop", "8", "--out", str(fused)]) == 0
    np.testing.assert_allclose(np.load(fused)["Y"], np.load(plain)["Y"], rtol=1e-10, atol=1e-12)


def test_no_valid_choice_is_an_error(capsys, tmp_path):
    path = REPO / "programs" / "fused" / "rmsnorm_linear.prism"
    assert main(["run", str(path), "--grid", "x=3", "--out", str(tmp_path / "o.npz")]) == 1
    err = capsys.readouterr().err
    assert "no choice of F (with gx = 3 as given) satisfies the constraints" in err
    assert "d/gx = 4096/3 is not a whole number" in err
    # as written, its kernels pre-defined ones: located where the op the first of them computes was written
    plain = REPO / "programs" / "rmsnorm_linear.prism"
    assert main(["compile", str(plain), "--search", "none", "--arch", "none", "--grid", "x=3", "-o",
                 str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.split(":")[0].endswith("rmsnorm_linear.prism") and ":5:9: no choice of" in err.splitlines()[0], err
    assert "matmul_Y': tile 'w_1' splits dim 1" in err
    assert "    Y = rms_norm(X) @ W\n" in err


# -- wrong kernels are not proved, and the interpreter shows the difference ---------------------------

RMSNORM_LINEAR = """dims n = 8, d = 4096
program rmsnorm_linear(X: f16[n, d], W: f16[d, d]) {{
    kernel k grid(x = {grid}) loop(F) {{
        xt = load X[:, loop]
        wt = load W[{wmap}]
        {body}
    }}
    return Y
}}
"""

WRONG = {
    # the mean of squares without its square root
    "wrong accumulator": dict(grid="gx", wmap="loop, x",
                              body="acc = acc_sum(xt @ wt)\n        ms = acc_mean_last(square(xt))\n        store Y[:, x] = acc / ms"),
}

REFUSED = {
    # W's rows split by the grid and its columns by the loop: the blocks multiply the wrong pieces
    "wrong map": (dict(grid="F", wmap="x, loop",
                       body="acc = acc_sum(xt @ wt)\n        rms = acc_rms_last(xt)\n        store Y[:, x] = acc / rms"),
                  r"wrong.prism:3:31: 'F' is both the loop range and the size of grid axis x"),
    # each piece divided by its own root mean square, before the loop has seen the whole row
    "division in the loop": (dict(grid="gx", wmap="loop, x",
                                  body="store Y[:, x] = acc_sum((xt @ wt) / sqrt(mean(square(xt), -1)))"),
                             r"wrong.prism:6:25: acc_sum gives what depends on how many iterations the loop has "
                             r"\(F\): sqrt of a mean over a piece of a split dim, which only a mean of the pieces"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_a_kernel_whose_result_follows_its_parameters_is_refused_where_it_is_written(tmp_path, name):
    """Kernels the prover found unequal to the program, which numerically differ from it, are refused before that
    now: what they compute depends on their parameters (`kernels.pieces`)."""
    path = tmp_path / "wrong.prism"
    path.write_text(RMSNORM_LINEAR.format(**REFUSED[name][0]))
    with pytest.raises(PrismError, match=REFUSED[name][1]):
        load(path)


@pytest.mark.parametrize("name", WRONG)
def test_wrong_kernel_is_not_proved_and_differs_numerically(tmp_path, name):
    path = tmp_path / "wrong.prism"
    path.write_text(RMSNORM_LINEAR.format(**WRONG[name]))
    wrong, plain = load(path).program(), load(REPO / "programs" / "rmsnorm_linear.prism").program()
    proof = prove(plain, wrong, DEFAULT, Limits(seconds=3))
    assert not proof.proved
    assert proof.numeric_gap is not None and proof.numeric_gap > 1e-3
    inputs = random_inputs(plain, bind_dims(plain, dict(n=4, d=64)), seed=1)
    params = {"F": 4, "gx": 2}
    assert not np.allclose(evaluate(wrong, inputs, params)["Y"], evaluate(plain, inputs)["Y"], rtol=1e-3)


def test_prove_command_reports_the_numeric_difference_of_a_wrong_kernel(tmp_path, capsys):
    path = tmp_path / "wrong.prism"
    path.write_text(RMSNORM_LINEAR.format(**WRONG["wrong accumulator"]))
    assert main(["prove", str(REPO / "programs" / "rmsnorm_linear.prism"), str(path), "--timeout", "3"]) == 3
    out = capsys.readouterr().out
    assert "not proved: Y" in out and "on random inputs they differ" in out


def test_wrong_attention_accumulator_is_not_proved(tmp_path):
    text = (REPO / "programs" / "fused" / "attention.prism").read_text()
    assert "l = acc_softmax_sum(s)" in text
    path = tmp_path / "wrong.prism"
    path.write_text(text.replace("l = acc_softmax_sum(s)", "l = acc_sum_last(exp(s))"))
    proof = prove(load(REPO / "programs" / "attention.prism").program(), load(path).program(), DEFAULT, Limits(seconds=3))
    assert not proof.proved and proof.numeric_gap > 1e-3


def test_a_combining_kernel_that_adds_online_softmaxs_pieces_unrescaled_is_refused_where_written(tmp_path):
    """The combining kernel adding the pieces without rescaling them to the common max: the prover found it unequal;
    it is refused at its folds now (`pieces.combined_by`)."""
    text = (REPO / "programs" / "fused" / "attention.decoding.prism").read_text()
    old = "acc_rescaled_sum(mt, pt) / acc_rescaled_sum(mt, lt)"
    assert old in text
    path = tmp_path / "wrong.prism"
    path.write_text(text.replace(old, "acc_sum(pt) / acc_sum(lt)"))
    with pytest.raises(PrismError, match="acc_sum folds the pieces of 'P', which kernel 'partial' stores one a block "
                                         "along its grid axis z, each acc_softmax_out over its piece: they combine by "
                                         "acc_rescaled_sum"):
        load(path).program()


# -- errors in kernels -------------------------------------------------------------------------------

KERNEL_ERRORS = [
    ("grid(x = gx, w = 2) loop(F)", "xt = load X[:, loop]\nstore Y[:, x] = acc_sum(xt)",
     "unknown grid axis 'w' (the axes are x, y and z)"),
    ("grid(x = gx, x = 2) loop(F)", "xt = load X[:, loop]\nstore Y[:, x] = acc_sum(xt)", "grid axis 'x' is given twice"),
    ("grid(x = 0)", "xt = load X[:, x]\nstore Y[:, x] = xt", "the size of grid axis x must be at least 1, got 0"),
    ("grid(x = gx) loop(F)", "xt = load X[:, q]\nstore Y[:, x] = xt", "'q' is not a grid axis or 'loop'"),
    ("grid(x = gx) loop(F)", "xt = load X[:, y]\nstore Y[:, x] = xt", "grid axis 'y' is not in the grid of kernel 'k'"),
    ("grid(x = gx) loop(F)", "xt = load X[loop, loop]\nstore Y[:, :] += acc_sum(xt)", "'loop' splits two dims of one tile"),
    ("grid(x = gx) loop(F)", "xt = load X[x, x]\nstore Y[x, :] = xt", "'x' splits two dims of one tile"),
    ("grid(x = gx)", "xt = load X[:, loop]\nstore Y[:, x] = xt", "'loop' here, but kernel 'k' has no loop(...)"),
    ("grid(x = gx)", "xt = load X[:]\nstore Y[:] += xt", "the map of 'xt' has 1 entries but 'X' has 2 dims [n, d]"),
    ("grid(x = gx)", "xt = load Q[:, x]\nstore Y[:, x] = xt", "undefined name 'Q'"),
    ("grid(x = gx) loop(F)", "xt = load X[:, x*loop]\nstore Y[:, x] = xt",
     "'Y' stores a value that changes every loop iteration; accumulate it first"),
    ("grid(x = gx) loop(F)", "xt = load X[:, x]\nstore Y[:, x] = acc_sum(xt)",
     "acc_sum accumulates a value that is the same in every iteration"),
    ("grid(x = gx)", "xt = load X[:, x]\nstore Y[:, x] = acc_sum(xt)",
     "acc_sum accumulates over the loop, but kernel 'k' has no loop(...)"),
    ("grid(x = 1) loop(F)", "xt = load X[:, loop]\ns = acc_sum_last(xt)\nstore Y[:, :] += s * xt",
     "mul combines a value from inside the loop with one from after it"),
    ("grid(x = 1) loop(F)", "xt = load X[:, loop]\nstore Y[:, :] += acc_sum(acc_sum_last(xt))",
     "acc_sum reads a value computed after the loop; accumulators cannot be nested"),
    ("grid(x = gx) loop(F)", "xt = load X[:, x*loop]\nstore Y[:, :] = acc_sum_last(xt)",
     "grid axis x writes no dim of 'Y', so its blocks' results must be added"),
    ("grid(x = gx) loop(F)", "xt = load X[:, loop]\nstore Y[:, :] = acc_sum_last(xt)",  # not '+=': that adds copies
     "every block along grid axis x would compute the same 'Y': no tile it is computed from is split by it"),
    ("grid(x = gx)", "xt = load X[:, x]\nstore Y[:, x] += xt", "every axis writes a dim of 'Y'; write '='"),
    ("grid(x = gx) loop(F)", "xt = load X[:, x*loop]\nstore Y[x] = acc_sum(xt)",
     "the stored tile has shape [n, d/(F*gx)] but the map has 1 entries"),
    ("grid(x = gx)", "xt = load X[:, x]\nstore Y[:, x] = split(xt, -1, -6, 2)",
     "split is a layout operator of the prover; it can only be used in rules"),
    ("grid(x = gx)", "xt = load X[:, x]", "kernel 'k' stores nothing"),
    ("grid(x = gx)", "xt = load X[:, x]\nxt = exp(xt)\nstore Y[:, x] = xt", "'xt' is already defined in kernel 'k'"),
    ("grid(x = gx)", "xt = load X[:, x]\nstore X[:, x] = xt", "'X' is already defined; every name is assigned once"),
    ("grid(x = gx)", "xt = load X[:, x]\nstore Y[:, x] = xt\nstore Y[:, x] = exp(xt)", "'Y' is stored twice"),
    ("grid(x = gx, y = gy) loop(F)", "xt = load X[x, loop]\nstore Y[x, :] += acc_sum_last(xt)",
     "every block along grid axis y would compute the same 'Y': no tile it is computed from is split by it"),
    ("grid(x = 2)", "xt = load X[:, :]\nstore Y[x, :] = xt", "every block along grid axis x would compute the same 'Y'"),
    ("grid(x = gx)", "xt = load X[:, x]\nstore Y[x, :, :, :, :, :] = xt", "the map of 'Y' has 6 entries; kernels store"),
    # what the kernel computes would depend on the parameters the tuner chooses (`kernels.pieces`)
    ("grid(x = gx) loop(F)", "xt = load X[:, x*loop]\nbt = load X[:, :]\nstore Y[:, :] += acc_sum_last(xt) + sum(bt, -1)",
     "the blocks along grid axis x add what depends on how many they are (gx): a partial sum plus a value that is "
     "not split, which is then added once a piece"),
    ("grid(x = gx) loop(F)", "xt = load X[:, loop]\nyt = load X[:, x]\nstore Y[:, x] = acc_sum(sum(xt, -1) + yt)",
     "acc_sum gives what depends on how many iterations the loop has (F): a partial sum plus a value that is not "
     "split"),
    ("grid(x = gx) loop(F)", "xt = load X[:, x*loop]\nstore Y[:, :] += acc_max_last(xt)",
     "(gx): each block's max over its piece of a split dim, which adding does not complete"),
    ("grid(x = 1) loop(F)", "xt = load X[:, loop]\nstore Y[:, :] = acc_sum(xt)",
     "(F): tiles of different parts of a dim the loop splits, folded together"),
    ("grid(x = 1) loop(F)", "xt = load X[:, loop]\nstore Y[:, :] = acc_max_last(xt @ transpose(xt, 0, 1))",
     "(F): acc_max_last of partial sums over the loop's pieces, which is not the acc_max_last of the whole"),
    ("grid(x = 1) loop(F)", "xt = load X[:, loop]\nstore Y[:, :] = acc_sum(exp(xt @ transpose(xt, 0, 1)))",
     "(F): exp of a partial sum, which is not the exp of the whole sum"),
    ("grid(x = gx) loop(F)", "xt = load X[:, x*loop]\nstore Y[:, :] += acc_sum(xt @ transpose(xt, 0, 1)) * acc_sum_last(xt)",
     "(gx): a mul of two partial sums"),
    ("grid(x = gx) loop(F)", "xt = load X[:, x]\nstore Y[:, x] = exp(xt)", "the loop of kernel 'k' walks no tile"),
    ("grid(x = gx)", "xt = load X[:, x]\nstore Y[:, x] = softmax(xt)", "what the blocks along grid axis x store "
     "depends on how many they are (gx): softmax of each piece of a row, as if it were the row"),
    ("grid(x = 1) loop(F)", "xt = load X[loop, :]\nyt = load X[:, loop]\n"
     "store Y[:, :] = acc_sum(sum(sum(sum(xt, -1) * sum(yt, -2), -1), -2))",
     "(F): a mul of pieces of two split dims broadcast against each other"),
]


ACCEPTED = {  # kernels whose result does not depend on their parameters, with two choices of them
    # a max over each piece of the row, folded by the pieces' max; a mean likewise
    "max of maxima": ("dims n = 8, d = 256\nprogram p(X: f32[n, d]) {\n    kernel k grid(x = gn) loop(F) {\n"
                      "        xt = load X[x, loop]\n        store Y[x, :] = acc_max_last(max(xt, -1)) + "
                      "acc_mean_last(mean(xt, -1))\n    }\n    return Y\n}\n", {"gn": 2, "F": 2}, {"gn": 4, "F": 8}),
    # the pieces of a split-K product added by the blocks of a second kernel, one piece a block
    "pieces added by blocks": ("dims n = 8, d = 1024, m = 64\nprogram p(X: f32[n, d], W: f32[d, m]) {\n"
                               "    kernel part grid(x = gx, z = S) loop(F) {\n        xt = load X[:, z*loop]\n"
                               "        wt = load W[z*loop, x]\n        store P[z, :, x] = acc_sum(xt @ wt)\n    }\n"
                               "    kernel comb grid(x = gx, z = S) {\n        pt = load P[z, :, x]\n"
                               "        store Y[:, x] += pt\n    }\n    return Y\n}\n",
                               {"gx": 2, "S": 2, "F": 4}, {"gx": 4, "S": 8, "F": 2}),
    # RMSNorm's statistics over the whole row beside a split-K product: a partial sum over a whole value
    "split-K over a whole norm": ("dims n = 8, d = 1024, m = 64\nprogram p(X: f32[n, d], W: f32[d, m]) {\n"
                                  "    kernel k grid(x = gx, z = gz) loop(F) {\n        xt = load X[:, z*loop]\n"
                                  "        xr = load X[:, loop]\n        wt = load W[z*loop, x]\n"
                                  "        store Y[:, x] += acc_sum(xt @ wt) / acc_rms_last(xr)\n    }\n"
                                  "    return Y\n}\n", {"gx": 2, "gz": 2, "F": 4}, {"gx": 4, "gz": 8, "F": 2}),
    # one iteration of a loop that walks nothing
    "one iteration": ("dims n = 8, d = 256, m = 32\nprogram p(X: f32[n, d], W: f32[d, m]) {\n"
                      "    kernel k grid(x = gx) loop(1) {\n        xt = load X[:, :]\n        wt = load W[:, x]\n"
                      "        store Y[:, x] = xt @ wt\n    }\n    return Y\n}\n", {"gx": 2}, {"gx": 8}),
}


@pytest.mark.parametrize("name", ACCEPTED)
def test_kernels_whose_result_holds_at_any_parameters_are_accepted(write, name):
    """What `kernels.pieces` lets through: the same result at two choices of the parameters."""
    text, one, other = ACCEPTED[name]
    program = load(write(text)).program()
    inputs = random_inputs(program, bind_dims(program, {}), seed=2)
    a, b = evaluate(program, inputs, one), evaluate(program, inputs, other)
    for out in a:
        np.testing.assert_allclose(a[out], b[out], rtol=1e-9)


SPLIT_PAIR = """dims b = 1, h = 2, q = 1, kv = 256, dh = 16
program attention(Q: f32[b, h, q, dh], K: f32[b, h, kv, dh], V: f32[b, h, kv, dh]) {
    kernel partial grid(x = gb, y = gh, z = S) loop(F) {
        qt = load Q[x, y, :, :]
        kt = load K[x, y, z*loop, :]
        vt = load V[x, y, z*loop, :]
        s = qt @ transpose(kt, -1, -2)
        store M[z, x, y, :, :] = acc_max_last(s)
        store L[z, x, y, :, :] = acc_softmax_sum(s)
        store P[z, x, y, :, :] = acc_softmax_out(s, vt)
        store V2[z, x, y, :, :] = acc_var_last(s)
    }
    kernel combine grid(x = gb, y = gh) loop(S) {
        mt = load M[loop, x, y, :, :]
        lt = load L[loop, x, y, :, :]
        pt = load P[loop, x, y, :, :]
        vt = load V2[loop, x, y, :, :]
        store O[x, y, :, :] = COMBINE
    }
    return O
}
"""


@pytest.mark.parametrize("combine,message", [
    ("acc_rescaled_sum(mt, pt) / acc_rescaled_sum(mt, lt)", None),
    ("acc_max_last(mt) + acc_sum(exp(mt))", None),  # (through another op first: the prover's to judge)
    ("acc_sum(pt) / acc_sum(lt)", "18:31: acc_sum folds the pieces of 'P', which kernel 'partial' stores one a block "
                                  "along its grid axis z, each acc_softmax_out over its piece: they combine by "
                                  "acc_rescaled_sum"),
    ("acc_mean_last(vt)", "18:31: acc_mean_last folds the pieces of 'V2', which kernel 'partial' stores one a block "
                          "along its grid axis z, each acc_var_last over its piece: they combine by no fold"),
    ("acc_sum(mt)", "18:31: acc_sum folds the pieces of 'M', which kernel 'partial' stores one a block along its grid "
                    "axis z, each acc_max_last over its piece: they combine by acc_max_last"),
])
def test_a_combining_kernel_folds_another_kernels_pieces_by_the_fold_that_combines_them(write, combine, message):
    """FlashDecoding's combining kernel written by hand: the per-piece states of online softmax combine by
    acc_rescaled_sum, a max by a max, a variance by none (`pieces.combined_by`); added plainly, the result followed
    the number of pieces S, and the block interpreter, the emulation and `compile`'s check all agreed with it."""
    path = write(SPLIT_PAIR.replace("COMBINE", combine))
    if message is None:
        load(path).program()
    else:
        with pytest.raises(PrismError, match=re.escape(f"t.prism:{message}")):
            load(path).program()


def test_an_accumulator_inside_a_stores_expression_is_pointed_at(tmp_path, capsys):
    """Not at the kernel's name: the accumulator that folds a value the loop does not split."""
    path = tmp_path / "k.prism"
    path.write_text("dims n = 8, d = 64\nprogram p(Q: f32[n, d], K: f32[n, d]) {\n    kernel k grid(x = gx) loop(F) {\n"
                    "        qt = load Q[x, :]\n        kt = load K[x, loop]\n"
                    "        store Y[x, :] = acc_sum(qt) + acc_sum_last(kt)\n    }\n    return Y\n}\n")
    assert main(["check", str(path)]) == 1
    assert f"{path}:6:25: acc_sum accumulates a value that is the same in every iteration" in capsys.readouterr().err


@pytest.mark.parametrize("header,body,message", KERNEL_ERRORS, ids=[m[2][:40] for m in KERNEL_ERRORS])
def test_kernel_errors_are_reported_with_their_location(tmp_path, capsys, header, body, message):
    path = tmp_path / "bad.prism"
    lines = "\n".join("        " + line for line in body.split("\n"))
    path.write_text(f"dims n = 8, d = 64\nprogram p(X: f16[n, d]) {{\n    kernel k {header} {{\n{lines}\n    }}\n"
                    f"    return X\n}}\n")
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert message in err
    assert f"{path}:" in err and "Traceback" not in err


def test_accumulators_are_refused_outside_kernels(tmp_path, capsys):
    path = tmp_path / "bad.prism"
    path.write_text("program p(X: f16[4, 4]) {\n    Y = acc_sum(X)\n    return Y\n}\n")
    assert main(["check", str(path)]) == 1
    assert ":2:9: acc_sum is a loop accumulator; it can only be used inside a kernel" in capsys.readouterr().err


def test_duplicate_kernel_names_are_refused(tmp_path, capsys):
    path = tmp_path / "bad.prism"
    path.write_text("program p(X: f16[4, 4]) {\n    kernel k grid(x = 4) {\n        t = load X[x, :]\n        store A[x, :] = t\n    }\n"
                    "    kernel k grid(x = 4) {\n        t = load A[x, :]\n        store B[x, :] = t\n    }\n    return B\n}\n")
    assert main(["check", str(path)]) == 1
    assert ":6:12: duplicate kernel 'k'" in capsys.readouterr().err


# -- several kernels and pre-defined ops in one program -------------------------------------------------


def test_a_program_mixes_custom_kernels_and_predefined_ops(tmp_path):
    path = tmp_path / "mixed.prism"
    path.write_text("""dims n = 8, d = 64
program p(X: f32[n, d], W: f32[d, d]) {
    H = exp(X)
    kernel mm grid(x = gx, y = gy) loop(F) {
        ht = load H[y, loop]
        wt = load W[loop, x]
        store A[y, x] = acc_sum(ht @ wt)
    }
    kernel split_k grid(x = gk) {
        at = load A[:, x]
        wt = load W[x, :]
        store B[:, :] += at @ wt
    }
    C = B + A
    return C, A
}
""")
    program = load(path).program()
    assert len(kernels_of(program)) == 2 and [s.name for s in free_symbols(program)] == ["gx", "gy", "F", "gk"]
    plain = tmp_path / "plain.prism"
    plain.write_text("dims n = 8, d = 64\nprogram p(X: f32[n, d], W: f32[d, d]) {\n    A = exp(X) @ W\n"
                     "    C = A @ W + A\n    return C, A\n}\n")
    inputs = random_inputs(program, bind_dims(program, {}), seed=2)
    want = evaluate(load(plain).program(), inputs)
    for params in ({}, dict(gx=2, gy=4, F=8, gk=4)):
        got = evaluate(program, inputs, params)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-10)
    proof = prove(load(plain).program(), program, DEFAULT)
    assert proof.proved, proof.reason


def test_partial_results_are_stored_in_f32_and_the_combined_output_in_the_programs_dtype(tmp_path, capsys):
    """FlashDecoding's per-piece max, sum and unnormalised output, and a `+=` sum across blocks, are kept in
    f32 in device memory; the combining kernel reads f32 tiles and stores the output in the inputs' dtype."""
    path = tmp_path / "decoding.prism"
    path.write_text((REPO / "programs" / "fused" / "attention.decoding.prism").read_text().replace("f16", "bf16"))
    program = load(path).program()
    partial, combine = kernels_of(program)
    assert [stored_dtype(partial, i) for i in range(3)] == [DType.F32] * 3
    assert stored_dtype(combine, 0) is DType.BF16 and program.outputs[0][1].dtype is DType.BF16
    assert all(storage(n) is DType.F32 for n in combine.inputs)
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "-> P [S, b, h, q, dh] = [16, 2, 8, 1, 128] f32" in out and "load  pt = P[loop, x, y, :, :]" in out
    assert "tile [1, b/gb, h/gh, q, dh] = [1, 1, 1, 1, 128] f32" in out  # (gb = 2: the model's choice)
    summed = tmp_path / "summed.prism"
    summed.write_text("""dims n = 8, d = 64
program p(X: f16[n, d], W: f16[d, d]) {
    kernel mm grid(x = gx) loop(F) {
        xt = load X[:, loop]
        wt = load W[loop, x]
        store A[:, x] = acc_sum(xt @ wt)
    }
    kernel split_k grid(x = gk) {
        at = load A[:, x]
        wt = load W[x, :]
        store B[:, :] += at @ wt
    }
    return B
}
""")
    mm, split_k = kernels_of(load(summed).program())
    # a sum across blocks is a whole result, in its own type (its blocks add in f32 apart: backend/sums.py)
    assert stored_dtype(mm, 0) is DType.F16 and stored_dtype(split_k, 0) is DType.F16


# -- show --------------------------------------------------------------------------------------------


def test_show_prints_tiles_shared_memory_and_checks(capsys):
    path = REPO / "programs" / "fused" / "rmsnorm_linear.prism"
    assert main(["show", str(path), "--dims", "n=16", "--grid", "x=64", "--loop", "64"]) == 0
    out = capsys.readouterr().out
    assert "kernel rmsnorm_matmul grid(x = gx = 64) loop(F = 64): 64 blocks, 64 iterations each" in out
    assert "load  wt = W[loop, x]   tile [d/F, d/gx] = [64, 64] f16" in out
    assert "= 16192 bytes (limit 232448 on H100)" in out
    # what the generated code allocates: the loop's tiles once per pipeline stage
    assert "as generated: 128 threads, a 3-stage cp.async pipeline, 34688 bytes of shared memory" in out
    assert "checks: every division exact" in out


def test_show_says_where_online_softmax_runs_in_registers(capsys):
    path = REPO / "programs" / "fused" / "attention.prism"
    args = ["--dims", "b=1,h=16,q=4096,kv=4096,dh=128", "--grid", "gb=1,gh=16,gq=32", "--loop", "F=64"]
    assert main(["show", str(path), *args]) == 0
    assert "online softmax over s in registers (8 warps of 16 rows, on wgmma)" in capsys.readouterr().out


def test_show_lists_violations_and_exits_1(capsys):
    path = REPO / "programs" / "fused" / "rmsnorm_linear.prism"
    assert main(["show", str(path), "--dims", "n=16", "--grid", "x=96", "--loop", "64"]) == 1
    out = capsys.readouterr().out
    assert "NOT VALID:" in out and "d/gx = 4096/96 = 128/3 is not a whole number" in out


def test_show_says_why_no_parameters_fit_and_fractions_unreduced(capsys):
    """`show` kept the chooser's heading alone ("...; at the last one tried, ...:" and nothing after it), where `run`
    said the reasons; a quotient was shown reduced (kv/(F*S) = 1/8 at kv = 96), as if kv were 1."""
    path = REPO / "programs" / "fused" / "attention.decoding.prism"
    assert main(["show", str(path), "--dims", "b=96,h=96,q=96,kv=96,dh=8192", "--hardware", "a100"]) == 1
    out = capsys.readouterr().out
    assert "at the last one tried, gb = 96, gh = 12, S = 48, F = 16:\n    kernel 'partial': tile 'kt' splits dim 3" in out
    assert "kv/(F*S) = 96/768 = 1/8 is not a whole number" in out
    assert "kernel 'combine': shared memory per block (bytes) is 75510656, above the limit of 166912" in out


def test_show_takes_the_parameters_and_threads_compile_takes(capsys, tmp_path):
    """`show` chose by the constraint solver's first valid choice, so its grid was not the one `compile` builds: the
    projection at decode was shown as 256 blocks of 128 threads where compile builds 128 of 256; and where that
    solver's choices all failed (attention's split at dims of 96 on the A100) it said no parameters fit, where the
    model tunes some and compile builds them."""
    path = REPO / "programs" / "fused" / "rmsnorm_linear.prism"
    assert main(["show", str(path)]) == 0
    shown = capsys.readouterr().out
    assert main(["compile", str(path), "--search", "none", "--no-emulate", "--arch", "sm_90", "-o", str(tmp_path / "o"),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (kernel,) = report["kernels"]
    assert f"grid(x = gx = {kernel['grid'][0]}) loop(F = {report['parameters']['F']})" in shown
    assert f"as generated: {kernel['block'][0]} threads" in shown
    assert f"; {kernel['block'][0]} threads a block" in shown  # the model's choice of twice the default
    decoding = REPO / "programs" / "fused" / "attention.decoding.prism"
    assert main(["show", str(decoding), "--dims", "b=96,h=96,q=96,kv=96,dh=96", "--hardware", "a100"]) == 0
    assert "tuned by the cost model, as `prismc compile --search none` tunes them: gb = 96, gh = 96, S = 1, F = 2" in \
        capsys.readouterr().out
    # parameters given are kept, the rest tuned at the default threads, as compile does with --grid
    assert main(["show", str(path), "--grid", "x=64"]) == 0
    out = capsys.readouterr().out
    assert "tuned by the cost model, as `prismc compile --search none` tunes them: F = 16 (" in out
    assert "as generated: 128 threads" in out


def test_show_rounds_the_dims_up_where_compile_does(capsys, tmp_path):
    """At sizes no tile divides, compile builds at sizes rounded up where the model finds that faster (`padding`);
    `show` tuned at the sizes given, a plan 17 times slower than the one built, and said nothing of it."""
    path = REPO / "programs" / "fused" / "attention.decoding.prism"
    assert main(["compile", str(path), "--dims", "kv=4099", "--search", "none", "--no-emulate", "--arch", "none",
                 "-o", str(tmp_path / "o"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["padded"] == {"kv": 4099} and report["dims"]["kv"] > 4099
    assert main(["show", str(path), "--dims", "kv=4099"]) == 0
    shown = capsys.readouterr().out
    assert f"built for kv={report['dims']['kv']} (given 4099), as `prismc compile --search none` rounds them up" in shown
    assert f"(the model's estimate, by the code's structure: {report['estimated_us']:.3f} us)" in shown
    assert main(["show", str(path), "--dims", "kv=4099", "--grid", "gb=2,gh=8,S=1"]) == 0  # given: at the sizes given
    assert "built for" not in capsys.readouterr().out


def test_show_draws_the_kernel_graph_as_dot(tmp_path, capsys):
    path = REPO / "programs" / "fused" / "attention.decoding.prism"
    out = tmp_path / "g.dot"
    assert main(["show", str(path), "--format", "dot", "-o", str(out)]) == 0
    dot = out.read_text()
    assert dot.startswith('digraph "attention" {') and dot.rstrip().endswith("}")
    assert dot.count("subgraph cluster_") == 2
    assert 'label="load kt[x, y, :, z*loop]\\ntile [b/gb, h/gh, dh, kv/(F*S)]"' in dot
    assert 'label="store M[z, x, y, :, :] ="' in dot


def test_show_svg_without_graphviz_is_refused_and_writes_nothing(tmp_path, capsys, monkeypatch):
    """It used to write the DOT text into g.svg, exit 0, and say so in a note only."""
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    out = tmp_path / "g.svg"
    assert main(["show", str(REPO / "programs" / "fused" / "swiglu.prism"), "--format", "svg", "-o", str(out)]) == 1
    assert not out.exists()
    assert "--format svg needs Graphviz's 'dot', which is not on PATH" in capsys.readouterr().err
    assert main(["show", str(REPO / "programs" / "fused" / "swiglu.prism"), "--format", "dot", "-o", str(out)]) == 0
    assert out.read_text().startswith("digraph")


@pytest.mark.skipif(__import__("shutil").which("dot") is None, reason="Graphviz's dot is not installed")
def test_show_svg_with_graphviz(tmp_path):
    out = tmp_path / "g.svg"
    assert main(["show", str(REPO / "programs" / "fused" / "swiglu.prism"), "--format", "svg", "-o", str(out)]) == 0
    assert "<svg" in out.read_text()


def test_show_binary_format_needs_an_output_file(capsys, monkeypatch):
    import shutil

    if shutil.which("dot") is None:
        pytest.skip("Graphviz's dot is not installed (without it --format png is refused)")
    assert main(["show", str(REPO / "programs" / "fused" / "swiglu.prism"), "--format", "png"]) == 2


def test_symbolic_maps_give_every_concrete_maps_tile_shape():
    import itertools

    k = rmsnorm_kernel()
    W = k.inputs[1]
    smap = SymbolicMap("W", 2, ("x", "loop"))
    symbolic = smap.tile_shape(W.shape, k)
    assert "m_W_x_1" in str(smap)
    for bits in itertools.product((0, 1), repeat=4):
        values = dict(zip([smap.var(a, d) for a in ("x", "loop") for d in (0, 1)], bits))
        if bits[0] + bits[1] > 1 or bits[2] + bits[3] > 1:
            continue
        concrete = tile_shape(W.shape, smap.assign(values), k)
        assert tuple(sympy.simplify(s.xreplace(values) - c) for s, c in zip(symbolic, concrete)) == (0, 0)


def test_an_error_in_a_second_kernel_points_into_that_kernel(tmp_path, capsys):
    path = tmp_path / "two.prism"
    path.write_text("""dims n = 4, d = 64
program p(X: f32[n, d]) {
    kernel a grid(x = gx) loop(F) {
        t = load X[x, loop]
        e = exp(t)
        store Y[x, :] = acc_sum_last(e)
    }
    kernel b grid(x = gx) loop(F) {
        t = load X[x, loop]
        e = exp(t)
        store Z[x, :] = e
    }
    return Y, Z
}
""")
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert ":10:13: 'Z' stores a value that changes every loop iteration" in err
    assert "undefined name" not in err and "cannot return" not in err


def test_defs_may_call_accumulators_for_use_in_kernels(tmp_path, capsys):
    path = tmp_path / "defs.prism"
    path.write_text("dims n = 4, d = 64\ndef rowsum(a) = acc_sum_last(a)\nprogram p(X: f32[n, d]) {\n"
                    "    kernel k grid(x = gx) loop(F) {\n        t = load X[x, loop]\n        store Y[x, :] = rowsum(t)\n"
                    "    }\n    return Y\n}\n")
    assert main(["check", str(path)]) == 0
    capsys.readouterr()
    bad = tmp_path / "bad.prism"
    bad.write_text("def rowsum(a) = acc_sum_last(a)\nprogram p(X: f32[4, 4]) {\n    Y = rowsum(X)\n    return Y\n}\n")
    assert main(["check", str(bad)]) == 1
    assert "acc_sum_last is a loop accumulator; it can only be used inside a kernel" in capsys.readouterr().err


def test_numeric_guard_falls_back_to_the_declared_sizes(tmp_path, capsys):
    """A literal grid size that does not divide the small test sizes still gets a numeric cross-check."""
    path = tmp_path / "k.prism"
    path.write_text("dims n = 64, d = 32\nprogram p(X: f32[n, d]) {\n    kernel k grid(x = 32) {\n"
                    "        t = load X[x, :]\n        store Y[x, :] = exp(t) * 2\n    }\n    return Y\n}\n")
    plain = tmp_path / "plain.prism"
    plain.write_text("dims n = 64, d = 32\nprogram p(X: f32[n, d]) {\n    Y = exp(X) * 3\n    return Y\n}\n")
    assert main(["prove", str(plain), str(path), "--timeout", "3"]) == 3
    out = capsys.readouterr().out
    assert "on random inputs they differ" in out and "no numeric cross-check" not in out


CAUSAL_KERNEL = """dims q = 8, kv = 16, d = 4

program p(Q: f64[q, d], K: f64[kv, d]) {
    kernel masked grid(x = 4, y = 2) loop(2) {
        qt = load Q[y, loop]
        kt = load K[x, loop]
        store S[y, x] = causal(acc_sum(qt @ transpose(kt, -1, -2)))
    }
    return S
}
"""


def test_causal_in_a_kernel_masks_each_block_at_its_place_in_the_whole_scores(write):
    """Blocks of 4 x 4 scores: those on the diagonal band are masked in part, those past it entirely, as the
    whole q x kv scores would be (the queries are the last 8 of 16 positions)."""
    program = load(write(CAUSAL_KERNEL)).program()
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((8, 4)), rng.standard_normal((16, 4))
    (s,) = evaluate(program, {"Q": q, "K": k}).values()
    expected = np.where(np.tril(np.ones((8, 16), dtype=bool), 8), q @ k.T, -np.inf)
    assert np.array_equal(np.isinf(s), np.isinf(expected))
    np.testing.assert_allclose(np.where(np.isinf(s), 0, s), np.where(np.isinf(expected), 0, expected), rtol=1e-12)
    assert np.isinf(s[0, 9:]).all() and np.isfinite(s[0, :9]).all()


def test_causal_in_a_kernel_compiles_to_code_that_masks_the_same_elements(write, tmp_path):
    """The generated CUDA, run in the CPU emulation, places each block's mask as the block interpreter does."""
    import json

    from prism_dsl.backend.emulate import compiler
    if compiler() is None:
        pytest.skip("no C++ compiler (g++ or clang++) for the emulation")
    out = tmp_path / "out"
    assert main(["compile", str(write(CAUSAL_KERNEL)), "--search", "none", "-o", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["checked"]["emulation"]["passed"], report["checked"]


TRANSPOSED_OPERANDS = """# A product's right operand read transposed from its tile, one kernel per tensor-core path.
program kt(A: f16[64, 64], B: f16[64, 64], C: f16[8, 64], D: f16[48, 64], Q: f16[2, 32, 64], K: f16[2, 128, 64],
           V: f16[2, 128, 64]) {
    kernel mn grid(x = g1) loop(F1) {
        at = load A[:, loop]
        bt = load B[x, loop]
        store S1[:, x] = acc_sum(at @ transpose(bt, 0, 1))
    }
    kernel nm grid(x = g2) loop(F2) {
        ct = load C[:, loop]
        bt = load B[x, loop]
        store S2[:, x] = acc_sum(ct @ transpose(bt, 0, 1))
    }
    kernel odd grid(x = g3) loop(F3) {
        at = load A[:, loop]
        dt = load D[x, loop]
        store S3[:, x] = acc_sum(at @ transpose(dt, 0, 1))
    }
    kernel whole grid(x = g4) {
        at = load A[:, :]
        bt = load B[x, :]
        store S4[:, x] = exp((at @ transpose(bt, 0, 1)) * 0.125)
    }
    kernel flash grid(x = g5) loop(F5) {
        qt = load Q[x, :, :]
        kt = load K[x, loop, :]
        vt = load V[x, loop, :]
        s = qt @ transpose(kt, -1, -2)
        store O[x, :, :] = acc_softmax_out(s, vt) / acc_softmax_sum(s)
    }
    return S1, S2, S3, S4, O
}
"""


def test_a_transposed_right_operand_stays_on_tensor_cores(write, tmp_path):
    """K as stored for Q @ K^T: the register-tiled product in both orientations (and with an odd number of
    n8 tiles per warp), the wmma product and online softmax read the transposed tile without `.trans`
    (a column-major fragment for wmma), and the emulated CUDA, under AddressSanitizer, matches the
    float64 reference."""
    import json

    from prism_dsl.backend.emulate import compiler
    if compiler() is None:
        pytest.skip("no C++ compiler (g++ or clang++) for the emulation")
    out = tmp_path / "out"
    assert main(["compile", str(write(TRANSPOSED_OPERANDS)), "--search", "none", "-o", str(out), "--sanitize",
                 "address", "--grid", "g1=2,g2=2,g3=2,g4=2,g5=2", "--loop", "F1=2,F2=2,F3=2,F5=2"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["checked"]["emulation"]["passed"], report["checked"]
    source = {name: (out / f"{name}.cu").read_text() for name in ("mn", "nm", "odd", "whole", "flash")}
    assert "ldmatrix<4>(r, s_bt + (wc + j * 8 + lane / 16 * 8 + lane % 8)" in source["mn"]
    assert "ldmatrix<4>(fa[i], s_bt + (wc + i * 16 + lane % 16)" in source["nm"]
    assert "ldmatrix<2>(fb[j], s_dt + (wc + j * 8 + lane % 8)" in source["odd"]
    assert "wmma::col_major> b" in source["whole"]
    assert "ldmatrix<4>(r, s_kt + (j * 8 + lane / 16 * 8 + lane % 8)" in source["flash"]
    assert not any(re.search(r"ldmatrix<\d, true>\([^,]+, s_[bdk]t ", s) for s in source.values())


@pytest.mark.parametrize("body", [
    "Y = A @ transpose(B * 2, -1, -2)",
    "Y = A @ transpose(exp(B), -1, -2)",
    "Y = transpose(A3, 0, 1) @ transpose(transpose(B3, 0, 1), -1, -2)",  # heads in the middle, token-major
])
def test_a_transposed_value_computed_first_is_stored_then_loaded_transposed(body, write, tmp_path, capsys):
    """A product's right operand that transposes a computed value: the value is computed by a kernel of its
    own and the product loads it transposed (it was fused into the transpose, which the product's load does,
    so nothing computed it: a TypeError or AttributeError from the lowering)."""
    text = (f"dims n = 16, m = 16, d = 32, h = 2\nprogram p(A: f32[n, d], B: f32[m, d], A3: f32[n, h, d], "
            f"B3: f32[m, h, d]) {{\n    {body}\n    return Y\n}}\n")
    from prism_dsl.backend.emulate import compiler

    emulated = [] if compiler() else ["--no-emulate"]
    code = main(["compile", str(write(text)), "--search", "none", "--arch", "none", "-o", str(tmp_path / "out"),
                 *emulated])
    out = capsys.readouterr().out
    assert code == 0 and ("verified: yes" in out or emulated), out


GAIN_BEFORE_PRODUCT = """# RMSNorm's gain applied to x inside the loop, before the projection (Llama's QKV, fused).
dims n = 64, d = 256, e = 256
program gain(X: f16[n, d], G: f16[d], W: f16[d, e]) {
    kernel k grid(x = gx) loop(F) {
        xt = load X[:, loop]
        gt = load G[loop]
        wt = load W[loop, x]
        store Y[:, x] = acc_sum(gt * xt @ wt) / sqrt(acc_mean_last(xt * xt) + 1e-05)
    }
    return Y
}
"""


def test_an_element_wise_product_operand_is_kept_in_16_bits_for_tensor_cores(write, tmp_path):
    """gt * xt, read only by the product, is written once per iteration to a padded f16 buffer, which the
    register-tiled product reads by ldmatrix; the emulated CUDA, under AddressSanitizer, matches the
    float64 reference."""
    import json

    from prism_dsl.backend.emulate import compiler
    from prism_dsl.kernels.fusion import plan
    program = load(write(GAIN_BEFORE_PRODUCT)).program()
    (kernel,) = kernels_of(program)
    staged = [b for b in plan(kernel).buffers if b.role == "value" and b.node.op == "mul" and b.dtype is not DType.F32]
    assert len(staged) == 1 and staged[0].dtype is DType.F16 and staged[0].pad == 8  # x * x stays f32
    if compiler() is None:
        pytest.skip("no C++ compiler (g++ or clang++) for the emulation")
    out = tmp_path / "out"
    assert main(["compile", str(write(GAIN_BEFORE_PRODUCT)), "--search", "none", "-o", str(out), "--sanitize",
                 "address", "--grid", "gx=2", "--loop", "F=2", "--no-wgmma"]) == 0  # wgmma: test_codegen
    report = json.loads((out / "report.json").read_text())
    assert report["checked"]["emulation"]["passed"], report["checked"]
    source = (out / "k.cu").read_text()
    name = f"s_{staged[0].name}"
    assert f"prism::store16({name} + i0 * 136 + i1, w);" in source  # 8 elements a thread, padded rows
    assert f"prism::ldmatrix<4>(fa[i], {name} + " in source


def test_causal_attention_runs_rope_the_mask_and_online_softmax_on_tensor_cores():
    """The fused causal kernel: RoPE'd Q (scaled) and K kept in padded f16 buffers computed from the tiles
    (Q's once, before the loop), the mask applied to the scores in registers where a tile crosses the
    diagonal, and the loop bounded per block."""
    from prism_dsl.backend.codegen import render_kernel
    from prism_dsl.kernels.fusion import plan

    k = kernels_of(load(REPO / "programs" / "fused" / "causal_attention.prism").program())[0]
    p = plan(k)
    ropes = [n for n in k.body() if n.op == "rope"]
    scaled = next(n for n in k.body() if n.op == "div")
    assert p.buffer(scaled).dtype is DType.F16 and p.buffer(ropes[1]).dtype is DType.F16  # the products' operands
    c = instantiate(k, binding(b=1, h=2, q=128, kv=128, dh=64, gq=2, gh=2, F=4), H100)
    src = render_kernel(c, load(REPO / "programs" / "fused" / "causal_attention.prism").program()).source
    loop = src.index("for (int it = 0; it < loop_end; ++it)")
    assert "const int loop_end = prism::causal_end((int)blockIdx.x * 64 + 63, 32, 4);" in src
    assert src.index("// (rope(qt, cqt, sqt) / 11.313708498984761)") < loop < src.index("// rope(kt, ckt, skt)")
    assert "s and p in registers" in src and "sc[i][j][e] = -INFINITY;" in src


POST_LOOP_CAUSAL = """dims n = 8, m = 16
program p(X: f32[n, m]) {
    kernel k grid(x = gx) loop(F) {
        xt = load X[x, loop]
        store P[x, :] = causal(acc_sum(xt))
    }
    Y = sum(P, -1)
    return Y
}
"""


def test_a_mask_after_the_loop_over_a_dim_the_loop_splits_is_refused_where_it_is_written(write):
    """After the loop, a dim the loop walks holds every iteration's piece folded together: the block interpreter
    and the code generator both refused to place a mask there, and returned as it is, P's shape [n, m/F] follows
    the loop's range. The checker refuses the fold itself now: its value depends on F (`kernels.pieces`)."""
    for text in (POST_LOOP_CAUSAL, POST_LOOP_CAUSAL.replace("    Y = sum(P, -1)\n    return Y", "    return P")):
        with pytest.raises(PrismError, match=r"t.prism:5:32: acc_sum gives what depends on how many iterations the "
                                             r"loop has \(F\): tiles of different parts of a dim the loop splits"):
            load(write(text))


ROPED_KEYS = """dims b = 1, h = 2, q = 64, kv = 96, dh = 16
program causal_attention(Q: f16[b, h, q, dh], K: f16[b, h, kv, dh], V: f16[b, h, kv, dh], CQ: f16[q, dh],
                          SQ: f16[q, dh], CK: f16[kv, dh], SK: f16[kv, dh]) {
    t7 = rope(K, CK, SK)
    kernel fused1 grid(x = gx, y = gy, z = gz) loop(F) {
        qt = load Q[:, z, y, :]
        vt = load V[:, z, loop, x]
        cqt = load CQ[y, :]
        sqt = load SQ[y, :]
        t7t = load t7[:, z, loop, :]
        t0 = causal(rope(qt, cqt, sqt) / 4.0 @ transpose(t7t, 3, 2))
        store O[:, z, y, x] = acc_softmax_out(t0, vt) / acc_softmax_sum(t0)
    }
    return O
}
"""


@pytest.mark.parametrize("dims, floor_us, bound", [
    (dict(n=8, d=4096), 10.06, "memory"),  # 33.7 MB at 3.35 TB/s
    (dict(n=4096, d=4096), 138.91, "math"),  # 137 GFLOP at 989.4 TFLOP/s
], ids=["decode", "prefill"])
def test_the_floor_is_at_the_datasheets_peaks_not_at_the_rates_the_model_takes(dims, floor_us, bound):
    """rms_norm(X) @ W on an H100 SXM: the floors the kernels are judged against are those of its datasheet, not
    the hardware file's measured copy bandwidth and matrix rate (3.0 TB/s, 800 TFLOP/s), which the cost model
    reads: at those the floor was 11-24% higher, and every estimate that much nearer to it."""
    from prism_dsl.backend.roofline import roofline

    plain = load(REPO / "programs" / "rmsnorm_linear.prism").program()
    floor = roofline(plain, bind_dims(plain, dims), H100)
    assert (floor["floor_us"], floor["bound"]) == (pytest.approx(floor_us, abs=0.01), bound)


def test_the_floor_counts_only_what_a_causal_mask_keeps():
    """Both products of causal attention count at the kept share of the scores (row i keeps columns up to
    i + kv - q), in the program as written and in its fused kernel alike; attention without a mask counts
    them whole."""
    from prism_dsl.backend.roofline import kept_share, masked_share, roofline

    assert kept_share(4, 4) == 10 / 16 and kept_share(2, 4) == 7 / 8 and kept_share(4, 2) == 3 / 8
    plain = load(REPO / "programs" / "causal_attention.prism").program()
    fused = load(REPO / "programs" / "fused" / "causal_attention.prism").program()
    dims = dict(b=1, h=2, q=64, kv=96, dh=16)
    share = masked_share(plain, bind_dims(plain, dims))
    assert sorted(share.values()) == [kept_share(64, 96)] * 2
    floor = roofline(plain, bind_dims(plain, dims), H100)
    assert floor["flops"] == round(2 * 2 * 2 * 64 * 96 * 16 * kept_share(64, 96))
    assert roofline(fused, bind_dims(fused, dims), H100)["flops"] == floor["flops"]
    # blocks along the output's columns (x) each compute the scores again: the floor counts them once
    split = load("roped.prism", ROPED_KEYS).program()
    assert roofline(split, bind_dims(split, dims), H100)["flops"] == floor["flops"]
    unmasked = load(REPO / "programs" / "attention.prism").program()
    assert masked_share(unmasked, bind_dims(unmasked, {})) == {}


def test_a_causal_grid_runs_its_longest_query_tiles_first_across_the_heads(write, tmp_path, monkeypatch):
    """The blocks of a causal loop run more iterations the later their query tile: where some wait for a
    slot (more blocks than SMs), the generated code takes the last query tile across every head first,
    then the one before it (`position.longest_first`), and the model schedules them so
    (`position.stretch`): at prefill shapes (16 heads, 32 tiles of 128 rows, 132 SMs) that order ends
    within 2% of the even spread, where the hardware's own order (the tiles of one head, shortest first,
    then the next head's) ends a third later. The emulation, sampling blocks, runs the launch's blocks
    that compute them; it fails where it runs the sampled indices as launched."""
    import heapq

    from prism_dsl.kernels.position import launch_index, launch_order, longest_first, stretch
    from prism_dsl.pipeline import emulation

    program = load("roped.prism", ROPED_KEYS).program()
    k = next(k for k in kernels_of(program) if k.name == "fused1")
    grid = {"x": 1, "y": 4, "z": 3}
    assert longest_first(k, grid, 8) == "y" and launch_order(k, grid, 8) == ("x", "z", "y")
    index = {(y, z): launch_index(k, grid, {"x": 0, "y": y, "z": z}, 8) for y in range(4) for z in range(3)}
    assert [index[3, z] for z in range(3)] == [0, 1, 2] and index[2, 0] == 3
    assert sorted(index.values()) == list(range(12))
    assert longest_first(k, grid, 12) is None  # every block starts at once: taken as launched
    assert longest_first(k, {"x": 1, "y": 1, "z": 30}, 8) is None  # one query tile: every block runs alike
    syms = {s.name: s for s in free_symbols(program)}
    binding = {**bind_dims(program, dict(b=1, h=16, q=4096, kv=4096, dh=16)),
               syms["gx"]: 1, syms["gy"]: 32, syms["gz"]: 16, syms["F"]: 64}
    c = instantiate(k, binding, H100)
    ends = [loop_end(c.shape, k, dict(c.grid), c.loop, causal_loop(k), {"y": y}) for y in range(32)]
    assert ends == [2 * (y + 1) for y in range(32)]
    assert 1 <= stretch(c.shape, k, dict(c.grid), c.loop, 132, 132) < 1.02
    free = [0] * 132
    for n in [ends[y] for _ in range(16) for y in range(32)]:  # as the hardware launches them
        heapq.heapreplace(free, free[0] + n)
    assert max(free) / (16 * sum(ends) / 132) > 1.3
    # generated and emulated, sampled: 3 query tiles of 64 rows on 48 heads (144 blocks), 4 key tiles
    path = write(ROPED_KEYS.replace("dims b = 1, h = 2, q = 64, kv = 96, dh = 16", "dims b = 1, h = 48, q = 192, kv = 256, dh = 64"))
    args = ["compile", str(path), "--search", "none", "--grid", "gx=1,gy=3,gz=48", "--loop", "F=4", "--emulate-blocks", "1",
            "--arch", "none"]
    assert main(args + ["-o", str(tmp_path / "ok")]) == 0
    source = (tmp_path / "ok" / "fused1.cu").read_text()
    assert "blk_y = 2 - launched / 48 % 3;" in source and "blk_z = launched % 48;" in source
    assert "blockIdx.y *" not in source
    monkeypatch.setattr(emulation, "_launched", lambda c, b, sms: b)
    assert main(args + ["-o", str(tmp_path / "wrong")]) == 1


def test_a_hardware_file_like_another_takes_the_figures_it_does_not_give(tmp_path, monkeypatch):
    """The H200 is the H100 with other memory: its file names the H100's (`like`) and gives only what differs
    (the bandwidth, and what a probe on an H200 measured). A file `like` itself is refused with its path."""
    from dataclasses import asdict
    from prism_dsl.kernels import hardware

    h100, h200 = asdict(load_hardware("h100")), asdict(load_hardware("h200"))
    assert {k for k in h100 if h100[k] != h200[k]} == {"name", "bandwidth_gbs", "launch_overhead_us", "dram_latency_ns",
                                                           "datasheet_bandwidth_gbs"}
    assert (h200["bandwidth_gbs"], h200["launch_overhead_us"], h200["dram_latency_ns"]) == (4300.0, 2.7, 660)
    (tmp_path / "loop.toml").write_text('name = "Loop"\nlike = "loop"\n')
    monkeypatch.setattr(hardware, "HARDWARE_DIR", tmp_path)
    hardware.load_hardware.cache_clear()
    try:
        with pytest.raises(PrismError, match=r"loop\.toml is malformed: it is `like` itself"):
            hardware.load_hardware("loop")
    finally:
        hardware.load_hardware.cache_clear()


def test_the_iterations_of_a_causal_grid_are_summed_in_closed_form():
    """`ends_sum` (what the cost model's mean iterations and its schedule of unequal blocks add up) agrees with
    the sum over every block, at random bounds: rows wholly masked, rows past the loop's end and those
    between; `floor_sum` with the sum of floors it stands for."""
    rng = np.random.default_rng(5)
    for _ in range(3000):
        last, step, piece = int(rng.integers(-400, 400)), int(rng.integers(1, 50)), int(rng.integers(0, 60))
        blocks, loop = int(rng.integers(0, 80)), int(rng.integers(1, 40))
        assert ends_sum(last, step, piece, blocks, loop) == sum(_end(last + b * piece, step, loop) for b in range(blocks))
        n, m, a, b = (int(v) for v in rng.integers([0, 1, 0, 0], [60, 40, 90, 90]))
        assert floor_sum(n, m, a, b) == sum((a * i + b) // m for i in range(n))


def test_the_shared_memory_bound_keeps_only_the_terms_that_can_be_largest():
    """`constraints._bound`, the symbolic maximum of the bound: a term another exceeds by a positive sum is
    dropped (zero among them), terms neither exceeds stay, and the value is the largest at any binding."""
    a, b = sympy.symbols("a b", positive=True, integer=True)
    assert _bound(0, a + 128, a) == a + 128
    assert _bound(a * b / 4 + 64, a * b / 4, 0) == a * b / 4 + 64
    kept = _bound(0, a + 1, b, a)
    assert isinstance(kept, sympy.Max) and set(kept.args) == {a + 1, b}
    assert set(_bound(a - b, 0).args) == {a - b, 0}  # a - b is not positive by its form: both stay
    for x, y in [(1, 5), (7, 2), (3, 3)]:
        assert value(kept, {a: x, b: y}) == max(x + 1, y)


def test_a_concrete_kernel_evaluates_all_its_shapes_at_once_as_one_at_a_time_would():
    """`Concrete.shape` and `output_shape` fill every node's shape in one compiled call; each agrees with
    the node's own symbolic shape evaluated alone, for every kernel of the fused programs; and the shared
    memory at a binding (`shared_memory_at`) is the symbolic bound's value there."""
    for path in sorted((Path(__file__).resolve().parent.parent / "programs" / "fused").glob("*.prism")):
        program = load(path).program()
        dims = program.default_binding()
        binding = {**dims, **choose(program, dims, {}, H100)}
        for k in kernels_of(program):
            c = instantiate(k, binding, H100)
            assert not isinstance(c, list), c
            for n in [*k.body(), *k.inputs]:
                assert c.shape(n) == tuple(int_value(s, binding) for s in n.shape), (path.name, n)
            for i, s in enumerate(k.stores):
                assert c.output_shape(i) == tuple(int_value(d, binding) for d in output_shape(s.value.shape, s.map, k))
            assert shared_memory_at(k, binding) == value(shared_memory(k), binding) == c.smem_bytes
            assert shared_memory_at(k, dims) is None or not k.symbols()  # the kernel's own symbols left free


def test_kernels_are_interned_and_compare_as_their_fields_do():
    """Building a kernel equal to one alive gives that one (`kernel._Interned`), so the caches keyed by a kernel
    find it by identity; the equality of the flat form (`Kernel._flat`) covers every field of the dataclass."""
    from dataclasses import fields, replace
    program = load(Path(__file__).resolve().parent.parent / "programs" / "fused" / "attention.decoding.prism").program()
    k = kernels_of(program)[0]
    assert replace(k) is k and replace(k, name=k.name + "2") != k
    assert [f.name for f in fields(k)] == ["name", "grid", "loop", "loads", "stores", "inputs"]
    assert [f.name for f in fields(k.loads[0])] == ["tile", "source", "map"]
    assert [f.name for f in fields(k.stores[0])] == ["name", "value", "map", "add", "then"]
    then = Node("input", (), SUM, k.stores[0].value.dtype, k.stores[0].value.shape)
    assert replace(k, stores=(replace(k.stores[0], then=then),) + k.stores[1:]) != k
    assert [f.name for f in fields(k.stores[0].map)] == ["dims"] and [f.name for f in fields(WHOLE)] == ["axis", "loop"]
    assert replace(k, loop=None) != k and replace(k, stores=k.stores[:1]) != k and replace(k, loads=k.loads[::-1]) != k
    hash(k), k.body(), k._flat()  # what a kernel works out once stays out of its pickle
    assert set(pickle.loads(pickle.dumps(k)).__dict__) == {f.name for f in fields(k)}


CAUSAL_SPLIT = """dims b = 1, h = 2, q = 16, kv = 64, dh = 32
program ca(Q: f16[b, h, q, dh], K: f16[b, h, kv, dh], V: f16[b, h, kv, dh]) {
    kernel partial grid(x = gq, y = gh, z = S) loop(F) {
        qt = load Q[:, y, x, :]
        kt = load K[:, y, z*loop, :]
        vt = load V[:, y, z*loop, :]
        s = causal(qt @ transpose(kt, -1, -2))
        store M[z, :, y, x, :] = acc_max_last(s)
        store L[z, :, y, x, :] = acc_softmax_sum(s)
        store P[z, :, y, x, :] = acc_softmax_out(s, vt)
    }
    kernel combine grid(x = gq, y = gh) loop(S) {
        mt = load M[loop, :, y, x, :]
        lt = load L[loop, :, y, x, :]
        pt = load P[loop, :, y, x, :]
        store O[:, y, x, :] = acc_rescaled_sum(mt, pt) / acc_rescaled_sum(mt, lt)
    }
    return O
}
"""


def test_online_softmax_over_a_piece_the_causal_mask_hides_whole_holds_nothing(tmp_path, capsys):
    """Causal FlashDecoding with more keys than queries: at kv = 24, q = 16 in two pieces, the first 4 rows see
    no key of the second piece. Its running max stays -inf and its sum and output 0 (not exp(-inf - -inf), NaN),
    in the block interpreter and in the generated code alike, so the split equals the plain program: proved,
    run to the same values, compiled and emulated."""
    split = tmp_path / "split.prism"
    split.write_text(CAUSAL_SPLIT)
    plain = tmp_path / "plain.prism"
    plain.write_text(CAUSAL_SPLIT.split("    kernel partial")[0] + "    O = softmax(causal(Q @ transpose(K, -1, -2))) @ V\n"
                     "    return O\n}\n")
    assert main(["prove", str(plain), str(split)]) == 0
    dims = {"b": 1, "h": 2, "q": 16, "kv": 24, "dh": 32}
    a, b = (load(p).program() for p in (split, plain))
    inputs = random_inputs(b, bind_dims(b, dims), 1)
    got = evaluate(a, inputs, {"gq": 1, "gh": 2, "S": 2, "F": 1})["O"]
    assert np.isfinite(got).all() and np.allclose(got, evaluate(b, inputs)["O"], rtol=1e-12, atol=1e-12)
    if __import__("prism_dsl.backend.emulate", fromlist=["compiler"]).compiler() is None:
        pytest.skip("no C++ compiler (g++ or clang++) to emulate the generated code")
    assert main(["compile", str(split), "--search", "none", "-o", str(tmp_path / "out"), "--arch", "none",
                 "--dims", ",".join(f"{k}={v}" for k, v in dims.items()), "--grid", "x=1,y=2,z=2", "--loop", "F=1",
                 "--sanitize", "address"]) == 0
    assert "verified: yes" in capsys.readouterr().out


def test_a_plain_reduction_over_a_kernels_pieces_is_tuned_with_that_kernel(tmp_path, capsys):
    """`sum(P, 0)` walks the S pieces kernel k stored: its kernel's estimate depends on S, so S is tuned with it (the
    tuner priced the reduction with S unbound, and compile stopped on a traceback)."""
    path = tmp_path / "pieces.prism"
    path.write_text("dims n = 8, d = 64\nprogram p(X: f16[n, d]) {\n    kernel k grid(z = S) loop(F) {\n"
                    "        xt = load X[:, z*loop]\n        store P[z, :, :] = acc_sum_last(xt)\n    }\n"
                    "    R = sum(P, 0)\n    return R\n}\n")
    args = ["compile", str(path), "--search", "none", "--arch", "none", "-o", str(tmp_path / "out")]
    assert main(args + ([] if emulate.compiler() else ["--no-emulate"])) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_rope_over_pieces_of_a_row_is_refused_and_over_whole_rows_is_built(tmp_path, capsys):
    """RoPE pairs each element with the one half a row away: on each block's piece of a row it would rotate the
    piece's halves, so what the kernel computes would follow gx. It was refused only where a tile held one element a
    row (a parameter `run` refused at the store); it is refused where it is written now, whatever gx. Whole rows,
    the grid over them, are built."""
    text = ("dims n = 8, d = 16\nprogram r(X: f16[n, d], C: f16[n, d], S: f16[n, d]) {\n"
            "    kernel k grid(x = gx) {\n        xt = load X[:, x]\n        ct = load C[:, x]\n"
            "        st = load S[:, x]\n        store Y[:, x] = rope(xt, ct, st)\n    }\n    return Y\n}\n")
    path = tmp_path / "rope.prism"
    path.write_text(text)
    assert main(["run", str(path), "--grid", "x=8", "--out", str(tmp_path / "y.npz")]) == 1
    err = capsys.readouterr().err
    assert "rope.prism:7:15: what the blocks along grid axis x store depends on how many they are (gx): rope of each " \
           "piece of a row, as if it were the row" in err and "Traceback" not in err
    path.write_text(text.replace("[:, x]", "[x, :]"))
    assert main(["run", str(path), "--grid", "x=8", "--out", str(tmp_path / "y.npz")]) == 0
    args = ["compile", str(path), "--search", "none", "--arch", "none", "-o", str(tmp_path / "out")]
    assert main(args + ([] if emulate.compiler() else ["--no-emulate"])) == 0


def test_a_literal_grid_size_no_dim_divides_is_said_at_the_tile_it_splits(tmp_path, capsys):
    path = tmp_path / "three.prism"
    path.write_text("dims n = 8, d = 256\nprogram p(X: f16[n, d], W: f16[d, d]) {\n"
                    "    kernel k grid(x = 3) loop(F) {\n        xt = load X[:, loop]\n        wt = load W[loop, x]\n"
                    "        store Y[:, x] = acc_sum(xt @ wt)\n    }\n    return Y\n}\n")
    assert main(["run", str(path), "--out", str(tmp_path / "y.npz")]) == 1
    err = capsys.readouterr().err
    assert f"{path}:5:9: no choice of F satisfies the constraints" in err
    assert "tile 'wt' splits dim 1 of size d by grid axis x (3): d/3 = 256/3 is not a whole number" in err


def test_kernel_parameters_for_a_program_without_kernels_say_where_they_apply(capsys, tmp_path):
    """`run programs/swiglu.prism --grid x=4` said "every grid size and loop range is fixed": there are none, and
    `compile` takes the flag for the kernels it lowers the operators into."""
    assert main(["run", str(REPO / "programs" / "swiglu.prism"), "--grid", "x=4", "--out", str(tmp_path / "y.npz")]) == 1
    assert "(kernel parameters of 'swiglu': none: it has no custom kernels; `prismc compile` lowers its operators " \
           "into kernels with parameters of their own" in capsys.readouterr().err
