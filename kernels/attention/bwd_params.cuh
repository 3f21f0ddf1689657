// ferroattn — attention backward kernel parameters.
//
// The one struct every attention-backward kernel (attention/bwd_prep.cuh,
// attention/bwd_dkdv_sm80.cuh, attention/bwd_dq_sm80.cuh) takes, by value, as its only kernel
// parameter. Its layout is mirrored exactly by `AttnBwdParams` in src/ops/attention_bwd.rs
// (#[repr(C)]); change both together (a Rust unit test checks size and offsets).
//
// `fwd` carries what the forward had: q, k, v, o (the forward's output, read here), lse (the
// forward's softmax_lse, natural log, read here; +inf for rows that saw no key), cu_seqlens,
// strides, sizes and the softmax scale. The backward adds:
//   dout       like o (its own strides), read
//   dq         like q (its own strides), written (deterministic path: by the dq kernel; default
//              path: by the convert kernel from dq_accum)
//   dk, dv     like k, v (their own strides), written; with GQA each kv head receives the sum
//              over its num_heads / num_heads_k query heads
//   softmax_d  fp32, lse's shape and strides (fwd.lse_batch_stride / lse_head_stride, row
//              stride 1): D_i = sum_d dout[i, d] * o[i, d] (FlashAttention-2 paper, §3.2 / Alg. 2)
//   dq_accum   fp32, padded (b, s_q, h, head_dim) / varlen (total_q, h, head_dim), strides below;
//              zeroed by the preprocess kernel, accumulated (atomics) by the dK/dV kernel in the
//              default (non-deterministic) path, converted to dq by the convert kernel.
//              nullptr on the deterministic path (the dq kernel writes dq directly).
// Layouts as in attention/params.cuh (padded / varlen, sequence before heads); strides in
// elements, last dim contiguous, 64-bit.
// Gradient formulas (FlashAttention-2 paper, §3.2): P = exp(scale·QKᵀ − LSE), dV = Pᵀ dO,
// dP = dO Vᵀ, dS = P ∘ (dP − D), dQ = scale · dS K, dK = scale · dSᵀ Q.
#pragma once
#include "attention/params.cuh"

struct AttnBwdParams {
    AttnFwdParams fwd;
    const void* __restrict__ dout;
    void* __restrict__ dq;
    void* __restrict__ dk;
    void* __restrict__ dv;
    float* __restrict__ softmax_d;
    float* __restrict__ dq_accum;   // nullptr on the deterministic path

    long long do_batch_stride, do_row_stride, do_head_stride;     // batch strides unused in varlen
    long long dq_batch_stride, dq_row_stride, dq_head_stride;
    long long dk_batch_stride, dk_row_stride, dk_head_stride;
    long long dv_batch_stride, dv_row_stride, dv_head_stride;
    long long dqa_batch_stride, dqa_row_stride, dqa_head_stride;  // dq_accum
};
