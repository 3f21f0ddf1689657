// ferroattn — attention backward, dK/dV kernel, sm80 family (mma.sync + ldmatrix + cp.async).
//
// What: for one key tile [n0, n0 + BlockN) of one kv head, the gradients of FlashAttention-2
// (paper §3.2, Alg. 2) with P recomputed from Q, K and the forward's LSE:
//   P  = exp2(S * scale_log2 - LSE * log2(e)),  S = Q K^T   (LSE natural log; +inf -> P = 0)
//   dV = sum P^T dO,   dP = dO V^T,   dS = P o (dP - D),   dK = softmax_scale * sum dS^T Q
// summed over every query head of the kv head's GQA group (heads h_k*g .. h_k*g + g - 1,
// g = num_heads / num_heads_k; a fixed order, no atomics for dK/dV) and over every query tile
// that can see the key tile. WithDQ: dS K of each query tile is added, unscaled, to the fp32
// dq_accum with red.global.add (the convert kernel multiplies by softmax_scale). Causal masks
// are bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q (per sequence in
// varlen), so the loop starts at the query tile holding row max(0, n0 - (seqlen_k - seqlen_q)).
// Masked pairs (key >= seqlen_k, query >= seqlen_q, causal) get P = dS = 0. Keys no query sees
// (causal, seqlen_q == 0) get dK = dV = 0 written. Rows of dK/dV >= seqlen_k and columns
// >= head_dim are not written.
//
// Layouts (see attention/bwd_params.cuh, attention/params.cuh): padded q/dout/dq_accum
// (b, s_q, h, d), k/v/dk/dv (b, s_k, h_k, d), lse/softmax_d (b, h, s_q); varlen (total, h, d),
// lse/softmax_d (h, total_q), sequence b at rows [cu_seqlens[b], cu_seqlens[b+1]) (clamped as
// in the forward). Every tensor has its own strides (elements, last dim contiguous); 16-bit
// tensors need 16-byte aligned bases and row/head/batch strides (multiples of 8 elements);
// dq_accum needs 16-byte aligned base and strides that are multiples of 4 (sm_90 adds 4 floats at
// a time). All offsets are 64-bit.
//
// Launch: grid (ceil(max_seqlen_k / BlockN), num_heads_k, batch), block NumWarps*32 threads,
// dynamic shared memory attn_bwd_dkdv_sm80_smem_bytes<...>() =
// (2*BlockN*HeadDim + 2*Stages*BlockM*HeadDim + NDs*BlockN*BlockM) * 2 + Stages*BlockM*8 bytes,
// NDs = 2 with WithDQ and HeadDim <= 128, else 1, plus BlockM*HeadDim*4 where the dQ reductions
// are staged (attn_bwd_dkdv_sm80_dq_stage: sm_90, WithDQ, HeadDim 64 or 128)
// (the DkDv formula of AttnBwdConfig::smem_bytes in src/tuning/attention_bwd.rs); above 48 KiB
// the caller raises CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES. WithDQ: dq_accum zeroed
// before the launch (preprocess kernel).
//
// Template parameters and constraints:
//   HeadDim  kernel head dim, multiple of 32 in [32, 256]; params.fwd.head_dim (multiple of 8,
//            <= HeadDim) is the real one: other columns load as 0 and are not written.
//   BlockM   query rows per pipeline tile, multiple of 32 (the dS^T tile is swizzled by rows of
//            BlockM/8 >= 4 chunks).
//   BlockN   keys per block, a multiple of 16*NumWarps: warp w owns keys [w*kWarpN, (w+1)*kWarpN),
//            kWarpN = BlockN / NumWarps (MT = kWarpN/16 m16 tiles).
//   NumWarps warps per block; NumWarps and BlockM/16 divide one another (dQ work split).
//   Stages   >= 1 buffers of (Q, dO, LSE, D) query tiles; tile it+Stages-1 is fetched while tile
//            it is computed. Stages == 1 (small shared memory GPUs) loads, then computes.
//   V        the variant (attention/variant.cuh): the mask bounds the query tiles of a key
//            block (bwd_dkdv_block.cuh) and the pairs of a tile; softcap and ALiBi modify each
//            recomputed score (the ALiBi slope follows the GQA loop's query head); with softcap
//            dS takes the factor 1 − tanh², recovered from P (ScoreMod::dcap_from_p). Sinks
//            need nothing here (the forward's LSE includes them).
//   WithDK / WithDV   compute and write dK / dV (at least one). WithDQ: add dS K to dq_accum.
//            dS (and the V tile product dP) is computed only with WithDK or WithDQ.
//   T        __half or __nv_bfloat16; lse, softmax_d and dq_accum are fp32.
//   DqDirect (default false) the wide kernel's dQ reductions unstaged on sm_90 too
//            (attn_bwd_dkdv_wide_dq_stage in bwd_dkdv_wide_sm80.cuh); false elsewhere.
// Kernel head dim 256 with WithDK and WithDV (attn_bwd_dkdv_sm80_wide) is forwarded to the
// single-pass wide kernel attention/bwd_dkdv_wide_sm80.cuh (64 x 64 tiles on 8 warps, its own
// shared-memory formula); everything below describes the other specialisations.
// Design ("warps own keys"): each warp computes S^T = K_w Q^T directly (A = its K rows by
// ldmatrix, B = Q rows by ldmatrix), so P^T sits in the mma accumulator layout and repacks
// straight into the A operand of dV += P^T dO (B = dO by ldmatrix.trans); likewise dP^T = V_w dO^T
// and dS^T = P^T o (dP^T - D) is the A operand of dK += dS^T Q (B = Q by ldmatrix.trans). The
// per-query LSE and D come from small fp32 shared arrays staged with the Q/dO tile (cp.async,
// 4 bytes, zero-filled past seqlen_q). WithDQ: each warp stores its dS^T (as T) into a swizzled
// BlockN x BlockM shared tile; after a barrier the warps split dQ_tile = dS K (A = dS by
// ldmatrix.trans of the stored dS^T, B = K by ldmatrix.trans; key loop unrolled for
// HeadDim <= 128) over query m16 tiles and column ranges, and add it to dq_accum (sm_90:
// red.global.add.v4.f32 after one lane-pair exchange; older: scalar red.global.add.f32). dK/dV
// stay in fp32 registers for the whole block (HeadDim registers per thread per m16 tile for
// both: head dims > 128 run split, see dkdv_split()) and are written at the end through the K/V tiles as 16-byte stores. With two dS^T buffers
// (HeadDim <= 128) the barrier that opens query tile it also completes tile it-1's dS^T: the
// warps run the dQ product of tile it-1 first, then tile it (one barrier per tile); with one
// buffer, dQ follows a second barrier inside the tile.
// A query tile is processed in sub-tiles of kSubM queries when the S^T and dP^T accumulators
// next to dK/dV would pass a register budget (kAccBudget).
// Shared memory: K, V (BlockN x HeadDim), Stages x (Q, dO) (BlockM x HeadDim), NDs x dS^T
// (BlockN x BlockM), Stages x (LSE*1, D) (BlockM fp32 each); 16-bit tiles XOR-swizzled in 16-byte chunks
// (common/swizzle.cuh): ldmatrix, cp.async and the dS^T stores are conflict-free.
// Registers: the production configurations compile without spills for sm_80 and sm_90a
// (bench/NOTES.md, "Backward").
//
// PTX features: mma.sync.aligned.m16n8k16 f16/bf16 -> f32, ldmatrix.x4(.trans), cp.async.cg (16 B)
// and cp.async.ca (4 B) with src-size zero fill, commit/wait_group, ex2.approx,
// red.global.add.f32 (sm_90: red.global.add.v4.f32). Needs sm_80 or newer.
#pragma once
#include "common/dtype.cuh"
#include "common/ptx.cuh"
#include "common/swizzle.cuh"
#include "attention/bwd_params.cuh"
#include "attention/fwd_sm80.cuh"
#include "attention/bwd_dkdv_block.cuh"

