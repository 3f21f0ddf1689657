//! 2:4 structured sparsity: the compressed layout, and the CPU reference of compress and
//! decompress (the oracle of the GPU kernels in kernels/sparse24/compress.cuh, which must
//! agree with these functions bit for bit).
//!
//! # The 2:4 rule
//! A matrix w (m, k) is 2:4 when every aligned group of 4 consecutive elements of a row
//! (columns 4j..4j+3) holds at most 2 non-zeros. "Non-zero" is numeric: +0.0 and -0.0 are
//! zeros, every other bit pattern (NaN included) is a non-zero.
//!
//! # Which two elements a group keeps
//! Every group keeps exactly two positions i0 < i1 (the hardware reads two indices per group
//! and rejects i0 == i1); their elements are stored bit for bit.
//! - `prune = false` (compress): positions ranked by (class, index), class 0 = non-zero,
//!   1 = -0.0, 2 = +0.0; the first two are kept. On a 2:4 group this keeps every non-zero,
//!   so decompress gives back the group bit for bit (a dropped element is a +0.0, or a -0.0
//!   of a group that has two other elements to keep). A group with more than 2 non-zeros
//!   (counted in `bad_groups`) keeps its first two non-zeros.
//! - `prune = true`: the two largest magnitudes |x| (NaN counts as larger than any number;
//!   ties: the lower index).
//!
//! # Compressed layout (what sparse24_layout reports)
//! Padded sizes: m_pad = m rounded up to [`TILE_M`] (128: the largest row tile of the
//! kernels, so they load w tiles without bounds checks), k_pad = k rounded up to [`TILE_K`]
//! (64: one metadata unit). Padding is zero; a padding group keeps positions (0, 1).
//!
//! `values` (m_pad, k_pad / 2), w's dtype, row-major: row r holds, group after group, the two
//! kept elements of each group of w's row r in index order (column 2j + s = slot s of group j).
//! This is exactly the A operand of `mma.sp` m16n8k32 in compressed form: a 16 × 16 tile of
//! `values` (16 rows, the 8 groups of 32 logical columns) is loaded like the A tile of a dense
//! m16n8k16 (PTX ISA, "Matrix fragments for sparse mma.m16n8k32 with .f16 and .bf16 types").
//!
//! `meta` (m_pad / 16, k_pad) int16 = 32-bit words, ordered so that one warp loads the
//! metadata of a 16-row × 64-column unit with one coalesced 128-byte read and each lane gets
//! exactly the register `mma.sp` wants, with no shuffling:
//! - meta row R covers w rows 16R..16R+15; inside it, unit u (w columns 64u..64u+63) is the
//!   64 int16 at columns 64u..64u+63, read as 32 little-endian 32-bit words, word l for lane l;
//! - lane l = 4g + t (g = l / 4, t = l % 4) holds the k32 step s = t / 2 (w columns
//!   64u + 32s .. +31) and its half h = t % 2 (16 columns 64u + 32s + 16h .. +15): bits 0..15
//!   describe w row 16R + g, bits 16..31 row 16R + g + 8;
//! - in each 16-bit half, nibble j (bits 4j..4j+3) describes group j of those 16 columns:
//!   bits 4j..4j+1 = i0, bits 4j+2..4j+3 = i1 (i0 < i1, ascending as `mma.sp::ordered_metadata`
//!   requires).
//!
//! Why: for mma.sp m16n8k32 with 16-bit types the sparsity selector picks which pair of
//! threads of each quad supplies metadata (PTX ISA, "Sparse matrix storage" and the m16n8k32
//! metadata figure): selector 0 threads 4g, 4g+1 (first / second 16 columns, rows g and g+8 in
//! the low / high 16 bits), selector 1 threads 4g+2, 4g+3. Step 0 of a 64-column unit runs with
//! selector 0 and step 1 with selector 1, so the same per-lane word feeds both.
//!
//! Malformed metadata: decompress writes slot 0 at i0 then slot 1 at i1 (i0 == i1: slot 1
//! wins); the indices are 2-bit fields, so they stay inside their group whatever the bits.

