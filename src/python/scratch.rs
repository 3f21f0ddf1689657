//! Scratch: fp32 device memory a launch writes and nobody reads back (the softmax_lse a caller
//! does not return, the split partials of the decode kernel), taken from torch's caching
//! allocator in one block (`torch._C._cuda_cudaCachingAllocator_raw_alloc`, the call behind the
//! public `torch.cuda.caching_allocator_alloc`) and handed back when the Scratch drops, right
//! after the launch is enqueued. The block belongs to the launch's stream, so torch reuses it
//! only for work ordered after that launch (as it does a temporary tensor's), and under CUDA
//! graph capture it comes from the graph's private pool. One allocator call replaces one
//! `torch.empty` and one DLPack import per buffer.

use super::eager::torch;
use crate::dtype::DType;
use crate::tensor::{Device, TensorMeta, TensorView};
use pyo3::prelude::*;

/// Regions start on this many bytes (the vector loads of the partials need 16).
const ALIGN: i64 = 256;

/// One block of fp32 regions on `device`, ordered on `stream`.
pub(super) struct Scratch<'py> {
    py: Python<'py>,
    ptr: u64,
    views: Vec<TensorView>,
}

impl<'py> Scratch<'py> {
    /// Contiguous fp32 regions of `shapes`, in order, on the current device (`device`: its id,
    /// which the caller has checked is current) for `stream`. AttributeError when torch has no
    /// CUDA caching allocator (the callers check for CUDA first); torch's OutOfMemoryError as is.
    pub fn new(py: Python<'py>, device: i32, stream: u64, shapes: &[&[i64]]) -> PyResult<Self> {
        let mut offsets = Vec::with_capacity(shapes.len());
        let mut bytes = 0i64;
        for shape in shapes {
            offsets.push(bytes);
            bytes += (shape.iter().product::<i64>() * 4 + ALIGN - 1) / ALIGN * ALIGN;
        }
        let ptr = match &torch(py)?.raw_alloc {
            Some(alloc) if bytes > 0 => alloc.bind(py).call1((bytes, stream))?.extract::<u64>()?,
            Some(_) => 0,
            None => return Err(pyo3::exceptions::PyAttributeError::new_err("torch has no CUDA caching allocator")),
        };
        let views = shapes
            .iter()
            .zip(offsets)
            .map(|(shape, off)| TensorView {
                meta: TensorMeta {
                    shape: shape.to_vec(),
                    strides: TensorMeta::contiguous_strides(shape),
                    dtype: DType::F32,
                    device: Device::cuda(device),
                },
                ptr: ptr + off as u64,
            })
            .collect();
        Ok(Scratch { py, ptr, views })
    }

    /// The regions, one per shape, in order.
    pub fn views(&self) -> &[TensorView] {
        &self.views
    }
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        if let Ok(Some(free)) = torch(self.py).map(|t| t.raw_delete.as_ref()) {
            // a failed free leaks the block to torch's pool accounting; nothing to report it to here
            let _ = free.bind(self.py).call1((self.ptr,));
        }
    }
}
