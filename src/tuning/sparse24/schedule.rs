//! 2:4 sparse kernels, the Hopper `wgmma .sp` path: how a call's work is laid out (tiles, banded,
//! stream-k, split-k, fused split-k), the cost models that choose, and the policies of the
//! knobs that override the choice (src/tuning/knobs.rs). Pure functions.

use super::*;

/// How a wgmma_sp call's work is laid out on the GPU (`wgmma_schedule`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WgmmaSchedule {
    /// One work unit per 256 x 128 tile on the balanced persistent grid (src/tuning/grid.rs).
    Tiles,
    /// Split-k (`wgmma_split_plan`).
    Split(WgmmaSplit),
    /// One work unit per 128 x 128 tile (`wgmma_bm128_config`), balanced grid.
    Bm128,
    /// Two launches on the stream: w rows 0 .. 256 `head_tiles` - 1 as whole 256 x 128 tiles (every
    /// token tile), then the remaining w rows as whole 128 x 128 tiles (`wgmma_bm128_config`), each on
    /// its balanced grid. Chosen where the 256-row tiles' last wave is mostly empty and the rest fits in
    /// fewer, cheaper 128-row waves (`wgmma_banded_plan`).
    Banded { head_tiles: u64 },
    /// Stream-K tail (`wgmma_stream_k_config`): the first `dp_tiles` 256 x 128 tiles run whole,
    /// CTA g taking g, g + grid, ...; the remaining tiles' 128-k stages are cut into `grid`
    /// contiguous, equal (+-1) ranges, one per CTA; a tile cut between CTAs is finished by the CTA
    /// holding its first stage, which adds the others' partial sums in k order (deterministic).
    /// `grid` <= SMs (the owner waits for CTAs of higher index: all must be resident).
    StreamK { dp_tiles: u64, grid: u64 },
}

/// Which tile wgmma_sp may use (the `wgmma_sp_tile` knob).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TilePolicy {
    /// `wgmma_schedule`'s rule (unset / "auto").
    Auto,
    /// 256 x 128 only ("256").
    Only256,
    /// 128 x 128 always ("128"; no split-k, no stream-K).
    Force128,
    /// `WgmmaSchedule::Banded` with this many 256-row feature tiles first ("band:H"; clamped to the
    /// call's 256-row feature tiles - 1; a call with a single one runs whole tiles).
    Banded(u64),
}

/// When wgmma_sp runs the stream-K tail (the `wgmma_sp_streamk` knob).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamKPolicy {
    /// `wgmma_schedule`'s cost rule (unset / "auto").
    Auto,
    /// never ("off").
    Off,
    /// always, with the tail the cost rule likes best ("on").
    On,
    /// always, with exactly this many whole tiles first ("dp:N"; clamped to tiles - 1).
    DpTiles(u64),
}

/// Cost-model constants of `wgmma_schedule` (stage-times of a 256 x 128 tile, ~0.9-1.0 us on an H200
/// SM): a 128 x 128 stage relative to a 256 x 128 one (128 x 128 ran 0.91 / 1.24 and 1.04 /
/// 1.31 of the 256-row tile's rate per SM -> ~0.65 of its time for half the work; later 20.9 /
/// 32.7 us = 0.64 at 512 x 4096 x 4096, 0.54-0.68 from the forced 128-row tile at 1024-8192 rows), and
/// one hand-off of a stream-K partial sum (128 KiB of fp32 written or read by one SM through L2; the
/// fused split-k measured ~5-6 us per sequential hand-off = write + read). The stream-K model
/// (`wgmma_stream_k_cost`) predicted 0.86-0.96x of whole tiles where the H200 measured 0.79-0.96x
/// SLOWER (bench/results/sparse24_schedules_20261130T1333/): it only picks the tail of the forced
/// ("on") form.
pub const WGMMA_BM128_STAGE: f64 = 0.65;
/// Fewest rows (tokens) for which the auto rule takes the 128-row tile: one whole 128-token tile. At 64
/// rows it measured no better than split-k (H200: 64 x 11008 x 4096 0.979 / 0.982x, 64 x 14336 x 4096
/// 1.012 / 1.004x of the 3- / 2-chunk split, bf16 / fp16), from 128 rows 1.17-1.53x; 65-127 rows not measured.
pub const WGMMA_BM128_MIN_ROWS: u64 = 128;
/// Stage-time of the 128-row tile relative to the 256-row one in the wave rule of `wgmma_schedule`
/// (calls with more 128-row tiles than SMs): the 128-row tile wins where ceil(2 tiles / sms) x this <
/// ceil(tiles / sms). 0.55 puts all seven shapes measured with the forced 128-row tile on the measured
/// side (wins: fp16 1024 x 14336 x 4096, 1.030x [1.021, 1.041]; losses: 1024 / 2048 / 4096 x 11008 x 4096,
/// 8192 x 14336 x 4096, 1024 x 4096 x 11008, 256 x 11008 x 4096, 0.75-0.97x).
pub const WGMMA_BM128_WAVE_STAGE: f64 = 0.55;
pub const WGMMA_SK_HANDOFF: f64 = 3.0;
/// Extra cost (stage-times) of the banded schedule's second launch (kernel boundary: the first
/// launch's tail drains, the second fills).
pub const WGMMA_BAND_LAUNCH: f64 = 2.0;
/// The banded schedule replaces whole tiles only where its modelled time is below this fraction of
/// theirs (the 128-row stage ratio varies 0.54-0.68 between shapes: keep a margin).
pub const WGMMA_BAND_MARGIN: f64 = 0.98;

