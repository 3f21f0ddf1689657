// ferroattn — attention backward, elementwise kernels (preprocess and dQ conversion).
//
// What:
//   attn_bwd_preprocess   softmax_d[i] = sum_{c < head_dim} float(dout[i, c]) * float(out[i, c])
//                         for every query row i (FlashAttention-2 paper §3.2: D_i = rowsum(dO∘O),
//                         the term dS = P∘(dP − D) subtracts), fp32; and, when
//                         params.dq_accum != nullptr, dq_accum[i, head, 0..head_dim) = 0 (the
//                         dK/dV kernel then adds dS·K into it with atomics).
//   attn_bwd_convert_dq   dq[i, head, c] = T(softmax_scale * dq_accum[i, head, c]) for c < head_dim
//                         (round to nearest even), the default path's last step; Tiled (default
//                         false): dq_accum in the tile layout of the sm90 backward's DqTiled
//                         (bwd_sm90.cuh), read back through a shared-memory tile.
// Layouts (attention/bwd_params.cuh, attention/params.cuh): dout/out/dq like q (padded
// (b, s_q, h, d), varlen (total_q, h, d)), each with its own strides; softmax_d has lse's shape
// and strides (fwd.lse_batch_stride / lse_head_stride, row stride 1; varlen: row offset
// cu_seqlens_q[b]); dq_accum fp32 (b, s_q, h, ≥ head_dim) / (total_q, h, ≥ head_dim), strides
// dqa_*. cu_seqlens values are clamped as in the forward (attn_detail::seq_coords). Strides in
// elements, last dim contiguous, 64-bit offsets. Vector access: dout/out/dq row, head and batch
// strides and base pointers 16-byte aligned (multiples of 8 elements), dq_accum's likewise
// (multiples of 4 floats).
//
// Launch: grid (ceil(seqlen_q / BlockM), num_heads, batch) (seqlen_q = max_seqlen_q for
// varlen), block 256 threads (8 warps), no dynamic shared memory.
//
// Template parameters and constraints:
//   HeadDim  kernel head dim, multiple of 32 in [32, 256]; params.fwd.head_dim (multiple of 8,
//            <= HeadDim) is the real one: columns beyond it are neither read nor written.
//   BlockM   query rows per block, a multiple of 64.
//   T        __half or __nv_bfloat16 (dout, out, dq).
// Work split: preprocess gives each row 4 consecutive threads; thread q of a row reads the
// 16-byte chunks q, q+4, q+8, ... of dout and out (all loads issued before the first use),
// and the 4 partial sums meet through two shuffles. Convert gives consecutive threads
// consecutive 8-column chunks of a row (two 16-byte fp32 loads, one 16-byte store). The sums
// are in a fixed order: both kernels are deterministic.
//
// PTX features: plain 16-byte global loads/stores, shfl.sync. Any sm_80+ target.
#pragma once
#include "common/dtype.cuh"
#include "common/ptx.cuh"
#include "attention/bwd_params.cuh"
#include "attention/bwd_common.cuh"

