"""The emulate pass: the generated code of a build run in the thread-faithful CPU emulation
(`backend.emulate`), every output element it wrote compared with the float64 reference.

    whole grid   every block of every kernel, kernels in turn on each other's outputs, as on the GPU;
                 every element of the program's outputs compared with the input program's reference
    sample       at dims where emulating every block would take minutes: per kernel the first and last block
                 along every grid axis and `extra` more at random (seeded; all blocks along axes whose
                 results are summed), each kernel fed the block interpreter's values of the tensors it
                 reads from other kernels, and exactly the elements the emulated blocks write compared:
                 the program's outputs with the input program's reference, the tensors kernels pass on
                 with the block interpreter (`semantics.blocks`), the executable definition of a kernel;
                 where the code takes its blocks in an order of its own (causal loops, longest first), the
                 launch's blocks that compute the sampled ones run (`kernels.position.launch_index`)

`prismc compile` and `prismc verify` both call `check`; what ran (threads per block, blocks emulated,
sanitizer, dims, seed) is in the check's `emulation` field and report.json.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..backend import banks, compare, cost
from ..backend import emulate as emulator
from ..ir.nodes import DTYPES
from ..kernels.kernel import kernels_of
from ..kernels.position import launch_index
from ..semantics.blocks import KernelRunner
from ..semantics.reference import bind_dims, evaluate_nodes
from .report import EmulationCheck

# Emulated work (flops of the kernels plus the bytes their blocks load) above which the emulation samples
# blocks: about 10 s of emulation on one core of a 2-core machine (benchmarks/emulation.py measures it).
WHOLE_GRID_WORK = 2e9
SAMPLED_EXTRA = 6  # blocks chosen at random per kernel, beyond the first and last along every axis


def work(built) -> float:
    """What emulating every block of every kernel costs, in the units of WHOLE_GRID_WORK: the kernels' FLOPs
    plus the bytes their blocks load."""
    total = 0.0
    for k in kernels_of(built.program):
        w = cost.kernel_work(built.concrete[k.name], built.hardware)
        total += w.flops + w.tensor_core_flops + w.l2
    return total


def choose_blocks(built, extra: str | int, seed: int) -> dict[str, list[tuple[int, int, int]]]:
    """Per kernel to sample, its blocks; empty for the whole grid. `extra`: "all", the whole grid; "auto", the
    whole grid unless `work` is above WHOLE_GRID_WORK; a number, that many random blocks per kernel beyond the
    first and last along every axis."""
    if extra == "all" or (extra == "auto" and work(built) <= WHOLE_GRID_WORK):
        return {}
    rng = np.random.default_rng(seed)
    chosen = {}
    for k in kernels_of(built.program):
        c = built.concrete[k.name]
        blocks = emulator.sample_blocks(c, SAMPLED_EXTRA if extra == "auto" else extra, rng)
        if len(blocks) < c.blocks():
            chosen[k.name] = blocks
    for r in built.kernels:  # a launch that combines its tiles' pieces: every piece of each tile sampled
        if r.combines:
            chosen.pop(r.name, None)
            if r.combines in chosen:
                chosen[r.name] = _pieces(built.concrete[r.name], chosen[r.combines])
    return chosen


def _pieces(first, tiles: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The blocks of `first` (a kernel whose last grid axis splits its loop into pieces) that compute the pieces of
    the given tiles (blocks of its combining kernel, whose grid is the others)."""
    split, pieces = first.grid[-1]
    at = ("x", "y", "z").index(split)
    return [tuple(p if i == at else t for i, t in enumerate(tile)) for tile in tiles for p in range(pieces)]


def stored_values(built, inputs: Mapping[str, np.ndarray], rounded: bool = False) -> dict[str, np.ndarray]:
    """Every tensor a kernel of the built program stores, by name, in the block interpreter (float64;
    `rounded`: with the roundings its kernels make, as `blocks.run_kernel` takes it)."""
    program = built.program
    runner = KernelRunner(program, bind_dims(program, inputs=inputs), dict(built.params), built.hardware.name.lower(),
                          concrete=built.concrete, rounded=rounded, ends=built.padded)
    env = {node: np.asarray(inputs[node.attr], dtype=np.float64) for node in program.inputs}
    evaluate_nodes([n for _, n in program.outputs], env, runner, rounded)
    values = {}
    for k in kernels_of(program):
        for i, store in enumerate(k.stores):
            if id(k) in runner.results:
                values[store.name] = runner.results[id(k)][i]
    return values


