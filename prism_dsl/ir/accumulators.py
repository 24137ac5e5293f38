"""The loop accumulators of custom kernels: one table, each accumulator declared once with all a stage needs.

An accumulator ends a kernel's loop body: it starts from `init`, folds each iteration's tile(s) into its
state with `step`, and gives its value after the loop with `finish`. The block-level interpreter runs
these folds one iteration at a time, exactly as a GPU block would; the NumPy semantics of the `acc_*`
operators (used when axioms are checked numerically) run the same folds along the loop dim of a tile
family (see `prove.layout`). What each accumulator *means*, in closed form, is an axiom in
rules/layout.rules, so the numeric check of that file tests these folds against the closed forms.

The online-softmax accumulators keep a running row max `m` and rescale what they have summed so far by
`exp(m_old - m_new)` whenever it grows, so no `exp` ever sees a positive argument (numerically safe
attention, as FlashAttention computes it). The code generated for online softmax in registers may let the max
lag a little behind (`backend.tensor_steps.lazy_max`: exps up to 2^8) where only the quotient of an output by
its sum is read, which does not depend on the max taken; these definitions are the exact ones.

Who reads which field of `Accumulator`: `ops` (name, operands, doc: the `acc_*` OpSpecs), `shapes` and
the prover's size rules in `prove.egraph` (like, row), `semantics` (init, step, finish), the search
(closed, combine, combining_only, operand_ops, like, row, online, linear), `kernels.fusion` (state, online,
reads_once, adds_products), `kernels.pieces` (completes, like, row: the checker's refusal of kernels whose
value depends on how many pieces their loop or grid cuts), `backend.codegen` (cuda_*), `backend.cost` (flops,
like). A new
accumulator is one row here plus its definition in rules/layout.rules, as long as its CUDA fold is one of
the kinds `codegen` renders from these strings: per state element (`cuda_fold` lines), per row (a
`cuda_reduce` of `cuda_term`, then `cuda_fold`: "sum", "max", or "welford", a running count, mean and sum
of squared deviations per row merged by Chan's formula, `part` the last), a matrix product (`like`
"matmul": `cuda_fold` is the dot product's start), or a member of the online-softmax group. Another kind of
fold needs its own code in `backend.codegen` (and, for new shared state, in `kernels.fusion`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

State = tuple


def _row(f):
    return lambda t: f(t, axis=-1, keepdims=True)


_rowsum, _rowmax = _row(np.sum), _row(np.max)


def _exp_minus(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """exp(a - b), with 0 where a is -inf: a running max that has seen nothing yet, or a score a causal mask
    removed. Where a row's every score so far was masked (a key tile, or a split's piece, wholly past its last
    key), b is -inf too and exp(a - b) would be NaN; the row then holds 0 (sum and output), and its running max
    -inf, until a score reaches it (`prism::exp_minus`)."""
    with np.errstate(invalid="ignore"):
        return np.where(np.isneginf(a), 0.0, np.exp(a - b))


_rescale = _exp_minus  # exp(m_old - m_new): what was folded so far, to the grown max


def _softmax_sum_step(state: State, s: np.ndarray) -> State:
    m, l = state
    m_new = np.maximum(m, _rowmax(s))
    return m_new, l * _rescale(m, m_new) + _rowsum(_exp_minus(s, m_new))


def _softmax_out_step(state: State, s: np.ndarray, v: np.ndarray) -> State:
    m, o = state
    m_new = np.maximum(m, _rowmax(s))
    return m_new, o * _rescale(m, m_new) + np.matmul(_exp_minus(s, m_new), v)


def _rescaled_step(state: State, m: np.ndarray, x: np.ndarray) -> State:
    big, acc = state
    big_new = np.maximum(big, m)
    return big_new, acc * _rescale(big, big_new) + _exp_minus(m, big_new) * x


def _last(shape):
    return shape[:-1] + (1,)


def _variance_step(state: State, t: np.ndarray) -> State:
    """Chan's merge of a tile's rows into the running (count, mean, sum of squared deviations): each tile's
    deviations are about its own mean, and the two means' difference enters squared, weighted by the counts,
    so nothing ever subtracts two large sums (the moments form E[x^2] - E[x]^2 loses all accuracy on rows far
    from zero)."""
    n, mean, m2 = state
    k = t.shape[-1]
    tile_mean = _rowsum(t) / k
    delta, total = tile_mean - mean, n + k
    return total, mean + delta * (k / total), m2 + _rowsum((t - tile_mean) ** 2) + delta * delta * (n * k / total)


def _variance(b, a):
    """mean(square(a - mean(a, -1)), -1) through the builder `b`."""
    return b("mean", [b("square", [b("sub", [a, b("mean", [a], [-1])])])], [-1])


def _softmax_terms(b, s):
    """exp(s - max(s, -1)) through the builder `b`: online softmax's terms over whole rows."""
    return b("exp", [b("sub", [s, b("max", [s], [-1])])])


