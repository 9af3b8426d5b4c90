//! Fences of forgotten runs (`Tombstone`), by id for the lookups every command on an unknown
//! run makes, and in the order they were added for their retention. Nothing iterates the hash
//! map: walks (snapshots, expiry) go through the queue.

use crate::ids::RunId;
use crate::state::Tombstone;
use foldhash::fast::FixedState;
use std::collections::{HashMap, VecDeque};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Tombstones {
    /// A fixed seed, as `Runs::by_id` (its hasher changes the speed, never an outcome).
    by_id: HashMap<RunId, Tombstone, FixedState>,
    /// `(stopped_at, id)` of every tombstone, oldest added first: expiry pops from the front,
    /// snapshots walk it all. Retention forgets runs nearly in the order they stopped; one that
    /// stopped before those ahead of it (it took longer to settle) waits for them to expire,
    /// so a fence may be kept a little longer than its retention, never shorter. A queue, not
    /// an ordered set: 24 bytes a tombstone instead of ~50.
    by_age: VecDeque<(u64, RunId)>,
}

impl Tombstones {
    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }

    pub(crate) fn get(&self, id: &RunId) -> Option<&Tombstone> {
        self.by_id.get(id)
    }

    /// Adds the fence of a run just forgotten; a run id has at most one (a live run and a
    /// tombstone never share an id: an admit on a tombstoned id is refused).
    pub(crate) fn insert(&mut self, id: RunId, t: Tombstone) {
        self.by_age.push_back((t.stopped_at, id.clone()));
        let old = self.by_id.insert(id, t);
        assert!(old.is_none(), "one tombstone per run id");
    }

    /// Drops the tombstones of runs stopped at or before `before`, from the front of the
    /// queue: after that their ids are unknown to the gate. Returns how many.
    pub(crate) fn expire(&mut self, before: u64) -> u32 {
        let mut n = 0;
        while self.by_age.front().is_some_and(|(at, _)| *at <= before) {
            let (_, id) = self.by_age.pop_front().expect("checked above");
            self.by_id.remove(&id).expect("indexed tombstones exist");
            n += 1;
        }
        n
    }

    /// Every tombstone, in the order they were added.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&RunId, &Tombstone)> {
        self.by_age.iter().map(|(_, id)| (id, &self.by_id[id]))
    }
}

/// In the order given (a snapshot's); a repeated id is an error of the caller.
impl Tombstones {
    pub(crate) fn try_from_iter(
        items: impl ExactSizeIterator<Item = (RunId, Tombstone)>,
    ) -> Result<Tombstones, RunId> {
        let mut t = Tombstones {
            by_id: HashMap::with_capacity_and_hasher(items.len(), FixedState::default()),
            by_age: VecDeque::with_capacity(items.len()),
        };
        for (id, tomb) in items {
            if t.by_id.contains_key(&id) {
                return Err(id);
            }
            t.insert(id, tomb);
        }
        Ok(t)
    }
}
