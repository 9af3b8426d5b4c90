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
    /// The disk's raw group-commit rate alone (no daemon): writers hand 128-byte records to one
    /// syncer. With --turnaround-us and --gather-us, a model of the daemon's batching.
    Ceiling {
        #[arg(long, default_value_t = 64)]
        writers: usize,
        #[arg(long, default_value_t = 2.0)]
        seconds: f64,
        /// Append instead of overwriting preallocated zeros.
        #[arg(long)]
        append: bool,
        /// How long each writer waits between its reply and its next record.
        #[arg(long, default_value_t = 0)]
        turnaround_us: u64,
        /// How long the syncer waits for a record from every writer before each batch.
        #[arg(long, default_value_t = 0)]
        gather_us: u64,
        /// Syncer threads: more than one overlaps fdatasyncs of the file (replies stay in order).
        #[arg(long, default_value_t = 1)]
        syncers: usize,
        /// Where the scratch file goes (on the disk you want to measure).
        #[arg(long, default_value = "estop-bench-data")]
        data: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// The harness at scale: N trajectories waiting for approval in one runner (memory each,
    /// threads), the scheduler's cost per decision, and an interrupt's time to the next model
    /// call with the stream open (docs/PERFORMANCE.md, "The harness").
    Agents {
        #[arg(long, default_value_t = 10_000)]
        trajectories: usize,
        /// Interrupts to time (each on a trajectory whose model stream is open).
        #[arg(long, default_value_t = 20)]
        controls: usize,
        /// Data dir of the daemon and the runners' journals the bench starts.
        #[arg(long, default_value = "estop-bench-data")]
        data: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Cancel cost among many identities, and memory per retained identity (in process).
    Kernel {
        #[arg(long, default_value_t = 1_000_000)]
        identities: u64,
        #[arg(long)]
        json: bool,
    },
    /// The egress proxy's overhead per request against a direct connection (p50/p99), and
    /// the start time of `estop run -- true` (docs/PERFORMANCE.md, "Egress").
    Egress {
        /// Concurrent connections; a list runs each in turn.
        #[arg(long, value_delimiter = ',', default_value = "1,32")]
        connections: Vec<usize>,
        /// Requests per connection.
        #[arg(long, default_value_t = 500)]
        requests: usize,
        /// `estop run -- true` to time (0 skips it).
        #[arg(long, default_value_t = 20)]
        starts: usize,
        /// Worker threads of the proxy's runtime (0: one current-thread runtime); the default
        /// is what `estop run` uses.
        #[arg(long, default_value_t = estop_egress::PROXY_WORKERS)]
        proxy_workers: usize,
        /// Data dir of the daemon the bench starts.
        #[arg(long, default_value = "estop-bench-data")]
        data: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// What `estop mcp` adds per tools/call against calling the upstream directly (calls/s,
    /// p50/p99), stdio and HTTP fronts, at each number of concurrent sessions, next to the raw
    /// fsync rate (docs/MCP.md, "Benchmark").
    Mcp {
        /// Calls per path and row, shared out over its sessions (each makes at least 10).
        #[arg(long, default_value_t = 500)]
        calls: usize,
        /// Concurrent client sessions, one row each.
        #[arg(long, value_delimiter = ',', default_values_t = [1, 16, 64])]
        sessions: Vec<usize>,
        /// Data dir of the daemon the bench starts (and where the disk probe runs).
        #[arg(long, default_value = "estop-bench-data")]
        data: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Durable admissions through 1 and 2 nodes over one PostgreSQL database, next to the
    /// server's raw single-row commit rate measured in the same run (docs/STORES.md).
    Store(crate::bench_store::StoreBenchArgs),
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
    /// Seconds each raw group-commit probe (the ceiling) runs; 0 skips it.
    #[arg(long, default_value_t = 2.0)]
    ceiling_seconds: f64,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
}

pub(crate) struct Spawned {
    child: Child,
    pub(crate) socket: String,
    soundgate: String,
    /// The console's address, for the group-commit counters in its `/metrics`.
    console: String,
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_daemon(data: &Path) -> Result<Spawned> {
    spawn_daemon_with(data, &[])
}

/// `spawn_daemon` with more `estop serve` arguments (`--store URL`).
pub(crate) fn spawn_daemon_with(data: &Path, extra: &[&str]) -> Result<Spawned> {
    let _ = std::fs::remove_dir_all(data);
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .args(["serve", "--allow-all", "--soundgate-listen", "127.0.0.1:0"])
        .args(extra)
        // A port of its own: another gate (or CI) may hold the default one.
        .args(["--console", "127.0.0.1:0"])
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
            "--held-per-token-max",
            "100000000",
            "--runs-per-token-max",
            "100000000",
        ])
        // Nor the share of connections: every load connection is the same agent.
        .args(["--connections-per-principal-max", "1000000"])
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
        console: field("console"),
        child,
    })
}

