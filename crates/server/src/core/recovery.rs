//! When the ledger fails: everything not yet durable is answered `unavailable`, and the state
//! is rebuilt from the durable prefix (retried every second until the disk is back). The core
//! decides; the shell fails the ledger, reopens it and reports back (`reopened`).

use super::*;

/// The ledger reopened after a failure (`Action::Recover`), as the shell reports it.
pub struct Reopened {
    /// The state rebuilt from the durable prefix.
    pub gate: Gate,
    /// The new ledger generation (one more than the failed one).
    pub generation: u64,
    /// The last record recovered: the next append gets the seq after it.
    pub last_seq: u64,
    /// The ledger takes appends again (false: it opened but cannot start writing; recovery
    /// is tried again after the usual wait).
    pub writing: bool,
}

impl Core {
    /// An append the shell could not make: the state moved but the record did not. Fail
    /// closed and rebuild from disk.
    pub fn append_failed(&mut self) {
        self.fail_journal();
    }

    /// A feed that was full or gone when the shell offered it an event.
    pub fn feed_gone(&mut self, tx: &crate::observe::FeedTx) {
        self.obs.feed_gone(tx);
    }

    pub(super) fn fail_journal(&mut self) {
        if !self.writing {
            return;
        }
        self.writing = false;
        // Replies whose record did not reach the disk are not acknowledged.
        self.actions.push(Action::FailLedger);
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

    /// Asks the shell to reopen the ledger, dropping every record that was not durable, and
    /// to rebuild the state from disk. Retried every second until the disk is back.
    pub(super) fn recover(&mut self) {
        // Each attempt re-reads the ledger: never more than once a second while the disk is down.
        self.next_recovery = self.mono + 1000;
        self.actions.push(Action::Recover);
    }

    /// The shell reopened the ledger: the state is what it holds.
    pub fn reopened(&mut self, r: Reopened) {
        assert_eq!(
            r.generation,
            self.generation + 1,
            "one generation per reopening"
        );
        self.generation = r.generation;
        self.gate = r.gate;
        self.last_seq = r.last_seq;
        self.committed_seq = r.last_seq;
        if r.writing {
            self.writing = true;
            self.rearm_all_timers();
            self.restart_sagas();
        }
    }
}
