//! The launch recorder (contract: python/ferroattn/_native.pyi, "profiler: launch records").
//!
//! Process-wide (every thread, every device). Off (the default) a launch pays one relaxed
//! atomic load ([`enabled`]). On, every launch made through `launch::launch` on a stream that
//! is not capturing a CUDA graph is bracketed by two timing events recorded on its stream
//! (start before cuLaunchKernel, end after) and described by a [`Description`]; the record is
//! kept until [`drain`] waits for its end event and turns the pair into GPU milliseconds
//! (cuEventElapsedTime). Launches on a capturing stream are counted, not recorded (an event
//! recorded there would join the graph, and its time would mean nothing).
//!
//! Launches while on take the recorder's lock from before the start event to after the end
//! event, so launches from several threads are serialised while recording and the records are
//! in launch order. Events are created with cuEventCreate(flags 0: timing enabled) in the
//! primary context of their device (current during a launch: `device::bind`), kept in a pool
//! per device and reused; they are never destroyed (at most 2 × [`MAX_RECORDS`] per device).
//! Kernel attributes (registers, static shared memory, occupancy) are queried once per
//! (function, block size, dynamic shared memory) and cached.
//!
//! Marks ([`mark`], [`marks_query`], [`marks_resolve`], [`marks_release`]): single timing
//! events the Python module hooks record on the caller's stream (one at the start and one at the
//! end of a hooked module call), taken from the same per-device pools as the launch records.
//! A mark is an id (> 0); [`marks_resolve`] turns ids into milliseconds from a reference event
//! and gives their events back to the pool. Recording a mark costs one cuEventRecord plus the
//! pool bookkeeping (no Python event object, no `torch.cuda.current_stream()` lookup).

use crate::error::{CudaResultExt, Result};
use crate::jit::Kernel;
use crate::launch_record::{LaunchInfo, LaunchShape, Work};
use cudarc::driver::{result as cu, sys};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

/// Remove the entries `ids` (in that order) from `book` and return their values. All or
/// nothing: the first id that is not in `book` (never added, already taken, or listed twice)
/// leaves `book` as it was and is returned as the error. Shared by the event and stamp books.
fn take_all<V>(book: &mut BTreeMap<u64, V>, ids: &[u64]) -> std::result::Result<Vec<V>, u64> {
    let mut out = Vec::with_capacity(ids.len());
    for (i, &id) in ids.iter().enumerate() {
        match book.remove(&id) {
            Some(v) => out.push(v),
            None => {
                for (&back, v) in ids[..i].iter().zip(out) {
                    book.insert(back, v);
                }
                return Err(id);
            }
        }
    }
    Ok(out)
}

/// Most records kept undrained; launches beyond are counted as dropped.
pub const MAX_RECORDS: usize = 1_000_000;

/// Most marks kept unresolved; marks beyond are not recorded (id 0) and counted as dropped.
pub const MAX_MARKS: usize = 2_000_000;

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

/// Per-function figures from the driver, for one block size and dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelAttrs {
    /// Registers per thread (CU_FUNC_ATTRIBUTE_NUM_REGS).
    pub registers: i32,
    /// Static shared memory per block in bytes (CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES).
    pub static_smem_bytes: i32,
    /// cuOccupancyMaxActiveBlocksPerMultiprocessor(function, block threads, dynamic smem).
    pub max_active_blocks_per_sm: i32,
    /// CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR of the launch's device.
    pub max_threads_per_sm: i32,
}

/// Theoretical occupancy: resident warps (blocks per SM × warps per block, a partial warp
/// counting whole) over the most warps an SM holds (max threads per SM / 32), in [0, 1].
pub fn theoretical_occupancy(
    max_active_blocks_per_sm: i32,
    block_threads: u32,
    max_threads_per_sm: i32,
) -> f64 {
    let max_warps = max_threads_per_sm / 32;
    if max_warps <= 0 || max_active_blocks_per_sm <= 0 {
        return 0.0;
    }
    let warps = max_active_blocks_per_sm as f64 * block_threads.div_ceil(32) as f64;
    (warps / max_warps as f64).clamp(0.0, 1.0)
}

/// Everything known about a launch when it is made.
#[derive(Clone, Debug, PartialEq)]
pub struct Description {
    /// The custom op, e.g. "ferroattn::attn_fwd".
    pub op: &'static str,
    /// Short kernel name, e.g. "attn_fwd_sm80".
    pub kernel: &'static str,
    /// The configuration's NVRTC name expression.
    pub config: String,
    /// e.g. "sm_90a".
    pub arch: &'static str,
    pub device: i32,
    /// The raw CUstream launched on.
    pub stream: u64,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub dynamic_smem_bytes: u32,
    pub attrs: KernelAttrs,
    /// [`theoretical_occupancy`] of this launch.
    pub occupancy: f64,
    pub work: Work,
}

/// A record waiting for its events to be resolved. `E` is the event type (a driver event in
/// the process-wide recorder; plain numbers in the bookkeeping tests).
#[derive(Debug)]
struct Pending<E> {
    seq: u64,
    desc: Description,
    start: E,
    end: E,
}

/// One drained record.
#[derive(Clone, Debug, PartialEq)]
pub struct Resolved {
    /// Position among the recorded launches of this process (0, 1, 2, …, in launch order).
    pub seq: u64,
    pub desc: Description,
    /// cuEventElapsedTime(start, end): the kernel's GPU time in milliseconds.
    pub gpu_ms: f64,
    /// cuEventElapsedTime(reference, start) in milliseconds; None without a reference event
    /// or where the driver refuses it.
    pub start_ms: Option<f64>,
}

