// ferroattn — attention backward, dK/dV/dQ kernel, sm90 family (sm_90a): TMA + mbarrier
// pipeline, warp-specialised, wgmma for all five products.
//
// What: the function of attn_bwd_dkdv_sm80<..., WithDK, WithDV, WithDQ = true> (bwd_dkdv_sm80.cuh)
// for one key tile [n0, n0 + 128) of one kv head: with P recomputed from Q, K and the forward's
// LSE (FlashAttention-2 paper §3.2, Alg. 2),
//   P = exp2(S * scale_log2 - LSE * log2(e)),  S = Q K^T   (LSE natural log; +inf -> P = 0)
//   dV = sum P^T dO,  dP = dO V^T,  dS = P o (dP - D),  dK = softmax_scale * sum dS^T Q,
//   dq_accum += dS K   (unscaled fp32; the convert kernel multiplies by softmax_scale)
// summed over every query head of the kv head's GQA group and every query tile that sees the
// key tile (bwd_dkdv_block.cuh: the same iteration order as the sm80 kernel), every variant of
// attention/variant.cuh (mask with skipped query tiles, softcap with its 1 - tanh^2 factor,
// ALiBi, dropout regenerating the forward's mask; sinks need nothing here). The design is
// FlashAttention-3's backward (Shah et al., 2024, §3 and appendix B.1), our own code: a producer
// warp loads K and V once and Q, dO (TMA) with LSE and D (plain loads) through a Stages-deep
// ring on mbarriers; two consumer warpgroups each own 64 keys of the tile and keep their dK and
// dV accumulators in registers for the whole block.
//
// Per query tile (64 rows) each consumer warpgroup issues
//   S^T  = K_w Q^T    (SS: A = its 64 K rows, K-major; B = Q, K-major)        64 x 64
//   dP^T = V_w dO^T   (SS, likewise)                                          64 x 64
// then, with P^T (and Z o P^T under dropout) and dS^T formed in registers in the accumulator
// layout and packed to 16 bits,
//   dV_w += (Z o P^T) dO   (RS: B = dO, MN-major)      dK_w += dS^T Q   (RS: B = Q, MN-major)
// and stores dS^T into a shared tile (keys x queries, 128-byte swizzle). After a barrier of both
// consumer warpgroups,
//   dQ = dS K   (SS: A = the dS^T tile read MN-major, B = K, MN-major)        64 x HeadDim
// at head dim 128 split by columns (warpgroup w: columns 64 w .. 64 w + 63), at head dim 64 by
// one warpgroup per tile, alternating; the fp32 result is staged in shared memory and added to
// dq_accum row by row with bulk reductions (cp.reduce.async.bulk .add.f32). dS^T has two
// buffers (tile it's dQ may still read one while tile it + 1 is written).
// Masked pairs (the variant's, and keys >= seqlen_k) get P = dS = 0. Query rows >= seqlen_q load
// as zero with LSE = +inf (P = 0). Keys no query sees get dK = dV = 0 written.
//
// Layouts: padded only (q/dout (b, s_q, h, d), k/v (b, s_k, h_k, d), lse/softmax_d (b, h, s_q)
// fp32, dq_accum (b, s_q, h, d) fp32 dense; dk/dv with their strides, written through
// bwd_dkdv_block.cuh's stores). q, k, v, dout are read only through the tensor maps of
// AttnBwdSm90Params (src/ops/attention_bwd/sm90.rs builds them): rank 4 (head dim, rows, heads,
// batch), 128-byte swizzle, boxes of 64 elements x 64 rows (q, dout) or 128 rows (k, v); columns
// past params.fwd.head_dim load as zero and are not written. dq_accum under DqTiled
// (src/ops/attention_bwd/sm90.rs `dq_accum_tiled_strides`; s_q a multiple of 64 and head_dim ==
// HeadDim): per (batch, head, 64-row query tile) HeadDim / 64 contiguous chunks of 4096 fp32,
// chunk c holding columns 64 c .. 64 c + 63 in the wgmma accumulator order: float4 j (j < 8) of
// consumer thread tid (warp w = tid / 32, g = tid % 32 / 4, t = tid % 4) at float (128 j + tid) * 4,
// its elements rows (16 w + g, 16 w + g + 8) x columns (8 j + 2 t, 8 j + 2 t + 1), row-major
// within the float4; tile (b, h, m) starts at b * dqa_batch_stride + h * dqa_head_stride + 64 m *
// dqa_row_stride (the row layout's formula with the strides of a (b, h, s_q, HeadDim) tensor).
// The convert kernel reads that order back (bwd_prep.cuh, Tiled).
//
// Launch: grid (ceil(s_k / 128), h_k, b) with b <= 65535, 384 threads, dynamic shared memory
// AttnBwdSm90Smem::kTotal bytes (the formula of AttnBwdConfig::smem_bytes for BwdKind::DkDvSm90
// in src/tuning/attention_bwd.rs); with dQ, dq_accum zeroed before (preprocess kernel). Warpgroup 0: the
// producer (setmaxnreg 24; its first warp works). Warpgroups 1, 2: consumers (setmaxnreg 240),
// keys 64 (wg - 1) .. + 63 of the tile.
//
// Template parameters: HeadDim 64 or 128 (the call's head dim <= HeadDim); Stages >= 2 query
// ring slots; V the variant; T __half or __nv_bfloat16; DqOverlap (default false) the order of a
// tile's last three products: false, dV and dK, wait, the barrier, then dQ and its reduction with
// no product in flight; true, dV, the dS^T store and the barrier, then dQ and dK issued together,
// dQ waited for and reduced while dK runs; Varlen (default false) the varlen layout: q, k, v, dout
// are (total, heads, head dim) and their maps rank 4 with one batch entry; a block's key tile and
// its query tiles start at the sequence's first rows (TMA loads past a sequence's end read the next
// sequence's rows, which the masks zero like key and query tails; everything else already follows
// bwd_dkdv_block.cuh's varlen geometry). A template argument, not a run-time test: the extra
// coordinates cost the padded kernels a spill at some variants. WithDq (default true): false
// leaves dQ out (the deterministic plan, whose dQ kernel writes dq itself): per tile S^T, dP^T,
// the scores, dV and dK only; no dS^T tile, no barrier between the warpgroups (each runs its keys
// alone), no dq_accum access; DqOverlap must then be false. DqTiled (default false; padded
// layout with dQ only): dq_accum in tiles instead of rows (below), one bulk reduction per
// warpgroup and tile instead of one per row. MaskWarps (default false; dropout only): the
// producer warpgroup's idle warps 1..3 form each slot's dropout keep words (the 32 keep bits of
// each consumer thread, the function the consumers otherwise evaluate themselves: Philox off the
// consumers' step) into the slot's 1 KiB, and arrive on its full barrier with warp 0.
//
// Shared memory (1024-aligned base): K, V (HeadDim / 64 chunks of 128 rows x 128 B each), the
// ring of Q and dO (Stages slots of HeadDim / 64 chunks of 64 rows x 128 B each), all in the
// canonical 128B-swizzle layout (16-byte chunk q of row r at q ^ (r % 8)); with dQ, two dS^T tiles
// (128 key rows x 64 queries x 2 B, swizzled likewise) and two dQ staging tiles (one per consumer
// warpgroup: 64 rows x 64 fp32, rows padded to 288 B); Stages x (LSE * log2(e), D) rows (64 fp32
// each); Stages x a TileInfo (16 B: the slot's query head, first row and dq_accum offset, written by
// the producer's lane 0 with the slot); with MaskWarps, Stages x 256 keep words (consumer thread
// cw * 128 + tid's at word cw * 128 + tid); mbarriers kv_full (count 1), full[Stages] (count 32:
// the producer warp's lanes after their LSE / D stores, lane 0 with the TMA bytes; with MaskWarps
// 128: also warps 1..3 after their keep words), empty[Stages] (count 8: lane 0 of each
// consumer warp once that slot's four products have completed) and stat_empty[Stages] (count 256:
// every consumer thread once its LSE / D (and keep word) loads of the slot are done; a thread's
// release orders its own loads only, so each arrives; warps 0..3 wait on it before refilling them).
// Epilogue: dV and softmax_scale * dK through the K / V tiles (common/swizzle.cuh layout) and
// store_dv / store_dk of bwd_dkdv_block.cuh.
//
// PTX features (sm_90a): wgmma.mma_async (SS incl. MN-major A, RS), cp.async.bulk.tensor.4d,
// cp.reduce.async.bulk.add.f32, mbarrier, setmaxnreg, named barriers, fence.proxy.async,
// ex2.approx, tanh.approx.
#pragma once
#include "common/dtype.cuh"
#include "common/ptx.cuh"
#include "common/swizzle.cuh"
#include "common/hopper.cuh"
#include "attention/bwd_params.cuh"
#include "attention/variant.cuh"
#include "attention/bwd_dkdv_block.cuh"

