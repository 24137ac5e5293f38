"""How an output is judged against the float64 reference: the one comparison the emulation on the CPU and the
kernels on a GPU both answer to (`check`), at the tolerance a program's storage types allow (`Tolerance`)."""

from __future__ import annotations

import math
from typing import Callable, Mapping

import numpy as np

from ..semantics.precision import FLOOR, RTOL, UNIT  # the storage types' units and least tolerances

# The widest a check is ever widened to (`Tolerance`): 0.1, or 3 times the base (bf16's 0.078: 0.234). Past it a
# program's own roundings to its storage types lose the output (a sum past f16's range stored in f16 makes every
# probability 0, 0.5 by `check`'s measure), and a check at twice that would pass a kernel that wrote zeros. The
# widest measured: gqa as written in bf16 (scores of 128-wide heads over 600 keys stored in bf16), 0.215.
WIDEST = 0.1
WIDEST_BASES = 3
ROUNDING_UNITS = 20
# The least magnitude each storage type rounds to an infinity (to nearest, ties to even): its largest number and
# half a spacing more. An f16 output of 84136 is stored as inf, whatever computes it.
OVERFLOW = {"f16": 65520.0, "bf16": 2.0**128 - 2.0**119, "f32": 2.0**128 - 2.0**103}


def widest(base: float) -> float:
    """How far a check of tolerance `base` may be widened (WIDEST, WIDEST_BASES)."""
    return max(WIDEST, WIDEST_BASES * base)


def tolerance(dtypes) -> float:
    """The relative tolerance of a program whose inputs and outputs are stored in `dtypes` (names: "f16",
    "bf16", ...): 20 rounding units of the narrowest, and never under its FLOOR (RTOL where no type is known).
    f16 gets 1e-2; bf16, whose 8 bits of significand are 3 fewer than f16's, 20 * 2^-8 = 0.078; f32 2e-4 and
    f64 1e-9. A kernel on tensor cores must round their operands to the storage type (online softmax's
    probabilities among them): on causal attention with RoPE those roundings alone, made exactly, reach 3.7e-2
    in bf16 (4.3e-3 in f16; benchmarks/roundings.py)."""
    known = [d for d in dtypes if d in UNIT]
    return max((max(FLOOR[d], ROUNDING_UNITS * UNIT[d]) for d in known), default=RTOL)


def _undefined(ref: np.ndarray, where: np.ndarray | None = None) -> str:
    """Why a reference holding NaN is no oracle; counted over `where` (a caller's part of a tensor built larger)."""
    within = np.isnan(ref) if where is None else np.isnan(ref) & where
    nan = np.argwhere(within if within.any() else np.isnan(ref))
    size = ref.size if where is None else int(np.sum(where))
    return (f"the reference itself holds NaN ({len(nan)} of {size} elements, the first at "
            f"{tuple(map(int, nan[0]))}): the program is not defined on these inputs")


