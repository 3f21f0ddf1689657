// ferroattn — epilogue activations shared by the GEMM and 2:4 sparse kernels.
//
// What: the element-wise activations a fused epilogue applies to fp32 accumulators, selected
// at compile time by an integer template parameter (the Rust `Activation` enum's discriminant,
// src/tuning/gemm_problem.rs; the two must agree):
//   0 none   f(x) = x
//   1 relu   f(x) = max(x, 0)
//   2 gelu_tanh  f(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))   (Hendrycks & Gimpel 2016, eq. 2;
//                                                                          torch approximate="tanh")
//   3 gelu_erf   f(x) = 0.5 x (1 + erf(x / sqrt(2)))                         (torch approximate="none")
//   4 silu   f(x) = x / (1 + exp(-x))                                        (torch.nn.functional.silu)
// Constraints: fp32 in and out; __expf/__fdividef from the CUDA math library (NVRTC built-ins);
// the GELUs use ex2.approx.ftz / rcp.approx.ftz (PTX ISA 9.7.3: max relative error 2^-22 /
// 2^-23; subnormal results flush to 0, where the true value is < 1.2e-38 of |x| anyway).
//
// Cost and accuracy: an epilogue applies the activation to every output, so its instruction
// count is exposed time in a GEMM whose epilogue does not overlap the mainloop (bench/NOTES.md,
// "Epilogue activations"). Both GELUs are evaluated in forms without cancellation:
//   gelu_tanh: 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)) exactly, so f(x) = x / (1 + exp(-2u)):
//              9 SASS instructions instead of 23 with tanhf; relative error <= 1.3e-5 wherever
//              |f(x)| > 1e-30 (tanhf's 1 + tanh(u) loses all digits for x < -5).
//   gelu_erf:  with z = |x| / sqrt(2), 1 + erf(x / sqrt(2)) = erfc(z) for x < 0 and 2 - erfc(z)
//              otherwise; erfc(z) = t exp(-z^2 + P(t)), t = 1 / (1 + z/2), P a degree-9 polynomial
//              (Chebyshev fit, fractional error < 1.2e-7 for all z >= 0: Press, Teukolsky,
//              Vetterling & Flannery, Numerical Recipes, 2nd ed., §6.2, "erfcc"); relative error of
//              f <= 1.7e-5 everywhere (fp32 evaluation, checked against math.erfc), against 1.0 in
//              the negative tail for 0.5 x (1 + erff).
#pragma once

namespace ferroattn {

enum ActivationKind : int { kActNone = 0, kActRelu = 1, kActGeluTanh = 2, kActGeluErf = 3, kActSilu = 4 };

// 2^x and 1/x, one MUFU instruction each, without the libdevice range fix-ups (see header).
__device__ __forceinline__ float act_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float act_rcp(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

template <int Act>
__device__ __forceinline__ float activate(float x) {
    if constexpr (Act == kActNone) {
        return x;
    } else if constexpr (Act == kActRelu) {
        return fmaxf(x, 0.0f);
    } else if constexpr (Act == kActGeluTanh) {
        // f(x) = x / (1 + 2^(c u)), u = x (1 + 0.044715 x^2), c = -2 sqrt(2/pi) log2(e). For
        // x << 0 the power overflows to inf and its reciprocal is 0 (f -> -0, the limit); for
        // x >> 0 the power is 0 and f = x.
        const float c = -2.0f * 0.7978845608028654f * 1.4426950408889634f;
        const float u = x * fmaf(0.044715f * x, x, 1.0f);
        return x * act_rcp(1.0f + act_exp2(c * u));
    } else if constexpr (Act == kActGeluErf) {
        const float z = fabsf(x) * 0.7071067811865476f;  // |x| / sqrt(2)
        const float t = act_rcp(fmaf(0.5f, z, 1.0f));
        float p = 0.17087277f;
        p = fmaf(p, t, -0.82215223f);
        p = fmaf(p, t, 1.48851587f);
        p = fmaf(p, t, -1.13520398f);
        p = fmaf(p, t, 0.27886807f);
        p = fmaf(p, t, -0.18628806f);
        p = fmaf(p, t, 0.09678418f);
        p = fmaf(p, t, 0.37409196f);
        p = fmaf(p, t, 1.00002368f);
        p = fmaf(p, t, -1.26551223f);
        const float log2e = 1.4426950408889634f;
        const float half_x_erfc = 0.5f * x * (t * act_exp2(fmaf(-z, z, p) * log2e));  // 0.5 x erfc(z)
        return x < 0.0f ? half_x_erfc : x - half_x_erfc;
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