namespace ferroattn {

// Kernel parameters (mirror: `AttnBwdSm90Params` in src/ops/attention_bwd/sm90.rs; change both
// together): the backward's parameters after the four tensor maps.
struct AttnBwdSm90Params {
    TmaMap tma_q;    // q: dims (head_dim, s_q, h, b), box (64, 64, 1, 1)
    TmaMap tma_k;    // k: dims (head_dim, s_k, h_k, b), box (64, 128, 1, 1)
    TmaMap tma_v;    // v: like k
    TmaMap tma_do;   // dout: like q
    AttnBwdParams p;
};

// Shared-memory map of attn_bwd_sm90 (offsets from the 1024-aligned base); without dQ
// (WithDq false) the dS^T and staging tiles take no space.
template <int HeadDim, int Stages, bool WithDq = true, bool KeepWords = false>
struct AttnBwdSm90Smem {
    enum : unsigned {
        kBlockM = 64,
        kBlockN = 128,
        kChunks = HeadDim / 64,
        kKVChunk = kBlockN * 128u,          // 128 rows x 64 elements
        kKVBytes = kChunks * kKVChunk,
        kQChunk = kBlockM * 128u,           // 64 rows x 64 elements
        kQBytes = kChunks * kQChunk,        // one ring slot of Q (or dO)
        kDsBytes = kBlockN * kBlockM * 2u,  // dS^T: 128 key rows of 64 queries
        kStageRow = 64u * 4u + 32u,         // dQ staging row: 64 fp32 + 32 B (conflict-free v2 stores)
        kStageBytes = kBlockM * kStageRow,
        kOffV = kKVBytes,
        kOffQ = 2u * kKVBytes,
        kOffDO = kOffQ + Stages * kQBytes,
        kOffDS = kOffDO + Stages * kQBytes,
        kOffStage = kOffDS + (WithDq ? 2u : 0u) * kDsBytes,
        kOffLse = kOffStage + (WithDq ? 2u : 0u) * kStageBytes,
        kOffD = kOffLse + Stages * kBlockM * 4u,
        kOffInfo = kOffD + Stages * kBlockM * 4u,   // per slot: TileInfo (16 B)
        kOffKeep = kOffInfo + Stages * 16u,         // KeepWords: per slot 256 keep words (1 KiB)
        kBars = kOffKeep + (KeepWords ? Stages * 1024u : 0u),
        kTotal = kBars + 8u * (1u + 3u * Stages) + 1024u,
    };
    unsigned base;
    __device__ __forceinline__ explicit AttnBwdSm90Smem(const void* raw)
        : base((sm90::smem_addr(raw) + 1023u) & ~1023u) {}
    __device__ __forceinline__ unsigned k() const { return base; }
    __device__ __forceinline__ unsigned v() const { return base + kOffV; }
    __device__ __forceinline__ unsigned q(int s) const { return base + kOffQ + s * kQBytes; }
    __device__ __forceinline__ unsigned dout(int s) const { return base + kOffDO + s * kQBytes; }
    __device__ __forceinline__ unsigned ds(int b) const { return base + kOffDS + b * kDsBytes; }
    __device__ __forceinline__ unsigned stage(int w) const { return base + kOffStage + w * kStageBytes; }
    __device__ __forceinline__ unsigned lse(int s) const { return base + kOffLse + s * kBlockM * 4u; }
    __device__ __forceinline__ unsigned d(int s) const { return base + kOffD + s * kBlockM * 4u; }
    __device__ __forceinline__ unsigned info(int s) const { return base + kOffInfo + s * 16u; }
    __device__ __forceinline__ unsigned keep(int s) const { return base + kOffKeep + s * 1024u; }
    __device__ __forceinline__ unsigned kv_full() const { return base + kBars; }
    __device__ __forceinline__ unsigned full(int s) const { return base + kBars + 8u * (1 + s); }
    __device__ __forceinline__ unsigned empty(int s) const { return base + kBars + 8u * (1 + Stages + s); }
    __device__ __forceinline__ unsigned stat_empty(int s) const { return base + kBars + 8u * (1 + 2 * Stages + s); }
};

namespace attn_bwd_detail {

// global[gaddr .. + bytes) += shared[saddr .. + bytes) (fp32, in L2), tracked by this thread's
// bulk async-groups; both addresses 16-byte aligned, bytes a multiple of 16.
__device__ __forceinline__ void bulk_reduce_add_f32(float* gaddr, unsigned saddr, unsigned bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 :: "l"(__cvta_generic_to_global(gaddr)), "r"(saddr), "r"(bytes) : "memory");
}

__device__ __forceinline__ void st_shared_v4_f32(unsigned addr, float a, float b, float c, float d) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" :: "r"(addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

__device__ __forceinline__ void st_shared_f32(unsigned addr, float v) {
    asm volatile("st.shared.f32 [%0], %1;\n" :: "r"(addr), "f"(v) : "memory");
}

// What the producer tells the consumers about the query tile of a ring slot (written with the
// slot's LSE / D, read after its full barrier): the query head, the first query row and the
// offset of the tile's row 0 in dq_accum. The consumers then keep none of the block's geometry
// live through their loop.
struct TileInfo {
    int hq, m_start;
    long long dq_off;
};

__device__ __forceinline__ void st_shared_tile_info(unsigned addr, const TileInfo& ti) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(addr), "r"(ti.hq), "r"(ti.m_start), "r"(static_cast<unsigned>(ti.dq_off)),
                    "r"(static_cast<unsigned>(static_cast<unsigned long long>(ti.dq_off) >> 32)) : "memory");
}

