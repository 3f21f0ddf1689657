//! Dense GEMM: argument validation (shared by `gemm_check` on metadata and `gemm` on real
//! tensors), backend selection ("auto" / "wmma" / "sm90"), the plan (`plan`: split-k, the
//! stream-k tail, and so the workspace the caller allocates; src/ops/workspace.rs) and the launch.
//!
//!   out[i] = act(alpha · a[i] @ b[i] + beta · c[i] + bias)        (python/ferroattn/_native.pyi)
//!
//! Layouts: a (batch, m, k), b (batch, k, n) of fp16 or bf16 (the same), each row- or
//! column-major in its last two dims (one of them of stride 1; a dim of size 1 counts as
//! either), batch stride >= 0 (0 = broadcast), any alignment. out (batch, m, n) fp16 / bf16 /
//! fp32 with stride(-1) == 1, no element reachable twice (batch stride != 0 unless batch == 1);
//! c (read only when beta != 0) like out but its batch stride may be 0; bias (n,) contiguous,
//! a's dtype or fp32; aux (pre-activation output) like out. Outputs may not overlap inputs or
//! each other. m, n, k, batch >= 1 (k == 0 is the Python layer's business: out = beta·c + bias).
//! Errors: ArgumentError / DTypeError / DeviceError naming the argument, expected and actual.

pub mod sm90;
pub mod wmma;
pub mod work;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::arch::Arch;
use crate::ops::validate::{
    check_device, check_disjoint, check_i32, check_no_self_overlap, check_not_null, NO_ELEMENT_TWICE,
};
use crate::tensor::{fmt_shape, TensorMeta, TensorView};
use crate::ops::workspace::WorkspaceLayout;
use crate::tuning::gemm_sm90::SplitK;
use crate::tuning::knobs::Knobs;
use crate::tuning::gemm_problem::{Activation, GemmProblem, Operand};

/// The kernel families, fastest first where both run.
pub const BACKENDS: [&str; 2] = ["sm90", "wmma"];

/// Problem sizes and the arguments that matter for validation, from metadata alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sizes {
    pub batch: i64,
    pub m: i64,
    pub n: i64,
    pub k: i64,
}

fn check_rank3(arg: &str, t: &TensorMeta, layout: &str) -> Result<()> {
    if t.strides.len() != t.shape.len() {
        return Err(Error::argument(
            arg,
            format!("{} strides", t.shape.len()),
            format!("{} strides", t.strides.len()),
        ));
    }
    if t.ndim() != 3 {
        return Err(Error::argument(
            arg,
            format!("3 dims {layout}"),
            format!("{} dims (shape {})", t.ndim(), fmt_shape(&t.shape)),
        ));
    }
    if let Some(s) = t.strides.iter().find(|&&s| s < 0) {
        return Err(Error::argument(
            arg,
            "non-negative strides",
            format!("stride {s} in {:?}", t.strides),
        ));
    }
    Ok(())
}

/// The per-batch matrix of a validated rank-3 tensor, with size-1 dims normalised; an
/// ArgumentError naming `arg` when neither of the last two dims has stride 1.
fn operand(arg: &str, t: &TensorMeta, ptr: u64, batch: i64) -> Result<Operand> {
    let s = &t.strides;
    let batch_stride = if t.shape[0] == 1 { 0 } else { s[0] };
    Operand {
        ptr,
        rows: t.shape[1],
        cols: t.shape[2],
        row_stride: s[1],
        col_stride: s[2],
        batch_stride,
        dtype: t.dtype,
    }
    .normalised(batch)
    .ok_or_else(|| {
        Error::argument(
            arg,
            "stride 1 in one of the last two dims (row-major: stride(-1) == 1, column-major: stride(-2) == 1)",
            format!("strides {:?} for shape {}", t.strides, fmt_shape(&t.shape)),
        )
    })
}

/// An out-like tensor (out, aux; c with `broadcast`): out's dtype (or its own for out), shape
/// (batch, m, n) or (1, m, n) when `broadcast`, stride(-1) == 1 and, when written, no element
/// reachable twice.
fn check_out_like(arg: &str, t: &TensorMeta, out_dtype: Option<DType>, s: Sizes, written: bool) -> Result<()> {
    check_rank3(arg, t, "(batch, m, n)")?;
    match out_dtype {
        None if !matches!(t.dtype, DType::F16 | DType::BF16 | DType::F32) => {
            return Err(Error::dtype(arg, "float16, bfloat16 or float32", t.dtype));
        }
        Some(d) if t.dtype != d => {
            return Err(Error::dtype(arg, format!("{d} (out's dtype)"), t.dtype));
        }
        _ => {}
    }
    let batch_ok = t.shape[0] == s.batch || (!written && t.shape[0] == 1);
    if !batch_ok || t.shape[1] != s.m || t.shape[2] != s.n {
        let what = if written { "" } else { " (or batch 1, broadcast)" };
        return Err(Error::argument(
            arg,
            format!("shape (batch, m, n) = {}{what}", fmt_shape(&[s.batch, s.m, s.n])),
            format!("shape {}", fmt_shape(&t.shape)),
        ));
    }
    if t.shape[2] > 1 && t.strides[2] != 1 {
        return Err(Error::argument(
            arg,
            "stride 1 in the last dim (row-major)",
            format!("strides {:?}", t.strides),
        ));
    }
    if written {
        check_no_self_overlap(arg, t, NO_ELEMENT_TWICE)?;
    }
    Ok(())
}

