//! Dense GEMM (WMMA family) tile heuristics: pure functions, unit-tested on CPU.
//!
//! [`wmma_config`] picks the specialisation of `ferroattn::gemm_wmma` (kernels/gemm/wmma.cuh)
//! for one validated problem; [`wmma_production_configs`] lists what `ferroattn precompile`
//! builds and CI checks for spills.

use crate::dtype::DType;
use crate::arch::Arch;
use crate::tuning::gemm_problem::{GemmProblem, Operand};

/// Block tile of the WMMA kernel: BM x BN outputs per block, BK deep k steps, WarpsM x WarpsN
/// warps (each a (BM/WarpsM) x (BN/WarpsN) grid of 16x16 accumulators), `stages` cp.async ring
/// slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WmmaTile {
    pub bm: u32,
    pub bn: u32,
    pub bk: u32,
    pub warps_m: u32,
    pub warps_n: u32,
    pub stages: u32,
    /// Fragments of the next k step read while the current one multiplies (kernel template
    /// `DoubleBuffer`; needs bk % 32 == 0).
    pub double_buffer: bool,
    /// Per-stage mbarriers (full / empty) instead of one `__syncthreads` per tile in the
    /// double-buffered interior loop, copies `stages - 2` tiles ahead (kernel template
    /// `Mbarrier`, kernels/gemm/wmma.cuh); needs `double_buffer` and at least 3 stages.
    pub mbarrier: bool,
    /// Persistent grid (kernel template `Persistent`, kernels/gemm/wmma.cuh; LARGE_SM90, and the
    /// tile override's 9th field): a balanced grid of at most one CTA per
    /// SM loops over the (batch entry, tile) items; interior items keep the mbarrier pipeline's
    /// phases across items, and the next item's first `stages - 2` k tiles are copied while the
    /// current item multiplies its last ones and runs its epilogue, which stages through a
    /// per-warp 16 x 16 fp32 slab after the ring (unrolled for out = alpha * acc). Large problems
    /// whose last wave is partial split their last items along k over all SMs (stream-k tail,
    /// [`stream_k_plan`]). Needs `mbarrier`.
    pub persistent: bool,
}

impl WmmaTile {
    /// sm_90a: 128 x 256 x 64 on 8 warps of 64 x 64, 4 stages, double-buffered fragments, per-stage
    /// mbarriers: the most reuse per shared-memory byte (each 16-wide fragment read feeds four
    /// mma), the next tile's first fragments read under the current tile's last mma, and warps
    /// that wait only for the copies they need and for the slot they refill (copies 2 tiles
    /// ahead, so a warp may run a tile ahead of the slowest one); one block per SM. Interior
    /// blocks run this loop, edge blocks the single-buffered one with `__syncthreads`
    /// (kernels/gemm/wmma.cuh), which keeps every layout spill-free. H200
    /// (bench/results/gemm_wmma_tuning_20261130T1106/, paired vs cuBLAS on 12 target points):
    /// median 0.534x, min 0.517x, where the same tile with one `__syncthreads` per tile and 3
    /// stages (the previous default) gave 0.463x / 0.421x, 256 x 128 x 64 with mbarriers 0.509x,
    /// 128 x 128 x 64 (two blocks per SM) 0.477x. Persistent
    /// (bench/results/gemm_wmma_tuning_20261130T1106/persistent_grid_20261130T1220/: the next
    /// tile's fill under this tile's epilogue): 1.030x the non-persistent kernel (paired median
    /// on 8 k = 4096 points + 8192^3; 0.996-1.056). The
    /// unrolled plain epilogue and the stream-k tail (bench/NOTES.md "WMMA path"): 1.109x the
    /// persistent kernel without them (paired median on 9 target points, 1.080-1.134; vs cuBLAS median
    /// 0.550, min 0.529 there, where it gave 0.498 / 0.479). Its ring
    /// (up to 216 KiB + 8 KiB of epilogue slabs) needs sm_90's shared memory: other archs take [`LARGE`].
    pub const LARGE_SM90: WmmaTile =
        WmmaTile { bm: 128, bn: 256, bk: 64, warps_m: 2, warps_n: 4, stages: 4, double_buffer: true, mbarrier: true, persistent: true };
    /// Other archs: 128 x 256 x 32, 3 stages, double-buffered fragments (no spills on sm_80; on
    /// the H200 median 0.417x cuBLAS on the 12 points where LARGE_SM90's 3-stage, one-barrier form gave 0.475x).
    pub const LARGE: WmmaTile =
        WmmaTile { bm: 128, bn: 256, bk: 32, warps_m: 2, warps_n: 4, stages: 3, double_buffer: true, mbarrier: false, persistent: false };
    /// 128 x 128 on 4 warps of 64 x 64, 3 stages: two blocks per SM. Single-buffered: with
    /// double buffering (and with 4 stages on sm_80) its 64 x 64 warp tiles spill.
    pub const MEDIUM: WmmaTile =
        WmmaTile { bm: 128, bn: 128, bk: 32, warps_m: 2, warps_n: 2, stages: 3, double_buffer: false, mbarrier: false, persistent: false };
    /// 64 x 64 on 4 warps of 32 x 32: for problems with too few 128-tiles to fill the GPU.
    pub const SMALL: WmmaTile =
        WmmaTile { bm: 64, bn: 64, bk: 32, warps_m: 2, warps_n: 2, stages: 3, double_buffer: true, mbarrier: false, persistent: false };

