// ferroattn — dense GEMM for Hopper (sm_90a): TMA + mbarrier pipeline, warp-specialised,
// persistent, wgmma.mma_async with fp32 accumulators and a fused epilogue.
//
// What: out[z] = act(alpha * a[z] @ b[z] + beta * c[z] + bias), aux[z] = the pre-activation value
// (src/tuning/gemm_problem.rs states the contract; cuBLASLt epilogue order: scale, add C, add bias,
// activate; the epilogue runs in fp32 and rounds once to out's type).
//   a: (m, k) per batch entry, K-major (row-major, k contiguous) or M-major (column-major);
//   b: (k, n), K-major (column-major, k contiguous) or N-major (row-major, n contiguous);
//   both read only through the TMA tensor maps of GemmSm90Params (built by src/tma.rs, rank 3:
//   contiguous dim, other dim, batch), 128-byte swizzled 64-element boxes.
//   out: row-major, written through shared memory by TMA bulk tensor stores (tma_out: pointer,
//   row and batch strides 16-byte aligned); c / aux: row-major, 64-bit strides in elements,
//   read/written straight from the registers in pairs of adjacent columns (pointer, row and
//   batch strides even).
// Tiling: one CTA tile BM x BN = 128 x BN (BN 256 in production; 128 compiles but has not run on
// a GPU) x BK 64, Stages smem stages of
// (128 + BN) x 64 elements. 384 threads = 3 warpgroups: warpgroup 0 is the producer (one thread
// issues every TMA copy; setmaxnreg.dec 40), warpgroups 1 and 2 are consumers (setmaxnreg.inc
// 232), each owning 64 rows x BN of the tile (64 x BN / 128 fp32 accumulators per thread).
// Persistent: gridDim.x <= number of tiles; CTA i takes tiles i, i + gridDim.x, ... in a grouped
// order (group_m m-tiles share an n-tile sweep, for L2 reuse); the producer runs ahead into the
// next tile while the consumers run the epilogue (the tensor cores idle meanwhile: 15 % of the
// active cycles at 8192 x 4096 x 4096 by ncu; kernels/gemm/sm90_pingpong.cuh overlaps it).
// Shared memory: Stages x (128 + BN) x 64 x 2 bytes of operand tiles, 4 x 8 KiB epilogue store
// buffers (two per consumer warpgroup), 2 x Stages mbarriers, 1 KiB alignment slack.
// Pipeline (per stage s): full[s] (count 1; producer arrive.expect_tx + TMA complete_tx) and
// empty[s] (count 8: lane 0 of each consumer warp once that stage's wgmmas have completed).
// Tails: TMA zero-fills out-of-range rows/cols/k of a box, so the k tail adds zeros and m/n
// tails compute values that the clipped TMA store / predicated c, aux and bias accesses skip.
// Shared-memory layouts (PTX ISA "Asynchronous warpgroup level matrix shared memory layout",
// canonical 128B-swizzle layouts): K-major operand tile = rows x 128 bytes (64 elements),
// 8-row groups 1024 B apart (SBO = 1024), a k16 step advances the start address 32 B;
// MN-major tile = 64-element (128 B) MN chunks of BK rows, chunks BK*128 B apart (LBO),
// 8-k-row groups 1024 B apart (SBO), a k16 step advances 16 rows = 2048 B.
// Accumulator layout of wgmma m64nNk16 (PTX ISA "Matrix fragments for wgmma .m64nNk16"): thread
// t of the warpgroup, warp w = t/32, lane l: d[4j + 2h + e] is row 16w + l/4 + 8h, column
// 8j + 2(l%4) + e.
// Constraints: T = __half or __nv_bfloat16; TOut = __half, __nv_bfloat16 or float; m, n, k,
// batch >= 1 with m, n, k <= 2^31 - 513 (int32 TMA coordinates); tensor maps describe exactly
// the operands (pointer and strides 16-byte aligned, which the host checks: src/ops/gemm/sm90.rs
// supports()).
// Registers: 168 per thread (the 65536 / 384 launch-bound cap), no spills, for every production
// specialisation.
// Instruction budget (SASS of the NN bf16 spec): 51 instructions per consumer warp and
// k-step (4 HGMMA; descriptors in uniform registers), ~75 per 64 x 64 epilogue sub-tile on the
// FastEpi path (stmatrix).
// PTX features (sm_90a): wgmma.mma_async / fence / commit_group / wait_group, setmaxnreg,
// cp.async.bulk.tensor.3d ... mbarrier::complete_tx::bytes, mbarrier.try_wait.parity (with a
// suspend-time hint), stmatrix.m8n8.x4, shfl.sync (warp-uniform role index),
// mbarrier.arrive(.expect_tx), fence.mbarrier_init, prefetch.tensormap,
// cp.async.bulk.tensor.3d.global.shared::cta (store) / commit_group / wait_group(.read),
// fence.proxy.async.shared::cta, bar.sync with a thread count (named barriers).
#pragma once
#include "common/activation.cuh"
#include "common/dtype.cuh"
#include "common/hopper.cuh"

