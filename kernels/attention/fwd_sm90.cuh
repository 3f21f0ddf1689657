// ferroattn — attention forward, sm90 family (sm_90a): TMA + mbarrier pipeline, warp-specialised,
// wgmma with S = Q K^T from shared memory and O += P V with P from registers.
//
// What: the same function as attention/fwd_sm80.cuh (O = softmax(scale * Q K^T [+ variant]) V,
// LSE per row in natural log, fp32; FlashAttention-2 semantics, bottom-right causal, GQA, empty
// rows -> O = 0 and LSE = +inf, every variant of attention/variant.cuh), in the FlashAttention-3
// design (Shah et al., "FlashAttention-3: Fast and Accurate Attention with Asynchrony and
// Low-precision", 2024, §3.1-3.2): a producer warp issues TMA loads of Q once and of K/V through a
// Stages-deep shared-memory ring on mbarriers; two consumer warpgroups each own 64 query rows and
// overlap, within the warpgroup, the next tile's S = Q K^T with this tile's O += P V while the
// softmax runs (the next S is issued before the previous P V, and the softmax of the next S runs
// while that P V is in flight).
//
// Layouts: padded only (q/o (b, s_q, h, d), k/v (b, s_k, h_k, d), lse (b, h, s_q) fp32; strides
// in AttnFwdParams, last dim contiguous). q, k, v are read and o is written only through the TMA
// tensor maps of AttnFwdSm90Params (src/ops/attention/sm90.rs builds them): rank 4 (head dim,
// rows, heads, batch), 128-byte swizzle, boxes of 64 elements x BlockM (q), BlockN (k, v), 64 (o).
// The maps' head-dim extent is the call's head_dim (<= HeadDim): columns past it load as zero
// and are not stored; rows past s_q / s_k load as zero and are not stored.
//
// Launch: grid (ceil(s_q / 128), h, b) with b <= 65535, 384 threads, dynamic shared memory
// AttnSm90Smem::kTotal bytes (the formula of AttnFwdSm90Config::smem_bytes in
// src/tuning/attention_sm90.rs). For causal masks blockIdx.x is reversed (heaviest tiles first).
// Warpgroup 0: the producer (setmaxnreg 24; one thread issues every copy). Warpgroups 1, 2: the
// consumers (setmaxnreg 240), rows 64 (wg - 1) .. + 63 of the 128-row query tile.
//
// Template parameters: HeadDim 64, 128, 192 or 256; BlockN keys per tile, a multiple of 16 (of 32 with
// dropout) for which common/wgmma.cuh has an SS wrapper; Stages >= 2 K/V ring slots; V the
// variant (attention/variant.cuh); T __half or __nv_bfloat16; KvSeparate (default false) how the
// ring's slots are released: false, K and V of a slot together once the slot's P V completed;
// true, K once its S = Q K^T completed and V once its P V completed, with the producer loading the
// next tile's K before this tile's V (so a K load is in flight for a whole tile, not only from the
// end of the previous P V).
//
// Shared memory (1024-aligned base): Q (HeadDim / 64 chunks of 128 rows x 128 B), K ring, V ring
// (Stages slots of HeadDim / 64 chunks of BlockN rows x 128 B), all in the canonical 128B-swizzle
// layout (16-byte chunk q of row r at q ^ (r % 8)); then mbarriers q_full, k_full[Stages],
// v_full[Stages] (count 1: producer expect_tx + TMA complete_tx) and empty[Stages] (count 8: lane 0
// of each consumer warp once that slot's P V has completed; with KvSeparate once its S = Q K^T
// has), and with KvSeparate v_empty[Stages] (count 8: once the slot's P V has completed). The epilogue stages each warpgroup's
// O in its own 64 rows of the Q tile and stores it with TMA.
// wgmma operands: S: A = Q (K-major, desc SBO 1024, k16 step +32 B, +16 KiB per 64-column chunk),
// B = K (K-major likewise); O: A = P (registers: the S accumulator layout packed to 16 bits, see
// common/wgmma.cuh), B = V (MN-major: LBO = one 64-column chunk = BlockN x 128 B, SBO 1024, k16
// step = 16 key rows = 2048 B).
// Work per block: the key tiles holding [n_begin, n_end) that some row of the tile sees
// (variant.cuh RowKeys), last tile first (the masked diagonal and key-tail tiles come first);
// a tile is masked only where it is not wholly visible to the warpgroup's 64 rows.
//
// PTX features (sm_90a): wgmma.mma_async (SS and RS), cp.async.bulk.tensor.4d (load, store),
// mbarrier, setmaxnreg, named barriers, fence.proxy.async, ex2.approx, tanh.approx.
#pragma once
#include "common/dtype.cuh"
#include "common/ptx.cuh"
#include "common/hopper.cuh"
#include "attention/params.cuh"
#include "attention/variant.cuh"