    /// The large tile of `arch` (LARGE_SM90 on sm_90a, LARGE elsewhere).
    pub fn large(arch: Arch) -> WmmaTile {
        if arch == Arch::Sm90a {
            WmmaTile::LARGE_SM90
        } else {
            WmmaTile::LARGE
        }
    }

    pub fn threads(&self) -> u32 {
        self.warps_m * self.warps_n * 32
    }

    /// Whether the kernel's static constraints hold (kernels/gemm/wmma.cuh header): BK a
    /// multiple of 16 (32 when double-buffered), the warp tile of 16, at least 2 stages,  mbarriers
    /// only with double buffering and 3+ stages, and every load distributes evenly over the threads
    /// for 16-byte vectors.
    pub fn is_valid(&self) -> bool {
        let (wm, wn) = (self.bm / self.warps_m.max(1), self.bn / self.warps_n.max(1));
        self.warps_m >= 1
            && self.warps_n >= 1
            && self.bm.is_multiple_of(self.warps_m)
            && self.bn.is_multiple_of(self.warps_n)
            && self.bk.is_multiple_of(if self.double_buffer { 32 } else { 16 })
            && self.bk >= 16
            && wm.is_multiple_of(16)
            && wm >= 16
            && wn.is_multiple_of(16)
            && wn >= 16
            && self.stages >= 2
            && (!self.mbarrier || (self.double_buffer && self.stages >= 3))
            && (!self.persistent || self.mbarrier)
            && (self.bm * self.bk / 8).is_multiple_of(self.threads())
            && (self.bn * self.bk / 8).is_multiple_of(self.threads())
    }
}

/// One specialisation of `ferroattn::gemm_wmma<T, TOut, BM, BN, BK, WarpsM, WarpsN, Stages,
/// ARow, BRow, VecA, VecB, DoubleBuffer[, Mbarrier]>` (Mbarrier only when true; false is
/// its default, so those kernels keep their names): the single source of truth for its template arguments, launch
/// shape, shared memory and cache key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmWmmaConfig {
    /// a's and b's dtype (fp16 or bf16).
    pub dtype: DType,
    /// out's dtype (fp16, bf16 or fp32).
    pub out_dtype: DType,
    pub tile: WmmaTile,
    /// a row-major (stride 1 along k) / b row-major (stride 1 along n).
    pub a_row_major: bool,
    pub b_row_major: bool,
    /// Elements per global->shared copy of a / b: 8, 4, 2 or 1 (see [`vector_elems`]).
    pub vec_a: u32,
    pub vec_b: u32,
    pub arch: Arch,
}

impl GemmWmmaConfig {
    pub const KERNEL: &'static str = "ferroattn::gemm_wmma";
    pub const HEADER: &'static str = "gemm/wmma.cuh";

    pub fn name_expression(&self) -> String {
        let t = &self.tile;
        let mbar = match (t.mbarrier, t.persistent) {
            (_, true) => ", true, true",
            (true, false) => ", true",
            (false, false) => "",
        };
        format!(
            "{}<{}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}{}>",
            Self::KERNEL,
            self.dtype.cuda_type(),
            self.out_dtype.cuda_type(),
            t.bm,
            t.bn,
            t.bk,
            t.warps_m,
            t.warps_n,
            t.stages,
            self.a_row_major,
            self.b_row_major,
            self.vec_a,
            self.vec_b,
            t.double_buffer,
            mbar
        )
    }

    pub fn threads(&self) -> u32 {
        self.tile.threads()
    }

    /// Dynamic shared memory in bytes (kernels/gemm/wmma.cuh `gemm_wmma_smem_bytes`, checked
    /// against NVRTC in the tests): max(the cp.async ring, the epilogue slabs). The ring holds
    /// `stages` A and B tiles, each stored line-major with 8 elements of padding per line
    /// (A lines: rows when row-major, k otherwise; B lines: k when row-major, columns
    /// otherwise); the epilogue stages the BM x (BN + 4) fp32 output tile. (The mbarrier loop's 2 x
    /// stages mbarriers, 16 bytes per stage, are static shared memory on top of this.)
    pub fn smem_bytes(&self) -> u32 {
        let t = &self.tile;
        let (a_lines, a_len) = if self.a_row_major { (t.bm, t.bk) } else { (t.bk, t.bm) };
        let (b_lines, b_len) = if self.b_row_major { (t.bk, t.bn) } else { (t.bn, t.bk) };
        let ring = t.stages * (a_lines * (a_len + 8) + b_lines * (b_len + 8)) * 2;
        let epilogue = t.bm * (t.bn + 4) * 4;
        if t.persistent {
            // + per-warp 16 x 16 fp32 slabs after the ring (offset rounded up to 128 bytes):
            // kernels/gemm/wmma.cuh gemm_wmma_persistent_smem_bytes
            (ring.div_ceil(128) * 128 + t.warps_m * t.warps_n * 16 * 16 * 4).max(epilogue)
        } else {
            ring.max(epilogue)
        }
    }