namespace ferroattn {

// dS^T tiles in shared memory: two with WithDQ and HeadDim <= 128 (the dQ product of query
// tile it-1 runs after the barrier that opens tile it, reading the other buffer: one barrier
// per tile), else one (dQ after a second barrier; head dims > 128 spill with two; without
// WithDQ the tile is unused, kept so that the layout does not depend on the flag otherwise).
template <int HeadDim, bool WithDQ>
__host__ __device__ constexpr int attn_bwd_dkdv_sm80_ds_bufs() {
    return (WithDQ && HeadDim <= 128) ? 2 : 1;
}

// dQ reductions staged through shared memory (sm_90, kernel head dims 64 and 128, WithDQ): each
// warp writes its fp32 dQ partial (16 query rows x its dQ columns) to its own slice of a
// BlockM x HeadDim fp32 staging tile and reads it back row-contiguous, so that one
// red.global.add.v4.f32 of the warp covers 2 rows x 64 columns (4 cache lines, 4 L2 requests)
// instead of 16 rows x 8 columns (16 lines, 8 L2 requests): 4x fewer L2 requests, +4-6 % on H200
// (bench/NOTES.md "Backward v6"). The staging tile adds BlockM*HeadDim*4 bytes of shared memory.
template <int HeadDim, bool WithDQ>
__host__ __device__ constexpr bool attn_bwd_dkdv_sm80_dq_stage() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
    return WithDQ && (HeadDim == 64 || HeadDim == 128);
#else
    return false;
#endif
}

template <int HeadDim, int BlockM, int BlockN, int Stages, bool WithDQ>
__host__ __device__ constexpr int attn_bwd_dkdv_sm80_smem_bytes() {
    return (2 * BlockN * HeadDim + 2 * Stages * BlockM * HeadDim
            + attn_bwd_dkdv_sm80_ds_bufs<HeadDim, WithDQ>() * BlockN * BlockM) * 2
         + Stages * BlockM * 8
         + (attn_bwd_dkdv_sm80_dq_stage<HeadDim, WithDQ>() ? BlockM * HeadDim * 4 : 0);
}

namespace attn_bwd_detail {

// dq_accum[p] += v (fire-and-forget reduction in L2).
__device__ __forceinline__ void red_add_f32(float* p, float v) {
    asm volatile("red.global.add.f32 [%0], %1;\n"
                 :: "l"(__cvta_generic_to_global(p)), "f"(v) : "memory");
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// dq_accum[p .. p+3] += (a, b, c, d); p 16-byte aligned. sm_90+.
__device__ __forceinline__ void red_add_v4_f32(float* p, float a, float b, float c, float d) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n"
                 :: "l"(__cvta_generic_to_global(p)), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}
#endif

// Zero an mma accumulator: A × B fragments of 4 fp32 values per thread.
template <int A, int B>
__device__ __forceinline__ void zero_frags(float (&acc)[A][B][4]) {
#pragma unroll
    for (int a = 0; a < A; ++a)
#pragma unroll
        for (int b = 0; b < B; ++b)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[a][b][e] = 0.f;
}

}  // namespace attn_bwd_detail
}  // namespace ferroattn

#include "attention/bwd_dkdv_wide_sm80.cuh"

