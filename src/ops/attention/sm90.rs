//! The sm90 attention-forward family (kernels/attention/fwd_sm90.cuh: TMA, mbarriers, wgmma,
//! warp specialisation) for sm_90a: tensor maps, parameters and the launch. `prepare` says
//! whether a call runs here; everything it declines runs on the sm80 family (never an error).

use crate::arch::Arch;
use crate::dtype::DType;
use crate::error::Result;
use crate::launch::launch as launch_kernel;
use crate::launch_record::LaunchInfo;
use crate::ops::attention::{launch_shape, AttnFwdParams, Problem, VariantKind, KERNELS, MAX_LAUNCH_BATCH};
use crate::tensor::TensorView;
use crate::tma::{Swizzle, TensorMap, Tiled};
use crate::tuning::attention::AttnFwdConfig;
use crate::tuning::attention_sm90::{fwd_config, FwdPolicy, BLOCK_M};
use crate::tuning::knobs::{Choice, FamilyChoice};

/// Mirror of `struct AttnFwdSm90Params` in kernels/attention/fwd_sm90.cuh (change both
/// together): the forward's parameters after the four tensor maps.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AttnFwdSm90Params {
    pub tma_q: TensorMap,
    pub tma_k: TensorMap,
    pub tma_v: TensorMap,
    pub tma_o: TensorMap,
    pub p: AttnFwdParams,
}

/// Whether the sm90 kernel takes a call of this shape: sm_90a (and the knob not set to sm80),
/// the padded layout (or varlen where `policy.varlen`), a batch within one grid, a head dim with a
/// specialisation. The tensor maps must also encode (`prepare`).
pub fn supports(p: &Problem, arch: Arch, family: FamilyChoice, policy: FwdPolicy) -> bool {
    family != FamilyChoice::Sm80
        && arch == Arch::Sm90a
        && (!p.varlen || policy.varlen)
        && p.batch <= MAX_LAUNCH_BATCH
        && crate::tuning::attention_sm90::kernel_head_dim(p.head_dim as u32, policy.d192).is_some()
}

/// The output tiles of a call (query tiles of BLOCK_M rows x heads x batch), the grid of the
/// non-persistent form.
fn tiles(p: &Problem) -> u64 {
    (p.seqlen_q as u64).div_ceil(BLOCK_M as u64) * p.heads as u64 * p.batch as u64
}

/// The rank-4 map (head dim, rows, heads, batch) of a padded q/k/v/out-like tensor, box
/// (64, `box_rows`, 1, 1), 128-byte swizzle; a varlen (total, heads, head dim) tensor maps as one
/// batch entry of `total` rows. A dim of size 1 gets the packed stride (it is never stepped over;
/// TMA wants every stride a multiple of 16 bytes).
pub(crate) fn map(arg: &str, t: &TensorView, dtype: DType, box_rows: u32) -> Result<TensorMap> {
    let (shape, strides) = match t.meta.shape.len() {
        3 => (
            vec![1, t.meta.shape[0], t.meta.shape[1], t.meta.shape[2]],
            vec![0, t.meta.strides[0], t.meta.strides[1], t.meta.strides[2]],
        ),
        _ => (t.meta.shape.clone(), t.meta.strides.clone()),
    };
    let elem = dtype.size_bytes() as u64;
    let round16 = |x: u64| x.div_ceil(16).max(1) * 16;
    // dims innermost first: head dim, rows, heads, batch (shape is (b, s, h, d))
    let dims = [shape[3] as u64, (shape[1] as u64).max(1), shape[2] as u64, shape[0] as u64];
    let given = [strides[1] as u64 * elem, strides[2] as u64 * elem, strides[0] as u64 * elem];
    let mut strides_bytes = [0u64; 3];
    let mut packed = dims[0] * elem;
    for i in 0..3 {
        strides_bytes[i] = if dims[i + 1] > 1 { given[i] } else { round16(packed) };
        packed = strides_bytes[i] * dims[i + 1];
    }
    Tiled {
        dtype,
        ptr: t.ptr,
        dims: dims.to_vec(),
        strides_bytes: strides_bytes.to_vec(),
        box_dims: vec![64, box_rows, 1, 1],
        swizzle: Swizzle::B128,
    }
    .encode(arg)
}

/// One sm90 launch, ready to go.
pub struct Prepared {
    config: AttnFwdConfig,
    params: AttnFwdSm90Params,
    device: i32,
    problem: Problem,
}

/// The sm90 launch of a validated call, or None when the sm90 family does not take it
/// (`supports`, or a tensor map the driver rejects: the call then runs on sm80).
#[allow(clippy::too_many_arguments)]
pub fn prepare(
    p: &Problem,
    kind: VariantKind,
    arch: Arch,
    family: FamilyChoice,
    policy: FwdPolicy,
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    out: &TensorView,
    prm: &AttnFwdParams,
) -> Result<Option<Prepared>> {
    if !supports(p, arch, family, policy) {
        return Ok(None);
    }
    // The persistent kernel numbers its tiles with 32-bit integers: more tiles take the rule's
    // non-persistent form.
    let policy = if tiles(p) > i32::MAX as u64 { FwdPolicy { persistent: Choice::Fixed(false), ..policy } } else { policy };
    let form = policy.form(p.head_dim as u32, kind.mask, p.seqlen_k as u64);
    let Some(config) = fwd_config(p.head_dim as u32, kind, p.dtype, arch, form) else { return Ok(None) };
    let maps = (|| -> Result<_> {
        Ok((
            map("q", q, p.dtype, BLOCK_M)?,
            map("k", k, p.dtype, config.block_n)?,
            map("v", v, p.dtype, config.block_n)?,
            map("out", out, p.dtype, 64)?,
        ))
    })();
    let Ok((tma_q, tma_k, tma_v, tma_o)) = maps else { return Ok(None) };
    Ok(Some(Prepared {
        config,
        params: AttnFwdSm90Params { tma_q, tma_k, tma_v, tma_o, p: *prm },
        device: p.device,
        problem: *p,
    }))
}

