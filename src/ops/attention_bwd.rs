//! Attention backward: argument validation (shared by `attn_bwd_check` on metadata and
//! `attn_bwd` on real tensors), the kernel parameter struct, and the launches of one call's
//! plan (`tuning::attention_bwd::bwd_plan`: preprocess → dK/dV → dQ convert or dQ kernel).
//!
//! Layouts as in the forward (src/ops/attention.rs, kernels/attention/bwd_params.cuh):
//!   padded: dout/out/dq like q (b, s_q, h, d), dk/dv like k/v (b, s_k, h_k, d),
//!           softmax_lse/softmax_d (b, h, s_q) fp32, dq_accum (b, s_q, h, d) fp32;
//!   varlen: dout/out/dq (total_q, h, d), dk/dv (total_k, h_k, d), softmax_lse/softmax_d
//!           (h, total_q) fp32, dq_accum (total_q, h, d) fp32.
//! The kernels read softmax_d with softmax_lse's strides, so softmax_d must have them.
//! q, k, v, cu_seqlens and max_seqlen are checked by the forward's `validate` (same errors).
//! A batch beyond the grid's 65535 runs the plan once per slice of it, as the forward does
//! (src/ops/attention/batch.rs).

use super::attention::batch::{advanced, advanced_mut, F32_BYTES};
use super::attention::{
    batch_row_head_strides, batch_slices, check_dense, check_tile_layout, params as fwd_params,
    validate as fwd_validate, AttnFwdParams, AttnVariant, BatchSlice, Problem, VariantKind,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::arch::Arch;
use crate::jit::{impl_kernel_spec, KernelMap, KernelSpec};
use crate::launch::launch;
use crate::launch_record::{LaunchInfo, LaunchShape};
use crate::ops::validate::{
    check_device, check_disjoint, check_dtype, check_no_self_overlap, check_not_null, check_shape,
    check_strides, NO_ELEMENT_TWICE,
};
use crate::ops::attention::work::AttnSizes;
use crate::tensor::{TensorMeta, TensorView};
use crate::tuning::attention_bwd::{bwd_plan, bwd_production_configs, AttnBwdConfig, BwdKind};
use std::ffi::c_void;

pub mod sm90;

/// Mirror of `struct AttnBwdParams` in kernels/attention/bwd_params.cuh (change both together).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AttnBwdParams {
    pub fwd: AttnFwdParams,
    pub dout: *const c_void,
    pub dq: *mut c_void,
    pub dk: *mut c_void,
    pub dv: *mut c_void,
    pub softmax_d: *mut f32,
    /// Null on the deterministic path.
    pub dq_accum: *mut f32,

    pub do_batch_stride: i64,
    pub do_row_stride: i64,
    pub do_head_stride: i64,
    pub dq_batch_stride: i64,
    pub dq_row_stride: i64,
    pub dq_head_stride: i64,
    pub dk_batch_stride: i64,
    pub dk_row_stride: i64,
    pub dk_head_stride: i64,
    pub dv_batch_stride: i64,
    pub dv_row_stride: i64,
    pub dv_head_stride: i64,
    pub dqa_batch_stride: i64,
    pub dqa_row_stride: i64,
    pub dqa_head_stride: i64,
}

impl AttnBwdParams {
    /// A copy for the launches over slice `s` (`AttnFwdParams::slice` for the forward's part);
    /// `dtype` is q's: the element type of dout, dq, dk and dv.
    pub fn slice(&self, dtype: DType, s: BatchSlice) -> AttnBwdParams {
        let e = dtype.size_bytes() as i64;
        let b = s.start;
        AttnBwdParams {
            fwd: self.fwd.slice(dtype, s),
            dout: advanced(self.dout, b * self.do_batch_stride * e),
            dq: advanced_mut(self.dq, b * self.dq_batch_stride * e),
            dk: advanced_mut(self.dk, b * self.dk_batch_stride * e),
            dv: advanced_mut(self.dv, b * self.dv_batch_stride * e),
            // softmax_d has lse's layout (validated): the kernels index it with lse's strides
            softmax_d: advanced_mut(self.softmax_d, b * self.fwd.lse_batch_stride * F32_BYTES),
            dq_accum: advanced_mut(self.dq_accum, b * self.dqa_batch_stride * F32_BYTES),
            ..*self
        }
    }
}

