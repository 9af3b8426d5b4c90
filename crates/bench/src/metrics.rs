//! The daemon's group-commit counters, read from its `/metrics` before and after a load step:
//! how many records each fdatasync carried and how long the syncs took, so a throughput figure
//! can be split into batches per second × records per batch.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// Cumulative group-commit counters of a daemon (`estop_ledger_*` in docs/HTTP.md).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SyncCounters {
    /// Group commits (one write and one fdatasync each).
    pub batches: u64,
    /// Records they carried.
    pub records: u64,
    /// Time spent in their write + fdatasync.
    pub sync_seconds: f64,
}

/// What the daemon's ledger did during one load step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SyncDelta {
    pub batches: u64,
    pub mean_batch_records: f64,
    pub batches_per_s: f64,
    /// Mean write + fdatasync time of a batch.
    pub mean_sync_us: f64,
    /// Share of the step's wall time the ledger spent in write + fdatasync: the rest the disk
    /// was idle (the sync thread releasing replies, or waiting for records).
    pub disk_busy_pct: f64,
}

impl SyncCounters {
    /// Reads the counters from a Prometheus text exposition; `None` if one is missing.
    pub fn parse(text: &str) -> Option<SyncCounters> {
        let value = |name: &str| {
            text.lines().find_map(|l| {
                let rest = l.strip_prefix(name)?;
                rest.strip_prefix(' ')?.trim().parse::<f64>().ok()
            })
        };
        Some(SyncCounters {
            batches: value("estop_ledger_batch_records_count")? as u64,
            records: value("estop_ledger_batch_records_sum")? as u64,
            sync_seconds: value("estop_ledger_fsync_seconds_sum")?,
        })
    }

    /// The counters' growth from `before` to `self` over `seconds` of wall time.
    pub fn since(&self, before: &SyncCounters, seconds: f64) -> SyncDelta {
        let batches = self.batches.saturating_sub(before.batches);
        let records = self.records.saturating_sub(before.records);
        let sync_seconds = (self.sync_seconds - before.sync_seconds).max(0.0);
        let per = batches.max(1) as f64;
        SyncDelta {
            batches,
            mean_batch_records: records as f64 / per,
            batches_per_s: batches as f64 / seconds.max(1e-9),
            mean_sync_us: sync_seconds * 1e6 / per,
            disk_busy_pct: 100.0 * sync_seconds / seconds.max(1e-9),
        }
    }
}

/// Fetches `/metrics` from the console at `addr` (host:port) with `token`.
pub fn fetch(addr: &str, token: &str) -> std::io::Result<SyncCounters> {
    // HTTP/1.0: the body comes whole, never chunked (a chunk boundary could split a value).
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET /metrics HTTP/1.0\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n"
    )?;
    let mut body = String::new();
    s.read_to_string(&mut body)?;
    SyncCounters::parse(&body).ok_or_else(|| {
        let status = body.lines().next().unwrap_or("").to_string();
        std::io::Error::other(format!("no group-commit counters in /metrics ({status})"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "\
# TYPE estop_ledger_fsync_seconds histogram
estop_ledger_fsync_seconds_bucket{le=\"0.00005\"} 3
estop_ledger_fsync_seconds_sum 0.25
estop_ledger_fsync_seconds_count 2000
# TYPE estop_ledger_batch_records histogram
estop_ledger_batch_records_bucket{le=\"+Inf\"} 2000
estop_ledger_batch_records_sum 64000
estop_ledger_batch_records_count 2000
";

    #[test]
    fn parses_the_counters_and_splits_a_step_into_batches() {
        let after = SyncCounters::parse(TEXT).expect("counters");
        assert_eq!(
            after,
            SyncCounters {
                batches: 2000,
                records: 64000,
                sync_seconds: 0.25
            }
        );
        let before = SyncCounters {
            batches: 1000,
            records: 4000,
            sync_seconds: 0.05,
        };
        let d = after.since(&before, 0.5);
        assert_eq!(d.batches, 1000);
        assert!((d.mean_batch_records - 60.0).abs() < 1e-9);
        assert!((d.batches_per_s - 2000.0).abs() < 1e-9);
        assert!((d.mean_sync_us - 200.0).abs() < 1e-6);
        assert!((d.disk_busy_pct - 40.0).abs() < 1e-6);
    }

    #[test]
    fn a_missing_counter_is_none_not_zero() {
        assert_eq!(
            SyncCounters::parse("estop_ledger_batch_records_sum 5\n"),
            None
        );
        // A longer name with the same prefix is not the counter.
        assert_eq!(
            SyncCounters::parse("estop_ledger_batch_records_count_x 1\n"),
            None
        );
    }
}
