//! estop ledger: the durable, append-only, checksummed log the gate's state is rebuilt from.
//! It knows bytes, not meaning: payloads are opaque. The byte format, fsync order and crash
//! analysis are in docs/LEDGER.md.
//!
//! Use:
//! 1. `Ledger::open(storage, options, on_snapshot, on_record)` recovers: it hands the newest valid
//!    snapshot and every later record to the callbacks, truncates a torn tail, cuts preallocated
//!    zeros off segments no longer written, refuses mid-log corruption, and starts a fresh
//!    segment.
//! 2. `recovered.ledger.spawn(notify)` starts the group-commit thread and returns a `Committer`.
//! 3. `committer.append(payload)` returns the record's seq at once; it is durable when
//!    `committer.durable() >= seq`, `wait_durable(seq)` returns, or `notify(Ok(d))` says `d >= seq`.
//! 4. On `ledger_failed`, drop the committer and reopen with `discard_after: Some(durable)`.
//! 5. `committer.snapshot(seq, state)` bounds recovery time; `verify`/`inspect` read without
//!    writing.

mod commit;
mod crash_storage;
mod error;
pub mod format;
mod inspect;
mod ledger;
mod probe;
mod scan;
mod snapshot;
mod stats;
mod storage;

pub use commit::{Committer, Notify, SYNC_THREAD_NAME, SnapshotReport};
pub use crash_storage::{CrashStats, CrashStorage};
pub use error::{LedgerError, ReplayCause};
pub use inspect::{RecordView, VerifyReport, inspect, inspect_state, verify};
pub use ledger::{Ledger, LedgerOptions, Recovered, RecoveryReport};
pub use probe::{
    FsyncProbe, GroupCommitOptions, GroupCommitProbe, group_commit_probe, raw_fsync_probe,
    raw_overwrite_probe,
};
pub use scan::{Preallocated, SegmentSummary, Superseded, TornTail};
pub use snapshot::{InvalidFile, SnapshotInfo};
pub use stats::{Histogram, HistogramSnapshot, SyncObserver, SyncStats};
pub use storage::{FileStorage, LOCK_FILE, MemStorage, Storage, StorageFile, read_file};
