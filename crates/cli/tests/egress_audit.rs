//! What the ledger says of an egress effect, and where its commit point is (issue 27, parts 5
//! and 6), with real processes: a real daemon, `estop run` with Python inside, and upstreams
//! this test starts on the host's 127.0.0.2.
//!
//! * The record names the request (method, URL, host, port, path, query), with secret query
//!   parameters redacted and the credential store's values nowhere; `ledger show`, `report`
//!   and the cancel's answer print it; a lower-case method is `GET` for the policy; userinfo is
//!   refused.
//! * Nothing reaches an upstream after a cancel is acknowledged: the proxy starts a request at
//!   the gate only once its connection is ready, just before the write.

mod common;

use common::{Daemon, bin, ok, poll};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::time::{Duration, Instant};

const POLICY: &str = r#"
[[rules]]
tool = "sandbox.run"
action = "allow"

[[rules]]
tool = "http.GET"
when = 'args.path == "/denied-get"'
action = "deny"

[[rules]]
tool = "http.*"
action = "allow"
"#;

/// `estop run --run RUN` of `script` (Python) under these `[egress]` settings (127.0.0.2 is
/// allowed); stdio piped.
fn estop_run(d: &Daemon, run: &str, settings: &str, script: &str) -> Child {
    let path = d
        .data()
        .parent()
        .unwrap()
        .join(format!("{run}-sandbox.toml"));
    std::fs::write(
        &path,
        format!("[egress]\nallow_destinations = [\"127.0.0.2/32\"]\nhold_ms = 20000\n{settings}"),
    )
    .unwrap();
    Command::new(bin())
        .args(["run", "--data"])
        .arg(d.data())
        .args(["--run", run, "--policy"])
        .arg(&path)
        .args(["--", "python3", "-c", script])
        .stdin(Stdio::null())
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

/// An HTTP/1.1 upstream on 127.0.0.2: records each request's head, answers `ok` (a request to
/// `/slow` is never answered: it says it arrived, then waits for a cut).
struct Upstream {
    port: u16,
    heads: Arc<Mutex<Vec<String>>>,
    slow: mpsc::Receiver<()>,
}

impl Upstream {
    fn start() -> Upstream {
        let listener = TcpListener::bind("127.0.0.2:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let heads = Arc::new(Mutex::new(Vec::new()));
        let (tx, slow) = mpsc::channel();
        let h = heads.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { break };
                let (h, tx) = (h.clone(), tx.clone());
                std::thread::spawn(move || {
                    let mut r = BufReader::new(conn);
                    let head = read_head(&mut r);
                    if head.is_empty() {
                        return;
                    }
                    h.lock().unwrap().push(head.clone());
                    if head.starts_with("GET /slow ") {
                        let _ = tx.send(());
                        let _ = r.read(&mut [0u8; 1]);
                        return;
                    }
                    let c = r.get_mut();
                    let _ = c.write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
                    );
                });
            }
        });
        Upstream { port, heads, slow }
    }
}

/// A request's head (up to the empty line) and its body (by `Content-Length`), read whole;
/// the head is returned ("" when the connection ended first).
fn read_head<R: BufRead>(r: &mut R) -> String {
    let mut head = String::new();
    let mut len = 0usize;
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return String::new();
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap_or(0);
        }
        head.push_str(&line);
        if line == "\r\n" {
            break;
        }
    }
    let mut body = vec![0; len];
    let _ = r.read_exact(&mut body);
    head
}

/// The daemon's whole data directory as bytes (ledger segments, snapshots, everything).
fn every_byte(dir: &std::path::Path) -> Vec<u8> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let p = entry.path();
        if p.is_dir() {
            out.extend(every_byte(&p));
        } else if let Ok(b) = std::fs::read(&p) {
            out.extend(b);
        }
    }
    out
}