namespace ferroattn {

// Kernel parameters (mirror: `AttnFwdSm90Params` in src/ops/attention/sm90.rs; change both
// together). The forward's params plus the four tensor maps.
struct AttnFwdSm90Params {
    TmaMap tma_q;   // q: dims (head_dim, s_q, h, b), box (64, 128, 1, 1)
    TmaMap tma_k;   // k: dims (head_dim, s_k, h_k, b), box (64, BlockN, 1, 1)
    TmaMap tma_v;   // v: like k
    TmaMap tma_o;   // o: dims (head_dim, s_q, h, b), box (64, 64, 1, 1)
    AttnFwdParams p;
};

// Shared-memory map of attn_fwd_sm90 (offsets from the 1024-aligned base).
template <int HeadDim, int BlockN, int Stages, bool KvSeparate = false, bool Persistent = false>
struct AttnSm90Smem {
    // Enumerators, not static constexpr members: NVRTC emits the latter as .global variables.
    enum : unsigned {
        kChunks = HeadDim / 64,
        kQChunk = 128u * 128u,                 // 128 rows x 64 elements
        kQBytes = kChunks * kQChunk,
        kKVChunk = BlockN * 128u,              // BlockN rows x 64 elements
        kKVBytes = kChunks * kKVChunk,         // one ring slot of K (or V)
        // Persistent: O is staged in its own tile where it fits (head dim <= 128), so the next
        // tile's Q loads while this one's O is stored; else in the Q tile as without Persistent.
        kOwnO = Persistent && HeadDim <= 128 ? 1u : 0u,
        kOOff = kQBytes + 2u * Stages * kKVBytes,
        kBars = kOOff + kOwnO * kQBytes,
        kNumBars = 1u + (KvSeparate ? 4u : 3u) * Stages + (Persistent ? 1u : 0u),
        kTotal = kBars + 8u * kNumBars + 1024u,
    };
    unsigned base;
    __device__ __forceinline__ explicit AttnSm90Smem(const void* raw)
        : base((sm90::smem_addr(raw) + 1023u) & ~1023u) {}
    __device__ __forceinline__ unsigned q() const { return base; }
    __device__ __forceinline__ unsigned k(int s) const { return base + kQBytes + s * kKVBytes; }
    __device__ __forceinline__ unsigned v(int s) const { return base + kQBytes + (Stages + s) * kKVBytes; }
    __device__ __forceinline__ unsigned q_full() const { return base + kBars; }
    __device__ __forceinline__ unsigned k_full(int s) const { return base + kBars + 8u * (1 + s); }
    __device__ __forceinline__ unsigned v_full(int s) const { return base + kBars + 8u * (1 + Stages + s); }
    __device__ __forceinline__ unsigned empty(int s) const { return base + kBars + 8u * (1 + 2 * Stages + s); }
    __device__ __forceinline__ unsigned v_empty(int s) const { return base + kBars + 8u * (1 + 3 * Stages + s); }
    __device__ __forceinline__ unsigned q_empty() const { return base + kBars + 8u * (kNumBars - 1); }
    // Where O is staged for its TMA store.
    __device__ __forceinline__ unsigned o() const { return kOwnO ? base + kOOff : base; }
};

// One output tile: query rows [128 m_block, + 128) of query head `head` of batch entry `batch`.
struct AttnSm90Tile {
    int m_block, head, batch;
};

// f(tile) for each tile next(k, tile) gives for k = 0, 1, ... (1: a tile, 0: none at this k,
// -1: no more): the persistent form's loop, the same in the producer and the consumers.
template <class Next, class F>
__device__ __forceinline__ void attn_sm90_for_each_tile(Next& next, F& f) {
    for (int k = 0;; ++k) {
        AttnSm90Tile tl;
        const int got = next(k, tl);
        if (got < 0) break;
        if (got > 0) f(tl);
    }
}

template <int HeadDim, int BlockN, int Stages, class V, typename T, bool KvSeparate = false, bool Persistent = false>
__global__ void __launch_bounds__(384, 1) attn_fwd_sm90(const __grid_constant__ AttnFwdSm90Params P) {
    using namespace sm90;
    using Sm = AttnSm90Smem<HeadDim, BlockN, Stages, KvSeparate, Persistent>;
    using Tr = DTypeTraits<T>;
    using Drop = attn_variant::DropoutMask<V>;
    constexpr int BlockM = 128;
    constexpr int NJ = BlockN / 8;      // 8-column chunks of S per thread row
    constexpr int KP = BlockN / 16;     // k16 steps of P V
    constexpr int DJ = HeadDim / 8;     // 8-column chunks of O
    static_assert(HeadDim == 64 || HeadDim == 128 || HeadDim == 192 || HeadDim == 256, "HeadDim is 64, 128, 192 or 256");
    static_assert(BlockN % 16 == 0 && BlockN >= 16 && BlockN <= 256, "BlockN: a multiple of 16 in 16..256");
    static_assert(!V::kDropout || BlockN % 32 == 0, "dropout units span 32 keys");
    static_assert(Stages >= 2, "Stages >= 2");
    static_assert(sizeof(T) == 2, "T must be __half or __nv_bfloat16");
    static_assert(Sm::kTotal <= 227u * 1024u, "tiles do not fit in 227 KiB of shared memory");

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const Sm sm(smem_raw);
    const AttnFwdParams& p = P.p;

    // Warp-uniform role index (see kernels/gemm/sm90.cuh).
    const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
    const int tid = threadIdx.x % 128;
    // varlen (cu_seqlens_q set): q, k, v, o are (total, heads, head dim) and their maps rank 4 with
    // one batch entry; a tile's rows start at the sequence's first row (TMA loads past a
    // sequence's end read the next one's rows, masked like key tails; partial tiles of O are
    // stored by the threads, so no other sequence's rows are written).
    const bool varlen = p.cu_seqlens_q != nullptr;
    // Without Persistent a block's tile is the grid's (m blocks fastest, reversed for causal masks:
    // heaviest first; then heads, then batch entries). With it, the work comes in units of two m
    // blocks of one head, m_pair and n_m - 1 - m_pair (one where they meet), so that under a causal
    // mask every unit holds about the same number of key tiles; a block takes units blockIdx.x,
    // + gridDim.x, ... (mirror: `persistent_units` in src/tuning/attention_sm90.rs), and the units
    // in flight together are consecutive, sharing their heads' K/V in L2.
    // (32-bit: the launch takes the persistent form only below 2^31 tiles, so a unit index plus the
    // grid stays below 2^32)
    // (Persistent) the block's k-th tile: member k & 1 of its unit k >> 1 (the heavier first) into
    // tl. Returns 1, 0 when that member does not exist (a unit of one m block), -1 past the last
    // unit. Everything is derived from k, so nothing else stays live across a tile.
    [[maybe_unused]] auto seq_tile = [&](int k, AttnSm90Tile& tl) {
        // (the counts from the parameters at each use: the producer's 24 registers keep nothing)
        const int n_m = (p.seqlen_q + BlockM - 1) / BlockM;
        const int pairs = (n_m + 1) / 2;
        const unsigned num_units = static_cast<unsigned>(pairs) * p.num_heads * p.batch;
        const unsigned u = blockIdx.x + static_cast<unsigned>(k >> 1) * gridDim.x;
        if (u >= num_units) return -1;
        const int u32 = static_cast<int>(u);
        const int x = u32 % pairs;
        const int hi = n_m - 1 - x;   // the later rows: more keys under a causal mask
        if ((k & 1) && x == hi) return 0;
        tl = AttnSm90Tile{(k & 1) ? x : hi, (u32 / pairs) % p.num_heads, u32 / pairs / p.num_heads};
        return 1;
    };
    const AttnSm90Tile block_tile{V::kCausal ? static_cast<int>(gridDim.x - 1 - blockIdx.x) : static_cast<int>(blockIdx.x),
                                  static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)};
    // A batch entry's lengths, its first rows in q/o (q0) and k/v (k0), and the batch coordinate
    // of the maps: padded s_q, s_k, 0, 0, batch; varlen from cu_seqlens, clamped as the sm80
    // kernel does (attn_detail::seq_coords), coordinate 0.
    struct Seq {
        int seqlen_q, seqlen_k, q0, k0, coord;
    };
    auto seq_of = [&](int batch) {
        if (!varlen) return Seq{p.seqlen_q, p.seqlen_k, 0, 0, batch};
        const int q0 = min(max(p.cu_seqlens_q[batch], 0), p.total_q);
        const int k0 = min(max(p.cu_seqlens_k[batch], 0), p.total_k);
        const int q1 = min(max(p.cu_seqlens_q[batch + 1], q0), p.total_q);
        const int k1 = min(max(p.cu_seqlens_k[batch + 1], k0), p.total_k);
        return Seq{min(q1 - q0, p.seqlen_q), k1 - k0, q0, k0, 0};
    };
    // A tile's key tiles: those holding [n_begin, n_end) that some row of it sees; none when the
    // tile starts past its sequence (varlen).
    struct Geom {
        int m_start, n_blocks, n_iter;
    };
    auto geom = [&](const AttnSm90Tile& tl, const Seq& sq) {
        const attn_variant::RowKeys<V> rk(p, sq.seqlen_q, sq.seqlen_k);
        const int m_start = tl.m_block * BlockM;
        const int n_end = rk.end(min(m_start + BlockM, sq.seqlen_q));
        const int n_begin = rk.begin(m_start);
        const int n_blocks = (n_end + BlockN - 1) / BlockN;
        return Geom{m_start, n_blocks, n_end > n_begin ? n_blocks - n_begin / BlockN : 0};
    };

