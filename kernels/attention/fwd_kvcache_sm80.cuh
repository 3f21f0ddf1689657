// ferroattn — split-KV attention forward over a key/value cache (decode), sm80 family.
//
// What: the attention forward of attention/fwd_sm80.cuh (same semantics: online softmax in base
// 2, bottom-right causal / window / softcap / ALiBi / sinks of attention/variant.cuh, empty rows
// O = 0 and LSE = +inf) for few queries against many keys, the shape of decoding:
//   - all query heads of one kv head are rows of one block ("packed GQA"): row r of a block is
//     query token r / group of query head kv_head * group + r % group, so every K/V byte is read
//     once per kv head, not once per query head;
//   - the keys of a sequence are split into num_splits ranges of whole tiles, one block each;
//     with num_splits > 1 each block writes a normalised partial O and its LSE (fp32) and
//     attention/split_combine.cuh merges them through the LSE (FlashDecoding, Dao et al. 2023);
//   - inside a block the 4 warps share the 16 rows and split every K/V tile of BlockN keys into
//     four slices of 16 keys; each warp keeps its own online-softmax state, and the block merges
//     the four at the end (the same LSE rule, in shared memory);
//   - K/V rows come from a contiguous cache (optional cache_batch_idx and leftpad), a packed
//     varlen tensor or a paged cache (block_table, any page size); see attention/kvcache_params.cuh.
//
// Launch: grid (ceil(max(s_q) * group / 16) * num_splits, h_k, b), 128 threads, dynamic shared
// memory attn_fwd_kvcache_sm80_smem_bytes<HeadDim, BlockN, Stages>() (AttnKvcacheConfig::smem_bytes
// in src/tuning/attention_kvcache.rs): the Q tile and Stages K and V tiles; the block merge reuses
// them for 4 x 16 x (HeadDim + 8) fp32 values (static_asserted to fit).
//
// Template parameters:
//   HeadDim  multiple of 32 in [32, 256]; params.base.head_dim (multiple of 8, <= HeadDim) is the
//            real one: other columns load as 0 and are not written.
//   BlockN   keys per K/V tile: 64 (16 per warp).
//   Stages   >= 1: K/V tile ring depth (tile t + Stages - 1 is fetched while tile t is used;
//            1: each tile is loaded, then used).
//   Paged    keys through base.block_table (else contiguous or varlen rows).
//   V        the variant (attention/variant.cuh); no dropout.
//   T        __half or __nv_bfloat16.
//
// PTX features: mma.sync.aligned.m16n8k16, ldmatrix.x4(.trans), cp.async.cg (zero fill),
// ex2.approx, tanh.approx (softcap). Needs sm_80 or newer.
#pragma once
#include "common/dtype.cuh"
#include "common/ptx.cuh"
#include "common/swizzle.cuh"
#include "attention/kvcache_params.cuh"
#include "attention/variant.cuh"