def check(got, ref, rtol: float = RTOL, dtype: str | None = None, where: np.ndarray | None = None) -> dict:
    """Compare an output with a float64 reference, element by element. Passes when no element of `got` is NaN or
    infinite (but as below) and every element satisfies |got - ref| <= rtol * (|ref| + scale), scale being the
    root-mean-square of `ref`: a relative test that does not fail on elements whose reference happens to be near
    zero while the tensor's values are not. Where the reference is infinite (a masked score), `got` must be the
    same infinity: a finite value there, however large, fails. Where the output is stored in `dtype` (a name:
    "f16"...), an element the reference puts past that type's range (OVERFLOW), or within rtol of it, may be the
    infinity of its sign, as the type stores it; `overflow` counts them, and they are left out of the scale. A
    failure names the first element out of tolerance (`first_wrong`). `where`: the elements the scale is taken
    over (a caller's part of a tensor built larger; the rest, made to agree, holds what zeros made there)."""
    if type(got).__module__.split(".")[0] == "torch":  # bf16, which numpy lacks, widened to float32 (exact)
        got = got.detach().cpu()
        got = (got.float() if str(got.dtype) == "torch.bfloat16" else got).numpy()
    got = np.asarray(got)
    ref = np.asarray(ref, dtype=np.float64)
    unfit = (f"shape {got.shape} differs from the reference's {ref.shape}" if got.shape != ref.shape
             else f"dtype {got.dtype} is not a real number type" if got.dtype.kind not in "fiu" else "")
    if not unfit and np.isnan(ref).any():
        return _where_defined(got, ref, rtol, dtype, where)
    if unfit:
        return dict(passed=False, max_rel_err=np.inf, max_abs_err=np.inf, nan=0, worst_index=(), reason=unfit)
    g = got.astype(np.float64)
    if g.size == 0:
        return dict(passed=True, max_rel_err=0.0, max_abs_err=0.0, nan=0, worst_index=(), reason="")
    overflow = 0
    if dtype in OVERFLOW:  # as the output's type stores a value past its range: the same infinity
        past = np.isfinite(ref) & np.isinf(g) & (np.sign(g) == np.sign(ref)) & (np.abs(ref) * (1 + rtol) >= OVERFLOW[dtype])
        overflow, ref = int(past.sum()), np.where(past, g, ref)
    infinite = np.isinf(ref)
    bad = (~np.isfinite(g) | infinite) & (g != ref)  # NaN, an infinity the reference lacks, or one it has missed
    finite = np.where(infinite, 0.0, ref)
    err = np.where(bad, np.inf, np.abs(np.where(infinite, 0.0, g) - finite))
    scaled = finite if where is None or not np.any(where) else finite[where]
    denom = np.abs(finite) + float(np.sqrt(np.mean(scaled * scaled)))
    with np.errstate(divide="ignore", invalid="ignore"):  # an all-zero reference leaves denom 0
        rel = np.where(denom > 0, err / denom, np.where(err > 0, np.inf, 0.0))
    worst = np.unravel_index(int(np.argmax(rel)), rel.shape)
    wrong = np.argwhere(~(err <= rtol * denom))  # out of tolerance, in row-major order (NaN included)
    passed = len(wrong) == 0
    at = tuple(int(i) for i in np.argwhere(bad)[0]) if bad.any() else ()  # (an f16 output past 65504, say)
    reason = "" if passed else (
        f"{int(bad.sum())} elements are NaN or inf, or miss an infinity of the reference (the first at {at}: "
        f"{float(g[at]):g}, expected {float(ref[at]):g})" if bad.any()
        else f"relative error {float(rel[worst]):.3g} at {tuple(map(int, worst))} exceeds {rtol}")
    out = {"passed": passed, "max_rel_err": float(rel.max()), "max_abs_err": float(err.max()), "nan": int(bad.sum()),
           "worst_index": tuple(int(i) for i in worst), "reason": reason}
    if overflow:
        out |= {"overflow": overflow, "dtype": dtype}
    first = None if passed else tuple(int(i) for i in wrong[0])
    if passed:
        return out
    return out | {"first_wrong": {"index": list(first), "got": float(g[first]), "expected": float(ref[first])}}


def _where_defined(got: np.ndarray, ref: np.ndarray, rtol: float, dtype: str | None, where: np.ndarray | None) -> dict:
    """`check` of an output whose reference holds NaN: never passed (the program is not defined on these inputs, so
    nothing vouches for those elements), but the elements where it is defined are compared, so that a right kernel
    and a wrong one still read differently (a row of zeros in a user's inputs to rms_norm is NaN in that row
    only); `undefined` says so in words."""
    defined = ~np.isnan(ref) if where is None else ~np.isnan(ref) & where
    why = _undefined(ref, where)
    if not defined.any():
        return dict(passed=False, max_rel_err=np.inf, max_abs_err=np.inf, nan=0, worst_index=(), reason=why,
                    undefined=why)
    inner = check(np.where(defined, got, 0), np.where(defined, ref, 0.0), rtol, dtype, defined)
    w = inner.get("first_wrong")
    wrong = f"the first wrong element at {tuple(w['index'])} is {w['got']:.6g}, expected {w['expected']:.6g}" if w \
        else inner["reason"]
    note = (f"{why}; where it is defined ({int(defined.sum())} elements) the output "
            + ("agrees with it" if inner["passed"] else f"differs from it: {wrong}"))
    return inner | {"passed": False, "reason": note, "undefined": note}


