//! `estop bench`: flags and printing for the benchmarks in crates/bench.

use anyhow::{Context, Result, anyhow};
use clap::{Args, Subcommand, ValueEnum};
use estop_bench::load::{self, LoadOptions, Mix, Protocol};
use serde_json::json;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: Option<BenchCmd>,
    #[command(flatten)]
    load: LoadArgs,
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Cancel cost among many identities, and memory per retained identity (in process).
    Kernel {
        #[arg(long, default_value_t = 1_000_000)]
        identities: u64,
        #[arg(long)]
        json: bool,
    },
    /// Recovery speed from a large ledger, with and without a snapshot.
    Recovery {
        #[arg(long, default_value_t = 10_000_000)]
        records: u64,
        /// Where to write the scratch ledger (on the disk you want to measure).
        #[arg(long, default_value = "estop-bench-data")]
        data: PathBuf,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum ProtocolArg {
    Native,
    Soundgate,
}

#[derive(Clone, Copy, ValueEnum)]
enum MixArg {
    /// Every admission allowed.
    Allow,
    /// Half the admissions held for approval.
    HalfHeld,
}

#[derive(Args)]
struct LoadArgs {
    /// Concurrent connections; a list runs each in turn (e.g. 1,64,256).
    #[arg(long, value_delimiter = ',', default_value = "1,64,256")]
    connections: Vec<usize>,
    /// Admissions per connection count.
    #[arg(long, default_value_t = 100_000)]
    ops: usize,
    /// A running server (socket path or host:port); without it, one is started on --data.
    #[arg(long)]
    target: Option<String>,
    #[arg(long, value_enum, default_value = "native")]
    protocol: ProtocolArg,
    #[arg(long, value_enum, default_value = "allow")]
    mix: MixArg,
    /// Data dir of the daemon the bench starts (and where the disk probe runs).
    #[arg(long, default_value = "estop-bench-data")]
    data: PathBuf,
    /// Agent token for a --target daemon (default: DATA/agent.token).
    #[arg(long, env = "ESTOP_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
}

struct Spawned {
    child: Child,
    socket: String,
    soundgate: String,
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_daemon(data: &Path) -> Result<Spawned> {
    let _ = std::fs::remove_dir_all(data);
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .args(["serve", "--allow-all", "--soundgate-listen", "127.0.0.1:0"])
        // The benchmark measures admissions: its one agent principal must not reach the shares
        // of runs and held effects (`--mix half-held` holds one effect in a fresh run per two
        // admits, far past the 20,000 held effects one principal may have by default).
        .args([
            "--runs-max",
            "100000000",
            "--runs-per-principal-max",
            "100000000",
        ])
        .args([
            "--held-max",
            "100000000",
            "--held-per-principal-max",
            "100000000",
        ])
        .arg("--data")
        .arg(data)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("starting estop serve for the benchmark")?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?)
        .read_line(&mut line)?;
    if !line.starts_with("estop ready") {
        let _ = child.kill();
        return Err(anyhow!("the benchmark daemon did not start: {line}"));
    }
    let field = |k: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))
            .unwrap_or("")
            .to_string()
    };
    Ok(Spawned {
        socket: field("socket"),
        soundgate: field("soundgate"),
        child,
    })
}

pub fn run(a: BenchArgs) -> Result<u8> {
    match a.what {
        Some(BenchCmd::Kernel { identities, json }) => kernel(identities, json),
        Some(BenchCmd::Recovery {
            records,
            data,
            json,
        }) => recovery(records, &data, json),
        None => load_bench(a.load),
    }
}

