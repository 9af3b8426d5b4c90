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
    /// Runs that are stopped and not compacted yet, by the time they stopped: retention visits
    /// these, not every run. Derived from the runs (rebuilt when a snapshot is loaded), kept by
    /// `insert` and `stopped`, and compared by `==`, so a drift shows in every snapshot round
    /// trip of the tests.
    uncompacted: BTreeSet<(u64, RunId)>,
}

/// The entry of `run` in `Runs::uncompacted`, if it has one.
fn uncompacted_entry(id: &RunId, run: &Run) -> Option<(u64, RunId)> {
    match &run.stop {
        Some(stop) if !run.compacted => Some((stop.at, id.clone())),
        _ => None,
    }
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
        if let Some(entry) = uncompacted_entry(&id, &run) {
            self.uncompacted.insert(entry);
        }
        let old = self.by_id.insert(id.clone(), Box::new(run));
        match &old {
            None => {
                self.order.insert(id);
            }
            Some(old) => {
                if let Some(entry) = uncompacted_entry(&id, old) {
                    self.uncompacted.remove(&entry);
                }
            }
        }
        old.map(|r| *r)
    }

    /// Notes that run `id` has just stopped (its `stop` was set): retention will visit it.
    pub(crate) fn stopped(&mut self, id: &RunId) {
        if let Some(entry) = self.by_id.get(id).and_then(|r| uncompacted_entry(id, r)) {
            self.uncompacted.insert(entry);
        }
    }

    /// Calls `compact` on every run that stopped at or before `before` and is not compacted,
    /// oldest stop first; a run for which it returns true is compacted and not visited again.
    /// Work is proportional to the runs awaiting compaction, not to all runs.
    pub(crate) fn compact_stopped(
        &mut self,
        before: u64,
        mut compact: impl FnMut(&mut Run) -> bool,
    ) -> u32 {
        // The due entries are a prefix of the index: split them off whole (one walk, no
        // rebalancing per entry) and put back the few that stay (runs still finalizing).
        let first_not_due = self
            .uncompacted
            .iter()
            .find(|(at, _)| *at > before)
            .cloned();
        let due = match first_not_due {
            Some(entry) => {
                let rest = self.uncompacted.split_off(&entry);
                std::mem::replace(&mut self.uncompacted, rest)
            }
            None => std::mem::take(&mut self.uncompacted),
        };
        let mut n = 0;
        for entry in due {
            let run = self
                .by_id
                .get_mut(&entry.1)
                .expect("an uncompacted entry names a run");
            if compact(run) {
                debug_assert!(run.compacted, "compact sets the flag");
                n += 1;
            } else {
                self.uncompacted.insert(entry);
            }
        }
        n
    }

    /// Every run, in id order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&RunId, &Run)> {
        self.order.iter().map(|id| (id, &*self.by_id[id]))
    }

    /// The runs after `after` (all of them without it), in id order: a listing's next page.
    pub(crate) fn iter_after(&self, after: Option<&RunId>) -> impl Iterator<Item = (&RunId, &Run)> {
        use std::ops::Bound;
        let from = after.map_or(Bound::Unbounded, Bound::Excluded);
        self.order
            .range((from, Bound::Unbounded))
            .map(|id| (id, &*self.by_id[id]))
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
        let uncompacted = by_id
            .iter()
            .filter_map(|(id, run)| uncompacted_entry(id, run))
            .collect();
        Runs {
            by_id,
            order: ids.into_iter().collect(),
            uncompacted,
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
        self.order == other.order
            && self.uncompacted == other.uncompacted
            && self.iter().all(|(id, run)| other.get(id) == Some(run))
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

    #[test]
    fn compaction_through_the_index_equals_a_walk_of_every_run() {
        use crate::state::Stop;
        use crate::vocab::{RunState, StopCause};
        let mut seed = 7u64;
        let mut next = move |n: u64| {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (seed >> 33) % n
        };
        for round in 0..50 {
            let mut runs = Runs::default();
            for i in 0..200 {
                let mut run = Run::new(i, None, None);
                match next(4) {
                    0 => {} // running, never stopped
                    k => {
                        run.stop = Some(Stop {
                            cause: StopCause::Cancelled,
                            reason: None,
                            by: None,
                            at: next(1000),
                            from: None,
                        });
                        run.state = if k == 1 {
                            RunState::Finalizing
                        } else {
                            RunState::Cancelled
                        };
                        run.compacted = k == 3 && next(2) == 0;
                    }
                }
                let stop_later = run.stop.is_none() && next(3) == 0;
                runs.insert(id(&format!("r{round}-{i}")), run);
                if stop_later {
                    // Stopped after it was inserted, as `stop_subtree` does.
                    let rid = id(&format!("r{round}-{i}"));
                    let run = runs.get_mut(&rid).expect("inserted");
                    run.stop = Some(Stop {
                        cause: StopCause::Closed,
                        reason: None,
                        by: None,
                        at: next(1000),
                        from: None,
                    });
                    run.state = RunState::Completed;
                    runs.stopped(&rid);
                }
            }
            let compact = |run: &mut Run| {
                if !run.state.is_terminal() {
                    return false;
                }
                run.compacted = true;
                true
            };
            for before in [100, 500, 500, 999] {
                let mut walked = runs.clone();
                let mut expected = 0;
                for (_, run) in walked.by_id.iter_mut() {
                    if !run.compacted && run.stop.as_ref().is_some_and(|s| s.at <= before) {
                        expected += u32::from(compact(run));
                    }
                }
                let n = runs.compact_stopped(before, compact);
                assert_eq!(n, expected, "round {round}, before {before}");
                let walked_runs: Vec<_> =
                    walked.iter().map(|(k, r)| (k.clone(), r.clone())).collect();
                let rebuilt: Runs = walked_runs.into_iter().collect();
                assert_eq!(
                    runs, rebuilt,
                    "the same runs compacted; the index matches a rebuild"
                );
            }
        }
    }
}