    /// Block tiles along m and n.
    pub fn tiles(&self, m: i64, n: i64) -> (u64, u64) {
        (
            (m as u64).div_ceil(self.tile.bm as u64),
            (n as u64).div_ceil(self.tile.bn as u64),
        )
    }
}

/// The widest copy vector (8, 4, 2 elements, else 1) whose alignment the operand meets
/// everywhere: pointer, leading dim (when more than one line is used) and batch stride.
pub fn vector_elems(op: &Operand) -> u32 {
    [8, 4, 2].into_iter().find(|&v| op.vector_aligned(v as i64)).unwrap_or(1)
}

/// Whether `tiles` blocks per batch entry occupy at least `fraction` of `sm_count` SMs.
fn fills(tiles: u64, batch: i64, sm_count: u32, fraction: f64) -> bool {
    tiles.saturating_mul(batch.max(1) as u64) as f64 >= fraction * sm_count as f64
}

/// The tile for an (m, n, batch) problem on a GPU of `sm_count` SMs of `arch`:
/// `WmmaTile::large(arch)` when its blocks fill every SM at least once (one block per SM: a
/// partial wave idles SMs), else MEDIUM when its blocks reach 90% of the SMs (on the H200,
/// 512 x 4096 x 11008 with 128 MEDIUM blocks ran 1.3-1.4x faster than with 512 SMALL ones),
/// else SMALL; a tile the arch's shared memory cannot hold is skipped. `narrow` (an operand
/// copied in vectors of fewer than 8 elements) always takes SMALL: its loads are 2-8x more
/// instructions, which the 32 x 32 warp tiles keep within the register budget.
pub fn wmma_tile(m: i64, n: i64, batch: i64, sm_count: u32, arch: Arch, narrow: bool) -> WmmaTile {
    if narrow {
        return WmmaTile::SMALL;
    }
    for (tile, fraction) in [(WmmaTile::large(arch), 1.0), (WmmaTile::MEDIUM, 0.9)] {
        let t = (m as u64).div_ceil(tile.bm as u64) * (n as u64).div_ceil(tile.bn as u64);
        let smem = [true, false]
            .iter()
            .flat_map(|&a| [true, false].map(|b| smem_of(tile, a, b)))
            .max()
            .unwrap_or(0);
        if fills(t, batch, sm_count, fraction) && smem <= arch.max_smem_per_block() {
            return tile;
        }
    }
    WmmaTile::SMALL
}

/// Bytes kept free beside the dynamic shared memory of an mbarrier tile for its static
/// mbarrier array (2 x stages x 8 bytes; ncu showed 128 bytes of static shared memory for 4
/// stages).
pub const MBARRIER_SMEM_MARGIN: u32 = 1024;

/// Shared memory a tile needs per block with 16-byte copies: the dynamic bytes of
/// [`GemmWmmaConfig::smem_bytes`] plus [`MBARRIER_SMEM_MARGIN`] for an mbarrier tile; what the
/// tile choice and the production list compare with the arch's per-block limit.
pub fn smem_of(tile: WmmaTile, a_row_major: bool, b_row_major: bool) -> u32 {
    let margin = if tile.mbarrier { MBARRIER_SMEM_MARGIN } else { 0 };
    margin + GemmWmmaConfig {
        dtype: DType::F16,
        out_dtype: DType::F16,
        tile,
        a_row_major,
        b_row_major,
        vec_a: 8,
        vec_b: 8,
        arch: Arch::Sm80,
    }
    .smem_bytes()
}

/// When a persistent WMMA launch splits its last items along k ("stream-k tail",
/// kernels/gemm/wmma.cuh `Persistent`): `Off` never, `Auto` by [`stream_k_plan`]'s rule, `On`
/// whenever the last wave is partial (the `gemm_wmma_streamk` knob).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamK {
    Off,
    Auto,
    On,
}

/// The stream-k plan of a persistent launch: (CTAs, first tail item) or None (no tail).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamKPlan {
    /// CTAs (one per SM at most): every CTA runs the same share of the work.
    pub grid: u64,
    /// Items 0 .. sk_first run whole (data-parallel, item w on CTA w % grid); the rest (grid plus
    /// the partial last wave's items) are split into equal ranges of k tiles, one per CTA.
    pub sk_first: u64,
}

