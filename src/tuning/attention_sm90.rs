//! Tile choices of the Hopper attention forward (kernels/attention/fwd_sm90.cuh): pure
//! functions, unit-tested on CPU.
//!
//! The kernel is a 128-row query tile on two consumer warpgroups of 64 rows plus one producer
//! warpgroup; what varies per head dim is the key tile (BlockN) and the K/V ring depth (Stages),
//! bounded by registers (S, P and O accumulators of a consumer thread: BlockN / 2 + BlockN / 4 +
//! HeadDim / 2 fp32/b32 within setmaxnreg 240) and by the 227 KiB of shared memory a block may use.

use crate::arch::Arch;
use crate::dtype::DType;
use crate::tuning::variant::{MaskKind, VariantKind};
use crate::tuning::attention::{production_variants, AttnFwdConfig, AttnFwdFamily, KvRelease};
use crate::tuning::knobs::{Choice, RingStages};

/// Query rows per block (two consumer warpgroups of 64).
pub const BLOCK_M: u32 = 128;
/// Warps per block: one producer and two consumer warpgroups.
pub const NUM_WARPS: u32 = 12;

/// The kernel head dim a call's head dim runs on, or None above 256. `d192`: head dims 129..=192
/// run on the dedicated 192 kernel (knob `attn_sm90_fwd_d192`), else on 256.
pub fn kernel_head_dim(head_dim: u32, d192: bool) -> Option<u32> {
    match head_dim {
        0..=64 => Some(64),
        65..=128 => Some(128),
        129..=192 if d192 => Some(192),
        129..=256 => Some(256),
        _ => None,
    }
}

/// (block_n, stages) per kernel head dim. d 64: 128-key tiles, 3 slots (112 KiB). d 128:
/// 128-key tiles, 2 slots (160 KiB). d 192: 112-key tiles, 2 slots (216 KiB; S, its fp32 copy, P
/// and O take 112 / 2 + 112 / 2 + 112 / 4 + 96 = 236 of the 240 registers); with dropout 96 keys.
/// d 256: 80-key tiles, 2 slots (225 KiB; O alone holds 128 registers per consumer thread); with
/// dropout 64 keys (its units span 32 keys).
pub fn fwd_tile(head_dim: u32, variant: VariantKind) -> (u32, u32) {
    match head_dim {
        64 => (128, 3),
        128 => (128, 2),
        192 if variant.dropout => (96, 2),
        192 => (112, 2),
        _ if variant.dropout => (64, 2),
        _ => (80, 2),
    }
}

/// The form of an sm90 forward launch: the ring's release, its depth, the persistent form, whether
/// varlen calls may run on it (the same kernels, which read cu_seqlens at run time) and whether
/// head dims 129..=192 run on the dedicated 192 kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct FwdForm {
    pub kv_release: KvRelease,
    pub stages: RingStages,
    pub persistent: bool,
    pub varlen: bool,
    pub d192: bool,
}

/// What the tuning knobs say of the sm90 forward's form (`attn_sm90_fwd_kv_release`,
/// `attn_sm90_fwd_stages`, `attn_sm90_fwd_persistent`, `attn_sm90_fwd_varlen`,
/// `attn_sm90_fwd_d192`): the release and the persistent form forced or left to `form`'s rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct FwdPolicy {
    pub kv_release: Choice<KvRelease>,
    pub stages: RingStages,
    pub persistent: Choice<bool>,
    pub varlen: bool,
    pub d192: bool,
}

/// Key lengths up to which the persistent form runs unmasked calls at kernel head dims <= 128.
pub const PERSISTENT_MAX_SEQLEN_K: u64 = 2048;

impl FwdPolicy {
    /// The form of a call of head dim `head_dim`, mask `mask` and `seqlen_k` keys per sequence:
    /// the knobs' forced choices, the measured rule for the rest (bench/NOTES.md, "Hopper forward
    /// forms measured"). Persistent where the mask is causal or local (each unit pairs a heavy m
    /// block with a light one, the heaviest first) and, at kernel head dims up to 128, for key
    /// lengths up to `PERSISTENT_MAX_SEQLEN_K` (few key tiles per m block: the prologue a block
    /// pays alone is a large share); each slot's K released after its Q·Kᵀ and V after its P·V at
    /// kernel head dims >= 128 and in the persistent form (two slots: the next K load is
    /// otherwise on the critical path once per key tile), K and V together at head dim 64
    /// otherwise (three slots hide the load).
    pub fn form(&self, head_dim: u32, mask: MaskKind, seqlen_k: u64) -> FwdForm {
        let hd = kernel_head_dim(head_dim, self.d192).unwrap_or(256);
        let persistent = self.persistent.or(mask != MaskKind::None || (hd <= 128 && seqlen_k <= PERSISTENT_MAX_SEQLEN_K));
        let rule_release = if hd >= 128 || persistent { KvRelease::Separate } else { KvRelease::Together };
        FwdForm {
            kv_release: self.kv_release.or(rule_release),
            stages: self.stages,
            persistent,
            varlen: self.varlen,
            d192: self.d192,
        }
    }
}