/// Validate GEMM arguments from metadata alone (`gemm_check`; `gemm` runs the same checks
/// first). `c` is ignored when `beta == 0` and required otherwise.
#[allow(clippy::too_many_arguments)]
pub fn validate(
    a: &TensorMeta,
    b: &TensorMeta,
    out: &TensorMeta,
    c: Option<&TensorMeta>,
    bias: Option<&TensorMeta>,
    aux: Option<&TensorMeta>,
    beta: f32,
    activation: &str,
) -> Result<(Sizes, Activation)> {
    if !matches!(a.dtype, DType::F16 | DType::BF16) {
        return Err(Error::dtype("a", "float16 or bfloat16", a.dtype));
    }
    if b.dtype != a.dtype {
        return Err(Error::dtype("b", format!("{} (a's dtype)", a.dtype), b.dtype));
    }
    check_rank3("a", a, "(batch, m, k)")?;
    check_rank3("b", b, "(batch, k, n)")?;
    let s = Sizes { batch: a.shape[0], m: a.shape[1], n: b.shape[2], k: a.shape[2] };
    for (what, v) in [("batch", s.batch), ("m", s.m), ("k", s.k)] {
        if v < 1 {
            return Err(Error::argument(
                "a",
                format!("{what} >= 1 in shape (batch, m, k)"),
                format!("shape {}", fmt_shape(&a.shape)),
            ));
        }
    }
    if b.shape[0] != s.batch || b.shape[1] != s.k || s.n < 1 {
        return Err(Error::argument(
            "b",
            format!("shape (batch, k, n) = ({}, {}, n >= 1) (a's batch and k)", s.batch, s.k),
            format!("shape {}", fmt_shape(&b.shape)),
        ));
    }
    check_i32("a", "m", s.m)?;
    check_i32("a", "k", s.k)?;
    check_i32("b", "n", s.n)?;
    operand("a", a, 0, s.batch)?;
    operand("b", b, 0, s.batch)?;
    check_out_like("out", out, None, s, true)?;
    if s.batch > 1 && out.strides[0] == 0 {
        return Err(Error::argument("out", "batch stride != 0 (batch > 1)", "batch stride 0"));
    }
    let c = if beta != 0.0 {
        let Some(c) = c else {
            return Err(Error::argument("c", format!("a tensor (beta = {beta} != 0)"), "None"));
        };
        check_out_like("c", c, Some(out.dtype), s, false)?;
        Some(c)
    } else {
        None
    };
    if let Some(t) = bias {
        if t.dtype != a.dtype && t.dtype != DType::F32 {
            return Err(Error::dtype("bias", format!("{} (a's dtype) or float32", a.dtype), t.dtype));
        }
        if t.ndim() != 1 || t.shape[0] != s.n || t.strides.len() != 1 {
            return Err(Error::argument(
                "bias",
                format!("shape (n,) = ({},)", s.n),
                format!("shape {}", fmt_shape(&t.shape)),
            ));
        }
        if s.n > 1 && t.strides[0] != 1 {
            return Err(Error::argument("bias", "a contiguous tensor (stride 1)", format!("stride {}", t.strides[0])));
        }
    }
    if let Some(t) = aux {
        check_out_like("aux", t, Some(out.dtype), s, true)?;
        if s.batch > 1 && t.strides[0] == 0 {
            return Err(Error::argument("aux", "batch stride != 0 (batch > 1)", "batch stride 0"));
        }
    }
    let act = Activation::parse("activation", activation)?;
    // Devices last, so that every other argument error is testable with CPU tensors.
    if !a.device.is_cuda() {
        return Err(Error::device("a", "a CUDA tensor", a.device));
    }
    check_device("b", b, "a", a)?;
    check_device("out", out, "a", a)?;
    for (arg, t) in [("c", c), ("bias", bias), ("aux", aux)] {
        if let Some(t) = t {
            check_device(arg, t, "a", a)?;
        }
    }
    Ok((s, act))
}

