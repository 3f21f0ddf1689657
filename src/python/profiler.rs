//! profiler_enable / profiler_enabled / profiler_stats / profiler_drain (the launch recorder) and
//! profiler_mark / profiler_marks_query / profiler_marks_resolve / profiler_marks_release (marks)
//! → crate::profiler. Converts records to the dicts of python/ferroattn/_native.pyi.

use super::attention::raw_handle;
use crate::error::Result;
use crate::profiler;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict};

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

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(profiler_enable, m)?)?;
    m.add_function(wrap_pyfunction!(profiler_enabled, m)?)?;
    m.add_function(wrap_pyfunction!(profiler_stats, m)?)?;
    m.add_function(wrap_pyfunction!(profiler_drain, m)?)?;
    m.add_function(wrap_pyfunction!(profiler_mark, m)?)?;
    m.add_function(wrap_pyfunction!(profiler_marks_query, m)?)?;
    m.add_function(wrap_pyfunction!(profiler_marks_resolve, m)?)?;
    m.add_function(wrap_pyfunction!(profiler_marks_release, m)?)?;
    Ok(())
}
