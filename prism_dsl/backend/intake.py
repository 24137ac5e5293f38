"""What the SMs take in: the memory side of the cost model (`cost`), the rates at which a kernel's tiles can
reach shared memory from device memory and from L2.

Where it sits: under `cost`, which takes the slowest of these beside the math; `benchmarks/gpu_probe.py` prices
its own copy kernels with the same functions, so that a GPU run measures these constants directly.

    fill   = busy * min(SM_FILL_BYTES_PER_CLOCK, warps * WARP_FILL_BYTES_PER_CLOCK) * clock: what the busy SMs
             can take in at all, with `warps` resident on each (`sm_intake`)
    bw     = min(bandwidth * BANDWIDTH_REACH, busy * flight / dram_latency, fill)   (`reachable_bandwidth`)
    l2 bw  = min(l2 bandwidth, fill)                                                  (`reachable_l2_bandwidth`)

the lines an SM's copies request (`line_seconds`): a copy from device memory or L2 fills 128-byte lines, and an
SM takes in about LINES_PER_CLOCK of them a clock however few of each line's bytes the tile uses. A tile whose
rows are strips of a wider tensor (a decode projection's 16 columns of every 8 KB row of its weights: 32 bytes a
line) is bound by that long before its bytes are:

    lines  = per loaded tile, its contiguous runs in the tensor times the lines each spans, over every block and
             iteration (TMA copies left out: they do not pass through the SM's load path)
    t_line = lines / (busy * LINES_PER_CLOCK * clock)

and the pipeline's own floor (`pipeline_seconds`): a loop's copies for iteration i + lead are issued at the top
of iteration i and must have landed by the top of iteration i + lead. Each iteration's tiles, those of every block
resident on the SM (`step` bytes), land a latency after they are issued and then cross the SM's intake, so

    t_pipe = rounds * iterations * (dram_latency + step / intake) / lead,   rounds = blocks / (busy * on_sm)

Little's law with the transfer itself counted: where the lead is one iteration and the tiles are large, the
loop waits for its tiles every iteration however fast its math, and loading two or more iterations ahead is
what hides the latency (`launch.held_by_batches`: such loops get a stage more where shared memory holds it).
The latency is device memory's: tiles that L2 holds arrive sooner, so the term is high where most of them hit.

The constants, and what anchors them (H100 SXM; read every figure as +-30%):
- BANDWIDTH_REACH = 0.9: streaming kernels (cuBLAS GEMV, FlashDecoding) reach 75-90% of the 3.35 TB/s HBM3
  peak; the hardware file's `bandwidth_gbs` is the measured copy bandwidth.
- dram_latency_ns (hardware file, H100 600, H200 660 as measured by the probe): loaded DRAM latency on Hopper in
  microbenchmark studies is roughly 500-700 ns; 3.35 TB/s over 600 ns needs about 2 MB in flight, 15 KB per SM.
- SM_FILL_BYTES_PER_CLOCK = 64: the bytes per clock one SM's L1 takes in from L2 at most. A100's whitepaper gives
  its L2 read bandwidth as 5120 bytes per clock for 108 SMs (47 each), so an SM's own path is at least that and is
  taken here as 64: about 112 GB/s per SM at 1.75 GHz.
- WARP_FILL_BYTES_PER_CLOCK = 3.7: what an SM takes in is bound first by the warps copying into it, measured
  (`benchmarks/gpu_probe.py`, an H200, 2026-11-28): one block of 128 threads copying by `cp.async` as the
  generated loops do took in 14.7 bytes per clock (19-26 GB/s), from device memory and from L2 alike, however
  many bytes it kept in flight past 16-32 KB, while two such blocks per SM streamed 4.5 TB/s over 132 SMs. So
  the intake is taken per resident warp, 14.7 / 4, up to the SM's 64 (17 warps); that it grows with a block's
  threads as with its blocks is the assumption the probe has not measured (128 threads). It binds where few SMs
  are busy, or few warps on each: 64 blocks of 128 threads stream at most 1.65 TB/s, however many bytes each
  keeps in flight, as measured (half the SMs, half the bandwidth).
- LINES_PER_CLOCK = 0.3: fitted to the decode projections an H200 timed (2026-11-30, `benchmarks/RESULTS.md`),
  which read their weights in strips of 32 bytes a row: rmsnorm_linear (1.18 million lines, 21.9 us), Llama's
  down projection (3.17 million, 48.4 us), rmsnorm_mlp and swiglu (2.23 million, 32.3 and 31.5 us) take in 0.27,
  0.30, 0.33 and 0.33 lines a clock an SM, less the launch; llama_qkv, 64 bytes a row, 0.20 (its weights'
  bandwidth binds first). `benchmarks/gpu_probe.py`'s strips of 32 bytes (copies alone, no math or barriers
  between) took in 0.41. At 0.3 full lines come in at 38 bytes a clock an SM (8.9 TB/s over 132 SMs), so it binds
  only where the lines are partly used. Before it the model put those kernels' time at 0.52-0.64 of what they
  took (`benchmarks/calibrate.py`).
- The pipeline's floor, checked against the two kernels on wgmma that the H200 timed (2026-11-28) with their
  copies one iteration ahead, laid out again as they ran and priced on the H200 file: attention at prefill
  (q = kv = 4096, dh = 128; 64 keys, 32 KB an iteration, two warpgroups taking turns) gets 324 us from it where
  the math gives 228, measured 334; swiglu at prefill (n = d = 4096; 48 KB an iteration) 801 us where the math
  gives 495, measured 615. So the floor accounts for attention's time, and overshoots swiglu's by 1.3x: its
  8 warps took in more than 8 x 3.7 bytes per clock (the assumption above; at least 6.1 a warp, if its time
  were all this floor). The probe's table of one block per SM at 128 to 512 threads measures it next time;
  `benchmarks/NOTES.md` ("Copies two iterations ahead") has the working.
"""

