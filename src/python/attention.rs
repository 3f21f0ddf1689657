//! attn_fwd_check (metadata) and attn_fwd (DLPack tensors) → ops::attention.

use crate::dlpack::{import, import_writable, Imported};
use crate::error::Result;
use crate::ops::attention as op;
use crate::tensor::TensorMeta;
use pyo3::prelude::*;
use super::variant::{check as check_variant, views, VariantArg};

/// `TensorMeta` as the .pyi defines it.
pub(super) type MetaTuple = (Vec<i64>, Vec<i64>, String, (i32, i32));

/// `TensorMeta` from the tuple; `expected` words the accepted dtypes in a DTypeError.
pub(super) fn meta_of(arg: &str, t: MetaTuple, expected: &str) -> Result<TensorMeta> {
    TensorMeta::from_parts(arg, t.0, t.1, &t.2, t.3, expected)
}

pub(super) fn meta(arg: &str, t: MetaTuple) -> Result<TensorMeta> {
    meta_of(arg, t, "float16 or bfloat16")
}

fn meta_opt(arg: &str, t: Option<MetaTuple>) -> Result<Option<TensorMeta>> {
    t.map(|t| meta_of(arg, t, "int32")).transpose()
}

/// Optional (cu_seqlens_q, cu_seqlens_k) metadata, int32.
pub(super) type CuMetas = (Option<TensorMeta>, Option<TensorMeta>);

pub(super) fn cu_metas(cu_seqlens_q: Option<MetaTuple>, cu_seqlens_k: Option<MetaTuple>) -> Result<CuMetas> {
    Ok((meta_opt("cu_seqlens_q", cu_seqlens_q)?, meta_opt("cu_seqlens_k", cu_seqlens_k)?))
}

/// Validate attention-forward arguments from metadata alone (same checks and errors as attn_fwd);
/// `variant` None = the plain call.
#[pyfunction]
#[pyo3(signature = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, variant=None))]
#[allow(clippy::too_many_arguments)]
fn attn_fwd_check(
    q: MetaTuple,
    k: MetaTuple,
    v: MetaTuple,
    cu_seqlens_q: Option<MetaTuple>,
    cu_seqlens_k: Option<MetaTuple>,
    max_seqlen_q: i64,
    max_seqlen_k: i64,
    variant: Option<&Bound<'_, PyAny>>,
) -> Result<()> {
    let (q, k, v) = (meta("q", q)?, meta("k", k)?, meta("v", v)?);
    let (cq, ck) = cu_metas(cu_seqlens_q, cu_seqlens_k)?;
    let variant = variant.filter(|v| !v.is_none()).map(|v| VariantArg::from_obj(v)?.metas()).transpose()?.unwrap_or_default();
    let p = op::validate(
        &q,
        &k,
        &v,
        None,
        None,
        cq.as_ref(),
        ck.as_ref(),
        max_seqlen_q,
        max_seqlen_k,
    )?;
    check_variant(&variant, &p, &q)?;
    Ok(())
}

/// A raw CUstream handle: a Python int in [0, 2^64) (0 = the legacy default stream). Not an int:
/// TypeError; out of range: ArgumentError; both name `stream`.
pub(super) fn stream_handle(stream: &Bound<'_, PyAny>) -> Result<u64> {
    raw_handle(stream, "stream", "a CUstream handle")
}

/// A raw driver handle (`what`, e.g. "a CUevent handle") passed as a Python int in [0, 2^64).
/// Not an int: TypeError; out of range: ArgumentError; both name `arg`.
pub(super) fn raw_handle(obj: &Bound<'_, PyAny>, arg: &str, what: &str) -> Result<u64> {
    let shown = || obj.repr().map(|r| r.to_string()).unwrap_or_default();
    let Ok(value) = obj.extract::<i128>() else {
        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "{arg}: expected an int ({what}), got {}",
            shown()
        ))
        .into());
    };
    u64::try_from(value)
        .map_err(|_| crate::error::Error::argument(arg, format!("{what}, an int in [0, 2**64)"), shown()))
}

/// An optional tensor argument (`writable`: one the op writes); a Python None counts as absent.
pub(super) fn import_opt(t: Option<&Bound<'_, PyAny>>, arg: &str, writable: bool) -> Result<Option<Imported>> {
    t.filter(|t| !t.is_none())
        .map(|t| if writable { import_writable(t, arg) } else { import(t, arg) })
        .transpose()
}

/// Optional (cu_seqlens_q, cu_seqlens_k) tensors; a Python None counts as absent.
pub(super) fn import_cu(
    cu_seqlens_q: Option<&Bound<'_, PyAny>>,
    cu_seqlens_k: Option<&Bound<'_, PyAny>>,
) -> Result<(Option<Imported>, Option<Imported>)> {
    Ok((import_opt(cu_seqlens_q, "cu_seqlens_q", false)?, import_opt(cu_seqlens_k, "cu_seqlens_k", false)?))
}

/// Launch attention forward on `stream` (raw CUstream; 0 = legacy default) in q's device's
/// primary context. Validates everything before launching; never synchronises.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn attn_fwd(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    softmax_lse: &Bound<'_, PyAny>,
    cu_seqlens_q: Option<&Bound<'_, PyAny>>,
    cu_seqlens_k: Option<&Bound<'_, PyAny>>,
    max_seqlen_q: i64,
    max_seqlen_k: i64,
    softmax_scale: f64,
    variant: &Bound<'_, PyAny>,
    stream: &Bound<'_, PyAny>,
) -> Result<()> {
    let stream = stream_handle(stream)?;
    let (q, k, v) = (import(q, "q")?, import(k, "k")?, import(v, "v")?);
    let variant = VariantArg::from_obj(variant)?.import()?;
    let variant = views(&variant);
    let (o, lse) = (import_writable(out, "out")?, import_writable(softmax_lse, "softmax_lse")?);
    let (cq, ck) = import_cu(cu_seqlens_q, cu_seqlens_k)?;
    let (qv, kv, vv, ov, lv) = (&q.view, &k.view, &v.view, &o.view, &lse.view);
    let (cqv, ckv) = (cq.as_ref().map(|t| &t.view), ck.as_ref().map(|t| &t.view));
    // Detached: the first call of a configuration compiles or loads a module.
    py.detach(|| {
        op::attn_fwd(
            qv,
            kv,
            vv,
            ov,
            lv,
            cqv,
            ckv,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale as f32,
            &variant,
            stream,
        )
    })
}

/// (query, key) pairs of one (batch, head) that a call shows (ops::attention::variant::visible_pairs):
/// the flash_attn window (-1 = unbounded side), `causal` forcing right = 0.
#[pyfunction]
fn attn_visible_pairs(seqlen_q: u64, seqlen_k: u64, causal: bool, window_left: i64, window_right: i64) -> u128 {
    let v = op::AttnVariant::<()> { causal, window_left, window_right, ..Default::default() };
    op::variant::visible_pairs(seqlen_q, seqlen_k, v.window())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(attn_visible_pairs, m)?)?;
    m.add_function(wrap_pyfunction!(attn_fwd_check, m)?)?;
    m.add_function(wrap_pyfunction!(attn_fwd, m)?)?;
    Ok(())
}
