//! `raw_fsync_probe`: how fast this disk does append + fdatasync of a small record, measured
//! without the ledger, so benchmarks can print the ledger's figures next to the machine's.
//! `raw_overwrite_probe`: the same for overwrites of zeros written (and synced) beforehand, which
//! is what the ledger does with preallocation on. `group_commit_probe`: the disk's raw
//! group-commit ceiling, many writers and one syncer, no protocol.

use std::fs::OpenOptions;
use std::io::{self, Seek, SeekFrom, Write};
use std::path::Path;
use std::time::Instant;

/// Latency of append (or overwrite) + fdatasync of one small record on a real directory.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FsyncProbe {
    pub syncs: u32,
    pub record_bytes: usize,
    pub p50_us: f64,
    pub p99_us: f64,
    pub mean_us: f64,
    pub syncs_per_s: f64,
}

/// Appends a `record_bytes`-byte record and calls fdatasync, `syncs` times, to a scratch file in
/// `dir` (removed afterwards).
pub fn raw_fsync_probe(dir: &Path, syncs: u32, record_bytes: usize) -> io::Result<FsyncProbe> {
    run_probe(dir, syncs, record_bytes, false)
}

/// Writes and syncs `syncs * record_bytes` zeros to a scratch file in `dir` (removed afterwards),
/// then overwrites them from the start with a `record_bytes`-byte record and an fdatasync,
/// `syncs` times: the file size never changes, as with the ledger's preallocated segments.
pub fn raw_overwrite_probe(dir: &Path, syncs: u32, record_bytes: usize) -> io::Result<FsyncProbe> {
    run_probe(dir, syncs, record_bytes, true)
}

fn run_probe(
    dir: &Path,
    syncs: u32,
    record_bytes: usize,
    overwrite: bool,
) -> io::Result<FsyncProbe> {
    assert!(syncs >= 1);
    let path = dir.join(format!("estop-fsync-probe-{}.tmp", std::process::id()));
    let result = probe(&path, syncs, record_bytes, overwrite);
    let removed = std::fs::remove_file(&path);
    let p = result?;
    removed?;
    Ok(p)
}

fn probe(path: &Path, syncs: u32, record_bytes: usize, overwrite: bool) -> io::Result<FsyncProbe> {
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    if overwrite {
        // Real zeros, not fallocate: unwritten extents would need a journal commit when first
        // written, like an append.
        let zeros = vec![0u8; record_bytes * syncs as usize];
        file.write_all(&zeros)?;
        file.sync_all()?;
        file.seek(SeekFrom::Start(0))?;
    }
    let record = vec![0x5au8; record_bytes];
    let mut lat_ns = Vec::with_capacity(syncs as usize);
    let start = Instant::now();
    for _ in 0..syncs {
        let t = Instant::now();
        file.write_all(&record)?;
        file.sync_data()?;
        lat_ns.push(t.elapsed().as_nanos() as u64);
    }
    let total_s = start.elapsed().as_secs_f64();
    lat_ns.sort_unstable();
    let pct = |p: f64| lat_ns[((lat_ns.len() - 1) as f64 * p).round() as usize] as f64 / 1000.0;
    Ok(FsyncProbe {
        syncs,
        record_bytes,
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        mean_us: total_s * 1e6 / f64::from(syncs),
        syncs_per_s: f64::from(syncs) / total_s,
    })
}

/// What one run of `group_commit_probe` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupCommitOptions {
    /// Writer threads, each with one record outstanding at a time (a closed loop).
    pub writers: usize,
    pub record_bytes: usize,
    /// How long the writers keep writing.
    pub duration: std::time::Duration,
    /// Overwrite zeros written and synced beforehand (as the ledger's preallocated segments are)
    /// instead of appending.
    pub overwrite: bool,
    /// How long a writer sleeps between its record's reply and handing over its next one (zero
    /// for the ceiling): stands for a protocol's round trip and work, to study batching.
    pub turnaround: std::time::Duration,
    /// Zero for the ceiling. Otherwise the syncer waits up to this long, from the moment it has
    /// records, for a record from every writer before it takes the next batch: a group-commit
    /// delay (in a closed loop every writer is either handed over or on its way back).
    pub gather: std::time::Duration,
    /// Syncer threads (1 for the ceiling). With more, a batch is taken while earlier ones are
    /// still being synced, each with its own write and fdatasync, and replies are released in
    /// batch order: overlapping fdatasyncs of one file.
    pub syncers: usize,
}

