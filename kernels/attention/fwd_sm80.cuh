// ferroattn — attention forward, sm80 family (mma.sync + ldmatrix + cp.async).
//
// What: O = softmax(scale * Q K^T [+ variant]) V and LSE = logsumexp(scale * Q K^T) per
// query row (natural log, fp32), FlashAttention-2 semantics: online softmax (FA2 Alg. 1) in
// base 2 with log2(e) folded into params.softmax_scale_log2, fp32 accumulation, O normalised
// once at the end. Causal masks are bottom-right aligned: row i sees key j iff
// j <= i + seqlen_k - seqlen_q (per sequence in varlen). A row that sees no key writes O = 0
// and LSE = +inf. GQA: query head h reads kv head h / (num_heads / num_heads_k).
//
// Layouts (see attention/params.cuh): padded q/o (b, s_q, h, d), k/v (b, s_k, h_k, d),
// lse (b, h, s_q); varlen q/o (total_q, h, d), k/v (total_k, h_k, d), lse (h, total_q) with
// sequence b at rows [cu_seqlens_q[b], cu_seqlens_q[b+1]). Strides in elements, last dim
// contiguous; base pointers and row/head/batch strides must be 16-byte aligned (multiples of
// 8 elements) because tiles move in 16-byte cp.async / vector stores.
//
// Launch: grid (ceil(seqlen_q / BlockM), num_heads, batch), block NumWarps*32 threads,
// dynamic shared memory attn_fwd_sm80_smem_bytes<...>() =
// (BlockM*HeadDim + 2*Stages*BlockN*HeadDim) * 2 bytes (the formula of
// AttnFwdConfig::smem_bytes in src/tuning/attention.rs); above 48 KiB the caller must raise
// CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES. For causal, blockIdx.x is reversed so the
// heaviest query tiles start first.
//
// Template parameters and constraints:
//   HeadDim  kernel head dim, multiple of 32 in [32, 256]; params.head_dim (multiple of 8,
//            <= HeadDim) is the real one: other columns load as 0 and are not written.
//   BlockM   query rows per block; a multiple of 16*NumWarps (each warp owns BlockM/NumWarps
//            consecutive rows = BlockM/NumWarps/16 m16 tiles).
//   BlockN   keys per pipeline tile, multiple of 16.
//   NumWarps warps per block.
//   Stages   >= 1: K tiles and V tiles each have a ring of Stages shared-memory slots. V
//            tile j+Stages is fetched as soon as P V_j is done; K tile j+Stages as soon as
//            Q K_j^T is done (or, when the tile is split into sub-blocks, after the tile).
//   V        the variant (attention/variant.cuh: AttnVariant<Mask, Softcap, Alibi, Sinks, Dropout,
//            ReturnSoftmax>):
//            mask (none, bottom-right causal, local window), softcap, ALiBi, sinks, dropout;
//            its run-time part comes in params.
//   T        __half or __nv_bfloat16 (q, k, v, o); lse is fp32.
// Shared memory: Q tile (swizzled, reused to stage O for 16-byte stores), K ring, V ring, all
// XOR-swizzled 16-byte chunks (common/swizzle.cuh): ldmatrix and cp.async are conflict-free.
// Registers: Q fragments are re-read from shared memory each k-step; S/P and O stay in
// registers, and P is repacked from the S accumulators straight into the A operand of the P·V
// mma. A K/V tile is processed in sub-blocks of kSubN keys when the S and O accumulators
// together would pass a register budget (kAccBudget), and near that budget (kLean) no 64-bit
// global pointer is kept live through the main loop: the K/V/O/LSE slice pointers sit in a
// 32-byte static shared table (128 B with alignment; only kLean kernels have it, on top of the
// dynamic formula) and are re-read per tile. The production configurations compile without
// spills for sm_80 and sm_90a (bench/NOTES.md).
// Work per block: the K/V tiles holding the keys [n_begin, n_end) that some row of the tile
// sees (variant.cuh RowKeys: [0, seqlen_k) without a mask, causal cuts n_end to
// m_start + BlockM + seqlen_k - seqlen_q, a local window also raises n_begin); tiles no row sees
// fully are skipped, tiles on the window's edges and the key tail are masked. Softcap and ALiBi
// modify each score before the mask; sinks start each row's online softmax; dropout scales the
// kept P after the row sums (variant.cuh).
//
// PTX features: mma.sync.aligned.m16n8k16 f16/bf16 -> f32, ldmatrix.x4(.trans),
// cp.async.cg (16 B, src-size zero fill), cp.async.commit_group/wait_group, ex2.approx.
// Needs sm_80 or newer.
#pragma once
#include "common/dtype.cuh"
#include "common/ptx.cuh"
#include "common/swizzle.cuh"
#include "attention/params.cuh"
#include "attention/variant.cuh"