/// The sm90 configuration of a call, or None where the kernel has no specialisation (head dim
/// above 256, an arch other than sm_90a). A forced ring depth (`form.stages`) that does not fit
/// in shared memory at this head dim takes the deepest that does (at least 2).
pub fn fwd_config(head_dim: u32, variant: VariantKind, dtype: DType, arch: Arch, form: FwdForm) -> Option<AttnFwdConfig> {
    if arch != Arch::Sm90a {
        return None;
    }
    let hd = kernel_head_dim(head_dim, form.d192)?;
    let (block_n, stages) = fwd_tile(hd, variant);
    let mut c = AttnFwdConfig {
        family: AttnFwdFamily::Sm90,
        head_dim: hd,
        block_m: BLOCK_M,
        block_n,
        num_warps: NUM_WARPS,
        stages: form.stages.forced().unwrap_or(stages),
        variant,
        dtype,
        arch,
        kv_release: form.kv_release,
        persistent: form.persistent,
    };
    while c.smem_bytes() > arch.max_smem_per_block() && c.stages > 2 {
        c.stages -= 1;
    }
    Some(c)
}

/// Every configuration `precompile` builds for `arch`: the forms `FwdPolicy::form`'s rule takes
/// (short and long keys) for the production variants at head dims 64, 128, 256 in both 16-bit
/// dtypes (none off sm_90a).
pub fn fwd_production_configs(arch: Arch) -> Vec<AttnFwdConfig> {
    rule_configs_at(arch, &[64, 128, 256], FwdPolicy::default())
}

/// (release, persistent) of every form the knobs can force.
const FORCED_FORMS: [(KvRelease, bool); 4] =
    [(KvRelease::Together, false), (KvRelease::Separate, false), (KvRelease::Separate, true), (KvRelease::Together, true)];

/// The forms an A/B run measures against the rule's (`precompile` builds them too, so CI holds
/// them to no spills): every release, persistent or not, at head dims 64, 128, 256, less the
/// production configurations; and the dedicated d 192 kernel in the rule's forms.
pub fn fwd_candidate_configs(arch: Arch) -> Vec<AttnFwdConfig> {
    let production = fwd_production_configs(arch);
    let mut out = Vec::new();
    for (kv_release, persistent) in FORCED_FORMS {
        let form = FwdForm { kv_release, persistent, ..FwdForm::default() };
        for &hd in &[64, 128, 256] {
            for_production_points(|v, dtype| out.extend(fwd_config(hd, v, dtype, arch, form)));
        }
    }
    out.retain(|c| !production.contains(c));
    out.extend(rule_configs_at(arch, &[192], FwdPolicy { d192: true, ..FwdPolicy::default() }));
    out
}

fn for_production_points(mut f: impl FnMut(VariantKind, DType)) {
    for v in production_variants() {
        for dtype in [DType::F16, DType::BF16] {
            f(v, dtype);
        }
    }
}

/// The configurations `policy`'s rule takes at `head_dims` for the production points, at key
/// lengths on either side of `PERSISTENT_MAX_SEQLEN_K` (each configuration once).
fn rule_configs_at(arch: Arch, head_dims: &[u32], policy: FwdPolicy) -> Vec<AttnFwdConfig> {
    let mut out: Vec<AttnFwdConfig> = Vec::new();
    for &hd in head_dims {
        for_production_points(|v, dtype| {
            for seqlen_k in [PERSISTENT_MAX_SEQLEN_K, PERSISTENT_MAX_SEQLEN_K + 1] {
                let c = fwd_config(hd, v, dtype, arch, policy.form(hd, v.mask, seqlen_k));
                if let Some(c) = c.filter(|c| !out.contains(c)) {
                    out.push(c);
                }
            }
        });
    }
    out
}

