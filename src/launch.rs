//! The one place that launches kernels: cuLaunchKernel (cuLaunchKernelEx for a programmatic
//! dependent launch) on the caller's raw CUstream (0 = legacy default stream) with one
//! by-value parameter struct. Checks the launch
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
    // SAFETY: forwarded to the caller.
    unsafe { launch_with(kernel, device, shape, stream, params, info, Dependency::Stream) }
}

/// How a launch waits for the work before it on its stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dependency {
    /// Stream order: the kernel starts once everything before it has completed.
    Stream,
    /// Programmatic dependent launch (sm_90 and newer; CUDA programming guide, "Programmatic
    /// Dependent Launch and Synchronization"): the kernel may start while the kernel before it
    /// still runs, once that one's blocks have all executed `griddepcontrol.launch_dependents`
    /// (or exited), and must execute `griddepcontrol.wait` before it reads anything the kernel
    /// before it writes; the wait returns when that kernel has completed and its writes are
    /// visible. Kernels after this one wait for it in stream order as usual.
    Programmatic,
}

/// [`launch`] with the dependency on the previous kernel of `stream` given by `dep`.
///
/// # Safety
/// As for [`launch`]; with [`Dependency::Programmatic`] the kernel must also execute
/// `griddepcontrol.wait` before touching memory the previous kernel on `stream` writes.
pub unsafe fn launch_with<P>(
    kernel: &Kernel,
    device: i32,
    shape: &LaunchShape,
    stream: u64,
    params: &mut P,
    info: &LaunchInfo,
    dep: Dependency,
) -> Result<()> {
    shape.check()?;
    crate::device::bind(device)?;
    let mut args = [params as *mut P as *mut std::ffi::c_void];
    let mut go = || match dep {
        // SAFETY: forwarded to the caller; cuLaunchKernel copies the argument bytes at launch.
        Dependency::Stream => unsafe {
            cu::launch_kernel(
                kernel.function(),
                shape.grid,
                shape.block,
                shape.dynamic_smem_bytes,
                stream as sys::CUstream,
                &mut args,
            )
        }
        .call("cuLaunchKernel"),
        Dependency::Programmatic => {
            // SAFETY: a zeroed attribute value is a valid union (all-integer members).
            let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
            value.programmaticStreamSerializationAllowed = 1;
            let mut attr = sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: [0; 4],
                value,
            };
            let config = sys::CUlaunchConfig {
                gridDimX: shape.grid.0,
                gridDimY: shape.grid.1,
                gridDimZ: shape.grid.2,
                blockDimX: shape.block.0,
                blockDimY: shape.block.1,
                blockDimZ: shape.block.2,
                sharedMemBytes: shape.dynamic_smem_bytes,
                hStream: stream as sys::CUstream,
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: forwarded to the caller; `config` and `attr` outlive the call, which
            // copies the argument bytes at launch.
            unsafe {
                sys::cuLaunchKernelEx(&config, kernel.function(), args.as_mut_ptr(), std::ptr::null_mut()).result()
            }
            .call("cuLaunchKernelEx")
        }
    };
    if crate::profiler::enabled() {
        crate::profiler::recorded_launch(kernel, device, shape, stream, info, go)
    } else {
        go()
    }
}
