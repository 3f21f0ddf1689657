//! profiler_enable / profiler_enabled / profiler_stats / profiler_drain → crate::profiler
//! (the launch recorder). Converts records to the dicts of python/ferroattn/_native.pyi.

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

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(profiler_enable, m)?)?;
    m.add_function(wrap_pyfunction!(profiler_enabled, m)?)?;
    m.add_function(wrap_pyfunction!(profiler_stats, m)?)?;
    m.add_function(wrap_pyfunction!(profiler_drain, m)?)?;
    Ok(())
}
