//! estop's benchmarks (SPEC §5). Every figure is printed next to the raw append+fdatasync rate
//! of the same disk measured in the same run, because these machines are shared and noisy:
//! compare ratios, not absolutes.

pub mod kernel;
pub mod load;

use std::path::Path;

/// The disk's own speed, measured with the ledger's probe.
#[derive(Debug, Clone, Copy)]
pub struct Disk {
    pub raw_fsync_p50_us: f64,
    pub raw_syncs_per_s: f64,
}

pub fn probe_disk(dir: &Path) -> std::io::Result<Disk> {
    std::fs::create_dir_all(dir)?;
    let p = estop_ledger::raw_fsync_probe(dir, 1000, 128)?;
    Ok(Disk {
        raw_fsync_p50_us: p.p50_us,
        raw_syncs_per_s: p.syncs_per_s,
    })
}

/// Percentile of sorted latencies (microseconds).
pub fn percentile(sorted_us: &[u32], p: f64) -> u32 {
    if sorted_us.is_empty() {
        return 0;
    }
    let i = ((sorted_us.len() as f64 - 1.0) * p).round() as usize;
    sorted_us[i.min(sorted_us.len() - 1)]
}
