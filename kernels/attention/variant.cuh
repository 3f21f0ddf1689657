// ferroattn — attention variants: the one mask and score rule every attention kernel shares.
//
// What: a variant is everything an attention call computes beyond softmax(scale · q kᵀ) v:
//   mask      none, bottom-right causal, or a local window (left, right)
//   softcap   score = c · tanh(scale · q·k / c)          (c > 0; Gemma-2 style logit capping)
//   ALiBi     score -= slope_h · |i + s_k − s_q − j|       (Press et al., "Train Short, Test Long", 2022)
//   dropout   after the softmax, P_ij is kept with probability 1 − p and scaled by 1/(1 − p)
//             (Srivastava et al., 2014; FlashAttention-2 §3.1): the mask is a pure function of
//             (seed, batch, head, i, j) through Philox4x32-7 (Salmon et al., "Parallel random
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

// Philox4x32-R (Salmon et al., SC 2011): four 32-bit words from a 128-bit counter and a 64-bit
// key, in kPhiloxRounds rounds. 7 rounds, as FlashAttention-2's dropout uses: the paper's table of
// minimum rounds has Philox4x32-7 passing TestU01's BigCrush (10 is its default with a safety
// margin); each round is two 32-bit multiplies per 16 mask bytes, the bulk of dropout's cost.
constexpr int kPhiloxRounds = 7;
__device__ __forceinline__ uint4 philox4x32(uint4 c, unsigned k0, unsigned k1) {
#pragma unroll
    for (int r = 0; r < kPhiloxRounds; ++r) {
        const unsigned lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
        const unsigned lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c;
}

// The dropout mask of one (batch, query head), a pure function of (seed, batch, head, i, j) shared
// by every kernel, forward and backward, whatever its thread layout.
//
// Units: one Philox4x32-7 call (counter (col unit, row unit, batch, head), key = the 64-bit seed)
// gives 16 random bytes, one per element of a unit of 2 rows x 8 keys:
//   rows {16a + r, 16a + r + 8}  (r < 8)          row unit ur = 8a + r        = (i >> 4) · 8 + (i & 7)
//   keys {32c + 2u + e + 8k}     (u < 4, e, k < 4) col unit uc = 4c + u        = (j >> 5) · 4 + ((j >> 1) & 3)
// Element (i, j) is byte ((j >> 3) & 1) · 2 + (j & 1) of word ((i >> 3) & 1) · 2 + ((j >> 4) & 1);
// it is kept iff that byte >= the 8-bit threshold t = round(256 p) (clamped to 255): the drop
// probability is t / 256, p to within 1/512 (FlashAttention-2 compares 8-bit words the same
// way). A unit is exactly what one lane holds of a row-major m16n8 fragment pair over 32 keys
// (rows g, g + 8; keys 2t, 2t + 1 of four n8 tiles), so the forward and dQ kernels spend one
// Philox call per 16 of their elements. The dK/dV kernel's transposed fragments split a unit
// between lanes l and l ^ 4; each computes one of the two units they share and they swap halves
// (frag_t).
template <class V>
struct DropoutMask {
    unsigned k0, k1, batch, head, thr4;   // thr4: the threshold in each byte
    float scale;                          // 1 / (1 − p)
    __device__ __forceinline__ DropoutMask(const AttnFwdParams& p, int head_, int batch_) {
        k0 = k1 = batch = head = thr4 = 0u;
        scale = 1.f;
        if constexpr (V::kDropout) {
            scale = p.dropout_scale;
            const unsigned long long seed = p.rng_state[0];
            k0 = static_cast<unsigned>(seed);
            k1 = static_cast<unsigned>(seed >> 32);
            thr4 = p.dropout_threshold * 0x01010101u;
            batch = static_cast<unsigned>(batch_ + p.dropout_batch0);
            head = static_cast<unsigned>(head_);
        }
    }
    __device__ __forceinline__ void set_head(const AttnFwdParams&, int head_, int) {
        if constexpr (V::kDropout) head = static_cast<unsigned>(head_);
    }
    __device__ __forceinline__ static unsigned row_unit(int i) {
        return (static_cast<unsigned>(i) >> 4) * 8u + (static_cast<unsigned>(i) & 7u);
    }
    __device__ __forceinline__ static unsigned col_unit(int j) {
        return (static_cast<unsigned>(j) >> 5) * 4u + ((static_cast<unsigned>(j) >> 1) & 3u);
    }
    // Bit 7 of each byte of the result: that byte of x >= the threshold (SWAR: the low 7 bits
    // compare through the borrow of (x | 0x80) − (t & 0x7f), the top bits by x ∧ ¬t, or equal
    // top bits and the low compare). Other bits are unspecified.
    __device__ __forceinline__ unsigned keep_bytes(unsigned x) const {
        const unsigned d = (x | 0x80808080u) - (thr4 & 0x7f7f7f7fu);
        return (x & ~thr4) | (~(x ^ thr4) & d);
    }
    // The kept-byte words of unit (ur, uc).
    __device__ __forceinline__ uint4 unit(unsigned ur, unsigned uc) const {
        uint4 w = philox4x32(make_uint4(uc, ur, batch, head), k0, k1);
        w.x = keep_bytes(w.x);
        w.y = keep_bytes(w.y);
        w.z = keep_bytes(w.z);
        w.w = keep_bytes(w.w);
        return w;
    }
    __device__ __forceinline__ static unsigned word(const uint4& w, int idx) {
        return idx == 0 ? w.x : idx == 1 ? w.y : idx == 2 ? w.z : w.w;
    }
    // Row-major fragments: this lane's rows r, r + 8 (r % 16 < 8) and keys c0 + 8 nn + 2 t + e
    // (c0 % 32 == 0, nn < 4, e < 2): one unit. Element (h, nn, e) is kept iff frag_keep.
    __device__ __forceinline__ uint4 frag(int r, int c0, int t) const {
        return unit(row_unit(r), col_unit(c0) + static_cast<unsigned>(t));
    }
    __device__ __forceinline__ static bool frag_keep(const uint4& w, int h, int nn, int e) {
        return ((word(w, h * 2 + (nn >> 1)) >> (8 * ((nn & 1) * 2 + e) + 7)) & 1u) != 0u;
    }
    // All ones over the 16-bit halves kept of the packed pair (e = 0 low, e = 1 high) of element
    // (h, nn): prmt's sign-replicate mode copies each byte's bit 7.
    __device__ __forceinline__ static unsigned frag_pair_mask(const uint4& w, int h, int nn) {
        const unsigned b0 = 8u | static_cast<unsigned>((nn & 1) * 2);
        const unsigned sel = b0 | (b0 << 4) | ((b0 + 1u) << 8) | ((b0 + 1u) << 12);
        unsigned m;
        asm("prmt.b32 %0, %1, 0, %2;\n" : "=r"(m) : "r"(word(w, h * 2 + (nn >> 1))), "r"(sel));
        return m;
    }

    // Transposed fragments (the dK/dV kernel): this lane's queries q0 + 8a + 2t + e (q0 % 16 == 0,
    // a, e < 2) and keys c0 + 16m + g + 8h (c0 % 32 == 0, m, h < 2): two units (e = 0, 1), of
    // which the lane holds the bytes of key parity g & 1. The lane computes the unit e = g & 1
    // and trades the other parity's bytes with lane ^ 4 (which computes e = 1 − (g & 1)). Every
    // lane of the warp must call it. u[e][a] byte m · 2 + h is the element (e, a, m, h).
    struct TFrag {
        unsigned u[2][2];
    };
    __device__ __forceinline__ TFrag frag_t(int q0, int c0, int t, int g) const {
        const unsigned s = static_cast<unsigned>(g) & 1u;
        const uint4 w = unit(row_unit(q0 + 2 * t + static_cast<int>(s)), col_unit(c0) + (static_cast<unsigned>(g) >> 1));
        // word a·2 + m, byte h·2 + parity: pick one parity of words (a, 0) and (a, 1)
        const unsigned own_sel = 0x6420u + s * 0x1111u, give_sel = 0x6420u + (s ^ 1u) * 0x1111u;
        unsigned own[2], give[2];
        asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(own[0]) : "r"(w.x), "r"(w.y), "r"(own_sel));
        asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(own[1]) : "r"(w.z), "r"(w.w), "r"(own_sel));
        asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(give[0]) : "r"(w.x), "r"(w.y), "r"(give_sel));
        asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(give[1]) : "r"(w.z), "r"(w.w), "r"(give_sel));
        TFrag f;
