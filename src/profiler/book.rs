//! The recorder's bookkeeping without the driver: pending records, event pools per device,
//! unresolved marks and the counters. `E` is the event type (a driver event in the
//! process-wide recorder; plain numbers in the tests), so all of it is tested on CPU.

use super::record::Description;
use crate::error::Result;
use std::collections::BTreeMap;

/// Remove the entries `ids` (in that order) from `book` and return their values. All or
/// nothing: the first id that is not in `book` (never added, already taken, or listed twice)
/// leaves `book` as it was and is returned as the error.
pub(super) fn take_all<V>(book: &mut BTreeMap<u64, V>, ids: &[u64]) -> std::result::Result<Vec<V>, u64> {
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

/// ArgumentError naming `arg` ("marks") for an id that `maker` ("profiler_mark") did not return
/// or that is resolved or released already.
pub(super) fn unknown_id(arg: &str, maker: &str, id: u64) -> crate::error::Error {
    crate::error::Error::argument(
        arg,
        format!("ids returned by {maker} that are not resolved or released yet (each once)"),
        id,
    )
}

/// A record waiting for its events to be resolved. `E` is the event type (a driver event in
/// the process-wide recorder; plain numbers in the bookkeeping tests).
#[derive(Debug)]
pub(super) struct Pending<E> {
    pub(super) seq: u64,
    pub(super) desc: Description,
    pub(super) start: E,
    pub(super) end: E,
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
pub(super) struct Book<E> {
    records: Vec<Pending<E>>,
    pub(super) pools: BTreeMap<i32, Vec<E>>,
    next_seq: u64,
    pub(super) skipped_capture: u64,
    pub(super) dropped: u64,
    cap: usize,
    /// Unresolved marks: id -> (device, event). Ids count up from 1 (0 means "no mark").
    pub(super) marks: BTreeMap<u64, (i32, E)>,
    next_mark: u64,
    mark_cap: usize,
}

impl<E> Book<E> {
    pub(super) const fn new(cap: usize, mark_cap: usize) -> Self {
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
    pub(super) fn admit(&mut self) -> bool {
        if self.records.len() >= self.cap {
            self.dropped += 1;
            return false;
        }
        true
    }

    /// One event of `device`: from its pool, else made by `create`.
    pub(super) fn take_event(&mut self, device: i32, create: impl FnOnce() -> Result<E>) -> Result<E> {
        match self.pools.entry(device).or_default().pop() {
            Some(e) => Ok(e),
            None => create(),
        }
    }

    /// Room for one more mark? Counts a drop when not.
    pub(super) fn admit_mark(&mut self) -> bool {
        if self.marks.len() >= self.mark_cap {
            self.dropped += 1;
            return false;
        }
        true
    }

    /// Keep a recorded mark; returns its id (> 0).
    pub(super) fn add_mark(&mut self, device: i32, event: E) -> u64 {
        let id = self.next_mark;
        self.next_mark += 1;
        self.marks.insert(id, (device, event));
        id
    }

    /// Remove the marks `ids` (in that order) and return their (device, event). All or nothing:
    /// an id that is not an unresolved mark (never made, already resolved or released, or
    /// listed twice) leaves the book as it was and is returned as the error.
    pub(super) fn take_marks(&mut self, ids: &[u64]) -> std::result::Result<Vec<(i32, E)>, u64> {
        take_all(&mut self.marks, ids)
    }

    /// Forget the marks among `ids` that are unresolved (others are ignored) and pool their
    /// events. Returns how many were released.
    pub(super) fn release_marks(&mut self, ids: &[u64]) -> usize {
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
    pub(super) fn take_events(
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

    pub(super) fn give_back(&mut self, device: i32, events: impl IntoIterator<Item = E>) {
        self.pools.entry(device).or_default().extend(events);
    }

    /// Keep a record; returns its sequence number.
    pub(super) fn push(&mut self, desc: Description, start: E, end: E) -> u64 {
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

    pub(super) fn take(&mut self) -> Vec<Pending<E>> {
        std::mem::take(&mut self.records)
    }

    pub(super) fn stats(&self, enabled: bool) -> Stats {
        Stats {
            enabled,
            pending: self.records.len(),
            skipped_capture: self.skipped_capture,
            dropped: self.dropped,
            marks: self.marks.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::launch_record::Work;
    use super::super::record::KernelAttrs;

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
}
