//! The end of a seed: the faults stop, and the shipped core must make progress again
//! (liveness after healing). Every request a connected client still waits on is answered —
//! waits by their decision, expiry, deadline or timeout — new work is admitted, retention
//! forgets what it should, no wait outlives its connection, and a last power loss keeps
//! everything acknowledged.

use super::{FRESH, ShippedWorld};

/// Rounds of one second (the core retries a failed recovery every second) given to settle.
const SETTLE_ROUNDS: usize = 10;

impl ShippedWorld {
    /// The clock moves by `ms`, then the driver's timer work and commit run; what a fault
    /// armed before healing still does (one failed sync or write) is recovered from here.
    fn settle(&mut self, ms: u64) -> Result<(), String> {
        for _ in 0..SETTLE_ROUNDS {
            self.mono += ms;
            self.tick_and_commit();
            self.settle_step()?;
        }
        Ok(())
    }

    /// Requests a client still waits on (answers it has not read).
    fn outstanding(&self) -> Vec<String> {
        self.clients
            .iter()
            .enumerate()
            .flat_map(|(c, cl)| {
                cl.asked
                    .iter()
                    .map(move |(id, a)| format!("client {c} request {id}: {a:?}"))
            })
            .collect()
    }

    pub(super) fn heal_and_check(&mut self) -> Result<(), String> {
        let seed = self.report.seed;
        self.disk.disarm();
        self.storage.set_space_left(None);
        self.storage_full = false;
        // Everything the clients wait on is answered once every timeout and expiry has passed.
        self.settle(1_000)?;
        let far = 3_600_000 + self.shape.wait_ms_max + self.shape.expiry_ms;
        self.settle(far / SETTLE_ROUNDS as u64)?;
        let left = self.outstanding();
        if !left.is_empty() {
            return Err(format!(
                "seed {seed}: after healing, {} requests were never answered: {}",
                left.len(),
                left.join("; ")
            ));
        }
        // The core accepts new work.
        // A client told `unavailable` (a fault armed before healing fired once) asks again.
        for _ in 0..3 {
            for c in 0..self.clients.len() {
                if !self.fresh_admitted.contains(&c) {
                    self.admit_in(c, FRESH);
                }
            }
            self.settle(1_000)?;
        }
        let left = self.outstanding();
        if !left.is_empty() || self.fresh_admitted.len() != self.clients.len() {
            return Err(format!(
                "seed {seed}: after healing, new work is not admitted ({} of {} clients; unanswered: {})",
                self.fresh_admitted.len(),
                self.clients.len(),
                left.join("; ")
            ));
        }
        // Retention has run: nothing stopped is kept past its retention.
        let period = self.opts.compaction_period_ms();
        self.settle((self.opts.tombstone_retention_ms + 2 * period) / SETTLE_ROUNDS as u64 + 1)?;
        let now = self.gate_now();
        let gate = self.core.as_ref().expect("booted").gate();
        self.auditor
            .check_retention_ran(gate, now)
            .map_err(|e| format!("seed {seed}, after healing: {e}"))?;
        self.all_leave()?;
        // A last power loss keeps everything acknowledged, and the ledger verifies.
        self.power_loss()?;
        let v = estop_ledger::verify(&*self.storage);
        if !v.is_ok() {
            return Err(format!(
                "seed {seed}: the ledger does not verify at the end: {v:?}"
            ));
        }
        Ok(())
    }
}
