//! 2:4 sparse kernels: configurations (template arguments, launch shape, shared memory) and
//! the tile heuristic. Pure functions, unit-tested on CPU.
//!
//! `Sparse24MatmulConfig` instantiates
//! `ferroattn::sparse24_matmul_sm80<BlockN, BlockR, WarpsN, WarpsR, Stages, Act, VecX, T>`
//! (kernels/sparse24/mma_sp.cuh): out = act(x @ w.T + bias) with w (n, k) 2:4-compressed.
//! BlockN w rows (output features) × BlockR x rows per block, k tiles of 64 (one metadata
//! unit). `Sparse24WgmmaConfig` instantiates
//! `ferroattn::sparse24_matmul_wgmma<T, BN, Stages, Act, BM, Epi, Sets>` (kernels/sparse24/wgmma_sp.cuh, sm_90a:
//! wgmma.mma_async.sp, same compressed layout). `Sparse24CompressConfig` instantiates the
//! compress / decompress kernels of kernels/sparse24/compress.cuh.

use crate::dtype::DType;
use crate::arch::Arch;
use crate::ops::gemm::problem::Activation;
use crate::ops::sparse24::host::TILE_M;

/// Logical k per pipeline stage (one metadata unit = two mma.sp k32 steps).
pub const BLOCK_K: u32 = 64;

/// Block tile of the matmul kernel: (block_n, block_r, warps_n, warps_r, stages).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tile {
    pub block_n: u32,
    pub block_r: u32,
    pub warps_n: u32,
    pub warps_r: u32,
    pub stages: u32,
}

impl Tile {
    /// Parse "block_n,block_r,warps_n,warps_r,stages" (the FERROATTN_SPARSE24_TILE override
    /// used by experiments); None when malformed or not a valid tile.
    pub fn parse(text: &str) -> Option<Tile> {
        let v: Vec<u32> = text
            .split(',')
            .map(|s| s.trim().parse().ok())
            .collect::<Option<_>>()?;
        let [block_n, block_r, warps_n, warps_r, stages] = v[..] else {
            return None;
        };
        let t = Tile {
            block_n,
            block_r,
            warps_n,
            warps_r,
            stages,
        };
        t.valid().then_some(t)
    }

    /// The constraints mma_sp.cuh static_asserts: warp tiles of whole m16 (w rows) and n8
    /// (x rows) mma tiles, block_n dividing the row padding of the compressed layout, at
    /// most 8 warps, 2..=8 stages.
    pub fn valid(&self) -> bool {
        let warps = self.warps_n * self.warps_r;
        self.warps_n > 0
            && self.warps_r > 0
            && warps <= 8
            && self.block_n.is_multiple_of(16 * self.warps_n)
            && self.block_r.is_multiple_of(8 * self.warps_r)
            && self.block_n > 0
            && (TILE_M as u32).is_multiple_of(self.block_n)
            && self.block_r > 0
            && self.block_r <= 256
            && (2..=8).contains(&self.stages)
    }
}

/// One specialisation of the sparse matmul kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Sparse24MatmulConfig {
    pub tile: Tile,
    pub activation: Activation,
    /// x rows are 16-byte aligned and k % 8 == 0: x tiles move with 16-byte cp.async;
    /// otherwise element by element.
    pub vec_x: bool,
    pub dtype: DType,
    pub arch: Arch,
}

impl Sparse24MatmulConfig {
    pub const KERNEL: &'static str = "ferroattn::sparse24_matmul_sm80";

    pub fn name_expression(&self) -> String {
        let t = &self.tile;
        format!(
            "{}<{}, {}, {}, {}, {}, {}, {}, {}>",
            Self::KERNEL,
            t.block_n,
            t.block_r,
            t.warps_n,
            t.warps_r,
            t.stages,
            self.activation.code(),
            self.vec_x,
            self.dtype.cuda_type()
        )
    }

    pub fn threads(&self) -> u32 {
        self.tile.warps_n * self.tile.warps_r * 32
    }

    /// Dynamic shared memory (bytes): `stages` × (values tile block_n × 32 + x tile
    /// block_r × 64 elements of 2 bytes + block_n / 16 metadata units of 128 bytes), at least
    /// the epilogue's staging tile block_r × (block_n + 8) × 2 (mma_sp.cuh static_asserts the
    /// same formula).
    pub fn smem_bytes(&self) -> u32 {
        let t = &self.tile;
        let stage =
            t.block_n * (BLOCK_K / 2) * 2 + t.block_r * BLOCK_K * 2 + (t.block_n / 16) * 128;
        let epilogue = t.block_r * (t.block_n + 8) * 2;
        (t.stages * stage).max(epilogue)
    }
}

/// The tiles of the 16-byte x path, largest first: 128 × 128 (4 warps of 64 × 64: each values
/// fragment feeds 8 mma, each x fragment 4; 4 stages = 100 KiB), 64 × 64, 32 × 32 and
/// 32 × 16 (few rows: the weight stream dominates, small blocks along n and deep pipelines
/// keep more of it in flight).
pub const VEC_TILES: [Tile; 4] = [
    Tile {
        block_n: 128,
        block_r: 128,
        warps_n: 2,
        warps_r: 2,
        stages: 4,
    },
    Tile {
        block_n: 64,
        block_r: 64,
        warps_n: 2,
        warps_r: 2,
        stages: 6,
    },
    Tile {
        block_n: 32,
        block_r: 32,
        warps_n: 2,
        warps_r: 1,
        stages: 8,
    },
    Tile {
        block_n: 32,
        block_r: 16,
        warps_n: 2,
        warps_r: 1,
        stages: 8,
    },
];

/// Blocks of `tile` one SM holds at once on `arch` (shared memory or threads; the per-SM
/// shared memory taken as the per-block maximum + 1 KiB, as on sm_80/86/89/90).
pub fn resident_blocks(tile: &Tile, arch: Arch) -> u32 {
    let c = Sparse24MatmulConfig {
        tile: *tile,
        activation: Activation::None,
        vec_x: true,
        dtype: DType::F16,
        arch,
    };
    let by_smem = (arch.max_smem_per_block() + 1024) / c.smem_bytes().max(1);
    let by_threads = 2048 / c.threads();
    by_smem.min(by_threads).max(1)
}

