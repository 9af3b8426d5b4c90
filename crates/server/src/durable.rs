//! Durable-before-visible: every reply and event carries the ledger position it depends on and
//! is written to the client only once that position is on stable storage (G6).

use tokio::sync::watch;

/// Where a reply must wait: the ledger generation and sequence number it depends on.
/// A generation ends when the ledger fails; records of it past its last durable seq are lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct After {
    pub generation: u64,
    pub seq: u64,
}

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

#[cfg(test)]
mod tests {
    use super::*;

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
}

/// Replies and events whose record is not durable yet. The ledger's sync thread only records
/// how far the ledger is durable and wakes one task, [`Release::deliver`], on the IO runtime,
/// which hands everything now durable to its connection in order: one cross-thread wakeup per
/// fdatasync instead of one per reply.
#[derive(Debug, Default)]
pub struct Release {
    inner: std::sync::Mutex<ReleaseInner>,
    wake: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct ReleaseInner {
    generation: u64,
    durable: u64,
    /// The generation failed: nothing past `durable` will ever be durable in it.
    failed: bool,
    /// In seq order: the core is the only producer and its seqs never go back.
    queue: std::collections::VecDeque<(u64, crate::core::Outbox, crate::core::Out)>,
}

impl ReleaseInner {
    /// Hands every queued item that is durable now to its connection. Runs under the lock, so
    /// an item sent straight through by [`Release::send`] never overtakes one queued before it.
    fn release_durable(&mut self) {
        while self
            .queue
            .front()
            .is_some_and(|(s, _, _)| *s <= self.durable)
        {
            if let Some((_, out, item)) = self.queue.pop_front() {
                let _ = out.send(item);
            }
        }
    }
}

impl Release {
    fn lock(&self) -> std::sync::MutexGuard<'_, ReleaseInner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sends `item` now if `after` is durable and nothing is queued before it, else once it
    /// and everything before it are durable.
    pub fn send(&self, after: After, out: &crate::core::Outbox, item: crate::core::Out) {
        let mut g = self.lock();
        let pending = after.generation == g.generation && after.seq > g.durable;
        if pending && g.failed {
            // It depends on a record that was lost with the failed generation.
            if let crate::core::Out::Answer { id, .. } = item {
                let _ = out.send(crate::core::Out::Answer {
                    id,
                    answer: crate::core::unavailable(),
                    after: After::default(),
                });
            }
        } else if pending || !g.queue.is_empty() {
            let seq = if pending { after.seq } else { g.durable };
            g.queue.push_back((seq, out.clone(), item));
            if !pending {
                drop(g);
                self.wake.notify_one();
            }
        } else {
            let _ = out.send(item);
        }
    }

    /// Called by the sync thread after each fdatasync: notes how far the ledger is durable and
    /// wakes [`Release::deliver`] if that releases something.
    pub fn durable(&self, generation: u64, seq: u64) {
        let mut g = self.lock();
        if g.generation != generation || seq <= g.durable {
            return;
        }
        g.durable = seq;
        let releases = g.queue.front().is_some_and(|(s, _, _)| *s <= seq);
        drop(g);
        if releases {
            self.wake.notify_one();
        }
    }

    /// The task that hands durable replies to their connections; runs on the IO runtime for as
    /// long as the daemon does.
    pub async fn deliver(self: std::sync::Arc<Self>) {
        loop {
            self.wake.notified().await;
            self.lock().release_durable();
        }
    }

    /// The generation failed: delivers what was durable and hands back everything else (none
    /// of it will ever be durable).
    pub fn fail(&self) -> Vec<(crate::core::Outbox, crate::core::Out)> {
        let mut g = self.lock();
        g.failed = true;
        g.release_durable();
        g.queue.drain(..).map(|(_, o, i)| (o, i)).collect()
    }

    /// A new generation starts with `seq` durable.
    pub fn start(&self, generation: u64, seq: u64) {
        let mut g = self.lock();
        assert!(
            g.queue.is_empty(),
            "a new generation starts with nothing waiting"
        );
        g.generation = generation;
        g.durable = seq;
        g.failed = false;
    }
}