/// The counters of `profiler_stats()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stats {
    pub enabled: bool,
    /// Records not drained yet.
    pub pending: usize,
    /// Launches not recorded because their stream was capturing a graph (since process start).
    pub skipped_capture: u64,
    /// Launches not recorded because MAX_RECORDS were pending, or because the end event could
    /// not be recorded after the kernel was launched, and marks not recorded because MAX_MARKS
    /// were unresolved (since process start).
    pub dropped: u64,
    /// Marks recorded and not yet resolved or released.
    pub marks: usize,
}

/// The recorder's state without the driver: pending records, event pools per device, counters.
#[derive(Debug)]
struct Book<E> {
    records: Vec<Pending<E>>,
    pools: BTreeMap<i32, Vec<E>>,
    next_seq: u64,
    skipped_capture: u64,
    dropped: u64,
    cap: usize,
    /// Unresolved marks: id -> (device, event). Ids count up from 1 (0 means "no mark").
    marks: BTreeMap<u64, (i32, E)>,
    next_mark: u64,
    mark_cap: usize,
}

impl<E> Book<E> {
    const fn new(cap: usize, mark_cap: usize) -> Self {
        Book {
            records: Vec::new(),
            pools: BTreeMap::new(),
            next_seq: 0,
            skipped_capture: 0,
            dropped: 0,
            cap,
            marks: BTreeMap::new(),
            next_mark: 1,
            mark_cap,
        }
    }

    /// Room for one more record? Counts a drop when not.
    fn admit(&mut self) -> bool {
        if self.records.len() >= self.cap {
            self.dropped += 1;
            return false;
        }
        true
    }

    /// One event of `device`: from its pool, else made by `create`.
    fn take_event(&mut self, device: i32, create: impl FnOnce() -> Result<E>) -> Result<E> {
        match self.pools.entry(device).or_default().pop() {
            Some(e) => Ok(e),
            None => create(),
        }
    }

    /// Room for one more mark? Counts a drop when not.
    fn admit_mark(&mut self) -> bool {
        if self.marks.len() >= self.mark_cap {
            self.dropped += 1;
            return false;
        }
        true
    }

    /// Keep a recorded mark; returns its id (> 0).
    fn add_mark(&mut self, device: i32, event: E) -> u64 {
        let id = self.next_mark;
        self.next_mark += 1;
        self.marks.insert(id, (device, event));
        id
    }

    /// Remove the marks `ids` (in that order) and return their (device, event). All or nothing:
    /// an id that is not an unresolved mark (never made, already resolved or released, or
    /// listed twice) leaves the book as it was and is returned as the error.
    fn take_marks(&mut self, ids: &[u64]) -> std::result::Result<Vec<(i32, E)>, u64> {
        take_all(&mut self.marks, ids)
    }

    /// Forget the marks among `ids` that are unresolved (others are ignored) and pool their
    /// events. Returns how many were released.
    fn release_marks(&mut self, ids: &[u64]) -> usize {
        let mut n = 0;
        for id in ids {
            if let Some((device, e)) = self.marks.remove(id) {
                self.give_back(device, [e]);
                n += 1;
            }
        }
        n
    }

    /// Two events of `device`: from its pool, else made by `create`.
    fn take_events(
        &mut self,
        device: i32,
        mut create: impl FnMut() -> Result<E>,
    ) -> Result<(E, E)> {
        let pool = self.pools.entry(device).or_default();
        let start = match pool.pop() {
            Some(e) => e,
            None => create()?,
        };
        let end = match pool.pop() {
            Some(e) => e,
            None => match create() {
                Ok(e) => e,
                Err(err) => {
                    pool.push(start);
                    return Err(err);
                }
            },
        };
        Ok((start, end))
    }

    fn give_back(&mut self, device: i32, events: impl IntoIterator<Item = E>) {
        self.pools.entry(device).or_default().extend(events);
    }

    /// Keep a record; returns its sequence number.
    fn push(&mut self, desc: Description, start: E, end: E) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.records.push(Pending {
            seq,
            desc,
            start,
            end,
        });
        seq
    }

    fn take(&mut self) -> Vec<Pending<E>> {
        std::mem::take(&mut self.records)
    }

    fn stats(&self, enabled: bool) -> Stats {
        Stats {
            enabled,
            pending: self.records.len(),
            skipped_capture: self.skipped_capture,
            dropped: self.dropped,
            marks: self.marks.len(),
        }
    }
}

/// A CUevent of the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Event(sys::CUevent);
// SAFETY: a CUevent is a process-wide driver handle usable from any thread.
unsafe impl Send for Event {}

static BOOK: Mutex<Book<Event>> = Mutex::new(Book::new(MAX_RECORDS, MAX_MARKS));

/// Lock, ignoring poisoning (the state stays consistent: every update is a single push/pop).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The recorder's counters. Needs no driver.
pub fn stats() -> Stats {
    lock(&BOOK).stats(enabled())
}

thread_local! {
    /// (device, context) of the last [`bind_cached`] on this thread.
    static BOUND: std::cell::Cell<(i32, usize)> = const { std::cell::Cell::new((-1, 0)) };
}