@dataclass(frozen=True)
class Accumulator:
    """One loop accumulator: its NumPy fold, shape, closed form, search facts, CUDA fold and cost."""

    name: str
    doc: str
    operands: int  # tensor operands
    like: str  # the op kind ("unary", "binary", "matmul") whose shape rule gives one iteration's value
    row: bool  # the last dim folds too (one value per row), besides the loop's iterations
    # NumPy fold: the state from the first iteration's operand shapes, one iteration, the value.
    init: Callable[..., State]
    step: Callable[..., State]
    finish: Callable[[State], np.ndarray]
    # The value over whole tensors when the loop runs once (the search's abstract expression):
    # closed(build, *operands), where build(op, operands, params) makes a node (`shapes.build`).
    closed: Callable
    # Split reductions (FlashDecoding): the accumulator that combines the per-piece results and the name
    # of the partial tensor; None when pieces cannot be combined. The pieces are equal in size, so a mean
    # of the pieces' means is the whole mean.
    combine: tuple[str, str] | None = None
    combining_only: bool = False  # only a split's combining kernel uses it (generation skips it)
    operand_ops: tuple[str, ...] = ()  # generation folds only values of these ops (empty: any value)
    # Online softmax: "softmax" folds exp(first operand - its running row max), rescaled as the max grows;
    # "max" is that running max. Such accumulators over the same scores share its buffers.
    online: str = ""
    # CUDA: the state buffers by role, the value in the last ("m": a running max, starting at -inf);
    # the fold's format strings ({0}, {1}: the operands at the element; {acc}, {m}: the state buffers;
    # {scale}: online softmax's rescaling factor per row; `part` and `row`: a row fold's C variables; for a
    # product fold, one string: the dot product's start, {row} the element's row in per-row state);
    # the value after the loop ({0}: the state at the element; {count}: the row elements folded).
    state: tuple[str, ...] = ("acc",)
    cuda_reduce: str = ""  # row folds: "sum" or "max" of `cuda_term` over each row, into `part`
    cuda_term: str = "{0}"
    cuda_fold: tuple[str, ...] = ()
    cuda_finish: str = "{0}"
    adds_products: bool = False  # a matrix product that only it reads is added straight into its state
    linear: bool = False  # its value is linear in its operand (the search drops pairs over proportional ones)
    # The reduction ("sum", "max", "mean") whose results over the pieces of a dim it completes into the whole dim's,
    # folding them over the loop (a mean of equal pieces' means is the whole mean); "sum" also says that blocks
    # which each fold a piece may add their values (`kernels.pieces`). Empty: a root mean square, a variance, online
    # softmax: their pieces are combined otherwise (`combine`).
    completes: str = ""
    flops: int = 1  # per element of the first operand (a product adds 2 per multiply-add)
    # A dim built past the size the caller gave (`kernels.masking`): the value each element of the first
    # operand's last dim past that size takes before the fold (the fold's identity: 0 for a sum, -inf for a
    # max and for online softmax's scores); None where the fold counts its elements (a mean's divisor).
    past_end: float | None = None

    @property
    def per_element(self) -> bool:
        """Each state element folds the operands' elements at its own index, once each."""
        return not self.row and self.like != "matmul"

    @property
    def reads_once(self) -> bool:
        """Each iteration reads every element of its operands once, in place: per element, or along its rows
        outside online softmax (which keeps exp(s - max) in a buffer of its own)."""
        return self.per_element or (self.row and not self.online)

    def advance(self, state: State | None, *operands) -> State:
        """The state after one more iteration (the first starts it from `init`)."""
        return self.step(self.init(*[np.shape(t) for t in operands]) if state is None else state, *operands)

    def value(self, state: State) -> np.ndarray:
        return np.asarray(self.finish(state), dtype=np.float64)


_ROW_SUM = ("{acc}[row] += part;",)

