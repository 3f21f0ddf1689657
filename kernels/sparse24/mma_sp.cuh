// ferroattn — 2:4 structured-sparse matmul with mma.sp (sm_80+).
//
// What: out (rows, n) = act(x (rows, k) @ w.T + bias), w (n, k) 2:4-sparse, given compressed as
// values (m_pad, k_pad / 2) + meta (m_pad / 16, k_pad) int16 (layout: src/ops/sparse24/host.rs).
// w is the sparse A operand of mma.sp.m16n8k32 (out^T = w x^T): a block computes BlockN output
// features (w rows) × BlockR x rows; warps tile it WarpsN × WarpsR, each warp a
// (BlockN / WarpsN) × (BlockR / WarpsR) tile of m16 (w rows) × n8 (x rows) mma tiles with fp32
// accumulators. k advances in tiles of 64 (one metadata unit: two k32 mma steps, selector 0
// then 1, fed by the same per-lane metadata word), through a Stages-deep cp.async pipeline:
//   values tile  BlockN × 32 elements (16-byte chunks XOR-swizzled, common/swizzle.cuh)
//   x tile       BlockR × 64 elements (swizzled likewise)
//   meta tile    BlockN / 16 units × 32 words (lane l reads word l: no conflicts, no shuffles)
// Fragments come from ldmatrix: the compressed 16 × 16 values tile of one k32 step is loaded
// exactly like a dense m16n8k16 A tile; an x tile of 8 rows × 32 k is one x4 load (b0..b3).
// Epilogue: + bias (fp32), activation (common/activation.cuh), rounded to T, staged through
// shared memory and written as 16-byte row segments (element by element when out is not
// 16-byte aligned or n % 8 != 0).
// Block order: a 1-D grid of row_tiles × n_tiles blocks, grouped 8 row tiles at a time
// (consecutive blocks share a values tile, a wave covers ~8 x tiles × ~16 w tiles: both stay
// in L2).
// Template parameters / constraints (static_asserted; the Rust mirror is
// src/tuning/sparse24.rs Sparse24MatmulConfig):
//   BlockN % (16 WarpsN) == 0, 128 % BlockN == 0 (n_pad is a multiple of 128, so values / meta
//   tiles need no bounds checks); BlockR % (8 WarpsR) == 0; Stages >= 2; Act in 0..4;
//   VecX: x's data pointer and row stride are 16-byte aligned and k % 8 == 0 (16-byte cp.async
//   with zero fill past rows / k), else x moves element by element; T = __half / __nv_bfloat16.
// Dynamic shared memory: max(Stages × (BlockN·32·2 + BlockR·64·2 + BlockN/16·128),
//   BlockR · (BlockN + 8) · 2) bytes (Sparse24MatmulConfig::smem_bytes).
// Safety: every global address is in bounds by construction (rows / k predicated, n_pad and
// k_pad from the validated layout); metadata only reaches the tensor core (2-bit indices
// inside a group), so no bit pattern can move a memory access.
// PTX features: mma.sp::ordered_metadata.sync.aligned.m16n8k32 (.f16 / .bf16, sm_80+, PTX ISA
// 8.5), ldmatrix, cp.async.cg with zero fill.
#pragma once
#include "common/activation.cuh"
#include "common/dtype.cuh"
#include "common/ptx.cuh"
#include "common/swizzle.cuh"
#include "sparse24/params.cuh"

namespace ferroattn {

// d += A · B for one m16n8k32 step: A 16 × 32 2:4-sparse (a: the compressed 16 × 16 tile in the
// dense m16n8k16 A fragment layout), B 32 × 8 (b[i]: k rows 8i + 2t, 8i + 2t + 1 of column g),
// e: the metadata word (rows g / g + 8 in the low / high half), Sel: the threads of each quad
// that supply it (0: lanes 4g, 4g + 1; 1: lanes 4g + 2, 4g + 3).
template <typename T, int Sel>
__device__ __forceinline__ void mma_sp_m16n8k32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[4],
                                                unsigned e) {
    if constexpr (DTypeTraits<T>::kIsBF16) {
        asm volatile(
            "mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9,%10,%11}, {%0,%1,%2,%3}, %12, %13;\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]), "r"(e),
              "n"(Sel));
    } else {
        asm volatile(
            "mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9,%10,%11}, {%0,%1,%2,%3}, %12, %13;\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]), "r"(e),
              "n"(Sel));
    }
}

