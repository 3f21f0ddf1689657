//! Environment: include dirs, NVRTC version, cache dir, driver/GPU presence and info.

use crate::error::Result;
use crate::{device, jit};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::PathBuf;

/// Extra CUDA include directories, searched after $CUDA_HOME/include and /usr/local/cuda/include.
#[pyfunction]
fn _configure(include_dirs: Vec<PathBuf>) {
    jit::headers::configure(include_dirs);
}

/// (major, minor) of the NVRTC library found, or None when it cannot be loaded.
#[pyfunction]
fn nvrtc_version() -> Option<(i32, i32)> {
    jit::nvrtc::version().ok()
}

/// The CUDA include directory NVRTC is given (holds cuda_fp16.h), or None.
#[pyfunction]
fn header_dir() -> Option<PathBuf> {
    jit::headers::header_dir().ok()
}

/// The on-disk kernel cache directory ($FERROATTN_CACHE_DIR or ~/.cache/ferroattn).
#[pyfunction]
fn cache_dir() -> PathBuf {
    jit::cache::cache_dir()
}

/// True when libcuda loads, cuInit succeeds and at least one GPU exists. Never raises.
#[pyfunction]
fn cuda_available() -> bool {
    device::cuda_available()
}

/// {name, sm, arch, sm_count, total_memory_bytes, max_smem_per_block_optin, driver_version};
/// raises NoDeviceError without a driver/GPU.
#[pyfunction]
#[pyo3(signature = (ordinal = 0))]
fn device_info(py: Python<'_>, ordinal: i32) -> Result<Py<PyDict>> {
    let i = device::info(ordinal)?;
    let d = PyDict::new(py);
    d.set_item("name", i.name)?;
    d.set_item("sm", i.sm)?;
    d.set_item("arch", i.arch.map(|a| a.name()))?;
    d.set_item("sm_count", i.sm_count)?;
    d.set_item("total_memory_bytes", i.total_memory_bytes)?;
    d.set_item("max_smem_per_block_optin", i.max_smem_per_block_optin)?;
    d.set_item("driver_version", i.driver_version)?;
    Ok(d.unbind())
}

/// Change one tuning knob (src/tuning/knobs.rs) for the rest of the process: `value` in its
/// environment variable's text form ("" for the default). ArgumentError naming `name` for an
/// unknown knob or a malformed value, naming the argument that is not a str, naming the variable
/// when the environment's is malformed.
#[pyfunction]
fn set_tuning_knob(name: &Bound<'_, PyAny>, value: &Bound<'_, PyAny>) -> Result<()> {
    let text = |arg: &str, v: &Bound<'_, PyAny>| -> Result<String> {
        v.extract::<String>().map_err(|_| {
            let ty = v.get_type().name().map_or_else(|_| "?".to_string(), |n| n.to_string());
            crate::error::Error::argument(arg, "a str", ty)
        })
    };
    crate::tuning::knobs::set(&text("name", name)?, &text("value", value)?)
}

/// {knob name: canonical text of its value} of every tuning knob (the environment's until
/// set_tuning_knob changes one). ArgumentError naming a malformed environment variable.
#[pyfunction]
fn tuning_knobs(py: Python<'_>) -> Result<Py<PyDict>> {
    let d = PyDict::new(py);
    for (name, value) in crate::tuning::knobs::get()?.items() {
        d.set_item(name, value)?;
    }
    Ok(d.unbind())
}

/// The on / off environment switch `var` (src/env_switch.rs, the knobs' rule too: `1`/`on`,
/// `0`/`off`, empty or unset: `default`). ArgumentError naming `var` for any other value.
#[pyfunction]
fn env_switch(var: &str, default: bool) -> Result<bool> {
    crate::env_switch::env_switch(var, default)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(env_switch, m)?)?;
    m.add_function(wrap_pyfunction!(set_tuning_knob, m)?)?;
    m.add_function(wrap_pyfunction!(tuning_knobs, m)?)?;
    m.add_function(wrap_pyfunction!(_configure, m)?)?;
    m.add_function(wrap_pyfunction!(nvrtc_version, m)?)?;
    m.add_function(wrap_pyfunction!(header_dir, m)?)?;
    m.add_function(wrap_pyfunction!(cache_dir, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(device_info, m)?)?;
    Ok(())
}
