"""Plain dot products: the products no tensor-core shape takes (a few rows at decode), read from shared memory 16
bytes a load. Two forms, chosen per product by what its right operand is:

    dot8     `a @ b` with b a 16-bit tile of the product's own columns: a group of lanes computes 8 adjacent outputs,
             each step one 16-byte load of b's row (`dot_lanes`)
    dotrows  `a @ transpose(t)` with t a 16-bit tile whose rows run along the contraction (attention's scores): a
             group of lanes computes one output, each lane 8 elements of both rows a load (`row_lanes`)

Where the outputs are fewer than the threads, a group's lanes share the contraction and add their parts by
shuffles (`lane_groups` lays the groups over the warps). The templates are templates/steps.j2's `dot8` and
`dotrows`; `codegen.Emitter.product` chooses, and `cost` prices them.
"""

from __future__ import annotations

import math

from ..ir.nodes import Node
from ..kernels.constraints import Concrete
from ..kernels.fusion import Place, plan
from .launch import CodegenConfig, padding


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
    are padded (the 8 rows a quarter warp reads then start on 8 distinct 16-byte bank groups), else 8 lanes share
    one (a quarter warp reads a row's 8 adjacent chunks); where the outputs are fewer than the threads, more
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
    outputs, lanes = math.prod(out_shape), 1 if padding(c, buf) else min(8, length // 8)
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
    if 1 < lanes < 8:
        spread = 32 // lanes
        return {"unit": f"PRISM_TID / PRISM_WARP * {spread} + PRISM_TID % {spread}",
                "step": f"PRISM_TID % PRISM_WARP / {spread}", "writer": f"PRISM_TID % PRISM_WARP < {spread}",
                "offsets": f"o = 16; o >= {spread}"}
    return {"unit": f"PRISM_TID / {lanes}", "step": f"PRISM_TID % {lanes}", "writer": f"PRISM_TID % {lanes} == 0",
            "offsets": f"o = {lanes // 2}; o > 0"}
