//! The kv-cache (decode) attention path: its kernel configurations and the split-KV heuristic.
//! Pure functions, unit-tested on CPU.
//!
//! `kvcache_config` picks the specialisation of `attn_fwd_kvcache_sm80` (kernels/attention/
//! fwd_kvcache_sm80.cuh) for one call; `num_splits` decides how many blocks share one sequence's
//! keys; `use_kvcache_path` is the rule that sends a `flash_attn_func` / varlen call with few
//! queries to this path; `kvcache_production_configs` lists what `precompile` builds.

use crate::arch::Arch;
use crate::dtype::DType;
use crate::tuning::variant::{MaskKind, VariantKind};
use crate::tuning::attention::kernel_head_dim;

/// Keys per K/V tile of the kv-cache kernel (4 warps x 16 keys).
pub const KVCACHE_BLOCK_N: u32 = 64;
/// Query rows per block (one m16 tile: query tokens x query heads of one kv head).
pub const KVCACHE_ROWS: u32 = 16;
/// At most this many splits per sequence (flash_attn's limit for `num_splits`).
pub const MAX_SPLITS: u32 = 128;

/// One specialisation of `ferroattn::attn_fwd_kvcache_sm80<HeadDim, BlockN, Stages, Paged, V, T>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttnKvcacheConfig {
    /// Kernel head dim (multiple of 32); the call's is masked inside.
    pub head_dim: u32,
    pub block_n: u32,
    /// K/V ring depth.
    pub stages: u32,
    /// Keys through a block table.
    pub paged: bool,
    pub variant: VariantKind,
    pub dtype: DType,
    pub arch: Arch,
}

impl AttnKvcacheConfig {
    pub const KERNEL: &'static str = "ferroattn::attn_fwd_kvcache_sm80";
    pub const HEADER: &'static str = "attention/fwd_kvcache_sm80.cuh";

    pub fn name_expression(&self) -> String {
        format!(
            "{}<{}, {}, {}, {}, {}, {}>",
            Self::KERNEL,
            self.head_dim,
            self.block_n,
            self.stages,
            self.paged,
            self.variant.cuda_type(),
            self.dtype.cuda_type()
        )
    }

    pub const THREADS: u32 = 128;

    /// The Q tile plus `stages` K and V tiles (`attn_fwd_kvcache_sm80_smem_bytes`).
    pub fn smem_bytes(&self) -> u32 {
        (KVCACHE_ROWS * self.head_dim + 2 * self.stages * self.block_n * self.head_dim) * 2
    }
}

/// The merge of split partials (`ferroattn::attn_split_combine<T>`, kernels/attention/split_combine.cuh).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SplitCombineConfig {
    pub dtype: DType,
    pub arch: Arch,
}

impl SplitCombineConfig {
    pub const KERNEL: &'static str = "ferroattn::attn_split_combine";
    pub const HEADER: &'static str = "attention/split_combine.cuh";
    pub fn name_expression(&self) -> String {
        format!("{}<{}>", Self::KERNEL, self.dtype.cuda_type())
    }
}

/// The cache append with rotary embedding (`ferroattn::attn_kv_append<T>`, kernels/attention/kv_append.cuh).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvAppendConfig {
    pub dtype: DType,
    pub arch: Arch,
}

impl KvAppendConfig {
    pub const KERNEL: &'static str = "ferroattn::attn_kv_append";
    pub const HEADER: &'static str = "attention/kv_append.cuh";
    pub fn name_expression(&self) -> String {
        format!("{}<{}>", Self::KERNEL, self.dtype.cuda_type())
    }
}

/// K/V ring depth per kernel head dim: about 100 KiB of ring or less, so that two blocks (eight
/// warps) share an SM up to d = 128 and keep >= 64 KiB of loads in flight per SM, which the
/// H200's bandwidth-latency product asks for (bench/NOTES.md, kv-cache entry).
pub fn kvcache_stages(head_dim: u32) -> u32 {
    match head_dim {
        0..=64 => 4,
        65..=128 => 3,
        _ => 2,
    }
}