impl_kernel_spec!(AttnBwdConfig, smem: |c| c.smem_bytes());

/// What `precompile` builds for this family.
pub fn production_specs(arch: Arch) -> Vec<AttnBwdConfig> {
    bwd_production_configs(arch)
}

/// The tensors `attn_bwd` writes (metadata), for validation.
#[derive(Clone, Copy, Debug)]
pub struct GradsMeta<'a> {
    pub dq: &'a TensorMeta,
    pub dk: &'a TensorMeta,
    pub dv: &'a TensorMeta,
    pub softmax_d: &'a TensorMeta,
    /// Required unless `deterministic`; ignored when it is.
    pub dq_accum: Option<&'a TensorMeta>,
    pub deterministic: bool,
}

/// Like q (or k, v): same shape and dtype; device, stride(-1) == 1, non-negative strides,
/// and (for outputs) no element written twice.
fn check_like(
    arg: &str,
    t: &TensorMeta,
    like: &TensorMeta,
    like_name: &str,
    q: &TensorMeta,
    written: bool,
) -> Result<()> {
    check_device(arg, t, "q", q)?;
    check_dtype(arg, t, like.dtype, &format!(" ({like_name}'s dtype)"))?;
    check_shape(arg, t, &like.shape, &format!(" ({like_name}'s shape)"))?;
    check_strides(arg, t)?;
    if written {
        check_no_self_overlap(arg, t, NO_ELEMENT_TWICE)?;
    }
    Ok(())
}

/// Validate attention-backward arguments from metadata alone. `grads` is None from
/// `attn_bwd_check` (the Python layer allocates the outputs from the same rules).
#[allow(clippy::too_many_arguments)]
pub fn validate(
    dout: &TensorMeta,
    q: &TensorMeta,
    k: &TensorMeta,
    v: &TensorMeta,
    out: &TensorMeta,
    softmax_lse: &TensorMeta,
    cu_seqlens_q: Option<&TensorMeta>,
    cu_seqlens_k: Option<&TensorMeta>,
    max_seqlen_q: i64,
    max_seqlen_k: i64,
    grads: Option<&GradsMeta<'_>>,
) -> Result<Problem> {
    // q, k, v, cu_seqlens, max_seqlen and softmax_lse (fp32, the forward's LSE shape, dense,
    // row stride 1) exactly as the forward checks them. `out` is an input here: any strides.
    let p = fwd_validate(
        q,
        k,
        v,
        None,
        Some(softmax_lse),
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
    )?;
    check_like("out", out, q, "q", q, false)?;
    check_like("dout", dout, q, "q", q, false)?;
    let Some(g) = grads else {
        return Ok(p);
    };
    check_like("dq", g.dq, q, "q", q, true)?;
    check_like("dk", g.dk, k, "k", q, true)?;
    check_like("dv", g.dv, v, "v", q, true)?;

    let d = g.softmax_d;
    check_device("softmax_d", d, "q", q)?;
    check_dtype("softmax_d", d, DType::F32, "")?;
    check_shape("softmax_d", d, &softmax_lse.shape, " (softmax_lse's shape)")?;
    check_strides("softmax_d", d)?;
    check_dense("softmax_d", d)?;
    let used = |t: &TensorMeta| -> Vec<i64> {
        t.shape
            .iter()
            .zip(&t.strides)
            .map(|(&n, &s)| if n > 1 { s } else { 0 })
            .collect()
    };
    // (an empty tensor's strides are never used)
    if d.numel() > 0 && used(d) != used(softmax_lse) {
        return Err(Error::argument(
            "softmax_d",
            format!(
                "strides {:?} (softmax_lse's layout: the kernels index both alike)",
                softmax_lse.strides
            ),
            format!("strides {:?}", d.strides),
        ));
    }

    if !g.deterministic {
        let Some(a) = g.dq_accum else {
            return Err(Error::argument(
                "dq_accum",
                "an fp32 workspace of q's shape (required when deterministic is False)",
                "None",
            ));
        };
        check_device("dq_accum", a, "q", q)?;
        check_dtype("dq_accum", a, DType::F32, "")?;
        check_shape("dq_accum", a, &q.shape, " (q's shape)")?;
        check_strides("dq_accum", a)?;
        check_dense("dq_accum", a)?;
    }
    Ok(p)
}

