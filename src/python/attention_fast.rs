//! attn_fwd_fast and attn_kvcache_fast: the common eager calls of `flash_attn_func` and
//! `flash_attn_with_kvcache` in one native call each → ops::attention::fast (which calls they
//! take) and the launches (ops::attention::attn_fwd, ops::attention::kvcache).
//!
//! The Python side's share of the rule, read here: every argument of an exact, already
//! normal type — tensors plain; `dropout_p` and `softcap` the float or int 0; `causal`,
//! `deterministic`, `rotary_interleaved`, `return_*` bools (`return_attn_probs` False);
//! `window_size` a tuple of two negative ints (unbounded); `alibi_slopes`, `s_aux`, the rotary,
//! paging, batch-index and left-pad tensors None; `num_splits` an int; `softmax_scale` None or a
//! float that ops::attention::fast::fast_scale takes — the eager rule (eager.rs), no
//! forward-mode AD level, no tensor that requires grad, q's device the current one. Anything
//! else returns None and the Python function runs its own path, whose checks own every error
//! message.

use super::eager::{forward_ad_active, plain_eager, torch};
use super::scratch::Scratch;
use crate::dlpack::{import, import_writable, Imported};
use crate::error::Result;
use crate::ops::attention as op;
use crate::ops::attention::kvcache;
use crate::tensor::TensorView;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyTuple};

/// The positional arguments of a one-call function (the Python function's own, in its order:
/// _native.pyi names them); a TypeError naming `name` unless there are exactly `n`.
fn positional<'py>(args: &Bound<'py, PyTuple>, name: &str, n: usize) -> PyResult<Vec<Bound<'py, PyAny>>> {
    if args.len() != n {
        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "{name}: expected {n} positional arguments, got {}", args.len())));
    }
    Ok(args.iter().collect())
}

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

/// `softmax_scale` when it is None (`Some(None)`: the default) or an exact float (`Some(Some(x))`);
/// None for anything else (the call is declined).
fn exact_scale(x: &Bound<'_, PyAny>) -> Option<Option<f64>> {
    if x.is_none() {
        return Some(None);
    }
    x.cast_exact::<PyFloat>().ok().map(|f| Some(f.value()))
}

/// The eager rule (eager.rs) on `tensors`, no forward-mode AD level, and no tensor that requires
/// grad even with grad mode off (DLPack refuses to export one; the Python path detaches it
/// first): whether a call may leave the op route. The device type and the lazy bits are the
/// imports' to check (every tensor is imported; fast_sizes and [`on_current_device`] read the
/// device).
fn eager_ok<'py>(py: Python<'py>, tensors: Vec<Bound<'py, PyAny>>) -> PyResult<bool> {
    Ok(plain_eager(py, tensors, None, true)? && !forward_ad_active(py)?)
}

/// Whether `q` is on the current CUDA device (the Python path switches the device otherwise) and
/// torch has what a taken call uses (CUDA, its caching allocator).
fn on_current_device(py: Python<'_>, q: &Imported) -> PyResult<bool> {
    let (d, t) = (&q.view.meta.device, torch(py)?);
    let (Some(get_device), Some(_), Some(_), Some(_)) = (&t.cuda_get_device, &t.cuda_raw_stream, &t.raw_alloc, &t.raw_delete)
    else {
        return Ok(false);   // a torch without CUDA
    };
    Ok(d.is_cuda() && get_device.bind(py).call0()?.extract::<i32>()? == d.id)
}

/// Where a taken call's softmax_lse lives.
enum Lse<'py> {
    /// Returned to the caller: a torch tensor and its import.
    Returned(Bound<'py, PyAny>, Imported),
    /// Not returned: a region of the scratch block.
    Scratch(TensorView),
}

/// A taken call's buffers: out = torch.empty_like(q) as the Python path makes it; softmax_lse
/// fp32 (b, h, s_q) from torch too when the caller returns it (`lse_returned`), else in the
/// scratch block (scratch.rs) with, for `splits` > 1, the fp32 split partials o_accum
/// (splits, b, h, s_q, d) and lse_accum (splits, b, h, s_q).
struct Outputs<'py> {
    out: Bound<'py, PyAny>,
    out_view: Imported,
    lse: Lse<'py>,
    accum: Option<(TensorView, TensorView)>,
    /// Owns the block the scratch views point into; handed back to torch when dropped.
    _scratch: Scratch<'py>,
}