pub fn run(a: BenchArgs) -> Result<u8> {
    match a.what {
        Some(BenchCmd::Ceiling {
            writers,
            seconds,
            append,
            turnaround_us,
            gather_us,
            syncers,
            data,
            json,
        }) => {
            let us = std::time::Duration::from_micros;
            let o = estop_ledger::GroupCommitOptions {
                writers: writers.max(1),
                record_bytes: estop_bench::PROBE_RECORD_BYTES,
                duration: std::time::Duration::from_secs_f64(seconds),
                overwrite: !append,
                turnaround: us(turnaround_us),
                gather: us(gather_us),
                syncers: syncers.max(1),
            };
            ceiling(o, &data, json)
        }
        Some(BenchCmd::Kernel { identities, json }) => kernel(identities, json),
        Some(BenchCmd::Agents {
            trajectories,
            controls,
            data,
            json,
        }) => crate::bench_agents::run(trajectories, controls, &data, json),
        Some(BenchCmd::Egress {
            connections,
            requests,
            starts,
            proxy_workers,
            data,
            json,
        }) => egress(connections, requests, starts, proxy_workers, &data, json),
        Some(BenchCmd::Recovery {
            records,
            data,
            json,
        }) => recovery(records, &data, json),
        Some(BenchCmd::Store(s)) => crate::bench_store::run(s),
        Some(BenchCmd::Mcp {
            calls,
            sessions,
            data,
            json,
        }) => mcp(calls, sessions, &data, json),
        None => load_bench(a.load),
    }
}

/// Most concurrent sessions one `estop bench mcp` row opens (each stdio one is a gateway).
const MCP_SESSIONS_MAX: usize = 256;

fn mcp(calls: usize, sessions: Vec<usize>, data: &Path, json: bool) -> Result<u8> {
    if sessions.iter().any(|&n| n == 0 || n > MCP_SESSIONS_MAX) {
        anyhow::bail!("--sessions: each between 1 and {MCP_SESSIONS_MAX}");
    }
    let spawned = spawn_daemon(data)?;
    let disk = estop_bench::probe_disk(&data.join("probe")).context("probing the disk")?;
    let o = estop_bench::mcp::McpOptions {
        socket: spawned.socket.clone(),
        data: data.to_path_buf(),
        calls: calls.max(10),
        sessions,
    };
    let rows = estop_bench::mcp::gateway_overhead(&o).context("the MCP benchmark")?;
    if !json {
        println!(
            "estop mcp: tools/call from N sessions at once, each one call at a time (each a new effect, admitted and completed durably) vs the same rmcp upstream called directly; raw fsync p50 {:.1} us, {:.0} syncs/s",
            disk.append.p50_us, disk.append.syncs_per_s
        );
        println!(
            "{:>8} {:>14} {:>6} {:>9} {:>9} {:>9} {:>10}",
            "sessions", "path", "calls", "calls/s", "p50", "p99", "added p50"
        );
    }
    for r in &rows {
        // Against the direct path at the same number of sessions.
        let direct = rows
            .iter()
            .find(|d| d.sessions == r.sessions)
            .map_or(0, |d| d.p50_us);
        let added = i64::from(r.p50_us) - i64::from(direct);
        if json {
            println!(
                "{}",
                json!({"bench": "mcp", "sessions": r.sessions, "path": r.name, "calls": r.calls,
                "calls_per_s": r.calls_per_s.round(), "p50_us": r.p50_us, "p99_us": r.p99_us,
                "added_p50_us": added, "raw_fsync_p50_us": round1(disk.append.p50_us),
                "raw_syncs_per_s": disk.append.syncs_per_s.round()})
            );
        } else {
            println!(
                "{:>8} {:>14} {:>6} {:>9.0} {:>7}us {:>7}us {:>8}us",
                r.sessions, r.name, r.calls, r.calls_per_s, r.p50_us, r.p99_us, added
            );
        }
    }
    drop(spawned);
    Ok(0)
}

