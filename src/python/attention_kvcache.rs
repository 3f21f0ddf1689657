//! attn_kvcache_check (metadata), attn_kvcache_num_splits, attn_fwd_kvcache and kv_append (DLPack
//! tensors) → ops::attention::kvcache.

use super::args::{cu_metas, import_cu, import_opt, meta, meta_of, stream_handle, MetaTuple};
use super::variant::{views, VariantArg};
use crate::dlpack::{import, import_writable};
use crate::error::Result;
use crate::ops::attention::kvcache as op;
use pyo3::prelude::*;

fn int32_meta(arg: &str, t: Option<MetaTuple>) -> Result<Option<crate::tensor::TensorMeta>> {
    t.map(|t| meta_of(arg, t, "int32")).transpose()
}

/// Validate a kv-cache attention call from metadata alone (the checks and errors of attn_fwd_kvcache).
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, cache_seqlens, seqlen_k_add,
                    cache_leftpad, cache_batch_idx, block_table, variant))]
#[allow(clippy::too_many_arguments)]
fn attn_kvcache_check(q: MetaTuple, k_cache: MetaTuple, v_cache: MetaTuple, cu_seqlens_q: Option<MetaTuple>,
                      cu_seqlens_k: Option<MetaTuple>, max_seqlen_q: i64, cache_seqlens: Option<MetaTuple>,
                      seqlen_k_add: i64, cache_leftpad: Option<MetaTuple>, cache_batch_idx: Option<MetaTuple>,
                      block_table: Option<MetaTuple>, variant: &Bound<'_, PyAny>) -> Result<()> {
    let (q, k, v) = (meta("q", q)?, meta("k_cache", k_cache)?, meta("v_cache", v_cache)?);
    let (cq, ck) = cu_metas(cu_seqlens_q, cu_seqlens_k)?;
    let (sl, lp, bi, bt) = (int32_meta("cache_seqlens", cache_seqlens)?, int32_meta("cache_leftpad", cache_leftpad)?,
                            int32_meta("cache_batch_idx", cache_batch_idx)?, int32_meta("block_table", block_table)?);
    let kv = op::KvCache { cache_seqlens: sl.as_ref(), seqlen_k_add, cache_leftpad: lp.as_ref(),
                           cache_batch_idx: bi.as_ref(), block_table: bt.as_ref() };
    let variant = VariantArg::from_obj(variant)?.metas()?;
    op::check(&q, &k, &v, cq.as_ref(), ck.as_ref(), max_seqlen_q, &kv, &variant.map(|t| t))?;
    Ok(())
}

/// Validate a cache append from metadata alone (the checks and errors of kv_append).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn kv_append_check(k_cache: MetaTuple, v_cache: MetaTuple, k: MetaTuple, v: MetaTuple, q: Option<MetaTuple>,
                   q_rot: Option<MetaTuple>, rotary_cos: Option<MetaTuple>, rotary_sin: Option<MetaTuple>,
                   cache_seqlens: Option<MetaTuple>, cache_batch_idx: Option<MetaTuple>,
                   block_table: Option<MetaTuple>) -> Result<()> {
    let (kc, vc, kn, vn) = (meta("k_cache", k_cache)?, meta("v_cache", v_cache)?, meta("k", k)?, meta("v", v)?);
    let opt = |arg: &str, t: Option<MetaTuple>| t.map(|t| meta(arg, t)).transpose();
    let (q, qr, cos, sin) = (opt("q", q)?, opt("q_rot", q_rot)?, opt("rotary_cos", rotary_cos)?, opt("rotary_sin", rotary_sin)?);
    let (sl, bi, bt) = (int32_meta("cache_seqlens", cache_seqlens)?, int32_meta("cache_batch_idx", cache_batch_idx)?,
                        int32_meta("block_table", block_table)?);
    let kv = op::KvCache { cache_seqlens: sl.as_ref(), seqlen_k_add: 0, cache_leftpad: None,
                           cache_batch_idx: bi.as_ref(), block_table: bt.as_ref() };
    let metas = op::AppendMetas { k_new: &kn, v_new: &vn, q: q.as_ref(), q_rot: qr.as_ref(), cos: cos.as_ref(), sin: sin.as_ref() };
    op::validate_append(&kc, &vc, &metas, &kv)?;
    Ok(())
}

/// The split count of a kv-cache call on `device` (ops::attention::kvcache::plan_splits).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn attn_kvcache_num_splits(device: i32, batch: i64, seqlen_q: i64, heads: i64, heads_k: i64, key_len: i64,
                           head_dim: i64, paged: bool, num_splits: i64) -> Result<u32> {
    op::plan_splits(device, batch, seqlen_q, heads, heads_k, key_len, head_dim, paged, num_splits)
}

/// Whether a flash_attn_func / varlen call of these sizes runs on the kv-cache kernel
/// (tuning::attention_kvcache::use_kvcache_path).
#[pyfunction]
fn attn_use_kvcache_path(seqlen_q: u64, group: u64, seqlen_k: u64, dropout: bool) -> bool {
    let kind = crate::ops::attention::VariantKind { dropout, ..Default::default() };
    crate::tuning::attention_kvcache::use_kvcache_path(seqlen_q, group, seqlen_k, kind)
}

/// Whether seqlen_q queries of a GQA group of `group` heads are few enough for the kv-cache kernel
/// (tuning::attention_kvcache::decode_rows_fit).
#[pyfunction]
fn attn_decode_rows_fit(seqlen_q: u64, group: u64) -> bool {
    crate::tuning::attention_kvcache::decode_rows_fit(seqlen_q, group)
}