impl<'py> Outputs<'py> {
    #[allow(clippy::too_many_arguments)]
    fn new(py: Python<'py>, q: &Bound<'py, PyAny>, device: i32, stream: u64, lse_shape: [i64; 3], head_dim: i64,
           splits: u32, lse_returned: bool) -> Result<Self> {
        let t = torch(py)?;
        let out = t.empty_like.bind(py).call1((q,))?;
        let out_view = import_writable(&out, "out")?;
        let [b, h, s_q] = lse_shape;
        let s = splits as i64;
        let (o_accum, lse_accum) = ([s, b, h, s_q, head_dim], [s, b, h, s_q]);
        // the scratch regions, in order: the lse when not returned, then the partials
        let mut shapes: Vec<&[i64]> = if lse_returned { vec![] } else { vec![&lse_shape] };
        if splits > 1 {
            shapes.extend([&o_accum[..], &lse_accum[..]]);
        }
        let scratch = Scratch::new(py, device, stream, &shapes)?;
        let mut regions = scratch.views().iter().cloned();
        let lse = if lse_returned {
            let f32_kw = PyDict::new(py);
            f32_kw.set_item(intern!(py, "dtype"), t.float32.bind(py))?;
            let lse = q.call_method(intern!(py, "new_empty"), (PyTuple::new(py, lse_shape)?,), Some(&f32_kw))?;
            let view = import_writable(&lse, "softmax_lse")?;
            Lse::Returned(lse, view)
        } else {
            Lse::Scratch(regions.next().expect("a region per shape"))
        };
        let accum = (splits > 1).then(|| (regions.next().expect("a region per shape"), regions.next().expect("a region per shape")));
        Ok(Outputs { out, out_view, lse, accum, _scratch: scratch })
    }

    fn out(&self) -> &TensorView {
        &self.out_view.view
    }

    fn lse(&self) -> &TensorView {
        match &self.lse {
            Lse::Returned(_, view) => &view.view,
            Lse::Scratch(region) => region,
        }
    }

    fn accum(&self) -> Option<(&TensorView, &TensorView)> {
        self.accum.as_ref().map(|(o, l)| (o, l))
    }
}

/// The raw handle of torch's current stream on `device`.
fn current_stream(py: Python<'_>, device: i32) -> PyResult<u64> {
    match &torch(py)?.cuda_raw_stream {
        Some(f) => f.bind(py).call1((device,))?.extract(),
        None => Ok(0),   // not reached: on_current_device declines without CUDA
    }
}

