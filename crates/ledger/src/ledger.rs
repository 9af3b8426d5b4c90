//! Opening a ledger: options, recovery (snapshot + replay, torn-tail truncation, discard after a
//! writer failure) and the fresh segment that every open starts. See docs/LEDGER.md "Recovery".

use std::sync::Arc;

use crate::commit::{self, Committer};
use crate::error::LedgerError;
use crate::format::{self, RECORD_HEADER_BYTES, SEGMENT_HEADER_BYTES};
use crate::scan::{self, Preallocated, Superseded, TornTail, Walk};
use crate::snapshot::{self, InvalidFile, SnapshotInfo};
use crate::storage::{Storage, StorageFile};

/// Limits and recovery choices. Every limit has its unit last.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerOptions {
    /// Largest payload `append` accepts (default 1 MiB).
    pub record_bytes_max: usize,
    /// A segment rolls before a write would take it past this (default 64 MiB).
    pub segment_bytes_max: u64,
    /// Zeros the sync thread writes ahead of the write position of the active segment whenever
    /// a batch would not fit in the zeros already there, at most up to `segment_bytes_max`
    /// (default 1 MiB; 0 turns preallocation off). They become durable with the fdatasync of the
    /// batch that needed them; later batches are overwrites inside the file, which sync without
    /// a file-size change (on ext4: no journal commit), cheaper than appends. The batch that
    /// extends pays for writing the whole chunk (about 1 ms per MiB on the project's machine),
    /// so a larger chunk means rarer but longer stalls. docs/LEDGER.md, "Preallocation".
    pub preallocate_bytes: u64,
    /// Bytes the commit buffer may hold before `append` answers `backpressure` (default 8 MiB).
    pub buffer_bytes_max: usize,
    /// Largest snapshot payload written or read (default 1 GiB).
    pub snapshot_bytes_max: u64,
    /// Snapshots kept by retention (default 2, at least 1).
    pub snapshots_keep: usize,
    /// After a writer failure: the last durable seq. Records after it are superseded (not
    /// replayed) and appends continue at `discard_after + 1`. `None` for a normal open.
    pub discard_after: Option<u64>,
    /// Where the sync thread reports each group commit's latency and size (metrics).
    pub sync_stats: crate::stats::SyncObserver,
    /// No sync thread: every sync runs on the thread that commits, waits or flushes, so one
    /// thread drives the whole pipeline (append, fdatasync, notify) in a deterministic order —
    /// for the simulation that runs the shipped core on a crash-simulating disk. Off by default.
    pub caller_syncs: bool,
}

impl Default for LedgerOptions {
    fn default() -> Self {
        LedgerOptions {
            record_bytes_max: 1 << 20,
            segment_bytes_max: 64 << 20,
            preallocate_bytes: 1 << 20,
            buffer_bytes_max: 8 << 20,
            snapshot_bytes_max: 1 << 30,
            snapshots_keep: 2,
            discard_after: None,
            sync_stats: crate::stats::SyncObserver::default(),
            caller_syncs: false,
        }
    }
}

impl LedgerOptions {
    fn check(&self) -> Result<(), LedgerError> {
        let record_max = RECORD_HEADER_BYTES + self.record_bytes_max;
        let bad = |reason: String| Err(LedgerError::Options { reason });
        if self.record_bytes_max > format::RECORD_PAYLOAD_BYTES_LIMIT {
            return bad(format!(
                "record_bytes_max must be at most {}",
                format::RECORD_PAYLOAD_BYTES_LIMIT
            ));
        }
        if self.segment_bytes_max < (SEGMENT_HEADER_BYTES + record_max) as u64 {
            return bad("segment_bytes_max must hold a header and one largest record".to_owned());
        }
        if self.buffer_bytes_max < record_max {
            return bad("buffer_bytes_max must hold one largest record".to_owned());
        }
        if self.snapshots_keep == 0 {
            return bad("snapshots_keep must be at least 1".to_owned());
        }
        Ok(())
    }
}

/// What recovery found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveryReport {
    /// The snapshot handed to `on_snapshot`, if any.
    pub snapshot: Option<SnapshotInfo>,
    /// Snapshot files skipped because they were invalid or partial.
    pub snapshots_invalid: Vec<InvalidFile>,
    /// Segments read.
    pub segments_read: usize,
    /// Records handed to `on_record`.
    pub records_replayed: u64,
    /// Last seq of the recovered state; appends continue at `last_seq + 1`.
    pub last_seq: u64,
    /// The torn write that was truncated, if any.
    pub torn_tail: Option<TornTail>,
    /// Bytes ignored by the supersede rule (e.g. what a failed writer left after `discard_after`).
    pub superseded: Vec<Superseded>,
    /// Preallocated zero tails cut off segments that are no longer written (without
    /// `discard_after` only).
    pub preallocated_cut: Vec<Preallocated>,
    /// Files removed: `*.tmp` leftovers, and with `discard_after` newer snapshots and segments.
    pub removed: Vec<String>,
    /// The fresh segment new records go to.
    pub segment: String,
}

