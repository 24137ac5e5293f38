"""Index classes and maps: how program assembly turns a generated kernel into kernels with concrete maps.

The dims of a kernel's body are grouped into index classes (dims that must be split alike: an
element-wise op's operands, a matmul's contracted pair...). A map is then a choice of classes for the
grid axes (a set, assigned to x, y, z in one canonical order: grid-axis symmetry broken, no dead axis)
and one for the loop; each tile's map follows (`build_kernel`).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

import sympy

from ..ir.accumulators import ACCUMULATORS
from ..ir.nodes import Node, dim_symbol
from ..ir.ops import OPS, Kind
from ..ir.shapes import ShapeError, rebuild
from ..kernels.kernel import AXES, DimMap, Kernel, Load, Store, TileMap, output_shape, tile_shape
from .config import SearchConfig
from .generate import Sketch, body_nodes


class IndexClasses:
    """Union-find over (node, dim from the end): the dims of a kernel body that must be split alike."""

    def __init__(self) -> None:
        self.parent: dict = {}

    def find(self, x):
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a, b) -> None:
        self.parent[self.find(a)] = self.find(b)


def index_classes(sketch: Sketch) -> tuple[IndexClasses, list]:
    """Group the body's splittable dims (size above 1) into classes; the classes in canonical order
    (first seen scanning the outputs' dims from the last, then the tiles')."""
    uf = IndexClasses()

    def dim(n: Node, i: int):
        return (n, i) if -n.rank <= i and n.shape[i] != 1 else None

    def tie(a, b) -> None:
        if a is not None and b is not None:
            uf.union(a, b)

    for n in body_nodes(sketch):
        kind = OPS[n.op].kind
        if kind is Kind.ACCUMULATE and not ACCUMULATORS[n.op].row:  # its dims are those of its op kind
            kind = Kind(ACCUMULATORS[n.op].like)
        if kind is Kind.MATMUL:
            a, b = n.args
            tie(dim(n, -1), dim(b, -1))
            tie(dim(n, -2), dim(a, -2))
            tie(dim(a, -1), dim(b, -2))
            for i in range(-3, -n.rank - 1, -1):
                tie(dim(n, i), dim(a, i))
                tie(dim(n, i), dim(b, i))
        elif kind is Kind.TRANSPOSE:  # each dim with the operand's dim it came from
            i, j = (d - n.rank for d in n.attr)
            for d in range(-1, -n.rank - 1, -1):
                tie(dim(n, d), dim(n.args[0], j if d == i else i if d == j else d))
        else:  # each dim with the operands' (broadcast), but a reduction's dim and a row accumulator's last
            folded = n.attr - n.rank if kind is Kind.REDUCE else -1 if kind is Kind.ACCUMULATE else None
            for a in n.args:
                for i in range(-1, -n.rank - 1, -1):
                    if i != folded:
                        tie(dim(n, i), dim(a, i))
    order: list = []
    for n in list(sketch.outputs) + list(sketch.tiles):
        for i in range(-1, -n.rank - 1, -1):
            if dim(n, i) is not None:
                root = uf.find((n, i))
                if root not in order:
                    order.append(root)
    return uf, order


@dataclass(frozen=True)
class MapChoice:
    grid: tuple[int, ...]  # class index per grid axis x, y, z
    loop: int | None  # class index the loop walks

    def axes(self, order: list) -> dict:
        """The grid axis of each class the grid splits: class root -> axis."""
        return {order[c]: a for c, a in zip(self.grid, AXES)}


def map_choices(sketch: Sketch, config: SearchConfig) -> tuple[list[MapChoice], IndexClasses, list]:
    """Every canonical map choice: grid classes as a set in class order (no two orders of the same axes,
    no axis without a class), and a loop class when the kernel accumulates. A loop over a dim the kernel
    stores would fold different output elements together, so it is not offered."""
    uf, order = index_classes(sketch)
    stored = {uf.find((o, i)) for o in sketch.outputs for i in range(-1, -o.rank - 1, -1)
              if o.shape[i] != 1}
    loops = [c for c, root in enumerate(order) if root not in stored] if sketch.loop else [None]
    grids = [g for k in range(min(config.max_grid_axes, len(order)) + 1)
             for g in itertools.combinations(range(len(order)), k)]
    return [MapChoice(grid, loop) for grid in grids for loop in loops], uf, order


class NoKernel(enum.Enum):
    """Why a map choice gives no kernel (program assembly counts it as `Rejection.MAPS`)."""

    TWO_DIMS_LOADED = "a tensor with two dims that must be split alike"  # no map splits them alike
    TWO_DIMS_STORED = "an output with two dims that must be split alike"
    SHAPES = "the body does not build at the tiles' sizes"
    SUMMED = "a split's result summed across blocks"  # a split's pieces are stored apart, for its combining kernel
    NOT_A_SUM = "a result summed across blocks that is not a sum over them"  # `sums_over`
    NO_COMBINING_FORM = "no combining form"
    NO_SPLIT_AXIS = "no grid axis left to split the loop's dim"


def tensor_map(n: Node, uf: IndexClasses, by_class: dict, loop_root=None, spare: str | None = None) -> TileMap | None:
    """The map of one of the kernel's tensors: each dim split by its class's grid axis (`by_class`:
    root -> axis), the loop's class also walked by the loop (and split by the `spare` axis when no grid
    axis splits it); None when two of its dims are in one class."""
    out, seen = [], set()
    for i in range(-n.rank, 0):
        if n.shape[i] == 1:
            out.append(DimMap())
            continue
        root = uf.find((n, i))
        if root in seen:
            return None
        seen.add(root)
        looped = root == loop_root
        out.append(DimMap(by_class.get(root) or (spare if looped else None), looped))
    return TileMap(tuple(out))


def param_suffix(base: str, dims) -> str:
    """`base`, with underscores added where a kernel parameter it names (g{axis}{suffix}, F{suffix}) would be a
    program dim's name: a dim named F would otherwise be the loop range, and a kernel over it not what it says."""
    suffix = base
    while any(f"{p}{suffix}" in dims for p in ("gx", "gy", "gz", "F")):
        suffix += "_"
    return suffix


