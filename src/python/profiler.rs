//! profiler_enable / profiler_enabled / profiler_stats / profiler_drain (the launch recorder) and
//! profiler_mark / profiler_marks_query / profiler_marks_resolve / profiler_marks_release (marks)
//! → crate::profiler. Converts records to the dicts of python/ferroattn/_native.pyi.

use super::args::raw_handle;
use crate::error::Result;
use crate::profiler;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyList, PyTuple};
use pyo3::{intern, PyTraverseError, PyVisit};

/// Turn the recording of our kernel launches on or off, process-wide. `enabled` must be a
/// bool (TypeError naming it otherwise).
#[pyfunction]
fn profiler_enable(enabled: &Bound<'_, PyAny>) -> PyResult<()> {
    let Ok(on) = enabled.cast::<PyBool>() else {
        let shown = enabled.repr().map(|r| r.to_string()).unwrap_or_default();
        return Err(PyTypeError::new_err(format!(
            "enabled: expected a bool, got {shown}"
        )));
    };
    profiler::set_enabled(on.is_true());
    Ok(())
}

/// Whether launch recording is on.
#[pyfunction]
fn profiler_enabled() -> bool {
    profiler::enabled()
}

/// {enabled, pending, skipped_capture, dropped}.
#[pyfunction]
fn profiler_stats(py: Python<'_>) -> PyResult<Py<PyDict>> {
    let s = profiler::stats();
    let d = PyDict::new(py);
    d.set_item("enabled", s.enabled)?;
    d.set_item("pending", s.pending)?;
    d.set_item("skipped_capture", s.skipped_capture)?;
    d.set_item("dropped", s.dropped)?;
    Ok(d.unbind())
}

fn record_dict<'py>(py: Python<'py>, r: profiler::Resolved) -> PyResult<Bound<'py, PyDict>> {
    let (desc, a, w) = (&r.desc, &r.desc.attrs, &r.desc.work);
    let d = PyDict::new(py);
    d.set_item("seq", r.seq)?;
    d.set_item("op", desc.op)?;
    d.set_item("kernel", desc.kernel)?;
    d.set_item("config", &desc.config)?;
    d.set_item("arch", desc.arch)?;
    d.set_item("device", desc.device)?;
    d.set_item("stream", desc.stream)?;
    d.set_item("grid", desc.grid)?;
    d.set_item("block", desc.block)?;
    d.set_item("dynamic_smem_bytes", desc.dynamic_smem_bytes)?;
    d.set_item("static_smem_bytes", a.static_smem_bytes)?;
    d.set_item("registers", a.registers)?;
    d.set_item("max_active_blocks_per_sm", a.max_active_blocks_per_sm)?;
    d.set_item("occupancy", desc.occupancy)?;
    d.set_item("flops", w.flops)?;
    d.set_item("bytes", w.bytes)?;
    d.set_item("exact", w.exact)?;
    d.set_item("gpu_ms", r.gpu_ms)?;
    d.set_item("start_ms", r.start_ms)?;
    Ok(d)
}

/// Resolve and return every record kept so far, in launch order, and forget them. Waits for
/// the kernels (GIL released). reference_event: a CUevent handle as an int, or None.
#[pyfunction]
#[pyo3(signature = (reference_event = None))]
fn profiler_drain<'py>(
    py: Python<'py>,
    reference_event: Option<&Bound<'py, PyAny>>,
) -> Result<Vec<Bound<'py, PyDict>>> {
    let reference = reference_event
        .filter(|e| !e.is_none())
        .map(|e| raw_handle(e, "reference_event", "a CUevent handle"))
        .transpose()?;
    let records = py.detach(|| profiler::drain(reference))?;
    Ok(records
        .into_iter()
        .map(|r| record_dict(py, r))
        .collect::<PyResult<_>>()?)
}

/// Mark ids from a Python sequence of ints (TypeError naming `marks` otherwise).
fn mark_ids(marks: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    marks.extract::<Vec<u64>>().map_err(|_| {
        let shown = marks.repr().map(|r| r.to_string()).unwrap_or_default();
        PyTypeError::new_err(format!(
            "marks: expected a sequence of mark ids (ints in [0, 2**64)), got {shown}"
        ))
    })
}