/// The checks of `attn_bwd` from metadata alone (`attn_bwd_check`): `validate` without the
/// gradients (the Python layer allocates them from the same rules), then the variant's.
#[allow(clippy::too_many_arguments)]
pub fn check(dout: &TensorMeta, q: &TensorMeta, k: &TensorMeta, v: &TensorMeta, out: &TensorMeta,
             softmax_lse: &TensorMeta, cu_seqlens_q: Option<&TensorMeta>, cu_seqlens_k: Option<&TensorMeta>,
             max_seqlen_q: i64, max_seqlen_k: i64, variant: &AttnVariant<&TensorMeta>) -> Result<VariantKind> {
    let p = validate(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, None)?;
    variant.validate(&p, q)
}

/// Whether any kernel of the plan has a non-empty grid: the per-query kernels need
/// batch · heads · seqlen_q > 0, the dK/dV kernels batch · heads_k · seqlen_k > 0 (they write
/// dk = dv = 0 for keys no query sees, also when seqlen_q == 0).
pub fn needs_launch(p: &Problem) -> bool {
    p.batch > 0 && ((p.seqlen_q > 0 && p.heads > 0) || (p.seqlen_k > 0 && p.heads_k > 0))
}

/// The launch of kernel `c` for problem `p` (one launch's: `Problem::slice`); None when its
/// grid is empty (which depends on the sequence lengths and heads only, not on the batch).
pub fn launch_shape(p: &Problem, c: &AttnBwdConfig) -> Option<LaunchShape> {
    let dim = |x: u64| u32::try_from(x).unwrap_or(u32::MAX); // too large: LaunchShape::check fails
    let (x, y, z) = c.grid(
        p.seqlen_q as u64,
        p.seqlen_k as u64,
        p.heads as u64,
        p.heads_k as u64,
        p.batch as u64,
    );
    (x > 0 && y > 0 && z > 0).then(|| LaunchShape {
        grid: (dim(x), dim(y), dim(z)),
        block: (c.threads(), 1, 1),
        dynamic_smem_bytes: c.smem_bytes(),
    })
}

/// The launches of `plan` for problem `p` (one launch's), in order; kernels with an empty grid
/// are left out.
pub fn launch_shapes(p: &Problem, plan: &[AttnBwdConfig]) -> Vec<(AttnBwdConfig, LaunchShape)> {
    plan.iter()
        .filter_map(|c| launch_shape(p, c).map(|s| (*c, s)))
        .collect()
}

/// The tensors of one `attn_bwd` call.
#[derive(Clone, Copy, Debug)]
pub struct BwdTensors<'a> {
    pub dout: &'a TensorView,
    pub q: &'a TensorView,
    pub k: &'a TensorView,
    pub v: &'a TensorView,
    /// The forward's output.
    pub out: &'a TensorView,
    /// The forward's LSE.
    pub softmax_lse: &'a TensorView,
    pub dq: &'a TensorView,
    pub dk: &'a TensorView,
    pub dv: &'a TensorView,
    pub softmax_d: &'a TensorView,
    pub dq_accum: Option<&'a TensorView>,
    pub cu_seqlens_q: Option<&'a TensorView>,
    pub cu_seqlens_k: Option<&'a TensorView>,
}

impl BwdTensors<'_> {
    /// The workspace the kernels use: None on the deterministic path.
    fn workspace(&self, deterministic: bool) -> Option<&TensorView> {
        if deterministic {
            None
        } else {
            self.dq_accum
        }
    }
}

