//! `raw_fsync_probe`: how fast this disk does append + fdatasync of a small record, measured
//! without the ledger, so benchmarks can print the ledger's figures next to the machine's.
//! `raw_overwrite_probe`: the same for overwrites of zeros written (and synced) beforehand, which
//! is what the ledger does with preallocation on.

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
