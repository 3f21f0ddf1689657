// ferroattn — append new keys/values to a KV cache, with rotary embedding of k and q.
//
// What (flash_attn 2's flash_attn_with_kvcache, reference/api-contracts.md §1.6):
//   k_cache[b, cache_seqlens[b] + t] = rotary(k_new[b, t], position cache_seqlens[b] + t)
//   v_cache[b, cache_seqlens[b] + t] = v_new[b, t]                        (t < s_new)
//   q_rot[b, i] = rotary(q[b, i], position cache_seqlens[b] + (per_token ? i : 0))
// where rotary(x, pos) rotates the first rotary_dim dims of x by the angles of row pos of cos/sin
// ((seqlen_ro, rotary_dim / 2), q's dtype): GPT-NeoX pairs (j, j + rotary_dim / 2) or, interleaved,
// GPT-J pairs (2j, 2j + 1): (x1, x2) -> (x1 cos − x2 sin, x2 cos + x1 sin), in fp32 with one
// rounding per product and sum as torch's eager reference (Su et al., "RoFormer", 2021). Without
// cos/sin the rows are copied. Cache position p of sequence b is page block_table[b, p / page_size]
// row p % page_size (paged) or cache row batch_idx[b] (or b), row p (contiguous). A position past
// the cache (p >= cache_rows) or a page / cache row index outside [0, cache_batches) is skipped:
// nothing is written outside k_cache / v_cache.
//
// Launch: grid (ceil(items / 4)), 128 threads, one warp per item; items = b * s_new * h_k key/value
// rows, then (with q_rot) b * s_q * h query rows. Template: T (__half or __nv_bfloat16).
// PTX features: none beyond sm_80's.
#pragma once
#include "common/dtype.cuh"

struct KvAppendParams {
    const void* __restrict__ k_new;     // (b, s_new, h_k, d)
    const void* __restrict__ v_new;
    void* __restrict__ k_cache;         // (b_cache, s_cache, h_k, d) or paged (num_pages, page_size, h_k, d)
    void* __restrict__ v_cache;
    const void* __restrict__ q;         // (b, s_q, h, d), read only with q_rot
    void* __restrict__ q_rot;           // (b, s_q, h, d) or nullptr (no rotary of q)
    const void* __restrict__ cos;       // (seqlen_ro, rotary_dim / 2) contiguous, or nullptr (no rotary)
    const void* __restrict__ sin;
    const int* __restrict__ seqlens;    // (b,) int32 cache_seqlens (before the append)
    const int* __restrict__ batch_idx;  // (b,) int32 or nullptr
    const int* __restrict__ block_table;// (b, max_pages) int32 or nullptr
    long long kn_batch_stride, kn_row_stride, kn_head_stride;
    long long vn_batch_stride, vn_row_stride, vn_head_stride;
    long long kc_batch_stride, kc_row_stride, kc_head_stride;   // batch stride: a cache row or a page
    long long vc_batch_stride, vc_row_stride, vc_head_stride;
    long long q_batch_stride, q_row_stride, q_head_stride;
    long long qr_batch_stride, qr_row_stride, qr_head_stride;
    long long block_table_batch_stride;
    int batch, s_new, heads_k, s_q, heads, head_dim;
    int rotary_dim;     // multiple of 16, <= head_dim (0: no rotary)
    int seqlen_ro;      // rows of cos / sin
    int interleaved;    // 1: pairs (2j, 2j + 1); 0: pairs (j, j + rotary_dim / 2)
    int q_per_token;    // 1: q token i at position cache_seqlens + i (causal / local); 0: all at cache_seqlens
    int cache_rows;     // positions one sequence can hold
    int cache_batches;  // cache rows or pages
    int page_size;
};

