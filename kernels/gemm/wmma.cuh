// ferroattn — dense GEMM, portable tensor-core path (nvcuda::wmma, sm_80+).
//
// What: out[z] = act(alpha * A[z] @ B[z] + beta * C[z] + bias) for z in [0, batch), with A[z]
// (m, k) and B[z] (k, n) of type T (fp16 or bf16), fp32 accumulation and an fp32 epilogue
// (the cuBLASLt order: scale, add C, add bias, activate) rounded once to TOut; when
// params.aux != nullptr the pre-activation value is also written there (for the backward of
// the activation). Activation codes: common/activation.cuh (0 none, 1 relu, 2 gelu_tanh,
// 3 gelu_erf, 4 silu), chosen at run time by params.activation (one uniform switch per
// element group in the epilogue; the main loop does not depend on it).
//
// Layouts (strides in elements, 64-bit; GemmWmmaParams):
//   A: ARow ? element (i, kk) at a + z*a_batch_stride + i*a_ld + kk        (row-major, NN/NT)
//           : element (i, kk) at a + z*a_batch_stride + kk*a_ld + i        (column-major)
//   B: BRow ? element (kk, j) at b + z*b_batch_stride + kk*b_ld + j        (row-major)
//           : element (kk, j) at b + z*b_batch_stride + j*b_ld + kk        (column-major)
//   out / c / aux: row-major, element (i, j) at p + z*batch_stride + i*ld + j; c (read only when
//   beta != 0) and bias (n,) (fp32 when bias_f32, else T) may be nullptr; a batch stride of 0
//   broadcasts an input. Any m, n, k >= 1, batch >= 1 (the grid's y dim loops over batch, so
//   any batch count works).
//
// Template parameters:
//   T, TOut    input (__half / __nv_bfloat16) and output (T's kind or float) types.
//   BM, BN, BK block tile; WarpsM x WarpsN warps, each owning a (BM/WarpsM) x (BN/WarpsN) tile of
//              16x16 wmma accumulators. BK a multiple of 16 (32 with DoubleBuffer), the warp tile
//              of 16.
//   Stages     >= 2: shared-memory ring of A/B tiles filled by cp.async, Stages-1 tiles ahead.
//   ARow, BRow the operand layouts (all four NN/NT/TN/TT combinations, no copies).
//   VecA, VecB elements per global->shared copy for each operand: 8 (16-byte cp.async.cg), 4 or
//              2 (8/4-byte cp.async.ca), or 1 (plain 2-byte loads and shared stores, no cp.async:
//              the path for rows that are not even 4-byte aligned, e.g. k = 17 row-major). The
//              caller (src/tuning/gemm.rs) picks the widest one for which the pointer, the leading
//              dim and the batch stride are multiples of the vector; vectors that cross the end of
//              a line copy only the in-range bytes (cp.async src-size; the rest is zero-filled).
//   DoubleBuffer  true: in interior blocks (below) the fragments of the next 16-deep k step are
//              read while the current step's mma run (two fragment sets in registers, the tile
//              boundary included: the barrier for tile kt+1 is taken before tile kt's last step);
//              edge blocks run the single-buffered loop (their checked copies keep more registers
//              live). false: one set, read right before its mma, one barrier per tile.
//   Mbarrier   how the double-buffered interior loop synchronises its warps (DoubleBuffer only;
//              edge blocks always run the single-buffered loop with __syncthreads):
//              false  one __syncthreads per tile, before the last 16-deep step's mma;
//              true   per-stage mbarriers instead: full[s] completes when every thread's copies
//                     into slot s landed (cp.async.mbarrier.arrive.noinc), empty[s] when every
//                     warp multiplied its last fragments of slot s (one arrive per warp); copies
//                     run Stages-2 tiles ahead (Stages >= 3), so a warp may run up to a tile
//                     ahead of the slowest one instead of meeting all of them every tile (H200,
//                     bench/NOTES.md "WMMA path": +15 % at 128x256x64 with 4 stages; ncu: the barrier and MIO
//                     throttle stalls gone).
//   Persistent (Mbarrier only; the sm_90a large tile, tile override field 9) a
//              persistent grid: gridDim = (CTAs, 1, 1) over the tiles_m * tiles_n * batch work
//              items, each CTA looping over items; interior items share one mbarrier pipeline
//              whose phases continue across items, the next item's first Stages - 2 k tiles are
//              copied under the current item's last ones and land during its epilogue, which
//              stages per warp (16 x 16 fp32 at a time) in a slab after the ring (unrolled when
//              the epilogue is out = alpha * acc with aligned vector stores); edge items run
//              the checked single-buffered loop and block-wide epilogue as usual. Optional
//              stream-k tail (params.sk_ws != nullptr, every item interior): items sk_first ..
//              are split into equal ranges of k tiles, one per CTA; an item split between CTAs
//              c and c + 1 is finished by c, which adds c + 1's fp32 partial tile (workspace
//              slot c, per-warp flags: st.release / ld.acquire at gpu scope) before its
//              epilogue (c + 1 produces at the start of its range, c consumes at the end; the
//              last CTA never waits, so any scheduling order of the CTAs completes).
// Copies: interior blocks (block tile inside m x n, k a multiple of BK, every thread's vectors at
// one element offset of its lines: FastCopy) copy each tile with one global pointer per operand
// and compile-time shared offsets (cp.async without bound checks), spread over the first half
// of the tile's 16-deep steps; edge blocks use load_tile (per-vector bounds, zero fill). The
// batch loop is instantiated once per kind of block, so neither path keeps the other's address
// registers live.
// Fragments: f16 operands use wmma.load (PTX, .shared state space) in their stored layouts. For
// bf16, ptxas lowers wmma.load into 32-bit loads (no shared-memory matrix loads; C++
// load_matrix_sync even came out as generic LD.E), so bf16 fragments are declared (row A, col B)
// and filled by ldmatrix.x4 (.trans for transposed storage) in the register order ptxas itself
// uses for those fragments (= the mma.m16n8k16 operand layouts; see ldsm_lane_offset).
// Tails: tile rows/columns and k steps beyond m, n, k are zero-filled on load and never stored.
//
// Shared memory (bytes = gemm_wmma_smem_bytes<...>(), mirrored by GemmWmmaConfig::smem_bytes in
// src/tuning/gemm.rs): Stages x (A tile + B tile), each tile stored "line-major" in the layout its
// operand has in global memory (the contiguous dim inside a line), each line padded by 8
// elements (16 bytes). Why padding and not an XOR swizzle: wmma::load_matrix_sync takes a plain
// pointer and one leading dimension, so the tile must be linear in shared memory; a line pitch
// of (L + 8) elements puts the 8 lines that one 16-byte-per-lane load phase touches on 8
// different 16-byte bank groups (pitch/16 bytes is odd), which is what a swizzle would achieve
// (ldmatrix and cp.async phases are conflict-free), and keeps every fragment pointer 32-byte
// aligned (wmma's requirement). The cost is 8/L of the ring (20% at L = 32, 11% at L = 64). The epilogue reuses the
// ring as a BM x (BN + 4) fp32 tile (store_matrix_sync: the accumulator fragment layout is
// opaque), then each thread processes groups of 4 columns (coalesced global stores, vectorised
// when out/c/aux pointers, leading dims and batch strides allow 4-element vectors). With
// Mbarrier, 2 x Stages 8-byte mbarriers are static shared memory on top of the dynamic bytes.
// Launch: grid (tiles_m * tiles_n, min(batch, 65535), 1) with block tiles visited in groups of
// params.group tile rows (L2 reuse of B; 8 unless $FERROATTN_GEMM_WMMA_GROUP says otherwise), block WarpsM*WarpsN*32 threads, dynamic smem as above (the
// caller raises the function's limit above 48 KiB).
// PTX features: wmma.load / wmma.mma.sync m16n16k16 f16/bf16 -> f32 (sm_80+ for bf16),
// ldmatrix.x4(.trans), cp.async.ca/.cg with src-size, cp.async.commit_group/wait_group;
// Mbarrier also mbarrier.init/inval/arrive, cp.async.mbarrier.arrive.noinc (sm_80+) and
// mbarrier.try_wait.parity (sm_90; test_wait.parity on older archs).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <mma.h>
#include "common/activation.cuh"
#include "common/dtype.cuh"

