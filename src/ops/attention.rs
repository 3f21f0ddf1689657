//! Attention forward: argument validation (shared by `attn_fwd_check` on metadata and
//! `attn_fwd` on real tensors), the kernel parameter struct, and the launch.
//!
//! Layouts (flash_attn convention, kernels/attention/params.cuh):
//!   padded: q (b, s_q, h, d), k/v (b, s_k, h_k, d), out like q, lse (b, h, s_q) fp32;
//!   varlen: q (total_q, h, d), k/v (total_k, h_k, d), out like q, lse (h, total_q) fp32,
//!           cu_seqlens_q/k (b + 1,) int32, max_seqlen_q/k give the grid.
//! In padded mode max_seqlen_q/k are ignored (the shapes say everything).
//!
//! Batch sizes up to 2^31 − 1: the grid's batch dim holds at most 65535, so a larger batch runs
//! as several launches over slices of it (src/ops/attention/batch.rs).
//!
//! Not checked (needs a device→host copy of cu_seqlens, i.e. a sync): that cu_seqlens are
//! non-decreasing, start at 0, end at total rows, and that no sequence exceeds max_seqlen.
//! The Python layer may check these on request; the kernel trusts them.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::arch::Arch;
use crate::jit::{impl_kernel_spec, KernelMap, KernelSpec};
use crate::launch_record::{LaunchInfo, LaunchShape};
use crate::ops::validate::{
    check_device, check_dtype, check_i32, check_not_null, check_shape, check_strides,
};
use work::AttnSizes;
use crate::tensor::{fmt_shape, TensorMeta, TensorView};
use crate::tuning::attention::{fwd_config, fwd_production_configs, AttnFwdConfig};
use std::ffi::c_void;

pub mod batch;
pub mod fast;
pub mod kvcache;
pub mod sm80;
pub mod sm90;
pub mod variant;
pub mod work;
pub use batch::{batch_slices, BatchSlice, MAX_LAUNCH_BATCH};
pub use variant::{AttnVariant, MaskKind, VariantKind};

/// Mirror of `struct AttnFwdParams` in kernels/attention/params.cuh (change both together).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AttnFwdParams {
    pub q: *const c_void,
    pub k: *const c_void,
    pub v: *const c_void,
    pub o: *mut c_void,
    pub lse: *mut f32,
    pub cu_seqlens_q: *const i32,
    pub cu_seqlens_k: *const i32,

    pub q_batch_stride: i64,
    pub q_row_stride: i64,
    pub q_head_stride: i64,
    pub k_batch_stride: i64,
    pub k_row_stride: i64,
    pub k_head_stride: i64,
    pub v_batch_stride: i64,
    pub v_row_stride: i64,
    pub v_head_stride: i64,
    pub o_batch_stride: i64,
    pub o_row_stride: i64,
    pub o_head_stride: i64,
    pub lse_batch_stride: i64,
    pub lse_head_stride: i64,

    pub batch: i32,
    pub num_heads: i32,
    pub num_heads_k: i32,
    pub head_dim: i32,
    pub seqlen_q: i32,
    pub seqlen_k: i32,
    pub softmax_scale: f32,
    pub softmax_scale_log2: f32,
    pub total_q: i32,
    pub total_k: i32,

    pub alibi_slopes: *const f32,
    pub sinks: *const f32,
    pub window_left: i32,
    pub window_right: i32,
    pub softcap: f32,
    pub softcap_in: f32,
    pub raw_scale: f32,
    pub raw_scale_inv: f32,
    pub alibi_batch_stride: i32,
    pub dropout_threshold: u32,
    pub rng_state: *const u64,
    pub s_dmask: *mut c_void,
    pub s_dmask_max: *mut f32,
    pub dropout_scale: f32,
    pub s_dmask_rows: i32,
    pub s_dmask_cols: i32,
    /// Dropout: the first batch index of this launch (a batch split over launches).
    pub dropout_batch0: i32,
}

impl_kernel_spec!(AttnFwdConfig, smem: |c| c.smem_bytes());