namespace ferroattn {

// Kernel parameters (mirror: `GemmSm90Params` in src/ops/gemm/sm90.rs; change both together).
struct GemmSm90Params {
    TmaMap tma_a;  // a: dims (contiguous, other, batch); box (64, 128) K-major or (64, 64) M-major
    TmaMap tma_b;  // b: box (64, BN) K-major or (64, 64) N-major
    TmaMap tma_out;  // out: dims (n, m, batch), box (128 bytes of columns, 64, 1), 128B swizzle
    void* out;
    const void* c;     // nullptr: no C term
    const void* bias;  // nullptr: no bias; (n,) of T or float (bias_f32)
    void* aux;         // nullptr: no pre-activation output
    long long out_row_stride;
    long long out_batch_stride;
    long long c_row_stride;
    long long c_batch_stride;
    long long aux_row_stride;
    long long aux_batch_stride;
    long long tiles;     // batch * tiles_m * tiles_n
    int m, n, k, batch;
    int a_batch_step;    // batch coordinate of entry z is z * step (0: broadcast operand)
    int b_batch_step;
    int tiles_m, tiles_n;
    int group_m;         // m-tiles per raster group (>= 1)
    int activation;      // ActivationKind (informational: the kernel's Act template argument rules)
    int bias_f32;        // 1: bias is float, 0: bias is T
    float alpha, beta;
};

namespace sm90 {

template <typename T, int BN, int TransA, int TransB>
__device__ __forceinline__ void wgmma_k16(float (&d)[BN / 2], unsigned long long desc_a,
                                          unsigned long long desc_b, int scale_d) {
    static_assert(BN == 128 || BN == 256, "BN is 128 or 256");
    if constexpr (BN == 256) {
        if constexpr (DTypeTraits<T>::kIsBF16) wgmma_m64n256k16_bf16<TransA, TransB>(d, desc_a, desc_b, scale_d);
        else wgmma_m64n256k16_f16<TransA, TransB>(d, desc_a, desc_b, scale_d);
    } else {
        if constexpr (DTypeTraits<T>::kIsBF16) wgmma_m64n128k16_bf16<TransA, TransB>(d, desc_a, desc_b, scale_d);
        else wgmma_m64n128k16_f16<TransA, TransB>(d, desc_a, desc_b, scale_d);
    }
}

// ---- tile schedule ------------------------------------------------------------------------
struct TileCoord {
    int z, tm, tn;
};

// A grid of tiles_m x tiles_n tiles per batch entry, raster groups of group_m m-tiles.
struct TileGrid {
    int tiles_m, tiles_n, group_m;
};

// Linear tile index -> (batch entry, m-tile, n-tile): batch-major; inside a batch entry,
// groups of group_m m-tiles sweep all n-tiles (m fastest), so concurrently running CTAs
// share their B columns and a few A rows in L2.
// `p`: anything with int members tiles_m, tiles_n, group_m (GemmSm90Params; TileGrid).
template <typename Grid>
__device__ __forceinline__ TileCoord tile_coord(const Grid& p, long long t) {
    const long long per_batch = static_cast<long long>(p.tiles_m) * p.tiles_n;
    const long long zl = t / per_batch;
    const int r = static_cast<int>(t - zl * per_batch);
    const int group_size = p.group_m * p.tiles_n;
    const int g = r / group_size;
    const int first_m = g * p.group_m;
    const int gm = min(p.tiles_m - first_m, p.group_m);
    const int rr = r - g * group_size;
    return {static_cast<int>(zl), first_m + rr % gm, rr / gm};
}

// ---- epilogue -----------------------------------------------------------------------------
template <typename U> struct Pair;
template <> struct Pair<float> {
    using V = float2;
    static __device__ __forceinline__ V make(float a, float b) { return make_float2(a, b); }
    static __device__ __forceinline__ float lo(V v) { return v.x; }
    static __device__ __forceinline__ float hi(V v) { return v.y; }
    static __device__ __forceinline__ float one(float a) { return a; }
};
template <> struct Pair<__half> {
    using V = __half2;
    static __device__ __forceinline__ V make(float a, float b) { return __floats2half2_rn(a, b); }
    static __device__ __forceinline__ float lo(V v) { return __low2float(v); }
    static __device__ __forceinline__ float hi(V v) { return __high2float(v); }
    static __device__ __forceinline__ __half one(float a) { return __float2half_rn(a); }
};
template <> struct Pair<__nv_bfloat16> {
    using V = __nv_bfloat162;
    static __device__ __forceinline__ V make(float a, float b) { return __floats2bfloat162_rn(a, b); }
    static __device__ __forceinline__ float lo(V v) { return __low2float(v); }
    static __device__ __forceinline__ float hi(V v) { return __high2float(v); }
    static __device__ __forceinline__ __nv_bfloat16 one(float a) { return __float2bfloat16_rn(a); }
};

// Two fp32 values as one 32-bit word of 16-bit out elements (a in the low half).
template <typename TOut>
__device__ __forceinline__ unsigned pack_pair(float a, float b) {
    const typename Pair<TOut>::V v = Pair<TOut>::make(a, b);
    return *reinterpret_cast<const unsigned*>(&v);
}

// Pack two fp32 values as out's type and store them at shared address `addr` (4 or 8 bytes).
template <typename TOut>
__device__ __forceinline__ void st_shared_pair(unsigned addr, float a, float b) {
    if constexpr (sizeof(TOut) == 4) {
        st_shared_v2_f32(addr, a, b);
    } else {
        st_shared_b32(addr, pack_pair<TOut>(a, b));
    }
}

// Stores four 8x8 matrices of 16-bit elements (stmatrix .x4): lanes 8i .. 8i + 7 give the
// 16-byte row addresses of matrix i, and register i of lane l holds row l / 4, columns 2 (l % 4)
// and 2 (l % 4) + 1 of matrix i (the low half is the lower column), the wgmma accumulator layout
// of an 8-column chunk (PTX ISA "stmatrix"; sm_90).
__device__ __forceinline__ void stmatrix_x4(unsigned addr, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// Writes one consumer warpgroup's 64 x BN accumulators (tile rows row0w .. row0w + 63, columns
// n0 .. n0 + BN - 1): out = act(alpha*acc + beta*c + bias), aux = the pre-activation value.
// out goes through shared memory: sub-tiles of 64 rows x 128 bytes (SC columns), written in the
// 128B-swizzled layout the out tensor map reads (16-byte chunk q of row r at chunk q ^ (r % 8)),
// double-buffered per warpgroup (`stage`: two 8 KiB buffers, sub-tile q in buffer q % 2) and
// stored by one thread with a bulk tensor copy, so the global writes overlap the next sub-tile
// and the next tile's mainloop. c is read and aux written directly (pairs of adjacent columns,
// predicated).
// Buffer reuse, one named barrier per sub-tile: on entry thread 0 waits until every earlier store
// of this warpgroup has read its buffer (barrier E); before barrier B_q (which orders sub-tile q's
// writes before store q) thread 0 waits until store q - 1 has read buffer (q + 1) % 2, so after
// B_q that buffer is free for sub-tile q + 1 (an earlier scheme had a second barrier per
// sub-tile for this: 2 x BN / SC + 0 vs BN / SC + 1 barriers per warpgroup and tile).
// FastEpi: a second, branch-free copy of the loop for calls without c and aux (bias and the
// activation stay): 16-bit outputs are written with stmatrix (4 x4 per 64 x 64 sub-tile per
// thread instead of 16 st.shared.b32 and their address arithmetic).
template <int Act, typename T, typename TOut, int BN, bool FastEpi>
__device__ __forceinline__ void epilogue(const GemmSm90Params& p, const float (&d)[BN / 2], int z,
                                         int row0w, int n0, unsigned stage, int bar_id) {
    using P = Pair<TOut>;
    constexpr int SC = 128 / sizeof(TOut);  // columns per sub-tile
    constexpr int JJ = SC / 8;              // accumulator column chunks per sub-tile
    constexpr int JH = JJ / 2;              // ... per half sub-tile (bias prefetch granularity)
    const int tid = threadIdx.x % 128;
    const int warp = tid / 32;
    const int lane = tid % 32;
    if (row0w >= p.m) return;  // uniform over the warpgroup
    const float alpha = p.alpha, beta = p.beta;
    const bool has_c = p.c != nullptr;
    const bool has_bias = p.bias != nullptr;
    const bool has_aux = p.aux != nullptr;
    const bool fast = FastEpi && !has_c && !has_aux;
    const TOut* c = has_c ? static_cast<const TOut*>(p.c) + z * p.c_batch_stride : nullptr;
    TOut* aux = has_aux ? static_cast<TOut*>(p.aux) + z * p.aux_batch_stride : nullptr;
    const int zo = p.batch > 1 ? z : 0;
    // stmatrix row address of this lane for the x4 that covers chunks 0, 1 of a sub-tile: matrix
    // g = lane / 8 is (chunk g / 2, rows 8 (g % 2) ..); chunk 2a + g / 2 of the same row lies at
    // this offset XOR (a << 5) (the row's swizzle XORs chunk bits 4-6 with row % 8 = lane % 8).
    const int g = lane / 8;
    const int srow = warp * 16 + 8 * (g & 1) + (lane & 7);
    const unsigned sm_off = srow * 128 + ((((g >> 1) ^ (lane & 7)) & 7) << 4);
    if (tid == 0) bulk_wait_read<0>();  // every earlier store of this warpgroup has read its buffer
    named_barrier(bar_id, 128);
#pragma unroll
    for (int q = 0; q < BN / SC; ++q) {
        const int cs = n0 + q * SC;  // first column of the sub-tile
        if (cs >= p.n) break;        // uniform
        const unsigned buf = stage + (q & 1) * 8192u;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            // this thread's bias values of the half sub-tile, loaded before any use
            // (one uniform branch skips them all when there is no bias)
            float bias0[JH], bias1[JH];
#pragma unroll
            for (int i = 0; i < JH; ++i) bias0[i] = bias1[i] = 0.0f;
            if (has_bias) {
#pragma unroll
                for (int i = 0; i < JH; ++i) {
                    const int col = cs + 8 * (half * JH + i) + 2 * (lane % 4);
                    if (col < p.n) {
                        if (p.bias_f32) {
                            const float* bf = static_cast<const float*>(p.bias) + col;
                            bias0[i] = __ldg(bf);
                            if (col + 1 < p.n) bias1[i] = __ldg(bf + 1);
                        } else {
                            const T* bt = static_cast<const T*>(p.bias) + col;
                            bias0[i] = to_float(__ldg(bt));
                            if (col + 1 < p.n) bias1[i] = to_float(__ldg(bt + 1));
                        }
                    }
                }
            }
            if constexpr (FastEpi && sizeof(TOut) == 2) {
                if (fast) {
                    // Straight-line: one stmatrix x4 per two chunks (16 rows x 16 columns of the warp).
#pragma unroll
                    for (int i2 = 0; i2 < JH / 2; ++i2) {
                        unsigned r[4];
#pragma unroll
                        for (int m = 0; m < 4; ++m) {
                            const int i = 2 * i2 + m / 2;       // chunk within the half
                            const int j = q * JJ + half * JH + i;  // accumulator chunk
                            const int h = m % 2;
                            r[m] = pack_pair<TOut>(activate<Act>(alpha * d[4 * j + 2 * h] + bias0[i]),
                                                   activate<Act>(alpha * d[4 * j + 2 * h + 1] + bias1[i]));
                        }
                        const unsigned a = (half * JH + 2 * i2) / 2;  // chunk pair within the row
                        stmatrix_x4((buf + sm_off) ^ (a << 5), r[0], r[1], r[2], r[3]);
                    }
                    continue;
                }
            }
            if (FastEpi && fast) {
                // 32-bit out: the same computation, straight-line, one st.shared.v2 per pair.
#pragma unroll
                for (int i = 0; i < JH; ++i) {
                    const int jj = half * JH + i;
                    const int j = q * JJ + jj;
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int r = warp * 16 + lane / 4 + 8 * h;
                        const float v0 = activate<Act>(alpha * d[4 * j + 2 * h] + bias0[i]);
                        const float v1 = activate<Act>(alpha * d[4 * j + 2 * h + 1] + bias1[i]);
                        const unsigned byte = (8 * jj + 2 * (lane % 4)) * sizeof(TOut);
                        const unsigned addr = buf + r * 128 + ((((byte >> 4) ^ (r & 7)) << 4) | (byte & 15));
                        st_shared_pair<TOut>(addr, v0, v1);
                    }
                }
                continue;
            }
#pragma unroll
            for (int i = 0; i < JH; ++i) {
                const int jj = half * JH + i;
                const int j = q * JJ + jj;
                const int col = cs + 8 * jj + 2 * (lane % 4);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = warp * 16 + lane / 4 + 8 * h;  // row within the 64-row sub-tile
                    const int row = row0w + r;
                    float v0 = alpha * d[4 * j + 2 * h] + bias0[i];
                    float v1 = alpha * d[4 * j + 2 * h + 1] + bias1[i];
                    if (has_c && row < p.m && col < p.n) {
                        const TOut* cp = c + row * p.c_row_stride + col;
                        if (col + 1 < p.n) {
                            const typename P::V cv = *reinterpret_cast<const typename P::V*>(cp);
                            v0 += beta * P::lo(cv);
                            v1 += beta * P::hi(cv);
                        } else {
                            v0 += beta * to_float(cp[0]);
                        }
                    }
                    if (has_aux && row < p.m && col < p.n) {
                        TOut* ap = aux + row * p.aux_row_stride + col;
                        if (col + 1 < p.n) *reinterpret_cast<typename P::V*>(ap) = P::make(v0, v1);
                        else ap[0] = P::one(v0);
                    }
                    v0 = activate<Act>(v0);
                    v1 = activate<Act>(v1);
                    const unsigned byte = (8 * jj + 2 * (lane % 4)) * sizeof(TOut);  // within the row
                    const unsigned addr = buf + r * 128 + ((((byte >> 4) ^ (r & 7)) << 4) | (byte & 15));
                    st_shared_pair<TOut>(addr, v0, v1);
                }
            }
        }
        fence_proxy_async_smem();
        if (tid == 0) bulk_wait_read<0>();  // store q - 1 has read buffer (q + 1) % 2
        named_barrier(bar_id, 128);         // B_q: sub-tile q is in buf
        if (tid == 0) {
            tma_store_3d(&p.tma_out, buf, cs, row0w, zo);
            bulk_commit();
        }
    }
}

