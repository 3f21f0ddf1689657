//! DLPack exchange (api-contracts §5) through the `dlpark` crate.
//!
//! Import: any DLPack producer or capsule (versioned or legacy) becomes an [`Imported`]
//! holding a [`TensorView`] (strides in elements, NULL strides → C-contiguous, pointer =
//! data + byte_offset). A producer with DLPack 1.3's C exchange API and its borrowed view
//! (`dltensor_from_py_object_no_sync`; torch 2.10 on) is read through that view: no managed
//! tensor is made, and the [`Imported`] holds a reference to the producer object, which keeps
//! the memory alive (a launch is ordered on the producer's stream, like every import here). Every other producer
//! or capsule is imported as a managed tensor that the [`Imported`] owns (its deleter runs
//! exactly once when it is dropped; a capsule is renamed `used_*`).
//!
//! Export: [`Buffer`] is Rust-allocated memory (host, or device via cuMemAlloc) shared by
//! every capsule exported from it; it is freed when the Buffer and every consumer are gone.

use crate::device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{fmt_shape, Device, TensorMeta, TensorView, DL_CPU, DL_CUDA};
use dlpark::ffi::{DLDevice, DLDeviceType, DLManagedTensor, DLManagedTensorVersioned};
use dlpark::metadata::Dynamic;
use dlpark::python::consumer::exchange::ExchangeApi;
use dlpark::python::{from_dlpack, DlpackExporter, ExportRequest, ImportedDlpack};
use dlpark::tensor::TensorRef;
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use pyo3::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// An imported tensor: keeps the producer's memory alive until dropped (a borrowed view:
/// the caller's Python object does).
pub struct Imported {
    _owner: Option<ImportedDlpack>,
    /// A borrowed view's producer object: a reference held as long as the import, so the memory
    /// outlives it even when the caller dropped its own (a property returning a fresh tensor).
    _producer: Option<Py<PyAny>>,
    pub view: TensorView,
    /// Base data pointer as exported (before byte_offset).
    pub data: u64,
    pub byte_offset: u64,
    /// True for a `dltensor_versioned` capsule.
    pub versioned: bool,
    /// The producer flagged the memory READ_ONLY (versioned capsules only).
    pub read_only: bool,
}

/// Import `obj` zero-copy (`arg` names it in errors). No stream is negotiated: torch's
/// producer default (stream=-1) does not synchronise; the caller orders work by launching
/// on the stream the data was produced on.
pub fn import(obj: &Bound<'_, PyAny>, arg: &str) -> Result<Imported> {
    reject_lazy_negation(obj, arg)?;
    if let Some(t) = import_view(obj, arg) {
        return t;
    }
    // Producer errors keep their Python type (TypeError, BufferError, ...) and gain the argument name.
    let owner = managed_import(obj).map_err(|e| {
        PyErr::from_type(
            e.get_type(obj.py()),
            format!("{arg}: {}", e.value(obj.py())),
        )
    })?;
    let versioned = matches!(owner, ImportedDlpack::Versioned(_));
    let read_only = owner.flags().contains(dlpark::DlpackFlags::READ_ONLY);
    let t = owner
        .validate()
        .map_err(|e| Error::argument(arg, "a valid DLPack tensor", e))?;
    let (view, data, byte_offset) = describe(&t, arg)?;
    Ok(Imported {
        _owner: Some(owner),
        _producer: None,
        view,
        data,
        byte_offset,
        versioned,
        read_only,
    })
}

/// torch exports a tensor with its lazy negation bit (`torch._neg_view`, `x.conj().imag`) as
/// the un-negated memory, flag-free, through both DLPack paths: such a tensor is an error
/// naming `arg` (it must be resolved first), never read as its negation.
fn reject_lazy_negation(obj: &Bound<'_, PyAny>, arg: &str) -> Result<()> {
    let py = obj.py();
    let Ok(is_neg) = obj.getattr(pyo3::intern!(py, "is_neg")) else {
        return Ok(());
    };
    if is_neg.call0().and_then(|b| b.is_truthy()).unwrap_or(false) {
        return Err(Error::argument(arg, "a tensor without torch's lazy negation bit (call .resolve_neg() first)",
                                   "one with is_neg() True"));
    }
    Ok(())
}

