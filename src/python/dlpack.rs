//! dlpack_info, Buffer, live_buffers.

use crate::dlpack;
use crate::error::Result;
use dlpark::python::{export_dlpack, ExportRequest};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

/// Import x zero-copy and describe it: {data_ptr, shape, strides, dtype, device, byte_offset, versioned}.
#[pyfunction]
fn dlpack_info(py: Python<'_>, x: &Bound<'_, PyAny>) -> Result<Py<PyDict>> {
    let t = dlpack::import(x, "x")?;
    let m = &t.view.meta;
    let d = PyDict::new(py);
    d.set_item("data_ptr", t.view.ptr)?;
    d.set_item("shape", PyTuple::new(py, &m.shape)?)?;
    d.set_item("strides", PyTuple::new(py, &m.strides)?)?;
    d.set_item("dtype", m.dtype.name())?;
    d.set_item("device", (m.device.kind, m.device.id))?;
    d.set_item("byte_offset", t.byte_offset)?;
    d.set_item("versioned", t.versioned)?;
    Ok(d.unbind())
}

/// A Rust-allocated buffer exported zero-copy through DLPack.
#[pyclass(name = "Buffer", module = "ferroattn._native", frozen)]
struct PyBuffer(dlpack::Buffer);

#[pymethods]
impl PyBuffer {
    #[staticmethod]
    #[pyo3(signature = (shape, dtype, device = "cpu"))]
    fn empty(shape: Vec<i64>, dtype: &str, device: &str) -> Result<Self> {
        Ok(PyBuffer(dlpack::Buffer::empty(&shape, dtype, device)?))
    }

    #[getter]
    fn data_ptr(&self) -> u64 {
        self.0.data_ptr()
    }

    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.0.shape)
    }

    #[getter]
    fn dtype(&self) -> &'static str {
        self.0.dtype.name()
    }

    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let request = ExportRequest::parse(stream.as_ref(), max_version, dl_device, copy)?;
        export_dlpack(&self.0, py, request)
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        let d = self.0.device();
        (d.kind, d.id)
    }

    fn __repr__(&self) -> String {
        format!(
            "Buffer(shape={}, dtype={}, device={})",
            crate::tensor::fmt_shape(&self.0.shape),
            self.0.dtype,
            self.0.device()
        )
    }
}

/// Number of Rust-allocated buffers not yet freed (for leak tests).
#[pyfunction]
fn live_buffers() -> usize {
    dlpack::live_buffers()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(dlpack_info, m)?)?;
    m.add_class::<PyBuffer>()?;
    m.add_function(wrap_pyfunction!(live_buffers, m)?)?;
    Ok(())
}
