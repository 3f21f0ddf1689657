//! Marks: single pooled timing events the module hooks record on the caller's stream, resolved
//! into milliseconds from a reference event (ids > 0; 0 means nothing was recorded).

use super::book::unknown_id;
use super::capture::{capturing, scoped_may_record, Scope};
use super::driver::{bind_cached, create_event, ensure_context, lock};
use super::recorder::BOOK;
use crate::error::{CudaResultExt, Result};
use cudarc::driver::{result as cu, sys};

/// Record a mark: a pooled timing event of `device` recorded on `stream` (a raw CUstream of
/// that device, 0 = its legacy default stream) now, in stream order. Makes the primary context
/// of `device` current on this thread first (as a launch does). Returns the mark's id (> 0), or
/// 0 when nothing was recorded: `stream` is capturing a CUDA graph (an event there would join
/// the graph) or [`MAX_MARKS`](super::MAX_MARKS) marks are unresolved (counted in [`Stats::dropped`](super::Stats::dropped)).
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

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
