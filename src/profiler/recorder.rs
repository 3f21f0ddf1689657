//! The launch recorder: the on/off switch, the recorded launch (two timing events around
//! cuLaunchKernel and a [`Description`]), and [`drain`], which turns the records into GPU times.

use super::book::{Book, Pending, Stats, MAX_MARKS, MAX_RECORDS};
use super::capture::{capturing, legacy_clear};
use super::driver::{create_event, ensure_context, lock, Event};
use super::record::{theoretical_occupancy, Description, KernelAttrs, Resolved};
use crate::error::{CudaResultExt, Result};
use crate::jit::Kernel;
use crate::launch_record::{LaunchInfo, LaunchShape};
use cudarc::driver::{result as cu, sys};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Whether launches are recorded (one relaxed load: the whole cost of the recorder when off).
#[inline]
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Turn recording on or off for every thread. Off keeps the undrained records.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

pub(super) static BOOK: Mutex<Book<Event>> = Mutex::new(Book::new(MAX_RECORDS, MAX_MARKS));

/// The recorder's counters. Needs no driver.
pub fn stats() -> Stats {
    lock(&BOOK).stats(enabled())
}

/// The driver's figures for `kernel` launched with `shape` on `device`, cached.
fn kernel_attrs(kernel: &Kernel, device: i32, shape: &LaunchShape) -> Result<KernelAttrs> {
    type Key = (usize, u32, u32);
    static CACHE: Mutex<BTreeMap<Key, KernelAttrs>> = Mutex::new(BTreeMap::new());
    let f = kernel.function();
    let threads = shape.block.0 * shape.block.1 * shape.block.2;
    let key = (f as usize, threads, shape.dynamic_smem_bytes);
    if let Some(a) = lock(&CACHE).get(&key) {
        return Ok(*a);
    }
    use sys::CUfunction_attribute::*;
    // SAFETY (all three): `f` is a loaded function; these calls only read its attributes.
    let registers = unsafe { cu::function::get_function_attribute(f, CU_FUNC_ATTRIBUTE_NUM_REGS) }
        .call("cuFuncGetAttribute(NUM_REGS)")?;
    let static_smem_bytes =
        unsafe { cu::function::get_function_attribute(f, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES) }
            .call("cuFuncGetAttribute(SHARED_SIZE_BYTES)")?;
    let max_active_blocks_per_sm = unsafe {
        cu::occupancy::max_active_block_per_multiprocessor(
            f,
            threads as i32,
            shape.dynamic_smem_bytes as usize,
        )
    }
    .call("cuOccupancyMaxActiveBlocksPerMultiprocessor")?;
    let attrs = KernelAttrs {
        registers,
        static_smem_bytes,
        max_active_blocks_per_sm,
        max_threads_per_sm: crate::device::max_threads_per_multiprocessor(device)?,
    };
    lock(&CACHE).insert(key, attrs);
    Ok(attrs)
}

