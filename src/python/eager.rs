//! eager_plain: the eager fast path's rule (python/ferroattn/ops/_eager.py documents it and
//! keeps its switch), read from torch's interpreter state in one native call. Its one home:
//! `_eager.plain_eager` and `attn_fwd_fast` (attention_fast.rs) both ask [`plain_eager`].

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::exceptions::PyTypeError;
use pyo3::types::{PyFrozenSet, PyList, PySet, PyTuple, PyType};
use pyo3::{intern, Py};

/// The torch objects the rule reads, looked up once per process.
pub(super) struct Torch {
    pub tensor: Py<PyType>,
    pub parameter: Py<PyType>,
    pub float32: Py<PyAny>,
    pub is_grad_enabled: Py<PyAny>,
    len_function_stack: Py<PyAny>,
    len_dispatch_stack: Py<PyAny>,
    functorch_active: Py<PyAny>,
    tracing_state: Py<PyAny>,
    profiler: Py<PyAny>,
    forward_ad: Py<PyAny>,
    pub empty_like: Py<PyAny>,
    /// `torch._C._cuda_getDevice` / `_cuda_getCurrentRawStream`; None in a torch built without CUDA.
    pub cuda_get_device: Option<Py<PyAny>>,
    pub cuda_raw_stream: Option<Py<PyAny>>,
    /// `torch._C._cuda_cudaCachingAllocator_raw_alloc` / `_raw_delete` (scratch.rs); None likewise.
    pub raw_alloc: Option<Py<PyAny>>,
    pub raw_delete: Option<Py<PyAny>>,
}

static TORCH: PyOnceLock<Torch> = PyOnceLock::new();

/// The cached torch objects (ImportError / AttributeError the first time, if torch lacks one).
pub(super) fn torch(py: Python<'_>) -> PyResult<&Torch> {
    TORCH.get_or_try_init(py, || {
        let torch = py.import("torch")?;
        let c = torch.getattr("_C")?;
        let get = |m: &Bound<'_, PyAny>, name: &str| m.getattr(name).map(Bound::unbind);
        Ok(Torch {
            tensor: torch.getattr("Tensor")?.cast_into::<PyType>()?.unbind(),
            parameter: py.import("torch.nn")?.getattr("Parameter")?.cast_into::<PyType>()?.unbind(),
            float32: get(&torch, "float32")?,
            is_grad_enabled: get(&c, "is_grad_enabled")?,
            len_function_stack: get(&c, "_len_torch_function_stack")?,
            len_dispatch_stack: get(&c, "_len_torch_dispatch_stack")?,
            functorch_active: get(&c, "_are_functorch_transforms_active")?,
            tracing_state: get(&c, "_get_tracing_state")?,
            profiler: py.import("torch.autograd.profiler")?.into_any().unbind(),
            forward_ad: py.import("torch.autograd.forward_ad")?.into_any().unbind(),
            empty_like: get(&torch, "empty_like")?,
            cuda_get_device: get(&c, "_cuda_getDevice").ok(),
            cuda_raw_stream: get(&c, "_cuda_getCurrentRawStream").ok(),
            raw_alloc: get(&c, "_cuda_cudaCachingAllocator_raw_alloc").ok(),
            raw_delete: get(&c, "_cuda_cudaCachingAllocator_raw_delete").ok(),
        })
    })
}