impl Prepared {
    pub fn config(&self) -> &AttnFwdConfig {
        &self.config
    }

    /// # Safety
    /// The tensors the maps and parameters describe stay alive in stream order.
    pub unsafe fn launch(mut self, stream: u64, info: &LaunchInfo) -> Result<()> {
        let mut shape = launch_shape(&self.problem, &self.config);
        if self.config.persistent {
            // one block per SM at most (the kernel's occupancy), over its share of the tiles
            let sms = crate::device::sm_count(self.device)? as u64;
            let p = &self.problem;
            let units = crate::tuning::attention_sm90::persistent_units(p.seqlen_q as u64, p.heads as u64, p.batch as u64);
            let grid = crate::ops::persistent::persistent_grid(units, sms)?;
            shape.grid = (grid as u32, 1, 1);
        }
        shape.check()?;
        let kernel = KERNELS.get(&self.config, self.device)?;
        // SAFETY: `params` mirrors AttnFwdSm90Params; forwarded from the caller.
        unsafe { launch_kernel(kernel, self.device, &shape, stream, &mut self.params, info) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};
    use crate::tuning::attention::KvRelease;
    use crate::tuning::attention_sm90::FwdForm;

    #[test]
    fn params_layout_matches_the_kernel() {
        assert_eq!(align_of::<AttnFwdSm90Params>(), 128);
        assert_eq!(offset_of!(AttnFwdSm90Params, tma_k), 128);
        assert_eq!(offset_of!(AttnFwdSm90Params, tma_o), 384);
        assert_eq!(offset_of!(AttnFwdSm90Params, p), 512);
        assert_eq!(size_of::<AttnFwdSm90Params>() % 128, 0);
    }

    fn problem(varlen: bool, batch: i64, head_dim: i64) -> Problem {
        Problem {
            varlen,
            batch,
            seqlen_q: 512,
            seqlen_k: 512,
            heads: 8,
            heads_k: 2,
            head_dim,
            dtype: DType::BF16,
            device: 0,
        }
    }

    #[test]
    fn supports_padded_hopper_calls_within_one_grid() {
        let p = problem(false, 2, 128);
        assert!(supports(&p, Arch::Sm90a, FamilyChoice::Auto, FwdPolicy::default()));
        assert!(supports(&p, Arch::Sm90a, FamilyChoice::Sm90, FwdPolicy::default()));
        assert!(!supports(&p, Arch::Sm90a, FamilyChoice::Sm80, FwdPolicy::default()));
        assert!(!supports(&p, Arch::Sm80, FamilyChoice::Sm90, FwdPolicy::default()));
        assert!(!supports(&p, Arch::Sm120, FamilyChoice::Auto, FwdPolicy::default()));
        assert!(!supports(&problem(true, 2, 128), Arch::Sm90a, FamilyChoice::Auto, FwdPolicy::default()));
        // varlen: only with the candidate knob (attn_sm90_fwd_varlen)
        let varlen = FwdPolicy { varlen: true, ..FwdPolicy::default() };
        assert!(supports(&problem(true, 2, 128), Arch::Sm90a, FamilyChoice::Auto, varlen));
        assert!(!supports(&problem(true, 2, 128), Arch::Sm90a, FamilyChoice::Sm80, varlen));
        assert!(!supports(&problem(false, MAX_LAUNCH_BATCH + 1, 128), Arch::Sm90a, FamilyChoice::Auto, FwdPolicy::default()));
        assert!(supports(&problem(false, 1, 8), Arch::Sm90a, FamilyChoice::Auto, FwdPolicy::default()));
        assert!(supports(&problem(false, 1, 256), Arch::Sm90a, FamilyChoice::Auto, FwdPolicy::default()));
    }

    /// One specialisation per head dim compiles for sm_90a; prints ptxas's report (registers,
    /// spills, wgmma serialisation warnings). `-- --ignored sm90_fwd_compiles --nocapture`.
    #[test]
    #[ignore]
    fn sm90_fwd_compiles() {
        let Some(_) = crate::jit::nvrtc::tests::toolchain() else { return };
        let filter = std::env::var("FERROATTN_TEST_SM90_HD").ok();
        for hd in [64u32, 128, 256] {
            if filter.as_deref().is_some_and(|f| f != hd.to_string()) {
                continue;
            }
            for kv_release in [KvRelease::Together, KvRelease::Separate] {
                let form = FwdForm { kv_release, ..FwdForm::default() };
                let c = fwd_config(hd, VariantKind::CAUSAL, DType::BF16, Arch::Sm90a, form).unwrap();
                crate::jit::nvrtc::tests::print_compile(&c, Arch::Sm90a);
            }
        }
    }

    /// Every production sm90 configuration and its A/B candidate form compile without spills (72 NVRTC compiles;
    /// `python -m ferroattn precompile --check-spills` covers it with the other families).
    #[test]
    #[ignore]
    fn sm90_fwd_production_specs_compile_without_spills() {
        let Some(_) = crate::jit::nvrtc::tests::toolchain() else { return };
        let mut specs = crate::tuning::attention_sm90::fwd_production_configs(Arch::Sm90a);
        specs.extend(crate::tuning::attention_sm90::fwd_candidate_configs(Arch::Sm90a));
        crate::jit::nvrtc::tests::assert_compile_without_spills(&specs);
    }
}