/// Tile for a call with `rows` x rows and `n_pad` (padded) w rows on a GPU with `sm_count`
/// SMs: the largest tile whose block rows fit the call (128 only above 64 rows, 64 above 32,
/// 32 above 16) and whose grid fills at least 3/4 of the GPU (of its resident block slots for
/// the 64- and 128-row tiles, of its SMs for the weight-streaming 16- and 32-row tiles); else
/// the smallest that fits. (On the H200, bench/NOTES.md "2:4": 128 × 128 tiles
/// at 32 blocks ran rows = 128, n = 4096 at 0.23x dense.)
pub fn tile_for(rows: u64, n_pad: u64, sm_count: u32, arch: Arch) -> Tile {
    let fits = |t: &Tile| rows > (t.block_r as u64) / 2 || t.block_r == 16;
    let allowed: Vec<Tile> = VEC_TILES.iter().copied().filter(fits).collect();
    for t in &allowed {
        let blocks = rows.div_ceil(t.block_r as u64) * (n_pad / t.block_n as u64);
        // compute-bound tiles want every resident slot busy; the small (weight-streaming)
        // tiles one block per SM
        let per_sm = if t.block_r > 32 {
            resident_blocks(t, arch) as u64
        } else {
            1
        };
        if 4 * blocks >= 3 * sm_count as u64 * per_sm {
            return *t;
        }
    }
    *allowed.last().expect("the 16-row tile always fits")
}

/// The tile of the element-wise x path (odd k or unaligned rows).
pub const SCALAR_X_TILE: Tile = Tile {
    block_n: 64,
    block_r: 64,
    warps_n: 2,
    warps_r: 2,
    stages: 4,
};

/// The configuration one call runs with (`tile`: an override, else the heuristic).
#[allow(clippy::too_many_arguments)]
pub fn matmul_config(
    rows: u64,
    n_pad: u64,
    sm_count: u32,
    activation: Activation,
    vec_x: bool,
    dtype: DType,
    arch: Arch,
    tile: Option<Tile>,
) -> Sparse24MatmulConfig {
    let tile = tile.unwrap_or(if vec_x {
        tile_for(rows, n_pad, sm_count, arch)
    } else {
        SCALAR_X_TILE
    });
    let mut c = Sparse24MatmulConfig {
        tile,
        activation,
        vec_x,
        dtype,
        arch,
    };
    while c.smem_bytes() > arch.max_smem_per_block() && c.tile.stages > 2 {
        c.tile.stages -= 1;
    }
    c
}

/// Every configuration `matmul_config` can return without an override: what precompile builds.
pub fn matmul_production_configs(arch: Arch) -> Vec<Sparse24MatmulConfig> {
    let mut out = Vec::new();
    for dtype in [DType::F16, DType::BF16] {
        for activation in Activation::ALL {
            for t in VEC_TILES {
                out.push(matmul_config(
                    0,
                    0,
                    0,
                    activation,
                    true,
                    dtype,
                    arch,
                    Some(t),
                ));
            }
            out.push(matmul_config(
                1, 128, 1, activation, false, dtype, arch, None,
            ));
        }
    }
    out
}

/// Which kernel of compress.cuh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CompressKind {
    Compress,
    Decompress,
}

/// One specialisation of `ferroattn::sparse24_compress<T>` / `ferroattn::sparse24_decompress<T>`:
/// one thread per metadata word (rows g and g + 8 of a 16-row tile, 16 columns), 256 threads
/// per block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Sparse24CompressConfig {
    pub kind: CompressKind,
    pub dtype: DType,
    pub arch: Arch,
}

impl Sparse24CompressConfig {
    pub const THREADS: u32 = 256;

    pub fn kernel(&self) -> &'static str {
        match self.kind {
            CompressKind::Compress => "ferroattn::sparse24_compress",
            CompressKind::Decompress => "ferroattn::sparse24_decompress",
        }
    }

    pub fn name_expression(&self) -> String {
        format!("{}<{}>", self.kernel(), self.dtype.cuda_type())
    }
}

/// Every compress / decompress configuration for `arch`.
pub fn compress_production_configs(arch: Arch) -> Vec<Sparse24CompressConfig> {
    [CompressKind::Compress, CompressKind::Decompress]
        .into_iter()
        .flat_map(|kind| {
            [DType::F16, DType::BF16].map(|dtype| Sparse24CompressConfig { kind, dtype, arch })
        })
        .collect()
}

/// One specialisation of `ferroattn::sparse24_matmul_wgmma<T, BN, Stages, Act>`
/// (kernels/sparse24/wgmma_sp.cuh, sm_90a only): wgmma.mma_async.sp, `block_n` w rows (two
/// consumer warpgroups of block_n / 2, one or two m64 blocks each) × `block_r` x rows per tile,
/// 128 logical k per TMA stage, 384 threads (producer warpgroup + 2 consumers), persistent grid
/// of min(tiles, SMs) CTAs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Sparse24WgmmaConfig {
    /// Tokens (x rows) per tile: the wgmma N (128, 192 or 256); the kernel's `BN`.
    pub block_r: u32,
    /// w rows (output features) per tile: 128 or 256; the kernel's `BM`.
    pub block_n: u32,
    pub stages: u32,
    pub activation: Activation,
    pub dtype: DType,
    pub arch: Arch,
    /// Epilogue form, the kernel's `Epi`: 0 = stores straight from the accumulator registers,
    /// 1 = staged through shared memory (stmatrix .trans, 16-byte coalesced stores; +16.1 KiB),
    /// 2 = split-k partial products (raw fp32 to a workspace; activation None; see
    /// `wgmma_split_plan`), 3 = split-k with the reduce fused (chunks pass a running sum through
    /// a workspace slot per tile; the last runs the staged epilogue; opt-in, see
    /// `wgmma_fused_split_configs`), 4 = stream-K tail (whole tiles, then the remaining tiles'
    /// stages spread over the CTAs; staged epilogue; see `WgmmaSchedule::StreamK`).
    pub epilogue: u32,
    /// Mainloop form, the kernel's `Sets` (metadata register sets): 1 = wgmma.wait_group 0 after
    /// every stage (production); 2 = two alternating metadata register sets and wait_group 1 (one
    /// stage of wgmmas stays in flight across the stage boundary; opt-in until measured,
    /// $FERROATTN_WGMMA_SP_MAINLOOP=pipe). Same shared memory.
    pub meta_sets: u32,
}

impl Sparse24WgmmaConfig {
    pub const KERNEL: &'static str = "ferroattn::sparse24_matmul_wgmma";
    pub const THREADS: u32 = 384;

    pub fn name_expression(&self) -> String {
        // Epi = 0 and Sets = 1 are the template defaults: those name expressions stay the 5- / 6-
        // argument ones (Sets = 2 spells Epi out)
        let epi = if self.meta_sets != 1 {
            format!(", {}, {}", self.epilogue, self.meta_sets)
        } else if self.epilogue == 0 {
            String::new()
        } else {
            format!(", {}", self.epilogue)
        };
        format!(
            "{}<{}, {}, {}, {}, {}{}>",
            Self::KERNEL,
            self.dtype.cuda_type(),
            self.block_r,
            self.stages,
            self.activation.code(),
            self.block_n,
            epi
        )
    }

