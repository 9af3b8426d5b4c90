//! The trajectory journal: every change of a record (and each message added to its context) is
//! appended to an estop-ledger in the harness's data directory and fsync'd before the runner
//! acts on it. Recovery keeps each trajectory's last record and its whole context.
//!
//! Compaction: once `compact_bytes` were appended since the last snapshot, the write that
//! crossed it builds the state a recovery would build by reading the journal back from its
//! storage (the newest snapshot and the records after it, the same `apply` as recovery; no copy
//! of the contexts is kept in memory between compactions) and writes that state as a ledger
//! snapshot (tmp file, fdatasync, rename, directory fsync:
//! `estop_ledger::Committer::snapshot`) covering every record written so far; the ledger's
//! retention then removes the segments the older of the two kept snapshots covers. A snapshot
//! holds every live trajectory whole, and of the ended ones only the newest `ended_keep`, ended
//! within `ended_keep_ms`, each with its record and its last message (the answer). A crash at
//! any step leaves either the old snapshot and every segment (the tmp file is ignored and
//! removed) or the new snapshot: the same live state, nothing lost, nothing twice
//! (`tests/journal.rs`).

use crate::chat::Message;
use crate::record::Record;
use estop_ledger::{
    Committer, FileStorage, Ledger, LedgerError, LedgerOptions, RecordView, Storage,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

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
    #[error("journal snapshot {seq} is not valid: {why}")]
    Snapshot { seq: u64, why: String },
    /// A read-only reader's bound (`read_only`).
    #[error("the journal holds {bytes} bytes, over the {bytes_max} a reader may read")]
    TooLarge { bytes: u64, bytes_max: u64 },
}

/// When the journal compacts and what a compaction keeps. Every limit has its unit last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JournalOptions {
    /// A snapshot is written once this many payload bytes were appended since the last one
    /// (default 16 MiB; at least 1).
    pub compact_bytes: u64,
    /// Ended trajectories a snapshot keeps, the most recently ended first (default 1,000).
    pub ended_keep: usize,
    /// An ended trajectory older than this (by its end) is left out of the next snapshot
    /// (default 7 days). One without an end time (journalled before it was kept) is kept by
    /// count only.
    pub ended_keep_ms: u64,
    /// The journal's ledger segments roll past this (default 8 MiB; at least 2 MiB): a
    /// segment is removed once a kept snapshot covers it, never the one being written.
    pub segment_bytes_max: u64,
}

impl Default for JournalOptions {
    fn default() -> Self {
        JournalOptions {
            compact_bytes: 16 << 20,
            ended_keep: 1_000,
            ended_keep_ms: 7 * 24 * 3600 * 1000,
            segment_bytes_max: 8 << 20,
        }
    }
}

impl JournalOptions {
    pub fn check(&self) -> Result<(), String> {
        if self.compact_bytes == 0 {
            return Err("journal compact_bytes must be at least 1".into());
        }
        if self.segment_bytes_max < 2 << 20 {
            return Err("journal segment_bytes_max must be at least 2 MiB (2097152)".into());
        }
        Ok(())
    }
}

/// Audit lines a snapshot keeps per trajectory (the newest).
pub const LOGS_KEPT_PER_TRAJECTORY: usize = 64;
/// The snapshot payload's format version.
const SNAPSHOT_VERSION: u32 = 1;

/// What recovery found: the state the journal's entries build.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub struct Recovered {
    pub records: BTreeMap<String, Record>,
    pub contexts: BTreeMap<String, Vec<Message>>,
    pub logs: Vec<(String, String)>,
}

#[derive(Serialize, Deserialize)]
struct Snapshot {
    version: u32,
    state: Recovered,
}

impl Recovered {
    /// One entry's change (recovery, a compaction's read-back and `read_only` all use this).
    fn apply(&mut self, e: Entry) {
        match e {
            Entry::Record { record } => {
                self.records.insert(record.identity.id.clone(), *record);
            }
            Entry::Context {
                trajectory,
                message,
            } => self.contexts.entry(trajectory).or_default().push(message),
            Entry::Log { trajectory, line } => self.logs.push((trajectory, line)),
        }
    }

    fn apply_bytes(&mut self, seq: u64, payload: &[u8]) -> Result<(), String> {
        let e: Entry = serde_json::from_slice(payload).map_err(|e| format!("{seq}: {e}"))?;
        self.apply(e);
        Ok(())
    }

