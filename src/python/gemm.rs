//! gemm_check (metadata), gemm_workspace and gemm (DLPack tensors) and gemm_backends → ops::gemm.

use super::args::{import_opt, meta_of, stream_handle, MetaTuple};
use crate::dlpack::{import, import_writable};
use crate::error::Result;
use crate::ops::gemm as op;
use crate::tensor::TensorMeta;
use pyo3::prelude::*;

fn meta_opt(arg: &str, t: Option<MetaTuple>, expected: &str) -> Result<Option<TensorMeta>> {
    t.map(|t| meta_of(arg, t, expected)).transpose()
}

const INPUT: &str = "float16 or bfloat16";
const OUTPUT: &str = "float16, bfloat16 or float32";

/// Validate GEMM arguments from metadata alone (same checks and errors as gemm).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn gemm_check(
    a: MetaTuple,
    b: MetaTuple,
    out: MetaTuple,
    c: Option<MetaTuple>,
    bias: Option<MetaTuple>,
    aux: Option<MetaTuple>,
    beta: f64,
    activation: &str,
) -> Result<()> {
    let (a, b, out) = (meta_of("a", a, INPUT)?, meta_of("b", b, INPUT)?, meta_of("out", out, OUTPUT)?);
    let c = meta_opt("c", c, OUTPUT)?;
    let bias = meta_opt("bias", bias, "float16, bfloat16 or float32")?;
    let aux = meta_opt("aux", aux, OUTPUT)?;
    op::validate(&a, &b, &out, c.as_ref(), bias.as_ref(), aux.as_ref(), beta as f32, activation)?;
    Ok(())
}

/// Bytes of the split-k / stream-K workspace a `gemm` call with these arguments needs (0: none);
/// the same validation and plan as the launch (ops::gemm::workspace_bytes).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn gemm_workspace(
    py: Python<'_>,
    a: &Bound<'_, PyAny>,
    b: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    c: Option<&Bound<'_, PyAny>>,
    bias: Option<&Bound<'_, PyAny>>,
    aux: Option<&Bound<'_, PyAny>>,
    alpha: f64,
    beta: f64,
    activation: &str,
    backend: &str,
) -> Result<u64> {
    let (a, b, o) = (import(a, "a")?, import(b, "b")?, import(out, "out")?);
    let c = import_opt(c, "c", false)?;
    let bias = import_opt(bias, "bias", false)?;
    let aux = import_opt(aux, "aux", false)?;
    let (cv, biasv, auxv) = (c.as_ref().map(|t| &t.view), bias.as_ref().map(|t| &t.view), aux.as_ref().map(|t| &t.view));
    py.detach(|| {
        op::workspace_bytes(&a.view, &b.view, &o.view, cv, biasv, auxv, alpha as f32, beta as f32, activation, backend)
    })
}

/// Launch the GEMM on `stream` (raw CUstream) in a's device's primary context; returns the
/// backend that ran. Validates everything (`workspace` included) before launching; never
/// synchronises.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn gemm(
    py: Python<'_>,
    a: &Bound<'_, PyAny>,
    b: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    c: Option<&Bound<'_, PyAny>>,
    bias: Option<&Bound<'_, PyAny>>,
    aux: Option<&Bound<'_, PyAny>>,
    alpha: f64,
    beta: f64,
    activation: &str,
    backend: &str,
    workspace: Option<&Bound<'_, PyAny>>,
    stream: &Bound<'_, PyAny>,
) -> Result<&'static str> {
    let stream = stream_handle(stream)?;
    let (a, b, o) = (import(a, "a")?, import(b, "b")?, import_writable(out, "out")?);
    let c = import_opt(c, "c", false)?;
    let bias = import_opt(bias, "bias", false)?;
    let aux = import_opt(aux, "aux", true)?;
    let ws = import_opt(workspace, "workspace", true)?;
    let (cv, biasv, auxv) = (c.as_ref().map(|t| &t.view), bias.as_ref().map(|t| &t.view), aux.as_ref().map(|t| &t.view));
    let wsv = ws.as_ref().map(|t| &t.view);
    // Detached: the first call of a configuration compiles or loads a module.
    py.detach(|| {
        op::gemm(
            &a.view,
            &b.view,
            &o.view,
            cv,
            biasv,
            auxv,
            alpha as f32,
            beta as f32,
            activation,
            backend,
            wsv,
            stream,
        )
    })
}

/// The backends this device supports, fastest first; NoDeviceError without a GPU.
#[pyfunction]
#[pyo3(signature = (device = 0))]
fn gemm_backends(device: i32) -> Result<Vec<&'static str>> {
    Ok(op::backends_for(crate::device::arch(device)?))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(gemm_check, m)?)?;
    m.add_function(wrap_pyfunction!(gemm_workspace, m)?)?;
    m.add_function(wrap_pyfunction!(gemm, m)?)?;
    m.add_function(wrap_pyfunction!(gemm_backends, m)?)?;
    Ok(())
}
