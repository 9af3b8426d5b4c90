//! Tokens as a real credential store, and agent text shown as it is (issue 11, findings 7 and
//! 8), against a real `estop serve`: revocation that ends open connections and console
//! sessions at once, token changes in the ledger with who made them (and no secret), registry
//! writes that survive concurrent creations, a lost registry that refuses to start, the
//! read-only `observer` role, private file modes, and every CLI table escaping control, bidi
//! and zero-width characters an agent wrote.

mod common;

use common::*;
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::time::Duration;

/// One HTTP/1.1 request with `Connection: close`; returns (status, body).
fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() {
        req.push_str("Content-Type: application/json\r\n");
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes()).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, body.to_string())
}

/// One HTTP/1.1 request with `Connection: close`; returns (status, head, body).
fn http_full(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() {
        req.push_str("Content-Type: application/json\r\n");
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes()).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, head.to_string(), body.to_string())
}

/// A console session, as the console's own page would hold it: whatever the login handed out
/// (a session secret in the answer, or a cookie), sent back the way the page sends it.
struct Session {
    addr: String,
    headers: Vec<(String, String)>,
}

impl Session {
    /// Logs in with `token` as the console's page; `Err(status)` when refused.
    fn login(addr: &str, token: &str) -> Result<Session, u16> {
        let origin = format!("http://{addr}");
        let own = [
            ("Origin", origin.as_str()),
            ("Sec-Fetch-Site", "same-origin"),
        ];
        let body = json!({"token": token}).to_string();
        let (status, head, body) = http_full(addr, "POST", "/api/v1/session", &own, &body);
        if status != 200 {
            return Err(status);
        }
        let mut headers = vec![
            ("Origin".to_string(), origin.clone()),
            ("Sec-Fetch-Site".to_string(), "same-origin".to_string()),
        ];
        let v: Value = serde_json::from_str(&body).unwrap();
        if let Some(id) = v["session"].as_str() {
            headers.push(("X-Estop-Session".into(), id.into()));
        }
        let cookie = head.lines().find_map(|l| {
            let (k, v) = l.split_once(": ")?;
            k.eq_ignore_ascii_case("set-cookie")
                .then(|| v.split(';').next().unwrap_or("").to_string())
        });
        if let Some(c) = cookie {
            headers.push(("Cookie".into(), c));
        }
        assert!(
            headers.len() > 2,
            "the login handed out no session: {head}\n{body}"
        );
        Ok(Session {
            addr: addr.to_string(),
            headers,
        })
    }

    /// `GET path` with the session; the status.
    fn get(&self, path: &str) -> u16 {
        let h: Vec<(&str, &str)> = self
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        http_full(&self.addr, "GET", path, &h, "").0
    }
}

fn create_token(d: &Daemon, name: &str, role: &str) -> String {
    let (code, out, err) = d.cli(&["token", "create", name, "--role", role]);
    assert_eq!(code, 0, "token create {name}: {err}");
    out.trim().to_string()
}

