//! Attention tile-size heuristics: pure functions, unit-tested on CPU.
//!
//! `fwd_config` picks the kernel specialisation for one call; `fwd_production_configs`
//! lists every specialisation `ferroattn precompile` builds and CI checks for spills.

use crate::dtype::DType;
use crate::arch::Arch;
use crate::tuning::variant::{MaskKind, VariantKind};

/// The attention-forward kernel families (DESIGN.md §7): `Sm80` (mma.sync, every GPU >= sm_80,
/// kernels/attention/fwd_sm80.cuh) and `Sm90` (wgmma + TMA, sm_90a, kernels/attention/fwd_sm90.cuh).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttnFwdFamily {
    Sm80,
    Sm90,
}

/// One specialisation of an attention-forward kernel: the single source of truth for its
/// template arguments, launch shape and cache key.
///   Sm80: `ferroattn::attn_fwd_sm80<HeadDim, BlockM, BlockN, NumWarps, Stages, V, T>`;
///   Sm90: `ferroattn::attn_fwd_sm90<HeadDim, BlockN, Stages, V, T[, KvSeparate[, Persistent]]>`
///         (block_m 128, 12 warps: src/tuning/attention_sm90.rs); `KvSeparate` is rendered only for
///         `KvRelease::Separate` or `persistent`, `Persistent` only when set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttnFwdConfig {
    pub family: AttnFwdFamily,
    /// Head dim the kernel is instantiated for (sm80: a multiple of 32 in 32..=256; sm90: 64,
    /// 128 or 256); the call's actual head dim (a multiple of 8, <= this) is masked.
    pub head_dim: u32,
    pub block_m: u32,
    pub block_n: u32,
    pub num_warps: u32,
    /// K/V pipeline depth (cp.async stages on sm80, TMA ring slots on sm90).
    pub stages: u32,
    /// The variant's compile-time part (kernels/attention/variant.cuh).
    pub variant: VariantKind,
    pub dtype: DType,
    pub arch: Arch,
    /// How the sm90 kernel's K/V ring releases its slots (`Together` on sm80, where it has no
    /// meaning).
    pub kv_release: KvRelease,
    /// The sm90 kernel's persistent form: one block per SM walks its share of the output tiles
    /// (false on sm80).
    pub persistent: bool,
}

/// How the sm90 forward's K/V ring releases a slot to the producer (kernels/attention/fwd_sm90.cuh,
/// template argument `KvSeparate`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum KvRelease {
    /// K and V of a slot together, once its P·V has completed.
    #[default]
    Together,
    /// K once its S = Q·Kᵀ has completed, V once its P·V has; the producer loads the next tile's K
    /// before this tile's V.
    Separate,
}

impl AttnFwdConfig {
    /// The kernel template of this family.
    pub fn kernel(&self) -> &'static str {
        match self.family {
            AttnFwdFamily::Sm80 => "ferroattn::attn_fwd_sm80",
            AttnFwdFamily::Sm90 => "ferroattn::attn_fwd_sm90",
        }
    }

    /// The file under kernels/ that defines it.
    pub fn header(&self) -> &'static str {
        match self.family {
            AttnFwdFamily::Sm80 => "attention/fwd_sm80.cuh",
            AttnFwdFamily::Sm90 => "attention/fwd_sm90.cuh",
        }
    }

    /// The NVRTC name expression that instantiates this specialisation.
    pub fn name_expression(&self) -> String {
        let (v, t) = (self.variant.cuda_type(), self.dtype.cuda_type());
        match self.family {
            AttnFwdFamily::Sm80 => format!(
                "{}<{}, {}, {}, {}, {}, {v}, {t}>",
                self.kernel(),
                self.head_dim,
                self.block_m,
                self.block_n,
                self.num_warps,
                self.stages
            ),
            AttnFwdFamily::Sm90 => {
                let separate = self.kv_release == KvRelease::Separate;
                let tail = match (separate, self.persistent) {
                    (_, true) => format!(", {separate}, true"),
                    (true, false) => ", true".to_string(),
                    (false, false) => String::new(),
                };
                format!("{}<{}, {}, {}, {v}, {t}{tail}>", self.kernel(), self.head_dim, self.block_n, self.stages)
            }
        }
    }

    pub fn threads(&self) -> u32 {
        self.num_warps * 32
    }

    /// Dynamic shared memory in bytes (the formulas the kernels document and static_assert
    /// against). Sm80: the Q tile plus `stages` K tiles and `stages` V tiles. Sm90: the same
    /// tiles plus 1 + 3 x stages mbarriers (1 + 4 x stages with `KvRelease::Separate`; one more when
    /// persistent) and 1 KiB of alignment slack (AttnSm90Smem::kTotal); persistent at head dims up to
    /// 128 also an O staging tile of the Q tile's size.
    pub fn smem_bytes(&self) -> u32 {
        let tiles = (self.block_m * self.head_dim + 2 * self.stages * self.block_n * self.head_dim) * 2;
        match self.family {
            AttnFwdFamily::Sm80 => tiles,
            AttnFwdFamily::Sm90 => {
                let per_stage = if self.kv_release == KvRelease::Separate { 4 } else { 3 };
                let own_o = if self.persistent && self.head_dim <= 128 { self.block_m * self.head_dim * 2 } else { 0 };
                tiles + own_o + 8 * (1 + per_stage * self.stages + u32::from(self.persistent)) + 1024
            }
        }
    }
}