    if (threadIdx.x == 0) {
        mbar_init(sm.q_full(), 1);
#pragma unroll
        for (int s = 0; s < Stages; ++s) {
            mbar_init(sm.k_full(s), 1);
            mbar_init(sm.v_full(s), 1);
            mbar_init(sm.empty(s), 8);
            if constexpr (KvSeparate) mbar_init(sm.v_empty(s), 8);
        }
        // Persistent: Q free for the next tile. Own O tile: lane 0 of each consumer warp after the
        // tile's last S = Q K^T; O in the Q tile: thread 0 of each consumer warpgroup once its O
        // store has read it.
        if constexpr (Persistent) mbar_init(sm.q_empty(), Sm::kOwnO ? 8 : 2);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        // ---- producer ----
        setmaxnreg_dec<24>();
        if (tid == 0) {
            tma_prefetch_map(&P.tma_q);
            tma_prefetch_map(&P.tma_k);
            tma_prefetch_map(&P.tma_v);
            // Key tile it of a tile (the it-th loaded: key tile n_blocks - 1 - it) uses ring slot
            // `stage` in `phase` for K and V alike; the ring runs on across a block's tiles.
            // KvSeparate loads K one key tile ahead of V.
            int stage = 0;
            unsigned phase = 0;
            [[maybe_unused]] unsigned q_phase = 0;
            auto produce = [&](const AttnSm90Tile& tl) {
                const Seq sq = seq_of(tl.batch);
                const Geom gm = geom(tl, sq);
                if (gm.m_start >= sq.seqlen_q) return;   // (varlen) past the sequence: no work, no Q
                const int head = tl.head, batch = sq.coord, n_blocks = gm.n_blocks, n_iter = gm.n_iter;
                const int head_k = head / (p.num_heads / p.num_heads_k);
                auto load_q = [&]() {
                    if constexpr (Persistent) mbar_wait(sm.q_empty(), q_phase ^ 1u);
                    mbar_expect_tx(sm.q_full(), Sm::kQBytes);
#pragma unroll
                    for (int c = 0; c < Sm::kChunks; ++c)
                        tma_load_4d(sm.q() + c * Sm::kQChunk, &P.tma_q, sm.q_full(), c * 64, sq.q0 + gm.m_start, head, batch);
                };
                auto load_k = [&](int s, unsigned ph, int it) {
                    mbar_wait(sm.empty(s), ph ^ 1u);
                    mbar_expect_tx(sm.k_full(s), Sm::kKVBytes);
#pragma unroll
                    for (int c = 0; c < Sm::kChunks; ++c)
                        tma_load_4d(sm.k(s) + c * Sm::kKVChunk, &P.tma_k, sm.k_full(s), c * 64,
                                    sq.k0 + (n_blocks - 1 - it) * BlockN, head_k, batch);
                };
                auto load_v = [&](int s, unsigned ph, int it) {
                    if constexpr (KvSeparate) mbar_wait(sm.v_empty(s), ph ^ 1u);   // else load_k waited
                    mbar_expect_tx(sm.v_full(s), Sm::kKVBytes);
#pragma unroll
                    for (int c = 0; c < Sm::kChunks; ++c)
                        tma_load_4d(sm.v(s) + c * Sm::kKVChunk, &P.tma_v, sm.v_full(s), c * 64,
                                    sq.k0 + (n_blocks - 1 - it) * BlockN, head_k, batch);
                };
                // Persistent: the first key tile's slot fills before Q, which waits for the previous
                // tile's last Q K^T (the ring needs nothing of Q, so it keeps loading meanwhile).
                auto advance = [&]() {
                    if (++stage == Stages) {
                        stage = 0;
                        phase ^= 1u;
                    }
                };
                if constexpr (!Persistent) load_q();
                if constexpr (KvSeparate) {
                    if (n_iter > 0) load_k(stage, phase, 0);
                }
                int it0 = 0;
                if constexpr (Persistent && !KvSeparate) {
                    if (n_iter > 0) {
                        load_k(stage, phase, 0);
                        load_v(stage, phase, 0);
                        advance();
                        it0 = 1;
                    }
                }
                if constexpr (Persistent) load_q();
                for (int it = it0; it < n_iter; ++it) {
                    if constexpr (KvSeparate) {
                        const int next = stage + 1 == Stages ? 0 : stage + 1;
                        if (it + 1 < n_iter) load_k(next, next == 0 ? phase ^ 1u : phase, it + 1);
                    } else {
                        load_k(stage, phase, it);
                    }
                    load_v(stage, phase, it);
                    advance();
                }
                q_phase ^= 1u;
            };
            if constexpr (Persistent) {
                attn_sm90_for_each_tile(seq_tile, produce);
            } else {
                produce(block_tile);
            }
        }
        return;
    }