/// A raw v1 connection with a read timeout, authenticated with `token`.
fn raw_conn(d: &Daemon, token: &str) -> (UnixStream, BufReader<UnixStream>) {
    let s = UnixStream::connect(d.socket()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut w = s;
    writeln!(w, "{}", json!({"id": 0, "op": "hello", "token": token})).unwrap();
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    assert!(line.contains("\"ok\":true"), "{line}");
    (w, r)
}

#[test]
fn revoking_a_token_ends_its_open_connections_and_console_sessions_at_once() {
    let d = Daemon::start_with(&["--console", "127.0.0.1:0"]);
    let addr = d.ready_field("console");
    let bob = create_token(&d, "bob", "operator");
    let spy = create_token(&d, "spy", "agent");

    // bob: two open v1 connections (one idle, one busy), a bearer token and a console session.
    let (_bob_idle_w, mut bob_idle) = raw_conn(&d, &bob);
    let (mut bob_w, mut bob_r) = raw_conn(&d, &bob);
    let bob_session = Session::login(&addr, &bob).unwrap();
    assert_eq!(bob_session.get("/api/v1/runs"), 200);
    // spy: an agent connection that only listens (it never sends another request).
    let mut a = d.client_with(&spy);
    admit(&mut a, "spy-run", "k", "pay", json!({}));
    let (mut spy_w, mut spy_r) = raw_conn(&d, &spy);
    writeln!(
        spy_w,
        "{}",
        json!({"id": 1, "op": "subscribe", "run": "spy-run"})
    )
    .unwrap();
    let mut line = String::new();
    spy_r.read_line(&mut line).unwrap();
    assert!(line.contains("\"ok\":true"), "{line}");

    // bob's event stream (server-sent events), followed until the first event.
    let mut events = std::net::TcpStream::connect(&addr).unwrap();
    events
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    write!(
        events,
        "GET /api/v1/events HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {bob}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut events = BufReader::new(events);
    let mut seen = String::new();
    while !seen.contains("event: ready") {
        assert_ne!(events.read_line(&mut seen).unwrap(), 0, "{seen}");
    }

    let (code, out, err) = d.cli(&["token", "revoke", "bob"]);
    assert_eq!(code, 0, "{out}{err}");
    // The stream ends at once (not at its next 15 s check).
    events
        .get_ref()
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut rest = String::new();
    let ended = events.read_to_string(&mut rest);
    assert!(ended.is_ok(), "the event stream did not end: {ended:?}");
    let (code, _, err) = d.cli(&["token", "revoke", "spy"]);
    assert_eq!(code, 0, "{err}");

    // bob's idle connection is told and closed at once; a request on the other is refused
    // (typed), and it is closed too. Nothing after the refusal: no reply of `runs`.
    let mut line = String::new();
    bob_idle.read_line(&mut line).unwrap();
    assert!(
        line.contains("\"unauthenticated\"") && line.contains("revoked"),
        "{line}"
    );
    line.clear();
    assert_eq!(bob_idle.read_line(&mut line).unwrap(), 0, "closed: {line}");
    let _ = writeln!(bob_w, "{}", json!({"id": 7, "op": "runs"}));
    let mut rest = String::new();
    bob_r.read_to_string(&mut rest).unwrap();
    assert!(
        rest.contains("\"unauthenticated\"") && rest.contains("revoked"),
        "{rest}"
    );
    assert!(!rest.contains("\"runs\""), "{rest}");
    // A new hello with the revoked secret is refused.
    let mut again = estop_server::client::Client::connect(&d.socket()).unwrap();
    let r = again.call(json!({"op": "hello", "token": bob})).unwrap();
    assert_eq!(r.error.unwrap().code, "unauthenticated");
    // The listening agent connection is closed without sending anything.
    let mut rest = String::new();
    let eof = spy_r.read_to_string(&mut rest);
    assert!(eof.is_ok(), "the connection was not closed: {eof:?}");
    assert!(!rest.contains("\"ok\":true"), "{rest}");
    let r = a.call(json!({"op": "status", "run": "spy-run"}));
    assert!(r.as_ref().map_or(true, |r| !r.ok), "{:?}", r.map(|r| r.raw));
    // Over HTTP: the bearer token and the session are both dead.
    let bearer = format!("Bearer {bob}");
    assert_eq!(
        http(
            &addr,
            "GET",
            "/api/v1/runs",
            &[("Authorization", &bearer)],
            ""
        )
        .0,
        401
    );
    assert_eq!(bob_session.get("/api/v1/runs"), 401, "the session ended");
    assert_eq!(
        Session::login(&addr, &bob).err(),
        Some(401),
        "a revoked token cannot log in"
    );
}

#[test]
fn a_console_session_ends_when_its_token_is_revoked() {
    let d = Daemon::start_with(&["--console", "127.0.0.1:0"]);
    let addr = d.ready_field("console");
    let carol = create_token(&d, "carol", "operator");
    let session = Session::login(&addr, &carol).unwrap();
    assert_eq!(session.get("/api/v1/session"), 200);
    let (code, _, err) = d.cli(&["token", "revoke", "carol"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        session.get("/api/v1/session"),
        401,
        "the session of a revoked token ends"
    );
}

#[test]
fn the_last_operator_token_cannot_be_revoked_and_only_operators_revoke() {
    let d = Daemon::start();
    // Agents and observers cannot revoke.
    let mut a = d.agent();
    assert_eq!(
        err_code(&mut a, json!({"op": "token_revoke", "name": "admin"})),
        "forbidden"
    );
    // The bootstrap agent token can be revoked.
    let (code, _, err) = d.cli(&["token", "revoke", "agent"]);
    assert_eq!(code, 0, "{err}");
    // admin is the only operator: refused, and it says what to do.
    let (code, _, err) = d.cli(&["token", "revoke", "admin"]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("last operator"), "{err}");
    assert!(err.contains("token create"), "{err}");
    let mut op = d.operator();
    ok(&mut op, json!({"op": "runs"}));
    // With a second operator, the bootstrap one goes; then the new one is the last.
    let bob = create_token(&d, "bob", "operator");
    let (code, _, err) = d.cli(&["token", "revoke", "admin"]);
    assert_eq!(code, 0, "{err}");
    let out = Command::new(bin())
        .args(["token", "revoke", "bob", "--data"])
        .arg(d.data())
        .env("ESTOP_TOKEN", &bob)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("last operator"));
    let out = Command::new(bin())
        .args(["token", "revoke", "nobody", "--data"])
        .arg(d.data())
        .env("ESTOP_TOKEN", &bob)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{err}");
    assert!(err.contains("nobody"), "{err}");
    // The CLI with a revoked token says so.
    let (code, _, err) = d.cli(&["runs"]);
    assert_eq!(code, 1);
    assert!(err.contains("refused the token"), "{err}");
}

#[test]
fn token_changes_are_in_the_ledger_with_who_made_them_and_no_secret() {
    let mut d = Daemon::start();
    let bob = create_token(&d, "bob", "operator");
    let (code, _, err) = d.cli(&["token", "create", "eve", "--role", "agent", "--group", "x"]);
    assert_eq!(code, 0, "{err}");
    let out = Command::new(bin())
        .args(["token", "revoke", "eve", "--data"])
        .arg(d.data())
        .env("ESTOP_TOKEN", &bob)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let show = |d: &Daemon| {
        let (code, out, err) = d.cli(&["ledger", "show"]);
        assert_eq!(code, 0, "{err}");
        out
    };
    let check = |out: &str| {
        // The bootstrap tokens, made by the gate itself at first start.
        let boot = out
            .lines()
            .find(|l| l.contains("token_create") && l.contains("name=admin"));
        let boot = boot.unwrap_or_else(|| panic!("no token_create of admin:\n{out}"));
        assert!(
            boot.contains("principal=estop") && boot.contains("role=operator"),
            "{boot}"
        );
        let created = out
            .lines()
            .find(|l| l.contains("token_create") && l.contains("name=eve"));
        let created = created.unwrap_or_else(|| panic!("no token_create of eve:\n{out}"));
        assert!(created.contains("principal=admin"), "{created}");
        assert!(created.contains("role=agent"), "{created}");
        assert!(created.contains("groups=x"), "{created}");
        let revoked = out
            .lines()
            .find(|l| l.contains("token_revoke") && l.contains("name=eve"));
        let revoked = revoked.unwrap_or_else(|| panic!("no token_revoke of eve:\n{out}"));
        assert!(revoked.contains("principal=bob"), "{revoked}");
    };
    check(&show(&d));
    // JSON carries the same.
    let (_, json_out, _) = d.cli(&["ledger", "show", "--json"]);
    assert!(json_out.contains("\"kind\":\"token_revoke\""), "{json_out}");
    // No secret, nor its hash, in any ledger byte.
    let sha = {
        use sha2::Digest as _;
        let h = sha2::Sha256::digest(bob.as_bytes());
        h.iter().map(|b| format!("{b:02x}")).collect::<String>()
    };
    for f in std::fs::read_dir(d.data().join("ledger")).unwrap() {
        let bytes = std::fs::read(f.unwrap().path()).unwrap();
        let text = String::from_utf8_lossy(&bytes);
        assert!(!text.contains(&bob), "a secret in the ledger");
        assert!(!text.contains(&sha), "a secret's hash in the ledger");
        let raw_hash = sha2::Sha256::digest(bob.as_bytes());
        assert!(
            !bytes.windows(32).any(|w| w == raw_hash.as_slice()),
            "a secret's hash in the ledger"
        );
    }
    // Recovery replays the records; the revocation still holds.
    d.restart();
    check(&show(&d));
    let mut c = estop_server::client::Client::connect(&d.socket()).unwrap();
    let r = c.call(json!({"op": "hello", "token": bob})).unwrap();
    assert!(r.ok, "bob survives a restart: {}", r.raw);
}

use sha2::Digest as _;

#[test]
fn concurrent_token_creations_all_survive_and_the_registry_is_never_torn() {
    let mut d = Daemon::start();
    let threads: Vec<_> = (0..12)
        .map(|t| {
            let socket = d.socket();
            let op = d.token("operator.token");
            std::thread::spawn(move || {
                let mut c = estop_server::client::Client::connect_as(&socket, &op).unwrap();
                (0..5)
                    .map(|i| {
                        let name = format!("t{t}-{i}");
                        let r = c
                            .call(json!({"op": "token", "name": name, "role": "agent"}))
                            .unwrap();
                        assert!(r.ok, "{name}: {}", r.raw);
                        (name, r.raw["token"].as_str().unwrap().to_string())
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let created: Vec<(String, String)> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    assert_eq!(created.len(), 60);
    // No temp file is left behind, and the registry parses.
    let leftovers: Vec<_> = std::fs::read_dir(d.data())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n.contains("tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    d.restart();
    for (name, secret) in &created {
        let mut c = estop_server::client::Client::connect(&d.socket()).unwrap();
        let r = c.call(json!({"op": "hello", "token": secret})).unwrap();
        assert!(r.ok, "{name} did not survive: {}", r.raw);
        assert_eq!(r.raw["principal"], name.as_str());
    }
}

/// Runs `estop serve` on `data` and returns its exit code and stderr if it exits; fails if it
/// becomes ready instead.
fn serve_refuses(data: &std::path::Path, extra: &[&str]) -> (i32, String) {
    let mut child = Command::new(bin())
        .args(["serve", "--console", "off", "--data"])
        .arg(data)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut first = String::new();
    BufReader::new(stdout).read_line(&mut first).unwrap();
    if first.starts_with("estop ready") {
        child.kill().unwrap();
        child.wait().unwrap();
        panic!("estop serve started: {first}");
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn a_lost_registry_refuses_to_start_instead_of_dropping_every_named_token() {
    let mut d = Daemon::start();
    let bob = create_token(&d, "bob", "operator");
    assert_eq!(d.terminate(), Some(0));
    std::fs::remove_file(d.data().join("tokens")).unwrap();
    let (code, err) = serve_refuses(d.data(), &[]);
    assert_ne!(code, 0);
    assert!(err.contains("tokens"), "{err}");
    assert!(
        err.contains("Restore") && err.contains("--reset-tokens"),
        "says what to do: {err}"
    );
    assert!(!d.data().join("tokens").exists(), "nothing re-created");
    // An unreadable registry (here: a directory in its place) refuses too.
    std::fs::create_dir(d.data().join("tokens")).unwrap();
    let (code, err) = serve_refuses(d.data(), &[]);
    assert_ne!(code, 0);
    assert!(err.contains("tokens"), "{err}");
    std::fs::remove_dir(d.data().join("tokens")).unwrap();
    // The explicit way out: fresh bootstrap tokens; bob stays gone.
    d.extra.push("--reset-tokens".into());
    d.spawn();
    let mut c = estop_server::client::Client::connect(&d.socket()).unwrap();
    let r = c.call(json!({"op": "hello", "token": bob})).unwrap();
    assert!(!r.ok);
    ok(&mut d.operator(), json!({"op": "runs"}));
    // A fresh data dir still bootstraps by itself.
    let fresh = Daemon::start();
    ok(&mut fresh.operator(), json!({"op": "runs"}));
}

#[test]
fn an_observer_reads_everything_and_changes_nothing() {
    let d = Daemon::start_with(&["--console", "127.0.0.1:0"]);
    let addr = d.ready_field("console");
    let obs = create_token(&d, "prometheus", "observer");
    let mut a = d.agent();
    let held = admit(&mut a, "r1", "k1", "refund", json!({"amount": 5}));
    assert_eq!(verdict(&held), "held");
    let mut o = estop_server::client::Client::connect(&d.socket()).unwrap();
    let hello = o.call(json!({"op": "hello", "token": obs})).unwrap();
    assert!(hello.ok, "{}", hello.raw);
    assert_eq!(hello.raw["role"], "observer");
    // Reads: every run, like an operator.
    for req in [
        json!({"op": "runs"}),
        json!({"op": "pending"}),
        json!({"op": "status", "run": "r1"}),
        json!({"op": "report", "run": "r1"}),
        json!({"op": "ledger"}),
        json!({"op": "subscribe", "run": "r1"}),
        json!({"op": "ping"}),
    ] {
        ok(&mut o, req);
    }
    assert_eq!(
        ok(&mut o, json!({"op": "pending"}))["pending"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    // No decision, no stop, no admission, no token change.
    for req in [
        json!({"op": "decide", "run": "r1", "key": "k1", "decision": "approve"}),
        json!({"op": "cancel", "run": "r1"}),
        json!({"op": "cancel", "run": "unseen"}),
        json!({"op": "kill", "run": "r1"}),
        json!({"op": "pause", "run": "r1"}),
        json!({"op": "resume", "run": "r1"}),
        json!({"op": "close", "run": "r1"}),
        json!({"op": "admit", "run": "o1", "key": "k", "tool": "pay", "args": {}}),
        json!({"op": "wait", "run": "r1", "key": "k1", "timeout_ms": 0}),
        json!({"op": "token", "name": "x", "role": "operator"}),
        json!({"op": "token_revoke", "name": "agent"}),
    ] {
        assert_eq!(err_code(&mut o, req.clone()), "forbidden", "{req}");
    }
    let mut op = d.operator();
    assert_eq!(
        ok(&mut op, json!({"op": "status", "run": "r1"}))["state"],
        "active"
    );
    // HTTP: metrics and reads yes, actions no.
    let bearer = format!("Bearer {obs}");
    let (status, body) = http(&addr, "GET", "/metrics", &[("Authorization", &bearer)], "");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("estop_"), "{body}");
    let (status, _) = http(
        &addr,
        "GET",
        "/api/v1/pending",
        &[("Authorization", &bearer)],
        "",
    );
    assert_eq!(status, 200);
    let (status, _) = http(
        &addr,
        "POST",
        "/api/v1/runs/r1/effects/k1/approve",
        &[("Authorization", &bearer)],
        "{}",
    );
    assert_eq!(status, 403);
    let (status, _) = http(
        &addr,
        "POST",
        "/api/v1/tokens",
        &[("Authorization", &bearer)],
        &json!({"name": "y", "role": "operator"}).to_string(),
    );
    assert_eq!(status, 403);
    // An agent token still cannot read metrics.
    let agent = format!("Bearer {}", d.token("agent.token"));
    assert_eq!(
        http(&addr, "GET", "/metrics", &[("Authorization", &agent)], "").0,
        403
    );
}

fn mode(p: &std::path::Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

#[test]
fn the_data_dir_socket_ledger_and_token_files_are_private() {
    let mut d = Daemon {
        dir: tempfile::tempdir().unwrap(),
        child: None,
        ready: String::new(),
        extra: vec!["--snapshot-every".into(), "1".into()],
    };
    // A data dir that starts out world-readable.
    std::fs::set_permissions(d.data(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(d.data().join("policy.toml"), POLICY).unwrap();
    d.spawn();
    let mut a = d.agent();
    admit(&mut a, "r", "k1", "pay", json!({}));
    admit(&mut a, "r", "k2", "pay", json!({}));
    create_token(&d, "bob", "agent");
    assert_eq!(mode(d.data()), 0o700, "data dir");
    assert_eq!(mode(&d.data().join("estop.sock")), 0o600, "socket");
    assert_eq!(mode(&d.data().join("ledger")), 0o700, "ledger dir");
    for f in ["tokens", "operator.token", "agent.token"] {
        assert_eq!(mode(&d.data().join(f)), 0o600, "{f}");
    }
    let mut seen = 0;
    for f in std::fs::read_dir(d.data().join("ledger")).unwrap() {
        let p = f.unwrap().path();
        assert_eq!(mode(&p), 0o600, "{}", p.display());
        seen += 1;
    }
    assert!(seen >= 3, "segments, a snapshot and the lock");
    // Files an older version left world-readable are made private at start.
    let seg = std::fs::read_dir(d.data().join("ledger"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "log"))
        .unwrap();
    assert_eq!(d.terminate(), Some(0));
    std::fs::set_permissions(&seg, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::set_permissions(d.data(), std::fs::Permissions::from_mode(0o755)).unwrap();
    d.spawn();
    assert_eq!(mode(&seg), 0o600);
    assert_eq!(mode(d.data()), 0o700);
    // A data dir whose mode cannot be set (procfs refuses chmod, even to root) stops the start
    // with a clear error instead of running with whatever mode it has.
    let (code, err) = serve_refuses(std::path::Path::new("/proc/self/fdinfo"), &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("private") && err.contains("chmod"), "{err}");
}

/// What a hostile agent writes into every free-text field it has.
const FORGED: &str = "x\n\u{1b}[32m      99 1700000000000 decide   r k FORGED principal=admin\u{1b}[0m\u{202e}\u{200b}\u{9b}\u{7f}";

/// Characters that must never reach the operator's terminal raw.
fn raw_hostile(s: &str) -> Option<char> {
    s.chars().find(|c| {
        matches!(*c, '\u{0}'..='\u{8}' | '\u{b}'..='\u{1f}' | '\u{7f}'..='\u{9f}'
            | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200b}'..='\u{200f}'
            | '\u{2060}' | '\u{feff}' | '\u{61c}')
    })
}

/// The hostile text is on screen whole, or cut short (`runs` truncates long reasons).
fn assert_shown_escaped(what: &str, out: &str) {
    assert_shown_escaped_as(what, out, true)
}

fn assert_shown_escaped_as(what: &str, out: &str, whole: bool) {
    if let Some(c) = raw_hostile(out) {
        panic!("{what}: raw {c:?} in\n{out}");
    }
    for line in out.lines() {
        let t = line.trim_start();
        assert!(
            !t.starts_with("[32m") && !t.starts_with("99 1700000000000"),
            "{what}: a forged line: {line}"
        );
    }
    if !whole {
        assert!(
            out.contains("x\\n\\u{1b}[32m"),
            "{what} does not show the text:\n{out}"
        );
        return;
    }
    assert!(
        out.contains("FORGED"),
        "{what} does not show the text at all:\n{out}"
    );
    for line in out.lines().filter(|l| l.contains("FORGED")) {
        assert!(
            line.contains("\\n"),
            "{what}: the newline is not escaped: {line}"
        );
        // `\u{1b}` as the terminal escaper writes it, or `\u001b` inside recorded JSON
        // arguments (`ledger show`'s `args=`), which JSON itself escapes.
        assert!(
            line.contains("\\u{1b}") || line.contains("\\u001b"),
            "{what}: ESC is not escaped: {line}"
        );
        assert!(
            line.contains("\\u{202e}"),
            "{what}: bidi is not escaped: {line}"
        );
    }
}

#[test]
fn agent_text_is_shown_escaped_in_every_cli_table() {
    let d = Daemon::start();
    let mut a = d.agent();
    // Held with hostile args (the inbox shows them), completed with a hostile error, cancelled
    // with a hostile reason.
    // (The inbox shows the first 60 characters of the args: the hostile ones come first.)
    let args = json!({"n": "\u{202e}\u{200b}\n\u{1b}[32mFORGED"});
    assert_eq!(verdict(&admit(&mut a, "r", "held", "refund", args)), "held");
    let go = admit(&mut a, "r2", "k", "pay", json!({}));
    let token = go["token"].as_str().map(str::to_string);
    let mut req =
        json!({"op": "complete", "run": "r2", "key": "k", "outcome": "error", "error": FORGED});
    if let Some(t) = token {
        req["token"] = json!(t);
    }
    let _ = a.call(req).unwrap();
    ok(
        &mut a,
        json!({"op": "cancel", "run": "r2", "reason": FORGED}),
    );

    let (code, out, err) = d.cli(&["ledger", "show"]);
    assert_eq!(code, 0, "{err}");
    assert_shown_escaped("ledger show", &out);
    let (code, out, err) = d.cli(&["report", "r2"]);
    assert_eq!(code, 0, "{err}");
    assert_shown_escaped("report", &out);
    let (code, out, err) = d.cli(&["runs"]);
    assert_eq!(code, 0, "{err}");
    assert_shown_escaped_as("runs", &out, false);
    let (code, out, err) = d.cli(&["status", "r2"]);
    assert_eq!(code, 0, "{err}");
    assert_shown_escaped("status", &out);
    let (code, out, err) = d.cli(&["pending"]);
    assert_eq!(code, 0, "{err}");
    assert!(raw_hostile(&out).is_none(), "pending: {out}");
    assert!(
        out.contains("\\u{202e}") || out.contains("\\u202e"),
        "pending: {out}"
    );
    // --json stays exact JSON: the text round-trips unchanged.
    let (_, out, _) = d.cli(&["status", "r2", "--json"]);
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["reason"], FORGED);
    // Error messages that quote agent text are escaped too.
    let (_, _, err) = d.cli(&["status", "no\u{202e}such"]);
    assert!(raw_hostile(&err).is_none(), "{err}");
}

#[test]
fn ids_with_control_bidi_or_zero_width_characters_are_refused_at_the_edge() {
    let d = Daemon::start();
    let mut a = d.agent();
    for (run, key, tool) in [
        ("r\u{202e}1", "k", "pay"),
        ("r", "k\u{200b}", "pay"),
        ("r", "k", "pa\u{2066}y"),
        ("r\u{feff}", "k", "pay"),
        ("r\u{61c}", "k", "pay"),
        ("r\u{200e}", "k", "pay"),
    ] {
        let req = json!({"op": "admit", "run": run, "key": key, "tool": tool, "args": {}});
        assert_eq!(err_code(&mut a, req.clone()), "invalid_field", "{req}");
    }
    let req = json!({"op": "admit", "run": "r", "key": "k", "tool": "pay", "args": {},
        "labels": {"te\u{202e}am": "x"}});
    assert_eq!(err_code(&mut a, req), "invalid_field");
    // Free text keeps every character (shown escaped, stored exactly).
    let req = json!({"op": "admit", "run": "r", "key": "k", "tool": "pay", "args": {},
        "labels": {"team": "a\u{202e}b"}});
    ok(&mut a, req);
    let mut op = d.operator();
    assert_eq!(
        ok(&mut op, json!({"op": "status", "run": "r"}))["labels"]["team"],
        "a\u{202e}b"
    );
    // Nothing of the refused requests was recorded.
    let runs = ok(&mut op, json!({"op": "runs"}));
    assert_eq!(runs["runs"].as_array().unwrap().len(), 1, "{runs}");
}
