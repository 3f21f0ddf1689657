// ferroattn — attention backward, single-pass dK/dV(/dQ) for wide head dims (HeadDim 256),
// sm80 family (mma.sync + ldmatrix + cp.async).
//
// What: the same gradients as attn_bwd_dkdv_sm80 (attention/bwd_dkdv_sm80.cuh; FlashAttention-2
// paper §3.2, Alg. 2) for one key tile of BlockN = 64 keys of one kv head, dK AND dV in one pass
// (five products per query tile: S = Q K^T, dP = dO V^T, dV += P^T dO, dK += dS^T Q, and with
// WithDQ dQ_tile = dS K added to dq_accum with red.global.add). attn_bwd_dkdv_sm80 forwards here
// when attn_bwd_dkdv_sm80_wide<HeadDim, WithDK, WithDV>() holds (HeadDim 256, dK and dV), so
// the kernel name, template parameters, masks, GQA loop, layouts and launch grid are the ones
// documented in bwd_dkdv_sm80.cuh; only the warp partition and the shared-memory map differ.
//
// Why: the "warps own keys" partition of bwd_dkdv_sm80.cuh keeps 16 keys x HeadDim of dK AND dV
// per warp in registers (2 x 128 fp32 per thread at d256): it cannot, so d > 128 ran split (two
// kernels, S recomputed: 6 products instead of 5). Here each product has its own warp layout
// and P / dS travel through shared memory:
//   S, dP (64 q x 64 k, contracted over HeadDim): warp w owns queries 16*(w%4).. and keys
//     32*(w/4).. (A = Q / dO rows by ldmatrix, B = K / V rows by ldmatrix); P and dS are written
//     (as T) into two BlockM x BlockN shared tiles (row = query, XOR-swizzled 16-byte chunks).
//   dV, dK (64 k x HeadDim, contracted over the 64 queries): warp w owns keys 32*(w%2).. and
//     columns (HeadDim/4)*(w/2)..: 2 x (HeadDim/4)/8 n8 tiles = 64 fp32 per accumulator per
//     thread at d256 (128 for both). A = P^T / dS^T by ldmatrix.trans of the stored tiles,
//     B = dO / Q by ldmatrix.trans.
//   dQ (64 q x HeadDim, contracted over the 64 keys): warp w owns queries 32*(w%2).. and
//     columns (HeadDim/4)*(w/2).., in kDqPasses passes of 32 (sm_90 staged) or 16 (others)
//     columns (A = dS by ldmatrix, B = K by ldmatrix.trans); each pass adds its partial to
//     dq_accum: sm_90 staged through 2 KiB of shared memory per warp, then row-contiguous
//     red.global.add.v4.f32 (attn_bwd_dkdv_wide_dq_stage); sm_100+, and sm_90 with DqDirect:
//     red.v4 after a lane-pair exchange; sm_80-89: scalar red.global.add.f32.
// Two barriers per query tile: one opens the tile (its Q/dO visible, every warp done with the
// previous tile's P/dS), one after the P/dS stores. Per warp and query tile: 320 mma.m16n8k16
// (64 per product), 176 ldmatrix.x4 (S 48, dP 48, dV 24, dK 24, dQ 32 with two passes; 192 with
// four: dQ 48), 16 32-bit P/dS stores per thread. The P/dS stores (8 rows x 4 lanes at chunks
// c ^ (row & 7)) and every ldmatrix phase are bank-conflict free.
//
// Shared memory (bytes, attn_bwd_dkdv_wide_smem_bytes):
//   K, V (BlockN x HeadDim each), Stages x (Q, dO) (BlockM x HeadDim each), P and dS
//   (BlockM x BlockN each), all 16-bit; Stages x (LSE, D) rows (BlockM fp32 each); sm_90 with
//   WithDQ and not DqDirect: + NumWarps x 2 KiB dQ staging:
//   (2*BlockN*HeadDim + 2*Stages*BlockM*HeadDim + 2*BlockM*BlockN) * 2 + Stages*BlockM*8 [+ 16384].
//   d256, 64 x 64: Stages 2 = 214 016 B (+16 384 staged = 230 400, sm_90a), Stages 1 =
//   147 968 B (sm_80: 163 KiB). AttnBwdConfig::smem_bytes (src/tuning/attention_bwd.rs) mirrors it.
// Registers (bench/NOTES.md "Backward v8", "Attention variants"): 247-255 per thread, 0 spills
// for every production configuration on sm_80 (Stages 1) and sm_90a (Stages 2; DqDirect for the
// variants whose staged build spills); one 8-warp block per SM.
// Measured (H200, kernel alone, b*s = 16k, h 8): 210-236 TFLOP/s, 0.87-1.21x SDPA-flash
// (FlashAttention-2) backward; the split it replaces: 122-194, 0.69-0.88x.
// Constraints: BlockM == BlockN == 64, NumWarps == 8, HeadDim % 256 == 0 (columns per warp a
// whole number of 8-chunk swizzle groups), WithDK && WithDV, Stages >= 1. DqDirect: the last
// template argument of attn_bwd_dkdv_sm80 (default false), see attn_bwd_dkdv_wide_dq_stage.
// The block set-up, dK/dV stores, K/V and query-tile loads and pipeline prologue are the ones
// of bwd_dkdv_sm80.cuh (attention/bwd_dkdv_block.cuh). Not standalone: included by
// attention/bwd_dkdv_sm80.cuh after its attn_bwd_detail helpers (red_add_*, zero_frags).
// PTX features: as bwd_dkdv_sm80.cuh, plus st.shared.v2.f32 / ld.shared.v4.f32 (staging).
#pragma once
#include "common/dtype.cuh"
#include "common/ptx.cuh"
#include "common/swizzle.cuh"
#include "attention/bwd_params.cuh"
#include "attention/fwd_sm80.cuh"
#include "attention/bwd_dkdv_block.cuh"

