//! The gate's runs: a hash index for the lookups every command makes (several per command, a
//! `BTreeMap` of string ids made each one ~20–30 string comparisons at 1e5 runs) beside an
//! ordered set of the same ids for everything that walks runs (snapshots, listings, retention),
//! so a walk's order never depends on a hash. Nothing iterates the hash map.

use crate::ids::RunId;
use crate::state::Run;
use foldhash::fast::FixedState;
use std::collections::{BTreeSet, HashMap};
use std::fmt;

/// Runs by id; walks are in id order. Runs are only ever added (retention compacts a run's
/// effects, it never forgets the run).
#[derive(Clone, Default)]
pub(crate) struct Runs {
    /// Lookups. A fixed seed: the kernel has no randomness, and since nothing iterates this map
    /// its hasher can change only the speed, never an outcome. (Whoever knows the seed could pick
    /// colliding run ids; only authenticated agents create runs, at most `runs_max`.)
    ///
    /// Boxed: a slot is 24 bytes, so the table's spare capacity and its rehashing while it grows
    /// cost little (a `Run` is ~300 bytes).
    by_id: HashMap<RunId, Box<Run>, FixedState>,
    /// The same ids, for walks in id order. A `RunId` is shared (`Arc`), so the second copy of
    /// each id is a pointer, not a string.
    order: BTreeSet<RunId>,
}

impl Runs {
    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }

    pub(crate) fn get(&self, id: &RunId) -> Option<&Run> {
        self.by_id.get(id).map(|r| &**r)
    }

    pub(crate) fn get_mut(&mut self, id: &RunId) -> Option<&mut Run> {
        self.by_id.get_mut(id).map(|r| &mut **r)
    }

    pub(crate) fn get_key_value(&self, id: &RunId) -> Option<(&RunId, &Run)> {
        self.by_id.get_key_value(id).map(|(k, r)| (k, &**r))
    }

    pub(crate) fn contains_key(&self, id: &RunId) -> bool {
        self.by_id.contains_key(id)
    }

    /// Inserts or replaces, like `BTreeMap::insert`.
    pub(crate) fn insert(&mut self, id: RunId, run: Run) -> Option<Run> {
        let old = self.by_id.insert(id.clone(), Box::new(run));
        if old.is_none() {
            self.order.insert(id);
        }
        old.map(|r| *r)
    }

    /// Every run, in id order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&RunId, &Run)> {
        self.order.iter().map(|id| (id, &*self.by_id[id]))
    }

    /// Calls `f` on every run, in id order.
    pub(crate) fn for_each_mut(&mut self, mut f: impl FnMut(&RunId, &mut Run)) {
        for id in &self.order {
            f(id, self.by_id.get_mut(id).expect("ordered ids are indexed"));
        }
    }
}

/// Like repeated `insert`s (a later duplicate replaces the run), but the ordered index is built
/// in bulk: a snapshot lists its runs in id order.
impl FromIterator<(RunId, Run)> for Runs {
    fn from_iter<I: IntoIterator<Item = (RunId, Run)>>(items: I) -> Runs {
        let items = items.into_iter();
        let mut by_id =
            HashMap::with_capacity_and_hasher(items.size_hint().0, FixedState::default());
        let mut ids = Vec::with_capacity(items.size_hint().0);
        for (id, run) in items {
            ids.push(id.clone());
            by_id.insert(id, Box::new(run));
        }
        Runs {
            by_id,
            order: ids.into_iter().collect(),
        }
    }
}

impl std::ops::Index<&RunId> for Runs {
    type Output = Run;

    fn index(&self, id: &RunId) -> &Run {
        &self.by_id[id]
    }
}

impl PartialEq for Runs {
    fn eq(&self, other: &Runs) -> bool {
        self.order == other.order && self.iter().all(|(id, run)| other.get(id) == Some(run))
    }
}

impl Eq for Runs {}

/// Formats as the ordered map it stands for.
impl fmt::Debug for Runs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> RunId {
        RunId::new(s).expect("valid")
    }

    #[test]
    fn walks_are_in_id_order_whatever_the_insertion_order() {
        let mut a = Runs::default();
        let mut b = Runs::default();
        for (i, s) in ["b", "c", "a", "aa"].into_iter().enumerate() {
            assert!(a.insert(id(s), Run::new(i as u64, None, None)).is_none());
        }
        for (i, s) in [(2, "a"), (3, "aa"), (0, "b"), (1, "c")] {
            b.insert(id(s), Run::new(i, None, None));
        }
        let ids: Vec<&str> = a.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(ids, ["a", "aa", "b", "c"]);
        assert_eq!(a, b);
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
        assert!(format!("{a:?}").starts_with("{\"a\": Run {"));
    }

    #[test]
    fn collecting_is_inserting_one_by_one() {
        let items = [("b", 1), ("a", 2), ("b", 3), ("c", 4)];
        let mut one_by_one = Runs::default();
        for (s, t) in items {
            one_by_one.insert(id(s), Run::new(t, None, None));
        }
        let collected: Runs = items
            .into_iter()
            .map(|(s, t)| (id(s), Run::new(t, None, None)))
            .collect();
        assert_eq!(collected, one_by_one);
        assert_eq!(collected.len(), 3);
        assert_eq!(collected[&id("b")].created_at, 3);
    }

    #[test]
    fn insert_replaces_like_a_map() {
        let mut runs = Runs::default();
        runs.insert(id("r"), Run::new(1, None, None));
        let old = runs.insert(id("r"), Run::new(2, None, None));
        assert_eq!(old.map(|r| r.created_at), Some(1));
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[&id("r")].created_at, 2);
        assert_eq!(runs.iter().count(), 1);
    }
}
