//! `estop bench egress`: what the egress proxy adds to a request, against a direct connection
//! to the same local server in the same run, at several connection counts (closed loop,
//! keep-alive to the proxy; the proxy admits and completes every request with the daemon and
//! dials the server afresh, as it does for a sandbox); and how long `estop run -- true` takes
//! from spawn to exit.

use crate::percentile;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
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
    /// Worker threads of the proxy's runtime (0: current-thread; `estop_egress::proxy_runtime`).
    pub proxy_workers: usize,
}

/// One connection count's figures, microseconds.
#[derive(Debug, Clone)]
pub struct Overhead {
    /// `http`, or `https` (after the first handshake).
    pub scheme: &'static str,
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

/// Runs the proxy on the host (the same `Proxy` a sandbox gets) and keep-alive servers on
/// 127.0.0.2, over HTTP and over TLS (a CA of the benchmark's own, which the proxy is told to
/// trust), then measures both paths at each connection count. HTTPS is measured after the
/// first handshake: the client's TLS session (with the server, or with the proxy inside a
/// CONNECT tunnel) is reused; the proxy's own upstream TLS connection is made per request.
pub fn proxy_overhead(o: &EgressOptions) -> anyhow::Result<Vec<Overhead>> {
    let tls = Tls::new(&o.data)?;
    let plain = serve_upstream(None)?;
    let secure = serve_upstream(Some(tls.server.clone()))?;
    let proxy = start_proxy(o, &tls.roots_file)?;
    // The CA the proxy signs its leaves with (what a sandbox trusts), made here if new.
    let egress_ca = estop_egress::tls::Ca::load_or_create(&o.data)?.cert_pem;
    let to_proxy = tls.client(egress_ca.as_bytes())?;
    let to_server = tls.client(tls.ca_pem.as_bytes())?;
    let mut out = Vec::new();
    for scheme in ["http", "https"] {
        for &c in &o.connections {
            let c = c.max(1);
            let (direct, proxied) = if scheme == "http" {
                let direct = drive(
                    c,
                    o.requests,
                    || tcp(plain),
                    |s| write!(s, "GET /direct HTTP/1.1\r\nHost: {plain}\r\n\r\n"),
                )?;
                let proxied = drive(
                    c,
                    o.requests,
                    || tcp(proxy),
                    |s| {
                        write!(
                            s,
                            "GET http://{plain}/proxied HTTP/1.1\r\nHost: {plain}\r\n\r\n"
                        )
                    },
                )?;
                (direct, proxied)
            } else {
                let get =
                    |s: &mut dyn Write| write!(s, "GET /secure HTTP/1.1\r\nHost: {secure}\r\n\r\n");
                let direct = drive(c, o.requests, || to_server.over(tcp(secure)?), get)?;
                let tunnel = || to_proxy.over(connect_tunnel(proxy, secure)?);
                let proxied = drive(c, o.requests, tunnel, get)?;
                (direct, proxied)
            };
            out.push(Overhead {
                scheme,
                connections: c,
                requests: direct.len(),
                direct_p50_us: percentile(&direct, 0.5),
                direct_p99_us: percentile(&direct, 0.99),
                proxied_p50_us: percentile(&proxied, 0.5),
                proxied_p99_us: percentile(&proxied, 0.99),
            });
        }
    }
    Ok(out)
}

fn tcp(to: SocketAddr) -> anyhow::Result<Box<dyn Stream>> {
    let c = TcpStream::connect(to)?;
    c.set_nodelay(true)?;
    Ok(Box::new(c))
}

/// A CONNECT to `to` through the proxy, answered 200: the tunnel, for TLS with the proxy.
fn connect_tunnel(proxy: SocketAddr, to: SocketAddr) -> anyhow::Result<Box<dyn Stream>> {
    let c = TcpStream::connect(proxy)?;
    c.set_nodelay(true)?;
    let mut r = BufReader::new(c);
    write!(r.get_mut(), "CONNECT {to} HTTP/1.1\r\nHost: {to}\r\n\r\n")?;
    let mut status = String::new();
    r.read_line(&mut status)?;
    anyhow::ensure!(
        status.starts_with("HTTP/1.1 200"),
        "CONNECT answered {status:?}"
    );
    while {
        let mut line = String::new();
        r.read_line(&mut line)? > 2
    } {}
    anyhow::ensure!(r.buffer().is_empty(), "bytes after the CONNECT answer");
    Ok(Box::new(r.into_inner()))
}

/// The benchmark's own CA and a leaf for 127.0.0.2; the CA's certificate is written where the
/// proxy reads its `upstream_roots`.
struct Tls {
    ca_pem: String,
    roots_file: PathBuf,
    server: Arc<rustls::ServerConfig>,
}

/// A TLS client configuration trusting one CA.
struct Client(Arc<rustls::ClientConfig>);

impl Tls {
    fn new(data: &std::path::Path) -> anyhow::Result<Tls> {
        let ca_key = rcgen::KeyPair::generate()?;
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new())?;
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_cert = ca.self_signed(&ca_key)?;
        let issuer = rcgen::Issuer::new(ca, ca_key);
        let key = rcgen::KeyPair::generate()?;
        let leaf = rcgen::CertificateParams::new(vec![UPSTREAM_IP.to_string()])?
            .signed_by(&key, &issuer)?;
        let server = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(
                vec![leaf.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )?;
        let roots_file = data.join("bench-upstream-ca.pem");
        std::fs::write(&roots_file, ca_cert.pem())?;
        Ok(Tls {
            ca_pem: ca_cert.pem(),
            roots_file,
            server: Arc::new(server),
        })
    }

