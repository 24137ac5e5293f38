"""How an output is judged against the float64 reference (`compare.check`), on the CPU and the GPU alike."""

from __future__ import annotations

import numpy as np
import pytest

from prism_dsl.backend.compare import check, tolerance


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


def test_a_reference_of_nan_fails_and_says_where_the_program_is_undefined():
    """Even a NaN where the reference has NaN does not pass: the program is not defined on those inputs (the
    sqrt of a negative), and the reason says how many elements and the first, which the summary prints."""
    ref = np.ones((3, 4))
    ref[1, 2] = ref[2, 0] = np.nan
    result = check(ref.copy(), ref)
    assert not result["passed"] and result["max_rel_err"] == np.inf
    assert result["reason"] == ("the reference itself holds NaN (2 of 12 elements, the first at (1, 2)): "
                                "the program is not defined on these inputs")


def test_the_tolerance_is_twenty_rounding_units_of_the_narrowest_storage_type_and_at_least_1e_2():
    assert tolerance({"f16"}) == tolerance({"f32", "f64"}) == tolerance(set()) == 1e-2
    assert tolerance({"bf16"}) == tolerance({"bf16", "f16", "f32"}) == 20 * 2.0**-8  # 0.078
    # a relative error of 3e-2: over f16's tolerance, within what bf16's roundings reach (causal attention
    # with RoPE, those roundings made exactly: up to 3.7e-2)
    ref = np.linspace(-1, 1, 9)
    got = ref + 3e-2 * (np.abs(ref) + np.sqrt(np.mean(ref**2)))
    assert not check(got, ref, tolerance({"f16"}))["passed"] and check(got, ref, tolerance({"bf16"}))["passed"]


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


def test_check_takes_torch_tensors_bf16_included():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    ref = np.array([1.0, -2.5, 3.25])
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        assert check(torch.tensor(ref, dtype=dtype), ref, rtol=1e-12)["passed"]  # these values are exact in each
    result = check(torch.tensor([1.0, -2.5, 3.5], dtype=torch.float64), ref)
    assert not result["passed"] and result["first_wrong"] == {"index": [2], "got": 3.5, "expected": 3.25}
