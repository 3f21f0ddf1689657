// ferroattn — 2:4 structured-sparse matmul for Hopper (sm_90a): wgmma.mma_async.sp, TMA +
// mbarrier pipeline, warp-specialised, persistent.
//
// What: out (rows, n) = act(x (rows, k) @ w.T + bias), w (n, k) 2:4-sparse, given compressed as
// values (m_pad, k_pad / 2) + meta (m_pad / 16, k_pad) int16 in the layout of
// src/ops/sparse24/host.rs (the SAME layout kernels/sparse24/mma_sp.cuh reads: no second
// layout). Same contract and Sparse24MatmulParams as mma_sp.cuh, plus three TMA maps.
// Orientation: w is wgmma's sparse A operand (M side = w rows = output features), the tokens
// (x rows) are N: a tile computes out^T (BM features x BN tokens) and the epilogue writes it
// transposed into row-major out.
// Tiling: BM = 128 or 256 features (two consumer warpgroups x 64 or x 128 = one or two m64
// blocks each) x BN tokens (128 / 192 / 256) x 128 logical k per pipeline stage (= 64 compressed
// columns = 2 metadata units = 4 k32 steps per m64 block).
// 384 threads = 3 warpgroups: warpgroup 0 = producer (one thread issues every TMA copy;
// setmaxnreg.dec 40), warpgroups 1, 2 = consumers (setmaxnreg.inc 232), consumer c owns
// features (BM / 2) c .. (BM / 2) (c + 1) - 1 of the tile, BM / 128 x BN / 2 fp32 accumulators
// per thread.
// Persistent: grid <= min(tiles, SMs) (the host: src/tuning/grid.rs, by default the fewest
// CTAs that keep ceil(tiles / SMs) waves); CTA i takes tiles i, i + gridDim.x, ... of the grouped
// order of mma_sp.cuh (groups of 8 token tiles sweep all feature tiles). Any grid >= 1 is correct.
// Shared memory per stage (every part 1024-byte aligned):
//   A  values  BM rows x 128 B (64 compressed elements), 128B swizzle, TMA box (64, BM) of
//              the values map: the canonical K-major layout of a dense A tile (kernels/gemm/
//              sm90.cuh): 8-row groups 1024 B apart (SBO 1024), k32 step j = compressed columns
//              16j .. 16j + 15 = start address + 32 j bytes.
//   B  x       two boxes (64 k, BN tokens) of the x map, BN x 128 B each, 128B swizzle; k32
//              step j reads box j / 2 at start address + 64 (j % 2) bytes (SBO 1024).
//   E  meta    BM / 16 meta rows (16 w rows each) x 64 words (2 units of 32 words), no swizzle:
//              word (r, 32 u + l) = lane l's metadata register of unit u of 16-row group r.
// Metadata (PTX ISA 9.7.15.6.2 "Matrix fragments for warpgroup-level multiply-accumulate
// operation with sparse matrix A"): warp w % 4 of the warpgroup supplies the metadata of A rows
// 16w .. 16w + 15 (here: meta row 4 (kMT c + i) + w of the tile for m64 block i, kMT = BM / 128);
// inside a warp, the f16/bf16 k32 layout is the one of mma.sp m16n8k32 (host.rs): selector 0 reads lanes 4g, 4g + 1 (first / second
// 16 columns; rows g / g + 8 in the low / high 16 bits), selector 1 lanes 4g + 2, 4g + 3.
// host.rs puts step s of a unit in lanes 4g + 2s + h, so step 0 runs with selector 0 and step 1
// with selector 1 on the same register (GPU-verified: a one-stage problem with random metadata
// is exact, 2026-11-30 run 1).
// Metadata registers are read asynchronously: like the accumulators, the metadata register of a
// wgmma.mma_async.sp is read while the wgmma runs, after the instruction was issued, so it must
// not be written until a wgmma.wait_group has retired that wgmma (ptxas does not protect it: it
// ends the register's live range at the issue; CUTLASS's sm90 sparse mainloop keeps 0 wgmma
// groups in flight for the same reason). Run 1 reloaded the registers for stage s + 1 while
// stage s's group was still running (wait_group 1): wrong results whenever metadata differed
// between stages / units (uniform metadata passed, a one-stage problem passed, error grew with
// the pipeline depth). The template parameter Sets picks the cure: 1 = wait_group 0 after each
// stage (production, the default), 2 = two register sets, alternate stages (wait_group 1 keeps
// one stage of wgmmas in flight; the stage count per tile is made even with a zero padding stage;
// the host picks it per call with $FERROATTN_WGMMA_SP_MAINLOOP=pipe).
// Pipeline (per stage s): full[s] (count 1; producer arrive.expect_tx + TMA complete_tx),
// empty[s] (count 8: lane 0 of each consumer warp once that stage's wgmmas completed).
// k_pad % 128 == 64 and the padding stage of Sets = 2: see the consumer loop.
// Tails: TMA zero-fills out-of-range x rows / x columns (k ..) and values / meta columns past
// k_pad / 2 (expect_tx counts whole boxes). A stage with one metadata unit (k_pad % 128 == 64,
// the last one) still loads the second x box (wholly out of range: zeros) and runs steps 2 and
// 3 on zero values and zero x with metadata (0, 1) per group (never the invalid zero pattern):
// exact zeros, and the same wgmma sequence every stage (no branch, see the consumer loop);
// w rows n .. m_pad are zero padding (compress) and never stored; out is predicated per
// element (token < rows, feature < n).
// Accumulators (PTX ISA "Matrix fragments for wgmma .m64nNk16", the k32 sparse shapes use the
// same D layout): thread t of the warpgroup, warp w = t / 32, lane l: d[4j + 2h + e] is
// feature 16w + l/4 + 8h, token 8j + 2(l%4) + e of an m64 block's 64 x BN tile.
// Epilogue: + bias (fp32), activation (common/activation.cuh), rounded to T; Epi = 0 stores
// straight from registers (one warp store covers 4 tokens x 8 consecutive features, 16 B each);
// Epi = 1 (production: 1.05-1.10x on k = 4096 shapes) stages 64 x 64 chunks in
// shared memory (stmatrix .trans) and stores 16 B per lane, 512 contiguous bytes per warp store.
// Epi = 2 (split-k, src/ops/sparse24 `launch_wgmma`): the grid sweeps (k chunk, tile) work units,
// each unit runs its chunk's stages only and stores its raw fp32 product (no bias, no activation:
// Act = 0) to a workspace; kernels/gemm/splitk_reduce.cuh (shared with the dense split-k) sums the
// chunks in order and applies bias + activation. For calls with too few tiles to fill the SMs.
// Epi = 4 (stream-K tail, src/ops/sparse24 `launch_wgmma_stream_k`): the first P.dp_tiles tiles run
// whole (staged epilogue), the remaining tiles' 128-k stages are cut into gridDim.x equal contiguous
// ranges (sp90::sk_unit); a segment that starts inside a tile stores its raw fp32 sum to its CTA's
// workspace slot and sets its CTA's counter; the tile's owner (the segment with the tile's first
// stage, always the last unit of its CTA) adds those partials in k order and runs the staged
// epilogue. For calls whose last wave of tiles is partial (e.g. 688 tiles on 132 SMs).
// Constraints (host side, src/ops/sparse24/mod.rs wgmma_unsupported): T = __half / __nv_bfloat16;
// x's data pointer and row stride 16-byte aligned (TMA), rows >= 1; values / meta as compress
// wrote them (m_pad % 128 == 0, k_pad % 64 == 0: the TMA maps' strides are then 16-byte
// multiples); rows, k_pad < 2^31.
// Dynamic shared memory: Stages x (128 BM + 256 BN + 16 BM) + 16 Stages + 1024 bytes, + 128 + 16384
// with Epi = 1 (sparse24_wgmma_smem_bytes below).
// PTX features (sm_90a): wgmma.mma_async.sp (m64nNk32 .f32.bf16.bf16 / .f32.f16.f16),
// wgmma.fence / commit_group / wait_group, setmaxnreg, cp.async.bulk.tensor.3d with
// mbarrier::complete_tx::bytes, mbarrier try_wait.parity / arrive(.expect_tx),
// prefetch.tensormap. Device helpers (mbarrier, TMA, descriptors, wgmma fences): namespace
// ferroattn::sm90 of kernels/gemm/sm90.cuh.
#pragma once
#include "common/activation.cuh"
#include "common/dtype.cuh"
#include "gemm/sm90.cuh"
#include "sparse24/params.cuh"

