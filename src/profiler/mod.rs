//! The launch recorder and the profiler's timing marks (contract: python/ferroattn/_native.pyi,
//! "profiler: launch records").
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
//!
//! Files: `record` (what a drained record says), `book` (the bookkeeping without the driver),
//! `driver` (events, context binding, the lock), `capture` (the graph-capture checks),
//! `recorder` (the switch, launches, drain) and `marks`.

mod book;
mod capture;
mod driver;
mod marks;
mod record;
mod recorder;

pub use book::{Stats, MAX_MARKS, MAX_RECORDS};
pub use capture::Scope;
pub use marks::{mark, mark_scoped, marks_query, marks_release, marks_resolve};
pub use record::{theoretical_occupancy, Description, KernelAttrs, Resolved};
pub(crate) use recorder::recorded_launch;
pub use recorder::{drain, enabled, set_enabled, stats};