// ---- pipeline pieces shared by gemm_sm90 and gemm_sm90_pingpong (kernels/gemm/sm90_pingpong.cuh) --
// Byte sizes and wgmma descriptor constants of one stage: an A tile of BM rows and a B tile of BN
// rows, BK = 64 elements (128 bytes) each, 128B swizzle (layouts: this file's header).
template <int BM, int BN, bool AKMajor, bool BKMajor>
struct StageTiles {
    // Enumerators, not static constexpr members: NVRTC emits the latter as .global variables.
    enum : int { BK = 64 };
    enum : unsigned {
        kABytes = BM * BK * 2,
        kBBytes = BN * BK * 2,
        kStageBytes = kABytes + kBBytes,
        kChunkBytes = 64 * BK * 2,  // one 64-element-wide MN chunk of BK rows
        kEpiBytes = 2 * 2 * 8192,   // two 8 KiB store buffers per consumer warpgroup
        // Leading byte offsets of the descriptors and bytes per k16 step (K-major: 32 B along
        // the row; MN-major: 16 k-rows = 2048 B).
        kLboA = AKMajor ? 16u : kChunkBytes,
        kLboB = BKMajor ? 16u : kChunkBytes,
        kStepA = AKMajor ? 32u : 2048u,
        kStepB = BKMajor ? 32u : 2048u,
    };
    // Stages operand tiles + the epilogue buffers + 2 x Stages mbarriers + 1 KiB alignment slack
    // (src/tuning/gemm_sm90.rs smem_bytes) fit in the 227 KiB a block may use.
    template <int Stages>
    __host__ __device__ static constexpr bool fits() {
        return Stages >= 2 && Stages * kStageBytes + kEpiBytes + 2 * Stages * 8 + 1024 <= 227 * 1024;
    }
};