/// `flash_attn_func(q, k, v, ...)` launched from here when it is the common plain or causal
/// eager call (module docs): returns `out` (torch.empty_like(q), fully written), or None when
/// the call must take the Python path. Raises only what that path would raise from the same
/// launch (the Rust validation's errors, CUDA / NVRTC errors).
#[pyfunction]
#[pyo3(signature = (*args))]
fn attn_fwd_fast<'py>(py: Python<'py>, args: &Bound<'py, PyTuple>) -> Result<Option<Bound<'py, PyAny>>> {
    let args = positional(args, "attn_fwd_fast", 12)?;
    let [q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
         return_attn_probs, s_aux] = &args[..] else { unreachable!("positional checked the count") };
    let Some(causal) = exact_bool(causal) else { return Ok(None) };
    if exact_bool(deterministic).is_none() || exact_bool(return_attn_probs) != Some(false) {
        return Ok(None);
    }
    if !(exact_zero(dropout_p) && exact_zero(softcap) && alibi_slopes.is_none() && s_aux.is_none()
        && unbounded_window(window_size))
    {
        return Ok(None);
    }
    let Some(scale) = exact_scale(softmax_scale) else { return Ok(None) };
    if !eager_ok(py, vec![q.clone(), k.clone(), v.clone()])? {
        return Ok(None);
    }
    // an input DLPack cannot describe (nested, sparse, ...) goes to the Python path, which names it
    let (Ok(qi), Ok(ki), Ok(vi)) = (import(q, "q"), import(k, "k"), import(v, "v")) else { return Ok(None) };
    if !on_current_device(py, &qi)? {
        return Ok(None);
    }
    let device = qi.view.meta.device.id;
    let plan = |b, s_q, h, h_k, s_k, d| kvcache::plan_splits(device, b, s_q, h, h_k, s_k, d, false, 0);
    let Some(call) = op::fast::fast_forward(&qi.view, &ki.view, &vi.view, causal, plan)? else { return Ok(None) };
    let Some(scale) = op::fast::fast_scale(scale, call.head_dim) else { return Ok(None) };
    let splits = match call.route {
        op::fast::FastRoute::Decode { splits } => splits,
        op::fast::FastRoute::Dense => 1,
    };
    let stream = current_stream(py, device)?;
    let o = Outputs::new(py, q, device, stream, call.lse_shape, call.head_dim, splits, false)?;
    let variant = op::AttnVariant { causal: call.causal, ..Default::default() };
    let (qv, kv, vv, ov, lv) = (&qi.view, &ki.view, &vi.view, o.out(), o.lse());
    let (s_q, s_k, scale) = (call.lse_shape[2], kv.meta.shape[1], scale as f32);
    // Detached: the first call of a configuration compiles or loads a module.
    match call.route {
        op::fast::FastRoute::Dense => {
            py.detach(|| op::attn_fwd(qv, kv, vv, ov, lv, None, None, s_q, s_k, scale, &variant, stream))?
        }
        op::fast::FastRoute::Decode { .. } => {
            let cache = kvcache::KvCache { cache_seqlens: None, seqlen_k_add: 0, cache_leftpad: None,
                                           cache_batch_idx: None, block_table: None };
            let accum = o.accum();
            py.detach(|| kvcache::attn_fwd_kvcache(qv, kv, vv, ov, lv, None, None, s_q, &cache, accum, scale, &variant,
                                                   stream))?
        }
    }
    Ok(Some(o.out))
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
#[pyo3(signature = (*args))]
fn attn_kvcache_fast<'py>(py: Python<'py>, args: &Bound<'py, PyTuple>) -> Result<Option<Bound<'py, PyAny>>> {
    let args = positional(args, "attn_kvcache_fast", 19)?;
    let [q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
         softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
         return_softmax_lse] = &args[..] else { unreachable!("positional checked the count") };
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
    let Some(scale) = exact_scale(softmax_scale) else { return Ok(None) };
    let sl_obj = (!cache_seqlens.is_none()).then_some(cache_seqlens);
    let new_obj = (!k.is_none()).then_some((k, v));
    let mut tensors = vec![q.clone(), k_cache.clone(), v_cache.clone()];
    tensors.extend(new_obj.iter().flat_map(|(k, v)| [(*k).clone(), (*v).clone()]));
    tensors.extend(sl_obj.cloned());
    if !eager_ok(py, tensors)? {
        return Ok(None);
    }
    // the cache is written when k / v are appended: imported writable then (as kv_append does)
    let cache_import = if new_obj.is_some() { import_writable } else { import };
    // an input DLPack cannot describe (nested, sparse, ...) goes to the Python path, which names it
    let (Ok(qi), Ok(kci), Ok(vci)) = (import(q, "q"), cache_import(k_cache, "k_cache"), cache_import(v_cache, "v_cache"))
    else {
        return Ok(None);
    };
    let new_i = match new_obj.map(|(k, v)| (import(k, "k"), import(v, "v"))) {
        Some((Ok(k), Ok(v))) => Some((k, v)),
        Some(_) => return Ok(None),
        None => None,
    };
    let Ok(sl_i) = sl_obj.map(|t| import(t, "cache_seqlens")).transpose() else { return Ok(None) };
    if !on_current_device(py, &qi)? {
        return Ok(None);
    }
    let device = qi.view.meta.device.id;
    let new_views = new_i.as_ref().map(|(k, v)| (&k.view, &v.view));
    let plan = |b, s_q, h, h_k, s_cache, d, n| kvcache::plan_splits(device, b, s_q, h, h_k, s_cache, d, false, n);
    let Some(call) = op::fast::fast_kvcache(&qi.view, &kci.view, &vci.view, new_views, sl_i.as_ref().map(|t| &t.view),
                                            causal, num_splits, plan)?
    else {
        return Ok(None);
    };
    let Some(scale) = op::fast::fast_scale(scale, call.head_dim) else { return Ok(None) };
    let stream = current_stream(py, device)?;
    let o = Outputs::new(py, q, device, stream, call.lse_shape, call.head_dim, call.splits, with_lse)?;
    let variant = op::AttnVariant { causal: call.causal, ..Default::default() };
    let sl_view = sl_i.as_ref().map(|t| &t.view);
    let (ov, lv, accum) = (o.out(), o.lse(), o.accum());
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
        kvcache::attn_fwd_kvcache(&qi.view, &kci.view, &vci.view, ov, lv, None, None, 0, &cache, accum, scale, &variant,
                                  stream)
    })?;
    let Outputs { out, lse, .. } = o;
    Ok(Some(match lse {
        Lse::Returned(lse, _) => PyTuple::new(py, [out, lse])?.into_any(),
        Lse::Scratch(_) => out,
    }))
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