/// The work units of the persistent forward (kernels/attention/fwd_sm90.cuh, `for_each_tile`;
/// change both together): unit u is the m blocks (n_m - 1 - x, x) of head (u / pairs) % h of batch
/// u / pairs / h, x = u % pairs, pairs = ceil(n_m / 2) (one m block where they meet); block `block`
/// of `grid` runs units block, block + grid, ... The units of a call (the grid's work count).
pub fn persistent_units(seqlen_q: u64, heads: u64, batch: u64) -> u64 {
    seqlen_q.div_ceil(BLOCK_M as u64).div_ceil(2) * heads * batch
}

/// The m blocks (heavier first) of the units block `block` of a persistent grid of `grid` runs,
/// for n_m m blocks per head, as `persistent_units` describes.
pub fn persistent_m_blocks(block: u64, grid: u64, units: u64, n_m: u64) -> Vec<u64> {
    let pairs = n_m.div_ceil(2);
    let mut out = Vec::new();
    let mut u = block;
    while u < units {
        let x = u % pairs;
        out.push(n_m - 1 - x);
        if x != n_m - 1 - x {
            out.push(x);
        }
        u += grid;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tuning::attention::tests::assert_fits_smem;

    #[test]
    fn head_dims_map_to_the_three_kernels() {
        assert_eq!(kernel_head_dim(8, false), Some(64));
        assert_eq!(kernel_head_dim(64, false), Some(64));
        assert_eq!(kernel_head_dim(72, false), Some(128));
        assert_eq!(kernel_head_dim(192, false), Some(256));
        assert_eq!(kernel_head_dim(264, false), None);
        // the dedicated 192 kernel (knob attn_sm90_fwd_d192)
        assert_eq!(kernel_head_dim(136, true), Some(192));
        assert_eq!(kernel_head_dim(192, true), Some(192));
        assert_eq!(kernel_head_dim(200, true), Some(256));
        assert_eq!(kernel_head_dim(128, true), Some(128));
        let c = fwd_config(160, VariantKind::CAUSAL, DType::BF16, Arch::Sm90a, FwdForm { d192: true, ..FwdForm::default() })
            .unwrap();
        assert_eq!((c.head_dim, c.block_n, c.stages), (192, 112, 2));
        assert_fits_smem(&c);
        let dr = VariantKind { dropout: true, ..VariantKind::CAUSAL };
        assert_eq!(fwd_config(192, dr, DType::BF16, Arch::Sm90a, FwdForm { d192: true, ..FwdForm::default() })
            .unwrap().block_n, 96);
        let d = FwdForm::default();
        assert!(fwd_config(128, VariantKind::CAUSAL, DType::BF16, Arch::Sm80, d).is_none());
        let c = fwd_config(96, VariantKind::CAUSAL, DType::BF16, Arch::Sm90a, d).unwrap();
        assert_eq!((c.head_dim, c.block_n, c.stages), (128, 128, 2));
        assert_eq!(
            c.name_expression(),
            "ferroattn::attn_fwd_sm90<128, 128, 2, ferroattn::AttnVariant<1, false, false, false, false, false>, __nv_bfloat16>"
        );
    }

    #[test]
    fn production_configs_fit_and_respect_the_kernel_rules() {
        let configs = fwd_production_configs(Arch::Sm90a);
        // per head dim and point the rule's form at short and long keys: two forms where unmasked
        // at d 64 and 128, one otherwise
        let masked = production_variants().iter().filter(|v| v.mask != MaskKind::None).count();
        let n = production_variants().len();
        assert_eq!(configs.len(), 2 * (2 * (2 * n - masked) + n));
        assert!(fwd_production_configs(Arch::Sm80).is_empty());
        for c in &configs {
            assert_fits_smem(c);
            assert_eq!(c.block_n % 16, 0);
            assert!(!c.variant.dropout || c.block_n % 32 == 0, "{}", c.name_expression());
            assert!(c.stages >= 2);
            // The live accumulators of a consumer thread while P V runs: S and its fp32 P copy
            // (block_n / 2 each), the 16-bit P operand (block_n / 4), O (head_dim / 2), within
            // setmaxnreg 240.
            assert!(c.block_n + c.block_n / 4 + c.head_dim / 2 <= 240, "{}", c.name_expression());
        }
    }

    #[test]
    fn smem_formula_matches_the_kernel_layout() {
        let c = fwd_config(256, VariantKind::PLAIN, DType::F16, Arch::Sm90a, FwdForm::default()).unwrap();
        // Q 64 KiB + 2 x (K 40 KiB + V 40 KiB) + 7 barriers + slack
        assert_eq!(c.smem_bytes(), 65536 + 4 * 40960 + 56 + 1024);
        // separate release: 2 more barriers (v_empty per slot)
        let s = AttnFwdConfig { kv_release: KvRelease::Separate, ..c };
        assert_eq!(s.smem_bytes(), c.smem_bytes() + 16);
    }

    #[test]
    fn forms_render_their_template_argument_and_forced_stages_fit() {
        let sep = FwdForm { kv_release: KvRelease::Separate, ..FwdForm::default() };
        let c = fwd_config(128, VariantKind::CAUSAL, DType::BF16, Arch::Sm90a, sep).unwrap();
        assert!(c.name_expression().ends_with(", __nv_bfloat16, true>"), "{}", c.name_expression());
        let d = fwd_config(128, VariantKind::CAUSAL, DType::BF16, Arch::Sm90a, FwdForm::default()).unwrap();
        assert!(d.name_expression().ends_with(", __nv_bfloat16>"), "{}", d.name_expression());
        // 3 slots at d 128: Q 32 KiB + 3 x 64 KiB + barriers fit in 227 KiB
        let three = FwdForm { stages: RingStages::Fixed(3), ..sep };
        let c3 = fwd_config(128, VariantKind::CAUSAL, DType::BF16, Arch::Sm90a, three).unwrap();
        assert_eq!(c3.stages, 3);
        assert_fits_smem(&c3);
        // 4 slots do not fit at d 128 (288 KiB), nor 3 at d 256: the deepest that fits
        let four = FwdForm { stages: RingStages::Fixed(4), ..sep };
        assert_eq!(fwd_config(128, VariantKind::CAUSAL, DType::BF16, Arch::Sm90a, four).unwrap().stages, 3);
        assert_eq!(fwd_config(256, VariantKind::CAUSAL, DType::BF16, Arch::Sm90a, three).unwrap().stages, 2);
        assert_eq!(fwd_config(64, VariantKind::CAUSAL, DType::BF16, Arch::Sm90a, four).unwrap().stages, 4);
        let production = fwd_production_configs(Arch::Sm90a);
        let candidates = fwd_candidate_configs(Arch::Sm90a);
        for c in &candidates {
            // the forced forms, and the d 192 kernel in the rule's forms; none twice
            assert!(FORCED_FORMS.contains(&(c.kv_release, c.persistent)) || c.head_dim == 192, "{c:?}");
            assert!(!production.contains(c), "{c:?}");
            assert_fits_smem(c);
        }
        // 4 forms x 3 head dims x the points, less the production ones, plus d 192's (one form a point)
        let points = 2 * production_variants().len();
        assert_eq!(candidates.len(), 12 * points - production.len() + points);
        assert!(fwd_candidate_configs(Arch::Sm90a).iter().filter(|c| c.head_dim == 192).all(|c| c.block_n % 16 == 0));
    }

    /// The rule picks, at each point measured (bench/results/sm90_forms_h100_20261207: d 64 / 128 /
    /// 256, 1k and 8k keys, causal and not), the best form measured there or one within 3 % of it.
    #[test]
    fn the_form_rule_takes_the_measured_forms_and_yields_to_forced_knobs() {
        use KvRelease::{Separate, Together};
        let auto = FwdPolicy::default();
        for (hd, mask, s_k, release, persistent) in [
            (64, MaskKind::None, 1024, Separate, true),
            (64, MaskKind::None, 8192, Together, false),
            (64, MaskKind::Causal, 8192, Separate, true),
            (128, MaskKind::None, 1024, Separate, true),
            (128, MaskKind::None, 8192, Separate, false),
            (128, MaskKind::Causal, 1024, Separate, true),
            (128, MaskKind::Local, 32768, Separate, true),
            (256, MaskKind::None, 1024, Separate, false),
            (256, MaskKind::Causal, 8192, Separate, true),
            (96, MaskKind::None, 8192, Separate, false),
        ] {
            let f = auto.form(hd, mask, s_k);
            assert_eq!((f.kv_release, f.persistent), (release, persistent), "d {hd} {mask:?} s_k {s_k}");
        }
        let forced = FwdPolicy { kv_release: Choice::Fixed(Together), persistent: Choice::Fixed(false), ..auto };
        let f = forced.form(128, MaskKind::Causal, 1024);
        assert_eq!((f.kv_release, f.persistent), (Together, false));
        let pers = FwdPolicy { persistent: Choice::Fixed(true), ..auto };
        assert_eq!(pers.form(64, MaskKind::None, 8192).kv_release, Separate);
        // a forced release keeps the rule's persistent choice, and the reverse
        let together = FwdPolicy { kv_release: Choice::Fixed(Together), ..auto }.form(64, MaskKind::Causal, 512);
        assert_eq!((together.kv_release, together.persistent), (Together, true));
        let off = FwdPolicy { persistent: Choice::Fixed(false), ..auto }.form(64, MaskKind::Causal, 512);
        assert_eq!((off.kv_release, off.persistent), (Together, false));
        // the key-length threshold, unmasked
        assert!(auto.form(128, MaskKind::None, PERSISTENT_MAX_SEQLEN_K).persistent);
        assert!(!auto.form(128, MaskKind::None, PERSISTENT_MAX_SEQLEN_K + 1).persistent);
        // the d 192 kernel (opt-in) releases separately
        assert_eq!(FwdPolicy { d192: true, ..auto }.form(160, MaskKind::None, 8192).kv_release, Separate);
    }

    /// Every m block of every head runs once, and under a causal mask (m block m holds m + 1 key
    /// tiles at 128 x 128) the blocks' work is balanced: each unit pairs a heavy m block with a
    /// light one.
    #[test]
    fn persistent_units_cover_every_tile_once_and_balance_causal_work() {
        use crate::tuning::grid::balanced_grid;
        // (s, heads, batch) of the bench grid's causal points at 16k tokens, and odd tile counts
        for (s, h, b) in [(1024u64, 16u64, 16u64), (8192, 16, 2), (2048, 32, 8), (4096, 8, 4), (512, 16, 32),
                          (16384, 8, 1), (1000, 7, 3), (300, 4, 37), (128, 1, 1)] {
            let n_m = s.div_ceil(128);
            let units = persistent_units(s, h, b);
            for grid in [balanced_grid(units, 132), units.min(132)] {
                let mut seen = vec![0u32; (n_m * h * b) as usize];
                let mut work = Vec::new();
                for blk in 0..grid {
                    let ms = persistent_m_blocks(blk, grid, units, n_m);
                    // the units' heads and batches in order: recover them to count each tile once
                    let mut u = blk;
                    let mut i = 0;
                    while u < units {
                        let pairs = n_m.div_ceil(2);
                        let hb = u / pairs;
                        let x = u % pairs;
                        for m in [n_m - 1 - x, x].into_iter().take(if x == n_m - 1 - x { 1 } else { 2 }) {
                            assert_eq!(ms[i], m);
                            seen[(hb * n_m + m) as usize] += 1;
                            i += 1;
                        }
                        u += grid;
                    }
                    work.push(ms.iter().map(|m| m + 1).sum::<u64>());
                }
                assert!(seen.iter().all(|&c| c == 1), "s {s} grid {grid}");
                let max = *work.iter().max().unwrap() as f64;
                let mean = work.iter().sum::<u64>() as f64 / grid as f64;
                // no block takes more than its share of whole units, each of at most n_m + 1 key tiles
                assert!(max <= (units.div_ceil(grid) * (n_m + 1)) as f64, "s {s} h {h} b {b} grid {grid}: max {max}");
                if units >= 4 * grid {
                    assert!(max / mean < 1.1, "s {s} h {h} b {b} grid {grid}: max {max} mean {mean}");
                }
            }
        }
    }

    #[test]
    fn the_persistent_form_renders_both_arguments_and_its_o_tile() {
        let pers = FwdForm { persistent: true, ..FwdForm::default() };
        let c = fwd_config(128, VariantKind::CAUSAL, DType::BF16, Arch::Sm90a, pers).unwrap();
        assert!(c.name_expression().ends_with(", __nv_bfloat16, false, true>"), "{}", c.name_expression());
        let plain = AttnFwdConfig { persistent: false, ..c };
        // its own O tile (128 x 128 x 2 B) and the q_empty barrier
        assert_eq!(c.smem_bytes(), plain.smem_bytes() + 32768 + 8);
        let sep = fwd_config(256, VariantKind::CAUSAL, DType::BF16, Arch::Sm90a,
                             FwdForm { kv_release: KvRelease::Separate, ..pers }).unwrap();
        assert!(sep.name_expression().ends_with(", true, true>"), "{}", sep.name_expression());
        // d 256: O staged in the Q tile (no room for its own)
        assert_eq!(sep.smem_bytes(), AttnFwdConfig { persistent: false, ..sep }.smem_bytes() + 8);
        // 3 slots and an O tile do not fit at d 128: 2
        let three = FwdForm { stages: RingStages::Fixed(3), ..pers };
        assert_eq!(fwd_config(128, VariantKind::CAUSAL, DType::BF16, Arch::Sm90a, three).unwrap().stages, 2);
    }
}