namespace ferroattn {

template <int HeadDim, int BlockM, int BlockN, int Stages>
__host__ __device__ constexpr int attn_fwd_sm80_smem_bytes() {
    return (BlockM * HeadDim + 2 * Stages * BlockN * HeadDim) * 2;
}

namespace attn_detail {

// The tile constraints of the query-row kernels (attn_fwd_sm80, attn_bwd_dq_sm80): BlockM query
// rows in m16 tiles split evenly over NumWarps warps, K/V tiles of BlockN keys (a multiple of
// 16) in a ring of Stages, 16-bit T, SmemBytes of dynamic shared memory within the 227 KiB
// limit. True, or a compile error naming the constraint that fails (compile time only).
template <int HeadDim, int BlockM, int BlockN, int NumWarps, int Stages, typename T, int SmemBytes>
__host__ __device__ constexpr bool query_tile_sm80_ok() {
    static_assert(HeadDim % 32 == 0 && HeadDim >= 32 && HeadDim <= 256,
                  "HeadDim must be a multiple of 32 in [32, 256]");
    static_assert(NumWarps >= 1 && BlockM % (16 * NumWarps) == 0,
                  "BlockM must be a multiple of 16 * NumWarps");
    static_assert(BlockN % 16 == 0 && BlockN >= 16, "BlockN must be a multiple of 16");
    static_assert(Stages >= 1, "Stages must be >= 1");
    static_assert(sizeof(T) == 2, "T must be __half or __nv_bfloat16");
    static_assert(SmemBytes <= 227 * 1024, "tile does not fit in 227 KiB of shared memory");
    return true;
}

// The passes of one thread's part of a tile copy: pass i copies the 16 bytes of chunk column c
// of row r0 + i * kRowsPerPass from `src` (advanced by kRowsPerPass rows per pass) into the
// swizzled shared tile s, zero-filling passes at or beyond rows_left (nothing is read there).
// s_off is the byte offset of (row r0, chunk c) in the tile.
template <int Rows, int HeadDim, int Threads, typename T>
__device__ __forceinline__ void copy_tile_passes(T* s, const T* src, unsigned s_off, int r0, int c,
                                                 int rows_left, long long row_stride) {
    constexpr int kChunks = HeadDim / 8;
    constexpr int kRowsPerPass = Threads / kChunks;
    constexpr int kPasses = (Rows + kRowsPerPass - 1) / kRowsPerPass;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
        const int r = r0 + i * kRowsPerPass;
        if ((Rows % kRowsPerPass == 0 && Threads % kChunks == 0) ||
            (r < Rows && r0 < kRowsPerPass)) {
            // With kRowsPerPass % 8 == 0 every pass keeps r % 8, hence the swizzle: the
            // shared address is then a compile-time offset from s_off.
            const unsigned dst = (kRowsPerPass % 8 == 0)
                ? smem_u32(s) + s_off + i * kRowsPerPass * HeadDim * 2
                : smem_u32(s + r * HeadDim + swizzle_chunk<kChunks>(r, c) * 8);
            cp_async_16_zfill(dst, src, i * kRowsPerPass < rows_left);
        }
        src += kRowsPerPass * row_stride;
    }
}

// Asynchronous copy of a Rows x HeadDim tile (global row stride `row_stride` elements, `g`
// = row 0 of the tensor slice) into a swizzled shared tile: rows [row0, row0 + Rows) of the
// slice. Thread `tid` owns chunk column tid % kChunks and rows tid / kChunks + i *
// kRowsPerPass; threads beyond kRowsPerPass * kChunks stay idle. Rows >= rows_valid
// (relative to row0) and columns >= head_dim are zero-filled (src-size 0: nothing is read).
template <int Rows, int HeadDim, int Threads, typename T>
__device__ __forceinline__ void load_tile_async(T* s, const T* g, int row0, int rows_valid,
                                                long long row_stride, int head_dim, int tid) {
    constexpr int kChunks = HeadDim / 8;
    constexpr int kRowsPerPass = Threads / kChunks;
    static_assert(kRowsPerPass >= 1, "need at least HeadDim/8 threads");
    const int c = static_cast<int>(static_cast<unsigned>(tid) % kChunks);   // tid >= 0: shifts
    const int r0 = static_cast<int>(static_cast<unsigned>(tid) / kChunks);
    const bool active = r0 < kRowsPerPass && c * 8 < head_dim;
    const unsigned s_off = (r0 * HeadDim + swizzle_chunk<kChunks>(r0, c) * 8) * 2;
    const T* src = g + static_cast<long long>(row0 + r0) * row_stride + c * 8;
    const int rows_left = active ? rows_valid - r0 : 0;   // pass i loads iff i*kRowsPerPass < rows_left
    copy_tile_passes<Rows, HeadDim, Threads>(s, src, s_off, r0, c, rows_left, row_stride);
}

// Per-thread part of a Rows x HeadDim tile copy (held through the loop when not kLean): thread `tid` owns chunk column tid % kChunks
// and rows tid / kChunks + i * kRowsPerPass (threads beyond kRowsPerPass * kChunks idle).
template <int Rows, int HeadDim, int Threads, typename T>
struct TileThread {
    static constexpr int kChunks = HeadDim / 8;
    static constexpr int kRowsPerPass = Threads / kChunks;
    static_assert(kRowsPerPass >= 1, "need at least HeadDim/8 threads");
    const T* g;       // element (row r0, column 8c) of the tensor slice
    unsigned s_off;   // byte offset of (row r0, chunk c) in the swizzled tile
    int r0, c;
    bool active;

