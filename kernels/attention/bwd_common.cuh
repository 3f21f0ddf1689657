// ferroattn — attention backward: helpers shared by the backward kernels.
//
// What: where the query-side backward tensors of one (batch, head) sequence start (dout, dq,
// dq_accum; softmax_d shares lse's offset, attn_detail::SeqCoords::lse_off), and a widening
// of two packed 16-bit values to fp32. The forward's attn_detail::seq_coords gives the
// sequence lengths and the q/k/v/o/lse offsets; bwd_query_offsets adds the others with the
// same cu_seqlens clamp, so no cu_seqlens value can move an access outside its tensor.
// Layouts: attention/bwd_params.cuh (padded: batch stride; varlen: row cu_seqlens_q[b] of a
// (total_q, h, d) tensor). Offsets in elements, 64-bit.
// Constraints: T is __half or __nv_bfloat16.
// PTX features: none beyond cvt (half/bf16 -> f32).
#pragma once
#include "common/dtype.cuh"
#include "attention/bwd_params.cuh"
#include "attention/fwd_sm80.cuh"

namespace ferroattn {
namespace attn_bwd_detail {

// Element offsets of row 0 of the (batch, head) slice of dout, dq and dq_accum.
struct BwdQueryOffsets {
    long long do_off, dq_off, dqa_off;
};

__device__ __forceinline__ BwdQueryOffsets bwd_query_offsets(const AttnBwdParams& p, int head,
                                                             int batch) {
    BwdQueryOffsets r;
    if (p.fwd.cu_seqlens_q != nullptr) {
        const long long q0 = attn_detail::seq_start(p.fwd.cu_seqlens_q, batch, p.fwd.total_q);
        r.do_off = q0 * p.do_row_stride;
        r.dq_off = q0 * p.dq_row_stride;
        r.dqa_off = q0 * p.dqa_row_stride;
    } else {
        r.do_off = static_cast<long long>(batch) * p.do_batch_stride;
        r.dq_off = static_cast<long long>(batch) * p.dq_batch_stride;
        r.dqa_off = static_cast<long long>(batch) * p.dqa_batch_stride;
    }
    r.do_off += static_cast<long long>(head) * p.do_head_stride;
    r.dq_off += static_cast<long long>(head) * p.dq_head_stride;
    r.dqa_off += static_cast<long long>(head) * p.dqa_head_stride;
    return r;
}

// The two 16-bit values of a 32-bit word (low half = lower column) as fp32.
template <typename T>
__device__ __forceinline__ float2 unpack2(unsigned u) {
    if constexpr (DTypeTraits<T>::kIsBF16) {
        return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
    } else {
        return __half22float2(*reinterpret_cast<const __half2*>(&u));
    }
}

}  // namespace attn_bwd_detail
}  // namespace ferroattn