/// The disk's raw group-commit rate: no protocol, no parsing, no state, one file.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupCommitProbe {
    pub options: GroupCommitOptions,
    /// Records made durable (each writer's record counts once its batch's fdatasync returned).
    pub records: u64,
    /// Batches, one write and one fdatasync each.
    pub syncs: u64,
    /// The largest batch: never more than `writers`, since each has one record outstanding.
    pub batch_records_max: u64,
    pub seconds: f64,
    pub records_per_s: f64,
    pub mean_batch_records: f64,
    /// Mean time of one batch's write + fdatasync.
    pub mean_sync_us: f64,
    /// The file's size when the probe ended: `records * record_bytes` when appending; the
    /// preallocated size, unchanged, when overwriting.
    pub file_bytes: u64,
}

/// The disk's raw group-commit ceiling: `writers` threads each hand a `record_bytes`-byte record
/// to one syncer thread and wait; the syncer takes every record handed over since its last sync
/// as one batch, writes it with one write, fdatasyncs it, and only then wakes the batch's writers,
/// which hand over their next record. Runs for `duration` on a scratch file in `dir` (removed
/// afterwards). This is the ledger's group commit with nothing else: what a design that makes
/// each record durable before its reply could reach on this disk with this many clients.
pub fn group_commit_probe(dir: &Path, options: GroupCommitOptions) -> io::Result<GroupCommitProbe> {
    assert!(options.writers >= 1 && options.record_bytes >= 1);
    let path = dir.join(format!(
        "estop-group-commit-probe-{}.tmp",
        std::process::id()
    ));
    let result = group_commit::run(&path, options);
    let removed = std::fs::remove_file(&path);
    let p = result?;
    removed?;
    Ok(p)
}

