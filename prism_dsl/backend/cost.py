"""The cost model: an estimated time per concrete kernel, for ranking where there is no GPU to time on.

Where it sits: parameter instantiation (`tune`) and reports. It counts what the generated code does
(`fusion.plan` and `codegen` decide that), from the instantiated tiles:

    dram   = bytes each load brings from device memory: the tensor once when it fits in L2 (re-reads by
             other blocks hit L2), every tile read otherwise; plus every byte stored
    l2     = bytes of every tile read by every block on every iteration (the traffic L2 serves)
    flops  = per block and iteration: 2*m*n*k per matrix product (on tensor cores where `codegen` puts
             it there), one per element for element-wise ops, accumulators and reductions
    occ    = blocks resident per SM: min(smem per SM / smem per block, threads per SM / threads per
             block, the block limit)
    waves  = ceil(blocks / (SMs * occ));  quant = blocks / (waves * min(blocks, SMs * occ))
    share  = min(blocks, SMs) / SMs                       (SMs with any work at all)
    hide   = min(1, threads resident per busy SM / 512)   (too few threads cannot hide memory latency)
    reach  = min(1, SM_REACH * share * hide)              (a lone SM can pull several times its 1/SMs share)
    t_mem  = max(dram / bandwidth, l2 / L2 bandwidth) / (reach * quant)
    t_math = (tensor-core flops / matrix peak + other flops / f32 peak) / (share * quant)
    t_loop = waves * F * iteration latency                (the loop does not pipeline its loads)
    time   = launch overhead + max(t_mem, t_math, t_loop)

It is meant to rank, not to predict to the microsecond: it puts a fused kernel ahead of the unfused
sequence (launches and the intermediates' round trips), and a grid that fills the SMs ahead of one that
leaves most idle. `roofline` is the floor a program cannot beat on some hardware: max(bytes/bandwidth,
flops/peak) with bytes = its inputs read once and outputs written once.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Mapping

import sympy

from .codegen import uses_tensor_cores
from ..ir.accumulators import ACCUMULATORS
from ..kernels.fusion import plan
from ..ir.nodes import DType, Node, Program
from ..kernels.constraints import Concrete, instantiate, instantiate_program, valid
from ..kernels.hardware import Hardware
from ..kernels.kernel import after_loop, free_symbols, kernels_of, loop_varying
from ..kernels.params import candidates, choose
from ..kernels.sizes import bind
from ..ir.ops import OPS, Kind

MAX_CANDIDATES = 4096  # per group of kernels that share parameters
SM_REACH = 4.0  # how many times its even share of the bandwidth one SM can draw when few SMs are busy


@dataclass(frozen=True)
class Estimate:
    kernel: str
    blocks: int
    waves: int
    occupancy: int  # blocks resident per SM
    dram_bytes: int
    l2_bytes: int
    flops: int
    tensor_core_flops: int
    time_us: float
    bound: str  # "memory", "math", "loop" or "launch": the term that decided

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def kernel_work(c: Concrete, hardware: Hardware) -> tuple[int, int, int, int]:
    """(dram bytes, l2 bytes, f32 flops, tensor-core flops) of one launch of `c`."""
    k = c.kernel
    shape = c.shape
    blocks, loop = c.blocks(), c.loop
    varying = loop_varying(k)
    dram = l2 = 0
    for load in k.loads:
        node = k.tile_node(load.tile)
        if node is None:
            continue
        src = k.inputs[load.source]
        tile_bytes = math.prod(shape(node)) * src.dtype.bytes
        traffic = tile_bytes * blocks * (loop if node in varying else 1)
        whole = math.prod(shape(src)) * src.dtype.bytes
        l2 += traffic
        dram += whole if whole <= hardware.l2_bytes else traffic
    for i, store in enumerate(k.stores):
        out = math.prod(c.output_shape(i)) * (store.value.dtype or DType.F32).bytes
        summed = math.prod(g for a, g in c.grid if a not in store.map.axes())
        dram += out * (summed if store.add else 1)
    p = plan(k)
    after = after_loop(k.body())
    flops = tc = 0
    for n in k.body():
        times = blocks * (1 if n in after and OPS[n.op].kind is not Kind.ACCUMULATE else loop)
        f, t = _node_flops(n, shape, p.place)
        flops += f * times
        tc += t * times
    return dram, l2, flops, tc


def _node_flops(n: Node, shape, place) -> tuple[int, int]:
    kind = OPS[n.op].kind
    if kind is Kind.MATMUL:
        work = 2 * math.prod(shape(n)) * shape(n.args[0])[-1]
        return (0, work) if uses_tensor_cores(n.args[0], n.args[1], place, shape) else (work, 0)
    if kind is Kind.ACCUMULATE:  # `flops` per element of its first operand, plus any product it folds
        acc, x = ACCUMULATORS[n.op], shape(n.args[0])
        return acc.flops * math.prod(x) + (2 * math.prod(shape(n)) * x[-1] if acc.like == "matmul" else 0), 0
    if kind in (Kind.UNARY, Kind.BINARY, Kind.REDUCE, Kind.ROWWISE):
        operand = n.args[0] if kind in (Kind.REDUCE, Kind.ROWWISE) else n
        return math.prod(shape(operand)) * (3 if kind is Kind.ROWWISE else 1), 0
    return 0, 0


def estimate(c: Concrete, hardware: Hardware, threads: int = 128) -> Estimate:
    dram, l2, flops, tc = kernel_work(c, hardware)
    blocks = c.blocks()
    occ = max(1, min(hardware.smem_per_sm // max(c.smem_bytes, 1), hardware.max_threads_per_sm // threads,
                     hardware.max_blocks_per_sm))
    resident = min(blocks, hardware.sms * occ)
    waves = math.ceil(blocks / resident)
    quant = blocks / (waves * resident)
    busy = min(blocks, hardware.sms)
    share = busy / hardware.sms
    hide = min(1.0, math.ceil(resident / busy) * threads / 512)
    reach = min(1.0, SM_REACH * share * hide)
    us = 1e6
    t_mem = max(dram / (hardware.bandwidth_gbs * 1e9), l2 / (hardware.l2_bandwidth_gbs * 1e9)) * us / (reach * quant)
    dtype = next((n.dtype.value for n in c.kernel.inputs if n.dtype in (DType.F16, DType.BF16)), "f16")
    t_math = (tc / (hardware.peak_tflops[dtype] * 1e12) + flops / (hardware.peak_tflops["f32"] * 1e12)) * us / (share * quant)
    t_loop = waves * c.loop * hardware.iteration_latency_us
    terms = {"memory": t_mem, "math": t_math, "loop": t_loop}
    bound = max(terms, key=terms.get)
    time = hardware.launch_overhead_us + terms[bound]
    if terms[bound] < hardware.launch_overhead_us:
        bound = "launch"
    return Estimate(c.kernel.name, blocks, waves, occ, dram, l2, flops, tc, round(time, 3), bound)


def roofline(program: Program, binding: Mapping[sympy.Symbol, int], hardware: Hardware) -> dict:
    """The program's floor on `hardware`: its inputs read once, its outputs written once, its math at peak."""
    def size(n: Node) -> int:
        return math.prod(int(bind(s, binding)) for s in n.shape) * (n.dtype or DType.F32).bytes

    moved = sum(size(n) for n in program.inputs) + sum(size(n) for _, n in program.outputs)
    flops = 0
    for n in program.nodes():
        if n.op == "matmul":
            flops += 2 * math.prod(int(bind(s, binding)) for s in n.shape) * int(bind(n.args[0].shape[-1], binding))
    dtype = next((n.dtype.value for n in program.inputs if n.dtype), "f16")
    t_mem = moved / (hardware.bandwidth_gbs * 1e9) * 1e6
    t_math = flops / (hardware.peak_tflops[dtype] * 1e12) * 1e6
    return {"bytes": moved, "flops": flops, "floor_us": round(max(t_mem, t_math), 3),
            "bound": "memory" if t_mem >= t_math else "math"}