from __future__ import annotations

import math

from .launch import Layout, iteration_bytes, tile_bytes
from ..kernels.constraints import Concrete
from ..kernels.hardware import Hardware
from ..kernels.kernel import loop_varying, storage

BANDWIDTH_REACH = 0.9
SM_FILL_BYTES_PER_CLOCK = 64  # per SM, from L2 into its L1, at most
WARP_FILL_BYTES_PER_CLOCK = 3.7  # per warp resident on a busy SM: what its copies take in (measured, H200)
CLOCK_GHZ = 1.75
LINE_BYTES = 128  # what a copy from device memory or L2 fills in an SM's L1, however few of its bytes are used
LINES_PER_CLOCK = 0.3  # per SM: the lines its copies take in (fitted, H200)


def sm_intake(warps: float) -> float:
    """Bytes per clock one busy SM takes in with `warps` warps resident on it (the docstring's fill, per SM)."""
    return min(SM_FILL_BYTES_PER_CLOCK, warps * WARP_FILL_BYTES_PER_CLOCK)


def reachable_bandwidth(hardware: Hardware, busy: int, flight: float, warps: float) -> float:
    """Bytes per second from device memory for `busy` SMs keeping `flight` bytes in flight each, with `warps`
    resident on each (the docstring's bw)."""
    return min(hardware.bandwidth_gbs * 1e9 * BANDWIDTH_REACH, busy * flight / (hardware.dram_latency_ns * 1e-9),
               busy * sm_intake(warps) * CLOCK_GHZ * 1e9)


def reachable_l2_bandwidth(hardware: Hardware, busy: int, warps: float) -> float:
    """Bytes per second L2 serves to `busy` SMs with `warps` resident on each: its own bandwidth, or what those
    SMs take in (min(l2 bw, fill))."""
    return min(hardware.l2_bandwidth_gbs * 1e9, busy * sm_intake(warps) * CLOCK_GHZ * 1e9)


def bytes_in_flight(c: Concrete, shape: Layout) -> int:
    """Bytes one block has in flight from device memory: its loop tiles for the iterations the pipeline loads
    ahead (one when unpipelined), or its largest other tile when it has no loop tiles."""
    per_iteration = iteration_bytes(c)
    return max(1, per_iteration * max(1, shape.lead) if per_iteration
               else max((b for _, b in tile_bytes(c)), default=16))


def pipeline_seconds(c: Concrete, shape: Layout, hardware: Hardware, on_sm: int, warps: float,
                     iterations: float) -> float:
    """t_pipe of the docstring: the least time a pipelined loop takes when each iteration's tiles must land a
    latency and their own transfer after they were issued, `lead` iterations before they are read; 0 for a loop
    that is not pipelined (the cost model charges it each iteration's latency instead) or copies nothing."""
    step = on_sm * iteration_bytes(c)
    if shape.stages < 2 or not step:
        return 0.0
    blocks = c.blocks()
    busy = min(blocks, hardware.sms)
    transfer = step / (sm_intake(warps) * CLOCK_GHZ * 1e9)
    rounds = blocks / (busy * on_sm)
    return rounds * iterations * (hardware.dram_latency_ns * 1e-9 + transfer) / max(1, shape.lead)


def tile_lines(tile: tuple[int, ...], whole: tuple[int, ...], itemsize: int) -> int:
    """The lines one copy of a tile of shape `tile` from a tensor of shape `whole` fills: its contiguous runs (the
    innermost dims it takes whole, and its part of the next) times the lines each spans (runs assumed to start
    on a line where they are shorter than one: a tile's strip starts at a multiple of its width)."""
    run = itemsize
    for t, w in zip(reversed(tile), reversed(whole)):
        run *= t
        if t != w:
            break
    runs = math.prod(tile) * itemsize // max(run, 1)
    return runs * -(-run // LINE_BYTES)


def lines(c: Concrete, shape: Layout, iterations: float) -> float:
    """The lines every block's copies fill over the kernel (the docstring's lines): each loop tile every
    iteration, the others once; the tiles TMA copies are left out."""
    k, varying = c.kernel, loop_varying(c.kernel)
    total = 0.0
    for load in k.loads:
        node = k.tile_node(load.tile)
        if node is None or load.tile in shape.tma:
            continue
        src = k.inputs[load.source]
        total += tile_lines(c.shape(node), c.shape(src), storage(src).bytes) * (iterations if node in varying else 1)
    return total * c.blocks()


def line_seconds(c: Concrete, shape: Layout, hardware: Hardware, iterations: float) -> float:
    """t_line of the docstring: the time the busy SMs take to take in the lines the kernel's copies fill."""
    return lines(c, shape, iterations) / (min(c.blocks(), hardware.sms) * LINES_PER_CLOCK * CLOCK_GHZ * 1e9)
