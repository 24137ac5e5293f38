"""Plain dot products: the products no tensor-core shape takes (a few rows at decode), read from shared memory 16
bytes a load. Two forms, chosen per product by what its right operand is:

    dot8     `a @ b` with b a 16-bit tile of the product's own columns: a group of lanes computes 8 adjacent outputs,
             each step one 16-byte load of b's row (`dot_lanes`)
    dotrows  `a @ transpose(t)` with t a 16-bit tile whose rows run along the contraction (attention's scores): a
             group of lanes computes one output, each lane 8 elements of both rows a load (`row_lanes`); on
             tensor cores where the shapes allow (`row_mma`: 8 rows of a at most, keys in 16s), t's rows are the
             16 rows of an mma.sync tile read by ldmatrix and a's rows its 8 columns ("mmarows")

Where the outputs are fewer than the threads, a group's lanes share the contraction and add their parts by
shuffles (`lane_groups` lays the groups over the warps). The templates are templates/steps.j2's `dot8` and
`dotrows`; `codegen.Emitter.product` chooses, and `cost` prices them.
"""

from __future__ import annotations

import math

from ..ir.accumulators import ACCUMULATORS
from ..ir.nodes import DType, Node
from ..ir.ops import OPS, Kind
from ..kernels.constraints import Concrete
from ..kernels.fusion import Place, compute_dtype, plan
from .launch import CodegenConfig, Layout, layout, padding, uses_tensor_cores


def dot_lanes(c: Concrete, b: Node, out_shape: tuple[int, ...], length: int, threads: int, config: CodegenConfig) -> int:
    """Lanes per 8 adjacent outputs of a product on the plain path that reads its right operand `b` 8 columns
    at a time (one 16-byte shared-memory load for 8 FMAs, `prism::load8`), or 0 where it cannot: b must be a
    loaded 16-bit tile of the product's own columns and contraction, with rows (padded) a multiple of 16
    bytes. Where the outputs are fewer than the threads, up to 32 lanes (a power of two) share each group's
    contraction and add their parts by shuffles, no more than keep each lane's shuffles below its FMAs."""
    if not config.vector_loads or b.op != "tile":
        return 0
    buf, sb = plan(c.kernel).buffer(b), c.shape(b)
    if (buf.dtype.bytes != 2 or len(sb) < 2 or sb[-1] != out_shape[-1] or sb[-2] != length or sb[-1] % 8
            or padding(c, buf) % 8):
        return 0
    units, lanes = math.prod(out_shape) // 8, 1
    while lanes < 32 and units * lanes < threads and 2 * lanes * ((2 * lanes).bit_length() - 1) <= length:
        lanes *= 2  # while a lane's shuffles (8 per halving) stay below its FMAs (8 per step it takes)
    return lanes


def row_lanes(c: Concrete, b: Node, out_shape: tuple[int, ...], length: int, threads: int,
              config: CodegenConfig) -> int:
    """Lanes per output of a product on the plain path whose right operand `b` is a loaded 16-bit tile read
    transposed (`a @ transpose(kt)`, the scores of attention): its rows run along the contraction, so each lane
    reads 8 of a row's elements by one 16-byte shared-memory load ("dotrows") where one lane a step would read
    2 bytes ("real dot", rows apart by the tile's row: 4 to 8 ways on the same banks). 0 where it cannot: the
    tile's rows must be the contraction, 16-byte aligned. A lane alone takes a whole row where the tile's rows
    are padded, an odd number of 16-byte chunks long or have their chunks permuted (the 8 rows a quarter warp reads
    then start on 8 distinct 16-byte bank groups), else 8 lanes share one (a quarter warp reads a row's 8 adjacent
    chunks; 2 or 4 for rows that short); where the outputs are fewer than the threads, more
    lanes share each row, up to 32, while each lane keeps a load of its own, adding their parts by shuffles."""
    if not config.vector_loads or b.op != "transpose" or sorted(d - b.rank for d in b.attr) != [-2, -1]:
        return 0
    tile, p = b.args[0], plan(c.kernel)
    if tile.op != "tile" or p.place.get(tile) is not Place.SMEM:
        return 0
    buf, st = p.buffer(tile), c.shape(tile)
    if (buf.dtype.bytes != 2 or len(st) < 2 or st[-1] != length or st[-2] != out_shape[-1] or length % 8
            or padding(c, buf) % 8):
        return 0
    outputs, chunks = math.prod(out_shape), length // 8  # 16-byte chunks a row
    # rows an odd number of chunks apart, padded, or with their chunks permuted (`launch.xor_rows`) start 8 in a
    # row on 8 distinct bank groups: a lane a row; else 8 lanes (fewer for shorter rows) read a row's chunks
    alone = padding(c, buf) or chunks % 2 or buf.name in layout(c, config).xor_rows
    lanes = 1 if alone else 1 << (min(8, chunks).bit_length() - 1)  # a power of two: `lane_groups`
    while lanes < 32 and outputs * lanes < threads and 16 * lanes <= length:
        lanes *= 2
    return lanes


