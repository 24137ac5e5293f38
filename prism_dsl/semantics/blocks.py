"""The block-level interpreter: the executable definition of what a custom kernel computes.

It does what a kernel means (docs/ARCHITECTURE.md), literally: for every block of the grid, for every loop
iteration, it slices each input's tile (through the load's map), runs the loop-body ops on the tiles,
folds the accumulators (`ir.accumulators`), then runs the post-loop ops and writes each stored tile at the
block's place (through the store's map), adding the results of blocks along axes that write no dim.
Everything is float64 NumPy. It must agree with the reference interpreter of the original program
(tests check that for every fused program), and generated CUDA, when there is some, must agree with it.
`evaluate` runs a whole program: custom kernels here, every other node in `reference`.
"""

from __future__ import annotations

import itertools
from typing import Mapping

import numpy as np
import sympy

from ..ir.accumulators import ACCUMULATORS
from ..ir.nodes import DType, Node, Program
from ..kernels.constraints import Concrete, instantiate_program
from ..kernels.fusion import compute_dtype
from ..kernels.hardware import load_hardware
from ..kernels.kernel import SUM, TileMap, after_loop, free_symbols, stored_dtype
from ..kernels.masking import given_end
from ..kernels.params import complete
from ..kernels.position import causal_loop, loop_end, placed, start, whole
from ..ir.ops import OPS, Kind
from .reference import apply, bind_dims, evaluate_nodes, quantize


