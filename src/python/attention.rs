//! attn_fwd_check (metadata) and attn_fwd (DLPack tensors) → ops::attention.

use crate::dlpack::{import, import_writable};
use crate::error::Result;
use crate::ops::attention as op;
use pyo3::prelude::*;
use super::args::{cu_metas, import_cu, meta, stream_handle, MetaTuple};
use super::variant::{optional_metas, views, VariantArg};

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
    let variant = optional_metas(variant)?;
    op::check(&q, &k, &v, cq.as_ref(), ck.as_ref(), max_seqlen_q, max_seqlen_k, &variant.map(|t| t))?;
    Ok(())
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

/// FLOPs of `products` attention products over `pairs` visible pairs (ops::attention::work::attn_product_flops).
#[pyfunction]
fn attn_flops(products: u64, pairs: u128, head_dim: u64) -> u128 {
    crate::ops::attention::work::attn_product_flops(products, pairs, head_dim)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(attn_visible_pairs, m)?)?;
    m.add_function(wrap_pyfunction!(attn_flops, m)?)?;
    m.add("ATTN_FWD_PRODUCTS", crate::ops::attention::work::ATTN_FWD_PRODUCTS)?;
    m.add("ATTN_BWD_PRODUCTS", crate::ops::attention::work::ATTN_BWD_PRODUCTS)?;
    m.add_function(wrap_pyfunction!(attn_fwd_check, m)?)?;
    m.add_function(wrap_pyfunction!(attn_fwd, m)?)?;
    Ok(())
}
