// ferroattn — epilogue activations shared by the GEMM and 2:4 sparse kernels.
//
// What: the element-wise activations a fused epilogue applies to fp32 accumulators, selected
// at compile time by an integer template parameter (the Rust `Activation` enum's discriminant,
// src/ops/gemm/problem.rs; the two must agree):
//   0 none   f(x) = x
//   1 relu   f(x) = max(x, 0)
//   2 gelu_tanh  f(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))   (Hendrycks & Gimpel 2016, eq. 2;
//                                                                          torch approximate="tanh")
//   3 gelu_erf   f(x) = 0.5 x (1 + erf(x / sqrt(2)))                         (torch approximate="none")
//   4 silu   f(x) = x / (1 + exp(-x))                                        (torch.nn.functional.silu)
// Constraints: fp32 in and out; tanhf/erff/__expf from the CUDA math library (NVRTC built-ins).
#pragma once

namespace ferroattn {

enum ActivationKind : int { kActNone = 0, kActRelu = 1, kActGeluTanh = 2, kActGeluErf = 3, kActSilu = 4 };

template <int Act>
__device__ __forceinline__ float activate(float x) {
    if constexpr (Act == kActNone) {
        return x;
    } else if constexpr (Act == kActRelu) {
        return fmaxf(x, 0.0f);
    } else if constexpr (Act == kActGeluTanh) {
        const float k0 = 0.7978845608028654f;  // sqrt(2/pi)
        const float inner = k0 * (x + 0.044715f * x * x * x);
        return 0.5f * x * (1.0f + tanhf(inner));
    } else if constexpr (Act == kActGeluErf) {
        return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f));
    } else {
        static_assert(Act == kActSilu, "unknown activation");
        // __fdividef (x * approximate reciprocal, ~2 ulp): IEEE `/` takes a slow path whenever
        // 1 + exp(-x) overflows (x < -88), which large-k GEMM outputs hit often; there the
        // approximate quotient is 0, and the exact value x*e^x (|.| < 1e-36) rounds to 0 in
        // fp16/bf16 anyway.
        return __fdividef(x, 1.0f + __expf(-x));
    }
}

}  // namespace ferroattn