def lane_groups(lanes: int) -> dict:
    """How a product's step ("dot8", "dotrows") lays groups of `lanes` lanes over the threads, each group sharing
    the contraction of its outputs (every lanes-th step a lane) and adding its lanes' parts by shuffles: C
    expressions for a group's index among a pass's groups (`unit`) and a lane's first step (`step`), the lane
    that writes the sum (`writer`) and the shuffles' offsets (`offsets`). With 8 lanes or more a group's lanes
    are adjacent, so a quarter warp is 8 lanes of one group; with 2 or 4 they are `spread` = 32 / lanes apart in
    their warp (lane g + i * spread), so a quarter warp is one lane of each of 8 groups (steps.j2 says, for each
    step, why that keeps a quarter warp's 8 loads on distinct banks)."""
    assert lanes & (lanes - 1) == 0 and 0 < lanes <= 32, lanes  # the shuffles halve a group
    if 1 < lanes < 8:
        spread = 32 // lanes
        return {"unit": f"PRISM_TID / PRISM_WARP * {spread} + PRISM_TID % {spread}",
                "step": f"PRISM_TID % PRISM_WARP / {spread}", "writer": f"PRISM_TID % PRISM_WARP < {spread}",
                "offsets": f"o = 16; o >= {spread}"}
    return {"unit": f"PRISM_TID / {lanes}", "step": f"PRISM_TID % {lanes}", "writer": f"PRISM_TID % {lanes} == 0",
            "offsets": f"o = {lanes // 2}; o > 0"}


ROW_MMA_ROWS = 8  # an m16n8k16 tile's columns: the rows of `a` one mma.sync takes (its keys are the tile's 16 rows)


def row_mma(c: Concrete, a: Node | None, b: Node, out_shape: tuple[int, ...], length: int, threads: int,
            config: CodegenConfig) -> str | None:
    """How a product of a few rows on the plain path runs on tensor cores instead, or None: as S^T = b^T @ a^T on
    m16n8k16 tiles, b's columns (the keys) the tiles' 16 rows, a's rows (8 at most: a query at decode, a group of
    queries sharing their keys) their 8 columns, read from shared memory as the B fragment. "rows": b is a tile
    read transposed ("dotrows", `row_lanes`), whose rows are the keys: ldmatrix; "cols": b is a tile of the
    product's own columns ("dot8", `dot_lanes`): ldmatrix.trans. So an mma.sync takes 16 keys and 16 of the
    contraction, where the plain path takes a conversion and an FMA for every element of b and every row of a.
    a must be a 16-bit buffer of b's type in shared memory, or None: values rounded to b's type for the mma
    (online softmax's p, in [0, 1], as the prefill kernels round it); the contraction and the keys multiples of
    16, and the arithmetic f32 (`compute_dtype`). What the product adds to (its start) is added as it is written."""
    if not config.tensor_cores or compute_dtype(c.kernel) is not DType.F32 or len(out_shape) < 2:
        return None
    if row_lanes(c, b, out_shape, length, threads, config):
        how, tile = "rows", b.args[0]
    elif dot_lanes(c, b, out_shape, length, threads, config):
        how, tile = "cols", b
    else:
        return None
    p = plan(c.kernel)
    tbuf = p.buffer(tile)
    if a is not None:  # a product wmma takes (8 rows and keys in 32s) stays there (`launch.uses_tensor_cores`)
        if p.place.get(a) is not Place.SMEM or uses_tensor_cores(a, b, p, c.shape):
            return None
        abuf = p.buffer(a)
        if abuf.dtype is not tbuf.dtype or c.shape(a)[-1] != length or padding(c, abuf) % 2:
            return None
    fits = (tbuf.dtype in (DType.F16, DType.BF16) and length % 16 == 0 and out_shape[-1] % 16 == 0
            and out_shape[-2] <= ROW_MMA_ROWS)
    return how if fits else None


# -- what the cost model counts of each form (`cost.kernel_work`)


def vector_flops(c: Concrete, n: Node, f32: int, threads: int, config: CodegenConfig) -> int:
    """Of a node's f32 flops, those of a plain product that `codegen` writes as "dot8" (`dot_lanes`)."""
    kind, shape = OPS[n.op].kind, c.shape
    if not f32 or len(n.args) < 2 or not (kind is Kind.MATMUL or kind is Kind.ACCUMULATE
                                          and ACCUMULATORS[n.op].like == "matmul"):
        return 0
    work = 2 * math.prod(shape(n)) * shape(n.args[0])[-1]
    # work > f32: online softmax's product, counted on tensor cores, not among the f32 flops
    return work if work <= f32 and dot_lanes(c, n.args[1], shape(n), shape(n.args[0])[-1], threads, config) else 0


def few_rows_flops(c: Concrete, n: Node, f32: int, laid: Layout, config: CodegenConfig) -> int:
    """The tensor-core flops, at an mma's 8 columns, of a product of a few rows that `codegen` runs on tensor
    cores (`row_mma`): a plain product, or online softmax's p @ v outside registers (p rounded); else 0."""
    if not f32 or len(n.args) < 2 or n.args[0] in laid.flash:
        return 0
    kind, acc = OPS[n.op].kind, ACCUMULATORS.get(n.op)
    a = n.args[0] if kind is Kind.MATMUL else None
    if not (kind is Kind.MATMUL or acc is not None and acc.like == "matmul" and acc.online == "softmax"):
        return 0
    length, out = c.shape(n.args[0])[-1], c.shape(n)
    if not row_mma(c, a, n.args[1], out, length, laid.threads, config):
        return 0
    return 2 * math.prod(out[:-2]) * out[-1] * ROW_MMA_ROWS * length