// Dynamic shared memory of the pipeline: Stages operand stages from `base` (1024-aligned), the
// epilogue store buffers at `epi`, then full[0..Stages) and empty[0..Stages) mbarriers at `bars`.
template <int Stages, unsigned StageBytes, unsigned EpiBytes>
struct PipelineSmem {
    unsigned base, epi, bars;
    __device__ __forceinline__ explicit PipelineSmem(const void* smem_raw)
        : base((smem_addr(smem_raw) + 1023u) & ~1023u),
          epi(base + Stages * StageBytes),
          bars(epi + EpiBytes) {}
    __device__ __forceinline__ unsigned full(int s) const { return bars + 8u * s; }
    __device__ __forceinline__ unsigned empty(int s) const { return bars + 8u * (Stages + s); }
    __device__ __forceinline__ unsigned stage_a(int s) const { return base + s * StageBytes; }
};

// Thread 0: full[s] count 1 (producer expect_tx), empty[s] count `empty_count`; the caller then
// synchronises the block (or cluster) before any thread uses them.
template <int Stages, unsigned StageBytes, unsigned EpiBytes>
__device__ __forceinline__ void init_pipeline_barriers(const PipelineSmem<Stages, StageBytes, EpiBytes>& sm,
                                                       unsigned empty_count) {
    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < Stages; ++s) {
            mbar_init(sm.full(s), 1);
            mbar_init(sm.empty(s), empty_count);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
}