/// `device::bind(device)`, skipped when this thread's current context is already the context a
/// previous call bound for `device` (primary contexts are retained for the process lifetime by
/// `device::bind`, so a remembered handle stays valid): one cuCtxGetCurrent when nothing
/// changed, instead of a lock, a map lookup and cuCtxGetCurrent.
fn bind_cached(device: i32) -> Result<()> {
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

/// Whether `stream` is capturing a graph (an error, e.g. the legacy stream while another
/// stream captures in global mode, counts as capturing: recording there is not safe).
fn capturing(stream: sys::CUstream) -> bool {
    // SAFETY: the caller's stream handle, as the launch itself uses it.
    match unsafe { cu::stream::is_capturing(stream) } {
        Ok(status) => status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE,
        Err(_) => true,
    }
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

fn create_event() -> Result<Event> {
    cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
        .call("cuEventCreate")
        .map(Event)
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
    let legacy_clear = (stream == 0 || stream == 1) && LEGACY_CLEAR.with(|c| c.get());
    if !legacy_clear && capturing(s) {
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

/// Make some context current on this thread when none is (cuEvent* calls need one; an event
/// carries its own context, so any will do): the primary context of `device`.
fn ensure_context(device: i32) -> Result<()> {
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

/// Record a mark: a pooled timing event of `device` recorded on `stream` (a raw CUstream of
/// that device, 0 = its legacy default stream) now, in stream order. Makes the primary context
/// of `device` current on this thread first (as a launch does). Returns the mark's id (> 0), or
/// 0 when nothing was recorded: `stream` is capturing a CUDA graph (an event there would join
/// the graph) or [`MAX_MARKS`] marks are unresolved (counted in [`Stats::dropped`]).
///
/// Host cost (the per-call path of the module hooks, so kept short): the context is bound only
/// when the thread's current context is not the one this thread last bound for `device`
/// ([`bind_cached`]: one cuCtxGetCurrent). The capture check stays per mark, also on the legacy
/// stream, which cannot capture itself but reports an error while a blocking stream of the
/// context captures (cudaErrorStreamCaptureImplicit; an event recorded there would invalidate
/// that capture): such a mark is not recorded either.
pub fn mark(device: i32, stream: u64) -> Result<u64> {
    bind_cached(device)?;
    let s = stream as sys::CUstream;
    if capturing(s) {
        return Ok(0);
    }
    record_mark(device, s)
}

/// Where a mark sits in a hooked root call (the outermost profiled module call of a forward):
/// what [`mark_scoped`] may skip.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// The start of a root call: the full capture check; on the legacy stream its outcome is
    /// remembered for the marks of this root call.
    Open,
    /// A mark inside the root call.
    Inner,
    /// The end of the root call (uses the remembered outcome, then forgets it).
    Close,
}

thread_local! {
    /// Set by a [`Scope::Open`] mark on the legacy stream that found no capture (or an inner one
    /// that checked); cleared by any [`Scope::Close`], by an Open off the legacy stream and by a
    /// check that found a capture.
    static LEGACY_CLEAR: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// [`mark`] for the module hooks' per-call path (the native forward wrapper): the capture check on
/// the legacy stream (0 or CU_STREAM_LEGACY) runs once per root call (at [`Scope::Open`], and at any later mark when
/// that check did not run or failed) instead of at every mark; every mark on any other stream is
/// checked as [`mark`] does.
///
/// Why that is safe: the legacy stream itself can never capture; its check only reports
/// CUDA_ERROR_STREAM_CAPTURE_IMPLICIT while a *blocking* stream of the context captures. A
/// capture that starts inside the root call does so on a stream that the capturing code makes
/// current (torch.cuda.graph does), so the next mark is on that stream and is checked; and a
/// capture of a blocking stream begun by another thread during the forward is already broken by
/// the forward's own launches on the legacy stream (each is the same implicit dependency). torch's
/// own streams are non-blocking (its stream pool), so its captures never involve the legacy stream.
pub fn mark_scoped(device: i32, stream: u64, scope: Scope) -> Result<u64> {
    bind_cached(device)?;
    if !scoped_may_record(stream, scope) {
        return Ok(0);
    }
    record_mark(device, stream as sys::CUstream)
}

/// The capture check of [`mark_scoped`] (shared with [`stamp_scoped`]): whether a mark at
/// `scope` may be recorded on `stream` now (false: the stream is capturing, or its check failed).
fn scoped_may_record(stream: u64, scope: Scope) -> bool {
    let s = stream as sys::CUstream;
    if stream == 0 || stream == 1 {
        // the legacy stream: 0, or CU_STREAM_LEGACY (0x1)
        let clear = match scope {
            Scope::Open => false,
            Scope::Inner | Scope::Close => LEGACY_CLEAR.with(|c| c.get()),
        };
        if !clear {
            let cap = capturing(s);
            LEGACY_CLEAR.with(|c| c.set(!cap && scope != Scope::Close));
            if cap {
                return false;
            }
        } else if scope == Scope::Close {
            LEGACY_CLEAR.with(|c| c.set(false));
        }
        true
    } else {
        if scope != Scope::Inner {
            // a root call that opens or closes off the legacy stream: nothing remembered for the next
            LEGACY_CLEAR.with(|c| c.set(false));
        }
        !capturing(s)
    }
}

/// Record a pooled event of `device` on `s` and keep it as a mark (the checks done).
fn record_mark(device: i32, s: sys::CUstream) -> Result<u64> {
    let mut book = lock(&BOOK);
    if !book.admit_mark() {
        return Ok(0);
    }
    let e = book.take_event(device, create_event)?;
    // SAFETY: a pool event of `device`'s primary context (current), on the caller's stream.
    if let Err(err) = unsafe { cu::event::record(e.0, s) }.call("cuEventRecord") {
        book.give_back(device, [e]);
        return Err(err);
    }
    Ok(book.add_mark(device, e))
}

/// ArgumentError naming `arg` ("marks" / "stamps") for an id that `maker` ("profiler_mark" /
/// "profiler_stamp") did not return or that is resolved or released already.
fn unknown_id(arg: &str, maker: &str, id: u64) -> crate::error::Error {
    crate::error::Error::argument(
        arg,
        format!("ids returned by {maker} that are not resolved or released yet (each once)"),
        id,
    )
}

fn unknown_mark(id: u64) -> crate::error::Error {
    unknown_id("marks", "profiler_mark", id)
}

/// Whether the GPU has passed each mark (cuEventQuery; never waits). ArgumentError naming
/// `marks` for an id that is not an unresolved mark; CudaError when the driver reports an error.
pub fn marks_query(ids: &[u64]) -> Result<Vec<bool>> {
    let book = lock(&BOOK);
    let mut events = Vec::with_capacity(ids.len());
    for id in ids {
        match book.marks.get(id) {
            Some(&(device, e)) => events.push((device, e)),
            None => return Err(unknown_mark(*id)),
        }
    }
    drop(book);
    if let Some(&(device, _)) = events.first() {
        ensure_context(device)?;
    }
    events
        .into_iter()
        .map(|(_, e)| {
            // SAFETY: a pool event recorded by `mark`, never destroyed.
            match unsafe { cu::event::query(e.0) } {
                Ok(()) => Ok(true),
                Err(cu::DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
                Err(err) => Err::<bool, _>(err).call("cuEventQuery"),
            }
        })
        .collect()
}

/// Milliseconds from `reference_event` (a raw CUevent recorded before the marks, 0/None: the
/// first mark of `ids`) to each mark of `ids` (cuEventElapsedTime; negative when the mark came
/// first; None where the driver refuses, e.g. a reference of another device). Waits for every
/// mark (cuEventSynchronize), then forgets the marks and pools their events, also when
/// resolving fails (then the first CudaError is returned). ArgumentError naming `marks`, and
/// nothing forgotten, when an id is not an unresolved mark. No ids: no driver call.
pub fn marks_resolve(ids: &[u64], reference_event: Option<u64>) -> Result<Vec<Option<f64>>> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let marks = lock(&BOOK).take_marks(ids).map_err(unknown_mark)?;
    let times = (|| -> Result<Vec<Option<f64>>> {
        ensure_context(marks[0].0)?;
        for (_, e) in &marks {
            // SAFETY: pool events recorded by `mark`, never destroyed.
            unsafe { cu::event::synchronize(e.0) }.call("cuEventSynchronize")?;
        }
        let reference = reference_event
            .filter(|&r| r != 0)
            .map(|r| r as sys::CUevent)
            .unwrap_or(marks[0].1 .0);
        Ok(marks
            .iter()
            .map(|(_, e)| {
                // SAFETY: `reference` is the caller's CUevent (the contract) or one of ours; the
                // driver refuses an invalid pair, which gives None.
                unsafe { cu::event::elapsed(reference, e.0) }
                    .ok()
                    .map(f64::from)
            })
            .collect())
    })();
    let mut book = lock(&BOOK);
    for (device, e) in marks {
        book.give_back(device, [e]);
    }
    times
}

/// Forget the unresolved marks among `ids` without timing them (ids already resolved or
/// released, or never made, are ignored) and pool their events. Returns how many were
/// released. Needs no driver.
pub fn marks_release(ids: &[u64]) -> usize {
    lock(&BOOK).release_marks(ids)
}

// ---- stamps (experimental; off the default path) ---------------------------------------------
//
// A stamp is a mark taken by a kernel instead of an event: `profiler_stamp`
// (kernels/profiler/stamp.cuh, one thread, compiled by the JIT engine like every other kernel,
// JIT-only: not in the precompile sets) writes %globaltimer (GPU nanoseconds) into one slot of a
// per-device buffer, launched on the caller's stream. Host cost per stamp: the capture check (as
// for a mark), the stamp book's lock and one cuLaunchKernel (no cuEventRecord). The question it
// answers (scripts/profiler_overhead.py, modes *_stamp*): is a kernel launch cheaper in situ than
// an event record? Stamps are resolved by one device synchronisation + one copy of the slots.
//
// Slots: STAMP_SLOTS per device (u64 each), handed out in order; once every stamp of a device is
// resolved or released the next stamp starts at slot 0 again. More than STAMP_SLOTS unresolved
// stamps on a device: not recorded (id 0, counted as dropped). A released (not resolved) stamp's
// kernel may still be queued: releasing while such a stamp runs on another stream than the next
// stamps of the same slot is a race (the hooks release only after a resolve or discard between
// forwards; the experiment resolves every forward).

/// Slots per device (8 bytes each: 512 KiB).
pub const STAMP_SLOTS: u32 = 1 << 16;

/// Which kernel of kernels/profiler/stamp.cuh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StampKernel {
    /// `profiler_stamp(u64* slot)`.
    Stamp,
    /// `profiler_globaltimer_probe(u64* out, int iters)`.
    Probe,
}

/// The stamp kernels' KernelSpec (JIT-only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StampSpec {
    pub kernel: StampKernel,
    pub arch: crate::arch::Arch,
}

impl crate::jit::KernelSpec for StampSpec {
    fn kernel(&self) -> &'static str {
        match self.kernel {
            StampKernel::Stamp => "ferroattn::profiler_stamp",
            StampKernel::Probe => "ferroattn::profiler_globaltimer_probe",
        }
    }
    fn header(&self) -> &'static str {
        "profiler/stamp.cuh"
    }
    fn name_expression(&self) -> String {
        self.kernel().to_string()
    }
    fn arch(&self) -> crate::arch::Arch {
        self.arch
    }
    fn dynamic_smem_bytes(&self) -> u32 {
        0
    }
}

static STAMP_KERNELS: crate::jit::KernelMap<StampSpec> = crate::jit::KernelMap::new();

/// Slot bookkeeping of one device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct SlotState {
    /// Next slot to hand out.
    next: u32,
    /// Stamps of this device handed out and not finished (resolved or released).
    live: u32,
}