/// The run's ledger entries of `kind` (over the protocol).
fn entries(d: &Daemon, run: &str, kind: &str) -> Vec<Value> {
    let mut op = d.operator();
    let v = ok(&mut op, json!({"op": "ledger", "run": run, "limit": 1000}));
    v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == kind)
        .cloned()
        .collect()
}

const RECORD_AGENT: &str = r#"
import http.client, sys, urllib.request
port = int(sys.argv[1])
base = "http://127.0.0.2:%d" % port
r = urllib.request.urlopen(base + "/hello?x=1&api_key=sekrit-123", timeout=10)
print("hello", r.status, flush=True)
def raw(method, url, body=None):
    c = http.client.HTTPConnection("127.0.0.1", 3128, timeout=10)
    c.request(method, url, body=body)
    r = c.getresponse()
    text = r.read().decode(errors="replace")
    c.close()
    return r.status, text
print("denied-get", raw("get", base + "/denied-get")[0], flush=True)
print("lower", raw("get", base + "/lower")[0], flush=True)
status, text = raw("GET", "http://u:pw@127.0.0.2:%d/userinfo" % port)
print("userinfo", status, "userinfo" in text, flush=True)
print("order", raw("POST", base + "/order", body=b'{"n": 1}')[0], flush=True)
"#;