use half::{bf16, f16};

/// Rows of w are padded to a multiple of this (the largest row tile of the kernels; the tile
/// heuristics own it).
pub use crate::tuning::sparse24::TILE_M;
/// Columns of w are padded to a multiple of this (one metadata unit: two k32 steps).
pub const TILE_K: usize = 64;

/// The shapes compress writes for a (m, k) matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub m: usize,
    pub k: usize,
    pub m_pad: usize,
    pub k_pad: usize,
}

impl Layout {
    pub fn new(m: usize, k: usize) -> Layout {
        Layout {
            m,
            k,
            m_pad: m.div_ceil(TILE_M) * TILE_M,
            k_pad: k.div_ceil(TILE_K) * TILE_K,
        }
    }
    /// (m_pad, k_pad / 2): the kept elements, w's dtype.
    pub fn values_shape(&self) -> [usize; 2] {
        [self.m_pad, self.k_pad / 2]
    }
    /// (m_pad / 16, k_pad): the metadata, int16.
    pub fn meta_shape(&self) -> [usize; 2] {
        [self.m_pad / 16, self.k_pad]
    }
    /// Groups of 4 in the unpadded matrix.
    pub fn groups(&self) -> usize {
        self.m * self.k.div_ceil(4)
    }
}

/// Where the metadata of (row, group) lives: (index of the int16 in the contiguous meta
/// tensor, nibble 0..3 inside it).
pub fn meta_position(layout: &Layout, row: usize, group: usize) -> (usize, u32) {
    let (tile, g16) = (row / 16, row % 16);
    let (g, high) = (g16 % 8, g16 / 8); // rows g and g + 8 share a word
    let col = group * 4;
    let (unit, in_unit) = (col / 64, col % 64);
    let (step, in_step) = (in_unit / 32, in_unit % 32);
    let (half, in_half) = (in_step / 16, in_step % 16);
    let lane = 4 * g + 2 * step + half;
    let word = tile * (layout.k_pad / 2) + unit * 32 + lane;
    (2 * word + high, (in_half / 4) as u32)
}

/// The 16-bit element types.
pub trait Elem: Copy {
    /// The bits of +inf.
    const INF_BITS: u16;
    /// The prune rule's magnitude key: the bits without the sign (for fp16 and bf16 the
    /// integer order of non-negative bit patterns is the numeric order); every NaN maps to
    /// +inf + 1 (NaN beats +inf; two NaNs tie). kernels/sparse24/compress.cuh uses the same key.
    fn prune_key(bits: u16) -> u16 {
        let m = bits & 0x7fff;
        if m > Self::INF_BITS {
            Self::INF_BITS + 1
        } else {
            m
        }
    }
}
impl Elem for f16 {
    const INF_BITS: u16 = 0x7c00;
}
impl Elem for bf16 {
    const INF_BITS: u16 = 0x7f80;
}

fn is_nonzero(bits: u16) -> bool {
    bits & 0x7fff != 0
}

/// The kept positions (i0 < i1) of one group of 4 (`x` padded with +0.0) and whether it has
/// more than 2 non-zeros.
pub fn select<E: Elem>(x: [u16; 4], prune: bool) -> ((usize, usize), bool) {
    let bad = x.iter().filter(|&&b| is_nonzero(b)).count() > 2;
    let mut order = [0usize, 1, 2, 3];
    if prune {
        // descending key; the sort is stable: ties keep the lower index first
        order.sort_by_key(|&i| std::cmp::Reverse(E::prune_key(x[i])));
    } else {
        let class = |i: usize| {
            if is_nonzero(x[i]) {
                0
            } else if x[i] != 0 {
                1
            } else {
                2
            }
        };
        order.sort_by_key(|&i| class(i)); // stable: index order inside a class
    }
    let (a, b) = (order[0], order[1]);
    ((a.min(b), a.max(b)), bad)
}

