//! Map `crate::Error` to the classes of python/ferroattn/errors.py, by name.

use crate::error::Error;
use pyo3::exceptions::{PyBufferError, PyRuntimeError};
use pyo3::prelude::*;

fn class_name(e: &Error) -> &'static str {
    match e {
        Error::Argument { .. } => "ArgumentError",
        Error::DType { .. } => "DTypeError",
        Error::Device { .. } => "DeviceError",
        Error::Cuda { .. } => "CudaError",
        Error::NoDevice(_) => "NoDeviceError",
        Error::UnsupportedGpu { .. } => "UnsupportedGpuError",
        Error::NvrtcNotFound { .. } => "NvrtcNotFoundError",
        Error::HeadersNotFound { .. } => "HeadersNotFoundError",
        Error::Compile { .. } => "CompileError",
        Error::Buffer(_) | Error::Python(_) => unreachable!("mapped directly"),
    }
}

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        match e {
            Error::Python(err) => err,
            Error::Buffer(msg) => PyBufferError::new_err(msg),
            e => Python::attach(|py| {
                let msg = e.to_string();
                match py
                    .import("ferroattn.errors")
                    .and_then(|m| m.getattr(class_name(&e)))
                {
                    Ok(cls) => match cls.call1((msg.clone(),)) {
                        Ok(obj) => PyErr::from_value(obj),
                        Err(err) => err,
                    },
                    // ferroattn.errors not importable (should not happen in the package)
                    Err(_) => PyRuntimeError::new_err(format!("{}: {msg}", class_name(&e))),
                }
            }),
        }
    }
}