/// The banded schedule (`WgmmaSchedule::Banded`) of a call with `feature_tiles` 256-row feature tiles
/// (ceil(n / 256)) x `row_tiles` token tiles, `k_tiles` stages on `sms` SMs, as (head_tiles, modelled
/// cost in stage-times): the head_tiles in 1 .. feature_tiles - 1 that minimises ceil(head x row_tiles /
/// sms) whole-tile waves + ceil(2 (feature_tiles - head) x row_tiles / sms) waves of the 128-row tile
/// (WGMMA_BM128_STAGE x k_tiles + fill each) + WGMMA_BAND_LAUNCH; of equal costs the largest head (the
/// fewest 128-row tiles). None when feature_tiles < 2.
/// E.g. 2048 x 11008 x 4096 (43 x 16 tiles, 32 stages, 132 SMs): head 41 -> 656 tiles in 5 waves +
/// 64 128-row tiles in one = 5 x 34 + 22.8 + 2 = 194.8 against 6 x 34 = 204 for whole tiles.
pub fn wgmma_banded_plan(feature_tiles: u64, row_tiles: u64, k_tiles: u64, sms: u64) -> Option<(u64, f64)> {
    let sms = sms.max(1);
    let mut best: Option<(u64, f64)> = None;
    for head in 1..feature_tiles {
        let tail128 = 2 * (feature_tiles - head) * row_tiles;
        let cost = wgmma_tiles_cost(head * row_tiles, k_tiles, sms)
            + tail128.div_ceil(sms) as f64 * (WGMMA_BM128_STAGE * k_tiles as f64 + WGMMA_SPLIT_UNIT_FILL)
            + WGMMA_BAND_LAUNCH;
        if best.is_none_or(|(_, c)| cost <= c) {
            best = Some((head, cost));
        }
    }
    best
}

/// Modelled critical path (stage-times) of the whole-tile schedule: ceil(tiles / sms) waves of
/// k_tiles stages + the per-unit fill / epilogue.
pub fn wgmma_tiles_cost(tiles: u64, k_tiles: u64, sms: u64) -> f64 {
    tiles.div_ceil(sms.max(1)) as f64 * (k_tiles as f64 + WGMMA_SPLIT_UNIT_FILL)
}

/// Modelled critical path (stage-times) of the stream-K schedule with `tail` tiles spread over `sms`
/// CTAs (the rest whole, ceil((tiles - tail) / sms) waves): whole waves + the range length ceil(tail x
/// k_tiles / sms) + a fill per segment (about range / k_tiles + 1 of them) + hand-offs (one partial
/// written, and an owner reads about k_tiles / range of them).
pub fn wgmma_stream_k_cost(tiles: u64, k_tiles: u64, sms: u64, tail: u64) -> f64 {
    let sms = sms.max(1);
    let tail = tail.min(tiles);
    let k = k_tiles.max(1) as f64;
    let range = (tail * k_tiles) as f64 / sms as f64;
    let reads = if range > 0.0 { (k / range).ceil() } else { 0.0 };
    let segments = (range / k).ceil() + 1.0;
    (tiles - tail).div_ceil(sms) as f64 * (k + WGMMA_SPLIT_UNIT_FILL)
        + range.ceil()
        + WGMMA_SPLIT_UNIT_FILL * segments
        + WGMMA_SK_HANDOFF * (1.0 + reads)
}

