// ferroattn — dense GEMM for Hopper (sm_90a), "ping-pong" schedule: the same contract, params,
// operand layouts, TMA maps and epilogue as kernels/gemm/sm90.cuh (read its header first), but
// each consumer warpgroup owns a whole BM x BN tile, so one warpgroup's epilogue runs while the
// other warpgroup's wgmmas keep the tensor cores busy.
//
// Why (bench/NOTES.md "Dense GEMM, Hopper path"): with both consumer
// warpgroups on one 128 x 256 tile (gemm_sm90), the tensor cores idle for the whole epilogue of
// every tile (~7.5 us of ~55 us at k = 4096); the mainloop alone runs at 1.04-1.08x cuBLAS.
//
// Tiling: CTA-level work unit = one BM x BN x BK=64 tile per consumer warpgroup, BM in {64, 128}
// (BM / 64 m64 wgmma blocks), BN in {128, 256} (the wgmma N); src/tuning/gemm_sm90.rs uses
// 128 x 128 with 6 stages (two m64n128k16 wgmmas per k16 step, 2 x 64 fp32 accumulators per
// thread). H200 (bench/NOTES.md "Dense GEMM, Hopper path"): 128 x 128 gemm_sm90_pingpong beats gemm_sm90 by
// 3-10 % at k = 4096 and loses 3-15 % at k >= 8192; gemm_sm90_pingpong_c2 (below) is correct but
// runs at ~0.4x cuBLAS (not understood yet; suspect: fewer co-resident 2-CTA clusters than the
// grid assumes, which a static persistent schedule turns into a second wave).
// 384 threads: warpgroup 0 = producer (one thread issues every TMA load; setmaxnreg.dec 40),
// warpgroups 1, 2 = consumers (setmaxnreg.inc 232).
// Schedule: CTA c walks the tiles t_s = c + s * gridDim.x (s = 0, 1, ...), grouped raster as in
// gemm_sm90 (tile_coord); consumer warpgroup w takes the s with s % 2 == w. The producer loads
// every tile's k-steps in s order into one ring of Stages stages; a consumer skips the stages of
// the other warpgroup's tiles (its ring position advances by k_tiles per skipped tile).
// Ordering (the ping-pong): the mainloops run strictly alternately. Warpgroup w waits at named
// barrier kTurn + w (256 threads: its own 128 bar.sync + the other warpgroup's 128 bar.arrive)
// before issuing the first wgmma of tile s > 0, and arrives on the other warpgroup's turn barrier
// after issuing its last wgmma of tile s, only if tile s + 1 exists (so every arrive is matched).
// Then it waits for its own wgmmas (wait_group 0), releases the last stage and runs the epilogue
// while the other warpgroup's mainloop runs.
// Pipeline: full[s] (count 1: producer expect_tx + TMA complete_tx), empty[s] (count 4: lane 0 of
// each warp of the one consumer warpgroup that read stage s, once its wgmmas have completed).
// Shared memory: Stages x (BM + BN) x 64 x 2 bytes of operand tiles (A: BM rows, B: BN rows of
// 128 bytes, 128B swizzle; the m64 block i of A starts 8 KiB x i in, for K-major and M-major A
// alike), 4 x 8 KiB epilogue store buffers (two per consumer warpgroup, sm90::epilogue),
// 2 x Stages mbarriers, 1 KiB alignment slack (src/tuning/gemm_sm90.rs smem_bytes).
// PTX (sm_90a): as gemm_sm90 plus bar.arrive (PTX ISA "bar, barrier": bar.arrive a, b).
#pragma once
#include "common/ptx.cuh"  // FERROATTN_SREG_READER
#include "gemm/sm90.cuh"

namespace ferroattn {

namespace sm90 {
// Signal named barrier `id` without waiting (the matching bar.sync side waits; PTX ISA
// "Parallel synchronization and communication instructions: bar, barrier").
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(count) : "memory");
}

// ---- 2-CTA clusters (PTX ISA "Thread block clusters", "mapa", "barrier.cluster",
// "cp.async.bulk.tensor" .multicast::cluster, "mbarrier.arrive" .shared::cluster) -------------
FERROATTN_SREG_READER(cluster_ctarank, unsigned, "cluster_ctarank")
FERROATTN_SREG_READER(cluster_id_x, unsigned, "clusterid.x")
FERROATTN_SREG_READER(cluster_count_x, unsigned, "nclusterid.x")
// Every thread of every CTA of the cluster: arrive (release) then wait (acquire).
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
// Arrive once on the mbarrier at CTA-relative shared address `bar` of cluster CTA `rank`.
__device__ __forceinline__ void mbar_arrive_cluster(unsigned bar, unsigned rank) {
    asm volatile(
        "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
        "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra];\n}\n"
        :: "r"(bar), "r"(rank) : "memory");
}
// mbar_wait with cluster-scope acquire (the arrivals it waits for may come from the peer CTA).
__device__ __forceinline__ void mbar_wait_cluster(unsigned bar, unsigned parity) {
    FERROATTN_MBAR_WAIT_LOOP(".acquire.cluster", bar, parity);
}
// TMA load of one box into shared address `dst` of every CTA in `mask` (same CTA-relative
// offset), completing on the mbarrier at the same offset `bar` in each of them.
__device__ __forceinline__ void tma_load_3d_multicast(unsigned dst, const TmaMap* map, unsigned bar,
                                                      int c0, int c1, int c2, unsigned short mask) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3, %4}], [%5], %6;\n"
        :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2),
           "r"(bar), "h"(mask)
        : "memory");
}

}  // namespace sm90

