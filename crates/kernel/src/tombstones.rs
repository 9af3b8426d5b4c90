//! Fences of forgotten runs (`Tombstone`), by id for the lookups every command on an unknown
//! run makes, and by the time the run stopped for their retention. Nothing iterates the hash
//! map: walks (snapshots, expiry) go through the ordered index.

use crate::ids::RunId;
use crate::state::Tombstone;
use foldhash::fast::FixedState;
use std::collections::{BTreeSet, HashMap};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Tombstones {
    /// A fixed seed, as `Runs::by_id` (its hasher changes the speed, never an outcome).
    by_id: HashMap<RunId, Tombstone, FixedState>,
    /// `(stopped_at, id)` of every tombstone: expiry visits a prefix, snapshots walk it all.
    by_age: BTreeSet<(u64, RunId)>,
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
        self.by_age.insert((t.stopped_at, id.clone()));
        let old = self.by_id.insert(id, t);
        assert!(old.is_none(), "one tombstone per run id");
    }

    /// Drops the tombstones of runs stopped at or before `before`, oldest first: after that
    /// their ids are unknown to the gate. Returns how many.
    pub(crate) fn expire(&mut self, before: u64) -> u32 {
        let mut n = 0;
        while self.by_age.first().is_some_and(|(at, _)| *at <= before) {
            let (_, id) = self.by_age.pop_first().expect("checked above");
            self.by_id.remove(&id).expect("indexed tombstones exist");
            n += 1;
        }
        n
    }

    /// Every tombstone, oldest stop first (ties by id).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&RunId, &Tombstone)> {
        self.by_age.iter().map(|(_, id)| (id, &self.by_id[id]))
    }
}

impl FromIterator<(RunId, Tombstone)> for Tombstones {
    fn from_iter<I: IntoIterator<Item = (RunId, Tombstone)>>(items: I) -> Tombstones {
        let mut t = Tombstones::default();
        for (id, tomb) in items {
            if let Some(old) = t.by_id.remove(&id) {
                t.by_age.remove(&(old.stopped_at, id.clone()));
            }
            t.insert(id, tomb);
        }
        t
    }
}