/// Launch through `go` (the cuLaunchKernel call) with recording: called by `launch::launch`
/// when [`enabled`], with `device`'s primary context current. Errors before the launch (event
/// creation or record, attribute queries) are returned without launching; after a successful
/// launch nothing fails (a record whose end event cannot be recorded is dropped and counted).
pub(crate) fn recorded_launch(
    kernel: &Kernel,
    device: i32,
    shape: &LaunchShape,
    stream: u64,
    info: &LaunchInfo,
    go: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let s = stream as sys::CUstream;
    // inside a hooked root call whose legacy-stream check found no capture (see mark_scoped), a
    // launch on the legacy stream needs no check of its own
    if !legacy_clear(stream) && capturing(s) {
        lock(&BOOK).skipped_capture += 1;
        return go();
    }
    let attrs = kernel_attrs(kernel, device, shape)?;
    let threads = shape.block.0 * shape.block.1 * shape.block.2;
    let desc = Description {
        op: info.op,
        kernel: kernel.name,
        config: kernel.name_expression.clone(),
        arch: kernel.arch.name(),
        device,
        stream,
        grid: shape.grid,
        block: shape.block,
        dynamic_smem_bytes: shape.dynamic_smem_bytes,
        attrs,
        occupancy: theoretical_occupancy(
            attrs.max_active_blocks_per_sm,
            threads,
            attrs.max_threads_per_sm,
        ),
        work: info.work,
    };
    let mut book = lock(&BOOK);
    if !book.admit() {
        drop(book);
        return go();
    }
    let (start, end) = book.take_events(device, create_event)?;
    // SAFETY: pool events of this device's primary context (current), on the launch's stream.
    if let Err(e) = unsafe { cu::event::record(start.0, s) }.call("cuEventRecord") {
        book.give_back(device, [start, end]);
        return Err(e);
    }
    if let Err(e) = go() {
        book.give_back(device, [start, end]);
        return Err(e);
    }
    // SAFETY: as above.
    if unsafe { cu::event::record(end.0, s) }.is_err() {
        book.give_back(device, [start, end]);
        book.dropped += 1;
        return Ok(());
    }
    book.push(desc, start, end);
    Ok(())
}

/// Wait for each record's end event and resolve its times.
fn resolve(records: Vec<Pending<Event>>, reference: Option<sys::CUevent>) -> Result<Vec<Resolved>> {
    if let Some(first) = records.first() {
        ensure_context(first.desc.device)?;
    }
    records
        .into_iter()
        .map(|r| {
            // SAFETY: pool events, recorded by `recorded_launch`, never destroyed.
            unsafe { cu::event::synchronize(r.end.0) }.call("cuEventSynchronize")?;
            let gpu_ms =
                unsafe { cu::event::elapsed(r.start.0, r.end.0) }.call("cuEventElapsedTime")?;
            // SAFETY: the caller's event handle (the contract: a CUevent); the driver refuses
            // one of another context or never recorded, which gives None.
            let start_ms = reference.and_then(|e| unsafe { cu::event::elapsed(e, r.start.0) }.ok());
            Ok(Resolved {
                seq: r.seq,
                desc: r.desc,
                gpu_ms: gpu_ms as f64,
                start_ms: start_ms.map(f64::from),
            })
        })
        .collect()
}

/// Every record kept so far, resolved, in launch order; the records are forgotten and their
/// events go back to the pools, also when resolving fails (then the first CudaError is
/// returned). Blocks until the last record's kernel has finished. `reference_event`: a raw
/// CUevent (0 counts as none) recorded before the launches; see [`Resolved::start_ms`].
/// With no records it touches no driver.
pub fn drain(reference_event: Option<u64>) -> Result<Vec<Resolved>> {
    let records = lock(&BOOK).take();
    if records.is_empty() {
        return Ok(Vec::new());
    }
    let events: Vec<(i32, [Event; 2])> = records
        .iter()
        .map(|r| (r.desc.device, [r.start, r.end]))
        .collect();
    let reference = reference_event
        .filter(|&e| e != 0)
        .map(|e| e as sys::CUevent);
    let resolved = resolve(records, reference);
    let mut book = lock(&BOOK);
    for (device, pair) in events {
        book.give_back(device, pair);
    }
    resolved
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enable_stats_and_empty_drain_need_no_driver() {
        set_enabled(true);
        assert!(enabled() && stats().enabled);
        set_enabled(false);
        assert!(!enabled() && !stats().enabled);
        if crate::device::cuda_available() {
            return; // a GPU test elsewhere may be recording: the book need not be empty
        }
        // Without a driver nothing can be launched, so the process-wide book stays empty.
        assert_eq!(stats().pending, 0);
        assert_eq!(drain(None).unwrap(), vec![]);
        assert_eq!(drain(Some(12345)).unwrap(), vec![]);
    }
}