/// Whole waves `Auto` needs before a stream-k tail. The tail's CTAs each walk their own range of
/// k tiles (different items at different k offsets at once), so its operand tiles are shared
/// less in L2 than the data-parallel raster's: with few waves the tail is a large share of the
/// call. H200 (bench/NOTES.md "WMMA path"): 7.8-54 waves gained 0.5-4.5 % (paired, 9 points); 3.9 waves
/// (512 items: 4096 x 4096 x 4096 / x 11008) lost ~5-8 % (estimated from two unpaired bench runs).
pub const STREAM_K_MIN_WAVES: u64 = 7;

/// Stream-k plan for `items` work items of `k_tiles` k tiles each on at most `cap` CTAs (pure).
/// Without a tail the balanced grid (src/tuning/grid.rs) idles the SMs that a partial last wave
/// leaves free: a CTA runs ceil(items / grid) items. With it every CTA runs items / cap items'
/// worth of k tiles (+ one partial tile's hand-off). None when `mode` is Off, when the items fill
/// whole waves (or one wave at most), or (Auto) when the last wave is >= 95 % full (the tail
/// would save < 0.05 item-times per CTA) or fewer than [`STREAM_K_MIN_WAVES`] whole waves precede
/// it; also None when the tail's k-tile units exceed i32 (the kernel counts them in 32 bits).
/// Needs interior items only (checked by the caller).
pub fn stream_k_plan(items: u64, k_tiles: u64, cap: u64, mode: StreamK) -> Option<StreamKPlan> {
    let g = cap.max(1);
    if mode == StreamK::Off || items <= g || k_tiles == 0 {
        return None;
    }
    let (waves, r) = (items / g, items % g);
    if r == 0 || (mode == StreamK::Auto && ((g - r) * 20 < g || waves < STREAM_K_MIN_WAVES)) {
        return None;
    }
    let sk_first = (waves - 1) * g;
    let units = (items - sk_first).checked_mul(k_tiles)?;
    if units > i32::MAX as u64 {
        return None;
    }
    Some(StreamKPlan { grid: g, sk_first })
}

/// The configuration for a validated problem: the copy vectors from the operands' alignment,
/// the tile from `tile` (an override) or [`wmma_tile`].
pub fn wmma_config(p: &GemmProblem, tile: Option<WmmaTile>, sm_count: u32, arch: Arch) -> GemmWmmaConfig {
    let (vec_a, vec_b) = (vector_elems(&p.a), vector_elems(&p.b));
    let tile = tile.unwrap_or_else(|| wmma_tile(p.m, p.n, p.batch, sm_count, arch, vec_a < 8 || vec_b < 8));
    GemmWmmaConfig {
        dtype: p.a.dtype,
        out_dtype: p.out.dtype,
        tile,
        a_row_major: p.a.row_major(),
        b_row_major: p.b.row_major(),
        vec_a,
        vec_b,
        arch,
    }
}

/// Parse a tile override "bm,bn,bk,warps_m,warps_n,stages[,double_buffer 0|1[,mbarrier 0|1
/// [,persistent 0|1]]]" (the `gemm_wmma_tile` knob, for tuning
/// experiments; double_buffer defaults to 1, mbarrier and persistent to 0); None when malformed
/// or invalid.
pub fn parse_tile(text: &str) -> Option<WmmaTile> {
    let v: Vec<u32> = text
        .split(',')
        .map(|s| s.trim().parse().ok())
        .collect::<Option<_>>()?;
    let (&[bm, bn, bk, warps_m, warps_n, stages], db) = (v.get(..6)?, v.get(6..)?) else {
        return None;
    };
    let flag = |x: u32| match x {
        0 => Some(false),
        1 => Some(true),
        _ => None,
    };
    let (double_buffer, mbarrier, persistent) = match db {
        [] => (true, false, false),
        [d] => (flag(*d)?, false, false),
        [d, mb] => (flag(*d)?, flag(*mb)?, false),
        [d, mb, ps] => (flag(*d)?, flag(*mb)?, flag(*ps)?),
        _ => return None,
    };
    let t = WmmaTile { bm, bn, bk, warps_m, warps_n, stages, double_buffer, mbarrier, persistent };
    t.is_valid().then_some(t)
}

