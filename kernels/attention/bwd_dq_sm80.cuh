// ferroattn — attention backward, dQ kernel of the deterministic path, sm80 family
// (mma.sync + ldmatrix + cp.async).
//
// What: dQ = softmax_scale · dS K with dS = P ∘ (dP − D), P = exp(scale · Q Kᵀ − LSE),
// dP = dO Vᵀ (FlashAttention-2 paper §3.2), for one tile of BlockM query rows per block, the
// loop running over the key tiles this tile sees. P is recomputed from the forward's LSE
// (params.fwd.lse, natural log; +inf for a row that saw no key, giving P = 0) in base 2:
// P = exp2(S · softmax_scale_log2 − LSE · log2(e)). D = params.softmax_d (the preprocess
// kernel's rowsum(dO ∘ O)). Causal masks are bottom-right aligned as in the forward: row i sees
// key j iff j <= i + seqlen_k − seqlen_q (per sequence in varlen); masked keys and keys past
// seqlen_k get P = 0, so a row that sees no key writes dQ = 0 exactly. GQA: query head h reads
// kv head h / (num_heads / num_heads_k). No atomics and a fixed summation order: the result is
// bitwise reproducible.
//
// Layouts (attention/bwd_params.cuh, attention/params.cuh): q, dout, dq (padded (b, s_q, h, d),
// varlen (total_q, h, d)), k, v ((b, s_k, h_k, d) / (total_k, h_k, d)), each with its own strides;
// lse and softmax_d fp32 with lse's strides (row stride 1). Strides in elements, last dim
// contiguous; base pointers and row/head/batch strides 16-byte aligned (multiples of 8
// elements): tiles move in 16-byte cp.async copies and 16-byte stores.
//
// Launch: grid (ceil(seqlen_q / BlockM), num_heads, batch) (seqlen_q = max_seqlen_q for
// varlen), block NumWarps*32 threads, dynamic shared memory attn_bwd_dq_sm80_smem_bytes<...>() =
// (2*BlockM*HeadDim + 2*Stages*BlockN*HeadDim) * 2 bytes (the Dq formula of
// AttnBwdConfig::smem_bytes in src/tuning/attention_bwd.rs); above 48 KiB the caller raises
// CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES. For causal, blockIdx.x is reversed so the
// heaviest query tiles start first.
//
// Template parameters and constraints:
//   HeadDim  kernel head dim, multiple of 32 in [32, 256]; params.fwd.head_dim (multiple of 8,
//            <= HeadDim) is the real one: other columns load as 0 and are not written.
//   BlockM   query rows per block; a multiple of 16*NumWarps (each warp owns BlockM/NumWarps
//            consecutive rows = MT m16 tiles).
//   BlockN   keys per pipeline tile, multiple of 16.
//   NumWarps warps per block.
//   Stages   >= 1: ring of Stages shared-memory slots, each one K tile and one V tile. With
//            Stages >= 2, tile j+Stages-1 is fetched at the top of tile j (one barrier per
//            tile); with 1 stage, tile j is fetched after every warp is done with tile j−1.
//   V        the variant (attention/variant.cuh): mask, softcap, ALiBi, dropout (sinks need nothing
//            here: the forward's LSE includes them, and their gradient is formed on the host).
//   T        __half or __nv_bfloat16 (q, k, v, dout, dq); lse, softmax_d fp32.
// Shared memory: Q and dO tiles (swizzled; the Q tile is reused to stage dQ for 16-byte
// stores), then the K/V ring, all XOR-swizzled 16-byte chunks (common/swizzle.cuh):
// ldmatrix and cp.async are conflict-free.
// Registers: per warp, the dQ accumulators (MT × HeadDim/2 fp32 per thread), S and dP of one
// key tile (2 × MT × BlockN/2), the 2·MT rows' LSE and D. Q and dO fragments are re-read from
// shared memory each k-step. Per key tile, each k-step loads one Q and one dO fragment and,
// per 16 keys, one K and one V fragment (non-transposed ldmatrix, the K pattern of the
// forward) feeding the S and dP mma; dS is formed in the S registers and repacked straight
// into the A operand of dS·K, whose B operand is K read again with ldmatrix.trans (the
// forward's V pattern).
// Work per block: the key tiles holding keys [n_begin, n_end) that some row of the tile sees
// (variant.cuh RowKeys, as in the forward); only tiles crossing the window's edges or the key
// tail are masked. Softcap: dS is multiplied by 1 − tanh² of the capped score (the derivative
// of c·tanh(x/c), the scale applied with the rest of dQ).
//
// PTX features: mma.sync.aligned.m16n8k16 f16/bf16 -> f32, ldmatrix.x4(.trans),
// cp.async.cg (16 B, src-size zero fill), cp.async.commit_group/wait_group, ex2.approx.
// Needs sm_80 or newer.
#pragma once
#include "common/dtype.cuh"
#include "common/ptx.cuh"
#include "common/swizzle.cuh"
#include "attention/bwd_params.cuh"
#include "attention/bwd_common.cuh"
#include "attention/fwd_sm80.cuh"

