//! The one error type of the crate. Every variant maps to one class of
//! `ferroattn.errors` (src/python/errors.rs); messages name the argument, the expected
//! and the actual value.

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Bad shape, stride, length or value (Python: `ArgumentError`, a `ValueError`).
    #[error("{arg}: expected {expected}, got {actual}")]
    Argument {
        arg: String,
        expected: String,
        actual: String,
    },

    /// Unsupported or mixed dtype (Python: `DTypeError`, a `TypeError`).
    #[error("{arg}: expected dtype {expected}, got {actual}")]
    DType {
        arg: String,
        expected: String,
        actual: String,
    },

    /// Tensor on the wrong device (Python: `DeviceError`).
    #[error("{arg}: expected {expected}, got {actual}")]
    Device {
        arg: String,
        expected: String,
        actual: String,
    },

    /// A CUDA driver call failed (Python: `CudaError`).
    #[error("{call} failed: {name}: {message}")]
    Cuda {
        call: &'static str,
        name: String,
        message: String,
    },

    /// No driver library, cuInit failed, or no such GPU (Python: `NoDeviceError`).
    #[error("no CUDA device: {0}")]
    NoDevice(String),

    /// The GPU is older than sm_80 (Python: `UnsupportedGpuError`).
    #[error("GPU compute capability {major}.{minor} is not supported: ferroattn needs sm_80 (Ampere) or newer")]
    UnsupportedGpu { major: i32, minor: i32 },

    /// libnvrtc could not be loaded (Python: `NvrtcNotFoundError`).
    #[error("NVRTC library (libnvrtc.so.13) not found; searched the loader path and {searched}; pip install nvidia-cuda-nvrtc==13.0.88")]
    NvrtcNotFound { searched: String },

    /// No directory holding cuda_fp16.h (Python: `HeadersNotFoundError`).
    #[error("CUDA headers (cuda_fp16.h) not found; searched: {searched}; pip install nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88 or set CUDA_HOME")]
    HeadersNotFound { searched: String },

    /// NVRTC failed (Python: `CompileError`); `log` is the whole compiler log.
    #[error("NVRTC failed to compile {name} for {arch}: {reason}\n{log}")]
    Compile {
        name: String,
        arch: String,
        reason: String,
        log: String,
    },

    /// A DLPack export request that cannot be honoured (Python: `BufferError`).
    #[error("{0}")]
    Buffer(String),

    /// An error raised by Python code we called (DLPack producers); re-raised unchanged.
    #[error(transparent)]
    Python(#[from] pyo3::PyErr),
}

impl Error {
    pub fn argument(
        arg: impl Into<String>,
        expected: impl Into<String>,
        actual: impl ToString,
    ) -> Self {
        Error::Argument {
            arg: arg.into(),
            expected: expected.into(),
            actual: actual.to_string(),
        }
    }
    pub fn dtype(
        arg: impl Into<String>,
        expected: impl Into<String>,
        actual: impl ToString,
    ) -> Self {
        Error::DType {
            arg: arg.into(),
            expected: expected.into(),
            actual: actual.to_string(),
        }
    }
    pub fn device(
        arg: impl Into<String>,
        expected: impl Into<String>,
        actual: impl ToString,
    ) -> Self {
        Error::Device {
            arg: arg.into(),
            expected: expected.into(),
            actual: actual.to_string(),
        }
    }
}

/// Attach the driver call's name to a cudarc `DriverError`.
pub trait CudaResultExt<T> {
    fn call(self, call: &'static str) -> Result<T>;
}

impl<T> CudaResultExt<T> for std::result::Result<T, cudarc::driver::DriverError> {
    fn call(self, call: &'static str) -> Result<T> {
        self.map_err(|e| {
            let name = e
                .error_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|_| format!("{:?}", e.0));
            let message = e
                .error_string()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            Error::Cuda {
                call,
                name,
                message,
            }
        })
    }
}
