//! The only tensor description inside the crate: shape, strides (in elements), dtype and
//! device ([`TensorMeta`]), plus the data pointer for a real tensor ([`TensorView`]).
//! Neither owns memory; the caller keeps the data alive (DLPack import, Python object).

use crate::dtype::DType;

/// DLPack device type codes we name (api-contracts §5.1).
pub const DL_CPU: i32 = 1;
pub const DL_CUDA: i32 = 2;

/// A DLPack device: (device type, ordinal).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Device {
    pub kind: i32,
    pub id: i32,
}

impl Device {
    pub const CPU: Device = Device {
        kind: DL_CPU,
        id: 0,
    };

    pub fn cuda(id: i32) -> Device {
        Device { kind: DL_CUDA, id }
    }

    pub fn is_cuda(&self) -> bool {
        self.kind == DL_CUDA
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kind {
            DL_CPU => write!(f, "cpu"),
            DL_CUDA => write!(f, "cuda:{}", self.id),
            3 => write!(f, "cuda_host:{}", self.id),
            13 => write!(f, "cuda_managed:{}", self.id),
            k => write!(f, "dlpack_device({k}):{}", self.id),
        }
    }
}

/// Tensor metadata without data (also what `attn_fwd_check` receives for fake tensors).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorMeta {
    pub shape: Vec<i64>,
    /// In elements, one per dim (never absent: importers fill C-contiguous strides).
    pub strides: Vec<i64>,
    pub dtype: DType,
    pub device: Device,
}

impl TensorMeta {
    /// From the parts Python passes as `TensorMeta`: (shape, strides, dtype name, (dl type, id)).
    /// `expected` describes the dtypes the caller accepts; it is the error message's "expected"
    /// when `dtype` is not a dtype ferroattn knows at all (e.g. float8, complex).
    pub fn from_parts(
        arg: &str,
        shape: Vec<i64>,
        strides: Vec<i64>,
        dtype: &str,
        device: (i32, i32),
        expected: &str,
    ) -> crate::Result<Self> {
        let dtype = DType::from_name(dtype)
            .ok_or_else(|| crate::Error::dtype(arg, expected, format!("{dtype:?}")))?;
        Ok(TensorMeta {
            shape,
            strides,
            dtype,
            device: Device {
                kind: device.0,
                id: device.1,
            },
        })
    }

    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    pub fn numel(&self) -> i64 {
        self.shape.iter().product()
    }

    /// Row-major strides for `shape`.
    pub fn contiguous_strides(shape: &[i64]) -> Vec<i64> {
        let mut strides = vec![0; shape.len()];
        let mut acc = 1i64;
        for i in (0..shape.len()).rev() {
            strides[i] = acc;
            acc = acc.saturating_mul(shape[i].max(1));
        }
        strides
    }
}

/// A tensor the kernels may read or write: metadata plus the address of element 0
/// (DLPack `data + byte_offset`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorView {
    pub meta: TensorMeta,
    pub ptr: u64,
}

/// Render a shape like Python does: `(2, 3)`, `(5,)`.
pub fn fmt_shape(shape: &[i64]) -> String {
    match shape {
        [one] => format!("({one},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_strides_are_row_major() {
        assert_eq!(TensorMeta::contiguous_strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(TensorMeta::contiguous_strides(&[]), Vec::<i64>::new());
        assert_eq!(TensorMeta::contiguous_strides(&[0, 3]), vec![3, 1]);
    }

    #[test]
    fn formatting() {
        assert_eq!(fmt_shape(&[5]), "(5,)");
        assert_eq!(fmt_shape(&[2, 3]), "(2, 3)");
        assert_eq!(Device::cuda(1).to_string(), "cuda:1");
        assert_eq!(Device::CPU.to_string(), "cpu");
    }
}