    // ---- consumers: warpgroup cw owns tile rows 64 cw .. 64 cw + 63 ----
    setmaxnreg_inc<240>();
    const int cw = wg - 1;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int t = lane % 4;
    const unsigned long long dq = wgmma_desc(sm.q() + cw * 8192u, 16u, 1024u);
    const unsigned long long dk0 = wgmma_desc(sm.k(0), 16u, 1024u);
    const unsigned long long dv0 = wgmma_desc(sm.v(0), Sm::kKVChunk, 1024u);

    const float scale_log2 = p.softmax_scale_log2;
    // The ring position and the Q phase run on across a block's tiles (Persistent).
    int stage = 0;
    unsigned phase = 0;
    unsigned q_phase = 0;
    // Ping-pong turns (below): with Persistent the opening pass is made once per block; each tile
    // with key tiles then runs n_iter + 1 turns per warpgroup, and warpgroup 1's last arrival of a
    // tile opens warpgroup 0's first turn of the next.
    if constexpr (Persistent) {
        if (cw == 1) named_barrier_arrive(3, 256);
    }
    auto consume = [&](const AttnSm90Tile& tl) {
    const Seq sq = seq_of(tl.batch);
    const Geom gm = geom(tl, sq);
    const int seqlen_q = sq.seqlen_q, seqlen_k = sq.seqlen_k;
    if (gm.m_start >= seqlen_q) return;   // (varlen) past the sequence: the producer loads nothing
    const attn_variant::RowKeys<V> rk(p, seqlen_q, seqlen_k);
    const int head = tl.head, batch = tl.batch, m_start = gm.m_start, n_blocks = gm.n_blocks, n_iter = gm.n_iter;
    const int wg_m0 = m_start + cw * 64;
    const int row0 = wg_m0 + warp * 16 + g;   // this thread's rows: row0 (h = 0), row0 + 8 (h = 1)
    float acc_o[HeadDim / 2];
#pragma unroll
    for (int i = 0; i < HeadDim / 2; ++i) acc_o[i] = 0.f;
    float row_max[2], row_sum[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        row_max[h] = -FERROATTN_INF;
        row_sum[h] = 0.f;
        if constexpr (V::kSinks) {
            // The sink joins the softmax as a column of raw score sink_raw and no value.
            row_max[h] = attn_variant::sink_raw(p, head);
            row_sum[h] = t == 0 ? 1.f : 0.f;
        }
    }
    const attn_variant::ScoreMod<V> smod(p, head, batch, seqlen_q, seqlen_k);
    const Drop drop(p, head, batch);

    // S = Q K^T of ring slot s into acc (overwritten).
    auto issue_qk = [&](float (&acc)[BlockN / 2], int s) {
        const unsigned long long dk = desc_at(dk0, s * static_cast<int>(Sm::kKVBytes));
#pragma unroll
        for (int ks = 0; ks < HeadDim / 16; ++ks) {
            const int c = ks / 4, kk = ks % 4;
            wgmma_ss<T, BlockN, 0, 0>(acc, desc_at(dq, c * Sm::kQChunk + kk * 32),
                                      desc_at(dk, c * Sm::kKVChunk + kk * 32), ks != 0);
        }
    };
    // O += P V of ring slot s.
    auto issue_pv = [&](const unsigned (&pa)[KP][4], int s) {
        const unsigned long long dv = desc_at(dv0, s * static_cast<int>(Sm::kKVBytes));
#pragma unroll
        for (int kk = 0; kk < KP; ++kk) wgmma_rs<T, HeadDim, 1>(acc_o, pa[kk], desc_at(dv, kk * 2048), 1);
    };
    // Ping-pong of the two consumer warpgroups (FlashAttention-3 §3.1): each issues its GEMMs
    // only in its turn (named barrier 3 + cw over both warpgroups: this one waits, the other
    // arrives when it has issued its own), so one warpgroup's softmax runs while the other's
    // GEMMs occupy the tensor cores. Warpgroup 0 has the first turn. Both run the same number of
    // turns (n_iter + 1); the last arrival of warpgroup 1 is left unmatched at exit.
    auto turn_wait = [&]() { named_barrier(3 + cw, 256); };
    auto turn_pass = [&]() { named_barrier_arrive(3 + (cw ^ 1), 256); };
    // The online-softmax step of key tile j (FA2 Alg. 1 in base 2): score modification, mask,
    // running max and sum, P = exp2(s * scale_log2 - m) in fp32 into pf, and corr[h], the factor
    // O must be rescaled by. Runs while the previous tile's P V is in flight, so it only does fp32
    // work on registers no wgmma reads: acc (the S accumulators) is only read (it is the next S
    // wgmma's operand), and the conversion of P to 16 bits waits for `pack` (defining the RS
    // operand's registers while a wgmma is in flight makes ptxas serialise every wgmma, C7513).
    auto softmax = [&](const float (&acc)[BlockN / 2], int j, float (&corr)[2], float (&s)[BlockN / 2]) {
        // The copy is pinned after the caller's wgmma wait (an empty asm ordered after it).
#pragma unroll
        for (int i = 0; i < BlockN / 2; ++i) {
            s[i] = acc[i];
            asm volatile("" : "+f"(s[i]) :: "memory");
        }
        const int n_start = j * BlockN;
        if constexpr (V::kSoftcap || V::kAlibi) {
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int jj = 0; jj < NJ; ++jj)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        s[4 * jj + 2 * h + e] = smod.apply(s[4 * jj + 2 * h + e], row0 + 8 * h,
                                                           n_start + 8 * jj + 2 * t + e);
        }
        const bool need_mask = n_start + BlockN > seqlen_k || !rk.tile_full(wg_m0, 64, n_start, BlockN);
        if (need_mask) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = row0 + 8 * h;
                const int c0 = n_start + 2 * t;
                const int lim = rk.hi(row) - c0;
                const int lo = rk.lo(row) - c0;
#pragma unroll
                for (int jj = 0; jj < NJ; ++jj)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int c = 8 * jj + e;
                        if (c >= lim || (V::kLocal && c < lo)) s[4 * jj + 2 * h + e] = -FERROATTN_INF;
                    }
            }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = row_max[h];