namespace ferroattn {

template <int HeadDim, int BlockM, int BlockN, int NumWarps, int Stages, class V,
          bool WithDK, bool WithDV, bool WithDQ, typename T, bool DqDirect = false>
__global__ void __launch_bounds__(NumWarps * 32) attn_bwd_dkdv_sm80(const AttnBwdParams params) {
    if constexpr (attn_bwd_dkdv_sm80_wide<HeadDim, WithDK, WithDV>()) {
        // HeadDim 256 with dK and dV: the single-pass wide kernel (bwd_dkdv_wide_sm80.cuh).
        attn_bwd_detail::dkdv_wide<HeadDim, BlockM, BlockN, NumWarps, Stages, V, WithDQ, T, DqDirect>(params);
    } else {
    static_assert(!DqDirect, "DqDirect: the wide kernel only");
    static_assert(HeadDim % 32 == 0 && HeadDim >= 32 && HeadDim <= 256,
                  "HeadDim must be a multiple of 32 in [32, 256]");
    static_assert(BlockM % 32 == 0 && BlockM >= 32, "BlockM must be a multiple of 32");
    static_assert(NumWarps >= 1 && BlockN % (16 * NumWarps) == 0,
                  "BlockN must be a multiple of 16 * NumWarps");
    static_assert(NumWarps % (BlockM / 16) == 0 || (BlockM / 16) % NumWarps == 0,
                  "NumWarps and BlockM/16 must divide one another");
    static_assert(Stages >= 1, "Stages must be >= 1");
    static_assert(WithDK || WithDV, "at least one of dK, dV");
    static_assert(sizeof(T) == 2, "T must be __half or __nv_bfloat16");
    static_assert(attn_bwd_dkdv_sm80_smem_bytes<HeadDim, BlockM, BlockN, Stages, WithDQ>() <= 227 * 1024,
                  "tile does not fit in 227 KiB of shared memory");

    constexpr int kThreads = NumWarps * 32;
    constexpr int kWarpN = BlockN / NumWarps;   // keys per warp
    constexpr int MT = kWarpN / 16;             // m16 key tiles per warp
    constexpr bool kDS = WithDK || WithDQ;      // dP and dS needed
    // Queries per compute step: the largest of BlockM, 64, 32, 16 dividing BlockM whose S^T
    // (and dP^T) accumulators fit next to dK/dV within kAccBudget fp32 registers per thread.
    // Two key tiles per warp (MT = 2) need more registers for fragments and addresses, and the
    // single-stage loop (loads issued inside the loop) for its addresses: both spill at 192. Head
    // dims below 128 ending in a 4-chunk swizzle group (d = 96) carry 4 more address registers
    // (LdsmCols tail) and spill even at 160.
    // The variants' terms (dropout's keep words, softcap, ALiBi, the window's bounds) take the
    // place of 32 of them.
    constexpr bool kVariantTerms = V::kDropout || V::kSoftcap || V::kAlibi || V::kLocal;
    constexpr int kAccBudget = (HeadDim % 64 != 0 && HeadDim < 128) ? 128
                             : (MT >= 2 || Stages == 1 || kVariantTerms) ? 160 : 192;
    constexpr int kAccFixed = MT * HeadDim / 2 * ((WithDK ? 1 : 0) + (WithDV ? 1 : 0));
    constexpr int kAccPerQ = MT * (kDS ? 2 : 1);   // registers per 2 queries of the step
    constexpr int kSubM =
        (kAccFixed + kAccPerQ * BlockM / 2 <= kAccBudget) ? BlockM
        : (BlockM % 64 == 0 && kAccFixed + kAccPerQ * 32 <= kAccBudget) ? 64
        : (kAccFixed + kAccPerQ * 16 <= kAccBudget) ? 32 : 16;
    constexpr int NQ = kSubM / 8;        // n8 query tiles per step
    constexpr int KD = HeadDim / 16;     // k16 steps over the head dim
    constexpr int DT = HeadDim / 8;      // n8 tiles of dK / dV
    constexpr unsigned kRowBytes = HeadDim * 2;
    constexpr unsigned kDsRowBytes = BlockM * 2;
    constexpr unsigned kTileKV = BlockN * kRowBytes;
    constexpr unsigned kTileQ = BlockM * kRowBytes;
    // Shared-memory map (bytes from the start of the dynamic buffer).
    constexpr unsigned kOffV = kTileKV;
    constexpr unsigned kOffQ = 2 * kTileKV;
    constexpr unsigned kOffDO = kOffQ + Stages * kTileQ;
    constexpr unsigned kOffDS = kOffDO + Stages * kTileQ;
    constexpr int kDsBufs = attn_bwd_dkdv_sm80_ds_bufs<HeadDim, WithDQ>();
    constexpr unsigned kTileDS = BlockN * kDsRowBytes;
    constexpr unsigned kOffLse = kOffDS + kDsBufs * kTileDS;
    constexpr unsigned kOffD = kOffLse + Stages * BlockM * 4;
    constexpr bool kStage = attn_bwd_dkdv_sm80_dq_stage<HeadDim, WithDQ>();
    constexpr unsigned kOffStage = kOffD + Stages * BlockM * 4;   // kStage: BlockM x HeadDim fp32
    static_assert(kOffStage + (kStage ? BlockM * HeadDim * 4 : 0) ==
                  static_cast<unsigned>(attn_bwd_dkdv_sm80_smem_bytes<HeadDim, BlockM, BlockN, Stages, WithDQ>()),
                  "shared-memory map and formula disagree");
    using Tr = DTypeTraits<T>;
    const AttnFwdParams& fp = params.fwd;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sK = reinterpret_cast<T*>(smem_raw);
    T* sV = reinterpret_cast<T*>(smem_raw + kOffV);
    T* sdS = reinterpret_cast<T*>(smem_raw + kOffDS);
    const float* sLse = reinterpret_cast<const float*>(smem_raw + kOffLse);
    const float* sD = reinterpret_cast<const float*>(smem_raw + kOffD);
    const unsigned smem0 = smem_u32(smem_raw);

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int t = lane % 4;

    attn_bwd_detail::DkdvBlock blk;
    if (!attn_bwd_detail::dkdv_block<BlockM, BlockN, V>(fp, blk)) return;   // past seqlen_k
    // The block's fields as the kernel's locals, which its lambdas capture one by one (as
    // before bwd_dkdv_block.cuh: using blk.* in the body changes the SASS).
    const attn_bwd_detail::BwdSeq& sq = blk.sq;
    const int head_k = blk.head_k, batch = blk.batch, seqlen_q = blk.seqlen_q, n0 = blk.n0;
    const int rows_k = blk.rows_k, head_dim = blk.head_dim, group = blk.group, diag = blk.diag;
    const int m_first = blk.m_first, per_head = blk.per_head, n_iter = blk.n_iter;
    if (n_iter <= 0) {
        attn_bwd_detail::store_dkdv_zero<BlockN, HeadDim, kThreads, WithDK, WithDV, T>(params, blk, tid);
        return;
    }
    const attn_variant::RowKeys<V> rk(fp, seqlen_q, blk.seqlen_k);
    attn_variant::ScoreMod<V> smod(fp, head_k * group, batch, seqlen_q, blk.seqlen_k);
    attn_variant::DropoutMask<V> drop(fp, head_k * group, batch);

    // ---- K and V tiles (once per block), then the first query tiles ----
    attn_bwd_detail::load_kv_tiles<BlockN, HeadDim, kThreads>(fp, blk, sK, sV, tid);
    constexpr attn_bwd_detail::DkdvSmemMap kMap{kOffQ, kOffDO, kOffLse, kOffD};
    auto load_iter = [&](int it) {
        attn_bwd_detail::load_query_tile<BlockM, HeadDim, kThreads, Stages, kDS, T>(params, blk, it, kMap,
                                                                                  smem_raw, smem0, tid);
    };
    attn_bwd_detail::query_pipe_prologue<Stages>(load_iter, n_iter);

    float acc_dk[MT][DT][4];
    float acc_dv[MT][DT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                acc_dk[mt][dt][e] = 0.f;
                acc_dv[mt][dt][e] = 0.f;
            }

    const float scale_log2 = fp.softmax_scale_log2;
    constexpr float kLog2e = 1.4426950408889634f;
    const int key0 = warp * kWarpN;                     // first key (tile row) of this warp
    const unsigned key_bytes = key0 * kRowBytes;
    // ldmatrix lane addresses (see LdsmCols), all relative to the start of shared memory:
    // t_cols: row lane%16, chunk 2*step + lane/16. A operand (K or V rows of this warp, 16x16:
    //   a0..a3), and, .trans, the B operand of a 16-row x 16-column block (Q, dO, K rows:
    //   b0, b1 of columns 0-7, then b0, b1 of columns 8-15).
    // b_cols: row (lane%8) + 8*(lane/16), chunk 2*step + (lane/8)%2: the B operand of S^T / dP^T
    //   from 16 Q / dO rows (b0, b1 of queries 0-7, then of queries 8-15: mma register pairs).
    const LdsmCols<HeadDim / 8> t_cols(smem0 + (lane % 16) * kRowBytes, lane, lane / 16);
    const LdsmCols<HeadDim / 8> b_cols(smem0 + ((lane % 8) + 8 * (lane / 16)) * kRowBytes, lane,
                                       (lane / 8) % 2);

    // acc[mt][nt] += A_w (warp's 16*MT rows of the K or V tile at a_off) x B^T (kSubM rows of
    // the Q or dO tile at b_off), contracted over the head dim.
    auto gemm_nt = [&](float (&acc)[MT][NQ][4], unsigned a_off, unsigned b_off) {
        auto step = [&](int kk, unsigned group_bytes) {
            unsigned a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                ldmatrix_x4(a[mt], t_cols.at(kk, a_off + key_bytes + mt * 16 * kRowBytes) + group_bytes);
#pragma unroll
            for (int nn = 0; nn < NQ / 2; ++nn) {
                unsigned b[4];
                ldmatrix_x4(b, b_cols.at(kk, b_off + nn * 16 * kRowBytes) + group_bytes);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_m16n8k16<T>(acc[mt][2 * nn], a[mt], b[0], b[1]);
                    mma_m16n8k16<T>(acc[mt][2 * nn + 1], a[mt], b[2], b[3]);
                }
            }
        };
        // k-steps in groups of 4 (one 8-chunk swizzle group each), the group loop kept rolled
        // so that ptxas cannot hoist every fragment load of the contraction at once; then the
        // steps of a trailing 4-chunk group (HeadDim % 64 == 32).
        constexpr int kGroups = (HeadDim / 8 & ~7) / 8;
#pragma unroll 1
        for (int grp = 0; grp < kGroups; ++grp) {
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) step(kk, static_cast<unsigned>(grp) << 7);
        }
#pragma unroll
        for (int kk = kGroups * 4; kk < KD; ++kk) step(kk, 0u);
    };
    // acc[mt][dt] += X^T (the warp's kSubM-column slab in registers, packed from x) x B (kSubM
    // rows of the Q or dO tile at b_off, read .trans).
    // is_p: x is P^T with the dropout mask in its sign (Dropout): the product takes Z o P,
    // Z = keep / (1 - p).
    auto gemm_tn = [&](float (&acc)[MT][DT][4], const float (&x)[MT][NQ][4], unsigned b_off, bool is_p = false) {
        auto xv = [&](float v) {
            if constexpr (V::kDropout) return is_p ? (v > 0.f ? v * drop.scale : 0.f) : v;
            return v;
        };
#pragma unroll
        for (int kk = 0; kk < kSubM / 16; ++kk) {
            unsigned pa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                pa[mt][0] = Tr::pack2(xv(x[mt][2 * kk][0]), xv(x[mt][2 * kk][1]));
                pa[mt][1] = Tr::pack2(xv(x[mt][2 * kk][2]), xv(x[mt][2 * kk][3]));
                pa[mt][2] = Tr::pack2(xv(x[mt][2 * kk + 1][0]), xv(x[mt][2 * kk + 1][1]));
                pa[mt][3] = Tr::pack2(xv(x[mt][2 * kk + 1][2]), xv(x[mt][2 * kk + 1][3]));
            }
#pragma unroll
            for (int dn = 0; dn < KD; ++dn) {
                unsigned b[4];
                ldmatrix_x4_trans(b, t_cols.at(dn, b_off + kk * 16 * kRowBytes));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_m16n8k16<T>(acc[mt][2 * dn], pa[mt], b[0], b[1]);
                    mma_m16n8k16<T>(acc[mt][2 * dn + 1], pa[mt], b[2], b[3]);
                }
            }
        }
    };

    // ---- dQ of one query tile (head hq, rows [m_start, m_start + rows_q)): dQ_tile = dS K (dS^T from the shared buffer at ds_off), added to
    // dq_accum. The caller guarantees a barrier between the dS^T stores and this call. ----
    auto dq_phase = [&](int hq, int m_start, int rows_q, unsigned ds_off) {
        {
            constexpr int kQT = BlockM / 16;                                 // m16 query tiles
            constexpr int kQG = 1;                                           // m16 query tiles per warp group
            constexpr int kQGroups = kQT / kQG;
            constexpr int kDqSplit = NumWarps >= kQGroups ? NumWarps / kQGroups : 1;   // warps per query group
            constexpr int kQTPerWarp = NumWarps >= kQGroups ? 1 : kQGroups / NumWarps;
            constexpr int kDqCols = HeadDim / kDqSplit;                      // columns per warp
            static_assert(kDqCols % 16 == 0, "dQ column split must give multiples of 16 columns");
            constexpr int kDqChunk = (kDqCols <= 64) ? kDqCols
                                   : (kDqCols % 64 == 0) ? 64
                                   : (kDqCols % 32 == 0) ? 32 : 16;        // columns per pass
            constexpr int kDqUnroll = HeadDim <= 128 ? BlockN / 16 : 1;
            const int dq_col0 = kDqSplit == 1 ? 0 : (warp / kQGroups) * kDqCols;
            float* gdQ = params.dq_accum
                + attn_bwd_detail::slice_off<true>(sq, batch, hq, params.dqa_batch_stride,
                                                   params.dqa_row_stride, params.dqa_head_stride)
                + static_cast<long long>(m_start) * params.dqa_row_stride;
            // A operand (dS, 16 queries x 16 keys) from the stored dS^T, .trans: key row
            // (lane%8) + 8*(lane/16), query chunk 2*qt + (lane/8)%2.
            const int arow = (lane % 8) + 8 * (lane / 16);
#pragma unroll
            for (int qi = 0; qi < kQTPerWarp; ++qi) {
                const int qg = NumWarps >= kQGroups ? warp % kQGroups : warp + qi * NumWarps;
                unsigned a_addr[kQG];
#pragma unroll
                for (int u = 0; u < kQG; ++u)
                    a_addr[u] = smem0 + ds_off + arow * kDsRowBytes
                        + (swizzle_chunk<BlockM / 8>(arow, 2 * (qg * kQG + u) + (lane / 8) % 2) << 4);
#pragma unroll
                for (int c0 = 0; c0 < kDqCols; c0 += kDqChunk) {
                    float acc_q[kQG][kDqChunk / 8][4];
#pragma unroll
                    for (int u = 0; u < kQG; ++u)
#pragma unroll
                    for (int nt = 0; nt < kDqChunk / 8; ++nt)
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc_q[u][nt][e] = 0.f;
                    // Unrolled (ldmatrix of key step ks+1 overlaps the mma of ks) where the
                    // registers allow it: head dims <= 128; the larger ones spill unrolled.
#pragma unroll (kDqUnroll)
                    for (int ks = 0; ks < BlockN / 16; ++ks) {
                        unsigned a[kQG][4];
#pragma unroll
                        for (int u = 0; u < kQG; ++u) ldmatrix_x4_trans(a[u], a_addr[u] + ks * 16 * kDsRowBytes);
#pragma unroll
                        for (int j = 0; j < kDqChunk / 16; ++j) {
                            // B operand (K rows ks*16 .. +15, columns dq_col0 + c0 + 16j ..), .trans.
                            unsigned addr;
                            if constexpr (kDqSplit == 1 || kDqCols % 64 == 0) {
                                // The warp's column offset is a whole number of 8-chunk
                                // swizzle groups: a plain byte offset.
                                addr = t_cols.at((c0 / 16) + j, ks * 16 * kRowBytes) + dq_col0 * 2;
                            } else {
                                const int kr = lane % 16;
                                const int chunk = (dq_col0 + c0) / 8 + 2 * j + lane / 16;
                                addr = smem0 + (ks * 16 + kr) * kRowBytes
                                     + (swizzle_chunk<HeadDim / 8>(kr, chunk) << 4);
                            }
                            unsigned b[4];
                            ldmatrix_x4_trans(b, addr);
#pragma unroll
                            for (int u = 0; u < kQG; ++u) {
                                mma_m16n8k16<T>(acc_q[u][2 * j], a[u], b[0], b[1]);
                                mma_m16n8k16<T>(acc_q[u][2 * j + 1], a[u], b[2], b[3]);
                            }
                        }
                    }
#pragma unroll
                    for (int u = 0; u < kQG; ++u) {
                    const int qt = qg * kQG + u;
#pragma unroll
                    for (int nt = 0; nt < kDqChunk / 8; ++nt) {
                        const int col = dq_col0 + c0 + nt * 8;   // n8 tile: all or no columns < head_dim
                        const bool col_ok = col < head_dim;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
                        if constexpr (kStage) {
                            // Into the warp's staging slice: 16 rows x kDqCols fp32, 16-byte chunk c
                            // of row r at chunk c ^ (r & 7) (the st.shared.v2 of a half-warp hit 4 of
                            // 8 chunk slots: 2-way bank conflicts, NOTES v6); rows g and g+8 share
                            // the swizzle. Lane (g, t) holds columns 8nt + 2t, +1: chunk
                            // 2nt + t/2, half t%2. Addresses from a volatile %tid read, so that none
                            // is hoisted out of the main loop into a register.
                            static_assert(kQG == 1 && kQTPerWarp == 1 && kDqChunk == kDqCols && kDqCols % 32 == 0,
                                          "staged dQ reduction: one dQ pass of >= 32 columns per warp");
                            const int vt = tid_x_volatile();
                            const int vg = (vt % 32) / 4, vq = vt % 4;
                            const unsigned a = smem_u32(smem_raw) + kOffStage + (vt / 32) * (16 * kDqCols * 4)
                                             + vg * (kDqCols * 4) + (((2 * nt) ^ ((vq >> 1) ^ (vg & 7))) << 4)
                                             + 8 * (vq & 1);
                            asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n"
                                         :: "r"(a), "f"(acc_q[u][nt][0]), "f"(acc_q[u][nt][1]) : "memory");
                            asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n"
                                         :: "r"(a + 8 * kDqCols * 4), "f"(acc_q[u][nt][2]), "f"(acc_q[u][nt][3])
                                         : "memory");
                            (void)col_ok;
                            continue;
                        }
                        // Lane pair (t, t^1) exchanges halves: even t adds row g, columns
                        // 4*(t/2) .. +3; odd t adds row g+8, the same columns.
                        const bool odd = (t & 1) != 0;
                        const float s0 = odd ? acc_q[u][nt][0] : acc_q[u][nt][2];
                        const float s1 = odd ? acc_q[u][nt][1] : acc_q[u][nt][3];
                        const float r0 = __shfl_xor_sync(0xffffffffu, s0, 1);
                        const float r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
                        const int row = qt * 16 + g + (odd ? 8 : 0);
                        if (col_ok && row < rows_q) {
                            float* p = gdQ + static_cast<long long>(row) * params.dqa_row_stride
                                     + col + 4 * (t >> 1);
                            if (odd) attn_bwd_detail::red_add_v4_f32(p, r0, r1, acc_q[u][nt][2], acc_q[u][nt][3]);
                            else     attn_bwd_detail::red_add_v4_f32(p, acc_q[u][nt][0], acc_q[u][nt][1], r0, r1);
                        }
#else
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const int row = qt * 16 + g + 8 * h;
                            if (col_ok && row < rows_q) {
                                float* p = gdQ + static_cast<long long>(row) * params.dqa_row_stride
                                         + col + 2 * t;
                                attn_bwd_detail::red_add_f32(p, acc_q[u][nt][2 * h]);
                                attn_bwd_detail::red_add_f32(p + 1, acc_q[u][nt][2 * h + 1]);
                            }
                        }
#endif
                    }
                    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
                    if constexpr (kStage) {
                        // Read back row-contiguous: lane l takes chunk l % kCh of rows
                        // i*kRowsPerI + l / kCh; one red.v4 per warp covers kRowsPerI whole rows
                        // of the warp's columns. Lane / warp from a volatile %tid read (nothing
                        // hoisted out of the main loop).
                        __syncwarp();
                        constexpr int kCh = kDqCols / 4;        // 16-byte chunks per staged row
                        constexpr int kRowsPerI = 32 / kCh;     // rows per warp instruction
                        const int vtid = tid_x_volatile();
                        const int vl = vtid % 32, vw = vtid / 32;
                        const int c = vl % kCh;
                        const int r0 = vl / kCh;
                        const int vqg = NumWarps >= kQGroups ? vw % kQGroups : vw;
                        const int col = (kDqSplit == 1 ? 0 : (vw / kQGroups) * kDqCols) + c0 + 4 * c;
                        float* p = gdQ + static_cast<long long>(vqg * 16 + r0) * params.dqa_row_stride + col;
                        const long long step = kRowsPerI * params.dqa_row_stride;
                        const unsigned sbase = smem_u32(smem_raw) + kOffStage + vw * (16 * kDqCols * 4);
#pragma unroll
                        for (int i = 0; i < 16 / kRowsPerI; ++i) {
                            const int r = i * kRowsPerI + r0;
                            float4 v;
                            asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                                         : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                                         : "r"(sbase + r * (kDqCols * 4) + ((c ^ (r & 7)) << 4)) : "memory");
                            if (vqg * 16 + r < rows_q && col < head_dim)
                                attn_bwd_detail::red_add_v4_f32(p, v.x, v.y, v.z, v.w);
                            p += step;
                        }
                        __syncwarp();   // the slice is rewritten only after the next tile's barrier; kept for clarity
                    }
#endif
                }
            }
        }
    };

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
            __syncthreads();   // tile it visible; every warp is done with tile it-1 and its dS
            if (it + Stages - 1 < n_iter) load_iter(it + Stages - 1);
            cp_async_commit();
        }
        // Double-buffered dS^T: the barrier above made tile it-1's dS^T complete, and every
        // warp is past the dQ of tile it-2, the last reader of the buffer tile it writes.
        if constexpr (WithDQ && kDsBufs == 2) {
            if (it > 0) {
                const int ip = it - 1;
                const int m_prev = (m_first + ip % per_head) * BlockM;
                dq_phase(head_k * group + ip / per_head, m_prev, min(BlockM, seqlen_q - m_prev),
                         kOffDS + (ip & 1) * kTileDS);
            }
        }
        const int hq = head_k * group + it / per_head;
        const int m_start = (m_first + it % per_head) * BlockM;
        const int rows_q = min(BlockM, seqlen_q - m_start);
        const unsigned offQ = kOffQ + slot * kTileQ;
        const unsigned offDO = kOffDO + slot * kTileQ;
        const float* lse_s = sLse + slot * BlockM;
        const float* d_s = sD + slot * BlockM;
        // Masking needed: key tail, query tail, or a causal pair not seen inside the tile.
        if constexpr (V::kAlibi) smod.set_head(fp, hq, batch);
        if constexpr (V::kDropout) drop.set_head(fp, hq, batch);
        // Masking needed: key tail, query tail, or a pair the variant hides inside the tile.
        const bool need_mask = (rows_k < BlockN) || (rows_q < BlockM) ||
                               (V::kCausal && m_start + diag < n0 + BlockN - 1) ||
                               (V::kLocal && !rk.tile_full(m_start, BlockM, n0, BlockN));
        const int causal_off = n0 - m_start - diag;   // causal: query q sees key k iff q >= k + causal_off
        const int ds_elem = kDsBufs == 2 ? (it & 1) * (BlockN * BlockM) : 0;   // this tile's dS^T

