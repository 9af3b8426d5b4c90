//! estop's benchmarks (SPEC §5). Every figure is printed next to the raw speed of the same disk
//! measured in the same run, because these machines are shared and noisy: compare ratios, not
//! absolutes. Like for like: the ledger overwrites preallocated space, so its single-connection
//! latency is compared with a raw *overwrite*+fdatasync (the append one is printed too), and its
//! throughput with the disk's raw group-commit rate at the same number of writers.

pub mod cache;
pub mod egress;
pub mod kernel;
pub mod load;
pub mod mcp;
pub mod metrics;

use estop_ledger::{FsyncProbe, GroupCommitOptions, GroupCommitProbe};
use std::path::Path;
use std::time::Duration;

/// Syncs each single probe makes.
pub const PROBE_SYNCS: u32 = 1000;
/// Record size of every raw probe (SPEC §5: 128-byte records).
pub const PROBE_RECORD_BYTES: usize = 128;
/// Writers of the group-commit ceiling (SPEC §5: 64).
pub const CEILING_WRITERS: usize = 64;

/// The disk's own latency for one small record made durable: appended, and overwritten in
/// place (what the ledger does with its preallocated segments).
#[derive(Debug, Clone, Copy)]
pub struct Disk {
    pub append: FsyncProbe,
    pub overwrite: FsyncProbe,
}

pub fn probe_disk(dir: &Path) -> std::io::Result<Disk> {
    std::fs::create_dir_all(dir)?;
    Ok(Disk {
        append: estop_ledger::raw_fsync_probe(dir, PROBE_SYNCS, PROBE_RECORD_BYTES)?,
        overwrite: estop_ledger::raw_overwrite_probe(dir, PROBE_SYNCS, PROBE_RECORD_BYTES)?,
    })
}

/// The disk's raw group-commit ceiling at `CEILING_WRITERS` writers of 128-byte records, no
/// protocol: appending (SPEC §5's definition) and overwriting preallocated zeros (the ledger's
/// way of writing).
#[derive(Debug, Clone, Copy)]
pub struct Ceiling {
    pub append: GroupCommitProbe,
    pub overwrite: GroupCommitProbe,
}

pub fn probe_ceiling(dir: &Path, duration: Duration) -> std::io::Result<Ceiling> {
    std::fs::create_dir_all(dir)?;
    let options = |overwrite| GroupCommitOptions {
        writers: CEILING_WRITERS,
        record_bytes: PROBE_RECORD_BYTES,
        duration,
        overwrite,
        turnaround: Duration::ZERO,
        gather: Duration::ZERO,
        syncers: 1,
    };
    Ok(Ceiling {
        append: estop_ledger::group_commit_probe(dir, options(false))?,
        overwrite: estop_ledger::group_commit_probe(dir, options(true))?,
    })
}

/// How many times the raw probe's p50 a measured p50 is (the raw figure floored at 1 µs).
pub fn latency_ratio(p50_us: f64, raw_p50_us: f64) -> f64 {
    p50_us / raw_p50_us.max(1.0)
}

/// A rate as a percentage of a ceiling (0 when the ceiling measured nothing).
pub fn share_pct(rate: f64, ceiling: f64) -> f64 {
    if ceiling > 0.0 {
        100.0 * rate / ceiling
    } else {
        0.0
    }
}

/// Percentile of sorted latencies (microseconds).
pub fn percentile(sorted_us: &[u32], p: f64) -> u32 {
    if sorted_us.is_empty() {
        return 0;
    }
    let i = ((sorted_us.len() as f64 - 1.0) * p).round() as usize;
    sorted_us[i.min(sorted_us.len() - 1)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_and_shares() {
        assert!((latency_ratio(150.0, 100.0) - 1.5).abs() < 1e-12);
        // A raw figure under 1 µs (a RAM disk) does not blow the ratio up.
        assert!((latency_ratio(20.0, 0.2) - 20.0).abs() < 1e-12);
        assert!((share_pct(45_000.0, 300_000.0) - 15.0).abs() < 1e-9);
        assert_eq!(share_pct(45_000.0, 0.0), 0.0);
    }

    #[test]
    fn percentiles_of_sorted_latencies() {
        let v: Vec<u32> = (1..=100).collect();
        assert_eq!(percentile(&v, 0.5), 51);
        assert_eq!(percentile(&v, 0.99), 99);
        assert_eq!(percentile(&v, 1.0), 100);
        assert_eq!(percentile(&[], 0.5), 0);
    }
}