/// Launch the kv-cache attention forward (and the split combine when `o_accum` is given) on
/// `stream`. Validates everything first; never synchronises.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn attn_fwd_kvcache(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    softmax_lse: &Bound<'_, PyAny>,
    cu_seqlens_q: Option<&Bound<'_, PyAny>>,
    cu_seqlens_k: Option<&Bound<'_, PyAny>>,
    max_seqlen_q: i64,
    cache_seqlens: Option<&Bound<'_, PyAny>>,
    seqlen_k_add: i64,
    cache_leftpad: Option<&Bound<'_, PyAny>>,
    cache_batch_idx: Option<&Bound<'_, PyAny>>,
    block_table: Option<&Bound<'_, PyAny>>,
    o_accum: Option<&Bound<'_, PyAny>>,
    lse_accum: Option<&Bound<'_, PyAny>>,
    softmax_scale: f64,
    variant: &Bound<'_, PyAny>,
    stream: &Bound<'_, PyAny>,
) -> Result<()> {
    let stream = stream_handle(stream)?;
    let (q, k, v) = (import(q, "q")?, import(k_cache, "k_cache")?, import(v_cache, "v_cache")?);
    let (o, lse) = (import_writable(out, "out")?, import_writable(softmax_lse, "softmax_lse")?);
    let (cq, ck) = import_cu(cu_seqlens_q, cu_seqlens_k)?;
    let sl = import_opt(cache_seqlens, "cache_seqlens", false)?;
    let lp = import_opt(cache_leftpad, "cache_leftpad", false)?;
    let bi = import_opt(cache_batch_idx, "cache_batch_idx", false)?;
    let bt = import_opt(block_table, "block_table", false)?;
    let oa = import_opt(o_accum, "o_accum", true)?;
    let la = import_opt(lse_accum, "lse_accum", true)?;
    let variant = VariantArg::from_obj(variant)?.import()?;
    let variant = views(&variant);
    let kv = op::KvCache {
        cache_seqlens: sl.as_ref().map(|t| &t.view),
        seqlen_k_add,
        cache_leftpad: lp.as_ref().map(|t| &t.view),
        cache_batch_idx: bi.as_ref().map(|t| &t.view),
        block_table: bt.as_ref().map(|t| &t.view),
    };
    let accum = op::accum_pair(oa.as_ref().map(|t| &t.view), la.as_ref().map(|t| &t.view))?;
    let (cqv, ckv) = (cq.as_ref().map(|t| &t.view), ck.as_ref().map(|t| &t.view));
    py.detach(|| {
        op::attn_fwd_kvcache(&q.view, &k.view, &v.view, &o.view, &lse.view, cqv, ckv, max_seqlen_q, &kv, accum,
                             softmax_scale as f32, &variant, stream)
    })
}

/// Append k / v (rotated) to the cache at cache_seqlens and rotate q into q_rot, on `stream`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn kv_append(
    py: Python<'_>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    q: Option<&Bound<'_, PyAny>>,
    q_rot: Option<&Bound<'_, PyAny>>,
    rotary_cos: Option<&Bound<'_, PyAny>>,
    rotary_sin: Option<&Bound<'_, PyAny>>,
    cache_seqlens: &Bound<'_, PyAny>,
    cache_batch_idx: Option<&Bound<'_, PyAny>>,
    block_table: Option<&Bound<'_, PyAny>>,
    rotary_interleaved: bool,
    q_per_token: bool,
    stream: &Bound<'_, PyAny>,
) -> Result<()> {
    let stream = stream_handle(stream)?;
    let (kc, vc) = (import_writable(k_cache, "k_cache")?, import_writable(v_cache, "v_cache")?);
    let (kn, vn) = (import(k, "k")?, import(v, "v")?);
    let q = import_opt(q, "q", false)?;
    let qr = import_opt(q_rot, "q_rot", true)?;
    let cos = import_opt(rotary_cos, "rotary_cos", false)?;
    let sin = import_opt(rotary_sin, "rotary_sin", false)?;
    let sl = import(cache_seqlens, "cache_seqlens")?;
    let bi = import_opt(cache_batch_idx, "cache_batch_idx", false)?;
    let bt = import_opt(block_table, "block_table", false)?;
    let kv = op::KvCache {
        cache_seqlens: Some(&sl.view),
        seqlen_k_add: 0,
        cache_leftpad: None,
        cache_batch_idx: bi.as_ref().map(|t| &t.view),
        block_table: bt.as_ref().map(|t| &t.view),
    };
    let args = op::AppendArgs {
        tensors: op::AppendTensors {
            k_new: &kn.view,
            v_new: &vn.view,
            q: q.as_ref().map(|t| &t.view),
            q_rot: qr.as_ref().map(|t| &t.view),
            cos: cos.as_ref().map(|t| &t.view),
            sin: sin.as_ref().map(|t| &t.view),
        },
        interleaved: rotary_interleaved,
        q_per_token,
    };
    py.detach(|| op::kv_append(&kc.view, &vc.view, &args, &kv, stream))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ATTN_KVCACHE_MAX_SPLITS", crate::tuning::attention_kvcache::MAX_SPLITS)?;
    m.add_function(wrap_pyfunction!(attn_kvcache_check, m)?)?;
    m.add_function(wrap_pyfunction!(attn_kvcache_num_splits, m)?)?;
    m.add_function(wrap_pyfunction!(attn_use_kvcache_path, m)?)?;
    m.add_function(wrap_pyfunction!(attn_decode_rows_fit, m)?)?;
    m.add_function(wrap_pyfunction!(attn_fwd_kvcache, m)?)?;
    m.add_function(wrap_pyfunction!(kv_append, m)?)?;
    m.add_function(wrap_pyfunction!(kv_append_check, m)?)?;
    Ok(())
}