fn load_bench(a: LoadArgs) -> Result<u8> {
    std::fs::create_dir_all(&a.data)?;
    let disk = estop_bench::probe_disk(&a.data).context("probing the disk")?;
    let spawned = match &a.target {
        Some(_) => None,
        None => Some(spawn_daemon(&a.data)?),
    };
    let protocol = match a.protocol {
        ProtocolArg::Native => Protocol::Native,
        ProtocolArg::Soundgate => Protocol::SoundGate,
    };
    let target = match (&a.target, &spawned) {
        (Some(t), _) => t.clone(),
        (None, Some(s)) if protocol == Protocol::SoundGate => s.soundgate.clone(),
        (None, Some(s)) => s.socket.clone(),
        (None, None) => unreachable!("a daemon was spawned"),
    };
    let token = match (&a.token, protocol) {
        (Some(t), _) => Some(t.clone()),
        (None, Protocol::Native) => Some(
            std::fs::read_to_string(a.data.join("agent.token"))
                .context("reading DATA/agent.token (or pass --token)")?
                .trim()
                .to_string(),
        ),
        (None, Protocol::SoundGate) => None,
    };
    if !a.json {
        println!(
            "disk: raw append+fdatasync p50 {:.0} us, {:.0} syncs/s ({})",
            disk.raw_fsync_p50_us,
            disk.raw_syncs_per_s,
            a.data.display()
        );
        println!(
            "{:>11} {:>12} {:>8} {:>8} {:>8} {:>8} {:>7} {:>10}",
            "connections",
            "admissions/s",
            "p50 us",
            "p95 us",
            "p99 us",
            "p999 us",
            "errors",
            "p50/fsync"
        );
    }
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    for &connections in &a.connections {
        let opts = LoadOptions {
            target: target.clone(),
            protocol,
            token: token.clone(),
            connections: connections.max(1),
            ops: a.ops,
            mix: match a.mix {
                MixArg::Allow => Mix::Allow,
                MixArg::HalfHeld => Mix::HalfHeld,
            },
            tag: format!("b{stamp}-{connections}"),
        };
        let r = load::run(&opts).with_context(|| format!("load with {connections} connections"))?;
        let ratio = f64::from(r.p50_us) / disk.raw_fsync_p50_us.max(1.0);
        if a.json {
            println!(
                "{}",
                json!({
                    "connections": r.connections, "ops": r.ops, "admissions_per_s": r.admissions_per_s.round(),
                    "p50_us": r.p50_us, "p95_us": r.p95_us, "p99_us": r.p99_us, "p999_us": r.p999_us,
                    "errors": r.errors, "raw_fsync_p50_us": disk.raw_fsync_p50_us.round(), "raw_syncs_per_s": disk.raw_syncs_per_s.round(),
                    "p50_over_raw_fsync": (ratio * 100.0).round() / 100.0,
                    "protocol": match protocol { Protocol::Native => "native", Protocol::SoundGate => "soundgate" },
                    "mix": match a.mix { MixArg::Allow => "allow", MixArg::HalfHeld => "half-held" },
                })
            );
        } else {
            println!(
                "{:>11} {:>12.0} {:>8} {:>8} {:>8} {:>8} {:>7} {:>9.2}x",
                r.connections,
                r.admissions_per_s,
                r.p50_us,
                r.p95_us,
                r.p99_us,
                r.p999_us,
                r.errors,
                ratio
            );
        }
    }
    drop(spawned);
    Ok(0)
}

fn kernel(identities: u64, json_out: bool) -> Result<u8> {
    // Memory first: freed pages stay in the process, so a later measurement would read zero.
    // Each measurement keeps its gate until all are done, so none reuses another's pages.
    let (m, kept) = estop_bench::kernel::memory_per_identity(identities, 10);
    let (t36, kept36) = estop_bench::kernel::memory_per_tombstone(identities, 36);
    let (t12, kept12) = estop_bench::kernel::memory_per_tombstone(identities, 12);
    drop((kept, kept36, kept12));
    let c = estop_bench::kernel::cancel_cost(identities, 10, 1000);
    if json_out {
        println!(
            "{}",
            json!({"identities": c.identities, "cancel_effects_per_run": c.effects_per_run, "cancels": c.cancels,
                   "cancel_p50_us": c.p50_us, "cancel_max_us": c.max_us, "bytes_per_identity": m.bytes_per_identity.round(),
                   "bytes_per_tombstone_36b_id": t36.bytes_per_identity.round(),
                   "bytes_per_tombstone_12b_id": t12.bytes_per_identity.round()})
        );
    } else {
        println!(
            "memory: {:.0} bytes per tombstone with 36-byte run ids, {:.0} with 12-byte ids, at {} tombstones (RSS delta)",
            t36.bytes_per_identity, t12.bytes_per_identity, t36.identities
        );
        println!(
            "cancel of a {}-effect run among {} identities: p50 {:.1} us CPU, max {:.1} us ({} cancels; plus one group-committed fsync before the ack)",
            c.effects_per_run, c.identities, c.p50_us, c.max_us, c.cancels
        );
        println!(
            "memory: {:.0} bytes per retained identity at {} identities (RSS delta)",
            m.bytes_per_identity, m.identities
        );
    }
    Ok(0)
}

fn recovery(records: u64, data: &Path, json_out: bool) -> Result<u8> {
    std::fs::create_dir_all(data)?;
    let disk = estop_bench::probe_disk(data)?;
    let r = estop_bench::kernel::recovery(&data.join("recovery-ledger"), records)
        .map_err(|e| anyhow!("{e}"))?;
    if json_out {
        println!(
            "{}",
            json!({"records": r.records, "replay_seconds": r.replay_seconds, "replay_records_per_s": r.replay_records_per_s.round(),
                   "snapshot_bytes": r.snapshot_bytes, "snapshot_recovery_seconds": r.snapshot_seconds,
                   "raw_fsync_p50_us": disk.raw_fsync_p50_us.round(), "raw_syncs_per_s": disk.raw_syncs_per_s.round()})
        );
    } else {
        println!(
            "disk: raw append+fdatasync p50 {:.0} us, {:.0} syncs/s",
            disk.raw_fsync_p50_us, disk.raw_syncs_per_s
        );
        println!(
            "replay of {} records: {:.2} s = {:.0} records/s",
            r.records, r.replay_seconds, r.replay_records_per_s
        );
        println!(
            "recovery from a snapshot ({} bytes) of the same state: {:.2} s",
            r.snapshot_bytes, r.snapshot_seconds
        );
    }
    Ok(0)
}