/// dlpark's import of a producer or capsule, with the Array API standard's fallback: a producer
/// whose `__dlpack__` raises TypeError for the `max_version` keyword (one older than DLPack 1.0)
/// is asked again with no arguments, and its legacy capsule imported. The first error is the
/// one reported when the retry fails too.
fn managed_import(obj: &Bound<'_, PyAny>) -> PyResult<ImportedDlpack> {
    let py = obj.py();
    match from_dlpack(obj.as_borrowed(), None, None) {
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyTypeError>(py)
            && obj.hasattr(pyo3::intern!(py, "__dlpack_device__")).unwrap_or(false) =>
        {
            match obj.call_method0(pyo3::intern!(py, "__dlpack__")) {
                Ok(capsule) => from_dlpack(capsule.as_borrowed(), None, None).map_err(|_| e),
                Err(_) => Err(e),
            }
        }
        other => other,
    }
}

/// The import through the producer's borrowed view (module docs), or None when the producer
/// offers none or the view fails (then the managed import runs and reports the producer's
/// error with its own type). The view carries no flags: READ_ONLY cannot be set on it.
fn import_view(obj: &Bound<'_, PyAny>, arg: &str) -> Option<Result<Imported>> {
    let api = ExchangeApi::from_object(obj.as_borrowed()).ok()??;
    let described = api
        .with_tensor_view_no_sync(obj.as_borrowed(), |raw, _stream| {
            // SAFETY: the producer filled `raw` for the duration of this callback; it is read
            // (and its shape / strides copied) only here.
            let t = unsafe { TensorRef::from_raw(raw) }
                .map_err(|e| Error::argument(arg, "a valid DLPack tensor", e))?;
            describe(&t, arg)
        })
        .ok()?;
    Some(described.map(|(view, data, byte_offset)| Imported {
        _owner: None,
        _producer: Some(obj.clone().unbind()),
        view,
        data,
        byte_offset,
        versioned: true,
        read_only: false,
    }))
}

/// The TensorView of a validated DLPack tensor, its base data pointer and byte offset.
fn describe(t: &TensorRef<'_>, arg: &str) -> Result<(TensorView, u64, u64)> {
    let triple = (t.dtype().code.0, t.dtype().bits, t.dtype().lanes);
    let dtype = DType::from_dl_triple(triple).ok_or_else(|| {
        Error::dtype(
            arg,
            DType::one_of(),
            format!("DLPack (code, bits, lanes) = {triple:?}"),
        )
    })?;
    let shape = t.shape().to_vec();
    let strides = t
        .strides_or_compact()
        .map_err(|e| Error::argument(arg, "valid strides", e))?
        .into_owned();
    let dev = t.device();
    let data = t.data_ptr() as u64;
    let byte_offset = t.byte_offset();
    let view = TensorView {
        meta: TensorMeta {
            shape,
            strides,
            dtype,
            device: Device {
                kind: dev.device_type.0 as i32,
                id: dev.device_id,
            },
        },
        ptr: data.wrapping_add(byte_offset),
    };
    Ok((view, data, byte_offset))
}

/// [`import`] for a tensor that will be written: a producer's READ_ONLY flag (DLPack 1.0) is an
/// error naming `arg`.
pub fn import_writable(obj: &Bound<'_, PyAny>, arg: &str) -> Result<Imported> {
    let t = import(obj, arg)?;
    if t.read_only {
        return Err(Error::argument(arg, "a writable tensor", "a DLPack tensor flagged READ_ONLY"));
    }
    Ok(t)
}

static LIVE: AtomicUsize = AtomicUsize::new(0);

/// Rust-allocated buffers not yet freed (for leak tests).
pub fn live_buffers() -> usize {
    LIVE.load(Ordering::SeqCst)
}

const HOST_ALIGN: usize = 256;

/// The memory behind a Buffer; freed on drop (from any thread: DLPack deleters may run anywhere).
struct Allocation {
    ptr: u64,
    bytes: usize,
    device: Device,
}

