//! attn_bwd_check (metadata) and attn_bwd (DLPack tensors) → ops::attention_bwd.

use super::args::{cu_metas, import_cu, import_opt, meta, meta_of, stream_handle, MetaTuple};
use crate::dlpack::{import, import_writable};
use crate::error::Result;
use crate::ops::attention_bwd as op;
use super::variant::{optional_metas, views, VariantArg};
use pyo3::prelude::*;

/// Validate attention-backward arguments from metadata alone (same checks and errors as attn_bwd);
/// `variant` None = the plain call.
#[pyfunction]
#[pyo3(signature = (dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, variant=None))]
#[allow(clippy::too_many_arguments)]
fn attn_bwd_check(
    dout: MetaTuple,
    q: MetaTuple,
    k: MetaTuple,
    v: MetaTuple,
    out: MetaTuple,
    softmax_lse: MetaTuple,
    cu_seqlens_q: Option<MetaTuple>,
    cu_seqlens_k: Option<MetaTuple>,
    max_seqlen_q: i64,
    max_seqlen_k: i64,
    variant: Option<&Bound<'_, PyAny>>,
) -> Result<()> {
    let variant = optional_metas(variant)?;
    let (dout, q, k, v, out) = (
        meta("dout", dout)?,
        meta("q", q)?,
        meta("k", k)?,
        meta("v", v)?,
        meta("out", out)?,
    );
    let lse = meta_of("softmax_lse", softmax_lse, "float32")?;
    let (cq, ck) = cu_metas(cu_seqlens_q, cu_seqlens_k)?;
    let (cq, ck) = (cq.as_ref(), ck.as_ref());
    op::check(&dout, &q, &k, &v, &out, &lse, cq, ck, max_seqlen_q, max_seqlen_k, &variant.map(|t| t))?;
    Ok(())
}

/// Launch attention backward on `stream` (raw CUstream; 0 = legacy default) in q's device's
/// primary context. Validates everything before launching; never synchronises.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn attn_bwd(
    py: Python<'_>,
    dout: &Bound<'_, PyAny>,
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    softmax_lse: &Bound<'_, PyAny>,
    dq: &Bound<'_, PyAny>,
    dk: &Bound<'_, PyAny>,
    dv: &Bound<'_, PyAny>,
    softmax_d: &Bound<'_, PyAny>,
    dq_accum: Option<&Bound<'_, PyAny>>,
    cu_seqlens_q: Option<&Bound<'_, PyAny>>,
    cu_seqlens_k: Option<&Bound<'_, PyAny>>,
    max_seqlen_q: i64,
    max_seqlen_k: i64,
    softmax_scale: f64,
    variant: &Bound<'_, PyAny>,
    deterministic: bool,
    stream: &Bound<'_, PyAny>,
) -> Result<()> {
    let stream = stream_handle(stream)?;
    let variant = VariantArg::from_obj(variant)?.import()?;
    let variant = views(&variant);
    let (dout, q, k, v) = (
        import(dout, "dout")?,
        import(q, "q")?,
        import(k, "k")?,
        import(v, "v")?,
    );
    let (out, lse) = (import(out, "out")?, import(softmax_lse, "softmax_lse")?);
    let (dq, dk, dv) = (
        import_writable(dq, "dq")?,
        import_writable(dk, "dk")?,
        import_writable(dv, "dv")?,
    );
    let d = import_writable(softmax_d, "softmax_d")?;
    let dq_accum = import_opt(dq_accum, "dq_accum", true)?;
    let (cq, ck) = import_cu(cu_seqlens_q, cu_seqlens_k)?;
    let tensors = op::BwdTensors {
        dout: &dout.view,
        q: &q.view,
        k: &k.view,
        v: &v.view,
        out: &out.view,
        softmax_lse: &lse.view,
        dq: &dq.view,
        dk: &dk.view,
        dv: &dv.view,
        softmax_d: &d.view,
        dq_accum: dq_accum.as_ref().map(|t| &t.view),
        cu_seqlens_q: cq.as_ref().map(|t| &t.view),
        cu_seqlens_k: ck.as_ref().map(|t| &t.view),
    };
    // Detached: the first call of a configuration compiles or loads a module.
    py.detach(|| {
        op::attn_bwd(
            &tensors,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale as f32,
            &variant,
            deterministic,
            stream,
        )
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(attn_bwd_check, m)?)?;
    m.add_function(wrap_pyfunction!(attn_bwd, m)?)?;
    Ok(())
}
