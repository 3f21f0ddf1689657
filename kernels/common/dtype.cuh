// ferroattn — 16-bit dtype helpers (half / bfloat16).
//
// What: a tiny trait `DTypeTraits<T>` for T = __half or __nv_bfloat16 that packs two fp32
// values into one 32-bit register of two T (round-to-nearest-even), as the A operand of
// mma.sync wants it, and a compile-time flag telling the PTX wrappers which mma variant to
// emit; and scalar conversions to_float(x) (__half / __nv_bfloat16 -> fp32 exactly; float and
// anything static_cast accepts unchanged) and from_float<T>(x) (fp32 -> T, round-to-nearest-even;
// identity for float), used by the GEMM epilogues (wmma, sm90, split-k reduce).
// Constraints: DTypeTraits' T is exactly __half or __nv_bfloat16 (anything else fails to compile).
// PTX features: cvt.rn.f16x2.f32 / cvt.rn.bf16x2.f32 (emitted by the cuda_fp16/bf16
// intrinsics; bf16x2 needs sm_80+).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace ferroattn {

template <typename T> struct DTypeTraits;

template <> struct DTypeTraits<__half> {
    static constexpr bool kIsBF16 = false;
    // lo -> low 16 bits (lower column index), hi -> high 16 bits.
    static __device__ __forceinline__ unsigned pack2(float lo, float hi) {
        __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<unsigned*>(&h);
    }
};

template <> struct DTypeTraits<__nv_bfloat16> {
    static constexpr bool kIsBF16 = true;
    static __device__ __forceinline__ unsigned pack2(float lo, float hi) {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<unsigned*>(&h);
    }
};

template <typename T> __device__ __forceinline__ float to_float(T x) { return static_cast<float>(x); }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
    return __bfloat162float(x);
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }

}  // namespace ferroattn
