// ferroattn — attention backward: the key block of the dK/dV kernels and its I/O.
//
// What: what attn_bwd_dkdv_sm80 (attention/bwd_dkdv_sm80.cuh, "warps own keys") and its
// single-pass wide specialisation (attention/bwd_dkdv_wide_sm80.cuh) share, so that each fact
// lives once: which sequence, key tile and query tiles a block works on (dkdv_block), where its
// dK / dV rows go and the zero store of a key tile no query sees (store_key_grad,
// store_dkdv_zero), the K / V tile loads (load_kv_tiles), the load of one pipeline iteration's
// Q, dO, LSE and D (load_query_tile) and the cp.async group discipline of the query pipeline
// (query_pipe_prologue). The kernels differ only in their warp partition and shared-memory map
// (passed in as DkdvSmemMap). Their machine code is the one they had before this header (SASS
// byte-identical); the forms below that look odd keep it so.
// Iteration it of a block: query head head_k*group + it / per_head, query tile
// m_first + it % per_head (GQA heads of the kv head in a fixed order, no atomics for dK/dV).
// The query tiles are those holding a row that sees a key of the block, by the variant's rule
// (attention/variant.cuh RowKeys): all without a mask; causal (bottom-right: query i sees key j
// iff j <= i + diag, diag = seqlen_k - seqlen_q) starts at the tile holding row
// max(0, n0 - diag); a local window also ends after the last row whose window reaches the block.
// Layouts: attention/bwd_params.cuh, attention/params.cuh (padded: batch stride; varlen: the
// sequence's first row, cu_seqlens clamped as in the forward). Offsets in elements, 64-bit.
// Constraints: T is __half or __nv_bfloat16; shared-memory tiles are XOR-swizzled in 16-byte
// chunks (common/swizzle.cuh).
// PTX features: cp.async.cg (16 B) and cp.async.ca (4 B) with src-size zero fill,
// commit/wait_group.
#pragma once
#include "common/dtype.cuh"
#include "common/ptx.cuh"
#include "common/swizzle.cuh"
#include "attention/bwd_params.cuh"
#include "attention/fwd_sm80.cuh"
#include "attention/variant.cuh"

