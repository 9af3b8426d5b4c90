//! Group commit: `Committer` is a cheap, cloneable handle; one sync thread owns the segment file,
//! swaps out the whole append buffer, writes it with one positional write (into zeros it
//! preallocated ahead of it) and one fdatasync, and publishes the durable seq. Any write or sync
//! error fails the committer closed, for good.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::error::LedgerError;
use crate::format::{self, RECORD_HEADER_BYTES, SEGMENT_HEADER_BYTES};
use crate::ledger::{ActiveSegment, LedgerOptions};
use crate::snapshot::{self, SnapshotInfo};
use crate::storage::Storage;

/// The name of the ledger's sync thread (the daemon ends the process if it panics).
pub const SYNC_THREAD_NAME: &str = "estop-ledger-sync";
/// Called from the sync thread after each sync: `Ok(durable seq)`, or once `Err(Failed)`.
pub type Notify = Box<dyn Fn(Result<u64, LedgerError>) + Send + Sync>;

/// What `Committer::snapshot` wrote and removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotReport {
    pub snapshot: SnapshotInfo,
    /// Old snapshots and segments removed by retention.
    pub removed: Vec<String>,
}

struct State {
    /// Framed records not yet taken by a sync, in seq order.
    buf: Vec<u8>,
    /// The buffer the last sync wrote, cleared, to swap in for `buf` at the next one.
    spare: Vec<u8>,
    next_seq: u64,
    /// The sync thread is waiting for work (so an append must wake it).
    sync_idle: bool,
    /// Records in the last batch synced.
    last_batch_records: u64,
    /// A batch is being written and synced (by the sync thread or by `commit`); the next
    /// one waits for it, so batches reach the file in seq order.
    syncing: bool,
    /// Threads blocked in `wait_durable`.
    waiters: usize,
    /// Set once, by the sync thread, on the first error.
    failed: Option<LedgerError>,
    /// The last handle is gone: drain and stop.
    closing: bool,
    /// The sync thread has exited.
    stopped: bool,
}

struct Shared {
    state: Mutex<State>,
    /// The file and how far it is durable; held by whoever syncs.
    writer: Mutex<Writer>,
    work: Condvar,
    durable_cv: Condvar,
    durable: AtomicU64,
    storage: Arc<dyn Storage>,
    options: LedgerOptions,
    notify: Notify,
    // Serializes snapshot writing and retention.
    snapshot_lock: Mutex<()>,
}

/// The active segment and the last seq synced into it.
struct Writer {
    segment: ActiveSegment,
    durable: u64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Critical sections do not panic midway; a poisoned lock still holds a consistent state.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

struct Owner {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        if self.shared.options.caller_syncs {
            // No thread: the last handle syncs what is buffered itself.
            let mut st = self.shared.lock();
            st.closing = true;
            if !st.buf.is_empty() && !st.syncing && st.failed.is_none() {
                let (batch, last_seq) = take_batch(&mut st);
                drop(st);
                sync_batch(&self.shared, batch, last_seq);
            }
            return;
        }
        // The last handle: sync what is buffered, then stop the thread.
        let idle = {
            let mut st = self.shared.lock();
            st.closing = true;
            st.sync_idle
        };
        if idle {
            self.shared.work.notify_one();
        }
        let handle = self
            .thread
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(h) = handle {
            // A panic in the sync thread already failed every waiter; nothing more to do here.
            let _ = h.join();
        }
    }
}

/// The writer of a ledger: `append` buffers, one thread syncs. Clones share the same writer;
/// dropping the last clone syncs what is buffered and stops the thread.
#[derive(Clone)]
pub struct Committer {
    owner: Arc<Owner>,
}

impl std::fmt::Debug for Committer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Committer")
            .field("durable", &self.durable())
            .finish()
    }
}

