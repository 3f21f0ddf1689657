//! The stamps' slot bookkeeping without the driver: unresolved stamps (id -> (device, slot)),
//! slot counters per device and drops, tested on CPU.

use super::book::take_all;
use std::collections::BTreeMap;

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
pub(super) struct StampBook {
    pub(super) slots: u32,
    devices: BTreeMap<i32, SlotState>,
    pub(super) stamps: BTreeMap<u64, (i32, u32)>,
    next_id: u64,
    pub(super) dropped: u64,
}

impl StampBook {
    pub(super) const fn new(slots: u32) -> Self {
        StampBook {
            slots,
            devices: BTreeMap::new(),
            stamps: BTreeMap::new(),
            next_id: 1,
            dropped: 0,
        }
    }

    /// A new stamp of `device`: (id > 0, slot), or None (every slot unresolved; a drop).
    pub(super) fn alloc(&mut self, device: i32) -> Option<(u64, u32)> {
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
    pub(super) fn unalloc(&mut self, id: u64) {
        if let Some((device, _)) = self.stamps.remove(&id) {
            self.finish([device]);
        }
    }

    /// Remove the stamps `ids` (in that order) and return their (device, slot); their slots stay
    /// reserved until [`finish`](Self::finish). All or nothing: an id that is not an unresolved
    /// stamp (never made, resolved, released, or listed twice) leaves the book as it was and is
    /// returned as the error.
    pub(super) fn take(&mut self, ids: &[u64]) -> std::result::Result<Vec<(i32, u32)>, u64> {
        take_all(&mut self.stamps, ids)
    }

    /// The slots of taken stamps (one device entry per stamp) are free again.
    pub(super) fn finish(&mut self, devices: impl IntoIterator<Item = i32>) {
        for d in devices {
            if let Some(st) = self.devices.get_mut(&d) {
                st.live = st.live.saturating_sub(1);
            }
        }
    }

    /// Forget the unresolved stamps among `ids` (others ignored); how many.
    pub(super) fn release(&mut self, ids: &[u64]) -> usize {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