    fn client(&self, ca_pem: &[u8]) -> anyhow::Result<Client> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls::pki_types::pem::PemObject::pem_slice_iter(ca_pem) {
            let cert: rustls::pki_types::CertificateDer<'static> = cert?;
            roots.add(cert)?;
        }
        let config = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Client(Arc::new(config)))
    }
}

impl Client {
    fn over(&self, io: Box<dyn Stream>) -> anyhow::Result<Box<dyn Stream>> {
        let name = rustls::pki_types::ServerName::try_from(UPSTREAM_IP)?.to_owned();
        let conn = rustls::ClientConnection::new(self.0.clone(), name)?;
        Ok(Box::new(rustls::StreamOwned::new(conn, io)))
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
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

fn start_proxy(o: &EgressOptions, upstream_roots: &std::path::Path) -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    listener.set_nonblocking(true)?;
    let settings = estop_egress::settings::Settings::parse(&format!(
        "[egress]\nallow_destinations = [\"{UPSTREAM_IP}/32\"]\nupstream_roots = {:?}\n",
        upstream_roots.display().to_string()
    ))?;
    let (socket, token, data) = (o.socket.clone(), o.token.clone(), o.data.clone());
    let run = format!("bench-egress-{}", std::process::id());
    let (tx, rx) = std::sync::mpsc::channel();
    let workers = o.proxy_workers;
    // Like `estop run`, with the runtime it would use with `workers`.
    std::thread::spawn(move || {
        let rt = estop_egress::proxy_runtime(workers);
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

/// A keep-alive HTTP/1.1 server answering `ok` to everything (over TLS when given a
/// configuration), a thread per connection.
fn serve_upstream(tls: Option<Arc<rustls::ServerConfig>>) -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind((UPSTREAM_IP, 0))?;
    let addr = listener.local_addr()?;
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let _ = conn.set_nodelay(true);
            let stream: Box<dyn Stream> = match &tls {
                None => Box::new(conn),
                Some(config) => match rustls::ServerConnection::new(config.clone()) {
                    Ok(c) => Box::new(rustls::StreamOwned::new(c, conn)),
                    Err(_) => continue,
                },
            };
            std::thread::spawn(move || {
                let mut r = BufReader::new(stream);
                while read_head(&mut r).is_ok_and(|n| n.is_some()) {
                    let c = r.get_mut();
                    let answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
                    if c.write_all(answer).and_then(|()| c.flush()).is_err() {
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

/// A connection the benchmark's clients speak HTTP/1.1 over: TCP, or TLS over it.
pub trait Stream: Read + Write + Send {}
impl<T: Read + Write + Send> Stream for T {}

/// `connections` clients in a closed loop, `per` requests each over one keep-alive
/// connection made by `connect` (a TLS handshake included); the sorted latencies (µs), the
/// first request of each (its handshake) not counted.
fn drive(
    connections: usize,
    per: usize,
    connect: impl Fn() -> anyhow::Result<Box<dyn Stream>> + Sync,
    send: impl Fn(&mut dyn Write) -> std::io::Result<()> + Sync,
) -> anyhow::Result<Vec<u32>> {
    let all = std::thread::scope(|s| {
        let workers: Vec<_> = (0..connections)
            .map(|_| {
                s.spawn(|| -> anyhow::Result<Vec<u32>> {
                    let mut r = BufReader::new(connect()?);
                    let mut us = Vec::with_capacity(per);
                    for i in 0..=per {
                        let t = Instant::now();
                        send(r.get_mut())?;
                        r.get_mut().flush()?;
                        let len = read_head(&mut r)?
                            .ok_or_else(|| anyhow::anyhow!("the connection closed"))?;
                        let mut body = vec![0; len];
                        r.read_exact(&mut body)?;
                        anyhow::ensure!(
                            body == b"ok",
                            "answered {:?}",
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
