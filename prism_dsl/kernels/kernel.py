"""Custom kernels: the block-graph IR and symbolic tile shapes.

A custom kernel (docs/ARCHITECTURE.md) launches a grid of 1 to 3 axes; each block runs a loop of `F`
iterations. Per input, a `TileMap` says which grid axis splits each dim across blocks and whether the
loop splits it; per output, which axis's blocks write side by side along each dim (axes that write no
dim add their blocks' results). The body is a graph of ordinary `ir.Node`s whose leaves are `tile`
nodes (the loaded tiles), with accumulators (`acc_*`) ending the loop part. Grid sizes and `F` are
SymPy expressions: integers, program dims, or free kernel symbols that instantiation chooses.

In a program, each output of a kernel is a `kernel` node whose operands are the kernel's inputs and
whose attr is (Kernel, output index), so kernel-level graphs mix custom and pre-defined kernels freely.

Tile shape of input dim d (the formula the search uses, with Boolean map variables m):
    tile_d = D_d / prod_p(1 - m[p][d] + m[p][d] * g_p) / (1 - m[F][d] + m[F][d] * F)
`constraints` checks that these shapes divide, fit and launch on a GPU; `params` chooses
the free symbols.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import cache
from typing import Iterator, Mapping

import sympy

from ..base.errors import PrismError
from ..ir.nodes import DType, Node, Program
from ..ir.ops import OPS, Kind

AXES = ("x", "y", "z")
ONE = sympy.Integer(1)


@dataclass(frozen=True)
class DimMap:
    """How one dim of a tile relates to the whole tensor: split by a grid axis, by the loop, or whole.

    Printed as in the surface syntax: `:` (whole), `x`, `loop`, or `x*loop` (the axis first: block b
    owns a 1/g slice and iteration i walks 1/F of that slice)."""

    axis: str | None = None
    loop: bool = False

    def __str__(self) -> str:
        parts = ([self.axis] if self.axis else []) + (["loop"] if self.loop else [])
        return "*".join(parts) or ":"


WHOLE = DimMap()


@dataclass(frozen=True)
class TileMap:
    dims: tuple[DimMap, ...]

    def __str__(self) -> str:
        return "[" + ", ".join(str(d) for d in self.dims) + "]"

    def axes(self) -> set[str]:
        return {d.axis for d in self.dims if d.axis}

    def dim_of(self, axis: str) -> int | None:
        """The dim (counted from the end) that `axis` splits, if any."""
        return next((-1 - i for i, d in enumerate(reversed(self.dims)) if d.axis == axis), None)

    def loop_dim(self) -> int | None:
        return next((-1 - i for i, d in enumerate(reversed(self.dims)) if d.loop), None)


@dataclass(frozen=True)
class SymbolicMap:
    """A map whose entries are not chosen yet: one 0/1 variable per (grid axis or loop, dim), the form
    the search enumerates (`m[p][d]` = 1 when axis p splits dim d). Printed as a matrix, one row per axis.

    `tile_shape` gives the tile with the Boolean formula of the module doc; `assign` gives the concrete
    `TileMap` for values of the variables (each axis and the loop splitting at most one dim)."""

    name: str
    rank: int
    axes: tuple[str, ...]  # grid axes, then "loop" when the kernel has one

    def var(self, axis: str, dim: int) -> sympy.Symbol:
        return sympy.Symbol(f"m_{self.name}_{axis}_{dim}", integer=True, nonnegative=True)

    def tile_shape(self, shape: tuple[sympy.Expr, ...], kernel: "Kernel") -> tuple[sympy.Expr, ...]:
        out = []
        for d, size in enumerate(shape):
            m = {a: self.var(a, d) for a in self.axes if a != "loop"}
            m_loop = self.var("loop", d) if "loop" in self.axes else sympy.Integer(0)
            out.append(symbolic_tile_dim(size, m, m_loop, kernel))
        return tuple(out)

    def assign(self, values: Mapping[sympy.Symbol, int]) -> TileMap:
        dims = []
        for d in range(self.rank):
            axis = next((a for a in self.axes if a != "loop" and values.get(self.var(a, d), 0)), None)
            dims.append(DimMap(axis, "loop" in self.axes and bool(values.get(self.var("loop", d), 0))))
        for a in self.axes:
            if sum(values.get(self.var(a, d), 0) for d in range(self.rank)) > 1:
                raise PrismError(f"map {self.name}: {a} may split one dim, not several")
        return TileMap(tuple(dims))

    def __str__(self) -> str:
        rows = [f"{a}: [" + ", ".join(str(self.var(a, d)) for d in range(self.rank)) + "]" for a in self.axes]
        return f"{self.name} {{" + "; ".join(rows) + "}"


@dataclass(frozen=True)
class Load:
    tile: str  # the tile's name in the body
    source: int  # which operand of the kernel (its inputs, in order of first load)
    map: TileMap


SUM = "+="  # the name of the input node that stands for a store's sum across blocks in its `then`


@dataclass(frozen=True)
class Store:
    name: str  # the program-level name of the output
    value: Node  # the block-level value stored
    map: TileMap  # no loop entries; extra leading entries add dims where the tile has size 1
    add: bool  # written `+=`: blocks along axes that write no dim add their results
    # with `add`, made by lowering only (`kernels.finishing`): what is stored, an element-wise function of the sum
    # (an input node named SUM, of the output's whole shape) and of the kernel's inputs, read at the element
    then: Node | None = None

    @property
    def result(self) -> Node:
        """What the program sees stored: the value, or its `then`."""
        return self.then or self.value


class _Interned(type):
    """Metaclass that returns the kernel already built when an equal one is built again (as `ir.nodes` does
    for nodes): lowering a program again gives the same kernel objects, which the caches keyed by a kernel
    (`fusion.plan`, `constraints`...) then find by identity."""

    def __init__(cls, *args):
        super().__init__(*args)
        cls._cache: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def __call__(cls, *args, **kwargs):
        kernel = super().__call__(*args, **kwargs)
        return cls._cache.setdefault(kernel._flat(), kernel)


@dataclass(frozen=True)
class Kernel(metaclass=_Interned):
    name: str
    grid: tuple[tuple[str, sympy.Expr], ...]  # (axis, size), axes in order x, y, z
    loop: sympy.Expr | None  # the loop range F; None: no loop (one pass)
    loads: tuple[Load, ...]
    stores: tuple[Store, ...]
    inputs: tuple[Node, ...]  # the kernel-level tensors its loads read, in order

    def __hash__(self) -> int:
        """The hash of the fields, worked out once: caches keyed by a kernel (`constraints._checker`) ask for it
        on every trial of the tuner, and it walks every map of every load and store."""
        known = self.__dict__.get("_hash")
        if known is None:
            known = hash((self.name, self.grid, self.loop, self.loads, self.stores, self.inputs))
            object.__setattr__(self, "_hash", known)
        return known

    def __eq__(self, other: object) -> bool:
        """Field by field, as the dataclass would, through a flat form of the fields worked out once (the caches
        keyed by a kernel compare each equal kernel of another lowering of a program with the first one
        cached, on every trial of the tuner). Nodes are interned, so their ids stand for them."""
        if self is other:
            return True
        if not isinstance(other, Kernel):
            return NotImplemented
        return hash(self) == hash(other) and self._flat() == other._flat()

    def __getstate__(self) -> dict:
        """The fields alone: what a kernel works out once (its hash, body, flat form, loop-varying nodes) holds
        string hashes and node ids, which mean nothing in another process; an unpickled kernel works them out
        again."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_hash", "_body", "_flat_fields", "_varying")}

    def _flat(self) -> tuple:
        flat = self.__dict__.get("_flat_fields")
        if flat is None:
            def dims(m: TileMap) -> tuple:
                return tuple((d.axis, d.loop) for d in m.dims)
            flat = (self.name, self.grid, self.loop,
                    tuple((l.tile, l.source, dims(l.map)) for l in self.loads),
                    tuple((s.name, id(s.value), dims(s.map), s.add, id(s.then)) for s in self.stores),
                    tuple(id(n) for n in self.inputs))
            object.__setattr__(self, "_flat_fields", flat)
        return flat

    @property
    def loop_range(self) -> sympy.Expr:
        return self.loop if self.loop is not None else ONE

    def size(self, axis: str) -> sympy.Expr:
        return dict(self.grid).get(axis, ONE)

    def load(self, tile: str) -> Load:
        return next(l for l in self.loads if l.tile == tile)

    def tile_node(self, name: str) -> Node | None:
        """The body's node for the tile loaded as `name` (None when nothing uses it)."""
        return next((n for n in self.body() if n.op == "tile" and n.attr == name), None)

    def body(self) -> list[Node]:
        """Every block-level node, operands first, each once (a fresh list; computed once per kernel)."""
        order = self.__dict__.get("_body")
        if order is None:  # nodes are interned and compare by identity; the kernel is immutable, so is its body
            order = list(dict.fromkeys(n for s in self.stores for n in s.value.walk()))
            object.__setattr__(self, "_body", order)
        return list(order)

    def symbols(self) -> set[sympy.Symbol]:
        return set().union(*(g.free_symbols for _, g in self.grid), self.loop_range.free_symbols)


