"""How an output is judged against the float64 reference (`compare.check`), on the CPU and the GPU alike."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from prism_dsl.backend.compare import WIDEST, Tolerance, check, tolerance, widest
from prism_dsl.pipeline.report import widened as tolerance_words
from prism_dsl.kernels.lower import lower
from prism_dsl.lang.check import load
from prism_dsl.semantics.blocks import evaluate
from prism_dsl.semantics.reference import bind_dims, quantize, random_inputs
from prism_dsl.ir.nodes import DType
from prism_dsl.cli.main import main
from test_codegen import ROOT, needs_cxx


def test_check_passes_within_tolerance_and_fails_beyond():
    ref = np.linspace(1, 2, 100)
    assert check(ref * 1.005, ref)["passed"]
    result = check(ref * (1 + 0.05 * (np.arange(100) == 37)), ref)
    assert not result["passed"] and result["worst_index"] == (37,)
    assert result["max_rel_err"] == pytest.approx(0.05 * ref[37] / (ref[37] + np.sqrt(np.mean(ref**2))))


def test_check_never_passes_nan_or_inf():
    ref = np.ones((4, 4))
    got = ref.astype(np.float16)
    got[1, 2], got[3, 0] = np.nan, np.inf
    result = check(got, ref, rtol=1e9)
    assert not result["passed"] and result["nan"] == 2 and result["worst_index"] == (1, 2)
    assert "2 elements are NaN or inf" in result["reason"]
    assert result["reason"].endswith("(the first at (1, 2): nan, expected 1)")  # where, as `verify` says


def test_a_reference_of_nan_fails_and_says_where_the_program_is_undefined():
    """Even a NaN where the reference has NaN does not pass: the program is not defined on those inputs (the
    sqrt of a negative), and the reason says how many elements and the first, which the summary prints."""
    ref = np.ones((3, 4))
    ref[1, 2] = ref[2, 0] = np.nan
    result = check(ref.copy(), ref)
    assert not result["passed"] and result["max_rel_err"] == 0.0
    held = "the reference itself holds NaN (2 of 12 elements, the first at (1, 2)): the program is not defined on these inputs"
    assert result["reason"] == result["undefined"] == f"{held}; where it is defined (10 elements) the output agrees with it"
    # the elements where it is defined are compared: a wrong one is named
    got = ref.copy()
    got[0, 3] = 1.5
    wrong = check(got, ref)
    assert not wrong["passed"] and wrong["max_rel_err"] > 0.2 and wrong["first_wrong"]["index"] == [0, 3]
    assert wrong["reason"].endswith("differs from it: the first wrong element at (0, 3) is 1.5, expected 1")
    # and where it is defined nowhere, nothing is
    nowhere = check(np.zeros(3), np.full(3, np.nan))
    assert nowhere["max_rel_err"] == np.inf and nowhere["reason"] == nowhere["undefined"] == (
        "the reference itself holds NaN (3 of 3 elements, the first at (0,)): the program is not defined on these inputs")


def test_the_tolerance_is_twenty_rounding_units_of_the_narrowest_storage_type_and_at_least_its_floor():
    assert tolerance({"f16"}) == tolerance({"f16", "f32", "f64"}) == tolerance(set()) == 1e-2
    assert tolerance({"f32"}) == tolerance({"f32", "f64"}) == 2e-4 and tolerance({"f64"}) == 1e-9
    assert tolerance({"bf16"}) == tolerance({"bf16", "f16", "f32"}) == 20 * 2.0**-8  # 0.078
    # a relative error of 3e-2: over f16's tolerance, within what bf16's roundings reach (causal attention
    # with RoPE, those roundings made exactly: up to 3.7e-2)
    ref = np.linspace(-1, 1, 9)
    got = ref + 3e-2 * (np.abs(ref) + np.sqrt(np.mean(ref**2)))
    assert not check(got, ref, tolerance({"f16"}))["passed"] and check(got, ref, tolerance({"bf16"}))["passed"]


def test_an_f32_program_is_held_to_f32_and_an_f32_value_rounded_to_16_bits_fails_it():
    """An f32 program's outputs 0.5% off, or rounded to f16 on the way (what a kernel that kept an f32 value in
    16 bits would give), fail its tolerance; f32's own rounding of the float64 values passes it."""
    ref = np.random.default_rng(0).standard_normal((64, 64))
    rtol = tolerance({"f32"})
    assert not check(ref * 1.005, ref, rtol)["passed"]
    assert not check(ref.astype(np.float16), ref, rtol)["passed"]
    assert check(ref.astype(np.float32), ref, rtol)["passed"]


