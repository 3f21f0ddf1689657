//! CUDA driver access: presence probe, cuInit, device attributes, and the device's
//! primary context (the one the CUDA runtime, hence torch, uses), retained once per
//! device and made current before module loads, allocations and launches.
//!
//! Every entry point first checks `is_culib_present()` so cudarc never panics on a
//! machine without libcuda; the first initialisation also runs under `catch_unwind`.

use crate::error::{CudaResultExt, Error, Result};
use crate::arch::Arch;
use cudarc::driver::{result as cu, sys};
use std::collections::HashMap;
use std::sync::{OnceLock, RwLock};

/// Load libcuda and run cuInit, once per process. Err is a NoDevice message.
fn init() -> Result<()> {
    static INIT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    INIT.get_or_init(|| {
        std::panic::catch_unwind(|| {
            // SAFETY: a pure probe; it dlopens and closes candidate library names.
            if !unsafe { sys::is_culib_present() } {
                return Err("CUDA driver library (libcuda.so.1) not found".to_string());
            }
            cu::init().call("cuInit").map_err(|e| e.to_string())
        })
        .unwrap_or_else(|_| Err("loading the CUDA driver library panicked".to_string()))
    })
    .clone()
    .map_err(Error::NoDevice)
}

pub fn device_count() -> Result<i32> {
    init()?;
    cu::device::get_count().call("cuDeviceGetCount")
}

/// True when libcuda loads, cuInit succeeds and at least one GPU exists. Never fails.
pub fn cuda_available() -> bool {
    matches!(device_count(), Ok(n) if n > 0)
}

fn device_handle(ordinal: i32) -> Result<sys::CUdevice> {
    let count = device_count()?;
    if ordinal < 0 || ordinal >= count {
        return Err(Error::NoDevice(format!(
            "device ordinal {ordinal} out of range: {count} CUDA device(s)"
        )));
    }
    cu::device::get(ordinal).call("cuDeviceGet")
}

fn attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
    // SAFETY: `dev` came from cuDeviceGet.
    unsafe { cu::device::get_attribute(dev, attr) }.call("cuDeviceGetAttribute")
}

/// Compute capability (major, minor) of a device, cached.
pub fn compute_capability(ordinal: i32) -> Result<(i32, i32)> {
    static CACHE: OnceLock<RwLock<HashMap<i32, (i32, i32)>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(cc) = cache.read().unwrap().get(&ordinal) {
        return Ok(*cc);
    }
    let dev = device_handle(ordinal)?;
    use sys::CUdevice_attribute::*;
    let cc = (
        attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    );
    cache.write().unwrap().insert(ordinal, cc);
    Ok(cc)
}

/// Most resident threads per multiprocessor (CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR,
/// e.g. 2048 on sm_80/sm_90), cached.
pub fn max_threads_per_multiprocessor(ordinal: i32) -> Result<i32> {
    static CACHE: OnceLock<RwLock<HashMap<i32, i32>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(n) = cache.read().unwrap().get(&ordinal) {
        return Ok(*n);
    }
    let dev = device_handle(ordinal)?;
    let n = attribute(
        dev,
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR,
    )?;
    cache.write().unwrap().insert(ordinal, n);
    Ok(n)
}

/// Multiprocessors of a device (at least 1), cached: the grid-size input of the GEMM and 2:4
/// tile heuristics and of the persistent sm90 GEMM grid.
pub fn sm_count(ordinal: i32) -> Result<u32> {
    static CACHE: OnceLock<RwLock<HashMap<i32, u32>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(n) = cache.read().unwrap().get(&ordinal) {
        return Ok(*n);
    }
    let n = info(ordinal)?.sm_count.max(1) as u32;
    cache.write().unwrap().insert(ordinal, n);
    Ok(n)
}

/// The arch kernels are compiled for on this device (UnsupportedGpu below sm_80).
pub fn arch(ordinal: i32) -> Result<Arch> {
    let (major, minor) = compute_capability(ordinal)?;
    Arch::from_sm(major, minor)
}