namespace ferroattn {
namespace attn_bwd_detail {

// Where batch `batch` lives: its sequence lengths and, for varlen, its first query and key
// rows. cu_seqlens values are clamped exactly as attn_detail::seq_coords does for the forward
// (a sequence is [x0, x1) within [0, total), at most max_seqlen_q query rows), so no value can
// move an access outside the tensors.
struct BwdSeq {
    int seqlen_q, seqlen_k;
    int q_row0, k_row0;   // varlen only
    bool varlen;
};

__device__ __forceinline__ BwdSeq bwd_seq(const AttnFwdParams& p, int batch) {
    BwdSeq s;
    s.varlen = p.cu_seqlens_q != nullptr;
    if (s.varlen) {
        const int q0 = min(max(p.cu_seqlens_q[batch], 0), p.total_q);
        const int q1 = min(max(p.cu_seqlens_q[batch + 1], q0), p.total_q);
        const int k0 = min(max(p.cu_seqlens_k[batch], 0), p.total_k);
        const int k1 = min(max(p.cu_seqlens_k[batch + 1], k0), p.total_k);
        s.seqlen_q = min(q1 - q0, p.seqlen_q);
        s.seqlen_k = k1 - k0;
        s.q_row0 = q0;
        s.k_row0 = k0;
    } else {
        s.seqlen_q = p.seqlen_q;
        s.seqlen_k = p.seqlen_k;
        s.q_row0 = s.k_row0 = 0;
    }
    return s;
}

// Element offset of row 0 of the (batch, head) slice of a tensor with the given strides: the
// batch stride in the padded layout, the sequence's first row in varlen. QSide: the tensor
// runs along the queries (q, dout, dq_accum, lse, softmax_d), else along the keys.
template <bool QSide>
__device__ __forceinline__ long long slice_off(const BwdSeq& s, int batch, int head,
                                               long long batch_stride, long long row_stride,
                                               long long head_stride) {
    const long long first = s.varlen
        ? static_cast<long long>(QSide ? s.q_row0 : s.k_row0) * row_stride
        : static_cast<long long>(batch) * batch_stride;
    return first + static_cast<long long>(head) * head_stride;
}

// 4-byte global->shared async copy (L1-allocating .ca: the only form below 16 bytes); when
// !pred, writes 4 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async_4_zfill(unsigned smem_addr, const void* src, bool pred) {
    const int src_size = pred ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"(smem_addr), "l"(src), "r"(src_size) : "memory");
}

// Writes rows [0, rows_valid) x columns [0, head_dim) of a Rows x HeadDim tile to global memory
// (row 0 at g, row stride `row_stride` elements) in 16-byte stores: from the swizzled shared
// tile s, or zeros when s is nullptr.
template <int Rows, int HeadDim, int Threads, typename T>
__device__ __forceinline__ void store_tile(T* g, long long row_stride, const T* s, int rows_valid,
                                           int head_dim, int tid) {
    constexpr int kChunks = HeadDim / 8;
    constexpr int kTotal = Rows * kChunks;
#pragma unroll
    for (int i = 0; i < (kTotal + Threads - 1) / Threads; ++i) {
        const int idx = tid + i * Threads;
        if (kTotal % Threads == 0 || idx < kTotal) {
            const int r = idx / kChunks;
            const int c = idx % kChunks;
            if (r < rows_valid && c * 8 < head_dim) {
                const uint4 val = s != nullptr
                    ? *reinterpret_cast<const uint4*>(s + r * HeadDim + swizzle_chunk<kChunks>(r, c) * 8)
                    : make_uint4(0u, 0u, 0u, 0u);
                *reinterpret_cast<uint4*>(g + static_cast<long long>(r) * row_stride + c * 8) = val;
            }
        }
    }
}

// One block of a dK/dV kernel: keys [n0, n0 + rows_k) of kv head head_k of batch `batch`, and
// the query tiles that see them: [m_first, m_tiles) of every query head of the GQA group,
// n_iter = per_head * group pipeline iterations (0: no query sees these keys).
struct DkdvBlock {
    BwdSeq sq;
    int head_k, batch;
    int seqlen_q, seqlen_k;
    int n0, rows_k;
    int head_dim;   // the real head dim (params.fwd.head_dim <= HeadDim)
    int group;      // query heads per kv head
    int diag;       // seqlen_k - seqlen_q (bottom-right alignment)
    int m_first;    // first query tile that sees the key tile
    int per_head;   // query tiles per query head
    int n_iter;
};

// Fills b for this block (grid (ceil(max_seqlen_k / BlockN), num_heads_k, batch)); false when
// the key tile starts past seqlen_k (the block has nothing to do; b is then partly set).
template <int BlockM, int BlockN, class V>
__device__ __forceinline__ bool dkdv_block(const AttnFwdParams& fp, DkdvBlock& b) {
    b.head_k = blockIdx.y;
    b.batch = blockIdx.z;
    b.sq = bwd_seq(fp, b.batch);
    b.seqlen_q = b.sq.seqlen_q;
    b.seqlen_k = b.sq.seqlen_k;
    b.n0 = blockIdx.x * BlockN;
    if (b.n0 >= b.seqlen_k) return false;
    b.rows_k = min(BlockN, b.seqlen_k - b.n0);
    b.head_dim = fp.head_dim;
    b.group = fp.num_heads / fp.num_heads_k;
    b.diag = b.seqlen_k - b.seqlen_q;
    int m_tiles = (b.seqlen_q + BlockM - 1) / BlockM;
    b.m_first = 0;
    if constexpr (V::kMasked) {
        // Rows that see a key of [n0, n0 + rows_k): [first_row(n0), last_row_plus1(last key)).
        const attn_variant::RowKeys<V> rk(fp, b.seqlen_q, b.seqlen_k);
        b.m_first = static_cast<int>(min(static_cast<long long>(m_tiles),
                                         max(0LL, rk.first_row(b.n0)) / BlockM));
        if constexpr (V::kLocal) {
            const long long r1 = rk.last_row_plus1(b.n0 + b.rows_k - 1, b.seqlen_q);
            m_tiles = r1 <= 0 ? 0 : static_cast<int>((r1 + BlockM - 1) / BlockM);
        }
    }
    b.per_head = V::kLocal ? max(0, m_tiles - b.m_first) : m_tiles - b.m_first;
    b.n_iter = b.per_head * b.group;
    return true;
}

// dK (dV) rows [n0, n0 + rows_k) of the block's kv head, columns [0, head_dim), from the
// swizzled BlockN x HeadDim shared tile s, or zeros when s is nullptr. The 64-bit row pointer is
// computed here, where it is written, so that none stays live through the main loop.
// The form is deliberate: the tensor base and strides by reference, the pointer built in a
// lambda over local copies of the block's fields, as in the kernels' former dk_ptr / dv_ptr
// lambdas. Passing the values, or capturing the block, lets the compiler turn the padded/varlen
// choice of slice_off into a select and changes the SASS of the kernels.
template <int BlockN, int HeadDim, int Threads, typename T>
__device__ __forceinline__ void store_key_grad(void* __restrict__ const& dst, const long long& batch_stride,
                                               const long long& row_stride, const long long& head_stride,
                                               const DkdvBlock& b, const T* s, int tid) {
    const BwdSeq& sq = b.sq;
    const int batch = b.batch, head_k = b.head_k, n0 = b.n0;
    auto rows_ptr = [&]() {
        return static_cast<T*>(dst) + slice_off<false>(sq, batch, head_k, batch_stride, row_stride, head_stride)
            + static_cast<long long>(n0) * row_stride;
    };
    store_tile<BlockN, HeadDim, Threads>(rows_ptr(), row_stride, s, b.rows_k, b.head_dim, tid);
}

template <int BlockN, int HeadDim, int Threads, typename T>
__device__ __forceinline__ void store_dk(const AttnBwdParams& params, const DkdvBlock& b, const T* s,
                                         int tid) {
    store_key_grad<BlockN, HeadDim, Threads>(params.dk, params.dk_batch_stride, params.dk_row_stride,
                                             params.dk_head_stride, b, s, tid);
}

template <int BlockN, int HeadDim, int Threads, typename T>
__device__ __forceinline__ void store_dv(const AttnBwdParams& params, const DkdvBlock& b, const T* s,
                                         int tid) {
    store_key_grad<BlockN, HeadDim, Threads>(params.dv, params.dv_batch_stride, params.dv_row_stride,
                                             params.dv_head_stride, b, s, tid);
}

// No query sees these keys (n_iter == 0: causal, or seqlen_q == 0): dK = dV = 0.
template <int BlockN, int HeadDim, int Threads, bool WithDK, bool WithDV, typename T>
__device__ __forceinline__ void store_dkdv_zero(const AttnBwdParams& params, const DkdvBlock& b, int tid) {
    if constexpr (WithDK) store_dk<BlockN, HeadDim, Threads>(params, b, static_cast<const T*>(nullptr), tid);
    if constexpr (WithDV) store_dv<BlockN, HeadDim, Threads>(params, b, static_cast<const T*>(nullptr), tid);
}

// The block's K and V tiles (BlockN x HeadDim each, rows past rows_k and columns past head_dim
// zero-filled) into sK, sV (cp.async, not committed).
template <int BlockN, int HeadDim, int Threads, typename T>
__device__ __forceinline__ void load_kv_tiles(const AttnFwdParams& fp, const DkdvBlock& b, T* sK, T* sV,
                                              int tid) {
    const T* gK = static_cast<const T*>(fp.k)
        + slice_off<false>(b.sq, b.batch, b.head_k, fp.k_batch_stride, fp.k_row_stride, fp.k_head_stride);
    const T* gV = static_cast<const T*>(fp.v)
        + slice_off<false>(b.sq, b.batch, b.head_k, fp.v_batch_stride, fp.v_row_stride, fp.v_head_stride);
    attn_detail::load_tile_async<BlockN, HeadDim, Threads>(sK, gK, b.n0, b.rows_k, fp.k_row_stride,
                                                           b.head_dim, tid);
    attn_detail::load_tile_async<BlockN, HeadDim, Threads>(sV, gV, b.n0, b.rows_k, fp.v_row_stride,
                                                           b.head_dim, tid);
}

// Byte offsets (from the start of the dynamic shared buffer) of the query pipeline's Stages
// slots: Q and dO (BlockM x HeadDim, 16-bit, slot s at +s*BlockM*HeadDim*2), LSE and D (BlockM
// fp32, slot s at +s*BlockM*4).
struct DkdvSmemMap {
    unsigned q, dout, lse, d;
};

// Iteration it's query tile into slot it % Stages (cp.async, not committed): Q and dO rows
// (zero-filled past seqlen_q and head_dim), LSE rows and, WithD, D (softmax_d) rows (4-byte
// copies, zero-filled past seqlen_q; one per thread of the first BlockM (x2) threads, looped
// when there are fewer threads).
template <int BlockM, int HeadDim, int Threads, int Stages, bool WithD, typename T>
__device__ __forceinline__ void load_query_tile(const AttnBwdParams& params, const DkdvBlock& b, int it,
                                                DkdvSmemMap m, unsigned char* smem_raw, unsigned smem0,
                                                int tid) {
    constexpr unsigned kTileQ = BlockM * HeadDim * 2;
    const AttnFwdParams& fp = params.fwd;
    const int slot = Stages == 1 ? 0 : it % Stages;
    const int hq = b.head_k * b.group + it / b.per_head;
    const int m_start = (b.m_first + it % b.per_head) * BlockM;
    const int rows_q = b.seqlen_q - m_start;
    const T* gQ = static_cast<const T*>(fp.q)
        + slice_off<true>(b.sq, b.batch, hq, fp.q_batch_stride, fp.q_row_stride, fp.q_head_stride);
    const T* gdO = static_cast<const T*>(params.dout)
        + slice_off<true>(b.sq, b.batch, hq, params.do_batch_stride, params.do_row_stride,
                          params.do_head_stride);
    T* dstQ = reinterpret_cast<T*>(smem_raw + m.q + slot * kTileQ);
    T* dstdO = reinterpret_cast<T*>(smem_raw + m.dout + slot * kTileQ);
    attn_detail::load_tile_async<BlockM, HeadDim, Threads>(dstQ, gQ, m_start, rows_q,
                                                           fp.q_row_stride, b.head_dim, tid);
    attn_detail::load_tile_async<BlockM, HeadDim, Threads>(dstdO, gdO, m_start, rows_q,
                                                           params.do_row_stride, b.head_dim, tid);
    const long long l_off =
        slice_off<true>(b.sq, b.batch, hq, fp.lse_batch_stride, 1, fp.lse_head_stride) + m_start;
    constexpr int kRowsLD = WithD ? 2 * BlockM : BlockM;   // LSE rows, then D rows
#pragma unroll
    for (int i0 = 0; i0 < kRowsLD; i0 += Threads) {
        const int i = i0 + tid;
        if (kRowsLD % Threads == 0 || i < kRowsLD) {
            const bool is_d = i >= BlockM;
            const int r = is_d ? i - BlockM : i;
            const float* src = (is_d ? params.softmax_d : fp.lse) + l_off + r;
            const unsigned dst = smem0 + (is_d ? m.d : m.lse) + (slot * BlockM + r) * 4;
            cp_async_4_zfill(dst, src, r < rows_q);
        }
    }
}

// Pipeline prologue after load_kv_tiles: Stages >= 2 commits K, V with query tile 0 (group 0),
// then one group per tile 1 .. Stages-2 (empty past n_iter); Stages == 1 commits K, V alone.
template <int Stages, typename LoadIter>
__device__ __forceinline__ void query_pipe_prologue(const LoadIter& load_iter, int n_iter) {
    if constexpr (Stages >= 2) {
        load_iter(0);
        cp_async_commit();   // group 0: K, V and query tile 0
#pragma unroll
        for (int s = 1; s < Stages - 1; ++s) {
            if (s < n_iter) load_iter(s);
            cp_async_commit();
        }
    } else {
        cp_async_commit();   // group 0: K, V
    }
}

}  // namespace attn_bwd_detail
}  // namespace ferroattn
