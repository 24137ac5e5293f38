"""Copies of tiles from device memory into shared memory: by every thread with `cp.async` (16, 8 or 4 bytes a
copy) or an element at a time, or by the tensor memory accelerator (TMA, sm_90), one instruction per box.

Where it sits: `launch.layout` asks `copy_bytes` which tiles go by `cp.async` (and so may be pipelined) and
`copied_by_tma` which go by TMA; `codegen` writes the copies (`load_step`, `tma_step`) and takes a tensor map per
TMA-copied tile as a kernel parameter (`TensorMap`), which the runtime has the CUDA driver encode
(`cuda_runtime`) and the emulation's harness builds (`emulate`).

TMA. A kernel on wgmma brings each loop tile into the 128-byte swizzle wgmma reads with one instruction per
box, issued by one thread, where cp.async had every thread copy 16 bytes at a time through its own address
arithmetic (at dh = 128, 8 copies per thread and iteration for attention's two tiles, and about 2 registers for
each copy's addresses held across the loop). A loop tile qualifies where wgmma reads it from its swizzle
(`launch.swizzled`): a matrix of 16-bit elements (its leading dims 1) whose columns are a multiple of 64, from a
tensor of at most 5 dims whose rows are a multiple of 16 bytes (the map's strides), with at most 256 rows
(a box dim's limit). The swizzle stores 64 columns (128 bytes) at a time, rows x 128 bytes each
(`ctext.swizzled`): one box per 64 columns, each landing on a 1024-byte boundary (the rows a multiple of 8),
where the 128-byte swizzle TMA writes is the layout wgmma's descriptors read. Every staged tile of the kernel
qualifies, or none is copied by TMA: one thread then issues a stage's boxes after `mbarrier.arrive.expect_tx` of
their bytes at the stage's mbarrier, which every thread waits for in place of cp.async's groups. Where the
loop allows it (`copy_warp`), that thread is lane 0 of a warp of their own, which refills each stage as soon as
its readers release it, where thread 0 refilled it after the block's barrier at the top of the next iteration.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cache
from typing import NamedTuple

import numpy as np

from ..ir.nodes import DType, Node
from ..kernels.constraints import Concrete
from ..ir.ops import OPS, Kind
from ..kernels.fusion import Place, plan
from ..kernels.kernel import after_loop, in_loop, loop_varying, storage
from ..kernels.masking import callers_shape, read_in_place
from ..kernels.sizes import int_value
from . import sums
from .ctext import INT_MAX, address, comment, decompose, ident, tensor_name
from .cuda_plan import MAX_THREADS
from .row_parts import held_in_registers

SWIZZLE_BYTES = 128  # a row of wgmma's 128-byte swizzle, and a box's inner dim in bytes
SWIZZLE_COLUMNS = SWIZZLE_BYTES // 2  # of 16-bit elements
MAX_BOX = 256  # elements of a box along any dim
MAX_RANK = 5
COPY_WARP = 32  # the threads of a kernel's copy warp (`copy_warp`), launched after its computing ones
REGISTERS_PER_COPY = 2  # per copy a thread issues per loop iteration where they are not evenly apart: its source
REGISTERS_PER_TILE = 3  # per loop tile whose copies are: one source pointer and one shared offset


def copy_bytes(c: Concrete, tile: Node, config) -> int:
    """Bytes per `cp.async` of a loaded tile: 16, 8 or 4, the widest whose elements divide both the tile's
    rows and the tensor's (so every copy is aligned at both ends); 0 where none does (2-byte elements in
    rows of odd length) or vector loads are off: those tiles are copied an element at a time."""
    if not config.vector_loads:
        return 0
    load = c.kernel.load(tile.attr)
    full = int_value(c.kernel.inputs[load.source].shape[-1], c.binding)
    part = int_value(tile.shape[-1], c.binding)
    size = plan(c.kernel).buffer(tile).dtype.bytes
    return next((n for n in (16, 8, 4) if n % size == 0 and part % (n // size) == 0 and full % (n // size) == 0), 0)


def vector_width(c: Concrete, tile: Node, config) -> int:
    """Elements per copy of a loaded tile (`copy_bytes`; 1 for the element-at-a-time copy)."""
    n = copy_bytes(c, tile, config)
    return n // plan(c.kernel).buffer(tile).dtype.bytes if n else 1


def starts(e, tile: Node, it: str) -> tuple[list[list[str]], list[list[str]]]:
    """Per dim of the tensor a loaded tile comes from, the C terms of where the block's tile starts at loop
    iteration `it` (`e`: the kernel's `codegen.Emitter`): its block's slice along a grid axis; and apart, the
    iteration's."""
    load, grid = e.k.load(tile.attr), dict(e.c.grid)
    dims = list(zip(e.shape(e.k.inputs[load.source]), e.shape(tile), load.map.dims))
    return ([[f"{e.blk}{dm.axis} * {size // grid[dm.axis]}"] if dm.axis else [] for size, _, dm in dims],
            [[f"{it} * {t}"] if dm.loop else [] for _, t, dm in dims])


def in_place(tensor: Node, config) -> bool:
    """Whether the kernels read `tensor` as the caller passes it (`masking.read_in_place`), as `config` (a
    `launch.CodegenConfig`) allows: its `in_place` switch, its dims built past the sizes given (`ends`)."""
    return config.in_place and read_in_place(tensor, dict(config.ends))


def load_step(e, tile: Node, it: str = "it", dst: str = "") -> dict:
    """The loaded tile copied in by the block's threads: at loop iteration `it` (a C expression), into `dst` (its
    buffer by default). Each copy's source is its thread's element of the first iteration's tile, then the
    iteration's step on it (`step`, "0" for a tile loaded once): nvcc keeps the first as a pointer through the
    loop, so an iteration's copy adds one term to it rather than computing its whole address again.

    A program input read in place (`masking.read_in_place`: a dim built past the size the caller gave, which its
    tensor has at that size) is addressed at its caller's shape, and each copy is guarded (`bound`): its index
    along each such dim below the caller's size, zeros in the buffer past it (cp.async reading no bytes)."""
    load = e.k.load(tile.attr)
    src = e.k.inputs[load.source]
    ends = dict(e.config.ends)
    full, shape, b = e.shape(src), e.shape(tile), e.plan.buffer(tile)
    lines, idx = decompose("e", shape, "i")
    at, step = starts(e, tile, it)
    parts = [a + ([i] if i != "0" else []) for a, i in zip(at, idx)]
    bound = []
    reach = math.prod(full)  # a guarded copy past the end forms its address too: 64-bit where the built size needs it
    if in_place(src, e.config):
        full = callers_shape(src, e.c.binding, ends)
        bound = [f"{' + '.join(p + s)} < {n}" for p, s, n, built in zip(parts, step, full, e.shape(src))
                 if n < built and p + s]
    text = comment(f"{tile.attr} = load {tensor_name(src)}{load.map}  tile {list(shape)} of {list(full)}"
                   + (" (read in place: zeros past the caller's end)" if bound else ""))
    vec, cp, at_c = vector_width(e.c, tile, e.config), copy_bytes(e.c, tile, e.config) > 0, e.offset(b, idx, shape)
    return {"kind": "load", "comment": text, "n": math.prod(shape), "idx": lines, "vec": vec, "cp": cp,
            "dst": dst or e.cname[b.name], "at": at_c, "src": f"g_{ident(tensor_name(src))}",
            "offset": address(parts, full, reach), "step": address(step, full, reach), "bound": " && ".join(bound),
            "apart": apart(tuple(shape), tuple(full), vec, e.threads, at_c) if cp and vec > 1 and not bound else None}


_INDEX_ARITHMETIC = re.compile(r"^[0-9i\s+\-*/%^()]+$")


class Apart(NamedTuple):
    """A thread's `copies` copies of a tile, each `src` elements on in the tensor and `dst` in the shared buffer."""
    copies: int
    src: int
    dst: int


@cache
def apart(shape: tuple[int, ...], full: tuple[int, ...], vec: int, threads: int, at: str) -> Apart | None:
    """Where a thread's copies of a tile are a fixed distance apart at both ends (`at`: the C offset in the
    shared buffer of indices i0, i1, ...). Each thread then makes n copies, the k-th at its first's addresses
    plus k times those, so nvcc keeps one source pointer and one shared offset a tile and folds each copy's
    distance into the instruction, rather than holding or computing an address a copy. None where the threads'
    copies do not all fall so (a pass over the tile that carries into another dim, or a swizzle that differs
    from one copy to the next). Worked out for every thread's first copy at once (the cost model asks for each
    candidate's tiles), once per shape."""
    units, step = math.prod(shape) // vec, threads * vec
    if units % threads or units // threads < 2 or not _INDEX_ARITHMETIC.match(at):
        return None
    copies, strides = units // threads, [math.prod(full[d + 1:]) for d in range(len(full))]
    inner = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    offset = compile(at.replace("/", "//"), "<at>", "eval")

    def place(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        i = [flat // inner[d] % shape[d] for d in range(len(shape))]
        dst = eval(offset, {"__builtins__": {}}, {f"i{d}": x for d, x in enumerate(i)})
        return sum(x * s for x, s in zip(i, strides)), np.broadcast_to(dst, flat.shape)
    first = np.arange(0, step, vec, dtype=np.int64)
    src0, dst0 = place(first)
    src1, dst1 = place(first + step)
    by = (int(src1[0] - src0[0]), int(dst1[0] - dst0[0]))
    for k in range(1, copies):
        src, dst = place(first + k * step)
        if (src - src0 != k * by[0]).any() or (dst - dst0 != k * by[1]).any():
            return None
    return Apart(copies, *by) if (copies - 1) * by[0] <= INT_MAX else None


# -- TMA -----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorMap:
    """A kernel parameter: the map of tensor `tensor` whose copies bring `box` (its dims, outer first)."""

    param: str
    tensor: str
    dtype: DType
    box: tuple[int, ...]
    fill: bool = False  # the tensor is read in place (`masking.read_in_place`): its map has the caller's dims, and
    # the zeros TMA fills past their ends are meant (the emulation refuses them elsewhere)

    def as_plan(self) -> dict:
        return {"param": self.param, "tensor": self.tensor, "box": list(self.box)}


def boxed(c: Concrete, tile: Node) -> bool:
    """Whether TMA can copy a loaded tile into wgmma's swizzle: a box of at most MAX_BOX rows per 64 columns, in a
    tensor whose every dim its signed 32-bit coordinates reach."""
    if tile.op != "tile":
        return False
    src = c.kernel.inputs[c.kernel.load(tile.attr).source]
    shape, full = c.shape(tile), c.shape(src)
    return (storage(src).bytes == 2 and len(shape) >= 2 and len(full) <= MAX_RANK and all(s == 1 for s in shape[:-2])
            and shape[-2] <= MAX_BOX and shape[-2] % 8 == 0 and shape[-1] % SWIZZLE_COLUMNS == 0
            and full[-1] * storage(src).bytes % 16 == 0 and max(full) - 1 <= INT_MAX)


def copied_by_tma(c: Concrete, staged: set[str], swizzled: frozenset[str], config) -> frozenset[str]:
    """The loop tiles TMA copies (`launch.layout`): every staged buffer where each is a swizzled tile it can copy
    (`boxed`), on an arch with TMA and wgmma and where `config.tma` allows; else none."""
    if not (config.tma and config.warpgroups and staged and staged <= swizzled):
        return frozenset()
    buffers = {b.name: b for b in plan(c.kernel).buffers}
    if any(buffers[n].role != "tile" or not boxed(c, buffers[n].node) or not _fits(c, buffers[n].node, config)
           for n in staged):
        return frozenset()
    return frozenset(staged)


def copy_warp(c: Concrete, registers: dict, in_flight: bool, pingpong: bool, tma: frozenset[str], threads: int,
              config) -> bool:
    """Whether a warp of its own issues the kernel's TMA copies (`launch.Layout.copy_warp`: warp specialization).
    Where thread 0 of a computing warp issues them, every iteration begins with a block-wide barrier, so that the
    stage it refills is free: the tensor cores wait at it for the slowest warp, and the copies for the barrier. A
    copy warp instead refills each stage once every computing thread has arrived at the stage's empty mbarrier,
    and the computing threads wait only for their tiles (its full one). That leaves nothing to order what the
    computing threads write to shared memory in one iteration against what they read in the next, so it is done
    only where they write none in the loop: every product folded in registers on wgmma with its batch in flight
    (`launch.in_flight`), every other fold a row sum in registers (`row_parts.held_in_registers`), no value kept in
    shared memory; or where two warpgroups of online softmax take turns (`launch.takes_turns`: that is their whole
    loop, whose stages empty mbarriers pace already, FlashAttention-3's producer and consumers). Not in a kernel
    that sums across blocks (`sums`), whose tickets take the whole block's barrier. The computing threads are whole
    warpgroups (the template tells the copy warp by its warpgroup's index, `threads / 128`), and the block with the
    copy warp stays within CUDA's threads a block."""
    if not (config.copy_warp and tma and (in_flight or pingpong)) or sums.groups(c):
        return False
    if threads % 128 or threads + COPY_WARP > MAX_THREADS:
        return False
    if pingpong:  # the loop is online softmax and its tiles alone (`launch.takes_turns`), its stages paced already
        return True
    k, p = c.kernel, plan(c.kernel)
    body, varying = k.body(), loop_varying(k)
    for n in in_loop(body, after_loop(body)):
        if n.op == "tile":
            continue
        if OPS[n.op].kind is Kind.ACCUMULATE:
            if n not in registers and not held_in_registers(n):
                return False
        elif n in varying and p.place.get(n) is Place.SMEM:
            return False
    return True


def _fits(c: Concrete, tile: Node, config) -> bool:
    """Whether a tile's box fits the tensor's map: a tensor read in place has the caller's dims there, which a box
    may not exceed (where the size built is a tile's multiple and the caller's is smaller than a tile)."""
    src = c.kernel.inputs[c.kernel.load(tile.attr).source]
    if not in_place(src, config):
        return True
    return all(t <= n for t, n in zip(c.shape(tile)[::-1], callers_shape(src, c.binding, dict(config.ends))[::-1]))


def tma_copies(e, tiles: list[Node], into: list[str], stages: int) -> tuple[list[dict], tuple[TensorMap, ...]]:
    """The TMA copies of a pipelined loop's tiles into their stages (`into`, by tile: C expressions of iteration
    `ahead`), completing bytes of the stage's mbarrier `full[ahead % stages]`, and the tensor map of each."""
    maps = tuple(_map(e, n) for n in tiles)
    return [tma_step(e, n, m, dst, f"&full[ahead % {stages}]") for n, m, dst in zip(tiles, maps, into)], maps


def _map(e, tile: Node) -> TensorMap:
    src = e.k.inputs[e.k.load(tile.attr).source]
    shape = e.shape(tile)
    box = (1,) * (len(shape) - 2) + (shape[-2], SWIZZLE_COLUMNS)
    return TensorMap(f"tm_{ident(tile.attr)}", tensor_name(src), storage(src), box, in_place(src, e.config))


def tma_step(e, tile: Node, m: TensorMap, dst: str, bar: str, it: str = "ahead") -> dict:
    """The copies of loop tile `tile` through map `m` at iteration `it` into `dst`, completing bytes of mbarrier
    `bar`: one box per 64 columns, the panels one after another as the swizzle lays them. Coordinates are
    signed 32-bit, innermost dim first."""
    load = e.k.load(tile.attr)
    src = e.k.inputs[load.source]
    shape = e.shape(tile)
    begin = [[f"(int){t}" if t.startswith(e.blk) else t for t in a + s] for a, s in zip(*starts(e, tile, it))]
    copies = []
    for panel in range(shape[-1] // SWIZZLE_COLUMNS):
        at = begin[:-1] + [begin[-1] + ([str(panel * SWIZZLE_COLUMNS)] if panel else [])]
        where = panel * shape[-2] * SWIZZLE_COLUMNS
        copies.append({"dst": f"{dst} + {where}" if where else dst, "at": ", ".join(" + ".join(a) or "0" for a in reversed(at))})
    text = comment(f"{tile.attr} = load {tensor_name(src)}{load.map}  tile {list(shape)} of {list(e.shape(src))}: by "
                   f"TMA, {len(copies)} box{'es' if len(copies) > 1 else ''} of {list(m.box)}"
                   + (" (read in place: the map's zeros past the caller's end)" if m.fill else ""))
    return {"kind": "tma", "comment": text, "map": m.param, "bar": bar, "copies": copies,
            "bytes": math.prod(shape) * storage(src).bytes}


def copy_registers(c: Concrete, shape, config) -> int:
    """What a thread holds across the loop for its copies of the loop's tiles: REGISTERS_PER_TILE for a tile whose
    copies fall a fixed distance apart (one source pointer, one shared offset: `copies.apart`, here at the source
    end), REGISTERS_PER_COPY for each copy of another; nothing for tiles whose rows' 16-byte chunks are permuted
    (`launch.xor_rows`: ptxas computes their addresses in the loop) or that TMA copies. The constants are the cost
    model's (`cost`, whose docstring anchors them)."""
    if c.loop <= 1 or shape.tma:
        return 0
    k, p, varying, total = c.kernel, plan(c.kernel), loop_varying(c.kernel), 0
    for load in k.loads:
        n = k.tile_node(load.tile)
        if n is None or n not in varying or p.buffer(n).name in shape.xor_rows:
            continue
        vec = vector_width(c, n, config)
        src = k.inputs[load.source]
        tile, full = c.shape(n), c.shape(src)
        spaced = not in_place(src, config) and apart(tuple(tile), tuple(full), vec, shape.threads, "0")
        total += REGISTERS_PER_TILE if spaced else REGISTERS_PER_COPY * -(-math.prod(tile) // (vec * shape.threads))
    return total