/// What `precompile` builds for the forward families (sm80 everywhere, sm90 on sm_90a, with the
/// sm90 A/B candidate form).
pub fn production_specs(arch: Arch) -> Vec<AttnFwdConfig> {
    let mut specs = fwd_production_configs(arch);
    specs.extend(crate::tuning::attention_sm90::fwd_production_configs(arch));
    specs.extend(crate::tuning::attention_sm90::fwd_candidate_configs(arch));
    specs
}

/// The loaded kernels of both forward families.
pub(crate) static KERNELS: KernelMap<AttnFwdConfig> = KernelMap::new();

/// The validated problem size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Problem {
    pub varlen: bool,
    pub batch: i64,
    /// Padded: s_q; varlen: max_seqlen_q (grid only).
    pub seqlen_q: i64,
    /// Padded: s_k; varlen: max_seqlen_k.
    pub seqlen_k: i64,
    pub heads: i64,
    pub heads_k: i64,
    pub head_dim: i64,
    pub dtype: DType,
    pub device: i32,
}

impl Problem {
    /// Nothing to compute: no launch.
    pub fn is_empty(&self) -> bool {
        self.batch == 0 || self.seqlen_q == 0 || self.heads == 0
    }
}

fn dims_msg(t: &TensorMeta) -> String {
    format!("{} dims (shape {})", t.ndim(), fmt_shape(&t.shape))
}

fn check_rank(arg: &str, t: &TensorMeta, rank: usize, layout: &str) -> Result<()> {
    if t.strides.len() != t.shape.len() {
        return Err(Error::argument(
            arg,
            format!("{} strides", t.shape.len()),
            format!("{} strides", t.strides.len()),
        ));
    }
    if let Some(s) = t.shape.iter().find(|&&s| s < 0) {
        return Err(Error::argument(
            arg,
            "non-negative sizes",
            format!("size {s} in shape {}", fmt_shape(&t.shape)),
        ));
    }
    if t.ndim() != rank {
        return Err(Error::argument(
            arg,
            format!("{rank} dims {layout}"),
            dims_msg(t),
        ));
    }
    Ok(())
}

/// The kernels move q/k/v/out tiles in 16-byte (8-element) copies: the data pointer and every
/// stride that is used (a dim of size > 1) must be multiples of 16 bytes. The torch op copies
/// such tensors first (python/ferroattn/ops/attention.py), so only direct callers see this.
pub(crate) fn check_tile_layout(arg: &str, t: &TensorView) -> Result<()> {
    if !t.ptr.is_multiple_of(16) {
        return Err(Error::argument(
            arg,
            "a 16-byte aligned data pointer",
            format!("address {:#x}", t.ptr),
        ));
    }
    let m = &t.meta;
    for i in 0..m.shape.len().saturating_sub(1) {
        if m.shape[i] > 1 && m.strides[i] % 8 != 0 {
            return Err(Error::argument(
                arg,
                "strides that are multiples of 8 elements (16-byte aligned rows)",
                format!("stride {} in dim {i} (strides {:?})", m.strides[i], m.strides),
            ));
        }
    }
    Ok(())
}

/// An output must be dense and non-overlapping (some permutation of a contiguous layout): the
/// kernel writes every element once, and overlapping elements would race.
pub(crate) fn check_dense(arg: &str, t: &TensorMeta) -> Result<()> {
    let mut dims: Vec<(i64, i64)> = t
        .strides
        .iter()
        .zip(&t.shape)
        .filter(|(_, &n)| n > 1)
        .map(|(&st, &n)| (st, n))
        .collect();
    dims.sort_unstable();
    let mut expected = 1;
    for &(st, n) in &dims {
        if st != expected {
            return Err(Error::argument(
                arg,
                "a dense, non-overlapping tensor (a permutation of a contiguous layout)",
                format!("strides {:?} for shape {}", t.strides, fmt_shape(&t.shape)),
            ));
        }
        expected *= n;
    }
    Ok(())
}