namespace ferroattn {

template <int HeadDim, int BlockN, int Stages>
__host__ __device__ constexpr int attn_fwd_kvcache_sm80_smem_bytes() {
    return (16 * HeadDim + 2 * Stages * BlockN * HeadDim) * 2;
}

namespace kvcache_detail {

// Where sequence `batch` lives: its query rows and its keys (attention/kvcache_params.cuh).
struct KvSeq {
    int seqlen_q;      // query tokens of this sequence
    int q0;            // varlen: first row of the sequence in q / o / lse (else 0)
    int len_k;         // keys (positions 0 .. len_k - 1)
    long long k_row0;  // contiguous / varlen: first key row; paged: 0
    long long cache_b; // contiguous: cache row; paged / varlen: 0
};

__device__ __forceinline__ int clamp_index(int i, int n) { return min(max(i, 0), n - 1); }

__device__ __forceinline__ KvSeq kv_seq(const AttnKvcacheParams& kp, bool paged, int batch) {
    const AttnFwdParams& p = kp.base;
    KvSeq s;
    s.q0 = 0;
    s.seqlen_q = p.seqlen_q;
    if (p.cu_seqlens_q != nullptr) {
        const int q0 = min(max(p.cu_seqlens_q[batch], 0), p.total_q);
        const int q1 = min(max(p.cu_seqlens_q[batch + 1], q0), p.total_q);
        s.q0 = q0;
        s.seqlen_q = min(q1 - q0, p.seqlen_q);
    }
    s.k_row0 = 0;
    s.cache_b = 0;
    int len;
    if (p.cu_seqlens_k != nullptr) {
        const int k0 = min(max(p.cu_seqlens_k[batch], 0), paged ? 0x7fffffff : p.total_k);
        const int k1 = max(p.cu_seqlens_k[batch + 1], k0);
        len = k1 - k0;
        if (!paged) {
            s.k_row0 = k0;
            len = min(len, p.total_k - k0);
        }
    } else if (kp.seqlens_k != nullptr) {
        len = kp.seqlens_k[batch] + kp.seqlen_k_add;
    } else {
        len = p.seqlen_k;
    }
    len = min(max(len, 0), kp.cache_rows);
    if (p.cu_seqlens_k == nullptr && !paged) {
        s.cache_b = kp.batch_idx != nullptr ? clamp_index(kp.batch_idx[batch], kp.cache_batches) : batch;
        if (kp.leftpad_k != nullptr) {
            const int lp = min(max(kp.leftpad_k[batch], 0), len);
            s.k_row0 = lp;
            len -= lp;
        }
    }
    s.len_k = len;
    return s;
}

}  // namespace kvcache_detail

template <int HeadDim, int BlockN, int Stages, bool Paged, class V, typename T>
__global__ void __launch_bounds__(128, 1) attn_fwd_kvcache_sm80(const AttnKvcacheParams kp) {
    static_assert(HeadDim % 32 == 0 && HeadDim >= 32 && HeadDim <= 256,
                  "HeadDim must be a multiple of 32 in [32, 256]");
    static_assert(BlockN == 64, "4 warps x 16 keys per tile");
    static_assert(Stages >= 1, "Stages must be >= 1");
    static_assert(!V::kDropout, "no dropout in the kv-cache forward");
    static_assert(sizeof(T) == 2, "T must be __half or __nv_bfloat16");
    constexpr int kThreads = 128;
    constexpr int kRows = 16;
    constexpr int kChunks = HeadDim / 8;
    constexpr int KT = HeadDim / 16;   // k16 steps of Q K^T
    constexpr int DT = HeadDim / 8;    // n8 tiles of O
    constexpr int kORow = HeadDim + 8; // fp32 row stride of the block merge (conflict-light)
    constexpr unsigned kRowBytes = HeadDim * 2;
    static_assert(4 * kRows * kORow * 4 <= attn_fwd_kvcache_sm80_smem_bytes<HeadDim, BlockN, Stages>(),
                  "the block merge must fit in the Q tile and the K/V ring");
    using Tr = DTypeTraits<T>;
    const AttnFwdParams& p = kp.base;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sK = sQ + kRows * HeadDim;
    T* sV = sK + Stages * BlockN * HeadDim;
    __shared__ float s_m[4][kRows], s_l[4][kRows], s_fin_m[kRows], s_fin_l[kRows];

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int t4 = lane % 4;

    const int split = static_cast<int>(blockIdx.x) % kp.num_splits;
    const int m0 = (static_cast<int>(blockIdx.x) / kp.num_splits) * kRows;
    const int head_k = blockIdx.y;
    const int batch = blockIdx.z;
    const int group = kp.group;
    const kvcache_detail::KvSeq sq = kvcache_detail::kv_seq(kp, Paged, batch);
    const int rows_total = sq.seqlen_q * group;
    if (m0 >= rows_total) return;
    const int rows_here = min(rows_total - m0, kRows);
    const int head_dim = p.head_dim;

    // Keys some row of the block sees, in whole tiles, then this split's share of the tiles.
    const attn_variant::RowKeys<V> rk(p, sq.seqlen_q, sq.len_k);
    const int q_first = m0 / group;
    const int q_last = (m0 + rows_here - 1) / group;
    const int n_begin = rk.begin(q_first);
    const int n_end = rk.end(q_last + 1);
    const int t_first = V::kLocal ? n_begin / BlockN : 0;
    const int t_all = n_end > n_begin ? (n_end + BlockN - 1) / BlockN - t_first : 0;
    const int per_split = (t_all + kp.num_splits - 1) / kp.num_splits;
    const int t_begin = t_first + split * per_split;
    const int t_end = t_first + min(t_all, (split + 1) * per_split);
    const bool write_final = kp.num_splits == 1;

    // This lane's two rows (g, g + 8): query token, query head, their key bounds.
    int row_q[2], row_head[2], row_hi[2], row_lo[2];
    bool row_ok[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = m0 + g + 8 * h;
        row_ok[h] = r < rows_total;
        const int rr = row_ok[h] ? r : m0;
        row_q[h] = rr / group;
        row_head[h] = head_k * group + rr % group;
        row_hi[h] = row_ok[h] ? rk.hi(row_q[h]) : 0;
        row_lo[h] = rk.lo(row_q[h]);
    }

    const float scale_log2 = p.softmax_scale_log2;
    float row_max[2] = {-FERROATTN_INF, -FERROATTN_INF};
    float row_sum[2] = {0.f, 0.f};
    float acc_o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[dt][e] = 0.f;

    if (t_begin < t_end) {
        // ---- Q tile: the block's packed rows ----
        for (int idx = tid; idx < kRows * kChunks; idx += kThreads) {
            const int r = idx / kChunks, c = idx % kChunks;
            const int row = m0 + r;
            const bool ok = row < rows_total && c * 8 < head_dim;
            const T* src = static_cast<const T*>(p.q);
            if (ok) {
                const int qi = row / group, head = head_k * group + row % group;
                src += (p.cu_seqlens_q != nullptr ? 0 : static_cast<long long>(batch) * p.q_batch_stride)
                     + static_cast<long long>(sq.q0 + qi) * p.q_row_stride
                     + static_cast<long long>(head) * p.q_head_stride + c * 8;
            }
            cp_async_16_zfill(smem_u32(sQ + r * HeadDim + swizzle_chunk<kChunks>(r, c) * 8), src, ok);
        }

        // ---- K/V tile loads: thread -> chunk column c and kRowsPerThread consecutive rows ----
        // (head dims whose chunk count does not divide 128, e.g. 96 or 224: the threads past the
        // last whole row group idle -- at 224, 4 groups of 28 leave threads 112..127, which must
        // not write the shared rows 64..79 past the slot -- and rows past the tile are skipped). Consecutive rows let a paged load find its page once per
        // tile: when the page size is a multiple of kRowsPerThread, a thread's rows of a tile lie
        // in one page (tiles start at multiples of 64 keys), and that page's block-table entry is
        // read one iteration ahead (`next_page`), off the path of the K/V loads; other page sizes
        // look up every row.
        constexpr int kGroups = kThreads / kChunks;
        constexpr int kRowsPerThread = (BlockN + kGroups - 1) / kGroups;
        const int lc = tid % kChunks;
        const int lr0 = (tid / kChunks) * kRowsPerThread;
        const bool col_ok = lc * 8 < head_dim;
        const long long k_col = static_cast<long long>(head_k) * p.k_head_stride + lc * 8;
        const long long v_col = static_cast<long long>(head_k) * p.v_head_stride + lc * 8;
        const T* gk = static_cast<const T*>(p.k);
        const T* gv = static_cast<const T*>(p.v);
        const int* bt = Paged ? kp.block_table + static_cast<long long>(batch) * kp.block_table_batch_stride : nullptr;
        const bool one_page = Paged && kp.page_size % kRowsPerThread == 0;
        // The page of this thread's first row of `tile` (one_page), clamped; 0 past the keys.
        auto fetch_page = [&](int tile) -> int {
            const int j = tile * BlockN + lr0;
            return (Paged && one_page && j < sq.len_k) ? kvcache_detail::clamp_index(bt[j / kp.page_size], kp.cache_batches) : 0;
        };
        const bool in_group = tid / kChunks < kGroups;   // false: an idle thread (no row group)
        auto load_kv = [&](int tile, int slot, int page) {
            if (kThreads % kChunks != 0 && !in_group) return;
            const int j0 = tile * BlockN + lr0;
            long long k_base, v_base;   // row j0's offsets (one_page / contiguous)
            if constexpr (Paged) {
                const int page_row = j0 % kp.page_size;
                k_base = static_cast<long long>(page) * p.k_batch_stride + static_cast<long long>(page_row) * p.k_row_stride + k_col;
                v_base = static_cast<long long>(page) * p.v_batch_stride + static_cast<long long>(page_row) * p.v_row_stride + v_col;
            } else {
                k_base = sq.cache_b * p.k_batch_stride + (sq.k_row0 + j0) * p.k_row_stride + k_col;
                v_base = sq.cache_b * p.v_batch_stride + (sq.k_row0 + j0) * p.v_row_stride + v_col;
            }
#pragma unroll
            for (int i = 0; i < kRowsPerThread; ++i) {
                const int r = lr0 + i;
                if (BlockN % kGroups != 0 && r >= BlockN) continue;
                const int j = j0 + i;
                const bool ok = col_ok && j < sq.len_k;
                long long k_off = k_base + i * p.k_row_stride, v_off = v_base + i * p.v_row_stride;
                if constexpr (Paged) {
                    if (!one_page && ok) {
                        const int pg = j / kp.page_size;
                        const long long phys = kvcache_detail::clamp_index(bt[pg], kp.cache_batches);
                        const long long row = j - pg * kp.page_size;
                        k_off = phys * p.k_batch_stride + row * p.k_row_stride + k_col;
                        v_off = phys * p.v_batch_stride + row * p.v_row_stride + v_col;
                    }
                }
                if (!ok) k_off = v_off = 0;
                const int s_off = (slot * BlockN + r) * HeadDim + swizzle_chunk<kChunks>(r, lc) * 8;
                cp_async_16_zfill(smem_u32(sK + s_off), gk + k_off, ok);
                cp_async_16_zfill(smem_u32(sV + s_off), gv + v_off, ok);
            }
        };
        int next_page = 0;
        // Commit groups: tile t_begin + s (with Q in the first) for s < Stages - 1, then one per
        // iteration, so tile t is complete when at most Stages - 2 groups are pending. One stage
        // (small shared memory, d 256): each iteration loads its own tile and waits for it.
#pragma unroll
        for (int s = 0; s < Stages - 1; ++s) {
            if (t_begin + s < t_end) load_kv(t_begin + s, s, fetch_page(t_begin + s));
            cp_async_commit();
        }
        if constexpr (Stages == 1) cp_async_commit();   // Q alone
        if (t_begin + Stages - 1 < t_end) next_page = fetch_page(t_begin + Stages - 1);

        attn_variant::ScoreMod<V> smod[2] = {
            attn_variant::ScoreMod<V>(p, row_head[0], batch, sq.seqlen_q, sq.len_k),
            attn_variant::ScoreMod<V>(p, row_head[1], batch, sq.seqlen_q, sq.len_k)};
        // ldmatrix lane addresses (as attention/fwd_sm80.cuh): Q rows lane % 16; K keys
        // (lane % 8) + 8 (lane / 16) of this warp's slice -> b0, b1 of keys 0-7, then of 8-15;
        // V (.trans) keys lane % 16 of the slice -> b0, b1 of dims 0-7, then of 8-15.
        const LdsmCols<kChunks> q_cols(smem_u32(sQ) + (lane % 16) * kRowBytes, lane, lane / 16);
        const LdsmCols<kChunks> k_cols(smem_u32(sK) + (warp * 16 + (lane % 8) + 8 * (lane / 16)) * kRowBytes,
                                       lane, (lane / 8) % 2);
        const LdsmCols<kChunks> v_cols(smem_u32(sV) + (warp * 16 + (lane % 16)) * kRowBytes, lane, lane / 16);

        for (int tile = t_begin; tile < t_end; ++tile) {
            const int it = tile - t_begin;
            if constexpr (Stages == 1) {
                __syncthreads();   // every warp is done with the previous tile
                load_kv(tile, 0, next_page);
                cp_async_commit();
                if (tile + 1 < t_end) next_page = fetch_page(tile + 1);
                cp_async_wait<0>();
                __syncthreads();   // tile `tile` (and Q) visible
            } else {
                cp_async_wait<Stages - 2>();
                __syncthreads();   // tile `tile` visible; every warp is done with the slot refilled next
                if (tile + Stages - 1 < t_end) {
                    load_kv(tile + Stages - 1, (it + Stages - 1) % Stages, next_page);
                    if (tile + Stages < t_end) next_page = fetch_page(tile + Stages);
                }
                cp_async_commit();
            }
            const unsigned slot_bytes = static_cast<unsigned>(it % Stages) * (BlockN * kRowBytes);

            // ---- S = Q K_slice^T (16 rows x 16 keys) ----
            float acc_s[2][4];
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_s[nt][e] = 0.f;
#pragma unroll
            for (int kk = 0; kk < KT; ++kk) {
                unsigned qa[4], kb[4];
                ldmatrix_x4(qa, q_cols.at(kk, 0));
                ldmatrix_x4(kb, k_cols.at(kk, slot_bytes));
                mma_m16n8k16<T>(acc_s[0], qa, kb[0], kb[1]);
                mma_m16n8k16<T>(acc_s[1], qa, kb[2], kb[3]);
            }

            // ---- score modification, mask (rows past the block, keys past the row's bounds) ----
            const int c0 = tile * BlockN + warp * 16 + 2 * t4;
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int col = c0 + nt * 8 + e;
                        float s = acc_s[nt][2 * h + e];
                        if constexpr (V::kSoftcap || V::kAlibi) s = smod[h].apply(s, row_q[h], col);
                        if (col >= row_hi[h] || (V::kLocal && col < row_lo[h])) s = -FERROATTN_INF;
                        acc_s[nt][2 * h + e] = s;
                    }

            // ---- online softmax (base 2) ----
            float corr[2];
            bool changed = false;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float mx = row_max[h];
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) mx = fmaxf(mx, fmaxf(acc_s[nt][2 * h], acc_s[nt][2 * h + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_scaled = (mx == -FERROATTN_INF) ? 0.f : mx * scale_log2;
                changed |= mx != row_max[h];
                corr[h] = exp2_fast(row_max[h] * scale_log2 - m_scaled);
                row_max[h] = mx;
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float pv = exp2_fast(fmaf(acc_s[nt][2 * h + e], scale_log2, -m_scaled));
                        acc_s[nt][2 * h + e] = pv;
                        sum += pv;
                    }
                row_sum[h] = row_sum[h] * corr[h] + sum;
            }
            if (__any_sync(0xffffffffu, changed)) {
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    acc_o[dt][0] *= corr[0];
                    acc_o[dt][1] *= corr[0];
                    acc_o[dt][2] *= corr[1];
                    acc_o[dt][3] *= corr[1];
                }
            }

            // ---- O += P V_slice ----
            unsigned pa[4];
            pa[0] = Tr::pack2(acc_s[0][0], acc_s[0][1]);
            pa[1] = Tr::pack2(acc_s[0][2], acc_s[0][3]);
            pa[2] = Tr::pack2(acc_s[1][0], acc_s[1][1]);
            pa[3] = Tr::pack2(acc_s[1][2], acc_s[1][3]);
#pragma unroll
            for (int dn = 0; dn < HeadDim / 16; ++dn) {
                unsigned vb[4];
                ldmatrix_x4_trans(vb, v_cols.at(dn, slot_bytes));
                mma_m16n8k16<T>(acc_o[2 * dn], pa, vb[0], vb[1]);
                mma_m16n8k16<T>(acc_o[2 * dn + 1], pa, vb[2], vb[3]);
            }
        }
        cp_async_wait<0>();
    }

    // ---- merge the four warps' states (LSE rule), then write O / LSE or the split partial ----
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 1);
        row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 2);
        if (t4 == 0) {
            s_m[warp][g + 8 * h] = row_max[h];
            s_l[warp][g + 8 * h] = row_sum[h];
        }
    }
    __syncthreads();   // also: every warp is done with Q and the K/V ring, which the merge reuses
    float* sO = reinterpret_cast<float*>(smem_raw);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = g + 8 * h;
        float m = -FERROATTN_INF;