/// Kernel parameters from validated views (`dq_accum` None: the deterministic path).
pub fn params(
    p: &Problem,
    t: &BwdTensors<'_>,
    dq_accum: Option<&TensorView>,
    softmax_scale: f32,
    variant: &AttnVariant<&TensorView>,
) -> AttnBwdParams {
    let fwd = fwd_params(
        p,
        t.q,
        t.k,
        t.v,
        t.out,
        t.softmax_lse,
        t.cu_seqlens_q,
        t.cu_seqlens_k,
        softmax_scale,
        variant,
    );
    let bsh = |t: &TensorView| batch_row_head_strides(p.varlen, &t.meta);
    let (dob, dor, doh) = bsh(t.dout);
    let (dqb, dqr, dqh) = bsh(t.dq);
    let (dkb, dkr, dkh) = bsh(t.dk);
    let (dvb, dvr, dvh) = bsh(t.dv);
    let (dab, dar, dah) = dq_accum.map_or((0, 0, 0), bsh);
    AttnBwdParams {
        fwd,
        dout: t.dout.ptr as *const c_void,
        dq: t.dq.ptr as *mut c_void,
        dk: t.dk.ptr as *mut c_void,
        dv: t.dv.ptr as *mut c_void,
        softmax_d: t.softmax_d.ptr as *mut f32,
        dq_accum: dq_accum.map_or(std::ptr::null_mut(), |a| a.ptr as *mut f32),
        do_batch_stride: dob,
        do_row_stride: dor,
        do_head_stride: doh,
        dq_batch_stride: dqb,
        dq_row_stride: dqr,
        dq_head_stride: dqh,
        dk_batch_stride: dkb,
        dk_row_stride: dkr,
        dk_head_stride: dkh,
        dv_batch_stride: dvb,
        dv_row_stride: dvr,
        dv_head_stride: dvh,
        dqa_batch_stride: dab,
        dqa_row_stride: dar,
        dqa_head_stride: dah,
    }
}

/// Checks that need the data pointers: non-NULL, 16-byte tile layout of every tile-loaded
/// tensor, and no written tensor sharing memory with another written tensor or an input.
fn check_views(t: &BwdTensors<'_>, deterministic: bool) -> Result<()> {
    let ws = t.workspace(deterministic);
    let reads = [
        ("dout", Some(t.dout)),
        ("q", Some(t.q)),
        ("k", Some(t.k)),
        ("v", Some(t.v)),
        ("out", Some(t.out)),
        ("softmax_lse", Some(t.softmax_lse)),
        ("cu_seqlens_q", t.cu_seqlens_q),
        ("cu_seqlens_k", t.cu_seqlens_k),
    ];
    let writes = [
        ("dq", Some(t.dq)),
        ("dk", Some(t.dk)),
        ("dv", Some(t.dv)),
        ("softmax_d", Some(t.softmax_d)),
        ("dq_accum", ws),
    ];
    for (arg, v) in reads.iter().chain(&writes) {
        if let Some(v) = v {
            check_not_null(arg, v)?;
        }
    }
    let tiles = [
        ("dout", Some(t.dout)),
        ("q", Some(t.q)),
        ("k", Some(t.k)),
        ("v", Some(t.v)),
        ("out", Some(t.out)),
        ("dq", Some(t.dq)),
        ("dk", Some(t.dk)),
        ("dv", Some(t.dv)),
        ("dq_accum", ws),
    ];
    for (arg, v) in tiles {
        if let Some(v) = v {
            check_tile_layout(arg, v)?;
        }
    }
    check_disjoint(&writes, &reads, true)
}

static KERNELS: KernelMap<AttnBwdConfig> = KernelMap::new();

