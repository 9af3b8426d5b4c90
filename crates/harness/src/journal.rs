//! The trajectory journal: every change of a record (and each message added to its context) is
//! appended to an estop-ledger in the harness's data directory and fsync'd before the runner
//! acts on it. Recovery keeps each trajectory's last record and its whole context.

use crate::chat::Message;
use crate::record::Record;
use estop_ledger::{Committer, FileStorage, Ledger, LedgerError, LedgerOptions};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// One journal entry (JSON in the ledger's record payload).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "entry", rename_all = "snake_case")]
pub enum Entry {
    Record {
        record: Box<Record>,
    },
    Context {
        trajectory: String,
        message: Message,
    },
    /// An audit line: a late or unknown result dropped, an action's failure.
    Log {
        trajectory: String,
        line: String,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("journal: {0}")]
    Ledger(#[from] LedgerError),
    #[error("journal entry {seq} is not valid: {why}")]
    Entry { seq: u64, why: String },
}

/// What recovery found.
#[derive(Debug, Default)]
pub struct Recovered {
    pub records: BTreeMap<String, Record>,
    pub contexts: BTreeMap<String, Vec<Message>>,
    pub logs: Vec<(String, String)>,
}

pub struct Journal {
    committer: Committer,
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Journal")
    }
}

impl Journal {
    /// Opens (creating) the journal in `dir`, replaying what it holds.
    pub fn open(dir: &Path) -> Result<(Journal, Recovered), JournalError> {
        let storage = Arc::new(FileStorage::open(dir)?);
        let mut rec = Recovered::default();
        let recovered = Ledger::open(
            storage,
            LedgerOptions::default(),
            |_, _| Ok::<(), String>(()),
            |seq, payload| {
                let e: Entry =
                    serde_json::from_slice(payload).map_err(|e| format!("{seq}: {e}"))?;
                match e {
                    Entry::Record { record } => {
                        rec.records.insert(record.identity.id.clone(), *record);
                    }
                    Entry::Context {
                        trajectory,
                        message,
                    } => rec.contexts.entry(trajectory).or_default().push(message),
                    Entry::Log { trajectory, line } => rec.logs.push((trajectory, line)),
                }
                Ok(())
            },
        )?;
        let committer = recovered.ledger.spawn(|_| {})?;
        Ok((Journal { committer }, rec))
    }

    /// Appends `entries` and returns once they are durable (one fdatasync for all of them).
    pub fn write(&self, entries: &[Entry]) -> Result<(), JournalError> {
        let mut last = None;
        for e in entries {
            let bytes = serde_json::to_vec(e).map_err(|err| JournalError::Entry {
                seq: 0,
                why: err.to_string(),
            })?;
            last = Some(self.committer.append_deferred(&bytes)?);
        }
        if let Some(seq) = last {
            self.committer.commit(false);
            self.committer.wait_durable(seq)?;
        }
        Ok(())
    }
}
