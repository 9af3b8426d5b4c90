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
    /// Framed records not yet taken by the sync thread, in seq order.
    buf: Vec<u8>,
    next_seq: u64,
    /// The sync thread is waiting for work (so an append must wake it).
    sync_idle: bool,
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
    work: Condvar,
    durable_cv: Condvar,
    durable: AtomicU64,
    storage: Arc<dyn Storage>,
    options: LedgerOptions,
    notify: Notify,
    // Serializes snapshot writing and retention.
    snapshot_lock: Mutex<()>,
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
            next_seq,
            sync_idle: false,
            waiters: 0,
            failed: None,
            closing: false,
            stopped: false,
        }),
        work: Condvar::new(),
        durable_cv: Condvar::new(),
        durable: AtomicU64::new(next_seq - 1),
        storage,
        options,
        notify,
        snapshot_lock: Mutex::new(()),
    });
    let thread_shared = shared.clone();
    let thread = std::thread::Builder::new()
        .name("estop-ledger-sync".to_owned())
        .spawn(move || sync_loop(&thread_shared, segment, next_seq - 1))
        .map_err(|e| LedgerError::io("spawn sync thread", "", e))?;
    Ok(Committer {
        owner: Arc::new(Owner {
            shared,
            thread: Mutex::new(Some(thread)),
        }),
    })
}

fn sync_loop(shared: &Shared, mut segment: ActiveSegment, mut durable: u64) {
    let mut batch: Vec<u8> = Vec::with_capacity(shared.options.buffer_bytes_max.min(1 << 20));
    loop {
        let last_seq = {
            let mut st = shared.lock();
            while st.buf.is_empty() {
                if st.closing {
                    st.stopped = true;
                    drop(st);
                    shared.durable_cv.notify_all();
                    return;
                }
                st.sync_idle = true;
                st = shared
                    .work
                    .wait(st)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                st.sync_idle = false;
            }
            // Take the whole buffer; appends go on filling the (empty) spare meanwhile.
            std::mem::swap(&mut st.buf, &mut batch);
            st.next_seq - 1
        };
        assert!(last_seq > durable, "a non-empty batch holds new records");
        match write_batch(shared, &mut segment, &batch, durable + 1) {
            Ok(sync) => {
                if let Some(stats) = &shared.options.sync_stats.0 {
                    stats.record_batch(sync, last_seq - durable, batch.len() as u64);
                }
                durable = last_seq;
                shared.durable.store(durable, Ordering::Release);
                let waiters = shared.lock().waiters;
                if waiters > 0 {
                    shared.durable_cv.notify_all();
                }
                (shared.notify)(Ok(durable));
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
                }
                shared.durable_cv.notify_all();
                (shared.notify)(Err(failed));
                return;
            }
        }
        batch.clear();
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
        if st.sync_idle {
            st.sync_idle = false;
            drop(st);
            sh.work.notify_one();
        }
        Ok(seq)
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
        let mut st = sh.lock();
        assert!(
            seq < st.next_seq,
            "wait_durable({seq}) for a seq never appended"
        );
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