// Role register budgets (setmaxnreg; the whole warpgroup executes it).
__device__ __forceinline__ void producer_setmaxnreg() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
}
__device__ __forceinline__ void consumer_setmaxnreg() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
}

// TMA load of one operand tile of `Rows` rows x BK = 64 k into shared address `dst`, completing
// on mbarrier `bar`: K-major, one box (k0, mn0, z); MN-major, Rows / 64 boxes (mn0 + 64 j, k0, z),
// one 64-wide MN chunk (8 KiB) each.
template <bool KMajor, int Rows>
__device__ __forceinline__ void tma_load_operand(unsigned dst, const TmaMap* map, unsigned bar,
                                                 int k0, int mn0, int z) {
    if constexpr (KMajor) {
        tma_load_3d(dst, map, bar, k0, mn0, z);
    } else {
#pragma unroll
        for (int j = 0; j < Rows / 64; ++j) tma_load_3d(dst + j * (64 * 64 * 2), map, bar, mn0 + 64 * j, k0, z);
    }
}

// Ring position: next stage, flipping the phase on wrap-around.
template <int Stages>
__device__ __forceinline__ void advance_stage(int& stage, unsigned& phase) {
    if (++stage == Stages) {
        stage = 0;
        phase ^= 1u;
    }
}

// Moves the descriptors of stage `stage` to the next stage (back to stage 0 after the last).
template <int Stages, unsigned StageBytes>
__device__ __forceinline__ void advance_descs(int stage, unsigned long long& da, unsigned long long& db) {
    const int adv = stage == Stages - 1 ? -static_cast<int>((Stages - 1) * StageBytes)
                                        : static_cast<int>(StageBytes);
    da = desc_at(da, adv);
    db = desc_at(db, adv);
}