def unmasked_finite(ref: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """`ref` with its infinities and NaN outside `mask` (the elements compared) as 0: past a caller's part of a tensor
    built larger it holds what zeros make there, which neither passes nor fails anything."""
    return ref if mask is None else np.where(mask | np.isfinite(ref), ref, 0.0)


class Tolerance:
    """A program's tolerance, per output: `base` (`tolerance` of its storage types), or, for an output that its
    kernels' own roundings move further than that, twice what those roundings alone cost.

    A kernel rounds two kinds of values to 16 bits that the float64 reference does not: the operands of a
    product on tensor cores, computed ones included (a normalised query, RoPE'd keys, softmax's
    probabilities), and every tensor it stores for another kernel to read (attention's scores where the
    product and the softmax are two kernels; f32 partial states excepted, `kernels.kernel.stored_dtype`). How
    far that moves an output depends on the program: with unit-RMS queries and no 1/sqrt(dh) scale, rounding
    the queries to f16 moves attention over 4096 keys by 1.6e-2 (`check`'s measure, 16 heads of 4096
    queries: `benchmarks/roundings.py --program`), past `base`, whatever the kernel; scores of 128-wide heads
    stored in f16 between two kernels move it by about as much. `rounded()` gives the built program evaluated
    with exactly those roundings and nothing else (the block interpreter's `rounded`), `exact()` the same
    program without them (None: the reference itself, where the program built is the input program), and
    `rounding` the error of the one against the other, e. Measured within one program, e is a rounding's
    effect only, never a difference between the program built and the input program, which the check
    itself judges. An output that misses `base` is judged again at max(base, 2e): the kernel computes in
    f32 with its own order of operations and its own exp, so its roundings are of the same size but not
    bit for bit the same, and the worst of a tensor's elements varies with which ones fall where. The
    rounded values (a second evaluation, a third with `exact`) are made only when an output misses `base`,
    so a program whose outputs meet it pays nothing. NaN, infinities and shapes are never widened, and no
    tolerance past `widest(base)`: roundings that lose more than that lose the output, and the check says so."""

    def __init__(self, base: float, rounded: Callable[[], Mapping[str, np.ndarray]] | None = None,
                 exact: Callable[[], Mapping[str, np.ndarray]] | None = None, dtypes: Mapping[str, str] | None = None):
        self.base = base
        self.dtypes = dict(dtypes or {})  # output name -> its storage type, for `check`'s overflow
        self._rounded = rounded
        self._exact = exact
        self._values: Mapping[str, np.ndarray] | None = None
        self._baseline: Mapping[str, np.ndarray] | None = None

    def rounding(self, name: str, ref, mask: np.ndarray | None = None, where: np.ndarray | None = None) -> float | None:
        """The rounded values' max relative error on output `name` (over `mask`) against the same program's
        unrounded ones (`ref` where there is no `exact`), or None without rounded values."""
        if self._rounded is None:
            return None
        if self._values is None:
            self._values = self._rounded()
        if self._exact is not None and self._baseline is None:
            self._baseline = self._exact()
        rounded = np.asarray(self._values[name], dtype=np.float64)
        ref = np.asarray(ref, dtype=np.float64)
        first = tuple(slice(0, n) for n in ref.shape)  # an output cut to the caller's rows (`pipeline.padding`)
        rounded = rounded[first] if rounded.ndim == ref.ndim else rounded
        if self._baseline is not None:
            ref = np.asarray(self._baseline[name], dtype=np.float64)[first]
        ref = unmasked_finite(ref, mask)
        return check(rounded if mask is None else np.where(mask, rounded, ref), ref, self.base,
                     self.dtypes.get(name), where)["max_rel_err"]

    def judge(self, name: str, got, ref, mask: np.ndarray | None = None, where: np.ndarray | None = None) -> dict:
        """`check` at `base`; an output that misses it only by its errors' size, judged at the widened
        tolerance (`rtol` and `rounding` say which was used and why); `where` as `check` takes it."""
        dtype = self.dtypes.get(name)
        first = check(got, ref, self.base, dtype, where) | {"rtol": self.base}
        if first["passed"] or first["nan"] or not math.isfinite(first["max_rel_err"]):
            return first
        e = self.rounding(name, ref, mask, where)
        if e is None or not math.isfinite(e) or 2 * e <= self.base:
            return first if e is None or not math.isfinite(e) else first | {"rounding": e}
        rtol = min(2 * e, widest(self.base))
        judged = check(got, ref, rtol, dtype, where) | {"rtol": rtol, "rounding": e}
        if not judged["passed"] and 2 * e > rtol:
            judged["reason"] += (f"; its kernels' own roundings (their arithmetic's, and their storage types') alone "
                                 f"move it by {e:.3g}, more than a check can allow ({rtol:g})")
        return judged
