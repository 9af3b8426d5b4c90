//! Ledger benchmark: raw fsync rate of the disk (append and overwrite), durable appends/s through
//! group commit at several client counts (with preallocation, and with it off for comparison:
//! the two runs alternate so a noisy machine affects both alike), CPU time per record, pipelined
//! append throughput, and recovery (replay) speed.
//!
//! `cargo run --release -p estop-ledger --example ledger_bench [DIR] [--quick]
//! [--preallocate-bytes=N]` (the chunk of the preallocated runs; default: the ledger's default)
//! (DIR defaults to a fresh directory under the system temp dir, on the disk being measured.)

use std::sync::Arc;
use std::time::{Duration, Instant};

use estop_ledger::{
    FileStorage, Ledger, LedgerError, LedgerOptions, Storage, raw_fsync_probe, raw_overwrite_probe,
};

const PAYLOAD_BYTES: usize = 128;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let chunk = match args
        .iter()
        .find_map(|a| a.strip_prefix("--preallocate-bytes="))
    {
        Some(n) => n.parse()?,
        None => LedgerOptions::default().preallocate_bytes,
    };
    let base = match args.iter().find(|a| !a.starts_with("--")) {
        Some(d) => std::path::PathBuf::from(d),
        None => std::env::temp_dir(),
    };
    let scratch = base.join(format!("estop-ledger-bench-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    let result = run(&scratch, quick, chunk);
    std::fs::remove_dir_all(&scratch)?;
    result
}

fn run(dir: &std::path::Path, quick: bool, chunk: u64) -> Result<(), Box<dyn std::error::Error>> {
    let probe = raw_fsync_probe(dir, if quick { 200 } else { 2000 }, PAYLOAD_BYTES)?;
    println!(
        "raw append+fdatasync ({} B): p50 {:.0} us, p99 {:.0} us, {:.0} syncs/s",
        PAYLOAD_BYTES, probe.p50_us, probe.p99_us, probe.syncs_per_s
    );
    let over = raw_overwrite_probe(dir, if quick { 200 } else { 2000 }, PAYLOAD_BYTES)?;
    println!(
        "raw overwrite+fdatasync ({} B): p50 {:.0} us, p99 {:.0} us, {:.0} syncs/s",
        PAYLOAD_BYTES, over.p50_us, over.p99_us, over.syncs_per_s
    );

    let run_for = Duration::from_millis(if quick { 300 } else { 2000 });
    for clients in [1usize, 8, 64, 256] {
        for (how, preallocate_bytes) in [("preallocated", chunk), ("appended", 0)] {
            closed_loop(dir, clients, how, preallocate_bytes, run_for, probe.p50_us)?;
        }
    }
    pipelined_and_recovery(dir, quick)
}

/// CPU time (user + system) this process has used so far, in microseconds (Linux).
fn cpu_us() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|v| v.parse().ok())
        .collect();
    // In clock ticks of 1/100 s (USER_HZ on Linux).
    f.iter().sum::<u64>() * 10_000
}

fn closed_loop(
    dir: &std::path::Path,
    clients: usize,
    how: &str,
    preallocate_bytes: u64,
    run_for: Duration,
    raw_p50_us: f64,
) -> Result<(), Box<dyn std::error::Error>> {
    {
        let ledger_dir = dir.join(format!("clients-{clients}-{how}"));
        let storage: Arc<dyn Storage> = Arc::new(FileStorage::open(&ledger_dir)?);
        let options = LedgerOptions {
            preallocate_bytes,
            ..LedgerOptions::default()
        };
        let c = open(storage, options)?.spawn(|_| {})?;
        let cpu = cpu_us();
        let start = Instant::now();
        let threads: Vec<_> = (0..clients)
            .map(|_| {
                let c = c.clone();
                std::thread::spawn(move || -> Result<Vec<u32>, LedgerError> {
                    let payload = [0x42u8; PAYLOAD_BYTES];
                    let mut lat = Vec::new();
                    while start.elapsed() < run_for {
                        let t = Instant::now();
                        let seq = c.append(&payload)?;
                        c.wait_durable(seq)?;
                        lat.push(t.elapsed().as_micros() as u32);
                    }
                    Ok(lat)
                })
            })
            .collect();
        let mut lat = Vec::new();
        for t in threads {
            lat.extend(t.join().map_err(|_| "bench thread panicked")??);
        }
        let secs = start.elapsed().as_secs_f64();
        let cpu_per_record = (cpu_us() - cpu) as f64 / lat.len() as f64;
        lat.sort_unstable();
        let pct = |p: f64| lat[((lat.len() - 1) as f64 * p) as usize];
        println!(
            "durable appends, {clients:>3} clients, {how:>12}: {:>8.0} records/s, p50 {} us, p99 {} us, p999 {} us, max {} us ({:.2}x raw p50), {cpu_per_record:.1} us CPU/record",
            lat.len() as f64 / secs,
            pct(0.5),
            pct(0.99),
            pct(0.999),
            pct(1.0),
            f64::from(pct(0.5)) / raw_p50_us
        );
    }
    Ok(())
}

fn pipelined_and_recovery(
    dir: &std::path::Path,
    quick: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    // Pipelined: one thread appends without waiting (retrying on backpressure), then recovery.
    let n: u64 = if quick { 200_000 } else { 3_000_000 };
    let ledger_dir = dir.join("pipelined");
    let storage: Arc<dyn Storage> = Arc::new(FileStorage::open(&ledger_dir)?);
    let c = open(storage, LedgerOptions::default())?.spawn(|_| {})?;
    let payload = [0x24u8; PAYLOAD_BYTES];
    let start = Instant::now();
    let mut i = 0;
    while i < n {
        match c.append(&payload) {
            Ok(_) => i += 1,
            Err(LedgerError::Backpressure { .. }) => std::thread::yield_now(),
            Err(e) => return Err(e.into()),
        }
    }
    c.flush()?;
    let secs = start.elapsed().as_secs_f64();
    println!(
        "pipelined appends (1 thread): {:.0} records/s durable",
        n as f64 / secs
    );
    drop(c);

    let storage: Arc<dyn Storage> = Arc::new(FileStorage::open(&ledger_dir)?);
    let start = Instant::now();
    let mut replayed = 0u64;
    let mut bytes = 0usize;
    let rec = Ledger::open(
        storage,
        LedgerOptions::default(),
        |_, _| Ok::<(), LedgerError>(()),
        |_, p| {
            replayed += 1;
            bytes += p.len();
            Ok(())
        },
    )?;
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(rec.report.records_replayed, n);
    println!(
        "recovery: {replayed} records ({} MiB) in {:.3} s = {:.0} records/s",
        bytes >> 20,
        secs,
        replayed as f64 / secs
    );
    Ok(())
}

fn open(storage: Arc<dyn Storage>, options: LedgerOptions) -> Result<Ledger, LedgerError> {
    let rec = Ledger::open(
        storage,
        options,
        |_, _| Ok::<(), LedgerError>(()),
        |_, _| Ok(()),
    )?;
    Ok(rec.ledger)
}