def tile_dim(size: sympy.Expr, dim: DimMap, kernel: Kernel) -> sympy.Expr:
    """`size` divided by what splits it: the formula of the module doc with the map's 0/1 values."""
    m = {a: ONE if dim.axis == a else sympy.Integer(0) for a, _ in kernel.grid}
    return symbolic_tile_dim(size, m, ONE if dim.loop else sympy.Integer(0), kernel)


def symbolic_tile_dim(size: sympy.Expr, m: Mapping[str, sympy.Expr], m_loop: sympy.Expr, kernel: Kernel) -> sympy.Expr:
    """The tile size with Boolean map variables (0/1 values or symbols): the search's symbolic form."""
    divisor = sympy.Mul(*[(1 - m[a] + m[a] * g) for a, g in kernel.grid])
    divisor *= 1 - m_loop + m_loop * kernel.loop_range
    return size / divisor


def tile_shape(shape: tuple[sympy.Expr, ...], tmap: TileMap, kernel: Kernel) -> tuple[sympy.Expr, ...]:
    return tuple(tile_dim(s, d, kernel) for s, d in zip(shape, tmap.dims))


def output_shape(tile: tuple[sympy.Expr, ...], tmap: TileMap, kernel: Kernel) -> tuple[sympy.Expr, ...]:
    """A stored tile's full shape: the tile (left-padded with 1s to the map's rank) times the grid along
    each mapped dim. The caller has checked that extra leading tile dims are 1."""
    rank = len(tmap.dims)
    padded = (ONE,) * max(0, rank - len(tile)) + tuple(tile[-rank:] if rank else ())
    return tuple(t * (kernel.size(d.axis) if d.axis else 1) for t, d in zip(padded, tmap.dims))