namespace ferroattn {

// Kernel parameters (mirrored #[repr(C)] by GemmWmmaParams in src/ops/gemm/wmma.rs).
struct GemmWmmaParams {
    const void* a;
    const void* b;
    void* out;
    const void* c;
    const void* bias;
    void* aux;
    long long a_ld, a_batch_stride;
    long long b_ld, b_batch_stride;
    long long out_ld, out_batch_stride;
    long long c_ld, c_batch_stride;
    long long aux_ld, aux_batch_stride;
    long long batch;
    int m, n, k;
    int tiles_m, tiles_n;
    float alpha, beta;
    int activation;
    int bias_f32;
    int group;  // tile rows per raster group (L2 reuse of B; >= 1, 8 unless overridden)
    // Stream-k tail of the persistent kernel (see gemm_wmma's Persistent): work items
    // sk_first .. items-1 are split along k over all CTAs when sk_ws != nullptr; sk_ws holds
    // gridDim.x partial BM x BN fp32 tiles, sk_flags gridDim.x * WarpsM * WarpsN zeroed u32 flags.
    long long sk_first;
    float* sk_ws;
    unsigned* sk_flags;
};

template <int BM, int BN, int BK, int WarpsM, int WarpsN, int Stages, bool ARow, bool BRow>
struct GemmWmmaShape {
    static constexpr int kPad = 8;  // elements per line of padding (16 bytes)
    static constexpr int kALineLen = ARow ? BK : BM;
    static constexpr int kALines = ARow ? BM : BK;
    static constexpr int kBLineLen = BRow ? BN : BK;
    static constexpr int kBLines = BRow ? BK : BN;
    static constexpr int kALd = kALineLen + kPad;
    static constexpr int kBLd = kBLineLen + kPad;
    static constexpr int kAStage = kALines * kALd;  // elements
    static constexpr int kBStage = kBLines * kBLd;
    static constexpr int kWM = BM / WarpsM;
    static constexpr int kWN = BN / WarpsN;
    static constexpr int kCLd = BN + 4;  // fp32 pitch of the staged output tile
    static constexpr int kPipeBytes = Stages * (kAStage + kBStage) * 2;
    static constexpr int kEpiBytes = BM * kCLd * 4;
    static constexpr int kSmemBytes = kPipeBytes > kEpiBytes ? kPipeBytes : kEpiBytes;
};

template <int BM, int BN, int BK, int WarpsM, int WarpsN, int Stages, bool ARow, bool BRow>
__host__ __device__ constexpr int gemm_wmma_smem_bytes() {
    return GemmWmmaShape<BM, BN, BK, WarpsM, WarpsN, Stages, ARow, BRow>::kSmemBytes;
}

// Persistent kernels (template argument Persistent): interior tiles stage their fp32 output per
// warp, one 16 x 16 accumulator at a time, in a slab of WarpsM * WarpsN KiB after the ring
// (offset rounded up to 128 bytes), so the ring keeps the next tile's first stages while the
// epilogue runs; edge tiles still stage the whole BM x (BN + 4) tile over the ring.
template <int BM, int BN, int BK, int WarpsM, int WarpsN, int Stages, bool ARow, bool BRow>
__host__ __device__ constexpr int gemm_wmma_warp_stage_offset() {
    return (GemmWmmaShape<BM, BN, BK, WarpsM, WarpsN, Stages, ARow, BRow>::kPipeBytes + 127) / 128 * 128;
}
template <int BM, int BN, int BK, int WarpsM, int WarpsN, int Stages, bool ARow, bool BRow>
__host__ __device__ constexpr int gemm_wmma_persistent_smem_bytes() {
    using S = GemmWmmaShape<BM, BN, BK, WarpsM, WarpsN, Stages, ARow, BRow>;
    constexpr int kLive = gemm_wmma_warp_stage_offset<BM, BN, BK, WarpsM, WarpsN, Stages, ARow, BRow>() +
                          WarpsM * WarpsN * 16 * 16 * 4;
    return kLive > S::kEpiBytes ? kLive : S::kEpiBytes;
}

namespace gemm_wmma_detail {

template <typename T> struct IsHalf { static constexpr bool value = false; };
template <> struct IsHalf<__half> { static constexpr bool value = true; };

template <bool C, typename A, typename B> struct Select { using type = A; };
template <typename A, typename B> struct Select<false, A, B> { using type = B; };

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Copy `src_bytes` (<= Bytes) from global src to shared dst and zero the rest of the Bytes.
template <int Bytes>
__device__ __forceinline__ void cp_async(unsigned dst, const void* src, int src_bytes) {
    if constexpr (Bytes == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                     :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
    } else {
        static_assert(Bytes == 8 || Bytes == 4, "cp.async copies 4, 8 or 16 bytes");
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n"
                     :: "r"(dst), "l"(src), "n"(Bytes), "r"(src_bytes) : "memory");
    }
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

// mbarriers of the Mbarrier loop (shared::cta addresses). PTX ISA "Parallel Synchronization
// and Communication Instructions: mbarrier".
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_inval(unsigned bar) {
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
// Arrive on `bar` once every cp.async this thread issued so far has completed (the arrival is
// one of the count given to mbar_init: .noinc).
__device__ __forceinline__ void cp_async_mbar_arrive(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(bar) : "memory");
}
// Wait until the phase of parity `parity` of `bar` has completed.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned done;
    do {
#if __CUDA_ARCH__ >= 900
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
#else
        asm volatile("{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
#endif
    } while (!done);
}

// Copy a Lines x LineLen tile into shared memory (line pitch Ld elements): element (l, e) comes
// from g[(line0 + l) * ld + e0 + e] and is zero when line0 + l >= line_end or e0 + e >= e_end.
// g must satisfy the Vec alignment (vectors start at multiples of Vec along the line).
template <typename T, int Lines, int LineLen, int Ld, int Vec, int Threads>
__device__ __forceinline__ void load_tile(T* s, const T* g, long long ld, int line0, int line_end,
                                          int e0, int e_end, int tid) {
    constexpr int kVecPerLine = LineLen / Vec;
    constexpr int kTotal = Lines * kVecPerLine;
    static_assert(LineLen % Vec == 0, "line length must be a multiple of the vector");
    static_assert(kTotal % Threads == 0, "tile vectors must divide evenly among the threads");
    if constexpr (Vec == 1) {
        // Synchronous 2-byte path: a rolled loop (no per-slot addresses kept live).
#pragma unroll 2
        for (int idx = tid; idx < kTotal; idx += Threads) {
            const int l = idx / kVecPerLine;
            const int e = idx % kVecPerLine;
            const int line = line0 + l;
            unsigned short v = 0;
            if (line < line_end && e0 + e < e_end)
                v = *reinterpret_cast<const unsigned short*>(g + static_cast<long long>(line) * ld + (e0 + e));
            *reinterpret_cast<unsigned short*>(s + l * Ld + e) = v;
        }
    } else {
#pragma unroll
        for (int j = 0; j < kTotal / Threads; ++j) {
            const int idx = tid + j * Threads;
            const int l = idx / kVecPerLine;
            const int e = (idx % kVecPerLine) * Vec;
            const int line = line0 + l;
            int count = line < line_end ? e_end - (e0 + e) : 0;
            count = count < 0 ? 0 : (count > Vec ? Vec : count);
            const T* src = g + static_cast<long long>(line) * ld + (e0 + e);
            cp_async<Vec * 2>(smem_addr(s + l * Ld + e), count > 0 ? src : g, count * 2);
        }
    }
}

// Fast copy plan of one operand tile (the interior path: the block tile lies inside m x n and
// the k tile is full, so no vector needs a bound check or zero fill). Thread tid copies the
// vectors tid + j * Threads (j < kPer) of the Lines x LineLen tile; because Threads is a multiple
// of the vectors per line, they all sit at the same element offset of lines tid / kVecPerLine +
// j * kLineStep: one global pointer (plus a 64-bit line step) and one shared offset per thread
// and operand, instead of a division, a 64-bit multiply and a clamp per vector (the general
// load_tile, which cost ~28 instructions per cp.async in the main loop).
template <int Lines, int LineLen, int Vec, int Threads>
struct FastCopy {
    static constexpr int kVecPerLine = LineLen / Vec;
    static constexpr int kTotal = Lines * kVecPerLine;
    static constexpr bool kOk = Vec >= 2 && Threads % kVecPerLine == 0 && kTotal % Threads == 0;
    static constexpr int kPer = kOk ? kTotal / Threads : 0;   // vectors per thread
    static constexpr int kLineStep = kOk ? Threads / kVecPerLine : 0;  // lines between them
};

// Whole-vector cp.async (no src-size operand: the source is known to be in range).
template <int Bytes>
__device__ __forceinline__ void cp_async_full(unsigned dst, const void* src) {
    if constexpr (Bytes == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(src) : "memory");
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" :: "r"(dst), "l"(src), "n"(Bytes) : "memory");
    }
}

// f16 fragments: wmma.load.{a,b} from the .shared state space (PTX ISA "Warp-level matrix load
// instruction: wmma.load"), which ptxas turns into shared-memory matrix loads (LDSM). The C++
// load_matrix_sync takes a generic pointer; address-space inference is not guaranteed, and for
// bf16 it came out as generic 32-bit LD.E loads (cuobjdump, sm_90a). The registers are written
// into the fragment's storage as mma.h's own loaders do (the fragment object as an int array of
// 8 f16x2 registers).
// The address is given as [base + Off] with the fragment's offset Off (bytes) an immediate:
// ptxas adds its per-lane row offset to the register part, so every load that shares `base`
// (one ring slot of one operand) shares one lane address and the LDSM carries Off as its
// immediate. With the offset folded into the register operand instead ([addr], addr = base +
// Off), ptxas computed the lane address per load (a VIADD + an IMAD.U32 before each of the 72
// LDSM of the 128x256x64 tile; cuobjdump, NVRTC 13.0, sm_90a), where bf16 (ldmatrix with the
// lane offset in the base) needs none.
#define FERROATTN_WMMA_LD8(OP, LAYOUT)                                                            \
    asm volatile("wmma.load." OP ".sync.aligned." LAYOUT ".m16n16k16.shared.f16"                  \
                 " {%0,%1,%2,%3,%4,%5,%6,%7}, [%8+%10], %9;\n"                                    \
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]), "=r"(r[4]), "=r"(r[5]),         \
                   "=r"(r[6]), "=r"(r[7])                                                         \
                 : "r"(base), "n"(Ldm), "n"(Off))

