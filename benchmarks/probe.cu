// Probes of the memory system and the launch path, read by benchmarks/gpu_probe.py on a GPU. Each answers
// one of the cost model's assumptions (prism_dsl/backend/cost.py): what a launch costs, how long a load from
// device memory takes, what bandwidth B blocks reach with F bytes of copies in flight each, from device
// memory and from L2, and whether strips of a few bytes per row stream as fast as whole tiles.

#include "prism.cuh"  // the generated code's own copy primitives (templates/)

// Nothing: a launch's own cost.
extern "C" __global__ void probe_empty() {}

// Spins for `cycles` clocks. Queued just before a timed launch, it keeps the GPU busy while the host issues that
// launch, so the start event is recorded when the GPU gets to it and the host's time is not in the interval.
extern "C" __global__ void probe_spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
}

// One thread follows a chain of indices (next[i] is the next slot) for `steps` loads, each waiting on the
// one before: the load-to-use latency of wherever the chain lives (L2 for a small one, device memory for
// one far larger than L2). The chain's end goes to *sink, so nothing is left out, and the host checks it.
extern "C" __global__ void probe_chase(const unsigned* __restrict__ next, unsigned stride, unsigned start,
                                       long long steps, unsigned* sink) {
    unsigned at = start;
    for (long long i = 0; i < steps; ++i) {
        at = __ldcg(next + (size_t)at * stride);  // .cg: around L1, which would otherwise keep a small chain
    }
    *sink = at;
}

// A block streams `tiles` tiles of `tile16` 16-byte units, unit i of tile t at unit(t, i), through a ring of
// STAGES tiles in shared memory with cp.async (prism.cuh's, as the generated loops use it): STAGES - 1 tiles in
// flight while one is read. Each thread folds what it reads into an XOR, so every byte is used; the block's XOR
// goes to out[b], which the host compares with the XOR of the same bytes.
template <int STAGES, class Unit>
__device__ void stream_tiles(Unit unit, long long tiles, int tile16, unsigned* out) {
    extern __shared__ uint4 ring[];
    auto issue = [&](long long t) {
        uint4* slot = ring + (t % STAGES) * tile16;
        for (int i = threadIdx.x; i < tile16; i += blockDim.x) prism::cp_async<1>(slot + i, unit(t, i));
    };
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < tiles) issue(s);
        prism::cp_async_commit();
    }
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (long long t = 0; t < tiles; ++t) {
        prism::cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile t has landed for every thread, and every thread is done with tile t - 1
        if (t + STAGES - 1 < tiles) issue(t + STAGES - 1);  // into tile t - 1's slot
        prism::cp_async_commit();
        const uint4* slot = ring + (t % STAGES) * tile16;
        for (int i = threadIdx.x; i < tile16; i += blockDim.x) {
            uint4 v = slot[i];
            acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
        }
    }
    unsigned x = acc.x ^ acc.y ^ acc.z ^ acc.w;
    for (int o = 16; o > 0; o >>= 1) x ^= prism::shfl_xor(x, o);
    if ((threadIdx.x & 31) == 0) atomicXor(out + blockIdx.x, x);
}

// Block b streams `tiles` contiguous tiles from unit b * step16 onwards, wrapping around at unit wrap16: each
// block its own stretch of a buffer far larger than L2 (step16 = tiles * tile16, wrap16 the whole buffer), or
// stretches of one footprint that stays in L2 (wrap16 that footprint), so that L2, not device memory, serves
// every load.
template <int STAGES>
__device__ void stream(const uint4* __restrict__ src, long long tiles, int tile16, long long step16, long long wrap16,
                       unsigned* out) {
    const long long first = blockIdx.x * step16;
    stream_tiles<STAGES>([&](long long t, int i) { return src + (first + t * tile16) % wrap16 + i; },  // whole tiles
                         tiles, tile16, out);
}

// A decode projection's loop streams a block's columns of every row of its weights (rows a whole row apart, a
// few dozen bytes of each): block b streams the strip of `width16` units at column (b % strips) * width16 of a
// row-major matrix whose rows are `row16` units long (strips = row16 / width16), over `rows` rows from row
// (b / strips) * rows, `tile_rows` rows a tile, through a ring of 3 tiles: what bandwidth strips of 32 to 512
// bytes a row reach beside whole tiles.
extern "C" __global__ void probe_strips(const uint4* __restrict__ src, int row16, int width16, int rows, int tile_rows,
                                        unsigned* out) {
    const int strips = row16 / width16;
    const long long row0 = (long long)(blockIdx.x / strips) * rows, col0 = blockIdx.x % strips * width16;
    stream_tiles<3>([&](long long t, int i) { return src + (row0 + t * tile_rows + i / width16) * row16 + col0 + i % width16; },
                    rows / tile_rows, tile_rows * width16, out);
}

#define PROBE_STREAM(S) \
    extern "C" __global__ void probe_stream_##S(const uint4* src, long long tiles, int tile16, long long step16, \
                                                long long wrap16, unsigned* out) { \
        stream<S>(src, tiles, tile16, step16, wrap16, out); \
    }
PROBE_STREAM(2)
PROBE_STREAM(3)
PROBE_STREAM(4)
PROBE_STREAM(5)
PROBE_STREAM(9)
PROBE_STREAM(17)