/// Part 5: the ledger, `ledger show` and `report` say what the requests were — method (upper
/// case, whatever the agent wrote: a rule on `http.GET` holds for `get`), URL with the secret
/// parameter `REDACTED` (and `query_sha256` beside it), the response's status and bytes — and
/// neither the secret parameter nor the injected credential is anywhere in the data
/// directory; a URL with userinfo is refused with a 400 and reaches nothing.
#[test]
fn the_ledger_and_the_report_say_what_each_request_was() {
    // Snapshots every few records: the arguments must survive one (and the restart below).
    let mut d = Daemon::start_with_policy(POLICY, &["--console", "off", "--snapshot-every", "4"]);
    let up = Upstream::start();
    let store = d.data().parent().unwrap().join("credentials.toml");
    std::fs::write(
        &store,
        "[[credential]]\nhost = \"127.0.0.2\"\nplain_http = true\nheader = \"X-Api-Key\"\nvalue = \"cred-s3cret-XYZ\"\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&store, std::fs::Permissions::from_mode(0o600)).unwrap();
    let settings = format!(
        "secret_params = [\"api_key\"]\ncredentials = {:?}\n",
        store.display().to_string()
    );
    let script = RECORD_AGENT.replace("int(sys.argv[1])", &up.port.to_string());
    let (code, out, err) = finish(estop_run(&d, "rec", &settings, &script));
    assert_eq!(code, 0, "{out}\n{err}");
    for line in [
        "hello 200",
        "denied-get 403",
        "lower 200",
        "userinfo 400 True",
        "order 200",
    ] {
        assert!(out.contains(line), "{line:?} in:\n{out}\n{err}");
    }
    upstream_saw_the_requests_as_admitted(&up);
    let hello_url = format!("http://127.0.0.2:{}/hello?x=1&api_key=REDACTED", up.port);
    let hello_key = admissions_name_the_requests(&d, up.port, &hello_url);
    the_cli_shows_them_and_no_secret_is_kept(&mut d, up.port, &hello_url, &hello_key);
}

/// The upstream saw `GET` (not `get`), the injected credential, no userinfo, and nothing of
/// the refused requests.
fn upstream_saw_the_requests_as_admitted(up: &Upstream) {
    let heads = up.heads.lock().unwrap().clone();
    let firsts: Vec<&str> = heads.iter().map(|h| h.lines().next().unwrap()).collect();
    assert_eq!(
        firsts,
        vec![
            "GET /hello?x=1&api_key=sekrit-123 HTTP/1.1",
            "GET /lower HTTP/1.1",
            "POST /order HTTP/1.1"
        ],
        "the method goes out upper case; the refused ones reach nothing"
    );
    assert!(heads.iter().all(|h| !h.contains('@')), "{heads:?}");
    assert!(
        heads[0]
            .to_ascii_lowercase()
            .contains("x-api-key: cred-s3cret-xyz"),
        "the credential is injected: {heads:?}"
    );
}

/// The admissions' arguments and the completions' status and bytes, over the protocol; the
/// `/hello` effect's key.
fn admissions_name_the_requests(d: &Daemon, port: u16, hello_url: &str) -> String {
    let admits = entries(d, "rec", "admit");
    let by_path = |p: &str| {
        admits
            .iter()
            .find(|a| a["args"]["path"] == p)
            .unwrap_or_else(|| panic!("no admission of {p}: {admits:#?}"))
            .clone()
    };
    let hello = by_path("/hello");
    assert_eq!(hello["tool"], "http.GET");
    let hello_key = hello["key"].as_str().unwrap().to_string();
    assert_eq!(hello["args"]["method"], "GET");
    assert_eq!(hello["args"]["url"], hello_url);
    assert_eq!(hello["args"]["query"], "x=1&api_key=REDACTED");
    assert_eq!(
        (
            &hello["args"]["host"],
            &hello["args"]["port"],
            &hello["args"]["scheme"]
        ),
        (&json!("127.0.0.2"), &json!(port), &json!("http"))
    );
    assert_eq!(hello["args"]["query_sha256"].as_str().unwrap().len(), 64);
    let lower = by_path("/lower");
    assert_eq!(
        (&lower["tool"], &lower["args"]["method"]),
        (&json!("http.GET"), &json!("GET"))
    );
    let completions = entries(d, "rec", "complete");
    let answered = completions
        .iter()
        .filter(|c| c["status"] == 200 && c["bytes"] == 2);
    assert_eq!(answered.count(), 3, "{completions:#?}");

    hello_key
}

/// `ledger show` and `report` print them (also after a restart from snapshots); neither secret
/// is anywhere in the data directory.
fn the_cli_shows_them_and_no_secret_is_kept(
    d: &mut Daemon,
    port: u16,
    hello_url: &str,
    hello_key: &str,
) {
    let bytes = every_byte(d.data());
    for secret in ["sekrit-123", "cred-s3cret-XYZ"] {
        let found = bytes.windows(secret.len()).any(|w| w == secret.as_bytes());
        assert!(!found, "{secret} is in the data directory");
    }
    let (code, shown, err) = d.cli(&["ledger", "show", "--run", "rec"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        shown.contains(&format!("\"url\":\"{hello_url}\"")),
        "{shown}"
    );
    let hello_done = shown
        .lines()
        .find(|l| l.contains(" complete ") && l.contains(hello_key))
        .unwrap_or_else(|| panic!("no completion of {hello_key}: {shown}"));
    assert!(
        hello_done.contains("bytes=2") && hello_done.contains("status=200"),
        "{hello_done}"
    );
    let (code, report, err) = d.cli(&["report", "rec"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        report.contains(&format!("GET {hello_url} -> 200 (2 bytes)")),
        "{report}"
    );
    assert!(
        report.contains(&format!(
            "POST http://127.0.0.2:{port}/order -> 200 (2 bytes)"
        )),
        "{report}"
    );
    assert!(
        !report.contains("sekrit-123") && !report.contains("cred-s3cret"),
        "{report}"
    );
    // Kept across a restart, from the snapshots and the records after them.
    d.restart();
    let (_, again, _) = d.cli(&["report", "rec"]);
    assert!(
        again.contains(&format!("GET {hello_url} -> 200 (2 bytes)")),
        "{again}"
    );
}

const SLOW_AGENT: &str = r#"
import urllib.request
try:
    urllib.request.urlopen("http://127.0.0.2:PORT/slow", timeout=60); print("slow: answered")
except Exception as e:
    print("slow: cut", type(e).__name__, flush=True)
"#;

/// Part 6: a request written whole and never answered is in flight when the operator cancels:
/// `estop cancel` names it (method and URL), and once cut it is `unknown`, `sent, no answer`,
/// which `estop report` says with the request.
#[test]
fn a_cancel_names_the_requests_in_flight_and_a_written_one_is_sent_no_answer() {
    let d = Daemon::start_with_policy(POLICY, &["--console", "off"]);
    let up = Upstream::start();
    let script = SLOW_AGENT.replace("PORT", &up.port.to_string());
    let child = estop_run(&d, "slow", "", &script);
    up.slow.recv_timeout(Duration::from_secs(60)).unwrap();
    let (code, said, err) = d.cli(&["cancel", "slow", "--reason", "stop"]);
    assert_eq!(code, 0, "{err}");
    let url = format!("http://127.0.0.2:{}/slow", up.port);
    assert!(said.contains("in flight: slow "), "{said}");
    assert!(said.contains(&format!("GET {url}")), "{said}");
    let (_, out, err) = finish(child);
    assert!(out.contains("slow: cut"), "{out}\n{err}");
    let report = poll(Duration::from_secs(20), Duration::from_millis(50), || {
        let (_, report, _) = d.cli(&["report", "slow"]);
        (report.contains("sent, no answer"), report)
    });
    assert!(report.contains(&format!("GET {url}")), "{report}");
    assert!(report.contains("error: sent, no answer"), "{report}");
    let mut op = d.operator();
    let r = ok(&mut op, json!({"op": "report", "run": "slow"}));
    assert_eq!(r["unknown"][0]["tool"], "http.GET", "{r}");
    assert_eq!(r["unknown"][0]["args"]["url"], url.as_str(), "{r}");
}

/// A certificate for `ip` from a CA the test makes; the CA's certificate is written to `roots`.
fn certificate_for(ip: &str, roots: &std::path::Path) -> (rcgen::Certificate, rcgen::KeyPair) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "egress audit test CA");
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

/// What the gated upstream saw: requests answered, connections held before their TLS
/// handshake, and when each request's first byte arrived.
#[derive(Default)]
struct Seen {
    holding: bool,
    held: usize,
    answered: usize,
    arrivals: Vec<(Instant, String)>,
}

/// An HTTPS upstream on 127.0.0.2 whose TLS handshakes the test can hold: a connection that
/// arrives while `holding` waits, before its handshake, until released. So the proxy's dial
/// is as slow as the test wants, and a request admitted before a cancel can be made to reach
/// its upstream only after it — unless the proxy starts it only after the dial.
struct Gated {
    port: u16,
    seen: Arc<(Mutex<Seen>, Condvar)>,
}

impl Gated {
    fn start(roots: &std::path::Path) -> Gated {
        let (leaf, key) = certificate_for("127.0.0.2", roots);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
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
        let listener = TcpListener::bind("127.0.0.2:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new((Mutex::new(Seen::default()), Condvar::new()));
        let s = seen.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { break };
                let (s, config) = (s.clone(), config.clone());
                std::thread::spawn(move || Gated::serve(conn, &s, config));
            }
        });
        Gated { port, seen }
    }

    fn serve(
        conn: std::net::TcpStream,
        seen: &(Mutex<Seen>, Condvar),
        config: Arc<rustls::ServerConfig>,
    ) {
        let (m, cv) = seen;
        {
            let mut g = m.lock().unwrap();
            if g.holding {
                g.held += 1;
                cv.notify_all();
                drop(cv.wait_while(g, |g| g.holding).unwrap());
            }
        }
        let tls = rustls::ServerConnection::new(config).unwrap();
        let mut s = rustls::StreamOwned::new(tls, conn);
        let mut first = [0u8; 1];
        if !matches!(s.read(&mut first), Ok(1)) {
            return;
        }
        let at = Instant::now();
        let mut r = BufReader::new(s);
        let head = read_head(&mut r);
        let line = format!("{}{}", first[0] as char, head.lines().next().unwrap_or(""));
        let _ = r
            .get_mut()
            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok");
        let _ = r.get_mut().flush();
        let mut g = m.lock().unwrap();
        g.arrivals.push((at, line));
        g.answered += 1;
        cv.notify_all();
    }

    /// Waits (up to `within`) until `done` holds of what was seen.
    fn until(&self, within: Duration, done: impl Fn(&Seen) -> bool) -> bool {
        let (m, cv) = &*self.seen;
        let g = m.lock().unwrap();
        let (g, _) = cv.wait_timeout_while(g, within, |g| !done(g)).unwrap();
        done(&g)
    }

    fn hold(&self, holding: bool) {
        let (m, cv) = &*self.seen;
        m.lock().unwrap().holding = holding;
        cv.notify_all();
    }
}