/// The stamps' state without the driver: unresolved stamps (id -> (device, slot)), slot
/// counters per device, drops.
#[derive(Debug)]
struct StampBook {
    slots: u32,
    devices: BTreeMap<i32, SlotState>,
    stamps: BTreeMap<u64, (i32, u32)>,
    next_id: u64,
    dropped: u64,
}

impl StampBook {
    const fn new(slots: u32) -> Self {
        StampBook {
            slots,
            devices: BTreeMap::new(),
            stamps: BTreeMap::new(),
            next_id: 1,
            dropped: 0,
        }
    }

    /// A new stamp of `device`: (id > 0, slot), or None (every slot unresolved; a drop).
    fn alloc(&mut self, device: i32) -> Option<(u64, u32)> {
        let st = self.devices.entry(device).or_default();
        if st.live == 0 {
            st.next = 0;
        }
        if st.next >= self.slots {
            self.dropped += 1;
            return None;
        }
        let slot = st.next;
        st.next += 1;
        st.live += 1;
        let id = self.next_id;
        self.next_id += 1;
        self.stamps.insert(id, (device, slot));
        Some((id, slot))
    }

    /// Undo the [`alloc`](Self::alloc) of `id` (its launch failed).
    fn unalloc(&mut self, id: u64) {
        if let Some((device, _)) = self.stamps.remove(&id) {
            self.finish([device]);
        }
    }