namespace ferroattn {

// Kernel parameters of sparse24_matmul_wgmma (mirrors: Sparse24WgmmaParams in
// src/ops/sparse24/mod.rs). 3 x 128 + 128 bytes.
struct Sparse24WgmmaParams {
    TmaMap tma_x;       // x (rows, k) T: dims (k, rows, 1), box (64, BN, 1), 128B swizzle
    TmaMap tma_values;  // values (m_pad, k_pad/2) T: dims (k_pad/2, m_pad, 1), box (64, BM, 1), 128B swizzle
    TmaMap tma_meta;    // meta as 4-byte words (m_pad/16, k_pad/2): dims (k_pad/2, m_pad/16, 1), box (64, BM/16, 1),
                        // no swizzle (any 4-byte element type: a bit copy)
    Sparse24MatmulParams p;  // x / values / meta pointers unused (the maps hold them); row_tiles = ceil(rows / BN),
                             // n_tiles = ceil(m_pad / BM)
    // Split-k (Epi = 2 only; the other forms never read these): work unit u = split s * tiles + tile;
    // split s runs the 128-k stages [s * chunk_tiles, min(k_tiles, (s + 1) * chunk_tiles)) (the host
    // keeps every chunk non-empty) and stores its raw fp32 product to ws + s * ws_split_stride,
    // element (token r, feature f) at r * ws_row_stride + f (f < n only); the reduce step
    // (kernels/gemm/splitk_reduce.cuh) adds the chunks, the bias and the activation.
    float* ws;
    long long ws_split_stride;  // elements
    long long ws_row_stride;    // elements
    int splits;                 // >= 1
    int chunk_tiles;            // >= 1
    // Epi = 3 (split-k with the reduce fused, opt-in): ws holds one slot per tile (256 consumer threads x
    // BM / 128 x BN / 2 fp32, thread-private float4 layout) and flags one counter per tile, zeroed by the
    // host before the launch; split s of a tile waits until its counter reads s, adds the slot (the running
    // sum of chunks 0..s-1, in chunk order), then stores the new sum and sets the counter to s + 1, or, the
    // last split, runs the staged epilogue (bias, activation) into out.
    unsigned* flags;
    // Epi = 4 (stream-K tail; see sp90::sk_unit): tiles 0 .. dp_tiles - 1 run whole (CTA g takes g,
    // g + gridDim.x, ...); the 128-k stages of the remaining tiles, in (tile, k) order, are cut into
    // gridDim.x contiguous ranges, CTA g taking range g after its whole tiles. ws holds one slot per CTA
    // (its first segment's partial sum when that segment starts inside a tile) and flags one counter per
    // CTA, zeroed by the host. The other forms never read it.
    int dp_tiles;
};

// The byte layout the host mirrors pack: maps at 0 / 128 / 256, p at 384 (5 pointers at 384..423,
// 2 int64 at 424, 8 int32 at 440..471, no padding inside), ws at 472, the two int64 at 480 / 488,
// splits / chunk_tiles at 496 / 500, flags at 504, dp_tiles at 512; 640 bytes in all (128-byte
// alignment of the maps).
static_assert(sizeof(Sparse24MatmulParams) == 88 && sizeof(Sparse24WgmmaParams) == 640 &&
                  alignof(Sparse24WgmmaParams) == 128,
              "Sparse24WgmmaParams layout (host mirrors)");

// epi = 1 (staged epilogue) adds 128 bytes of alignment + two 8 KiB staging buffers (one per
// consumer warpgroup: 64 tokens x 64 features of T).
__host__ __device__ constexpr unsigned sparse24_wgmma_smem_bytes(int bn, int stages, int bm = 128, int epi = 0) {
    return static_cast<unsigned>(stages) * (128u * bm + 256u * bn + 16u * bm) + 16u * stages + 1024u +
           (epi == 1 || epi == 3 || epi == 4 ? 128u + 2u * 8192u : 0u);
}

namespace sp90 {

// Generated by a script. d (64 x N, fp32) += A (64 x 32, 2:4 sparse:
// desc_a = the 64 x 16 compressed tile, meta / Sel = this thread's metadata register and the
// sparsity selector) * B (32 x N, desc_b); scale_d = 0 overwrites d. Both operands K-major.
#define FERROATTN_WGMMA_SP_M64N128K32(NAME, TY) \
template <int Sel> \
__device__ __forceinline__ void NAME(float (&d)[64], unsigned long long desc_a, \
                                                   unsigned long long desc_b, unsigned meta, int scale_d) { \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %67, 0;\n" \
        "wgmma.mma_async.sp.sync.aligned.m64n128k32.f32." TY "." TY " " \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, %66, %68, p, 1, 1, 0, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
        : "l"(desc_a), "l"(desc_b), "r"(meta), "r"(scale_d), "n"(Sel)); \
}
FERROATTN_WGMMA_SP_M64N128K32(wgmma_sp_m64n128k32_bf16, "bf16")
FERROATTN_WGMMA_SP_M64N128K32(wgmma_sp_m64n128k32_f16, "f16")
#undef FERROATTN_WGMMA_SP_M64N128K32


#define FERROATTN_WGMMA_SP_M64N192K32(NAME, TY) \
template <int Sel> \
__device__ __forceinline__ void NAME(float (&d)[96], unsigned long long desc_a, \
                                                   unsigned long long desc_b, unsigned meta, int scale_d) { \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %99, 0;\n" \
        "wgmma.mma_async.sp.sync.aligned.m64n192k32.f32." TY "." TY " " \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, %96, %97, %98, %100, p, 1, 1, 0, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]) \
        : "l"(desc_a), "l"(desc_b), "r"(meta), "r"(scale_d), "n"(Sel)); \
}
FERROATTN_WGMMA_SP_M64N192K32(wgmma_sp_m64n192k32_bf16, "bf16")
FERROATTN_WGMMA_SP_M64N192K32(wgmma_sp_m64n192k32_f16, "f16")
#undef FERROATTN_WGMMA_SP_M64N192K32


#define FERROATTN_WGMMA_SP_M64N256K32(NAME, TY) \
template <int Sel> \
__device__ __forceinline__ void NAME(float (&d)[128], unsigned long long desc_a, \
                                                   unsigned long long desc_b, unsigned meta, int scale_d) { \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %131, 0;\n" \
        "wgmma.mma_async.sp.sync.aligned.m64n256k32.f32." TY "." TY " " \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, %130, %132, p, 1, 1, 0, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
        : "l"(desc_a), "l"(desc_b), "r"(meta), "r"(scale_d), "n"(Sel)); \
}
FERROATTN_WGMMA_SP_M64N256K32(wgmma_sp_m64n256k32_bf16, "bf16")
FERROATTN_WGMMA_SP_M64N256K32(wgmma_sp_m64n256k32_f16, "f16")
#undef FERROATTN_WGMMA_SP_M64N256K32


template <typename T, int BN, int Sel>
__device__ __forceinline__ void wgmma_sp_k32(float (&d)[BN / 2], unsigned long long desc_a,
                                             unsigned long long desc_b, unsigned meta, int scale_d) {
    static_assert(BN == 128 || BN == 192 || BN == 256, "BN is 128, 192 or 256");
    constexpr bool kBF = DTypeTraits<T>::kIsBF16;
    if constexpr (BN == 128) {
        if constexpr (kBF) wgmma_sp_m64n128k32_bf16<Sel>(d, desc_a, desc_b, meta, scale_d);
        else wgmma_sp_m64n128k32_f16<Sel>(d, desc_a, desc_b, meta, scale_d);
    } else if constexpr (BN == 192) {
        if constexpr (kBF) wgmma_sp_m64n192k32_bf16<Sel>(d, desc_a, desc_b, meta, scale_d);
        else wgmma_sp_m64n192k32_f16<Sel>(d, desc_a, desc_b, meta, scale_d);
    } else {
        if constexpr (kBF) wgmma_sp_m64n256k32_bf16<Sel>(d, desc_a, desc_b, meta, scale_d);
        else wgmma_sp_m64n256k32_f16<Sel>(d, desc_a, desc_b, meta, scale_d);
    }
}

// Tile t -> (token tile, feature tile): the grouped order of mma_sp.cuh (8 token tiles per
// group; inside a group the token tile runs fastest, so concurrent CTAs share w tiles).
__device__ __forceinline__ void tile_of(const Sparse24MatmulParams& p, long long t, int& row_tile, int& n_tile) {
    constexpr int kGroup = 8;
    const long long per_group = static_cast<long long>(kGroup) * p.n_tiles;
    const int group = static_cast<int>(t / per_group);
    const int first_r = group * kGroup;
    const int gsize = min(p.row_tiles - first_r, kGroup);
    const int in_group = static_cast<int>(t - group * per_group);
    row_tile = first_r + in_group % gsize;
    n_tile = in_group / gsize;
}

// Split-k (Epi = 2): work unit u -> tile t and its 128-k stages [kb, ke) (split s = u / tiles runs
// chunk s of P.chunk_tiles stages; the last chunk may be shorter, never empty: host rule).
__device__ __forceinline__ void split_of(const Sparse24WgmmaParams& P, long long tiles, int k_tiles, long long u,
                                         long long& t, int& kb, int& ke) {
    const int s = static_cast<int>(u / tiles);
    t = u - static_cast<long long>(s) * tiles;
    kb = s * P.chunk_tiles;
    ke = min(k_tiles, kb + P.chunk_tiles);
}

// Fused split-k (Epi = 3) per-tile counters: wait until *f >= want (acquire, gpu scope; one thread,
// then a barrier), set *f = v (release, after the slot stores and a fence).
__device__ __forceinline__ void wait_flag(const unsigned* f, unsigned want) {
    unsigned v;
    for (;;) {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(f) : "memory");
        if (v >= want) return;
        __nanosleep(64);
    }
}
__device__ __forceinline__ void set_flag(unsigned* f, unsigned v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(f), "r"(v) : "memory");
}

