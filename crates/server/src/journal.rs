//! The gate's ledger: recovery into a `Gate` (snapshot + replay through the kernel) and the
//! committer the core's shell appends records to.

use estop_kernel::record_codec::{RecordDecoder, decode_snapshot};
use estop_kernel::{Gate, Limits};
use estop_ledger::{Committer, Ledger, LedgerError, LedgerOptions, RecoveryReport, Storage};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

/// A ledger recovered into a gate, not yet accepting appends.
#[derive(Debug)]
pub struct Opened {
    pub gate: Gate,
    pub ledger: Ledger,
    pub report: RecoveryReport,
}

/// Opens the ledger in `storage` and rebuilds the gate from it. `discard_after`: after a
/// writer failure, the last durable seq (later records are dropped).
pub fn open(
    storage: Arc<dyn Storage>,
    limits: &Limits,
    options: LedgerOptions,
) -> Result<Opened, JournalError> {
    // Recorded commands passed the bounds of their day: replay them under `for_replay`, then
    // enforce today's.
    let replay_limits = limits.for_replay();
    let gate = std::cell::RefCell::new(Gate::new(replay_limits.clone()));
    let mut decoder = RecordDecoder::default();
    let recovered = Ledger::open(
        storage,
        options,
        |_seq, bytes| -> Result<(), String> {
            *gate.borrow_mut() =
                decode_snapshot(bytes, replay_limits.clone()).map_err(|e| e.to_string())?;
            Ok(())
        },
        |_seq, bytes| replay_record(&mut gate.borrow_mut(), &mut decoder, bytes),
    )?;
    let mut gate = gate.into_inner();
    gate.set_limits(limits.clone());
    Ok(Opened {
        gate,
        ledger: recovered.ledger,
        report: recovered.report,
    })
}

/// Replays one recorded command into `gate` (recovery, from the ledger or from PostgreSQL:
/// `pgstore::load`). A record that does not apply, or changes nothing, is refused: the state
/// it was recorded against is not the one being rebuilt.
pub fn replay_record(
    gate: &mut Gate,
    decoder: &mut RecordDecoder,
    bytes: &[u8],
) -> Result<(), String> {
    // Borrowed where it was decoded: a record is ~300 bytes, and moving it out of the
    // `Result` was a copy per record.
    let decoded = decoder.decode(bytes);
    let rec = match &decoded {
        Ok(rec) => rec,
        Err(e) => return Err(e.to_string()),
    };
    let changed = gate
        .replay(rec.at, &rec.principal, &rec.command)
        .map_err(|e| format!("the recorded command no longer applies: {e}"))?;
    if !changed {
        return Err("the recorded command changed nothing on replay".into());
    }
    Ok(())
}

/// The appending side, owned by the core's shell (`core::Shell`).
#[derive(Debug)]
pub struct Journal {
    committer: Committer,
}

impl Journal {
    pub fn start(
        ledger: Ledger,
        notify: impl Fn(Result<u64, LedgerError>) + Send + Sync + 'static,
    ) -> Result<Journal, JournalError> {
        Ok(Journal {
            committer: ledger.spawn(notify)?,
        })
    }

    /// Appends one record; returns its seq. The record is synced by the next `commit` (the
    /// core commits once per burst of messages). When the commit buffer is full, waits for the
    /// sync in progress (backpressure reaches the clients through the core's queue).
    pub fn append(&self, payload: &[u8]) -> Result<u64, LedgerError> {
        match self.committer.append_deferred(payload) {
            Err(LedgerError::Backpressure { .. }) => {
                self.committer.wait_durable(self.last_seq())?;
                self.committer.append_deferred(payload)
            }
            other => other,
        }
    }

    /// Starts the sync of everything appended; see `Committer::commit`.
    /// Returns whether the sync ran on this thread (see `Committer::commit`).
    pub fn commit(&self, inline: bool) -> bool {
        self.committer.commit(inline)
    }

    /// Records carried by the last sync.
    pub fn last_batch_records(&self) -> u64 {
        self.committer.last_batch_records()
    }

    pub fn last_seq(&self) -> u64 {
        self.committer.next_seq() - 1
    }

    pub fn durable_seq(&self) -> u64 {
        self.committer.durable()
    }

    /// Makes everything appended durable (shutdown).
    pub fn flush(&self) -> Result<u64, LedgerError> {
        self.committer.flush()
    }

    pub fn snapshot(&self, seq: u64, bytes: &[u8]) -> Result<(), LedgerError> {
        self.committer.snapshot(seq, bytes).map(|_| ())
    }
}
