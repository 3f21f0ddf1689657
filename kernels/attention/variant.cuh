// ferroattn — attention variants: the one mask and score rule every attention kernel shares.
//
// What: a variant is everything an attention call computes beyond softmax(scale · q kᵀ) v:
//   mask      none, bottom-right causal, or a local window (left, right)
//   softcap   score = c · tanh(scale · q·k / c)          (c > 0; Gemma-2 style logit capping)
//   ALiBi     score -= slope_h · |i + s_k − s_q − j|       (Press et al., "Train Short, Test Long", 2022)
//   dropout   after the softmax, P_ij is kept with probability 1 − p and scaled by 1/(1 − p)
//             (Srivastava et al., 2014; FlashAttention-2 §3.1): the mask is a pure function of
//             (seed, batch, head, i, j) through Philox4x32-10 (Salmon et al., "Parallel random
//             numbers: as easy as 1, 2, 3", SC 2011), so the backward regenerates it exactly
//   sinks     one logit per query head joins every row's softmax and carries no value
//             (GPT-OSS style "attention sinks"; Xiao et al., "Efficient Streaming LMs with
//             Attention Sinks", 2023, learnable form)
// Semantics are flash_attn 2.8's (reference/api-contracts.md §1.2): softcap applies first, then
// ALiBi, then the mask. Row i (0-based in its sequence) sees key j iff
//   j <= i + diag + right   (causal: right = 0; none: always)
//   j >= i + diag - left    (local with a bounded left side; else always)
//   j <  seqlen_k
// with diag = seqlen_k − seqlen_q (bottom-right alignment).
//
// Compile-time part: AttnVariant<Mask, Softcap, Alibi, Sinks>, a template argument of every
// attention kernel (rendered by AttnVariantKind::cuda_type in src/ops/attention/variant.rs). A
// variant that is off compiles to nothing: every branch below is `if constexpr`.
// Run-time part: the variant fields of AttnFwdParams (attention/params.cuh), filled by the host
// from the same value (window sides, softcap, slope and sink pointers).
//
// Units: the kernels keep scores in "raw" units r and compute exp2(r · scale_log2 − m). Without
// softcap r = q·k and scale_log2 = scale · log2(e). With softcap r = c · tanh(q·k · scale / c)
// and scale_log2 = log2(e) (the scale moved inside tanh). ALiBi and sinks are added in the same
// raw units: slope / raw_scale and sink / raw_scale with raw_scale = scale (no softcap) or 1.
// The host stores raw_scale in params.raw_scale, so device code never branches on it.
#pragma once
#include "attention/params.cuh"

