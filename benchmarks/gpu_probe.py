"""Measures, on a GPU, the figures the cost model assumes about memory and launches, and prints each beside
the model's own: what a kernel launch costs (alone, and back to back), how long one load from L2 and from
device memory takes, what bandwidth B blocks reach with F bytes of copies in flight each, what L2 serves B
blocks streaming a footprint that stays in it, what one SM takes in with one block of 128, 256 or 512
threads on it (whether the intake grows with the warps copying, as `intake.sm_intake` assumes), and what
bandwidth blocks reach that each read a strip of 32 to 512 bytes of every row of a matrix, as the decode
projections read their weights (the model counts their bytes alone, whatever the strip's width).

    python benchmarks/gpu_probe.py [--hardware NAME] [--json FILE]     # needs a CUDA GPU and pycuda

The figures are compared with the hardware file the device's name names (h100 on an H100, h200 on an H200;
`hardware.for_device`), h100 where none does, or the one `--hardware` gives.

The kernels are in benchmarks/probe.cu. The streaming kernel copies through shared memory with cp.async as
the generated loops do, and the XOR of everything it read is checked against the host's for every block, so
a figure is only printed for a kernel that read every byte. Every run (the launches, the chases, the
streams) is timed between two CUDA events with a spinning kernel queued before the first and lengthened
until the host has queued the whole run before the GPU gets to it (`cuda_runtime.Ahead`), so that the
host's time to issue the run is never counted: a launch "back to back" is the GPU's time per launch queued. The bandwidth table sets each measured figure beside `intake.reachable_bandwidth` at the same blocks
and bytes in flight (the L2 table beside `intake.reachable_l2_bandwidth`), and the summary gives what the
tables imply for the hardware file's constants (`bandwidth_gbs` with BANDWIDTH_REACH, `dram_latency_ns`,
`l2_bandwidth_gbs`, WARP_FILL_BYTES_PER_CLOCK, `launch_overhead_us`): the question it settles first is whether
half the SMs, each with deep pipelines, stream as fast as all of them. That decides attention at decode with 4096 keys,
where the model prefers 64 blocks each reading all the keys (3 of 4 of them from L2) to 256 blocks and a
combining kernel: the L2 figures say whether 64 SMs take in those bytes as fast as the model lets them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prism_dsl.backend import intake  # noqa: E402
from prism_dsl.backend.cuda_runtime import NVCC_OPTIONS, Ahead, device_target  # noqa: E402
from prism_dsl.backend.launch import blocks_per_sm  # noqa: E402
from prism_dsl.kernels.hardware import Hardware, for_device, hardware_names, load_hardware  # noqa: E402

SOURCE = Path(__file__).with_name("probe.cu")
HEADERS = ROOT / "templates"  # prism.cuh, whose cp.async the streaming kernel uses
STAGES = (2, 3, 4, 5, 9, 17)  # the depths probe.cu instantiates
THREADS = 128
STREAM_BYTES = 1 << 30  # far beyond L2: every byte comes from device memory
SLOT = 256  # bytes between the links of a chase: one per L2 sector group, no two in a line
L2_FOOTPRINT = 8 << 20  # streamed from L2: within one partition of the H100's (25 MB of 50) and the A100's 40 MB
L2_READ = 4 << 20  # bytes each block reads of it, from its own place (half of it: the XORs are not all alike)
# Strips: a block streams its columns of every row of a d = 4096 projection's f16 weights (8 KB rows), as the
# decode projections' loops do, 16 KB tiles in 3 stages; 128 MB of rows, far beyond L2
STRIP_ROW = 8192
STRIP_ROWS = 16384
STRIP_TILE = 16384
STRIP_WIDTHS = (32, 64, 128, 256, 512)  # bytes of each row a block reads
STRIP_BLOCKS = 256  # strips x ranges of rows: about two blocks per SM, as those kernels launch


@dataclass(frozen=True)
class Point:
    """One streaming measurement: `blocks` blocks of `threads` threads, `stages` tiles of `tile` bytes each."""
    blocks: int
    stages: int
    tile: int
    gbs: float  # measured, GB/s
    threads: int = THREADS

    @property
    def flight(self) -> int:  # bytes one block keeps in flight: the tiles loaded ahead
        return (self.stages - 1) * self.tile


@dataclass(frozen=True)
class Strip:
    """One strip measurement: `blocks` blocks, each reading `width` bytes of every row of its range of rows."""
    width: int
    blocks: int
    gbs: float  # measured, GB/s


def strip_layout(width: int, row: int = STRIP_ROW, rows: int = STRIP_ROWS, blocks: int = STRIP_BLOCKS,
                 tile: int = STRIP_TILE) -> tuple[int, int, int, int]:
    """(strips across a row, ranges of rows, rows a block reads, rows a tile) for strips `width` bytes wide: every
    byte read once, by `blocks` blocks (fewer where the strips across a row are more than that)."""
    strips = row // width
    ranges = max(1, blocks // strips)
    return strips, ranges, rows // ranges, tile // width


def strip_xors(words: np.ndarray, width: int, **sizes) -> np.ndarray:
    """The XOR of the words block b of `probe_strips` reads, for every b (b = range * strips + strip)."""
    strips, ranges, rows, _ = strip_layout(width, **sizes)
    tiles = words.reshape(ranges, rows, strips, width // 4)
    return np.bitwise_xor.reduce(np.bitwise_xor.reduce(tiles, axis=3), axis=1).reshape(-1)


def configurations(sms: int) -> list[tuple[int, int, int]]:
    """(blocks, stages, tile bytes) to measure: from an eighth of the SMs to two blocks per SM, each from a
    shallow pipeline of small tiles (4 KB in flight) to 128 KB in flight."""
    depths = [(2, 4096), (3, 4096), (3, 8192), (5, 8192), (3, 16384), (9, 8192), (17, 8192)]
    return [(b, s, t) for b in block_counts(sms) for s, t in depths]


def block_counts(sms: int) -> list[int]:
    return sorted({max(1, sms // 8), max(1, sms // 4), max(1, sms // 2), sms * 3 // 4, sms, 2 * sms})


def l2_configurations(sms: int) -> list[tuple[int, int, int]]:
    """(blocks, stages, tile bytes) to stream from L2: the same blocks and four per SM (the intake grows with
    the warps on an SM: L2's own peak is reached only with many), with 32 and 64 KB in flight, enough that
    L2's latency (a few hundred ns) does not bind before an SM's intake does."""
    return [(b, s, t) for b in [*block_counts(sms), 4 * sms] for s, t in ((3, 16384), (9, 8192))]


def thread_configurations(sms: int) -> list[tuple[int, int, int, int]]:
    """(blocks, stages, tile bytes, threads): an eighth of the SMs, one block on each with 128 KB in flight, of
    128 to 512 threads: whether one SM's intake grows with the warps copying into it (`intake.sm_intake`)."""
    return [(max(1, sms // 8), 9, 16384, threads) for threads in (128, 256, 512)]


def resident(point: Point, hardware: Hardware) -> int:
    """Blocks resident on a busy SM, as `cost.estimate` counts them (`launch.blocks_per_sm`, at most the blocks
    per SM launched)."""
    fit = max(1, blocks_per_sm(point.stages * point.tile, point.threads, 0, hardware))
    return min(fit, -(-point.blocks // hardware.sms))


def per_sm_flight(point: Point, hardware: Hardware) -> tuple[int, float]:
    """(busy SMs, bytes in flight per busy SM): the blocks resident on an SM each with their flight."""
    return min(point.blocks, hardware.sms), resident(point, hardware) * point.flight


def warps(point: Point, hardware: Hardware) -> float:
    """Warps resident on a busy SM."""
    return resident(point, hardware) * point.threads / 32


def model_gbs(point: Point, hardware: Hardware) -> float:
    busy, flight = per_sm_flight(point, hardware)
    return intake.reachable_bandwidth(hardware, busy, flight, warps(point, hardware)) / 1e9


def model_l2_gbs(point: Point, hardware: Hardware) -> float:
    return intake.reachable_l2_bandwidth(hardware, min(point.blocks, hardware.sms), warps(point, hardware)) / 1e9


def summarize(points: list[Point], hardware: Hardware, l2: list[Point] = (), threads: list[Point] = ()) -> dict:
    """What the measurements say of the model's memory constants:
    - peak_gbs: the most any configuration streamed (the model: bandwidth_gbs * BANDWIDTH_REACH);
    - fill_bytes_per_clock: the most one SM took in, over configurations with at most half the SMs busy, in
      bytes per clock at intake.CLOCK_GHZ (the model: `intake.sm_intake` of one block's warps);
    - latency_ns: busy * flight / bandwidth, the median over the configurations that stream under 60% of the
      peak and under 60% of that SM intake (where only the bytes in flight can bind; None when none does);
    - half_over_full: the most streamed with half the SMs over the most with all of them;
    from the `l2` points (a footprint that stays in L2), where given:
    - l2_peak_gbs: the most any configuration streamed (the model: l2_bandwidth_gbs);
    - l2_fill_bytes_per_clock: as fill_bytes_per_clock, with no device memory behind it to bind first;
    from the `threads` points (one block per SM, of more or fewer threads), where given:
    - warp_fill_bytes_per_clock: per block size, one SM's intake over its warps (the model:
      WARP_FILL_BYTES_PER_CLOCK while under SM_FILL_BYTES_PER_CLOCK)."""
    peak = max(p.gbs for p in points)
    half = [p for p in points if p.blocks <= hardware.sms // 2]
    fill = max((p.gbs / p.blocks for p in half), default=None)  # GB/s per SM
    bound = []
    for p in points:
        busy, flight = per_sm_flight(p, hardware)
        if p.gbs < 0.6 * peak and (fill is None or p.gbs / busy < 0.6 * fill):
            bound.append(busy * flight / p.gbs)  # bytes / (GB/s) = ns
    halves = [p.gbs for p in points if p.blocks == hardware.sms // 2]
    fulls = [p.gbs for p in points if p.blocks == hardware.sms]
    summary = {"peak_gbs": round(peak, 1),
               "fill_bytes_per_clock": round(fill / intake.CLOCK_GHZ, 1) if fill is not None else None,
               "latency_ns": round(statistics.median(bound), 1) if bound else None,
               "half_over_full": round(max(halves) / max(fulls), 3) if halves and fulls else None}
    if l2:
        l2_fill = max((p.gbs / p.blocks for p in l2 if p.blocks <= hardware.sms // 2), default=None)
        summary |= {"l2_peak_gbs": round(max(p.gbs for p in l2), 1),
                    "l2_fill_bytes_per_clock": round(l2_fill / intake.CLOCK_GHZ, 1) if l2_fill is not None else None}
    if threads:
        summary["warp_fill_bytes_per_clock"] = {p.threads: round(p.gbs / p.blocks / intake.CLOCK_GHZ / (p.threads / 32), 2)
                                                for p in threads}
    return summary


def report(points: list[Point], launch: dict, chase: dict, hardware: Hardware, device: str,
           l2: list[Point] = (), threads: list[Point] = ()) -> str:
    """The tables and the summary as markdown."""
    lines = [f"# Probes on {device} (hardware file: {hardware.name})", "", *_table(points, model_gbs, hardware)]
    if l2:
        lines += ["", f"From L2 ({L2_FOOTPRINT >> 20} MB streamed over and over, {L2_READ >> 20} MB per block):", "",
                  *_table(l2, model_l2_gbs, hardware)]
    if threads:
        lines += ["", "From device memory, one block per SM of more threads:", "", *_table(threads, model_gbs, hardware)]
    s = summarize(points, hardware, l2, threads)
    model_fill = (f"{intake.sm_intake(THREADS / 32):.1f} ({THREADS // 32} warps x WARP_FILL_BYTES_PER_CLOCK "
                  f"{intake.WARP_FILL_BYTES_PER_CLOCK}, at most SM_FILL_BYTES_PER_CLOCK {intake.SM_FILL_BYTES_PER_CLOCK})")
    lines += ["", "| figure | measured | the model's |", "|---|---|---|",
              f"| streaming peak (GB/s) | {s['peak_gbs']} | {hardware.bandwidth_gbs * intake.BANDWIDTH_REACH:.0f} "
              f"(bandwidth_gbs {hardware.bandwidth_gbs:.0f} x BANDWIDTH_REACH {intake.BANDWIDTH_REACH}) |",
              f"| one SM's intake, at most half the SMs busy (bytes/clock at {intake.CLOCK_GHZ} GHz) | "
              f"{s['fill_bytes_per_clock']} | {model_fill} |",
              f"| latency where the bytes in flight bind (ns) | {s['latency_ns']} | {hardware.dram_latency_ns} "
              f"(dram_latency_ns) |",
              f"| half the SMs over all of them, at best | {s['half_over_full']} | "
              f"{model_half_over_full(hardware):.3f} |",
              *([f"| streaming from L2, peak (GB/s) | {s['l2_peak_gbs']} | {hardware.l2_bandwidth_gbs:.0f} "
                 f"(l2_bandwidth_gbs) |",
                 f"| one SM's intake from L2, at most half the SMs busy (bytes/clock) | "
                 f"{s['l2_fill_bytes_per_clock']} | {model_fill} |"] if l2 else []),
              *([f"| one SM's intake per warp, one block of {n} threads on it (bytes/clock) | {fill} | "
                 f"{min(intake.WARP_FILL_BYTES_PER_CLOCK, intake.SM_FILL_BYTES_PER_CLOCK / (n / 32)):.2f} |"
                 for n, fill in s.get("warp_fill_bytes_per_clock", {}).items()]),
              f"| one load's latency from device memory, unloaded (ns) | {chase['dram_ns']:.0f} | |",
              f"| one load's latency from L2 (ns) | {chase['l2_ns']:.0f} | |",
              f"| a launch timed alone (us) | {launch['alone_us']:.2f} | {hardware.launch_overhead_us} "
              f"(launch_overhead_us) |",
              f"| a launch among launches back to back (us) | {launch['back_to_back_us']:.2f} | |"]
    return "\n".join(lines)


def _table(points: list[Point], model, hardware: Hardware) -> list[str]:
    lines = ["| blocks | stages x tile | in flight per block | measured GB/s | model GB/s | measured / model |",
             "|---|---|---|---|---|---|"]
    for p in points:
        m = model(p, hardware)
        blocks = p.blocks if p.threads == THREADS else f"{p.blocks} of {p.threads} threads"
        lines.append(f"| {blocks} | {p.stages} x {p.tile // 1024} KB | {p.flight // 1024} KB | {p.gbs:.0f} | {m:.0f} "
                     f"| {p.gbs / m:.2f} |")
    return lines


def model_half_over_full(hardware: Hardware) -> float:
    """The model's best figure with half the SMs busy over its best with all of them, over the configurations."""
    def best(blocks):
        return max(model_gbs(Point(b, s, t, 0.0), hardware) for b, s, t in configurations(hardware.sms) if b == blocks)
    return best(hardware.sms // 2) / best(hardware.sms)


# -- on the GPU ------------------------------------------------------------------------------------------------

def _events(drv, module, launch, repeat: int, before=lambda: None) -> list[float]:
    """Milliseconds of `launch()` between two events, `repeat` times, after one warm-up: the GPU's own, with
    `probe_spin` queued ahead of the start event until the host has queued all of `launch()` before the GPU
    gets there (`cuda_runtime.Ahead`). `before()` is queued ahead of the spin, outside the interval."""
    spin = module.get_function("probe_spin")
    spin.prepare("q")
    before()
    spin.prepared_call((1, 1, 1), (1, 1, 1), 0)  # loaded now, not in the first sample
    launch()
    lead, start, end = drv.Event(), drv.Event(), drv.Event()
    ahead, times = Ahead(), []

    def queue(cycles: int) -> None:
        lead.record()
        before()
        spin.prepared_call((1, 1, 1), (1, 1, 1), cycles)
        start.record()
        launch()
        end.record()

    def lead_ms() -> float:
        end.synchronize()
        return lead.time_till(start)

    for _ in range(repeat):
        ahead.sample(queue, lead_ms)
        times.append(start.time_till(end))
    if ahead.behind:
        print("warning: the host could not queue a probe's launches ahead of the GPU; its times include the "
              "host's", file=sys.stderr)
    return times


def probe_launch(drv, module) -> dict:
    empty = module.get_function("probe_empty")
    empty.prepare("")
    alone = statistics.median(_events(drv, module, lambda: empty.prepared_call((1, 1, 1), (32, 1, 1)), 200))
    many = 200  # well within the launches a stream holds queued before the host must wait
    batch = statistics.median(_events(drv, module, lambda: [empty.prepared_call((1, 1, 1), (32, 1, 1))
                                                            for _ in range(many)], 5))
    return {"alone_us": alone * 1e3, "back_to_back_us": batch * 1e3 / many}


def probe_chase(drv, module, footprint: int, steps: int, seed: int = 0) -> float:
    """Nanoseconds per dependent load over a random cycle through `footprint` bytes (one link per SLOT)."""
    slots = footprint // SLOT
    order = np.random.default_rng(seed).permutation(slots).astype(np.uint32)
    chain = np.zeros(slots * (SLOT // 4), np.uint32)
    chain[order * (SLOT // 4)] = np.roll(order, -1)
    chase = module.get_function("probe_chase")
    chase.prepare("PIIqP")
    device, sink = drv.to_device(chain), drv.mem_alloc(4)
    times = _events(drv, module, lambda: chase.prepared_call((1, 1, 1), (1, 1, 1), int(device), SLOT // 4, int(order[0]),
                                                     steps, int(sink)), 3)
    end = np.zeros(1, np.uint32)
    drv.memcpy_dtoh(end, sink)
    if int(end[0]) != int(order[steps % slots]):
        raise RuntimeError(f"the chase through {footprint} bytes ended at slot {end[0]}, not {order[steps % slots]}")
    device.free()
    sink.free()
    return statistics.median(times) * 1e6 / steps


def block_xors(words: np.ndarray, blocks: int, start: int, count: int, wrap: int) -> np.ndarray:
    """The XOR of words [b * start, b * start + count) modulo `wrap` of `words`, for every block b (at most one
    wrap)."""
    prefix = np.concatenate([[0], np.bitwise_xor.accumulate(words[:wrap])]).astype(np.uint32)
    first = np.arange(blocks, dtype=np.int64) * start % wrap
    end = first + count
    inside = prefix[np.minimum(end, wrap)] ^ prefix[first]
    return np.where(end > wrap, inside ^ prefix[np.maximum(end - wrap, 0)], inside)


def probe_stream(drv, module, sms: int, smem_optin: int, l2: bool = False, threads: bool = False) -> list[Point]:
    """GB/s for each configuration: from device memory (each block its own stretch of STREAM_BYTES), or with
    `l2` from L2 (stretches of L2_FOOTPRINT, L2_READ bytes per block, spread over it); with `threads` the
    configurations of more threads per block."""
    words = np.random.default_rng(1).integers(0, 2**32, (L2_FOOTPRINT if l2 else STREAM_BYTES) // 4, dtype=np.uint32)
    src = drv.to_device(words)
    points = []
    chosen = (thread_configurations(sms) if threads else
              [(*c, THREADS) for c in (l2_configurations if l2 else configurations)(sms)])
    for blocks, stages, tile, block_threads in chosen:
        if stages * tile > smem_optin:
            continue
        fn = module.get_function(f"probe_stream_{stages}")
        fn.prepare("PqiqqP")
        if stages * tile > 48 * 1024:
            fn.set_attribute(drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, stages * tile)
        tiles = L2_READ // tile if l2 else STREAM_BYTES // (blocks * tile)
        step = L2_FOOTPRINT // blocks // tile * tile if l2 else tiles * tile  # bytes between blocks' first tiles
        wrap = L2_FOOTPRINT if l2 else STREAM_BYTES
        out = drv.mem_alloc(4 * blocks)

        def before():  # the XORs zeroed
            drv.memset_d32_async(out, 0, blocks)

        def launch():
            fn.prepared_call((blocks, 1, 1), (block_threads, 1, 1), int(src), tiles, tile // 16, step // 16, wrap // 16,
                             int(out), shared_size=stages * tile)

        times = _events(drv, module, launch, 5, before)
        got = np.zeros(blocks, np.uint32)
        drv.memcpy_dtoh(got, out)
        out.free()
        want = (block_xors(words, blocks, step // 4, tiles * tile // 4, wrap // 4) if l2 else
                np.bitwise_xor.reduce(words[:blocks * tiles * tile // 4].reshape(blocks, -1), axis=1))
        if not np.array_equal(got, want):
            raise RuntimeError(f"the streaming kernel ({blocks} blocks, {stages} x {tile} bytes"
                               f"{', from L2' if l2 else ''}) did not read every "
                               f"byte: {int((got != want).sum())} of {blocks} blocks' XORs differ from the host's")
        points.append(Point(blocks, stages, tile, blocks * tiles * tile / (statistics.median(times) * 1e-3) / 1e9,
                            block_threads))
    src.free()
    return points


def probe_strips(drv, module) -> list[Strip]:
    """GB/s of `probe_strips` at each strip width, every byte of STRIP_ROWS rows read once."""
    words = np.random.default_rng(2).integers(0, 2**32, STRIP_ROWS * STRIP_ROW // 4, dtype=np.uint32)
    src = drv.to_device(words)
    fn = module.get_function("probe_strips")
    fn.prepare("PiiiiP")
    found = []
    for width in STRIP_WIDTHS:
        strips, ranges, rows, tile_rows = strip_layout(width)
        blocks = strips * ranges
        out = drv.mem_alloc(4 * blocks)

        def before():
            drv.memset_d32_async(out, 0, blocks)

        def launch():
            fn.prepared_call((blocks, 1, 1), (THREADS, 1, 1), int(src), STRIP_ROW // 16, width // 16, rows, tile_rows,
                             int(out), shared_size=3 * STRIP_TILE)

        times = _events(drv, module, launch, 5, before)
        got = np.zeros(blocks, np.uint32)
        drv.memcpy_dtoh(got, out)
        out.free()
        if not np.array_equal(got, strip_xors(words, width)):
            raise RuntimeError(f"the strip kernel ({width} bytes a row) did not read every byte")
        found.append(Strip(width, blocks, blocks * rows * width / (statistics.median(times) * 1e-3) / 1e9))
    src.free()
    return found


def strip_table(strips: list[Strip]) -> list[str]:
    widest = max(strips, key=lambda p: p.width)
    lines = [f"Strips of {STRIP_ROW // 1024} KB rows (a d = 4096 projection's weights), {STRIP_TILE // 1024} KB tiles in "
             f"3 stages, {THREADS} threads a block, every byte read once:", "",
             "| bytes of each row a block reads | blocks | measured GB/s | over the widest |", "|---|---|---|---|"]
    lines += [f"| {p.width} | {p.blocks} | {p.gbs:.0f} | {p.gbs / widest.gbs:.2f} |" for p in strips]
    return lines


def run(keep=lambda measured: None) -> tuple[list[Point], list[Point], list[Point], list[Strip], dict, dict, str]:
    """Every probe, in turn; `keep` is given what has been measured so far after each (a step cut short by its time
    limit keeps those)."""
    import pycuda.driver as drv
    from pycuda.compiler import SourceModule

    drv.init()
    dev = drv.Device(0)
    context = dev.retain_primary_context()
    context.push()
    try:
        module = SourceModule(SOURCE.read_text(), no_extern_c=True, options=NVCC_OPTIONS, include_dirs=[str(HEADERS)],
                              **device_target(dev.compute_capability()))
        sms = dev.get_attribute(drv.device_attribute.MULTIPROCESSOR_COUNT)
        optin = dev.get_attribute(drv.device_attribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        major, minor = dev.compute_capability()
        device = f"{dev.name()}, {sms} SMs, sm_{major}{minor}, driver {drv.get_driver_version()}"
        measured = {"device": device}
        steps = [("launch", lambda: probe_launch(drv, module)),
                 ("chase", lambda: {"l2_ns": probe_chase(drv, module, 8 << 20, 100_000),
                                    "dram_ns": probe_chase(drv, module, 1 << 30, 100_000)}),
                 ("stream", lambda: probe_stream(drv, module, sms, optin)),
                 ("l2_stream", lambda: probe_stream(drv, module, sms, optin, l2=True)),
                 ("thread_stream", lambda: probe_stream(drv, module, sms, optin, threads=True)),
                 ("strips", lambda: probe_strips(drv, module))]
        for name, measure in steps:
            measured[name] = measure()
            print(f"measured: {name}", file=sys.stderr, flush=True)
            keep(measured)
        return (measured["stream"], measured["l2_stream"], measured["thread_stream"], measured["strips"],
                measured["launch"], measured["chase"], device)
    finally:
        drv.Context.pop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hardware", choices=hardware_names(), help="the hardware file whose figures to compare "
                        "with (default: the one the device's name names, else h100)")
    parser.add_argument("--json", help="also write every measurement to this file (rewritten as each part is "
                        "measured, so that a run cut short keeps what it measured; the summary at the end)")
    args = parser.parse_args()
    from prism_dsl.backend.cuda_runtime import gpu_status

    ok, name_or_reason = gpu_status()  # the device's name, or why none is usable
    if not ok:
        print(f"gpu_probe.py needs a usable CUDA GPU: {name_or_reason}", file=sys.stderr)
        return 1
    hardware = load_hardware(args.hardware or for_device(name_or_reason) or "h100")
    def keep(measured: dict) -> None:  # what is measured so far, as the whole file will hold it
        if args.json:
            text = json.dumps({k: [asdict(p) for p in v] if isinstance(v, list) else v for k, v in measured.items()},
                              indent=2) + "\n"
            Path(args.json + ".new").write_text(text)
            Path(args.json + ".new").replace(args.json)
    points, l2, threads, strips, launch, chase, device = run(keep)
    print(report(points, launch, chase, hardware, device, l2, threads))
    print("\n" + "\n".join(strip_table(strips)))
    if args.json:  # the whole, with the summary
        Path(args.json).write_text(json.dumps({"device": device, "launch": launch, "chase": chase,
                                               "stream": [asdict(p) for p in points],
                                               "l2_stream": [asdict(p) for p in l2],
                                               "thread_stream": [asdict(p) for p in threads],
                                               "strips": [asdict(p) for p in strips],
                                               "summary": summarize(points, hardware, l2, threads)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