fn check_cu_seqlens(arg: &str, t: &TensorMeta, q: &TensorMeta) -> Result<i64> {
    check_device(arg, t, "q", q)?;
    check_dtype(arg, t, DType::I32, "")?;
    check_rank(arg, t, 1, "(batch + 1,)")?;
    if t.shape[0] > 1 && t.strides[0] != 1 {
        return Err(Error::argument(
            arg,
            "a contiguous tensor (stride 1)",
            format!("stride {}", t.strides[0]),
        ));
    }
    if t.shape[0] < 1 {
        return Err(Error::argument(
            arg,
            "length batch + 1 >= 1",
            format!("length {}", t.shape[0]),
        ));
    }
    Ok(t.shape[0])
}

/// Validate attention-forward arguments from metadata alone. `out`/`lse` are None from
/// `attn_fwd_check` (the Python layer allocates them from the same rules).
#[allow(clippy::too_many_arguments)]
pub fn validate(
    q: &TensorMeta,
    k: &TensorMeta,
    v: &TensorMeta,
    out: Option<&TensorMeta>,
    lse: Option<&TensorMeta>,
    cu_seqlens_q: Option<&TensorMeta>,
    cu_seqlens_k: Option<&TensorMeta>,
    max_seqlen_q: i64,
    max_seqlen_k: i64,
) -> Result<Problem> {
    // dtypes
    if !matches!(q.dtype, DType::F16 | DType::BF16) {
        return Err(Error::dtype("q", "float16 or bfloat16", q.dtype));
    }
    check_dtype("k", k, q.dtype, " (q's dtype)")?;
    check_dtype("v", v, q.dtype, " (q's dtype)")?;

    let varlen = match (cu_seqlens_q, cu_seqlens_k) {
        (Some(_), Some(_)) => true,
        (None, None) => false,
        (Some(_), None) => {
            return Err(Error::argument(
                "cu_seqlens_k",
                "a tensor (cu_seqlens_q was given)",
                "None",
            ))
        }
        (None, Some(_)) => {
            return Err(Error::argument(
                "cu_seqlens_q",
                "a tensor (cu_seqlens_k was given)",
                "None",
            ))
        }
    };
    let (rank, layout) = if varlen {
        (3, "(total_q, heads, head_dim) in varlen mode")
    } else {
        (4, "(batch, seqlen, heads, head_dim)")
    };
    check_rank("q", q, rank, layout)?;
    let kv_layout = if varlen {
        "(total_k, heads_k, head_dim) in varlen mode"
    } else {
        "(batch, seqlen_k, heads_k, head_dim)"
    };
    check_rank("k", k, rank, kv_layout)?;
    check_rank("v", v, rank, kv_layout)?;
    check_strides("q", q)?;
    check_strides("k", k)?;
    check_strides("v", v)?;

    let d = q.shape[rank - 1];
    let heads = q.shape[rank - 2];
    let heads_k = k.shape[rank - 2];
    if !(8..=256).contains(&d) || d % 8 != 0 {
        return Err(Error::argument(
            "q",
            "head dim a multiple of 8 in 8..=256",
            format!("head dim {d}"),
        ));
    }
    if k.shape[rank - 1] != d {
        return Err(Error::argument(
            "k",
            format!("head dim {d} (q's head dim)"),
            format!("head dim {}", k.shape[rank - 1]),
        ));
    }
    if v.shape != k.shape {
        return Err(Error::argument(
            "v",
            format!("shape {} (k's shape)", fmt_shape(&k.shape)),
            format!("shape {}", fmt_shape(&v.shape)),
        ));
    }
    if heads_k < 1 || heads % heads_k != 0 {
        return Err(Error::argument(
            "k",
            format!("a number of heads >= 1 that divides q's {heads}"),
            format!("{heads_k} heads"),
        ));
    }
    if heads > 65535 {
        return Err(Error::argument("q", "at most 65535 heads", heads));
    }

    let (batch, seqlen_q, seqlen_k, total_q) = if varlen {
        let (cq, ck) = (cu_seqlens_q.unwrap(), cu_seqlens_k.unwrap());
        let lq = check_cu_seqlens("cu_seqlens_q", cq, q)?;
        let lk = check_cu_seqlens("cu_seqlens_k", ck, q)?;
        if lk != lq {
            return Err(Error::argument(
                "cu_seqlens_k",
                format!("length {lq} (cu_seqlens_q's length)"),
                format!("length {lk}"),
            ));
        }
        let (total_q, total_k) = (q.shape[0], k.shape[0]);
        check_i32("q", "rows (cu_seqlens are int32)", total_q)?;
        check_i32("k", "rows (cu_seqlens are int32)", total_k)?;
        let batch = lq - 1;
        if max_seqlen_q < 1 && batch > 0 && total_q > 0 {
            return Err(Error::argument(
                "max_seqlen_q",
                ">= 1 for a non-empty input",
                max_seqlen_q,
            ));
        }
        if max_seqlen_k < 0 || (max_seqlen_k < 1 && batch > 0 && total_k > 0) {
            return Err(Error::argument(
                "max_seqlen_k",
                ">= 1 for a non-empty input (>= 0 always)",
                max_seqlen_k,
            ));
        }
        (
            batch,
            if total_q == 0 { 0 } else { max_seqlen_q.max(0) },
            max_seqlen_k,
            total_q,
        )
    } else {
        let (b, s_q, s_k) = (q.shape[0], q.shape[1], k.shape[1]);
        if k.shape[0] != b {
            return Err(Error::argument(
                "k",
                format!("batch size {b} (q's batch size)"),
                format!("batch size {}", k.shape[0]),
            ));
        }
        (b, s_q, s_k, s_q)
    };
    // Any batch: a call of more than the grid's 65535 runs as several launches (batch.rs);
    // the launches' first batch index (dropout_batch0) is an int32.
    check_i32(if varlen { "cu_seqlens_q" } else { "q" }, "a batch size", batch)?;
    let (name_q, name_k) = if varlen { ("max_seqlen_q", "max_seqlen_k") } else { ("q", "k") };
    check_i32(name_q, "a sequence length", seqlen_q)?;
    check_i32(name_k, "a sequence length", seqlen_k)?;
    // Devices are checked after dtypes and shapes, so that every other argument error is
    // reported (and testable) with CPU tensors too.
    if !q.device.is_cuda() {
        return Err(Error::device("q", "a CUDA tensor", q.device));
    }
    check_device("k", k, "q", q)?;
    check_device("v", v, "q", q)?;

    check_outputs(out, lse, q, varlen, batch, heads, seqlen_q, total_q)?;
    Ok(Problem {
        varlen,
        batch,
        seqlen_q,
        seqlen_k,
        heads,
        heads_k,
        head_dim: d,
        dtype: q.dtype,
        device: q.device.id,
    })
}

