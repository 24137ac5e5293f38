"""Where a block's values sit in the whole tensors: what position-dependent ops (`causal`) need in a kernel.

A custom kernel's body works on tiles, but `causal(s)` masks by an element's row and column in the whole
tensor. Inside a kernel, a value's dim takes its place from the loaded tile it comes from: `origin`
follows the dim down the body (element-wise ops keep it from an operand that is not broadcast along it,
a product takes its rows from the left operand and its columns from the right one, a transpose swaps two
dims) to a tile's dim, whose place is its load's map: the block's slice along a grid axis, plus the
iteration's step where the loop splits it. The block interpreter (`semantics.blocks`) and the code
generator compute the same offsets from what `origin` returns. A dim that comes from no tile (a reduced
one, or a value built from constants) sits at 0, with its own size as the whole.

A loop folding only online softmax over `causal(s)`, whose columns the loop walks, ends early in each
block (`CausalLoop`): the key tiles past the block's last row are masked whole, and adding nothing to the
running max and sums, they are never loaded. The code generator, the block interpreter and the cost model
stop at the same iteration.

The blocks of such a loop run different numbers of iterations: the last query tiles the most. The
generated code takes its blocks in a launch order of its own (`longest_first`): the longest query tiles
first, each across every other grid axis (heads, batches) before the next shorter one, so the short ones
fill the SMs at the end instead of a long one starting last. The cost model schedules the blocks in that
order (`stretch`); the emulation picks the launch's blocks that compute the ones it samples (`launch_index`).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from functools import cache
from typing import Mapping

from ..base.errors import PrismError
from ..ir.accumulators import ACCUMULATORS
from ..ir.nodes import Node
from ..ir.ops import OPS, Kind
from ..ir.shapes import same
from .kernel import DimMap, Kernel, Load


@dataclass(frozen=True)
class Origin:
    """Dim `dim` (counted from the end) of the tile that `load` loads gives a value's dim its place."""

    load: Load
    dim: int

    @property
    def dm(self) -> DimMap:
        """The load map's entry for that dim."""
        return self.load.map.dims[self.dim]


def origin(kernel: Kernel, node: Node, dim: int) -> Origin | None:
    """The loaded tile dim that places dim `dim` (counted from the end) of the body value `node`, if any."""
    while True:
        if -dim > node.rank:
            return None
        if node.op == "tile":
            return Origin(kernel.load(node.attr), dim)
        kind = OPS[node.op].kind
        if kind is Kind.TRANSPOSE:
            i, j = (d - node.rank for d in node.attr)
            dim = j if dim == i else i if dim == j else dim
            node = node.args[0]
            continue
        like = ACCUMULATORS[node.op].like if kind is Kind.ACCUMULATE else kind.value
        if kind is Kind.ACCUMULATE and ACCUMULATORS[node.op].row and dim == -1:
            return None  # folded
        if kind is Kind.REDUCE and dim == node.attr - node.rank:
            return None  # reduced
        if like == "matmul" and dim in (-1, -2):
            node = node.args[1 if dim == -1 else 0]  # columns from the right operand, rows from the left
            continue
        operand = _unbroadcast(node, dim) if node.args else None
        if operand is None:
            return None
        node = operand


def placed(kernel: Kernel, node: Node, dim: int, after: bool) -> Origin | None:
    """`origin`, for a value computed after the loop when `after`: there a dim the loop walks holds the
    fold of every iteration's piece, which has no one place in the whole tensor, so it is refused."""
    o = origin(kernel, node, dim)
    if o is not None and after and o.dm.loop:
        raise PrismError(f"kernel '{kernel.name}': {node.op} after the loop over a dim the loop splits has no place "
                         "(its elements hold every iteration's piece folded together)")
    return o


def _unbroadcast(node: Node, dim: int) -> Node | None:
    """The first operand of `node` that is not broadcast along `dim`."""
    for a in node.args:
        if -dim <= a.rank and same(a.shape[dim], node.shape[dim]):
            return a
    return None