namespace ferroattn {

template <int HeadDim, int BlockM, int BlockN, int Stages>
__host__ __device__ constexpr int attn_bwd_dq_sm80_smem_bytes() {
    return (2 * BlockM * HeadDim + 2 * Stages * BlockN * HeadDim) * 2;
}

template <int HeadDim, int BlockM, int BlockN, int NumWarps, int Stages, class V, typename T>
__global__ void __launch_bounds__(NumWarps * 32) attn_bwd_dq_sm80(const AttnBwdParams params) {
    static_assert(attn_detail::query_tile_sm80_ok<HeadDim, BlockM, BlockN, NumWarps, Stages, T,
                  attn_bwd_dq_sm80_smem_bytes<HeadDim, BlockM, BlockN, Stages>()>());

    constexpr int kThreads = NumWarps * 32;
    constexpr int kWarpM = BlockM / NumWarps;
    constexpr int MT = kWarpM / 16;     // m16 tiles per warp
    constexpr int NT = BlockN / 8;      // n8 tiles of S / dP per warp
    constexpr int KT = HeadDim / 16;    // k16 steps of Q Kᵀ and dO Vᵀ
    constexpr int DT = HeadDim / 8;     // n8 tiles of dQ
    constexpr int kChunks = HeadDim / 8;
    constexpr unsigned kRowBytes = HeadDim * 2;
    constexpr float kLog2e = 1.4426950408889634f;
    using Tr = DTypeTraits<T>;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sDO = sQ + BlockM * HeadDim;
    T* sK = sDO + BlockM * HeadDim;
    T* sV = sK + Stages * BlockN * HeadDim;

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int t = lane % 4;

    const int m_block = V::kCausal ? static_cast<int>(gridDim.x - 1 - blockIdx.x)
                                   : static_cast<int>(blockIdx.x);
    const int head = blockIdx.y;
    const AttnFwdParams& fp = params.fwd;
    const int batch = blockIdx.z;
    const attn_detail::SeqCoords sc = attn_detail::seq_coords(fp, head, batch);
    const int seqlen_q = sc.seqlen_q;
    const int seqlen_k = sc.seqlen_k;
    const int m_start = m_block * BlockM;
    if (m_start >= seqlen_q) return;
    const attn_bwd_detail::BwdQueryOffsets bo = attn_bwd_detail::bwd_query_offsets(params, head, batch);

    const int head_dim = fp.head_dim;
    const int rows_q = min(seqlen_q - m_start, BlockM);
    // The variant's key range per row (attention/variant.cuh); keys this tile can see:
    // [n_begin, n_end).
    const attn_variant::RowKeys<V> rk(fp, seqlen_q, seqlen_k);
    const int n_end = rk.end(m_start + rows_q);
    const int n_begin = rk.begin(m_start);

    if (n_end <= n_begin) {
        // No row of this tile sees a key: dQ = 0.
        T* gdq = static_cast<T*>(params.dq) + bo.dq_off
               + static_cast<long long>(m_start) * params.dq_row_stride;
        constexpr int kTotal = BlockM * kChunks;
        for (int idx = tid; idx < kTotal; idx += kThreads) {
            const int r = idx / kChunks;
            const int c = idx % kChunks;
            if (r < rows_q && c * 8 < head_dim) {
                *reinterpret_cast<uint4*>(gdq + static_cast<long long>(r) * params.dq_row_stride
                                          + c * 8) = make_uint4(0u, 0u, 0u, 0u);
            }
        }
        return;
    }
    // Key tiles j_first .. n_blocks - 1 (absolute indices; slot j % Stages).
    const int n_blocks = (n_end + BlockN - 1) / BlockN;
    const int j_first = V::kLocal ? n_begin / BlockN : 0;

    const T* gK = static_cast<const T*>(fp.k) + sc.k_off;
    const T* gV = static_cast<const T*>(fp.v) + sc.v_off;
    // One pipeline slot: K tile j and V tile j.
    auto load_kv = [&](int j) {
        const int slot = j % Stages;
        attn_detail::load_tile_async<BlockN, HeadDim, kThreads>(
            sK + slot * BlockN * HeadDim, gK, j * BlockN, seqlen_k - j * BlockN, fp.k_row_stride,
            head_dim, tid);
        attn_detail::load_tile_async<BlockN, HeadDim, kThreads>(
            sV + slot * BlockN * HeadDim, gV, j * BlockN, seqlen_k - j * BlockN, fp.v_row_stride,
            head_dim, tid);
    };

    // Prologue. Commit group s holds K/V tile j_first + s (group 0 also Q and dO); from the
    // second tile on, the iteration of tile j commits tile j − 1 + Stages.
    attn_detail::load_tile_async<BlockM, HeadDim, kThreads>(
        sQ, static_cast<const T*>(fp.q) + sc.q_off, m_start, rows_q, fp.q_row_stride, head_dim, tid);
    attn_detail::load_tile_async<BlockM, HeadDim, kThreads>(
        sDO, static_cast<const T*>(params.dout) + bo.do_off, m_start, rows_q, params.do_row_stride,
        head_dim, tid);
    load_kv(j_first);
    cp_async_commit();
#pragma unroll
    for (int s = 1; s < Stages; ++s) {
        if (j_first + s < n_blocks) load_kv(j_first + s);
        cp_async_commit();
    }
    const attn_variant::ScoreMod<V> smod(fp, head, batch, seqlen_q, seqlen_k);
    const attn_variant::DropoutMask<V> drop(fp, head, batch);

    const int warp_row0 = warp * kWarpM;   // first tile row of this warp
    // LSE (scaled to base 2) and D of this thread's 2·MT rows; rows past the sequence get
    // LSE = +inf (P = 0) and D = 0.
    float lse2[MT][2], dval[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = warp_row0 + mt * 16 + g + h * 8;
            if (r < rows_q) {
                const long long off = sc.lse_off + m_start + r;
                lse2[mt][h] = fp.lse[off] * kLog2e;
                dval[mt][h] = params.softmax_d[off];
            } else {
                lse2[mt][h] = FERROATTN_INF;
                dval[mt][h] = 0.f;
            }
        }

    float acc_dq[MT][DT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dq[mt][dt][e] = 0.f;

    const float scale_log2 = fp.softmax_scale_log2;
    // ldmatrix lane addresses (see LdsmCols and the forward kernel):
    // Q and dO (A operand): row lane%16 of a 16-row block, logical chunk 2*step + lane/16; dO
    //   uses Q's addresses plus a constant offset.
    // K and V (B operand of S = Q Kᵀ and dP = dO Vᵀ, 16 keys x 16 dims, non-transposed): key
    //   (lane%8) + 8*(lane/16), chunk 2*step + (lane/8)%2 -> b0, b1 of keys 0-7, then of keys
    //   8-15; V uses K's addresses plus a constant offset.
    // K (B operand of dQ = dS K, .trans, 16 keys x 16 dims): key lane%16, chunk 2*step +
    //   lane/16 -> b0, b1 of dims 0-7, then b0, b1 of dims 8-15.
    const LdsmCols<kChunks> q_cols(smem_u32(sQ) + (warp_row0 + (lane % 16)) * kRowBytes, lane,
                                   lane / 16);
    const LdsmCols<kChunks> k_cols(smem_u32(sK) + ((lane % 8) + 8 * (lane / 16)) * kRowBytes,
                                   lane, (lane / 8) % 2);
    const LdsmCols<kChunks> kt_cols(smem_u32(sK) + (lane % 16) * kRowBytes, lane, lane / 16);
    constexpr unsigned kDoOffset = BlockM * kRowBytes;            // sDO - sQ in bytes
    constexpr unsigned kVOffset = Stages * BlockN * kRowBytes;    // sV - sK in bytes

    for (int j = j_first; j < n_blocks; ++j) {
        if constexpr (Stages >= 2) {
            cp_async_wait<Stages - 2>();
            __syncthreads();   // tile j visible; every warp is done with tile j-1
            if (j > j_first) {
                if (j - 1 + Stages < n_blocks) load_kv(j - 1 + Stages);
                cp_async_commit();
            }
        } else {
            if (j > j_first) {
                __syncthreads();   // every warp is done with tile j-1 (the only slot)
                load_kv(j);
                cp_async_commit();
            }
            cp_async_wait<0>();
            __syncthreads();   // tile j visible
        }
        const unsigned slot_bytes = static_cast<unsigned>(j % Stages) * (BlockN * kRowBytes);

        // ---- S = Q Kᵀ and dP = dO Vᵀ ----
        float acc_s[MT][NT][4], acc_dp[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    acc_s[mt][nt][e] = 0.f;
                    acc_dp[mt][nt][e] = 0.f;
                }
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) {
            unsigned qa[MT][4], da[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                ldmatrix_x4(qa[mt], q_cols.at(kk, mt * 16 * kRowBytes));
                ldmatrix_x4(da[mt], q_cols.at(kk, mt * 16 * kRowBytes + kDoOffset));
            }
#pragma unroll
            for (int nn = 0; nn < NT / 2; ++nn) {
                unsigned kb[4], vb[4];
                ldmatrix_x4(kb, k_cols.at(kk, nn * 16 * kRowBytes) + slot_bytes);
                ldmatrix_x4(vb, k_cols.at(kk, nn * 16 * kRowBytes + kVOffset) + slot_bytes);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_m16n8k16<T>(acc_s[mt][2 * nn], qa[mt], kb[0], kb[1]);
                    mma_m16n8k16<T>(acc_s[mt][2 * nn + 1], qa[mt], kb[2], kb[3]);
                    mma_m16n8k16<T>(acc_dp[mt][2 * nn], da[mt], vb[0], vb[1]);
                    mma_m16n8k16<T>(acc_dp[mt][2 * nn + 1], da[mt], vb[2], vb[3]);
                }
            }
        }

        // ---- P (recomputed, masked) and dS = P ∘ (dP − D), into acc_s ----
        // Softcap and ALiBi modify the score first (variant.cuh); with softcap dS also takes
        // the factor 1 − tanh² of the cap (the scale is applied in the epilogue).
        const int n_start = j * BlockN;
        const bool need_mask = (n_start + BlockN > seqlen_k) ||
                               !rk.tile_full(m_start, BlockM, n_start, BlockN);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            // dropout: this lane's keep bytes of rows (mt, g + 8h), 32 keys per unit
            [[maybe_unused]] uint4 keepw[V::kDropout ? NT / 4 : 1];
            if constexpr (V::kDropout) {
                static_assert(NT % 4 == 0, "dropout units span 32 keys of a tile");
#pragma unroll
                for (int q4 = 0; q4 < NT / 4; ++q4)
                    keepw[q4] = drop.frag(m_start + warp_row0 + mt * 16 + g, n_start + q4 * 32, t);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = m_start + warp_row0 + mt * 16 + g + h * 8;
                const float l2 = lse2[mt][h];
                const float dv = dval[mt][h];
                const int c0 = n_start + 2 * t;
                const int lim = need_mask ? rk.hi(row) - c0 : BlockN;   // keep key nt*8+e iff in [lo, lim)
                const int lo = rk.lo(row) - c0;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float sc_ = acc_s[mt][nt][2 * h + e];
                        float dcap = 1.f;
                        if constexpr (V::kSoftcap || V::kAlibi) sc_ = smod.apply(sc_, row, c0 + nt * 8 + e, dcap);
                        float p = exp2_fast(fmaf(sc_, scale_log2, -l2));
                        if (nt * 8 + e >= lim || (V::kLocal && need_mask && nt * 8 + e < lo)) p = 0.f;
                        float dpv = acc_dp[mt][nt][2 * h + e];
                        if constexpr (V::kDropout)   // dS = P o (Z o dP - D), Z = keep / (1 - p)
                            dpv = attn_variant::DropoutMask<V>::frag_keep(keepw[nt / 4], h, nt % 4, e) ? dpv * drop.scale : 0.f;
                        float ds = p * (dpv - dv);
                        if constexpr (V::kSoftcap) ds *= dcap;
                        acc_s[mt][nt][2 * h + e] = ds;
                    }
            }
        }

        // ---- dQ += dS K (dS from registers, K via ldmatrix.trans) ----