namespace ferroattn {

namespace attn_bwd_detail {

// The rows of one elementwise block: block (blockIdx.x, head blockIdx.y, batch blockIdx.z) covers query rows [m_start, m_start + rows_q) of its sequence.
struct RowBlock {
    attn_detail::SeqCoords sc;
    BwdQueryOffsets bo;
    int m_start, rows_q;
};

// Fills rb; false when the block starts past the end of its sequence (nothing to do).
template <int HeadDim, int BlockM, typename T>
__device__ __forceinline__ bool row_block(const AttnBwdParams& params, RowBlock& rb) {
    static_assert(HeadDim % 32 == 0 && HeadDim >= 32 && HeadDim <= 256,
                  "HeadDim must be a multiple of 32 in [32, 256]");
    static_assert(BlockM % 64 == 0, "BlockM must be a multiple of 64");
    static_assert(sizeof(T) == 2, "T must be __half or __nv_bfloat16");
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    rb.sc = attn_detail::seq_coords(params.fwd, head, batch);
    rb.m_start = blockIdx.x * BlockM;
    if (rb.m_start >= rb.sc.seqlen_q) return false;
    rb.rows_q = min(rb.sc.seqlen_q - rb.m_start, BlockM);
    rb.bo = bwd_query_offsets(params, head, batch);
    return true;
}

// attn_bwd_convert_dq's Tiled form: dq_accum in the sm90 backward's tile layout (bwd_sm90.cuh,
// DqTiled: per 64-row tile HeadDim / 64 chunks of 4096 fp32 in wgmma accumulator order), gacc at
// the block's first tile. Per 64 x 64 chunk: coalesced 16-byte loads of the accumulator order,
// each float4 scaled and packed to two 4-byte pairs of a bf16/fp16 shared tile in row order (rows
// of 72 elements: a warp's stores hit 32 different banks), then 16-byte row stores to dq.
template <int HeadDim, int BlockM, typename T>
__device__ __forceinline__ void convert_dq_tiled(const float* gacc, T* gdq, long long dq_row_stride, int rows_q,
                                                 int head_dim, float scale) {
    using Tr = DTypeTraits<T>;
    constexpr int kThreads = 256;
    constexpr int kRow = 72;   // elements per shared row (64 + 8 of padding)
    static_assert(HeadDim % 64 == 0 && BlockM % 64 == 0, "whole 64 x 64 chunks");
    __shared__ __align__(16) T tile[64 * kRow];
    const int tid = threadIdx.x;
#pragma unroll 1
    for (int m = 0; m < BlockM / 64; ++m)
#pragma unroll 1
        for (int c = 0; c < HeadDim / 64; ++c) {
            const float4* src = reinterpret_cast<const float4*>(gacc + (static_cast<long long>(m) * (HeadDim / 64) + c) * 4096);
            float4 x[1024 / kThreads];
#pragma unroll
            for (int i = 0; i < 1024 / kThreads; ++i) x[i] = src[tid + i * kThreads];
            if (m + c > 0) __syncthreads();   // the previous chunk's rows are read
#pragma unroll
            for (int i = 0; i < 1024 / kThreads; ++i) {
                const int q = tid + i * kThreads;   // float4 j = q / 128 of accumulator thread q % 128
                const int j = q / 128, at = q % 128;
                const int row = (at / 32) * 16 + (at % 32) / 4, col = 8 * j + 2 * (at % 4);
                *reinterpret_cast<unsigned*>(tile + row * kRow + col) = Tr::pack2(scale * x[i].x, scale * x[i].y);
                *reinterpret_cast<unsigned*>(tile + (row + 8) * kRow + col) = Tr::pack2(scale * x[i].z, scale * x[i].w);
            }
            __syncthreads();
#pragma unroll
            for (int i = 0; i < 512 / kThreads; ++i) {
                const int idx = tid + i * kThreads;
                const int r = idx / 8, cc = idx % 8;
                const int row = 64 * m + r, col = 64 * c + 8 * cc;
                if (row < rows_q && col < head_dim)
                    *reinterpret_cast<uint4*>(gdq + static_cast<long long>(row) * dq_row_stride + col) =
                        *reinterpret_cast<const uint4*>(tile + r * kRow + 8 * cc);
            }
        }
}

}  // namespace attn_bwd_detail

template <int HeadDim, int BlockM, typename T>
__global__ void __launch_bounds__(256) attn_bwd_preprocess(const AttnBwdParams params) {
    constexpr int kThreads = 256;
    constexpr int kLanesPerRow = 4;
    constexpr int kRowsPerPass = kThreads / kLanesPerRow;   // 64
    constexpr int kChunks = HeadDim / 8;                    // 16-byte chunks per row
    constexpr int kPerLane = kChunks / kLanesPerRow;        // HeadDim % 32 == 0: exact

    const int tid = threadIdx.x;
    attn_bwd_detail::RowBlock rb;
    if (!attn_bwd_detail::row_block<HeadDim, BlockM, T>(params, rb)) return;
    const int m_start = rb.m_start, rows_q = rb.rows_q, head_dim = params.fwd.head_dim;
    const int quarter = tid % kLanesPerRow;

#pragma unroll
    for (int pass = 0; pass < BlockM / kRowsPerPass; ++pass) {
        const int r = pass * kRowsPerPass + tid / kLanesPerRow;
        const bool row_ok = r < rows_q;
        const long long row = m_start + r;
        const T* gdo = static_cast<const T*>(params.dout) + rb.bo.do_off + row * params.do_row_stride;
        const T* go = static_cast<const T*>(params.fwd.o) + rb.sc.o_off + row * params.fwd.o_row_stride;
        uint4 a[kPerLane], b[kPerLane];
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            const int c = quarter + i * kLanesPerRow;
            if (row_ok && c * 8 < head_dim) {
                a[i] = *reinterpret_cast<const uint4*>(gdo + c * 8);
                b[i] = *reinterpret_cast<const uint4*>(go + c * 8);
            } else {
                a[i] = make_uint4(0u, 0u, 0u, 0u);
                b[i] = make_uint4(0u, 0u, 0u, 0u);
            }
        }
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            const unsigned av[4] = {a[i].x, a[i].y, a[i].z, a[i].w};
            const unsigned bv[4] = {b[i].x, b[i].y, b[i].z, b[i].w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 x = attn_bwd_detail::unpack2<T>(av[e]);
                const float2 y = attn_bwd_detail::unpack2<T>(bv[e]);
                acc = fmaf(x.x, y.x, acc);
                acc = fmaf(x.y, y.y, acc);
            }
        }
        // The 4 threads of a row are consecutive lanes of one warp; every lane takes part.
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        acc += __shfl_xor_sync(0xffffffffu, acc, 2);
        if (row_ok && quarter == 0) params.softmax_d[rb.sc.lse_off + row] = acc;
        if (params.dq_accum != nullptr && row_ok) {
            float* gacc = params.dq_accum + rb.bo.dqa_off + row * params.dqa_row_stride;
#pragma unroll
            for (int i = 0; i < kPerLane; ++i) {
                const int c = quarter + i * kLanesPerRow;
                if (c * 8 < head_dim) {
                    reinterpret_cast<float4*>(gacc + c * 8)[0] = make_float4(0.f, 0.f, 0.f, 0.f);
                    reinterpret_cast<float4*>(gacc + c * 8)[1] = make_float4(0.f, 0.f, 0.f, 0.f);
                }
            }
        }
    }
}