ACCUMULATORS: dict[str, Accumulator] = {
    a.name: a
    for a in (
        Accumulator("acc_sum", "running sum of the tile", 1, "unary", False,
                    lambda s: (np.zeros(s),), lambda st, t: (st[0] + t,), lambda st: st[0],
                    lambda b, a: a, combine=("acc_sum", "part"), operand_ops=("matmul", "sum"),
                    cuda_fold=("{acc}[e] += {0};",), adds_products=True, linear=True, completes="sum"),
        Accumulator("acc_sum_last", "running sum of the tile's row sums", 1, "unary", True,
                    lambda s: (np.zeros(_last(s)),), lambda st, t: (st[0] + _rowsum(t),), lambda st: st[0],
                    lambda b, a: b("sum", [a], [-1]), cuda_reduce="sum", cuda_fold=_ROW_SUM, linear=True, past_end=0.0,
                    completes="sum"),
        Accumulator("acc_mean_last", "mean of every row element seen", 1, "unary", True,
                    lambda s: (np.zeros(_last(s)), 0), lambda st, t: (st[0] + _rowsum(t), st[1] + t.shape[-1]),
                    lambda st: st[0] / st[1], lambda b, a: b("mean", [a], [-1]), combine=("acc_mean_last", "mean"),
                    cuda_reduce="sum", cuda_fold=_ROW_SUM, cuda_finish="({0} / real({count}))", linear=True,
                    completes="mean"),
        Accumulator("acc_rms_last", "root mean square of every row element seen", 1, "unary", True,
                    lambda s: (np.zeros(_last(s)), 0), lambda st, t: (st[0] + _rowsum(t * t), st[1] + t.shape[-1]),
                    lambda st: np.sqrt(st[0] / st[1]), lambda b, a: b("sqrt", [b("mean", [b("square", [a])], [-1])]),
                    combine=("acc_rms_last", "rms"), cuda_reduce="sum", cuda_term="{0} * {0}", cuda_fold=_ROW_SUM,
                    cuda_finish="prism::sqrt_({0} / real({count}))"),
        Accumulator("acc_var_last", "variance of every row element seen, about their mean", 1, "unary", True,
                    lambda s: (0, np.zeros(_last(s)), np.zeros(_last(s))), _variance_step, lambda st: st[2] / st[0],
                    _variance, cuda_reduce="welford", cuda_fold=("{acc}[row] = part;",),
                    cuda_finish="({0} / real({count}))",
                    flops=4),
        Accumulator("acc_max_last", "running row max", 1, "unary", True,
                    lambda s: (np.full(_last(s), -np.inf),), lambda st, t: (np.maximum(st[0], _rowmax(t)),),
                    lambda st: st[0], lambda b, a: b("max", [a], [-1]), combine=("acc_max_last", "max"),
                    combining_only=True, online="max", state=("m",), cuda_reduce="max", completes="max",
                    cuda_fold=("{m}[row] = prism::max_({m}[row], part);",), past_end=-np.inf),
        Accumulator("acc_softmax_sum", "sum of exp(s - running max), rescaled", 1, "unary", True,
                    lambda s: (np.full(_last(s), -np.inf), np.zeros(_last(s))), _softmax_sum_step,
                    lambda st: st[1], lambda b, s: b("sum", [_softmax_terms(b, s)], [-1]),
                    combine=("acc_rescaled_sum", "sum"), online="softmax", state=("m", "acc"), cuda_reduce="sum",
                    cuda_fold=("{acc}[row] = {acc}[row] * {scale}[row] + part;",), past_end=-np.inf),
        Accumulator("acc_softmax_out", "exp(s - running max) @ v, rescaled", 2, "matmul", False,
                    lambda s, v: (np.full(_last(s), -np.inf), np.zeros(np.matmul(np.zeros(s), np.zeros(v)).shape)),
                    _softmax_out_step, lambda st: st[1], lambda b, s, v: b("matmul", [_softmax_terms(b, s), v]),
                    combine=("acc_rescaled_sum", "out"), online="softmax", state=("m", "acc"),
                    cuda_fold=("{acc}[e] * {scale}[{row}]",), flops=4, past_end=-np.inf),
        Accumulator("acc_rescaled_sum", "sum of exp(m - running max of m) * x", 2, "binary", False,
                    lambda m, x: (np.full(np.broadcast_shapes(m, x), -np.inf), np.zeros(np.broadcast_shapes(m, x))),
                    _rescaled_step, lambda st: st[1], lambda b, m, x: x, combining_only=True, state=("m", "acc"),
                    cuda_fold=("const real mv = {0}, mo = {m}[e], mn = prism::max_(mo, mv);",
                               "{acc}[e] = {acc}[e] * prism::rescale(mo, mn) + prism::exp_minus(mv, mn) * {1};",
                               "{m}[e] = mn;")),
    )
}

ONLINE_SOFTMAX = tuple(name for name, a in ACCUMULATORS.items() if a.online == "softmax")
RUNNING_MAX = next(name for name, a in ACCUMULATORS.items() if a.online == "max")  # the max they share


def fold(name: str, tiles_per_iteration) -> np.ndarray:
    """Run accumulator `name` over an iterable of per-iteration operand tuples."""
    acc = ACCUMULATORS[name]
    state = None
    with np.errstate(all="ignore"):
        for operands in tiles_per_iteration:
            state = acc.advance(state, *operands)
        return acc.value(state)


def fold_along(name: str, axis: int, *operands: np.ndarray) -> np.ndarray:
    """The accumulator over a tile family: iteration i is index i along `axis` (kept, with size 1)."""
    rank = max(-axis, *(np.ndim(x) for x in operands))
    padded = [np.reshape(x, (1,) * (rank - np.ndim(x)) + np.shape(x)) for x in operands]
    count = max(np.shape(x)[axis] for x in padded)
    if any(np.shape(x)[axis] not in (1, count) for x in padded):
        raise ValueError("accumulator operands disagree on the number of iterations")
    def take(x, i):
        return np.take(x, [i if np.shape(x)[axis] > 1 else 0], axis=axis)
    return fold(name, ([take(x, i) for x in padded] for i in range(count)))