/// Round a (multiple-of-8) head dim up to the kernel head dim it runs on.
pub fn kernel_head_dim(head_dim: u32) -> u32 {
    head_dim.div_ceil(32).max(1) * 32
}

/// Tile shape for a kernel head dim: (block_m, block_n, num_warps, stages).
/// mma.sync kernel (kernels/attention/fwd_sm80.cuh). Up to d = 128: 128-row query tiles on 4
/// warps of 32 rows (each K/V fragment read from shared memory feeds two m16 tiles); d = 64
/// uses 128-key tiles (processed as two 64-key softmax steps). Above d = 128: 64-row tiles on
/// 4 warps of 16 rows (O would not fit in registers at 32 rows), one K/V stage from d = 192 so
/// that 2-3 blocks share an SM. Every tile fits the 163 KiB an A100 block may use.
/// Measured on H200 against SDPA-flash: bench/NOTES.md.
/// Dropout (its Philox words live next to S and O) takes 32-key tiles at d 65..=128, where the
/// 64-key tile would spill.
pub fn fwd_tile(head_dim: u32, variant: VariantKind) -> (u32, u32, u32, u32) {
    match head_dim {
        0..=32 => (128, 128, 4, 2),
        33..=64 => (128, 128, 4, 2),
        65..=128 if variant.dropout => (128, 32, 4, 2),
        65..=128 => (128, 64, 4, 2),
        129..=160 => (64, 64, 4, 2),
        _ => (64, 64, 4, 1),
    }
}

/// The configuration one attention-forward call runs with.
pub fn fwd_config(head_dim: u32, variant: VariantKind, dtype: DType, arch: Arch) -> AttnFwdConfig {
    let hd = kernel_head_dim(head_dim);
    let (block_m, block_n, num_warps, stages) = fwd_tile(hd, variant);
    let mut config =
        AttnFwdConfig {
            family: AttnFwdFamily::Sm80,
            head_dim: hd,
            block_m,
            block_n,
            num_warps,
            stages,
            variant,
            dtype,
            arch,
            kv_release: KvRelease::Together,
            persistent: false,
        };
    // GPUs with less shared memory per block (sm_86/89: 99 KiB) get a shallower K/V pipeline.
    while config.smem_bytes() > arch.max_smem_per_block() && config.stages > 1 {
        config.stages -= 1;
    }
    config
}

