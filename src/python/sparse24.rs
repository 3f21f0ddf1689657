//! sparse24_* (python/ferroattn/_native.pyi, "2:4 structured sparsity") → ops::sparse24.

use super::args::{
    import_opt, launch_with_workspace, meta_of, planner_args, planner_item, planner_opt, stream_handle, MetaTuple,
};
use crate::dlpack::{import, import_writable, Imported};
use crate::error::Result;
use crate::ops::sparse24 as op;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

/// {m_pad, k_pad, values_shape, meta_shape, tile_m, tile_k} of a (m, k) matrix.
#[pyfunction]
fn sparse24_layout(py: Python<'_>, m: i64, k: i64) -> Result<Py<PyDict>> {
    let l = op::layout(m, k)?;
    let d = PyDict::new(py);
    d.set_item("m_pad", l.m_pad)?;
    d.set_item("k_pad", l.k_pad)?;
    d.set_item("values_shape", (l.values_shape()[0], l.values_shape()[1]))?;
    d.set_item("meta_shape", (l.meta_shape()[0], l.meta_shape()[1]))?;
    d.set_item("tile_m", op::host::TILE_M)?;
    d.set_item("tile_k", op::host::TILE_K)?;
    Ok(d.unbind())
}

/// GPU compress of w into values / meta; bad_groups set to the count of non-2:4 groups.
#[pyfunction]
fn sparse24_compress(
    py: Python<'_>,
    w: &Bound<'_, PyAny>,
    values: &Bound<'_, PyAny>,
    meta: &Bound<'_, PyAny>,
    bad_groups: &Bound<'_, PyAny>,
    prune: bool,
    stream: &Bound<'_, PyAny>,
) -> Result<()> {
    let stream = stream_handle(stream)?;
    let w = import(w, "w")?;
    let (v, m) = (
        import_writable(values, "values")?,
        import_writable(meta, "meta")?,
    );
    let b = import_writable(bad_groups, "bad_groups")?;
    let (wv, vv, mv, bv) = (&w.view, &v.view, &m.view, &b.view);
    py.detach(|| op::compress(wv, vv, mv, bv, prune, stream))
}

/// GPU decompress of values / meta into out.
#[pyfunction]
fn sparse24_decompress(
    py: Python<'_>,
    values: &Bound<'_, PyAny>,
    meta: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    stream: &Bound<'_, PyAny>,
) -> Result<()> {
    let stream = stream_handle(stream)?;
    let (v, m) = (import(values, "values")?, import(meta, "meta")?);
    let o = import_writable(out, "out")?;
    let (vv, mv, ov) = (&v.view, &m.view, &o.view);
    py.detach(|| op::decompress(vv, mv, ov, stream))
}

/// The Rust CPU reference of sparse24_compress; returns bad_groups.
#[pyfunction]
fn sparse24_compress_host(
    w: &Bound<'_, PyAny>,
    values: &Bound<'_, PyAny>,
    meta: &Bound<'_, PyAny>,
    prune: bool,
) -> Result<usize> {
    let w = import(w, "w")?;
    let (v, m) = (
        import_writable(values, "values")?,
        import_writable(meta, "meta")?,
    );
    op::compress_host(&w.view, &v.view, &m.view, prune)
}

/// The Rust CPU reference of sparse24_decompress.
#[pyfunction]
fn sparse24_decompress_host(
    values: &Bound<'_, PyAny>,
    meta: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
) -> Result<()> {
    let (v, m) = (import(values, "values")?, import(meta, "meta")?);
    let o = import_writable(out, "out")?;
    op::decompress_host(&v.view, &m.view, &o.view)
}

/// Validate sparse24_matmul arguments from metadata alone.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn sparse24_matmul_check(
    x: MetaTuple,
    values: MetaTuple,
    meta: MetaTuple,
    out: MetaTuple,
    bias: Option<MetaTuple>,
    n: i64,
    k: i64,
    activation: &str,
) -> Result<()> {
    let half = "float16 or bfloat16";
    let x = meta_of("x", x, half)?;
    let values = meta_of("values", values, half)?;
    let meta = meta_of("meta", meta, "int16")?;
    let out = meta_of("out", out, half)?;
    let bias = bias
        .map(|b| meta_of("bias", b, "float16, bfloat16 or float32"))
        .transpose()?;
    op::validate_matmul(
        &x,
        &values,
        &meta,
        Some(&out),
        bias.as_ref(),
        n,
        k,
        activation,
    )?;
    Ok(())
}

