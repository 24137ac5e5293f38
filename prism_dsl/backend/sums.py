"""Sums across blocks finished in the launch that adds them: `store T[...] += v` stored once, in T's own type.

A store that some grid axis does not write (`+=`, the blocks of that axis each adding their part: split-K over
the grid, a product whose contraction the grid splits) is a whole result, not a partial one
(`kernels.kernel.stored_dtype`): T is f16 where v is. The blocks cannot add in f16 (each addition would round,
and there are no f16 atomics worth the name), and adding into T itself would need T zeroed before every launch
(a memset: one more launch). So each such store has a workspace of f32 in device memory, zero between launches,
the shape of T: every block adds its tile into it with f32 atomics, then takes a ticket for its tile (one
counter per tile, `prism::last_of`, as a split's combining kernel does: `tails`); the block that takes the
tile's last ticket, which sees every other block's additions, reads the tile's sums, stores them into T in
T's type, and puts them back to zero for the next launch. T is written once, by one block, with no memset.

f64 stores keep the plain form (their atomics add in f64 into T, zeroed before the launch: `RenderedKernel.zero`).

The stores summed over the same grid axes share their tiles' tickets (`Group`). The groups' tickets, one after
another, are the kernel's counters (`prism_tickets`: a kernel that finishes sums never also runs a combining
kernel in its launch, `tails.joins`), and the stores' workspaces one f32 buffer (`prism_sums`), each at an offset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..ir.nodes import DType
from ..kernels.constraints import Concrete
from ..kernels.kernel import AXES, stored_dtype

ALIGN = 4  # f32 elements: each workspace starts on a 16-byte boundary of the buffer


@dataclass(frozen=True)
class Group:
    """The stores of one kernel summed over the same grid axes, finished together."""

    axes: tuple[str, ...]  # the grid axes (of more than one block) they are summed over
    stores: tuple[int, ...]  # the kernel's store indices
    ticket: int  # the group's first counter
    tiles: int  # its counters: one per place of the block along the other axes
    pieces: int  # the blocks that add into each tile


def summed_axes(c: Concrete, index: int) -> tuple[str, ...]:
    """The grid axes (of more than one block) whose blocks add into store `index`: none for a plain store."""
    store = c.kernel.stores[index]
    if not store.add:
        return ()
    grid = dict(c.grid)
    return tuple(a for a in AXES if grid.get(a, 1) > 1 and a not in store.map.axes())


def finished(c: Concrete, index: int) -> bool:
    """Whether store `index` adds into a workspace that the tile's last block stores (see the module doc)."""
    return bool(summed_axes(c, index)) and stored_dtype(c.kernel, index) is not DType.F64


def groups(c: Concrete) -> list[Group]:
    """The kernel's finished stores, by the grid axes they are summed over, each group with its tickets."""
    by_axes: dict[tuple[str, ...], list[int]] = {}
    for i in range(len(c.kernel.stores)):
        if finished(c, i):
            by_axes.setdefault(summed_axes(c, i), []).append(i)
    grid, out, ticket = dict(c.grid), [], 0
    for axes, stores in by_axes.items():
        pieces = math.prod(grid[a] for a in axes)
        tiles = math.prod(g for a, g in c.grid if a not in axes)
        out.append(Group(axes, tuple(stores), ticket, tiles, pieces))
        ticket += tiles
    return out


def offsets(c: Concrete) -> tuple[dict[int, int], int]:
    """Each finished store's workspace offset in the kernel's f32 buffer (elements), and the buffer's size."""
    at, size = {}, 0
    for g in groups(c):
        for i in g.stores:
            at[i] = size
            size += -(-math.prod(c.output_shape(i)) // ALIGN) * ALIGN
    return at, size


def tickets(c: Concrete) -> int:
    return sum(g.tiles for g in groups(c))


def ticket_index(c: Concrete, group: Group, blk: str) -> str:
    """The C expression of the block's counter in `group`: its place along the grid axes the group is not summed
    over (`blk`: the prefix of the block's indices, blockIdx. or a causal launch order's blk_)."""
    return place_index([(a, g) for a, g in c.grid if a not in group.axes], blk, group.ticket)


def place_index(grid, blk: str, start: int = 0) -> str:
    """The C expression of a block's place along the axes of `grid` ((axis, size) pairs), counted from `start`: the
    tile counter it takes (here, and a split's combining kernel's in `tails`)."""
    index, stride = [str(start)] if start else [], 1
    for axis, size in grid:
        if size > 1:
            index.append(f"{blk}{axis}" + (f" * {stride}" if stride > 1 else ""))
            stride *= size
    return " + ".join(index) or "0"


def parameters(c: Concrete) -> list[str]:
    """The kernel's parameters after its tensors: the tickets and the workspaces, where it finishes a sum."""
    return ["unsigned* __restrict__ prism_tickets", "float* __restrict__ prism_sums"] if groups(c) else []


def sum_target(c: Concrete, index: int, where: str) -> str:
    """Where a block adds element `where` of finished store `index`: its workspace."""
    base = offsets(c)[0][index]
    return f"prism_sums[{base} + {where}]" if base else f"prism_sums[{where}]"
