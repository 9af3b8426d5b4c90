//! Closed-loop load: N connections, each admitting unique keys (durably) as fast as replies come
//! back, one run per connection — the reference system's load shape, so the two compare on one
//! machine in one run. Speaks protocol v1 or the SoundGate wire.

use crate::percentile;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

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

trait Conn: std::io::Read + Write + Send {}
impl<T: std::io::Read + Write + Send> Conn for T {}

fn connect(target: &str) -> std::io::Result<(Box<dyn Conn>, Box<dyn Conn>)> {
    // A reply that never comes is a bug to report, not a benchmark that hangs.
    let timeout = Some(Duration::from_secs(30));
    if target.contains('/') {
        let s = UnixStream::connect(target)?;
        s.set_read_timeout(timeout)?;
        Ok((Box::new(s.try_clone()?), Box::new(s)))
    } else {
        let s = TcpStream::connect(target)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(timeout)?;
        Ok((Box::new(s.try_clone()?), Box::new(s)))
    }
}

/// Runs the load; returns the figures. Errors (refusals, error replies) are counted, not fatal.
pub fn run(opts: &LoadOptions) -> std::io::Result<LoadReport> {
    let per = opts.ops.div_ceil(opts.connections.max(1));
    let barrier = Arc::new(Barrier::new(opts.connections + 1));
    let mut handles = Vec::new();
    for c in 0..opts.connections {
        let opts = opts.clone();
        let barrier = Arc::clone(&barrier);
        handles.push(std::thread::spawn(move || -> std::io::Result<(Vec<u32>, usize)> {
            // Reach the barrier even when connecting fails, or everyone else waits forever.
            let connected = connect(&opts.target);
            if connected.is_err() {
                barrier.wait();
            }
            let (r, mut w) = connected?;
            let mut r = BufReader::with_capacity(64 * 1024, r);
            let mut line = String::new();
            if opts.protocol == Protocol::Native {
                let token = opts.token.clone().unwrap_or_default();
                w.write_all(format!("{{\"id\":0,\"op\":\"hello\",\"token\":\"{token}\"}}\n").as_bytes())?;
                let hello = r.read_line(&mut line);
                if hello.is_err() || !line.contains("\"ok\":true") {
                    barrier.wait();
                    hello?;
                    return Err(std::io::Error::other(format!("hello failed: {line}")));
                }
            }
            let mut lat = Vec::with_capacity(per);
            let mut errors = 0;
            let mut req = Vec::with_capacity(256);
            barrier.wait();
            for i in 0..per {
                req.clear();
                let held = opts.mix == Mix::HalfHeld && i % 2 == 1;
                let run = if opts.mix == Mix::HalfHeld { format!("{}-{c}-{i}", opts.tag) } else { format!("{}-{c}", opts.tag) };
                match opts.protocol {
                    Protocol::Native => {
                        let tool = if held { "bench_hold" } else { "bench_pay" };
                        write!(req, "{{\"id\":{i},\"op\":\"admit\",\"run\":\"{run}\",\"key\":\"k{i}\",\"tool\":\"{tool}\",\"args\":{{\"n\":{i}}},\"needs_approval\":{held}}}\n")?;
                    }
                    Protocol::SoundGate => {
                        write!(req, "{{\"op\":\"submit\",\"run_id\":\"{run}\",\"effect_key\":\"k{i}\",\"needs_approval\":{held}}}\n")?;
                    }
                }
                let t = Instant::now();
                w.write_all(&req)?;
                line.clear();
                if r.read_line(&mut line)? == 0 {
                    return Err(std::io::Error::other("the server closed the connection"));
                }
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
        }));
    }
    barrier.wait();
    let start = Instant::now();
    let mut all = Vec::with_capacity(opts.ops);
    let mut errors = 0;
    for h in handles {
        let (lat, e) = h
            .join()
            .map_err(|_| std::io::Error::other("a load thread panicked"))??;
        all.extend(lat);
        errors += e;
    }
    let seconds = start
        .elapsed()
        .as_secs_f64()
        .max(Duration::from_micros(1).as_secs_f64());
    all.sort_unstable();
    Ok(LoadReport {
        connections: opts.connections,
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