namespace ferroattn {

// The single-pass wide kernel serves this specialisation of attn_bwd_dkdv_sm80.
template <int HeadDim, bool WithDK, bool WithDV>
__host__ __device__ constexpr bool attn_bwd_dkdv_sm80_wide() {
    return HeadDim > 128 && WithDK && WithDV;
}

// dQ reductions of the wide kernel staged through shared memory (sm_90, WithDQ, unless
// DqDirect): each warp writes 16 query rows x its pass's 32 dQ columns (fp32) to its own slice
// and reads them back row-contiguous, so that one red.global.add.v4.f32 covers 4 whole rows x 32
// columns (4 cache lines) instead of 16 rows x 8 columns (16 lines). Adds NumWarps * 16 * 32 * 4
// = 16 KiB (+13 % at d256 on H200, bench/NOTES.md "Backward v8"). DqDirect (the kernel's last
// template argument, set by the host for the variants whose staged build spills) keeps the
// direct reductions of sm_100+ (4 passes, red.v4 after a lane-pair exchange) on sm_90 too.
// Must match AttnBwdConfig::wide_dq_staged (src/tuning/attention_bwd.rs), which decides
// DqDirect and the shared-memory size.
template <int HeadDim, bool WithDQ, bool DqDirect = false>
__host__ __device__ constexpr bool attn_bwd_dkdv_wide_dq_stage() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
    return WithDQ && HeadDim == 256 && !DqDirect;
#else
    return false;
#endif
}

template <int HeadDim, int BlockM, int BlockN, int Stages, bool WithDQ, bool DqDirect = false>
__host__ __device__ constexpr int attn_bwd_dkdv_wide_smem_bytes() {
    return (2 * BlockN * HeadDim + 2 * Stages * BlockM * HeadDim + 2 * BlockM * BlockN) * 2
         + Stages * BlockM * 8 + (attn_bwd_dkdv_wide_dq_stage<HeadDim, WithDQ, DqDirect>() ? 8 * 16 * 32 * 4 : 0);
}