__device__ __forceinline__ int2 ld_shared_v2_s32(unsigned addr) {
    int2 r;
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(r.x), "=r"(r.y) : "r"(addr) : "memory");
    return r;
}

__device__ __forceinline__ unsigned ld_shared_u32(unsigned addr) {
    unsigned r;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(r) : "r"(addr) : "memory");
    return r;
}

__device__ __forceinline__ long long ld_shared_s64(unsigned addr) {
    long long r;
    asm volatile("ld.shared.b64 %0, [%1];\n" : "=l"(r) : "r"(addr) : "memory");
    return r;
}

__device__ __forceinline__ float2 ld_shared_v2_f32(unsigned addr) {
    float2 r;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(r.x), "=f"(r.y) : "r"(addr) : "memory");
    return r;
}

}  // namespace attn_bwd_detail

template <int HeadDim, int Stages, class V, typename T, bool DqOverlap = false, bool Varlen = false,
          bool WithDq = true, bool DqTiled = false, bool MaskWarps = false>
__global__ void __launch_bounds__(384, 1) attn_bwd_sm90(const __grid_constant__ AttnBwdSm90Params P) {
    using namespace sm90;
    using Sm = AttnBwdSm90Smem<HeadDim, Stages, WithDq, MaskWarps>;
    using Tr = DTypeTraits<T>;
    using Drop = attn_variant::DropoutMask<V>;
    constexpr int BlockM = Sm::kBlockM;
    constexpr int BlockN = Sm::kBlockN;
    constexpr int KD = HeadDim / 16;   // k16 steps over the head dim (S^T, dP^T)
    constexpr int KQ = BlockM / 16;    // k16 steps over the query tile (dV, dK)
    constexpr int KN = BlockN / 16;    // k16 steps over the key tile (dQ)
    constexpr int NJ = BlockM / 8;     // 8-query chunks of S^T per thread row
    constexpr int DJ = HeadDim / 8;    // 8-column chunks of dK / dV
    // Head dim 128: both warpgroups compute dQ, one 64-column chunk each; 64: one warpgroup the
    // whole tile, alternating by tile.
    constexpr bool kDqSplit = HeadDim == 128;
    constexpr unsigned kDqChunk = 64u * 64u;   // fp32 of one warpgroup's dQ tile (DqTiled: one chunk)
    constexpr float kLog2e = 1.4426950408889634f;
    static_assert(HeadDim == 64 || HeadDim == 128, "HeadDim is 64 or 128");
    static_assert(Stages >= 2, "Stages >= 2");
    static_assert(WithDq || !DqOverlap, "DqOverlap orders the dQ product: only with WithDq");
    static_assert(!DqTiled || (WithDq && !Varlen), "DqTiled: the padded layout's dQ only");
    static_assert(!MaskWarps || V::kDropout, "MaskWarps: the dropout mask's keep words");
    static_assert(!DqTiled || kDqChunk * 4u <= Sm::kStageBytes, "a fragment-ordered chunk fits the staging tile");
    static_assert(sizeof(T) == 2, "T must be __half or __nv_bfloat16");
    static_assert(Sm::kTotal <= 227u * 1024u, "tiles do not fit in 227 KiB of shared memory");

    const AttnBwdParams& prm = P.p;
    const AttnFwdParams& fp = prm.fwd;
    attn_bwd_detail::DkdvBlock blk;
    if (!attn_bwd_detail::dkdv_block<BlockM, BlockN, V>(fp, blk)) return;   // past seqlen_k
    if (blk.n_iter <= 0) {
        attn_bwd_detail::store_dkdv_zero<BlockN, HeadDim, 384, true, true, T>(prm, blk, threadIdx.x);
        return;
    }
    const int n_iter = blk.n_iter;
    const int batch = blk.batch;
    const int seqlen_q = blk.seqlen_q;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const Sm sm(smem_raw);
    const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
    const int tid = threadIdx.x % 128;

    if (threadIdx.x == 0) {
        mbar_init(sm.kv_full(), 1);
#pragma unroll
        for (int s = 0; s < Stages; ++s) {
            mbar_init(sm.full(s), MaskWarps ? 128 : 32);
            mbar_init(sm.empty(s), 8);
            mbar_init(sm.stat_empty(s), 256);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        // ---- producer: the first warp ----
        setmaxnreg_dec<24>();
        if constexpr (MaskWarps) {
            if (tid >= 32) {
                // ---- the dropout mask: warps 1..3 form each slot's keep words ----
                // Consumer warp j (warpgroup j / 4, warp j % 4) is computed by warp 1 + j % 3, its
                // lanes as the consumer's lanes (frag_t16 trades bytes between lanes l, l ^ 4).
                const int mw = tid / 32 - 1, lane = tid % 32;
                const int g = lane / 4, t = lane % 4;
                Drop drop(fp, blk.head_k * blk.group, batch);
#pragma unroll 1
                for (int it = 0; it < n_iter; ++it) {
                    // the slot and its phase, the query head and tile, from `it` alone (no loop
                    // state beyond it: the warpgroup has 24 registers)
                    const int stage = it % Stages;
                    const unsigned phase = static_cast<unsigned>(it / Stages) & 1u;
                    drop.set_head(fp, blk.head_k * blk.group + it / blk.per_head, batch);
                    const int m_start = (blk.m_first + it % blk.per_head) * BlockM;
                    mbar_wait(sm.stat_empty(stage), phase ^ 1u);   // the slot's last keep words read
#pragma unroll 1
                    for (int j = mw; j < 8; j += 3) {
                        unsigned keep = 0u;
                        // One Philox call at a time, its round keys formed inside it (the keys
                        // made opaque per call).
#pragma unroll 1
                        for (int kk = 0; kk < BlockM / 16; ++kk) {
                            Drop d = drop;
                            asm volatile("" : "+r"(d.k0), "+r"(d.k1));
                            keep |= Drop::tfrag16_bits(d.frag_t16(m_start + 16 * kk, blk.n0 + (j / 4) * 64 + (j % 4) * 16, t, g))
                                    << (8 * kk);
                        }
                        st_shared_b32(sm.keep(stage) + static_cast<unsigned>(j * 32 + lane) * 4u, keep);
                    }
                    mbar_arrive(sm.full(stage));
                }
                return;
            }
        }
        if (tid < 32) {
            const int lane = tid;
            // The maps' coordinates of a row of the sequence and of the batch entry.
            auto q_row = [&](int r) { return Varlen ? blk.sq.q_row0 + r : r; };
            auto k_row = [&](int r) { return Varlen ? blk.sq.k_row0 + r : r; };
            const int coord = Varlen ? 0 : batch;
            if (lane == 0) {
                tma_prefetch_map(&P.tma_q);
                tma_prefetch_map(&P.tma_k);
                tma_prefetch_map(&P.tma_v);
                tma_prefetch_map(&P.tma_do);
                mbar_expect_tx(sm.kv_full(), 2 * Sm::kKVBytes);
#pragma unroll
                for (int c = 0; c < Sm::kChunks; ++c) {
                    tma_load_4d(sm.k() + c * Sm::kKVChunk, &P.tma_k, sm.kv_full(), c * 64, k_row(blk.n0), blk.head_k, coord);
                    tma_load_4d(sm.v() + c * Sm::kKVChunk, &P.tma_v, sm.kv_full(), c * 64, k_row(blk.n0), blk.head_k, coord);
                }
            }
            int stage = 0;
            unsigned phase = 0;
            for (int it = 0; it < n_iter; ++it) {
                const int hq = blk.head_k * blk.group + it / blk.per_head;
                const int m_start = (blk.m_first + it % blk.per_head) * BlockM;
                mbar_wait(sm.stat_empty(stage), phase ^ 1u);   // LSE / D of the slot's last use read
                mbar_wait(sm.empty(stage), phase ^ 1u);
                const long long l_off = attn_bwd_detail::slice_off<true>(blk.sq, batch, hq, fp.lse_batch_stride, 1,
                                                                         fp.lse_head_stride) + m_start;
#pragma unroll
                for (int r = lane; r < BlockM; r += 32) {
                    const bool ok = m_start + r < seqlen_q;
                    attn_bwd_detail::st_shared_f32(sm.lse(stage) + 4u * r, ok ? fp.lse[l_off + r] * kLog2e : FERROATTN_INF);
                    attn_bwd_detail::st_shared_f32(sm.d(stage) + 4u * r, ok ? prm.softmax_d[l_off + r] : 0.f);
                }
                if (lane == 0) {
                    const long long dq_off = attn_bwd_detail::slice_off<true>(blk.sq, batch, hq, prm.dqa_batch_stride,
                                                                              prm.dqa_row_stride, prm.dqa_head_stride)
                        + static_cast<long long>(m_start) * prm.dqa_row_stride;
                    attn_bwd_detail::st_shared_tile_info(sm.info(stage), attn_bwd_detail::TileInfo{hq, m_start, dq_off});
                    mbar_expect_tx(sm.full(stage), 2 * Sm::kQBytes);   // lane 0's arrival
#pragma unroll
                    for (int c = 0; c < Sm::kChunks; ++c) {
                        tma_load_4d(sm.q(stage) + c * Sm::kQChunk, &P.tma_q, sm.full(stage), c * 64, q_row(m_start), hq, coord);
                        tma_load_4d(sm.dout(stage) + c * Sm::kQChunk, &P.tma_do, sm.full(stage), c * 64, q_row(m_start), hq, coord);
                    }
                } else {
                    mbar_arrive(sm.full(stage));
                }
                if (++stage == Stages) {
                    stage = 0;
                    phase ^= 1u;
                }
            }
        }
        return;
    }

    // ---- consumers: warpgroup cw owns keys 64 cw .. 64 cw + 63 of the tile ----
    setmaxnreg_inc<240>();
    const int cw = wg - 1;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int t = lane % 4;
    const int key_t = cw * 64 + warp * 16 + g;   // this thread's tile keys: key_t (h = 0), key_t + 8 (h = 1)
    const int n0 = blk.n0;
    const int seqlen_k = blk.seqlen_k;

    // Descriptors (stage / buffer offsets added per use).
    const unsigned long long dk_a = wgmma_desc(sm.k() + cw * 8192u, 16u, 1024u);            // A of S^T
    const unsigned long long dv_a = wgmma_desc(sm.v() + cw * 8192u, 16u, 1024u);            // A of dP^T
    const unsigned long long dq_b = wgmma_desc(sm.q(0), 16u, 1024u);                        // B of S^T (K-major)
    const unsigned long long ddo_b = wgmma_desc(sm.dout(0), 16u, 1024u);                    // B of dP^T
    const unsigned long long dq_mn = wgmma_desc(sm.q(0), Sm::kQChunk, 1024u);               // B of dK (MN-major)
    const unsigned long long ddo_mn = wgmma_desc(sm.dout(0), Sm::kQChunk, 1024u);           // B of dV
    const unsigned long long dds_a = wgmma_desc(sm.ds(0), Sm::kDsBytes, 1024u);             // A of dQ (MN-major)
    const unsigned long long dk_mn =
        wgmma_desc(sm.k() + (kDqSplit ? cw * Sm::kKVChunk : 0u), Sm::kKVChunk, 1024u);     // B of dQ (MN-major)

    float acc_dk[HeadDim / 2], acc_dv[HeadDim / 2];
#pragma unroll
    for (int i = 0; i < HeadDim / 2; ++i) {
        acc_dk[i] = 0.f;
        acc_dv[i] = 0.f;
    }
    const attn_variant::RowKeys<V> rk(fp, seqlen_q, seqlen_k);
    attn_variant::ScoreMod<V> smod(fp, blk.head_k * blk.group, batch, seqlen_q, seqlen_k);
    Drop drop(fp, blk.head_k * blk.group, batch);
    const float scale_log2 = fp.softmax_scale_log2;
    // The warpgroup's keys all exist and every pair of a query tile is visible: no mask.
    const bool keys_full = n0 + cw * 64 + 64 <= seqlen_k;
    // The rows that see this thread's keys (h = 0, 1): [x, y), clamped to [0, seqlen_q + BlockM]
    // (a row of a query tile, in [0, seqlen_q + BlockM), compares with them as with the unclamped
    // bounds), y = 0 past seqlen_k. Fixed for the block.
    int2 key_rows[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int kr = n0 + key_t + 8 * h;
        const long long cap = static_cast<long long>(seqlen_q) + BlockM;
        key_rows[h].x = static_cast<int>(min(max(rk.first_row(kr), 0LL), cap));
        key_rows[h].y = kr < seqlen_k ? static_cast<int>(min(max(rk.last_row_plus1(kr, seqlen_q), 0LL), cap)) : 0;
        // Formed here, once: left to itself ptxas keeps their 64-bit inputs live into the loop.
        asm volatile("" : "+r"(key_rows[h].x), "+r"(key_rows[h].y));
    }

    // dQ = dS K of tile `it` (dS^T buffer it & 1) into acc_q (issued, committed; not waited).
    auto issue_dq = [&](float (&acc_q)[32], int it) {
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < KN; ++ks)
            wgmma_ss<T, 64, 1, 1>(acc_q, desc_at(dds_a, (it & 1) * static_cast<int>(Sm::kDsBytes) + ks * 2048),
                                  desc_at(dk_mn, ks * 2048), ks != 0);
        wgmma_commit();
    };
    // The completed dQ of query tile (hq, m_start), 64 rows x 64 columns fp32, through this
    // warpgroup's staging tile into dq_accum. Row layout: staged row by row, then bulk reductions
    // of a row each (rows < seqlen_q). DqTiled: staged in fragment order (float4 j of thread tid
    // at (128 j + tid) * 16 B: one warp's store covers 512 contiguous bytes), then ONE 16 KiB bulk
    // reduction into the tile's chunk, which is laid out the same way.
    auto reduce_dq = [&](const float (&acc_q)[32], long long dq_off, int m_start) {
        const unsigned stg = sm.stage(cw);
        if (warp == 0) bulk_wait_read<0>();   // the previous tile's reductions have read it
        named_barrier(2 + cw, 128);
        if constexpr (DqTiled) {
#pragma unroll
            for (int j = 0; j < 8; ++j)
                attn_bwd_detail::st_shared_v4_f32(stg + (static_cast<unsigned>(j) * 128u + static_cast<unsigned>(tid)) * 16u,
                                                  acc_q[4 * j], acc_q[4 * j + 1], acc_q[4 * j + 2], acc_q[4 * j + 3]);
        } else {
#pragma unroll
            for (int jj = 0; jj < 8; ++jj)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const unsigned row = static_cast<unsigned>(warp * 16 + g + 8 * h);
                    st_shared_v2_f32(stg + row * Sm::kStageRow + (8u * jj + 2u * t) * 4u, acc_q[4 * jj + 2 * h],
                                     acc_q[4 * jj + 2 * h + 1]);
                }
        }
        fence_proxy_async_smem();
        named_barrier(2 + cw, 128);
        if (warp == 0) {
            if constexpr (DqTiled) {
                if (lane == 0)
                    attn_bwd_detail::bulk_reduce_add_f32(prm.dq_accum + dq_off + (kDqSplit ? cw * kDqChunk : 0), stg,
                                                         kDqChunk * 4u);
            } else {
                const int col0 = kDqSplit ? cw * 64 : 0;
                const int cols = min(64, fp.head_dim - col0);
                if (cols > 0) {
                    float* gdq = prm.dq_accum + dq_off + col0;
#pragma unroll
                    for (int r = lane; r < BlockM; r += 32)
                        if (m_start + r < seqlen_q)
                            attn_bwd_detail::bulk_reduce_add_f32(gdq + static_cast<long long>(r) * prm.dqa_row_stride,
                                                                 stg + r * Sm::kStageRow, static_cast<unsigned>(cols) * 4u);
                }
            }
            bulk_commit();
        }
    };
    // Whether this warpgroup computes tile it's dQ (warpgroup-uniform).
    auto dq_here = [&](int it) { return kDqSplit || (it & 1) == cw; };

    // Per warpgroup and tile it: S^T and dP^T, the scores, dV and dK, dS^T stored, the barrier
    // that completes dS^T (both warpgroups), dQ and its reduction.
    mbar_wait(sm.kv_full(), 0u);
    int stage = 0;
    unsigned phase = 0;