const CHARGING_AGENT: &str = r#"
import sys, threading, time, urllib.request, urllib.error
base = "https://127.0.0.2:PORT"
def worker(k):
    i = 0
    until = time.time() + 90
    while time.time() < until:
        i += 1
        try:
            urllib.request.urlopen("%s/charge-%d-%d" % (base, k, i), timeout=60).read()
        except urllib.error.HTTPError as e:
            if e.code == 403:
                return
        except Exception as e:
            # A CONNECT the proxy refuses (the run stopped) fails the tunnel with its 403.
            if "403" in str(e):
                return
threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
for t in threads: t.start()
for t in threads: t.join()
print("agent done", flush=True)
"#;

/// Part 6, hostile timing: eight worker threads of the agent charge an HTTPS upstream without
/// pause; the upstream holds every new TLS handshake once warmed up, so requests the gate has
/// admitted are waiting on their dial when the operator cancels; the handshakes are released
/// the instant the cancel is acknowledged. No request's first byte may reach the upstream
/// after that instant. (With the start at admission, the held requests were already started:
/// released, they were written before the proxy heard of the stop.)
#[test]
fn nothing_reaches_the_upstream_after_a_cancel_is_acknowledged() {
    let d = Daemon::start_with_policy(POLICY, &["--console", "off"]);
    let roots = d.data().parent().unwrap().join("gated-ca.pem");
    let up = Gated::start(&roots);
    let settings = format!("upstream_roots = {:?}\n", roots.display().to_string());
    let script = CHARGING_AGENT.replace("PORT", &up.port.to_string());
    let child = estop_run(&d, "race", &settings, &script);
    assert!(
        up.until(Duration::from_secs(60), |s| s.answered >= 8),
        "the agent's requests flow"
    );
    up.hold(true);
    assert!(
        up.until(Duration::from_secs(30), |s| s.held >= 4),
        "requests wait on their dial"
    );
    let mut op = d.operator();
    let reply = ok(
        &mut op,
        json!({"op": "cancel", "run": "race", "reason": "stop"}),
    );
    let acked = Instant::now();
    up.hold(false);
    let (_, out, err) = finish(child);
    assert!(out.contains("agent done"), "{out}\n{err}");
    let (m, _) = &*up.seen;
    let seen = m.lock().unwrap();
    let late: Vec<(Duration, &str)> = seen
        .arrivals
        .iter()
        .filter(|(at, _)| *at > acked)
        .map(|(at, line)| (*at - acked, line.as_str()))
        .collect();
    let margin = seen
        .arrivals
        .iter()
        .filter(|(at, _)| *at <= acked)
        .map(|(at, _)| acked - *at)
        .min();
    eprintln!(
        "requests answered {}, held at the cancel {}, reached after the ack {}, closest before \
         it {margin:?}; the cancel's answer: {reply}",
        seen.arrivals.len(),
        seen.held,
        late.len()
    );
    assert!(
        late.is_empty(),
        "{} requests reached the upstream after the cancel was acknowledged: {late:?}",
        late.len()
    );
}