def test_check_poison_pattern_fails():
    poison = np.full(4, 0xFFFF, np.uint16).view(np.float16)
    assert check(poison, np.zeros(4))["nan"] == 4


def test_check_tolerates_near_zero_references():
    ref = np.array([1.0, -1.0, 1e-9, 2.0])
    got = ref + np.array([0, 0, 1e-4, 0])
    result = check(got, ref)
    assert result["passed"] and result["max_abs_err"] == pytest.approx(1e-4)


def test_check_all_zero_reference():
    assert check(np.zeros(3), np.zeros(3))["passed"]
    result = check(np.array([0.0, 1e-30, 0.0]), np.zeros(3))
    assert not result["passed"] and result["worst_index"] == (1,)


def test_check_shape_mismatch_fails_with_a_reason():
    result = check(np.zeros((2, 3)), np.zeros((3, 2)))
    assert not result["passed"] and result["reason"] == "shape (2, 3) differs from the reference's (3, 2)"


def test_check_wants_the_references_infinities_exactly():
    ref = np.array([-np.inf, 1.0, 2.0])
    assert check(np.array([-np.inf, 1.0, 2.0], np.float32), ref)["passed"]
    assert not check(np.array([np.inf, 1.0, 2.0]), ref)["passed"]
    assert not check(np.array([-65504.0, 1.0, 2.0], np.float16), ref)["passed"]  # the largest f16 is not -inf


def test_an_output_stored_past_its_types_range_is_the_infinity_the_type_stores():
    """Given the output's storage type, an element whose reference that type rounds to an infinity (or that is
    within the tolerance of doing so) may be that infinity, and is counted; nowhere else, and never of the other
    sign. Without the type, an infinity the reference lacks fails as before."""
    ref = np.array([1.0, 84136.6, -70000.0, 65000.0, 2.0])
    got = np.array([1.0, np.inf, -np.inf, np.inf, 2.0], np.float16)
    result = check(got, ref, dtype="f16")
    assert result["passed"] and result["overflow"] == 3 and result["dtype"] == "f16"  # 65000 * 1.01 rounds past it
    assert result["max_rel_err"] == 0.0  # and the scale leaves them out
    assert not check(got, ref)["passed"]
    assert not check(np.array([1.0, np.inf, np.inf, 65000.0, 2.0]), ref, dtype="f16")["passed"]  # -70000 is not +inf
    assert not check(np.array([1.0, np.inf, -np.inf, 65000.0, np.inf]), ref, dtype="f16")["passed"]  # 2 is finite
    assert not check(np.array([np.inf, 1.0]), np.array([60000.0, 1.0]), dtype="f16")["passed"]  # within range
    assert not check(np.array([np.inf, 1.0]), np.array([84136.6, 1.0]), dtype="f32")["passed"]  # f32 holds it
    assert check(np.array([np.inf, 1.0]), np.array([3.5e38, 1.0]), dtype="f32")["overflow"] == 1
    assert "overflow" not in check(ref, ref, dtype="f16")


def test_an_output_past_f16s_range_passes_and_the_summary_says_so(tmp_path, capsys):
    """A program whose f16 output the reference puts past 65504 on the checks' random inputs: the kernels store
    those elements as inf, as the program's type does, and the check passes on the rest and says how many."""
    path = tmp_path / "p.prism"
    path.write_text("dims n = 8, d = 64\nprogram big(X: f16[n, d]) {\n    Y = X * 40000.0\n    return Y\n}\n")
    out = tmp_path / "out"
    assert main(["compile", str(path), "--search", "none", "-o", str(out), "--arch", "none"]) == 0
    said = capsys.readouterr().out
    y = json.loads((out / "report.json").read_text())["checked"]["emulation"]["outputs"]["Y"]
    assert y["passed"] and y["overflow"] > 0 and "verified: yes" in said
    assert f"{y['overflow']} element(s) past f16's range in the reference, stored as its infinities" in said