#pragma unroll
        for (int a = 0; a < 2; ++a) {
            const unsigned recv = __shfl_xor_sync(0xffffffffu, give[a], 4);
            f.u[0][a] = s ? recv : own[a];
            f.u[1][a] = s ? own[a] : recv;
        }
        return f;
    }
    __device__ __forceinline__ static bool tfrag_keep(const TFrag& f, int e, int a, int m, int h) {
        return ((f.u[e][a] >> (8 * (m * 2 + h) + 7)) & 1u) != 0u;
    }
    // frag_t for a warp of one m16 key tile (keys c16 + g + 8h, c16 % 16 == 0): half of each of
    // the two units, so a Philox call per 8 of the lane pair's elements. u[e] byte a · 2 + h is
    // the element (e, a, h).
    struct TFrag16 {
        unsigned u[2];
    };
    __device__ __forceinline__ TFrag16 frag_t16(int q0, int c16, int t, int g) const {
        const unsigned s = static_cast<unsigned>(g) & 1u;
        const uint4 w = unit(row_unit(q0 + 2 * t + static_cast<int>(s)), col_unit(c16) + (static_cast<unsigned>(g) >> 1));
        const bool m1 = ((c16 >> 4) & 1) != 0;   // this tile's words: (a, m) = (0, m), (1, m)
        const unsigned wa0 = m1 ? w.y : w.x, wa1 = m1 ? w.w : w.z;
        const unsigned own_sel = 0x6420u + s * 0x1111u, give_sel = 0x6420u + (s ^ 1u) * 0x1111u;
        unsigned own, give;
        asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(own) : "r"(wa0), "r"(wa1), "r"(own_sel));
        asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(give) : "r"(wa0), "r"(wa1), "r"(give_sel));
        const unsigned recv = __shfl_xor_sync(0xffffffffu, give, 4);
        TFrag16 f;
        f.u[0] = s ? recv : own;
        f.u[1] = s ? own : recv;
        return f;
    }
    __device__ __forceinline__ static bool tfrag16_keep(const TFrag16& f, int e, int a, int h) {
        return ((f.u[e] >> (8 * (a * 2 + h) + 7)) & 1u) != 0u;
    }
    // frag_t16 as 8 keep bits in one register (where the keep bytes of several units must stay
    // live): bit e · 4 + a · 2 + h is the element (e, a, h). Each byte's bit 7 moves to bit 0,
    // then one multiply by 2^24 + 2^17 + 2^10 + 2^3 gathers the four bytes' bits into bits
    // 24..27 (the other partial products land on distinct lower bits, so nothing carries).
    __device__ __forceinline__ static unsigned tfrag16_bits(const TFrag16& f) {
        const unsigned b0 = (((f.u[0] >> 7) & 0x01010101u) * 0x01020408u) >> 24;
        const unsigned b1 = (((f.u[1] >> 7) & 0x01010101u) * 0x01020408u) >> 24;
        return b0 | (b1 << 4);
    }
    __device__ __forceinline__ static bool tbits16_keep(unsigned bits, int e, int a, int h) {
        return ((bits >> (e * 4 + a * 2 + h)) & 1u) != 0u;
    }
};

// The sink logit of `head` in raw units (Sinks), for the online softmax's initial running max
// (and a running sum of exp(0) = 1 on one lane per row).
__device__ __forceinline__ float sink_raw(const AttnFwdParams& p, int head) {
    return p.sinks[head] * p.raw_scale_inv;
}

}  // namespace attn_variant
}  // namespace ferroattn