/// Validate real tensors and build the problem every backend receives.
#[allow(clippy::too_many_arguments)]
pub fn problem(
    a: &TensorView,
    b: &TensorView,
    out: &TensorView,
    c: Option<&TensorView>,
    bias: Option<&TensorView>,
    aux: Option<&TensorView>,
    alpha: f32,
    beta: f32,
    activation: &str,
) -> Result<GemmProblem> {
    // The scales as the kernels take them (fp32): NaN or inf would silently poison every output.
    for (arg, v) in [("alpha", alpha), ("beta", beta)] {
        if !v.is_finite() {
            return Err(Error::argument(arg, "a number finite in float32", v));
        }
    }
    let (s, act) = validate(
        &a.meta,
        &b.meta,
        &out.meta,
        c.map(|t| &t.meta),
        bias.map(|t| &t.meta),
        aux.map(|t| &t.meta),
        beta,
        activation,
    )?;
    let c = if beta != 0.0 { c } else { None };
    for (arg, t) in [("a", Some(a)), ("b", Some(b)), ("out", Some(out)), ("c", c), ("bias", bias), ("aux", aux)] {
        if let Some(t) = t {
            check_not_null(arg, t)?;
        }
    }
    // Outputs must not overlap any input or each other (the kernel reads inputs while writing).
    check_disjoint(
        &[("out", Some(out)), ("aux", aux)],
        &[("a", Some(a)), ("b", Some(b)), ("c", c), ("bias", bias)],
        false,
    )?;
    let op = |arg: &str, t: &TensorView| operand(arg, &t.meta, t.ptr, s.batch);
    Ok(GemmProblem {
        device: a.meta.device.id,
        batch: s.batch,
        m: s.m,
        n: s.n,
        k: s.k,
        a: op("a", a)?,
        b: op("b", b)?,
        out: op("out", out)?,
        c: c.map(|t| op("c", t)).transpose()?,
        bias: bias.map(|t| (t.ptr, t.meta.dtype)),
        aux: aux.map(|t| op("aux", t)).transpose()?,
        alpha,
        beta,
        activation: act,
    })
}


/// The backends a device of `arch` supports, fastest first (whether or not a given problem
/// fits the fast path).
pub fn backends_for(arch: Arch) -> Vec<&'static str> {
    if arch == Arch::Sm90a {
        vec!["sm90", "wmma"]
    } else {
        vec!["wmma"]
    }
}

/// The backend that runs `p`: "auto" takes sm90 when it supports the problem under `knobs`, else
/// wmma; an explicit backend that cannot run it is an ArgumentError naming `backend`.
pub fn choose_backend(p: &GemmProblem, arch: Arch, knobs: &Knobs, backend: &str) -> Result<&'static str> {
    let sm90 = sm90::supports(p, arch, knobs);
    match backend {
        "auto" => Ok(if sm90 { "sm90" } else { "wmma" }),
        "wmma" => Ok("wmma"),
        "sm90" if sm90 => Ok("sm90"),
        "sm90" => {
            let why = if !backends_for(arch).contains(&"sm90") {
                format!("this device ({arch}) has no sm90 path")
            } else {
                "the sm90 path does not support this problem (src/ops/gemm/sm90.rs: 16-byte aligned \
                 a, b and out)"
                    .to_string()
            };
            Err(Error::argument(
                "backend",
                format!("a backend that supports this call: one of {:?}", supported(sm90)),
                format!("\"sm90\" ({why})"),
            ))
        }
        other => Err(Error::argument("backend", "one of \"auto\", \"wmma\", \"sm90\"", format!("{other:?}"))),
    }
}

/// The explicit backends that run a problem (`sm90`: whether the sm90 family supports it).
fn supported(sm90: bool) -> Vec<&'static str> {
    BACKENDS.into_iter().filter(|b| *b == "wmma" || (*b == "sm90" && sm90)).collect()
}

/// What a validated call launches ([`plan`]): the backend and the decision that sets its
/// workspace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launch {
    /// The Hopper kernel, split-k with `split` (src/ops/gemm/sm90/splitk.rs).
    Sm90 { split: Option<SplitK> },
    /// The WMMA kernel as the plan says (a stream-k tail or not).
    Wmma(wmma::Plan),
}

impl Launch {
    pub fn backend(&self) -> &'static str {
        match self {
            Launch::Sm90 { .. } => "sm90",
            Launch::Wmma(_) => "wmma",
        }
    }

    /// The workspace this launch needs (src/ops/workspace.rs; empty: none): the split-k chunks
    /// or the stream-k tail's partial tiles and flags.
    pub fn workspace(&self, p: &GemmProblem) -> WorkspaceLayout {
        match self {
            Launch::Sm90 { split: Some(s) } => sm90::splitk::workspace(p, *s),
            Launch::Sm90 { split: None } => WorkspaceLayout::NONE,
            Launch::Wmma(w) => w.workspace(),
        }
    }
}