    __device__ __forceinline__ TileThread(const T* slice, long long row_stride, int head_dim,
                                          int tid) {
        c = tid % kChunks;
        r0 = tid / kChunks;
        active = r0 < kRowsPerPass && c * 8 < head_dim;
        s_off = (r0 * HeadDim + swizzle_chunk<kChunks>(r0, c) * 8) * 2;
        g = slice + static_cast<long long>(r0) * row_stride + c * 8;
    }

    // Asynchronously copy rows [row0, row0 + Rows) of the slice (global row stride
    // row_stride elements) into the swizzled shared tile s. Rows >= rows_valid (relative to
    // row0) and columns >= head_dim are zero-filled (src-size 0: nothing is read).
    __device__ __forceinline__ void load(T* s, int row0, int rows_valid,
                                         long long row_stride) const {
        const T* src = g + static_cast<long long>(row0) * row_stride;
        const int rows_left = active ? rows_valid - r0 : 0;   // pass i loads iff i*kRowsPerPass < rows_left
        copy_tile_passes<Rows, HeadDim, Threads>(s, src, s_off, r0, c, rows_left, row_stride);
    }
};

// Holds a TileThread through the main loop, or nothing (Lean).
template <bool Lean, typename Thr, typename T>
struct KVHold {
    Thr thr;
    __device__ __forceinline__ KVHold(const T* slice, long long row_stride, int head_dim, int tid)
        : thr(slice, row_stride, head_dim, tid) {}
};
template <typename Thr, typename T>
struct KVHold<true, Thr, T> {
    __device__ __forceinline__ KVHold(const T*, long long, int, int) {}
};

// Where the (batch, head) slice of this block lives: sequence lengths and element offsets of
// row 0 of q/o (head `head`), k/v (its kv head) and lse. Computed once per block (it costs
// two integer divisions and, for varlen, global loads).
struct SeqCoords {
    int seqlen_q, seqlen_k;
    long long q_off, k_off, v_off, o_off, lse_off;
};

// First row of sequence `batch` in a varlen tensor of `total` rows: cu_seqlens[batch] clamped
// to [0, total], so that no cu_seqlens value (unchecked during CUDA-graph capture) can move an
// access outside the tensor.
__device__ __forceinline__ int seq_start(const int* cu_seqlens, int batch, int total) {
    return min(max(cu_seqlens[batch], 0), total);
}

__device__ __forceinline__ SeqCoords seq_coords(const AttnFwdParams& p, int head, int batch) {
    SeqCoords c;
    const int head_k = head / (p.num_heads / p.num_heads_k);
    if (p.cu_seqlens_q != nullptr) {
        // Clamped so that no cu_seqlens value (unchecked during CUDA-graph capture) can move a
        // read or write outside q/k/v/o: a sequence is [q0, q1) within [0, total_q), at most
        // seqlen_q (max_seqlen_q, the grid's size) rows long; likewise for k.
        const int q0 = seq_start(p.cu_seqlens_q, batch, p.total_q);
        const int k0 = seq_start(p.cu_seqlens_k, batch, p.total_k);
        const int q1 = min(max(p.cu_seqlens_q[batch + 1], q0), p.total_q);
        const int k1 = min(max(p.cu_seqlens_k[batch + 1], k0), p.total_k);
        c.seqlen_q = min(q1 - q0, p.seqlen_q);
        c.seqlen_k = k1 - k0;
        c.q_off = static_cast<long long>(q0) * p.q_row_stride;
        c.k_off = static_cast<long long>(k0) * p.k_row_stride;
        c.v_off = static_cast<long long>(k0) * p.v_row_stride;
        c.o_off = static_cast<long long>(q0) * p.o_row_stride;
        c.lse_off = q0;
    } else {
        c.seqlen_q = p.seqlen_q;
        c.seqlen_k = p.seqlen_k;
        c.q_off = static_cast<long long>(batch) * p.q_batch_stride;
        c.k_off = static_cast<long long>(batch) * p.k_batch_stride;
        c.v_off = static_cast<long long>(batch) * p.v_batch_stride;
        c.o_off = static_cast<long long>(batch) * p.o_batch_stride;
        c.lse_off = static_cast<long long>(batch) * p.lse_batch_stride;
    }
    c.q_off += static_cast<long long>(head) * p.q_head_stride;
    c.o_off += static_cast<long long>(head) * p.o_head_stride;
    c.k_off += static_cast<long long>(head_k) * p.k_head_stride;
    c.v_off += static_cast<long long>(head_k) * p.v_head_stride;
    c.lse_off += static_cast<long long>(head) * p.lse_head_stride;
    return c;
}

}  // namespace attn_detail