namespace ferroattn {

enum : int { kMaskNone = 0, kMaskCausal = 1, kMaskLocal = 2 };

template <int Mask, bool Softcap, bool Alibi, bool Sinks, bool Dropout = false, bool ReturnSoftmax = false>
struct AttnVariant {
    static_assert(Mask == kMaskNone || Mask == kMaskCausal || Mask == kMaskLocal, "unknown mask kind");
    static constexpr int kMask = Mask;
    static constexpr bool kCausal = Mask == kMaskCausal;
    static constexpr bool kLocal = Mask == kMaskLocal;
    // Some keys below seqlen_k are hidden from some rows (the rows' key ranges differ).
    static constexpr bool kMasked = Mask != kMaskNone;
    static constexpr bool kSoftcap = Softcap;
    static constexpr bool kAlibi = Alibi;
    static constexpr bool kSinks = Sinks;
    static constexpr bool kDropout = Dropout;
    // Dropout, testing only: the forward also writes the undropped softmax with the mask in its
    // sign (params.s_dmask / s_dmask_max).
    static constexpr bool kReturnSoftmax = Dropout && ReturnSoftmax;
};

// tanh, approximate (sm_75+, max abs error ~2^-10.7 near 0, relative ~2^-11).
__device__ __forceinline__ float tanh_fast(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

namespace attn_variant {

// The visible keys of query row `row`: [lo(row), hi(row)). For local, unbounded sides arrive
// from the host as values >= every sequence length (so no side needs a run-time test); the
// bounds are computed in 64 bits and clamped to [0, seqlen_k].
template <class V>
struct RowKeys {
    int diag, seqlen_k, left, right;
    __device__ __forceinline__ RowKeys(const AttnFwdParams& p, int seqlen_q, int seqlen_k_)
        : diag(seqlen_k_ - seqlen_q), seqlen_k(seqlen_k_), left(p.window_left), right(p.window_right) {}
    __device__ __forceinline__ int hi(int row) const {
        if constexpr (V::kCausal) return min(seqlen_k, row + diag + 1);
        if constexpr (V::kLocal)
            return static_cast<int>(min(static_cast<long long>(seqlen_k),
                                        static_cast<long long>(row) + diag + right + 1));
        return seqlen_k;
    }
    __device__ __forceinline__ int lo(int row) const {
        if constexpr (V::kLocal)
            return static_cast<int>(max(0LL, static_cast<long long>(row) + diag - left));
        return 0;
    }
    // Keys seen by any of rows [m0, m1) (m0 < m1): [lo(m0), hi(m1 - 1)) (bounds are monotone in
    // the row); an empty range has begin >= end.
    __device__ __forceinline__ int begin(int m0) const { return lo(m0); }
    __device__ __forceinline__ int end(int m1) const { return hi(m1 - 1); }
    // Rows seen by key j: [first_row(j), last_row(j)] clamped to [0, seqlen_q) by the caller.
    // Row i sees j iff j <= i + diag + right and j >= i + diag - left (and j < seqlen_k).
    __device__ __forceinline__ long long first_row(int j) const {
        if constexpr (V::kCausal) return static_cast<long long>(j) - diag;
        if constexpr (V::kLocal) return static_cast<long long>(j) - diag - right;
        return 0;
    }
    __device__ __forceinline__ long long last_row_plus1(int j, int seqlen_q) const {
        if constexpr (V::kLocal)
            return min(static_cast<long long>(seqlen_q), static_cast<long long>(j) - diag + left + 1);
        return seqlen_q;
    }
    // Whether every pair of rows [m0, m0 + rows) x keys [n0, n0 + cols) (all inside the
    // sequence) is visible: then the tile needs no mask but the tails'.
    __device__ __forceinline__ bool tile_full(int m0, int rows, int n0, int cols) const {
        if constexpr (!V::kMasked) return true;
        return n0 + cols <= hi(m0) && n0 >= lo(m0 + rows - 1);
    }
};

// The score modification of one (batch, head): softcap, then ALiBi, on raw scores (units: see
// the header). Built once per block.
template <class V>
struct ScoreMod {
    float cap;       // softcap c (Softcap)
    float cap_in;    // scale / c: tanh's argument per unit of q·k (Softcap)
    float cap_inv;   // 1 / c (Softcap)
    float slope;     // ALiBi slope in raw units (Alibi): the score loses slope·|i + diag − j|
    int diag;

    __device__ __forceinline__ ScoreMod(const AttnFwdParams& p, int head, int batch, int seqlen_q,
                                        int seqlen_k) {
        cap = p.softcap;
        cap_in = p.softcap_in;
        cap_inv = 0.f;
        if constexpr (V::kSoftcap) cap_inv = 1.f / p.softcap;
        diag = seqlen_k - seqlen_q;
        slope = 0.f;
        set_head(p, head, batch);
    }
    // The ALiBi slope of another query head (kernels whose loop visits several, e.g. GQA).
    __device__ __forceinline__ void set_head(const AttnFwdParams& p, int head, int batch) {
        if constexpr (V::kAlibi)
            slope = p.alibi_slopes[batch * p.alibi_batch_stride + head] * p.raw_scale_inv;
    }
    // Raw score of (row, col) from q·k.
    __device__ __forceinline__ float apply(float s, int row, int col) const {
        if constexpr (V::kSoftcap) s = cap * tanh_fast(s * cap_in);
        if constexpr (V::kAlibi) s -= slope * fabsf(static_cast<float>(row + diag - col));
        return s;
    }
    // apply(), also returning d(raw)/d(q·k) / scale = 1 − tanh² in `dcap` (Softcap; the
    // backward multiplies dS by it; the scale itself is applied with dK and dQ).
    __device__ __forceinline__ float apply(float s, int row, int col, float& dcap) const {
        if constexpr (V::kSoftcap) {
            const float th = tanh_fast(s * cap_in);
            dcap = fmaf(-th, th, 1.f);
            s = cap * th;
        }
        if constexpr (V::kAlibi) s -= slope * fabsf(static_cast<float>(row + diag - col));
        return s;
    }
    // 1 − tanh² of the capped score, recovered from p = exp2(raw · log2(e) − lse2) (softcap
    // kernels have scale_log2 = log2(e)): raw = (log2(p) + lse2) · ln 2, tanh = (raw + ALiBi
    // bias) / c. For kernels that no longer hold the score when they form dS; p == 0 gives 0
    // (dS = 0 there anyway).
    __device__ __forceinline__ float dcap_from_p(float p, float lse2, int row, int col) const {
        float lg;
        asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(lg) : "f"(p));
        float raw = (lg + lse2) * 0.6931471805599453f;
        if constexpr (V::kAlibi) raw += slope * fabsf(static_cast<float>(row + diag - col));
        const float th = raw * cap_inv;
        return p > 0.f ? fmaf(-th, th, 1.f) : 0.f;
    }
};

// Philox4x32-10 (Salmon et al., SC 2011): four 32-bit words from a 128-bit counter and a 64-bit
// key.
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, unsigned k0, unsigned k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const unsigned lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
        const unsigned lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c;
}

// The dropout mask of one (batch, query head): key j of row i is kept iff word (j & 3) of
// Philox(counter (j / 4, i, batch · h + head, 0), key seed) is >= p · 2^32. One Philox call
// covers keys 4q .. 4q + 3 of a row. Layout-free: every kernel (forward, backward) gets the same
// mask for the same (i, j).
template <class V>
struct DropoutMask {
    unsigned k0, k1, bh, threshold;
    float scale;
    __device__ __forceinline__ DropoutMask(const AttnFwdParams& p, int head, int batch) {
        k0 = k1 = bh = threshold = 0u;
        scale = 1.f;
        if constexpr (V::kDropout) {
            const unsigned long long seed = p.rng_state[0];
            k0 = static_cast<unsigned>(seed);
            k1 = static_cast<unsigned>(seed >> 32);
            threshold = p.dropout_threshold;
            scale = p.dropout_scale;
            bh = static_cast<unsigned>(batch * p.num_heads + head);
        }
    }
    __device__ __forceinline__ void set_head(const AttnFwdParams& p, int head, int batch) {
        if constexpr (V::kDropout) bh = static_cast<unsigned>(batch * p.num_heads + head);
    }
    __device__ __forceinline__ uint4 words(int i, int j) const {
        return philox4x32_10(make_uint4(static_cast<unsigned>(j) >> 2, static_cast<unsigned>(i), bh, 0u), k0, k1);
    }
    // Keys j and j + 1 (j even) of row i.
    __device__ __forceinline__ void keep2(int i, int j, bool& a, bool& b) const {
        const uint4 w = words(i, j);
        const bool hi = (j & 2) != 0;
        a = (hi ? w.z : w.x) >= threshold;
        b = (hi ? w.w : w.y) >= threshold;
    }
    // keep2 for `Pairs` (row, even key) pairs into a bit set (bits 2k, 2k + 1 of the 128: pair
    // k), one Philox call at a time (a rolled loop: one call's registers live, not Pairs calls').
    // pair(k, i, j) names pair k's row and key. Pairs <= 64; KeepBits::get takes a constant bit.
    struct KeepBits {
        unsigned long long lo, hi;
        __device__ __forceinline__ bool get(int bit) const {
            return ((bit < 64 ? lo >> bit : hi >> (bit - 64)) & 1ull) != 0ull;
        }
    };
    template <int Pairs, typename PairAt>
    __device__ __forceinline__ KeepBits keep_bits(const PairAt& pair) const {
        static_assert(Pairs <= 64, "at most 128 mask bits");
        KeepBits bits{0ull, 0ull};
#pragma unroll 1
        for (int k = 0; k < Pairs; ++k) {
            int i, j;
            pair(k, i, j);
            bool a, b;
            keep2(i, j, a, b);
            const unsigned long long two = static_cast<unsigned long long>(a) | (static_cast<unsigned long long>(b) << 1);
            if (k < 32) {
                bits.lo |= two << (2 * k);
            } else {
                bits.hi |= two << (2 * k - 64);
            }
        }
        return bits;
    }
    __device__ __forceinline__ bool keep(int i, int j) const {
        const uint4 w = words(i, j);
        const unsigned x = (j & 2) ? ((j & 1) ? w.w : w.z) : ((j & 1) ? w.y : w.x);
        return x >= threshold;
    }
};

// The sink logit of `head` in raw units (Sinks), for the online softmax's initial running max
// (and a running sum of exp(0) = 1 on one lane per row).
__device__ __forceinline__ float sink_raw(const AttnFwdParams& p, int head) {
    return p.sinks[head] * p.raw_scale_inv;
}

}  // namespace attn_variant
}  // namespace ferroattn