/// Validate everything, then launch the kernels of `bwd_plan` in order on `stream` (raw
/// CUstream; 0 = legacy default) in the primary context of q's device. Never synchronises.
/// Kernels with an empty grid are skipped; a problem with no non-empty grid touches no device.
/// Blocking only on the first call of a configuration (compile or disk-cache load).
pub fn attn_bwd(
    t: &BwdTensors<'_>,
    max_seqlen_q: i64,
    max_seqlen_k: i64,
    softmax_scale: f32,
    variant: &AttnVariant<&TensorView>,
    deterministic: bool,
    stream: u64,
) -> Result<()> {
    let grads = GradsMeta {
        dq: &t.dq.meta,
        dk: &t.dk.meta,
        dv: &t.dv.meta,
        softmax_d: &t.softmax_d.meta,
        dq_accum: t.dq_accum.map(|a| &a.meta),
        deterministic,
    };
    let p = validate(
        &t.dout.meta,
        &t.q.meta,
        &t.k.meta,
        &t.v.meta,
        &t.out.meta,
        &t.softmax_lse.meta,
        t.cu_seqlens_q.map(|c| &c.meta),
        t.cu_seqlens_k.map(|c| &c.meta),
        max_seqlen_q,
        max_seqlen_k,
        Some(&grads),
    )?;
    let kind = variant.metas().validate(&p, &t.q.meta)?;
    if !(softmax_scale.is_finite() && softmax_scale > 0.0) {
        return Err(Error::argument(
            "softmax_scale",
            "a finite number > 0",
            softmax_scale,
        ));
    }
    if !needs_launch(&p) {
        return Ok(());
    }
    check_views(t, deterministic)?;
    if let Some(a) = variant.alibi_slopes {
        check_not_null("alibi_slopes", a)?;
    }
    let arch = crate::device::arch(p.device)?;
    // The Hopper plan where it takes the call (sm90.rs), else the sm80 family's.
    let knobs = crate::tuning::knobs::get()?;
    let (plan, maps) =
        match sm90::prepare(&p, t, kind, deterministic, arch, knobs.attn_bwd_family, knobs.attn_sm90_bwd_dq_overlap,
                            knobs.attn_sm90_bwd_varlen, knobs.attn_sm90_bwd_dq_tiled, knobs.attn_sm90_bwd_mask_warps) {
        Some((plan, maps)) => (plan, Some(maps)),
        None => (bwd_plan(p.head_dim as u32, kind, deterministic, p.dtype, arch), None),
    };
    // Everything that can fail before the first launch: grid limits (the first slice is the
    // widest: its grids stand for every slice's), compile / module load.
    let launches = launch_shapes(&p.slice(BatchSlice::first(p.batch)), &plan);
    let mut kernels = Vec::with_capacity(launches.len());
    for (config, shape) in &launches {
        shape.check()?;
        kernels.push(KERNELS.get(config, p.device)?);
    }
    let mut prm = params(&p, t, t.workspace(deterministic), softmax_scale, variant);
    if plan.iter().any(|c| c.kind == BwdKind::ConvertDq { tiled: true }) {
        // dq_accum in the Hopper kernel's tiles (sm90.rs `dq_tileable`): every kernel of the plan
        // addresses it with these strides
        (prm.dqa_batch_stride, prm.dqa_row_stride, prm.dqa_head_stride) = sm90::dq_accum_tiled_strides(&p);
    }
    let sizes = AttnSizes::new(&p, &t.q.meta, &t.k.meta);
    // One pass of the plan per slice of the batch (batch.rs): a slice's kernels touch only its
    // batch entries, so the passes are independent.
    for s in batch_slices(p.batch) {
        let mut slice_prm = prm.slice(p.dtype, s);
        let slice_sizes = sizes.slice(s);
        let slice = p.slice(s);
        for ((config, _), kernel) in launches.iter().zip(&kernels) {
            // non-empty for the first slice, so for every slice
            let Some(shape) = launch_shape(&slice, config) else { continue };
            let info = LaunchInfo {
                op: "ferroattn::attn_bwd",
                work: slice_sizes.bwd(config.kind, variant.window(), deterministic),
            };
            if let (BwdKind::DkDvSm90 { .. }, Some(maps)) = (config.kind, &maps) {
                // (the Hopper plan runs one slice: sm90::supports)
                let mut hp = sm90::params(maps, slice_prm);
                // SAFETY: `hp` mirrors AttnBwdSm90Params; its maps and pointers describe the
                // caller's tensors, kept alive in stream order as below.
                unsafe { launch(kernel, p.device, &shape, stream, &mut hp, &info)? };
                continue;
            }
            // SAFETY: `slice_prm` mirrors the kernels' AttnBwdParams; its pointers lie within
            // the caller's tensors, which the caller keeps alive in stream order (torch's
            // caching allocator does).
            unsafe { launch(kernel, p.device, &shape, stream, &mut slice_prm, &info)? };
        }
    }
    Ok(())
}

#[cfg(test)]
mod batch_tests;
#[cfg(test)]
mod tests;