/// The variants production configurations are built for: plain and causal, and what the model
/// families of transformers use: a causal local window (Mistral, Qwen2, Gemma-2/3, Cohere2,
/// GPT-OSS), softcap with and without it (Gemma-2), sinks with and without it (GPT-OSS), a
/// two-sided window (ModernBERT, bidirectional), ALiBi causal and not, dropout causal and not
/// (training BERT, GPT-2 and Llama-family models). Other combinations compile on first use.
pub fn production_variants() -> [VariantKind; 12] {
    let (plain, causal) = (VariantKind::PLAIN, VariantKind::CAUSAL);
    let local = VariantKind { mask: MaskKind::Local, ..plain };
    [
        plain,
        causal,
        local,
        VariantKind { softcap: true, ..causal },
        VariantKind { softcap: true, ..local },
        VariantKind { sinks: true, ..causal },
        VariantKind { sinks: true, ..local },
        VariantKind { alibi: true, ..plain },
        VariantKind { alibi: true, ..causal },
        VariantKind { softcap: true, ..plain },
        VariantKind { dropout: true, ..plain },
        VariantKind { dropout: true, ..causal },
    ]
}

/// The (kernel head dim, variant, dtype) points that production configurations are built for:
/// every multiple of 32 in [32, 256] with plain and causal, the other production variants at
/// the head dims models use (64, 128, 256), both 16-bit dtypes, in that nesting.
pub fn production_points() -> impl Iterator<Item = (u32, VariantKind, DType)> {
    (32..=256).step_by(32).flat_map(|hd| {
        production_variants()
            .into_iter()
            .filter(move |v| [VariantKind::PLAIN, VariantKind::CAUSAL].contains(v) || matches!(hd, 64 | 128 | 256))
            .flat_map(move |v| [DType::F16, DType::BF16].into_iter().map(move |dtype| (hd, v, dtype)))
    })
}

/// Every configuration `fwd_config` can return for `arch` at the production points: what
/// `precompile` builds.
pub fn fwd_production_configs(arch: Arch) -> Vec<AttnFwdConfig> {
    production_points().map(|(hd, v, dtype)| fwd_config(hd, v, dtype, arch)).collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::jit::KernelSpec;

    /// `c`'s dynamic shared memory fits in its arch's per-block limit.
    pub(crate) fn assert_fits_smem(c: &impl KernelSpec) {
        assert!(
            c.dynamic_smem_bytes() <= c.arch().max_smem_per_block(),
            "{} needs {} B on {:?}",
            c.name_expression(),
            c.dynamic_smem_bytes(),
            c.arch()
        );
    }

    #[test]
    fn production_points_cover_the_grid_once() {
        let points: Vec<_> = production_points().collect();
        assert_eq!(points.len(), 8 * 2 * 2 + 3 * 10 * 2);
        assert_eq!(points[0], (32, VariantKind::PLAIN, DType::F16));
        assert_eq!(points[1], (32, VariantKind::PLAIN, DType::BF16));
        assert_eq!(points[2], (32, VariantKind::CAUSAL, DType::F16));
        let last = VariantKind { dropout: true, ..VariantKind::CAUSAL };
        assert_eq!(*points.last().unwrap(), (256, last, DType::BF16));
        for (i, a) in points.iter().enumerate() {
            assert!(!points[i + 1..].contains(a), "{a:?} twice");
        }
    }

    #[test]
    fn every_production_config_fits_its_arch() {
        for arch in Arch::ALL {
            for c in fwd_production_configs(arch) {
                assert_fits_smem(&c);
                assert_eq!(c.block_m % (16 * c.num_warps), 0, "{}", c.name_expression());
            }
        }
    }

    #[test]
    fn head_dims_round_up_to_the_kernel_head_dim() {
        assert_eq!(kernel_head_dim(8), 32);
        assert_eq!(kernel_head_dim(32), 32);
        assert_eq!(kernel_head_dim(40), 64);
        assert_eq!(kernel_head_dim(256), 256);
        let c = fwd_config(72, VariantKind::CAUSAL, DType::BF16, Arch::Sm90a);
        assert_eq!(c.head_dim, 96);
        assert!(c.variant.causal());
        assert!(c.name_expression().starts_with("ferroattn::attn_fwd_sm80<96, "));
        assert!(c.name_expression().ends_with(", ferroattn::AttnVariant<1, false, false, false, false, false>, __nv_bfloat16>"));
    }
}