    /// What a snapshot keeps: every live trajectory whole; the newest `ended_keep` ended ones
    /// that ended within `ended_keep_ms` of `now_ms`, each with its record and its last message;
    /// the newest [`LOGS_KEPT_PER_TRAJECTORY`] audit lines of each kept trajectory. Returns the
    /// ids left out. Older ends go first, so a retry (which ends after what it retried) is never
    /// left out while the trajectory it retried is kept.
    pub fn retain(&mut self, now_ms: u64, o: &JournalOptions) -> Vec<String> {
        let mut ended: Vec<(Option<u64>, &String)> = self
            .records
            .iter()
            .filter(|(_, r)| r.state.is_terminal())
            .map(|(id, r)| (r.ended_at_ms, id))
            .collect();
        // Newest end first; an unknown end counts as the oldest.
        ended.sort_by(|a, b| b.cmp(a));
        let dropped: Vec<String> = ended
            .iter()
            .enumerate()
            .filter(|(i, (at, _))| {
                *i >= o.ended_keep
                    || at.is_some_and(|at| now_ms.saturating_sub(at) > o.ended_keep_ms)
            })
            .map(|(_, (_, id))| (*id).clone())
            .collect();
        for id in &dropped {
            self.records.remove(id);
            self.contexts.remove(id);
        }
        self.contexts.retain(|id, _| self.records.contains_key(id));
        for (id, ctx) in &mut self.contexts {
            if self.records[id].state.is_terminal() && ctx.len() > 1 {
                ctx.drain(..ctx.len() - 1);
            }
        }
        let mut per: BTreeMap<&str, usize> = BTreeMap::new();
        let mut keep = vec![false; self.logs.len()];
        for (i, (id, _)) in self.logs.iter().enumerate().rev() {
            let n = per.entry(id).or_default();
            if self.records.contains_key(id) && *n < LOGS_KEPT_PER_TRAJECTORY {
                *n += 1;
                keep[i] = true;
            }
        }
        let mut i = 0;
        self.logs.retain(|_| {
            i += 1;
            keep[i - 1]
        });
        dropped
    }
}

/// What a compaction did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compacted {
    /// The snapshot covers records `1..=seq`.
    pub seq: u64,
    pub snapshot_bytes: u64,
    /// Ended trajectories left out.
    pub dropped: Vec<String>,
    /// Files the ledger's retention removed.
    pub removed: Vec<String>,
}

/// Where the writer is; writes and compactions hold its lock, one at a time.
struct Mirror {
    /// Payload bytes appended since the last snapshot.
    since_bytes: u64,
    /// The last record written (durable).
    last_seq: u64,
}

pub struct Journal {
    committer: Committer,
    /// What a compaction reads the state back from.
    storage: Arc<dyn Storage>,
    opts: JournalOptions,
    mirror: Mutex<Mirror>,
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Journal")
    }
}

fn ledger_options(o: &JournalOptions) -> LedgerOptions {
    LedgerOptions {
        segment_bytes_max: o.segment_bytes_max,
        ..LedgerOptions::default()
    }
}

fn load_snapshot(payload: &[u8]) -> Result<Recovered, String> {
    let s: Snapshot = serde_json::from_slice(payload).map_err(|e| e.to_string())?;
    if s.version != SNAPSHOT_VERSION {
        return Err(format!(
            "format version {} is not {SNAPSHOT_VERSION}",
            s.version
        ));
    }
    Ok(s.state)
}

impl Journal {
    /// Opens (creating) the journal in `dir`, replaying what it holds, with the default options.
    pub fn open(dir: &Path) -> Result<(Journal, Recovered), JournalError> {
        Journal::open_with(dir, JournalOptions::default())
    }

    /// Opens (creating) the journal in `dir`, replaying what it holds.
    pub fn open_with(
        dir: &Path,
        opts: JournalOptions,
    ) -> Result<(Journal, Recovered), JournalError> {
        Journal::open_storage(Arc::new(FileStorage::open(dir)?), opts)
    }

    /// Opens the journal on any ledger storage (the tests' crash-simulating one).
    pub fn open_storage(
        storage: Arc<dyn Storage>,
        opts: JournalOptions,
    ) -> Result<(Journal, Recovered), JournalError> {
        opts.check()
            .map_err(|why| JournalError::Entry { seq: 0, why })?;
        // Both callbacks build the one state (the snapshot first, then the records after it).
        let rec = std::cell::RefCell::new(Recovered::default());
        let mut since_bytes = 0u64;
        let recovered = Ledger::open(
            Arc::clone(&storage),
            ledger_options(&opts),
            |seq, payload| {
                *rec.borrow_mut() =
                    load_snapshot(payload).map_err(|why| format!("snapshot {seq}: {why}"))?;
                Ok::<(), String>(())
            },
            |seq, payload| {
                since_bytes += payload.len() as u64;
                rec.borrow_mut().apply_bytes(seq, payload)
            },
        )?;
        let rec = rec.into_inner();
        let last_seq = recovered.report.last_seq;
        let committer = recovered.ledger.spawn(|_| {})?;
        let mirror = Mirror {
            since_bytes,
            last_seq,
        };
        Ok((
            Journal {
                committer,
                storage,
                opts,
                mirror: Mutex::new(mirror),
            },
            rec,
        ))
    }