namespace sm90 {
// The kernel body (both wrappers below). Cluster = 1: one CTA per work unit (a BM x BN tile).
// Cluster = 2 (BM = BN = 128 only): the two CTAs of a cluster take m-tiles 2u and 2u + 1 of the
// same n-tile (work unit u over tiles_m2 = ceil(tiles_m / 2) m-pairs) in lock-step; each CTA's
// producer loads its own A tile and one 64-row half of the shared B tile, multicast to both CTAs
// (halves the B traffic from L2), so a stage's full barrier collects A + both halves of B
// (kStageBytes, as without clusters) and its empty barrier needs the release of both CTAs'
// consumers (count 8: each consumer warp arrives on its own and on the peer's empty barrier).
// An m-tile past tiles_m (odd tiles_m) loads the last valid A rows again and stores nothing.
template <typename T, typename TOut, bool AKMajor, bool BKMajor, int BM, int BN, int Stages, int Act,
          bool FastEpi, int Cluster>
__device__ __forceinline__ void pingpong_body(const GemmSm90Params& p) {
    static_assert(BM == 64 || BM == 128, "BM is 64 or 128");
    static_assert(BM * BN == 128 * 128 || BM * BN == 64 * 256 || BM * BN == 64 * 128,
                  "at most 128 fp32 accumulators per thread");
    static_assert(Cluster == 1 || (Cluster == 2 && BM == 128 && BN == 128), "clusters: 128 x 128 only");
    constexpr int MI = BM / 64;  // m64 wgmma blocks per tile
    using S = StageTiles<BM, BN, AKMajor, BKMajor>;
    constexpr int BK = S::BK;
    constexpr int kTurn = 3;  // named barriers 3, 4 (1, 2: the epilogues' per-warpgroup barriers)
    static_assert(S::template fits<Stages>(), "stages do not fit in shared memory");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const PipelineSmem<Stages, S::kStageBytes, S::kEpiBytes> sm(smem_raw);

    const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);  // uniform (gemm_sm90)
    const int tid = threadIdx.x % 128;
    const int k_tiles = (p.k + BK - 1) / BK;
    // Work units: tiles (Cluster 1) or m-tile pairs (Cluster 2); this CTA's first unit and stride.
    const int units_m = Cluster == 1 ? p.tiles_m : (p.tiles_m + 1) / 2;
    const int group_m = Cluster == 1 ? p.group_m : max(1, p.group_m / 2);
    const long long units = static_cast<long long>(p.batch) * units_m * p.tiles_n;
    // Work unit u -> its tile coordinates (Cluster 1: gemm_sm90's tile_coord over the params).
    auto unit_coord = [&](long long u) {
        if constexpr (Cluster == 1) return tile_coord(p, u);
        else return tile_coord(TileGrid{units_m, p.tiles_n, group_m}, u);
    };
    const unsigned rank = Cluster == 1 ? 0u : cluster_ctarank();
    const long long first = Cluster == 1 ? blockIdx.x : cluster_id_x();
    const long long stride = Cluster == 1 ? gridDim.x : cluster_count_x();
    init_pipeline_barriers(sm, 4 * Cluster);
    if constexpr (Cluster == 1) __syncthreads();
    else cluster_sync();  // the peer's barriers are initialised before any multicast or remote arrive

