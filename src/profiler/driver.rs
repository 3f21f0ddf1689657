//! The driver pieces the recorder and the marks share: the pooled timing event,
//! binding a device's primary context (cached per thread), and the lock that ignores poisoning.

use crate::error::{CudaResultExt, Result};
use cudarc::driver::{result as cu, sys};
use std::sync::{Mutex, MutexGuard};

/// A CUevent of the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Event(pub(super) sys::CUevent);
// SAFETY: a CUevent is a process-wide driver handle usable from any thread.
unsafe impl Send for Event {}

pub(super) fn create_event() -> Result<Event> {
    cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
        .call("cuEventCreate")
        .map(Event)
}

/// Lock, ignoring poisoning (the state stays consistent: every update is a single push/pop).
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

thread_local! {
    /// (device, context) of the last [`bind_cached`] on this thread.
    static BOUND: std::cell::Cell<(i32, usize)> = const { std::cell::Cell::new((-1, 0)) };
}

/// `device::bind(device)`, skipped when this thread's current context is already the context a
/// previous call bound for `device` (primary contexts are retained for the process lifetime by
/// `device::bind`, so a remembered handle stays valid): one cuCtxGetCurrent when nothing
/// changed, instead of a lock, a map lookup and cuCtxGetCurrent.
pub(super) fn bind_cached(device: i32) -> Result<()> {
    let (d, c) = BOUND.with(|b| b.get());
    if d == device && c != 0 {
        // A bind succeeded on this thread before, so the driver is loaded (cudarc panics on a
        // driver call without one: the first call of a thread always goes through device::bind,
        // which reports a missing driver as NoDevice).
        let mut current: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one pointer.
        unsafe { sys::cuCtxGetCurrent(&mut current) }
            .result()
            .call("cuCtxGetCurrent")?;
        if c == current as usize {
            return Ok(());
        }
    }
    crate::device::bind(device)?;
    let mut bound: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: as above.
    unsafe { sys::cuCtxGetCurrent(&mut bound) }
        .result()
        .call("cuCtxGetCurrent")?;
    BOUND.with(|b| b.set((device, bound as usize)));
    Ok(())
}

/// Make some context current on this thread when none is (cuEvent* calls need one; an event
/// carries its own context, so any will do): the primary context of `device`.
pub(super) fn ensure_context(device: i32) -> Result<()> {
    let mut current: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one pointer.
    unsafe { sys::cuCtxGetCurrent(&mut current) }
        .result()
        .call("cuCtxGetCurrent")?;
    if current.is_null() {
        crate::device::bind(device)?;
    }
    Ok(())
}