namespace attn_bwd_detail {

template <int HeadDim, int BlockM, int BlockN, int NumWarps, int Stages, class V,
          bool WithDQ, typename T, bool DqDirect>
__device__ __forceinline__ void dkdv_wide(const AttnBwdParams& params) {
    static_assert(BlockM == 64 && BlockN == 64 && NumWarps == 8,
                  "wide dK/dV kernel: 64 x 64 tiles on 8 warps");
    static_assert(HeadDim % 256 == 0, "wide dK/dV kernel: HeadDim a multiple of 256");
    static_assert(Stages >= 1, "Stages must be >= 1");
    static_assert(sizeof(T) == 2, "T must be __half or __nv_bfloat16");
    static_assert(attn_bwd_dkdv_wide_smem_bytes<HeadDim, BlockM, BlockN, Stages, WithDQ, DqDirect>() <= 227 * 1024,
                  "tile does not fit in 227 KiB of shared memory");

    constexpr int kThreads = NumWarps * 32;
    constexpr int KD = HeadDim / 16;          // k16 steps over the head dim (S, dP)
    constexpr int kCols = HeadDim / 4;        // columns per warp (dK, dV, dQ)
    constexpr int NC = kCols / 8;             // n8 tiles per warp (dK, dV, dQ)
    // dQ column passes per warp (fewer live dQ accumulators next to dK/dV): 2 (32 columns) with
    // the staged sm_90 reductions, else 4 (16 columns: the one-stage sm_80 tile spills with 2).
    constexpr int kDqPasses = attn_bwd_dkdv_wide_dq_stage<HeadDim, WithDQ, DqDirect>() ? 2 : 4;
    constexpr int kDqCols = kCols / kDqPasses;
    // Unroll of the dV/dK query-step loop and of the dQ key-step loop (1: registers).
    constexpr int kDkdvUnroll = 1;
    constexpr int kDqUnroll = 1;
    static_assert(kDqCols % 16 == 0, "dQ pass: a multiple of 16 columns");
    constexpr unsigned kRowBytes = HeadDim * 2;
    constexpr unsigned kPRowBytes = BlockN * 2;   // P / dS rows (queries), 8 chunks
    constexpr unsigned kTileKV = BlockN * kRowBytes;
    constexpr unsigned kTileQ = BlockM * kRowBytes;
    constexpr unsigned kTileP = BlockM * kPRowBytes;
    constexpr unsigned kOffV = kTileKV;
    constexpr unsigned kOffQ = 2 * kTileKV;
    constexpr unsigned kOffDO = kOffQ + Stages * kTileQ;
    constexpr unsigned kOffP = kOffDO + Stages * kTileQ;
    constexpr unsigned kOffDS = kOffP + kTileP;
    constexpr unsigned kOffLse = kOffDS + kTileP;
    constexpr unsigned kOffD = kOffLse + Stages * BlockM * 4;
    constexpr bool kStage = attn_bwd_dkdv_wide_dq_stage<HeadDim, WithDQ, DqDirect>();
    constexpr unsigned kOffStage = kOffD + Stages * BlockM * 4;
    static_assert(!kStage || kDqCols == 32 || kDqCols == 64, "staged dQ reductions: 32 or 64 columns per pass");
    static_assert(kOffStage + (kStage ? NumWarps * 2048 : 0) ==
                  static_cast<unsigned>(attn_bwd_dkdv_wide_smem_bytes<HeadDim, BlockM, BlockN, Stages, WithDQ, DqDirect>()),
                  "shared-memory map and formula disagree");
    using Tr = DTypeTraits<T>;
    const AttnFwdParams& fp = params.fwd;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sK = reinterpret_cast<T*>(smem_raw);
    T* sV = reinterpret_cast<T*>(smem_raw + kOffV);
    const unsigned smem0 = smem_u32(smem_raw);

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int t = lane % 4;

    DkdvBlock blk;
    if (!dkdv_block<BlockM, BlockN, V>(fp, blk)) return;   // past seqlen_k
    // The block's fields as the kernel's locals, which its lambdas capture one by one (as
    // before bwd_dkdv_block.cuh: using blk.* in the body changes the SASS).
    const BwdSeq& sq = blk.sq;
    const int head_k = blk.head_k, batch = blk.batch, seqlen_q = blk.seqlen_q, n0 = blk.n0;
    const int rows_k = blk.rows_k, head_dim = blk.head_dim, group = blk.group;
    const int m_first = blk.m_first, per_head = blk.per_head, n_iter = blk.n_iter;
    if (n_iter <= 0) {
        store_dkdv_zero<BlockN, HeadDim, kThreads, true, true, T>(params, blk, tid);
        return;
    }
    const attn_variant::RowKeys<V> rk(fp, seqlen_q, blk.seqlen_k);
    attn_variant::ScoreMod<V> smod(fp, head_k * group, batch, seqlen_q, blk.seqlen_k);
    attn_variant::DropoutMask<V> drop(fp, head_k * group, batch);

    // ---- K and V tiles (once per block), then the first query tiles ----
    load_kv_tiles<BlockN, HeadDim, kThreads>(fp, blk, sK, sV, tid);
    constexpr DkdvSmemMap kMap{kOffQ, kOffDO, kOffLse, kOffD};
    auto load_iter = [&](int it) {
        load_query_tile<BlockM, HeadDim, kThreads, Stages, true, T>(params, blk, it, kMap, smem_raw, smem0, tid);
    };
    query_pipe_prologue<Stages>(load_iter, n_iter);

    float acc_dk[2][NC][4];
    float acc_dv[2][NC][4];
    zero_frags(acc_dk);
    zero_frags(acc_dv);

    const float scale_log2 = fp.softmax_scale_log2;
    constexpr float kLog2e = 1.4426950408889634f;
    // Warp roles. S / dP: queries sw_q .. +16, keys sw_k .. +32. dK / dV: keys kw_k .. +32,
    // columns cw .. +kCols. dQ: queries qw_q .. +32, columns cw .. +kCols.
    const int sw_q = (warp % 4) * 16;
    const int sw_k = (warp / 4) * 32;
    const int kw_k = (warp % 2) * 32;
    const int qw_q = (warp % 2) * 32;
    const int cw = (warp / 2) * kCols;
    const unsigned cw_bytes = cw * 2;   // a whole number of 8-chunk swizzle groups

    // ldmatrix lane patterns (LdsmCols): "a": row lane%16, chunk 2*i + lane/16 (A operand of
    // 16 rows, or .trans the B operand of 16 k-rows x 16 columns: b0, b1 of columns 0-7, then of
    // 8-15). "b": row (lane%8) + 8*(lane/16), chunk 2*i + (lane/8)%2 (B operand of 16 n-rows:
    // b0, b1 of rows 0-7, then of rows 8-15; or .trans the A operand A = X^T of a stored X:
    // a0..a3 of 16 columns x 16 rows of X).
    const LdsmCols<HeadDim / 8> a_cols(smem0 + (lane % 16) * kRowBytes, lane, lane / 16);
    const LdsmCols<HeadDim / 8> b_cols(smem0 + ((lane % 8) + 8 * (lane / 16)) * kRowBytes, lane,
                                       (lane / 8) % 2);
    // dS A operand (dQ): row qw_q + lane%16 (+16*mt), chunk 2*ks + lane/16 at chunk
    // (2*ks) ^ ds_x (ks is a run-time loop index: no per-step register table).
    const unsigned ds_a0 = smem0 + kOffDS + (qw_q + lane % 16) * kPRowBytes;
    const int ds_x = (lane / 16) ^ (lane & 7);
    // P^T / dS^T A operand (dK / dV): stored rows (queries) lane%8 + 8*(lane/16), key chunks of
    // this warp's keys kw_k + 16*mt: chunk kw_k/8 + 2*mt + (lane/8)%2.
    unsigned pt_addr[2];
    {
        const int r = (lane % 8) + 8 * (lane / 16);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
            pt_addr[mt] = smem0 + kOffP + r * kPRowBytes
                        + (swizzle_chunk<BlockN / 8>(r, kw_k / 8 + 2 * mt + (lane / 8) % 2) << 4);
    }

    for (int it = 0; it < n_iter; ++it) {
        const int slot = Stages == 1 ? 0 : it % Stages;
        if constexpr (Stages == 1) {
            if (it > 0) __syncthreads();   // every warp is done with the previous tile
            load_iter(it);
            cp_async_commit();
            cp_async_wait<0>();
            __syncthreads();
        } else {
            cp_async_wait<Stages - 2>();
            __syncthreads();   // tile it visible; every warp is done with tile it-1 (Q, dO, P, dS)
            if (it + Stages - 1 < n_iter) load_iter(it + Stages - 1);
            cp_async_commit();
        }
        const int m_start = (m_first + it % per_head) * BlockM;
        const int rows_q = min(BlockM, seqlen_q - m_start);
        const unsigned offQ = kOffQ + slot * kTileQ;
        const unsigned offDO = kOffDO + slot * kTileQ;
        if constexpr (V::kAlibi) smod.set_head(fp, head_k * group + it / per_head, batch);
        if constexpr (V::kDropout) drop.set_head(fp, head_k * group + it / per_head, batch);
        const bool need_mask = (rows_k < BlockN) || (rows_q < BlockM) ||
                               (V::kCausal && m_start + blk.diag < n0 + BlockN - 1) ||
                               (V::kLocal && !rk.tile_full(m_start, BlockM, n0, BlockN));
        const int causal_off = n0 - m_start - blk.diag;   // causal: query q sees key k iff q >= k + causal_off

        const float* lse_s = reinterpret_cast<const float*>(smem_raw + kOffLse) + slot * BlockM;
        const float* d_s = reinterpret_cast<const float*>(smem_raw + kOffD) + slot * BlockM;

        // ---- S = Q K^T and dP = dO V^T (16 queries x 32 keys per warp), then P and dS ----
        {
            float acc_s[4][4];
            float acc_p[4][4];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    acc_s[nt][e] = 0.f;
                    acc_p[nt][e] = 0.f;
                }
            const unsigned q_off = offQ + sw_q * kRowBytes;
            const unsigned o_off = offDO + sw_q * kRowBytes;
            const unsigned k_off = sw_k * kRowBytes;
            // k-steps in groups of 4 (one 8-chunk swizzle group); the group loop stays rolled.
#pragma unroll 1
            for (int grp = 0; grp < KD / 4; ++grp) {
                const unsigned gb = static_cast<unsigned>(grp) << 7;
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) {
                    unsigned aq[4], ao[4];
                    ldmatrix_x4(aq, a_cols.at(kk, q_off) + gb);
                    ldmatrix_x4(ao, a_cols.at(kk, o_off) + gb);
#pragma unroll
                    for (int nn = 0; nn < 2; ++nn) {
                        unsigned b[4];
                        ldmatrix_x4(b, b_cols.at(kk, k_off + nn * 16 * kRowBytes) + gb);
                        mma_m16n8k16<T>(acc_s[2 * nn], aq, b[0], b[1]);
                        mma_m16n8k16<T>(acc_s[2 * nn + 1], aq, b[2], b[3]);
                        ldmatrix_x4(b, b_cols.at(kk, kOffV + k_off + nn * 16 * kRowBytes) + gb);
                        mma_m16n8k16<T>(acc_p[2 * nn], ao, b[0], b[1]);
                        mma_m16n8k16<T>(acc_p[2 * nn + 1], ao, b[2], b[3]);
                    }
                }
            }
            // Thread (g, t) holds rows sw_q + g (e = 0, 1) and sw_q + g + 8 (e = 2, 3), keys
            // sw_k + 8*nt + 2t + (e & 1).
            float lse2[2], dd[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                lse2[h] = lse_s[sw_q + g + 8 * h] * kLog2e;
                dd[h] = d_s[sw_q + g + 8 * h];
            }
            T* sP = reinterpret_cast<T*>(smem_raw + kOffP);
            T* sdS = reinterpret_cast<T*>(smem_raw + kOffDS);
            // dropout: this lane's keep bytes of its 2 rows x 8 keys of the warp's 16 x 32 tile
            [[maybe_unused]] uint4 keepw;
            if constexpr (V::kDropout) keepw = drop.frag(m_start + sw_q + g, n0 + sw_k, t);
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int h = e >> 1;
                    const int r = sw_q + g + 8 * h;
                    const int c = sw_k + nt * 8 + 2 * t + (e & 1);
                    float sv = acc_s[nt][e];
                    float dcap = 1.f;
                    if constexpr (V::kSoftcap || V::kAlibi) sv = smod.apply(sv, m_start + r, n0 + c, dcap);
                    float p = exp2_fast(fmaf(sv, scale_log2, -lse2[h]));
                    if (need_mask) {
                        // The variant's rule (variant.cuh RowKeys) on absolute positions.
                        const bool ok = r < rows_q && c < rows_k && (!V::kCausal || r >= c + causal_off) &&
                                        (!V::kLocal || (n0 + c < rk.hi(m_start + r) && n0 + c >= rk.lo(m_start + r)));
                        p = ok ? p : 0.f;
                    }
                    float dpv = acc_p[nt][e];
                    if constexpr (V::kDropout) {   // dV takes Z o P, dS = P o (Z o dP - D)
                        const float z = attn_variant::DropoutMask<V>::frag_keep(keepw, h, nt, e & 1) ? drop.scale : 0.f;
                        dpv *= z;
                        acc_s[nt][e] = p * z;
                    } else {
                        acc_s[nt][e] = p;
                    }
                    float ds = p * (dpv - dd[h]);
                    if constexpr (V::kSoftcap) ds *= dcap;   // d(c·tanh(x/c)): dS · (1 − tanh²)
                    acc_p[nt][e] = ds;
                }
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int off = swizzle_offset<BlockN>(sw_q + g + 8 * h, sw_k + nt * 8 + 2 * t);
                    *reinterpret_cast<unsigned*>(sP + off) = Tr::pack2(acc_s[nt][2 * h], acc_s[nt][2 * h + 1]);
                    *reinterpret_cast<unsigned*>(sdS + off) = Tr::pack2(acc_p[nt][2 * h], acc_p[nt][2 * h + 1]);
                }
            }
        }
        __syncthreads();   // P and dS complete

        auto dkdv_products = [&]() {
        // ---- dV += P^T dO, dK += dS^T Q (32 keys x kCols columns per warp) ----
#pragma unroll (kDkdvUnroll)
        for (int kk = 0; kk < BlockM / 16; ++kk) {
            unsigned pa[2][4], da[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                ldmatrix_x4_trans(pa[mt], pt_addr[mt] + kk * 16 * kPRowBytes);
                ldmatrix_x4_trans(da[mt], pt_addr[mt] + (kOffDS - kOffP) + kk * 16 * kPRowBytes);
            }
#pragma unroll
            for (int dn = 0; dn < NC / 2; ++dn) {
                unsigned b[4];
                ldmatrix_x4_trans(b, a_cols.at(dn, offDO + kk * 16 * kRowBytes) + cw_bytes);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    mma_m16n8k16<T>(acc_dv[mt][2 * dn], pa[mt], b[0], b[1]);
                    mma_m16n8k16<T>(acc_dv[mt][2 * dn + 1], pa[mt], b[2], b[3]);
                }
                ldmatrix_x4_trans(b, a_cols.at(dn, offQ + kk * 16 * kRowBytes) + cw_bytes);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    mma_m16n8k16<T>(acc_dk[mt][2 * dn], da[mt], b[0], b[1]);
                    mma_m16n8k16<T>(acc_dk[mt][2 * dn + 1], da[mt], b[2], b[3]);
                }
            }
        }

        };
        dkdv_products();
        // ---- dQ_tile = dS K (32 queries x kCols columns per warp), added to dq_accum ----
        if constexpr (WithDQ) {
            const int hq = head_k * group + it / per_head;
            float* gdQ = params.dq_accum
                + slice_off<true>(sq, batch, hq, params.dqa_batch_stride, params.dqa_row_stride,
                                  params.dqa_head_stride)
                + static_cast<long long>(m_start) * params.dqa_row_stride;
            // kDqPasses passes over the warp's columns (fewer live accumulators next to dK/dV);
            // unrolled: the pass's column chunks are XOR-swizzled inside the warp's 8-chunk
            // group, so its ldmatrix addresses come from LdsmCols steps, not a byte offset.
#pragma unroll
            for (int pass = 0; pass < kDqPasses; ++pass) {
                float acc_q[2][kDqCols / 8][4];
                zero_frags(acc_q);
#pragma unroll (kDqUnroll)
                for (int ks = 0; ks < BlockN / 16; ++ks) {
                    unsigned a[2][4];
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt)
                        ldmatrix_x4(a[mt], ds_a0 + mt * 16 * kPRowBytes + (((2 * ks) ^ ds_x) << 4));
#pragma unroll
                    for (int dn = 0; dn < kDqCols / 16; ++dn) {
                        unsigned b[4];
                        ldmatrix_x4_trans(b, a_cols.at(pass * (kDqCols / 16) + dn, ks * 16 * kRowBytes) + cw_bytes);
#pragma unroll
                        for (int mt = 0; mt < 2; ++mt) {
                            mma_m16n8k16<T>(acc_q[mt][2 * dn], a[mt], b[0], b[1]);
                            mma_m16n8k16<T>(acc_q[mt][2 * dn + 1], a[mt], b[2], b[3]);
                        }
                    }
                }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
                if constexpr (kStage) {
                    // Per m16 tile, in chunks of kSR rows (2 KiB per warp): the warp's rows x
                    // kDqCols columns into its slice (row r, 16-byte chunk c at c ^ (r & 7)), then
                    // read back row-contiguous: lane l takes chunk l % kCh of rows
                    // i * (32 / kCh) + l / kCh, one red.v4 per 4 cache lines (4 rows x 32 columns
                    // or 2 rows x 64 columns).
                    constexpr int kCh = kDqCols / 4;      // 16-byte chunks per staged row
                    constexpr int kSR = 512 / kDqCols;    // rows per staged chunk
                    constexpr int kHPer = kSR / 8;        // accumulator row halves per chunk
                    const unsigned sb = smem0 + kOffStage + warp * 2048;
                    const int col0 = cw + pass * kDqCols;
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
                        for (int hc = 0; hc < 2 / kHPer; ++hc) {
#pragma unroll
                            for (int nt = 0; nt < kDqCols / 8; ++nt)
#pragma unroll
                                for (int hh = 0; hh < kHPer; ++hh) {
                                    const int h = hc * kHPer + hh;
                                    const int r = g + 8 * hh;
                                    const unsigned a = sb + r * (kCh * 16) + ((((2 * nt + (t >> 1)) ^ (r & 7))) << 4)
                                                     + 8 * (t & 1);
                                    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n"
                                                 :: "r"(a), "f"(acc_q[mt][nt][2 * h]), "f"(acc_q[mt][nt][2 * h + 1])
                                                 : "memory");
                                }
                            __syncwarp();
                            const int c = lane % kCh;
                            const int col = col0 + 4 * c;
#pragma unroll
                            for (int i = 0; i < 4; ++i) {
                                const int r = i * (32 / kCh) + lane / kCh;
                                float4 v;
                                asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                                             : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                                             : "r"(sb + r * (kCh * 16) + ((c ^ (r & 7)) << 4)) : "memory");
                                const int row = qw_q + mt * 16 + hc * 8 + r;
                                if (row < rows_q && col < head_dim)
                                    red_add_v4_f32(gdQ + static_cast<long long>(row) * params.dqa_row_stride + col,
                                                   v.x, v.y, v.z, v.w);
                            }
                            __syncwarp();
                        }
                    }
                } else
