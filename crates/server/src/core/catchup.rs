//! Catching up with records other nodes committed (the PostgreSQL store, docs/STORES.md): they
//! are applied to this node's gate, in seq order, before its own commands of the burst, so its
//! own records are numbered on from the database's last. Then what they changed reaches this
//! node's waiters, subscribers, timers, feeds and sagas, as if its own commands had made the
//! change.

use super::*;
use estop_kernel::record_codec::RecordDecoder;

impl Core {
    /// The seq of the last record applied (this node's own, or caught up).
    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    /// Applies records `last_seq + 1 ..` committed by other nodes (already durable). Every
    /// record is applied first, and only then are waiters re-checked: a re-check may append a
    /// record of this node's, which must follow the last one caught up. `Err`: a record does
    /// not apply as it did where it was made (the nodes' states differ); the caller fails
    /// closed and rebuilds the gate from the database.
    pub fn catch_up(&mut self, records: &[(u64, Vec<u8>)]) -> Result<(), String> {
        let mut decoder = RecordDecoder::default();
        let mut changes = Vec::with_capacity(records.len());
        for (seq, bytes) in records {
            assert_eq!(*seq, self.last_seq + 1, "caught-up records follow the last");
            let rec = decoder
                .decode(bytes)
                .map_err(|e| format!("record {seq}: {e}"))?;
            // The same transition recovery replays (`Gate::replay` and `apply` share it),
            // with the events this node's waiters and subscribers need.
            let applied = self
                .gate
                .apply(rec.at, &rec.principal, &rec.command)
                .map_err(|e| format!("record {seq} does not apply here: {e}"))?;
            if !applied.changed {
                return Err(format!("record {seq} changes nothing here"));
            }
            // An attempt another node began is that node's to offer (see `core::sagas`).
            self.begun_elsewhere(&rec.command);
            self.last_seq = *seq;
            self.committed_seq = *seq;
            self.records_since_snapshot += 1;
            changes.push((rec.command.run().cloned(), applied.events, rec.at));
        }
        for (run, events, at) in changes {
            if let Some(run) = &run {
                self.rearm(run);
            }
            self.publish(&events);
            // A cancel, a failed attempt or a settle made on another node makes this node's
            // executors due too: offered here if nothing else wakes the saga.
            self.saga_touched(&events);
            let after = self.after();
            let actions = &mut self.actions;
            self.obs
                .changed(&self.gate, run.as_ref(), &events, after, at, |tx, event| {
                    actions.push(Action::Feed { tx, event })
                });
        }
        Ok(())
    }
}
