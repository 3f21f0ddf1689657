// ferroattn — the reduce step of split-k dense GEMM on the Hopper path (src/ops/gemm/sm90/splitk.rs).
//
// What: out = act(alpha * sum_s ws[s] + bias + beta * c), aux = the pre-activation value, for one
// (m, n) problem whose k was split into `splits` chunks; ws[s] (fp32, row-major (m, n) with row
// stride ws_row_stride elements, chunks ws_split_stride elements apart) holds the raw product of
// chunk s (written by gemm_sm90 with alpha 1, beta 0, no bias, no activation). The epilogue is the
// one of kernels/gemm/sm90.cuh `epilogue` in the same fp32 order (alpha * acc + bias, then
// + beta * c; aux before the activation; one rounding to TOut): the splits are summed in
// s = 0, 1, ... order, so the result is deterministic (run to run, independent of the grid).
//   out / aux: row-major TOut, row strides in elements (any, 64-bit); c: TOut, nullptr = no C term;
//   bias: (n,) float / __half / __nv_bfloat16 by bias_kind (0 = no bias).
// Work split: one thread per 4 adjacent columns of one row (ws read as float4: the host keeps
// ws_row_stride and ws_split_stride multiples of 4 and ws 16-byte aligned); columns >= n are
// never read or written. Grid-stride loop over m * ceil(n / 4) quads, 256 threads per block.
// Constraints: TOut = __half, __nv_bfloat16 or float; m, n, splits >= 1; m * ceil(n / 4) < 2^62.
// Cost: reads splits * m * n * 4 bytes of ws (+ c, bias), writes out (+ aux): memory-bound.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "common/activation.cuh"
#include "common/dtype.cuh"

namespace ferroattn {

// Kernel parameters (mirror: `GemmSplitkReduceParams` in src/ops/gemm/sm90/splitk.rs; change both).
struct GemmSplitkReduceParams {
    const float* ws;
    void* out;
    const void* c;     // nullptr: no C term
    const void* bias;  // nullptr: no bias
    void* aux;         // nullptr: no pre-activation output
    long long ws_row_stride;    // elements, multiple of 4
    long long ws_split_stride;  // elements, multiple of 4
    long long out_row_stride;
    long long c_row_stride;
    long long aux_row_stride;
    int m, n, splits;
    int bias_kind;  // 0: none, 1: float, 2: __half, 3: __nv_bfloat16
    float alpha, beta;
};

namespace splitk {

__device__ __forceinline__ float bias_at(const void* bias, int kind, int col) {
    switch (kind) {
        case 1: return __ldg(static_cast<const float*>(bias) + col);
        case 2: return to_float(static_cast<const __half*>(bias)[col]);
        case 3: return to_float(static_cast<const __nv_bfloat16*>(bias)[col]);
        default: return 0.0f;
    }
}

}  // namespace splitk

// grid = (min(ceil(m * ceil(n / 4) / 256), 65535 * 8)), block = 256, no shared memory.
template <typename TOut, int Act>
__global__ void __launch_bounds__(256) gemm_splitk_reduce(const __grid_constant__ GemmSplitkReduceParams p) {
    using namespace splitk;
    const long long quads_per_row = (p.n + 3) / 4;
    const long long total = static_cast<long long>(p.m) * quads_per_row;
    const TOut* c = static_cast<const TOut*>(p.c);
    TOut* out = static_cast<TOut*>(p.out);
    TOut* aux = static_cast<TOut*>(p.aux);
    for (long long q = blockIdx.x * 256ll + threadIdx.x; q < total; q += static_cast<long long>(gridDim.x) * 256) {
        const long long row = q / quads_per_row;
        const int col0 = static_cast<int>(q - row * quads_per_row) * 4;
        const float* w = p.ws + row * p.ws_row_stride + col0;
        float4 acc = __ldg(reinterpret_cast<const float4*>(w));
        for (int s = 1; s < p.splits; ++s) {
            const float4 v = __ldg(reinterpret_cast<const float4*>(w + s * p.ws_split_stride));
            acc.x += v.x;
            acc.y += v.y;
            acc.z += v.z;
            acc.w += v.w;
        }
        // One column at a time, each guarded (no early exit: a break inside the unrolled loop
        // made ptxas keep the four sums in local memory for the heavier activations).
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = col0 + e;
            if (col < p.n) {
                const float sum = e == 0 ? acc.x : e == 1 ? acc.y : e == 2 ? acc.z : acc.w;
                float v = p.alpha * sum + bias_at(p.bias, p.bias_kind, col);
                if (c != nullptr) v += p.beta * to_float(c[row * p.c_row_stride + col]);
                if (aux != nullptr) aux[row * p.aux_row_stride + col] = from_float<TOut>(v);
                out[row * p.out_row_stride + col] = from_float<TOut>(activate<Act>(v));
            }
        }
    }
}

}  // namespace ferroattn
