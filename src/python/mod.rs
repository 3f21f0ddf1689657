//! The `ferroattn._native` module (python/ferroattn/_native.pyi is its contract).
//! Thin: convert arguments, call `ops`/`jit`/`device`/`dlpack`, map errors (errors.rs).

mod args;
mod attention;
mod attention_fast;
mod attention_bwd;
mod attention_kvcache;
mod dlpack;
mod eager;
mod env;
pub mod errors;
mod gemm;
mod jit;
mod profiler;
mod scratch;
mod sparse24;
mod variant;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    env::register(m)?;
    jit::register(m)?;
    attention::register(m)?;
    attention_fast::register(m)?;
    attention_bwd::register(m)?;
    attention_kvcache::register(m)?;
    gemm::register(m)?;
    dlpack::register(m)?;
    eager::register(m)?;
    profiler::register(m)?;
    sparse24::register(m)?;
    Ok(())
}
