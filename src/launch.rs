//! The one place that launches kernels: cuLaunchKernel on the caller's raw CUstream
//! (0 = legacy default stream) with one by-value parameter struct. Checks the launch
//! error; never synchronises. While the launch recorder is on (src/profiler.rs), the launch
//! is bracketed by timing events and described by a record; off, it costs one relaxed load.

use crate::error::{CudaResultExt, Error, Result};
use crate::jit::Kernel;
use cudarc::driver::{result as cu, sys};

/// Grid, block and dynamic shared memory of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchShape {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub dynamic_smem_bytes: u32,
}

impl LaunchShape {
    /// Driver limits on grid dims (x < 2^31, y and z <= 65535).
    pub fn check(&self) -> Result<()> {
        let (x, y, z) = self.grid;
        if x == 0 || y == 0 || z == 0 || x > i32::MAX as u32 || y > 65535 || z > 65535 {
            return Err(Error::argument(
                "launch grid",
                "x in 1..2^31, y and z in 1..=65535",
                format!("{:?}", self.grid),
            ));
        }
        Ok(())
    }
}

/// The work one launch does, as the op computes it (src/ops/work.rs): what the launch
/// recorder reports. Plain numbers, computed whether or not recording is on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Work {
    /// Floating-point operations of the tensor-core products (2·m·n·k each).
    pub flops: f64,
    /// Compulsory global-memory traffic in bytes: every tensor read or written, once.
    pub bytes: f64,
    /// False when the counts rest on an assumption (varlen: lengths live on the device).
    pub exact: bool,
}

/// What the launch recorder needs from the op besides the kernel and the launch shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LaunchInfo {
    /// The custom op that launches it, e.g. "ferroattn::attn_fwd".
    pub op: &'static str,
    pub work: Work,
}

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
