//! The one place that launches kernels: cuLaunchKernel on the caller's raw CUstream
//! (0 = legacy default stream) with one by-value parameter struct. Checks the launch
//! error; never synchronises. While the launch recorder is on (src/profiler/), the launch
//! is bracketed by timing events and described by a record; off, it costs one relaxed load.
//! What describes a launch (shape, work, op) lives in src/launch_record.rs, which the
//! recorder reads too.

use crate::error::{CudaResultExt, Result};
use crate::jit::Kernel;
use crate::launch_record::{LaunchInfo, LaunchShape};
use cudarc::driver::{result as cu, sys};

/// Launch `kernel` with `params` (its only, by-value, kernel parameter) on `stream` in
/// `device`'s primary context. `info` describes the launch to the recorder (used only
/// while it is on).
///
/// # Safety
/// `params` must be the exact `#[repr(C)]` mirror of the kernel's parameter type, and
/// every pointer in it must stay valid until the kernel has run (stream order).
pub unsafe fn launch<P>(
    kernel: &Kernel,
    device: i32,
    shape: &LaunchShape,
    stream: u64,
    params: &mut P,
    info: &LaunchInfo,
) -> Result<()> {
    shape.check()?;
    crate::device::bind(device)?;
    let mut args = [params as *mut P as *mut std::ffi::c_void];
    let mut go = || {
        // SAFETY: forwarded to the caller; cuLaunchKernel copies the argument bytes at launch.
        unsafe {
            cu::launch_kernel(
                kernel.function(),
                shape.grid,
                shape.block,
                shape.dynamic_smem_bytes,
                stream as sys::CUstream,
                &mut args,
            )
        }
        .call("cuLaunchKernel")
    };
    if crate::profiler::enabled() {
        crate::profiler::recorded_launch(kernel, device, shape, stream, info, go)
    } else {
        go()
    }
}