/// The configuration of one kv-cache call.
pub fn kvcache_config(head_dim: u32, paged: bool, variant: VariantKind, dtype: DType, arch: Arch) -> AttnKvcacheConfig {
    let hd = kernel_head_dim(head_dim);
    let mut c = AttnKvcacheConfig {
        head_dim: hd,
        block_n: KVCACHE_BLOCK_N,
        stages: kvcache_stages(hd),
        paged,
        variant: VariantKind { dropout: false, return_softmax: false, ..variant },
        dtype,
        arch,
    };
    while c.smem_bytes() > arch.max_smem_per_block() && c.stages > 1 {
        c.stages -= 1;
    }
    c
}

/// Blocks of one (batch, kv head) along the packed query rows.
pub fn row_blocks(seqlen_q: u64, group: u64) -> u64 {
    seqlen_q.saturating_mul(group).div_ceil(KVCACHE_ROWS as u64)
}

/// How many blocks split one sequence's keys (flash_attn's `num_splits`): `requested` >= 1 is
/// taken as given (at most `MAX_SPLITS` and the number of key tiles); 0 asks the heuristic:
/// 1 when the blocks without a split already fill 80 % of a wave (`sm_count` x `blocks_per_sm`),
/// else the count of at most `MAX_SPLITS` (and at most one per 2 key tiles) whose wave
/// efficiency is within 85 % of the best, the smallest such (the rule of FlashAttention-2's
/// `num_splits_heuristic`, with waves of this kernel's occupancy).
pub fn num_splits(blocks: u64, key_len: u64, sm_count: u32, blocks_per_sm: u32, requested: u32) -> u32 {
    let tiles = key_len.div_ceil(KVCACHE_BLOCK_N as u64).max(1);
    if requested >= 1 {
        return requested.min(MAX_SPLITS).min(tiles as u32).max(1);
    }
    let wave = (sm_count as u64 * blocks_per_sm.max(1) as u64).max(1);
    if blocks == 0 || blocks * 10 >= wave * 8 {
        return 1;
    }
    let max_splits = (MAX_SPLITS as u64).min(tiles.div_ceil(2)).max(1);
    let eff = |s: u64| {
        let waves = (blocks * s) as f64 / wave as f64;
        waves / waves.ceil()
    };
    let best = (1..=max_splits).map(eff).fold(0.0, f64::max);
    (1..=max_splits).find(|&s| eff(s) >= 0.85 * best).unwrap_or(1) as u32
}

/// Blocks of the kv-cache kernel that share one SM (shared memory bound; 128 threads each).
pub fn blocks_per_sm(config: &AttnKvcacheConfig) -> u32 {
    let smem = config.smem_bytes() + 1024;   // + the static merge arrays and the driver's reserve
    (config.arch.max_smem_per_sm() / smem).clamp(1, 8)
}

/// Whether `seqlen_q` queries of a GQA group of `group` heads are few enough for the kv-cache
/// kernel (at most two blocks of packed rows per kv head): decode and speculative decoding.
pub fn decode_rows_fit(seqlen_q: u64, group: u64) -> bool {
    group >= 1 && row_blocks(seqlen_q, group) <= 2
}

/// Whether a `flash_attn_func` / varlen call (not a kv-cache call) runs on the kv-cache kernel:
/// few query rows per kv head (`decode_rows_fit`) against many keys, no dropout (the kv-cache
/// kernel has none) and no returned softmax.
pub fn use_kvcache_path(seqlen_q: u64, group: u64, seqlen_k: u64, variant: VariantKind) -> bool {
    !variant.dropout && !variant.return_softmax && decode_rows_fit(seqlen_q, group) && seqlen_k >= 2 * KVCACHE_BLOCK_N as u64
        && seqlen_k >= 8 * seqlen_q
}

/// The variants precompiled for the kv-cache kernel: what decoding models use.
fn kvcache_production_variants() -> [VariantKind; 5] {
    let plain = VariantKind::PLAIN;
    [
        plain,
        VariantKind::CAUSAL,
        VariantKind { mask: MaskKind::Local, ..plain },
        VariantKind { softcap: true, mask: MaskKind::Local, ..plain },
        VariantKind { sinks: true, mask: MaskKind::Local, ..plain },
    ]
}

