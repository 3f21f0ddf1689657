// ferroattn — wgmma.mma_async wrappers (sm_90a): m64nNk16, fp32 accumulators, f16 / bf16 inputs,
// for the N the GEMM and attention kernels use, in two forms:
//   SS: A and B from shared-memory descriptors (PTX ISA "wgmma.mma_async", a-desc, b-desc);
//   RS: A from four 32-bit registers per thread (the m64k16 register fragment), B from a descriptor.
//
// Accumulator layout of m64nNk16 (PTX ISA "Matrix fragments for wgmma .m64nNk16"): thread t
// of the warpgroup, warp w = t/32, lane l: d[4j + 2h + e] is row 16w + l/4 + 8h, column
// 8j + 2(l%4) + e. The RS form's A fragment (PTX ISA "Register fragment layout for matrix A")
// is that layout packed to 16 bits, so an S accumulator converts to P in place (wgmma_rs).
//
// Operand lists: the N / 2 accumulators of a thread are asm operands %0 .. %(N / 2 - 1), the
// other operands follow them. FERROATTN_WGMMA_ACC_<R> is the PTX text of the first R accumulator
// operands (rows of 16, "," between rows), FERROATTN_WGMMA_OUT_<R> their "+f" constraints, both
// built up from the shorter lists (groups of 8 registers).
#pragma once
#include "common/dtype.cuh"

