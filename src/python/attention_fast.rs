//! attn_fwd_fast: `flash_attn_func`'s common eager call in one native call →
//! ops::attention::fast (which calls it takes) and ops::attention::attn_fwd (the launch).
//!
//! The Python side's share of the rule, read here: every argument of an exact, already
//! normal type — q, k, v plain tensors; `dropout_p` and `softcap` the float or int 0; `causal`,
//! `deterministic` bools; `window_size` a tuple of two negative ints (unbounded); `alibi_slopes`
//! and `s_aux` None; `return_attn_probs` False; `softmax_scale` None or a float that
//! ops::attention::fast::fast_scale takes — the eager rule (eager.rs), no forward-mode AD level,
//! q's device the current one. Anything else returns None and flash_attn_func runs its Python
//! path, whose checks own every error message.

use super::eager::{forward_ad_active, plain_eager, torch};
use crate::dlpack::{import, import_writable};
use crate::error::Result;
use crate::ops::attention as op;
use crate::ops::attention::kvcache;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyTuple};

/// An exact Python bool's value (not an int, not a numpy bool), or None.
fn exact_bool(x: &Bound<'_, PyAny>) -> Option<bool> {
    x.cast_exact::<PyBool>().ok().map(|b| b.is_true())
}

/// True for the exact float 0.0 / -0.0 or the exact int 0.
fn exact_zero(x: &Bound<'_, PyAny>) -> bool {
    if let Ok(f) = x.cast_exact::<PyFloat>() {
        return f.value() == 0.0;
    }
    x.cast_exact::<PyInt>().ok().and_then(|i| i.extract::<i64>().ok()) == Some(0)
}

/// True for an exact tuple of two exact negative ints (flash_attn: both sides unbounded).
fn unbounded_window(x: &Bound<'_, PyAny>) -> bool {
    let Ok(t) = x.cast_exact::<PyTuple>() else { return false };
    t.len() == 2
        && t.iter().all(|s| s.cast_exact::<PyInt>().ok().and_then(|i| i.extract::<i64>().ok()).is_some_and(|v| v < 0))
}

/// `flash_attn_func(q, k, v, ...)` launched from here when it is the common plain or causal
/// eager call (module docs): returns `out` (torch.empty_like(q), fully written), or None when
/// the call must take the Python path. Raises only what that path would raise from the same
/// launch (the Rust validation's errors, CUDA / NVRTC errors).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn attn_fwd_fast<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    dropout_p: &Bound<'py, PyAny>,
    softmax_scale: &Bound<'py, PyAny>,
    causal: &Bound<'py, PyAny>,
    window_size: &Bound<'py, PyAny>,
    softcap: &Bound<'py, PyAny>,
    alibi_slopes: &Bound<'py, PyAny>,
    deterministic: &Bound<'py, PyAny>,
    return_attn_probs: &Bound<'py, PyAny>,
    s_aux: &Bound<'py, PyAny>,
) -> Result<Option<Bound<'py, PyAny>>> {
    let Some(causal) = exact_bool(causal) else { return Ok(None) };
    if exact_bool(deterministic).is_none() || exact_bool(return_attn_probs) != Some(false) {
        return Ok(None);
    }
    if !(exact_zero(dropout_p) && exact_zero(softcap) && alibi_slopes.is_none() && s_aux.is_none()
        && unbounded_window(window_size))
    {
        return Ok(None);
    }
    let scale = if softmax_scale.is_none() {
        None
    } else {
        match softmax_scale.cast_exact::<PyFloat>() {
            Ok(f) => Some(f.value()),
            Err(_) => return Ok(None),
        }
    };
    let cuda = intern!(py, "cuda");
    let device_types = PyTuple::new(py, [cuda])?;
    if !plain_eager(py, [q.clone(), k.clone(), v.clone()], device_types.as_any())? || forward_ad_active(py)? {
        return Ok(None);
    }
    let (qi, ki, vi) = (import(q, "q")?, import(k, "k")?, import(v, "v")?);
    let t = torch(py)?;
    let device = qi.view.meta.device.id;
    if qi.view.meta.device.is_cuda() && t.cuda_get_device.bind(py).call0()?.extract::<i32>()? != device {
        return Ok(None);   // the Python path switches the device
    }
    let plan = |b, s_q, h, h_k, s_k, d| kvcache::plan_splits(device, b, s_q, h, h_k, s_k, d, false, 0);
    let Some(call) = op::fast::fast_forward(&qi.view, &ki.view, &vi.view, causal, plan)? else { return Ok(None) };
    let Some(scale) = op::fast::fast_scale(scale, call.head_dim) else { return Ok(None) };
    let f32_kw = PyDict::new(py);
    f32_kw.set_item(intern!(py, "dtype"), t.float32.bind(py))?;
    let new_f32 = |shape: &[i64]| q.call_method(intern!(py, "new_empty"), (PyTuple::new(py, shape)?,), Some(&f32_kw));
    let out = t.empty_like.bind(py).call1((q,))?;
    let lse = new_f32(&call.lse_shape)?;
    let [b, h, s_q] = call.lse_shape;
    let accum = match call.route {
        op::fast::FastRoute::Decode { splits } if splits > 1 => {
            let s = splits as i64;
            Some((new_f32(&[s, b, h, s_q, call.head_dim])?, new_f32(&[s, b, h, s_q])?))
        }
        _ => None,
    };
    let stream: u64 = t.cuda_raw_stream.bind(py).call1((device,))?.extract()?;
    let (oi, li) = (import_writable(&out, "out")?, import_writable(&lse, "softmax_lse")?);
    let acc = match &accum {
        Some((o, l)) => Some((import_writable(o, "o_accum")?, import_writable(l, "lse_accum")?)),
        None => None,
    };
    let variant = op::AttnVariant { causal: call.causal, ..Default::default() };
    let (qv, kv, vv, ov, lv) = (&qi.view, &ki.view, &vi.view, &oi.view, &li.view);
    let s_k = kv.meta.shape[1];
    let scale = scale as f32;
    // Detached: the first call of a configuration compiles or loads a module.
    match call.route {
        op::fast::FastRoute::Dense => {
            py.detach(|| op::attn_fwd(qv, kv, vv, ov, lv, None, None, s_q, s_k, scale, &variant, stream))?
        }
        op::fast::FastRoute::Decode { .. } => {
            let cache = kvcache::KvCache { cache_seqlens: None, seqlen_k_add: 0, cache_leftpad: None,
                                           cache_batch_idx: None, block_table: None };
            let accum = acc.as_ref().map(|(o, l)| (&o.view, &l.view));
            py.detach(|| kvcache::attn_fwd_kvcache(qv, kv, vv, ov, lv, None, None, s_q, &cache, accum, scale, &variant,
                                                   stream))?
        }
    }
    Ok(Some(out))
}