fn egress(
    connections: Vec<usize>,
    requests: usize,
    starts: usize,
    proxy_workers: usize,
    data: &Path,
    json: bool,
) -> Result<u8> {
    // The disk's raw rate, beside the figures: a proxied request waits for a durable admission.
    let disk = estop_bench::probe_disk(data).context("probing the disk")?;
    let spawned = spawn_daemon(data)?;
    let token = std::fs::read_to_string(data.join("agent.token"))
        .context("reading DATA/agent.token")?
        .trim()
        .to_string();
    let o = estop_bench::egress::EgressOptions {
        socket: spawned.socket.clone(),
        token,
        data: data.to_path_buf(),
        connections,
        requests: requests.max(1),
        starts,
        estop: std::env::current_exe()?,
        proxy_workers,
    };
    let rows = estop_bench::egress::proxy_overhead(&o).context("the proxy benchmark")?;
    if !json {
        println!(
            "egress proxy: GET through the proxy (admitted durably, outcome completed behind the response, upstream connections kept) vs direct keep-alive, same local server; https after the first handshake; proxy runtime: {}",
            match proxy_workers {
                0 => "current-thread".to_string(),
                n => format!("{n} workers"),
            }
        );
        println!(
            "raw overwrite+fdatasync p50 {:.0} us ({:.0}/s), append p50 {:.0} us",
            disk.overwrite.p50_us, disk.overwrite.syncs_per_s, disk.append.p50_us
        );
        println!(
            "{:>6} {:>5} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "scheme",
            "conns",
            "requests",
            "direct p50",
            "direct p99",
            "proxy p50",
            "proxy p99",
            "added p50"
        );
    }
    for r in &rows {
        let added = i64::from(r.proxied_p50_us) - i64::from(r.direct_p50_us);
        if json {
            println!(
                "{}",
                json!({"bench": "egress", "scheme": r.scheme, "connections": r.connections, "requests": r.requests,
                "direct_p50_us": r.direct_p50_us, "direct_p99_us": r.direct_p99_us,
                "proxied_p50_us": r.proxied_p50_us, "proxied_p99_us": r.proxied_p99_us,
                "added_p50_us": added, "proxy_workers": proxy_workers,
                "raw_overwrite_p50_us": disk.overwrite.p50_us.round(),
                "raw_append_p50_us": disk.append.p50_us.round()})
            );
        } else {
            println!(
                "{:>6} {:>5} {:>8} {:>8}us {:>8}us {:>8}us {:>8}us {:>8}us",
                r.scheme,
                r.connections,
                r.requests,
                r.direct_p50_us,
                r.direct_p99_us,
                r.proxied_p50_us,
                r.proxied_p99_us,
                added
            );
        }
    }
    if starts > 0 {
        let s = estop_bench::egress::sandbox_start(&o).context("timing estop run -- true")?;
        if json {
            println!(
                "{}",
                json!({"bench": "sandbox_start", "runs": s.runs, "p50_ms": s.p50_ms, "p99_ms": s.p99_ms})
            );
        } else {
            println!(
                "estop run -- true: p50 {:.1} ms, p99 {:.1} ms ({} runs, spawn to exit)",
                s.p50_ms, s.p99_ms, s.runs
            );
        }
    }
    drop(spawned);
    Ok(0)
}