def test_the_roundings_of_an_output_cut_to_the_callers_rows_are_measured_on_those_rows():
    """Where the build's rows were rounded up (`pipeline.padding`), the output judged is the caller's first rows,
    and the rounded values (of every row built) are measured on the same rows."""
    ref = np.linspace(1.0, 2.0, 12).reshape(3, 4)
    rounded = np.vstack([ref * (1 + 0.03), np.full((2, 4), 1e6)])  # the rows past the caller's: anything
    tol = Tolerance(0.01, lambda: {"Y": rounded})
    assert tol.rounding("Y", ref) == pytest.approx(check(ref * 1.03, ref)["max_rel_err"])
    judged = tol.judge("Y", ref * 1.04, ref)
    assert judged["passed"] and judged["rtol"] == pytest.approx(2 * judged["rounding"])


def test_check_takes_torch_tensors_bf16_included():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    ref = np.array([1.0, -2.5, 3.25])
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        assert check(torch.tensor(ref, dtype=dtype), ref, rtol=1e-12)["passed"]  # these values are exact in each
    result = check(torch.tensor([1.0, -2.5, 3.5], dtype=torch.float64), ref)
    assert not result["passed"] and result["first_wrong"] == {"index": [2], "got": 3.5, "expected": 3.25}


def _never():
    raise AssertionError("the rounded reference is made only for an output that misses the base tolerance")


def test_an_output_within_the_base_tolerance_never_asks_for_the_rounded_reference():
    ref = np.linspace(1, 2, 100)
    result = Tolerance(1e-2, _never).judge("O", ref * 1.005, ref)
    assert result["passed"] and result["rtol"] == 1e-2 and "rounding" not in result


def test_an_output_that_rounding_alone_moves_past_the_tolerance_is_judged_at_twice_the_roundings_error():
    ref = np.ones(100)  # |ref| + rms(ref) = 2: a relative error is half the change
    rounded = ref + 0.03 * (np.arange(100) == 3)  # the roundings alone: 1.5e-2, past 1e-2
    tol = Tolerance(1e-2, lambda: {"O": rounded})
    result = tol.judge("O", ref + 0.04 * (np.arange(100) == 50), ref)  # 2e-2, on another element
    assert result["passed"] and result["rounding"] == pytest.approx(0.015) and result["rtol"] == pytest.approx(0.03)
    wrong = tol.judge("O", ref + 0.2 * (np.arange(100) == 50), ref)  # a bug, not a rounding
    assert not wrong["passed"] and wrong["rtol"] == pytest.approx(0.03) and "exceeds 0.03" in wrong["reason"]


def test_roundings_within_the_base_tolerance_widen_nothing_and_nan_never_passes():
    ref = np.ones(100)
    result = Tolerance(1e-2, lambda: {"O": ref * 1.001}).judge("O", ref * 1.05, ref)
    assert not result["passed"] and result["rtol"] == 1e-2 and result["rounding"] == pytest.approx(5e-4)
    poison = ref.copy()
    poison[7] = np.nan
    assert not Tolerance(1e-2, lambda: {"O": ref * 1.5}).judge("O", poison, ref)["passed"]
    assert not Tolerance(1e-2).judge("O", ref * 1.05, ref)["passed"]  # no rounded reference: the base alone


def test_roundings_that_lose_the_output_widen_the_tolerance_no_further_than_the_widest():
    """A sum past f16's range stored in f16 makes every probability 0: the roundings alone then lose half the output,
    and twice that would pass anything. No check is widened past `widest(base)` (0.1, or 3 times the base: bf16's
    0.234), and the words say why it failed; an output that passes there is not said to be lost."""
    ref = np.ones(100)
    lost = Tolerance(1e-2, lambda: {"O": np.zeros(100)})
    result = lost.judge("O", np.zeros(100), ref)
    assert not result["passed"] and result["rtol"] == WIDEST and result["rounding"] == pytest.approx(0.5)
    assert "alone move it by 0.5, more than a check can allow (0.1)" in result["reason"]
    assert "the widest a check allows" in tolerance_words(result, 1e-2)
    near = Tolerance(1e-2, lambda: {"O": ref + 0.08 * (np.arange(100) == 3)})  # roundings of 4e-2: 8e-2 allowed
    assert near.judge("O", ref + 0.14 * (np.arange(100) == 9), ref)["rtol"] == pytest.approx(0.08)
    assert "twice the" in tolerance_words(near.judge("O", ref + 0.14 * (np.arange(100) == 9), ref), 1e-2)
    bf16 = Tolerance(tolerance({"bf16"}), lambda: {"O": ref + 0.43 * (np.arange(100) == 3)})  # roundings of 0.215
    kept = bf16.judge("O", ref + 0.4 * (np.arange(100) == 9), ref)  # 0.2: within 3 times bf16's 0.078
    assert kept["passed"] and kept["rtol"] == pytest.approx(widest(tolerance({"bf16"})))
    assert "the widest a check allows" in tolerance_words(kept, 1e-2) and "lose" not in tolerance_words(kept, 1e-2)