/// The segment the writer appends to.
pub(crate) struct ActiveSegment {
    pub name: String,
    pub file: Box<dyn StorageFile>,
    /// The write position: the end of the last record written.
    pub bytes: u64,
    /// The file holds zeros from `bytes` up to here (preallocation), and ends here.
    pub zeroed: u64,
}

/// Zeros written per call while preallocating.
const ZEROS_BYTES: usize = 256 << 10;
static ZEROS: [u8; ZEROS_BYTES] = [0; ZEROS_BYTES];

impl ActiveSegment {
    /// Creates `seg-<first_seq>.log` atomically (tmp file with a synced header, rename,
    /// directory fsync), replacing a file of that name.
    pub(crate) fn create(
        storage: &dyn Storage,
        first_seq: u64,
    ) -> Result<ActiveSegment, LedgerError> {
        assert!(first_seq >= 1);
        let name = format::segment_name(first_seq);
        let tmp = format!("{name}{}", format::TMP_SUFFIX);
        let mut file = storage
            .create(&tmp)
            .map_err(|e| LedgerError::io("create", &tmp, e))?;
        file.write_all(&format::encode_segment_header(first_seq))
            .map_err(|e| LedgerError::io("write", &tmp, e))?;
        file.sync_data()
            .map_err(|e| LedgerError::io("sync", &tmp, e))?;
        storage
            .rename(&tmp, &name)
            .map_err(|e| LedgerError::io("rename", &tmp, e))?;
        storage
            .sync_dir()
            .map_err(|e| LedgerError::io("sync directory", &name, e))?;
        Ok(ActiveSegment {
            name,
            file,
            bytes: SEGMENT_HEADER_BYTES as u64,
            zeroed: SEGMENT_HEADER_BYTES as u64,
        })
    }

    /// Writes `batch` at the write position, after extending the file with zeros first if the
    /// batch and one zero record header would not fit in what is already zeroed. Not durable
    /// until `file.sync_data()`.
    pub(crate) fn write(
        &mut self,
        batch: &[u8],
        options: &LedgerOptions,
    ) -> Result<(), LedgerError> {
        let end = self.bytes + batch.len() as u64;
        // At least a whole zero header must follow the last record: that is how a reader
        // tells the preallocated end from a torn write.
        let need = end + RECORD_HEADER_BYTES as u64;
        if options.preallocate_bytes > 0 && need > self.zeroed {
            let target = need
                .max(self.zeroed.saturating_add(options.preallocate_bytes))
                .min(need.max(options.segment_bytes_max));
            let mut at = self.zeroed;
            while at < target {
                let n = (target - at).min(ZEROS_BYTES as u64) as usize;
                self.file
                    .write_all_at(at, &ZEROS[..n])
                    .map_err(|e| LedgerError::io("preallocate", &self.name, e))?;
                at += n as u64;
            }
            self.zeroed = target;
        }
        self.file
            .write_all_at(self.bytes, batch)
            .map_err(|e| LedgerError::io("write", &self.name, e))?;
        self.bytes = end;
        self.zeroed = self.zeroed.max(end);
        Ok(())
    }

    /// Cuts the preallocated zeros off a segment that will not be written again (ftruncate to
    /// the end of its last record, then fsync). Its records must all be durable.
    pub(crate) fn cut_zero_tail(&mut self, storage: &dyn Storage) -> Result<(), LedgerError> {
        if self.zeroed > self.bytes {
            storage
                .truncate(&self.name, self.bytes)
                .map_err(|e| LedgerError::io("truncate", &self.name, e))?;
            self.zeroed = self.bytes;
        }
        Ok(())
    }
}

/// A recovered ledger, ready to write: turn it into a `Committer` with `spawn`.
pub struct Ledger {
    storage: Arc<dyn Storage>,
    options: LedgerOptions,
    segment: ActiveSegment,
    next_seq: u64,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger")
            .field("segment", &self.segment.name)
            .field("next_seq", &self.next_seq)
            .finish()
    }
}

/// The result of `Ledger::open`.
#[derive(Debug)]
pub struct Recovered {
    pub ledger: Ledger,
    pub report: RecoveryReport,
}

fn replay_error<E: Into<Box<dyn std::error::Error + Send + Sync>>>(seq: u64, e: E) -> LedgerError {
    LedgerError::Replay {
        seq,
        source: Arc::from(e.into()),
    }
}