    /// Dynamic shared memory (bytes): `stages` × (values block_n × 128 B + x 2 × block_r × 128 B +
    /// metadata block_n × 16 B) + 2 × `stages` mbarriers + 1 KiB alignment slack
    /// (`sparse24_wgmma_smem_bytes` in wgmma_sp.cuh, which static_asserts <= 227 KiB).
    /// The staged epilogue (`epilogue` 1) adds 128 B of alignment + two 8 KiB buffers.
    pub fn smem_bytes(&self) -> u32 {
        self.stages * (128 * self.block_n + 256 * self.block_r + 16 * self.block_n)
            + 16 * self.stages
            + 1024
            + if self.epilogue == 1 || self.epilogue == 3 || self.epilogue == 4 {
                128 + 2 * 8192
            } else {
                0
            }
    }
}

/// The wgmma_sp configuration for a call: 256 w rows × 128 tokens, 3 stages (205 KiB of shared
/// memory): the fastest of the four tiles measured on the H200 (bench/NOTES.md "2:4 wgmma_sp":
/// 1.24× / 1.31× torch dense at 8192³ / 4096×11008×4096 bf16; 128 × 128 × 4 stages
/// 0.91× / 1.04×).
pub fn wgmma_config(activation: Activation, dtype: DType, arch: Arch) -> Sparse24WgmmaConfig {
    wgmma_config_epilogue(activation, dtype, arch, WGMMA_EPILOGUE_DEFAULT)
}

/// `wgmma_config` with an explicit epilogue form (0 direct, 1 staged; see
/// `Sparse24WgmmaConfig::epilogue`) and the production mainloop (`WGMMA_META_SETS_DEFAULT`).
pub fn wgmma_config_epilogue(
    activation: Activation,
    dtype: DType,
    arch: Arch,
    epilogue: u32,
) -> Sparse24WgmmaConfig {
    wgmma_config_variant(activation, dtype, arch, epilogue, WGMMA_META_SETS_DEFAULT)
}

/// `wgmma_config` with an explicit epilogue form and mainloop form (`meta_sets` 1: wait_group 0
/// per stage, 2: pipelined; see `Sparse24WgmmaConfig::meta_sets`).
pub fn wgmma_config_variant(
    activation: Activation,
    dtype: DType,
    arch: Arch,
    epilogue: u32,
    meta_sets: u32,
) -> Sparse24WgmmaConfig {
    Sparse24WgmmaConfig {
        block_r: 128,
        block_n: 256,
        stages: 3,
        activation,
        dtype,
        arch,
        epilogue,
        meta_sets,
    }
}

/// The mainloop form production uses when $FERROATTN_WGMMA_SP_MAINLOOP is unset: 1 (wait_group 0
/// per stage). The pipelined form (2) is spill-free at the production tile (0 spills, 0 metadata
/// hazards in SASS) and correct, but measured 0-4 % slower on the H200
/// (bench/results/sparse24_ab_pipe_nvidia-h200_20261130T0628.json): it stays opt-in.
pub const WGMMA_META_SETS_DEFAULT: u32 = 1;

/// Parse $FERROATTN_WGMMA_SP_MAINLOOP: unset / empty -> the default, "wait0" or "1" -> 1, "pipe"
/// or "2" -> 2; anything else None (the caller raises an ArgumentError).
pub fn parse_wgmma_mainloop(value: Option<&str>) -> Option<u32> {
    match value.map(str::trim) {
        None | Some("") => Some(WGMMA_META_SETS_DEFAULT),
        Some("wait0") | Some("1") => Some(1),
        Some("pipe") | Some("2") => Some(2),
        Some(_) => None,
    }
}

/// The epilogue form production uses when $FERROATTN_WGMMA_SP_EPILOGUE is unset: 1 (staged). H200
/// same-process A/B, 2026-11-30 05:38: staged / direct 1.05-1.10x on every k = 4096 LLM shape
/// (bf16 8192x11008x4096: 966 vs 884 dense-equivalent TFLOP/s), 1.03x at 8192^3, 0.99-1.01x at
/// k = 11008; outputs bitwise equal (bench/results/sparse24_ab_epilogue_nvidia-h200_20261130T053800.json).
pub const WGMMA_EPILOGUE_DEFAULT: u32 = 1;

/// Parse $FERROATTN_WGMMA_SP_EPILOGUE: unset / empty -> the default, "direct" or "0" -> 0,
/// "smem" / "staged" or "1" -> 1; anything else None (the caller raises an ArgumentError).
pub fn parse_wgmma_epilogue(value: Option<&str>) -> Option<u32> {
    match value.map(str::trim) {
        None | Some("") => Some(WGMMA_EPILOGUE_DEFAULT),
        Some("direct") | Some("0") => Some(0),
        Some("smem") | Some("staged") | Some("1") => Some(1),
        Some(_) => None,
    }
}

/// The opt-in pipelined-mainloop configurations (`meta_sets` 2, staged epilogue; every dtype and
/// activation) for `arch`: not precompiled (NVRTC builds one on its first call), but held to the
/// same no-spill rule by the sparse24 tests.
pub fn wgmma_pipelined_configs(arch: Arch) -> Vec<Sparse24WgmmaConfig> {
    if arch != Arch::Sm90a {
        return Vec::new();
    }
    let mut out = Vec::new();
    for dtype in [DType::F16, DType::BF16] {
        for activation in Activation::ALL {
            out.push(wgmma_config_variant(activation, dtype, arch, 1, 2));
        }
    }
    out
}

/// Every configuration `wgmma_config` / `wgmma_split_config` / the fused split / `wgmma_schedule`'s
/// 128-row tile return for `arch` (none below or above Hopper: wgmma is sm_90a
/// only): what precompile builds (20 + 2 split-k partial-product kernels + 10 fused split-k kernels +
/// 10 BM-128 kernels).
pub fn wgmma_production_configs(arch: Arch) -> Vec<Sparse24WgmmaConfig> {
    if arch != Arch::Sm90a {
        return Vec::new();
    }
    let mut out = Vec::new();
    for dtype in [DType::F16, DType::BF16] {
        for activation in Activation::ALL {
            for epilogue in [0, 1] {
                out.push(wgmma_config_epilogue(activation, dtype, arch, epilogue));
            }
        }
        out.push(wgmma_split_config(dtype, arch));
    }
    out.extend(wgmma_fused_split_configs(arch));
    for dtype in [DType::F16, DType::BF16] {
        for activation in Activation::ALL {
            out.push(wgmma_bm128_config(activation, dtype, arch));
        }
    }
    out
}