    if (wg == 0) {
        producer_setmaxnreg();
        if (tid == 0) {
            tma_prefetch_map(&p.tma_a);
            tma_prefetch_map(&p.tma_b);
            int stage = 0;
            unsigned phase = 0;
            for (long long u = first; u < units; u += stride) {
                const TileCoord tc = unit_coord(u);
                const int tm = Cluster == 1 ? tc.tm : min(2 * tc.tm + static_cast<int>(rank), p.tiles_m - 1);
                const int m0 = tm * BM;
                const int n0 = tc.tn * BN;
                const int za = tc.z * p.a_batch_step;
                const int zb = tc.z * p.b_batch_step;
                for (int kt = 0; kt < k_tiles; ++kt) {
                    if constexpr (Cluster == 1) mbar_wait(sm.empty(stage), phase ^ 1u);
                    else mbar_wait_cluster(sm.empty(stage), phase ^ 1u);
                    const unsigned fb = sm.full(stage);
                    mbar_expect_tx(fb, S::kStageBytes);
                    const unsigned sa = sm.stage_a(stage);
                    const unsigned sb = sa + S::kABytes;
                    const int k0 = kt * BK;
                    tma_load_operand<AKMajor, BM>(sa, &p.tma_a, fb, k0, m0, za);
                    if constexpr (Cluster == 2) {
                        // 64 rows (K-major: box (64, 64)) or one 64-wide chunk (N-major) of B each.
                        const unsigned dst = sb + rank * S::kChunkBytes;
                        const int nh = n0 + 64 * static_cast<int>(rank);
                        if constexpr (BKMajor) tma_load_3d_multicast(dst, &p.tma_b, fb, k0, nh, zb, 0x3);
                        else tma_load_3d_multicast(dst, &p.tma_b, fb, nh, k0, zb, 0x3);
                    } else {
                        tma_load_operand<BKMajor, BN>(sb, &p.tma_b, fb, k0, n0, zb);
                    }
                    advance_stage<Stages>(stage, phase);
                }
            }
        }
    } else {
        consumer_setmaxnreg();
        const int cw = wg - 1;
        const int lane = tid % 32;
        // Release stage `s` (lane 0 of each warp): to this CTA, and with clusters to the peer.
        auto release = [&](int s) {
            if constexpr (Cluster == 1) {
                mbar_arrive(sm.empty(s));
            } else {
                mbar_arrive_cluster(sm.empty(s), 0u);
                mbar_arrive_cluster(sm.empty(s), 1u);
            }
        };
        // Stage-0 descriptors (desc_at advances them to a stage and k16 step).
        const unsigned long long da0 = wgmma_desc(sm.base, S::kLboA, 1024u);
        const unsigned long long db0 = wgmma_desc(sm.base + S::kABytes, S::kLboB, 1024u);
        float d[MI][BN / 2];
        // Ring position of this warpgroup's next k-step: warpgroup 1 starts after unit s = 0.
        long long pos = static_cast<long long>(cw) * k_tiles;
        long long s = cw;
        for (long long u = first + cw * stride; u < units; u += 2 * stride, s += 2) {
            const TileCoord tc = unit_coord(u);
            const int tm = Cluster == 1 ? tc.tm : 2 * tc.tm + static_cast<int>(rank);
            int stage = static_cast<int>(pos % Stages);
            unsigned phase = static_cast<unsigned>((pos / Stages) & 1);
            // This stage's descriptors, advanced with the stage below.
            unsigned long long da = desc_at(da0, stage * S::kStageBytes);
            unsigned long long db = desc_at(db0, stage * S::kStageBytes);
            if (s > 0) named_barrier(kTurn + cw, 256);  // the other warpgroup has issued unit s - 1
            int prev = 0;
            for (int kt = 0; kt < k_tiles; ++kt) {
                mbar_wait(sm.full(stage), phase);
                wgmma_fence();
                wgmma_k_tile<T, BN, AKMajor, BKMajor, MI>(d, da, db, kt);
                wgmma_commit();
                wgmma_wait<1>();
                if (kt > 0 && lane == 0) release(prev);
                prev = stage;
                advance_descs<Stages, S::kStageBytes>(stage, da, db);
                advance_stage<Stages>(stage, phase);
            }
            // Every wgmma of this unit is issued: the other warpgroup may start its mainloop.
            if (u + stride < units) named_barrier_arrive(kTurn + (1 - cw), 256);
            pos += 2ll * k_tiles;
            wgmma_wait<0>();
#pragma unroll
            for (int i = 0; i < MI; ++i) fence_accumulators(d[i]);
            if (lane == 0) release(prev);
#pragma unroll
            for (int i = 0; i < MI; ++i)
                epilogue<Act, T, TOut, BN, FastEpi>(p, d[i], tc.z, tm * BM + i * 64, tc.tn * BN,
                                                    sm.epi + cw * 16384u, 1 + cw);
        }
        if (tid == 0) bulk_wait_all();  // the last stores have read shared memory and completed
    }
    // With clusters: no CTA exits while its peer may still arrive on its empty barriers.
    if constexpr (Cluster == 2) cluster_sync();
}
}  // namespace sm90

// One launch computes every (batch entry, BM x BN tile); grid = (min(tiles, SMs)), block = 384,
// dynamic shared memory = Stages * (BM + BN) * 128 + 32768 + 16 * Stages + 1024 bytes.
template <typename T, typename TOut, bool AKMajor, bool BKMajor, int BM, int BN, int Stages, int Act,
          bool FastEpi>
__global__ void __launch_bounds__(384, 1) gemm_sm90_pingpong(const __grid_constant__ GemmSm90Params p) {
    sm90::pingpong_body<T, TOut, AKMajor, BKMajor, BM, BN, Stages, Act, FastEpi, 1>(p);
}

// The same with 2-CTA clusters along m and B multicast (BM = BN = 128). grid = 2 x min(units,
// SMs / 2) with units = batch * ceil(tiles_m / 2) * tiles_n; the b tensor map's box is 64 rows
// (K-major) or 64 x 64 (N-major), i.e. half of B's BN = 128 rows per CTA.
template <typename T, typename TOut, bool AKMajor, bool BKMajor, int BM, int BN, int Stages, int Act,
          bool FastEpi>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(384, 1)
gemm_sm90_pingpong_c2(const __grid_constant__ GemmSm90Params p) {
    sm90::pingpong_body<T, TOut, AKMajor, BKMajor, BM, BN, Stages, Act, FastEpi, 2>(p);
}

}  // namespace ferroattn
