//! The gate's runs: a hash index for the lookups every command makes (several per command, a
//! `BTreeMap` of string ids made each one ~20–30 string comparisons at 1e5 runs) beside an
//! ordered set of the same ids for everything that walks runs (snapshots, listings, retention),
//! so a walk's order never depends on a hash. Nothing iterates the hash map.

use crate::ids::RunId;
use crate::state::Run;
use foldhash::fast::FixedState;
use std::collections::{BTreeSet, HashMap};
use std::fmt;

/// Runs by id; walks are in id order. Retention removes stopped runs (`forget_stopped`).
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
    /// Every stopped run, by the time it stopped: retention visits these, not every run.
    /// Derived from the runs (rebuilt when a snapshot is loaded), kept by `insert`, `stopped`
    /// and `forget_stopped`, and compared by `==`, so a drift shows in every snapshot round
    /// trip of the tests.
    stopped: BTreeSet<(u64, RunId)>,
}

/// The entry of `run` in `Runs::stopped`, if it has one.
fn stopped_entry(id: &RunId, run: &Run) -> Option<(u64, RunId)> {
    run.stop.as_ref().map(|stop| (stop.at, id.clone()))
}

/// What retention does with a stopped run that is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Due {
    /// Not yet (still finalizing): visit it again next time.
    Keep,
    Forget,
    /// Not this one nor any later one this time (no room for its tombstone).
    Halt,
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
        if let Some(entry) = stopped_entry(&id, &run) {
            self.stopped.insert(entry);
        }
        let old = self.by_id.insert(id.clone(), Box::new(run));
        match &old {
            None => {
                self.order.insert(id);
            }
            Some(old) => {
                if let Some(entry) = stopped_entry(&id, old) {
                    self.stopped.remove(&entry);
                }
            }
        }
        old.map(|r| *r)
    }

    /// Notes that run `id` has just stopped (its `stop` was set): retention will visit it.
    pub(crate) fn stopped(&mut self, id: &RunId) {
        if let Some(entry) = self.by_id.get(id).and_then(|r| stopped_entry(id, r)) {
            self.stopped.insert(entry);
        }
    }

    /// Visits the runs that stopped at or before `before`, oldest stop first, and removes
    /// those `due` says to forget; returns them in that order. Work is proportional to the
    /// runs visited, never to all runs.
    pub(crate) fn forget_stopped(
        &mut self,
        before: u64,
        mut due: impl FnMut(&Run) -> Due,
    ) -> Vec<(RunId, Run)> {
        let mut kept = Vec::new();
        let mut forgotten = Vec::new();
        while self.stopped.first().is_some_and(|(at, _)| *at <= before) {
            let entry = self.stopped.pop_first().expect("checked above");
            let run = self
                .by_id
                .get(&entry.1)
                .expect("a stopped entry names a run");
            match due(run) {
                Due::Keep => kept.push(entry),
                Due::Forget => {
                    let run = self.by_id.remove(&entry.1).expect("exists");
                    self.order.remove(&entry.1);
                    forgotten.push((entry.1, *run));
                }
                Due::Halt => {
                    kept.push(entry);
                    break;
                }
            }
        }
        self.stopped.extend(kept);
        forgotten
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
        let stopped = by_id
            .iter()
            .filter_map(|(id, run)| stopped_entry(id, run))
            .collect();
        Runs {
            by_id,
            order: ids.into_iter().collect(),
            stopped,
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
            && self.stopped == other.stopped
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
    fn forgetting_through_the_index_equals_a_walk_of_every_run() {
        use crate::state::Stop;
        use crate::vocab::{RunState, StopCause};
        let mut seed = 7u64;
        let mut next = move |n: u64| {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (seed >> 33) % n
        };
        let stop = |at| Stop {
            cause: StopCause::Cancelled,
            reason: None,
            by: None,
            at,
            from: None,
        };
        for round in 0..50 {
            let mut runs = Runs::default();
            for i in 0..200 {
                let mut run = Run::new(i, None, None);
                match next(3) {
                    0 => {} // running, never stopped
                    k => {
                        run.stop = Some(stop(next(1000)));
                        run.state = if k == 1 {
                            RunState::Finalizing
                        } else {
                            RunState::Cancelled
                        };
                    }
                }
                let stop_later = run.stop.is_none() && next(3) == 0;
                runs.insert(id(&format!("r{round}-{i}")), run);
                if stop_later {
                    // Stopped after it was inserted, as `stop_subtree` does.
                    let rid = id(&format!("r{round}-{i}"));
                    let run = runs.get_mut(&rid).expect("inserted");
                    run.stop = Some(stop(next(1000)));
                    run.state = RunState::Completed;
                    runs.stopped(&rid);
                }
            }
            let due = |run: &Run| {
                if run.state.is_terminal() {
                    Due::Forget
                } else {
                    Due::Keep
                }
            };
            for before in [100, 500, 500, 999] {
                let expected: Vec<RunId> = {
                    let mut v: Vec<(u64, RunId)> = runs
                        .iter()
                        .filter(|(_, r)| r.state.is_terminal())
                        .filter_map(|(k, r)| r.stop.as_ref().map(|s| (s.at, k.clone())))
                        .filter(|(at, _)| *at <= before)
                        .collect();
                    v.sort();
                    v.into_iter().map(|(_, k)| k).collect()
                };
                let gone: Vec<RunId> = runs
                    .forget_stopped(before, due)
                    .into_iter()
                    .map(|(k, _)| k)
                    .collect();
                assert_eq!(gone, expected, "round {round}, before {before}");
                let rest: Vec<_> = runs.iter().map(|(k, r)| (k.clone(), r.clone())).collect();
                let rebuilt: Runs = rest.into_iter().collect();
                assert_eq!(runs, rebuilt, "the index matches a rebuild");
            }
            // A halt keeps the run it halted at and every later one.
            let mut n = 0;
            let first_two = runs.forget_stopped(u64::MAX, |_| {
                n += 1;
                if n <= 2 { Due::Forget } else { Due::Halt }
            });
            assert!(first_two.len() <= 2);
            let rest: Vec<_> = runs.iter().map(|(k, r)| (k.clone(), r.clone())).collect();
            assert_eq!(runs, rest.into_iter().collect::<Runs>(), "after a halt");
        }
    }
}
