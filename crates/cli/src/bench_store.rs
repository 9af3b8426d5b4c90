//! `estop bench store`: durable admissions/s and p50/p99 through one and two `estop serve
//! --store` nodes over one PostgreSQL database, at each connection count, next to the
//! server's raw single-row commit rate (`synchronous_commit` on) measured in the same run.
//! What bounds the nodes: every burst of every node commits under one advisory lock, one
//! transaction at a time (docs/STORES.md).

use crate::bench::spawn_daemon_with;
use anyhow::{Context, Result};
use clap::Args;
use estop_bench::load::{self, LoadOptions, LoadReport, Mix, Protocol};
use serde_json::json;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct StoreBenchArgs {
    /// The database (its estop table is used as it is; a password belongs in ESTOP_STORE).
    #[arg(long, value_name = "URL", env = "ESTOP_STORE", hide_env_values = true)]
    url: String,
    /// Concurrent connections in all; with two nodes, half go to each.
    #[arg(long, value_delimiter = ',', default_value = "1,64,256")]
    connections: Vec<usize>,
    /// Admissions per connection count.
    #[arg(long, default_value_t = 20_000)]
    ops: usize,
    /// Node counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    nodes: Vec<usize>,
    /// Seconds of the raw commit probe.
    #[arg(long, default_value_t = 2.0)]
    probe_seconds: f64,
    /// Where the nodes' data directories go.
    #[arg(long, default_value = "estop-bench-data")]
    data: PathBuf,
    #[arg(long)]
    json: bool,
}

/// The server's raw commit: one row inserted and committed per transaction, one client.
struct RawCommit {
    commits_per_s: f64,
    p50_us: u32,
    p99_us: u32,
}

fn raw_commit(url: &str, seconds: f64) -> Result<RawCommit> {
    // As a node connects (its TLS, `synchronous_commit = on`).
    let mut c = estop_server::pgstore::Target::parse(url)?
        .connect()
        .context("connecting")?;
    c.batch_execute(
        "SET synchronous_commit = on;
         CREATE TEMP TABLE estop_bench_probe (n bigint, payload bytea)",
    )?;
    let payload = vec![0u8; 300]; // about one record
    let mut lat = Vec::new();
    let start = Instant::now();
    let mut n: i64 = 0;
    while start.elapsed() < Duration::from_secs_f64(seconds) {
        let t = Instant::now();
        let mut tx = c.transaction()?;
        tx.execute(
            "INSERT INTO estop_bench_probe VALUES ($1, $2)",
            &[&n, &payload],
        )?;
        tx.commit()?;
        lat.push(u32::try_from(t.elapsed().as_micros()).unwrap_or(u32::MAX));
        n += 1;
    }
    lat.sort_unstable();
    Ok(RawCommit {
        commits_per_s: lat.len() as f64 / start.elapsed().as_secs_f64(),
        p50_us: estop_bench::percentile(&lat, 0.50),
        p99_us: estop_bench::percentile(&lat, 0.99),
    })
}

pub fn run(a: StoreBenchArgs) -> Result<u8> {
    let raw = raw_commit(&a.url, a.probe_seconds).context("the raw commit probe")?;
    if a.json {
        println!(
            "{}",
            json!({"raw_commit": {"commits_per_s": raw.commits_per_s, "p50_us": raw.p50_us,
                "p99_us": raw.p99_us}})
        );
    } else {
        println!(
            "PostgreSQL raw commit (one row, one client, synchronous_commit on): {:.0}/s, p50 {} us, p99 {} us",
            raw.commits_per_s, raw.p50_us, raw.p99_us
        );
        println!(
            "{:>5} {:>11} {:>12} {:>8} {:>8} {:>7} {:>12}",
            "nodes", "connections", "admissions/s", "p50 us", "p99 us", "errors", "p50/raw p50"
        );
    }
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    // An agent token of the bench's own in the database's registry, which every node knows
    // (the bootstrap secrets are in the data dir of whichever node started first, maybe long ago).
    let registry = a.data.join("registry");
    std::fs::create_dir_all(&registry)?;
    let (tokens, _) = estop_server::tokens::Tokens::open_in_database(&registry, &a.url, false)
        .context("opening the token registry")?;
    let agent = format!("bench-{stamp}");
    let token = tokens
        .create(&agent, estop_kernel::Role::Agent, &[])
        .context("making the bench's agent token")?;
    for &nodes in &a.nodes {
        let spawned = (0..nodes.max(1))
            .map(|i| {
                spawn_daemon_with(&a.data.join(format!("node{i}")), &["--store", &a.url])
                    .with_context(|| format!("starting node {i}"))
            })
            .collect::<Result<Vec<_>>>()?;
        for &connections in &a.connections {
            let r = through(
                &spawned,
                &token,
                connections,
                a.ops,
                format!("s{stamp}-{nodes}-{connections}"),
            )?;
            let ratio = f64::from(r.p50_us) / f64::from(raw.p50_us.max(1));
            if a.json {
                println!(
                    "{}",
                    json!({"nodes": nodes, "connections": connections,
                        "admissions_per_s": r.admissions_per_s, "p50_us": r.p50_us,
                        "p99_us": r.p99_us, "errors": r.errors, "p50_over_raw": ratio})
                );
            } else {
                println!(
                    "{:>5} {:>11} {:>12.0} {:>8} {:>8} {:>7} {:>11.2}x",
                    nodes, connections, r.admissions_per_s, r.p50_us, r.p99_us, r.errors, ratio
                );
            }
        }
    }
    if let Err(e) = tokens.revoke(&agent) {
        eprintln!("estop bench store: the bench's token {agent} is left in the registry: {e}");
    }
    Ok(0)
}

/// One load step, its connections split over the nodes, all with the same agent token (the
/// registry is the database's: every node knows it).
fn through(
    nodes: &[crate::bench::Spawned],
    token: &str,
    connections: usize,
    ops: usize,
    tag: String,
) -> Result<LoadReport> {
    let n = nodes.len();
    let reports = std::thread::scope(|s| {
        let handles: Vec<_> = nodes
            .iter()
            .enumerate()
            .map(|(i, node)| {
                let share = connections / n + usize::from(i < connections % n);
                let token = Some(token.to_string());
                let opts = LoadOptions {
                    target: node.socket.clone(),
                    protocol: Protocol::Native,
                    token,
                    connections: share.max(1),
                    ops: ops / n,
                    mix: Mix::Allow,
                    tag: format!("{tag}-n{i}"),
                };
                s.spawn(move || load::run(&opts))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a load thread"))
            .collect::<std::io::Result<Vec<_>>>()
    })?;
    // Together: the sum of the rates, the worse node's latencies.
    Ok(LoadReport {
        connections,
        ops,
        errors: reports.iter().map(|r| r.errors).sum(),
        seconds: reports.iter().map(|r| r.seconds).fold(0.0, f64::max),
        admissions_per_s: reports.iter().map(|r| r.admissions_per_s).sum(),
        p50_us: reports.iter().map(|r| r.p50_us).max().unwrap_or(0),
        p95_us: reports.iter().map(|r| r.p95_us).max().unwrap_or(0),
        p99_us: reports.iter().map(|r| r.p99_us).max().unwrap_or(0),
        p999_us: reports.iter().map(|r| r.p999_us).max().unwrap_or(0),
    })
}