def _slices(full: tuple[int, ...], tile: tuple[int, ...], tmap: TileMap, grid: Mapping[str, int],
            block: Mapping[str, int], i: int) -> tuple[slice, ...]:
    """Where the tile of `block` at iteration `i` sits in the whole tensor: a split dim gives block b
    the b-th of g equal slices, and the loop walks that slice (or the whole dim) in F equal steps."""
    out = []
    for size, t, dm in zip(full, tile, tmap.dims):
        start = block[dm.axis] * (size // grid[dm.axis]) if dm.axis else 0
        if dm.loop:
            start += i * t
        out.append(slice(start, start + t))
    return tuple(out)


def run_kernel(c: Concrete, operands: list[np.ndarray], rounded: bool = False,
               ends: Mapping[str, int] = {}) -> list[np.ndarray]:
    """Every output of the concrete kernel `c` for the given input arrays (`rounded`: as
    `reference.evaluate_nodes` takes it, for the products of the kernel's body, and each output rounded to
    the type the kernel stores it in, `kernels.kernel.stored_dtype`; `ends`: dims built past the sizes the caller
    gave, by name, with those sizes: each fold takes its elements past them as its identity, `kernels.masking`)."""
    k = c.kernel
    body = k.body()
    arith = compute_dtype(k)  # what `rounded` computes the body in, as the kernel does
    accs = [n for n in body if OPS[n.op].kind is Kind.ACCUMULATE]
    after = after_loop(body)
    in_loop = [n for n in body if n not in after and OPS[n.op].kind is not Kind.ACCUMULATE]
    post = [n for n in body if n in after and OPS[n.op].kind is not Kind.ACCUMULATE]
    tiles = {l.tile: l for l in k.loads}
    outs = [np.zeros(c.output_shape(i)) for i in range(len(k.stores))]
    grid = dict(c.grid)
    axes = [a for a, _ in c.grid]
    stops = causal_loop(k)  # the key tiles a causal mask hides are not visited (`kernels.position`)

    def value(n: Node, values: dict[Node, np.ndarray], block: dict[str, int], i: int) -> np.ndarray:
        """A body node's value at iteration `i` of `block` (a tile in `post`: one the loop does not split)."""
        if n.op == "causal":
            return _causal(c, n, values[n.args[0]], block, i, n in after)
        if n.op != "tile":
            return apply(n, [values[a] for a in n.args], rounded, arith)
        load = tiles[n.attr]
        src = operands[load.source]
        return src[_slices(src.shape, c.shape(n), load.map, grid, block, i)]

    with np.errstate(all="ignore"):
        for idx in itertools.product(*(range(g) for _, g in c.grid)):
            block = dict(zip(axes, idx))
            states: dict[Node, tuple] = {}
            values: dict[Node, np.ndarray] = {}
            for i in range(loop_end(c.shape, k, grid, c.loop, stops, block)):
                values = {}
                for n in in_loop:
                    values[n] = value(n, values, block, i)
                for n in accs:
                    operands_ = [_masked(c, n, values[n.args[0]], ends, block, i), *(values[a] for a in n.args[1:])]
                    states[n] = ACCUMULATORS[n.op].advance(states.get(n), *operands_)
                    if rounded and arith is DType.F32:  # the running state is held in f32 registers
                        states[n] = tuple(quantize(np.asarray(v, dtype=np.float64), DType.F32) for v in states[n])
            for n in accs:
                values[n] = ACCUMULATORS[n.op].value(states[n])
            for n in post:
                values[n] = value(n, values, block, 0)
            for out, store in zip(outs, k.stores):
                _write(out, values[store.value], store, block)
        for i, store in enumerate(k.stores):  # a chain after a sum across blocks, over the whole sum (`finishing`)
            if store.then is not None:
                outs[i] = _then(store.then, outs[i], dict(zip(k.inputs, operands)), rounded, arith)
    return [quantize(o, stored_dtype(k, i)) for i, o in enumerate(outs)] if rounded else outs


def _then(n: Node, total: np.ndarray, tensors: Mapping[Node, np.ndarray], rounded: bool, arith: DType) -> np.ndarray:
    """A store's `then` at every element: its sum (the input named SUM) and the kernel's operands it reads, whole."""
    if n.op == "input":
        return total if n.attr == SUM else np.asarray(tensors[n], dtype=np.float64)
    return apply(n, [_then(a, total, tensors, rounded, arith) for a in n.args], rounded, arith)


def _masked(c: Concrete, acc: Node, x: np.ndarray, ends: Mapping[str, int], block: Mapping[str, int], i: int):
    """An accumulator's first operand with each element of its last dim past the size given (`kernels.masking`)
    as the fold's identity (`Accumulator.past_end`), by the element's place in the whole tensor."""
    fill = ACCUMULATORS[acc.op].past_end
    end = None if fill is None else given_end(c.kernel, acc.args[0], -1, ends)
    if end is None:
        return x
    o = placed(c.kernel, acc.args[0], -1, False)
    at = start(o.dm, whole(c.shape, c.kernel, o), dict(c.grid), c.loop, block, i)
    return np.where(np.arange(np.shape(x)[-1]) + at >= end, fill, x)


def _causal(c: Concrete, n: Node, x: np.ndarray, block: Mapping[str, int], i: int, after: bool):
    """causal(x) for a block's value: rows and columns are placed in the whole tensors they come from
    (`kernels.position`); after the loop, a dim the loop splits has no place (an error, as in the CUDA)."""
    x = np.asarray(x)
    x = x.reshape((1,) * (2 - x.ndim) + x.shape)
    at, sizes = [], []
    for dim in (-2, -1):
        o = placed(c.kernel, n, dim, after and c.loop > 1)
        if o is None:
            at.append(0)
            sizes.append(x.shape[dim])
            continue
        full = whole(c.shape, c.kernel, o)
        at.append(start(o.dm, full, dict(c.grid), c.loop, block, i))
        sizes.append(full)
    rows = np.arange(x.shape[-2])[:, None] + at[0]
    cols = np.arange(x.shape[-1])[None, :] + at[1]
    return np.where(cols > rows + (sizes[1] - sizes[0]), -np.inf, x)


def _write(out: np.ndarray, tile: np.ndarray, store, block: Mapping[str, int]) -> None:
    rank = out.ndim
    tile = np.asarray(tile)
    if tile.ndim > rank:
        tile = tile.reshape(tile.shape[tile.ndim - rank :])
    tile = tile.reshape((1,) * (rank - tile.ndim) + tile.shape)
    where = []
    for dm, t, size in zip(store.map.dims, tile.shape, out.shape):
        start = block[dm.axis] * t if dm.axis else 0
        where.append(slice(start, start + t))
    tile = np.broadcast_to(tile, tuple(s.stop - s.start for s in where))
    if store.add:
        out[tuple(where)] += tile
    else:
        out[tuple(where)] = tile


class KernelRunner:
    """Evaluates `kernel` nodes for `reference.evaluate_nodes`: instantiates each kernel once (with the
    given params by symbol name, valid defaults for the rest) and runs it once for all its outputs."""

    def __init__(self, program: Program, dims: Mapping[sympy.Symbol, int], params: Mapping[str, int], hardware: str,
                 prefer: str = "fill", concrete: Mapping[str, Concrete] | None = None, smem: bool = True,
                 rounded: bool = False, ends: Mapping[str, int] = {}):
        """`concrete`: the kernels already instantiated (as a build tuned them), used as they are. `smem`
        False: given every parameter, the kernels are held to every limit but the shared-memory bound (the
        interpreter keeps tiles in arrays; a build has checked what its generated code takes instead)."""
        if concrete is None:
            hw = load_hardware(hardware)
            symbols = {s.name: s for s in free_symbols(program)}
            given = not smem and set(params) == set(symbols)
            values = params if given else complete(program, dims, params, hw, prefer)
            concrete = instantiate_program(program, {**dims, **{symbols[n]: v for n, v in values.items()}}, hw,
                                           generated=(lambda c: 0) if given else None)
        self.concrete = dict(concrete)
        self.rounded, self.ends = rounded, dict(ends)  # `ends`: as `run_kernel` takes it
        self.results: dict[int, list[np.ndarray]] = {}

    def __call__(self, node: Node, operands: list[np.ndarray]) -> np.ndarray:
        kernel, index = node.attr
        if id(kernel) not in self.results:
            self.results[id(kernel)] = run_kernel(self.concrete[kernel.name], operands, self.rounded,
                                                     self.ends)
        return self.results[id(kernel)][index]


def evaluate(program: Program, inputs: Mapping[str, np.ndarray], params: Mapping[str, int] | None = None,
             hardware: str = "h100", prefer: str = "fill", smem: bool = True,
             rounded: bool = False, ends: Mapping[str, int] = {}) -> dict[str, np.ndarray]:
    """The program's outputs, by name, for the given input arrays (any float dtype; cast to float64).

    Kernel-level ops run in the reference semantics (`reference.apply`); custom kernels run in this
    block-level interpreter with the grid sizes and loop ranges in `params` (by symbol name), and valid
    choices for the ones not given (see `kernels.params.complete`); `smem` as `KernelRunner` takes it;
    `rounded` as `reference.evaluate_nodes` takes it; `ends` as `run_kernel` takes it."""
    env = {node: np.asarray(inputs[node.attr], dtype=np.float64) for node in program.inputs}
    kernels = None
    if any(n.op == "kernel" for n in program.nodes()):
        kernels = KernelRunner(program, bind_dims(program, inputs=inputs), params or {}, hardware, prefer, smem=smem,
                               rounded=rounded, ends=ends)
    values = evaluate_nodes([n for _, n in program.outputs], env, kernels, rounded)
    return {name: values[node] for name, node in program.outputs}
