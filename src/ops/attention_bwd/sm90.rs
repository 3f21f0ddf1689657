//! The sm90 attention-backward family (kernels/attention/bwd_sm90.cuh: TMA, mbarriers, wgmma,
//! warp specialisation) for sm_90a: its tensor maps, parameters and the choice of plan.
//! `prepare` says whether a call runs the Hopper plan (`bwd_plan_sm90`); everything it declines
//! runs `bwd_plan` (the sm80 family; never an error).

use super::{AttnBwdParams, BwdTensors};
use crate::arch::Arch;
use crate::error::Result;
use crate::ops::attention::sm90::map;
use crate::ops::attention::{Problem, VariantKind, MAX_LAUNCH_BATCH};
use crate::tma::TensorMap;
use crate::tuning::attention_bwd::{bwd_plan_sm90, dq_tile_head_dim, AttnBwdConfig};
use crate::tuning::knobs::FamilyChoice;

/// Mirror of `struct AttnBwdSm90Params` in kernels/attention/bwd_sm90.cuh (change both
/// together): the backward's parameters after the four tensor maps.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AttnBwdSm90Params {
    pub tma_q: TensorMap,
    pub tma_k: TensorMap,
    pub tma_v: TensorMap,
    pub tma_do: TensorMap,
    pub p: AttnBwdParams,
}

/// Whether the Hopper backward may take a call of this shape: the knob not set to sm80, the
/// padded layout (or varlen where `varlen_ok`: knob `attn_sm90_bwd_varlen`) and a batch within
/// one grid (the plan itself also needs sm_90a and a head dim up to 128, and under `Auto` the
/// atomic-dQ path: `bwd_plan_sm90`).
pub fn supports(p: &Problem, family: FamilyChoice, varlen_ok: bool) -> bool {
    family != FamilyChoice::Sm80 && (!p.varlen || varlen_ok) && p.batch <= MAX_LAUNCH_BATCH
}

/// Whether a call's dq_accum can take the Hopper kernel's tile layout (kernels/attention/
/// bwd_sm90.cuh, `DqTiled`): the padded layout, s_q a multiple of the 64-row query tile and a
/// head dim that is a kernel head dim (64 or 128). Then the tiles cover exactly the elements of
/// q's shape, so the same dense (b, s_q, h, d) fp32 buffer holds them and the preprocess kernel's
/// zeroing (through `dq_accum_tiled_strides`) clears every one.
pub fn dq_tileable(p: &Problem) -> bool {
    !p.varlen && p.seqlen_q % 64 == 0 && u32::try_from(p.head_dim).is_ok_and(dq_tile_head_dim)
}

/// dq_accum's (batch, row, head) strides in the tile layout: those of a contiguous (b, h, s_q,
/// d) tensor, so that the row layout's offset of row 64 m of head h, batch b is the tile's first
/// float (bwd_sm90.cuh); the kernels that read dq_accum by rows (preprocess) then touch the same
/// set of elements.
pub fn dq_accum_tiled_strides(p: &Problem) -> (i64, i64, i64) {
    (p.heads * p.seqlen_q * p.head_dim, p.head_dim, p.seqlen_q * p.head_dim)
}

/// The Hopper plan of a validated call and its tensor maps, or None when the call runs the sm80
/// plan (`supports`, `bwd_plan_sm90`, or a tensor map the driver rejects). `dq_tiled`: knob
/// `attn_sm90_bwd_dq_tiled` (taken where `dq_tileable`); `mask_warps`: knob
/// `attn_sm90_bwd_mask_warps`.
#[allow(clippy::too_many_arguments)]
pub fn prepare(
    p: &Problem,
    t: &BwdTensors<'_>,
    kind: VariantKind,
    deterministic: bool,
    arch: Arch,
    family: FamilyChoice,
    dq_overlap: bool,
    varlen_ok: bool,
    dq_tiled: bool,
    mask_warps: bool,
) -> Option<(Vec<AttnBwdConfig>, [TensorMap; 4])> {
    if !supports(p, family, varlen_ok) {
        return None;
    }
    let tiled = dq_tiled && dq_tileable(p);
    let plan = bwd_plan_sm90(p.head_dim as u32, kind, deterministic, p.dtype, arch, family, dq_overlap, p.varlen, tiled,
                             mask_warps)?;
    let maps = (|| -> Result<_> {
        Ok([
            map("q", t.q, p.dtype, 64)?,
            map("k", t.k, p.dtype, 128)?,
            map("v", t.v, p.dtype, 128)?,
            map("dout", t.dout, p.dtype, 64)?,
        ])
    })();
    maps.ok().map(|m| (plan, m))
}