pub(crate) fn spawn(
    storage: Arc<dyn Storage>,
    options: LedgerOptions,
    segment: ActiveSegment,
    next_seq: u64,
    notify: Notify,
) -> Result<Committer, LedgerError> {
    assert!(next_seq >= 1);
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            buf: Vec::with_capacity(options.buffer_bytes_max.min(1 << 20)),
            spare: Vec::with_capacity(options.buffer_bytes_max.min(1 << 20)),
            next_seq,
            // Without a sync thread the caller always finds the syncer idle: it syncs itself.
            sync_idle: options.caller_syncs,
            syncing: false,
            last_batch_records: 0,
            waiters: 0,
            failed: None,
            closing: false,
            stopped: false,
        }),
        writer: Mutex::new(Writer {
            segment,
            durable: next_seq - 1,
        }),
        work: Condvar::new(),
        durable_cv: Condvar::new(),
        durable: AtomicU64::new(next_seq - 1),
        storage,
        options,
        notify,
        snapshot_lock: Mutex::new(()),
    });
    let thread = if shared.options.caller_syncs {
        None
    } else {
        let thread_shared = shared.clone();
        Some(
            std::thread::Builder::new()
                .name(SYNC_THREAD_NAME.to_owned())
                .spawn(move || sync_loop(&thread_shared))
                .map_err(|e| LedgerError::io("spawn sync thread", "", e))?,
        )
    };
    Ok(Committer {
        owner: Arc::new(Owner {
            shared,
            thread: Mutex::new(thread),
        }),
    })
}

fn sync_loop(shared: &Shared) {
    loop {
        let (batch, last_seq) = {
            let mut st = shared.lock();
            while st.buf.is_empty() || st.syncing {
                if st.closing && st.buf.is_empty() && !st.syncing {
                    st.stopped = true;
                    drop(st);
                    shared.durable_cv.notify_all();
                    return;
                }
                if st.stopped {
                    return; // Failed (by an inline sync).
                }
                st.sync_idle = true;
                st = shared
                    .work
                    .wait(st)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                st.sync_idle = false;
            }
            take_batch(&mut st)
        };
        if !sync_batch(shared, batch, last_seq) {
            return;
        }
    }
}

/// Takes the whole buffer for one sync (appends go on filling the empty spare meanwhile).
/// The caller must have seen `!syncing` and a non-empty buffer.
fn take_batch(st: &mut State) -> (Vec<u8>, u64) {
    debug_assert!(!st.syncing && !st.buf.is_empty());
    st.syncing = true;
    let spare = std::mem::take(&mut st.spare);
    (std::mem::replace(&mut st.buf, spare), st.next_seq - 1)
}

/// Writes and syncs one batch taken with `take_batch`, publishes the new durable seq and hands
/// the batch's buffer back. Returns false once the committer failed.
fn sync_batch(shared: &Shared, mut batch: Vec<u8>, last_seq: u64) -> bool {
    let mut w = shared
        .writer
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    assert!(last_seq > w.durable, "a non-empty batch holds new records");
    let first_seq = w.durable + 1;
    match write_batch(shared, &mut w.segment, &batch, first_seq) {
        Ok(sync) => {
            if let Some(stats) = &shared.options.sync_stats.0 {
                stats.record_batch(sync, last_seq - w.durable, batch.len() as u64);
            }
            w.durable = last_seq;
            shared.durable.store(last_seq, Ordering::Release);
            // Publish before the next batch can start: notifications arrive in seq order.
            (shared.notify)(Ok(last_seq));
            drop(w);
            batch.clear();
            let records = last_seq - first_seq + 1;
            let (waiters, wake_sync_thread) = {
                let mut st = shared.lock();
                st.syncing = false;
                st.last_batch_records = records;
                st.spare = batch;
                (
                    st.waiters,
                    st.sync_idle && (!st.buf.is_empty() || st.closing),
                )
            };
            if waiters > 0 {
                shared.durable_cv.notify_all();
            }
            if wake_sync_thread {
                shared.work.notify_one();
            }
            true
        }
        Err(cause) => {
            // Fail closed: never retry, never touch this file again.
            let failed = LedgerError::Failed {
                cause: Arc::new(cause),
            };
            {
                let mut st = shared.lock();
                st.failed = Some(failed.clone());
                st.buf = Vec::new();
                st.stopped = true;
                st.syncing = false;
            }
            drop(w);
            shared.durable_cv.notify_all();
            shared.work.notify_all();
            (shared.notify)(Err(failed));
            false
        }
    }
}