def build_kernel(sketch: Sketch, uf: IndexClasses, by_class: dict, loop_root, name: str, suffix: str,
                 sources: list[Node], store_names: list[str], split: bool = False) -> tuple[Kernel, list[Node]] | NoKernel:
    """The concrete-map kernel over `sources` (kernel-level nodes, one per tile) with the grid axis of
    each index class given (`by_class`: root -> axis) and the loop over `loop_root`'s class; its output
    nodes. With `split`, one more grid axis splits the loop's class too (each block walks its piece with
    the loop) and every store gains a leading dim along that axis: the partial results of a split
    reduction."""
    axes = AXES[: len(by_class)]
    split_axis = AXES[len(axes)] if split else None
    all_axes = axes + ((split_axis,) if split else ())
    grid = tuple((a, dim_symbol(f"g{a}{suffix}")) for a in all_axes) or (("x", sympy.Integer(1)),)
    loop = dim_symbol(f"F{suffix}") if sketch.loop else None
    shell = Kernel(name, grid, loop, (), (), ())
    loads, new = [], {}
    for j, (tile, src) in enumerate(zip(sketch.tiles, sources)):
        tmap = tensor_map(tile, uf, by_class, loop_root, split_axis)
        if tmap is None:
            return NoKernel.TWO_DIMS_LOADED
        loads.append(Load(tile.attr, j, tmap))
        new[tile] = Node("tile", (), tile.attr, src.dtype, tile_shape(src.shape, tmap, shell))
    try:
        for n in body_nodes(sketch):
            if n not in new:
                new[n] = n if n.op == "const" else rebuild(n, [new[a] for a in n.args])
    except ShapeError:
        return NoKernel.SHAPES
    if loop_root is not None:
        varying = {new[t] for t, load in zip(sketch.tiles, loads) if load.map.loop_dim() is not None}
        memo: dict = {}
        for out in sketch.outputs:
            new[out] = hoisted_scales(new[out], varying, memo)
    stores = stores_of(sketch.outputs, store_names, new, uf, by_class, all_axes,
                       DimMap(split_axis) if split else None, summed=not split)
    if isinstance(stores, NoKernel):
        return stores
    kernel = Kernel(name, grid, loop, tuple(loads), stores, tuple(sources))
    return kernel, kernel_outputs(kernel)