namespace ferroattn {
namespace sm90 {

#define FERROATTN_WGMMA_ACC_32 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define FERROATTN_WGMMA_ACC_40 FERROATTN_WGMMA_ACC_32 "," "%32, %33, %34, %35, %36, %37, %38, %39"
#define FERROATTN_WGMMA_ACC_48 FERROATTN_WGMMA_ACC_40 ", %40, %41, %42, %43, %44, %45, %46, %47"
#define FERROATTN_WGMMA_ACC_56 FERROATTN_WGMMA_ACC_48 ", %48, %49, %50, %51, %52, %53, %54, %55"
#define FERROATTN_WGMMA_ACC_64 FERROATTN_WGMMA_ACC_48 "," \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define FERROATTN_WGMMA_ACC_88 FERROATTN_WGMMA_ACC_64 "," \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79," \
    "%80, %81, %82, %83, %84, %85, %86, %87"
#define FERROATTN_WGMMA_ACC_96 FERROATTN_WGMMA_ACC_88 ", %88, %89, %90, %91, %92, %93, %94, %95"
#define FERROATTN_WGMMA_ACC_128 FERROATTN_WGMMA_ACC_96 "," \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111," \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// Accumulators d[B] .. d[B + 7] as read-write asm operands.
#define FERROATTN_WGMMA_D8(B) \
    "+f"(d[B]), "+f"(d[B + 1]), "+f"(d[B + 2]), "+f"(d[B + 3]), \
    "+f"(d[B + 4]), "+f"(d[B + 5]), "+f"(d[B + 6]), "+f"(d[B + 7])
#define FERROATTN_WGMMA_OUT_32 \
    FERROATTN_WGMMA_D8(0), FERROATTN_WGMMA_D8(8), FERROATTN_WGMMA_D8(16), FERROATTN_WGMMA_D8(24)
#define FERROATTN_WGMMA_OUT_40 FERROATTN_WGMMA_OUT_32, FERROATTN_WGMMA_D8(32)
#define FERROATTN_WGMMA_OUT_48 FERROATTN_WGMMA_OUT_40, FERROATTN_WGMMA_D8(40)
#define FERROATTN_WGMMA_OUT_56 FERROATTN_WGMMA_OUT_48, FERROATTN_WGMMA_D8(48)
#define FERROATTN_WGMMA_OUT_64 FERROATTN_WGMMA_OUT_48, FERROATTN_WGMMA_D8(48), FERROATTN_WGMMA_D8(56)
#define FERROATTN_WGMMA_OUT_88 \
    FERROATTN_WGMMA_OUT_64, FERROATTN_WGMMA_D8(64), FERROATTN_WGMMA_D8(72), FERROATTN_WGMMA_D8(80)
#define FERROATTN_WGMMA_OUT_96 FERROATTN_WGMMA_OUT_88, FERROATTN_WGMMA_D8(88)
#define FERROATTN_WGMMA_OUT_128 FERROATTN_WGMMA_OUT_96, \
    FERROATTN_WGMMA_D8(96), FERROATTN_WGMMA_D8(104), FERROATTN_WGMMA_D8(112), FERROATTN_WGMMA_D8(120)

// The instruction up to the operands after the accumulators: the predicate p = (scale_d != 0)
// from operand %P, then wgmma m64nNk16 with fp32 accumulators and TY inputs on the R accumulators.
#define FERROATTN_WGMMA_OPEN(N, TY, R, P) \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %" #P ", 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" FERROATTN_WGMMA_ACC_##R "}, "

// SS form NAME for R = N / 2 accumulators; operands after them: %R desc_a, %R1 desc_b,
// %R2 scale_d, %R3 TransA, %R4 TransB (R1 .. R4 = R + 1 .. R + 4, written out: the
// preprocessor does not add).
#define FERROATTN_WGMMA_SS(NAME, TY, N, R, R1, R2, R3, R4) \
template <int TransA, int TransB> \
__device__ __forceinline__ void NAME(float (&d)[R], unsigned long long desc_a, \
                                     unsigned long long desc_b, int scale_d) { \
    asm volatile( \
        FERROATTN_WGMMA_OPEN(N, TY, R, R2) "%" #R ", %" #R1 ", p, 1, 1, %" #R3 ", %" #R4 ";\n}\n" \
        : FERROATTN_WGMMA_OUT_##R \
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TransA), "n"(TransB)); \
}
#define FERROATTN_WGMMA_SS_BF16_F16(N, R, R1, R2, R3, R4) \
    FERROATTN_WGMMA_SS(wgmma_m64n##N##k16_bf16, "bf16", N, R, R1, R2, R3, R4) \
    FERROATTN_WGMMA_SS(wgmma_m64n##N##k16_f16, "f16", N, R, R1, R2, R3, R4)

// RS form NAME; operands after the accumulators: %R .. %R3 a[0..3], %R4 desc_b, %R5 scale_d,
// %R6 TransB.
#define FERROATTN_WGMMA_RS(NAME, TY, N, R, R1, R2, R3, R4, R5, R6) \
template <int TransB> \
__device__ __forceinline__ void NAME(float (&d)[R], const unsigned (&a)[4], \
                                     unsigned long long desc_b, int scale_d) { \
    asm volatile( \
        FERROATTN_WGMMA_OPEN(N, TY, R, R5) \
        "{%" #R ", %" #R1 ", %" #R2 ", %" #R3 "}, %" #R4 ", p, 1, 1, %" #R6 ";\n}\n" \
        : FERROATTN_WGMMA_OUT_##R \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TransB)); \
}
#define FERROATTN_WGMMA_RS_BF16_F16(N, R, R1, R2, R3, R4, R5, R6) \
    FERROATTN_WGMMA_RS(wgmma_m64n##N##k16_rs_bf16, "bf16", N, R, R1, R2, R3, R4, R5, R6) \
    FERROATTN_WGMMA_RS(wgmma_m64n##N##k16_rs_f16, "f16", N, R, R1, R2, R3, R4, R5, R6)

// wgmma_m64n<N>k16_{bf16,f16}<TransA, TransB>(d, desc_a, desc_b, scale_d)
FERROATTN_WGMMA_SS_BF16_F16(64, 32, 33, 34, 35, 36)
FERROATTN_WGMMA_SS_BF16_F16(80, 40, 41, 42, 43, 44)
FERROATTN_WGMMA_SS_BF16_F16(96, 48, 49, 50, 51, 52)
FERROATTN_WGMMA_SS_BF16_F16(112, 56, 57, 58, 59, 60)
FERROATTN_WGMMA_SS_BF16_F16(128, 64, 65, 66, 67, 68)
FERROATTN_WGMMA_SS_BF16_F16(176, 88, 89, 90, 91, 92)
FERROATTN_WGMMA_SS_BF16_F16(192, 96, 97, 98, 99, 100)
FERROATTN_WGMMA_SS_BF16_F16(256, 128, 129, 130, 131, 132)
// wgmma_m64n<N>k16_rs_{bf16,f16}<TransB>(d, a, desc_b, scale_d)
FERROATTN_WGMMA_RS_BF16_F16(64, 32, 33, 34, 35, 36, 37, 38)
FERROATTN_WGMMA_RS_BF16_F16(96, 48, 49, 50, 51, 52, 53, 54)
FERROATTN_WGMMA_RS_BF16_F16(128, 64, 65, 66, 67, 68, 69, 70)
FERROATTN_WGMMA_RS_BF16_F16(192, 96, 97, 98, 99, 100, 101, 102)
FERROATTN_WGMMA_RS_BF16_F16(256, 128, 129, 130, 131, 132, 133, 134)

#undef FERROATTN_WGMMA_RS_BF16_F16
#undef FERROATTN_WGMMA_RS
#undef FERROATTN_WGMMA_SS_BF16_F16
#undef FERROATTN_WGMMA_SS
#undef FERROATTN_WGMMA_OPEN
#undef FERROATTN_WGMMA_OUT_128
#undef FERROATTN_WGMMA_OUT_96
#undef FERROATTN_WGMMA_OUT_88
#undef FERROATTN_WGMMA_OUT_64
#undef FERROATTN_WGMMA_OUT_56
#undef FERROATTN_WGMMA_OUT_48
#undef FERROATTN_WGMMA_OUT_40
#undef FERROATTN_WGMMA_OUT_32
#undef FERROATTN_WGMMA_D8
#undef FERROATTN_WGMMA_ACC_128
#undef FERROATTN_WGMMA_ACC_96
#undef FERROATTN_WGMMA_ACC_88
#undef FERROATTN_WGMMA_ACC_64
#undef FERROATTN_WGMMA_ACC_56
#undef FERROATTN_WGMMA_ACC_48
#undef FERROATTN_WGMMA_ACC_40
#undef FERROATTN_WGMMA_ACC_32

// d (64 x N, fp32) (+)= A (64 x 16) * B (16 x N) for T = __half / __nv_bfloat16, A and B from
// shared-memory descriptors; scale_d = 0 overwrites d. TransA / TransB = 1: that operand is
// MN-major in shared memory. N in {64, 80, 96, 112, 128, 176, 192, 256}.
template <typename T, int N, int TransA, int TransB>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], unsigned long long desc_a,
                                         unsigned long long desc_b, int scale_d) {
    static_assert(N == 64 || N == 80 || N == 96 || N == 112 || N == 128 || N == 176 || N == 192 || N == 256,
                  "no wgmma_ss wrapper for this N");
    if constexpr (N == 64) {
        if constexpr (DTypeTraits<T>::kIsBF16) wgmma_m64n64k16_bf16<TransA, TransB>(d, desc_a, desc_b, scale_d);
        else wgmma_m64n64k16_f16<TransA, TransB>(d, desc_a, desc_b, scale_d);
    } else if constexpr (N == 80) {
        if constexpr (DTypeTraits<T>::kIsBF16) wgmma_m64n80k16_bf16<TransA, TransB>(d, desc_a, desc_b, scale_d);
        else wgmma_m64n80k16_f16<TransA, TransB>(d, desc_a, desc_b, scale_d);
    } else if constexpr (N == 96) {
        if constexpr (DTypeTraits<T>::kIsBF16) wgmma_m64n96k16_bf16<TransA, TransB>(d, desc_a, desc_b, scale_d);
        else wgmma_m64n96k16_f16<TransA, TransB>(d, desc_a, desc_b, scale_d);
    } else if constexpr (N == 112) {
        if constexpr (DTypeTraits<T>::kIsBF16) wgmma_m64n112k16_bf16<TransA, TransB>(d, desc_a, desc_b, scale_d);
        else wgmma_m64n112k16_f16<TransA, TransB>(d, desc_a, desc_b, scale_d);
    } else if constexpr (N == 128) {
        if constexpr (DTypeTraits<T>::kIsBF16) wgmma_m64n128k16_bf16<TransA, TransB>(d, desc_a, desc_b, scale_d);
        else wgmma_m64n128k16_f16<TransA, TransB>(d, desc_a, desc_b, scale_d);
    } else if constexpr (N == 176) {
        if constexpr (DTypeTraits<T>::kIsBF16) wgmma_m64n176k16_bf16<TransA, TransB>(d, desc_a, desc_b, scale_d);
        else wgmma_m64n176k16_f16<TransA, TransB>(d, desc_a, desc_b, scale_d);
    } else if constexpr (N == 192) {
        if constexpr (DTypeTraits<T>::kIsBF16) wgmma_m64n192k16_bf16<TransA, TransB>(d, desc_a, desc_b, scale_d);
        else wgmma_m64n192k16_f16<TransA, TransB>(d, desc_a, desc_b, scale_d);
    } else if constexpr (N == 256) {
        if constexpr (DTypeTraits<T>::kIsBF16) wgmma_m64n256k16_bf16<TransA, TransB>(d, desc_a, desc_b, scale_d);
        else wgmma_m64n256k16_f16<TransA, TransB>(d, desc_a, desc_b, scale_d);
    }
}

// As wgmma_ss with A from registers: a[0..3] hold this thread's m64k16 fragment (warp w of the
// warpgroup owns rows 16w .. 16w + 15; lane l: a[0] = (row l/4, cols 2(l%4), +1), a[1] = the
// same columns of row l/4 + 8, a[2] / a[3] = columns 8 + 2(l%4), +1 of those rows; the low half
// is the lower column). N in {64, 96, 128, 192, 256}.
template <typename T, int N, int TransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const unsigned (&a)[4],
                                         unsigned long long desc_b, int scale_d) {
    static_assert(N == 64 || N == 96 || N == 128 || N == 192 || N == 256, "no wgmma_rs wrapper for this N");
    if constexpr (N == 64) {
        if constexpr (DTypeTraits<T>::kIsBF16) wgmma_m64n64k16_rs_bf16<TransB>(d, a, desc_b, scale_d);
        else wgmma_m64n64k16_rs_f16<TransB>(d, a, desc_b, scale_d);
    } else if constexpr (N == 96) {
        if constexpr (DTypeTraits<T>::kIsBF16) wgmma_m64n96k16_rs_bf16<TransB>(d, a, desc_b, scale_d);
        else wgmma_m64n96k16_rs_f16<TransB>(d, a, desc_b, scale_d);
    } else if constexpr (N == 128) {
        if constexpr (DTypeTraits<T>::kIsBF16) wgmma_m64n128k16_rs_bf16<TransB>(d, a, desc_b, scale_d);
        else wgmma_m64n128k16_rs_f16<TransB>(d, a, desc_b, scale_d);
    } else if constexpr (N == 192) {
        if constexpr (DTypeTraits<T>::kIsBF16) wgmma_m64n192k16_rs_bf16<TransB>(d, a, desc_b, scale_d);
        else wgmma_m64n192k16_rs_f16<TransB>(d, a, desc_b, scale_d);
    } else if constexpr (N == 256) {
        if constexpr (DTypeTraits<T>::kIsBF16) wgmma_m64n256k16_rs_bf16<TransB>(d, a, desc_b, scale_d);
        else wgmma_m64n256k16_rs_f16<TransB>(d, a, desc_b, scale_d);
    }
}

}  // namespace sm90
}  // namespace ferroattn
