//! JIT entry points: precompile, jit_stats, clear_memory_cache.

use crate::error::Result;
use crate::jit::cache::STATS;
use crate::{jit, ops};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::atomic::Ordering::Relaxed;

/// Compile every production configuration for each arch (no GPU needed); one dict per kernel.
/// Raises CompileError on a compile failure, or (check_spills=True) on register spills.
#[pyfunction]
#[pyo3(signature = (archs, check_spills = false))]
fn precompile(py: Python<'_>, archs: Vec<String>, check_spills: bool) -> Result<Vec<Py<PyDict>>> {
    let reports = py.detach(|| ops::precompile(&archs, check_spills))?;
    reports
        .into_iter()
        .map(|r| {
            let d = PyDict::new(py);
            d.set_item("kernel", r.kernel)?;
            d.set_item("config", r.config)?;
            d.set_item("arch", r.arch)?;
            d.set_item("registers", r.resources.registers)?;
            d.set_item("spill_stores", r.resources.spill_stores)?;
            d.set_item("spill_loads", r.resources.spill_loads)?;
            d.set_item("stack_bytes", r.resources.stack_bytes)?;
            d.set_item("static_smem_bytes", r.resources.static_smem_bytes)?;
            d.set_item("dynamic_smem_bytes", r.dynamic_smem_bytes)?;
            d.set_item("cubin_bytes", r.cubin_bytes)?;
            d.set_item("compile_seconds", r.compile_seconds)?;
            d.set_item("from_cache", r.from_cache)?;
            Ok(d.unbind())
        })
        .collect()
}

/// The arch names `precompile` takes ("sm_90" is accepted too, as sm_90a).
#[pyfunction]
fn precompile_archs() -> Vec<&'static str> {
    crate::arch::Arch::ALL.map(|a| a.name()).to_vec()
}

/// JIT counters of this process (compiles, disk/memory hits, seconds spent).
#[pyfunction]
fn jit_stats(py: Python<'_>) -> PyResult<Py<PyDict>> {
    let secs = |n: &std::sync::atomic::AtomicU64| n.load(Relaxed) as f64 * 1e-9;
    let d = PyDict::new(py);
    d.set_item("compiles", STATS.compiles.load(Relaxed))?;
    d.set_item("compile_seconds", secs(&STATS.compile_nanos))?;
    d.set_item("disk_hits", STATS.disk_hits.load(Relaxed))?;
    d.set_item("disk_load_seconds", secs(&STATS.disk_load_nanos))?;
    d.set_item("module_loads", STATS.module_loads.load(Relaxed))?;
    d.set_item("module_load_seconds", secs(&STATS.module_load_nanos))?;
    d.set_item("memory_hits", STATS.memory_hits.load(Relaxed))?;
    d.set_item("corrupt_rebuilt", STATS.corrupt_rebuilt.load(Relaxed))?;
    Ok(d.unbind())
}

/// Forget in-process compiled kernels (the disk cache stays).
#[pyfunction]
fn clear_memory_cache() {
    jit::clear_memory_cache();
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(precompile, m)?)?;
    m.add_function(wrap_pyfunction!(precompile_archs, m)?)?;
    m.add_function(wrap_pyfunction!(jit_stats, m)?)?;
    m.add_function(wrap_pyfunction!(clear_memory_cache, m)?)?;
    Ok(())
}