template <int HeadDim, int BlockM, int BlockN, int NumWarps, int Stages, class V, typename T>
__global__ void __launch_bounds__(NumWarps * 32) attn_fwd_sm80(const AttnFwdParams params) {
    static_assert(attn_detail::query_tile_sm80_ok<HeadDim, BlockM, BlockN, NumWarps, Stages, T,
                  attn_fwd_sm80_smem_bytes<HeadDim, BlockM, BlockN, Stages>()>());

    constexpr int kThreads = NumWarps * 32;
    constexpr int kWarpM = BlockM / NumWarps;
    constexpr int MT = kWarpM / 16;     // m16 tiles per warp
    // Keys per online-softmax step: the largest of BlockN, 64, 32, 16 dividing BlockN whose S
    // accumulators, with O's, stay within kAccBudget fp32 registers per thread (chosen so the
    // production configs compile without spills; ptxas needs the rest for addresses and
    // fragments; S wider than 64 keys needs more temporaries). kSplit: more than one step per
    // K/V tile.
    constexpr int kAccBudget = BlockN > 64 ? 160 : 192;
    constexpr int kSubN =
        (MT * (HeadDim + BlockN) / 2 <= kAccBudget) ? BlockN
        : (BlockN % 64 == 0 && MT * (HeadDim + 64) / 2 <= kAccBudget) ? 64
        : (BlockN % 32 == 0 && MT * (HeadDim + 32) / 2 <= kAccBudget) ? 32 : 16;
    constexpr bool kSplit = kSubN < BlockN;
    // Accumulators this close to the register file's limit: keep no 64-bit offsets live
    // through the main loop (see load_k).
    constexpr bool kLean = MT * (HeadDim + kSubN) / 2 >= 160;
    constexpr int NT = kSubN / 8;       // n8 tiles of S per warp and sub-block
    constexpr int KT = HeadDim / 16;    // k16 steps of Q K^T
    constexpr int DT = HeadDim / 8;     // n8 tiles of O
    constexpr int kChunks = HeadDim / 8;
    using Tr = DTypeTraits<T>;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sK = sQ + BlockM * HeadDim;
    T* sV = sK + Stages * BlockN * HeadDim;

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int t = lane % 4;

    const int m_block = V::kCausal ? static_cast<int>(gridDim.x - 1 - blockIdx.x)
                                   : static_cast<int>(blockIdx.x);
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const attn_detail::SeqCoords sc = attn_detail::seq_coords(params, head, batch);
    const int seqlen_q = sc.seqlen_q;
    const int seqlen_k = sc.seqlen_k;
    const int m_start = m_block * BlockM;
    if (m_start >= seqlen_q) return;

    const int head_dim = params.head_dim;
    const int rows_q = min(seqlen_q - m_start, BlockM);
    // The variant's key range per row (attention/variant.cuh); keys this tile can see:
    // [n_begin, n_end) (rows past seqlen_q only widen it).
    const attn_variant::RowKeys<V> rk(params, seqlen_q, seqlen_k);
    const int n_end = rk.end(m_start + BlockM);
    const int n_begin = rk.begin(m_start);

    if (n_end <= n_begin) {
        // No row of this tile sees a key: O = 0, LSE = +inf (with sinks: the sink's logit).
        T* gO = static_cast<T*>(params.o) + sc.o_off
              + static_cast<long long>(m_start) * params.o_row_stride;
        float* gLse = params.lse + sc.lse_off + m_start;
        constexpr int kTotal = BlockM * kChunks;
        for (int idx = tid; idx < kTotal; idx += kThreads) {
            const int r = idx / kChunks;
            const int c = idx % kChunks;
            if (r < rows_q && c * 8 < head_dim) {
                *reinterpret_cast<uint4*>(gO + static_cast<long long>(r) * params.o_row_stride
                                          + c * 8) = make_uint4(0u, 0u, 0u, 0u);
            }
        }
        float empty_lse = FERROATTN_INF;
        if constexpr (V::kSinks) empty_lse = params.sinks[head];
        for (int r = tid; r < rows_q; r += kThreads) gLse[r] = empty_lse;
        return;
    }
    // K/V tiles j_first .. n_blocks - 1 (absolute tile indices; slot j % Stages).
    const int n_blocks = (n_end + BlockN - 1) / BlockN;
    const int j_first = V::kLocal ? n_begin / BlockN : 0;

    // K/V tile loads. kLean (accumulators near the register limit): no 64-bit slice pointer
    // stays live through the main loop; thread 0 stores the K and V slice pointers (and the
    // O/LSE row-0 pointers for the epilogue) in a small static shared table before the loop,
    // and every load reads them back (one broadcast ld.shared, volatile so ptxas cannot keep
    // the value in registers) plus a few per-thread integer instructions (one extra
    // __syncthreads per block publishes the table before the prologue's loads).
    // Otherwise per-thread pointers stay in registers.
    using KVThread = attn_detail::TileThread<BlockN, HeadDim, kThreads, T>;
    // Per-thread K/V descriptors held through the loop (not kLean); empty when kLean.
    const attn_detail::KVHold<kLean, KVThread, T> k_thr(
        static_cast<const T*>(params.k) + sc.k_off, params.k_row_stride, head_dim, tid);
    const attn_detail::KVHold<kLean, KVThread, T> v_thr(
        static_cast<const T*>(params.v) + sc.v_off, params.v_row_stride, head_dim, tid);
    __shared__ __align__(16) unsigned long long s_ptrs[4];   // k, v, o (row m_start), lse (row m_start)
    if constexpr (kLean) {
        if (tid == 0) {
            s_ptrs[0] = reinterpret_cast<unsigned long long>(static_cast<const T*>(params.k) + sc.k_off);
            s_ptrs[1] = reinterpret_cast<unsigned long long>(static_cast<const T*>(params.v) + sc.v_off);
            s_ptrs[2] = reinterpret_cast<unsigned long long>(
                static_cast<T*>(params.o) + sc.o_off + static_cast<long long>(m_start) * params.o_row_stride);
            s_ptrs[3] = reinterpret_cast<unsigned long long>(params.lse + sc.lse_off + m_start);
        }
        __syncthreads();   // the prologue's loads below already read the table
    }
    auto load_k = [&](int j) {
        T* dst = sK + (j % Stages) * BlockN * HeadDim;
        if constexpr (kLean) {
            attn_detail::load_tile_async<BlockN, HeadDim, kThreads>(
                dst, reinterpret_cast<const T*>(ld_shared_u64_volatile(smem_u32(&s_ptrs[0]))),
                j * BlockN, seqlen_k - j * BlockN, params.k_row_stride, head_dim, tid_x_volatile());
        } else {
            k_thr.thr.load(dst, j * BlockN, seqlen_k - j * BlockN, params.k_row_stride);
        }
    };
    auto load_v = [&](int j) {
        T* dst = sV + (j % Stages) * BlockN * HeadDim;
        if constexpr (kLean) {
            attn_detail::load_tile_async<BlockN, HeadDim, kThreads>(
                dst, reinterpret_cast<const T*>(ld_shared_u64_volatile(smem_u32(&s_ptrs[1]))),
                j * BlockN, seqlen_k - j * BlockN, params.v_row_stride, head_dim, tid_x_volatile());
        } else {
            v_thr.thr.load(dst, j * BlockN, seqlen_k - j * BlockN, params.v_row_stride);
        }
    };

    // Prologue. Commit groups are, in order, K_0 (+Q), V_0, K_1, V_1, ...: K_i is group 2i
    // and V_i group 2i+1, so both waits below keep at most 2*Stages-2 groups in flight.
    attn_detail::load_tile_async<BlockM, HeadDim, kThreads>(
        sQ, static_cast<const T*>(params.q) + sc.q_off, m_start, rows_q, params.q_row_stride,
        head_dim, tid);
    load_k(j_first);
    cp_async_commit();
    load_v(j_first);
    cp_async_commit();
#pragma unroll
    for (int s = 1; s < Stages; ++s) {
        if (j_first + s < n_blocks) load_k(j_first + s);
        cp_async_commit();
        if (j_first + s < n_blocks) load_v(j_first + s);
        cp_async_commit();
    }

    float acc_o[MT][DT][4];
    float row_max[MT][2];
    float row_sum[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] = 0.f;
        }
        row_max[mt][0] = row_max[mt][1] = -FERROATTN_INF;
        row_sum[mt][0] = row_sum[mt][1] = 0.f;
        if constexpr (V::kSinks) {
            // The sink joins the softmax as a column of raw score sink_raw and no value: the
            // running max starts there with a running sum of exp(0) = 1 (on one lane per row).
            const float sink = attn_variant::sink_raw(params, head);
            row_max[mt][0] = row_max[mt][1] = sink;
            row_sum[mt][0] = row_sum[mt][1] = (lane % 4 == 0) ? 1.f : 0.f;
        }
    }
    const attn_variant::ScoreMod<V> smod(params, head, batch, seqlen_q, seqlen_k);
    const attn_variant::DropoutMask<V> drop(params, head, batch);
    const float scale_log2 = params.softmax_scale_log2;
    const int warp_row0 = warp * kWarpM;   // first tile row of this warp
    constexpr unsigned kRowBytes = HeadDim * 2;
    // ldmatrix lane addresses (see LdsmCols). The four 8x8 matrices of one ldmatrix.x4 land in
    // four consecutive registers and mma.sync takes its B operand as a consecutive register
    // pair, so each operand's lane pattern is chosen to put the registers one mma needs next to
    // each other (otherwise ptxas inserts two moves per mma).
    // Q (A operand): row lane%16 of a 16-row block, logical chunk 2*step + lane/16 -> a0..a3.
    // K (B operand, 16 keys x 16 dims): key (lane%8) + 8*(lane/16), chunk 2*step + (lane/8)%2
    //   -> b0, b1 of keys 0-7, then b0, b1 of keys 8-15. Exception (kKPaired false): lean
    //   tiles whose rows end in a 4-chunk swizzle group (d = 96) cannot afford K's own six
    //   address registers; K then shares V's pattern (b0 keys 0-7, b0 keys 8-15, b1 keys 0-7,
    //   b1 keys 8-15) and ptxas pairs the registers with moves.
    // V (.trans, 16 keys x 16 dims): key lane%16, chunk 2*step + lane/16 -> b0, b1 of dims
    //   0-7, then b0, b1 of dims 8-15.
    const LdsmCols<kChunks> q_cols(smem_u32(sQ) + (warp_row0 + (lane % 16)) * kRowBytes, lane,
                                   lane / 16);
    constexpr bool kKPaired = !(LdsmCols<kChunks>::kTail && kLean);
    constexpr unsigned kVOffset = Stages * BlockN * kRowBytes;   // sV - sK in bytes
    const LdsmCols<kChunks> v_cols(smem_u32(sV) + (lane % 16) * kRowBytes, lane, lane / 16);
    const LdsmCols<kChunks> k_cols = kKPaired
        ? LdsmCols<kChunks>(smem_u32(sK) + ((lane % 8) + 8 * (lane / 16)) * kRowBytes, lane,
                            (lane / 8) % 2)
        : LdsmCols<kChunks>(smem_u32(sK) + (lane % 16) * kRowBytes, lane, lane / 16);

    for (int j = j_first; j < n_blocks; ++j) {
        const int slot = j % Stages;
        cp_async_wait<2 * Stages - 2>();
        __syncthreads();   // K_j visible; every warp is done with P V_{j-1}
        if (j > j_first) {
            if (j - 1 + Stages < n_blocks) load_v(j - 1 + Stages);
            cp_async_commit();
        }
        const unsigned slot_bytes = static_cast<unsigned>(slot) * (BlockN * kRowBytes);

        // The tile is processed in sub-blocks of kSubN keys, each a full online-softmax step
        // (S, mask, softmax, P V): this bounds the live S registers (see kSubN).
#pragma unroll 1
        for (int sub = 0; sub < BlockN / kSubN; ++sub) {
            const unsigned sub_bytes = slot_bytes + static_cast<unsigned>(sub) * (kSubN * kRowBytes);
            // ---- S = Q K_sub^T ----
            float acc_s[MT][NT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc_s[mt][nt][e] = 0.f;

            // k-steps in groups of 4 (one 8-chunk swizzle group each); the group loop is
            // kept rolled so the scheduler cannot hoist every fragment load at once.
            auto qk_step = [&](int kk, unsigned group_bytes) {
                unsigned qa[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    ldmatrix_x4(qa[mt], q_cols.at(kk, mt * 16 * kRowBytes) + group_bytes);
#pragma unroll
                for (int nn = 0; nn < NT / 2; ++nn) {
                    unsigned kb[4];
                    if constexpr (kKPaired) {
                        ldmatrix_x4(kb, k_cols.at(kk, nn * 16 * kRowBytes) + sub_bytes + group_bytes);
                    } else {   // V's lanes: b0 keys 0-7, b0 keys 8-15, b1 keys 0-7, b1 keys 8-15
                        unsigned r[4];
                        ldmatrix_x4(r, v_cols.at(kk, nn * 16 * kRowBytes) - kVOffset + sub_bytes
                                           + group_bytes);
                        kb[0] = r[0]; kb[1] = r[2]; kb[2] = r[1]; kb[3] = r[3];
                    }
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_m16n8k16<T>(acc_s[mt][2 * nn], qa[mt], kb[0], kb[1]);
                        mma_m16n8k16<T>(acc_s[mt][2 * nn + 1], qa[mt], kb[2], kb[3]);
                    }
                }
            };
            // With one m16 tile per warp (MT == 1) the registers allow the group loop to be
            // unrolled as well (no spills at d = 160..256), letting ptxas overlap the fragment
            // loads of one group with the mma of the previous one.
            constexpr int kGroups = (kChunks & ~7) / 8;
            constexpr bool kUnrollGroups = MT == 1;
            if constexpr (kUnrollGroups) {
#pragma unroll
                for (int grp = 0; grp < kGroups; ++grp) {
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk) qk_step(kk, static_cast<unsigned>(grp) << 7);
                }
            } else {
#pragma unroll 1
                for (int grp = 0; grp < kGroups; ++grp) {
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk) qk_step(kk, static_cast<unsigned>(grp) << 7);
                }
            }
#pragma unroll
            for (int kk = kGroups * 4; kk < KT; ++kk) qk_step(kk, 0u);

            if (sub == 0) {
                cp_async_wait<2 * Stages - 2>();
                __syncthreads();   // V_j visible; without sub-blocks, all warps are done with K_j
                if constexpr (!kSplit) {
                    if (j + Stages < n_blocks) load_k(j + Stages);
                    cp_async_commit();
                }
            }

            const int n_start = j * BlockN + sub * kSubN;
            // ---- score modification (softcap, ALiBi) ----
            if constexpr (V::kSoftcap || V::kAlibi) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int row = m_start + warp_row0 + mt * 16 + g + h * 8;
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                            for (int e = 0; e < 2; ++e)
                                acc_s[mt][nt][2 * h + e] = smod.apply(acc_s[mt][nt][2 * h + e], row,
                                                                      n_start + nt * 8 + 2 * t + e);
                    }
            }
            // ---- mask (key tail, the variant's window) ----
            const bool need_mask = (n_start + kSubN > seqlen_k) ||
                                   !rk.tile_full(m_start, BlockM, n_start, kSubN);
            if (need_mask) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int row = m_start + warp_row0 + mt * 16 + g + h * 8;
                        const int c0 = n_start + 2 * t;
                        const int lim = rk.hi(row) - c0;   // keep key nt*8+e iff in [lo, lim)
                        const int lo = rk.lo(row) - c0;
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                const int c = nt * 8 + e;
                                if (c >= lim || (V::kLocal && c < lo)) acc_s[mt][nt][2 * h + e] = -FERROATTN_INF;
                            }
                    }
            }

            // ---- online softmax (base 2) ----
            float corr[MT][2];
            bool changed = false;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float mx = row_max[mt][h];
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
                        mx = fmaxf(mx, fmaxf(acc_s[mt][nt][2 * h], acc_s[mt][nt][2 * h + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    const float m_scaled = (mx == -FERROATTN_INF) ? 0.f : mx * scale_log2;
                    changed |= mx != row_max[mt][h];
                    corr[mt][h] = exp2_fast(row_max[mt][h] * scale_log2 - m_scaled);
                    row_max[mt][h] = mx;
                    float sum = 0.f;
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const float p = exp2_fast(fmaf(acc_s[mt][nt][2 * h + e], scale_log2,
                                                           -m_scaled));
                            acc_s[mt][nt][2 * h + e] = p;
                            sum += p;
                        }
                    row_sum[mt][h] = row_sum[mt][h] * corr[mt][h] + sum;
                }
            // Rescale O only when some row of this warp raised its max (corr == 1 otherwise;
            // a row still at -inf has O == 0). Warp-uniform branch.
            if (__any_sync(0xffffffffu, changed)) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int dt = 0; dt < DT; ++dt) {
                        acc_o[mt][dt][0] *= corr[mt][0];
                        acc_o[mt][dt][1] *= corr[mt][0];
                        acc_o[mt][dt][2] *= corr[mt][1];
                        acc_o[mt][dt][3] *= corr[mt][1];
                    }
            }

            // ---- dropout: keep P with probability 1 - p (the row sums above, hence the LSE, are
            // of the undropped P); the kept words mask the packed P below and 1 / (1 - p) joins
            // the epilogue's 1 / sum. With s_dmask (testing), the undropped P = exp(s - m_running),
            // negated where dropped, and m_running per 16 keys.
            using Drop = attn_variant::DropoutMask<V>;
            [[maybe_unused]] uint4 keepw[V::kDropout ? MT : 1][V::kDropout ? NT / 4 : 1];
            if constexpr (V::kDropout) {
                static_assert(NT % 4 == 0, "dropout units span 32 keys of a sub-block");
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int q4 = 0; q4 < NT / 4; ++q4)
                        keepw[mt][q4] = drop.frag(m_start + warp_row0 + mt * 16 + g, n_start + q4 * 32, t);
            }
            if constexpr (V::kReturnSoftmax) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int row = m_start + warp_row0 + mt * 16 + g + h * 8;
                        const bool row_ok = row < seqlen_q && row < params.s_dmask_rows;
                        const long long row_off = row_ok
                            ? (static_cast<long long>(batch) * params.num_heads + head) * params.s_dmask_rows + row
                            : 0;
                        if (row_ok && t == 0) {
                            const float m_nat = row_max[mt][h] == -FERROATTN_INF ? -FERROATTN_INF
                                                                                : row_max[mt][h] * params.raw_scale;
#pragma unroll
                            for (int q16 = 0; q16 < kSubN / 16; ++q16) {
                                const int grp = n_start / 16 + q16;
                                if (grp < params.s_dmask_cols / 16)
                                    params.s_dmask_max[row_off * (params.s_dmask_cols / 16) + grp] = m_nat;
                            }
                        }
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt) {
                            const int col = n_start + nt * 8 + 2 * t;
                            const bool k0 = Drop::frag_keep(keepw[mt][nt / 4], h, nt % 4, 0);
                            const bool k1 = Drop::frag_keep(keepw[mt][nt / 4], h, nt % 4, 1);
                            const float p0 = acc_s[mt][nt][2 * h], p1 = acc_s[mt][nt][2 * h + 1];
                            if (row_ok && col + 1 < params.s_dmask_cols) {
                                *reinterpret_cast<unsigned*>(static_cast<T*>(params.s_dmask) + row_off * params.s_dmask_cols
                                                             + col) = Tr::pack2(k0 ? p0 : -p0, k1 ? p1 : -p1);
                            }
                        }
                    }
            }

            // ---- O += P V_sub (P from registers) ----
