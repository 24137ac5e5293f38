"""The cost model: an estimated time per concrete kernel, for ranking where there is no GPU to time on.

Where it sits: parameter instantiation (`tune`) and reports. It prices the code the generator writes for the
kernel: `launch.layout` (threads, register-tiled products, pipeline stages, shared memory) is the same
decision `codegen` renders, and the work is counted from the instantiated tiles:

    dram   = bytes each load brings from device memory: the tensor once when it fits in L2 (re-reads by
             other blocks hit L2), every tile read otherwise; plus every byte stored
    l2     = bytes of every tile read by every block on every iteration (the traffic L2 serves)
    math   = per block and iteration, each product by the path that runs it (below), every other op one
             f32 operation per element (row-wise ops three)
    occ    = blocks resident per SM: by shared memory (`layout.smem`), threads, registers (an estimate:
             REGISTERS_BASE plus every register-tiled product's accumulators and one's fragments, and what a
             thread holds for its copies of the loop's tiles: REGISTERS_PER_TILE, or REGISTERS_PER_COPY a
             copy; an online softmax's running state and rows, at most 255; or ptxas's count where the kernel
             was compiled) and the block limit
    resident = min(blocks, SMs * occ);  waves = ceil(blocks / resident);  busy = min(blocks, SMs)

    Memory, by Little's law: the bandwidth a kernel reaches is the bytes it keeps in flight over the
    latency, at most the achievable share of the peak:
        flight = per SM, the loop tiles of every resident block (as many iterations of them as the pipeline
                 loads ahead, `Layout.lead`: stages - 1; stages - 2 with a wgmma batch in flight or p @ v a step
                 late; stages - 3 where warpgroups take turns; one unpipelined); a kernel without loop tiles
                 keeps its largest tile in flight (`intake.bytes_in_flight`); stores are not counted
        fill   = busy * min(SM_FILL_BYTES_PER_CLOCK, warps * WARP_FILL_BYTES_PER_CLOCK) * clock: what the busy
                 SMs can take in at all, with `warps` resident on each (TMA's copies, issued by one thread, at
                 SM_FILL_BYTES_PER_CLOCK: the warps' share was measured of cp.async, which they issue themselves)
        bw     = min(bandwidth * BANDWIDTH_REACH, busy * flight / dram_latency, fill)
        t_pipe = a pipelined loop's floor: each iteration's tiles land a latency and their own transfer
                 through the SM's intake after they were issued, `lead` iterations ahead (`intake`)
        t_line = the 128-byte lines the copies fill, at LINES_PER_CLOCK an SM (`intake`: strips of a row fill
                 a line for a few of its bytes)
        t_mem  = max(dram / bw, l2 / min(l2 bandwidth, fill), t_line, t_pipe)

    Math, per path (each a rate for the whole GPU, scaled by busy / SMs):
        register-tiled mma.sync   min(peak * MMA_SYNC_REACH * min(1, warps * occ / SUBPARTITIONS),
                                      smem bandwidth * flops per ldmatrix byte)
            (online softmax in registers: s = q @ kt priced so, p @ v with only v's bytes by ldmatrix;
            its exp and rescaling are f32 work; on warpgroups both products at the wgmma rate below, and
            where p @ v runs one iteration late (`Layout.overlap`) both at peak * WGMMA_IN_FLIGHT, the
            softmax's f32 work (max, exp, sums, rescaling, the causal mask) beside p @ v: SOFTMAX_BESIDE
            of the shorter of the two is not counted; where two warpgroups take turns (`Layout.pingpong`)
            both products at peak * WGMMA_PINGPONG (WGMMA_PINGPONG_TMA where TMA copies the loop's tiles:
            `Layout.tma`), and the f32 work of one beside the other's products:
            the longer of the products and that work counts, not their sum)
        register-tiled wgmma (sm_90a)   min(peak * WGMMA_REACH * (1 with 2 or more warpgroups per SM, else
                                            WGMMA_LONE), smem bandwidth * flops per operand byte read);
                                        each iteration's batch in flight into the next (`Layout.in_flight`):
                                        peak * WGMMA_IN_FLIGHT, whatever the warpgroups; the iteration's
                                        f32 work (an RMSNorm's sum of squares) then runs beside the batch
                                        before it, and the shorter of the two is not counted (but for the
                                        first iteration, which has no batch before it);
                                        with a copy warp (`Layout.copy_warp`) peak * WGMMA_COPY_WARP
        wmma with the accumulator in shared memory each k step   peak * WMMA_REACH
        plain f32 dot products and element-wise work   f32 peak * SCALAR_REACH
        plain dot products reading 8 columns per 16-byte load ("dot8")   f32 peak * VECTOR_REACH

    Phases: a pipelined loop overlaps its copies with its math (time = max of the two), and so do two or
    more resident blocks; a lone unpipelined block per SM waits for every tile before computing
    (time = sum). Each loop iteration of an unpipelined block also pays the hardware's iteration latency.

    Blocks of unequal length (a causal loop: the last query tiles run the most iterations) are scheduled
    as the generated code takes them (`kernels.position.longest_first`: the longest query tiles first,
    across the heads): each on the first of the `resident` slots to come free; `tail` is that schedule's
    length over the iterations spread evenly. Equal blocks (tail 1) run in waves, the last one partly
    empty: its idle slots leave their SMs' math unused, so the math time is counted for whole waves
    (t_math * waves * resident / blocks); the bandwidth is shared by whichever blocks are running, and the
    memory time is left as it is.

        time = launch overhead + phases * tail (+ waves * loop * iteration latency, unpipelined)

    A split's combining kernel that runs in the launch of the kernel whose pieces it combines (`tails`: each
    tile's last block combines them) pays no launch overhead; the rest of its time is counted as if it ran
    alone after that kernel, which is about what the last tiles' combining takes, the others running
    beside the pieces still being folded.

    From the compiled code (`compiled`: the compile check's figures for the hardware's arch, `nvcc.nvcc_check`):
    the registers ptxas reports replace the estimate in occ, and where cuobjdump read the SASS
    (`sass.issued`: the fewest instructions a warp that runs the products issues per iteration of the main
    loop, `loop`, and per iteration that issues the copies of the iterations ahead, `copying`; once besides;
    and `spare`, what a warp with no product leaves out per iteration) the time to issue them joins the math:
        per warp = copying * (iterations - last) + loop * last + once
                   - spare * iterations * (1 - product warps / warps)
                   (last: the pipeline's last iterations, `Layout.lead` of them, which copy nothing ahead;
                    product warps: those a register-tiled product's layout takes, all where it takes every one)
        t_issue  = blocks * warps * per warp / (busy * min(SUBPARTITIONS, warps per SM) * clock)
    one instruction per clock per warp scheduler, none of them idle. It is a floor: the shortest path still
    takes every forward branch past other code that only some threads or some iterations run (a guard on the
    thread index; online softmax's rescaling factor, an exp except where the old max is -inf, and the
    arrival that frees the stage before, `if (it > 0)`, both skipped only on the first iteration; the
    outputs' rescaling, only where a row's max moved by over `prism::kLazyMax`): at dh = 128, attention at
    prefill issues at least 312 of the 417 instructions in its loop (269 on iterations that copy nothing).
    It binds only where every path through the loop issues more than the products and copies take.
    The phases take max(t_math, t_issue) for the math, the last wave's idle slots counted as for t_math. The
    search ranks by the code's structure (it cannot compile every candidate); the chosen program is priced
    again from its compiled code, and `Estimate.priced` says which was done.

    From the emulation's count of shared-memory wavefronts (`compiled["wavefronts"]`: per block, bank conflicts
    included, `backend.banks`; `prismc compile --banks`), the time the busy SMs' shared memory takes to serve
    them, one wavefront (128 bytes) per clock per SM (SMEM_BYTES_PER_CLOCK), is a floor beside the issue floor:
        t_shared = blocks * wavefronts / (busy * clock)
    and the phases take max(t_math, t_issue, t_shared), idle slots counted as for t_math. It is low: the count
    leaves out wgmma's operands (the math prices them against the same bandwidth) and TMA's copies.

The constants, and what anchors them (H100 SXM; read every figure as +-30%):
- BANDWIDTH_REACH, dram_latency_ns (hardware file): `intake`'s docstring.
- launch_overhead_us (hardware file, 3.0), once per kernel: not a published H100 figure, but the usual order
  of one launch timed alone with CUDA events (a few microseconds). It decides between one kernel and two at
  decode, where the work itself takes a few microseconds; `--rank measure` replaces it with timings.
- SM_FILL_BYTES_PER_CLOCK, WARP_FILL_BYTES_PER_CLOCK (what an SM takes in), CLOCK_GHZ: `intake`'s docstring.
- MMA_SYNC_REACH = 0.5: `mma.sync` cannot issue fast enough to reach the sm_90 dense peak (989 TFLOP/s
  f16); FlashAttention-2, built on it, runs at 350-400 TFLOP/s on H100, FlashAttention-3 with `wgmma`
  at 600-750.
- WGMMA_REACH = 0.65 (520 TFLOP/s of the hardware file's 800): wgmma issues a 64 x N x 16 product per
  instruction from shared memory, so issue slots and ldmatrix no longer bind. FlashAttention-3's ablation on
  H100 (head dim 128) reports about 570-580 TFLOP/s for wgmma without warp specialization and 661 with it;
  the code here also waits for each iteration's batch and synchronises the block around it (cp.async, no
  TMA), so it is taken a little lower. WGMMA_LONE = 0.75: with one warpgroup per SM nothing runs on the
  tensor cores while it waits for its batch, the barrier and the next tiles' wait (an estimate: about a
  quarter of an iteration of 64-deep k at N = 128); a second warpgroup fills that time.
  WGMMA_IN_FLIGHT = 0.72 (576 TFLOP/s): where each iteration's batch stays in flight while the next
  iteration waits for its tiles, passes its barrier and issues its own batch, the tensor cores are not left
  idle by that wait; what remains is the code without TMA or warp-specialized producers, priced at
  FlashAttention-3's figure for that configuration (570-580) itself rather than below it. Online softmax
  whose p @ v runs one iteration late, beside the next scores' max and exp, has the same rate: that
  ablation puts FlashAttention-3 with only one of its two overlaps (warp specialization, or this pipelining
  of the two products with the softmax) at 570-582 TFLOP/s, against 661 with both.
  WGMMA_COPY_WARP = 0.82 (656 TFLOP/s): each iteration's batch in flight as above, and the loop's TMA copies
  issued by a warp of their own, which refills each stage once its readers have released it, so the loop has
  no block-wide barrier (`Layout.copy_warp`): the two overlaps together, at 1% under FlashAttention-3's 661
  (its copy warp also hands the computing warpgroups its registers, setmaxnreg, which this one does not), and
  inside the 600-750 TFLOP/s that cuBLAS's GEMMs, built the same way, reach on H100. Unmeasured: the in-flight
  kernels an H200 timed (cp.async, a block-wide barrier an iteration) ran at 530-560 TFLOP/s (2026-11-30).
  Warpgroups taking turns with a copy warp (`Layout.pingpong` and `copy_warp`) are FlashAttention-3's own
  kernel: the same rate.
- WGMMA_PINGPONG = 0.78 (624 TFLOP/s): two warpgroups taking turns on the tensor cores, one's batch beside the
  other's softmax, as well as p @ v one iteration late in each: the two overlaps of FlashAttention-3, whose
  ablation (H100, head dim 128) puts the kernel with both at 661 TFLOP/s. With cp.async (`--no-tma`) the
  computing warps issue their own copies (8 16-byte copies per thread and iteration at dh = 128, with their
  address arithmetic) and wait at the stages' mbarriers, so it is taken about 6% lower.
  WGMMA_PINGPONG_TMA = 0.81 (648 TFLOP/s): the same with the loop tiles copied by TMA (`Layout.tma`), as
  FlashAttention-3 copies them: 2% under its 661, since FlashAttention-3 gives the copies a producer warp of
  their own and the computing warpgroups the registers it frees (setmaxnreg), where here thread 0 of a
  computing warp issues them, after waiting for the stage's readers (who read it three iterations before, so
  the wait seldom holds it; `--no-copy-warp`: with a copy warp, WGMMA_COPY_WARP above). Read from the SASS (nvcc 13, sm_90a, attention at q = kv = 4096, dh = 128, the
  static report's kernel): its loop holds 434 instructions, 3 UTMALDG and no LDGSTS (417 with cp.async, 8
  LDGSTS), a warp issues at least 273 an iteration (329 on those that copy; 269 and 312 with cp.async), and
  ptxas gives 138 registers (154).
- SOFTMAX_BESIDE = 0.5: read from the SASS of attention at dh = 128 (nvcc 13, sm_90a): of an iteration's
  34 MUFU.EX2 and 42 FFMA, which the PTX has all before p @ v's wait, ptxas issues 18 and 25 between the
  scores' wait and that one, and schedules the rest after it; the rescaling of the outputs must follow it.
- The f32 work beside a batch in flight, read from the SASS of rmsnorm_linear at n = d = 4096 (nvcc 13,
  sm_90a): its loop waits for the cp.async tiles and the block's barrier, issues the next copies, adds its
  part of the X tile's squares into registers (4 LDS.128 and 32 FFMA a thread: `row_parts`) and issues its
  batch of 4 HGMMA, then waits with `WARPGROUP.DEPBAR.LE gsb0, 0x1`: the batch before is still running
  through all of it, so the tensor cores wait only where that work is the longer.
- smem bandwidth: 128 bytes per clock per SM at 1.75 GHz (about 30 TB/s for the GPU); a warp tile of
  tm x tn instruction tiles moves (256 tm + 128 tn) * 2 bytes by ldmatrix per k step for 4096 tm tn flops,
  the left operand's share divided among the products that load its fragments once (a gated MLP's two).
- SUBPARTITIONS = 4: an SM issues from 4 warp schedulers, each with its own tensor-core unit; a warp
  runs on one, so fewer than 4 computing warps per SM leave the rest of the peak idle.
- WMMA_REACH = 0.04: the wmma path reloads and stores its accumulator in shared memory every k step and
  its 256-512-byte row strides conflict 8 ways: about 30-40 TFLOP/s as generated.
- SCALAR_REACH = 0.2: a plain dot product issues 2 shared loads and 2 conversions per FFMA: about 12 of
  the 60 TFLOP/s f32 peak. Scores read from a transposed tile's rows ("dotrows", `dots.row_lanes`) are priced
  the same: by their SASS (nvcc 13, sm_90a) they issue as many conversions per FFMA (32 FFMA among 104 a 4-step
  unroll, 8 of them LDS.128), what they save is shared-memory wavefronts (half as many, none conflicting),
  which this model does not count.
- VECTOR_REACH = 0.4: read from the SASS of "dot8" (nvcc 13, sm_90): its unrolled inner loop issues 32
  FFMA among 79-83 instructions (one HADD2.F32 conversion per 16-bit element, 8 LDS of which 4 are
  16-byte), so FFMA takes 0.4 of the issue slots; the shuffles that add the lanes' parts come after it.
- REGISTERS_BASE = 32, REGISTERS_PER_TILE = 3, REGISTERS_PER_COPY = 2 (none where TMA copies the loop's tiles):
  read from ptxas (nvcc 13, sm_90) over the kernels of the static report (benchmarks/NOTES.md, 2026-11-29,
  "Copies two iterations ahead"). The threads' passes over a tile have their trip count in sight
  (templates/steps.j2), so nvcc unrolls the copies of the loop's tiles into the main loop. Where a thread's
  copies of a tile fall a fixed distance apart (`copies.apart`: nearly every tile), they are written as its
  first copy's addresses plus k times that distance, and nvcc holds one 64-bit source pointer and one shared
  offset a tile across the loop: three registers. Other tiles' copies each keep their own source pointer: two a
  copy. Copies into tiles whose rows' 16-byte chunks are permuted (`launch.xor_rows`: rows of 32 or 64 bytes)
  are not counted: ptxas computes their addresses in the loop rather than holding them. A kernel with no
  product and no loop tiles takes 28-34 (RMSNorm and RoPE at prefill), so the base. Over the 16 kernels of that
  report the guess is 0.81 to 1.27 of ptxas's count (gpt2_mlp's second product at decode: 38 against 47;
  swiglu at decode: 51 against 40); before the copies were written apart it was 2 to 52 registers over (a
  pointer a copy, and a base of 64). ptxas's own count replaces it for the program that is built. Shared
  memory mostly decides the blocks per SM before registers do.
It is meant to rank, not to predict to the microsecond; `roofline` gives the floor no program beats.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, replace
from typing import Mapping, NamedTuple

from .intake import (CLOCK_GHZ, bytes_in_flight, line_seconds, pipeline_seconds, reachable_bandwidth,
                     reachable_l2_bandwidth)
from .copies import copy_registers
from .dots import few_rows_flops, vector_flops
from .launch import CodegenConfig, Layout, blocks_per_sm, layout, uses_tensor_cores
from ..ir.accumulators import ACCUMULATORS
from ..kernels.fusion import Place, Plan, plan
from ..ir.nodes import DType, Node
from ..kernels.constraints import Concrete
from ..kernels.hardware import Hardware
from ..kernels.position import mean_iterations, stretch
from ..kernels.kernel import SUM, after_loop, loop_varying, storage, stored_dtype
from .sums import finished
from ..ir.ops import OPS, Kind

MMA_SYNC_REACH = 0.5
WGMMA_REACH = 0.65
WGMMA_LONE = 0.75  # the share of WGMMA_REACH one warpgroup per SM keeps busy
WGMMA_IN_FLIGHT = 0.72  # with each iteration's batch in flight into the next (`Layout.in_flight`)
WGMMA_COPY_WARP = 0.82  # the same with a copy warp issuing the TMA copies (`Layout.copy_warp`)
WGMMA_PINGPONG = 0.78  # two warpgroups taking turns on the tensor cores (`Layout.pingpong`)
WGMMA_PINGPONG_TMA = 0.81  # the same with the loop tiles copied by TMA (`Layout.tma`)
SOFTMAX_BESIDE = 0.5  # the share of online softmax's f32 work issued while p @ v runs (`Layout.overlap`)
WMMA_REACH = 0.04
SCALAR_REACH = 0.2
VECTOR_REACH = 0.4
SMEM_BYTES_PER_CLOCK = 128  # per SM
REGISTERS_BASE = 32  # registers per thread besides a register-tiled product's accumulators and fragments
SUBPARTITIONS = 4  # warp schedulers (and tensor-core units) per SM: one warp keeps at most one busy


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
    bound: str  # "memory", "math", "issue", "shared", "loop" or "launch": the term that decided
    priced: str = "structure"  # from what: "structure" (launch.layout), "ptxas" (and its registers), "sass" (and issue)
    registers: int = 0  # per thread, for the blocks per SM: the model's guess, or ptxas's count where priced from it
    launched_by: str | None = None  # the kernel in whose launch it runs (a combining kernel: `tails`); None: its own
    warps: int = 0  # warps resident on a busy SM (`tuning.tune` prefers more between equal estimates)
    wavefronts: float = 0.0  # shared-memory wavefronts a block, counted in the emulation (0: not counted)
    shared_us: float = 0.0  # the time the busy SMs' shared memory takes to serve them (t_shared)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class Work(NamedTuple):
    """What one launch of a kernel moves and computes (`kernel_work`)."""
    dram: int  # bytes from device memory
    l2: int  # bytes through L2
    flops: int  # f32 flops
    tensor_core_flops: int
    vector: int  # of `flops`, those in products that read their right operand 8 columns at a time
    looped: int  # of `flops` less `vector`, those evaluated on every loop iteration
    rows: int = 0  # of `tensor_core_flops`, those of products whose few rows are an mma's columns (`dots.row_mma`)


def kernel_work(c: Concrete, hardware: Hardware, laid: Layout | None = None,
                config: CodegenConfig = CodegenConfig()) -> Work:
    """The `Work` of one launch of `c`, laid out as `laid` (by default as `config` lays it out)."""
    k = c.kernel
    laid = laid or layout(c, config)
    registered = {acc.args[0] for acc in laid.registers} | set(laid.flash)  # products in registers (mma.sync, wgmma)
    shape, blocks, loop = c.shape, c.blocks(), iterations(c)
    varying = loop_varying(k)
    dram = l2 = 0
    for load in k.loads:
        node = k.tile_node(load.tile)
        if node is None:
            continue
        src = k.inputs[load.source]
        tile_bytes = math.prod(shape(node)) * storage(src).bytes
        traffic = round(tile_bytes * blocks * (loop if node in varying else 1))
        whole = math.prod(shape(src)) * storage(src).bytes
        l2 += traffic
        dram += whole if whole <= hardware.l2_bytes else traffic
    for i, store in enumerate(k.stores):
        elements = math.prod(c.output_shape(i))
        summed = math.prod(g for a, g in c.grid if a not in store.map.axes())
        done = finished(c, i)  # f32 adds into a workspace; the last blocks' reads and zeroing (`sums`)
        dram += elements * stored_dtype(k, i).bytes * (summed if store.add and not done else 1)
        dram += elements * (4 * summed + 8) if done else 0
        if store.then is not None:  # the tensors its chain reads at the elements stored (`kernels.finishing`)
            dram += sum(math.prod(c.shape(n)) * storage(n).bytes for n in store.then.walk() if n.op == "input"
                        and n.attr != SUM)
    p, after = plan(k), after_loop(k.body())
    flops = tc = vec = looped = 0
    # Values made once: after the loop, or before it from tiles it does not split (and the values evaluated
    # in place where only those read them); the rest every iteration.
    once: set[Node] = set()
    for n in reversed(k.body()):
        if OPS[n.op].kind is Kind.ACCUMULATE:
            continue
        readers = p.users[n]
        if n in after or (n not in varying and (p.place[n] in (Place.SMEM, Place.STORED)
                                                  or (readers and all(u in once for u in readers)))):
            once.add(n)
    rows = 0
    for n in k.body():
        times = blocks * (1 if n in once else loop)
        f, t = _node_flops(n, shape, p, registered, flash=n.args[0] in laid.flash if n.args else False)
        few = few_rows_flops(c, n, f, laid, config)
        if few:  # on tensor cores at 8 columns (`dots.row_mma`), out of the f32 work
            f, t = f - 2 * math.prod(shape(n)) * shape(n.args[0])[-1], t + few
            rows += few * times
        v = vector_flops(c, n, f, laid.threads, config)
        flops, tc, vec = flops + f * times, tc + t * times, vec + v * times
        looped += 0 if n in once else (f - v) * times
    return Work(dram, l2, round(flops), round(tc), round(vec), round(looped), round(rows))


def iterations(c: Concrete) -> float:
    """Loop iterations per block, on average (a causal loop stops early: `kernels.position`)."""
    return mean_iterations(c.shape, c.kernel, dict(c.grid), c.loop)


def _node_flops(n: Node, shape, p: Plan, registered=frozenset(), flash: bool = False) -> tuple[int, int]:
    """(f32 flops, tensor-core flops) of one evaluation of `n`; `flash`: an accumulator of online softmax
    in registers, whose product runs on tensor cores."""
    kind = OPS[n.op].kind
    if kind is Kind.MATMUL:
        work = 2 * math.prod(shape(n)) * shape(n.args[0])[-1]
        return (0, work) if n in registered or uses_tensor_cores(n.args[0], n.args[1], p, shape) else (work, 0)
    if kind is Kind.ACCUMULATE:  # `flops` per element of its first operand, plus any product it folds
        if not flash and n.args[0] in registered:  # a register-tiled product: mma.sync adds into the registers
            return 0, 0
        acc, x = ACCUMULATORS[n.op], shape(n.args[0])
        product = 2 * math.prod(shape(n)) * x[-1] if acc.like == "matmul" else 0
        return acc.flops * math.prod(x) + (0 if flash else product), product if flash else 0
    if kind in (Kind.UNARY, Kind.BINARY, Kind.MASK, Kind.REDUCE, Kind.ROWWISE):
        operand = n.args[0] if kind in (Kind.REDUCE, Kind.ROWWISE) else n
        return math.prod(shape(operand)) * (3 if kind is Kind.ROWWISE else 1), 0
    return 0, 0


def estimate(c: Concrete, hardware: Hardware, threads: int = 128, config: CodegenConfig | None = None,
             compiled: Mapping | None = None, launched: bool = True) -> Estimate:
    """The kernel's estimated time, priced from the code's structure, or from `compiled` where given (the
    compile check's figures for the hardware's arch: ptxas's `registers`, and `issued` from the SASS; and
    `wavefronts`, a block's shared-memory wavefronts counted in the emulation).
    `launched` False: the kernel runs in another's launch (`tails`), which pays the launch overhead."""
    config = config or for_hardware(CodegenConfig(threads=threads), hardware)
    shape = layout(c, config)
    dram, l2, flops, tc, vec, looped, rows = kernel_work(c, hardware, shape, config)
    blocks = c.blocks()
    regs = min(255, REGISTERS_BASE + sum(t.accumulators for t in shape.registers.values())  # all live at once
               + max([6 * t.tm + 2 * t.tn if t.orient != "wg" else 8  # one product's fragments (wgmma: descriptors)
                      for t in shape.registers.values()] + [0])
               + max([f.accumulators + 4 * f.tm for f in shape.flash.values()], default=0)
               + copy_registers(c, shape, config))
    if compiled and compiled.get("registers"):  # what ptxas gave it, in place of the estimate
        regs = compiled["registers"]
    occ = max(1, blocks_per_sm(shape.smem, shape.launched, regs, hardware))
    resident = min(blocks, hardware.sms * occ)
    waves = math.ceil(blocks / resident)
    busy = min(blocks, hardware.sms)
    us = 1e6
    on_sm = math.ceil(resident / busy)  # blocks resident on a busy SM
    flight, warps = on_sm * bytes_in_flight(c, shape), on_sm * shape.threads / 32
    copying = math.inf if shape.tma else warps  # TMA's copies are not the warps': the SM's own intake bounds them
    t_mem = max(dram / reachable_bandwidth(hardware, busy, flight, copying),
                l2 / reachable_l2_bandwidth(hardware, busy, copying),
                line_seconds(c, shape, hardware, iterations(c)),
                pipeline_seconds(c, shape, hardware, on_sm, copying, iterations(c))) * us
    t_math = _math_seconds(c, shape, hardware, flops, tc, occ, vec, looped, rows) * us / (busy / hardware.sms)
    issued = (compiled or {}).get("issued")
    t_issue = _issue_seconds(c, shape, hardware, issued, occ) * us if issued else 0.0
    wavefronts = float((compiled or {}).get("wavefronts") or 0.0)
    t_shared = blocks * wavefronts * 128 / (busy * SMEM_BYTES_PER_CLOCK * CLOCK_GHZ * 1e9) * us
    tail = stretch(c.shape, c.kernel, dict(c.grid), c.loop, resident, hardware.sms)  # unequal blocks, as launched
    if tail == 1 and blocks > resident:  # equal blocks: the last wave's idle slots leave their SMs' math unused
        t_math, t_issue, t_shared = (t * waves * resident / blocks for t in (t_math, t_issue, t_shared))
    overlaps = shape.stages > 1 or on_sm > 1
    t_loop = 0.0 if shape.stages > 1 else waves * iterations(c) * hardware.iteration_latency_us
    terms = {"memory": t_mem, "math": t_math, "issue": t_issue, "shared": t_shared, "loop": t_loop}
    bound = max(terms, key=terms.get)
    compute = max(t_math, t_issue, t_shared)
    body = (max(t_mem, compute) if overlaps else t_mem + compute) * tail + t_loop
    overhead = hardware.launch_overhead_us if launched else 0.0
    if body < overhead:
        bound = "launch"
    return Estimate(c.kernel.name, blocks, waves, occ, dram, l2, flops, tc, round(overhead + body, 3), bound,
                    "sass" if issued else "ptxas" if compiled and compiled.get("registers") else "structure", regs,
                    warps=int(warps), wavefronts=round(wavefronts, 1), shared_us=round(t_shared, 3))


def _issue_seconds(c: Concrete, shape: Layout, hardware: Hardware, issued: Mapping, occ: int) -> float:
    """Seconds the busy SMs take to issue what every warp of the launch issues (`sass.Issued`'s fields), one
    instruction per clock per warp scheduler that has a warp (t_issue in the docstring)."""
    warps, blocks = shape.threads // 32, c.blocks()
    busy = min(blocks, hardware.sms)
    per_sm = warps * min(occ, math.ceil(blocks / busy))  # warps resident on a busy SM
    n = iterations(c)
    last = min(n, max(0, shape.lead) if shape.stages > 1 else 0)  # the iterations with no copies ahead to issue
    per_warp = issued.get("copying", issued["loop"]) * (n - last) + issued["loop"] * last + issued["once"]
    per_warp -= issued.get("spare", 0.0) * n * (1 - _product_warps(shape, warps) / warps)  # warps with no product
    return blocks * warps * per_warp / (busy * min(SUBPARTITIONS, per_sm) * CLOCK_GHZ * 1e9)


def _product_warps(shape: Layout, warps: int) -> int:
    """The block's warps that run a register-tiled product (the first ones: `if (warp < N)` in the code); all
    of them where the kernel has none, or where one takes every warp."""
    taken = [t.wm * t.wn * t.wk for t in shape.registers.values()] + [f.warps for f in shape.flash.values()]
    return min(warps, max(taken, default=warps))


def _math_seconds(c: Concrete, shape: Layout, hardware: Hardware, flops: int, tc: int, occ: int = 1,
                  vec: int = 0, looped: int = 0, rows: int = 0) -> float:
    """Seconds of math on the whole GPU: each product by its path, the rest as f32 work (`vec` of it in
    products that read 8 columns per 16-byte load; `looped` of the rest evaluated on every iteration, which
    runs beside a wgmma batch in flight)."""
    k = c.kernel
    dtype = next((n.dtype.value for n in k.inputs if n.dtype in (DType.F16, DType.BF16)), "f16")
    peak = hardware.peak_tflops[dtype] * 1e12
    smem = SMEM_BYTES_PER_CLOCK * CLOCK_GHZ * 1e9 * hardware.sms
    times = c.blocks() * iterations(c)
    seconds, registered, batches = 0.0, 0, 0.0

    def mma_sync(work: int, warps: int, flops_per_byte: float) -> float:
        """Seconds of `work` on mma.sync by `warps` computing warps per block, each k step moving
        1 / flops_per_byte bytes per flop by ldmatrix; fewer than SUBPARTITIONS warps per SM leave
        tensor cores idle."""
        busy = min(1.0, warps * occ / SUBPARTITIONS)
        return work / min(peak * MMA_SYNC_REACH * busy, smem * flops_per_byte)

    sharing = collections.Counter((acc.args[0].args[0], t) for acc, t in shape.registers.items())
    for acc, t in shape.registers.items():
        work = 2 * math.prod(c.shape(acc)) * c.shape(acc.args[0].args[0])[-1] * times
        p = sharing[acc.args[0].args[0], t]  # products on the same fragments of a (`tensor_steps.shared_operand`)
        if t.orient == "wg":  # per group and k step: tm blocks of A (64 x 16) and B (16 x N_w), A shared by p
            read = t.tm * (64 * 16 / p + 16 * t.tn * 8) * 2
            reach = (WGMMA_COPY_WARP if shape.copy_warp else WGMMA_IN_FLIGHT if shape.in_flight
                     else WGMMA_REACH * (WGMMA_LONE if t.groups * occ < 2 else 1.0))
            product = work / min(peak * reach, smem * 2 * 64 * 16 * 8 * t.tn * t.tm / read)
            seconds += product
            batches += product if shape.in_flight else 0.0
        else:
            x4, pairs = (512 * t.tm / p, 256 * t.tn) if t.orient == "mn" else (512 * t.tm, 256 * t.tn / p)
            seconds += mma_sync(work, t.wm * t.wn * t.wk, 4096 * t.tm * t.tn / (x4 + pairs))
        registered += work
    f32 = hardware.peak_tflops["f32"] * 1e12
    # f32 work that runs beside the tensor cores: an online softmax's beside p @ v (`Layout.overlap`,
    # `Layout.pingpong`); an iteration's other work beside the batch the iteration before left in flight
    # (`Layout.in_flight`), for all but the first iteration
    steps = iterations(c)
    hidden = min(batches, looped / (f32 * SCALAR_REACH)) * max(0.0, steps - 1) / steps
    for s, f in shape.flash.items():  # s = q @ kt as above (tn = n / 8); p @ v: only v by ldmatrix
        qk, pv = 2 * f.m * f.n * f.d * times, 2 * f.m * f.dv * f.n * f.outs * times
        softmax = _softmax_flops(c, s) * times / (f32 * SCALAR_REACH) if f.wg else 0.0  # its f32 work's seconds
        if f.wg and shape.pingpong:  # one warpgroup's softmax beside the other's products
            products = (qk + pv) / (peak * (WGMMA_COPY_WARP if shape.copy_warp else WGMMA_PINGPONG_TMA if shape.tma
                                            else WGMMA_PINGPONG))
            seconds += products
            hidden += min(products, softmax)
        elif f.wg and shape.overlap:  # p @ v one iteration late, beside the next iteration's softmax
            seconds += (qk + pv) / (peak * WGMMA_IN_FLIGHT)
            hidden += SOFTMAX_BESIDE * min(pv / (peak * WGMMA_IN_FLIGHT), softmax)
        elif f.wg:  # both on wgmma (operand bytes read by it bind nowhere near: 64 rows share every B byte)
            seconds += (qk + pv) / (peak * WGMMA_REACH * (WGMMA_LONE if f.warps // 4 * occ < 2 else 1.0))
        else:
            seconds += mma_sync(qk, f.warps, 4096 * f.tm * f.n / 8 / ((256 * f.tm + 16 * f.n) * 2))
            seconds += mma_sync(pv, f.warps, 16.0 * f.tm)
        registered += qk + pv
    # a few rows as an mma's 8 columns (`dots.row_mma`), `rows` counted at those 8: each warp's k step reads 16
    # rows of t by ldmatrix (512 bytes) and the 8 columns from shared memory (256) for 4096 flops
    seconds += mma_sync(rows, shape.threads // 32, 4096 / 768) if rows else 0.0
    registered += rows
    seconds += (tc - registered) / (peak * WMMA_REACH)
    return seconds + (flops - vec) / (f32 * SCALAR_REACH) + vec / (f32 * VECTOR_REACH) - hidden


def _softmax_flops(c: Concrete, s: Node) -> int:
    """The f32 flops of one evaluation of online softmax over `s` in registers: its accumulators' running max,
    exp, sums and rescaling, and the causal mask where `s` is masked there (`launch.scores_product`)."""
    p = plan(c.kernel)
    nodes = [u for u in p.users[s] if OPS[u.op].kind is Kind.ACCUMULATE] + ([s] if s.op == "causal" else [])
    return sum(_node_flops(n, c.shape, p, flash=True)[0] for n in nodes)


def for_hardware(codegen: CodegenConfig | None, hardware: Hardware) -> CodegenConfig:
    """The code generator's options (the defaults where None) with what the hardware decides: the shared
    memory a block may fill, its arch (wgmma on sm_90 only), its SMs, and the bytes an SM keeps in flight to
    stream its share of the bandwidth over the DRAM latency (`launch.deepened`; H100: 13.6 KB)."""
    return replace(codegen or CodegenConfig(), smem_limit=hardware.smem_per_block, arch=hardware.arch, sms=hardware.sms,
                   flight=round(hardware.bandwidth_gbs * hardware.dram_latency_ns / hardware.sms),
                   smem_per_sm=hardware.smem_per_sm)
