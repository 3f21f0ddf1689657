// ferroattn — parameter structs of the 2:4 sparse kernels (mirrored #[repr(C)] in
// src/ops/sparse24/mod.rs; change both together).
//
// Sparse24MatmulParams: out (rows, n) = act(x (rows, k) @ w.T + bias), w (n, k) compressed into
//   values (m_pad, k_pad / 2) and meta (m_pad / 16, k_pad) int16 (layout: src/ops/sparse24/host.rs).
//   Strides in elements; x and out have stride 1 along their last dim.
// Sparse24CompressParams: compress w (m, k) -> values, meta, bad_groups; or decompress
//   values, meta -> dense (m, k). `dense` is w or out.
#pragma once

namespace ferroattn {

struct Sparse24MatmulParams {
    const void* x;
    const void* values;
    const unsigned* meta;
    const void* bias;       // nullptr, or (n,) of T (bias_kind 1) or float (bias_kind 2)
    void* out;
    long long x_row_stride;
    long long out_row_stride;
    int rows;
    int n;
    int k;
    int k_pad;
    int bias_kind;
    int vec_out;            // 1: out's data pointer and row stride are 16-byte aligned and n % 8 == 0
    int row_tiles;          // ceil(rows / BlockR)
    int n_tiles;            // m_pad / BlockN
};

struct Sparse24CompressParams {
    void* dense;            // compress: w (read); decompress: out (written)
    void* values;
    unsigned* meta;
    int* bad_groups;        // compress only: atomically incremented (zeroed by the host before)
    long long dense_row_stride;
    int m;
    int k;
    int m_pad;
    int k_pad;
    int prune;
};

}  // namespace ferroattn