mod group_commit {
    use super::{GroupCommitOptions, GroupCommitProbe};
    use std::fs::{File, OpenOptions};
    use std::io::{self, Write};
    use std::os::unix::fs::FileExt;
    use std::path::Path;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Barrier, Condvar, Mutex, MutexGuard};
    use std::thread::Thread;
    use std::time::{Duration, Instant};

    /// Bytes of zeros an overwriting probe writes first; batches wrap around inside them.
    const OVERWRITE_AREA_BYTES: usize = 16 << 20;

    struct Queue {
        /// Records handed over since the syncer last took a batch.
        buf: Vec<u8>,
        /// The writers of those records, woken once their batch is durable.
        waiting: Vec<Thread>,
        /// Records handed over in all; the last of them is record number `queued`.
        queued: u64,
        /// Syncers waiting for records.
        syncers_idle: usize,
        stop: bool,
        /// Where the next overwriting batch goes.
        offset: usize,
        /// Batches are numbered as taken; `publish` is the next whose durability may be made
        /// known, `done` those synced out of turn (their last record and writers).
        taken: u64,
        publish: u64,
        done: std::collections::BTreeMap<u64, (u64, Vec<Thread>)>,
    }

    struct Shared {
        queue: Mutex<Queue>,
        work: Condvar,
        /// Every record numbered up to this one is durable.
        durable: AtomicU64,
    }

    impl Shared {
        fn lock(&self) -> MutexGuard<'_, Queue> {
            self.queue
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        }
    }

    struct Synced {
        records: u64,
        syncs: u64,
        batch_records_max: u64,
        sync_ns: u64,
    }

    pub(super) fn run(path: &Path, o: GroupCommitOptions) -> io::Result<GroupCommitProbe> {
        let mut file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        let area = OVERWRITE_AREA_BYTES.max(2 * o.writers * o.record_bytes);
        if o.overwrite {
            // Real zeros, not fallocate (see `probe`).
            file.write_all(&vec![0u8; area])?;
            file.sync_all()?;
        }
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                buf: Vec::with_capacity(o.writers * o.record_bytes),
                waiting: Vec::with_capacity(o.writers),
                queued: 0,
                syncers_idle: 0,
                stop: false,
                offset: 0,
                taken: 0,
                publish: 0,
                done: std::collections::BTreeMap::new(),
            }),
            work: Condvar::new(),
            durable: AtomicU64::new(0),
        });
        let syncers_n = o.syncers.max(1);
        let start = Arc::new(Barrier::new(o.writers + syncers_n + 1));
        let writers: Vec<_> = (0..o.writers)
            .map(|_| {
                let (shared, start) = (Arc::clone(&shared), Arc::clone(&start));
                std::thread::spawn(move || writer(&shared, &start, o.record_bytes, o.turnaround))
            })
            .collect();
        let file = Arc::new(file);
        let area = if o.overwrite { Some(area) } else { None };
        let syncers: Vec<_> = (0..syncers_n)
            .map(|_| {
                let (shared, start, file) =
                    (Arc::clone(&shared), Arc::clone(&start), Arc::clone(&file));
                std::thread::spawn(move || {
                    syncer(&shared, &start, &file, area, o.gather, o.writers)
                })
            })
            .collect();
        start.wait();
        let t = Instant::now();
        std::thread::sleep(o.duration);
        shared.lock().stop = true;
        // Every syncer, not one: an idle syncer left waiting would never be joined.
        shared.work.notify_all();
        for w in writers {
            w.join()
                .map_err(|_| io::Error::other("a probe writer panicked"))?;
        }
        let mut synced = Synced {
            records: 0,
            syncs: 0,
            batch_records_max: 0,
            sync_ns: 0,
        };
        for h in syncers {
            let s = h
                .join()
                .map_err(|_| io::Error::other("a probe syncer panicked"))??;
            synced.records += s.records;
            synced.syncs += s.syncs;
            synced.batch_records_max = synced.batch_records_max.max(s.batch_records_max);
            synced.sync_ns += s.sync_ns;
        }
        let seconds = t.elapsed().as_secs_f64();
        let file_bytes = std::fs::metadata(path)?.len();
        Ok(summarize(o, &synced, seconds, file_bytes))
    }

    fn summarize(
        o: GroupCommitOptions,
        s: &Synced,
        seconds: f64,
        file_bytes: u64,
    ) -> GroupCommitProbe {
        let syncs = s.syncs.max(1) as f64;
        GroupCommitProbe {
            options: o,
            records: s.records,
            syncs: s.syncs,
            batch_records_max: s.batch_records_max,
            seconds,
            records_per_s: s.records as f64 / seconds.max(1e-9),
            mean_batch_records: s.records as f64 / syncs,
            mean_sync_us: s.sync_ns as f64 / syncs / 1000.0,
            file_bytes,
        }
    }

    fn writer(shared: &Shared, start: &Barrier, record_bytes: usize, turnaround: Duration) {
        let record = vec![0x5au8; record_bytes];
        let me = std::thread::current();
        start.wait();
        for i in 0u64.. {
            if i > 0 && !turnaround.is_zero() {
                std::thread::sleep(turnaround);
            }
            let seq = {
                let mut q = shared.lock();
                // Checked under the lock the syncer stops under, so no record is left behind.
                if q.stop {
                    return;
                }
                q.buf.extend_from_slice(&record);
                q.waiting.push(me.clone());
                q.queued += 1;
                if q.syncers_idle > 0 {
                    shared.work.notify_one();
                }
                q.queued
            };
            // The reply: only once the batch holding this record is durable.
            while shared.durable.load(Ordering::Acquire) < seq {
                std::thread::park();
            }
        }
    }

    fn syncer(
        shared: &Shared,
        start: &Barrier,
        file: &File,
        overwrite_area: Option<usize>,
        gather: Duration,
        writers: usize,
    ) -> io::Result<Synced> {
        let mut batch = Vec::new();
        let mut woken: Vec<Thread> = Vec::new();
        let mut s = Synced {
            records: 0,
            syncs: 0,
            batch_records_max: 0,
            sync_ns: 0,
        };
        start.wait();
        loop {
            let (ticket, last, offset) = {
                let mut q = shared.lock();
                let mut deadline = None;
                while q.buf.is_empty() || (!gather.is_zero() && q.waiting.len() < writers) {
                    if q.stop {
                        if q.buf.is_empty() {
                            return Ok(s);
                        }
                        break;
                    }
                    q.syncers_idle += 1;
                    if q.buf.is_empty() {
                        q = shared
                            .work
                            .wait(q)
                            .unwrap_or_else(std::sync::PoisonError::into_inner);
                    } else {
                        let d = *deadline.get_or_insert_with(|| Instant::now() + gather);
                        let left = d.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            q.syncers_idle -= 1;
                            break;
                        }
                        q = shared
                            .work
                            .wait_timeout(q, left)
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .0;
                    }
                    q.syncers_idle -= 1;
                }
                std::mem::swap(&mut q.buf, &mut batch);
                std::mem::swap(&mut q.waiting, &mut woken);
                // Each batch's place in the file is decided here, in the order batches are
                // taken: appended after the previous one, or overwriting the zeros after it.
                let at = match overwrite_area {
                    Some(area) if q.offset + batch.len() > area => 0,
                    _ => q.offset,
                };
                q.offset = at + batch.len();
                let ticket = q.taken;
                q.taken += 1;
                (ticket, q.queued, at)
            };
            let t = Instant::now();
            file.write_all_at(&batch, offset as u64)?;
            file.sync_data()?;
            s.sync_ns += u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
            s.syncs += 1;
            let n = woken.len() as u64;
            s.records += n;
            s.batch_records_max = s.batch_records_max.max(n);
            // Replies in batch order: a batch synced before an earlier one waits for it.
            let release = {
                let mut guard = shared.lock();
                let q = &mut *guard;
                q.done.insert(ticket, (last, std::mem::take(&mut woken)));
                let mut release = Vec::new();
                while let Some(entry) = q.done.first_entry() {
                    if *entry.key() != q.publish {
                        break;
                    }
                    let (last, threads) = entry.remove();
                    q.publish += 1;
                    shared.durable.store(last, Ordering::Release);
                    release.extend(threads);
                }
                release
            };
            for w in release {
                w.unpark();
            }
            batch.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn options(overwrite: bool) -> GroupCommitOptions {
        GroupCommitOptions {
            writers: 8,
            record_bytes: 128,
            duration: Duration::from_millis(60),
            overwrite,
            turnaround: Duration::ZERO,
            gather: Duration::ZERO,
            syncers: 1,
        }
    }

    #[test]
    fn appending_group_commit_writes_every_record_once_in_batches_of_at_most_one_per_writer() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = group_commit_probe(dir.path(), options(false)).expect("probe");
        assert!(p.records >= 1 && p.syncs >= 1, "{p:?}");
        // Every record handed over was written once: the file is exactly the records.
        assert_eq!(p.file_bytes, p.records * 128, "{p:?}");
        // A writer has one record outstanding, so no batch holds more than one per writer.
        assert!(p.batch_records_max <= 8, "{p:?}");
        assert!(
            p.mean_batch_records >= 1.0 && p.mean_batch_records <= 8.0,
            "{p:?}"
        );
        let mean = p.records as f64 / p.syncs as f64;
        assert!((p.mean_batch_records - mean).abs() < 1e-9);
        assert!((p.records_per_s - p.records as f64 / p.seconds).abs() < 1e-6 * p.records_per_s);
        // The scratch file is gone.
        assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0);
    }

    #[test]
    fn overwriting_group_commit_never_changes_the_file_size() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = group_commit_probe(dir.path(), options(true)).expect("probe");
        assert!(p.records >= 1, "{p:?}");
        assert_eq!(p.file_bytes, 16 << 20, "{p:?}");
        assert!(p.batch_records_max <= 8, "{p:?}");
    }

    #[test]
    fn a_gathering_syncer_fills_its_batches_with_every_writer() {
        let dir = tempfile::tempdir().expect("tempdir");
        let o = GroupCommitOptions {
            // Long enough that eight threads on any machine hand their records over in time.
            gather: Duration::from_secs(5),
            duration: Duration::from_millis(30),
            ..options(false)
        };
        let p = group_commit_probe(dir.path(), o).expect("probe");
        assert_eq!(p.batch_records_max, 8, "{p:?}");
        assert_eq!(p.file_bytes, p.records * 128, "{p:?}");
    }

    #[test]
    fn overlapping_syncers_write_every_record_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let o = GroupCommitOptions {
            syncers: 3,
            ..options(false)
        };
        let p = group_commit_probe(dir.path(), o).expect("probe");
        assert!(p.records >= 1, "{p:?}");
        // Batches reserve their places in the file in turn, so none overlaps another.
        assert_eq!(p.file_bytes, p.records * 128, "{p:?}");
        assert!(p.batch_records_max <= 8, "{p:?}");
    }

    #[test]
    fn single_probes_report_ordered_percentiles() {
        let dir = tempfile::tempdir().expect("tempdir");
        for p in [
            raw_fsync_probe(dir.path(), 20, 128).expect("append"),
            raw_overwrite_probe(dir.path(), 20, 128).expect("overwrite"),
        ] {
            assert_eq!(p.syncs, 20);
            assert!(p.p50_us > 0.0 && p.p50_us <= p.p99_us, "{p:?}");
        }
    }
}
