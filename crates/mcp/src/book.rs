//! The gateway's book of tasks (both forms: SEP-2663's and 2025-11-25's own): whose each is,
//! and the bounds on them (`[gateway]`): `tasks_running_max` running, `tasks_kept_max` kept
//! (running or ended: an ended task is kept its TTL after it ends, for its client) and a
//! principal's share, `tasks_per_principal_max` kept, so that one principal cannot take tasks
//! from the others. rmcp's store holds the tasks themselves and forgets them past their TTL
//! without telling; whenever a task is asked for, the book looks up in the store each task the
//! store may have forgotten (its TTL after it started, then an eighth of its TTL later each
//! time), so a principal's share frees up as its tasks are forgotten, and no entry outlives its
//! task past the next ask. The book holds at most `tasks_kept_max` entries.

use crate::config::Gateway as Bounds;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Which form a task is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// SEP-2663's tasks extension (rmcp's own requests).
    Extension,
    /// 2025-11-25's own form; `cancelled`: `tasks/cancel` ended it (it then stays `cancelled`).
    Own { cancelled: bool },
}

#[derive(Debug)]
pub struct Kept {
    pub owner: String,
    pub form: Form,
    ttl: Duration,
    /// When to look in the store whether it still holds the task.
    look_at: Instant,
}

/// Why no task can start now.
#[derive(Debug, PartialEq, Eq)]
pub enum Full {
    Running(usize),
    Kept(usize),
    Share { owner: String, share: usize },
}

impl std::fmt::Display for Full {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Full::Running(n) => write!(
                f,
                "{n} tasks are running on this gateway (`tasks_running_max`)"
            ),
            Full::Kept(n) => write!(
                f,
                "{n} tasks are kept on this gateway (`tasks_kept_max`; an ended task is kept its TTL)"
            ),
            Full::Share { owner, share } => write!(
                f,
                "principal {owner:?} keeps {share} tasks on this gateway, its share \
                 (`tasks_per_principal_max`; an ended task is kept its TTL)"
            ),
        }
    }
}

/// What the store says of a task: `None` once it forgot it.
pub type Lookup<'a> = &'a dyn Fn(&str) -> Option<()>;

#[derive(Debug, Default)]
pub struct Book {
    kept: BTreeMap<String, Kept>,
    /// Tasks kept by each principal (only principals with some).
    per_owner: BTreeMap<String, usize>,
    /// Slots promised to calls still being admitted (2025-11-25's form), by principal.
    reserved: BTreeMap<String, usize>,
    reserved_total: usize,
}

/// How often a task the store still holds past its first look is looked up again.
const LOOK_AGAIN_MIN: Duration = Duration::from_millis(10);

impl Book {
    /// Whether `owner` may have another task now, `running` running in the store; forgets
    /// first what the store let go of.
    pub fn room(
        &mut self,
        owner: &str,
        bounds: &Bounds,
        running: usize,
        store: Lookup,
    ) -> Result<(), Full> {
        if running + self.reserved_total >= bounds.tasks_running_max {
            return Err(Full::Running(bounds.tasks_running_max));
        }
        self.forget(store, Instant::now());
        let share = bounds.tasks_per_principal_max;
        let mine = self.per_owner.get(owner).copied().unwrap_or(0)
            + self.reserved.get(owner).copied().unwrap_or(0);
        if mine >= share {
            return Err(Full::Share {
                owner: owner.to_string(),
                share,
            });
        }
        if self.kept.len() + self.reserved_total >= bounds.tasks_kept_max {
            return Err(Full::Kept(bounds.tasks_kept_max));
        }
        Ok(())
    }

