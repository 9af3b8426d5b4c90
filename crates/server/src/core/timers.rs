//! Time-driven work of the core: deadlines and approval expiries (a `Tick` per run at its next
//! due time), retention, and snapshots (with backoff after a failure).

use super::*;

impl Core {
    pub(super) fn rearm_all_timers(&mut self) {
        self.timers.clear();
        self.timer_of.clear();
        let ids: Vec<RunId> = self
            .gate
            .runs()
            .filter(|(_, r)| r.stop.is_none())
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            self.rearm(&id);
        }
    }

    pub(super) fn rearm(&mut self, run: &RunId) {
        let next = self.gate.next_timer(run);
        let current = self.timer_of.get(run).copied();
        if next == current {
            return;
        }
        if let Some(old) = current {
            self.timers.remove(&(old, run.clone()));
            self.timer_of.remove(run);
        }
        if let Some(at) = next {
            self.timers.insert((at, run.clone()));
            self.timer_of.insert(run.clone(), at);
        }
    }

    /// Timer work due at `now`: deadlines and expiries, waits that end, retention, snapshots,
    /// and a recovery attempt while the ledger is down.
    pub fn fire_timers(&mut self, now: Now) {
        self.at(now);
        let now = self.now;
        // Deadlines and approval expiries.
        while let Some((at, run)) = self.timers.first().cloned() {
            if at > now {
                break;
            }
            self.timers.remove(&(at, run.clone()));
            self.timer_of.remove(&run);
            if !self.writing {
                break;
            }
            let _ = self.apply_reply(&system_principal(), Command::Tick { run: run.clone() });
            self.rearm(&run);
        }
        self.expire_waiters();
        self.offer_due();
        // Retention and snapshots.
        if now >= self.next_compaction && self.writing {
            self.next_compaction = now + self.opts.compaction_period_ms();
            let cmd = Command::Compact {
                before: now.saturating_sub(self.opts.retention_ms),
                tombstones_before: if self.opts.planted_tombstones_dropped {
                    now
                } else {
                    now.saturating_sub(self.opts.tombstone_retention_ms)
                },
            };
            let _ = self.apply_reply(&system_principal(), cmd);
        }
        let due = self.snapshot_retry.is_none_or(|(at, _)| self.mono >= at);
        if self.records_since_snapshot >= self.opts.snapshot_every_records && due {
            self.snapshot();
        }
        if !self.writing && self.mono >= self.next_recovery {
            self.recover();
        }
    }

    /// Asks for a snapshot of the current state (covering every record so far). A failure
    /// (`snapshot_failed`) is retried after a backoff (1 s, doubling up to 10 min), never on
    /// every loop: encoding the whole state again each time would starve every client of the
    /// core.
    pub(super) fn snapshot(&mut self) {
        if !self.writing {
            return;
        }
        let mut bytes = Vec::new();
        estop_kernel::record_codec::encode_snapshot(&self.gate, &mut bytes);
        self.actions.push(Action::Snapshot {
            seq: self.last_seq,
            bytes,
        });
    }

    /// The shell wrote the snapshot.
    pub fn snapshot_done(&mut self) {
        self.records_since_snapshot = 0;
        self.snapshot_retry = None;
    }

    /// The shell could not write the snapshot: the next is tried after a backoff, returned.
    pub fn snapshot_failed(&mut self) -> Duration {
        const RETRY_FIRST: Duration = Duration::from_secs(1);
        const RETRY_MAX: Duration = Duration::from_secs(600);
        let wait = self
            .snapshot_retry
            .map_or(RETRY_FIRST, |(_, w)| (w * 2).min(RETRY_MAX));
        self.snapshot_retry = Some((self.mono + wait.as_millis() as u64, wait));
        self.obs.snapshot_failed();
        wait
    }
}