// Operand A (IsA) or B fragment of f16, row- (Row) or column-major, leading dim Ldm elements,
// first stored element at shared address base + Off bytes.
template <typename T, bool IsA, bool Row, int Ldm, int Off, typename Frag>
__device__ __forceinline__ void wmma_load_shared(Frag& f, unsigned base) {
    static_assert(IsHalf<T>::value, "bf16 fragments are loaded with ldmatrix");
    unsigned* r = reinterpret_cast<unsigned*>(&f);
    if constexpr (IsA && Row) FERROATTN_WMMA_LD8("a", "row");
    else if constexpr (IsA) FERROATTN_WMMA_LD8("a", "col");
    else if constexpr (Row) FERROATTN_WMMA_LD8("b", "row");
    else FERROATTN_WMMA_LD8("b", "col");
}

// wmma_load_shared of fragment x (x < NX, 16 rows of A / 16 columns of B apart) at k offset kk
// (a multiple of 16, kk < 16 * NK) of a slot whose warp tile starts at `base`: the byte offset
// is (x * 16 * Ldm + kk) * 2 when the fragment's 16-row (A) / 16-column (B) dim is the line
// dim (Strided), else (kk * Ldm + x * 16) * 2. x and kk are runtime arguments that are
// constants after the caller's loops unroll; the asm operand needs an integral constant
// expression, so the (x, kk) pair is matched against every candidate at compile time and the
// comparisons fold away (SASS: one LDSM [R + imm] per call, no compares). Arguments outside
// the candidates trap (a caller bug; the caller's loops stay inside them, and with constant
// arguments the trap folds away with the compares).
template <typename T, bool IsA, bool Row, int Ldm, bool Strided, int NX, int NK, int Idx = 0, typename Frag>
__device__ __forceinline__ void wmma_load_shared_at(Frag& f, unsigned base, int x, int kk) {
    constexpr int kX = Idx % NX, kK = (Idx / NX) * 16;
    constexpr int kOff = Strided ? (kX * 16 * Ldm + kK) * 2 : (kK * Ldm + kX * 16) * 2;
    if (x == kX && kk == kK) {
        wmma_load_shared<T, IsA, Row, Ldm, kOff>(f, base);
    } else if constexpr (Idx + 1 < NX * NK) {
        wmma_load_shared_at<T, IsA, Row, Ldm, Strided, NX, NK, Idx + 1>(f, base, x, kk);
    } else {
        __trap();  // (x, kk) outside the candidates: a caller bug, never a silently unloaded fragment
    }
}
#undef FERROATTN_WMMA_LD8

// bf16 fragments through ldmatrix. ptxas lowers wmma.load of bf16 (even from .shared) into
// 32-bit loads, not into shared-memory matrix loads, so bf16 fragments are filled with
// ldmatrix.x4 (.trans for the transposed storage) instead. This fixes the fragments' register
// order: A (row_major fragment) {a0, a1, a2, a3} = rows 0-7 / 8-15 x k 0-7, then rows 0-7 / 8-15
// x k 8-15; B (col_major fragment) {b0, b1} of columns 0-7, then {b0, b1} of columns 8-15, with
// b0 = k 0-7, b1 = k 8-15: the mma.m16n8k16 operand layouts (PTX ISA "Matrix fragments for
// mma.m16n8k16"), which is also the order ptxas itself loads these fragments in (cuobjdump of
// wmma.load.a.row / wmma.load.b.col, bf16, sm_90a). Only the (row A, col B) fragment types are
// filled this way, so wmma::mma_sync runs the standard HMMA on them.
// `base`: shared address of the fragment's first stored element; Ld: line pitch in elements.
template <bool Trans>
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, unsigned addr) {
    if constexpr (Trans) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
    }
}

// Byte offset of this lane's ldmatrix row address inside a 16 x 16 fragment whose first stored
// element is at offset 0. A fragment (16 rows x 16 k), stored [m][k] (Row) or [k][m]: matrices
// {rows 0-7, k 0-7}, {rows 8-15, k 0-7}, {rows 0-7, k 8-15}, {rows 8-15, k 8-15}; loaded with
// .trans when stored [k][m]. B fragment (16 k x 16 columns), stored [k][n] (Row) or [n][k]:
// matrices {cols 0-7, k 0-7}, {cols 0-7, k 8-15}, {cols 8-15, k 0-7}, {cols 8-15, k 8-15};
// loaded with .trans when stored [k][n].
// In both cases matrix i covers the 8 x 8 block (16-dim offset 8 * (i & 1), k offset
// 8 * (i >> 1)) for A and (n offset 8 * (i >> 1), k offset 8 * (i & 1)) for B, which puts lane
// row r of matrix i at stored line r + 8 * (i & 1), element 8 * (i >> 1) when Row, and at line
// r + 8 * (i >> 1), element 8 * (i & 1) otherwise, for A and B alike.
template <bool Row, int Ld>
__device__ __forceinline__ unsigned ldsm_lane_offset(int lane) {
    const int i = lane >> 3, r = lane & 7;
    const int line = Row ? r + 8 * (i & 1) : r + 8 * (i >> 1);
    const int elem = Row ? 8 * (i >> 1) : 8 * (i & 1);
    return static_cast<unsigned>((line * Ld + elem) * 2);
}

// Part `part` of `parts` (compile-time after unrolling) of one k tile's copies on the interior fast
// path: vectors j with j * parts / kN == part, A's first, from the global cursors a_g / b_g into the
// ring slot at shared addresses sa / sb (this thread's first vector); the last part advances the
// cursors by one k tile (a_ld / b_ld: the operands' line pitches in elements).
template <typename S, typename CA, typename CB, bool ARow, bool BRow, int BK, int VecA, int VecB, typename T>
__device__ __forceinline__ void copy_tile_part(unsigned sa, unsigned sb, const T*& a_g, const T*& b_g, long long a_ld,
                                               long long b_ld, int part, int parts) {
    constexpr int kN = CA::kPer + CB::kPer;
#pragma unroll
    for (int j = 0; j < kN; ++j) {
        if (j * parts / kN != part) continue;
        if (j < CA::kPer) {
            cp_async_full<VecA * 2>(sa + j * (CA::kLineStep * S::kALd * 2),
                                    a_g + static_cast<long long>(j * CA::kLineStep) * a_ld);
        } else {
            const int jb = j - CA::kPer;
            cp_async_full<VecB * 2>(sb + jb * (CB::kLineStep * S::kBLd * 2),
                                    b_g + static_cast<long long>(jb * CB::kLineStep) * b_ld);
        }
    }
    if (part == parts - 1) {
        a_g += ARow ? static_cast<long long>(BK) : BK * a_ld;
        b_g += BRow ? BK * b_ld : static_cast<long long>(BK);
    }
}