/// An exact Python int's value, or None (bools and other types: None).
fn exact_int(x: &Bound<'_, PyAny>) -> Option<i64> {
    x.cast_exact::<PyInt>().ok().and_then(|i| i.extract::<i64>().ok())
}

/// `flash_attn_with_kvcache(q, k_cache, v_cache, k, v, ...)` (its parameters in its order)
/// launched from here when it is the common call (ops::attention::fast::fast_kvcache: a
/// contiguous-row cache, an optional append, no rotary, paging, batch index or left pad, the
/// plain or causal variant; exact argument types, the eager rule): appends k / v at
/// `cache_seqlens` in place, then attends, as the Python path does. Returns `out`, or
/// `(out, softmax_lse)` with `return_softmax_lse`; None when the call must take the Python path.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn attn_kvcache_fast<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    rotary_cos: &Bound<'py, PyAny>,
    rotary_sin: &Bound<'py, PyAny>,
    cache_seqlens: &Bound<'py, PyAny>,
    cache_batch_idx: &Bound<'py, PyAny>,
    cache_leftpad: &Bound<'py, PyAny>,
    block_table: &Bound<'py, PyAny>,
    softmax_scale: &Bound<'py, PyAny>,
    causal: &Bound<'py, PyAny>,
    window_size: &Bound<'py, PyAny>,
    softcap: &Bound<'py, PyAny>,
    rotary_interleaved: &Bound<'py, PyAny>,
    alibi_slopes: &Bound<'py, PyAny>,
    num_splits: &Bound<'py, PyAny>,
    return_softmax_lse: &Bound<'py, PyAny>,
) -> Result<Option<Bound<'py, PyAny>>> {
    let (Some(causal), Some(interleaved), Some(with_lse)) =
        (exact_bool(causal), exact_bool(rotary_interleaved), exact_bool(return_softmax_lse))
    else {
        return Ok(None);
    };
    let Some(num_splits) = exact_int(num_splits) else { return Ok(None) };
    if !(rotary_cos.is_none() && rotary_sin.is_none() && cache_batch_idx.is_none() && cache_leftpad.is_none()
        && block_table.is_none() && alibi_slopes.is_none() && exact_zero(softcap) && unbounded_window(window_size))
        || k.is_none() != v.is_none()
    {
        return Ok(None);
    }
    let scale = if softmax_scale.is_none() {
        None
    } else {
        match softmax_scale.cast_exact::<PyFloat>() {
            Ok(f) => Some(f.value()),
            Err(_) => return Ok(None),
        }
    };
    let sl_obj = (!cache_seqlens.is_none()).then_some(cache_seqlens);
    let new_obj = (!k.is_none()).then_some((k, v));
    let mut tensors = vec![q.clone(), k_cache.clone(), v_cache.clone()];
    tensors.extend(new_obj.iter().flat_map(|(k, v)| [(*k).clone(), (*v).clone()]));
    tensors.extend(sl_obj.cloned());
    let device_types = PyTuple::new(py, [intern!(py, "cuda")])?;
    if !plain_eager(py, tensors, device_types.as_any())? || forward_ad_active(py)? {
        return Ok(None);
    }
    // the cache is written when k / v are appended: imported writable then (as kv_append does)
    let cache_import = if new_obj.is_some() { import_writable } else { import };
    let (qi, kci, vci) = (import(q, "q")?, cache_import(k_cache, "k_cache")?, cache_import(v_cache, "v_cache")?);
    let new_i = match new_obj {
        Some((k, v)) => Some((import(k, "k")?, import(v, "v")?)),
        None => None,
    };
    let sl_i = sl_obj.map(|t| import(t, "cache_seqlens")).transpose()?;
    let t = torch(py)?;
    let device = qi.view.meta.device.id;
    if qi.view.meta.device.is_cuda() && t.cuda_get_device.bind(py).call0()?.extract::<i32>()? != device {
        return Ok(None);
    }
    let new_views = new_i.as_ref().map(|(k, v)| (&k.view, &v.view));
    let plan = |b, s_q, h, h_k, s_cache, d, n| kvcache::plan_splits(device, b, s_q, h, h_k, s_cache, d, false, n);
    let Some(call) = op::fast::fast_kvcache(&qi.view, &kci.view, &vci.view, new_views, sl_i.as_ref().map(|t| &t.view),
                                            causal, num_splits, plan)?
    else {
        return Ok(None);
    };
    let Some(scale) = op::fast::fast_scale(scale, call.head_dim) else { return Ok(None) };
    let f32_kw = PyDict::new(py);
    f32_kw.set_item(intern!(py, "dtype"), t.float32.bind(py))?;
    let new_f32 = |shape: &[i64]| q.call_method(intern!(py, "new_empty"), (PyTuple::new(py, shape)?,), Some(&f32_kw));
    let out = t.empty_like.bind(py).call1((q,))?;
    let lse = new_f32(&call.lse_shape)?;
    let [b, h, s_q] = call.lse_shape;
    let accum = if call.splits > 1 {
        let s = call.splits as i64;
        Some((new_f32(&[s, b, h, s_q, call.head_dim])?, new_f32(&[s, b, h, s_q])?))
    } else {
        None
    };
    let stream: u64 = t.cuda_raw_stream.bind(py).call1((device,))?.extract()?;
    let (oi, li) = (import_writable(&out, "out")?, import_writable(&lse, "softmax_lse")?);
    let acc = match &accum {
        Some((o, l)) => Some((import_writable(o, "o_accum")?, import_writable(l, "lse_accum")?)),
        None => None,
    };
    let variant = op::AttnVariant { causal: call.causal, ..Default::default() };
    let sl_view = sl_i.as_ref().map(|t| &t.view);
    let scale = scale as f32;
    py.detach(|| -> Result<()> {
        if let (Some((kn, vn)), Some(sl)) = (new_views, sl_view) {
            let cache = kvcache::KvCache { cache_seqlens: Some(sl), seqlen_k_add: 0, cache_leftpad: None,
                                           cache_batch_idx: None, block_table: None };
            let args = kvcache::AppendArgs {
                tensors: kvcache::AppendTensors { k_new: kn, v_new: vn, q: None, q_rot: None, cos: None, sin: None },
                interleaved,
                q_per_token: call.causal,
            };
            kvcache::kv_append(&kci.view, &vci.view, &args, &cache, stream)?;
        }
        let cache = kvcache::KvCache { cache_seqlens: sl_view, seqlen_k_add: call.s_new, cache_leftpad: None,
                                       cache_batch_idx: None, block_table: None };
        let accum = acc.as_ref().map(|(o, l)| (&o.view, &l.view));
        kvcache::attn_fwd_kvcache(&qi.view, &kci.view, &vci.view, &oi.view, &li.view, None, None, 0, &cache, accum,
                                  scale, &variant, stream)
    })?;
    Ok(Some(if with_lse { PyTuple::new(py, [out, lse])?.into_any() } else { out }))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(attn_kvcache_fast, m)?)?;
    m.add_function(wrap_pyfunction!(attn_fwd_fast, m)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gates_take_only_the_exact_plain_values() {
        Python::initialize();
        Python::attach(|py| -> PyResult<()> {
            let eval = |src: &str| py.eval(&std::ffi::CString::new(src).unwrap(), None, None);
            assert_eq!(exact_bool(&eval("True")?), Some(true));
            assert_eq!(exact_bool(&eval("False")?), Some(false));
            for odd in ["1", "0", "None", "'yes'"] {
                assert_eq!(exact_bool(&eval(odd)?), None, "{odd}");
            }
            for zero in ["0.0", "-0.0", "0"] {
                assert!(exact_zero(&eval(zero)?), "{zero}");
            }
            for odd in ["False", "0.1", "'0'", "None", "1", "10**30"] {
                assert!(!exact_zero(&eval(odd)?), "{odd}");
            }
            for ok in ["(-1, -1)", "(-5, -1)"] {
                assert!(unbounded_window(&eval(ok)?), "{ok}");
            }
            for odd in ["[-1, -1]", "(-1,)", "(-1, 0)", "(4, -1)", "(True, -1)", "(-1.0, -1)", "(-1, -1, -1)"] {
                assert!(!unbounded_window(&eval(odd)?), "{odd}");
            }
            Ok(())
        })
        .unwrap();
    }
}