template <int HeadDim, int BlockM, typename T, bool Tiled = false>
__global__ void __launch_bounds__(256) attn_bwd_convert_dq(const AttnBwdParams params) {
    constexpr int kThreads = 256;
    constexpr int kChunks = HeadDim / 8;
    constexpr int kTotal = BlockM * kChunks;
    static_assert(kTotal % kThreads == 0, "whole passes");
    using Tr = DTypeTraits<T>;

    const int tid = threadIdx.x;
    attn_bwd_detail::RowBlock rb;
    if (!attn_bwd_detail::row_block<HeadDim, BlockM, T>(params, rb)) return;
    const int m_start = rb.m_start, rows_q = rb.rows_q, head_dim = params.fwd.head_dim;
    const float scale = params.fwd.softmax_scale;
    const float* gacc = params.dq_accum + rb.bo.dqa_off + static_cast<long long>(m_start) * params.dqa_row_stride;
    T* gdq = static_cast<T*>(params.dq) + rb.bo.dq_off + static_cast<long long>(m_start) * params.dq_row_stride;
    if constexpr (Tiled) {
        attn_bwd_detail::convert_dq_tiled<HeadDim, BlockM, T>(gacc, gdq, params.dq_row_stride, rows_q, head_dim, scale);
    } else {
#pragma unroll
        for (int i = 0; i < kTotal / kThreads; ++i) {
            const int idx = tid + i * kThreads;
            const int r = idx / kChunks;
            const int c = idx % kChunks;
            if (r < rows_q && c * 8 < head_dim) {
                const float4* src = reinterpret_cast<const float4*>(
                    gacc + static_cast<long long>(r) * params.dqa_row_stride + c * 8);
                const float4 x0 = src[0];
                const float4 x1 = src[1];
                uint4 out;
                out.x = Tr::pack2(scale * x0.x, scale * x0.y);
                out.y = Tr::pack2(scale * x0.z, scale * x0.w);
                out.z = Tr::pack2(scale * x1.x, scale * x1.y);
                out.w = Tr::pack2(scale * x1.z, scale * x1.w);
                *reinterpret_cast<uint4*>(gdq + static_cast<long long>(r) * params.dq_row_stride + c * 8) = out;
            }
        }
    }
}

}  // namespace ferroattn