template <int BlockN, int BlockR, int WarpsN, int WarpsR, int Stages, int Act, bool VecX, typename T>
__global__ void __launch_bounds__(WarpsN * WarpsR * 32)
    sparse24_matmul_sm80(const Sparse24MatmulParams p) {
    constexpr int kThreads = WarpsN * WarpsR * 32;
    constexpr int kBlockK = 64;
    constexpr int kValCols = kBlockK / 2;       // compressed columns per k tile
    constexpr int kWarpN = BlockN / WarpsN;
    constexpr int kWarpR = BlockR / WarpsR;
    constexpr int kMT = kWarpN / 16;
    constexpr int kNT = kWarpR / 8;
    constexpr int kValBytes = BlockN * kValCols * 2;
    constexpr int kXBytes = BlockR * kBlockK * 2;
    constexpr int kMetaWords = (BlockN / 16) * 32;
    constexpr int kStageBytes = kValBytes + kXBytes + kMetaWords * 4;
    constexpr int kOutCols = BlockN + 8;        // epilogue staging row (+16 bytes: no bank conflicts)
    static_assert(BlockN % (16 * WarpsN) == 0 && 128 % BlockN == 0, "BlockN");
    static_assert(BlockR % (8 * WarpsR) == 0, "BlockR");
    static_assert(Stages >= 2, "Stages");
    static_assert(kStageBytes % 16 == 0, "16-byte aligned stages");

    extern __shared__ __align__(16) unsigned char smem[];

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int warp_n0 = (warp % WarpsN) * kWarpN;
    const int warp_r0 = (warp / WarpsN) * kWarpR;

    // grouped block order
    constexpr int kGroup = 8;
    const int pid = blockIdx.x;
    const int per_group = kGroup * p.n_tiles;
    const int group = pid / per_group;
    const int first_r = group * kGroup;
    const int gsize = min(p.row_tiles - first_r, kGroup);
    const int in_group = pid - group * per_group;
    const int row_tile = first_r + in_group % gsize;
    const int n_tile = in_group / gsize;
    const int n0 = n_tile * BlockN;
    const long long r0 = static_cast<long long>(row_tile) * BlockR;

    const T* __restrict__ x = static_cast<const T*>(p.x);
    const int ktiles = p.k_pad / kBlockK;

    // ---- per-thread copy assignments, fixed for the whole k loop. Chunk i = tid + j * kThreads
    // (compile-time trip counts, fully unrolled); kThreads is a multiple of 32, so chunk j's row
    // is chunk 0's row + j * kThreads / chunks-per-row, and its column chunk is chunk 0's.
    constexpr int kValRowChunks = kValCols / 8;   // 4 chunks of 16 bytes per values row
    constexpr int kXRowChunks = kBlockK / 8;      // 8 per x row
    constexpr int kValChunks = BlockN * kValRowChunks;
    constexpr int kMetaChunks = (BlockN / 16) * 8;
    constexpr int kXChunks = BlockR * kXRowChunks;
    constexpr int kValIters = (kValChunks + kThreads - 1) / kThreads;
    constexpr int kMetaIters = (kMetaChunks + kThreads - 1) / kThreads;
    constexpr int kXIters = (kXChunks + kThreads - 1) / kThreads;
    constexpr int kValRowStep = kThreads / kValRowChunks;
    constexpr int kXRowStep = kThreads / kXRowChunks;
    static_assert(kValCols == 32 && kValRowStep % 8 == 0,
                  "values rows of 4 chunks; a row step of 8 keeps the swizzle (row / 2) % 4 per thread");
    const long long val_stride = p.k_pad / 2;
    const int val_row0 = tid / kValRowChunks, val_ch = tid % kValRowChunks;
    // values chunk j of k tile kt: global val_g0 + j * kValRowStep * val_stride + kt * 32 elements,
    // shared (stage base) + val_s0 + j * kValRowStep * kValCols * 2 bytes
    const T* val_g0 = static_cast<const T*>(p.values) + static_cast<long long>(n0 + val_row0) * val_stride + val_ch * 8;
    const unsigned val_s0 = swizzle_offset<kValCols>(val_row0, val_ch * 8) * 2;
    // metadata chunk j: unit u = i / 8, 16 bytes c = i % 8 of its 128
    const long long meta_row_words = p.k_pad / 2;  // 32-bit words per 16-row tile
    // x chunk j: row x_row0 + j * kXRowStep, columns x_ch * 8 .. + 7 of the k tile
    const int x_row0 = tid / kXRowChunks, x_ch = tid % kXRowChunks;

    auto load_stage = [&](unsigned stage_base, int kt) {
        const unsigned val_s = stage_base;
        const unsigned x_s = stage_base + kValBytes;
        const unsigned meta_s = stage_base + kValBytes + kXBytes;
#pragma unroll
        for (int j = 0; j < kValIters; ++j) {
            if (kValChunks % kThreads == 0 || tid + j * kThreads < kValChunks) {
                const T* src = val_g0 + static_cast<long long>(j * kValRowStep) * val_stride + kt * kValCols;
                cp_async_16_zfill(val_s + val_s0 + j * kValRowStep * kValCols * 2, src, true);
            }
        }
#pragma unroll
        for (int j = 0; j < kMetaIters; ++j) {
            const int i = tid + j * kThreads;
            if (kMetaChunks % kThreads == 0 || i < kMetaChunks) {
                const int u = i / 8, c = i % 8;
                const unsigned* src = p.meta + (static_cast<long long>(n0 / 16 + u) * meta_row_words + kt * 32 + c * 4);
                cp_async_16_zfill(meta_s + (u * 32 + c * 4) * 4, src, true);
            }
        }
        const int col = kt * kBlockK + x_ch * 8;
#pragma unroll
        for (int j = 0; j < kXIters; ++j) {
            if (kXChunks % kThreads == 0 || tid + j * kThreads < kXChunks) {
                const int row = x_row0 + j * kXRowStep;
                const long long r = r0 + row;
                const unsigned dst = x_s + swizzle_offset<kBlockK>(row, x_ch * 8) * 2;
                if constexpr (VecX) {
                    const bool ok = r < p.rows && col < p.k;
                    const T* src = ok ? x + r * p.x_row_stride + col : x;
                    cp_async_16_zfill(dst, src, ok);
                } else {
                    const unsigned short* xs = reinterpret_cast<const unsigned short*>(x);
                    unsigned short e[8];
#pragma unroll
                    for (int q = 0; q < 8; ++q) {
                        e[q] = (r < p.rows && col + q < p.k) ? xs[r * p.x_row_stride + col + q] : 0;
                    }
                    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst),
                                 "r"(e[0] | (static_cast<unsigned>(e[1]) << 16)),
                                 "r"(e[2] | (static_cast<unsigned>(e[3]) << 16)),
                                 "r"(e[4] | (static_cast<unsigned>(e[5]) << 16)),
                                 "r"(e[6] | (static_cast<unsigned>(e[7]) << 16))
                                 : "memory");
                }
            }
        }
    };

    float acc[kMT][kNT][4];