fn write_batch(
    shared: &Shared,
    segment: &mut ActiveSegment,
    batch: &[u8],
    first_seq: u64,
) -> Result<std::time::Duration, LedgerError> {
    let opts = &shared.options;
    if segment.bytes > SEGMENT_HEADER_BYTES as u64
        && segment.bytes + batch.len() as u64 > opts.segment_bytes_max
    {
        // Everything in the old segment is durable already; it is never written again. Its
        // preallocated zeros are cut (durably) before the next segment exists, so a segment that
        // is not the last never holds any.
        segment.cut_zero_tail(&*shared.storage)?;
        *segment = ActiveSegment::create(&*shared.storage, first_seq)?;
    }
    debug_assert_eq!(format::decode_record_header(batch).seq, first_seq);
    segment.write(batch, opts)?;
    let started = std::time::Instant::now();
    segment
        .file
        .sync_data()
        .map_err(|e| LedgerError::io("sync", &segment.name, e))?;
    Ok(started.elapsed())
}

impl Committer {
    fn shared(&self) -> &Shared {
        &self.owner.shared
    }

    /// Buffers one record and returns its seq at once; it is durable once `durable() >= seq`.
    /// Never blocks on IO. Refuses with `record_too_large`, `backpressure` (buffer full: retry
    /// after the next sync) or `ledger_failed` (reopen with `discard_after`).
    pub fn append(&self, payload: &[u8]) -> Result<u64, LedgerError> {
        let seq = self.append_deferred(payload)?;
        self.commit(false);
        Ok(seq)
    }

    /// Like `append`, but does not start a sync: the record waits in the buffer until the
    /// next `commit`, `append`, `flush`, `wait_durable` or `snapshot`. Lets a caller that
    /// appends a burst start one sync for all of it, and choose where that sync runs.
    pub fn append_deferred(&self, payload: &[u8]) -> Result<u64, LedgerError> {
        let sh = self.shared();
        let max = sh.options.record_bytes_max;
        if payload.len() > max {
            return Err(LedgerError::RecordTooLarge {
                bytes: payload.len(),
                max,
            });
        }
        // Checksum the payload outside the lock; only len and seq are added under it.
        let payload_crc = crc32c::crc32c(payload);
        let framed = RECORD_HEADER_BYTES + payload.len();
        let mut st = sh.lock();
        if let Some(f) = &st.failed {
            return Err(f.clone());
        }
        if st.closing || st.stopped {
            return Err(LedgerError::Closed);
        }
        if st.buf.len() + framed > sh.options.buffer_bytes_max {
            return Err(LedgerError::Backpressure {
                buffered_bytes: st.buf.len(),
                max: sh.options.buffer_bytes_max,
            });
        }
        let seq = st.next_seq;
        st.next_seq += 1;
        format::append_record(&mut st.buf, seq, payload, payload_crc);
        Ok(seq)
    }

    /// Starts syncing what is buffered, unless a sync is running (it takes the buffer when it
    /// is done). With `inline`, and the sync thread idle, the caller writes and syncs on its own
    /// thread — one thread handoff less per commit, for when nothing else would use the time —
    /// and returns once that sync is done; the outcome reaches `notify` and `durable()` exactly
    /// as from the sync thread. Otherwise it wakes the sync thread and returns at once.
    /// Returns whether the sync ran on the caller's thread. With `caller_syncs` every commit
    /// is inline.
    pub fn commit(&self, inline: bool) -> bool {
        let sh = self.shared();
        let mut st = sh.lock();
        if st.buf.is_empty() || st.syncing || !st.sync_idle || st.failed.is_some() {
            return false;
        }
        if inline || sh.options.caller_syncs {
            let (batch, last_seq) = take_batch(&mut st);
            drop(st);
            sync_batch(sh, batch, last_seq);
            true
        } else {
            st.sync_idle = false;
            drop(st);
            sh.work.notify_one();
            false
        }
    }