/// The stream-K tail the cost rule likes best, as (tail tiles, modelled cost): every tile when
/// tiles <= sms; else the partial last wave (tiles % sms) or that plus one full wave (never more: a
/// full-grid stream-K would run 132 CTAs where the balanced grid runs e.g. 128, which measured
/// 1.7-4.4 % faster on the H200).
pub fn wgmma_stream_k_tail(tiles: u64, k_tiles: u64, sms: u64) -> (u64, f64) {
    let sms = sms.max(1);
    if tiles <= sms {
        return (tiles, wgmma_stream_k_cost(tiles, k_tiles, sms, tiles));
    }
    let r = tiles % sms;
    let mut best = (r + sms, wgmma_stream_k_cost(tiles, k_tiles, sms, r + sms));
    if r >= 1 {
        let c = wgmma_stream_k_cost(tiles, k_tiles, sms, r);
        if c < best.1 {
            best = (r, c);
        }
    }
    best
}

/// The schedule of a wgmma_sp call (production tile and mainloop) with `tiles` 256 x 128 tiles,
/// `k_tiles` 128-k stages, `rows` x `n` outputs on `sms` SMs. Forced policies first (Force128 ->
/// Bm128; StreamK On / DpTiles -> StreamK); then (split policy Auto; a forced split count keeps its
/// split, "off" its whole tiles) the 128-row tile where the call has at least WGMMA_BM128_MIN_ROWS rows,
/// twice the tiles still fit in one wave (2 tiles <= sms) and its modelled time (WGMMA_BM128_STAGE x
/// k_tiles + UNIT_FILL) is below split-k's best (`wgmma_split_plan`, `wgmma_split_cost`) and the whole-tile
/// one; else split-k
/// where `wgmma_split_plan` says so; else, for calls with more 128-row tiles
/// than SMs, the 128-row tile where its wave count x WGMMA_BM128_WAVE_STAGE is below the 256-row tile's
/// (a partial last wave that the 128-row tile packs tighter: 1024 x 14336 x 4096, 448 tiles = 3.4 waves
/// -> 7 x 0.55 = 3.85 < 4); else whole tiles. The auto rule never
/// picks stream-K: on the H200 it measured slower than whole tiles on every shape tried
/// (0.79-0.96x; e.g. 2048 x 11008 x 4096 fp16 182.7 vs 174.6 us), so it stays opt-in.
/// Measured (H200, GPU time, 5 paired rounds, bf16 / fp16, us,
/// bench/results/sparse24_schedules_20261130T1333/; previous schedule -> 128-row tile):
/// 256 x 4096 x 4096 27.8 -> 20.2 / 27.9 -> 20.5 (was split 3), 512 x 4096 x 4096 32.6 -> 21.2 (whole
/// tiles), 384 x 4096 x 4096 28.9 -> 20.7 (split 2), 128 x 11008 x 4096 36.1 -> 26.7 (split 3), 128 x 14336
/// x 4096 37.2 -> 29.3 (whole), 512 x 4096 x 11008 52.1 -> 44.8 / 52.6 -> 45.0 (fused split 2), 1024^3
/// 13.3 -> 9.7 (whole).
#[allow(clippy::too_many_arguments)]
pub fn wgmma_schedule(
    tiles: u64,
    k_tiles: u64,
    rows: u64,
    n: u64,
    sms: u64,
    split: SplitPolicy,
    tile: TilePolicy,
    stream_k: StreamKPolicy,
) -> WgmmaSchedule {
    let sms = sms.max(1);
    if tile == TilePolicy::Force128 {
        return WgmmaSchedule::Bm128;
    }
    let feature_tiles = n.div_ceil(256).max(1);
    if let TilePolicy::Banded(h) = tile {
        if feature_tiles >= 2 {
            return WgmmaSchedule::Banded { head_tiles: h.min(feature_tiles - 1) };
        }
    }
    let sk = |dp: u64| WgmmaSchedule::StreamK { dp_tiles: dp, grid: sms };
    match stream_k {
        StreamKPolicy::On if tiles >= 1 => return sk(tiles - wgmma_stream_k_tail(tiles, k_tiles, sms).0),
        StreamKPolicy::DpTiles(d) if tiles >= 1 => return sk(d.min(tiles - 1)),
        _ => {}
    }
    let plan = wgmma_split_plan(tiles, k_tiles, rows, n, sms, split);
    if tile == TilePolicy::Auto && split == SplitPolicy::Auto && rows >= WGMMA_BM128_MIN_ROWS && tiles >= 1 && 2 * tiles <= sms {
        let bm128 = WGMMA_BM128_STAGE * k_tiles as f64 + WGMMA_SPLIT_UNIT_FILL;
        let other = match plan {
            Some(p) => wgmma_split_cost(tiles, k_tiles, rows, n, sms, p.splits as u64),
            None => wgmma_tiles_cost(tiles, k_tiles, sms),
        };
        if bm128 < other {
            return WgmmaSchedule::Bm128;
        }
    }
    let waves = |t: u64| t.div_ceil(sms) as f64;
    if tile == TilePolicy::Auto
        && split == SplitPolicy::Auto
        && plan.is_none()
        && rows >= WGMMA_BM128_MIN_ROWS
        && 2 * tiles > sms
        && waves(2 * tiles) * WGMMA_BM128_WAVE_STAGE < waves(tiles)
    {
        return WgmmaSchedule::Bm128;
    }
    if tile == TilePolicy::Auto && split == SplitPolicy::Auto && plan.is_none() && rows >= WGMMA_BM128_MIN_ROWS && tiles > sms {
        let row_tiles = tiles / feature_tiles;
        if let Some((head, cost)) = wgmma_banded_plan(feature_tiles, row_tiles, k_tiles, sms) {
            if cost < WGMMA_BAND_MARGIN * wgmma_tiles_cost(tiles, k_tiles, sms) {
                return WgmmaSchedule::Banded { head_tiles: head };
            }
        }
    }
    match plan {
        Some(p) => WgmmaSchedule::Split(p),
        None => WgmmaSchedule::Tiles,
    }
}

