"""How an output is judged against the float64 reference: the one comparison the emulation on the CPU and the
kernels on a GPU both answer to (`check`)."""

from __future__ import annotations

import numpy as np


RTOL = 1e-2  # the least relative tolerance of a check: 20 rounding units of f16, about three decimal digits
ROUNDING_UNITS = 20
UNIT = {"f16": 2.0**-11, "bf16": 2.0**-8, "f32": 2.0**-24, "f64": 2.0**-53}  # half the spacing of numbers near 1


def tolerance(dtypes) -> float:
    """The relative tolerance of a program whose inputs and outputs are stored in `dtypes` (names: "f16",
    "bf16", ...): 20 rounding units of the narrowest, and never under RTOL. f16 gets 1e-2; bf16, whose 8
    bits of significand are 3 fewer than f16's, 20 * 2^-8 = 0.078. A kernel on tensor cores must round
    their operands to the storage type (online softmax's probabilities among them): on causal attention with
    RoPE those roundings alone, made exactly, reach 3.7e-2 in bf16 (4.3e-3 in f16; benchmarks/roundings.py)."""
    return max([RTOL] + [ROUNDING_UNITS * UNIT[d] for d in dtypes if d in UNIT])


def _undefined(ref: np.ndarray) -> str:
    nan = np.argwhere(np.isnan(ref))
    return (f"the reference itself holds NaN ({len(nan)} of {ref.size} elements, the first at "
            f"{tuple(map(int, nan[0]))}): the program is not defined on these inputs")


def check(got, ref, rtol: float = RTOL) -> dict:
    """Compare an output with a float64 reference, element by element. Passes when no element of `got` is NaN or
    infinite (but as below) and every element satisfies |got - ref| <= rtol * (|ref| + scale), scale being the
    root-mean-square of `ref`: a relative test that does not fail on elements whose reference happens to be near
    zero while the tensor's values are not. Where the reference is infinite (a masked score), `got` must be the
    same infinity: a finite value there, however large, fails. A failure names the first element out of tolerance
    (`first_wrong`)."""
    if type(got).__module__.split(".")[0] == "torch":  # bf16, which numpy lacks, widened to float32 (exact)
        got = got.detach().cpu()
        got = (got.float() if str(got.dtype) == "torch.bfloat16" else got).numpy()
    got = np.asarray(got)
    ref = np.asarray(ref, dtype=np.float64)
    unfit = (f"shape {got.shape} differs from the reference's {ref.shape}" if got.shape != ref.shape
             else f"dtype {got.dtype} is not a real number type" if got.dtype.kind not in "fiu"
             else _undefined(ref) if np.isnan(ref).any() else "")
    if unfit:
        return dict(passed=False, max_rel_err=np.inf, max_abs_err=np.inf, nan=0, worst_index=(), reason=unfit)
    g = got.astype(np.float64)
    if g.size == 0:
        return dict(passed=True, max_rel_err=0.0, max_abs_err=0.0, nan=0, worst_index=(), reason="")
    infinite = np.isinf(ref)
    bad = (~np.isfinite(g) | infinite) & (g != ref)  # NaN, an infinity the reference lacks, or one it has missed
    finite = np.where(infinite, 0.0, ref)
    err = np.where(bad, np.inf, np.abs(np.where(infinite, 0.0, g) - finite))
    denom = np.abs(finite) + float(np.sqrt(np.mean(finite * finite)))
    with np.errstate(divide="ignore", invalid="ignore"):  # an all-zero reference leaves denom 0
        rel = np.where(denom > 0, err / denom, np.where(err > 0, np.inf, 0.0))
    worst = np.unravel_index(int(np.argmax(rel)), rel.shape)
    wrong = np.argwhere(~(err <= rtol * denom))  # out of tolerance, in row-major order (NaN included)
    passed = len(wrong) == 0
    reason = "" if passed else (
        f"{int(bad.sum())} elements are NaN or inf, or miss an infinity of the reference" if bad.any()
        else f"relative error {float(rel[worst]):.3g} at {tuple(map(int, worst))} exceeds {rtol}")
    out = {"passed": passed, "max_rel_err": float(rel.max()), "max_abs_err": float(err.max()), "nan": int(bad.sum()),
           "worst_index": tuple(int(i) for i in worst), "reason": reason}
    first = None if passed else tuple(int(i) for i in wrong[0])
    if passed:
        return out
    return out | {"first_wrong": {"index": list(first), "got": float(g[first]), "expected": float(ref[first])}}