fn load_bench(a: LoadArgs) -> Result<u8> {
    std::fs::create_dir_all(&a.data)?;
    let disk = estop_bench::probe_disk(&a.data).context("probing the disk")?;
    let ceiling = if a.ceiling_seconds > 0.0 {
        let d = std::time::Duration::from_secs_f64(a.ceiling_seconds);
        Some(estop_bench::probe_ceiling(&a.data, d).context("probing the group-commit ceiling")?)
    } else {
        None
    };
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
    // The group-commit counters of the daemon the bench started (not of a --target one).
    let metrics = match &spawned {
        Some(s) if !s.console.is_empty() => {
            let op = std::fs::read_to_string(a.data.join("operator.token"))
                .context("reading DATA/operator.token")?;
            Some((s.console.clone(), op.trim().to_string()))
        }
        _ => None,
    };
    let counters = || {
        metrics
            .as_ref()
            .and_then(|(addr, t)| estop_bench::metrics::fetch(addr, t).ok())
    };
    if !a.json {
        print_disk(&disk, &a.data);
        if let Some(c) = &ceiling {
            print_ceiling(c);
        }
        Row::print_header();
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
        let before = counters();
        let r = load::run(&opts).with_context(|| format!("load with {connections} connections"))?;
        let ledger = match (before, counters()) {
            (Some(b), Some(after)) => Some(after.since(&b, r.seconds)),
            _ => None,
        };
        let row = Row::new(&r, &disk, ceiling.as_ref(), ledger);
        if a.json {
            let mut j = row.json();
            j["protocol"] = json!(match protocol {
                Protocol::Native => "native",
                Protocol::SoundGate => "soundgate",
            });
            j["mix"] = json!(match a.mix {
                MixArg::Allow => "allow",
                MixArg::HalfHeld => "half-held",
            });
            println!("{j}");
        } else {
            row.print();
        }
    }
    drop(spawned);
    Ok(0)
}

/// One load step's figures compared with the same run's raw probes.
struct Row<'a> {
    r: &'a load::LoadReport,
    disk: &'a estop_bench::Disk,
    ceiling: Option<&'a estop_bench::Ceiling>,
    /// The daemon's group commits during the step (when the bench started it).
    ledger: Option<estop_bench::metrics::SyncDelta>,
    /// p50 over the raw overwrite+fdatasync p50 (what the ledger does).
    over_overwrite: f64,
    /// p50 over the raw append+fdatasync p50.
    over_append: f64,
    /// Admissions/s as a share (%) of the raw group-commit ceiling, overwriting and appending.
    pct_overwrite: f64,
    pct_append: f64,
}