/// The opt-in stream-K kernels (`epilogue` 4, every dtype and activation; $FERROATTN_WGMMA_SP_STREAMK
/// "on" / "dp:N") for `arch`: not precompiled (NVRTC builds one on its first call; the auto rule
/// never picks them, see `wgmma_schedule`), held to the no-spill rule by the sparse24 tests.
pub fn wgmma_stream_k_configs(arch: Arch) -> Vec<Sparse24WgmmaConfig> {
    if arch != Arch::Sm90a {
        return Vec::new();
    }
    let mut out = Vec::new();
    for dtype in [DType::F16, DType::BF16] {
        for activation in Activation::ALL {
            out.push(wgmma_stream_k_config(activation, dtype, arch));
        }
    }
    out
}

/// The 128 w-row x 128 token tile (staged epilogue, 4 stages: 222 400 B of shared memory) that
/// `wgmma_schedule` picks when the 256-row tiles would leave most SMs idle (H200: 0.91x / 1.04x
/// torch dense per SM at 8192^3 / 4096 x 11008 x 4096, against 1.24x / 1.31x for 256 x 128: worse per
/// SM, but twice the CTAs).
pub fn wgmma_bm128_config(activation: Activation, dtype: DType, arch: Arch) -> Sparse24WgmmaConfig {
    Sparse24WgmmaConfig {
        block_n: 128,
        stages: 4,
        ..wgmma_config_variant(activation, dtype, arch, 1, 1)
    }
}

/// The stream-K tail kernel (`epilogue` 4: whole tiles first, then the tail's stages spread evenly
/// over the CTAs; staged epilogue) at the production tile.
pub fn wgmma_stream_k_config(activation: Activation, dtype: DType, arch: Arch) -> Sparse24WgmmaConfig {
    wgmma_config_variant(activation, dtype, arch, 4, 1)
}

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

/// $FERROATTN_WGMMA_SP_TILE: which tile wgmma_sp may use.
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

/// Parse $FERROATTN_WGMMA_SP_TILE: unset / empty / "auto" -> Auto, "256" -> Only256, "128" ->
/// Force128, "band:H" (H >= 1) -> Banded(H); anything else None (the caller raises an ArgumentError).
pub fn parse_wgmma_tile(value: Option<&str>) -> Option<TilePolicy> {
    match value.map(str::trim) {
        None | Some("") | Some("auto") => Some(TilePolicy::Auto),
        Some("256") => Some(TilePolicy::Only256),
        Some("128") => Some(TilePolicy::Force128),
        Some(v) => v
            .strip_prefix("band:")
            .and_then(|h| h.trim().parse::<u64>().ok())
            .filter(|&h| h >= 1)
            .map(TilePolicy::Banded),
    }
}

/// $FERROATTN_WGMMA_SP_STREAMK: when wgmma_sp runs the stream-K tail.
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

/// Parse $FERROATTN_WGMMA_SP_STREAMK: unset / empty / "auto" -> Auto, "off" -> Off, "on" -> On,
/// "dp:N" (N >= 0) -> DpTiles(N); anything else None (the caller raises an ArgumentError).
pub fn parse_wgmma_stream_k(value: Option<&str>) -> Option<StreamKPolicy> {
    match value.map(str::trim) {
        None | Some("") | Some("auto") => Some(StreamKPolicy::Auto),
        Some("off") => Some(StreamKPolicy::Off),
        Some("on") => Some(StreamKPolicy::On),
        Some(v) => v
            .strip_prefix("dp:")
            .and_then(|n| n.trim().parse::<u64>().ok())
            .map(StreamKPolicy::DpTiles),
    }
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
/// pass a running fp32 sum in chunk order, the last one runs the epilogue; $FERROATTN_SPARSE24_SPLITK_FUSE,
/// `parse_wgmma_split_fuse`).
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

/// Parse $FERROATTN_SPARSE24_SPLITK_FUSE: unset / empty -> Auto, "1" -> On, "0" -> Off; anything
/// else None (the caller raises an ArgumentError).
pub fn parse_wgmma_split_fuse(value: Option<&str>) -> Option<FusePolicy> {
    match value.map(str::trim) {
        None | Some("") => Some(FusePolicy::Auto),
        Some("1") => Some(FusePolicy::On),
        Some("0") => Some(FusePolicy::Off),
        Some(_) => None,
    }
}

/// Whether a call split into `splits` chunks runs the fused kernel under `policy`.
pub fn fuse_split(splits: u32, policy: FusePolicy) -> bool {
    match policy {
        FusePolicy::On => true,
        FusePolicy::Off => false,
        FusePolicy::Auto => splits <= WGMMA_FUSE_MAX_SPLITS,
    }
}

/// How split-k is chosen for wgmma_sp ($FERROATTN_SPARSE24_SPLITK, `parse_wgmma_split`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitPolicy {
    /// `wgmma_split_plan`'s cost rule (unset / "auto").
    Auto,
    /// never split ("0" / "off").
    Off,
    /// exactly this many chunks where k has that many stages (a number >= 1; 1 = off).
    Force(u32),
}

