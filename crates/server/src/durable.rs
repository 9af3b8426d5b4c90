//! Durable-before-visible: every reply and event carries the ledger position it depends on and
//! is written to the client only once that position is on stable storage (G6).

use crate::answer::Out;
use crate::outbox::Outbox;
use tokio::sync::watch;

pub use crate::answer::After;

/// Published by the ledger's sync thread.
#[derive(Debug, Clone, Default)]
pub struct DurableState {
    pub generation: u64,
    /// Highest durable seq of this generation.
    pub seq: u64,
    /// The generation failed (fail closed); the core is recovering.
    pub failed: bool,
    /// Last durable seq of each ended generation, indexed by generation.
    pub ended: Vec<u64>,
}

/// What a waiting reply learns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    Durable,
    /// Its record did not reach the disk: the client gets `storage_unavailable`.
    Lost,
}

/// Waits until `after` is durable, or known lost.
pub async fn wait(rx: &mut watch::Receiver<DurableState>, after: After) -> Durability {
    if after.seq == 0 {
        return Durability::Durable;
    }
    let mut verdict = None;
    let _ = rx
        .wait_for(|s| {
            verdict = decide(s, after);
            verdict.is_some()
        })
        .await;
    verdict.unwrap_or(Durability::Lost)
}

pub fn decide(s: &DurableState, after: After) -> Option<Durability> {
    if after.generation == s.generation {
        if s.seq >= after.seq {
            Some(Durability::Durable)
        } else if s.failed {
            Some(Durability::Lost)
        } else {
            None
        }
    } else {
        let end = s.ended.get(after.generation as usize).copied().unwrap_or(0);
        Some(if end >= after.seq {
            Durability::Durable
        } else {
            Durability::Lost
        })
    }
}

/// Replies and events whose record is not durable yet. Whichever thread learns that the ledger
/// is durable further — the ledger's sync thread after an fdatasync, or the core after syncing a
/// light burst itself — hands what that releases to the connections, in order, straight to their
/// sockets where it can ([`Outbox::release`]). Neither the IO thread nor the connections' writers
/// are woken for it: under load that moves the reply writes off the IO thread, which parses the
/// requests, onto the sync thread, which otherwise waits for the disk; for a lone request it
/// spares a thread handoff.
#[derive(Debug, Default)]
pub struct Release {
    inner: std::sync::Mutex<ReleaseInner>,
}

#[derive(Debug, Default)]
struct ReleaseInner {
    generation: u64,
    durable: u64,
    /// The generation failed: nothing past `durable` will ever be durable in it.
    failed: bool,
    /// In hand-over order: the core is the only producer. An item is released once its seq is
    /// durable and everything before it is released.
    queue: std::collections::VecDeque<(u64, Outbox, Out)>,
    /// A thread is handing released items over (outside the lock): no item may overtake them,
    /// and it takes whatever else becomes durable before it stops.
    delivering: bool,
    /// A planted bug for the tests that must catch it (off unless `plant_early_release`): a
    /// reply waits for one record less than it depends on.
    planted_early: bool,
}

impl Release {
    fn lock(&self) -> std::sync::MutexGuard<'_, ReleaseInner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sends `item` now if `after` is durable and nothing is queued before it, else once it
    /// and everything before it are durable.
    ///
    /// Nothing queued is ever stranded: while no thread is delivering, every queued item but
    /// the newest waits for a seq that is not durable yet, so the newest is handed over with
    /// them by the [`Release::durable`] that releases them; while a thread is delivering, it
    /// looks at the queue again before it stops.
    pub fn send(&self, after: After, out: &Outbox, item: Out) {
        let mut g = self.lock();
        let current = after.generation == g.generation;
        let slack = u64::from(g.planted_early);
        let mut pending = current && after.seq > g.durable + slack;
        let item = if pending && g.failed {
            // It depends on a record that was lost with the failed generation.
            pending = false;
            match item {
                Out::Answer { id, .. } => lost(id),
                Out::Event { .. } | Out::Rendered(_) => return,
            }
        } else {
            item
        };
        if pending || !g.queue.is_empty() || g.delivering {
            let seq = if pending { after.seq } else { g.durable };
            g.queue.push_back((seq, out.clone(), item));
        } else {
            // Nothing is queued or being handed over, and only the core (this caller) queues:
            // nothing can overtake it outside the lock.
            drop(g);
            if current {
                out.release(item);
            } else {
                // Of an earlier generation: the writer asks the durable state.
                let _ = out.send(item);
            }
        }
    }