#pragma unroll
            for (int jj = 0; jj < NJ; ++jj) mx = fmaxf(mx, fmaxf(s[4 * jj + 2 * h], s[4 * jj + 2 * h + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_scaled = (mx == -FERROATTN_INF) ? 0.f : mx * scale_log2;
            corr[h] = exp2_fast(row_max[h] * scale_log2 - m_scaled);
            row_max[h] = mx;
            float sum = 0.f;
#pragma unroll
            for (int jj = 0; jj < NJ; ++jj)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float pv = exp2_fast(fmaf(s[4 * jj + 2 * h + e], scale_log2, -m_scaled));
                    s[4 * jj + 2 * h + e] = pv;
                    sum += pv;
                }
            row_sum[h] = row_sum[h] * corr[h] + sum;
        }
    };
    // P of key tile j (fp32, from softmax) into the RS operand pk. Dropout (the row sums, hence
    // the LSE, are of the undropped P): the kept words of each 32-key unit mask the packed P;
    // 1 / (1 - p) joins the epilogue's 1 / sum. With the returned softmax (testing), the undropped
    // P (negated where dropped) and the running max per 16 keys are written too.
    auto pack = [&](const float (&s)[BlockN / 2], int j, unsigned (&pk)[KP][4]) {
        const int n_start = j * BlockN;
        [[maybe_unused]] uint4 keepw[V::kDropout ? BlockN / 32 : 1];
        if constexpr (V::kDropout) {
#pragma unroll
            for (int q4 = 0; q4 < BlockN / 32; ++q4) keepw[q4] = drop.frag(row0, n_start + q4 * 32, t);
        }
        if constexpr (V::kReturnSoftmax) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = row0 + 8 * h;
                const bool row_ok = row < seqlen_q && row < p.s_dmask_rows;
                const long long row_off = row_ok
                    ? (static_cast<long long>(batch) * p.num_heads + head) * p.s_dmask_rows + row : 0;
                if (row_ok && t == 0) {
                    const float m_nat = row_max[h] == -FERROATTN_INF ? -FERROATTN_INF : row_max[h] * p.raw_scale;
#pragma unroll
                    for (int q16 = 0; q16 < BlockN / 16; ++q16) {
                        const int grp = n_start / 16 + q16;
                        if (grp < p.s_dmask_cols / 16) p.s_dmask_max[row_off * (p.s_dmask_cols / 16) + grp] = m_nat;
                    }
                }
#pragma unroll
                for (int jj = 0; jj < NJ; ++jj) {
                    const int col = n_start + 8 * jj + 2 * t;
                    const bool k0 = Drop::frag_keep(keepw[jj / 4], h, jj % 4, 0);
                    const bool k1 = Drop::frag_keep(keepw[jj / 4], h, jj % 4, 1);
                    const float p0 = s[4 * jj + 2 * h], p1 = s[4 * jj + 2 * h + 1];
                    if (row_ok && col + 1 < p.s_dmask_cols)
                        *reinterpret_cast<unsigned*>(static_cast<T*>(p.s_dmask) + row_off * p.s_dmask_cols + col) =
                            Tr::pack2(k0 ? p0 : -p0, k1 ? p1 : -p1);
                }
            }
        }