// Stream-K tail (Epi = 4). The tail = tiles P.dp_tiles .. tiles - 1, w = their 128-k stages in (tile, k)
// order (tail tile j's stage kk is index j * k_tiles + kk); CTA g's range is [sk_start(w, g),
// sk_start(w, g + 1)) (contiguous, the ranges of consecutive CTAs adjoin, an empty range when w <
// gridDim.x). A CTA's work units: its whole tiles g, g + gridDim.x, ... < dp_tiles, then one segment per
// tile its range touches, in order. Only its first segment can start inside a tile (kb > 0); a segment
// with kb = 0 and ke < k_tiles is the tile's first ("owner") part, the last unit of its CTA.
__device__ __forceinline__ long long sk_start(long long w, int g) {
    return w * g / static_cast<long long>(gridDim.x);
}
// Work units of this CTA.
__device__ __forceinline__ long long sk_units(const Sparse24WgmmaParams& P, long long tiles, int k_tiles) {
    const int g = blockIdx.x;
    const long long dp = P.dp_tiles;
    const long long nd = dp > g ? (dp - g - 1) / gridDim.x + 1 : 0;
    const long long w = (tiles - dp) * k_tiles;
    const long long a = sk_start(w, g), b = sk_start(w, g + 1);
    return nd + (a < b ? (b - 1) / k_tiles - a / k_tiles + 1 : 0);
}
// Unit i (0-based, < sk_units) of this CTA -> tile t and its stages [kb, ke).
__device__ __forceinline__ void sk_unit(const Sparse24WgmmaParams& P, long long tiles, int k_tiles, long long i,
                                        long long& t, int& kb, int& ke) {
    const int g = blockIdx.x;
    const long long dp = P.dp_tiles;
    const long long nd = dp > g ? (dp - g - 1) / gridDim.x + 1 : 0;
    if (i < nd) {
        t = g + i * gridDim.x;
        kb = 0;
        ke = k_tiles;
        return;
    }
    const long long w = (tiles - dp) * k_tiles;
    const long long a = sk_start(w, g), b = sk_start(w, g + 1);
    const long long tt = a / k_tiles + (i - nd);                 // tail tile
    const long long s = i == nd ? a : tt * k_tiles;
    const long long e = min(b, (tt + 1) * k_tiles);
    t = dp + tt;
    kb = static_cast<int>(s - tt * k_tiles);
    ke = static_cast<int>(e - tt * k_tiles);
}