    /// Remove the stamps `ids` (in that order) and return their (device, slot); their slots stay
    /// reserved until [`finish`](Self::finish). All or nothing: an id that is not an unresolved
    /// stamp (never made, resolved, released, or listed twice) leaves the book as it was and is
    /// returned as the error.
    fn take(&mut self, ids: &[u64]) -> std::result::Result<Vec<(i32, u32)>, u64> {
        take_all(&mut self.stamps, ids)
    }

    /// The slots of taken stamps (one device entry per stamp) are free again.
    fn finish(&mut self, devices: impl IntoIterator<Item = i32>) {
        for d in devices {
            if let Some(st) = self.devices.get_mut(&d) {
                st.live = st.live.saturating_sub(1);
            }
        }
    }

    /// Forget the unresolved stamps among `ids` (others ignored); how many.
    fn release(&mut self, ids: &[u64]) -> usize {
        let mut n = 0;
        for id in ids {
            if let Some((device, _)) = self.stamps.remove(id) {
                self.finish([device]);
                n += 1;
            }
        }
        n
    }
}

/// The counters of `profiler_stamp_stats()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StampStats {
    /// Stamps recorded and not yet resolved or released.
    pub live: usize,
    /// Stamps not recorded because every slot of their device was unresolved.
    pub dropped: u64,
    /// Slots per device.
    pub slots: u32,
}

/// A device's slot buffer (CUdeviceptr) and stamp kernel (CUfunction as usize).
#[derive(Clone, Copy, Debug)]
struct StampDevice {
    buf: u64,
    function: usize,
}

struct Stamps {
    book: StampBook,
    devices: BTreeMap<i32, StampDevice>,
}

static STAMPS: Mutex<Stamps> = Mutex::new(Stamps {
    book: StampBook::new(STAMP_SLOTS),
    devices: BTreeMap::new(),
});

/// Stamp counters. Needs no driver.
pub fn stamp_stats() -> StampStats {
    let s = lock(&STAMPS);
    StampStats {
        live: s.book.stamps.len(),
        dropped: s.book.dropped,
        slots: s.book.slots,
    }
}

/// The stamp kernel and slot buffer of `device` (its primary context current): made on the
/// first call (JIT compile or disk cache, cuMemAlloc of STAMP_SLOTS × 8 bytes, zeroed).
fn stamp_device(device: i32) -> Result<StampDevice> {
    if let Some(d) = lock(&STAMPS).devices.get(&device) {
        return Ok(*d);
    }
    let spec = StampSpec {
        kernel: StampKernel::Stamp,
        arch: crate::device::arch(device)?,
    };
    let kernel = STAMP_KERNELS.get(&spec, device)?;
    crate::device::bind(device)?;
    let bytes = STAMP_SLOTS as usize * 8;
    // SAFETY: a plain device allocation in the current (primary) context, zeroed before use.
    let buf = unsafe { cu::malloc_sync(bytes) }.call("cuMemAlloc")?;
    unsafe { cu::memset_d8_sync(buf, 0, bytes) }.call("cuMemsetD8")?;
    let mut s = lock(&STAMPS);
    // another thread may have won: keep the first (the loser's 512 KiB stay allocated)
    let d = *s.devices.entry(device).or_insert(StampDevice {
        buf,
        function: kernel.function() as usize,
    });
    Ok(d)
}