#pragma unroll
            for (int kk = 0; kk < kSubN / 16; ++kk) {
                unsigned pa[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    pa[mt][0] = Tr::pack2(acc_s[mt][2 * kk][0], acc_s[mt][2 * kk][1]);
                    pa[mt][1] = Tr::pack2(acc_s[mt][2 * kk][2], acc_s[mt][2 * kk][3]);
                    pa[mt][2] = Tr::pack2(acc_s[mt][2 * kk + 1][0], acc_s[mt][2 * kk + 1][1]);
                    pa[mt][3] = Tr::pack2(acc_s[mt][2 * kk + 1][2], acc_s[mt][2 * kk + 1][3]);
                    if constexpr (V::kDropout) {   // n8 tiles 2kk, 2kk + 1: elements nn, nn + 1 of a unit
                        const uint4& w = keepw[mt][(2 * kk) / 4];
                        const int nn = (2 * kk) % 4;
                        pa[mt][0] &= Drop::frag_pair_mask(w, 0, nn);
                        pa[mt][1] &= Drop::frag_pair_mask(w, 1, nn);
                        pa[mt][2] &= Drop::frag_pair_mask(w, 0, nn + 1);
                        pa[mt][3] &= Drop::frag_pair_mask(w, 1, nn + 1);
                    }
                }
#pragma unroll
                for (int dn = 0; dn < HeadDim / 16; ++dn) {
                    unsigned vb[4];
                    ldmatrix_x4_trans(vb, v_cols.at(dn, kk * 16 * kRowBytes) + sub_bytes);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_m16n8k16<T>(acc_o[mt][2 * dn], pa[mt], vb[0], vb[1]);
                        mma_m16n8k16<T>(acc_o[mt][2 * dn + 1], pa[mt], vb[2], vb[3]);
                    }
                }
            }
        }

        if constexpr (kSplit) {
            // K_j is read by every sub-block: only now may K_{j+Stages} overwrite its slot.
            __syncthreads();
            if (j + Stages < n_blocks) load_k(j + Stages);
            cp_async_commit();
        }
    }
    cp_async_wait<0>();   // only empty groups can remain; drain them before exit

    // ---- epilogue: normalise, LSE, stage O in the Q tile, 16-byte stores ----
    // kLean: the output pointers come back from the shared table (see load_k), not registers.
    T* gO;
    float* gLse;
    if constexpr (kLean) {
        gO = reinterpret_cast<T*>(ld_shared_u64_volatile(smem_u32(&s_ptrs[2])));
        gLse = reinterpret_cast<float*>(ld_shared_u64_volatile(smem_u32(&s_ptrs[3])));
    } else {
        gO = static_cast<T*>(params.o) + sc.o_off + static_cast<long long>(m_start) * params.o_row_stride;
        gLse = params.lse + sc.lse_off + m_start;
    }
    const float scale = params.raw_scale;   // LSE = max_raw * raw_scale + log(sum)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float sum = row_sum[mt][h];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const bool empty = !(sum > 0.f);
            // dropout: O = (Z o P) V / sum with Z = keep / (1 - p)
            const float inv = empty ? 0.f : (V::kDropout ? drop.scale : 1.f) / sum;
            const int r = warp_row0 + mt * 16 + g + h * 8;
            if (t == 0 && r < rows_q) {
                gLse[r] = empty ? FERROATTN_INF : row_max[mt][h] * scale + logf(sum);
            }
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                acc_o[mt][dt][2 * h] *= inv;
                acc_o[mt][dt][2 * h + 1] *= inv;
            }
        }
    // Each warp only ever read its own rows of sQ; make sure all its lanes are past them.
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = warp_row0 + mt * 16 + g + h * 8;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                *reinterpret_cast<unsigned*>(sQ + swizzle_offset<HeadDim>(r, dt * 8 + 2 * t)) =
                    Tr::pack2(acc_o[mt][dt][2 * h], acc_o[mt][dt][2 * h + 1]);
            }
        }
    __syncthreads();
    {
        constexpr int kTotal = BlockM * kChunks;
#pragma unroll
        for (int i = 0; i < (kTotal + kThreads - 1) / kThreads; ++i) {
            const int idx = tid + i * kThreads;
            if (kTotal % kThreads == 0 || idx < kTotal) {
                const int r = idx / kChunks;
                const int c = idx % kChunks;
                if (r < rows_q && c * 8 < head_dim) {
                    const uint4 val = *reinterpret_cast<const uint4*>(
                        sQ + r * HeadDim + swizzle_chunk<kChunks>(r, c) * 8);
                    *reinterpret_cast<uint4*>(gO + static_cast<long long>(r) * params.o_row_stride
                                              + c * 8) = val;
                }
            }
        }
    }
}

}  // namespace ferroattn