// The fragments of one 16-deep k step (offset kk inside the BK-deep tile) of a warp's kMI x kNI
// 16 x 16 sub-tiles, from the ring slot whose warp-tile origin is at shared addresses a_s / b_s
// (bf16: plus this lane's ldmatrix row, ldsm_lane_offset): f16 through wmma.load with immediate
// offsets (wmma_load_shared_at), bf16 through ldmatrix.x4 into (row, col) fragments.
template <typename T, typename S, bool ARow, bool BRow, int BK, int kMI, int kNI, typename FragA, typename FragB>
__device__ __forceinline__ void load_step_frags(FragA (&a)[kMI], FragB (&b)[kNI], unsigned a_s, unsigned b_s,
                                                int kk) {
    constexpr bool kHalf = IsHalf<T>::value;
#pragma unroll
    for (int i = 0; i < kMI; ++i) {
        if constexpr (kHalf) {
            wmma_load_shared_at<T, true, ARow, S::kALd, ARow, kMI, BK / 16>(a[i], a_s, i, kk);
        } else {
            const unsigned addr = a_s + (ARow ? (i * 16 * S::kALd + kk) * 2 : (kk * S::kALd + i * 16) * 2);
            ldmatrix_x4<!ARow>(reinterpret_cast<unsigned*>(&a[i]), addr);
        }
    }
#pragma unroll
    for (int j = 0; j < kNI; ++j) {
        if constexpr (kHalf) {
            wmma_load_shared_at<T, false, BRow, S::kBLd, !BRow, kNI, BK / 16>(b[j], b_s, j, kk);
        } else {
            const unsigned addr = b_s + (BRow ? (kk * S::kBLd + j * 16) * 2 : (j * 16 * S::kBLd + kk) * 2);
            ldmatrix_x4<BRow>(reinterpret_cast<unsigned*>(&b[j]), addr);
        }
    }
}

// The k-step fragment loads of one warp (warp tile (warp_m, warp_n) of S): its shared addresses in
// ring slot 0, one 32-bit base per operand (the warp's tile; bf16: plus this lane's ldmatrix row,
// ldsm_lane_offset), and load_frags(a, b, slot, kk): load_step_frags of k step kk from ring slot
// `slot` (int or unsigned, as the caller's loop counts them).
template <typename T, typename S, bool ARow, bool BRow, int BK>
struct WarpStepFrags {
    unsigned a_base, b_base;

    __device__ __forceinline__ WarpStepFrags(const T* sA, const T* sB, int lane, int warp_m, int warp_n)
        : a_base(smem_addr(sA) + (IsHalf<T>::value ? 0u : ldsm_lane_offset<ARow, S::kALd>(lane)) +
                 (ARow ? warp_m * S::kWM * S::kALd * 2 : warp_m * S::kWM * 2)),
          b_base(smem_addr(sB) + (IsHalf<T>::value ? 0u : ldsm_lane_offset<BRow, S::kBLd>(lane)) +
                 (BRow ? warp_n * S::kWN * 2 : warp_n * S::kWN * S::kBLd * 2)) {}

    template <int kMI, int kNI, typename FragA, typename FragB, typename Slot>
    __device__ __forceinline__ void operator()(FragA (&a)[kMI], FragB (&b)[kNI], Slot slot, int kk) const {
        const unsigned a_s = a_base + slot * (S::kAStage * 2);
        const unsigned b_s = b_base + slot * (S::kBStage * 2);
        load_step_frags<T, S, ARow, BRow, BK>(a, b, a_s, b_s, kk);
    }
};

// 4 consecutive elements of a TOut row: one vector access when `vec`, else per element j < count.
template <typename TOut>
__device__ __forceinline__ void load4(const TOut* p, bool vec, int count, float (&x)[4]) {
    if (vec) {
        if constexpr (sizeof(TOut) == 4) {
            const float4 v = *reinterpret_cast<const float4*>(p);
            x[0] = v.x; x[1] = v.y; x[2] = v.z; x[3] = v.w;
        } else {
            const uint2 v = *reinterpret_cast<const uint2*>(p);
            const TOut* h = reinterpret_cast<const TOut*>(&v);
#pragma unroll
            for (int j = 0; j < 4; ++j) x[j] = to_float<TOut>(h[j]);
        }
    } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) x[j] = j < count ? to_float<TOut>(p[j]) : 0.0f;
    }
}

template <typename TOut>
__device__ __forceinline__ void store4(TOut* p, bool vec, int count, const float (&x)[4]) {
    if (vec) {
        if constexpr (sizeof(TOut) == 4) {
            *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
        } else {
            uint2 v;
            TOut* h = reinterpret_cast<TOut*>(&v);
#pragma unroll
            for (int j = 0; j < 4; ++j) h[j] = from_float<TOut>(x[j]);
            *reinterpret_cast<uint2*>(p) = v;
        }
    } else {
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (j < count) p[j] = from_float<TOut>(x[j]);
    }
}

__device__ __forceinline__ float activate_rt(int act, float x) {
    switch (act) {
        case kActRelu: return activate<kActRelu>(x);
        case kActGeluTanh: return activate<kActGeluTanh>(x);
        case kActGeluErf: return activate<kActGeluErf>(x);
        case kActSilu: return activate<kActSilu>(x);
        default: return x;
    }
}

// Whether 4-element vector accesses of a row-major TOut matrix are aligned everywhere.
template <typename TOut>
__device__ __forceinline__ bool vec4_ok(const void* p, long long ld, long long batch_stride) {
    return p != nullptr && (reinterpret_cast<unsigned long long>(p) % (4 * sizeof(TOut))) == 0 &&
           ld % 4 == 0 && batch_stride % 4 == 0;
}

}  // namespace gemm_wmma_detail

template <typename T, typename TOut, int BM, int BN, int BK, int WarpsM, int WarpsN, int Stages,
          bool ARow, bool BRow, int VecA, int VecB, bool DoubleBuffer, bool Mbarrier = false,
          bool Persistent = false>