// A real (PTX-level) use of a metadata register after the wait_group that retired its wgmmas.
__device__ __forceinline__ unsigned touch(unsigned v) {
    unsigned r;
    asm volatile("mov.b32 %0, %1;\n" : "=r"(r) : "r"(v));
    return r;
}

__device__ __forceinline__ unsigned ld_shared_u32(unsigned addr) {
    unsigned v;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
    return v;
}

__device__ __forceinline__ uint4 ld_shared_v4(unsigned addr) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
    return v;
}

// stmatrix .x4 .trans: lanes 8i .. 8i + 7 give the 16-byte row addresses of matrix i; register i
// of lane l holds fragment row l / 4, columns 2 (l % 4), 2 (l % 4) + 1 of matrix i, and memory row
// c receives fragment COLUMN c (PTX ISA "stmatrix", .trans). With the accumulator fragment of an
// m64 block (rows = features, columns = tokens), memory rows are tokens of 8 consecutive features.
__device__ __forceinline__ void stmatrix_x4_trans(unsigned addr, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// Epilogue bias of the two accumulator rows a consumer thread holds in an m64 block: features f0
// (fragment h = 0) and f0 + 8 (h = 1); 0 past n or without bias (bias_kind 0 none, 1 T, 2 fp32).
// Shared by both epilogue forms.
template <typename T>
__device__ __forceinline__ void bias_pair(const Sparse24MatmulParams& p, int f0, float& b0, float& b1) {
    const int f1 = f0 + 8;
    b0 = 0.0f;
    b1 = 0.0f;
    if (p.bias_kind == 2) {
        const float* bf = static_cast<const float*>(p.bias);
        if (f0 < p.n) b0 = __ldg(bf + f0);
        if (f1 < p.n) b1 = __ldg(bf + f1);
    } else if (p.bias_kind == 1) {
        const T* bt = static_cast<const T*>(p.bias);
        if (f0 < p.n) b0 = static_cast<float>(bt[f0]);
        if (f1 < p.n) b1 = static_cast<float>(bt[f1]);
    }
}

// One output value of either epilogue form: act(accumulator + bias), in fp32.
template <int Act>
__device__ __forceinline__ float epilogue_value(float acc, float bias) {
    return activate<Act>(acc + bias);
}

}  // namespace sp90