/// The split-k partial-product kernel (`epilogue` 2, activation None: the reduce step applies
/// bias and activation) at the production tile.
pub fn wgmma_split_config(dtype: DType, arch: Arch) -> Sparse24WgmmaConfig {
    wgmma_config_variant(Activation::None, dtype, arch, 2, 1)
}

/// The fused split-k kernels (`epilogue` 3, every dtype and activation) for `arch` (empty below or
/// above Hopper): precompiled; `fuse_split` says when they run.
pub fn wgmma_fused_split_configs(arch: Arch) -> Vec<Sparse24WgmmaConfig> {
    if arch != Arch::Sm90a {
        return Vec::new();
    }
    let mut out = Vec::new();
    for dtype in [DType::F16, DType::BF16] {
        for activation in Activation::ALL {
            out.push(wgmma_config_variant(activation, dtype, arch, 3, 1));
        }
    }
    out
}

/// A wgmma_sp split-k plan: the k of a call is cut into `splits` chunks of `chunk_tiles` 128-k
/// stages (the last may be shorter, none empty); the kernel runs splits x tiles work units.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WgmmaSplit {
    pub splits: u32,
    pub chunk_tiles: u32,
}

/// Whether a split-k wgmma_sp call fuses the reduce into the kernel (Epi 3: the chunks of a tile
/// pass a running fp32 sum in chunk order, the last one runs the epilogue; the `sparse24_splitk_fuse`
/// knob).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FusePolicy {
    /// fuse where it measured faster: `splits <= WGMMA_FUSE_MAX_SPLITS` (unset / empty).
    Auto,
    /// always ("1").
    On,
    /// never: partial products + the reduce kernel ("0").
    Off,
}

/// Most chunks `FusePolicy::Auto` fuses. The hand-offs of the running sum are sequential per tile,
/// so fusing pays only for few chunks. Measured on the H200 (bench/NOTES.md, GPU time,
/// 3 paired rounds): 2 chunks (512 x 4096 x 11008) fused 51.7 / 52.3 us vs 55.4 / 56.2 unfused
/// (bf16 / fp16); 3-4 chunks 7-16 % slower fused (256 x 4096 x 4096 / 11008), decode-sized splits
/// up to 2.2x slower.
pub const WGMMA_FUSE_MAX_SPLITS: u32 = 2;

/// Whether a call split into `splits` chunks runs the fused kernel under `policy`.
pub fn fuse_split(splits: u32, policy: FusePolicy) -> bool {
    match policy {
        FusePolicy::On => true,
        FusePolicy::Off => false,
        FusePolicy::Auto => splits <= WGMMA_FUSE_MAX_SPLITS,
    }
}