/// A row-major (rows, cols) matrix of 16-bit elements with a row stride (elements).
pub struct Matrix<'a> {
    pub data: &'a [u16],
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
}

/// Compress `w` into `values` / `meta` (contiguous, shapes of `Layout::new(w.rows, w.cols)`,
/// meta as its int16 elements). Returns the number of groups with more than 2 non-zeros.
pub fn compress<E: Elem>(w: &Matrix, values: &mut [u16], meta: &mut [u16], prune: bool) -> usize {
    let l = Layout::new(w.rows, w.cols);
    assert_eq!(values.len(), l.m_pad * l.k_pad / 2, "values length");
    assert_eq!(meta.len(), l.m_pad * l.k_pad / 16, "meta length");
    let mut bad = 0;
    let half_k = l.k_pad / 2;
    for r in 0..l.m_pad {
        for j in 0..l.k_pad / 4 {
            let mut x = [0u16; 4];
            if r < w.rows {
                for (i, v) in x.iter_mut().enumerate() {
                    let c = 4 * j + i;
                    if c < w.cols {
                        *v = w.data[r * w.row_stride + c];
                    }
                }
            }
            let ((i0, i1), b) = select::<E>(x, prune);
            bad += b as usize;
            values[r * half_k + 2 * j] = x[i0];
            values[r * half_k + 2 * j + 1] = x[i1];
            let (at, nibble) = meta_position(&l, r, j);
            let code = (i0 | (i1 << 2)) as u16;
            meta[at] = (meta[at] & !(0xf << (4 * nibble))) | (code << (4 * nibble));
        }
    }
    bad
}