/// Launch the stamp kernel for a new stamp of `device` on `s` (the checks done).
fn record_stamp(device: i32, s: sys::CUstream) -> Result<u64> {
    let mut st = lock(&STAMPS);
    let dev = match st.devices.get(&device) {
        Some(d) => *d,
        None => {
            drop(st);
            let d = stamp_device(device)?;
            st = lock(&STAMPS);
            d
        }
    };
    let Some((id, slot)) = st.book.alloc(device) else {
        return Ok(0);
    };
    let mut ptr: u64 = dev.buf + 8 * slot as u64;
    let mut args = [&mut ptr as *mut u64 as *mut std::ffi::c_void];
    // SAFETY: the loaded stamp kernel (one u64* parameter), a slot inside this device's buffer
    // (never freed), on the caller's stream; launched 1 x 1.
    let launched = unsafe {
        cu::launch_kernel(
            dev.function as sys::CUfunction,
            (1, 1, 1),
            (1, 1, 1),
            0,
            s,
            &mut args,
        )
    }
    .call("cuLaunchKernel(profiler_stamp)");
    if let Err(e) = launched {
        st.book.unalloc(id);
        return Err(e);
    }
    Ok(id)
}

/// [`mark`] with a stamp: the full capture check on `stream` (a raw CUstream of `device`; 0 =
/// its legacy stream), then the stamp kernel launched there. Returns the stamp's id (> 0), or 0
/// when nothing was recorded (capturing stream, every slot unresolved). The first stamp of a
/// device compiles (or loads) the kernel and allocates the slots.
pub fn stamp(device: i32, stream: u64) -> Result<u64> {
    bind_cached(device)?;
    let s = stream as sys::CUstream;
    if capturing(s) {
        return Ok(0);
    }
    record_stamp(device, s)
}

/// [`mark_scoped`] with a stamp (the same capture checks, [`Scope`] for [`Scope`]).
pub fn stamp_scoped(device: i32, stream: u64, scope: Scope) -> Result<u64> {
    bind_cached(device)?;
    if !scoped_may_record(stream, scope) {
        return Ok(0);
    }
    record_stamp(device, stream as sys::CUstream)
}

fn unknown_stamp(id: u64) -> crate::error::Error {
    unknown_id("stamps", "profiler_stamp", id)
}

/// The %globaltimer value (ns) of each stamp of `ids`, in that order. Waits for every stream of
/// each involved device's primary context (cuCtxSynchronize), then copies the slot range once
/// per device; the stamps are forgotten (also when that fails: then the first CudaError).
/// ArgumentError naming `stamps`, nothing forgotten, for an id that is not an unresolved stamp.
/// No ids: no driver call.
pub fn stamps_resolve(ids: &[u64]) -> Result<Vec<u64>> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let (taken, devices) = {
        let mut s = lock(&STAMPS);
        let taken = s.book.take(ids).map_err(unknown_stamp)?;
        let devices = s.devices.clone();
        (taken, devices)
    };
    let read = (|| -> Result<Vec<u64>> {
        let mut out = vec![0u64; taken.len()];
        let mut per_device: BTreeMap<i32, Vec<usize>> = BTreeMap::new();
        for (i, (d, _)) in taken.iter().enumerate() {
            per_device.entry(*d).or_default().push(i);
        }
        for (d, idx) in per_device {
            let dev = devices
                .get(&d)
                .copied()
                .ok_or_else(|| unknown_stamp(ids[idx[0]]))?;
            crate::device::bind(d)?;
            cu::ctx::synchronize().call("cuCtxSynchronize")?;
            let lo = idx.iter().map(|&i| taken[i].1).min().unwrap_or(0);
            let hi = idx.iter().map(|&i| taken[i].1).max().unwrap_or(0);
            let mut host = vec![0u64; (hi - lo + 1) as usize];
            // SAFETY: slots lo..=hi lie inside the device's buffer (slot < STAMP_SLOTS).
            unsafe { cu::memcpy_dtoh_sync(&mut host, dev.buf + 8 * lo as u64) }
                .call("cuMemcpyDtoH")?;
            for i in idx {
                out[i] = host[(taken[i].1 - lo) as usize];
            }
        }
        Ok(out)
    })();
    lock(&STAMPS).book.finish(taken.iter().map(|(d, _)| *d));
    read
}

/// Forget the unresolved stamps among `ids` (others ignored); how many. Needs no driver.
pub fn stamps_release(ids: &[u64]) -> usize {
    lock(&STAMPS).book.release(ids)
}