#pragma unroll
        for (int kk = 0; kk < KP; ++kk) {
            pk[kk][0] = Tr::pack2(s[8 * kk + 0], s[8 * kk + 1]);
            pk[kk][1] = Tr::pack2(s[8 * kk + 2], s[8 * kk + 3]);
            pk[kk][2] = Tr::pack2(s[8 * kk + 4], s[8 * kk + 5]);
            pk[kk][3] = Tr::pack2(s[8 * kk + 6], s[8 * kk + 7]);
            if constexpr (V::kDropout) {   // chunks 2kk, 2kk + 1: elements nn, nn + 1 of a unit
                const uint4& w = keepw[(2 * kk) / 4];
                const int nn = (2 * kk) % 4;
                pk[kk][0] &= Drop::frag_pair_mask(w, 0, nn);
                pk[kk][1] &= Drop::frag_pair_mask(w, 1, nn);
                pk[kk][2] &= Drop::frag_pair_mask(w, 0, nn + 1);
                pk[kk][3] &= Drop::frag_pair_mask(w, 1, nn + 1);
            }
        }
    };

    mbar_wait(sm.q_full(), q_phase);
    q_phase ^= 1u;
    // (Persistent, own O tile) Q of this tile is no longer read: the next tile's may load.
    [[maybe_unused]] auto release_q = [&]() {
        if constexpr (Persistent && Sm::kOwnO) {
            __syncwarp();   // every lane is past its q_full wait (no wgmma wait orders them here)
            if (lane == 0) mbar_arrive(sm.q_empty());
        }
    };
    if (n_iter > 0) {
        if constexpr (!Persistent) {
            if (cw == 1) turn_pass();
        }
        float acc_s[BlockN / 2];
        unsigned pa[KP][4];
        float corr[2];
        int j = n_blocks - 1;
        mbar_wait(sm.k_full(stage), phase);
        turn_wait();
        wgmma_fence();
        issue_qk(acc_s, stage);
        wgmma_commit();
        turn_pass();
        wgmma_wait<0>();
        fence_accumulators(acc_s);
        if constexpr (KvSeparate) {
            if (lane == 0) mbar_arrive(sm.empty(stage));   // K of this slot is no longer read
        }
        if (n_iter == 1) release_q();
        {
            float pf[BlockN / 2];
            softmax(acc_s, j, corr, pf);   // O is 0: corr is not needed
            pack(pf, j, pa);
        }
#pragma unroll 1
        for (int it = 1; it < n_iter; ++it) {
            const int prev = stage;
            const unsigned prev_phase = phase;
            if (++stage == Stages) {
                stage = 0;
                phase ^= 1u;
            }
            --j;
            mbar_wait(sm.k_full(stage), phase);
            fence_accumulators(acc_s);
            fence_accumulators(acc_o);
            fence_fragments(pa);
            mbar_wait(sm.v_full(prev), prev_phase);
            turn_wait();
            wgmma_fence();
            issue_qk(acc_s, stage);
            wgmma_commit();
            wgmma_fence();
            issue_pv(pa, prev);
            wgmma_commit();
            turn_pass();
            wgmma_wait<1>();   // S of tile j is ready; P V of tile j + 1 may still run
            if constexpr (KvSeparate) {
                if (lane == 0) mbar_arrive(sm.empty(stage));   // K of this slot is no longer read
            }
            if (it + 1 == n_iter) release_q();
            float pf[BlockN / 2];
            softmax(acc_s, j, corr, pf);
            wgmma_wait<0>();
            fence_accumulators(acc_o);
            fence_fragments(pa);
            if (lane == 0) mbar_arrive(KvSeparate ? sm.v_empty(prev) : sm.empty(prev));
#pragma unroll
            for (int jj = 0; jj < DJ; ++jj) {
                acc_o[4 * jj + 0] *= corr[0];
                acc_o[4 * jj + 1] *= corr[0];
                acc_o[4 * jj + 2] *= corr[1];
                acc_o[4 * jj + 3] *= corr[1];
            }
            pack(pf, j, pa);
        }
        mbar_wait(sm.v_full(stage), phase);
        fence_accumulators(acc_o);
        fence_fragments(pa);
        turn_wait();
        wgmma_fence();
        issue_pv(pa, stage);
        wgmma_commit();
        turn_pass();
        wgmma_wait<0>();
        fence_accumulators(acc_o);
        if (lane == 0) mbar_arrive(KvSeparate ? sm.v_empty(stage) : sm.empty(stage));
        if (++stage == Stages) {   // the ring's next slot, for the next tile (Persistent)
            stage = 0;
            phase ^= 1u;
        }
    } else {
        release_q();
    }

    // ---- epilogue: normalise, LSE, O through this warpgroup's rows of the Q tile, TMA store ----
    float* lse = p.lse + static_cast<long long>(batch) * p.lse_batch_stride + sq.q0
               + static_cast<long long>(head) * p.lse_head_stride;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float sum = row_sum[h];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const bool empty = !(sum > 0.f);
        const float inv = empty ? 0.f : (V::kDropout ? drop.scale : 1.f) / sum;
        const int row = row0 + 8 * h;
        if (t == 0 && row < seqlen_q) lse[row] = empty ? FERROATTN_INF : row_max[h] * p.raw_scale + logf(sum);