/// The checks of `attn_fwd` from metadata alone (`attn_fwd_check`): `validate` without the
/// outputs (the Python layer allocates them from the same rules), then the variant's.
#[allow(clippy::too_many_arguments)]
pub fn check(q: &TensorMeta, k: &TensorMeta, v: &TensorMeta, cu_seqlens_q: Option<&TensorMeta>,
             cu_seqlens_k: Option<&TensorMeta>, max_seqlen_q: i64, max_seqlen_k: i64,
             variant: &AttnVariant<&TensorMeta>) -> Result<VariantKind> {
    let p = validate(q, k, v, None, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)?;
    variant.validate(&p, q)
}

/// `out` (q's device, dtype and shape, dense) and `softmax_lse` (fp32, (batch, heads, seqlen_q)
/// padded or (heads, total_q) varlen, dense) of a forward, when given: shared by every forward
/// family.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_outputs(out: Option<&TensorMeta>, lse: Option<&TensorMeta>, q: &TensorMeta, varlen: bool, batch: i64,
                            heads: i64, seqlen_q: i64, total_q: i64) -> Result<()> {
    if let Some(o) = out {
        check_device("out", o, "q", q)?;
        check_dtype("out", o, q.dtype, " (q's dtype)")?;
        check_shape("out", o, &q.shape, " (q's shape)")?;
        check_strides("out", o)?;
        check_dense("out", o)?;
    }
    if let Some(l) = lse {
        check_device("softmax_lse", l, "q", q)?;
        check_dtype("softmax_lse", l, DType::F32, "")?;
        let (want, why) = if varlen {
            (vec![heads, total_q], " (heads, total_q)")
        } else {
            (vec![batch, heads, seqlen_q], " (batch, heads, seqlen_q)")
        };
        check_shape("softmax_lse", l, &want, why)?;
        check_strides("softmax_lse", l)?;
        check_dense("softmax_lse", l)?;
    }
    Ok(())
}

