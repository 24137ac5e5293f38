"""The loop accumulators of custom kernels, as folds: the one definition of what each computes.

An accumulator ends a kernel's loop body: it starts from `init`, folds each iteration's tile(s) into its
state with `step`, and gives its value after the loop with `finish`. The block-level interpreter runs
these folds one iteration at a time, exactly as a GPU block would; the NumPy semantics of the `acc_*`
operators (used when axioms are checked numerically) run the same folds along the loop dim of a tile
family (see `layout`). What each accumulator *means*, in closed form, is an axiom in rules/layout.rules,
so the numeric check of that file tests these folds against the closed forms.

The online-softmax accumulators keep a running row max `m` and rescale what they have summed so far by
`exp(m_old - m_new)` whenever it grows, so no `exp` ever sees a positive argument (numerically safe
attention, as FlashAttention computes it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

State = tuple


def _row(f):
    return lambda t: f(t, axis=-1, keepdims=True)


_rowsum, _rowmax = _row(np.sum), _row(np.max)


def _rescale(m_old: np.ndarray, m_new: np.ndarray) -> np.ndarray:
    """exp(m_old - m_new), with 0 where nothing was seen yet (m_old = -inf)."""
    with np.errstate(invalid="ignore"):
        return np.where(np.isneginf(m_old), 0.0, np.exp(m_old - m_new))


def _softmax_sum_step(state: State, s: np.ndarray) -> State:
    m, l = state
    m_new = np.maximum(m, _rowmax(s))
    return m_new, l * _rescale(m, m_new) + _rowsum(np.exp(s - m_new))


def _softmax_out_step(state: State, s: np.ndarray, v: np.ndarray) -> State:
    m, o = state
    m_new = np.maximum(m, _rowmax(s))
    return m_new, o * _rescale(m, m_new) + np.matmul(np.exp(s - m_new), v)


def _rescaled_step(state: State, m: np.ndarray, x: np.ndarray) -> State:
    big, acc = state
    big_new = np.maximum(big, m)
    return big_new, acc * _rescale(big, big_new) + np.exp(m - big_new) * x


def _zeros(*shapes) -> np.ndarray:
    return np.zeros(np.broadcast_shapes(*shapes))


@dataclass(frozen=True)
class Accumulator:
    name: str
    init: Callable[..., State]  # from the first iteration's operand shapes
    step: Callable[..., State]
    finish: Callable[[State], np.ndarray]
    state_tiles: int  # how many tiles of the result's shape the state holds (for shared-memory sizing)


def _last(shape):
    return shape[:-1] + (1,)


ACCUMULATORS: dict[str, Accumulator] = {
    a.name: a
    for a in (
        Accumulator("acc_sum", lambda s: (np.zeros(s),), lambda st, t: (st[0] + t,), lambda st: st[0], 1),
        Accumulator("acc_sum_last", lambda s: (np.zeros(_last(s)),), lambda st, t: (st[0] + _rowsum(t),),
                    lambda st: st[0], 1),
        Accumulator("acc_mean_last", lambda s: (np.zeros(_last(s)), 0),
                    lambda st, t: (st[0] + _rowsum(t), st[1] + t.shape[-1]), lambda st: st[0] / st[1], 1),
        Accumulator("acc_rms_last", lambda s: (np.zeros(_last(s)), 0),
                    lambda st, t: (st[0] + _rowsum(t * t), st[1] + t.shape[-1]),
                    lambda st: np.sqrt(st[0] / st[1]), 1),
        Accumulator("acc_max_last", lambda s: (np.full(_last(s), -np.inf),),
                    lambda st, t: (np.maximum(st[0], _rowmax(t)),), lambda st: st[0], 1),
        Accumulator("acc_softmax_sum", lambda s: (np.full(_last(s), -np.inf), np.zeros(_last(s))),
                    _softmax_sum_step, lambda st: st[1], 2),
        Accumulator("acc_softmax_out",
                    lambda s, v: (np.full(_last(s), -np.inf), np.zeros(np.matmul(np.zeros(s), np.zeros(v)).shape)),
                    _softmax_out_step, lambda st: st[1], 2),
        Accumulator("acc_rescaled_sum", lambda m, x: (np.full(np.broadcast_shapes(m, x), -np.inf), _zeros(m, x)),
                    _rescaled_step, lambda st: st[1], 2),
    )
}


def fold(name: str, tiles_per_iteration) -> np.ndarray:
    """Run accumulator `name` over an iterable of per-iteration operand tuples."""
    acc = ACCUMULATORS[name]
    state = None
    with np.errstate(all="ignore"):
        for operands in tiles_per_iteration:
            if state is None:
                state = acc.init(*[np.shape(t) for t in operands])
            state = acc.step(state, *operands)
        return np.asarray(acc.finish(state), dtype=np.float64)


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