impl Allocation {
    fn new(bytes: usize, device: Device) -> Result<Allocation> {
        let ptr = match device.kind {
            DL_CPU => {
                let layout = std::alloc::Layout::from_size_align(bytes.max(1), HOST_ALIGN)
                    .map_err(|e| Error::argument("shape", "a size that fits in memory", e))?;
                // SAFETY: non-zero size layout.
                let p = unsafe { std::alloc::alloc_zeroed(layout) };
                if p.is_null() {
                    return Err(Error::argument(
                        "shape",
                        "an allocatable size",
                        format!("{bytes} bytes"),
                    ));
                }
                p as u64
            }
            DL_CUDA => device::alloc(device.id, bytes)?,
            _ => unreachable!("Buffer devices are cpu or cuda"),
        };
        LIVE.fetch_add(1, Ordering::SeqCst);
        Ok(Allocation { ptr, bytes, device })
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        match self.device.kind {
            DL_CPU => {
                let layout =
                    std::alloc::Layout::from_size_align(self.bytes.max(1), HOST_ALIGN).unwrap();
                // SAFETY: allocated in `new` with this layout.
                unsafe { std::alloc::dealloc(self.ptr as *mut u8, layout) };
            }
            _ => {
                // A failing free (context torn down at exit) cannot be reported from a deleter.
                let _ = device::free(self.device.id, self.ptr);
            }
        }
        LIVE.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A C-contiguous Rust-allocated tensor exported zero-copy through DLPack.
#[derive(Clone)]
pub struct Buffer {
    alloc: Arc<Allocation>,
    pub shape: Vec<i64>,
    pub dtype: DType,
}

/// Parse "cpu", "cuda", "cuda:N".
pub fn parse_device(s: &str) -> Result<Device> {
    match s {
        "cpu" => Ok(Device::CPU),
        "cuda" => Ok(Device::cuda(0)),
        _ => s
            .strip_prefix("cuda:")
            .and_then(|n| n.parse::<i32>().ok())
            .filter(|n| *n >= 0)
            .map(Device::cuda)
            .ok_or_else(|| {
                Error::argument(
                    "device",
                    "\"cpu\", \"cuda\" or \"cuda:N\"",
                    format!("{s:?}"),
                )
            }),
    }
}

impl Buffer {
    /// Uninitialised (host memory: zeroed) C-contiguous buffer.
    pub fn empty(shape: &[i64], dtype: &str, device: &str) -> Result<Buffer> {
        let dt = DType::parse("dtype", dtype)?;
        if let Some(bad) = shape.iter().find(|&&s| s < 0) {
            return Err(Error::argument(
                "shape",
                "non-negative sizes",
                format!("{} (size {bad})", fmt_shape(shape)),
            ));
        }
        let bytes = shape
            .iter()
            .try_fold(dt.size_bytes(), |acc, &s| acc.checked_mul(s as usize))
            .ok_or_else(|| {
                Error::argument("shape", "a size that fits in memory", fmt_shape(shape))
            })?;
        let device = parse_device(device)?;
        Ok(Buffer {
            alloc: Arc::new(Allocation::new(bytes, device)?),
            shape: shape.to_vec(),
            dtype: dt,
        })
    }

    pub fn data_ptr(&self) -> u64 {
        self.alloc.ptr
    }

    pub fn device(&self) -> Device {
        self.alloc.device
    }

    fn managed<M: ManagedTensorBase>(&self) -> PyResult<Managed<M>> {
        let mut init = Dynamic::compact(self.shape.clone())
            .initialize_as::<M>(Arc::clone(&self.alloc))
            .map_err(|e| pyo3::exceptions::PyBufferError::new_err(e.to_string()))?;
        init.set_data(self.alloc.ptr as *mut std::ffi::c_void)
            .set_device(self.dl_device())
            .set_dtype(self.dtype.to_dl());
        // SAFETY: data stays valid while the Arc<Allocation> context lives; strides explicit.
        Ok(unsafe { init.finish() })
    }

    fn dl_device(&self) -> DLDevice {
        DLDevice {
            device_type: DLDeviceType(self.alloc.device.kind as u32),
            device_id: self.alloc.device.id,
        }
    }
}

impl DlpackExporter for Buffer {
    fn device(&self) -> DLDevice {
        self.dl_device()
    }

    fn flags(&self) -> DlpackFlags {
        DlpackFlags::empty()
    }

    /// §5.3 stream rules. A Buffer has no pending device work (cuMemAlloc is synchronous
    /// and nothing else writes it), so no stream needs to wait; only the value is checked.
    fn prepare_export(&self, _py: Python<'_>, request: &ExportRequest<'_>) -> PyResult<()> {
        match self.alloc.device.kind {
            DL_CUDA => request.cuda_stream().map(|_| ()),
            _ => match request.stream() {
                None => Ok(()),
                Some(s) if s.is_none() || s.extract::<i64>().ok() == Some(-1) => Ok(()),
                Some(s) => Err(pyo3::exceptions::PyBufferError::new_err(format!(
                    "stream must be None for a CPU buffer, got {s}"
                ))),
            },
        }
    }

    fn export_legacy(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensor>> {
        self.managed()
    }

    fn export_versioned(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        self.managed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffer_lifetime_follows_last_owner() {
        let before = live_buffers();
        let b = Buffer::empty(&[2, 3], "float16", "cpu").unwrap();
        assert_eq!(live_buffers(), before + 1);
        assert_eq!(b.data_ptr() % HOST_ALIGN as u64, 0);
        let m: Managed<DLManagedTensorVersioned> = b.managed().unwrap();
        drop(b);
        assert_eq!(
            live_buffers(),
            before + 1,
            "an exported tensor keeps the memory alive"
        );
        {
            let t = m.validate().unwrap();
            assert_eq!(t.shape(), &[2, 3]);
            assert_eq!(t.strides().unwrap(), &[3, 1]);
            assert_eq!(DType::from_dl(t.dtype()), Some(DType::F16));
        }
        drop(m);
        assert_eq!(live_buffers(), before);
    }

    #[test]
    fn export_then_import_round_trip_with_byte_offset() {
        use dlpark::python::export_dlpack;
        Python::initialize();
        Python::attach(|py| {
            let b = Buffer::empty(&[4, 6], "int32", "cpu").unwrap();
            for (max_version, versioned) in [(None, false), (Some((1, 3)), true)] {
                let request = ExportRequest::parse(None, max_version, None, None).unwrap();
                let capsule = export_dlpack(&b, py, request).unwrap();
                let t = import(capsule.bind(py), "x").unwrap();
                assert_eq!(t.versioned, versioned);
                assert_eq!(t.view.ptr, b.data_ptr());
                assert_eq!(t.view.meta.shape, vec![4, 6]);
                assert_eq!(t.view.meta.strides, vec![6, 1]);
                assert_eq!(t.view.meta.dtype, DType::I32);
                assert_eq!(t.view.meta.device, Device::CPU);
                // consumed: a second import fails, naming the argument
                let e = import(capsule.bind(py), "k").err().unwrap().to_string();
                assert!(e.contains("k: ") && e.contains("consumed"), "{e}");
            }
            // a producer that locates the data through byte_offset and omits strides (legacy)
            let mut init = Dynamic::compact(vec![3i64])
                .initialize_as::<DLManagedTensor>(Arc::clone(&b.alloc))
                .unwrap();
            init.set_data(b.data_ptr() as *mut std::ffi::c_void)
                .set_byte_offset(8)
                .set_device(b.dl_device())
                .set_dtype(DType::I32.to_dl());
            let managed = unsafe { init.finish() };
            let capsule = pyo3::IntoPyObject::into_pyobject(managed, py).unwrap();
            // dlpark only exports explicit strides; clear them in the capsule as old producers do
            unsafe {
                let raw = pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), c"dltensor".as_ptr())
                    as *mut DLManagedTensor;
                (*raw).dl_tensor.strides = std::ptr::null_mut();
            }
            let t = import(&capsule, "x").unwrap();
            assert_eq!(t.byte_offset, 8);
            assert_eq!(t.view.ptr, b.data_ptr() + 8);
            assert_eq!(
                t.view.meta.strides,
                vec![1],
                "NULL strides mean C-contiguous"
            );
            // not a DLPack object: the producer's TypeError, with the argument name
            let e = import(&pyo3::types::PyDict::new(py).into_any(), "v")
                .err()
                .unwrap();
            let Error::Python(e) = e else { panic!() };
            assert!(e.is_instance_of::<pyo3::exceptions::PyTypeError>(py));
            assert!(e.to_string().contains("v: "), "{e}");
        });
    }

    #[test]
    fn buffer_argument_errors() {
        assert!(matches!(
            Buffer::empty(&[2], "float8", "cpu"),
            Err(Error::DType { .. })
        ));
        assert!(matches!(
            Buffer::empty(&[-1], "int32", "cpu"),
            Err(Error::Argument { .. })
        ));
        assert!(matches!(
            Buffer::empty(&[1], "int32", "tpu"),
            Err(Error::Argument { .. })
        ));
        assert_eq!(parse_device("cuda:3").unwrap(), Device::cuda(3));
    }
}
