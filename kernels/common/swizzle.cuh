// ferroattn — shared-memory swizzle for row-major tiles of 16-bit elements.
//
// What: a tile of Rows x Cols elements (Cols = HeadDim, a multiple of 32) is stored as rows of
// Cols/8 16-byte chunks with no padding; chunk c of row r lives at chunk position
// swizzle_chunk<Chunks>(r, c) of that row. Chunks are XOR-permuted inside aligned groups of
// 8 (by r % 8); when Chunks % 8 == 4 the last group of 4 is permuted by (r / 2) % 4. Any 8
// consecutive rows read at one logical chunk (an ldmatrix phase), and any 8 consecutive
// chunks of a row-major walk (a cp.async phase), hit 8 distinct 16-byte bank groups.
// Constraints: Chunks % 4 == 0. The permutation stays inside its row.
// PTX features: none.
#pragma once

namespace ferroattn {

template <int Chunks>
__device__ __forceinline__ int swizzle_chunk(int row, int chunk) {
    static_assert(Chunks % 4 == 0, "row must hold a multiple of 4 chunks of 16 bytes");
    constexpr int kFull = Chunks & ~7;   // chunks in complete groups of 8
    if constexpr (kFull == Chunks) {
        return chunk ^ (row & 7);
    } else {
        return chunk < kFull ? (chunk ^ (row & 7)) : (chunk ^ ((row >> 1) & 3));
    }
}

// Element offset (in 16-bit elements) of (row, col) in a swizzled tile; col % 8 is kept.
template <int Cols>
__device__ __forceinline__ int swizzle_offset(int row, int col) {
    return row * Cols + (swizzle_chunk<Cols / 8>(row, col >> 3) << 3) + (col & 7);
}

}  // namespace ferroattn

namespace ferroattn {

// Per-lane byte addresses for ldmatrix reads of a swizzled tile whose rows hold Chunks 16-byte
// chunks, for the access pattern every mma operand here uses: the lane's row r satisfies
// r % 8 == lane % 8, and at step i (a compile-time constant after unrolling) the lane reads
// logical chunk 2*i + b, b in {0, 1} fixed per lane. Precomputing the 4 (+2 for a tail group
// of 4 chunks) possible in-group XOR results keeps the address of every step an immediate
// offset from one of at most 6 registers, instead of one register per unrolled step.
template <int Chunks>
struct LdsmCols {
    static constexpr int kFull = Chunks & ~7;
    static constexpr bool kTail = kFull != Chunks;
    unsigned main[4];
    unsigned tail[2];

    // base: shared address of (row r, chunk 0) of this lane's row.
    __device__ __forceinline__ LdsmCols(unsigned base, int lane, int b) {
        const int x = b ^ (lane & 7);
#pragma unroll
        for (int k = 0; k < 4; ++k) main[k] = base + (((2 * k) ^ x) << 4);
        const int y = b ^ ((lane >> 1) & 3);
#pragma unroll
        for (int k = 0; k < 2; ++k) tail[k] = base + ((kFull + ((2 * k) ^ y)) << 4);
    }
    // Byte address of step i (logical chunk 2*i + b), plus a compile-time byte offset.
    __device__ __forceinline__ unsigned at(int i, unsigned extra) const {
        if (!kTail || 2 * i < kFull) return main[i & 3] + ((i >> 2) << 7) + extra;
        return tail[(2 * i - kFull) >> 1] + extra;
    }
};

}  // namespace ferroattn