// One BK = 64 k-step of MI m64 blocks: d[i] (+)= A block i (8 KiB apart from da) x B (db); the
// first k16 step of k-tile 0 overwrites d.
template <typename T, int BN, bool AKMajor, bool BKMajor, int MI>
__device__ __forceinline__ void wgmma_k_tile(float (&d)[MI][BN / 2], unsigned long long da,
                                             unsigned long long db, int kt) {
    using S = StageTiles<64, BN, AKMajor, BKMajor>;
#pragma unroll
    for (int kk = 0; kk < S::BK / 16; ++kk) {
#pragma unroll
        for (int i = 0; i < MI; ++i)
            wgmma_k16<T, BN, AKMajor ? 0 : 1, BKMajor ? 0 : 1>(
                d[i], desc_at(da, i * 8192u + kk * S::kStepA), desc_at(db, kk * S::kStepB), (kt | kk) != 0);
    }
}

}  // namespace sm90

// One launch computes every (batch entry, 128 x BN tile) of the problem; grid = (min(tiles,
// SMs)), block = 384, dynamic shared memory = Stages * (128 + BN) * 128 + 32768 + 16 * Stages
// + 1024 bytes (src/tuning/gemm_sm90.rs smem_bytes). Act (ActivationKind) is a template argument:
// one epilogue per kernel (five inlined epilogues of 64 x BN registers cost ptxas 8x the time).
template <typename T, typename TOut, bool AKMajor, bool BKMajor, int BN, int Stages, int Act,
          bool FastEpi>