/// True when calling a custom op's implementation directly on `tensors` (None allowed; the
/// first one is not None) does what the op call does: the conditions of ops/_eager.py's module
/// docs (plain tensor types, no autograd to record, no lazy negation / conjugation bit, the
/// first tensor's device type in `device_types`, no torch function or dispatch mode, the
/// autograd profiler off, no functorch transform, not jit-traced). The caller checks the switch
/// and `torch.compiler.is_compiling()` first (Dynamo traces only that). `no_grad_tensors`: a
/// tensor that requires grad declines also with grad mode off (a caller that hands the tensors
/// to DLPack undetached). `device_types` None: the device type and the lazy bits are the
/// caller's to check, through the DLPack import of every tensor (which reports the device and
/// refuses a lazy negation bit and the complex dtypes a conjugation bit needs).
pub(super) fn plain_eager<'py>(
    py: Python<'py>,
    tensors: impl IntoIterator<Item = Bound<'py, PyAny>>,
    device_types: Option<&Bound<'py, PyAny>>,
    no_grad_tensors: bool,
) -> PyResult<bool> {
    let t = torch(py)?;
    let grad = no_grad_tensors || t.is_grad_enabled.bind(py).call0()?.is_truthy()?;
    let (tensor, parameter) = (t.tensor.bind(py), t.parameter.bind(py));
    let mut first = None;
    for x in tensors {
        if x.is_none() {
            continue;
        }
        let ty = x.get_type();
        if !(ty.is(tensor) || ty.is(parameter)) {
            return Ok(false);
        }
        if grad && x.getattr(intern!(py, "requires_grad"))?.is_truthy()? {
            return Ok(false);
        }
        if device_types.is_some()
            && (x.call_method0(intern!(py, "is_neg"))?.is_truthy()? || x.call_method0(intern!(py, "is_conj"))?.is_truthy()?)
        {
            return Ok(false);   // a lazy negation / conjugation bit: the op resolves it (DLPack cannot carry it)
        }
        if first.is_none() {
            first = Some(x);
        }
    }
    let Some(first) = first else { return Ok(false) };
    if let Some(device_types) = device_types {
        if !device_types.contains(first.getattr(intern!(py, "device"))?.getattr(intern!(py, "type"))?)? {
            return Ok(false);
        }
    }
    Ok(t.len_function_stack.bind(py).call0()?.extract::<usize>()? == 0
        && t.len_dispatch_stack.bind(py).call0()?.extract::<usize>()? == 0
        && !t.profiler.bind(py).getattr(intern!(py, "_is_profiler_enabled"))?.is_truthy()?
        && !t.functorch_active.bind(py).call0()?.is_truthy()?
        && t.tracing_state.bind(py).call0()?.is_none())
}

/// Whether a forward-mode AD level is active (`torch.autograd.forward_ad._current_level >= 0`):
/// the calls that must check their inputs for tangents (ops/_to_native.py `reject_forward_ad`).
pub(super) fn forward_ad_active(py: Python<'_>) -> PyResult<bool> {
    let level: i64 = torch(py)?.forward_ad.bind(py).getattr(intern!(py, "_current_level"))?.extract()?;
    Ok(level >= 0)
}

/// [`plain_eager`] for Python (ops/_eager.py `plain_eager`): `tensors` a tuple or list (None
/// allowed), `device_types` a tuple, list or set of device type names (a string is refused: it
/// would match by substring); TypeError naming the argument otherwise.
#[pyfunction]
fn eager_plain<'py>(py: Python<'py>, tensors: &Bound<'py, PyAny>, device_types: &Bound<'py, PyAny>) -> PyResult<bool> {
    let items: Vec<Bound<'py, PyAny>> = match (tensors.cast::<PyTuple>(), tensors.cast::<PyList>()) {
        (Ok(t), _) => t.iter().collect(),
        (_, Ok(l)) => l.iter().collect(),
        _ => return Err(PyTypeError::new_err(format!(
            "eager_plain: tensors: expected a tuple or list of tensors (None allowed), got {}", type_name(tensors)))),
    };
    if !(device_types.is_instance_of::<PyTuple>() || device_types.is_instance_of::<PyList>()
        || device_types.is_instance_of::<PyFrozenSet>() || device_types.is_instance_of::<PySet>())
    {
        return Err(PyTypeError::new_err(format!(
            "eager_plain: device_types: expected a tuple, list or set of device type names, got {}",
            type_name(device_types))));
    }
    plain_eager(py, items, Some(device_types), false)
}

fn type_name(x: &Bound<'_, PyAny>) -> String {
    x.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(eager_plain, m)?)?;
    Ok(())
}