/// %globaltimer as the GPU updates it: one thread of `profiler_globaltimer_probe` reads it
/// `iters` times on `device`'s legacy stream (waits for it). Returns [smallest non-zero step,
/// reads that changed, last - first, largest step] (ns, count, ns, ns).
pub fn globaltimer_probe(device: i32, iters: i32) -> Result<[u64; 4]> {
    if iters < 1 {
        return Err(crate::error::Error::argument("iters", "an int >= 1", iters));
    }
    let spec = StampSpec {
        kernel: StampKernel::Probe,
        arch: crate::device::arch(device)?,
    };
    let kernel = STAMP_KERNELS.get(&spec, device)?;
    crate::device::bind(device)?;
    // SAFETY: 32 bytes in the current context, freed below.
    let buf = unsafe { cu::malloc_sync(32) }.call("cuMemAlloc")?;
    let run = (|| -> Result<[u64; 4]> {
        let mut ptr = buf;
        let mut n = iters;
        let mut args = [
            &mut ptr as *mut u64 as *mut std::ffi::c_void,
            &mut n as *mut i32 as *mut std::ffi::c_void,
        ];
        // SAFETY: the probe kernel (u64*, int), a 32-byte buffer, one thread.
        unsafe {
            cu::launch_kernel(
                kernel.function(),
                (1, 1, 1),
                (1, 1, 1),
                0,
                std::ptr::null_mut(),
                &mut args,
            )
        }
        .call("cuLaunchKernel(profiler_globaltimer_probe)")?;
        cu::ctx::synchronize().call("cuCtxSynchronize")?;
        let mut out = [0u64; 4];
        // SAFETY: the 32-byte buffer written by the probe.
        unsafe { cu::memcpy_dtoh_sync(&mut out, buf) }.call("cuMemcpyDtoH")?;
        Ok(out)
    })();
    // SAFETY: allocated above; the probe has finished (synchronised) or never ran.
    let _ = unsafe { cu::free_sync(buf) };
    run
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    fn desc(op: &'static str) -> Description {
        Description {
            op,
            kernel: "attn_fwd_sm80",
            config: "ferroattn::attn_fwd_sm80<128, 128, 64, 4, 2, true, __nv_bfloat16>".into(),
            arch: "sm_90a",
            device: 0,
            stream: 0,
            grid: (8, 8, 2),
            block: (128, 1, 1),
            dynamic_smem_bytes: 98304,
            attrs: KernelAttrs {
                registers: 255,
                static_smem_bytes: 0,
                max_active_blocks_per_sm: 2,
                max_threads_per_sm: 2048,
            },
            occupancy: 0.125,
            work: Work {
                flops: 1.0,
                bytes: 2.0,
                exact: true,
            },
        }
    }

    /// A fake event factory: numbers 0, 1, 2, … and a count of creations.
    fn counter(n: &mut u32) -> impl FnMut() -> Result<u32> + '_ {
        move || {
            *n += 1;
            Ok(*n - 1)
        }
    }

    #[test]
    fn cap_counts_drops_and_seq_follows_the_records() {
        let mut book: Book<u32> = Book::new(3, 10);
        let mut made = 0;
        for i in 0..5 {
            if book.admit() {
                let (a, b) = book.take_events(0, counter(&mut made)).unwrap();
                assert_eq!(book.push(desc("op"), a, b), i);
            }
        }
        let s = book.stats(true);
        assert_eq!(
            (s.pending, s.dropped, s.skipped_capture, s.enabled),
            (3, 2, 0, true)
        );
        assert_eq!(made, 6);
        let taken = book.take();
        assert_eq!(
            taken.iter().map(|r| r.seq).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        assert_eq!(book.stats(false).pending, 0);
        // drained records make room again; sequence numbers keep counting
        for r in taken {
            book.give_back(r.desc.device, [r.start, r.end]);
        }
        assert!(book.admit());
        let (a, b) = book.take_events(0, counter(&mut made)).unwrap();
        assert_eq!(book.push(desc("op"), a, b), 3);
        assert_eq!(made, 6, "events came from the pool");
        assert_eq!(book.stats(true).dropped, 2, "drops count since the start");
    }

    #[test]
    fn pools_are_per_device_and_a_failed_creation_keeps_the_first_event() {
        let mut book: Book<u32> = Book::new(10, 10);
        book.give_back(1, [7]);
        let mut fail = || -> Result<u32> { Err(Error::NoDevice("test".into())) };
        assert!(book.take_events(1, &mut fail).is_err());
        assert_eq!(book.pools[&1], vec![7], "the pooled event is kept");
        assert!(book.take_events(0, &mut fail).is_err());
        let mut made = 100;
        let (a, b) = book.take_events(1, counter(&mut made)).unwrap();
        assert_eq!((a, b), (7, 100));
        book.give_back(1, [a, b]);
        book.give_back(2, [5, 6]);
        assert_eq!(book.pools[&1].len(), 2);
        assert_eq!(book.pools[&2].len(), 2);
    }

    #[test]
    fn occupancy_is_resident_warps_over_the_sm_maximum() {
        assert_eq!(theoretical_occupancy(2, 128, 2048), 8.0 / 64.0);
        assert_eq!(theoretical_occupancy(1, 256, 2048), 0.125);
        assert_eq!(theoretical_occupancy(16, 128, 2048), 1.0);
        assert_eq!(
            theoretical_occupancy(1, 33, 2048),
            2.0 / 64.0,
            "a partial warp counts whole"
        );
        assert_eq!(theoretical_occupancy(64, 1024, 2048), 1.0, "clamped");
        assert_eq!(theoretical_occupancy(0, 128, 2048), 0.0);
        assert_eq!(theoretical_occupancy(2, 128, 0), 0.0);
    }

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

    #[test]
    fn marks_share_the_pool_and_resolve_all_or_nothing() {
        let mut book: Book<u32> = Book::new(10, 3);
        let mut made = 0;
        let mut ids = vec![];
        for _ in 0..3 {
            assert!(book.admit_mark());
            let e = book.take_event(0, counter(&mut made)).unwrap();
            ids.push(book.add_mark(0, e));
        }
        assert_eq!(ids, vec![1, 2, 3], "ids count up from 1 (0 = no mark)");
        assert!(!book.admit_mark(), "the cap holds");
        assert_eq!((book.stats(true).marks, book.stats(true).dropped), (3, 1));
        // an unknown or repeated id leaves every mark in place
        assert_eq!(book.take_marks(&[1, 9]), Err(9));
        assert_eq!(book.take_marks(&[2, 2]), Err(2));
        assert_eq!(book.stats(true).marks, 3);
        assert_eq!(book.marks[&1], (0, 0));
        let taken = book.take_marks(&[3, 1]).unwrap();
        assert_eq!(taken, vec![(0, 2), (0, 0)], "in the order asked");
        for (d, e) in taken {
            book.give_back(d, [e]);
        }
        assert_eq!(book.take_marks(&[1]), Err(1), "a resolved mark is gone");
        // release: unknown ids ignored, events pooled
        assert_eq!(book.release_marks(&[2, 2, 7]), 1);
        assert_eq!(book.stats(true).marks, 0);
        // marks and launch records draw on one pool per device
        let (a, b) = book.take_events(0, counter(&mut made)).unwrap();
        let c = book.take_event(0, counter(&mut made)).unwrap();
        assert_eq!(made, 3, "no event made after the first three");
        let mut all = vec![a, b, c];
        all.sort();
        assert_eq!(all, vec![0, 1, 2]);
        assert_eq!(book.add_mark(0, c), 4, "ids are never reused");
    }

    #[test]
    fn stamp_slots_restart_when_all_are_finished_and_take_is_all_or_nothing() {
        let mut b = StampBook::new(3);
        let a: Vec<(u64, u32)> = (0..3).map(|_| b.alloc(0).unwrap()).collect();
        assert_eq!(
            a,
            vec![(1, 0), (2, 1), (3, 2)],
            "ids from 1, slots in order"
        );
        assert_eq!(b.alloc(0), None, "every slot unresolved: a drop");
        assert_eq!(b.dropped, 1);
        assert_eq!(b.alloc(1), Some((4, 0)), "slots are per device");
        // all or nothing
        assert_eq!(b.take(&[1, 9]), Err(9));
        assert_eq!(b.take(&[2, 2]), Err(2));
        assert_eq!(b.stamps.len(), 4);
        let t = b.take(&[3, 1]).unwrap();
        assert_eq!(t, vec![(0, 2), (0, 0)], "in the order asked");
        // taken but not finished: the slots stay reserved, no restart
        assert_eq!(b.release(&[2]), 1);
        assert_eq!(
            b.alloc(0),
            None,
            "slot 3 does not exist; 0..2 still reserved"
        );
        b.finish(t.iter().map(|(d, _)| *d));
        assert_eq!(b.devices[&0].live, 0);
        assert_eq!(
            b.alloc(0),
            Some((5, 0)),
            "all finished: back to slot 0; ids never reused"
        );
        // a failed launch gives its slot back
        let (id, slot) = b.alloc(0).unwrap();
        assert_eq!(slot, 1);
        b.unalloc(id);
        assert_eq!(b.devices[&0].live, 1);
        assert_eq!(
            b.release(&[5, 5, id, 42, 4]),
            2,
            "unknown / repeated / undone ids ignored"
        );
        assert!(b.stamps.is_empty());
        assert_eq!(b.alloc(0).unwrap().1, 0);
    }

    #[test]
    fn stamp_spec_names_the_header_and_kernels() {
        use crate::jit::KernelSpec;
        let s = StampSpec {
            kernel: StampKernel::Stamp,
            arch: crate::arch::Arch::Sm90a,
        };
        assert_eq!(s.name_expression(), "ferroattn::profiler_stamp");
        assert_eq!(s.dynamic_smem_bytes(), 0);
        let text =
            crate::jit::sources::get(s.header()).expect("kernels/profiler/stamp.cuh embedded");
        for k in [StampKernel::Stamp, StampKernel::Probe] {
            let name = StampSpec { kernel: k, ..s }.kernel();
            let short = name.rsplit("::").next().unwrap();
            assert!(
                text.contains(&format!("__global__ void {short}(")),
                "{short}"
            );
        }
        assert!(text.contains("%%globaltimer"));
    }

    #[test]
    fn stamp_kernels_compile_without_spills() {
        // JIT-only kernels (not in the precompile sets): compiled here so a broken header fails a test
        if crate::jit::nvrtc::tests::toolchain().is_none() {
            return;
        }
        let specs: Vec<StampSpec> = [crate::arch::Arch::Sm80, crate::arch::Arch::Sm90a]
            .into_iter()
            .flat_map(|arch| {
                [StampKernel::Stamp, StampKernel::Probe].map(|kernel| StampSpec { kernel, arch })
            })
            .collect();
        let reports = crate::jit::precompile::precompile(&specs).unwrap();
        assert_eq!(reports.len(), 4);
        for r in &reports {
            assert!(r.cubin_bytes > 0, "{}", r.config);
        }
        crate::jit::precompile::check_spills(&reports).unwrap();
    }

    #[test]
    fn stamp_functions_without_a_driver() {
        assert_eq!(stamps_release(&[u64::MAX - 1]), 0);
        assert_eq!(stamps_resolve(&[]).unwrap(), Vec::<u64>::new());
        assert!(matches!(
            stamps_resolve(&[u64::MAX - 1]),
            Err(Error::Argument { .. })
        ));
        assert!(matches!(
            globaltimer_probe(0, 0),
            Err(Error::Argument { .. })
        ));
        assert_eq!(stamp_stats().slots, STAMP_SLOTS);
        if !crate::device::cuda_available() {
            assert!(stamp(0, 0).is_err(), "no device: an error, not a stamp");
            assert!(stamp_scoped(0, 0, Scope::Open).is_err());
        }
    }

    #[test]
    fn mark_functions_without_a_driver() {
        assert_eq!(marks_release(&[u64::MAX - 1]), 0);
        assert_eq!(marks_resolve(&[], None).unwrap(), vec![]);
        assert!(matches!(
            marks_resolve(&[u64::MAX - 1], None),
            Err(Error::Argument { .. })
        ));
        assert!(matches!(
            marks_query(&[u64::MAX - 1]),
            Err(Error::Argument { .. })
        ));
        assert_eq!(marks_query(&[]).unwrap(), Vec::<bool>::new());
        if !crate::device::cuda_available() {
            assert!(mark(0, 0).is_err(), "no device: an error, not a mark");
        }
    }
}