/// The launch of `p` with backend `chosen` (from [`choose_backend`]) on `arch` with `sms` SMs
/// under `knobs`: the one decision that both the launch ([`gemm`]) and the caller's workspace
/// planner ([`workspace_bytes`]) follow. Pure but for the wmma tile override's error.
pub fn plan(p: &GemmProblem, chosen: &str, arch: Arch, sms: u32, knobs: &Knobs) -> Result<Launch> {
    if chosen == "sm90" {
        Ok(Launch::Sm90 { split: sm90::splitk::plan(p, knobs, sms as i64) })
    } else {
        Ok(Launch::Wmma(wmma::plan(p, arch, sms, knobs)?))
    }
}

/// A validated call, its knobs and its launch.
type Planned = (GemmProblem, Knobs, Launch);

/// The common part of [`gemm`] and [`workspace_bytes`]: the backend name, validation, the
/// backend choice and the plan on a's device.
#[allow(clippy::too_many_arguments)]
fn validate_and_plan(
    a: &TensorView,
    b: &TensorView,
    out: &TensorView,
    c: Option<&TensorView>,
    bias: Option<&TensorView>,
    aux: Option<&TensorView>,
    alpha: f32,
    beta: f32,
    activation: &str,
    backend: &str,
) -> Result<Planned> {
    if !matches!(backend, "auto" | "wmma" | "sm90") {
        return Err(Error::argument("backend", "one of \"auto\", \"wmma\", \"sm90\"", format!("{backend:?}")));
    }
    let p = problem(a, b, out, c, bias, aux, alpha, beta, activation)?;
    let arch = crate::device::arch(p.device)?;
    let knobs = crate::tuning::knobs::get()?;
    let chosen = choose_backend(&p, arch, &knobs, backend)?;
    let launch = plan(&p, chosen, arch, crate::device::sm_count(p.device)?, &knobs)?;
    Ok((p, knobs, launch))
}

/// Bytes of the workspace a [`gemm`] call with these arguments needs (0: none): the same
/// validation and plan as the launch, so the caller allocates exactly what it checks
/// (`_native.gemm_workspace`; src/ops/workspace.rs).
#[allow(clippy::too_many_arguments)]
pub fn workspace_bytes(
    a: &TensorView,
    b: &TensorView,
    out: &TensorView,
    c: Option<&TensorView>,
    bias: Option<&TensorView>,
    aux: Option<&TensorView>,
    alpha: f32,
    beta: f32,
    activation: &str,
    backend: &str,
) -> Result<u64> {
    let (p, _, launch) = validate_and_plan(a, b, out, c, bias, aux, alpha, beta, activation, backend)?;
    Ok(launch.workspace(&p).bytes())
}

/// Validate everything, pick the backend and launch on `stream` (raw CUstream) in the primary
/// context of a's device. Never synchronises. Returns the backend that ran. `workspace`: the
/// caller's uint8 buffer of at least [`workspace_bytes`] bytes (None when that is 0), or its
/// allocator, asked for those bytes once the plan is known (`workspace::Source`); checked here
/// (an error naming `workspace` otherwise).
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    a: &TensorView,
    b: &TensorView,
    out: &TensorView,
    c: Option<&TensorView>,
    bias: Option<&TensorView>,
    aux: Option<&TensorView>,
    alpha: f32,
    beta: f32,
    activation: &str,
    backend: &str,
    workspace: &mut crate::ops::workspace::Source<'_>,
    stream: u64,
) -> Result<&'static str> {
    workspace.precheck("workspace")?;
    let (p, knobs, launch) = validate_and_plan(a, b, out, c, bias, aux, alpha, beta, activation, backend)?;
    let tensors = [("a", Some(a)), ("b", Some(b)), ("out", Some(out)), ("c", c), ("bias", bias), ("aux", aux)];
    let layout = launch.workspace(&p);
    let given = workspace.resolve(&layout)?;
    let ws = crate::ops::workspace::check("workspace", given.as_ref(), layout, "a", &a.meta, &tensors)?;
    match launch {
        // SAFETY: `p` was validated by `problem` and sm90 supports it (choose_backend); `ws` was
        // checked for this launch and the caller keeps it alive with the tensors.
        Launch::Sm90 { split } => unsafe { sm90::launch(&p, &knobs, split, ws.as_ref(), stream)? },
        Launch::Wmma(w) => wmma::launch(&p, &w, &knobs, ws.as_ref(), stream)?,
    }
    Ok(launch.backend())
}

#[cfg(test)]
mod tests;