    /// Plants a bug, for the simulation's test that it bites: from now on a reply is released
    /// one record before the fdatasync it depends on. Never called by the daemon.
    #[doc(hidden)]
    pub fn plant_early_release(&self) {
        self.lock().planted_early = true;
    }

    /// Called after each fdatasync, on the thread that ran it: notes how far the ledger is
    /// durable and hands over what that releases.
    pub fn durable(&self, generation: u64, seq: u64) {
        let mut g = self.lock();
        if g.generation != generation || seq <= g.durable {
            return;
        }
        g.durable = seq;
        let releases = g.queue.front().is_some_and(|(s, _, _)| *s <= seq);
        drop(g);
        if releases {
            self.hand_over();
        }
    }

    /// Hands every released item to its connection, outside the lock, until none is left. If
    /// another thread is already at it, leaves them to that thread, which looks again before it
    /// stops.
    fn hand_over(&self) {
        {
            let mut g = self.lock();
            if g.delivering {
                return;
            }
            g.delivering = true;
        }
        let mut batch = Vec::new();
        loop {
            {
                let mut g = self.lock();
                let durable = g.durable;
                while g.queue.front().is_some_and(|(s, _, _)| *s <= durable) {
                    if let Some((_, out, item)) = g.queue.pop_front() {
                        batch.push((out, item));
                    }
                }
                if batch.is_empty() {
                    g.delivering = false;
                    return;
                }
            }
            for (out, item) in batch.drain(..) {
                out.release(item);
            }
        }
    }

    /// The generation failed: what was durable is delivered; every answer that depends on a
    /// record past that is answered `storage_unavailable` instead, in its place (none of it
    /// will ever be durable), and such events are dropped.
    pub fn fail(&self) {
        let mut g = self.lock();
        g.failed = true;
        let durable = g.durable;
        let queue = std::mem::take(&mut g.queue);
        g.queue = queue
            .into_iter()
            .filter_map(|(seq, out, item)| match item {
                _ if seq <= durable => Some((seq, out, item)),
                Out::Answer { id, .. } => Some((durable, out, lost(id))),
                Out::Event { .. } | Out::Rendered(_) => None,
            })
            .collect();
        drop(g);
        self.hand_over();
    }

    /// A new generation starts with `seq` durable. Anything still queued is of the failed one
    /// and was released by [`Release::fail`]; whoever is handing it over goes on.
    pub fn start(&self, generation: u64, seq: u64) {
        let mut g = self.lock();
        for (s, _, _) in g.queue.iter_mut() {
            *s = 0;
        }
        g.generation = generation;
        g.durable = seq;
        g.failed = false;
    }
}

