// ferroattn — 2:4 compress / decompress kernels.
//
// What: sparse24_compress<T> turns a dense w (m, k) into the compressed form the sparse matmul
// reads (values (m_pad, k_pad / 2) of T, meta (m_pad / 16, k_pad) int16 = 32-bit words), and
// counts the groups of 4 with more than 2 non-zeros into *bad_groups; sparse24_decompress<T>
// inverts it into a dense (m, k). The layout and the selection rules (which two elements a group
// keeps, prune or not) are documented in src/ops/sparse24/host.rs, the CPU reference these
// kernels must match bit for bit.
// Work split: one thread per metadata word = rows g and g + 8 of a 16-row tile × 16 columns
// (4 groups): word index i = (tile * (k_pad / 64) + unit) * 32 + lane, lane = 4g + 2*step + half,
// columns 64*unit + 32*step + 16*half .. +15.
// Constraints: T is __half or __nv_bfloat16; w / out have stride 1 along k (any row stride,
// any alignment: elements move one at a time); values / meta are contiguous; every index is
// bounds-checked against m, k (w, out) or m_pad, k_pad (values, meta), and metadata indices are
// 2-bit fields, so no meta bit pattern leaves its group.
// PTX features: none beyond sm_80 integer/atomic instructions.
#pragma once
#include "common/dtype.cuh"
#include "sparse24/params.cuh"

namespace ferroattn {

namespace sparse24_detail {

// The prune rule's magnitude key: the bits without the sign, as an integer (for fp16 and bf16
// the integer order of non-negative bit patterns is the numeric order); every NaN maps to
// +inf + 1, so NaN beats +inf and two NaNs tie.
template <typename T>
__device__ __forceinline__ int prune_key(unsigned short bits) {
    const int inf = DTypeTraits<T>::kIsBF16 ? 0x7f80 : 0x7c00;
    const int m = bits & 0x7fff;
    return m > inf ? inf + 1 : m;
}

// Kept positions (i0 < i1) of one group; adds 1 to *bad when it has more than 2 non-zeros.
template <typename T>
__device__ __forceinline__ void select_group(const unsigned short (&x)[4], bool prune, int& i0, int& i1,
                                             int& bad) {
    int nonzero = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) nonzero += (x[i] & 0x7fffu) != 0;
    bad += nonzero > 2;
    // rank: the best position gets the smallest key; ties keep the lower index (strict <)
    int a = -1, b = -1;
    if (prune) {
        int ka = -1, kb = -1;  // the two largest keys so far, ka >= kb
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int m = prune_key<T>(x[i]);
            if (m > ka) {
                b = a; kb = ka; a = i; ka = m;
            } else if (m > kb) {
                b = i; kb = m;
            }
        }
    } else {
        // class 0 non-zero, 1 -0.0, 2 +0.0; first two by (class, index)
        int ca = 3, cb = 3;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int c = (x[i] & 0x7fffu) != 0 ? 0 : (x[i] != 0 ? 1 : 2);
            if (c < ca) {
                b = a; cb = ca; a = i; ca = c;
            } else if (c < cb) {
                b = i; cb = c;
            }
        }
    }
    i0 = a < b ? a : b;
    i1 = a < b ? b : a;
}

}  // namespace sparse24_detail