def test_a_mask_limits_the_roundings_error_to_the_elements_compared():
    ref = np.ones(100)
    rounded = ref + 0.1 * (np.arange(100) == 90)  # far off, but outside the mask
    mask = np.arange(100) < 50
    result = Tolerance(1e-2, lambda: {"O": rounded}).judge("O", np.where(mask, ref + 0.03, ref), ref, mask)
    assert not result["passed"] and result["rounding"] == 0.0 and result["rtol"] == 1e-2


def test_the_roundings_are_measured_within_the_program_built_so_a_wrong_program_never_widens_its_own_tolerance():
    """With `exact`, e is the rounded values against the same program unrounded: a program whose values are
    off the reference (a wrong fusion, say) has small roundings of its own and is judged at the base."""
    ref = np.ones(100)
    wrong = ref + 0.2 * (np.arange(100) == 50)  # the program built, off the reference on one element
    tol = Tolerance(1e-2, lambda: {"O": wrong * (1 + 1e-4)}, lambda: {"O": wrong})
    result = tol.judge("O", wrong, ref)
    assert not result["passed"] and result["rtol"] == 1e-2 and result["rounding"] < 1e-3
    judged_on_ref = Tolerance(1e-2, lambda: {"O": wrong * (1 + 1e-4)}).judge("O", wrong, ref)
    assert judged_on_ref["passed"]  # what measuring against the reference instead would have let through


def test_the_rounded_evaluation_rounds_what_each_kernel_stores_to_its_storage_type(tmp_path):
    """Attention as written: the scores go to device memory between the product and the softmax, and the
    probabilities between the softmax and the second product, each in f16; the output too."""
    path = tmp_path / "a.prism"
    path.write_text("dims s = 8, dh = 128, kv = 64\n\nprogram a(Q: f16[s, dh], K: f16[dh, kv], V: f16[kv, dh]) {\n"
                    "    O = softmax(Q @ K) @ V\n    return O\n}\n")
    program = load(path).program()
    inputs = random_inputs(program, bind_dims(program, {}), 0)
    f16 = lambda x: quantize(np.asarray(x), DType.F16)  # noqa: E731
    s = f16(inputs["Q"] @ inputs["K"])
    p = np.exp(s - s.max(-1, keepdims=True))
    want = f16(f16(p / p.sum(-1, keepdims=True)) @ inputs["V"])
    got = evaluate(lower(program), inputs, rounded=True)["O"]
    assert np.allclose(got, want, rtol=1e-12, atol=0)
    assert not np.allclose(evaluate(lower(program), inputs)["O"], want, rtol=1e-6)


@needs_cxx
def test_attention_whose_scores_are_stored_in_f16_is_judged_at_what_storing_them_costs(tmp_path, capsys):
    """128-wide heads, no 1/sqrt(dh): scores of about +-30 stored in f16 between two kernels move the output
    by 1.05e-2 whatever the kernels (the program as written, op by op); the emulation's error is exactly
    that, and it passes at twice it, where a check that rounded only the products' operands failed it."""
    widened(tmp_path, capsys, (ROOT / "programs/gqa.prism").read_text(), "g=1,s=8,dh=128,kv=128", "stored tensors")


def widened(tmp_path, capsys, text: str, dims: str, says: str) -> Path:
    """Compile `text` as written at `dims`; its output O passes at twice its own roundings' error, which is the
    kernels' error (to 10%), and the summary says `says`. The output directory."""
    path = tmp_path / "p.prism"
    path.write_text(text)
    out = tmp_path / "out"
    assert main(["compile", str(path), "--search", "none", "-o", str(out), "--arch", "none", "--dims", dims]) == 0
    assert says in capsys.readouterr().out
    o = json.loads((out / "report.json").read_text())["checked"]["emulation"]["outputs"]["O"]
    assert o["passed"] and o["rounding"] > 1e-2 and o["rtol"] == pytest.approx(2 * o["rounding"])
    assert o["max_rel_err"] == pytest.approx(o["rounding"], rel=0.1)
    return out