/// The imported tensors of a `sparse24_matmul` call (x, values, meta, out, bias); `out`
/// writable when the call launches.
struct MatmulOperands {
    x: Imported,
    values: Imported,
    meta: Imported,
    out: Imported,
    bias: Option<Imported>,
}

type MatmulOperandArgs<'a, 'py> =
    (&'a Bound<'py, PyAny>, &'a Bound<'py, PyAny>, &'a Bound<'py, PyAny>, &'a Bound<'py, PyAny>, Option<&'a Bound<'py, PyAny>>);

impl MatmulOperands {
    fn import((x, values, meta, out, bias): MatmulOperandArgs<'_, '_>, launch: bool) -> Result<Self> {
        let (x, values, meta) = (import(x, "x")?, import(values, "values")?, import(meta, "meta")?);
        let out = if launch { import_writable(out, "out")? } else { import(out, "out")? };
        Ok(MatmulOperands { x, values, meta, out, bias: import_opt(bias, "bias", false)? })
    }
}

/// Bytes of the split-k / stream-K workspace a `sparse24_matmul` call needs (0: none): `args` are
/// sparse24_matmul's arguments before `workspace` (x, values, meta, out, bias, n, k, activation,
/// backend), positional; the same checks and plan as the launch (ops::sparse24::matmul_workspace).
#[pyfunction]
#[pyo3(signature = (*args))]
fn sparse24_matmul_workspace(py: Python<'_>, args: &Bound<'_, PyTuple>) -> PyResult<u64> {
    const NAMES: [&str; 9] = ["x", "values", "meta", "out", "bias", "n", "k", "activation", "backend"];
    planner_args("sparse24_matmul_workspace", args, &NAMES)?;
    let (x, values, meta, out) = (args.get_item(0)?, args.get_item(1)?, args.get_item(2)?, args.get_item(3)?);
    let bias = planner_opt(args, 4)?;
    let (n, k): (i64, i64) = (planner_item(args, 5, &NAMES)?, planner_item(args, 6, &NAMES)?);
    let (activation, backend): (String, String) = (planner_item(args, 7, &NAMES)?, planner_item(args, 8, &NAMES)?);
    let t = MatmulOperands::import((&x, &values, &meta, &out, bias.as_ref()), false)?;
    let bv = t.bias.as_ref().map(|b| &b.view);
    let (xv, vv, mv, ov) = (&t.x.view, &t.values.view, &t.meta.view, &t.out.view);
    Ok(py.detach(|| op::matmul_workspace(xv, vv, mv, ov, bv, n, k, &activation, &backend))?)
}

/// out = act(x @ w.T + bias) with w 2:4-compressed; returns the backend that ran. `workspace`:
/// None, the uint8 buffer of `sparse24_matmul_workspace` bytes, or an allocator
/// `alloc(nbytes, device)` called for exactly those bytes (args.rs `launch_with_workspace`).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn sparse24_matmul(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    values: &Bound<'_, PyAny>,
    meta: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    bias: Option<&Bound<'_, PyAny>>,
    n: i64,
    k: i64,
    activation: &str,
    backend: &str,
    workspace: Option<&Bound<'_, PyAny>>,
    stream: &Bound<'_, PyAny>,
) -> Result<&'static str> {
    let stream = stream_handle(stream)?;
    let t = MatmulOperands::import((x, values, meta, out, bias), true)?;
    let bv = t.bias.as_ref().map(|b| &b.view);
    let (xv, vv, mv, ov) = (&t.x.view, &t.values.view, &t.meta.view, &t.out.view);
    launch_with_workspace(py, workspace, xv.meta.device.id, |ws| {
        op::matmul(xv, vv, mv, ov, bv, n, k, activation, backend, ws, stream)
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(sparse24_layout, m)?)?;
    m.add_function(wrap_pyfunction!(sparse24_compress, m)?)?;
    m.add_function(wrap_pyfunction!(sparse24_decompress, m)?)?;
    m.add_function(wrap_pyfunction!(sparse24_compress_host, m)?)?;
    m.add_function(wrap_pyfunction!(sparse24_decompress_host, m)?)?;
    m.add_function(wrap_pyfunction!(sparse24_matmul_check, m)?)?;
    m.add_function(wrap_pyfunction!(sparse24_matmul_workspace, m)?)?;
    m.add_function(wrap_pyfunction!(sparse24_matmul, m)?)?;
    Ok(())
}