def start(dm: DimMap, full: int, grid: Mapping[str, int], loop: int, block: Mapping[str, int], i: int) -> int:
    """Where a tile dim of map `dm` over a dim of size `full` starts, in block `block` at iteration `i`."""
    piece = full // grid[dm.axis] if dm.axis else full
    return (block[dm.axis] * piece if dm.axis else 0) + (i * (piece // loop) if dm.loop else 0)


@dataclass(frozen=True)
class CausalLoop:
    """A loop that stops at the last key tile a causal mask leaves something of: every accumulator is online
    softmax (or its running max) over `mask`, whose columns come from a tile the loop walks (split by no
    grid axis), and whose rows the loop does not walk. Where each block stops: `loop_bounds`."""

    mask: Node
    rows: Origin | None  # where the rows come from (None: a value's own rows, from 0)
    cols: Origin


@cache
def causal_loop(kernel: Kernel) -> CausalLoop | None:
    """The kernel's loop as a causal loop, or None where it must run every iteration (another accumulator,
    another mask, or a mask whose columns the loop does not walk)."""
    accs = [n for n in kernel.body() if OPS[n.op].kind is Kind.ACCUMULATE]
    masks = {a.args[0] for a in accs}
    if len(masks) != 1 or not all(ACCUMULATORS[a.op].online for a in accs):
        return None
    (mask,) = masks
    if mask.op != "causal":
        return None
    rows, cols = origin(kernel, mask, -2), origin(kernel, mask, -1)
    if cols is None or not cols.dm.loop or cols.dm.axis or (rows is not None and rows.dm.loop):
        return None
    return CausalLoop(mask, rows, cols)


def whole(shape_of, kernel: Kernel, o: Origin) -> int:
    """The size of the whole tensor's dim that origin `o` places (`shape_of`: a node's concrete shape)."""
    src = shape_of(kernel.inputs[o.load.source])
    return src[o.dim] if -o.dim <= len(src) else 1


def extent(shape_of, kernel: Kernel | None, mask: Node) -> tuple[int, int]:
    """(rows, columns) of the whole scores a causal mask places its elements in: in a kernel, the whole
    tensors' dims its rows and columns come from (`origin`), else (or where a dim comes from no tile) its own."""
    found = [(d, origin(kernel, mask, d) if kernel is not None else None) for d in (-2, -1)]
    return tuple(whole(shape_of, kernel, o) if o is not None else shape_of(mask)[d] for d, o in found)


def loop_bounds(shape_of, kernel: Kernel, grid: Mapping[str, int], loop: int, cl: CausalLoop) -> tuple[int, int, int]:
    """(last, step, piece) of a causal loop: block b may stop after the iteration that holds column
    `row0(b) + last` (row0(b) = b * piece along the rows' grid axis, 0 without one); each iteration
    covers `step` columns."""
    rows = shape_of(cl.mask)[-2]
    full_r, full_c = extent(shape_of, kernel, cl.mask)
    piece = full_r // grid[cl.rows.dm.axis] if cl.rows and cl.rows.dm.axis else 0
    return rows - 1 + full_c - full_r, full_c // loop, piece


def loop_end(shape_of, kernel: Kernel, grid: Mapping[str, int], loop: int, cl: CausalLoop | None,
             block: Mapping[str, int]) -> int:
    """How many iterations block `block` runs: all of them without a causal loop, else up to the one
    holding the block's last kept column (at least the first: a block whose every row is masked whole
    still gives its rows' states their values)."""
    if cl is None:
        return loop
    last, step, piece = loop_bounds(shape_of, kernel, grid, loop, cl)
    return _end(last + (block[cl.rows.dm.axis] * piece if piece else 0), step, loop)


def _end(last: int, step: int, loop: int) -> int:
    return 1 if last < 0 else min(loop, last // step + 1)


def mean_iterations(shape_of, kernel: Kernel, grid: Mapping[str, int], loop: int) -> float:
    """The iterations a block runs, on average over the grid (the loop range without a causal loop)."""
    cl = causal_loop(kernel)
    if cl is None:
        return float(loop)
    last, step, piece = loop_bounds(shape_of, kernel, grid, loop, cl)  # `loop_end` of every block along the rows
    blocks = grid[cl.rows.dm.axis] if piece else 1
    return ends_sum(last, step, piece, blocks, loop) / blocks


def ends_sum(last: int, step: int, piece: int, blocks: int, loop: int) -> int:
    """sum(_end(last + b * piece, step, loop) for b in range(blocks)), in closed form (piece >= 0): the blocks
    whose every column is masked run 1 iteration, those past the loop's last tile all `loop`, and between them
    a sum of floors (`floor_sum`). The cost model asks for it for every tiling it tries, over thousands of blocks."""
    if piece == 0 or blocks <= 1:
        return blocks * _end(last, step, loop) if blocks > 0 else 0
    masked = min(blocks, max(0, -(last // piece))) if last < 0 else 0  # last + b * piece < 0
    full = min(blocks, max(masked, -((last - (loop - 1) * step) // piece)))  # from here on: the whole loop
    between = full - masked
    return (masked + (blocks - full) * loop + between
            + floor_sum(between, step, piece, last + masked * piece))


def floor_sum(n: int, m: int, a: int, b: int) -> int:
    """sum((a * i + b) // m for i in range(n)) for n, a, b >= 0 and m > 0, in O(log) steps (the reduction of
    the lattice points under a line by Euclid's algorithm)."""
    total = 0
    while n > 0:
        if a >= m:
            total += n * (n - 1) // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        top = a * n + b
        if top < m:
            break
        n, b, m, a = top // m, top % m, a, m
    return total


def longest_first(kernel: Kernel, grid: Mapping[str, int], sms: int) -> str | None:
    """The grid axis of a causal loop's query rows where its blocks along it run different numbers of
    iterations (more than one block along it), and some wait for a slot (more blocks than `sms`, the GPU's
    SMs), which the generated code then takes longest first; None where it takes blocks as launched."""
    cl = causal_loop(kernel)
    if cl is None or cl.rows is None or not cl.rows.dm.axis or grid.get(cl.rows.dm.axis, 1) == 1 \
            or math.prod(grid.values()) <= sms:
        return None
    return cl.rows.dm.axis


def launch_order(kernel: Kernel, grid: Mapping[str, int], sms: int) -> tuple[str, ...]:
    """The grid axes from the one that varies fastest in the launch's order to the slowest: as the hardware
    launches blocks (x, y, z), or, for `longest_first`, the other axes first and the query rows last (the
    rows counted from the last block down)."""
    axes = tuple(a for a in ("x", "y", "z") if a in grid)
    rows = longest_first(kernel, grid, sms)
    return axes if rows is None else tuple(a for a in axes if a != rows) + (rows,)


def launch_index(kernel: Kernel, grid: Mapping[str, int], block: Mapping[str, int], sms: int) -> int:
    """Which of the launch's blocks (0 first) computes `block` (its index along each grid axis)."""
    rows, index, stride = longest_first(kernel, grid, sms), 0, 1
    for a in launch_order(kernel, grid, sms):
        at = block.get(a, 0)
        index += (grid[a] - 1 - at if a == rows else at) * stride
        stride *= grid[a]
    return index


def stretch(shape_of, kernel: Kernel, grid: Mapping[str, int], loop: int, slots: int, sms: int) -> float:
    """For blocks that run different numbers of iterations (a causal loop), how much longer the grid takes
    than its iterations spread evenly over `slots` (blocks resident at once): each block, in launch order,
    starts on the first slot to come free (all at once where they fit: the longest decides). 1 where every
    block runs the whole loop."""
    cl = causal_loop(kernel)
    rows = cl.rows.dm.axis if cl is not None and cl.rows is not None else None
    if not rows or grid.get(rows, 1) == 1:
        return 1.0
    # longest first: the code's order where blocks wait for a slot (`longest_first`); else every one starts at once
    last, step, piece = loop_bounds(shape_of, kernel, grid, loop, cl)
    across = math.prod(grid.values()) // grid[rows]  # blocks per query tile, launched one after another
    tiles = grid[rows]
    slots = max(1, min(slots, across * tiles))
    even = across * ends_sum(last, step, piece, tiles, loop) / slots
    if across * tiles > 64 * slots:  # any list schedule ends within its longest block of the even spread
        return 1 + _end(last + (tiles - 1) * piece, step, loop) / even
    lengths = [_end(last + r * piece, step, loop) for r in reversed(range(tiles))]
    free, times = {0: slots}, [0]  # slots by the time they come free; those times, a heap
    for n in lengths:
        todo = across
        while todo:
            t = times[0]
            took = min(free[t], todo)
            if took == free[t]:
                heapq.heappop(times)
                del free[t]
            else:
                free[t] -= took
            todo -= took
            if t + n not in free:
                free[t + n] = 0
                heapq.heappush(times, t + n)
            free[t + n] += took
    return max(free) / even
