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
use crate::tuning::gemm_problem::Activation;

mod schedule;
mod wgmma;
pub use schedule::*;
pub use wgmma::*;

/// Rows of w are padded to a multiple of this in the compressed layout (the largest row tile
/// of the kernels, so they load w tiles without bounds checks; `ops::sparse24::host::Layout`).
pub const TILE_M: usize = 128;

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
    /// Parse "block_n,block_r,warps_n,warps_r,stages" (the `sparse24_tile` knob, used by
    /// experiments); None when malformed or not a valid tile.
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


#[cfg(test)]
mod tests;