/// The answer for a request whose record was lost with a failed generation.
fn lost(id: estop_protocol::Id) -> Out {
    Out::Answer {
        id,
        answer: crate::answer::unavailable(),
        after: After::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use estop_protocol::server_line as wire;

    #[test]
    fn waits_for_its_seq_and_reports_loss_after_failure() {
        let mut s = DurableState {
            generation: 0,
            seq: 5,
            failed: false,
            ended: vec![],
        };
        assert_eq!(
            decide(
                &s,
                After {
                    generation: 0,
                    seq: 5
                }
            ),
            Some(Durability::Durable)
        );
        assert_eq!(
            decide(
                &s,
                After {
                    generation: 0,
                    seq: 6
                }
            ),
            None
        );
        s.failed = true;
        assert_eq!(
            decide(
                &s,
                After {
                    generation: 0,
                    seq: 6
                }
            ),
            Some(Durability::Lost)
        );
        let s = DurableState {
            generation: 1,
            seq: 0,
            failed: false,
            ended: vec![5],
        };
        assert_eq!(
            decide(
                &s,
                After {
                    generation: 0,
                    seq: 5
                }
            ),
            Some(Durability::Durable)
        );
        assert_eq!(
            decide(
                &s,
                After {
                    generation: 0,
                    seq: 7
                }
            ),
            Some(Durability::Lost)
        );
    }

    fn answer(n: u64) -> Out {
        Out::Answer {
            id: estop_protocol::Id::from_u64(n),
            answer: crate::answer::Answer::Pong,
            after: After::default(),
        }
    }

    fn at(seq: u64) -> After {
        After { generation: 0, seq }
    }

    /// What the connection was handed so far: answer ids (0 for `storage_unavailable`) and
    /// `e` for each event.
    fn handed(rx: &mut tokio::sync::mpsc::UnboundedReceiver<Out>) -> Vec<String> {
        let mut seen = Vec::new();
        while let Ok(item) = rx.try_recv() {
            seen.push(match item {
                Out::Answer {
                    answer: crate::answer::Answer::Error(..),
                    ..
                } => "lost".to_string(),
                Out::Answer { id, .. } => id.to_string(),
                Out::Event { .. } => "e".to_string(),
                Out::Rendered(_) => "bytes".to_string(),
            });
        }
        seen
    }

    /// A release queue in generation 0 with nothing durable, and one connection's outbox.
    fn started() -> (Release, Outbox, tokio::sync::mpsc::UnboundedReceiver<Out>) {
        let release = Release::default();
        release.start(0, 0);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        (release, Outbox::from(tx), rx)
    }

    #[test]
    fn the_syncing_thread_hands_replies_over_in_order_once_durable() {
        let (release, out, mut rx) = started();
        release.send(at(1), &out, answer(1));
        release.send(at(3), &out, answer(3));
        release.send(at(0), &out, answer(4)); // durable already, but behind the others
        assert!(handed(&mut rx).is_empty(), "nothing is durable yet");

        release.durable(0, 2);
        assert_eq!(handed(&mut rx), ["1"], "handed over by the call itself");
        release.durable(0, 3);
        assert_eq!(handed(&mut rx), ["3", "4"]);
        release.send(at(3), &out, answer(5));
        assert_eq!(handed(&mut rx), ["5"], "nothing queued: straight through");
    }

    /// Replies queued by one thread (the core) while another reports durability and hands
    /// them over (the sync thread) arrive once each, in the order they were sent — also a reply
    /// sent, already durable, while the other thread is still handing over those before it.
    #[test]
    fn replies_keep_their_order_while_another_thread_releases_them() {
        use std::sync::atomic::{AtomicU64, Ordering};
        const ROUNDS: u64 = 400;
        const PENDING: u64 = 50;
        const LATE: u64 = 5;
        let (release, out, mut rx) = started();
        let release = std::sync::Arc::new(release);
        let produced = std::sync::Arc::new(AtomicU64::new(0));
        let syncing = std::sync::Arc::new(AtomicU64::new(0));
        let syncer = std::thread::spawn({
            let (release, produced, syncing) = (release.clone(), produced.clone(), syncing.clone());
            move || {
                let mut durable = 0;
                while durable < ROUNDS * PENDING {
                    let p = produced.load(Ordering::Acquire);
                    if p > durable {
                        durable = p;
                        syncing.store(durable, Ordering::Release);
                        release.durable(0, durable);
                    }
                }
            }
        });
        let mut n = 0;
        let mut expected = Vec::new();
        for round in 0..ROUNDS {
            let base = round * PENDING;
            for seq in base + 1..=base + PENDING {
                n += 1;
                release.send(at(seq), &out, answer(n));
                expected.push(n.to_string());
            }
            produced.store(base + PENDING, Ordering::Release);
            // As soon as the syncer is making them durable, send replies that depend on
            // nothing newer: they must wait for the hand-over of the ones before them.
            while syncing.load(Ordering::Acquire) < base + PENDING {
                std::hint::spin_loop();
            }
            for _ in 0..LATE {
                n += 1;
                release.send(at(base + PENDING), &out, answer(n));
                expected.push(n.to_string());
            }
        }
        syncer.join().unwrap();
        assert_eq!(handed(&mut rx), expected);
    }

    #[test]
    fn a_failed_generation_answers_unavailable_in_place_and_drops_its_events() {
        let (release, out, mut rx) = started();
        let event = || Out::Event {
            event: wire::Event {
                event: wire::EventKind::Held,
                run: "r".into(),
                key: None,
                reason: None,
                decision: None,
                outcome: None,
                attempt: None,
                tool: None,
                args: None,
                idempotency_key: None,
                at: 0,
            },
            after: at(2),
        };
        release.send(at(1), &out, answer(1));
        release.send(at(2), &out, event());
        release.send(at(3), &out, answer(3));
        release.durable(0, 1);
        assert_eq!(handed(&mut rx), ["1"]);
        release.fail();
        assert_eq!(
            handed(&mut rx),
            ["lost"],
            "the event is dropped, the answer is lost"
        );
        // A reply that depends on a lost record, sent after the failure.
        release.send(at(4), &out, answer(4));
        assert_eq!(handed(&mut rx), ["lost"]);
        release.start(1, 1);
        release.send(
            After {
                generation: 1,
                seq: 1,
            },
            &out,
            answer(5),
        );
        assert_eq!(handed(&mut rx), ["5"]);
    }
}