    /// How many records the last sync carried: a caller choosing `commit(inline)` can tell a
    /// lone request from a stream of them.
    pub fn last_batch_records(&self) -> u64 {
        self.shared().lock().last_batch_records
    }

    /// The highest seq known durable (every record up to it is on stable storage).
    pub fn durable(&self) -> u64 {
        self.shared().durable.load(Ordering::Acquire)
    }

    /// The seq the next append will get.
    pub fn next_seq(&self) -> u64 {
        self.shared().lock().next_seq
    }

    /// Blocks until `seq` is durable. Errs with `ledger_failed` if the committer failed first.
    /// `seq` must have been returned by `append` (asserted).
    pub fn wait_durable(&self, seq: u64) -> Result<(), LedgerError> {
        let sh = self.shared();
        if sh.durable.load(Ordering::Acquire) >= seq {
            return Ok(());
        }
        self.commit(false);
        let mut st = sh.lock();
        assert!(
            seq < st.next_seq,
            "wait_durable({seq}) for a seq never appended"
        );
        if sh.options.caller_syncs {
            // The commit above synced on this thread, or the committer failed (or closed): no
            // one else would ever make `seq` durable.
            return if sh.durable.load(Ordering::Acquire) >= seq {
                Ok(())
            } else {
                Err(st.failed.clone().unwrap_or(LedgerError::Closed))
            };
        }
        loop {
            if sh.durable.load(Ordering::Acquire) >= seq {
                return Ok(());
            }
            if let Some(f) = &st.failed {
                return Err(f.clone());
            }
            if st.stopped {
                return Err(LedgerError::Closed);
            }
            st.waiters += 1;
            st = sh
                .durable_cv
                .wait(st)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            st.waiters -= 1;
        }
    }

    /// Waits until everything appended before this call is durable; returns that seq.
    /// For shutdown: finishes in-flight syncs.
    pub fn flush(&self) -> Result<u64, LedgerError> {
        let target = {
            let st = self.shared().lock();
            if let Some(f) = &st.failed {
                return Err(f.clone());
            }
            st.next_seq - 1
        };
        self.wait_durable(target)?;
        Ok(target)
    }

    /// Writes a snapshot covering records `1..=seq` (waiting until `seq` is durable first), then
    /// applies retention: keeps the newest `snapshots_keep` snapshots and removes the segments
    /// whose records are all covered by the oldest kept one. Runs on the caller's thread; appends
    /// and syncs go on meanwhile.
    pub fn snapshot(&self, seq: u64, bytes: &[u8]) -> Result<SnapshotReport, LedgerError> {
        let sh = self.shared();
        assert!(seq >= 1, "a snapshot covers at least one record");
        if bytes.len() as u64 > sh.options.snapshot_bytes_max {
            return Err(LedgerError::Options {
                reason: format!(
                    "snapshot of {} bytes is larger than snapshot_bytes_max = {}",
                    bytes.len(),
                    sh.options.snapshot_bytes_max
                ),
            });
        }
        let _one_at_a_time = sh
            .snapshot_lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.wait_durable(seq)?;
        if let Some(f) = &sh.lock().failed {
            return Err(f.clone());
        }
        let snapshot = snapshot::write(&*sh.storage, seq, bytes)?;
        let removed = snapshot::retain(&*sh.storage, sh.options.snapshots_keep)?;
        Ok(SnapshotReport { snapshot, removed })
    }

    /// True once the committer failed; `append` then always errs.
    pub fn failed(&self) -> Option<LedgerError> {
        self.shared().lock().failed.clone()
    }
}
