// TMA copies as the generated kernels make them (prism.cuh's mbarrier and tma_load, the maps the first parameters),
// for benchmarks/tma_probe.py: a [64, 64] box of a row-major f16 tensor [rows, cols] at (row0, col0) through the
// first map and the box below it through the second (a map of the same tensor) land in shared memory in the
// 128-byte swizzle, at one mbarrier, and the block writes them back unswizzled to `out` ([128, 64], row-major).
//
// Built as a program of its own (-DTMA_PROBE_MAIN) it is the reference way to do the same: the host encodes the map
// with cuTensorMapEncodeTiled and launches with <<<>>> (the runtime passes the map among the kernel's parameters by
// itself), or prints the map it encodes for a given address (`encode ADDRESS ROWS COLS`) so that the bytes can be
// set beside the runtime's own encoding (cuda_plan.encode_map).
#include "prism.cuh"

extern "C" __global__ void __launch_bounds__(128) tma_probe(const __grid_constant__ prism::TensorMap map,
                                                            const __grid_constant__ prism::TensorMap below,
                                                            half* out, int row0, int col0)
{
    extern __shared__ __align__(1024) unsigned char raw[];
    half* const box = reinterpret_cast<half*>(raw);  // 2 x 8 KB, at the start of dynamic shared memory
    uint64_t* const full = reinterpret_cast<uint64_t*>(raw + 16384);
    if (threadIdx.x == 0) {
        prism::mbarrier_init(full, 1);
        prism::mbarrier_init_fence();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        prism::mbarrier_expect_tx(full, 2 * 64 * 64 * 2);
        prism::tma_load(box, map, full, {col0, row0});  // innermost first
        prism::tma_load(box + 64 * 64, below, full, {col0, row0 + 64});
    }
    prism::mbarrier_wait(full, 0);
    for (int e = threadIdx.x; e < 128 * 64; e += blockDim.x) {
        const int r = e / 64, c = e % 64;
        out[e] = box[r * 64 + ((c / 8) ^ (r % 8)) * 8 + c % 8];  // the 128-byte swizzle's chunk of (r, c)
    }
}

#if defined(TMA_PROBE_MAIN)
#include <cuda.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

// The driver's encoder through the runtime, so that the program needs no link to libcuda.
using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                            const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                            CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static bool encode(CUtensorMap* map, void* at, unsigned long long rows, unsigned long long cols) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) != cudaSuccess
        || found != cudaDriverEntryPointSuccess) {
        std::printf("cuTensorMapEncodeTiled not found\n");
        return false;
    }
    cuuint64_t dims[2] = {cols, rows}, strides[1] = {cols * 2};
    cuuint32_t box[2] = {64, 64}, ones[2] = {1, 1};
    CUresult r = reinterpret_cast<Encode>(fn)(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, at, dims, strides, box, ones,
                                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                        CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) std::printf("cuTensorMapEncodeTiled: CUresult %d\n", int(r));
    return r == CUDA_SUCCESS;
}

static void print_map(const CUtensorMap& map) {
    const unsigned char* b = reinterpret_cast<const unsigned char*>(&map);
    for (int i = 0; i < 128; ++i) std::printf("%02x", b[i]);
    std::printf("\n");
}

int main(int argc, char** argv) {
    if (cudaFree(nullptr) != cudaSuccess) { std::printf("no CUDA device\n"); return 2; }
    if (argc == 5 && !std::strcmp(argv[1], "encode")) {  // encode ADDRESS ROWS COLS: the map's bytes, in hex
        alignas(64) CUtensorMap map;
        if (!encode(&map, reinterpret_cast<void*>(std::strtoull(argv[2], nullptr, 0)), std::strtoull(argv[3], nullptr, 0),
                    std::strtoull(argv[4], nullptr, 0))) return 1;
        print_map(map);
        return 0;
    }
    const int rows = 256, cols = 512, row0 = 64, col0 = 128;  // a box away from the origin in both dims
    std::vector<__half> host(rows * cols), got(128 * 64);
    for (int i = 0; i < rows * cols; ++i) host[i] = __float2half(float(i % 2039) / 2039.0f - 0.5f);
    __half *src, *out;
    cudaMalloc(&src, host.size() * 2);
    cudaMalloc(&out, got.size() * 2);
    cudaMemcpy(src, host.data(), host.size() * 2, cudaMemcpyHostToDevice);
    cudaMemset(out, 0xff, got.size() * 2);  // NaN: every element must be written
    alignas(64) CUtensorMap map;
    if (!encode(&map, src, rows, cols)) return 1;
    tma_probe<<<1, 128, 16384 + 64>>>(map, map, out, row0, col0);
    cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) { std::printf("kernel: %s\n", cudaGetErrorString(err)); return 1; }
    cudaMemcpy(got.data(), out, got.size() * 2, cudaMemcpyDeviceToHost);
    int wrong = 0;
    for (int r = 0; r < 128; ++r)
        for (int c = 0; c < 64; ++c)
            wrong += __half2float(got[r * 64 + c]) != __half2float(host[(row0 + r) * cols + col0 + c]);
    std::printf("%d of 8192 elements wrong\n", wrong);
    return wrong ? 1 : 0;
}
#endif