def splits(kernel: Kernel) -> Iterator[tuple[sympy.Expr, list[sympy.Expr]]]:
    """Each loaded dim's whole size, and the grid sizes and loop range that split it."""
    for load in kernel.loads:
        for size, dm in zip(kernel.inputs[load.source].shape, load.map.dims):
            yield size, ([kernel.size(dm.axis)] if dm.axis else []) + ([kernel.loop_range] if dm.loop else [])


def loop_varying(kernel: Kernel) -> set[Node]:
    """Body nodes whose value changes from one loop iteration to the next (before any accumulator); a fresh set,
    worked out once per kernel."""
    known = kernel.__dict__.get("_varying")
    if known is None:
        known = frozenset(_varying(kernel))
        object.__setattr__(kernel, "_varying", known)
    return set(known)


def _varying(kernel: Kernel) -> set[Node]:
    varying: set[Node] = set()
    for n in kernel.body():
        if n.op == "tile":
            if kernel.load(n.attr).map.loop_dim() is not None:
                varying.add(n)
        elif OPS[n.op].kind is not Kind.ACCUMULATE and any(a in varying for a in n.args):
            varying.add(n)
    return varying


def after_loop(body: list[Node]) -> set[Node]:
    """Nodes computed after the loop: accumulators, what depends on them, and tiles only they read."""
    after: set[Node] = set()
    for n in body:
        if OPS[n.op].kind is Kind.ACCUMULATE or any(a in after for a in n.args):
            after.add(n)
    users_in_loop = {a for n in in_loop(body, after) for a in n.args}
    for n in body:
        if n.op == "tile" and n not in users_in_loop and any(n in m.args for m in after):
            after.add(n)
    return after


