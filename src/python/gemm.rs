//! gemm_check (metadata), gemm_workspace and gemm (DLPack tensors) and gemm_backends → ops::gemm.

use super::args::{import_opt, launch_with_workspace, meta_of, planner_args, planner_item, planner_opt, stream_handle,
                  MetaTuple};
use crate::dlpack::{import, import_writable, Imported};
use crate::error::Result;
use crate::ops::gemm as op;
use crate::tensor::{TensorMeta, TensorView};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

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

/// The imported tensors of a `gemm` call (a, b, out, c, bias, aux); `out` and `aux` writable
/// when the call launches.
struct Operands {
    a: Imported,
    b: Imported,
    out: Imported,
    c: Option<Imported>,
    bias: Option<Imported>,
    aux: Option<Imported>,
}

type AnyRef<'a, 'py> = &'a Bound<'py, PyAny>;
type OperandArgs<'a, 'py> =
    (AnyRef<'a, 'py>, AnyRef<'a, 'py>, AnyRef<'a, 'py>, Option<AnyRef<'a, 'py>>, Option<AnyRef<'a, 'py>>, Option<AnyRef<'a, 'py>>);

impl Operands {
    fn import((a, b, out, c, bias, aux): OperandArgs<'_, '_>, launch: bool) -> Result<Self> {
        let (a, b) = (import(a, "a")?, import(b, "b")?);
        let out = if launch { import_writable(out, "out")? } else { import(out, "out")? };
        let (c, bias) = (import_opt(c, "c", false)?, import_opt(bias, "bias", false)?);
        Ok(Operands { a, b, out, c, bias, aux: import_opt(aux, "aux", launch)? })
    }
    fn opt(t: &Option<Imported>) -> Option<&TensorView> {
        t.as_ref().map(|t| &t.view)
    }
}

/// Bytes of the split-k / stream-K workspace a `gemm` call needs (0: none): `args` are gemm's
/// arguments before `workspace` (a, b, out, c, bias, aux, alpha, beta, activation, backend),
/// positional; the same validation and plan as the launch (ops::gemm::workspace_bytes).
#[pyfunction]
#[pyo3(signature = (*args))]
fn gemm_workspace(py: Python<'_>, args: &Bound<'_, PyTuple>) -> PyResult<u64> {
    const NAMES: [&str; 10] = ["a", "b", "out", "c", "bias", "aux", "alpha", "beta", "activation", "backend"];
    planner_args("gemm_workspace", args, &NAMES)?;
    let (a, b, out) = (args.get_item(0)?, args.get_item(1)?, args.get_item(2)?);
    let (c, bias, aux) = (planner_opt(args, 3)?, planner_opt(args, 4)?, planner_opt(args, 5)?);
    let (alpha, beta): (f64, f64) = (planner_item(args, 6, &NAMES)?, planner_item(args, 7, &NAMES)?);
    let (activation, backend): (String, String) = (planner_item(args, 8, &NAMES)?, planner_item(args, 9, &NAMES)?);
    let t = Operands::import((&a, &b, &out, c.as_ref(), bias.as_ref(), aux.as_ref()), false)?;
    let (cv, biasv, auxv) = (Operands::opt(&t.c), Operands::opt(&t.bias), Operands::opt(&t.aux));
    Ok(py.detach(|| {
        op::workspace_bytes(&t.a.view, &t.b.view, &t.out.view, cv, biasv, auxv, alpha as f32, beta as f32, &activation,
                            &backend)
    })?)
}

/// Launch the GEMM on `stream` (raw CUstream) in a's device's primary context; returns the
/// backend that ran. `workspace`: None, the uint8 tensor of `gemm_workspace` bytes, or an
/// allocator `alloc(nbytes, device)` called for exactly those bytes (args.rs
/// `launch_with_workspace`). Validates everything (`workspace` included) before launching; never
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
    let t = Operands::import((a, b, out, c, bias, aux), true)?;
    let (cv, biasv, auxv) = (Operands::opt(&t.c), Operands::opt(&t.bias), Operands::opt(&t.aux));
    // Detached: the first call of a configuration compiles or loads a module.
    launch_with_workspace(py, workspace, t.a.view.meta.device.id, |ws| {
        op::gemm(&t.a.view, &t.b.view, &t.out.view, cv, biasv, auxv, alpha as f32, beta as f32, activation, backend, ws,
                 stream)
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
