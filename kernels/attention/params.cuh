// ferroattn — attention forward kernel parameters.
//
// The one struct every attention-forward kernel takes, by value, as its only kernel
// parameter. Its layout is mirrored exactly by `AttnFwdParams` in src/ops/attention.rs
// (#[repr(C)]); change both together (a Rust unit test checks size and offsets).
//
// Layouts (flash_attn convention, sequence before heads):
//   padded:  q (b, s_q, h, d), k/v (b, s_k, h_k, d), o like q, lse (b, h, s_q) fp32
//   varlen:  q (total_q, h, d), k/v (total_k, h_k, d), o like q, lse (h, total_q) fp32,
//            sequence i occupies rows [cu_seqlens_q[i], cu_seqlens_q[i+1]) of q.
// Strides are in elements; the last dim of every tensor has stride 1.
// All strides and offsets are 64-bit: an index may pass 2^31.
// softmax_scale_log2 is raw_scale * log2(e): the factor of the raw scores inside exp2 (the
// softcap variant moves the scale inside tanh, attention/variant.cuh); softmax_scale stays the
// caller's scale (the backward's dQ and dK factor).
#pragma once

struct AttnFwdParams {
    const void* __restrict__ q;
    const void* __restrict__ k;
    const void* __restrict__ v;
    void* __restrict__ o;
    float* __restrict__ lse;
    const int* __restrict__ cu_seqlens_q;   // nullptr unless varlen, else (batch + 1,) int32
    const int* __restrict__ cu_seqlens_k;   // nullptr unless varlen, else (batch + 1,) int32

    long long q_batch_stride, q_row_stride, q_head_stride;   // batch stride unused in varlen
    long long k_batch_stride, k_row_stride, k_head_stride;
    long long v_batch_stride, v_row_stride, v_head_stride;
    long long o_batch_stride, o_row_stride, o_head_stride;
    long long lse_batch_stride, lse_head_stride;              // lse row stride is 1; varlen: batch offset = cu_seqlens_q[b]

    int batch;
    int num_heads;       // h (query heads)
    int num_heads_k;     // h_k; query head i reads kv head i / (h / h_k)
    int head_dim;        // actual head dim (multiple of 8, <= template HeadDim); columns beyond it are masked
    int seqlen_q;        // padded: s_q; varlen: max_seqlen_q (grid size only)
    int seqlen_k;        // padded: s_k; varlen: max_seqlen_k
    float softmax_scale;        // applied to q·k
    float softmax_scale_log2;   // softmax_scale * log2(e), for exp2
    int total_q;         // varlen: rows of q/o (cu_seqlens_q values are clamped to [0, total_q])
    int total_k;         // varlen: rows of k/v (cu_seqlens_k values are clamped to [0, total_k])

    // The run-time part of the variant (attention/variant.cuh); unused fields are 0 / nullptr.
    const float* __restrict__ alibi_slopes;   // ALiBi: (b, h) or (h,) fp32, row stride alibi_batch_stride
    const float* __restrict__ sinks;          // sinks: (h,) fp32 logits
    int window_left;     // local: row i sees keys >= i + diag - window_left (unbounded: >= every length)
    int window_right;    // local: row i sees keys <= i + diag + window_right (unbounded: likewise)
    float softcap;       // softcap c > 0
    float softcap_in;    // softmax_scale / c
    float raw_scale;     // softmax_scale, or 1 with softcap: LSE = max_raw * raw_scale + log(sum)
    float raw_scale_inv; // 1 / raw_scale: ALiBi slopes and sinks into raw score units
    int alibi_batch_stride;   // h for (b, h) slopes, 0 for (h,)
    unsigned dropout_threshold;   // dropout: an element is dropped iff its random byte < this (round(256 p), <= 255)
    const unsigned long long* __restrict__ rng_state;   // dropout: the Philox key (one 64-bit word)
    void* __restrict__ s_dmask;       // dropout, returned softmax: (b, h, s_dmask_rows, s_dmask_cols), q's dtype
    float* __restrict__ s_dmask_max;  // its running row max per 16 keys: (b, h, s_dmask_rows, s_dmask_cols / 16)
    float dropout_scale;              // 1 / (1 - p)
    int s_dmask_rows;
    int s_dmask_cols;
    int dropout_batch0;   // dropout: the first batch index of this launch (a batch split over launches)
};
