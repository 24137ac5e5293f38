"""Split reductions (FlashDecoding): a loop kernel's map choice also offered as two kernels.

A valid choice for a loop kernel whose accumulators all have a combining form (`combine` in `ir.accumulators`) is also
offered split in two (`Split`): the first kernel's loop dim is also split by one more grid axis and
each block stores its piece's partial state; a combining kernel loops over the pieces. `build_choice`
builds the kernels of either kind of choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from ..ir.accumulators import ACCUMULATORS, ONLINE_SOFTMAX, RUNNING_MAX
from ..ir.nodes import Node
from ..ir.ops import OPS, Kind
from ..ir.shapes import ShapeError, build, rebuild
from ..kernels.kernel import AXES, DimMap, Kernel, Load, TileMap, tile_shape
from .generate import Sketch, body_nodes
from .maps import IndexClasses, MapChoice, NoKernel, build_kernel, index_classes, kernel_outputs, stores_of


@dataclass(frozen=True)
class Split:
    """A loop kernel's map choice, split in two as FlashDecoding does: the first kernel gets one more grid
    axis, which also splits the loop's dim into pieces, and stores each accumulator's per-piece state (and
    the scores' running max, for the online-softmax ones) along a new leading dim; a combining kernel
    loops over the pieces (`acc_rescaled_sum` rescales each by exp(its max - the running max)) and does
    the post-loop work. It pays when the first kernel alone has too few blocks to fill the GPU."""

    choice: MapChoice


def split_states(sketch: Sketch) -> list[Node] | None:
    """What the first kernel of a split stores: the scores' running max first (online softmax), then each
    accumulator; None when the kernel cannot be split (an accumulator with no combining form, online
    softmax over different scores, or post-loop work that reads more than the accumulators)."""
    accs = [n for n in body_nodes(sketch) if OPS[n.op].kind is Kind.ACCUMULATE]
    if not sketch.loop or not accs or any(ACCUMULATORS[a.op].combine is None for a in accs):
        return None

    def only_accumulators(n: Node) -> bool:
        if n in accs or n.op == "const":
            return True
        if n.op == "tile" or OPS[n.op].kind is Kind.REDUCE:
            return False  # a reduce's dim index would move with the new leading dim
        return all(only_accumulators(a) for a in n.args)

    if not all(only_accumulators(o) for o in sketch.outputs):
        return None
    scores = list(dict.fromkeys(a.args[0] for a in accs if a.op in ONLINE_SOFTMAX))
    if len(scores) > 1:
        return None
    states = list(accs)
    if scores:
        m = build(RUNNING_MAX, [scores[0]])  # the scores' running max (nodes are interned: accs' own, if there)
        states = [m] + [a for a in accs if a is not m]
    return states


def build_choice(sketch: Sketch, choice: MapChoice | Split, uf: IndexClasses, order: list, name: str, suffix: str,
                 sources: list[Node], store_names: list[str], base: int = 0) -> tuple[list[Kernel], list[Node]] | NoKernel:
    """The kernels of one map choice over `sources` (kernel-level nodes, one per tile) and the nodes of
    the last one's outputs; or why the choice gives no kernel. A split's kernels are `{name}_partial`
    and `{name}_combine`, its partial results `t{base}_{kind}`."""
    if isinstance(choice, Split):
        return _build_split(sketch, choice.choice, uf, order, name, suffix, sources, store_names, base)
    loop_root = order[choice.loop] if choice.loop is not None else None
    built = build_kernel(sketch, uf, choice.axes(order), loop_root, name, suffix, sources, store_names)
    return built if isinstance(built, NoKernel) else ([built[0]], built[1])


def _build_split(sketch: Sketch, choice: MapChoice, uf: IndexClasses, order: list, name: str, suffix: str,
                 sources: list[Node], store_names: list[str], base: int) -> tuple[list[Kernel], list[Node]] | NoKernel:
    """The two kernels of a split (see `Split`) and the combining kernel's output nodes, or why not."""
    states = split_states(sketch)
    if states is None:
        return NoKernel.NO_COMBINING_FORM
    if choice.loop is None or choice.loop in choice.grid or len(choice.grid) >= len(AXES):
        return NoKernel.NO_SPLIT_AXIS
    by_class = choice.axes(order)
    # Classes over the original body and the states together (a new running max ties to its scores).
    uf_all, _ = index_classes(Sketch(sketch.inputs, sketch.tiles, tuple(sketch.outputs) + tuple(states), True))
    kinds = [ACCUMULATORS[a.op].combine[1] for a in states]
    part_names = [f"t{base}_{k}" + (str(kinds[:j].count(k)) if kinds.count(k) > 1 else "")
                  for j, k in enumerate(kinds)]
    built = build_kernel(Sketch(sketch.inputs, sketch.tiles, tuple(states), True), uf_all,
                         {uf_all.find(r): a for r, a in by_class.items()}, uf_all.find(order[choice.loop]),
                         f"{name}_partial", suffix, sources, part_names, split=True)
    if isinstance(built, NoKernel):
        return built
    first, parts = built
    pieces = first.grid[-1][1]  # the split axis's size: the combining loop walks that many pieces
    axes = AXES[: len(by_class)]
    # The same grid as the first kernel's (less the split axis): each block combines the pieces of the
    # tile it would have computed unsplit, which is what the layout proof relates.
    grid = first.grid[: len(axes)] or (("x", sympy.Integer(1)),)
    shell = Kernel(f"{name}_combine", grid, pieces, (), (), ())
    loads, tiles = [], {}
    for j, (state, part, store) in enumerate(zip(states, parts, first.stores)):
        tmap = TileMap((DimMap(None, True),) + store.map.dims[1:])
        tile = f"{part_names[j].lower()}t"
        loads.append(Load(tile, j, tmap))
        tiles[state] = Node("tile", (), tile, part.dtype, tile_shape(part.shape, tmap, shell))
    m = tiles[states[0]] if states[0].op == RUNNING_MAX and any(a.op in ONLINE_SOFTMAX for a in states) else None
    new: dict[Node, Node] = {}
    try:
        for a in states:
            op = ACCUMULATORS[a.op].combine[0]
            new[a] = build(op, [m, tiles[a]] if ACCUMULATORS[op].operands == 2 else [tiles[a]])
        for n in body_nodes(sketch):
            if n not in new and OPS[n.op].kind is not Kind.ACCUMULATE and n.op != "tile" and any(
                    below in new for below in n.walk()):
                new[n] = rebuild(n, [new.get(a, a) for a in n.args])
    except ShapeError:
        return NoKernel.SHAPES
    stores = stores_of(sketch.outputs, store_names, new, uf, by_class, axes, summed=False)
    if isinstance(stores, NoKernel):
        return stores
    second = Kernel(f"{name}_combine", grid, pieces, tuple(loads), stores, tuple(parts))
    return [first, second], kernel_outputs(second)
