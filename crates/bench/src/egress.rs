//! `estop bench egress`: what the egress proxy adds to a request, against a direct connection
//! to the same local server in the same run, at several connection counts (closed loop,
//! keep-alive to the proxy; the proxy admits and completes every request with the daemon and
//! dials the server afresh, as it does for a sandbox); and how long `estop run -- true` takes
//! from spawn to exit.

use crate::percentile;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::Instant;

/// Where the proxy's upstream listens: a loopback address the proxy is told it may reach.
pub const UPSTREAM_IP: &str = "127.0.0.2";

pub struct EgressOptions {
    /// The daemon's socket and an agent token.
    pub socket: String,
    pub token: String,
    /// The daemon's data directory (the egress CA lives there; `estop run` reads its token).
    pub data: PathBuf,
    pub connections: Vec<usize>,
    /// Requests per connection (the first of each connection is not counted).
    pub requests: usize,
    /// How many `estop run -- true` to time (0: none).
    pub starts: usize,
    /// The `estop` binary.
    pub estop: PathBuf,
}

/// One connection count's figures, microseconds.
#[derive(Debug, Clone)]
pub struct Overhead {
    pub connections: usize,
    pub requests: usize,
    pub direct_p50_us: u32,
    pub direct_p99_us: u32,
    pub proxied_p50_us: u32,
    pub proxied_p99_us: u32,
}

/// `estop run -- true`, spawn to exit, milliseconds.
#[derive(Debug, Clone, Copy)]
pub struct Start {
    pub runs: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

/// Runs the proxy on the host (the same `Proxy` a sandbox gets) and a keep-alive HTTP server
/// on 127.0.0.2, then measures both paths at each connection count.
pub fn proxy_overhead(o: &EgressOptions) -> anyhow::Result<Vec<Overhead>> {
    let upstream = serve_upstream()?;
    let proxy = start_proxy(o)?;
    let mut out = Vec::new();
    for &c in &o.connections {
        let c = c.max(1);
        let direct = drive(
            c,
            o.requests,
            |s| write!(s, "GET /direct HTTP/1.1\r\nHost: {upstream}\r\n\r\n"),
            upstream,
        )?;
        let proxied = drive(
            c,
            o.requests,
            |s| {
                write!(
                    s,
                    "GET http://{upstream}/proxied HTTP/1.1\r\nHost: {upstream}\r\n\r\n"
                )
            },
            proxy,
        )?;
        out.push(Overhead {
            connections: c,
            requests: direct.len(),
            direct_p50_us: percentile(&direct, 0.5),
            direct_p99_us: percentile(&direct, 0.99),
            proxied_p50_us: percentile(&proxied, 0.5),
            proxied_p99_us: percentile(&proxied, 0.99),
        });
    }
    Ok(out)
}

/// Times `estop run --data DATA -- true` (the sandbox made, the launch admitted and recorded,
/// the run closed), one after another.
pub fn sandbox_start(o: &EgressOptions) -> anyhow::Result<Start> {
    let mut ms = Vec::new();
    for _ in 0..o.starts {
        let t = Instant::now();
        let status = std::process::Command::new(&o.estop)
            .arg("run")
            .arg("--data")
            .arg(&o.data)
            .args(["--socket", &o.socket, "--token", &o.token, "--", "true"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()?;
        anyhow::ensure!(
            status.success(),
            "estop run -- true failed ({status}): run it alone to see why"
        );
        ms.push(t.elapsed().as_micros() as u32);
    }
    ms.sort_unstable();
    Ok(Start {
        runs: ms.len(),
        p50_ms: f64::from(percentile(&ms, 0.5)) / 1000.0,
        p99_ms: f64::from(percentile(&ms, 0.99)) / 1000.0,
    })
}

fn start_proxy(o: &EgressOptions) -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    listener.set_nonblocking(true)?;
    let settings = estop_egress::settings::Settings::parse(&format!(
        "[egress]\nallow_destinations = [\"{UPSTREAM_IP}/32\"]\n"
    ))?;
    let (socket, token, data) = (o.socket.clone(), o.token.clone(), o.data.clone());
    let run = format!("bench-egress-{}", std::process::id());
    let (tx, rx) = std::sync::mpsc::channel();
    // Like `estop run`: one current-thread runtime serves the proxy.
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build();
        let result = rt.map_err(anyhow::Error::from).and_then(|rt| {
            rt.block_on(async {
                let l = tokio::net::TcpListener::from_std(listener)?;
                let _ = tx.send(Ok(()));
                estop_egress::serve_proxy(&socket, &token, &run, &data, settings, l).await
            })
        });
        if let Err(e) = result {
            let _ = tx.send(Err(e));
        }
    });
    rx.recv()??;
    Ok(addr)
}

/// A keep-alive HTTP/1.1 server answering `ok` to everything, a thread per connection.
fn serve_upstream() -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind((UPSTREAM_IP, 0))?;
    let addr = listener.local_addr()?;
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let _ = conn.set_nodelay(true);
                let mut r = BufReader::new(conn);
                while read_head(&mut r).is_ok_and(|n| n.is_some()) {
                    let c = r.get_mut();
                    if c.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    Ok(addr)
}

/// Reads one message head; its Content-Length (None at the end of the stream).
fn read_head(r: &mut impl BufRead) -> std::io::Result<Option<usize>> {
    let (mut len, mut first) = (0, true);
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            return Ok(None);
        }
        if line == "\r\n" && !first {
            return Ok(Some(len));
        }
        first = false;
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap_or(0);
        }
    }
}

/// `connections` clients in a closed loop against `to`, `per` requests each over one
/// keep-alive connection; the sorted latencies (µs), first request of each not counted.
fn drive(
    connections: usize,
    per: usize,
    send: impl Fn(&mut TcpStream) -> std::io::Result<()> + Sync,
    to: SocketAddr,
) -> anyhow::Result<Vec<u32>> {
    let all = std::thread::scope(|s| {
        let workers: Vec<_> = (0..connections)
            .map(|_| {
                s.spawn(|| -> anyhow::Result<Vec<u32>> {
                    let conn = TcpStream::connect(to)?;
                    conn.set_nodelay(true)?;
                    let mut w = conn.try_clone()?;
                    let mut r = BufReader::new(conn);
                    let mut us = Vec::with_capacity(per);
                    for i in 0..=per {
                        let t = Instant::now();
                        send(&mut w)?;
                        let len = read_head(&mut r)?
                            .ok_or_else(|| anyhow::anyhow!("{to} closed the connection"))?;
                        let mut body = vec![0; len];
                        r.read_exact(&mut body)?;
                        anyhow::ensure!(
                            body == b"ok",
                            "{to} answered {:?}",
                            String::from_utf8_lossy(&body)
                        );
                        if i > 0 {
                            us.push(t.elapsed().as_micros() as u32);
                        }
                    }
                    Ok(us)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("a client thread"))
            .collect::<anyhow::Result<Vec<_>>>()
    })?;
    let mut all: Vec<u32> = all.into_iter().flatten().collect();
    all.sort_unstable();
    Ok(all)
}
