//! `LedgerError`: every way the ledger refuses, with a stable code for operators.
//! Codes and what to do about them are listed in docs/LEDGER.md ("Error codes").

use std::io;
use std::sync::Arc;

/// The cause handed to a replay callback error. `Arc` so that `LedgerError` is `Clone`:
/// the committer hands the same failure to the notify callback and to every later caller.
pub type ReplayCause = Arc<dyn std::error::Error + Send + Sync>;

/// Every error of the ledger. `code()` is stable; the message says what to do.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LedgerError {
    #[error(
        "ledger I/O error ({op} {file}): {source}; check the disk and permissions, then reopen the ledger"
    )]
    Io {
        op: &'static str,
        file: String,
        #[source]
        source: Arc<io::Error>,
    },
    #[error(
        "ledger disk is full ({op} {file}): {source}; free disk space, then reopen the ledger with discard_after = the last durable seq"
    )]
    Full {
        op: &'static str,
        file: String,
        #[source]
        source: Arc<io::Error>,
    },
    #[error(
        "ledger is corrupt in {file} at byte {offset}: {reason}; run `estop ledger verify`, then restore the directory from a copy or reopen with discard_after set to the last seq you accept"
    )]
    Corrupt {
        file: String,
        offset: u64,
        reason: String,
    },
    #[error(
        "ledger file {file} has format version {version}, this build reads version {supported}; run a newer estop"
    )]
    UnsupportedVersion {
        file: String,
        version: u32,
        supported: u32,
    },
    #[error(
        "ledger writer failed earlier and accepts nothing more (cause: {cause}); drop the committer and reopen the ledger with discard_after = its durable seq"
    )]
    Failed { cause: Arc<LedgerError> },
    #[error("ledger committer is closed; reopen the ledger")]
    Closed,
    #[error(
        "ledger directory {dir} is in use by another process; stop it or use another directory"
    )]
    Locked { dir: String },
    #[error("invalid ledger options: {reason}")]
    Options { reason: String },
    #[error("replay stopped at seq {seq}: the caller refused it: {source}")]
    Replay {
        seq: u64,
        #[source]
        source: ReplayCause,
    },
    #[error(
        "record of {bytes} bytes is larger than record_bytes_max = {max}; split it or raise the limit"
    )]
    RecordTooLarge { bytes: usize, max: usize },
    #[error(
        "ledger commit buffer is full ({buffered_bytes} bytes buffered, buffer_bytes_max = {max}); retry after the next sync"
    )]
    Backpressure { buffered_bytes: usize, max: usize },
}

impl LedgerError {
    /// A stable, machine-readable code (documented in docs/LEDGER.md).
    pub fn code(&self) -> &'static str {
        match self {
            LedgerError::Io { .. } => "ledger_io",
            LedgerError::Full { .. } => "ledger_full",
            LedgerError::Corrupt { .. } => "ledger_corrupt",
            LedgerError::UnsupportedVersion { .. } => "ledger_unsupported_version",
            LedgerError::Failed { .. } => "ledger_failed",
            LedgerError::Closed => "ledger_closed",
            LedgerError::Locked { .. } => "ledger_locked",
            LedgerError::Options { .. } => "ledger_options",
            LedgerError::Replay { .. } => "ledger_replay",
            LedgerError::RecordTooLarge { .. } => "record_too_large",
            LedgerError::Backpressure { .. } => "backpressure",
        }
    }

    /// The error that caused a `Failed`, or `self`.
    pub fn root(&self) -> &LedgerError {
        match self {
            LedgerError::Failed { cause } => cause.root(),
            other => other,
        }
    }

    /// Wraps an IO error from operation `op` on `file`; a full disk or quota becomes `Full`.
    pub fn io(op: &'static str, file: &str, source: io::Error) -> LedgerError {
        let file = file.to_owned();
        let source = Arc::new(source);
        if is_full(&source) {
            LedgerError::Full { op, file, source }
        } else {
            LedgerError::Io { op, file, source }
        }
    }

    pub(crate) fn corrupt(file: &str, offset: u64, reason: impl Into<String>) -> LedgerError {
        LedgerError::Corrupt {
            file: file.to_owned(),
            offset,
            reason: reason.into(),
        }
    }
}

fn is_full(e: &io::Error) -> bool {
    const ENOSPC: i32 = 28;
    const EDQUOT: i32 = 122;
    matches!(
        e.kind(),
        io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded
    ) || matches!(e.raw_os_error(), Some(ENOSPC) | Some(EDQUOT))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_disk_is_its_own_code() {
        let e = LedgerError::io("write", "seg", io::Error::from_raw_os_error(28));
        assert_eq!(e.code(), "ledger_full");
        let e = LedgerError::io("write", "seg", io::Error::other("boom"));
        assert_eq!(e.code(), "ledger_io");
        let f = LedgerError::Failed { cause: Arc::new(e) };
        assert_eq!(f.code(), "ledger_failed");
        assert_eq!(f.root().code(), "ledger_io");
        assert!(f.to_string().contains("discard_after"));
    }
}