/// What `precompile` builds for the kv-cache path on `arch`: head dims 64, 128 and 256, both
/// 16-bit dtypes, contiguous and paged, the decoding variants; the combine and append kernels.
pub fn kvcache_production_configs(arch: Arch) -> Vec<AttnKvcacheConfig> {
    let mut out = Vec::new();
    for hd in [64, 128, 256] {
        for v in kvcache_production_variants() {
            for paged in [false, true] {
                for dtype in [DType::F16, DType::BF16] {
                    out.push(kvcache_config(hd, paged, v, dtype, arch));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tuning::attention::tests::assert_fits_smem;

    #[test]
    fn configs_fit_and_name_their_template() {
        for arch in Arch::ALL {
            for c in kvcache_production_configs(arch) {
                assert_fits_smem(&c);
                assert!(c.stages >= 1);
            }
        }
        let c = kvcache_config(128, true, VariantKind::CAUSAL, DType::BF16, Arch::Sm90a);
        assert_eq!(c.name_expression(),
                   "ferroattn::attn_fwd_kvcache_sm80<128, 64, 3, true, ferroattn::AttnVariant<1, false, false, false, false, false>, __nv_bfloat16>");
        // d 100 runs on the 128 kernel
        assert_eq!(kvcache_config(100, false, VariantKind::PLAIN, DType::F16, Arch::Sm80).head_dim, 128);
    }

    #[test]
    fn a_requested_split_count_is_kept_within_limits() {
        assert_eq!(num_splits(8, 8192, 132, 2, 7), 7);
        assert_eq!(num_splits(8, 8192, 132, 2, 1000), 128);
        assert_eq!(num_splits(8, 100, 132, 2, 5), 2);    // 2 key tiles
        assert_eq!(num_splits(8, 0, 132, 2, 5), 1);
    }

    #[test]
    fn the_heuristic_splits_only_what_does_not_fill_the_gpu() {
        // b 32 x h_k 8 = 256 blocks on 132 SMs x 2: nearly a wave already
        assert_eq!(num_splits(256, 32768, 132, 2, 0), 1);
        // b 1 x h_k 8 at 32k keys: split until the GPU is full
        let s = num_splits(8, 32768, 132, 2, 0);
        assert!((16..=128).contains(&s), "{s}");
        let waves = (8 * s) as f64 / 264.0;
        assert!(waves / waves.ceil() >= 0.85 * 0.97, "{s}: {waves}");
        // short caches: at most one split per two tiles
        assert!(num_splits(8, 256, 132, 2, 0) <= 2);
        assert_eq!(num_splits(0, 256, 132, 2, 0), 1);
    }

    #[test]
    fn decode_shapes_take_the_kvcache_path() {
        assert!(use_kvcache_path(1, 4, 8192, VariantKind::CAUSAL));
        assert!(use_kvcache_path(4, 8, 8192, VariantKind::PLAIN));   // 32 rows: two blocks
        assert!(!use_kvcache_path(5, 8, 8192, VariantKind::PLAIN));
        assert!(!use_kvcache_path(1, 1, 64, VariantKind::PLAIN));     // one tile: nothing to split
        assert!(!use_kvcache_path(1, 4, 8192, VariantKind { dropout: true, ..VariantKind::PLAIN }));
        // the rows rule alone (paged decode in continuous batching: any key count)
        assert!(decode_rows_fit(1, 8) && decode_rows_fit(4, 8) && decode_rows_fit(32, 1));
        assert!(!decode_rows_fit(5, 8) && !decode_rows_fit(33, 1));
        // no wrap-around of the row count, and no group of no heads
        assert!(!decode_rows_fit(1 << 63, 2) && !decode_rows_fit(1 << 62, 4) && !decode_rows_fit(u64::MAX, u64::MAX));
        assert!(!decode_rows_fit(1, 0));
    }
}