    fn mirror(&self) -> std::sync::MutexGuard<'_, Mirror> {
        self.mirror
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Appends `entries` and returns once they are durable (one fdatasync for all of them);
    /// then compacts if `compact_bytes` were appended since the last snapshot.
    pub fn write(&self, entries: &[Entry]) -> Result<(), JournalError> {
        let mut m = self.mirror();
        let mut last = None;
        let mut bytes_total = 0u64;
        for e in entries {
            let bytes = serde_json::to_vec(e).map_err(|err| JournalError::Entry {
                seq: 0,
                why: err.to_string(),
            })?;
            bytes_total += bytes.len() as u64;
            last = Some(self.committer.append_deferred(&bytes)?);
        }
        let Some(seq) = last else { return Ok(()) };
        self.committer.commit(false);
        self.committer.wait_durable(seq)?;
        m.last_seq = seq;
        m.since_bytes += bytes_total;
        if m.since_bytes >= self.opts.compact_bytes {
            self.compact_locked(&mut m, crate::runner::now_ms())?;
        }
        Ok(())
    }

    /// Writes a snapshot of the state now (with `now_ms` for the age of ended trajectories),
    /// whatever was appended since the last one. `None` with nothing journalled yet.
    pub fn compact(&self, now_ms: u64) -> Result<Option<Compacted>, JournalError> {
        let mut m = self.mirror();
        self.compact_locked(&mut m, now_ms)
    }

    fn compact_locked(
        &self,
        m: &mut Mirror,
        now_ms: u64,
    ) -> Result<Option<Compacted>, JournalError> {
        if m.last_seq == 0 {
            return Ok(None);
        }
        // Every record up to `last_seq` is durable and nothing is written meanwhile (the lock).
        let (mut state, read_to) = read_once(&*self.storage, u64::MAX)?;
        if read_to != m.last_seq {
            return Err(JournalError::Snapshot {
                seq: m.last_seq,
                why: format!("read back to record {read_to}, written to {}", m.last_seq),
            });
        }
        let dropped = state.retain(now_ms, &self.opts);
        let snap = Snapshot {
            version: SNAPSHOT_VERSION,
            state,
        };
        let bytes = serde_json::to_vec(&snap).map_err(|e| JournalError::Snapshot {
            seq: m.last_seq,
            why: e.to_string(),
        })?;
        let report = self.committer.snapshot(m.last_seq, &bytes)?;
        m.since_bytes = 0;
        Ok(Some(Compacted {
            seq: m.last_seq,
            snapshot_bytes: bytes.len() as u64,
            dropped,
            removed: report.removed,
        }))
    }
}

/// Reads the journal in `dir` without its lock and without changing anything, beside a runner
/// that appends and compacts: the state a recovery would build now (a torn tail, a record being
/// written, is left out). Refused (`TooLarge`) when its files hold over `bytes_max`; an empty
/// state when there is no journal. A file removed by a compaction under the reader, or a
/// segment that grew while it was read (a record seen cut, then a whole one after it: what a
/// writer mid-batch looks like to a reader that reads the file in pieces), makes it read again,
/// at most `READ_TRIES` times in all; a corruption that stays is reported.
pub fn read_only(dir: &Path, bytes_max: u64) -> Result<Recovered, JournalError> {
    if !dir.exists() {
        return Ok(Recovered::default());
    }
    let storage = FileStorage::open_read_only(dir)?;
    let mut tries = 0;
    loop {
        tries += 1;
        match read_once(&storage, bytes_max) {
            Err(JournalError::Ledger(e)) if tries < READ_TRIES && moved_under(&e) => continue,
            r => return r.map(|(state, _)| state),
        }
    }
}

/// Reads of one `read_only` call, at most.
const READ_TRIES: u32 = 5;

/// An error a writer working beside the reader can cause.
fn moved_under(e: &LedgerError) -> bool {
    match e {
        LedgerError::Io { source, .. } => source.kind() == std::io::ErrorKind::NotFound,
        LedgerError::Corrupt { .. } => true,
        _ => false,
    }
}

/// The state in `storage` and the last record it holds.
fn read_once(storage: &dyn Storage, bytes_max: u64) -> Result<(Recovered, u64), JournalError> {
    let io = |op: &'static str, e: std::io::Error| LedgerError::io(op, "journal", e);
    let mut bytes = 0u64;
    for name in storage.list().map_err(|e| io("list", e))? {
        bytes += storage.file_len(&name).unwrap_or(0);
    }
    if bytes > bytes_max {
        return Err(JournalError::TooLarge { bytes, bytes_max });
    }
    let rec = std::cell::RefCell::new(Recovered::default());
    let bad: std::cell::RefCell<Option<JournalError>> = std::cell::RefCell::new(None);
    let report = estop_ledger::inspect_state(
        storage,
        |seq, payload| match load_snapshot(payload) {
            Ok(s) => *rec.borrow_mut() = s,
            Err(why) => *bad.borrow_mut() = Some(JournalError::Snapshot { seq, why }),
        },
        |r: RecordView<'_>| {
            if bad.borrow().is_none()
                && let Err(why) = rec.borrow_mut().apply_bytes(r.seq, r.payload)
            {
                *bad.borrow_mut() = Some(JournalError::Entry { seq: r.seq, why });
            }
        },
    );
    if let Some(e) = report.error {
        return Err(e.into());
    }
    match bad.into_inner() {
        Some(e) => Err(e),
        None => Ok((rec.into_inner(), report.last_seq)),
    }
}
