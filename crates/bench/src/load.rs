//! Closed-loop load: N connections, each admitting unique keys (durably) as fast as replies come
//! back, one run per connection — the reference system's load shape, so the two compare on one
//! machine in one run. Speaks protocol v1 or the SoundGate wire.
//!
//! The client is one thread multiplexing every connection (a tokio current-thread runtime): on
//! a 2-core machine a thread per connection would spend the CPU the server needs on waking
//! client threads, and measure the client instead of the gate. Both servers are driven by the
//! same client, so their figures compare.

use crate::percentile;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Native,
    SoundGate,
}

/// What every admission in the run looks like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mix {
    /// Every admit is allowed.
    Allow,
    /// Every other admit asks for approval (held), each in a run of its own so it does not hold
    /// the allowed ones as siblings.
    HalfHeld,
}

#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub target: String,
    pub protocol: Protocol,
    pub token: Option<String>,
    pub connections: usize,
    /// Admissions in all (split across connections).
    pub ops: usize,
    pub mix: Mix,
    /// Distinguishes runs of repeated benchmarks against one daemon.
    pub tag: String,
}

#[derive(Debug, Clone)]
pub struct LoadReport {
    pub connections: usize,
    pub ops: usize,
    pub errors: usize,
    pub seconds: f64,
    pub admissions_per_s: f64,
    pub p50_us: u32,
    pub p95_us: u32,
    pub p99_us: u32,
    pub p999_us: u32,
}

/// A reply that never comes is a bug to report, not a benchmark that hangs.
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

async fn read_reply<R: AsyncBufReadExt + Unpin>(
    r: &mut R,
    line: &mut String,
) -> std::io::Result<()> {
    line.clear();
    match tokio::time::timeout(REPLY_TIMEOUT, r.read_line(line)).await {
        Err(_) => Err(std::io::Error::other(format!(
            "no reply within {REPLY_TIMEOUT:?}"
        ))),
        Ok(Ok(0)) => Err(std::io::Error::other("the server closed the connection")),
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(e),
    }
}

async fn one_connection<S: AsyncRead + AsyncWrite>(
    stream: S,
    opts: &LoadOptions,
    c: usize,
    per: usize,
    start: &tokio::sync::Barrier,
) -> std::io::Result<(Vec<u32>, usize)> {
    let (r, mut w) = tokio::io::split(stream);
    let mut r = BufReader::with_capacity(64 * 1024, r);
    let mut line = String::new();
    let hello = async {
        if opts.protocol == Protocol::Native {
            let token = opts.token.clone().unwrap_or_default();
            w.write_all(
                format!("{{\"id\":0,\"op\":\"hello\",\"token\":\"{token}\"}}\n").as_bytes(),
            )
            .await?;
            read_reply(&mut r, &mut line).await?;
            if !line.contains("\"ok\":true") {
                return Err(std::io::Error::other(format!("hello failed: {line}")));
            }
        }
        Ok(())
    }
    .await;
    // Everyone reaches the barrier, even after a failure, or the others wait forever.
    start.wait().await;
    hello?;
    let mut lat = Vec::with_capacity(per);
    let mut errors = 0;
    let mut req = Vec::with_capacity(256);
    let run_effects_max = estop_kernel::Limits::default().effects_per_run_max;
    for i in 0..per {
        use std::io::Write;
        req.clear();
        let held = opts.mix == Mix::HalfHeld && i % 2 == 1;
        let run = if opts.mix == Mix::HalfHeld {
            format!("{}-{c}-{i}", opts.tag)
        } else {
            // One run per connection, continued in a fresh one at the kernel's bound on a run's
            // effects (so a long single-connection run measures admissions, not refusals).
            let part = i / run_effects_max;
            format!("{}-{c}-{part}", opts.tag)
        };
        match opts.protocol {
            Protocol::Native => {
                let tool = if held { "bench_hold" } else { "bench_pay" };
                writeln!(
                    req,
                    "{{\"id\":{i},\"op\":\"admit\",\"run\":\"{run}\",\"key\":\"k{i}\",\"tool\":\"{tool}\",\"args\":{{\"n\":{i}}},\"needs_approval\":{held}}}"
                )?;
            }
            Protocol::SoundGate => {
                writeln!(
                    req,
                    "{{\"op\":\"submit\",\"run_id\":\"{run}\",\"effect_key\":\"k{i}\",\"needs_approval\":{held}}}"
                )?;
            }
        }
        let t = Instant::now();
        w.write_all(&req).await?;
        read_reply(&mut r, &mut line).await?;
        lat.push(t.elapsed().as_micros().min(u128::from(u32::MAX)) as u32);
        let good = if held {
            line.contains("\"held") // held / held_for_approval
        } else {
            line.contains("\"admitted\"") || line.contains("\"release\"")
        };
        if !good {
            errors += 1;
        }
    }
    Ok((lat, errors))
}

/// Runs the load; returns the figures. Refusals and error replies are counted, not fatal.
pub fn run(opts: &LoadOptions) -> std::io::Result<LoadReport> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(run_async(opts))
}

async fn run_async(opts: &LoadOptions) -> std::io::Result<LoadReport> {
    let n = opts.connections.max(1);
    let per = opts.ops.div_ceil(n);
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(n + 1));
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..n {
        let opts = opts.clone();
        let barrier = std::sync::Arc::clone(&barrier);
        tasks.spawn(async move {
            if opts.target.contains('/') {
                match estop_server::uds::UnixConn::connect(&opts.target).await {
                    Ok(s) => one_connection(s, &opts, c, per, &barrier).await,
                    Err(e) => {
                        barrier.wait().await;
                        Err(e)
                    }
                }
            } else {
                match tokio::net::TcpStream::connect(&opts.target).await {
                    Ok(s) => {
                        s.set_nodelay(true)?;
                        one_connection(s, &opts, c, per, &barrier).await
                    }
                    Err(e) => {
                        barrier.wait().await;
                        Err(e)
                    }
                }
            }
        });
    }
    barrier.wait().await;
    let start = Instant::now();
    let mut all = Vec::with_capacity(opts.ops);
    let mut errors = 0;
    while let Some(joined) = tasks.join_next().await {
        let (lat, e) =
            joined.map_err(|e| std::io::Error::other(format!("a load task failed: {e}")))??;
        all.extend(lat);
        errors += e;
    }
    let seconds = start.elapsed().as_secs_f64().max(1e-6);
    all.sort_unstable();
    Ok(LoadReport {
        connections: n,
        ops: all.len(),
        errors,
        seconds,
        admissions_per_s: all.len() as f64 / seconds,
        p50_us: percentile(&all, 0.50),
        p95_us: percentile(&all, 0.95),
        p99_us: percentile(&all, 0.99),
        p999_us: percentile(&all, 0.999),
    })
}