#pragma unroll
        for (int w = 0; w < 4; ++w) m = fmaxf(m, s_m[w][r]);
        float sink = -FERROATTN_INF;
        if constexpr (V::kSinks) {
            // The sink joins the softmax once per row: in split 0.
            if (split == 0) sink = attn_variant::sink_raw(p, row_head[h]);
            m = fmaxf(m, sink);
        }
        float l = 0.f;
        if (m != -FERROATTN_INF) {
#pragma unroll
            for (int w = 0; w < 4; ++w) l += s_l[w][r] * exp2_fast((s_m[w][r] - m) * scale_log2);
            if constexpr (V::kSinks) l += exp2_fast((sink - m) * scale_log2);
        }
        const float f = (l > 0.f && row_max[h] != -FERROATTN_INF)
                      ? exp2_fast((row_max[h] - m) * scale_log2) / l : 0.f;
        if (warp == 0 && t4 == 0) {
            s_fin_m[r] = m;
            s_fin_l[r] = l;
        }
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            *reinterpret_cast<float2*>(sO + (warp * kRows + r) * kORow + dt * 8 + 2 * t4) =
                make_float2(acc_o[dt][2 * h] * f, acc_o[dt][2 * h + 1] * f);
        }
    }
    __syncthreads();

    constexpr int kCols4 = HeadDim / 4;
    const float raw_scale = p.raw_scale;   // LSE = max_raw * raw_scale + log(sum)
    for (int idx = tid; idx < kRows * kCols4; idx += kThreads) {
        const int r = idx / kCols4, c4 = idx % kCols4;
        const int row = m0 + r;
        if (row >= rows_total) continue;
        const int qi = row / group, head = head_k * group + row % group;
        const float m = s_fin_m[r], l = s_fin_l[r];
        const bool empty = !(l > 0.f);
        if (c4 == 0) {
            const float lse = empty ? (write_final ? FERROATTN_INF : -FERROATTN_INF) : m * raw_scale + logf(l);
            if (write_final) {
                const long long off = p.cu_seqlens_q != nullptr
                    ? static_cast<long long>(head) * p.lse_head_stride + sq.q0 + qi
                    : static_cast<long long>(batch) * p.lse_batch_stride + static_cast<long long>(head) * p.lse_head_stride + qi;
                p.lse[off] = lse;
            } else {
                const long long off = ((static_cast<long long>(split) * p.batch + batch) * p.num_heads + head) * p.seqlen_q + qi;
                kp.lse_accum[off] = lse;
            }
        }
        if (c4 * 4 >= head_dim) continue;
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const float4 x = *reinterpret_cast<const float4*>(sO + (w * kRows + r) * kORow + c4 * 4);
            o.x += x.x; o.y += x.y; o.z += x.z; o.w += x.w;
        }
        if (write_final) {
            const long long off = (p.cu_seqlens_q != nullptr ? 0 : static_cast<long long>(batch) * p.o_batch_stride)
                                + static_cast<long long>(sq.q0 + qi) * p.o_row_stride
                                + static_cast<long long>(head) * p.o_head_stride + c4 * 4;
            *reinterpret_cast<uint2*>(static_cast<T*>(p.o) + off) = make_uint2(Tr::pack2(o.x, o.y), Tr::pack2(o.z, o.w));
        } else {
            const long long off = (((static_cast<long long>(split) * p.batch + batch) * p.num_heads + head) * p.seqlen_q + qi)
                                * head_dim + c4 * 4;
            *reinterpret_cast<float4*>(kp.o_accum + off) = o;
        }
    }
}

}  // namespace ferroattn
