//! Whether a stream is capturing a CUDA graph (nothing is recorded there), and the per root
//! call shortcut of that check on the legacy stream ([`Scope`]) that the module hooks use.

use cudarc::driver::{result as cu, sys};

/// Whether `stream` is capturing a graph (an error, e.g. the legacy stream while another
/// stream captures in global mode, counts as capturing: recording there is not safe).
pub(super) fn capturing(stream: sys::CUstream) -> bool {
    // SAFETY: the caller's stream handle, as the launch itself uses it.
    match unsafe { cu::stream::is_capturing(stream) } {
        Ok(status) => status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE,
        Err(_) => true,
    }
}

/// Where a mark sits in a hooked root call (the outermost profiled module call of a forward):
/// what [`mark_scoped`](super::mark_scoped) may skip.
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

/// Whether a launch on `stream` may skip its capture check: the legacy stream (0 or
/// CU_STREAM_LEGACY) inside a hooked root call whose check found no capture (see
/// [`scoped_may_record`]).
pub(super) fn legacy_clear(stream: u64) -> bool {
    (stream == 0 || stream == 1) && LEGACY_CLEAR.with(|c| c.get())
}

/// The capture check of [`mark_scoped`](super::mark_scoped): whether a mark at `scope` may be
/// recorded on `stream` now (false: the stream is capturing, or its check failed).
pub(super) fn scoped_may_record(stream: u64, scope: Scope) -> bool {
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