#pragma unroll
    for (int i = 0; i < kMT; ++i)
#pragma unroll
        for (int j = 0; j < kNT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.0f;

    const unsigned smem0 = smem_u32(smem);
#pragma unroll
    for (int s = 0; s < Stages - 1; ++s) {
        if (s < ktiles) load_stage(smem0 + s * kStageBytes, s);
        cp_async_commit();
    }

    // ldmatrix byte offsets inside a stage. values: lane l reads row (l % 16) of an m16 tile at
    // chunk 2 kk + l / 16 (matrices rows 0-7 | 8-15 × chunk 0 | 1 = a0..a3); the tile rows start
    // at multiples of 16, so the swizzle term ((row / 2) % 4) is the lane's. x: lane l reads
    // row (l % 8) of an n8 tile at chunk 4 kk + l / 8 (b0..b3 = k 0-7, 8-15, 16-23, 24-31); rows
    // start at multiples of 8, so the swizzle term (row % 8) is the lane's.
    const int a_row = lane & 15, a_chunk = lane >> 4;
    const int b_row = lane & 7, b_chunk = lane >> 3;
    unsigned a_off[2], b_off[2];
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
        a_off[kk] = swizzle_offset<kValCols>(warp_n0 + a_row, (2 * kk + a_chunk) * 8) * 2;
        b_off[kk] = swizzle_offset<kBlockK>(warp_r0 + b_row, (4 * kk + b_chunk) * 8) * 2;
    }
    const unsigned meta_off = kValBytes + kXBytes + ((warp_n0 >> 4) * 32 + lane) * 4;

    int read_stage = 0;                 // stage of k tile kt
    int write_stage = Stages - 1;       // stage of k tile kt + Stages - 1
    for (int kt = 0; kt < ktiles; ++kt) {
        cp_async_wait<Stages - 2>();
        __syncthreads();
        if (kt + Stages - 1 < ktiles) load_stage(smem0 + write_stage * kStageBytes, kt + Stages - 1);
        cp_async_commit();
        write_stage = write_stage == Stages - 1 ? 0 : write_stage + 1;

        const unsigned base = smem0 + read_stage * kStageBytes;
        read_stage = read_stage == Stages - 1 ? 0 : read_stage + 1;
        unsigned e[kMT];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
            asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(e[mt]) : "r"(base + meta_off + mt * 128) : "memory");
        }
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
            unsigned a[kMT][4];
            unsigned b[kNT][4];
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) ldmatrix_x4(a[mt], base + a_off[kk] + mt * 16 * kValCols * 2);
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) ldmatrix_x4(b[nt], base + kValBytes + b_off[kk] + nt * 8 * kBlockK * 2);
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt) {
                    if (kk == 0) {
                        mma_sp_m16n8k32<T, 0>(acc[mt][nt], a[mt], b[nt], e[mt]);
                    } else {
                        mma_sp_m16n8k32<T, 1>(acc[mt][nt], a[mt], b[nt], e[mt]);
                    }
                }
        }
    }

    // ---- epilogue
    cp_async_wait<0>();
    __syncthreads();
    T* cs = reinterpret_cast<T*>(smem);  // BlockR × kOutCols staging tile
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int nl = warp_n0 + mt * 16 + g + 8 * h;
            const int n = n0 + nl;
            float bv = 0.0f;
            if (p.bias_kind != 0 && n < p.n) {
                bv = p.bias_kind == 2 ? static_cast<const float*>(p.bias)[n]
                                      : static_cast<float>(static_cast<const T*>(p.bias)[n]);
            }
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
                const int rl = warp_r0 + nt * 8 + 2 * t;
                cs[rl * kOutCols + nl] = static_cast<T>(activate<Act>(acc[mt][nt][2 * h] + bv));
                cs[(rl + 1) * kOutCols + nl] = static_cast<T>(activate<Act>(acc[mt][nt][2 * h + 1] + bv));
            }
        }
    }
    __syncthreads();
    T* out = static_cast<T*>(p.out);
    constexpr int kOutChunks = BlockN / 8;
#pragma unroll 4
    for (int i = tid; i < BlockR * kOutChunks; i += kThreads) {
        const int rl = i / kOutChunks, ch = i % kOutChunks;
        const long long r = r0 + rl;
        const int n = n0 + ch * 8;
        if (r >= p.rows || n >= p.n) continue;
        const T* src = cs + rl * kOutCols + ch * 8;
        T* dst = out + r * p.out_row_stride + n;
        if (p.vec_out) {
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j)
                if (n + j < p.n) dst[j] = src[j];
        }
    }
}

}  // namespace ferroattn