/// The sm90 kernel's parameters: the maps of `prepare` and the backward's parameters.
pub fn params(maps: &[TensorMap; 4], p: AttnBwdParams) -> AttnBwdSm90Params {
    let [tma_q, tma_k, tma_v, tma_do] = *maps;
    AttnBwdSm90Params { tma_q, tma_k, tma_v, tma_do, p }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn params_layout_matches_the_kernel() {
        assert_eq!(align_of::<AttnBwdSm90Params>(), 128);
        assert_eq!(offset_of!(AttnBwdSm90Params, tma_k), 128);
        assert_eq!(offset_of!(AttnBwdSm90Params, tma_do), 384);
        assert_eq!(offset_of!(AttnBwdSm90Params, p), 512);
        assert_eq!(size_of::<AttnBwdSm90Params>() % 128, 0);
    }

    fn problem(varlen: bool, batch: i64) -> Problem {
        Problem {
            varlen,
            batch,
            seqlen_q: 512,
            seqlen_k: 512,
            heads: 8,
            heads_k: 2,
            head_dim: 128,
            dtype: DType::BF16,
            device: 0,
        }
    }

    #[test]
    fn dq_accum_tiles_fill_q_shape_only_at_whole_tiles_and_kernel_head_dims() {
        let p = problem(false, 2);
        assert!(dq_tileable(&p));
        assert!(dq_tileable(&Problem { head_dim: 64, seqlen_q: 64, ..p }));
        assert!(!dq_tileable(&Problem { seqlen_q: 500, ..p }));
        assert!(!dq_tileable(&Problem { head_dim: 96, ..p }));
        assert!(!dq_tileable(&Problem { head_dim: 32, ..p }));
        assert!(!dq_tileable(&problem(true, 2)));
        // (b, h, s, d) strides: the last tile of the last head of the last batch ends at b·s·h·d
        let (bs, rs, hs) = dq_accum_tiled_strides(&p);
        assert_eq!((bs, rs, hs), (8 * 512 * 128, 128, 512 * 128));
        let last = (p.batch - 1) * bs + (p.heads - 1) * hs + (p.seqlen_q - 64) * rs + 64 * 128;
        assert_eq!(last, p.batch * p.seqlen_q * p.heads * p.head_dim);
    }

    #[test]
    fn supports_padded_calls_within_one_grid_unless_the_knob_says_sm80() {
        assert!(supports(&problem(false, 2), FamilyChoice::Auto, false));
        assert!(supports(&problem(false, 2), FamilyChoice::Sm90, false));
        assert!(!supports(&problem(false, 2), FamilyChoice::Sm80, false));
        assert!(!supports(&problem(true, 2), FamilyChoice::Auto, false));
        // varlen: only with attn_sm90_bwd_varlen
        assert!(supports(&problem(true, 2), FamilyChoice::Auto, true));
        assert!(!supports(&problem(true, 2), FamilyChoice::Sm80, true));
        assert!(!supports(&problem(false, MAX_LAUNCH_BATCH + 1), FamilyChoice::Sm90, false));
    }

    /// Both production head dims compile for sm_90a; prints ptxas's report (registers, spills,
    /// wgmma serialisation warnings). `-- --ignored sm90_bwd_compiles --nocapture`;
    /// FERROATTN_TEST_SM90_BWD_VARIANT=plain|causal|local|softcap-local|softcap|alibi|dropout picks the variant,
    /// FERROATTN_TEST_SM90_HD=64|128 the head dim, FERROATTN_TEST_SM90_VARLEN=1 the varlen layout.
    #[test]
    #[ignore]
    fn sm90_bwd_compiles() {
        use crate::ops::attention::MaskKind;
        use crate::tuning::attention_bwd::BwdKind;
        let Some(_) = crate::jit::nvrtc::tests::toolchain() else { return };
        let filter = std::env::var("FERROATTN_TEST_SM90_HD").ok();
        let varlen = std::env::var("FERROATTN_TEST_SM90_VARLEN").is_ok_and(|v| v == "1");
        let v = match std::env::var("FERROATTN_TEST_SM90_BWD_VARIANT").as_deref() {
            Ok("plain") => VariantKind::PLAIN,
            Ok("local") => VariantKind { mask: MaskKind::Local, ..VariantKind::PLAIN },
            Ok("softcap-local") => VariantKind { mask: MaskKind::Local, softcap: true, ..VariantKind::PLAIN },
            Ok("softcap") => VariantKind { softcap: true, ..VariantKind::CAUSAL },
            Ok("alibi") => VariantKind { alibi: true, ..VariantKind::CAUSAL },
            Ok("dropout") => VariantKind { dropout: true, ..VariantKind::CAUSAL },
            _ => VariantKind::CAUSAL,
        };
        for hd in [64u32, 128] {
            if filter.as_deref().is_some_and(|f| f != hd.to_string()) {
                continue;
            }
            // the atomic kernel in both product orders, and the deterministic plan's (no dQ)
            // (and, under dropout, each with the mask warps)
            for (dq_overlap, dq) in [(false, true), (true, true), (false, false)] {
                let c = crate::tuning::attention_bwd::sm90_dkdv_config(hd, v, DType::BF16, Arch::Sm90a, dq_overlap, varlen, dq);
                crate::jit::nvrtc::tests::print_compile(&c, Arch::Sm90a);
                if v.dropout {
                    let mut m = c;
                    if let BwdKind::DkDvSm90 { mask_warps, .. } = &mut m.kind {
                        *mask_warps = true;
                    }
                    crate::jit::nvrtc::tests::print_compile(&m, Arch::Sm90a);
                }
            }
        }
    }

    /// Every production sm90 backward configuration compiles without spills (`python -m
    /// ferroattn precompile --check-spills` covers it with the other families).
    #[test]
    #[ignore]
    fn sm90_bwd_production_specs_compile_without_spills() {
        use crate::tuning::attention_bwd::{bwd_production_configs, BwdKind};
        let Some(_) = crate::jit::nvrtc::tests::toolchain() else { return };
        let specs: Vec<_> =
            bwd_production_configs(Arch::Sm90a).into_iter().filter(|c| matches!(c.kind, BwdKind::DkDvSm90 { .. })).collect();
        crate::jit::nvrtc::tests::assert_compile_without_spills(&specs);
    }
}