template <typename T>
__global__ void __launch_bounds__(256) sparse24_compress(const Sparse24CompressParams p) {
    const long long word = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int units = p.k_pad / 64;
    const long long words = static_cast<long long>(p.m_pad / 16) * units * 32;
    int bad = 0;
    if (word < words) {
        const int lane = static_cast<int>(word & 31);
        const long long tu = word >> 5;
        const int tile = static_cast<int>(tu / units);
        const int unit = static_cast<int>(tu - static_cast<long long>(tile) * units);
        const int g = lane >> 2, step = (lane >> 1) & 1, half = lane & 1;
        const int col0 = unit * 64 + step * 32 + half * 16;
        const unsigned short* w = static_cast<const unsigned short*>(p.dense);
        unsigned short* values = static_cast<unsigned short*>(p.values);
        unsigned meta_word = 0;
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
            const int row = tile * 16 + g + 8 * hi;
            unsigned short kept[8];
            unsigned bits16 = 0;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                unsigned short x[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int c = col0 + 4 * j + i;
                    x[i] = (row < p.m && c < p.k) ? w[static_cast<long long>(row) * p.dense_row_stride + c] : 0;
                }
                int i0, i1;
                sparse24_detail::select_group<T>(x, p.prune != 0, i0, i1, bad);
                kept[2 * j] = x[i0];
                kept[2 * j + 1] = x[i1];
                bits16 |= static_cast<unsigned>(i0 | (i1 << 2)) << (4 * j);
            }
            meta_word |= bits16 << (16 * hi);
            // 8 kept values = 16 bytes at values[row][col0 / 2 ..]: aligned (k_pad / 2 and col0 / 2
            // are multiples of 8)
            uint4 v;
            v.x = kept[0] | (static_cast<unsigned>(kept[1]) << 16);
            v.y = kept[2] | (static_cast<unsigned>(kept[3]) << 16);
            v.z = kept[4] | (static_cast<unsigned>(kept[5]) << 16);
            v.w = kept[6] | (static_cast<unsigned>(kept[7]) << 16);
            *reinterpret_cast<uint4*>(values + static_cast<long long>(row) * (p.k_pad / 2) + col0 / 2) = v;
        }
        p.meta[word] = meta_word;
    }
    // block-wide count, one atomic per block
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) bad += __shfl_xor_sync(0xffffffffu, bad, o);
    __shared__ int block_bad;
    if (threadIdx.x == 0) block_bad = 0;
    __syncthreads();
    if ((threadIdx.x & 31) == 0 && bad != 0) atomicAdd(&block_bad, bad);
    __syncthreads();
    if (threadIdx.x == 0 && block_bad != 0) atomicAdd(p.bad_groups, block_bad);
}

template <typename T>
__global__ void __launch_bounds__(256) sparse24_decompress(const Sparse24CompressParams p) {
    const long long word = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int units = p.k_pad / 64;
    const long long words = static_cast<long long>(p.m_pad / 16) * units * 32;
    if (word >= words) return;
    const int lane = static_cast<int>(word & 31);
    const long long tu = word >> 5;
    const int tile = static_cast<int>(tu / units);
    const int unit = static_cast<int>(tu - static_cast<long long>(tile) * units);
    const int g = lane >> 2, step = (lane >> 1) & 1, half = lane & 1;
    const int col0 = unit * 64 + step * 32 + half * 16;
    if (col0 >= p.k) return;
    const unsigned meta_word = p.meta[word];
    const unsigned short* values = static_cast<const unsigned short*>(p.values);
    unsigned short* out = static_cast<unsigned short*>(p.dense);
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
        const int row = tile * 16 + g + 8 * hi;
        if (row >= p.m) continue;
        const uint4 v = *reinterpret_cast<const uint4*>(values + static_cast<long long>(row) * (p.k_pad / 2) + col0 / 2);
        const unsigned vv[4] = {v.x, v.y, v.z, v.w};
        const unsigned bits16 = meta_word >> (16 * hi);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const unsigned code = (bits16 >> (4 * j)) & 0xfu;
            unsigned short x[4] = {0, 0, 0, 0};
            x[code & 3u] = static_cast<unsigned short>(vv[j] & 0xffffu);
            x[code >> 2] = static_cast<unsigned short>(vv[j] >> 16);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int c = col0 + 4 * j + i;
                if (c < p.k) out[static_cast<long long>(row) * p.dense_row_stride + c] = x[i];
            }
        }
    }
}

}  // namespace ferroattn