/// Parse $FERROATTN_SPARSE24_SPLITK: unset / empty / "auto" -> Auto, "0" / "off" -> Off, an
/// integer >= 1 -> Force; anything else None (the caller raises an ArgumentError).
pub fn parse_wgmma_split(value: Option<&str>) -> Option<SplitPolicy> {
    match value.map(str::trim) {
        None | Some("") | Some("auto") => Some(SplitPolicy::Auto),
        Some("0") | Some("off") => Some(SplitPolicy::Off),
        Some(v) => v.parse::<u32>().ok().filter(|&n| n >= 1).map(SplitPolicy::Force),
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tuning::attention::tests::assert_fits_smem;

    #[test]
    fn heuristic_tiles_are_valid_and_fit() {
        for arch in Arch::ALL {
            for c in matmul_production_configs(arch) {
                assert!(c.tile.valid(), "{:?}", c.tile);
                assert_fits_smem(&c);
            }
        }
        assert_eq!(matmul_production_configs(Arch::Sm90a).len(), 2 * 5 * 5);
    }

    #[test]
    fn tiles_fill_the_gpu() {
        let h = |rows, n| tile_for(rows, n, 132, Arch::Sm90a);
        assert_eq!(h(1, 4096), VEC_TILES[3]);
        assert_eq!(h(16, 14336), VEC_TILES[3]);
        assert_eq!(h(31, 4096), VEC_TILES[2]);
        assert_eq!(h(16384, 4096), VEC_TILES[0]);
        assert_eq!(h(1024, 4096), VEC_TILES[0], "256 blocks of 264 slots");
        assert_eq!(
            h(128, 4096),
            VEC_TILES[2],
            "128 x 128: 32 blocks; 64 x 64: 128"
        );
        assert_eq!(h(128, 14336), VEC_TILES[1]);
        assert_eq!(
            h(40, 128),
            VEC_TILES[3],
            "nothing fills the GPU: the smallest tile"
        );
        assert_eq!(resident_blocks(&VEC_TILES[0], Arch::Sm90a), 2);
        assert_eq!(resident_blocks(&VEC_TILES[0], Arch::Sm80), 1);
        assert_eq!(resident_blocks(&VEC_TILES[3], Arch::Sm90a), 6);
        // every production configuration is one the heuristic can pick (or the scalar tile)
        let prod = matmul_production_configs(Arch::Sm90a);
        for rows in [1u64, 7, 16, 17, 31, 33, 64, 65, 128, 1000, 4096] {
            for n in [128u64, 4096, 11008, 14336] {
                let c = matmul_config(
                    rows,
                    n,
                    132,
                    Activation::Relu,
                    true,
                    DType::BF16,
                    Arch::Sm90a,
                    None,
                );
                assert!(prod.contains(&c), "{c:?}");
            }
        }
    }

    #[test]
    fn smem_formula() {
        let c = matmul_config(
            4096,
            4096,
            132,
            Activation::None,
            true,
            DType::BF16,
            Arch::Sm90a,
            None,
        );
        // 4 × (128·32·2 + 128·64·2 + 8·128) = 4 × 25600
        assert_eq!(c.smem_bytes(), 102_400);
        // sm_86 (99 KiB): one stage fewer
        let c = matmul_config(
            4096,
            4096,
            84,
            Activation::None,
            true,
            DType::BF16,
            Arch::Sm86,
            None,
        );
        assert_eq!(c.tile.block_n, 128);
        assert_eq!(c.tile.stages, 3);
        // the largest tile: 2 stages of 128 x 256 hold the 256 x (128 + 8) epilogue tile too
        let t = Tile {
            block_n: 128,
            block_r: 256,
            warps_n: 2,
            warps_r: 4,
            stages: 2,
        };
        let c = matmul_config(
            1,
            128,
            132,
            Activation::None,
            true,
            DType::F16,
            Arch::Sm90a,
            Some(t),
        );
        assert_eq!(c.smem_bytes(), 2 * (8192 + 32768 + 1024));
        assert!(c.smem_bytes() >= 256 * 136 * 2);
    }

    #[test]
    fn name_expressions() {
        let c = matmul_config(
            7,
            128,
            108,
            Activation::Silu,
            false,
            DType::F16,
            Arch::Sm80,
            None,
        );
        assert_eq!(
            c.name_expression(),
            "ferroattn::sparse24_matmul_sm80<64, 64, 2, 2, 4, 4, false, __half>"
        );
        let c = Sparse24CompressConfig {
            kind: CompressKind::Decompress,
            dtype: DType::BF16,
            arch: Arch::Sm80,
        };
        assert_eq!(
            c.name_expression(),
            "ferroattn::sparse24_decompress<__nv_bfloat16>"
        );
    }

    #[test]
    fn tile_override_parsing() {
        assert_eq!(
            Tile::parse("128, 64,2,2,3"),
            Some(Tile {
                block_n: 128,
                block_r: 64,
                warps_n: 2,
                warps_r: 2,
                stages: 3
            })
        );
        assert_eq!(Tile::parse("128,64,2,2"), None);
        assert_eq!(Tile::parse("96,64,2,2,3"), None, "block_n must divide 128");
        assert_eq!(Tile::parse("128,64,4,4,3"), None, "at most 8 warps");
        assert_eq!(Tile::parse("a,b,c,d,e"), None);
    }

    #[test]
    fn wgmma_split_rule() {
        let auto = SplitPolicy::Auto;
        // 512 x 4096 x 11008: 64 tiles, 86 stages: two chunks fill 128 SMs
        assert_eq!(
            wgmma_split_plan(64, 86, 512, 4096, 132, auto),
            Some(WgmmaSplit { splits: 2, chunk_tiles: 43 })
        );
        // 256 x 4096 x 11008: 32 tiles -> 4 chunks of 22 (the last 20)
        assert_eq!(
            wgmma_split_plan(32, 86, 256, 4096, 132, auto),
            Some(WgmmaSplit { splits: 4, chunk_tiles: 22 })
        );
        // decode: 16 x 4096 x 4096, 16 tiles x 32 stages -> 8 chunks of 4
        assert_eq!(
            wgmma_split_plan(16, 32, 16, 4096, 132, auto),
            Some(WgmmaSplit { splits: 8, chunk_tiles: 4 })
        );
        // a full wave or more of tiles: no split (8192^3: 2048 tiles; 172 tiles = 1.3 waves)
        assert_eq!(wgmma_split_plan(2048, 64, 8192, 8192, 132, auto), None);
        assert_eq!(wgmma_split_plan(172, 32, 512, 11008, 132, auto), None);
        // 86 tiles x 32 stages: 3 chunks would be 2 waves of 11 stages, but 256 x 11008 fp32
        // partials x 3 cost more than the 10 stages saved
        assert_eq!(wgmma_split_plan(86, 32, 256, 11008, 132, auto), None);
        // too few stages to split
        assert_eq!(wgmma_split_plan(1, 1, 16, 256, 132, auto), None);
        assert_eq!(wgmma_split_plan(1, 7, 16, 256, 132, auto), None);
        assert_eq!(wgmma_split_plan(1, 8, 16, 256, 132, auto), None);
        assert_eq!(wgmma_split_plan(1, 16, 16, 256, 132, auto), Some(WgmmaSplit { splits: 4, chunk_tiles: 4 }));
        // forced and off
        assert_eq!(wgmma_split_plan(16, 32, 16, 4096, 132, SplitPolicy::Off), None);
        assert_eq!(
            wgmma_split_plan(172, 32, 512, 11008, 132, SplitPolicy::Force(3)),
            Some(WgmmaSplit { splits: 3, chunk_tiles: 11 })
        );
        assert_eq!(wgmma_split_plan(16, 32, 16, 4096, 132, SplitPolicy::Force(1)), None);
        // 5 chunks of 32 stages: chunk 7 -> 5 chunks (7,7,7,7,4); 12 of 32: chunk 3 -> 11 chunks
        assert_eq!(
            wgmma_split_plan(16, 32, 16, 4096, 132, SplitPolicy::Force(5)),
            Some(WgmmaSplit { splits: 5, chunk_tiles: 7 })
        );
        assert_eq!(
            wgmma_split_plan(16, 32, 16, 4096, 132, SplitPolicy::Force(12)),
            Some(WgmmaSplit { splits: 11, chunk_tiles: 3 })
        );
        assert_eq!(
            wgmma_split_plan(16, 3, 16, 4096, 132, SplitPolicy::Force(9)),
            Some(WgmmaSplit { splits: 3, chunk_tiles: 1 })
        );
        // every plan: chunks cover the stages exactly, none empty, within the limits
        for tiles in [1u64, 2, 5, 16, 33, 43, 64, 65, 66, 100, 131, 132] {
            for k_tiles in [2u64, 3, 8, 9, 31, 32, 33, 64, 86, 87, 128] {
                for rows in [1u64, 16, 128, 256, 1000] {
                    let policies = [auto, SplitPolicy::Force(2), SplitPolicy::Force(7), SplitPolicy::Force(200)];
                    for policy in policies {
                        if let Some(p) = wgmma_split_plan(tiles, k_tiles, rows, 4096, 132, policy) {
                            let (s, c) = (p.splits as u64, p.chunk_tiles as u64);
                            assert!(s >= 2 && c >= 1, "{p:?}");
                            assert!((s - 1) * c < k_tiles && s * c >= k_tiles, "{tiles} {k_tiles} {p:?}");
                            if policy == auto {
                                assert!(c >= WGMMA_SPLIT_MIN_CHUNK && s <= WGMMA_SPLIT_MAX, "{p:?}");
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(parse_wgmma_split(None), Some(SplitPolicy::Auto));
        assert_eq!(parse_wgmma_split(Some(" auto ")), Some(SplitPolicy::Auto));
        assert_eq!(parse_wgmma_split(Some("off")), Some(SplitPolicy::Off));
        assert_eq!(parse_wgmma_split(Some("0")), Some(SplitPolicy::Off));
        assert_eq!(parse_wgmma_split(Some("3")), Some(SplitPolicy::Force(3)));
        assert_eq!(parse_wgmma_split(Some("-1")), None);
        assert_eq!(parse_wgmma_split(Some("two")), None);
        // the partial-product kernel: Epi 2, no activation, no staging buffer
        let c = wgmma_split_config(DType::F16, Arch::Sm90a);
        assert_eq!(c.name_expression(), "ferroattn::sparse24_matmul_wgmma<__half, 128, 3, 0, 256, 2>");
        assert_eq!(c.smem_bytes(), wgmma_config_epilogue(Activation::None, DType::F16, Arch::Sm90a, 0).smem_bytes());
        assert!(wgmma_production_configs(Arch::Sm90a).contains(&c));
        // fused split-k (Epi 3): every activation, the staged epilogue's buffer, precompiled
        let fused = wgmma_fused_split_configs(Arch::Sm90a);
        assert_eq!(fused.len(), 10);
        assert!(fused.iter().all(|f| f.epilogue == 3 && f.meta_sets == 1));
        let f = fused[0];
        assert_eq!(f.smem_bytes(), Sparse24WgmmaConfig { epilogue: 1, ..f }.smem_bytes());
        assert!(f.name_expression().ends_with(", 256, 3>"), "{}", f.name_expression());
        assert!(wgmma_fused_split_configs(Arch::Sm80).is_empty());
        assert!(fused.iter().all(|f| wgmma_production_configs(Arch::Sm90a).contains(f)));
        // when the fused form runs
        assert_eq!(parse_wgmma_split_fuse(None), Some(FusePolicy::Auto));
        assert_eq!(parse_wgmma_split_fuse(Some(" ")), Some(FusePolicy::Auto));
        assert_eq!(parse_wgmma_split_fuse(Some("1")), Some(FusePolicy::On));
        assert_eq!(parse_wgmma_split_fuse(Some("0")), Some(FusePolicy::Off));
        assert_eq!(parse_wgmma_split_fuse(Some("yes")), None);
        assert!(fuse_split(2, FusePolicy::Auto));
        assert!(!fuse_split(3, FusePolicy::Auto));
        assert!(!fuse_split(16, FusePolicy::Auto));
        assert!(fuse_split(16, FusePolicy::On));
        assert!(!fuse_split(2, FusePolicy::Off));
    }

    #[test]
    fn wgmma_configs() {
        for arch in Arch::ALL {
            let prod = wgmma_production_configs(arch);
            assert_eq!(
                prod.len(),
                if arch == Arch::Sm90a { 42 } else { 0 },
                "{arch:?}"
            );
            for c in prod {
                assert_fits_smem(&c);
            }
        }
        let c = wgmma_config_epilogue(Activation::Silu, DType::BF16, Arch::Sm90a, 0);
        assert_eq!(
            c.name_expression(),
            "ferroattn::sparse24_matmul_wgmma<__nv_bfloat16, 128, 3, 4, 256>"
        );
        let s = Sparse24WgmmaConfig { epilogue: 1, ..c };
        assert_eq!(
            s.name_expression(),
            "ferroattn::sparse24_matmul_wgmma<__nv_bfloat16, 128, 3, 4, 256, 1>"
        );
        // sparse24_wgmma_smem_bytes(128, 3, 256, 1)
        assert_eq!(s.smem_bytes(), c.smem_bytes() + 128 + 16384);
        assert!(s.smem_bytes() <= 227 * 1024);
        assert_eq!(
            wgmma_config(Activation::Silu, DType::BF16, Arch::Sm90a).epilogue,
            WGMMA_EPILOGUE_DEFAULT
        );
        assert_eq!(parse_wgmma_epilogue(None), Some(WGMMA_EPILOGUE_DEFAULT));
        assert_eq!(
            parse_wgmma_epilogue(Some(" ")),
            Some(WGMMA_EPILOGUE_DEFAULT)
        );
        assert_eq!(parse_wgmma_epilogue(Some("direct")), Some(0));
        assert_eq!(parse_wgmma_epilogue(Some("0")), Some(0));
        assert_eq!(parse_wgmma_epilogue(Some("smem")), Some(1));
        assert_eq!(parse_wgmma_epilogue(Some("1")), Some(1));
        assert_eq!(parse_wgmma_epilogue(Some("fast")), None);
        // the pipelined mainloop: Sets = 2 spells Epi out; same shared memory; opt-in
        let pipe = Sparse24WgmmaConfig { meta_sets: 2, ..s };
        assert_eq!(
            pipe.name_expression(),
            "ferroattn::sparse24_matmul_wgmma<__nv_bfloat16, 128, 3, 4, 256, 1, 2>"
        );
        assert_eq!(
            Sparse24WgmmaConfig {
                epilogue: 0,
                ..pipe
            }
            .name_expression(),
            "ferroattn::sparse24_matmul_wgmma<__nv_bfloat16, 128, 3, 4, 256, 0, 2>"
        );
        assert_eq!(pipe.smem_bytes(), s.smem_bytes());
        assert_eq!(c.meta_sets, 1);
        assert_eq!(WGMMA_META_SETS_DEFAULT, 1);
        assert_eq!(
            wgmma_config(Activation::Silu, DType::BF16, Arch::Sm90a).meta_sets,
            WGMMA_META_SETS_DEFAULT
        );
        assert!(wgmma_production_configs(Arch::Sm90a)
            .iter()
            .all(|c| c.meta_sets == 1));
        let piped = wgmma_pipelined_configs(Arch::Sm90a);
        assert_eq!(piped.len(), 10);
        assert!(piped.iter().all(|c| c.meta_sets == 2 && c.epilogue == 1));
        assert!(wgmma_pipelined_configs(Arch::Sm80).is_empty());
        assert_eq!(parse_wgmma_mainloop(None), Some(WGMMA_META_SETS_DEFAULT));
        assert_eq!(
            parse_wgmma_mainloop(Some("")),
            Some(WGMMA_META_SETS_DEFAULT)
        );
        assert_eq!(parse_wgmma_mainloop(Some("wait0")), Some(1));
        assert_eq!(parse_wgmma_mainloop(Some("1")), Some(1));
        assert_eq!(parse_wgmma_mainloop(Some(" pipe ")), Some(2));
        assert_eq!(parse_wgmma_mainloop(Some("2")), Some(2));
        assert_eq!(parse_wgmma_mainloop(Some("3")), None);
        // sparse24_wgmma_smem_bytes(128, 3, 256) in wgmma_sp.cuh
        assert_eq!(
            c.smem_bytes(),
            3 * (128 * 256 + 256 * 128 + 16 * 256) + 16 * 3 + 1024
        );
        let big = Sparse24WgmmaConfig {
            block_r: 256,
            block_n: 128,
            stages: 2,
            ..c
        };
        assert!(big.smem_bytes() <= 227 * 1024);
    }

    #[test]
    fn wgmma_schedule_rule() {
        use WgmmaSchedule::*;
        let (auto, t_auto, sk_auto) = (SplitPolicy::Auto, TilePolicy::Auto, StreamKPolicy::Auto);
        let sched = |tiles, k_tiles, rows, n| wgmma_schedule(tiles, k_tiles, rows, n, 132, auto, t_auto, sk_auto);
        // 256 x 128 tiles, 132 SMs. 512 x 4096 x 4096 = 64 tiles -> the 128-row tile (128 CTAs; measured
        // 20.9 vs 32.7 us); where split-k's model costs more than 0.65 k_tiles + 2 the 128-row tile
        // replaces it: 512 x 4096 x 11008 (64 tiles, 2 chunks: 63 vs 53.9), 256 x 4096 x 4096 (32
        // tiles, 3 chunks: 27.5 vs 22.8), 128 x 11008 x 4096 (43 tiles, 3 chunks: 31.1 vs 22.8)
        assert_eq!(sched(64, 32, 512, 4096), Bm128);
        assert_eq!(sched(64, 86, 512, 4096), Bm128);
        assert_eq!(sched(32, 32, 256, 4096), Bm128);
        assert_eq!(sched(43, 32, 128, 11008), Bm128);
        // fewer than 128 rows keep split-k (64 rows measured no better with the 128-row tile)
        assert_eq!(sched(43, 32, 64, 11008), Split(WgmmaSplit { splits: 3, chunk_tiles: 11 }));
        assert_eq!(sched(56, 32, 64, 14336), Split(WgmmaSplit { splits: 2, chunk_tiles: 16 }));
        // split-k keeps decode-sized calls and long k at few tiles: 16 x 4096 x 4096 (8 chunks),
        // 128 x 4096 x 4096 (4 chunks: 21.0 vs 22.8), 256 x 4096 x 11008 (4 chunks: 42 vs 57.9)
        assert_eq!(sched(16, 32, 16, 4096), Split(WgmmaSplit { splits: 8, chunk_tiles: 4 }));
        assert_eq!(sched(16, 32, 128, 4096), Split(WgmmaSplit { splits: 4, chunk_tiles: 8 }));
        assert_eq!(sched(32, 86, 256, 4096), Split(WgmmaSplit { splits: 4, chunk_tiles: 22 }));
        // never stream-K in auto (measured slower), whole tiles on the balanced grid elsewhere:
        // 2048 x 11008 x 4096 (688 tiles), 8192^3, 8192 x 14336 x 4096, 1024 x 4096 x 4096 (128 tiles),
        // 1024 x 4096 x 11008, 16384^3, 16384 x 14336 x 4096, 256 x 11008 x 4096 (86 tiles)
        // the wave rule: 1024 x 14336 x 4096 (448 tiles: 7 x 0.55 < 4 waves; measured 1.030x forced) and
        // 512 x 11008 x 4096 (172 tiles: 3 x 0.55 < 2) take the 128-row tile; 1024 x 11008 x 4096 (344
        // tiles: 6 x 0.55 > 3; measured 0.933x forced) keeps whole tiles, as do the shapes below
        assert_eq!(sched(448, 32, 1024, 14336), Bm128);
        assert_eq!(sched(172, 32, 512, 11008), Bm128);
        assert_eq!(sched(344, 32, 1024, 11008), Tiles);
        assert_eq!(wgmma_schedule(448, 32, 1024, 14336, 132, auto, TilePolicy::Only256, sk_auto), Tiles);
        assert_eq!(wgmma_schedule(448, 32, 1024, 14336, 132, SplitPolicy::Off, t_auto, sk_auto), Tiles);
        // the banded rule: 2048 x 11008 x 4096 (688 tiles = 5.2 waves): 41 feature tiles whole (656 tiles,
        // 5 waves) + the last 512 w rows as 64 128-row tiles (one wave); 4096 x 11008 x 4096 (1376 tiles =
        // 10.4 waves): 41 whole (1312, 10 waves) + 128 128-row tiles
        let (head, cost) = wgmma_banded_plan(43, 16, 32, 132).unwrap();
        assert_eq!(head, 41);
        assert!((cost - 194.8).abs() < 1e-9, "{cost}");
        assert_eq!(sched(688, 32, 2048, 11008), Banded { head_tiles: 41 });
        assert_eq!(sched(1376, 32, 4096, 11008), Banded { head_tiles: 41 });
        assert_eq!(wgmma_schedule(688, 32, 2048, 11008, 132, auto, TilePolicy::Only256, sk_auto), Tiles);
        assert_eq!(wgmma_schedule(688, 32, 2048, 11008, 132, SplitPolicy::Off, t_auto, sk_auto), Tiles);
        assert_eq!(wgmma_banded_plan(1, 16, 32, 132), None);
        // forced: "band:H" clamps H to the feature tiles - 1; a single feature tile takes the auto rule
        let band = |h, tiles, n| wgmma_schedule(tiles, 32, 1024, n, 132, auto, TilePolicy::Banded(h), sk_auto);
        assert_eq!(band(3, 8 * 43, 11008), Banded { head_tiles: 3 });
        assert_eq!(band(99, 8 * 43, 11008), Banded { head_tiles: 42 });
        assert!(!matches!(band(1, 8, 200), Banded { .. }), "one feature tile: the auto rule");
        for (tiles, k_tiles, rows, n) in [
            (512u64, 32u64, 4096u64, 4096u64),
            (2048, 64, 8192, 8192),
            (3584, 32, 8192, 14336),
            (128, 32, 1024, 4096),
            (128, 86, 1024, 4096),
            (8192, 128, 16384, 16384),
            (7168, 32, 16384, 14336),
            (86, 32, 256, 11008),
        ] {
            assert_eq!(sched(tiles, k_tiles, rows, n), Tiles, "{tiles} {k_tiles}");
        }
        // policies: "256" / "off" restore the choices before the 128-row tile; forced forms
        assert_eq!(wgmma_schedule(64, 32, 512, 4096, 132, auto, TilePolicy::Only256, sk_auto), Tiles);
        assert_eq!(
            wgmma_schedule(64, 86, 512, 4096, 132, auto, TilePolicy::Only256, sk_auto),
            Split(WgmmaSplit { splits: 2, chunk_tiles: 43 })
        );
        assert_eq!(wgmma_schedule(64, 32, 512, 4096, 132, SplitPolicy::Off, t_auto, StreamKPolicy::Off), Tiles);
        assert_eq!(
            wgmma_schedule(64, 86, 512, 4096, 132, SplitPolicy::Force(3), t_auto, sk_auto),
            Split(WgmmaSplit { splits: 3, chunk_tiles: 29 })
        );
        let with = |tile, sk| wgmma_schedule(688, 32, 2048, 11008, 132, auto, tile, sk);
        assert_eq!(with(TilePolicy::Force128, sk_auto), Bm128);
        assert_eq!(with(t_auto, StreamKPolicy::DpTiles(5)), StreamK { dp_tiles: 5, grid: 132 });
        assert_eq!(with(t_auto, StreamKPolicy::DpTiles(9999)), StreamK { dp_tiles: 687, grid: 132 });
        assert_eq!(with(t_auto, StreamKPolicy::On), StreamK { dp_tiles: 528, grid: 132 });
        assert_eq!(
            wgmma_schedule(344, 32, 1024, 11008, 132, auto, t_auto, StreamKPolicy::On),
            StreamK { dp_tiles: 132, grid: 132 }
        );
        // forced stream-K wins over split-k and the 128-row tile; forced 128 over everything
        assert_eq!(
            wgmma_schedule(16, 32, 16, 4096, 132, auto, t_auto, StreamKPolicy::DpTiles(0)),
            StreamK { dp_tiles: 0, grid: 132 }
        );
        assert_eq!(wgmma_schedule(16, 32, 16, 4096, 132, auto, TilePolicy::Force128, StreamKPolicy::On), Bm128);
        // the forced tail: the partial wave or one wave more (all tiles when tiles <= sms); the auto
        // rule: never stream-K, the 128-row tile only from 128 rows, where 2 tiles <= sms or the wave
        // rule holds
        for tiles in 1..1500u64 {
            for k_tiles in [1u64, 2, 8, 32, 33, 86] {
                let (tail, _) = wgmma_stream_k_tail(tiles, k_tiles, 132);
                assert!(tail >= 1 && tail <= tiles, "{tiles} {k_tiles}");
                if tiles > 132 {
                    assert!(tail == tiles % 132 || tail == tiles % 132 + 132, "{tiles} {tail}");
                } else {
                    assert_eq!(tail, tiles);
                }
                for rows in [64u64, 1024, 8192] {
                    match wgmma_schedule(tiles, k_tiles, rows, 4096, 132, auto, t_auto, sk_auto) {
                        StreamK { .. } => panic!("auto never picks stream-K"),
                        Bm128 => assert!(
                            rows >= 128
                                && (2 * tiles <= 132
                                    || (2 * tiles).div_ceil(132) as f64 * WGMMA_BM128_WAVE_STAGE
                                        < tiles.div_ceil(132) as f64),
                            "{tiles} {rows}"
                        ),
                        Banded { head_tiles } => assert!(rows >= 128 && tiles > 132 && head_tiles >= 1, "{tiles} {rows}"),
                        Tiles | Split(_) => {}
                    }
                }
            }
        }
        // parsing
        assert_eq!(parse_wgmma_tile(None), Some(TilePolicy::Auto));
        assert_eq!(parse_wgmma_tile(Some(" auto")), Some(TilePolicy::Auto));
        assert_eq!(parse_wgmma_tile(Some("256")), Some(TilePolicy::Only256));
        assert_eq!(parse_wgmma_tile(Some("128")), Some(TilePolicy::Force128));
        assert_eq!(parse_wgmma_tile(Some("band:41")), Some(TilePolicy::Banded(41)));
        assert_eq!(parse_wgmma_tile(Some("band:0")), None);
        assert_eq!(parse_wgmma_tile(Some("band:x")), None);
        assert_eq!(parse_wgmma_tile(Some("64")), None);
        assert_eq!(parse_wgmma_stream_k(None), Some(StreamKPolicy::Auto));
        assert_eq!(parse_wgmma_stream_k(Some("")), Some(StreamKPolicy::Auto));
        assert_eq!(parse_wgmma_stream_k(Some("off")), Some(StreamKPolicy::Off));
        assert_eq!(parse_wgmma_stream_k(Some(" on ")), Some(StreamKPolicy::On));
        assert_eq!(parse_wgmma_stream_k(Some("dp:0")), Some(StreamKPolicy::DpTiles(0)));
        assert_eq!(parse_wgmma_stream_k(Some("dp:528")), Some(StreamKPolicy::DpTiles(528)));
        assert_eq!(parse_wgmma_stream_k(Some("dp:-1")), None);
        assert_eq!(parse_wgmma_stream_k(Some("1")), None);
        // configs: 128-row tile 4 stages fits; stream-K = production tile, staged epilogue's smem
        let b = wgmma_bm128_config(Activation::None, DType::BF16, Arch::Sm90a);
        assert_eq!((b.block_n, b.block_r, b.stages, b.epilogue), (128, 128, 4, 1));
        assert_eq!(b.smem_bytes(), 222_400);
        assert!(b.smem_bytes() <= 227 * 1024);
        assert_eq!(b.name_expression(), "ferroattn::sparse24_matmul_wgmma<__nv_bfloat16, 128, 4, 0, 128, 1>");
        let s = wgmma_stream_k_config(Activation::Relu, DType::F16, Arch::Sm90a);
        assert_eq!(s.name_expression(), "ferroattn::sparse24_matmul_wgmma<__half, 128, 3, 1, 256, 4>");
        assert_eq!(s.smem_bytes(), wgmma_config(Activation::Relu, DType::F16, Arch::Sm90a).smem_bytes());
        let prod = wgmma_production_configs(Arch::Sm90a);
        assert!(prod.contains(&b) && !prod.contains(&s));
        let sk = wgmma_stream_k_configs(Arch::Sm90a);
        assert_eq!(sk.len(), 10);
        assert!(sk.contains(&s) && sk.iter().all(|c| c.epilogue == 4 && c.block_n == 256));
        assert!(wgmma_stream_k_configs(Arch::Sm80).is_empty());
    }
}