/// Record a mark (a pooled timing event) on the raw CUstream `stream` of `device`; its id, or
/// 0 when not recorded (capturing stream, too many unresolved marks).
#[pyfunction]
fn profiler_mark(stream: &Bound<'_, PyAny>, device: &Bound<'_, PyAny>) -> Result<u64> {
    // the common case first (a plain u64 extraction); raw_handle words the errors
    let stream = match stream.extract::<u64>() {
        Ok(s) => s,
        Err(_) => raw_handle(stream, "stream", "a raw CUstream handle")?,
    };
    let shown = || device.repr().map(|r| r.to_string()).unwrap_or_default();
    let Ok(device) = device.extract::<i64>() else {
        return Err(PyTypeError::new_err(format!(
            "device: expected an int (a CUDA device index), got {}",
            shown()
        ))
        .into());
    };
    let device = i32::try_from(device)
        .ok()
        .filter(|d| *d >= 0)
        .ok_or_else(|| {
            crate::error::Error::argument("device", "a CUDA device index >= 0", device)
        })?;
    profiler::mark(device, stream)
}

/// Whether the GPU has passed each mark (no wait).
#[pyfunction]
fn profiler_marks_query(marks: &Bound<'_, PyAny>) -> Result<Vec<bool>> {
    profiler::marks_query(&mark_ids(marks)?)
}

/// ms from the reference event (None/0: the first mark) to each mark; waits (GIL released);
/// forgets the marks.
#[pyfunction]
#[pyo3(signature = (marks, reference_event = None))]
fn profiler_marks_resolve<'py>(
    py: Python<'py>,
    marks: &Bound<'py, PyAny>,
    reference_event: Option<&Bound<'py, PyAny>>,
) -> Result<Vec<Option<f64>>> {
    let ids = mark_ids(marks)?;
    let reference = reference_event
        .filter(|e| !e.is_none())
        .map(|e| raw_handle(e, "reference_event", "a CUevent handle"))
        .transpose()?;
    py.detach(|| profiler::marks_resolve(&ids, reference))
}

/// Forget marks without timing them; returns how many were unresolved.
#[pyfunction]
fn profiler_marks_release(marks: &Bound<'_, PyAny>) -> PyResult<usize> {
    Ok(profiler::marks_release(&mark_ids(marks)?))
}

/// The module hooks' per-call path in one native call (python/ferroattn/profiler/hooks.py, wrap
/// mode; the contract is the Python wrapper there, which this mirrors step for step): stored as
/// the hooked module's instance `forward`; a call opens a call entry (start mark, shapes, depth,
/// step, record_function / NVTX ranges when given), calls `inner`, and closes the entry (end
/// mark, ranges) also when `inner` raises. The entry is the 9-item list the Python side reads:
/// [name, kind, depth, step, start mark, end mark, shapes, module, record_function context].
///
/// Marks: with `mark` None, native marks straight from Rust (`crate::profiler::mark_scoped` on
/// `raw_stream(device)`, fetched per mark); otherwise `mark()` (a Python callable returning a
/// token). Has an instance `__dict__` (functools.update_wrapper and the restore bookkeeping set
/// attributes on it) and takes part in cyclic GC (it references its module).
#[pyclass(name = "ProfilerForward", module = "ferroattn._native", dict, frozen)]
struct ProfilerForward {
    /// True once the object holds its fields. The GC can traverse the object before that: the
    /// instance `__dict__` is made while the (zeroed) object is being allocated, and that
    /// allocation may run a collection (seen as a crash in `visit_decref` on a null field).
    ready: bool,
    f: Fields,
}

/// What a ProfilerForward holds, given by keyword to its constructor (the names below).
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
struct Fields {
    inner: Py<PyAny>,
    att: Py<PyAny>,
    name: Py<PyAny>,
    kind: Py<PyAny>,
    module: Py<PyAny>,
    stack: Py<PyList>,
    calls: Py<PyList>,
    kill: Py<PyList>,
    close: Py<PyAny>,
    raw_stream: Py<PyAny>,
    device: i32,
    mark: Option<Py<PyAny>>,
    probe: Option<Py<PyAny>>,
    open_rf: Py<PyAny>,
    push: Option<Py<PyAny>>,
    pop: Option<Py<PyAny>>,
    tensor: Py<PyAny>,
    shapes: bool,
}