#pragma unroll 1
        for (int sub = 0; sub < BlockM / kSubM; ++sub) {
            const unsigned q_sub = sub * kSubM * kRowBytes;
            // ---- S^T = K_w Q_sub^T, then P^T ----
            float acc_s[MT][NQ][4];
            attn_bwd_detail::zero_frags(acc_s);
            gemm_nt(acc_s, 0u, offQ + q_sub);
            // Mask: key row kr keeps query columns [lo, hi) of the tile: hi = rows_q (0 for a
            // key past seqlen_k), lo = kr + causal_off (causal) or 0; a local window bounds both
            // by the rows that see key n0 + kr (variant.cuh RowKeys). Relative to this thread's
            // first column in the step (sub*kSubM + 2t), element (nt, e) is column nt*8 + (e&1).
            int lo[MT][2], hi[MT][2];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int kr = key0 + mt * 16 + g + 8 * h;
                    const int q0 = sub * kSubM + 2 * t;
                    hi[mt][h] = (kr < rows_k ? rows_q : 0) - q0;
                    lo[mt][h] = V::kCausal ? kr + causal_off - q0 : -q0;
                    if constexpr (V::kLocal) {
                        const long long first = rk.first_row(n0 + kr) - m_start;
                        const long long last = rk.last_row_plus1(n0 + kr, seqlen_q) - m_start;
                        lo[mt][h] = static_cast<int>(min(max(first, 0LL), static_cast<long long>(BlockM))) - q0;
                        hi[mt][h] = min(hi[mt][h],
                                        static_cast<int>(min(max(last, 0LL), static_cast<long long>(BlockM))) - q0);
                    }
                }
            // Dropout: the keep bytes of this lane's queries (n8 tiles nt, nt + 1) x keys (m16
            // tiles mt, mt + 1), two units per pair shared with lane ^ 4 (variant.cuh frag_t);
            // a warp of one m16 key tile holds half of each unit (frag_t16).
            using Drop = attn_variant::DropoutMask<V>;
            constexpr bool kDropPairs = MT % 2 == 0;
            [[maybe_unused]] typename Drop::TFrag tf[V::kDropout && kDropPairs ? MT / 2 : 1];
            [[maybe_unused]] typename Drop::TFrag16 tf16;
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt) {
                if constexpr (V::kDropout) {
                    if (nt % 2 == 0) {
                        const int q0 = m_start + sub * kSubM + nt * 8;
                        if constexpr (kDropPairs) {
#pragma unroll
                            for (int mp = 0; mp < MT / 2; ++mp) tf[mp] = drop.frag_t(q0, n0 + key0 + mp * 32, t, g);
                        } else {
                            static_assert(kDropPairs || MT == 1, "dropout: 16 or an even number of m16 key tiles per warp");
                            tf16 = drop.frag_t16(q0, n0 + key0, t, g);
                        }
                    }
                }
                const float2 l = *reinterpret_cast<const float2*>(lse_s + sub * kSubM + nt * 8 + 2 * t);
                const float l0 = l.x * kLog2e;
                const float l1 = l.y * kLog2e;
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float sv = acc_s[mt][nt][e];
                        if constexpr (V::kSoftcap || V::kAlibi)
                            sv = smod.apply(sv, m_start + sub * kSubM + nt * 8 + 2 * t + (e & 1),
                                            n0 + key0 + mt * 16 + g + 8 * (e >> 1));
                        float p = exp2_fast(fmaf(sv, scale_log2, (e & 1) ? -l1 : -l0));
                        if (need_mask) {
                            const int c = nt * 8 + (e & 1);
                            p = (c >= lo[mt][e >> 1] && c < hi[mt][e >> 1]) ? p : 0.f;
                        }
                        // Dropout: the sign carries the mask (P >= 0; a dropped P is stored as -P).
                        if constexpr (V::kDropout) {
                            const bool kept = kDropPairs ? Drop::tfrag_keep(tf[mt / 2], e & 1, nt & 1, mt & 1, e >> 1)
                                                         : Drop::tfrag16_keep(tf16, e & 1, nt & 1, e >> 1);
                            p = kept ? p : -p;
                        }
                        acc_s[mt][nt][e] = p;
                    }
            }
            // ---- dV += P^T dO_sub ----
            if constexpr (WithDV) gemm_tn(acc_dv, acc_s, offDO + q_sub, true);
            if constexpr (kDS) {
                // ---- dP^T = V_w dO_sub^T, dS^T = P^T o (dP^T - D) ----
                float acc_p[MT][NQ][4];
                attn_bwd_detail::zero_frags(acc_p);
                gemm_nt(acc_p, kOffV, offDO + q_sub);
#pragma unroll
                for (int nt = 0; nt < NQ; ++nt) {
                    const float2 dd = *reinterpret_cast<const float2*>(d_s + sub * kSubM + nt * 8 + 2 * t);
                    float2 l2 = make_float2(0.f, 0.f);
                    if constexpr (V::kSoftcap) {
                        l2 = *reinterpret_cast<const float2*>(lse_s + sub * kSubM + nt * 8 + 2 * t);
                        l2.x *= kLog2e;
                        l2.y *= kLog2e;
                    }
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            float pv = acc_s[mt][nt][e];
                            float dpv = acc_p[mt][nt][e];
                            if constexpr (V::kDropout) {   // dS = P o (Z o dP - D)
                                dpv = pv > 0.f ? dpv * drop.scale : 0.f;
                                pv = fabsf(pv);
                            }
                            float ds = pv * (dpv - ((e & 1) ? dd.y : dd.x));
                            if constexpr (V::kSoftcap)   // d(c·tanh(x/c)): dS · (1 − tanh²)
                                ds *= smod.dcap_from_p(pv, (e & 1) ? l2.y : l2.x,
                                                       m_start + sub * kSubM + nt * 8 + 2 * t + (e & 1),
                                                       n0 + key0 + mt * 16 + g + 8 * (e >> 1));
                            acc_p[mt][nt][e] = ds;
                        }
                }
                // ---- dK += dS^T Q_sub ----
                if constexpr (WithDK) gemm_tn(acc_dk, acc_p, offQ + q_sub);
                // ---- dS^T (as T) into the shared tile for dQ ----
                if constexpr (WithDQ) {
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            int r = key0 + mt * 16 + g + 8 * h;
                            int tq = t;
                            if constexpr (kStage && (V::kMasked || V::kSoftcap || V::kAlibi) && HeadDim == 128) {
                                // Rows / lanes from a volatile %tid read: the NQ x 2 store offsets
                                // are not held through the loop (the causal staged d128 kernel spills
                                // 32 bytes otherwise).
                                const int vtd = tid_x_volatile();
                                r = (vtd / 32) * kWarpN + mt * 16 + (vtd % 32) / 4 + 8 * h;
                                tq = vtd % 4;
                            }
#pragma unroll
                            for (int nt = 0; nt < NQ; ++nt) {
                                *reinterpret_cast<unsigned*>(
                                    sdS + ds_elem + swizzle_offset<BlockM>(r, sub * kSubM + nt * 8 + 2 * tq)) =
                                    Tr::pack2(acc_p[mt][nt][2 * h], acc_p[mt][nt][2 * h + 1]);
                            }
                        }
                }
            }
        }

        if constexpr (WithDQ && kDsBufs == 1) {
            __syncthreads();   // dS^T tile complete
            dq_phase(hq, m_start, rows_q, kOffDS);
        }
    }
    if constexpr (WithDQ && kDsBufs == 2) {
        __syncthreads();   // dS^T of the last tile complete
        const int il = n_iter - 1;
        const int m_last = (m_first + il % per_head) * BlockM;
        dq_phase(head_k * group + il / per_head, m_last, min(BlockM, seqlen_q - m_last),
                 kOffDS + (il & 1) * kTileDS);
    }
    cp_async_wait<0>();   // only empty groups can remain
    __syncthreads();      // every warp is done with K, V (dQ reads all of K)

    // ---- epilogue: dV, dK = scale * acc through the K/V tiles, 16-byte stores ----
    const float scale = fp.softmax_scale;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = key0 + mt * 16 + g + 8 * h;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                const int off = swizzle_offset<HeadDim>(r, dt * 8 + 2 * t);
                if constexpr (WithDV)
                    *reinterpret_cast<unsigned*>(sV + off) =
                        Tr::pack2(acc_dv[mt][dt][2 * h], acc_dv[mt][dt][2 * h + 1]);
                if constexpr (WithDK)
                    *reinterpret_cast<unsigned*>(sK + off) =
                        Tr::pack2(acc_dk[mt][dt][2 * h] * scale, acc_dk[mt][dt][2 * h + 1] * scale);
            }
        }
    __syncthreads();
    if constexpr (WithDV) attn_bwd_detail::store_dv<BlockN, HeadDim, kThreads>(params, blk, sV, tid);
    if constexpr (WithDK) attn_bwd_detail::store_dk<BlockN, HeadDim, kThreads>(params, blk, sK, tid);
    }  // narrow kernel
}

}  // namespace ferroattn