#pragma unroll
        for (int kk = 0; kk < BlockN / 16; ++kk) {
            unsigned pa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                pa[mt][0] = Tr::pack2(acc_s[mt][2 * kk][0], acc_s[mt][2 * kk][1]);
                pa[mt][1] = Tr::pack2(acc_s[mt][2 * kk][2], acc_s[mt][2 * kk][3]);
                pa[mt][2] = Tr::pack2(acc_s[mt][2 * kk + 1][0], acc_s[mt][2 * kk + 1][1]);
                pa[mt][3] = Tr::pack2(acc_s[mt][2 * kk + 1][2], acc_s[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int dn = 0; dn < HeadDim / 16; ++dn) {
                unsigned kb[4];
                ldmatrix_x4_trans(kb, kt_cols.at(dn, kk * 16 * kRowBytes) + slot_bytes);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_m16n8k16<T>(acc_dq[mt][2 * dn], pa[mt], kb[0], kb[1]);
                    mma_m16n8k16<T>(acc_dq[mt][2 * dn + 1], pa[mt], kb[2], kb[3]);
                }
            }
        }
    }
    cp_async_wait<0>();   // only empty groups can remain; drain them before exit

    // ---- epilogue: scale, stage dQ in the Q tile, 16-byte stores ----
    const float scale = fp.softmax_scale;
    // Each warp only ever read its own rows of sQ and sDO; make sure all its lanes are past them.
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = warp_row0 + mt * 16 + g + h * 8;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                *reinterpret_cast<unsigned*>(sQ + swizzle_offset<HeadDim>(r, dt * 8 + 2 * t)) =
                    Tr::pack2(scale * acc_dq[mt][dt][2 * h], scale * acc_dq[mt][dt][2 * h + 1]);
            }
        }
    __syncthreads();
    {
        T* gdq = static_cast<T*>(params.dq) + bo.dq_off
               + static_cast<long long>(m_start) * params.dq_row_stride;
        constexpr int kTotal = BlockM * kChunks;
#pragma unroll
        for (int i = 0; i < (kTotal + kThreads - 1) / kThreads; ++i) {
            const int idx = tid + i * kThreads;
            if (kTotal % kThreads == 0 || idx < kTotal) {
                const int r = idx / kChunks;
                const int c = idx % kChunks;
                if (r < rows_q && c * 8 < head_dim) {
                    const uint4 val = *reinterpret_cast<const uint4*>(
                        sQ + r * HeadDim + swizzle_chunk<kChunks>(r, c) * 8);
                    *reinterpret_cast<uint4*>(gdq + static_cast<long long>(r) * params.dq_row_stride
                                              + c * 8) = val;
                }
            }
        }
    }
}

}  // namespace ferroattn