/// (batch, row, head) strides of a validated q/k/v/out-like tensor; varlen tensors have no
/// batch dim (batch stride 0).
pub(crate) fn batch_row_head_strides(varlen: bool, t: &TensorMeta) -> (i64, i64, i64) {
    let s = &t.strides;
    if varlen {
        (0, s[0], s[1])
    } else {
        (s[0], s[1], s[2])
    }
}

/// Kernel parameters from validated views.
#[allow(clippy::too_many_arguments)]
pub fn params(
    p: &Problem,
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    out: &TensorView,
    lse: &TensorView,
    cu_seqlens_q: Option<&TensorView>,
    cu_seqlens_k: Option<&TensorView>,
    softmax_scale: f32,
    variant: &AttnVariant<&TensorView>,
) -> AttnFwdParams {
    let bsh = |t: &TensorView| batch_row_head_strides(p.varlen, &t.meta);
    let (qb, qr, qh) = bsh(q);
    let (kb, kr, kh) = bsh(k);
    let (vb, vr, vh) = bsh(v);
    let (ob, or, oh) = bsh(out);
    let ls = &lse.meta.strides;
    let (lse_batch_stride, lse_head_stride) = if p.varlen { (0, ls[0]) } else { (ls[0], ls[1]) };
    let mut prm = AttnFwdParams {
        q: q.ptr as *const c_void,
        k: k.ptr as *const c_void,
        v: v.ptr as *const c_void,
        o: out.ptr as *mut c_void,
        lse: lse.ptr as *mut f32,
        cu_seqlens_q: cu_seqlens_q.map_or(std::ptr::null(), |t| t.ptr as *const i32),
        cu_seqlens_k: cu_seqlens_k.map_or(std::ptr::null(), |t| t.ptr as *const i32),
        q_batch_stride: qb,
        q_row_stride: qr,
        q_head_stride: qh,
        k_batch_stride: kb,
        k_row_stride: kr,
        k_head_stride: kh,
        v_batch_stride: vb,
        v_row_stride: vr,
        v_head_stride: vh,
        o_batch_stride: ob,
        o_row_stride: or,
        o_head_stride: oh,
        lse_batch_stride,
        lse_head_stride,
        batch: p.batch as i32,
        num_heads: p.heads as i32,
        num_heads_k: p.heads_k as i32,
        head_dim: p.head_dim as i32,
        seqlen_q: p.seqlen_q as i32,
        seqlen_k: p.seqlen_k as i32,
        softmax_scale,
        softmax_scale_log2: softmax_scale * std::f32::consts::LOG2_E,
        // varlen only (validated to fit in i32: cu_seqlens are int32)
        total_q: if p.varlen { q.meta.shape[0] as i32 } else { 0 },
        total_k: if p.varlen { k.meta.shape[0] as i32 } else { 0 },
        alibi_slopes: std::ptr::null(),
        sinks: std::ptr::null(),
        window_left: 0,
        window_right: 0,
        softcap: 0.0,
        softcap_in: 0.0,
        raw_scale: softmax_scale,
        raw_scale_inv: 1.0,
        alibi_batch_stride: 0,
        dropout_threshold: 0,
        rng_state: std::ptr::null(),
        s_dmask: std::ptr::null_mut(),
        s_dmask_max: std::ptr::null_mut(),
        dropout_scale: 1.0,
        s_dmask_rows: 0,
        s_dmask_cols: 0,
        dropout_batch0: 0,
    };
    variant.fill_params(&mut prm);
    prm
}

