//! When the ledger fails: everything not yet durable is answered `unavailable`, and the state
//! is rebuilt from the durable prefix (retried every second until the disk is back).

use super::*;

/// The ledger's sync thread reports here: durable progress to the repliers, failure to the core.
pub(super) fn notifier(
    durable_tx: &Arc<watch::Sender<DurableState>>,
    release: &Arc<crate::durable::Release>,
    generation: u64,
    core_tx: &mpsc::Sender<CoreMsg>,
) -> impl Fn(Result<u64, LedgerError>) + Send + Sync + 'static {
    let durable_tx = Arc::clone(durable_tx);
    let release = Arc::clone(release);
    let core_tx = core_tx.clone();
    move |r| match r {
        Ok(seq) => {
            // The watch first, so a released reply never waits on it again.
            durable_tx.send_if_modified(|s| {
                let advance = s.generation == generation && seq > s.seq;
                if advance {
                    s.seq = seq;
                }
                advance
            });
            release.durable(generation, seq);
        }
        Err(e) => {
            crate::log::error(&format!(
                "ledger failed: {e}; no change is acknowledged until it recovers"
            ));
            durable_tx.send_modify(|s| {
                if s.generation == generation {
                    s.failed = true;
                }
            });
            let _ = core_tx.send(CoreMsg::LedgerFailed);
        }
    }
}

impl Core {
    pub(super) fn fail_journal(&mut self) {
        let Some(journal) = self.journal.take() else {
            return;
        };
        let durable = journal.durable_seq();
        drop(journal);
        let generation = self.generation;
        self.durable_tx.send_modify(|s| {
            if s.generation == generation {
                s.failed = true;
                s.seq = durable;
            }
        });
        // Replies whose record did not reach the disk are not acknowledged.
        self.release.fail();
        // Everything waiting is answered now: the state it waited on may not survive recovery.
        let waiters: Vec<Waiter> = self.waiters.drain().flat_map(|(_, ws)| ws).collect();
        for w in &waiters {
            self.waiter_shares.give_back(&w.principal);
        }
        self.waiters_of_conn.clear();
        self.waiter_deadlines.clear();
        for w in waiters {
            self.send(w.to, unavailable());
        }
        self.recover();
    }

    /// Reopens the ledger after a failure, dropping every record that was not durable, and
    /// rebuilds the state from disk. Retried every second until the disk is back.
    pub(super) fn recover(&mut self) {
        // Each attempt re-reads the ledger: never more than once a second while the disk is down.
        self.next_recovery = self.mono + 1000;
        let durable = self.durable_tx.borrow().seq;
        let opened = match (self.open)(Some(durable)) {
            Ok(o) => o,
            Err(e) => {
                crate::log::error(&format!("ledger still unavailable: {e}; retrying in 1s"));
                return;
            }
        };
        let generation = self.generation + 1;
        let seq = opened.report.last_seq;
        self.durable_tx.send_modify(|s| {
            let end = s.seq;
            s.ended.push(end);
            assert_eq!(
                s.ended.len() as u64,
                generation,
                "one end per finished generation"
            );
            s.generation = generation;
            s.seq = seq;
            s.failed = true;
        });
        self.generation = generation;
        self.gate = opened.gate;
        self.last_seq = seq;
        self.committed_seq = seq;
        self.release.start(generation, seq);
        match Journal::start(
            opened.ledger,
            notifier(&self.durable_tx, &self.release, generation, &self.self_tx),
        ) {
            Ok(journal) => {
                self.durable_tx.send_modify(|s| s.failed = false);
                self.journal = Some(journal);
                self.rearm_all_timers();
                crate::log::info(&format!(
                    "ledger recovered at seq {seq}; accepting changes again"
                ));
            }
            Err(e) => crate::log::error(&format!(
                "ledger reopened but cannot start writing: {e}; retrying in 1s"
            )),
        }
    }
}