/// The keyword names `ProfilerForward(...)` takes: the fields of `Fields`.
const FIELD_NAMES: [&str; 18] = ["inner", "att", "name", "kind", "module", "stack", "calls", "kill", "close",
                                 "raw_stream", "device", "mark", "probe", "open_rf", "push", "pop", "tensor",
                                 "shapes"];

impl ProfilerForward {
    fn take_mark<'py>(
        &self,
        py: Python<'py>,
        scope: profiler::Scope,
    ) -> PyResult<Bound<'py, PyAny>> {
        if let Some(m) = &self.f.mark {
            return m.bind(py).call0();
        }
        let stream: u64 = self.f.raw_stream.bind(py).call1((self.f.device,))?.extract()?;
        let id = profiler::mark_scoped(self.f.device, stream, scope)?;
        Ok(id.into_pyobject(py)?.into_any())
    }

    fn shapes_of<'py>(
        &self,
        py: Python<'py>,
        args: &Bound<'py, PyTuple>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if !self.f.shapes || args.is_empty() {
            return Ok(py.None().into_bound(py));
        }
        let tensor = self.f.tensor.bind(py);
        let shape = |a: Bound<'py, PyAny>| -> PyResult<Bound<'py, PyAny>> {
            if a.is_instance(tensor)? {
                a.getattr(intern!(py, "shape"))
            } else {
                Ok(py.None().into_bound(py))
            }
        };
        if args.len() == 1 {
            let a = args.get_item(0)?;
            if a.is_instance(tensor)? {
                return a.getattr(intern!(py, "shape"));
            }
            return Ok(PyList::new(py, [py.None()])?.into_any());
        }
        let out = PyList::empty(py);
        for a in args.iter() {
            out.append(shape(a)?)?;
        }
        Ok(out.into_any())
    }

    /// The Python wrapper's `finally` block.
    fn finish<'py>(&self, py: Python<'py>, call: &Bound<'py, PyList>) -> PyResult<()> {
        let stack = self.f.stack.bind(py);
        let n = stack.len();
        if n > 0 && stack.get_item(n - 1)?.is(call) {
            stack.del_item(n - 1)?;
            if call.get_item(5)?.is_none() {
                let scope = if n == 1 {
                    profiler::Scope::Close
                } else {
                    profiler::Scope::Inner
                };
                call.set_item(5, self.take_mark(py, scope)?)?;
            }
            if let Some(pop) = &self.f.pop {
                pop.bind(py).call0()?;
            }
            let rf = call.get_item(8)?;
            if !rf.is_none() {
                call.set_item(8, py.None())?;
                rf.call_method1(intern!(py, "__exit__"), (py.None(), py.None(), py.None()))?;
            }
            Ok(())
        } else {
            self.f.close.bind(py).call1((call,)).map(|_| ())
        }
    }
}

#[pymethods]
impl ProfilerForward {
    /// Every field by keyword (`ProfilerForward(inner=..., att=..., ...)`, the names of
    /// `Fields`): a missing one is a KeyError naming it; an unknown one, a callable field that
    /// is not callable or a `tensor` that is not a type is a TypeError naming it.
    #[new]
    #[pyo3(signature = (**fields))]
    fn new(fields: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let Some(given) = fields else {
            return Err(PyTypeError::new_err("ProfilerForward: expected its fields as keyword arguments"));
        };
        for key in given.keys() {
            let key: String = key.extract()?;
            if !FIELD_NAMES.contains(&key.as_str()) {
                return Err(PyTypeError::new_err(format!(
                    "ProfilerForward: unexpected field {key:?} (expected {})",
                    FIELD_NAMES.join(", ")
                )));
            }
        }
        let f: Fields = given.extract()?;
        let py = given.py();
        // raw_stream is read only for native marks (mark None)
        let raw_stream = if f.mark.is_none() { Some(&f.raw_stream) } else { None };
        let callables = [("inner", Some(&f.inner)), ("close", Some(&f.close)), ("raw_stream", raw_stream),
                         ("open_rf", Some(&f.open_rf)), ("mark", f.mark.as_ref()), ("probe", f.probe.as_ref()),
                         ("push", f.push.as_ref()), ("pop", f.pop.as_ref())];
        for (name, v) in callables {
            if let Some(v) = v {
                let v = v.bind(py);
                if !v.is_callable() {
                    return Err(PyTypeError::new_err(format!(
                        "ProfilerForward: {name}: expected a callable, got {}",
                        v.get_type().name()?
                    )));
                }
            }
        }
        if f.tensor.bind(py).cast::<pyo3::types::PyType>().is_err() {
            return Err(PyTypeError::new_err(format!(
                "ProfilerForward: tensor: expected a type (torch.Tensor), got {}",
                f.tensor.bind(py).get_type().name()?
            )));
        }
        Ok(ProfilerForward { ready: true, f })
    }

