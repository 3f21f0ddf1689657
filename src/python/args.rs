//! Argument helpers every binding file shares: tensor metadata tuples → `TensorMeta`,
//! raw driver handles, optional DLPack tensors.

use crate::dlpack::{import, import_writable, Imported};
use crate::error::Result;
use crate::tensor::TensorMeta;
use pyo3::conversion::FromPyObjectOwned;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

/// `TensorMeta` as the .pyi defines it.
pub(super) type MetaTuple = (Vec<i64>, Vec<i64>, String, (i32, i32));

/// `TensorMeta` from the tuple; `expected` words the accepted dtypes in a DTypeError.
pub(super) fn meta_of(arg: &str, t: MetaTuple, expected: &str) -> Result<TensorMeta> {
    TensorMeta::from_parts(arg, t.0, t.1, &t.2, t.3, expected)
}

pub(super) fn meta(arg: &str, t: MetaTuple) -> Result<TensorMeta> {
    meta_of(arg, t, "float16 or bfloat16")
}

fn meta_opt(arg: &str, t: Option<MetaTuple>) -> Result<Option<TensorMeta>> {
    t.map(|t| meta_of(arg, t, "int32")).transpose()
}

/// Optional (cu_seqlens_q, cu_seqlens_k) metadata, int32.
pub(super) type CuMetas = (Option<TensorMeta>, Option<TensorMeta>);

pub(super) fn cu_metas(cu_seqlens_q: Option<MetaTuple>, cu_seqlens_k: Option<MetaTuple>) -> Result<CuMetas> {
    Ok((meta_opt("cu_seqlens_q", cu_seqlens_q)?, meta_opt("cu_seqlens_k", cu_seqlens_k)?))
}

/// A raw CUstream handle: a Python int in [0, 2^64) (0 = the legacy default stream). Not an int:
/// TypeError; out of range: ArgumentError; both name `stream`.
pub(super) fn stream_handle(stream: &Bound<'_, PyAny>) -> Result<u64> {
    raw_handle(stream, "stream", "a CUstream handle")
}

/// A raw driver handle (`what`, e.g. "a CUevent handle") passed as a Python int in [0, 2^64).
/// Not an int: TypeError; out of range: ArgumentError; both name `arg`.
pub(super) fn raw_handle(obj: &Bound<'_, PyAny>, arg: &str, what: &str) -> Result<u64> {
    let shown = || obj.repr().map(|r| r.to_string()).unwrap_or_default();
    let Ok(value) = obj.extract::<i128>() else {
        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "{arg}: expected an int ({what}), got {}",
            shown()
        ))
        .into());
    };
    u64::try_from(value)
        .map_err(|_| crate::error::Error::argument(arg, format!("{what}, an int in [0, 2**64)"), shown()))
}

/// An optional tensor argument (`writable`: one the op writes); a Python None counts as absent.
pub(super) fn import_opt(t: Option<&Bound<'_, PyAny>>, arg: &str, writable: bool) -> Result<Option<Imported>> {
    t.filter(|t| !t.is_none())
        .map(|t| if writable { import_writable(t, arg) } else { import(t, arg) })
        .transpose()
}

/// Optional (cu_seqlens_q, cu_seqlens_k) tensors; a Python None counts as absent.
pub(super) fn import_cu(
    cu_seqlens_q: Option<&Bound<'_, PyAny>>,
    cu_seqlens_k: Option<&Bound<'_, PyAny>>,
) -> Result<(Option<Imported>, Option<Imported>)> {
    Ok((import_opt(cu_seqlens_q, "cu_seqlens_q", false)?, import_opt(cu_seqlens_k, "cu_seqlens_k", false)?))
}

/// The positional arguments of a workspace planner, which are its launch's leading ones
/// (`names`): ArgumentError naming `func` for another count.
pub(super) fn planner_args<'py>(func: &str, args: &Bound<'py, PyTuple>, names: &[&str]) -> Result<()> {
    if args.len() != names.len() {
        let expected = format!("its launch's {} arguments before workspace ({})", names.len(), names.join(", "));
        return Err(crate::error::Error::argument(func, expected, format!("{} arguments", args.len())));
    }
    Ok(())
}

/// Item `i` of `args` as `T`; a conversion error keeps its type (TypeError, OverflowError) and
/// names `names[i]`.
pub(super) fn planner_item<'py, T>(args: &Bound<'py, PyTuple>, i: usize, names: &[&str]) -> PyResult<T>
where
    T: FromPyObjectOwned<'py>,
    for<'a> <T as FromPyObject<'a, 'py>>::Error: Into<PyErr>,
{
    let py = args.py();
    args.get_item(i)?.extract::<T>().map_err(|e| {
        let e: PyErr = e.into();
        PyErr::from_type(e.get_type(py), format!("{}: {}", names[i], e.value(py)))
    })
}

/// Item `i` of `args`: None as None.
pub(super) fn planner_opt<'py>(args: &Bound<'py, PyTuple>, i: usize) -> PyResult<Option<Bound<'py, PyAny>>> {
    let x = args.get_item(i)?;
    Ok(if x.is_none() { None } else { Some(x) })
}

/// Run `launch` detached from the interpreter with its `workspace` argument as an
/// [`ops::workspace::Source`](crate::ops::workspace::Source): None or a uint8 tensor (imported
/// writable), or a callable `alloc(nbytes, device) -> tensor` (the op layer's torch allocation)
/// that the launch calls, re-attached, once its plan knows the bytes. The allocated tensor is
/// held until `launch` returns (the kernels are enqueued by then; torch's allocator orders any
/// reuse of the memory after them on the stream).
pub(super) fn launch_with_workspace<R: Send>(
    py: Python<'_>,
    workspace: Option<&Bound<'_, PyAny>>,
    device: i32,
    launch: impl FnOnce(&mut crate::ops::workspace::Source<'_>) -> Result<R> + Send,
) -> Result<R> {
    use crate::ops::workspace::Source;
    let Some(alloc) = workspace.filter(|w| !w.is_none() && w.is_callable()) else {
        let given = import_opt(workspace, "workspace", true)?;
        let mut source = Source::Given(given.as_ref().map(|w| &w.view));
        return py.detach(|| launch(&mut source));
    };
    let alloc = alloc.clone().unbind();
    let mut held: Option<Py<PyAny>> = None;
    let result = {
        let mut allocate = |bytes: u64| -> Result<crate::tensor::TensorView> {
            Python::attach(|py| {
                let t = alloc.bind(py).call1((bytes, device))?;
                let view = import_writable(&t, "workspace")?.view.clone();
                held = Some(t.unbind());
                Ok(view)
            })
        };
        let mut source = Source::Alloc(&mut allocate);
        py.detach(|| launch(&mut source))
    };
    drop(held);
    result
}
