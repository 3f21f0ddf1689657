// ferroattn — parameters of the split-KV attention forward over a key/value cache.
//
// The one struct `attn_fwd_kvcache_sm80` (attention/fwd_kvcache_sm80.cuh) and its combine kernel
// (attention/split_combine.cuh) take, by value. Mirrored exactly by `AttnKvcacheParams` in
// src/ops/attention/kvcache.rs (#[repr(C)]; a Rust unit test checks size and offsets).
//
// `base` is the ordinary forward's parameter block (attention/params.cuh), so every variant
// functor of attention/variant.cuh reads it unchanged. Its fields mean what they mean there, with:
//   q/o (b, s_q, h, d) padded or (total_q, h, d) varlen (base.cu_seqlens_q), lse (b, h, s_q) or
//     (h, total_q);
//   k/v the cache: contiguous (b_cache, s_cache, h_k, d), or paged (num_pages, page_size, h_k, d)
//     when block_table != nullptr, or a packed varlen (total_k, h_k, d) (base.cu_seqlens_k, not
//     paged); k_batch_stride is the stride of dim 0 (a cache row or a page);
//   base.seqlen_q: s_q (varlen: max_seqlen_q, the grid's size);
//   base.seqlen_k: the key length when neither seqlens_k nor cu_seqlens_k is given.
// Sequence b's keys (positions 0 .. len_b - 1 of the causal / window / ALiBi rules) are
//   len_b = seqlens_k[b] + seqlen_k_add − leftpad_k[b]   (seqlens_k given)
//         = cu_seqlens_k[b + 1] − cu_seqlens_k[b]         (varlen)
//         = base.seqlen_k                                  (otherwise)
// clamped so that no key lies outside the cache: the cache row (or the block table's pages) holds
// `cache_rows` keys. Key position j of sequence b is stored at
//   paged:      page block_table[b, j / page_size], row j % page_size
//   contiguous: cache row batch_idx[b] (or b), row leftpad_k[b] + j
//   varlen:     row cu_seqlens_k[b] + j of the packed tensor
// Page and cache-row indices read from device memory are clamped to [0, cache_batches).
// All strides in elements; 64-bit offsets everywhere.
#pragma once
#include "attention/params.cuh"

struct AttnKvcacheParams {
    AttnFwdParams base;
    const int* __restrict__ seqlens_k;     // (b,) int32 cache lengths before the append, or nullptr
    const int* __restrict__ leftpad_k;     // (b,) int32 first key row of each cache row, or nullptr
    const int* __restrict__ batch_idx;     // (b,) int32 cache row of each batch entry, or nullptr
    const int* __restrict__ block_table;   // (b, max_pages) int32 page indices, or nullptr
    float* __restrict__ o_accum;           // split partials (num_splits, b, h, s_q, d) fp32, or nullptr
    float* __restrict__ lse_accum;         // (num_splits, b, h, s_q) fp32 (natural log; −inf = empty)
    long long block_table_batch_stride;
    int seqlen_k_add;    // tokens appended before this attention (added to seqlens_k)
    int cache_rows;      // keys one sequence can hold: s_cache, max_pages * page_size, or total_k
    int cache_batches;   // cache rows (contiguous) or pages (paged): the range of device indices
    int page_size;       // paged: keys per page (any value >= 1)
    int num_splits;      // key splits per sequence (1: the kernel writes o / lse itself)
    int group;           // h / h_k: query heads per kv head, packed as rows of one block
};