    #[pyo3(signature = (*args, **kwargs))]
    fn __call__<'py>(
        &self,
        py: Python<'py>,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let inner = self.f.inner.bind(py);
        let att = self.f.att.bind(py);
        if !att.getattr(intern!(py, "_live"))?.is_truthy()?
            || self.f.kill.bind(py).get_item(0)?.is_truthy()?
        {
            return inner.call(args, kwargs);
        }
        let shapes = self.shapes_of(py, args)?;
        let stack = self.f.stack.bind(py);
        let depth = stack.len();
        let step = att.getattr(intern!(py, "step"))?;
        let scope = if depth == 0 {
            profiler::Scope::Open
        } else {
            profiler::Scope::Inner
        };
        let start = self.take_mark(py, scope)?;
        let none = py.None().into_bound(py);
        let call = PyList::new(
            py,
            [
                self.f.name.bind(py).clone(),
                self.f.kind.bind(py).clone(),
                depth.into_pyobject(py)?.into_any(),
                step,
                start,
                none.clone(),
                shapes,
                self.f.module.bind(py).clone(),
                none,
            ],
        )?;
        self.f.calls.bind(py).append(&call)?;
        if let Some(probe) = &self.f.probe {
            if probe.bind(py).call0()?.is_truthy()? {
                call.set_item(8, self.f.open_rf.bind(py).call1((self.f.name.bind(py),))?)?;
            }
        }
        if let Some(push) = &self.f.push {
            push.bind(py).call1((self.f.name.bind(py),))?;
        }
        stack.append(&call)?;
        let result = inner.call(args, kwargs);
        let closed = self.finish(py, &call);
        match (result, closed) {
            (_, Err(e)) => Err(e),
            (r, Ok(())) => r,
        }
    }

    /// Itself, as for a Python function (copy / deepcopy treat functions as atomic): a model
    /// copied while profiled shares the wrapper, as it would share the Python wrapper.
    fn __copy__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __deepcopy__(slf: Py<Self>, _memo: &Bound<'_, PyAny>) -> Py<Self> {
        slf
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if !self.ready {
            return Ok(());   // not initialized yet (see `ready`): it holds no references
        }
        for o in [
            &self.f.inner,
            &self.f.att,
            &self.f.name,
            &self.f.kind,
            &self.f.module,
            &self.f.close,
            &self.f.raw_stream,
            &self.f.open_rf,
            &self.f.tensor,
        ] {
            visit.call(o)?;
        }
        for o in [&self.f.stack, &self.f.calls, &self.f.kill] {
            visit.call(o)?;
        }
        for o in [&self.f.mark, &self.f.probe, &self.f.push, &self.f.pop]
            .into_iter()
            .flatten()
        {
            visit.call(o)?;
        }
        Ok(())
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(profiler_enable, m)?)?;
    m.add_function(wrap_pyfunction!(profiler_enabled, m)?)?;
    m.add_function(wrap_pyfunction!(profiler_stats, m)?)?;
    m.add_function(wrap_pyfunction!(profiler_drain, m)?)?;
    m.add_function(wrap_pyfunction!(profiler_mark, m)?)?;
    m.add_function(wrap_pyfunction!(profiler_marks_query, m)?)?;
    m.add_function(wrap_pyfunction!(profiler_marks_resolve, m)?)?;
    m.add_function(wrap_pyfunction!(profiler_marks_release, m)?)?;
    m.add_class::<ProfilerForward>()?;
    Ok(())
}