#endif
                {
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int nt = 0; nt < kDqCols / 8; ++nt) {
                        const int col = cw + pass * kDqCols + nt * 8;   // n8 tile: all or no columns < head_dim
                        const bool col_ok = col < head_dim;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
                        // Lane pair (t, t^1) exchanges halves: even t adds row g, columns
                        // 4*(t/2) .. +3; odd t adds row g+8, the same columns.
                        const bool odd = (t & 1) != 0;
                        const float s0 = odd ? acc_q[mt][nt][0] : acc_q[mt][nt][2];
                        const float s1 = odd ? acc_q[mt][nt][1] : acc_q[mt][nt][3];
                        const float r0 = __shfl_xor_sync(0xffffffffu, s0, 1);
                        const float r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
                        const int row = qw_q + mt * 16 + g + (odd ? 8 : 0);
                        if (col_ok && row < rows_q) {
                            float* p = gdQ + static_cast<long long>(row) * params.dqa_row_stride + col + 4 * (t >> 1);
                            if (odd) red_add_v4_f32(p, r0, r1, acc_q[mt][nt][2], acc_q[mt][nt][3]);
                            else     red_add_v4_f32(p, acc_q[mt][nt][0], acc_q[mt][nt][1], r0, r1);
                        }
#else
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const int row = qw_q + mt * 16 + g + 8 * h;
                            if (col_ok && row < rows_q) {
                                float* p = gdQ + static_cast<long long>(row) * params.dqa_row_stride + col + 2 * t;
                                red_add_f32(p, acc_q[mt][nt][2 * h]);
                                red_add_f32(p + 1, acc_q[mt][nt][2 * h + 1]);
                            }
                        }
#endif
                    }
                }
            }
        }
    }
    cp_async_wait<0>();   // only empty groups can remain
    __syncthreads();      // every warp is done with K, V

    // ---- epilogue: dV, dK = scale * acc through the K/V tiles, 16-byte stores ----
    const float scale = fp.softmax_scale;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = kw_k + mt * 16 + g + 8 * h;
#pragma unroll
            for (int nt = 0; nt < NC; ++nt) {
                const int off = swizzle_offset<HeadDim>(r, cw + nt * 8 + 2 * t);
                *reinterpret_cast<unsigned*>(sV + off) =
                    Tr::pack2(acc_dv[mt][nt][2 * h], acc_dv[mt][nt][2 * h + 1]);
                *reinterpret_cast<unsigned*>(sK + off) =
                    Tr::pack2(acc_dk[mt][nt][2 * h] * scale, acc_dk[mt][nt][2 * h + 1] * scale);
            }
        }
    __syncthreads();
    store_dv<BlockN, HeadDim, kThreads>(params, blk, sV, tid);
    store_dk<BlockN, HeadDim, kThreads>(params, blk, sK, tid);
}

}  // namespace attn_bwd_detail
}  // namespace ferroattn