/// What `device_info()` reports.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub name: String,
    pub sm: (i32, i32),
    /// None when the GPU is older than sm_80.
    pub arch: Option<Arch>,
    pub sm_count: i32,
    pub total_memory_bytes: usize,
    pub max_smem_per_block_optin: i32,
    /// As cuDriverGetVersion reports it, e.g. 13000.
    pub driver_version: i32,
}

pub fn info(ordinal: i32) -> Result<DeviceInfo> {
    let dev = device_handle(ordinal)?;
    use sys::CUdevice_attribute::*;
    let sm = compute_capability(ordinal)?;
    let mut driver_version = 0;
    // SAFETY: writes one int.
    unsafe { sys::cuDriverGetVersion(&mut driver_version) }
        .result()
        .call("cuDriverGetVersion")?;
    Ok(DeviceInfo {
        name: cu::device::get_name(dev).call("cuDeviceGetName")?,
        sm,
        arch: Arch::from_sm(sm.0, sm.1).ok(),
        sm_count: attribute(dev, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        // SAFETY: `dev` came from cuDeviceGet.
        total_memory_bytes: unsafe { cu::device::total_mem(dev) }.call("cuDeviceTotalMem")?,
        max_smem_per_block_optin: attribute(
            dev,
            CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )?,
        driver_version,
    })
}

/// A retained primary context. Contexts are process-wide and thread-safe driver objects.
#[derive(Clone, Copy)]
struct Ctx(sys::CUcontext);
// SAFETY: a CUcontext handle may be used from any thread (cuCtxSetCurrent per thread).
unsafe impl Send for Ctx {}
unsafe impl Sync for Ctx {}

/// Make the primary context of `ordinal` current on this thread, retaining it the first
/// time (it is never released: it lives as long as the process, like torch's).
pub fn bind(ordinal: i32) -> Result<()> {
    static CTXS: OnceLock<RwLock<HashMap<i32, Ctx>>> = OnceLock::new();
    let ctxs = CTXS.get_or_init(Default::default);
    let cached = ctxs.read().unwrap().get(&ordinal).copied();
    let ctx = match cached {
        Some(ctx) => ctx,
        None => {
            let dev = device_handle(ordinal)?;
            let mut map = ctxs.write().unwrap();
            match map.get(&ordinal) {
                Some(ctx) => *ctx,
                None => {
                    // SAFETY: `dev` came from cuDeviceGet.
                    let ctx =
                        Ctx(unsafe { cu::primary_ctx::retain(dev) }
                            .call("cuDevicePrimaryCtxRetain")?);
                    map.insert(ordinal, ctx);
                    ctx
                }
            }
        }
    };
    let mut current: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one pointer.
    unsafe { sys::cuCtxGetCurrent(&mut current) }
        .result()
        .call("cuCtxGetCurrent")?;
    if current != ctx.0 {
        // SAFETY: `ctx` is a retained primary context.
        unsafe { cu::ctx::set_current(ctx.0) }.call("cuCtxSetCurrent")?;
    }
    Ok(())
}

/// cuMemAlloc in the primary context of `ordinal` (only `Buffer` uses it; never on a hot path).
pub fn alloc(ordinal: i32, bytes: usize) -> Result<u64> {
    bind(ordinal)?;
    // SAFETY: plain allocation; freed by `free`.
    unsafe { cu::malloc_sync(bytes.max(1)) }.call("cuMemAlloc")
}

/// cuMemFree of a pointer from `alloc` (any thread).
pub fn free(ordinal: i32, ptr: u64) -> Result<()> {
    bind(ordinal)?;
    // SAFETY: `ptr` came from `alloc` and is freed once.
    unsafe { cu::free_sync(ptr) }.call("cuMemFree")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        // On the CPU-only CI box there is no libcuda: every entry point returns NoDevice.
        if unsafe { sys::is_culib_present() } {
            return; // a machine with a driver: nothing to check here
        }
        assert!(!cuda_available());
        assert!(matches!(device_count(), Err(Error::NoDevice(_))));
        assert!(matches!(info(0), Err(Error::NoDevice(_))));
        assert!(matches!(bind(0), Err(Error::NoDevice(_))));
        assert!(matches!(arch(0), Err(Error::NoDevice(_))));
    }
}