#pragma unroll 1
    for (int it = 0; it < n_iter; ++it) {
        const int qoff = stage * static_cast<int>(Sm::kQBytes);

        // ---- S^T = K_w Q^T, dP^T = V_w dO^T (one group), then dQ of tile it - 1 ----
        float acc_s[BlockM / 2], acc_dp[BlockM / 2];
        mbar_wait(sm.full(stage), phase);
        const int2 hm = attn_bwd_detail::ld_shared_v2_s32(sm.info(stage));
        const int hq = hm.x, m_start = hm.y;
        if constexpr (V::kAlibi) smod.set_head(fp, hq, batch);
        if constexpr (V::kDropout) drop.set_head(fp, hq, batch);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < KD; ++ks) {
            const int c = ks / 4, kk = ks % 4;
            wgmma_ss<T, BlockM, 0, 0>(acc_s, desc_at(dk_a, c * Sm::kKVChunk + kk * 32),
                                      desc_at(dq_b, qoff + c * Sm::kQChunk + kk * 32), ks != 0);
        }
#pragma unroll
        for (int ks = 0; ks < KD; ++ks) {
            const int c = ks / 4, kk = ks % 4;
            wgmma_ss<T, BlockM, 0, 0>(acc_dp, desc_at(dv_a, c * Sm::kKVChunk + kk * 32),
                                      desc_at(ddo_b, qoff + c * Sm::kQChunk + kk * 32), ks != 0);
        }
        wgmma_commit();
        [[maybe_unused]] float acc_q[32];

        // Where a mask is needed, the visible queries of this thread's keys are [key_rows.x, key_rows.y).
        const bool need_mask = !keys_full || !rk.tile_full(m_start, BlockM, n0 + cw * 64, 64);

        // Dropout: this lane's keep bits of the tile (variant.cuh frag_t16, one unit per 16
        // queries, 8 bits each in one register), while S^T and dP^T run.
        [[maybe_unused]] unsigned keep = 0u;
        if constexpr (MaskWarps) {
            keep = attn_bwd_detail::ld_shared_u32(sm.keep(stage) + static_cast<unsigned>(cw * 128 + tid) * 4u);
        } else if constexpr (V::kDropout) {
#pragma unroll
            for (int kk = 0; kk < KQ; ++kk)
                keep |= Drop::tfrag16_bits(drop.frag_t16(m_start + 16 * kk, n0 + cw * 64 + warp * 16, t, g)) << (8 * kk);
        }

        wgmma_wait<0>();
        fence_accumulators(acc_s);
        fence_accumulators(acc_dp);
        // ---- P^T (Z o P^T under dropout) and dS^T = P^T o (dP^T - D) in one pass over the
        // accumulators, packed to the RS operands of dV += (Z o P^T) dO and dK += dS^T Q ----
        unsigned pa[KQ][4], da[KQ][4];
        {
            const unsigned lse_s = sm.lse(stage);
            const unsigned d_s = sm.d(stage);
            // Per k16 step (query chunks 2 kk, 2 kk + 1): form, then pack at once, so that the fp32
            // values die as their 16-bit operands appear.
#pragma unroll
            for (int kk = 0; kk < KQ; ++kk) {
#pragma unroll
                for (int jj = 2 * kk; jj < 2 * kk + 2; ++jj) {
                    const float2 l2 = attn_bwd_detail::ld_shared_v2_f32(lse_s + 4u * (8 * jj + 2 * t));
                    const float2 dd = attn_bwd_detail::ld_shared_v2_f32(d_s + 4u * (8 * jj + 2 * t));
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int idx = 4 * jj + 2 * h + e;
                            const int ql = 8 * jj + 2 * t + e;
                            const int qi = m_start + ql, kr = n0 + key_t + 8 * h;
                            float sv = acc_s[idx];
                            [[maybe_unused]] float dcap = 1.f;
                            if constexpr (V::kSoftcap) sv = smod.apply(sv, qi, kr, dcap);
                            else if constexpr (V::kAlibi) sv = smod.apply(sv, qi, kr);
                            float p = exp2_fast(fmaf(sv, scale_log2, e ? -l2.y : -l2.x));
                            if (need_mask) p = (qi >= key_rows[h].x && qi < key_rows[h].y) ? p : 0.f;
                            float dpv = acc_dp[idx];
                            float pz = p;
                            if constexpr (V::kDropout) {   // dV takes Z o P, dS = P o (Z o dP - D)
                                const bool kept = Drop::tbits16_keep(keep >> (8 * kk), e, jj & 1, h);
                                pz = kept ? p * drop.scale : 0.f;
                                dpv = kept ? dpv * drop.scale : 0.f;
                            }
                            float ds = p * (dpv - (e ? dd.y : dd.x));
                            if constexpr (V::kSoftcap) ds *= dcap;   // d(c tanh(x / c)) = 1 - tanh^2
                            acc_s[idx] = pz;
                            acc_dp[idx] = ds;
                        }
                }
                pa[kk][0] = Tr::pack2(acc_s[8 * kk + 0], acc_s[8 * kk + 1]);
                pa[kk][1] = Tr::pack2(acc_s[8 * kk + 2], acc_s[8 * kk + 3]);
                pa[kk][2] = Tr::pack2(acc_s[8 * kk + 4], acc_s[8 * kk + 5]);
                pa[kk][3] = Tr::pack2(acc_s[8 * kk + 6], acc_s[8 * kk + 7]);
                da[kk][0] = Tr::pack2(acc_dp[8 * kk + 0], acc_dp[8 * kk + 1]);
                da[kk][1] = Tr::pack2(acc_dp[8 * kk + 2], acc_dp[8 * kk + 3]);
                da[kk][2] = Tr::pack2(acc_dp[8 * kk + 4], acc_dp[8 * kk + 5]);
                da[kk][3] = Tr::pack2(acc_dp[8 * kk + 6], acc_dp[8 * kk + 7]);
            }
        }
        const long long dq_off = attn_bwd_detail::ld_shared_s64(sm.info(stage) + 8u);
        mbar_arrive(sm.stat_empty(stage));   // this thread's LSE / D / TileInfo loads of the slot are done
        fence_fragments(pa);
        fence_fragments(da);
        fence_accumulators(acc_dv);
        fence_accumulators(acc_dk);
        // dS^T of tile it into buffer it & 1 (key rows, 128-byte swizzle).
        auto store_ds = [&]() {
            const unsigned dsb = sm.ds(it & 1);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned r = static_cast<unsigned>(key_t + 8 * h);   // r % 8 == g
#pragma unroll
                for (int jj = 0; jj < NJ; ++jj)
                    st_shared_b32(dsb + r * 128u + ((static_cast<unsigned>(jj) ^ static_cast<unsigned>(g)) << 4) + 4u * t,
                                  da[jj / 2][(jj & 1) * 2 + h]);
            }
            fence_proxy_async_smem();
        };
        auto issue_dv = [&]() {
#pragma unroll
            for (int kk = 0; kk < KQ; ++kk) wgmma_rs<T, HeadDim, 1>(acc_dv, pa[kk], desc_at(ddo_mn, qoff + kk * 2048), 1);
        };
        auto issue_dk = [&]() {
#pragma unroll
            for (int kk = 0; kk < KQ; ++kk) wgmma_rs<T, HeadDim, 1>(acc_dk, da[kk], desc_at(dq_mn, qoff + kk * 2048), 1);
        };
        if constexpr (DqOverlap) {
            // dV, then (dS^T complete) dQ and dK together; dQ's reduction runs under dK.
            wgmma_fence();
            issue_dv();
            wgmma_commit();
            store_ds();
            named_barrier(1, 256);   // both warpgroups' dS^T rows of tile it are in
            // (Two branches, not one with two tests: ptxas serialises the wgmmas when the dQ
            // accumulators' state differs between the paths that meet before the reduction.)
            if (dq_here(it)) {
                issue_dq(acc_q, it);
                wgmma_fence();
                issue_dk();
                wgmma_commit();
                wgmma_wait<1>();   // dV and dQ of it are done; dK may still run
                fence_accumulators(acc_q);
                reduce_dq(acc_q, dq_off, m_start);
            } else {
                wgmma_fence();
                issue_dk();
                wgmma_commit();
            }
            wgmma_wait<0>();
            fence_accumulators(acc_dk);
            fence_accumulators(acc_dv);
            if (lane == 0) mbar_arrive(sm.empty(stage));   // Q, dO of this slot are no longer read
        } else {
            // (without dQ: dV and dK only, nothing shared with the other warpgroup)
            wgmma_fence();
            issue_dv();
            issue_dk();
            wgmma_commit();
            if constexpr (WithDq) store_ds();
            wgmma_wait<0>();   // dV, dK of it: their 16-bit operands die, the slot is free
            fence_accumulators(acc_dk);
            fence_accumulators(acc_dv);
            if (lane == 0) mbar_arrive(sm.empty(stage));   // Q, dO of this slot are no longer read
            if constexpr (WithDq) {
                named_barrier(1, 256);   // both warpgroups' dS^T rows of tile it are in
                // dQ of tile it (its accumulators do not fit next to S^T, dP^T, dK and dV at head dim 128:
                // issued with the next tile's scores or with dV, dK it spills; at head dim 64 the former
                // measured slower, bench/NOTES.md "Hopper backward").
                if (dq_here(it)) {
                    issue_dq(acc_q, it);
                    wgmma_wait<0>();
                    fence_accumulators(acc_q);
                    reduce_dq(acc_q, dq_off, m_start);
                }
            }
        }
        if (++stage == Stages) {
            stage = 0;
            phase ^= 1u;
        }
    }
    if (warp == 0) bulk_wait_read<0>();   // staging tiles stay valid until read

    // ---- epilogue: dV, softmax_scale * dK through the K / V tiles (swizzle.cuh layout) ----
    named_barrier(1, 256);   // both warpgroups are past their last product reading K and V
    unsigned char* base_ptr = smem_raw + (sm.base - smem_addr(smem_raw));
    T* sK = reinterpret_cast<T*>(base_ptr);
    T* sV = reinterpret_cast<T*>(base_ptr + Sm::kOffV);
    const float scale = fp.softmax_scale;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = key_t + 8 * h;
#pragma unroll
        for (int jj = 0; jj < DJ; ++jj) {
            const int off = swizzle_offset<HeadDim>(r, jj * 8 + 2 * t);
            *reinterpret_cast<unsigned*>(sV + off) = Tr::pack2(acc_dv[4 * jj + 2 * h], acc_dv[4 * jj + 2 * h + 1]);
            *reinterpret_cast<unsigned*>(sK + off) =
                Tr::pack2(acc_dk[4 * jj + 2 * h] * scale, acc_dk[4 * jj + 2 * h + 1] * scale);
        }
    }
    named_barrier(1, 256);
    const int ctid = threadIdx.x - 128;
    // The block's geometry again (not kept live through the loop, where registers are short).
    attn_bwd_detail::DkdvBlock eb;
    attn_bwd_detail::dkdv_block<BlockM, BlockN, V>(fp, eb);
    attn_bwd_detail::store_dv<BlockN, HeadDim, 256>(prm, eb, sV, ctid);
    attn_bwd_detail::store_dk<BlockN, HeadDim, 256>(prm, eb, sK, ctid);
    if (warp == 0) bulk_wait_all();
}

}  // namespace ferroattn
