//! Group-commit statistics for metrics: how long each fdatasync took and how many records and
//! bytes each batch carried. Fixed buckets and relaxed atomics: recording costs two clock reads
//! and a few atomic adds per batch, nothing per record.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds (inclusive) of the sync-latency buckets, in microseconds.
pub const SYNC_US_BUCKETS: &[u64] = &[
    50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 1_000_000,
];
/// Upper bounds (inclusive) of the batch-size buckets, in records.
pub const BATCH_RECORDS_BUCKETS: &[u64] = &[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096];

/// A histogram with fixed bucket bounds; the last slot counts values above every bound.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [u64],
    counts: Vec<AtomicU64>,
    sum: AtomicU64,
}

/// A copy of a histogram's counters (not cumulative: `counts[i]` is bucket `i` alone).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistogramSnapshot {
    pub bounds: &'static [u64],
    /// One per bound, then one for values above the last bound.
    pub counts: Vec<u64>,
    pub sum: u64,
}

impl HistogramSnapshot {
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }
}

impl Histogram {
    pub fn new(bounds: &'static [u64]) -> Histogram {
        assert!(bounds.windows(2).all(|w| w[0] < w[1]), "bounds ascend");
        Histogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicU64::new(0),
        }
    }

    pub fn record(&self, value: u64) {
        let i = self.bounds.partition_point(|b| *b < value);
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum.fetch_add(value, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> HistogramSnapshot {
        HistogramSnapshot {
            bounds: self.bounds,
            counts: self
                .counts
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .collect(),
            sum: self.sum.load(Ordering::Relaxed),
        }
    }
}

/// What the sync thread records for each group commit.
#[derive(Debug)]
pub struct SyncStats {
    /// fdatasync latency of each batch, in microseconds.
    pub sync_us: Histogram,
    /// Records per batch (one fdatasync each).
    pub batch_records: Histogram,
    /// Bytes written in all batches.
    pub bytes: AtomicU64,
}

impl Default for SyncStats {
    fn default() -> Self {
        SyncStats {
            sync_us: Histogram::new(SYNC_US_BUCKETS),
            batch_records: Histogram::new(BATCH_RECORDS_BUCKETS),
            bytes: AtomicU64::new(0),
        }
    }
}

impl SyncStats {
    pub fn record_batch(&self, sync: Duration, records: u64, bytes: u64) {
        self.sync_us
            .record(u64::try_from(sync.as_micros()).unwrap_or(u64::MAX));
        self.batch_records.record(records);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// Where a ledger reports its group commits, if anywhere. Shared by every committer a process
/// opens (a reopen after a failure keeps counting in the same place). Options compare equal
/// whatever their observer: it changes what is measured, not what is written.
#[derive(Debug, Clone, Default)]
pub struct SyncObserver(pub Option<Arc<SyncStats>>);

impl PartialEq for SyncObserver {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for SyncObserver {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_inclusive_upper_bounds_with_an_overflow_slot() {
        let h = Histogram::new(&[1, 10]);
        for v in [0, 1, 2, 10, 11, 1000] {
            h.record(v);
        }
        let s = h.snapshot();
        assert_eq!(s.counts, vec![2, 2, 2]);
        assert_eq!(s.sum, 1024);
        assert_eq!(s.count(), 6);
    }
}