/// Grid (ceil(seqlen_q / block_m), heads, batch), block num_warps*32, smem from the config (both
/// families).
/// `p` is one launch's problem (`Problem::slice`: batch at most `MAX_LAUNCH_BATCH`).
pub fn launch_shape(p: &Problem, config: &AttnFwdConfig) -> LaunchShape {
    LaunchShape {
        grid: (
            (p.seqlen_q as u64).div_ceil(config.block_m as u64) as u32,
            p.heads as u32,
            p.batch as u32,
        ),
        block: (config.threads(), 1, 1),
        dynamic_smem_bytes: config.smem_bytes(),
    }
}

/// Validate everything, then launch on `stream` (raw CUstream; 0 = legacy default) in the
/// primary context of q's device. Never synchronises. Empty inputs launch nothing; a batch
/// of more than `MAX_LAUNCH_BATCH` entries launches once per slice of at most that many.
/// Blocking only on the first call of a configuration (compile or disk-cache load).
#[allow(clippy::too_many_arguments)]
pub fn attn_fwd(
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    out: &TensorView,
    lse: &TensorView,
    cu_seqlens_q: Option<&TensorView>,
    cu_seqlens_k: Option<&TensorView>,
    max_seqlen_q: i64,
    max_seqlen_k: i64,
    softmax_scale: f32,
    variant: &AttnVariant<&TensorView>,
    stream: u64,
) -> Result<()> {
    let p = validate(
        &q.meta,
        &k.meta,
        &v.meta,
        Some(&out.meta),
        Some(&lse.meta),
        cu_seqlens_q.map(|t| &t.meta),
        cu_seqlens_k.map(|t| &t.meta),
        max_seqlen_q,
        max_seqlen_k,
    )?;
    let kind = variant.metas().validate(&p, &q.meta)?;
    if !softmax_scale.is_finite() {
        return Err(Error::argument("softmax_scale", "a finite number", softmax_scale));
    }
    if p.is_empty() {
        return Ok(());
    }
    for (arg, t) in [("q", q), ("k", k), ("v", v), ("out", out), ("softmax_lse", lse)] {
        check_not_null(arg, t)?;
    }
    for (arg, t) in [
        ("alibi_slopes", variant.alibi_slopes),
        ("sinks", variant.sinks),
        ("rng_state", variant.rng_state),
        ("s_dmask", variant.s_dmask),
        ("s_dmask_max", variant.s_dmask_max),
    ] {
        if let Some(t) = t {
            check_not_null(arg, t)?;
        }
    }
    for (arg, t) in [("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)] {
        if let Some(t) = t {
            check_not_null(arg, t)?;
        }
    }
    for (arg, t) in [("q", q), ("k", k), ("v", v), ("out", out)] {
        check_tile_layout(arg, t)?;
    }
    let arch = crate::device::arch(p.device)?;
    let prm = params(&p, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, variant);
    let sizes = AttnSizes::new(&p, &q.meta, &k.meta);
    let work = |s: BatchSlice| LaunchInfo { op: "ferroattn::attn_fwd", work: sizes.slice(s).fwd(variant.window()) };
    let knobs = crate::tuning::knobs::get()?;
    let policy = crate::tuning::attention_sm90::FwdPolicy {
        kv_release: knobs.attn_sm90_fwd_kv_release,
        stages: knobs.attn_sm90_fwd_stages,
        persistent: knobs.attn_sm90_fwd_persistent,
        varlen: knobs.attn_sm90_fwd_varlen,
        d192: knobs.attn_sm90_fwd_d192,
    };
    if let Some(launch) = sm90::prepare(&p, kind, arch, knobs.attn_fwd_family, policy, q, k, v, out, &prm)? {
        // SAFETY: as below; the maps describe the caller's q, k, v and out.
        return unsafe { launch.launch(stream, &work(BatchSlice::first(p.batch))) };
    }
    // SAFETY: `prm` mirrors the kernel's AttnFwdParams; its pointers lie within the caller's
    // tensors, which the caller keeps alive in stream order (torch's caching allocator does).
    unsafe { sm80::launch(&p, fwd_config(p.head_dim as u32, kind, p.dtype, arch), &prm, stream, work) }
}

#[cfg(test)]
mod tests;