    /// Forgets the tasks the store let go of, looking up only those it may have.
    pub fn forget(&mut self, store: Lookup, now: Instant) {
        let due: Vec<String> = self
            .kept
            .iter()
            .filter(|(_, k)| k.look_at <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in due {
            if store(&id).is_some() {
                if let Some(k) = self.kept.get_mut(&id) {
                    k.look_at = now + (k.ttl / 8).max(LOOK_AGAIN_MIN);
                }
            } else {
                self.remove(&id);
            }
        }
    }

    fn remove(&mut self, id: &str) {
        let Some(k) = self.kept.remove(id) else {
            return;
        };
        if let Some(n) = self.per_owner.get_mut(&k.owner) {
            *n -= 1;
            if *n == 0 {
                self.per_owner.remove(&k.owner);
            }
        }
    }

    /// Promises `owner` a slot (after `room`), until `keep` or `unreserve`.
    pub fn reserve(&mut self, owner: &str) {
        *self.reserved.entry(owner.to_string()).or_insert(0) += 1;
        self.reserved_total += 1;
    }

    pub fn unreserve(&mut self, owner: &str) {
        if let Some(n) = self.reserved.get_mut(owner) {
            *n -= 1;
            if *n == 0 {
                self.reserved.remove(owner);
            }
            self.reserved_total -= 1;
        }
    }

    /// Books a task that just started, living `ttl`.
    pub fn keep(&mut self, id: String, owner: String, form: Form, ttl: Duration) {
        *self.per_owner.entry(owner.clone()).or_insert(0) += 1;
        let look_at = Instant::now() + ttl;
        let old = self.kept.insert(
            id,
            Kept {
                owner,
                form,
                ttl,
                look_at,
            },
        );
        debug_assert!(old.is_none(), "a task id is booked once");
    }

    pub fn get(&self, id: &str) -> Option<&Kept> {
        self.kept.get(id)
    }

    pub fn get_mut(&mut self, id: &str) -> Option<&mut Kept> {
        self.kept.get_mut(id)
    }

    /// `owner`'s tasks, by id.
    pub fn owned_by<'a>(&'a self, owner: &'a str) -> impl Iterator<Item = (&'a String, &'a Kept)> {
        self.kept.iter().filter(move |(_, k)| k.owner == owner)
    }

    /// How many tasks are booked, and how many of them are `owner`'s.
    pub fn counts(&self, owner: &str) -> (usize, usize) {
        (
            self.kept.len(),
            self.per_owner.get(owner).copied().unwrap_or(0),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounds() -> Bounds {
        Bounds {
            tasks_running_max: 3,
            tasks_kept_max: 4,
            tasks_per_principal_max: 2,
            ..Bounds::default()
        }
    }

    #[test]
    fn a_share_frees_up_once_the_store_forgot_its_tasks_and_not_before() {
        let b = bounds();
        let mut book = Book::default();
        let ttl = Duration::from_millis(1000);
        let held = |_: &str| Some(());
        let gone = |_: &str| None;
        book.keep("a1".into(), "alice".into(), Form::Extension, ttl);
        book.keep(
            "a2".into(),
            "alice".into(),
            Form::Own { cancelled: false },
            ttl,
        );
        assert!(matches!(
            book.room("alice", &b, 0, &held),
            Err(Full::Share { .. })
        ));
        assert_eq!(book.room("bob", &b, 0, &held), Ok(()));
        // Reserved slots count as tasks, for the share and the bounds.
        book.reserve("bob");
        book.reserve("bob");
        assert!(matches!(
            book.room("bob", &b, 0, &held),
            Err(Full::Share { .. })
        ));
        assert_eq!(book.room("carol", &b, 1, &held), Err(Full::Running(3)));
        assert_eq!(book.room("carol", &b, 0, &held), Err(Full::Kept(4)));
        book.unreserve("bob");
        book.unreserve("bob");
        // Not looked up before its TTL: the store may hold it still.
        book.forget(&gone, Instant::now());
        assert_eq!(book.counts("alice"), (2, 2));
        // Past it: what the store still holds stays, what it forgot is forgotten, entry and count.
        let later = Instant::now() + ttl;
        book.forget(&|id: &str| (id == "a1").then_some(()), later);
        assert_eq!(book.counts("alice"), (1, 1));
        assert!(book.get("a2").is_none() && book.get("a1").is_some());
        book.forget(&gone, later + ttl);
        assert_eq!(book.counts("alice"), (0, 0));
        assert!(book.per_owner.is_empty() && book.reserved.is_empty());
        assert_eq!(book.room("alice", &b, 0, &held), Ok(()));
    }
}
