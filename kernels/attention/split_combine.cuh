// ferroattn — merge of split-KV attention partials through their LSE.
//
// What: for every query row (batch b, head h, token i) with num_splits partials
// (O_s normalised, LSE_s natural log, −inf for a split that saw no key) written by
// attention/fwd_kvcache_sm80.cuh:
//   M = max_s LSE_s,  w_s = exp(LSE_s − M),  L = Σ_s w_s,
//   O = Σ_s (w_s / L) O_s,  LSE = M + log L,
// and a row no split saw gets O = 0 and LSE = +inf (FlashDecoding, Dao et al. 2023; the same
// rule as the kernels' online softmax).
//
// Layouts (attention/kvcache_params.cuh): o_accum (num_splits, b, h, s_q, d) fp32 and lse_accum
// (num_splits, b, h, s_q) fp32, contiguous (s_q = base.seqlen_q, in varlen the longest sequence;
// rows past a sequence's length are skipped); out and lse as the forward's (padded or varlen).
//
// Launch: grid (ceil(b * h * s_q / 4)), 128 threads (one warp per row), no shared memory.
// Template: T the output dtype (__half or __nv_bfloat16).
// PTX features: none beyond sm_80's.
#pragma once
#include "common/dtype.cuh"
#include "common/ptx.cuh"
#include "attention/kvcache_params.cuh"

namespace ferroattn {

template <typename T>
__global__ void __launch_bounds__(128) attn_split_combine(const AttnKvcacheParams kp) {
    using Tr = DTypeTraits<T>;
    const AttnFwdParams& p = kp.base;
    const int lane = threadIdx.x % 32;
    const long long row = static_cast<long long>(blockIdx.x) * 4 + threadIdx.x / 32;
    const long long rows = static_cast<long long>(p.batch) * p.num_heads * p.seqlen_q;
    if (row >= rows) return;
    const int qi = static_cast<int>(row % p.seqlen_q);
    const int head = static_cast<int>((row / p.seqlen_q) % p.num_heads);
    const int batch = static_cast<int>(row / (static_cast<long long>(p.seqlen_q) * p.num_heads));
    int q0 = 0;
    if (p.cu_seqlens_q != nullptr) {
        q0 = min(max(p.cu_seqlens_q[batch], 0), p.total_q);
        const int q1 = min(max(p.cu_seqlens_q[batch + 1], q0), p.total_q);
        if (qi >= q1 - q0) return;
    }
    const int splits = kp.num_splits;
    const long long split_rows = rows;   // rows of one split's partial
    float m = -FERROATTN_INF;
    for (int s = lane; s < splits; s += 32) m = fmaxf(m, kp.lse_accum[s * split_rows + row]);
#pragma unroll
    for (int o = 16; o >= 1; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float l = 0.f;
    if (m != -FERROATTN_INF) {
        for (int s = lane; s < splits; s += 32) l += __expf(kp.lse_accum[s * split_rows + row] - m);
    }
#pragma unroll
    for (int o = 16; o >= 1; o /= 2) l += __shfl_xor_sync(0xffffffffu, l, o);
    const bool empty = !(l > 0.f);
    const float inv_l = empty ? 0.f : 1.f / l;

    const long long o_off = (p.cu_seqlens_q != nullptr ? 0 : static_cast<long long>(batch) * p.o_batch_stride)
                          + static_cast<long long>(q0 + qi) * p.o_row_stride
                          + static_cast<long long>(head) * p.o_head_stride;
    T* out = static_cast<T*>(p.o) + o_off;
    const int d = p.head_dim;
    for (int c = lane * 4; c < d; c += 128) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        if (!empty) {
            for (int s = 0; s < splits; ++s) {
                const float lse_s = kp.lse_accum[s * split_rows + row];
                if (lse_s == -FERROATTN_INF) continue;   // an empty split's partial is not read
                const float w = __expf(lse_s - m) * inv_l;
                const float4 x = *reinterpret_cast<const float4*>(kp.o_accum + (s * split_rows + row) * d + c);
                acc.x = fmaf(w, x.x, acc.x);
                acc.y = fmaf(w, x.y, acc.y);
                acc.z = fmaf(w, x.z, acc.z);
                acc.w = fmaf(w, x.w, acc.w);
            }
        }
        *reinterpret_cast<uint2*>(out + c) = make_uint2(Tr::pack2(acc.x, acc.y), Tr::pack2(acc.z, acc.w));
    }
    if (lane == 0) {
        const long long off = p.cu_seqlens_q != nullptr
            ? static_cast<long long>(head) * p.lse_head_stride + q0 + qi
            : static_cast<long long>(batch) * p.lse_batch_stride + static_cast<long long>(head) * p.lse_head_stride + qi;
        p.lse[off] = empty ? FERROATTN_INF : m + logf(l);
    }
}

}  // namespace ferroattn