# -- parameter choice by the model ------------------------------------------------------------------------


def parameters(program: Program, dims: Mapping[sympy.Symbol, int], given: Mapping[str, int], hardware: Hardware,
               threads: int = 128) -> tuple[dict[str, int], dict[str, Concrete], list[Estimate]]:
    """A lowered program at these dims: its kernel parameters by name (`given` kept, the rest chosen by
    the model), every kernel concrete, and their estimates. Raises PrismError listing the violated
    constraints when no choice is valid."""
    symbols = {s.name: s for s in free_symbols(program)}
    fixed = {symbols[n]: v for n, v in given.items()}
    try:
        chosen = tune(program, dims, fixed, hardware, threads)
    except ValueError:  # `choose` searches further, and reports every violated constraint in words
        chosen = choose(program, dims, fixed, hardware)
    params = {**given, **{s.name: v for s, v in chosen.items()}}
    concrete = instantiate_program(program, {**dims, **{symbols[n]: v for n, v in params.items()}}, hardware)
    return params, concrete, [estimate(k, hardware, threads) for k in concrete.values()]


def tune(program: Program, dims: Mapping[sympy.Symbol, int], fixed: Mapping[sympy.Symbol, int], hardware: Hardware,
         threads: int = 128) -> dict[sympy.Symbol, int]:
    """Values for the free kernel parameters that minimise the estimated time. Kernels that share a
    parameter are tuned together; the rest one at a time. Every combination of candidate values is tried
    when there are at most MAX_CANDIDATES of them; beyond that, a descent from the best of a few starts
    (every parameter at its smallest, middle or largest candidate) that changes one or two parameters at
    a time while the estimate improves. Raises ValueError when a kernel has no valid choice (the caller
    reports the violations through `kernels.params.choose`)."""
    binding = {**dims, **fixed}
    free = set(free_symbols(program)) - set(fixed)
    chosen: dict[sympy.Symbol, int] = {}
    for group in _groups(program, free):
        syms = sorted({s for k in group for s in k.symbols() if s in free}, key=str)
        cands = [candidates(program, s, binding) for s in syms]
        own = [(k, [i for i, s in enumerate(syms) if s in k.symbols()]) for k in group]
        memo: dict = {}

        def time_of(values: tuple[int, ...]) -> float:
            total = 0.0
            for k, mine in own:  # a kernel's estimate depends on its own parameters only
                key = (k.name, tuple(values[i] for i in mine))
                if key not in memo:
                    trial = {**binding, **{syms[i]: values[i] for i in mine}}
                    memo[key] = estimate(instantiate(k, trial, hardware), hardware, threads).time_us \
                        if valid(k, trial, hardware) else math.inf
                total += memo[key]
            return total

        if math.prod(len(c) for c in cands) <= MAX_CANDIDATES:
            best = min(itertools.product(*cands), key=time_of)  # the first of equal times: deterministic
        else:
            starts = [tuple(c[0] for c in cands), tuple(c[len(c) // 2] for c in cands), tuple(c[-1] for c in cands)]
            start = min(starts, key=time_of)
            if time_of(start) == math.inf:  # none valid: the first valid combination, if any
                start = next((v for v in itertools.islice(itertools.product(*cands), 20 * MAX_CANDIDATES)
                              if time_of(v) < math.inf), start)
            best = _descend(start, cands, time_of)
        if time_of(best) == math.inf:
            raise ValueError("no valid parameters for kernel " + ", ".join(k.name for k in group))
        chosen.update(zip(syms, best))
    return chosen


def _descend(start: tuple[int, ...], cands: list[list[int]], time_of) -> tuple[int, ...]:
    """Local search: the best change of one or two values at a time, until none improves."""
    current, now = start, time_of(start)
    for _ in range(16):
        moves = [current[:i] + (v,) + current[i + 1:] for i, c in enumerate(cands) for v in c]
        moves += [tuple(v if n == i else w if n == j else x for n, x in enumerate(current))
                  for i, j in itertools.combinations(range(len(cands)), 2) for v in cands[i] for w in cands[j]]
        best = min(moves, key=time_of)
        if time_of(best) >= now:
            break
        current, now = best, time_of(best)
    return current


def _groups(program: Program, free: set) -> list[list]:
    """Kernels joined when they share a free parameter (FlashDecoding's split count, say)."""
    groups: list[list] = []
    for k in kernels_of(program):
        mine = k.symbols() & free
        joined = [g for g in groups if any(mine & (kk.symbols() & free) for kk in g)]
        merged = [k] + [kk for g in joined for kk in g]
        groups = [g for g in groups if g not in joined] + [merged]
    return groups