def check(built, plan: Mapping, inputs: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], *, seed: int,
          rtol: float | compare.Tolerance, checked_against: str, sanitizer: str | None = None, extra: str | int = "auto",
          header: str | None = None, callers: Mapping[str, tuple[slice, ...]] = {}) -> EmulationCheck:
    """The built kernels (their runtime `plan`: `build.plan_of`) emulated on `inputs`; the program's outputs
    compared with `reference` at `rtol` (a `compare.Tolerance` may widen it for an output: `build.tolerance_of`),
    what one kernel passes to another with the block interpreter's values at the base tolerance. `callers`: of a
    tensor built past the sizes given (`pipeline.padding`), the caller's part, the only one compared."""
    tolerance = rtol if isinstance(rtol, compare.Tolerance) else compare.Tolerance(rtol)
    rtol = tolerance.base
    dtypes, shapes, blocks, launched, values = _setup(built, plan, inputs, extra, seed)
    outputs = {name for name, _ in built.program.outputs}
    result = emulator.run(built.kernels, dtypes, shapes, as_passed(inputs, shapes), sanitizer=sanitizer,
                          blocks=launched, feed=values, header=header)
    sizes = sorted({k.block[0] for k in built.kernels})  # threads per block: several where kernels differ
    ran = {"threads_per_block": sizes[-1] if sizes else 0, "block_sizes": sizes, "sanitizer": sanitizer,
           "dims": {d.name: int(built.binding[d.symbol]) for d in built.source.dims},
           "blocks": {name: {"emulated": e, "grid": g} for name, (e, g) in result.blocks.items()},
           "whole_grid": not blocks, "sample_seed": seed if blocks else None, "seconds": result.seconds}
    if result.finding:
        return EmulationCheck(False, rtol, seed, checked_against, {}, ran, result.finding.as_dict())
    masks = _written(built, blocks)
    parts = {}  # the caller's part of each tensor built past the sizes given: the only part compared, and scaled
    for name, part in callers.items():
        if name in outputs or name in values:
            parts[name] = np.zeros(np.shape(reference[name] if name in outputs else values[name]), dtype=bool)
            parts[name][part] = True
            masks[name] = parts[name] & masks[name] if name in masks else parts[name]
    compared = {}
    for name in outputs:
        compared[name] = _compare(result.outputs[name], reference[name], masks.get(name), tolerance, name,
                                  parts.get(name))
    for name in [n for n in values if n not in outputs]:  # sampled: what kernels pass on, against the block interpreter
        compared[name] = _compare(result.outputs[name], values[name], masks.get(name), compare.Tolerance(rtol), name,
                                  parts.get(name)) | {"against": "block interpreter"}
    return EmulationCheck(all(o["passed"] for o in compared.values()), rtol, seed, checked_against, compared, ran)


def wavefronts(built, plan: Mapping, inputs: Mapping[str, np.ndarray], *, seed: int, extra: str | int = 0,
               header: str | None = None) -> dict[str, banks.Wavefronts]:
    """The built kernels' shared-memory wavefronts (`backend.banks`), per kernel, over the blocks `choose_blocks`
    gives for `extra` (by default the first and last along every grid axis: the work of a causal loop's
    shortest and longest blocks, say), each kernel fed as `check` feeds it."""
    dtypes, shapes, _, launched, values = _setup(built, plan, inputs, extra, seed)
    return banks.count(built.kernels, dtypes, shapes, as_passed(inputs, shapes), blocks=launched, feed=values,
                       header=header)


def as_passed(inputs: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """The inputs as the kernels take them (`shapes`, the plan's): an input the kernels read in place at the sizes
    the caller gave (`masking.read_in_place`), given at the sizes built, cut to the caller's part. Its copy is the
    emulation's only array of it, so that a read past the caller's part is outside every array (the address
    sanitizer reports it)."""
    return {name: np.ascontiguousarray(a[tuple(slice(0, n) for n in shapes[name])])
            if name in shapes and np.shape(a) != tuple(shapes[name]) else a for name, a in inputs.items()}


def _setup(built, plan: Mapping, inputs: Mapping[str, np.ndarray], extra: str | int, seed: int):
    """The tensors' types and shapes (from `plan`), the grid blocks chosen per kernel, the launch's blocks that
    compute them, and the values fed to kernels: sampled, each kernel reads what the others store from the block
    interpreter (`run` loads only what a kernel reads, after its producer's output was saved)."""
    dtypes = {n: DTYPES[t["dtype"]] for n, t in plan["tensors"].items()}
    shapes = {n: tuple(t["shape"]) for n, t in plan["tensors"].items()}
    blocks = choose_blocks(built, extra, seed)
    values = stored_values(built, inputs) if blocks and _fed(built) else {}
    sms = built.hardware.sms
    launched = {name: [_launched(built.concrete[name], b, sms) for b in bs] for name, bs in blocks.items()}
    return dtypes, shapes, blocks, launched, values


def _fed(built) -> bool:
    """Whether a sampled emulation needs the block interpreter's values of what the kernels store (every block of
    every kernel, which at prefill sizes costs more than the emulation): where a kernel reads what another stored
    (it is fed them), or stores what the program does not return (they are compared)."""
    kernels, outputs = kernels_of(built.program), {name for name, _ in built.program.outputs}
    return any(i.op == "kernel" for k in kernels for i in k.inputs) or any(
        s.name not in outputs for k in kernels for s in k.stores)


def _launched(c, block: tuple[int, int, int], sms: int) -> tuple[int, int, int]:
    """The launch's block (blockIdx) that computes grid block `block` (`kernels.position.launch_index`)."""
    grid = dict(c.grid)
    index = launch_index(c.kernel, grid, dict(zip(("x", "y", "z"), block)), sms)
    gx, gy = grid.get("x", 1), grid.get("y", 1)
    return index % gx, index // gx % gy, index // (gx * gy)


def _written(built, blocks: Mapping[str, list]) -> dict[str, np.ndarray]:
    masks = {}
    for k in kernels_of(built.program):
        if k.name in blocks:
            for store, mask in zip(k.stores, emulator.written(built.concrete[k.name], blocks[k.name])):
                masks[store.name] = mask
    return masks


def _compare(got: np.ndarray, ref: np.ndarray, mask: np.ndarray | None, tolerance: compare.Tolerance,
             name: str, part: np.ndarray | None = None) -> dict:
    """`tolerance.judge` over the elements `mask` selects (all when None): the others take the reference's
    values, so that they neither pass nor fail anything, and `elements` says how many were compared; the scale
    taken over the caller's `part` of a tensor built past the sizes given (what zeros make past it, however
    large, widens nothing)."""
    ref = compare.unmasked_finite(np.asarray(ref, dtype=np.float64), mask)
    got = np.asarray(got, dtype=np.float64) if mask is None else np.where(mask, got, ref)
    return tolerance.judge(name, got, ref, mask, part) | {"elements": int(ref.size if mask is None else mask.sum())}