/// What `precompile` builds for `arch`: fp16 and bf16 inputs, out in the input dtype or fp32,
/// the four layouts, 16-byte copies, every tile [`wmma_tile`] picks for such operands (the
/// arch's large tile only where its shared memory holds it).
pub fn wmma_production_configs(arch: Arch) -> Vec<GemmWmmaConfig> {
    let mut out = Vec::new();
    for dtype in [DType::F16, DType::BF16] {
        for out_dtype in [dtype, DType::F32] {
            for tile in [WmmaTile::large(arch), WmmaTile::MEDIUM, WmmaTile::SMALL] {
                if (0..4).any(|i| smem_of(tile, i & 1 == 0, i & 2 == 0) > arch.max_smem_per_block()) {
                    continue;
                }
                for a_row_major in [true, false] {
                    for b_row_major in [true, false] {
                        out.push(GemmWmmaConfig {
                            dtype,
                            out_dtype,
                            tile,
                            a_row_major,
                            b_row_major,
                            vec_a: 8,
                            vec_b: 8,
                            arch,
                        });
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_k_plan_splits_the_last_wave_and_one_more() {
        // 8192 x 14336 x 4096 bf16 on 132 SMs: 64 x 56 = 3584 items of 64 k tiles: 27 whole waves
        // + 20; the tail is the last whole wave + the 20 (152 items), ~1.15 items per CTA.
        let p = stream_k_plan(3584, 64, 132, StreamK::Auto).unwrap();
        assert_eq!(p, StreamKPlan { grid: 132, sk_first: 26 * 132 });
        assert!((3584 - p.sk_first) * 64 >= 132 * 64); // every CTA's range holds >= one item
        // 7168 items: 54 waves + 40 (last wave 30 % full): a tail; 2752 = 20 x 132 + 112 (85 %): a tail
        assert!(stream_k_plan(7168, 64, 132, StreamK::Auto).is_some());
        assert!(stream_k_plan(2752, 64, 132, StreamK::Auto).is_some());
        // 2634 = 19 x 132 + 126: the last wave 95.5 % full -> not worth it unless forced
        assert_eq!(stream_k_plan(2634, 64, 132, StreamK::Auto), None);
        assert!(stream_k_plan(2634, 64, 132, StreamK::On).is_some());
        // whole waves, one wave or less, Off, zero k tiles, unit overflow
        assert_eq!(stream_k_plan(2112, 64, 132, StreamK::On), None);
        assert_eq!(stream_k_plan(132, 64, 132, StreamK::On), None);
        assert_eq!(stream_k_plan(100, 64, 132, StreamK::On), None);
        assert_eq!(stream_k_plan(3584, 64, 132, StreamK::Off), None);
        assert_eq!(stream_k_plan(3584, 0, 132, StreamK::On), None);
        assert_eq!(stream_k_plan(3584, 1 << 24, 132, StreamK::On), None);
        // a small cap (tests force few CTAs): 20 items on 7 CTAs = 2 waves + 6 -> tail from item 7
        assert_eq!(stream_k_plan(20, 5, 7, StreamK::On), Some(StreamKPlan { grid: 7, sk_first: 7 }));
        // Auto needs 7 whole waves: 512 items (3 + 116) no, 1024 (7 + 100) yes; On ignores it
        assert_eq!(stream_k_plan(512, 172, 132, StreamK::Auto), None);
        assert!(stream_k_plan(512, 172, 132, StreamK::On).is_some());
        assert_eq!(stream_k_plan(1024, 64, 132, StreamK::Auto), Some(StreamKPlan { grid: 132, sk_first: 6 * 132 }));
        assert_eq!(stream_k_plan(20, 5, 7, StreamK::Auto), None);
    }

    fn cfg(tile: WmmaTile, a_row: bool, b_row: bool) -> GemmWmmaConfig {
        GemmWmmaConfig {
            dtype: DType::BF16,
            out_dtype: DType::F32,
            tile,
            a_row_major: a_row,
            b_row_major: b_row,
            vec_a: 8,
            vec_b: 2,
            arch: Arch::Sm90a,
        }
    }

    #[test]
    fn builtin_tiles_are_valid_and_fit_every_arch() {
        for tile in [WmmaTile::LARGE_SM90, WmmaTile::LARGE, WmmaTile::MEDIUM, WmmaTile::SMALL] {
            assert!(tile.is_valid(), "{tile:?}");
            // LARGE_SM90 is only picked on sm_90a; the others on every arch (sm_86's 99 KiB
            // skips LARGE: see tile_choice_fills_the_gpu)
            let arch = if tile == WmmaTile::LARGE_SM90 { Arch::Sm90a } else { Arch::Sm80 };
            for (a, b) in [(true, true), (true, false), (false, true), (false, false)] {
                assert!(smem_of(tile, a, b) <= arch.max_smem_per_block(), "{tile:?} {a} {b}");
            }
        }
        assert!((0..4).any(|i| smem_of(WmmaTile::LARGE_SM90, i & 1 == 0, i & 2 == 0) > Arch::Sm80.max_smem_per_block()));
        // invalid shapes are rejected
        let bad = WmmaTile { bk: 48, double_buffer: true, ..WmmaTile::MEDIUM }; // odd 16-deep step count
        assert!(WmmaTile { double_buffer: false, ..bad }.is_valid());
        assert!(!bad.is_valid());
        assert!(!WmmaTile { stages: 1, ..WmmaTile::SMALL }.is_valid());
        assert!(WmmaTile { mbarrier: true, ..WmmaTile::SMALL }.is_valid());
        assert!(!WmmaTile { mbarrier: true, ..WmmaTile::MEDIUM }.is_valid()); // single-buffered
        assert!(!WmmaTile { stages: 2, mbarrier: true, ..WmmaTile::SMALL }.is_valid());
        assert!(WmmaTile { persistent: true, ..WmmaTile::LARGE_SM90 }.is_valid());
        assert!(!WmmaTile { persistent: true, ..WmmaTile::LARGE }.is_valid()); // no mbarriers
        assert!(!WmmaTile { bn: 72, ..WmmaTile::MEDIUM }.is_valid()); // warp width 36
        assert!(WmmaTile { bn: 96, ..WmmaTile::MEDIUM }.is_valid()); // warp width 48
    }

    #[test]
    fn smem_formula_by_hand() {
        // 4 stages of 128 x 128 x 32, NN: A 128 rows x (32+8), B 32 rows x (128+8), 2 bytes
        let t4 = WmmaTile { stages: 4, ..WmmaTile::MEDIUM };
        assert_eq!(cfg(t4, true, true).smem_bytes(), 4 * (128 * 40 + 32 * 136) * 2);
        // TT: A 32 lines x (128+8), B 128 lines x (32+8)
        assert_eq!(cfg(t4, false, false).smem_bytes(), 4 * (32 * 136 + 128 * 40) * 2);
        // MEDIUM (3 stages): the staged 128 x 132 fp32 tile is larger than the ring
        assert_eq!(cfg(WmmaTile::MEDIUM, true, true).smem_bytes(), 128 * 132 * 4);
        // LARGE (BK 32): the staged 128 x (256 + 4) fp32 tile exceeds the ring (NN: 3 x
        // (A 128 x 40 + B 32 x 264), TT: 3 x (A 32 x 136 + B 256 x 40))
        let t = WmmaTile::LARGE;
        let epi = 128 * 260 * 4;
        assert_eq!(cfg(t, true, true).smem_bytes(), epi.max(3 * (128 * 40 + 32 * 264) * 2));
        assert_eq!(cfg(t, false, false).smem_bytes(), epi.max(3 * (32 * 136 + 256 * 40) * 2));
        assert_eq!(cfg(t, false, false).smem_bytes(), epi);
        // LARGE_SM90 (BK 64, 4 stages): NN 4 x (A 128 x 72 + B 64 x 264), TT 4 x (A 64 x 136 +
        // B 256 x 72), NT (the linear layout) 4 x (A 128 x 72 + B 256 x 72) = 216 KiB; plus the
        // mbarriers' static bytes where tiles are checked against the arch's limit
        let t = WmmaTile { persistent: false, ..WmmaTile::LARGE_SM90 };
        assert_eq!(cfg(t, true, true).smem_bytes(), 4 * (128 * 72 + 64 * 264) * 2);
        assert_eq!(cfg(t, false, false).smem_bytes(), 4 * (64 * 136 + 256 * 72) * 2);
        assert_eq!(cfg(t, true, false).smem_bytes(), 4 * (128 * 72 + 256 * 72) * 2);
        assert_eq!(smem_of(t, true, false), 4 * (128 * 72 + 256 * 72) * 2 + MBARRIER_SMEM_MARGIN);
        assert_eq!(smem_of(WmmaTile::LARGE, true, false), cfg(WmmaTile::LARGE, true, false).smem_bytes());
        // persistent: + 8 warps x 1 KiB of epilogue slabs after the ring (NT: 221184 + 8192 +
        // the margin = 230400 <= 227 KiB; every layout fits sm_90a)
        let ps = WmmaTile { persistent: true, ..WmmaTile::LARGE_SM90 };
        assert_eq!(cfg(ps, true, false).smem_bytes(), 4 * (128 * 72 + 256 * 72) * 2 + 8 * 1024);
        assert_eq!(cfg(ps, true, true).smem_bytes(), 4 * (128 * 72 + 64 * 264) * 2 + 8 * 1024);
        for (a, b) in [(true, true), (true, false), (false, true), (false, false)] {
            assert!(smem_of(ps, a, b) <= Arch::Sm90a.max_smem_per_block(), "{a} {b}");
        }
        // a ring smaller than the staged edge tile: the edge epilogue sets the size
        let small = WmmaTile { stages: 3, persistent: true, mbarrier: true, ..WmmaTile::LARGE };
        assert_eq!(cfg(small, false, false).smem_bytes(), 128 * 260 * 4);
        // a tile whose staged 64 x (512 + 4) fp32 output exceeds its 2-stage ring
        let t = WmmaTile { bm: 64, bn: 512, bk: 32, warps_m: 2, warps_n: 4, stages: 2, double_buffer: true, mbarrier: false, persistent: false };
        // (ring 2 x (64 x 40 + 32 x 520) x 2 = 76800 bytes)
        assert_eq!(cfg(t, true, true).smem_bytes(), 64 * 516 * 4);
    }

    #[test]
    fn name_expression_lists_the_template_arguments_in_order() {
        let c = cfg(WmmaTile::MEDIUM, true, false);
        assert_eq!(
            c.name_expression(),
            "ferroattn::gemm_wmma<__nv_bfloat16, float, 128, 128, 32, 2, 2, 3, true, false, 8, 2, false>"
        );
        // Mbarrier = true is appended (the kernel's last template argument, default false)
        let c = cfg(WmmaTile { persistent: false, ..WmmaTile::LARGE_SM90 }, false, true);
        assert_eq!(
            c.name_expression(),
            "ferroattn::gemm_wmma<__nv_bfloat16, float, 128, 256, 64, 2, 4, 4, false, true, 8, 2, true, true>"
        );
        // Persistent = true follows Mbarrier
        let c = cfg(WmmaTile { persistent: true, ..WmmaTile::LARGE_SM90 }, true, false);
        assert_eq!(
            c.name_expression(),
            "ferroattn::gemm_wmma<__nv_bfloat16, float, 128, 256, 64, 2, 4, 4, true, false, 8, 2, true, true, true>"
        );
    }

    fn operand(ptr: u64, rows: i64, cols: i64, ld: i64, batch_stride: i64) -> Operand {
        Operand {
            ptr,
            rows,
            cols,
            row_stride: ld,
            col_stride: 1,
            batch_stride,
            dtype: DType::F16,
        }
    }

    #[test]
    fn vector_width_follows_alignment() {
        assert_eq!(vector_elems(&operand(0x100, 64, 64, 64, 4096)), 8);
        assert_eq!(vector_elems(&operand(0x100, 64, 20, 20, 1280)), 4); // k = 20
        assert_eq!(vector_elems(&operand(0x100, 64, 18, 18, 1152)), 2); // k = 18
        assert_eq!(vector_elems(&operand(0x100, 64, 17, 17, 1088)), 1); // k = 17
        assert_eq!(vector_elems(&operand(0x102, 64, 64, 64, 4096)), 1); // 2-byte aligned pointer
        assert_eq!(vector_elems(&operand(0x104, 64, 64, 64, 4096)), 2);
        assert_eq!(vector_elems(&operand(0x100, 1, 16, 17, 0)), 8); // one row: ld unused
        assert_eq!(vector_elems(&operand(0x100, 1, 17, 17, 0)), 1); // no vector may straddle the row end
        assert_eq!(vector_elems(&operand(0x100, 64, 60, 64, 4096)), 4); // line 60 < ld 64
        assert_eq!(vector_elems(&operand(0x100, 64, 64, 64, 4100)), 4); // batch stride
    }

    #[test]
    fn tile_choice_fills_the_gpu() {
        let sms = 132;
        // 4096^2: 16 x 16 = 256 LARGE tiles >= 132
        assert_eq!(wmma_tile(4096, 4096, 1, sms, Arch::Sm90a, false), WmmaTile::LARGE_SM90);
        // 1024^2: 8 x 4 = 32 LARGE tiles, 64 MEDIUM tiles (< 0.9 x 132): SMALL (256 tiles)
        assert_eq!(wmma_tile(1024, 1024, 1, sms, Arch::Sm90a, false), WmmaTile::SMALL);
        // ... unless the batch fills the GPU
        assert_eq!(wmma_tile(1024, 1024, 8, sms, Arch::Sm90a, false), WmmaTile::LARGE_SM90);
        // 2048 x 1024: 16 x 4 = 64 LARGE, 16 x 8 = 128 MEDIUM >= 0.9 x 132: MEDIUM; 2048^2
        // (128 LARGE < 132) MEDIUM; 512 x 4096: 4 x 32 = 128 MEDIUM; 1024 x 768: 8 x 6 = 48: SMALL
        assert_eq!(wmma_tile(2048, 1024, 1, sms, Arch::Sm90a, false), WmmaTile::MEDIUM);
        assert_eq!(wmma_tile(2048, 2048, 1, sms, Arch::Sm90a, false), WmmaTile::MEDIUM);
        assert_eq!(wmma_tile(512, 4096, 1, sms, Arch::Sm90a, false), WmmaTile::MEDIUM);
        assert_eq!(wmma_tile(1024, 768, 1, sms, Arch::Sm90a, false), WmmaTile::SMALL);
        // 512 x 11008: 4 x 43 = 172 LARGE blocks
        assert_eq!(wmma_tile(512, 11008, 1, sms, Arch::Sm90a, false), WmmaTile::LARGE_SM90);
        // tiny problems and huge batches never overflow
        assert_eq!(wmma_tile(1, 1, 1, sms, Arch::Sm90a, false), WmmaTile::SMALL);
        assert_eq!(wmma_tile(1, 1, 1 << 20, sms, Arch::Sm90a, false), WmmaTile::LARGE_SM90);
        assert_eq!(wmma_tile(i32::MAX as i64, i32::MAX as i64, i64::MAX, sms, Arch::Sm90a, false), WmmaTile::LARGE_SM90);
        // narrow copies take SMALL; archs with 99 KiB of shared memory never take LARGE
        assert_eq!(wmma_tile(4096, 4096, 1, sms, Arch::Sm90a, true), WmmaTile::SMALL);
        assert_eq!(wmma_tile(4096, 4096, 1, sms, Arch::Sm86, false), WmmaTile::MEDIUM);
        assert_eq!(wmma_tile(4096, 4096, 1, sms, Arch::Sm80, false), WmmaTile::LARGE);
    }

    #[test]
    fn tile_override_parsing() {
        assert_eq!(parse_tile("128,128,32,2,2,3,0"), Some(WmmaTile::MEDIUM));
        assert_eq!(parse_tile(" 64, 64, 32, 2, 2, 3 "), Some(WmmaTile::SMALL));
        assert_eq!(parse_tile("128,128,32,2,2"), None);
        assert_eq!(parse_tile("128,256,64,2,4,4,1,1"), Some(WmmaTile { persistent: false, ..WmmaTile::LARGE_SM90 }));
        let s7 = WmmaTile { stages: 3, mbarrier: false, persistent: false, ..WmmaTile::LARGE_SM90 }; // the 3-stage, one-barrier form
        assert_eq!(parse_tile("128,256,64,2,4,3,1"), Some(s7));
        assert_eq!(parse_tile("128,256,64,2,4,3"), Some(s7));
        assert_eq!(parse_tile("128,256,64,2,4,3,0"), Some(WmmaTile { double_buffer: false, ..s7 }));
        assert_eq!(parse_tile("128,256,32,2,4,3,1"), Some(WmmaTile::LARGE));
        assert_eq!(parse_tile("128,256,32,2,4,3"), Some(WmmaTile::LARGE));
        assert_eq!(parse_tile("128,256,48,2,4,3,1"), None); // odd number of 16-deep steps
        assert_eq!(parse_tile("128,256,32,2,4,3,2"), None);
        assert_eq!(parse_tile("128,256,32,2,4,3,-1"), None);
        assert_eq!(parse_tile("128,256,32,2,4,3,1,1"), Some(WmmaTile { mbarrier: true, ..WmmaTile::LARGE }));
        assert_eq!(parse_tile("128,256,32,2,4,3,1,0"), Some(WmmaTile::LARGE));
        assert_eq!(parse_tile("128,256,64,2,4,3,0,1"), None); // mbarriers need double buffering
        assert_eq!(parse_tile("128,256,64,2,4,2,1,1"), None); // and 3 stages
        assert_eq!(parse_tile("128,256,64,2,4,3,1,2"), None);
        assert_eq!(parse_tile("128,256,64,2,4,3,1,0,1"), None); // persistent needs mbarriers
        let ps = WmmaTile { persistent: true, ..WmmaTile::LARGE_SM90 };
        assert_eq!(ps, WmmaTile::LARGE_SM90); // the sm_90a default is persistent
        let np = WmmaTile { persistent: false, ..WmmaTile::LARGE_SM90 };
        assert_eq!(parse_tile("128,256,64,2,4,4,1,1,1"), Some(ps));
        assert_eq!(parse_tile("128,256,64,2,4,4,1,1,0"), Some(np));
        assert_eq!(parse_tile("128,256,64,2,4,4,1,1,2"), None);
        assert_eq!(parse_tile("128,256,64,2,4,4,1,1,1,1"), None);
        assert_eq!(parse_tile("128,128,24,2,2,4"), None);
        assert_eq!(parse_tile("a,b"), None);
    }

    #[test]
    fn production_configs_cover_dtypes_layouts_and_tiles() {
        let cs = wmma_production_configs(Arch::Sm80);
        assert_eq!(cs.len(), 2 * 2 * 3 * 4);
        assert_eq!(wmma_production_configs(Arch::Sm86).len(), 2 * 2 * 2 * 4);
        let mut seen = std::collections::HashSet::new();
        for c in &cs {
            assert!(seen.insert(*c), "duplicate {c:?}");
            assert!(c.tile.is_valid());
            assert!(c.smem_bytes() <= Arch::Sm80.max_smem_per_block());
            assert!(c.out_dtype == c.dtype || c.out_dtype == DType::F32);
        }
        for (a, b) in [(true, true), (true, false), (false, true), (false, false)] {
            assert!(cs.iter().any(|c| c.a_row_major == a && c.b_row_major == b));
        }
    }
}