__global__ void __launch_bounds__(WarpsM * WarpsN * 32)
gemm_wmma(const GemmWmmaParams p) {
    namespace wm = nvcuda::wmma;
    using namespace gemm_wmma_detail;
    using S = GemmWmmaShape<BM, BN, BK, WarpsM, WarpsN, Stages, ARow, BRow>;
    constexpr int kThreads = WarpsM * WarpsN * 32;
    constexpr int kWM = S::kWM, kWN = S::kWN;
    constexpr int kMI = kWM / 16, kNI = kWN / 16;
    static_assert(BK % (DoubleBuffer ? 32 : 16) == 0 && kWM % 16 == 0 && kWN % 16 == 0,
                  "BK a multiple of 16 (32 with DoubleBuffer: an even number of 16-deep steps), "
                  "warp tiles multiples of 16");
    static_assert(Stages >= 2, "at least two pipeline stages");
    static_assert(!Mbarrier || (DoubleBuffer && Stages >= 3),
                  "the mbarrier loop needs DoubleBuffer and at least three stages");
    static_assert(VecA == 1 || VecA == 2 || VecA == 4 || VecA == 8, "VecA in {1, 2, 4, 8}");
    static_assert(VecB == 1 || VecB == 2 || VecB == 4 || VecB == 8, "VecB in {1, 2, 4, 8}");
    // f16: fragments in the stored layouts, loaded by wmma.load.shared; bf16: (row, col)
    // fragments filled by ldmatrix (see ldsm_lane_offset).
    constexpr bool kHalf = IsHalf<T>::value;
    using LayoutA = typename Select<ARow || !kHalf, wm::row_major, wm::col_major>::type;
    using LayoutB = typename Select<BRow && kHalf, wm::row_major, wm::col_major>::type;

    extern __shared__ __align__(128) unsigned char smem[];
    // Mbarrier: full[s] = mbar[s], empty[s] = mbar[Stages + s] (unused otherwise).
    __shared__ __align__(8) unsigned long long mbar[Mbarrier ? 2 * Stages : 1];
    T* const sA = reinterpret_cast<T*>(smem);
    T* const sB = sA + Stages * S::kAStage;

    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31;
    const int warp_m = warp / WarpsN, warp_n = warp % WarpsN;

    // Block tile: groups of p.group tile rows walk the tile columns together (B tiles reused in L2).
    const int kGroup = p.group > 0 ? p.group : 8;
    const int tile = blockIdx.x;
    const int per_group = kGroup * p.tiles_n;
    const int first_m = (tile / per_group) * kGroup;
    const int group_rows = min(p.tiles_m - first_m, kGroup);
    const int in_group = tile % per_group;
    // (not const: the persistent loop points them at each of its tiles before batch_entry)
    int m0 = (first_m + in_group % group_rows) * BM;
    int n0 = (in_group / group_rows) * BN;
    const int k_tiles = (p.k + BK - 1) / BK;

    const bool out_vec = vec4_ok<TOut>(p.out, p.out_ld, p.out_batch_stride);
    const bool c_vec = vec4_ok<TOut>(p.c, p.c_ld, p.c_batch_stride);
    const bool aux_vec = vec4_ok<TOut>(p.aux, p.aux_ld, p.aux_batch_stride);

    // Interior blocks (the block tile inside m x n, k a multiple of BK, FastCopy possible) copy
    // every tile by the fast plan; edge blocks take load_tile's checked, zero-filling copies. The
    // batch loop is instantiated once per path (fast is a constant at both call sites below), so
    // that the edge path's hoisted per-vector indices are not live in the interior path.
    using CA = FastCopy<S::kALines, S::kALineLen, VecA, kThreads>;
    using CB = FastCopy<S::kBLines, S::kBLineLen, VecB, kThreads>;
    const bool interior = CA::kOk && CB::kOk && m0 + BM <= p.m && n0 + BN <= p.n && p.k % BK == 0;

    // One batch entry z: main loop, then epilogue.
    auto batch_entry = [&](const long long z, const bool fast) {
        const T* const A = static_cast<const T*>(p.a) + z * p.a_batch_stride;
        const T* const B = static_cast<const T*>(p.b) + z * p.b_batch_stride;

        auto load_stage = [&](int stage, int kt) {
            const int k0 = kt * BK;
            T* const a_s = sA + stage * S::kAStage;
            T* const b_s = sB + stage * S::kBStage;
            if constexpr (ARow) {
                load_tile<T, BM, BK, S::kALd, VecA, kThreads>(a_s, A, p.a_ld, m0, p.m, k0, p.k, tid);
            } else {
                load_tile<T, BK, BM, S::kALd, VecA, kThreads>(a_s, A, p.a_ld, k0, p.k, m0, p.m, tid);
            }
            if constexpr (BRow) {
                load_tile<T, BK, BN, S::kBLd, VecB, kThreads>(b_s, B, p.b_ld, k0, p.k, n0, p.n, tid);
            } else {
                load_tile<T, BN, BK, S::kBLd, VecB, kThreads>(b_s, B, p.b_ld, n0, p.n, k0, p.k, tid);
            }
        };

        wm::fragment<wm::accumulator, 16, 16, 16, float> acc[kMI][kNI];
#pragma unroll
        for (int i = 0; i < kMI; ++i)
#pragma unroll
            for (int j = 0; j < kNI; ++j) wm::fill_fragment(acc[i][j], 0.0f);

        // Fragments of one 16-deep k step of this warp's tile, read from ring slot `stage`.
        using FragA = wm::fragment<wm::matrix_a, 16, 16, 16, T, LayoutA>;
        using FragB = wm::fragment<wm::matrix_b, 16, 16, 16, T, LayoutB>;
        FragA fa[2][kMI];
        FragB fb[2][kNI];
        const WarpStepFrags<T, S, ARow, BRow, BK> load_frags(sA, sB, lane, warp_m, warp_n);

        // The main loop; kFast (a constant at both call sites) selects the copy path of every tile.
        auto main_loop = [&](const bool kFast) {
            // Fast plan: this thread's first vector of A and B at tile 0 (A: ARow -> lines are m
            // rows, elements k, a tile adds BK elements; else lines are k, a tile adds BK lines.
            // B: BRow -> lines k, elements n; else lines n, elements k).
            const int a_l = tid / CA::kVecPerLine, a_e = (tid % CA::kVecPerLine) * VecA;
            const int b_l = tid / CB::kVecPerLine, b_e = (tid % CB::kVecPerLine) * VecB;
            const T* a_g = A + (ARow ? static_cast<long long>(m0 + a_l) * p.a_ld + a_e
                                     : static_cast<long long>(a_l) * p.a_ld + (m0 + a_e));
            const T* b_g = B + (BRow ? static_cast<long long>(b_l) * p.b_ld + (n0 + b_e)
                                     : static_cast<long long>(n0 + b_l) * p.b_ld + b_e);
            const unsigned a_s0 = smem_addr(sA) + (a_l * S::kALd + a_e) * 2;
            const unsigned b_s0 = smem_addr(sB) + (b_l * S::kBLd + b_e) * 2;
            // Part `part` of `parts` (compile-time after unrolling) of the copies of the tile that
            // a_g / b_g point at, into ring slot `stage`: vectors j with j * parts / kN == part, A's
            // first; the last part advances a_g / b_g to the next tile.
            auto copy_fast = [&](int stage, int part, int parts) {
                const unsigned sa = a_s0 + stage * (S::kAStage * 2);
                const unsigned sb = b_s0 + stage * (S::kBStage * 2);
                copy_tile_part<S, CA, CB, ARow, BRow, BK, VecA, VecB>(sa, sb, a_g, b_g, p.a_ld, p.b_ld, part, parts);
            };
            // Tile kt into ring slot `stage`, part `part` of `parts` (the checked path issues
            // everything at part 0). Tiles are requested in order 0, 1, 2, ...
            auto load_next = [&](int stage, int kt, int part, int parts) {
                if (kFast) {
                    copy_fast(stage, part, parts);
                } else {
                    if (part == 0) load_stage(stage, kt);
                }
            };
            // Copies of the next tile are spread over the first half of a tile's 16-deep steps
            // (interleaved with fragment reads and mma instead of one burst after the barrier).
            constexpr int kSteps = BK / 16;
            constexpr int kParts = kSteps / 2 > 1 ? kSteps / 2 : 1;
#pragma unroll
            for (int s = 0; s < Stages - 1; ++s) {
                if (s < k_tiles) load_next(s, s, 0, 1);
                cp_async_commit();
            }
            constexpr bool kMbarLoop = DoubleBuffer && Mbarrier;
            // Single-buffered fragments: one barrier per tile, then the tile's fragments are
            // read and multiplied step by step; the refill of slot (kt-1) % Stages goes out in
            // steps 0 .. kParts-1. Also the edge blocks' loop of double-buffered tiles (their
            // checked copies keep more registers live than two fragment sets leave).
            auto single_buffered = [&]() {
                for (int kt = 0; kt < k_tiles; ++kt) {
                    cp_async_wait<Stages - 2>();
                    __syncthreads();  // tile kt landed for everyone; slot (kt-1) % Stages is free
                    const int next = kt + Stages - 1;
                    // the checked copies go out before the first fragment reads (as few registers
                    // live as possible across their address math)
                    if (!kFast && next < k_tiles) load_stage(next % Stages, next);
#pragma unroll
                    for (int step = 0; step < kSteps; ++step) {
                        load_frags(fa[0], fb[0], kt % Stages, step * 16);
                        if (kFast && step < kParts && next < k_tiles) copy_fast(next % Stages, step, kParts);
                        if (step == kParts - 1) cp_async_commit();
#pragma unroll
                        for (int i = 0; i < kMI; ++i)
#pragma unroll
                            for (int j = 0; j < kNI; ++j)
                                wm::mma_sync(acc[i][j], fa[0][i], fb[0][j], acc[i][j]);
                    }
                }
            };
            if constexpr (kMbarLoop) {
              if (kFast) {
                // Per-stage mbarriers. Tile t lives in slot t % Stages; its full phase
                // and, once every warp multiplied its last fragments of it, its empty phase are
                // phase t / Stages of that slot's barriers. The prologue above issued tiles
                // 0 .. Stages-2; from then on the copies of tile kt + kDist (kDist = Stages - 2)
                // go out in steps 0 .. kParts-1 of tile kt, after the empty phase of tile
                // kt + kDist - Stages = kt - 2 (the same slot) completed: a warp waits for the
                // slowest one only when it is two tiles ahead of it. The barriers live through one
                // batch entry (initialised here, invalidated after the loop).
                constexpr int kDist = Stages - 2;
                const unsigned full0 = smem_addr(mbar), empty0 = full0 + 8u * Stages;
                if (tid == 0) {
#pragma unroll
                    for (int s = 0; s < Stages; ++s) {
                        mbar_init(full0 + 8u * s, kThreads);
                        mbar_init(empty0 + 8u * s, kThreads / 32);
                    }
                }
                __syncthreads();  // barriers initialised
                // the prologue's tiles: each arrival completes once all of this thread's copies
                // so far landed
#pragma unroll
                for (int s = 0; s < Stages - 1; ++s) {
                    if (s < k_tiles) cp_async_mbar_arrive(full0 + 8u * s);
                }
                mbar_wait(full0, 0u);  // tile 0 landed
                load_frags(fa[0], fb[0], 0, 0);
                for (int kt = 0; kt < k_tiles; ++kt) {
                    const int stage = kt % Stages;
                    const int next = kt + kDist;
                    const int nslot = next % Stages;
#pragma unroll
                    for (int step = 0; step < kSteps; ++step) {
                        const int cur = step & 1;
                        if (step == kSteps - 1 && kt + 1 < k_tiles) {
                            mbar_wait(full0 + 8u * ((kt + 1) % Stages), static_cast<unsigned>((kt + 1) / Stages) & 1u);
                        }
                        if (step + 1 < kSteps) {
                            load_frags(fa[cur ^ 1], fb[cur ^ 1], stage, (step + 1) * 16);
                        } else if (kt + 1 < k_tiles) {
                            load_frags(fa[cur ^ 1], fb[cur ^ 1], (kt + 1) % Stages, 0);
                        }
                        if (step < kParts && next >= Stages - 1 && next < k_tiles) {
                            if (step == 0 && next >= Stages) {
                                mbar_wait(empty0 + 8u * nslot, static_cast<unsigned>(next / Stages - 1) & 1u);
                            }
                            copy_fast(nslot, step, kParts);
                            if (step == kParts - 1) cp_async_mbar_arrive(full0 + 8u * nslot);
                        }
#pragma unroll
                        for (int i = 0; i < kMI; ++i)
#pragma unroll
                            for (int j = 0; j < kNI; ++j)
                                wm::mma_sync(acc[i][j], fa[cur][i], fb[cur][j], acc[i][j]);
                    }
                    // The mma of the last step consumed this warp's last fragments of tile kt
                    // (they waited for the ldmatrix results): slot `stage` may be refilled.
                    __syncwarp();
                    if (lane == 0) mbar_arrive(empty0 + 8u * stage);
                }
                __syncthreads();  // every thread is past its last barrier operation
                if (tid == 0) {
#pragma unroll
                    for (int s = 0; s < 2 * Stages; ++s) mbar_inval(full0 + 8u * s);
                }
              } else {
                single_buffered();
              }
            } else if (DoubleBuffer && kFast) {
                // Tiles kt+1 .. kt+Stages-1 are in flight (cp.async) while tile kt is multiplied;
                // fragments are double-buffered in registers: the fragments of k step kk+1 (for
                // the last step: step 0 of the next tile, after the barrier that makes that tile
                // visible) are read while the mma of step kk run, so no shared-memory latency is
                // exposed at a tile boundary. The refill of ring slot (kt-1) % Stages is issued in
                // steps 0 .. kParts-1 of tile kt and committed before the last step's wait: every
                // warp read its last fragments of tile kt-1 before the barrier of the previous
                // iteration.
                static_assert(kParts <= kSteps - 1, "refill committed before the last step");
                cp_async_wait<Stages - 2>();
                __syncthreads();  // tile 0 landed
                load_frags(fa[0], fb[0], 0, 0);
                for (int kt = 0; kt < k_tiles; ++kt) {
                    const int stage = kt % Stages;
                    const int next = kt + Stages - 1;
#pragma unroll
                    for (int step = 0; step < kSteps; ++step) {
                        const int cur = step & 1;  // kSteps is even: the parity restarts every tile
                        if (step == kSteps - 1) {
                            cp_async_wait<Stages - 2>();
                            __syncthreads();  // tile kt+1 landed; nobody reads slot (kt-1) % Stages
                        }
                        if (step + 1 < kSteps) {
                            load_frags(fa[cur ^ 1], fb[cur ^ 1], stage, (step + 1) * 16);
                        } else if (kt + 1 < k_tiles) {
                            load_frags(fa[cur ^ 1], fb[cur ^ 1], (kt + 1) % Stages, 0);
                        }
                        if (step < kParts && next < k_tiles) load_next(next % Stages, next, step, kParts);
                        if (step == kParts - 1) cp_async_commit();
#pragma unroll
                        for (int i = 0; i < kMI; ++i)
#pragma unroll
                            for (int j = 0; j < kNI; ++j)
                                wm::mma_sync(acc[i][j], fa[cur][i], fb[cur][j], acc[i][j]);
                    }
                }
            } else {
                single_buffered();
            }
        };
        main_loop(fast);
        cp_async_wait<0>();
        __syncthreads();  // every warp is done with the ring

        // Epilogue: the block's fp32 tile goes to shared memory (the ring is free now), then
        // every thread walks groups of 4 columns of it: a runtime loop with one copy of the
        // element code and no accumulator live (small code, low register pressure).
        float* const ctile = reinterpret_cast<float*>(smem);
#pragma unroll
        for (int i = 0; i < kMI; ++i)
#pragma unroll
            for (int j = 0; j < kNI; ++j)
                wm::store_matrix_sync(ctile + (warp_m * kWM + i * 16) * S::kCLd + warp_n * kWN + j * 16,
                                      acc[i][j], S::kCLd, wm::mem_row_major);
        __syncthreads();
        TOut* const out = static_cast<TOut*>(p.out) + z * p.out_batch_stride;
        const TOut* const cm = static_cast<const TOut*>(p.c) + z * p.c_batch_stride;
        TOut* const aux = static_cast<TOut*>(p.aux) + z * p.aux_batch_stride;
        constexpr int kGroupsPerRow = BN / 4;
#pragma unroll 1
        for (int g = tid; g < BM * kGroupsPerRow; g += kThreads) {
            const int r = g / kGroupsPerRow;
            const int row = m0 + r;
            const int col = n0 + (g % kGroupsPerRow) * 4;
            const int count = p.n - col;  // valid columns of this group (may be <= 0)
            if (row >= p.m || count <= 0) continue;
            const float4 v = *reinterpret_cast<const float4*>(ctile + r * S::kCLd + (g % kGroupsPerRow) * 4);
            float x[4] = {p.alpha * v.x, p.alpha * v.y, p.alpha * v.z, p.alpha * v.w};
            const bool full = count >= 4;
            if (p.beta != 0.0f) {
                float cv[4];
                load4<TOut>(cm + static_cast<long long>(row) * p.c_ld + col, c_vec && full, count, cv);
#pragma unroll
                for (int e = 0; e < 4; ++e) x[e] += p.beta * cv[e];
            }
            if (p.bias != nullptr) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    if (e < count) {
                        x[e] += p.bias_f32 ? static_cast<const float*>(p.bias)[col + e]
                                           : to_float<T>(static_cast<const T*>(p.bias)[col + e]);
                    }
                }
            }
            if (p.aux != nullptr) {
                store4<TOut>(aux + static_cast<long long>(row) * p.aux_ld + col, aux_vec && full, count, x);
            }
            if (p.activation != kActNone) {
#pragma unroll
                for (int e = 0; e < 4; ++e) x[e] = activate_rt(p.activation, x[e]);
            }
            store4<TOut>(out + static_cast<long long>(row) * p.out_ld + col, out_vec && full, count, x);
        }
        __syncthreads();  // the staged tile is the next batch entry's ring
    };
    if constexpr (Persistent) {
        // Persistent grid (template argument Persistent; needs the mbarrier pipeline). The work
        // items are (batch entry z, block tile) pairs, w = z * tiles + tile (tiles in the grouped
        // order above); block b runs w = b, b + gridDim.x, ... (gridDim.y is 1). Interior items
        // form one stream of k tiles through the ring: the CTA's interior k tile number g (over all
        // its interior items) lives in slot g % Stages, its full / empty phases are phase g / Stages
        // of that slot's barriers, initialised once per CTA, so the phases continue across items.
        // While an item multiplies its last kDist k tiles, the copies of the NEXT item's first
        // kDist k tiles go out (when that item is interior too and k_tiles >= kDist), so they land
        // during this item's epilogue, which stages through a per-warp 16 x 16 fp32 slab outside
        // the ring (gemm_wmma_persistent_smem_bytes) instead of the ring. Edge items run
        // batch_entry's checked loop and block-wide epilogue as in the default kernel, after a
        // __syncthreads when an interior item precedes them (nothing is prefetched for them).
        // With a stream-k tail (params sk_*, all items interior) the last items are split along k
        // between neighbouring CTAs (next_seg below): the unit of work is then a segment (item,
        // k tiles [kb, ke)), and everything above holds per segment.
        static_assert(Mbarrier, "the persistent loop runs the mbarrier pipeline");
        constexpr int kSteps = BK / 16;
        constexpr int kParts = kSteps / 2 > 1 ? kSteps / 2 : 1;
        constexpr int kDist = Stages - 2;
        constexpr int kStageOff = gemm_wmma_warp_stage_offset<BM, BN, BK, WarpsM, WarpsN, Stages, ARow, BRow>();
        const long long tiles = static_cast<long long>(p.tiles_m) * p.tiles_n;
        const long long items = tiles * p.batch;
        auto locate = [&](long long w, long long& z, int& mm, int& nn) {
            z = w / tiles;
            const int t = static_cast<int>(w - z * tiles);
            const int fm = (t / per_group) * kGroup;
            const int gr = min(p.tiles_m - fm, kGroup);
            const int ig = t % per_group;
            mm = (fm + ig % gr) * BM;
            nn = (ig / gr) * BN;
        };
        auto inside = [&](int mm, int nn) {
            return CA::kOk && CB::kOk && mm + BM <= p.m && nn + BN <= p.n && p.k % BK == 0;
        };
        const unsigned full0 = smem_addr(mbar), empty0 = full0 + 8u * Stages;
        if (tid == 0) {
#pragma unroll
            for (int s = 0; s < Stages; ++s) {
                mbar_init(full0 + 8u * s, kThreads);
                mbar_init(empty0 + 8u * s, kThreads / 32);
            }
        }
        __syncthreads();  // barriers initialised
        float* const wstage = reinterpret_cast<float*>(smem + kStageOff) + warp * 256;
        // Interior items' epilogue is out = alpha * acc alone (the common case), with aligned
        // 4-element vector stores: the unrolled fast path below.
        const bool plain_epi = p.beta == 0.0f && p.bias == nullptr && p.aux == nullptr &&
                               p.activation == kActNone && out_vec;

        // Copy plan (as batch_entry's fast path): this thread's first vector of A and B of a tile.
        const int a_l = tid / CA::kVecPerLine, a_e = (tid % CA::kVecPerLine) * VecA;
        const int b_l = tid / CB::kVecPerLine, b_e = (tid % CB::kVecPerLine) * VecB;
        const unsigned a_s0 = smem_addr(sA) + (a_l * S::kALd + a_e) * 2;
        const unsigned b_s0 = smem_addr(sB) + (b_l * S::kBLd + b_e) * 2;
        const T* a_g = nullptr;  // copy cursor: the k tile whose copies go out next
        const T* b_g = nullptr;
        auto point_copies = [&](long long z, int mm, int nn, int kb) {
            const T* const A = static_cast<const T*>(p.a) + z * p.a_batch_stride;
            const T* const B = static_cast<const T*>(p.b) + z * p.b_batch_stride;
            const long long k0 = static_cast<long long>(kb) * BK;  // first k of the segment
            a_g = A + (ARow ? static_cast<long long>(mm + a_l) * p.a_ld + (k0 + a_e)
                            : (k0 + a_l) * p.a_ld + (mm + a_e));
            b_g = B + (BRow ? (k0 + b_l) * p.b_ld + (nn + b_e)
                            : static_cast<long long>(nn + b_l) * p.b_ld + (k0 + b_e));
        };
        auto copy_part = [&](unsigned slot, int part, int parts) {
            const unsigned sa = a_s0 + slot * (S::kAStage * 2);
            const unsigned sb = b_s0 + slot * (S::kBStage * 2);
            copy_tile_part<S, CA, CB, ARow, BRow, BK, VecA, VecB>(sa, sb, a_g, b_g, p.a_ld, p.b_ld, part, parts);
        };
        // Wait until slot g % Stages is free for k tile g: its previous k tile g - Stages was
        // consumed by every warp (that empty phase of the slot completed).
        auto empty_wait = [&](unsigned g) {
            if (g >= static_cast<unsigned>(Stages))
                mbar_wait(empty0 + 8u * (g % Stages), (g / Stages - 1u) & 1u);
        };

        using FragA = wm::fragment<wm::matrix_a, 16, 16, 16, T, LayoutA>;
        using FragB = wm::fragment<wm::matrix_b, 16, 16, 16, T, LayoutB>;
        FragA fa[2][kMI];
        FragB fb[2][kNI];
        const WarpStepFrags<T, S, ARow, BRow, BK> load_frags(sA, sB, lane, warp_m, warp_n);

        // Work segments (item w, k tiles [kb, ke)): items below sk_end0 whole, w = blockIdx.x,
        // + gridDim.x, ... (data-parallel); then, with a stream-k tail, this CTA's contiguous range
        // [u0, u1) of the tail's k-tile units (unit u = k tile u % k_tiles of item sk_first +
        // u / k_tiles): every range holds at least k_tiles units (the tail has >= gridDim.x items),
        // so an item is split between at most two CTAs, at the end of CTA c's range (k tiles
        // [0, s), "consumer": adds the other part and runs the epilogue) and the start of CTA
        // c + 1's ("producer": k tiles [s, k_tiles), writes its fp32 partial tile to slot c of
        // sk_ws and raises its warps' flags). The kernel takes the tail only when every item is
        // interior (else it runs all items data-parallel; the host launches gridDim.x <= SMs CTAs,
        // one per SM, so every producer runs while its consumer waits).
        const bool sk_on = p.sk_ws != nullptr && p.sk_first >= 0 && items - p.sk_first >= gridDim.x && CA::kOk &&
                           CB::kOk && p.m % BM == 0 && p.n % BN == 0 && p.k % BK == 0;
        const long long sk_end0 = sk_on ? p.sk_first : items;  // the data-parallel items
        // tail units (< 2 * gridDim.x * k_tiles: 32-bit, the host checks) and this CTA's range
        const int sk_units = static_cast<int>((items - sk_end0) * k_tiles);
        const int u0 = static_cast<int>(static_cast<long long>(sk_units) * blockIdx.x / gridDim.x);
        const int u1 = static_cast<int>(static_cast<long long>(sk_units) * (blockIdx.x + 1) / gridDim.x);
        // The segment after (w, kb, ke) (w = items: none); w = -1: this CTA's first one.
        auto next_seg = [&](long long w, int ke, long long& wn, int& kbn, int& ken) {
            int u = u1;
            if (w < sk_end0) {
                wn = w < 0 ? blockIdx.x : w + gridDim.x;
                if (wn < sk_end0) {
                    kbn = 0;
                    ken = k_tiles;
                    return;
                }
                u = u0;
            } else {
                u = static_cast<int>(w - sk_end0) * k_tiles + ke;
            }
            if (u < u1) {
                wn = sk_end0 + u / k_tiles;
                kbn = u % k_tiles;
                ken = min(k_tiles, kbn + (u1 - u));
            } else {
                wn = items;
                kbn = 0;
                ken = 0;
            }
        };

        unsigned g = 0;         // interior k tiles of this CTA before the current segment
        bool primed = false;    // the current segment's first kDist k tiles are already issued
        bool prev_inter = false;
        long long w = 0;
        int kb = 0, ke = 0;
        next_seg(-1, 0, w, kb, ke);
        long long z = 0;
        if (w < items) locate(w, z, m0, n0);
        while (w < items) {
            // the next segment (found after this one's first k tiles: not live across them)
            long long wn = items, zn = 0;
            int kbn = 0, ken = 0, mn = 0, nn = 0;
            auto find_next = [&]() {
                next_seg(w, ke, wn, kbn, ken);
                if (wn < items) locate(wn, zn, mn, nn);
            };
            const int len = ke - kb;  // k tiles of this segment
            if (!inside(m0, n0)) {
                if (prev_inter) __syncthreads();  // every warp is done with the ring
                batch_entry(z, false);            // ends with __syncthreads (edge items are whole)
                prev_inter = false;
                find_next();
            } else {
                if (!primed) {
                    point_copies(z, m0, n0, kb);
#pragma unroll
                    for (int s = 0; s < kDist; ++s) {
                        if (s < len) {
                            empty_wait(g + s);
                            copy_part((g + s) % Stages, 0, 1);
                            cp_async_mbar_arrive(full0 + 8u * ((g + s) % Stages));
                        }
                    }
                }
                wm::fragment<wm::accumulator, 16, 16, 16, float> acc[kMI][kNI];
#pragma unroll
                for (int i = 0; i < kMI; ++i)
#pragma unroll
                    for (int j = 0; j < kNI; ++j) wm::fill_fragment(acc[i][j], 0.0f);
                mbar_wait(full0 + 8u * (g % Stages), (g / Stages) & 1u);  // k tile 0 landed
                load_frags(fa[0], fb[0], g % Stages, 0);
                // One k tile kt (global number g + kt); `issue`: the copies of k tile kt + kDist
                // (this item's, or the next item's after point_copies) go out under it.
                auto k_tile = [&](const int kt, const bool issue) {
                    const unsigned gt = g + kt;
                    const unsigned stage = gt % Stages;
                    const unsigned gn = gt + kDist;
                    const unsigned nslot = gn % Stages;
#pragma unroll
                    for (int step = 0; step < kSteps; ++step) {
                        const int cur = step & 1;
                        if (step == kSteps - 1 && kt + 1 < len) {
                            mbar_wait(full0 + 8u * ((gt + 1) % Stages), ((gt + 1) / Stages) & 1u);
                        }
                        if (step + 1 < kSteps) {
                            load_frags(fa[cur ^ 1], fb[cur ^ 1], stage, (step + 1) * 16);
                        } else if (kt + 1 < len) {
                            load_frags(fa[cur ^ 1], fb[cur ^ 1], (gt + 1) % Stages, 0);
                        }
                        if (step < kParts && issue) {
                            if (step == 0) empty_wait(gn);
                            copy_part(nslot, step, kParts);
                            if (step == kParts - 1) cp_async_mbar_arrive(full0 + 8u * nslot);
                        }
#pragma unroll
                        for (int i = 0; i < kMI; ++i)
#pragma unroll
                            for (int j = 0; j < kNI; ++j)
                                wm::mma_sync(acc[i][j], fa[cur][i], fb[cur][j], acc[i][j]);
                    }
                    __syncwarp();
                    if (lane == 0) mbar_arrive(empty0 + 8u * stage);
                };
                // k tiles whose copy partner kt + kDist is this item's, then the last kDist ones,
                // under which the next item's first k tiles go out (chain) or nothing; the copy
                // cursor moves to the next item once, between the two loops (a branch inside the
                // loop was if-converted: ~30 instructions of pointer math per k tile).
                const int k_own = len > kDist ? len - kDist : 0;
                for (int kt = 0; kt < k_own; ++kt) k_tile(kt, true);
                find_next();
                // the next segment's first kDist k tiles go out under this segment's last ones
                const bool chain = wn < items && inside(mn, nn) && len >= kDist && ken - kbn >= kDist;
                if (chain) point_copies(zn, mn, nn, kbn);
                for (int kt = k_own; kt < len; ++kt) k_tile(kt, chain);
                g += static_cast<unsigned>(len);
                primed = chain;

                // Stream-k: a producer segment (k tiles [kb > 0, k_tiles)) hands its partial tile
                // to the consumer, CTA blockIdx.x - 1, and has no epilogue; a consumer segment
                // (k tiles [0, ke < k_tiles)) adds the producer's partial first. Per warp: its
                // kMI x kNI fragments at 256-float strides (store/load_matrix_sync, so both sides
                // use the same opaque accumulator layout), one flag per warp.
                constexpr int kWarps = WarpsM * WarpsN;
                if (kb > 0 || ke < k_tiles) {
                    const long long slot = kb > 0 ? blockIdx.x - 1 : blockIdx.x;
                    float* const part = p.sk_ws + ((slot * kWarps + warp) * (kMI * kNI)) * 256;
                    unsigned* const flag = p.sk_flags + slot * kWarps + warp;
                    if (kb > 0) {
#pragma unroll
                        for (int i = 0; i < kMI; ++i)
#pragma unroll
                            for (int j = 0; j < kNI; ++j)
                                wm::store_matrix_sync(part + (i * kNI + j) * 256, acc[i][j], 16, wm::mem_row_major);
                        __threadfence();  // this lane's partial stores before the flag
                        __syncwarp();
                        if (lane == 0) asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(flag), "r"(1u) : "memory");
                        prev_inter = true;
                        w = wn;
                        kb = kbn;
                        ke = ken;
                        z = zn;
                        m0 = mn;
                        n0 = nn;
                        continue;
                    }
                    unsigned ready = 0;
                    do {
                        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(ready) : "l"(flag) : "memory");
                    } while (ready == 0);
#pragma unroll
                    for (int i = 0; i < kMI; ++i)
#pragma unroll
                        for (int j = 0; j < kNI; ++j) {
                            wm::fragment<wm::accumulator, 16, 16, 16, float> t;
                            wm::load_matrix_sync(t, part + (i * kNI + j) * 256, 16, wm::mem_row_major);
#pragma unroll
                            for (int e = 0; e < t.num_elements; ++e) acc[i][j].x[e] += t.x[e];
                        }
                }

                // Epilogue of this warp's kWM x kWN outputs, one 16 x 16 accumulator at a time
                // through the warp's slab: lane l handles groups of 4 columns f = l and l + 32 of
                // the 64 in the 16 x 16 block (row f / 4), so 8 lanes read 128 contiguous bytes.
                // The tile is interior: every group is in range (count 4).
                TOut* const out = static_cast<TOut*>(p.out) + z * p.out_batch_stride;
                const TOut* const cm = static_cast<const TOut*>(p.c) + z * p.c_batch_stride;
                TOut* const aux = static_cast<TOut*>(p.aux) + z * p.aux_batch_stride;
                const int row0 = m0 + warp_m * kWM, col0 = n0 + warp_n * kWN;
                if (plain_epi) {
                    // out = alpha * acc only (no C, bias, aux or activation; 4-element vector
                    // stores aligned): unrolled over the kMI x kNI accumulators, so each fragment is
                    // picked at compile time (the runtime loop below selects it through a chain of
                    // kMI * kNI compares and branches per fragment); each lane keeps one output row
                    // pointer (row lane / 4 of a 16 x 16 block, columns (lane % 4) * 4 .. + 3; row
                    // + 8 for its second group) plus compile-time column offsets. Software-pipelined:
                    // fragment c + 1 goes through the slab before fragment c's values are scaled,
                    // converted and stored, so the slab reads' latency overlaps the next staging.
                    const int fr = lane >> 2, fc = (lane & 3) * 4;
                    TOut* const o0 = out + static_cast<long long>(row0 + fr) * p.out_ld + (col0 + fc);
                    const float* const s0 = wstage + fr * 16 + fc;
                    float4 v[2];
#pragma unroll
                    for (int c = 0; c <= kMI * kNI; ++c) {
                        float4 nv[2];
                        if (c < kMI * kNI) {
                            __syncwarp();  // the previous block's reads are done
#pragma unroll
                            for (int i = 0; i < kMI; ++i)
#pragma unroll
                                for (int j = 0; j < kNI; ++j)
                                    if (c == i * kNI + j) wm::store_matrix_sync(wstage, acc[i][j], 16, wm::mem_row_major);
                            __syncwarp();
                            nv[0] = *reinterpret_cast<const float4*>(s0);
                            nv[1] = *reinterpret_cast<const float4*>(s0 + 128);
                        }
                        if (c > 0) {
                            const int i = (c - 1) / kNI, j = (c - 1) % kNI;
#pragma unroll
                            for (int h = 0; h < 2; ++h) {
                                const float x[4] = {p.alpha * v[h].x, p.alpha * v[h].y, p.alpha * v[h].z,
                                                    p.alpha * v[h].w};
                                store4<TOut>(o0 + static_cast<long long>(i * 16 + h * 8) * p.out_ld + j * 16, true,
                                             4, x);
                            }
                        }
                        if (c < kMI * kNI) {
                            v[0] = nv[0];
                            v[1] = nv[1];
                        }
                    }
                } else {
#pragma unroll 1
                for (int c = 0; c < kMI * kNI; ++c) {
                    __syncwarp();  // the previous block's reads are done
#pragma unroll
                    for (int i = 0; i < kMI; ++i)
#pragma unroll
                        for (int j = 0; j < kNI; ++j)
                            if (c == i * kNI + j) wm::store_matrix_sync(wstage, acc[i][j], 16, wm::mem_row_major);
                    __syncwarp();
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int f = lane + 32 * h;
                        const int r = f >> 2, c4 = (f & 3) * 4;
                        const float4 v = *reinterpret_cast<const float4*>(wstage + r * 16 + c4);
                        const int row = row0 + (c / kNI) * 16 + r;
                        const int col = col0 + (c % kNI) * 16 + c4;
                        float x[4] = {p.alpha * v.x, p.alpha * v.y, p.alpha * v.z, p.alpha * v.w};
                        if (p.beta != 0.0f) {
                            float cv[4];
                            load4<TOut>(cm + static_cast<long long>(row) * p.c_ld + col, c_vec, 4, cv);
#pragma unroll
                            for (int e = 0; e < 4; ++e) x[e] += p.beta * cv[e];
                        }
                        if (p.bias != nullptr) {
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                x[e] += p.bias_f32 ? static_cast<const float*>(p.bias)[col + e]
                                                   : to_float<T>(static_cast<const T*>(p.bias)[col + e]);
                            }
                        }
                        if (p.aux != nullptr) {
                            store4<TOut>(aux + static_cast<long long>(row) * p.aux_ld + col, aux_vec, 4, x);
                        }
                        if (p.activation != kActNone) {
#pragma unroll
                            for (int e = 0; e < 4; ++e) x[e] = activate_rt(p.activation, x[e]);
                        }
                        store4<TOut>(out + static_cast<long long>(row) * p.out_ld + col, out_vec, 4, x);
                    }
                }
                }
                prev_inter = true;
            }
            w = wn;
            kb = kbn;
            ke = ken;
            z = zn;
            m0 = mn;
            n0 = nn;
        }
        cp_async_wait<0>();
        __syncthreads();  // every thread is past its last barrier operation
        if (tid == 0) {
#pragma unroll
            for (int s = 0; s < 2 * Stages; ++s) mbar_inval(full0 + 8u * s);
        }
    } else {
    if (interior) {
        for (long long z = blockIdx.y; z < p.batch; z += gridDim.y) batch_entry(z, true);
    } else {
        for (long long z = blockIdx.y; z < p.batch; z += gridDim.y) batch_entry(z, false);
    }
    }
}

}  // namespace ferroattn