impl<'a> Row<'a> {
    fn new(
        r: &'a load::LoadReport,
        disk: &'a estop_bench::Disk,
        ceiling: Option<&'a estop_bench::Ceiling>,
        ledger: Option<estop_bench::metrics::SyncDelta>,
    ) -> Row<'a> {
        let p50 = f64::from(r.p50_us);
        let share = |c: f64| estop_bench::share_pct(r.admissions_per_s, c);
        Row {
            r,
            disk,
            ceiling,
            ledger,
            over_overwrite: estop_bench::latency_ratio(p50, disk.overwrite.p50_us),
            over_append: estop_bench::latency_ratio(p50, disk.append.p50_us),
            pct_overwrite: ceiling.map_or(0.0, |c| share(c.overwrite.records_per_s)),
            pct_append: ceiling.map_or(0.0, |c| share(c.append.records_per_s)),
        }
    }

    fn print_header() {
        println!(
            "{:>11} {:>12} {:>7} {:>7} {:>7} {:>7} {:>6} {:>9} {:>9} {:>9} {:>9} {:>7} {:>9} {:>8} {:>6}",
            "connections",
            "admissions/s",
            "p50 us",
            "p95 us",
            "p99 us",
            "p999 us",
            "errors",
            "p50/ovw",
            "p50/app",
            "%gc-ovw",
            "%gc-app",
            "batch",
            "batches/s",
            "sync us",
            "busy%"
        );
    }

    fn print(&self) {
        let (r, ledger) = (self.r, self.ledger);
        let opt =
            |v: Option<f64>, digits: usize| v.map_or("-".to_string(), |v| format!("{v:.digits$}"));
        println!(
            "{:>11} {:>12.0} {:>7} {:>7} {:>7} {:>7} {:>6} {:>8.2}x {:>8.2}x {:>9} {:>9} {:>7} {:>9} {:>8} {:>6}",
            r.connections,
            r.admissions_per_s,
            r.p50_us,
            r.p95_us,
            r.p99_us,
            r.p999_us,
            r.errors,
            self.over_overwrite,
            self.over_append,
            opt(self.ceiling.map(|_| self.pct_overwrite), 1),
            opt(self.ceiling.map(|_| self.pct_append), 1),
            opt(ledger.map(|l| l.mean_batch_records), 1),
            opt(ledger.map(|l| l.batches_per_s), 0),
            opt(ledger.map(|l| l.mean_sync_us), 0),
            opt(ledger.map(|l| l.disk_busy_pct), 0),
        );
    }

    fn json(&self) -> serde_json::Value {
        let (r, disk) = (self.r, self.disk);
        let mut j = json!({
            "connections": r.connections, "ops": r.ops, "admissions_per_s": r.admissions_per_s.round(),
            "p50_us": r.p50_us, "p95_us": r.p95_us, "p99_us": r.p99_us, "p999_us": r.p999_us,
            "errors": r.errors,
            "raw_overwrite_p50_us": round1(disk.overwrite.p50_us), "raw_overwrite_syncs_per_s": disk.overwrite.syncs_per_s.round(),
            "raw_fsync_p50_us": round1(disk.append.p50_us), "raw_syncs_per_s": disk.append.syncs_per_s.round(),
            "p50_over_raw_overwrite": round2(self.over_overwrite),
            "p50_over_raw_fsync": round2(self.over_append),
        });
        if let Some(c) = self.ceiling {
            j["group_commit_writers"] = json!(c.overwrite.options.writers);
            j["group_commit_overwrite_per_s"] = json!(c.overwrite.records_per_s.round());
            j["group_commit_append_per_s"] = json!(c.append.records_per_s.round());
            j["group_commit_overwrite_mean_batch"] = json!(round1(c.overwrite.mean_batch_records));
            j["group_commit_append_mean_batch"] = json!(round1(c.append.mean_batch_records));
            j["share_of_group_commit_overwrite_pct"] = json!(round1(self.pct_overwrite));
            j["share_of_group_commit_append_pct"] = json!(round1(self.pct_append));
        }
        if let Some(l) = &self.ledger {
            j["ledger_batches"] = json!(l.batches);
            j["ledger_mean_batch_records"] = json!(round1(l.mean_batch_records));
            j["ledger_batches_per_s"] = json!(l.batches_per_s.round());
            j["ledger_mean_sync_us"] = json!(round1(l.mean_sync_us));
            j["ledger_disk_busy_pct"] = json!(round1(l.disk_busy_pct));
        }
        j
    }
}

fn round1(v: f64) -> f64 {
    (v * 10.0).round() / 10.0
}

fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