def test_the_rounded_reference_rounds_every_products_operands_to_their_storage_types_and_computes_in_f32(tmp_path):
    """Program as written and custom kernel alike (the block interpreter applies the same rule); a custom
    kernel's stored output is rounded to its type too, which for the fused form is the output's own rounding.
    Every operation runs in f32, as a kernel's arithmetic does, but where f64 is stored: there it is the
    float64 reference exactly."""
    path = tmp_path / "p.prism"
    path.write_text("dims n = 8, d = 16\n\nprogram p(X: f16[n, d], W: f16[d, d]) {\n"
                    "    Y = rms_norm(X) * 3.0 @ W + X\n    return Y\n}\n")
    program = load(path).program()
    inputs = random_inputs(program, bind_dims(program, {}), 0)
    x, w = inputs["X"], inputs["W"]
    normed = x / np.sqrt(np.mean(x * x, -1, keepdims=True)) * 3.0
    assert np.allclose(evaluate(program, inputs)["Y"], normed @ w + x, rtol=1e-12)
    got = evaluate(program, inputs, rounded=True)["Y"]
    x32, w32 = x.astype(np.float32), w.astype(np.float32)  # W and X: stored f16 already
    normed32 = x32 / np.sqrt(np.mean(np.square(x32), axis=-1, keepdims=True)) * np.float32(3.0)
    operand = quantize(normed32.astype(np.float64), DType.F16).astype(np.float32)
    assert np.allclose(got, operand @ w32 + x32, rtol=1e-6) and np.array_equal(got, quantize(got, DType.F32))
    assert not np.allclose(got, normed @ w + x, rtol=1e-6)
    path.write_text(path.read_text().replace("f16", "f64"))
    program = load(path).program()
    inputs = random_inputs(program, bind_dims(program, {}), 0)
    assert np.array_equal(evaluate(program, inputs, rounded=True)["Y"], evaluate(program, inputs)["Y"])
    fused = load("programs/fused/rmsnorm_linear.prism").program()
    inputs = random_inputs(fused, bind_dims(fused, {"n": 8, "d": 64}), 0)
    exact, rounded = evaluate(fused, inputs)["Y"], evaluate(fused, inputs, rounded=True)["Y"]
    assert np.array_equal(exact, rounded) or check(rounded, exact)["max_rel_err"] < 1e-3


@needs_cxx
def test_a_kernel_on_tensor_cores_is_held_to_the_roundings_it_cannot_avoid(tmp_path, capsys):
    """Causal attention with RoPE whose scores are sharpened (x4 where the program divides by sqrt(128)): the
    RoPE'd queries and keys go to the products in f16, and that alone moves the output past 1e-2. The kernel's
    error is the roundings' own (it rounds where they do), so it passes at twice theirs; compile and verify
    both say why the tolerance is wider."""
    text = (ROOT / "programs/fused/causal_attention.prism").read_text().replace("/ sqrt(128)", "* 4.0")
    out = widened(tmp_path, capsys, text, "h=2,q=128,kv=128,dh=64", "twice the")
    assert main(["verify", str(out)]) == 0
    assert "(tolerance " in capsys.readouterr().out


@needs_cxx
def test_an_f32_layer_norm_of_rows_far_from_zero_meets_f32s_tolerance(tmp_path, capsys):
    """Split in two kernels, the second adds 256 piece means near 1000: one running f32 sum lost 4.1e-4 of the
    centred values, past 2e-4; eight interleaved sums added pairwise (`ctext.reduction`) lose 9e-5."""
    path = tmp_path / "far.prism"
    path.write_text("dims n = 4, d = 16384\nprogram far(X: f32[n, d]) {\n    Y = layer_norm(X + 1000.0, 1e-5)\n"
                    "    return Y\n}\n")
    out = tmp_path / "out"
    assert main(["compile", str(path), "--search", "none", "--arch", "none", "-o", str(out)]) == 0, capsys.readouterr()
    y = json.loads((out / "report.json").read_text())["checked"]["emulation"]["outputs"]["Y"]
    assert y["rtol"] == 2e-4 and y["max_rel_err"] < 1.5e-4 and "part[p] += " in (out / "layer_norm_Y.cu").read_text()


def test_a_reference_holding_nan_is_counted_over_the_callers_part():
    """Of a tensor built larger than the caller's (`where`: its part), the NaN the message counts are the part's."""
    ref = np.zeros((4, 3))
    ref[:2] = np.nan
    where = np.zeros((4, 3), dtype=bool)
    where[:2] = True
    assert "(6 of 6 elements, the first at (0, 0))" in check(ref, ref, where=where)["reason"]
    assert "(6 of 12 elements" in check(ref, ref)["reason"]