#pragma unroll
        for (int jj = 0; jj < DJ; ++jj) {
            acc_o[4 * jj + 2 * h] *= inv;
            acc_o[4 * jj + 2 * h + 1] *= inv;
        }
    }
    // (varlen) a warpgroup tile that ends past its sequence: stored by the threads, row by row
    if (varlen && wg_m0 < seqlen_q && wg_m0 + 64 > seqlen_q) {
        T* o = static_cast<T*>(p.o) + static_cast<long long>(sq.q0) * p.o_row_stride
             + static_cast<long long>(head) * p.o_head_stride;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + 8 * h;
            if (row >= seqlen_q) continue;
#pragma unroll
            for (int jj = 0; jj < DJ; ++jj) {
                const int col = 8 * jj + 2 * t;   // head_dim is a multiple of 8: both or neither
                if (col < p.head_dim)
                    *reinterpret_cast<unsigned*>(o + static_cast<long long>(row) * p.o_row_stride + col) =
                        Tr::pack2(acc_o[4 * jj + 2 * h], acc_o[4 * jj + 2 * h + 1]);
            }
        }
    }
    // uniform over the warpgroup: else no row of it goes through the TMA store
    const bool store = wg_m0 < seqlen_q && !(varlen && wg_m0 + 64 > seqlen_q);
    if (!store && !(Persistent && !Sm::kOwnO)) return;
    if constexpr (Persistent && Sm::kOwnO) {
        if (tid == 0) bulk_wait_read<0>();   // this warpgroup's previous O store has read the tile
    }
    named_barrier(1 + cw, 128);      // every warp of the warpgroup is past its last wgmma on Q
    if (!store) {                    // (Persistent, O in the Q tile)
        if (tid == 0) mbar_arrive(sm.q_empty());
        return;
    }