fn print_disk(disk: &estop_bench::Disk, dir: &Path) {
    println!(
        "disk: raw overwrite+fdatasync p50 {:.0} us ({:.0} syncs/s), raw append+fdatasync p50 {:.0} us ({:.0} syncs/s), {} B records ({})",
        disk.overwrite.p50_us,
        disk.overwrite.syncs_per_s,
        disk.append.p50_us,
        disk.append.syncs_per_s,
        disk.append.record_bytes,
        dir.display()
    );
}

fn print_ceiling(c: &estop_bench::Ceiling) {
    let o = &c.overwrite.options;
    println!(
        "ceiling: raw group commit, {} writers x {} B, no protocol: overwrite {:.0} records/s (batch {:.1}, sync {:.0} us), append {:.0} records/s (batch {:.1}, sync {:.0} us)",
        o.writers,
        o.record_bytes,
        c.overwrite.records_per_s,
        c.overwrite.mean_batch_records,
        c.overwrite.mean_sync_us,
        c.append.records_per_s,
        c.append.mean_batch_records,
        c.append.mean_sync_us
    );
}

fn ceiling(o: estop_ledger::GroupCommitOptions, data: &Path, json_out: bool) -> Result<u8> {
    std::fs::create_dir_all(data)?;
    let p = estop_ledger::group_commit_probe(data, o).context("group-commit probe")?;
    let (turnaround_us, gather_us) = (o.turnaround.as_micros(), o.gather.as_micros());
    if json_out {
        println!(
            "{}",
            json!({"writers": o.writers, "record_bytes": o.record_bytes, "overwrite": o.overwrite,
                   "turnaround_us": turnaround_us, "gather_us": gather_us, "syncers": o.syncers, "records": p.records,
                   "records_per_s": p.records_per_s.round(), "syncs": p.syncs,
                   "mean_batch_records": round1(p.mean_batch_records), "mean_sync_us": round1(p.mean_sync_us)})
        );
    } else {
        println!(
            "raw group commit, {} writers x {} B, {}, turnaround {} us, gather {} us, {} syncer(s): {:.0} records/s, {} syncs, batch {:.1} (max {}), sync {:.0} us",
            o.writers,
            o.record_bytes,
            if o.overwrite { "overwrite" } else { "append" },
            turnaround_us,
            gather_us,
            o.syncers,
            p.records_per_s,
            p.syncs,
            p.mean_batch_records,
            p.batch_records_max,
            p.mean_sync_us
        );
    }
    Ok(0)
}