__global__ void __launch_bounds__(384, 1) gemm_sm90(const __grid_constant__ GemmSm90Params p) {
    using namespace sm90;
    constexpr int BM = 128;
    using S = StageTiles<BM, BN, AKMajor, BKMajor>;
    // Deliberately not shared with gemm_sm90_pingpong: the local copies of S's sizes and the
    // inline TMA loads / stage advance of the producer. Using S:: enumerators in the producer's
    // expressions, tma_load_operand or advance_stage here compiles to different (equivalent)
    // SASS (NVRTC 13.0), and this kernel's SASS is the GPU-validated one.
    constexpr int BK = S::BK;
    constexpr unsigned kABytes = S::kABytes;
    constexpr unsigned kStageBytes = S::kStageBytes;
    constexpr unsigned kChunkBytes = S::kChunkBytes;
    constexpr unsigned kEpiBytes = S::kEpiBytes;
    static_assert(S::template fits<Stages>(), "stages do not fit in shared memory");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const PipelineSmem<Stages, kStageBytes, kEpiBytes> sm(smem_raw);

    // Broadcast from lane 0: the compiler then knows wg is warp-uniform, so the role branches
    // below are convergent and the consumers' descriptor / stage arithmetic can live in uniform
    // registers (a plain threadIdx.x / 128 makes every value inside the branches per-thread).
    const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
    const int tid = threadIdx.x % 128;
    const int k_tiles = (p.k + BK - 1) / BK;
    init_pipeline_barriers(sm, 8);
    __syncthreads();

    if (wg == 0) {
        // Producer warpgroup: one thread issues every copy.
        producer_setmaxnreg();
        if (tid == 0) {
            tma_prefetch_map(&p.tma_a);
            tma_prefetch_map(&p.tma_b);
            int stage = 0;
            unsigned phase = 0;
            for (long long t = blockIdx.x; t < p.tiles; t += gridDim.x) {
                const TileCoord tc = tile_coord(p, t);
                const int m0 = tc.tm * BM;
                const int n0 = tc.tn * BN;
                const int za = tc.z * p.a_batch_step;
                const int zb = tc.z * p.b_batch_step;
                for (int kt = 0; kt < k_tiles; ++kt) {
                    mbar_wait(sm.empty(stage), phase ^ 1u);
                    const unsigned fb = sm.full(stage);
                    mbar_expect_tx(fb, kStageBytes);
                    const unsigned sa = sm.stage_a(stage);
                    const unsigned sb = sa + kABytes;
                    const int k0 = kt * BK;
                    if constexpr (AKMajor) {
                        tma_load_3d(sa, &p.tma_a, fb, k0, m0, za);
                    } else {
#pragma unroll
                        for (int j = 0; j < BM / 64; ++j)
                            tma_load_3d(sa + j * kChunkBytes, &p.tma_a, fb, m0 + 64 * j, k0, za);
                    }
                    if constexpr (BKMajor) {
                        tma_load_3d(sb, &p.tma_b, fb, k0, n0, zb);
                    } else {
#pragma unroll
                        for (int j = 0; j < BN / 64; ++j)
                            tma_load_3d(sb + j * kChunkBytes, &p.tma_b, fb, n0 + 64 * j, k0, zb);
                    }
                    if (++stage == Stages) {
                        stage = 0;
                        phase ^= 1u;
                    }
                }
            }
        }
    } else {
        // Consumer warpgroups: 64 rows x BN each.
        consumer_setmaxnreg();
        const int cw = wg - 1;
        const int lane = tid % 32;
        // The current stage's descriptors, built once and advanced with the stage (desc_at; its
        // comment has the proof that the adds are exact).
        unsigned long long da = wgmma_desc(sm.base + cw * (64 * BK * 2), S::kLboA, 1024u);
        unsigned long long db = wgmma_desc(sm.base + kABytes, S::kLboB, 1024u);
        float d[1][BN / 2];
        int stage = 0;
        unsigned phase = 0;
        for (long long t = blockIdx.x; t < p.tiles; t += gridDim.x) {
            const TileCoord tc = tile_coord(p, t);
            int prev = 0;
            for (int kt = 0; kt < k_tiles; ++kt) {
                mbar_wait(sm.full(stage), phase);
                wgmma_fence();
                wgmma_k_tile<T, BN, AKMajor, BKMajor, 1>(d, da, db, kt);
                wgmma_commit();
                wgmma_wait<1>();
                if (kt > 0 && lane == 0) mbar_arrive(sm.empty(prev));
                prev = stage;
                advance_descs<Stages, kStageBytes>(stage, da, db);
                if (++stage == Stages) {
                    stage = 0;
                    phase ^= 1u;
                }
            }
            wgmma_wait<0>();
            fence_accumulators(d[0]);
            if (lane == 0) mbar_arrive(sm.empty(prev));
            epilogue<Act, T, TOut, BN, FastEpi>(p, d[0], tc.z, tc.tm * BM + cw * 64, tc.tn * BN, sm.epi + cw * 16384u,
                                       1 + cw);
        }
        if (tid == 0) bulk_wait_all();  // the last stores have read shared memory and completed
    }
}

}  // namespace ferroattn