// grid = (g), 1 <= g <= row_tiles * n_tiles (host: src/tuning/grid.rs), block = 384, dynamic shared
// memory = sparse24_wgmma_smem_bytes(BN, Stages, BM). Act: ActivationKind (one epilogue per kernel).
// BM = features per tile: 128 (each consumer warpgroup one m64 block) or 256 (two m64 blocks,
// 2 x BN / 2 accumulators; x is reused over twice the features: less L2 traffic per FLOP). With
// BM = 256 the host passes n_tiles = ceil(m_pad / 256) and maps whose values / meta boxes are 256
// / 16 rows; a last tile's second half (rows >= m_pad) is TMA zero fill: its m64 blocks run on
// metadata (0, 1) per group (never the zero pattern) and their outputs are never stored.
//
// Epi (epilogue form): 0 = stores straight from the accumulator registers (2-byte stores, 4 x 16 B
// per warp instruction); 2 = split-k partial (raw fp32 to P.ws, see Sparse24WgmmaParams); 3 = split-k
// with the reduce fused (opt-in: chunks of a tile pass a running fp32 sum through P.ws in chunk order,
// the last runs the staged epilogue; see Sparse24WgmmaParams.flags); 4 = stream-K tail (see the header and
// Sparse24WgmmaParams.dp_tiles; staged epilogue); 1 = staged: per consumer warpgroup, chunks of 64 features (one m64 block) x
// 64 tokens go through an 8 KiB shared buffer (stmatrix .trans, 16-byte chunks XOR-swizzled by
// token % 8: conflict-free writes and reads) and leave as 16-byte coalesced stores (8 lanes = one
// token's 128 contiguous bytes); per element where out is not 16-byte aligned / a feature tail.
//
// Sets (mainloop form, metadata register sets): 1 (the default, the production form of
// src/tuning/sparse24 WgmmaMainloop::DEFAULT) = wait_group 0 after every stage; 2 = two
// alternating metadata register sets and wait_group 1 (one stage of wgmmas in flight across the
// stage boundary). Register budget: ptxas reports 168 registers (the entry count, 65536 / 384)
// for every form, but it allocates the code after setmaxnreg.inc 232 against 232 (SASS: the
// consumer code of <bf16, 128, 3, 0, 256, 1> uses R0..R186, Sets = 1) -- EXCEPT when the consumer
// path contains a trap (BPT.TRAP): then the whole kernel is allocated at 168 (Sets = 2 with the
// former __trap() liveness sink: R0..R165 and 32 B of epilogue spills; with the store sink below:
// R0..R185, 0 spills). Keep traps out of the consumer path.
template <typename T, int BN, int Stages, int Act, int BM = 128, int Epi = 0, int Sets = 1>
__global__ void __launch_bounds__(384, 1) sparse24_matmul_wgmma(const __grid_constant__ Sparse24WgmmaParams P) {
    using namespace sm90;
    constexpr int kMT = BM / 128;                             // m64 blocks per consumer warpgroup
    constexpr int kSets = Sets;                               // metadata register sets (1 or 2)
    static_assert(kSets == 1 || kSets == 2, "Sets is 1 or 2");
    constexpr unsigned kABytes = BM * 128;                    // BM rows x 64 compressed elements
    constexpr unsigned kBBoxBytes = BN * 128;                 // BN tokens x 64 k
    constexpr unsigned kBBytes = 2 * kBBoxBytes;
    constexpr unsigned kMetaBytes = (BM / 16) * 64 * 4;       // BM / 16 meta rows x 2 units x 32 words
    constexpr unsigned kStageBytes = kABytes + kBBytes + kMetaBytes;
    static_assert(BM == 128 || BM == 256, "BM");
    static_assert(BN % 64 == 0 && BN <= 256, "BN");
    static_assert(kStageBytes % 1024 == 0, "1024-byte aligned stages (128B swizzle atoms)");
    static_assert(Stages >= 2 && sparse24_wgmma_smem_bytes(BN, Stages, BM, Epi) <= 227 * 1024,
                  "stages do not fit in shared memory");
    static_assert(Epi >= 0 && Epi <= 4, "Epi is 0, 1, 2, 3 or 4");
    static_assert(Epi != 2 || (kSets == 1 && Act == 0), "split-k partials (Epi 2): Sets 1, no activation");
    static_assert(Epi != 3 || kSets == 1, "fused split-k (Epi 3): Sets 1");
    static_assert(Epi != 4 || kSets == 1, "stream-K tail (Epi 4): Sets 1");
    constexpr bool kSplit = Epi == 2 || Epi == 3;
    constexpr bool kSK = Epi == 4;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const unsigned bars = base + Stages * kStageBytes;
    auto full = [&](int s) { return bars + 8u * s; };
    auto empty = [&](int s) { return bars + 8u * (Stages + s); };
    // Epi = 1: the two staging buffers (8 KiB each), 128-byte aligned after the barriers
    const unsigned epi_buf = (bars + 16u * Stages + 127u) & ~127u;

    const Sparse24MatmulParams& p = P.p;
    const int wg = threadIdx.x / 128;
    const int tid = threadIdx.x % 128;
    const int k_tiles = (p.k_pad + 127) / 128;                // stages with data per tile
    // stages run per tile: kSets = 2 alternates two metadata register sets, so the count is made
    // even (an odd k_tiles gets one padding stage wholly past k_pad: TMA zero fill, adds zeros)
    const int k_steps = kSets == 2 ? (k_tiles + 1) & ~1 : k_tiles;
    const long long tiles = static_cast<long long>(p.row_tiles) * p.n_tiles;
    // work units: one per tile, or (Epi = 2) one per (k chunk, tile)
    const long long units = kSplit ? tiles * P.splits : tiles;
    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < Stages; ++s) {
            mbar_init(full(s), 1);
            mbar_init(empty(s), 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        // Producer warpgroup: one thread issues every copy.
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (tid == 0) {
            tma_prefetch_map(&P.tma_x);
            tma_prefetch_map(&P.tma_values);
            tma_prefetch_map(&P.tma_meta);
            int stage = 0;
            unsigned phase = 0;
            // Epi = 4: u counts this CTA's own units (sp90::sk_unit); else the global unit index
            const long long u_end = kSK ? sp90::sk_units(P, tiles, k_tiles) : units;
            for (long long u = kSK ? 0 : blockIdx.x; u < u_end; u += kSK ? 1 : gridDim.x) {
                long long t = u;
                int kb = 0, ke = k_steps;  // this unit's stages [kb, ke)
                if constexpr (kSplit) sp90::split_of(P, tiles, k_tiles, u, t, kb, ke);
                if constexpr (kSK) sp90::sk_unit(P, tiles, k_tiles, u, t, kb, ke);
                int row_tile, n_tile;
                sp90::tile_of(p, t, row_tile, n_tile);
                const int n0 = n_tile * BM;
                const int r0 = row_tile * BN;
                for (int kt = kb; kt < ke; ++kt) {
                    sm90::mbar_wait(empty(stage), phase ^ 1u);
                    const unsigned fb = full(stage);
                    mbar_expect_tx(fb, kStageBytes);  // out-of-range box parts count (zero-filled)
                    const unsigned sa = base + stage * kStageBytes;
                    const unsigned sb = sa + kABytes;
                    const unsigned se = sb + kBBytes;
                    tma_load_3d(sa, &P.tma_values, fb, kt * 64, n0, 0);
                    tma_load_3d(se, &P.tma_meta, fb, kt * 64, n0 / 16, 0);
                    tma_load_3d(sb, &P.tma_x, fb, kt * 128, r0, 0);
                    tma_load_3d(sb + kBBoxBytes, &P.tma_x, fb, kt * 128 + 64, r0, 0);
                    if (++stage == Stages) {
                        stage = 0;
                        phase ^= 1u;
                    }
                }
            }
        }
    } else {
        // Consumer warpgroups: features (BM / 2) cw .. + BM / 2 - 1 of the tile x BN tokens each.
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
        const int cw = wg - 1;
        const int warp = tid / 32;
        const int lane = tid % 32;
        // this warp's metadata words for m64 block i: meta row 4 (kMT cw + i) + warp of the stage,
        // word `lane` of unit 0 / 1
        const unsigned meta_off = kABytes + kBBytes + ((cw * kMT * 4 + warp) * 64 + lane) * 4;
        const int m_pad = (p.n + 127) / 128 * 128;
        float d[kMT][BN / 2];
        // Metadata registers, kSets sets (see "Metadata registers are read asynchronously" above):
        // em[set][i][u] = unit u of m64 block i. A set is written only once the wgmma group that
        // read it has retired (kSets = 1: wait_group 0 each stage; kSets = 2: the stages alternate
        // sets and wait_group 1 retires the other set's group before it is reloaded).
        unsigned em[kSets][kMT][2];
#pragma unroll
        for (int s = 0; s < kSets; ++s)
#pragma unroll
            for (int i = 0; i < kMT; ++i) em[s][i][0] = em[s][i][1] = 0x44444444u;
        unsigned keep = 0;  // kSets = 2: a use of each set after its group retired (liveness for ptxas)
        int stage = 0;
        unsigned phase = 0;
        const long long u_end = kSK ? sp90::sk_units(P, tiles, k_tiles) : units;
        for (long long u = kSK ? 0 : blockIdx.x; u < u_end; u += kSK ? 1 : gridDim.x) {
            long long t = u;
            int kb = 0, ke = k_steps;  // this unit's stages [kb, ke) (the producer's)
            if constexpr (kSplit) sp90::split_of(P, tiles, k_tiles, u, t, kb, ke);
            if constexpr (kSK) sp90::sk_unit(P, tiles, k_tiles, u, t, kb, ke);
            int row_tile, n_tile;
            sp90::tile_of(p, t, row_tile, n_tile);
            int prev = 0;
            for (int kt0 = kb; kt0 < ke; kt0 += kSets) {
#pragma unroll
                for (int h = 0; h < kSets; ++h) {
                    const int kt = kt0 + h;
                    sm90::mbar_wait(full(stage), phase);
                    const unsigned st = base + stage * kStageBytes;
                    const unsigned sb = st + kABytes;
                    // a unit past k_pad (unit 1 of a stage with k_pad % 128 == 64, or both units of
                    // the even-count padding stage; uniform): values and x are TMA zero fill, meta
                    // zero fill = the invalid pattern 0b0000: indices (0, 1) per group instead, so
                    // the steps add exact zeros without a branch around the wgmmas (a branch makes
                    // ptxas inject warpgroup.arrive, C7519)
                    const bool unit0 = kt * 128 < p.k_pad;
                    const bool unit1 = kt * 128 + 64 < p.k_pad;
#pragma unroll
                    for (int i = 0; i < kMT; ++i) {
                        const unsigned mo = st + meta_off + i * (4 * 256);
                        // an m64 block wholly past m_pad (BM = 256, last tile): zero values, same trick
                        const bool rows_ok = kMT == 1 || n_tile * BM + (cw * kMT + i) * 64 < m_pad;
                        em[h][i][0] = rows_ok && unit0 ? sp90::ld_shared_u32(mo) : 0x44444444u;
                        em[h][i][1] = rows_ok && unit1 ? sp90::ld_shared_u32(mo + 128) : 0x44444444u;
                    }
                    const int acc = kt != kb;
                    wgmma_fence();
#pragma unroll
                    for (int i = 0; i < kMT; ++i) {
                        const unsigned sa = st + (cw * kMT + i) * (64 * 128);  // this block's 64 values rows
                        sp90::wgmma_sp_k32<T, BN, 0>(d[i], wgmma_desc(sa, 16u, 1024u), wgmma_desc(sb, 16u, 1024u),
                                                     em[h][i][0], acc);
                        sp90::wgmma_sp_k32<T, BN, 1>(d[i], wgmma_desc(sa + 32u, 16u, 1024u),
                                                     wgmma_desc(sb + 64u, 16u, 1024u), em[h][i][0], 1);
                        sp90::wgmma_sp_k32<T, BN, 0>(d[i], wgmma_desc(sa + 64u, 16u, 1024u),
                                                     wgmma_desc(sb + kBBoxBytes, 16u, 1024u), em[h][i][1], 1);
                        sp90::wgmma_sp_k32<T, BN, 1>(d[i], wgmma_desc(sa + 96u, 16u, 1024u),
                                                     wgmma_desc(sb + kBBoxBytes + 64u, 16u, 1024u), em[h][i][1], 1);
                    }
                    wgmma_commit();
                    if constexpr (kSets == 1) {
                        // this stage's wgmmas (and their metadata reads) done: registers and stage free
                        wgmma_wait<0>();
                        if (lane == 0) mbar_arrive(empty(stage));
                    } else {
                        wgmma_wait<1>();  // the previous stage's group (the other set) retired
#pragma unroll
                        for (int i = 0; i < kMT; ++i) keep ^= sp90::touch(em[h ^ 1][i][0]) ^ sp90::touch(em[h ^ 1][i][1]);
                        if (kt > 0 && lane == 0) mbar_arrive(empty(prev));
                        prev = stage;
                    }
                    if (++stage == Stages) {
                        stage = 0;
                        phase ^= 1u;
                    }
                }
            }
            wgmma_wait<0>();
#pragma unroll
            for (int i = 0; i < kMT; ++i) fence_accumulators(d[i]);
            if constexpr (kSets == 2) {
#pragma unroll
                for (int i = 0; i < kMT; ++i) keep ^= sp90::touch(em[1][i][0]) ^ sp90::touch(em[1][i][1]);
                if (lane == 0) mbar_arrive(empty(prev));
            }

            if constexpr (Epi == 3) {
                // fused split-k: add the running sum of the earlier chunks, pass it on or finish the tile
                const int split = static_cast<int>((u - t) / tiles);
                float* slot = P.ws + t * (256ll * kMT * (BN / 2));
                unsigned* flag = P.flags + t;
                const int ct = cw * 128 + tid;  // consumer thread 0..255
                if (split > 0) {
                    if (ct == 0) sp90::wait_flag(flag, static_cast<unsigned>(split));
                    named_barrier(3, 256);
#pragma unroll
                    for (int i = 0; i < kMT; ++i)
#pragma unroll
                        for (int q = 0; q < BN / 8; ++q) {
                            const float4 v = __ldcg(reinterpret_cast<const float4*>(slot) + (i * (BN / 8) + q) * 256 + ct);
                            d[i][4 * q] = v.x + d[i][4 * q];
                            d[i][4 * q + 1] = v.y + d[i][4 * q + 1];
                            d[i][4 * q + 2] = v.z + d[i][4 * q + 2];
                            d[i][4 * q + 3] = v.w + d[i][4 * q + 3];
                        }
                }
                if (split + 1 < P.splits) {
#pragma unroll
                    for (int i = 0; i < kMT; ++i)
#pragma unroll
                        for (int q = 0; q < BN / 8; ++q)
                            __stcg(reinterpret_cast<float4*>(slot) + (i * (BN / 8) + q) * 256 + ct,
                                   make_float4(d[i][4 * q], d[i][4 * q + 1], d[i][4 * q + 2], d[i][4 * q + 3]));
                    __threadfence();
                    named_barrier(3, 256);  // every consumer thread's part of the sum is out
                    if (ct == 0) sp90::set_flag(flag, static_cast<unsigned>(split + 1));
                    continue;  // not the last chunk: no output
                }
            }

            if constexpr (Epi == 4) {
                // stream-K tail: a segment that starts inside its tile hands its partial sum to the tile's
                // owner through this CTA's slot; the owner (kb = 0) adds the later segments' partials in k
                // order (the first segments of CTAs blockIdx.x + 1, ...) and runs the epilogue
                constexpr long long kSlot = 256ll * kMT * (BN / 2);  // fp32 per slot
                const int ct = cw * 128 + tid;                       // consumer thread 0..255
                if (kb > 0) {
                    float* slot = P.ws + blockIdx.x * kSlot;
#pragma unroll
                    for (int i = 0; i < kMT; ++i)
#pragma unroll
                        for (int q = 0; q < BN / 8; ++q)
                            __stcg(reinterpret_cast<float4*>(slot) + (i * (BN / 8) + q) * 256 + ct,
                                   make_float4(d[i][4 * q], d[i][4 * q + 1], d[i][4 * q + 2], d[i][4 * q + 3]));
                    __threadfence();
                    named_barrier(3, 256);  // every consumer thread's part is out
                    if (ct == 0) sp90::set_flag(P.flags + blockIdx.x, 1u);
                    continue;  // not the tile's owner: no output
                }
                if (ke < k_tiles) {
                    const long long w = (tiles - P.dp_tiles) * k_tiles;
                    const long long tile_end = (t - P.dp_tiles + 1) * k_tiles;
                    for (int g2 = blockIdx.x + 1; g2 < static_cast<int>(gridDim.x); ++g2) {
                        const long long a2 = sp90::sk_start(w, g2);
                        if (a2 >= tile_end) break;
                        if (sp90::sk_start(w, g2 + 1) == a2) continue;  // empty range: no segment
                        if (ct == 0) sp90::wait_flag(P.flags + g2, 1u);
                        named_barrier(3, 256);
                        const float* slot = P.ws + g2 * kSlot;
#pragma unroll
                        for (int i = 0; i < kMT; ++i)
#pragma unroll
                            for (int q = 0; q < BN / 8; ++q) {
                                const float4 v = __ldcg(reinterpret_cast<const float4*>(slot) + (i * (BN / 8) + q) * 256 + ct);
                                d[i][4 * q] = d[i][4 * q] + v.x;
                                d[i][4 * q + 1] = d[i][4 * q + 1] + v.y;
                                d[i][4 * q + 2] = d[i][4 * q + 2] + v.z;
                                d[i][4 * q + 3] = d[i][4 * q + 3] + v.w;
                            }
                    }
                }
            }

            // ---- epilogue: out[token][feature] = act(d + bias), predicated per element
            const int g = lane >> 2, tq = lane & 3;
            T* out = static_cast<T*>(p.out);
            const long long r0 = static_cast<long long>(row_tile) * BN;
            if constexpr (Epi == 1 || Epi == 3 || Epi == 4) {
                // 16-byte stores need out and its row stride 16-byte aligned (uniform)
                const bool vec = (reinterpret_cast<unsigned long long>(p.out) & 15ull) == 0 &&
                                 (p.out_row_stride & 7) == 0;
                const unsigned buf = epi_buf + cw * 8192u;
                const int q = lane >> 3, rr = lane & 7;
#pragma unroll
                for (int i = 0; i < kMT; ++i) {
                    const int fb = n_tile * BM + (cw * kMT + i) * 64;  // first feature of m64 block i
                    float b0, b1;  // features fb + 16 warp + g (h = 0) and + 8 (h = 1)
                    sp90::bias_pair<T>(p, fb + warp * 16 + g, b0, b1);
#pragma unroll
                    for (int c = 0; c < BN / 64; ++c) {
                        // chunk: tokens 64 c .. 64 c + 63 (accumulator columns j = 8 c .. 8 c + 7).
                        // stmatrix x4 = fragments (j, h 0), (j, h 1), (j + 1, h 0), (j + 1, h 1);
                        // lane 8 q' + rr addresses buffer row (token) 8 (j' + q' / 2) + rr, 16-byte
                        // chunk 2 warp + q' % 2 (features 16 warp + 8 (q' % 2) ..), swizzled.
#pragma unroll
                        for (int jp = 0; jp < 4; ++jp) {
                            const int j = 8 * c + 2 * jp;
                            // bias + activation in place (one value at a time: fewer live temporaries
                            // than packing from eight activations at once, which spilled gelu_erf)
#pragma unroll
                            for (int x = 0; x < 8; ++x)
                                d[i][4 * j + x] = sp90::epilogue_value<Act>(d[i][4 * j + x], (x & 2) ? b1 : b0);
                            const unsigned w0 = pack_pair<T>(d[i][4 * j], d[i][4 * j + 1]);
                            const unsigned w1 = pack_pair<T>(d[i][4 * j + 2], d[i][4 * j + 3]);
                            const unsigned w2 = pack_pair<T>(d[i][4 * j + 4], d[i][4 * j + 5]);
                            const unsigned w3 = pack_pair<T>(d[i][4 * j + 6], d[i][4 * j + 7]);
                            const int tok = 16 * jp + 8 * (q >> 1) + rr;
                            const int ch = (2 * warp + (q & 1)) ^ (tok & 7);
                            sp90::stmatrix_x4_trans(buf + tok * 128 + ch * 16, w0, w1, w2, w3);
                        }
                        named_barrier(1 + cw, 128);  // chunk complete in buf
#pragma unroll
                        for (int pass = 0; pass < 4; ++pass) {
                            const int idx = pass * 128 + tid;
                            const int tok = idx >> 3, qq = idx & 7;
                            const uint4 v = sp90::ld_shared_v4(buf + tok * 128 + ((qq ^ (tok & 7)) * 16));
                            const long long r = r0 + 64 * c + tok;
                            const int f = fb + 8 * qq;
                            if (r < p.rows) {
                                T* dst = out + r * p.out_row_stride + f;
                                if (vec && f + 8 <= p.n) {
                                    *reinterpret_cast<uint4*>(dst) = v;
                                } else {
                                    const unsigned wv[4] = {v.x, v.y, v.z, v.w};
                                    unsigned short* d16 = reinterpret_cast<unsigned short*>(dst);
#pragma unroll
                                    for (int e = 0; e < 8; ++e)
                                        if (f + e < p.n)
                                            d16[e] = static_cast<unsigned short>(wv[e >> 1] >> (16 * (e & 1)));
                                }
                            }
                        }
                        named_barrier(1 + cw, 128);  // buf read by every thread: free for the next chunk
                    }
                }
            } else if constexpr (Epi == 2) {
                // split-k partial: the raw fp32 accumulators of split (u - t) / tiles to the
                // workspace, token-major like out (8 consecutive features = one 32-byte sector per
                // warp store row); the reduce adds bias and activation
                const long long split = (u - t) / tiles;
                float* ws = P.ws + split * P.ws_split_stride;
#pragma unroll
                for (int i = 0; i < kMT; ++i) {
                    const int f0 = n_tile * BM + (cw * kMT + i) * 64 + warp * 16 + g;
                    const int f1 = f0 + 8;
#pragma unroll
                    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const long long r = r0 + 8 * j + 2 * tq + e;
                            if (r < p.rows) {
                                float* wrow = ws + r * P.ws_row_stride;
                                if (f0 < p.n) wrow[f0] = d[i][4 * j + e];
                                if (f1 < p.n) wrow[f1] = d[i][4 * j + 2 + e];
                            }
                        }
                    }
                }
            } else {
#pragma unroll
            for (int i = 0; i < kMT; ++i) {
                // features f0 (h = 0), f0 + 8 (h = 1) of m64 block i
                const int f0 = n_tile * BM + (cw * kMT + i) * 64 + warp * 16 + g;
                const int f1 = f0 + 8;
                float b0, b1;
                sp90::bias_pair<T>(p, f0, b0, b1);
#pragma unroll
                for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const long long r = r0 + 8 * j + 2 * tq + e;
                        if (r < p.rows) {
                            T* orow = out + r * p.out_row_stride;
                            if (f0 < p.n) orow[f0] = static_cast<T>(sp90::epilogue_value<Act>(d[i][4 * j + e], b0));
                            if (f1 < p.n) orow[f1] = static_cast<T>(sp90::epilogue_value<Act>(d[i][4 * j + 2 + e], b1));
                        }
                    }
                }
            }
            }  // Epi == 0
        }
        // kSets = 2: keep the XOR of every metadata set (taken after its group retired) alive, so
        // ptxas cannot end a set's live range at its wgmmas and reuse the register while they
        // run. Never true (rows >= 1 is a host contract). A store, not __trap(): a trap on the
        // consumer path makes ptxas allocate it at the 168-register entry count (see Sets above).
        if (kSets == 2 && p.rows < 0) *static_cast<unsigned*>(p.out) = keep;
    }
}

}  // namespace ferroattn