/// Decompress `values` / `meta` of a (rows, cols) matrix into `out` (row-major with
/// `row_stride`; every element of the (rows, cols) window is written).
pub fn decompress(
    values: &[u16],
    meta: &[u16],
    out: &mut [u16],
    rows: usize,
    cols: usize,
    row_stride: usize,
) {
    let l = Layout::new(rows, cols);
    assert_eq!(values.len(), l.m_pad * l.k_pad / 2, "values length");
    assert_eq!(meta.len(), l.m_pad * l.k_pad / 16, "meta length");
    let half_k = l.k_pad / 2;
    for r in 0..rows {
        for j in 0..cols.div_ceil(4) {
            let (at, nibble) = meta_position(&l, r, j);
            let code = (meta[at] >> (4 * nibble)) & 0xf;
            let (i0, i1) = ((code & 3) as usize, (code >> 2) as usize);
            let mut x = [0u16; 4];
            x[i0] = values[r * half_k + 2 * j];
            x[i1] = values[r * half_k + 2 * j + 1];
            for (i, &v) in x.iter().enumerate() {
                if 4 * j + i < cols {
                    out[r * row_stride + 4 * j + i] = v;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NZ: u16 = 0x3c00; // 1.0 in f16
    const NEG0: u16 = 0x8000;

    fn f(x: f32) -> u16 {
        f16::from_f32(x).to_bits()
    }

    /// Deterministic pseudo-random u64 stream (splitmix64).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
            z ^ (z >> 31)
        }
        /// A random non-zero finite f16 or bf16 bit pattern.
        fn value(&mut self, bf: bool) -> u16 {
            loop {
                let x = (self.next() as f32 / u64::MAX as f32) * 8.0 - 4.0;
                let b = if bf {
                    bf16::from_f32(x).to_bits()
                } else {
                    f(x)
                };
                if is_nonzero(b) {
                    return b;
                }
            }
        }
    }

    /// A random 2:4 matrix: each group gets 0..=2 non-zeros at random positions, the rest
    /// +0.0 or -0.0.
    fn random_24(rng: &mut Rng, rows: usize, cols: usize, stride: usize, bf: bool) -> Vec<u16> {
        let mut w = vec![0xdeadu16; rows * stride];
        for r in 0..rows {
            for j in 0..cols.div_ceil(4) {
                let keep = (rng.next() % 3) as usize;
                let mut pos = [0usize, 1, 2, 3];
                for i in (1..4).rev() {
                    pos.swap(i, (rng.next() % (i as u64 + 1)) as usize);
                }
                let mut room = 2 - keep; // a -0.0 comes back only when the group has room for it
                for i in 0..4 {
                    let c = 4 * j + i;
                    if c >= cols {
                        continue;
                    }
                    let nz = pos[..keep].contains(&i);
                    w[r * stride + c] = if nz {
                        rng.value(bf)
                    } else if room > 0 && rng.next().is_multiple_of(4) {
                        room -= 1;
                        NEG0
                    } else {
                        0
                    };
                }
            }
        }
        w
    }

    fn compress_vec<E: Elem>(w: &Matrix, prune: bool) -> (Vec<u16>, Vec<u16>, usize) {
        let l = Layout::new(w.rows, w.cols);
        let mut values = vec![0xffffu16; l.m_pad * l.k_pad / 2];
        let mut meta = vec![0xffffu16; l.m_pad * l.k_pad / 16];
        let bad = compress::<E>(w, &mut values, &mut meta, prune);
        (values, meta, bad)
    }

    #[test]
    fn layout_shapes_and_padding() {
        let l = Layout::new(1, 1);
        assert_eq!((l.m_pad, l.k_pad), (128, 64));
        assert_eq!(l.values_shape(), [128, 32]);
        assert_eq!(l.meta_shape(), [8, 64]);
        let l = Layout::new(4096, 11008);
        assert_eq!((l.m_pad, l.k_pad), (4096, 11008));
        assert_eq!(l.meta_shape(), [256, 11008]);
        let l = Layout::new(129, 65);
        assert_eq!((l.m_pad, l.k_pad), (256, 128));
        // 2 bits per kept element: meta bytes = values elements / 4
        assert_eq!(
            l.meta_shape()[0] * l.meta_shape()[1] * 2,
            l.values_shape()[0] * l.values_shape()[1] / 4
        );
        assert_eq!(Layout::new(0, 5).m_pad, 0);
        assert_eq!(Layout::new(3, 10).groups(), 9);
    }

    #[test]
    fn meta_positions_follow_the_mma_sp_lane_order() {
        let l = Layout::new(128, 128);
        // row 0, group 0: tile 0, lane 0, low half, nibble 0
        assert_eq!(meta_position(&l, 0, 0), (0, 0));
        // row 8 shares lane 0's word, high half
        assert_eq!(meta_position(&l, 8, 0), (1, 0));
        // group 3 = columns 12..15: nibble 3 of lane 0
        assert_eq!(meta_position(&l, 0, 3), (0, 3));
        // columns 16..19: second half of step 0 -> lane 1
        assert_eq!(meta_position(&l, 0, 4), (2, 0));
        // columns 32..35: step 1 (selector 1) -> lane 2; columns 48.. -> lane 3
        assert_eq!(meta_position(&l, 0, 8), (4, 0));
        assert_eq!(meta_position(&l, 0, 12), (6, 0));
        // row 1 -> lane 4 (g = 1)
        assert_eq!(meta_position(&l, 1, 0), (8, 0));
        // row 15 = g 7 high half, columns 60..63 -> lane 31, nibble 3
        assert_eq!(meta_position(&l, 15, 15), (63, 3));
        // columns 64.. -> unit 1: words 32..
        assert_eq!(meta_position(&l, 0, 16), (64, 0));
        // rows 16.. -> meta row 1 (k_pad int16 per meta row)
        assert_eq!(meta_position(&l, 16, 0), (128, 0));
        // every (row, group) gets its own nibble
        let mut seen = std::collections::HashSet::new();
        for r in 0..128 {
            for j in 0..32 {
                assert!(seen.insert(meta_position(&l, r, j)));
            }
        }
        assert_eq!(seen.len(), l.meta_shape()[0] * l.meta_shape()[1] * 4);
    }

    #[test]
    fn hand_made_metadata() {
        // one row: group 0 keeps (1, 3), group 1 keeps (0, 2), group 2 all zero -> (0, 1),
        // group 3 one non-zero at 3 -> (0, 3) (fill with the lowest +0.0)
        let mut w = vec![0u16; 16];
        w[1] = f(2.0);
        w[3] = f(-3.0);
        w[4] = f(5.0);
        w[6] = f(7.0);
        w[15] = f(1.5);
        let m = Matrix {
            data: &w,
            rows: 1,
            cols: 16,
            row_stride: 16,
        };
        let (values, meta, bad) = compress_vec::<f16>(&m, false);
        assert_eq!(bad, 0);
        // nibbles: i0 | i1 << 2: (1,3) = 0b1101 = 0xd, (0,2) = 0b1000 = 0x8, (0,1) = 0x4, (0,3) = 0xc
        assert_eq!(meta[0], 0xc48d);
        assert_eq!(
            &values[..8],
            &[f(2.0), f(-3.0), f(5.0), f(7.0), 0, 0, 0, f(1.5)]
        );
        // row 8 of the tile is padding: (0, 1) everywhere, in the high half-word
        assert_eq!(meta[1], 0x4444);
        // padding rows and columns: zero values, (0, 1) groups
        assert!(values[8..16].iter().all(|&v| v == 0));
        assert!(meta.iter().skip(2).all(|&m| m == 0x4444));
    }

    #[test]
    fn negative_zero_is_kept_when_there_is_room() {
        let x = [0, NEG0, NZ, 0];
        assert_eq!(select::<f16>(x, false), ((1, 2), false));
        let x = [NEG0, 0, NEG0, NEG0];
        assert_eq!(select::<f16>(x, false), ((0, 2), false));
    }

    #[test]
    fn more_than_two_nonzeros_keep_the_first_two_and_count() {
        let x = [NZ, 0, f(3.0), f(-9.0)];
        assert_eq!(select::<f16>(x, false), ((0, 2), true));
        let w = vec![NZ, NZ, NZ, 0, NZ, NZ, NZ, NZ, 0, 0, NZ, 0];
        let m = Matrix {
            data: &w,
            rows: 1,
            cols: 12,
            row_stride: 12,
        };
        assert_eq!(compress_vec::<f16>(&m, false).2, 2);
        assert_eq!(compress_vec::<f16>(&m, true).2, 2, "prune counts them too");
    }

    #[test]
    fn prune_keeps_the_two_largest_magnitudes() {
        assert_eq!(
            select::<f16>([f(1.0), f(-4.0), f(3.0), f(2.0)], true),
            ((1, 2), true)
        );
        // ties: lower index
        assert_eq!(
            select::<f16>([f(2.0), f(-2.0), f(2.0), f(1.0)], true),
            ((0, 1), true)
        );
        assert_eq!(
            select::<f16>([f(1.0), f(3.0), f(-3.0), f(3.0)], true),
            ((1, 2), true)
        );
        // NaN beats +inf, +inf beats numbers
        let nan = 0x7e00;
        let inf = 0x7c00;
        assert_eq!(
            select::<f16>([f(1.0), inf, f(5.0), nan], true),
            ((1, 3), true)
        );
        // all zero: (0, 1)
        assert_eq!(select::<f16>([0, NEG0, 0, 0], true), ((0, 1), false));
        // bf16 magnitudes
        let b = |x: f32| bf16::from_f32(x).to_bits();
        assert_eq!(
            select::<bf16>([b(100.0), b(-0.5), b(-300.0), b(1.0)], true),
            ((0, 2), true)
        );
    }

    #[test]
    fn prune_then_decompress_is_the_pruned_matrix() {
        let mut rng = Rng(7);
        let (rows, cols) = (5, 23);
        let w: Vec<u16> = (0..rows * cols).map(|_| rng.value(false)).collect();
        let m = Matrix {
            data: &w,
            rows,
            cols,
            row_stride: cols,
        };
        let (values, meta, bad) = compress_vec::<f16>(&m, true);
        assert_eq!(
            bad,
            rows * 6,
            "every group of random non-zeros is bad, the tail group of 3 too"
        );
        let mut out = vec![0xffffu16; rows * cols];
        decompress(&values, &meta, &mut out, rows, cols, cols);
        for r in 0..rows {
            for j in 0..cols.div_ceil(4) {
                let idx: Vec<usize> = (4 * j..(4 * j + 4).min(cols)).collect();
                let kept: Vec<usize> = idx
                    .iter()
                    .copied()
                    .filter(|&c| out[r * cols + c] != 0)
                    .collect();
                assert!(kept.len() <= 2);
                let min_kept = kept
                    .iter()
                    .map(|&c| f16::from_bits(w[r * cols + c]).to_f32().abs())
                    .fold(f32::INFINITY, f32::min);
                for &c in &idx {
                    if kept.contains(&c) {
                        assert_eq!(out[r * cols + c], w[r * cols + c]);
                    } else {
                        assert!(f16::from_bits(w[r * cols + c]).to_f32().abs() <= min_kept);
                    }
                }
            }
        }
    }

    #[test]
    fn round_trip_is_bitwise_on_random_24_matrices() {
        let mut rng = Rng(42);
        for &(rows, cols, stride) in &[
            (1, 1, 1),
            (3, 5, 7),
            (17, 64, 64),
            (130, 100, 101),
            (16, 200, 256),
            (129, 65, 65),
        ] {
            for bf in [false, true] {
                let w = random_24(&mut rng, rows, cols, stride, bf);
                let m = Matrix {
                    data: &w,
                    rows,
                    cols,
                    row_stride: stride,
                };
                let (values, meta, bad) = if bf {
                    compress_vec::<bf16>(&m, false)
                } else {
                    compress_vec::<f16>(&m, false)
                };
                assert_eq!(bad, 0);
                let mut out = vec![0x5555u16; rows * stride];
                decompress(&values, &meta, &mut out, rows, cols, stride);
                for r in 0..rows {
                    for c in 0..stride {
                        let want = if c < cols { w[r * stride + c] } else { 0x5555 };
                        assert_eq!(out[r * stride + c], want, "({r}, {c}) of {rows}x{cols}");
                    }
                }
                // every metadata nibble is valid (i0 < i1), padding included
                for &word in &meta {
                    for n in 0..4 {
                        let code = (word >> (4 * n)) & 0xf;
                        assert!((code & 3) < (code >> 2), "nibble {code:#x}");
                    }
                }
                // compress of the decompressed matrix reproduces values and meta
                let m2 = Matrix {
                    data: &out,
                    rows,
                    cols,
                    row_stride: stride,
                };
                let again = if bf {
                    compress_vec::<bf16>(&m2, false)
                } else {
                    compress_vec::<f16>(&m2, false)
                };
                assert_eq!((again.0, again.1), (values, meta));
            }
        }
    }

    #[test]
    fn malformed_metadata_stays_inside_the_group() {
        let l = Layout::new(2, 8);
        let values: Vec<u16> = (1..=(l.m_pad * l.k_pad / 2) as u16).collect();
        for pattern in [0x0000u16, 0xffff, 0x5555, 0xaaaa, 0x1234] {
            let meta = vec![pattern; l.m_pad * l.k_pad / 16];
            let mut out = vec![0u16; 2 * 8];
            decompress(&values, &meta, &mut out, 2, 8, 8);
            for r in 0..2 {
                for j in 0..2 {
                    let code = (pattern >> (4 * j)) & 0xf; // lane 0/4 words: row r's low half
                    let (i0, i1) = ((code & 3) as usize, (code >> 2) as usize);
                    let mut want = [0u16; 4];
                    want[i0] = values[r * 32 + 2 * j];
                    want[i1] = values[r * 32 + 2 * j + 1];
                    assert_eq!(&out[r * 8 + 4 * j..r * 8 + 4 * j + 4], &want);
                }
            }
        }
    }
}