namespace ferroattn {
namespace kv_append_detail {

template <typename T, int N>
__device__ __forceinline__ void load_f(const T* src, float (&x)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = to_float(src[i]);
}

template <typename T>
__device__ __forceinline__ void store8(T* dst, const float (&x)[8]) {
    using Tr = DTypeTraits<T>;
    *reinterpret_cast<uint4*>(dst) = make_uint4(Tr::pack2(x[0], x[1]), Tr::pack2(x[2], x[3]),
                                                Tr::pack2(x[4], x[5]), Tr::pack2(x[6], x[7]));
}

// One row of head_dim elements from src to dst, rotated at position pos (rotary_dim 0: copied).
// The warp's lanes take 8-element chunks; a GPT-NeoX lane takes a chunk of each half.
template <typename T>
__device__ __forceinline__ void rotate_row(const KvAppendParams& p, const T* src, T* dst, int pos, int lane) {
    const int chunks = p.head_dim / 8;
    const int rd = p.rotary_dim;
    const int half_chunks = rd / 16;   // chunks in each half of the rotated dims (GPT-NeoX)
    const T* cs = static_cast<const T*>(p.cos) + static_cast<long long>(min(max(pos, 0), p.seqlen_ro - 1)) * (rd / 2);
    const T* sn = static_cast<const T*>(p.sin) + static_cast<long long>(min(max(pos, 0), p.seqlen_ro - 1)) * (rd / 2);
    for (int c = lane; c < chunks; c += 32) {
        if (c * 8 >= rd) {
            *reinterpret_cast<uint4*>(dst + c * 8) = *reinterpret_cast<const uint4*>(src + c * 8);
        } else if (p.interleaved) {
            float x[8], co[4], si[4], y[8];
            load_f(src + c * 8, x);
            load_f(cs + c * 4, co);
            load_f(sn + c * 4, si);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                y[2 * j] = __fsub_rn(__fmul_rn(x[2 * j], co[j]), __fmul_rn(x[2 * j + 1], si[j]));
                y[2 * j + 1] = __fadd_rn(__fmul_rn(x[2 * j + 1], co[j]), __fmul_rn(x[2 * j], si[j]));
            }
            store8(dst + c * 8, y);
        } else if (c < half_chunks) {
            float x1[8], x2[8], co[8], si[8], y1[8], y2[8];
            load_f(src + c * 8, x1);
            load_f(src + (c + half_chunks) * 8, x2);
            load_f(cs + c * 8, co);
            load_f(sn + c * 8, si);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                y1[j] = __fsub_rn(__fmul_rn(x1[j], co[j]), __fmul_rn(x2[j], si[j]));
                y2[j] = __fadd_rn(__fmul_rn(x2[j], co[j]), __fmul_rn(x1[j], si[j]));
            }
            store8(dst + c * 8, y1);
            store8(dst + (c + half_chunks) * 8, y2);
        }
        // GPT-NeoX chunks of the second half: written by their first-half lane
    }
}

template <typename T>
__device__ __forceinline__ void copy_row(const KvAppendParams& p, const T* src, T* dst, int lane) {
    for (int c = lane; c < p.head_dim / 8; c += 32)
        *reinterpret_cast<uint4*>(dst + c * 8) = *reinterpret_cast<const uint4*>(src + c * 8);
}

}  // namespace kv_append_detail

template <typename T>
__global__ void __launch_bounds__(128) attn_kv_append(const KvAppendParams p) {
    const int lane = threadIdx.x % 32;
    long long item = static_cast<long long>(blockIdx.x) * 4 + threadIdx.x / 32;
    const long long kv_items = static_cast<long long>(p.batch) * p.s_new * p.heads_k;
    const bool rotary = p.cos != nullptr && p.rotary_dim > 0;
    if (item < kv_items) {
        const int hk = static_cast<int>(item % p.heads_k);
        const int t = static_cast<int>((item / p.heads_k) % p.s_new);
        const int b = static_cast<int>(item / (static_cast<long long>(p.heads_k) * p.s_new));
        const int pos = p.seqlens[b] + t;
        if (pos < 0 || pos >= p.cache_rows) return;
        long long slot, row;
        if (p.block_table != nullptr) {
            const int page = pos / p.page_size;
            slot = p.block_table[static_cast<long long>(b) * p.block_table_batch_stride + page];
            row = pos - page * p.page_size;
        } else {
            slot = p.batch_idx != nullptr ? p.batch_idx[b] : b;
            row = pos;
        }
        if (slot < 0 || slot >= p.cache_batches) return;
        const T* kn = static_cast<const T*>(p.k_new) + b * p.kn_batch_stride + t * p.kn_row_stride + hk * p.kn_head_stride;
        const T* vn = static_cast<const T*>(p.v_new) + b * p.vn_batch_stride + t * p.vn_row_stride + hk * p.vn_head_stride;
        T* kc = static_cast<T*>(p.k_cache) + slot * p.kc_batch_stride + row * p.kc_row_stride + hk * p.kc_head_stride;
        T* vc = static_cast<T*>(p.v_cache) + slot * p.vc_batch_stride + row * p.vc_row_stride + hk * p.vc_head_stride;
        if (rotary) kv_append_detail::rotate_row(p, kn, kc, pos, lane);
        else kv_append_detail::copy_row(p, kn, kc, lane);
        kv_append_detail::copy_row(p, vn, vc, lane);
        return;
    }
    item -= kv_items;
    if (p.q_rot == nullptr || item >= static_cast<long long>(p.batch) * p.s_q * p.heads) return;
    const int h = static_cast<int>(item % p.heads);
    const int i = static_cast<int>((item / p.heads) % p.s_q);
    const int b = static_cast<int>(item / (static_cast<long long>(p.heads) * p.s_q));
    const int pos = p.seqlens[b] + (p.q_per_token ? i : 0);
    const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + i * p.q_row_stride + h * p.q_head_stride;
    T* qr = static_cast<T*>(p.q_rot) + b * p.qr_batch_stride + i * p.qr_row_stride + h * p.qr_head_stride;
    if (rotary) kv_append_detail::rotate_row(p, q, qr, pos, lane);
    else kv_append_detail::copy_row(p, q, qr, lane);
}

}  // namespace ferroattn