def hoisted_scales(n: Node, varying: set, memo: dict) -> Node:
    """`n` with every constant scale of a product's operand that changes each loop iteration moved onto
    its other operand, when that one does not (it is computed once, before the loop):
    `q @ (transpose(k) / c)` becomes `(q / c) @ transpose(k)`. The two are equal in exact arithmetic,
    and the program assembled from the kernel is proved like every candidate; the e-graph's cheapest
    term may have put the scale on either side, since it cannot know which tile the loop walks.
    `varying` holds the loop-walked tiles and gains every node that changes with them (before any
    accumulator, as `kernels.kernel.loop_varying` counts them)."""
    if n in memo:
        return memo[n]
    args = [hoisted_scales(a, varying, memo) for a in n.args]
    out = n if all(a is b for a, b in zip(args, n.args)) else rebuild(n, args)
    if n.op == "matmul":
        for i in (0, 1):
            core, scales = _peeled(args[i])
            if scales and args[i] in varying and args[1 - i] not in varying:
                other = args[1 - i]
                for s in scales:  # innermost first, each with its constant on the side it was
                    other = rebuild(s, [other, s.args[1]] if s.args[1].op == "const" else [s.args[0], other])
                out = rebuild(n, [core, other] if i == 0 else [other, core])
                break
    if OPS[out.op].kind is not Kind.ACCUMULATE and any(a in varying for a in out.args):
        varying.add(out)
    memo[n] = out
    return out


def _peeled(n: Node) -> tuple[Node, list[Node]]:
    """`n` without the constant scales (a product or quotient by a constant) over its core, looked for
    through transposes: the core with the transposes kept, and the scale nodes, innermost first."""
    if n.op == "transpose":
        core, scales = _peeled(n.args[0])
        return (rebuild(n, [core]) if scales else n), scales
    if n.op == "div" and n.args[1].op == "const" or n.op == "mul" and n.args[1].op == "const":
        core, scales = _peeled(n.args[0])
        return core, scales + [n]
    if n.op == "mul" and n.args[0].op == "const":
        core, scales = _peeled(n.args[1])
        return core, scales + [n]
    return n, []


def stores_of(outputs, names: list[str], new: dict, uf: IndexClasses, by_class: dict, axes: tuple,
              lead: DimMap | None = None, summed: bool = True) -> tuple[Store, ...] | NoKernel:
    """The stores of a kernel's outputs (`new`: body node -> its node in the kernel), each split by the
    grid axes of its classes (after `lead`, a new leading dim, for a split's partial results). An output
    that some grid axis does not split is summed across blocks (`+=`) where `summed` allows (added in f32, stored
    once in its own type by the tile's last block: backend/sums.py)."""
    stores = []
    for out, name in zip(outputs, names):
        tmap = tensor_map(out, uf, by_class)
        if tmap is None:
            return NoKernel.TWO_DIMS_STORED
        dims = ((lead,) if lead is not None else ()) + tmap.dims
        written = {d.axis for d in dims if d.axis}
        add = any(a not in written for a in axes)
        if add and not summed:
            return NoKernel.SUMMED
        if add and not all(sums_over(out, root, uf) for root, a in by_class.items() if a not in written):
            return NoKernel.NOT_A_SUM
        stores.append(Store(name, new[out], TileMap(dims), add))
    return tuple(stores)


def sums_over(out: Node, root, uf: IndexClasses) -> bool:
    """Whether the blocks' values of `out`, each over its piece of index class `root` (which no dim of `out` is in:
    the grid axis that splits it writes none), add up to `out` over the whole class: `out` is a sum over the class
    (a product or reduction contracting it, a running sum folding it) seen through linear ops only, every one of its
    terms over it. Anything else (gelu of a partial product, a partial mean, a term the pieces do not split, which
    every block would add again) the numeric check would refuse anyway, at the cost of running the kernel."""
    def over(n: Node, dim: int) -> bool:
        return -n.rank <= dim and n.shape[dim] != 1 and uf.find((n, dim)) == root

    def reads(n: Node) -> bool:
        return n.op == "tile" and any(over(n, d) for d in range(-n.rank, 0)) or any(reads(a) for a in n.args)

    def linear(n: Node) -> bool:
        a = n.args
        if n.op == "matmul":
            return over(a[0], -1) or linear(a[0]) and not reads(a[1]) or linear(a[1]) and not reads(a[0])
        if n.op == "sum":
            return over(a[0], n.attr - a[0].rank) or linear(a[0])
        if n.op in ("acc_sum", "acc_sum_last"):
            return n.op == "acc_sum_last" and over(a[0], -1) or linear(a[0])
        if n.op in ("add", "sub"):
            return linear(a[0]) and linear(a[1])
        if n.op in ("mul", "div"):
            return linear(a[0]) and not reads(a[1]) or n.op == "mul" and linear(a[1]) and not reads(a[0])
        return n.op in ("neg", "transpose") and linear(a[0])

    return linear(out)


def kernel_outputs(kernel: Kernel) -> list[Node]:
    return [Node("kernel", kernel.inputs, (kernel, i), s.value.dtype, output_shape(s.value.shape, s.map, kernel))
            for i, s in enumerate(kernel.stores)]