def in_loop(body: list[Node], after: set[Node]) -> list[Node]:
    """The nodes each loop iteration computes: those not after the loop, and the accumulators it folds."""
    return [n for n in body if n not in after or OPS[n.op].kind is Kind.ACCUMULATE]


def splits_loop(kernel: Kernel) -> bool:
    """Whether a grid axis also splits the loop's dim (`z*loop`): each block folds one piece of the
    reduction, and what its accumulators hold at the end is a partial result."""
    return any(dm.axis and dm.loop for load in kernel.loads for dm in load.map.dims)


@cache
def stored_dtype(kernel: Kernel, index: int) -> DType:
    """How a store's tensor is kept in device memory. Partial results are kept in f32 even when the values
    are f16/bf16: what a split reduction's blocks store from their accumulators (FlashDecoding's running max,
    sum and unnormalised output; split-K's partial products), which another kernel combines, and an online
    softmax's state stored as it is. Rounding those to 16 bits loses more than the final rounding does (and an
    unnormalised f16 output can overflow). Everything else is stored in its value's dtype; the value's dtype
    stays the program's (a combining kernel's result is f16 again). A sum across blocks (`+=`) is a whole
    result: the blocks add in f32 apart and the tile's last block stores the sum once, in the value's dtype
    (`backend.sums`)."""
    store = kernel.stores[index]
    dtype = store.result.dtype or DType.F32
    if dtype not in (DType.F16, DType.BF16):
        return dtype
    partial = not store.add and splits_loop(kernel) and any(OPS[n.op].kind is Kind.ACCUMULATE for n in store.value.walk())
    return DType.F32 if partial or _unnormalised(store.value) else dtype


def _unnormalised(value: Node) -> bool:
    """An online softmax's sum, or its output before the division, stored as it is: up to the row's length, past
    f16's range at 65536 (a running max beside it is a value of the tile, which its dtype holds exactly)."""
    return value.op in ("acc_softmax_sum", "acc_softmax_out")


def storage(tensor: Node) -> DType:
    """The dtype a kernel-level tensor (a program input or a kernel's output) has in device memory."""
    return stored_dtype(*tensor.attr) if tensor.op == "kernel" else (tensor.dtype or DType.F32)


def kernels_of(program: Program) -> list[Kernel]:
    """The program's custom kernels, in the order they run."""
    return list({id(n.attr[0]): n.attr[0] for n in program.nodes() if n.op == "kernel"}.values())


def free_symbols(program: Program) -> list[sympy.Symbol]:
    """The kernel symbols (grid sizes and loop ranges that are not program dims), in order of appearance."""
    dims = {d.symbol for d in program.dims}
    sizes = [g for k in kernels_of(program) for g in [*(g for _, g in k.grid), k.loop_range]]
    return list(dict.fromkeys(s for g in sizes for s in sorted(g.free_symbols - dims, key=str)))


def fresh_name(base: str, taken) -> str:
    """`base`, or `base_2`, `base_3`... the first not in `taken`."""
    name, i = base, 1
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    return name