fn kernel(identities: u64, json_out: bool) -> Result<u8> {
    use estop_bench::kernel::{KeyShape, effect_key};
    // Memory first: freed pages stay in the process, so a later measurement would read zero.
    // Each measurement keeps its gate until all are done, so none reuses another's pages.
    let (m, kept) = estop_bench::kernel::memory_per_identity(identities, 10, KeyShape::Short);
    let (mc, kept_c) = estop_bench::kernel::memory_per_identity(identities, 10, KeyShape::Client);
    let (ms, kept_s) =
        estop_bench::kernel::memory_per_identity(identities, 10, KeyShape::ClientInStep);
    let (t36, kept36) = estop_bench::kernel::memory_per_tombstone(identities, 36);
    let (t12, kept12) = estop_bench::kernel::memory_per_tombstone(identities, 12);
    drop((kept, kept_c, kept_s, kept36, kept12));
    let c = estop_bench::kernel::cancel_cost(identities, 10, 1000);
    let short_bytes = effect_key(KeyShape::Short, 0, 0).len();
    let client_bytes = effect_key(KeyShape::Client, 0, 0).len();
    let step_bytes = effect_key(KeyShape::ClientInStep, 0, 0).len();
    if json_out {
        println!(
            "{}",
            json!({"identities": c.identities, "cancel_effects_per_run": c.effects_per_run, "cancels": c.cancels,
                   "cancel_p50_us": c.p50_us, "cancel_max_us": c.max_us, "bytes_per_identity": m.bytes_per_identity.round(),
                   "short_key_bytes": short_bytes,
                   "bytes_per_identity_client_keys": mc.bytes_per_identity.round(),
                   "client_key_bytes": client_bytes,
                   "bytes_per_identity_client_step_keys": ms.bytes_per_identity.round(),
                   "client_step_key_bytes": step_bytes,
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
            "memory: {:.0} bytes per retained identity at {} identities with {}-byte keys like step-000042 (RSS delta)",
            m.bytes_per_identity, m.identities, short_bytes
        );
        println!(
            "memory: {:.0} bytes per retained identity at {} identities with {}-byte keys shaped like the Python client's ({})",
            mc.bytes_per_identity,
            mc.identities,
            client_bytes,
            effect_key(KeyShape::Client, 0, 0)
        );
        println!(
            "memory: {:.0} bytes per retained identity at {} identities with {}-byte keys of a call in a named step ({})",
            ms.bytes_per_identity,
            ms.identities,
            step_bytes,
            effect_key(KeyShape::ClientInStep, 0, 0)
        );
    }
    Ok(0)
}

fn recovery(records: u64, data: &Path, json_out: bool) -> Result<u8> {
    use estop_bench::cache::Method;
    std::fs::create_dir_all(data)?;
    let disk = estop_bench::probe_disk(data)?;
    let r =
        estop_bench::kernel::recovery(&data.join("recovery-ledger"), records, Method::DropCaches)
            .map_err(|e| anyhow!("{e}"))?;
    let per_s = |seconds: f64| r.records as f64 / seconds.max(1e-9);
    if json_out {
        let mut j = json!({"records": r.records, "replay_seconds": r.replay_seconds, "replay_records_per_s": r.replay_records_per_s.round(),
               "snapshot_bytes": r.snapshot_bytes, "snapshot_recovery_seconds": r.snapshot_seconds,
               "raw_fsync_p50_us": disk.append.p50_us.round(), "raw_syncs_per_s": disk.append.syncs_per_s.round(),
               "raw_overwrite_p50_us": disk.overwrite.p50_us.round()});
        match &r.cold_replay {
            Ok(c) => {
                j["cold_replay_seconds"] = json!(c.seconds);
                j["cold_replay_records_per_s"] = json!(per_s(c.seconds).round());
                j["cold_method"] = json!(c.evicted.method.name());
                j["cold_replay_resident_bytes"] = json!(c.evicted.resident_bytes);
                j["ledger_bytes"] = json!(c.evicted.file_bytes);
            }
            Err(e) => j["cold_replay_error"] = json!(e),
        }
        match &r.cold_snapshot {
            Ok(c) => j["cold_snapshot_recovery_seconds"] = json!(c.seconds),
            Err(e) => j["cold_snapshot_error"] = json!(e),
        }
        println!("{j}");
    } else {
        print_disk(&disk, data);
        println!(
            "replay of {} records, warm (ledger in the page cache): {:.2} s = {:.0} records/s",
            r.records, r.replay_seconds, r.replay_records_per_s
        );
        match &r.cold_replay {
            Ok(c) => println!(
                "replay of {} records, cold ({}: {} of {} bytes still cached): {:.2} s = {:.0} records/s",
                r.records,
                c.evicted.method.name(),
                c.evicted.resident_bytes,
                c.evicted.file_bytes,
                c.seconds,
                per_s(c.seconds)
            ),
            Err(e) => println!("replay cold: NOT MEASURED ({e})"),
        }
        println!(
            "recovery from a snapshot ({} bytes) of the same state, warm: {:.2} s",
            r.snapshot_bytes, r.snapshot_seconds
        );
        match &r.cold_snapshot {
            Ok(c) => println!(
                "recovery from the snapshot, cold ({}: {} of {} bytes still cached): {:.2} s",
                c.evicted.method.name(),
                c.evicted.resident_bytes,
                c.evicted.file_bytes,
                c.seconds
            ),
            Err(e) => println!("recovery from the snapshot cold: NOT MEASURED ({e})"),
        }
    }
    Ok(0)
}