/// How split-k is chosen for wgmma_sp (the `sparse24_splitk` knob).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitPolicy {
    /// `wgmma_split_plan`'s cost rule (unset / "auto").
    Auto,
    /// never split ("0" / "off").
    Off,
    /// exactly this many chunks where k has that many stages (a number >= 1; 1 = off).
    Force(u32),
}

/// Shortest chunk the rule makes (128-k stages): a unit of fewer stages is mostly pipeline fill.
pub const WGMMA_SPLIT_MIN_CHUNK: u64 = 4;
/// Most chunks the rule makes.
pub const WGMMA_SPLIT_MAX: u64 = 16;
/// Cost-model constants of `wgmma_split_plan` (in stage-times, one stage = 128 k of a 256 x 128
/// tile, ~0.8-1.0 us on an H200 SM): the fixed cost of splitting (reduce launch + its tail) and
/// the workspace bytes (written by the kernel and read by the reduce, counted twice) per
/// stage-time.
pub const WGMMA_SPLIT_FIXED_STAGES: f64 = 4.0;
/// Pipeline fill per work unit (stage-times): the first stage's loads wait for memory.
pub const WGMMA_SPLIT_UNIT_FILL: f64 = 2.0;
pub const WGMMA_SPLIT_WS_BYTES_PER_STAGE: f64 = 2.4e6;

/// `wgmma_split_plan`'s modelled time (stage-times) of `s` chunks (s = 1: unsplit):
/// waves(s) x (chunk(s) + UNIT_FILL) + [s > 1] (FIXED + 2 x s x rows x n_ws x 4 / WS_BYTES_PER_STAGE).
pub fn wgmma_split_cost(tiles: u64, k_tiles: u64, rows: u64, n: u64, sms: u64, s: u64) -> f64 {
    let s = s.max(1);
    let n_ws = n.div_ceil(4) * 4;
    let waves = (s * tiles).div_ceil(sms.max(1)) as f64;
    let main = waves * (k_tiles.div_ceil(s) as f64 + WGMMA_SPLIT_UNIT_FILL);
    if s == 1 {
        main
    } else {
        let ws = 2.0 * (s * rows * n_ws * 4) as f64;
        main + WGMMA_SPLIT_FIXED_STAGES + ws / WGMMA_SPLIT_WS_BYTES_PER_STAGE
    }
}

/// The split-k plan for a wgmma_sp call of `tiles` tiles (256 w rows x 128 tokens), `k_tiles`
/// 128-k stages, `rows` x `n` outputs on `sms` SMs, or None (run unsplit).
/// Auto: the split count S minimising  waves(S) x (chunk(S) + UNIT_FILL) + [S > 1] (FIXED + 2 x S
/// x rows x n_ws x 4 / WS_BYTES_PER_STAGE)  with waves(S) = ceil(S x tiles / sms) and chunk(S) =
/// ceil(k_tiles / S) >= WGMMA_SPLIT_MIN_CHUNK, S <= WGMMA_SPLIT_MAX (ties: fewer chunks), i.e. a
/// split only where it shortens the critical path by more than the workspace traffic costs
/// (decode- and prefill-sized calls whose tiles leave SMs idle). Force(n): n chunks (at most
/// k_tiles). The chunk count is then made exact: S = ceil(k_tiles / chunk), so no chunk is empty.
pub fn wgmma_split_plan(
    tiles: u64,
    k_tiles: u64,
    rows: u64,
    n: u64,
    sms: u64,
    policy: SplitPolicy,
) -> Option<WgmmaSplit> {
    if tiles == 0 || k_tiles < 2 || sms == 0 {
        return None;
    }
    let exact = |s: u64| {
        let chunk = k_tiles.div_ceil(s);
        WgmmaSplit { splits: k_tiles.div_ceil(chunk) as u32, chunk_tiles: chunk as u32 }
    };
    let s = match policy {
        SplitPolicy::Off => return None,
        SplitPolicy::Force(n) => (n as u64).min(k_tiles),
        SplitPolicy::Auto => {
            let cost = |s: u64| wgmma_split_cost(tiles, k_tiles, rows, n, sms, s);
            let max_s = WGMMA_SPLIT_MAX.min(k_tiles / WGMMA_SPLIT_MIN_CHUNK).max(1);
            let mut best = (1, cost(1));
            for s in 2..=max_s {
                let c = cost(s);
                if c < best.1 {
                    best = (s, c);
                }
            }
            best.0
        }
    };
    let plan = exact(s.max(1));
    (plan.splits >= 2).then_some(plan)
}