#pragma unroll
    for (int jj = 0; jj < DJ; ++jj) {
        const unsigned chunk = sm.o() + (jj / 8) * Sm::kQChunk;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = cw * 64 + warp * 16 + g + 8 * h;   // tile row
            const unsigned addr = chunk + r * 128u + ((static_cast<unsigned>(jj % 8) ^ (r % 8)) << 4) + 4u * t;
            st_shared_b32(addr, Tr::pack2(acc_o[4 * jj + 2 * h], acc_o[4 * jj + 2 * h + 1]));
        }
    }
    fence_proxy_async_smem();
    named_barrier(1 + cw, 128);
    if (tid == 0) {
#pragma unroll
        for (int c = 0; c < Sm::kChunks; ++c)
            tma_store_4d(&P.tma_o, sm.o() + c * Sm::kQChunk + cw * 8192u, c * 64, sq.q0 + wg_m0, head, sq.coord);
        bulk_commit();
        if constexpr (!Persistent) {
            bulk_wait_all();
        } else if constexpr (!Sm::kOwnO) {
            bulk_wait_read<0>();              // the Q tile is read: the next tile's Q may load
            mbar_arrive(sm.q_empty());
        }
    }
    };
    if constexpr (Persistent) {
        attn_sm90_for_each_tile(seq_tile, consume);
        if (tid == 0) bulk_wait_all();   // the last O stores are complete before the block exits
    } else {
        consume(block_tile);
    }
}

}  // namespace ferroattn