impl Ledger {
    /// Recovers the ledger in `storage`: hands the newest valid snapshot to `on_snapshot(seq,
    /// payload)`, then every later record, in order, to `on_record(seq, payload)`; truncates a torn
    /// tail; refuses mid-log corruption; and starts a fresh segment for new appends.
    ///
    /// An error from a callback stops recovery with `LedgerError::Replay` and changes nothing.
    pub fn open<E, S, R>(
        storage: Arc<dyn Storage>,
        options: LedgerOptions,
        mut on_snapshot: S,
        mut on_record: R,
    ) -> Result<Recovered, LedgerError>
    where
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
        S: FnMut(u64, &[u8]) -> Result<(), E>,
        R: FnMut(u64, &[u8]) -> Result<(), E>,
    {
        options.check()?;
        let st: &dyn Storage = &*storage;
        let listing = scan::list(st)?;
        let limit = options.discard_after.unwrap_or(u64::MAX);

        let (chosen, snapshots_invalid) =
            snapshot::newest_valid(st, &listing.snapshots, limit, options.snapshot_bytes_max)?;
        let snapshot_seq = chosen.as_ref().map_or(0, |(info, _)| info.seq);
        if let Some((info, payload)) = &chosen {
            on_snapshot(info.seq, payload).map_err(|e| replay_error(info.seq, e))?;
        }
        let snapshot = chosen.map(|(info, _)| info);

        let walk = Walk {
            storage: st,
            segments: &listing.segments,
            snapshot_seq,
            limit,
            skip_covered: true,
            deliver_from: snapshot_seq + 1,
            batch_bytes_max: options.buffer_bytes_max as u64,
        };
        let out = walk
            .run(|_, _, seq, payload| on_record(seq, payload).map_err(|e| replay_error(seq, e)))?;

        // From here on the directory changes; each step is safe to crash in and to redo.
        let mut removed = Vec::new();
        for tmp in &listing.tmp {
            st.remove(tmp)
                .map_err(|e| LedgerError::io("remove", tmp, e))?;
            removed.push(tmp.clone());
        }
        let mut preallocated_cut = Vec::new();
        if let Some(torn) = &out.torn_tail {
            st.truncate(&torn.segment, torn.offset)
                .map_err(|e| LedgerError::io("truncate", &torn.segment, e))?;
        }
        if options.discard_after.is_none() {
            // No segment read here is written again: cut their preallocated zeros (durably, which
            // also syncs what a killed writer left unsynced in them).
            for s in out.segments.iter().filter(|s| s.preallocated_bytes > 0) {
                let offset = s.bytes - s.preallocated_bytes;
                st.truncate(&s.name, offset)
                    .map_err(|e| LedgerError::io("truncate", &s.name, e))?;
                preallocated_cut.push(Preallocated {
                    segment: s.name.clone(),
                    offset,
                    bytes: s.preallocated_bytes,
                });
            }
            if let Some(last) = &out.last_live_segment {
                let done = out.torn_tail.as_ref().is_some_and(|t| &t.segment == last)
                    || preallocated_cut.iter().any(|p| &p.segment == last);
                if !done {
                    // A killed writer may have left written but unsynced records; they were just
                    // replayed, so they must be durable before anything is built on them.
                    st.sync(last)
                        .map_err(|e| LedgerError::io("sync", last, e))?;
                }
            }
        }
        let next_seq = out.last_seq + 1;
        if let Some(d) = options.discard_after {
            assert_eq!(out.last_seq, d, "the walk stops exactly at discard_after");
            for s in listing.snapshots.iter().filter(|s| s.seq > d) {
                st.remove(&s.name)
                    .map_err(|e| LedgerError::io("remove", &s.name, e))?;
                removed.push(s.name.clone());
            }
            for s in listing.segments.iter().rev().filter(|s| s.seq > next_seq) {
                st.remove(&s.name)
                    .map_err(|e| LedgerError::io("remove", &s.name, e))?;
                removed.push(s.name.clone());
            }
        }
        if !removed.is_empty() {
            st.sync_dir()
                .map_err(|e| LedgerError::io("sync directory", "ledger directory", e))?;
        }
        // Replaces seg-<next_seq> if it exists: it can only hold records after the live ones.
        let segment = ActiveSegment::create(st, next_seq)?;
        let report = RecoveryReport {
            snapshot,
            snapshots_invalid,
            segments_read: out.segments.len(),
            records_replayed: out.records_delivered,
            last_seq: out.last_seq,
            torn_tail: out.torn_tail,
            superseded: out.superseded,
            preallocated_cut,
            removed,
            segment: segment.name.clone(),
        };
        Ok(Recovered {
            ledger: Ledger {
                storage,
                options,
                segment,
                next_seq,
            },
            report,
        })
    }

    /// The seq the next append will get.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Starts the group-commit thread. `notify` is called from that thread after every sync
    /// with the new durable seq, or once with the error that failed the committer; keep it cheap.
    pub fn spawn<N>(self, notify: N) -> Result<Committer, LedgerError>
    where
        N: Fn(Result<u64, LedgerError>) + Send + Sync + 'static,
    {
        commit::spawn(
            self.storage,
            self.options,
            self.segment,
            self.next_seq,
            Box::new(notify),
        )
    }
}
