"""When each shared-memory buffer of a kernel is in use, and how buffers whose uses never meet share bytes.

Where it sits: beside `fusion.plan`, whose buffers it dates; `constraints` bounds a block's shared memory by
`shared_memory`, and the back end's layout places the buffers by `arrange`, so the bound holds for the code.

A generated kernel runs in three phases with a barrier between each: BEFORE the loop (state set to its
start, tiles the loop does not split loaded, loop-invariant values computed), the LOOP (its tiles loaded,
values computed, accumulators folded) and AFTER it (results written out). A buffer lives from the phase
that first writes it to the last that reads it:

    a loaded tile or a value   from the phase it is made in (the loop's if its tile is split by the loop,
                               after it if it depends on an accumulator, before it otherwise) to the last
                               phase that reads it, through the values evaluated in place
    accumulator state          BEFORE (its start value) to AFTER; a state the code writes only after the
                               loop (an accumulator held in registers through it) AFTER to AFTER
    online-softmax scratch     the LOOP (its factors and exp(s - max), made and read in each iteration)

Buffers are laid out by lifetime class, each class contiguous and in plan order, so that buffers that are
never in use at once share bytes:

    [0,1] | [0,2] | [1,2] | [1,1]          [0,0] starts where [1,2] starts, [2,2] where [1,1] starts
    bytes = S01 + S02 + max(S00, S12 + S11, S12 + S22)        (S01: the bytes of class [BEFORE, LOOP] ...)

In a typical attention kernel the query tile and the tables it is made from are needed only before the loop,
the pipelined key and value tiles only in it, and the outputs' f32 state only after it: they overlap.
"""

from __future__ import annotations

from functools import cache
from typing import Callable, Mapping, Sequence

from ..ir.nodes import Node
from ..ir.ops import OPS, Kind
from .fusion import Place, plan
from .kernel import Kernel, after_loop, loop_varying

BEFORE, LOOP, AFTER = 0, 1, 2
Lifetime = tuple[int, int]  # (first phase, last phase)

# The classes in the order they are laid out; [0,0] and [2,2] go over classes not in use in their phase.
_STACKED = ((BEFORE, LOOP), (BEFORE, AFTER), (LOOP, AFTER), (LOOP, LOOP))


@cache
def lifetimes(kernel: Kernel) -> dict[str, Lifetime]:
    """Each plan buffer's lifetime by name, as the plain code uses it (every state set before the loop)."""
    p = plan(kernel)
    varying, after = loop_varying(kernel), after_loop(kernel.body())
    stored = {s.value for s in kernel.stores}

    def made(n: Node) -> int:
        if OPS[n.op].kind is Kind.ACCUMULATE or n in varying:
            return LOOP
        return AFTER if n in after else BEFORE

    read: dict[Node, frozenset[int]] = {}

    def reads(n: Node) -> frozenset[int]:
        """The phases that read n's value: where each reader is made, or, for a reader evaluated in place
        (or a product fused into its accumulator), where that reader is read."""
        if n not in read:
            phases = {AFTER} if n in stored else set()
            for u in p.users[n]:
                phases |= reads(u) if p.place[u] in (Place.INLINE, Place.FUSED) else {made(u)}
            read[n] = frozenset(phases)
        return read[n]

    out: dict[str, Lifetime] = {}
    for roles in p.state.values():
        for b in roles.values():
            out[b.name] = (BEFORE, AFTER)
    for roles in p.groups.values():
        for b in roles.values():
            out.setdefault(b.name, (LOOP, LOOP))
    for b in p.buffers:
        if b.name not in out:
            first = made(b.node)
            out[b.name] = (first, max(reads(b.node) | {first}))
    return out


def in_use(live: Lifetime) -> str:
    """A lifetime in words: "before the loop", "in and after the loop"..."""
    first, last = live
    if (first, last) == (BEFORE, AFTER):
        return "in use throughout"
    return " and ".join(["before", "in", "after"][first:last + 1]) + " the loop"


def arrange(names: Sequence[str], size: Mapping[str, int], live: Mapping[str, Lifetime]) -> tuple[dict[str, int], int]:
    """Byte offsets of the buffers `names` (in order) and the bytes they take: each lifetime class
    contiguous, classes as the module docstring lays them out. `size` must keep each buffer's alignment."""
    sums = class_sums(names, size, live)
    base = {(BEFORE, LOOP): 0, (BEFORE, AFTER): sums[BEFORE, LOOP]}
    base[LOOP, AFTER] = base[BEFORE, BEFORE] = base[BEFORE, AFTER] + sums[BEFORE, AFTER]
    base[LOOP, LOOP] = base[AFTER, AFTER] = base[LOOP, AFTER] + sums[LOOP, AFTER]
    offsets = {}
    for name in names:
        offsets[name] = base[live[name]]
        base[live[name]] += size[name]
    return offsets, total(sums, max)


def class_sums(names: Sequence[str], size: Mapping[str, object], live: Mapping[str, Lifetime]) -> dict[Lifetime, object]:
    sums: dict[Lifetime, object] = {c: 0 for c in _STACKED + ((BEFORE, BEFORE), (AFTER, AFTER))}
    for name in names:
        sums[live[name]] += size[name]
    return sums


def total(sums: Mapping[Lifetime, object], maximum: Callable = max):
    """The bytes of the arrangement (`maximum`: `max`, or `sympy.Max` for a symbolic bound)."""
    return (sums[BEFORE, LOOP] + sums[BEFORE, AFTER]
            + maximum(sums[BEFORE, BEFORE], sums[LOOP, AFTER] + sums[LOOP, LOOP], sums[LOOP, AFTER] + sums[AFTER, AFTER]))
