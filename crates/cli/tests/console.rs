//! The console's HTTP API against a real `estop serve`: authentication and roles, operator verbs
//! with the same semantics and durability as protocol v1, server-sent events, login links,
//! sessions and CSRF, and `/metrics`. A tiny HTTP/1.1 client over std keeps the test free of an
//! HTTP stack.

mod common;

use common::*;
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Resp {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn code(&self) -> String {
        self.json()["error"]["code"]
            .as_str()
            .unwrap_or("")
            .to_string()
    }
}

/// One request, `Connection: close`, the whole response read back.
fn http(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Resp {
    let mut s = TcpStream::connect(addr).unwrap();
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
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Resp {
        status,
        headers,
        body: body.to_string(),
    }
}

struct Console {
    d: Daemon,
    addr: String,
    op: String,
}

impl Console {
    fn start() -> Console {
        Console::start_with_policy(POLICY)
    }

    fn start_with_policy(policy: &str) -> Console {
        let d = Daemon::start_with_policy(policy, &["--console", "127.0.0.1:0"]);
        let addr = d.ready_field("console");
        assert!(addr.starts_with("127.0.0.1:"), "{}", d.ready);
        let op = format!("Bearer {}", d.token("operator.token"));
        Console { d, addr, op }
    }

    fn get(&self, path: &str) -> Resp {
        http(&self.addr, "GET", path, &[("Authorization", &self.op)], "")
    }

    fn post(&self, path: &str, body: Value) -> Resp {
        http(
            &self.addr,
            "POST",
            path,
            &[("Authorization", &self.op)],
            &body.to_string(),
        )
    }

    fn as_token(&self, token: &str, method: &str, path: &str) -> Resp {
        http(
            &self.addr,
            method,
            path,
            &[("Authorization", &format!("Bearer {token}"))],
            "",
        )
    }
}

#[test]
fn the_ready_line_names_the_console_and_off_turns_it_off() {
    let c = Console::start();
    assert_eq!(c.get("/api/v1/runs").status, 200);
    let off = Daemon::start_with(&["--console", "off"]);
    assert!(!off.ready.contains("console="), "{}", off.ready);
}

#[test]
fn an_address_that_is_asked_for_and_taken_stops_the_daemon_with_a_clear_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(bin())
        .args(["serve", "--console", &addr, "--data"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot listen for the console"), "{err}");
}

#[test]
fn no_token_is_unauthenticated_and_agents_only_read_their_own_runs() {
    let c = Console::start();
    let r = http(&c.addr, "GET", "/api/v1/runs", &[], "");
    assert_eq!(r.status, 401);
    assert_eq!(r.code(), "unauthenticated");
    assert_eq!(r.header("cache-control"), Some("no-store"));
    assert_eq!(c.as_token("nope", "GET", "/api/v1/runs").status, 401);

    let mut a = c.d.agent();
    admit(&mut a, "mine", "k1", "pay", json!({"n": 1}));
    let made = c.post(
        "/api/v1/tokens",
        json!({"name": "other", "role": "agent", "groups": []}),
    );
    assert_eq!(made.status, 200, "{}", made.body);
    let other = made.json()["token"].as_str().unwrap().to_string();
    let mut b = c.d.client_with(&other);
    admit(&mut b, "theirs", "k1", "refund", json!({"n": 2}));

    let agent = c.d.token("agent.token");
    let runs = c.as_token(&agent, "GET", "/api/v1/runs").json();
    let ids: Vec<&str> = runs["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["run"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["mine"]);
    // Another agent's run looks like no run at all.
    let r = c.as_token(&agent, "GET", "/api/v1/runs/theirs");
    assert_eq!((r.status, r.code().as_str()), (404, "not_found"));
    let r = c.as_token(&agent, "GET", "/api/v1/runs/theirs/report");
    assert_eq!(r.status, 404);
    assert_eq!(
        c.as_token(&agent, "GET", "/api/v1/runs/mine/report").status,
        200
    );
    let pending = c.as_token(&other, "GET", "/api/v1/pending").json();
    assert_eq!(pending["pending"].as_array().unwrap().len(), 1);
    assert_eq!(
        c.as_token(&agent, "GET", "/api/v1/pending").json()["pending"],
        json!([])
    );
    // Reads only: an agent cannot decide, stop, read the raw ledger or see metrics over HTTP.
    for (method, path) in [
        ("POST", "/api/v1/runs/mine/cancel"),
        ("POST", "/api/v1/runs/theirs/effects/k1/approve"),
        // Nor move the reverse saga of its own run.
        ("POST", "/api/v1/runs/mine/effects/k1/settle"),
        ("POST", "/api/v1/runs/mine/effects/k1/retry"),
        ("POST", "/api/v1/runs/mine/effects/k1/skip"),
        ("POST", "/api/v1/runs/mine/effects/k1/compensate"),
        ("GET", "/api/v1/runs/mine/ledger"),
        ("GET", "/metrics"),
        ("POST", "/api/v1/login-links"),
    ] {
        let r = c.as_token(&agent, method, path);
        assert_eq!(r.status, 403, "{method} {path}: {}", r.body);
    }
}

#[test]
fn approve_and_reject_over_http_answer_the_agents_wait() {
    let c = Console::start();
    let mut a = c.d.agent();
    let held = admit(&mut a, "r1", "refund-1", "refund", json!({"amount": 250}));
    assert_eq!(verdict(&held), "held");
    let pending = c.get("/api/v1/pending").json();
    let item = &pending["pending"][0];
    assert_eq!(item["tool"], "refund");
    assert_eq!(item["args"], json!({"amount": 250}));
    assert_eq!(item["digest"].as_str().unwrap().len(), 64);
    assert_eq!(item["quorum"], 1);
    assert!(item["rule"].is_string());

    let sock = c.d.socket();
    let agent_token = c.d.token("agent.token");
    let waiter = std::thread::spawn(move || {
        let mut w = estop_server::client::Client::connect_as(&sock, &agent_token).unwrap();
        ok(
            &mut w,
            json!({"op": "wait", "run": "r1", "key": "refund-1", "timeout_ms": 20000}),
        )
    });
    let r = c.post(
        "/api/v1/runs/r1/effects/refund-1/decide",
        json!({"decision": "approve", "reason": "checked"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["status"], "approved");
    assert_eq!(r.json()["approvals"], json!(["admin"]));
    assert_eq!(verdict(&waiter.join().unwrap()), "admitted");
    // Deciding what is no longer pending writes nothing: 409 not_pending, as in v1.
    let again = c.post("/api/v1/runs/r1/effects/refund-1/approve", json!({}));
    assert_eq!((again.status, again.code().as_str()), (409, "not_pending"));

    admit(&mut a, "r1", "refund-2", "refund", json!({"amount": 9999}));
    let r = c.post(
        "/api/v1/runs/r1/effects/refund-2/reject",
        json!({"reason": "too much"}),
    );
    assert_eq!(r.json()["status"], "rejected");
    let w = ok(
        &mut a,
        json!({"op": "wait", "run": "r1", "key": "refund-2", "timeout_ms": 1000}),
    );
    assert_eq!(
        (verdict(&w), w["reason"].as_str()),
        ("refused", Some("rejected"))
    );
    // The same checks as v1: a bad decision, an unknown run, a body that is not an object.
    let bad = c.post(
        "/api/v1/runs/r1/effects/refund-1/decide",
        json!({"decision": "maybe"}),
    );
    assert_eq!((bad.status, bad.code().as_str()), (400, "invalid_field"));
    assert_eq!(
        c.post("/api/v1/runs/nope/effects/k/approve", json!({}))
            .status,
        404
    );
    // The saga's operator actions go the same way: checked as v1 `saga`, then the kernel.
    let skip = c.post("/api/v1/runs/r1/effects/refund-1/skip", json!({}));
    assert_eq!((skip.status, skip.code().as_str()), (400, "missing_field"));
    let settle = c.post(
        "/api/v1/runs/r1/effects/refund-1/settle",
        json!({"outcome": "ok"}),
    );
    assert_eq!((settle.status, settle.code().as_str()), (409, "conflict"));
    // A result says it happened: only with `ok`.
    let settle = c.post(
        "/api/v1/runs/r1/effects/refund-1/settle",
        json!({"outcome": "error", "result": {"id": 1}}),
    );
    assert_eq!(
        (settle.status, settle.code().as_str()),
        (400, "invalid_field")
    );
    // Compensating one effect is for a stopped run's effect that names its undo.
    let one = c.post("/api/v1/runs/r1/effects/refund-1/compensate", json!({}));
    assert_eq!((one.status, one.code().as_str()), (409, "conflict"));
    let undo = c.post("/api/v1/runs/r1/effects/refund-1/undo", json!({}));
    assert_eq!((undo.status, undo.code().as_str()), (404, "unknown_op"));
    let r = http(
        &c.addr,
        "POST",
        "/api/v1/runs/r1/pause",
        &[("Authorization", &c.op)],
        "[1]",
    );
    assert_eq!((r.status, r.code().as_str()), (400, "bad_json"));
    // The ledger shows both decisions with their reasons and the approver.
    let l = c.get("/api/v1/runs/r1/ledger").json();
    let decides: Vec<&Value> = l["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "decide")
        .collect();
    assert_eq!(decides.len(), 2);
    assert_eq!(decides[0]["reason"], "checked");
    assert_eq!(decides[0]["principal"], "admin");
}

#[test]
fn a_cancel_acknowledged_over_http_survives_kill_9_and_the_report_tells_the_truth() {
    let mut c = Console::start();
    let mut a = c.d.agent();
    let done = admit(&mut a, "job", "pay-1", "pay", json!({"n": 1}));
    ok(
        &mut a,
        json!({"op": "complete", "run": "job", "key": "pay-1", "token": done["token"], "outcome": "ok"}),
    );
    admit(&mut a, "job", "pay-2", "pay", json!({"n": 2}));
    let r = c.post(
        "/api/v1/runs/job/cancel",
        json!({"reason": "stop now", "cascade": false}),
    );
    assert_eq!((r.status, r.code().as_str()), (400, "invalid_field"));
    let r = c.post("/api/v1/runs/job/cancel", json!({"reason": "stop now"}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["runs"], json!(["job"]));
    // Durable before visible: the 200 above means the fence is on disk.
    c.d.restart();
    c.addr = c.d.ready_field("console");
    let s = c.get("/api/v1/runs/job").json();
    assert_eq!(s["cause"], "cancelled");
    let rep = c.get("/api/v1/runs/job/report").json();
    assert_eq!(rep["done"][0]["key"], "pay-1");
    assert_eq!(rep["in_flight"][0]["key"], "pay-2");
    let mut a = c.d.agent();
    let late = admit(&mut a, "job", "pay-3", "pay", json!({"n": 4}));
    assert_eq!(
        (verdict(&late), late["reason"].as_str()),
        ("refused", Some("cancelled"))
    );
    // Pause, resume, kill and close answer like v1 (state after the request).
    let k = admit(&mut a, "other", "k", "pay", json!({}));
    ok(
        &mut a,
        json!({"op": "complete", "run": "other", "key": "k", "token": k["token"], "outcome": "ok"}),
    );
    assert_eq!(
        c.post("/api/v1/runs/other/pause", json!({})).json()["state"],
        "paused"
    );
    assert_eq!(
        c.post("/api/v1/runs/other/resume", json!({})).json()["state"],
        "active"
    );
    assert_eq!(
        c.post("/api/v1/runs/other/close", json!({})).json()["state"],
        "completed"
    );
    let filtered = c.get("/api/v1/runs?state=completed").json();
    assert_eq!(filtered["runs"].as_array().unwrap().len(), 1);
    let r = c.get("/api/v1/runs?limit=x");
    assert_eq!((r.status, r.code().as_str()), (400, "invalid_field"));
    assert_eq!(c.post("/api/v1/runs/other/explode", json!({})).status, 404);
}

/// Reads server-sent events until `want` appears in a data line, or panics after 20 s.
fn read_events_until(addr: &str, auth: &str, path: &str, want: &str, act: impl FnOnce()) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: {auth}\r\nAccept: text/event-stream\r\n\r\n"
    )
    .unwrap();
    let mut r = BufReader::new(s);
    let mut seen = String::new();
    let mut act = Some(act);
    loop {
        let mut line = String::new();
        let n = r.read_line(&mut line).expect("an event within 20 s");
        assert!(n > 0, "the stream ended; saw:\n{seen}");
        seen.push_str(&line);
        if line.starts_with("event: ready")
            && let Some(f) = act.take()
        {
            f();
        }
        if line.starts_with("data: ") && line.contains(want) {
            return seen;
        }
    }
}

#[test]
fn server_sent_events_report_changes_once_durable_and_agents_see_only_their_own() {
    let c = Console::start();
    let sock = c.d.socket();
    let agent = c.d.token("agent.token");
    let seen = read_events_until(
        &c.addr,
        &c.op,
        "/api/v1/events",
        "\"event\":\"held\"",
        || {
            let mut a = estop_server::client::Client::connect_as(&sock, &agent).unwrap();
            admit(&mut a, "live", "k", "refund", json!({}));
        },
    );
    assert!(seen.contains("\"run\":\"live\""), "{seen}");
    assert!(seen.contains("\"key\":\"k\""), "{seen}");

    // An agent's feed carries its own runs only: another agent's hold never shows, its own does.
    let made = c.post("/api/v1/tokens", json!({"name": "b", "role": "agent"}));
    let other = made.json()["token"].as_str().unwrap().to_string();
    let sock = c.d.socket();
    let agent = c.d.token("agent.token");
    let seen = read_events_until(
        &c.addr,
        &format!("Bearer {agent}"),
        "/api/v1/events",
        "\"run\":\"mine-2\"",
        || {
            let mut b = estop_server::client::Client::connect_as(&sock, &other).unwrap();
            admit(&mut b, "secret-run", "k", "refund", json!({}));
            let mut a = estop_server::client::Client::connect_as(&sock, &agent).unwrap();
            admit(&mut a, "mine-2", "k", "refund", json!({}));
        },
    );
    assert!(!seen.contains("secret-run"), "{seen}");
}

#[test]
fn login_links_work_once_and_sessions_need_the_csrf_token_to_change_state() {
    let c = Console::start();
    let link = c.post("/api/v1/login-links", json!({})).json();
    let url = link["url"].as_str().unwrap();
    let code = &url[url.find("/login#code=").unwrap() + "/login#code=".len()..];
    // The link opens the page; its script posts the code from the console's own origin.
    let page = http(&c.addr, "GET", "/login", &[], "");
    assert_eq!(page.status, 200);
    assert!(page.header("set-cookie").is_none(), "no cookie");
    let origin = format!("http://{}", c.addr);
    let from_page = [("Origin", origin.as_str())];
    let body = json!({"code": code}).to_string();
    let r = http(&c.addr, "POST", "/api/v1/session", &from_page, &body);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.header("set-cookie").is_none(), "no cookie");
    let login = r.json();
    let secret = login["session"].as_str().unwrap().to_string();
    let csrf = login["csrf"].as_str().unwrap().to_string();
    assert_eq!(
        http(&c.addr, "POST", "/api/v1/session", &from_page, &body).status,
        401,
        "one-time"
    );

    let session = [
        ("X-Estop-Session", secret.as_str()),
        ("Sec-Fetch-Site", "same-origin"),
    ];
    let me = http(&c.addr, "GET", "/api/v1/session", &session, "").json();
    assert_eq!(me["principal"], "admin");
    assert!(me.get("csrf").is_none(), "no secret in whoami: {me}");
    let mut a = c.d.agent();
    admit(&mut a, "s", "k", "pay", json!({}));
    let pause =
        |headers: &[(&str, &str)]| http(&c.addr, "POST", "/api/v1/runs/s/pause", headers, "{}");
    let with = |more: &[(&'static str, &str)]| {
        let mut h: Vec<(&str, String)> = session.iter().map(|(k, v)| (*k, v.to_string())).collect();
        h.extend(more.iter().map(|(k, v)| (*k, v.to_string())));
        h
    };
    let send = |h: Vec<(&str, String)>| {
        let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
        pause(&h).status
    };
    assert_eq!(send(with(&[])), 403, "no CSRF token");
    assert_eq!(send(with(&[("X-CSRF-Token", "wrong")])), 403);
    let cross = with(&[("X-CSRF-Token", &csrf), ("Origin", "http://evil.example")]);
    assert_eq!(send(cross), 403, "cross-origin");
    assert_eq!(send(with(&[("X-CSRF-Token", &csrf)])), 200);
    // Logging out ends the session.
    let out = with(&[("X-CSRF-Token", &csrf)]);
    let out: Vec<(&str, &str)> = out.iter().map(|(k, v)| (*k, v.as_str())).collect();
    assert_eq!(
        http(&c.addr, "DELETE", "/api/v1/session", &out, "").status,
        200
    );
    let r = http(&c.addr, "GET", "/api/v1/runs", &session, "");
    assert_eq!(r.status, 401);
    // A pasted token makes a session too; a wrong one does not.
    let bad = http(
        &c.addr,
        "POST",
        "/api/v1/session",
        &from_page,
        r#"{"token":"nope"}"#,
    );
    assert_eq!(bad.status, 401);
    let body = json!({"token": c.d.token("operator.token")}).to_string();
    let good = http(&c.addr, "POST", "/api/v1/session", &from_page, &body);
    assert_eq!(good.status, 200);
    assert!(good.json()["session"].is_string());
    // The daemon's log never holds a secret.
    let log = std::fs::read_to_string(c.d.data().join("serve.log")).unwrap();
    assert!(!log.contains(&csrf));
    assert!(!log.contains(&secret));
    assert!(!log.contains(&c.d.token("operator.token")));
    assert!(!log.contains(code));
}

#[test]
fn the_ui_is_served_with_a_strict_content_security_policy() {
    let c = Console::start();
    let r = http(&c.addr, "GET", "/", &[], "");
    assert_eq!(r.status, 200);
    assert!(r.body.contains("<script src=\"/app.js\""));
    assert!(
        r.header("content-security-policy")
            .unwrap()
            .contains("script-src 'self'")
    );
    assert_eq!(r.header("x-frame-options"), Some("DENY"));
    assert!(
        http(&c.addr, "GET", "/app.js", &[], "")
            .body
            .contains("textContent")
    );
    let spec = http(&c.addr, "GET", "/api/v1/openapi.yaml", &[], "");
    assert!(
        spec.body.starts_with("openapi: 3"),
        "{}",
        &spec.body[..spec.body.len().min(80)]
    );
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no series {series} in:\n{text}"))
}

#[test]
fn metrics_count_admissions_decisions_runs_fsyncs_and_connections() {
    let c = Console::start();
    let mut a = c.d.agent();
    admit(&mut a, "m1", "a", "pay", json!({}));
    admit(&mut a, "m1", "b", "refund", json!({}));
    admit(&mut a, "m2", "c", "drop_table", json!({}));
    c.post("/api/v1/runs/m1/effects/b/approve", json!({}));
    c.post("/api/v1/runs/m2/cancel", json!({}));
    let r = c.get("/metrics");
    assert_eq!(r.status, 200);
    assert!(
        r.header("content-type")
            .unwrap()
            .starts_with("text/plain; version=0.0.4")
    );
    let m = r.body;
    assert_eq!(
        metric(
            &m,
            r#"estop_admissions_total{verdict="admitted",reason=""}"#
        ),
        1.0
    );
    assert_eq!(
        metric(
            &m,
            r#"estop_admissions_total{verdict="held",reason="approval"}"#
        ),
        1.0
    );
    assert_eq!(
        metric(
            &m,
            r#"estop_admissions_total{verdict="refused",reason="denied"}"#
        ),
        1.0
    );
    assert_eq!(
        metric(
            &m,
            r#"estop_approval_decision_seconds_count{decision="approved"}"#
        ),
        1.0
    );
    assert_eq!(metric(&m, "estop_approvals_pending"), 0.0);
    // Approved and not yet consumed by the agent's `wait`: still held.
    assert_eq!(metric(&m, "estop_effects_held"), 1.0);
    assert_eq!(metric(&m, "estop_tombstones"), 0.0);
    assert_eq!(metric(&m, r#"estop_runs{state="active"}"#), 1.0);
    assert_eq!(metric(&m, r#"estop_runs{state="cancelled"}"#), 1.0);
    assert!(metric(&m, "estop_ledger_fsync_seconds_count") >= 1.0);
    assert!(metric(&m, "estop_ledger_batch_records_sum") >= 4.0);
    assert!(metric(&m, r#"estop_ledger_batch_records_bucket{le="+Inf"}"#) >= 1.0);
    assert!(metric(&m, r#"estop_connections{listener="protocol"}"#) >= 1.0);
    assert!(metric(&m, r#"estop_connections{listener="console"}"#) >= 1.0);
}

/// Hostile, through the console's API: a compensating call a quorum-2 rule holds is in the
/// inbox as the undo of its effect; the one operator's approve, second approve and retry, and
/// an agent's approve, do not send it; a second operator's approve does.
#[test]
fn one_operator_cannot_approve_a_quorum_2_compensation_through_the_console() {
    let c = Console::start_with_policy(
        r#"
[[rules]]
tool = "refund"
action = "allow"
compensate = "unrefund"

[[rules]]
tool = "unrefund"
action = "approve"
quorum = 2
"#,
    );
    let (code, secret, err) = c.d.cli(&["token", "create", "bob", "--role", "operator"]);
    assert_eq!(code, 0, "{err}");
    let bob = secret.trim().to_string();
    let mut a = c.d.agent();
    let v = admit(&mut a, "r1", "k1", "refund", json!({"amount": 5}));
    ok(
        &mut a,
        json!({"op": "complete", "run": "r1", "key": "k1", "token": v["token"], "outcome": "ok"}),
    );
    let mut ex = c.d.agent();
    ok(&mut ex, json!({"op": "compensations"}));
    assert_eq!(c.post("/api/v1/runs/r1/cancel", json!({})).status, 200);
    let inbox = c.get("/api/v1/pending").json();
    let item = &inbox["pending"][0];
    assert_eq!(
        (&item["approval"], &item["tool"], &item["compensates"]),
        (&json!("r1#1"), &json!("unrefund"), &json!("refund")),
        "{inbox}"
    );
    let metrics = c.get("/metrics").body;
    assert_eq!(
        metric(&metrics, "estop_approvals_pending"),
        1.0,
        "{metrics}"
    );
    let approve = "/api/v1/runs/r1/effects/k1/approve";
    let r = c.post(approve, json!({}));
    assert_eq!(
        (r.status, &r.json()["status"]),
        (200, &json!("held")),
        "{}",
        r.body
    );
    let r = c.post(approve, json!({}));
    assert_eq!(
        (r.status, r.code().as_str()),
        (409, "conflict"),
        "{}",
        r.body
    );
    let r = c.post("/api/v1/runs/r1/effects/k1/retry", json!({}));
    assert_eq!(
        (r.status, r.code().as_str()),
        (409, "conflict"),
        "{}",
        r.body
    );
    assert!(r.body.contains("r1#1"), "{}", r.body);
    let agent = c.d.token("agent.token");
    assert_eq!(c.as_token(&agent, "POST", approve).status, 403);
    ok(&mut ex, json!({"op": "ping"}));
    assert!(
        ex.events.is_empty(),
        "sent on one operator's word: {:?}",
        ex.events
    );
    let r = c.as_token(&bob, "POST", approve);
    assert_eq!(
        (r.status, &r.json()["status"]),
        (200, &json!("approved")),
        "{}",
        r.body
    );
    let e = loop {
        let ev = ex.next_event().unwrap().expect("an event");
        if ev.event == estop_protocol::EventKind::Compensate {
            break ev;
        }
    };
    assert_eq!((e.key.as_deref(), e.attempt), (Some("k1"), Some(1)));
    let metrics = c.get("/metrics").body;
    assert_eq!(
        metric(&metrics, "estop_approvals_pending"),
        0.0,
        "{metrics}"
    );
}

/// An executor's token (`role = "executor"`) runs compensations over the protocol socket and
/// reads nothing over HTTP either: no verb, no metrics, no event stream.
#[test]
fn an_executor_token_reads_nothing_over_http() {
    let c = Console::start();
    let made = c.post(
        "/api/v1/tokens",
        json!({"name": "undoer", "role": "executor", "groups": []}),
    );
    assert_eq!(made.status, 200, "{}", made.body);
    let token = made.json()["token"].as_str().unwrap().to_string();
    let mut a = c.d.agent();
    admit(&mut a, "mine", "k1", "pay", json!({"n": 1}));
    for (method, path) in [
        ("GET", "/api/v1/runs"),
        ("GET", "/api/v1/runs/mine"),
        ("GET", "/api/v1/runs/mine/report"),
        ("GET", "/api/v1/pending"),
        ("GET", "/metrics"),
        ("GET", "/api/v1/events"),
        ("POST", "/api/v1/runs/mine/cancel"),
    ] {
        let r = c.as_token(&token, method, path);
        assert_eq!(r.status, 403, "{method} {path}: {}", r.body);
    }
}

/// A harness journal in the daemon's data directory, as `estop agent run` leaves it: a live
/// trajectory with a held call and a stored interrupt, two ended ones. The writer stays open
/// (its lock held) while the console reads.
fn harness_journal(d: &Daemon) -> estop_harness::journal::Journal {
    use estop_harness::budget::{Budget, Limits, Prices};
    use estop_harness::chat::{Message, ToolCall};
    use estop_harness::journal::{Entry, Journal};
    use estop_harness::machine::State;
    use estop_harness::record::{CallLimits, Control, Exit, Grants, HeldCall, Identity, Record};
    let rec = |id: &str, state: State| {
        let mut r = Record::new(
            Identity {
                id: id.into(),
                parent: Some("boss".into()),
                tenant: "default".into(),
                task: format!("<i>task</i> of {id}"),
                ..Identity::default()
            },
            CallLimits {
                model: "m".into(),
                max_output_tokens: 100,
                call_deadline_ms: 1_000,
                tool_deadline_ms: 500,
                retry: Default::default(),
            },
            Budget::new(
                Limits {
                    turns_max: Some(5),
                    ..Limits::default()
                },
                Prices::default(),
                1,
            ),
            Grants {
                tools: Vec::new(),
                restricted: false,
            },
            "journal".into(),
        );
        r.state = state;
        r.turns = 4;
        r.budget.spend.turns = 4;
        if state.is_terminal() {
            r.exit = Some(Exit::Canceled {
                reason: "stop\u{202e}now".into(),
            });
            r.ended_at_ms = Some(2);
        }
        r
    };
    let (j, _) = Journal::open(&d.data().join("harness").join("journal")).unwrap();
    let mut a = rec("a", State::AwaitingApproval);
    a.held
        .push(HeldCall::new(ToolCall::new("c1", "drop_table", "{}"), 99));
    a.control.push(Control::Interrupt {
        message: "use the replica".into(),
    });
    a.identity.contract = Some(estop_harness::contract::Contract {
        must_call: vec!["lookup".into()],
        ..Default::default()
    });
    a.leases.push(estop_harness::record::Lease {
        id: "fetch@orders.internal".into(),
        kind: "credential".into(),
        tool: Some("fetch".into()),
    });
    let mut c = rec("c", State::Failed);
    c.exit = Some(Exit::CompletionCheckFailed {
        failed: vec!["must_call".into()],
    });
    c.check = Some(estop_harness::contract::CheckResult {
        passed: false,
        checked: vec!["answer_nonempty".into(), "must_call".into()],
        failed: vec![estop_harness::contract::CheckFailure {
            check: "must_call".into(),
            why: "no call settled ok for [\"lookup\"]".into(),
        }],
        notices: 1,
    });
    let entries = [
        Entry::Context {
            trajectory: "b".into(),
            message: Message::text(estop_harness::chat::Role::Assistant, "done <b>here</b>"),
        },
        Entry::Record {
            record: Box::new(a),
        },
        Entry::Record {
            record: Box::new(rec("b", State::Canceled)),
        },
        Entry::Record {
            record: Box::new(c),
        },
    ];
    j.write(&entries).unwrap();
    j
}

#[test]
fn trajectories_are_read_from_the_harness_journal_by_operators_and_observers_in_pages() {
    let c = Console::start();
    // No journal yet: an empty list, not an error.
    let r = c.get("/api/v1/trajectories");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["trajectories"], json!([]));
    let _writer = harness_journal(&c.d);

    let r = c.get("/api/v1/trajectories?limit=2");
    assert_eq!(r.status, 200, "{}", r.body);
    let page = r.json();
    let ids: Vec<&str> = page["trajectories"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["a", "b"]);
    assert_eq!(page["next"], "b");
    let rest = c.get("/api/v1/trajectories?after=b").json();
    assert_eq!(rest["trajectories"][0]["id"], "c");
    assert_eq!(rest["next"], Value::Null);
    let live = c.get("/api/v1/trajectories?state=live").json();
    assert_eq!(live["trajectories"].as_array().unwrap().len(), 1);

    let a = c.get("/api/v1/trajectories/a").json();
    assert_eq!(a["state"], "AWAITING_APPROVAL");
    assert_eq!(a["parent"], "boss");
    assert_eq!(a["task"], "<i>task</i> of a");
    assert_eq!(
        a["budget"]["dimensions"][0],
        json!({"dimension": "turns", "spent": 4, "limit": 5})
    );
    assert_eq!(a["budget"]["stage"], "steer");
    assert_eq!(a["budget"]["binding"], "turns");
    assert_eq!(a["held"][0]["tool"], "drop_table");
    assert_eq!(
        a["control"][0],
        json!({"control": "interrupt", "message": "use the replica"})
    );
    // The task contract, the credential handle (tool and host, no secret) and, for `c`, the
    // completion check that failed, naming the check.
    assert_eq!(a["contract"]["must_call"], json!(["lookup"]));
    assert_eq!(
        a["leases"],
        json!([{"kind": "credential", "id": "fetch@orders.internal", "tool": "fetch"}])
    );
    let cc = c.get("/api/v1/trajectories/c").json();
    assert_eq!(
        cc["exit"],
        json!({"exit": "COMPLETION_CHECK_FAILED", "reason": "must_call"})
    );
    assert_eq!(cc["check"]["failed"][0]["check"], "must_call");
    assert_eq!(cc["check"]["notices"], 1);
    let b = c.get("/api/v1/trajectories/b").json();
    assert_eq!(
        b["exit"],
        json!({"exit": "CANCELED", "reason": "stop\u{202e}now"})
    );
    assert_eq!(b["answer"], "done <b>here</b>");

    let missing = c.get("/api/v1/trajectories/nope");
    assert_eq!(
        (missing.status, missing.code().as_str()),
        (404, "not_found")
    );
    let bad = c.get("/api/v1/trajectories?state=dead");
    assert_eq!((bad.status, bad.code().as_str()), (400, "invalid_field"));
    let bad = c.get("/api/v1/trajectories?limit=0");
    assert_eq!(bad.status, 400);

    // Who: not an agent (a trajectory's task and answer are another agent's text), not without
    // a token; an observer reads, like runs.
    let agent = c.d.token("agent.token");
    let r = c.as_token(&agent, "GET", "/api/v1/trajectories");
    assert_eq!((r.status, r.code().as_str()), (403, "forbidden"));
    let r = c.as_token(&agent, "GET", "/api/v1/trajectories/a");
    assert_eq!(r.status, 403);
    assert_eq!(
        http(&c.addr, "GET", "/api/v1/trajectories", &[], "").status,
        401
    );
    let made = c.post(
        "/api/v1/tokens",
        json!({"name": "watcher", "role": "observer", "groups": []}),
    );
    assert_eq!(made.status, 200, "{}", made.body);
    let observer = made.json()["token"].as_str().unwrap().to_string();
    let r = c.as_token(&observer, "GET", "/api/v1/trajectories/a");
    assert_eq!(r.status, 200, "{}", r.body);
}

/// `estop agent list` reads the same journal from the terminal, beside its writer: one line per
/// trajectory, the agent's texts quoted and escaped (a bidi override never reaches the
/// terminal raw), in pages.
#[test]
fn estop_agent_list_prints_the_journal_s_trajectories_escaped() {
    let d = Daemon::start_with(&[]);
    let _writer = harness_journal(&d);
    let (code, out, err) = d.cli(&["agent", "list"]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert_eq!(
        lines[0],
        "a AWAITING_APPROVAL turns=4/5 stage=steer pending=0 held=1 control=1 parent=boss task=\"<i>task</i> of a\""
    );
    assert!(
        lines[1].starts_with("b CANCELED turns=4/5 stage=steer pending=0 held=0 control=0 exit=CANCELED:\"stop\\u{202e}now\""),
        "{}",
        lines[1]
    );
    assert!(!out.contains('\u{202e}'));
    let (_, out, _) = d.cli(&["agent", "list", "--state", "ended", "--limit", "1"]);
    assert_eq!(out.lines().last(), Some("(more: --after b)"), "{out}");
    let (code, _, err) = d.cli(&["agent", "list", "--state", "dead"]);
    assert_ne!(code, 0);
    assert!(err.contains("use all, live or ended"), "{err}");
    let (code, out, _) = d.cli(&["agent", "list", "--json", "--after", "b"]);
    assert_eq!(code, 0);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["trajectories"][0]["id"], "c");
}

/// A browser session of `token`'s principal, logged in from the console's page: its secret and
/// CSRF token.
fn session_of(c: &Console, token: &str) -> (String, String) {
    let origin = format!("http://{}", c.addr);
    let body = json!({ "token": token }).to_string();
    let r = http(
        &c.addr,
        "POST",
        "/api/v1/session",
        &[("Origin", &origin)],
        &body,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    (
        v["session"].as_str().unwrap().to_string(),
        v["csrf"].as_str().unwrap().to_string(),
    )
}

/// A POST from the console's own page in a session: its secret, the CSRF token (unless
/// `csrf` is empty) and `site` (`Some` as Sec-Fetch-Site).
fn session_post(
    c: &Console,
    (secret, csrf): (&str, &str),
    site: Option<&str>,
    origin: Option<&str>,
    path: &str,
    body: &str,
) -> Resp {
    let mut h = vec![("X-Estop-Session", secret)];
    if !csrf.is_empty() {
        h.push(("X-CSRF-Token", csrf));
    }
    if let Some(s) = site {
        h.push(("Sec-Fetch-Site", s));
    }
    if let Some(o) = origin {
        h.push(("Origin", o));
    }
    http(&c.addr, "POST", path, &h, body)
}

/// Every action on a trajectory, with a body it would take.
const TRAJECTORY_ACTIONS: &[(&str, &str)] = &[
    ("cancel", r#"{"reason": "enough"}"#),
    ("pause", "{}"),
    ("resume", "{}"),
    ("kill", r#"{"reason": "now"}"#),
    ("interrupt", r#"{"message": "use the replica"}"#),
    ("budget", r#"{"turns": 3}"#),
];

/// Acting on a trajectory is an operator's, from the console's own page: an observer's and an
/// agent's session (and their bearer tokens) are forbidden every action; an operator's session
/// without its CSRF token, from another origin or from no page at all is refused, exactly as a
/// run action is. Bad input is refused before the runner is asked, and with no runner the
/// runner's actions are `unavailable`.
#[test]
fn trajectory_actions_are_an_operators_from_the_console_s_own_page() {
    let c = Console::start();
    let made = c.post(
        "/api/v1/tokens",
        json!({"name": "watcher", "role": "observer", "groups": []}),
    );
    assert_eq!(made.status, 200, "{}", made.body);
    let observer = made.json()["token"].as_str().unwrap().to_string();
    let agent = c.d.token("agent.token");
    for token in [&observer, &agent] {
        let (secret, csrf) = session_of(&c, token);
        for (action, body) in TRAJECTORY_ACTIONS {
            let path = format!("/api/v1/trajectories/t-1/{action}");
            let r = session_post(&c, (&secret, &csrf), Some("same-origin"), None, &path, body);
            assert_eq!(
                (r.status, r.code().as_str()),
                (403, "forbidden"),
                "{action}: {}",
                r.body
            );
            let r = http(
                &c.addr,
                "POST",
                &path,
                &[("Authorization", &format!("Bearer {token}"))],
                body,
            );
            assert_eq!(r.status, 403, "{action} with a bearer token: {}", r.body);
        }
    }
    let op = session_of(&c, &c.d.token("operator.token"));
    let origin = format!("http://{}", c.addr);
    for (action, body) in TRAJECTORY_ACTIONS {
        let path = format!("/api/v1/trajectories/t-1/{action}");
        let no_csrf = session_post(&c, (&op.0, ""), Some("same-origin"), None, &path, body);
        assert_eq!(no_csrf.status, 403, "{action} without the CSRF token");
        let wrong = session_post(&c, (&op.0, "0"), Some("same-origin"), None, &path, body);
        assert_eq!(wrong.status, 403, "{action} with a wrong CSRF token");
        let cross = session_post(
            &c,
            (&op.0, &op.1),
            None,
            Some("http://evil.example"),
            &path,
            body,
        );
        assert_eq!(cross.status, 403, "{action} from another origin");
        let cross = session_post(&c, (&op.0, &op.1), Some("same-site"), None, &path, body);
        assert_eq!(cross.status, 403, "{action} from another port");
        let nowhere = session_post(&c, (&op.0, &op.1), None, None, &path, body);
        assert_eq!(nowhere.status, 403, "{action} from no page");
    }
    let post = |action: &str, body: &str| {
        session_post(
            &c,
            (&op.0, &op.1),
            None,
            Some(&origin),
            &format!("/api/v1/trajectories/t-1/{action}"),
            body,
        )
    };
    // No runner listens: the runner's actions say so; bad input is refused before that.
    for (action, body) in [
        ("interrupt", r#"{"message": "x"}"#),
        ("budget", r#"{"usd_micros": 5}"#),
    ] {
        let r = post(action, body);
        assert_eq!(
            (r.status, r.code().as_str()),
            (503, "unavailable"),
            "{}",
            r.body
        );
        assert!(r.body.contains("no runner is listening"), "{}", r.body);
    }
    let r = post("interrupt", r#"{"message": "  "}"#);
    assert_eq!(
        (r.status, r.code().as_str()),
        (400, "invalid_field"),
        "{}",
        r.body
    );
    let r = post("interrupt", "{}");
    assert_eq!(
        (r.status, r.code().as_str()),
        (400, "bad_json"),
        "{}",
        r.body
    );
    let r = post("budget", "{}");
    assert_eq!(
        (r.status, r.code().as_str()),
        (400, "invalid_field"),
        "{}",
        r.body
    );
    let r = post("budget", r#"{"turns": 3, "dollars": 1}"#);
    assert_eq!(
        (r.status, r.code().as_str()),
        (400, "bad_json"),
        "{}",
        r.body
    );
    // Within the console's body bound (64 KiB), over the control socket's line with the rest.
    let long = json!({ "message": "x".repeat(64 * 1024 - 40) }).to_string();
    assert!(long.len() < 64 * 1024);
    let r = post("interrupt", &long);
    assert_eq!(
        (r.status, r.code().as_str()),
        (413, "line_too_long"),
        "{}",
        r.body
    );
    let r = post("restart", "{}");
    assert_eq!(
        (r.status, r.code().as_str()),
        (404, "unknown_op"),
        "{}",
        r.body
    );
}

/// An operator acts on a running `estop agent run` from the console: an interrupt is stored in
/// the runner (the daemon vouches for the operator with a grant, never a token) and reaches
/// the model at the next boundary; an observer's does nothing; a cancel from the console ends
/// the trajectory CANCELED; once the runner is gone, its actions are `unavailable`.
#[test]
fn an_operator_interrupts_and_cancels_a_running_trajectory_from_the_console() {
    use estop_harness::scripted::{self, Script, Scripted, Seen, Step};
    let c = Console::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let gated = |text: &str| {
        vec![
            scripted::text(text),
            Step::Gate,
            scripted::finish("stop"),
            Step::Done,
        ]
    };
    let model = rt
        .block_on(Scripted::start(
            "127.0.0.1:0",
            Script {
                responses: vec![
                    gated("Dropping orders_staging"),
                    gated("Using the replica"),
                    gated("Within four turns"),
                ],
            },
        ))
        .unwrap();
    let config = c.d.data().join("agent.toml");
    std::fs::write(
        &config,
        format!(
            "[[model]]\nname = \"scripted\"\nbase_url = \"{}\"\nusd_per_mtok_input = 3.0\n\
             usd_per_mtok_output = 15.0\n\n[budget]\nturns = 5\n",
            model.base_url()
        ),
    )
    .unwrap();
    let mut runner = std::process::Command::new(bin())
        .args(["agent", "run", "--config"])
        .arg(&config)
        .args(["--model", "scripted", "--id", "traj-c", "--data"])
        .arg(c.d.data())
        .arg("clean up staging")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let seen = |what: Seen| {
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(60), model.wait_for(&what)).await
        })
        .is_ok()
    };
    if !seen(Seen::Call { n: 0 }) {
        let _ = runner.kill();
        let out = runner.wait_with_output().unwrap();
        panic!("no model call: {}", String::from_utf8_lossy(&out.stderr));
    }
    let origin = format!("http://{}", c.addr);
    let post = |s: &(String, String), action: &str, body: Value| {
        session_post(
            &c,
            (&s.0, &s.1),
            Some("same-origin"),
            Some(&origin),
            &format!("/api/v1/trajectories/traj-c/{action}"),
            &body.to_string(),
        )
    };
    let made = c.post(
        "/api/v1/tokens",
        json!({"name": "watcher", "role": "observer", "groups": []}),
    );
    let observer = session_of(&c, made.json()["token"].as_str().unwrap());
    let r = post(&observer, "interrupt", json!({"message": "no"}));
    assert_eq!(r.status, 403, "{}", r.body);
    let r = post(&observer, "cancel", json!({}));
    assert_eq!(r.status, 403, "{}", r.body);
    let op = session_of(&c, &c.d.token("operator.token"));
    let r = post(
        &op,
        "interrupt",
        json!({"message": "use the replica instead"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["stored"], true, "{}", r.body);
    // The stream was cut; the next call carries the marker and then the operator's message.
    assert!(seen(Seen::Gone { n: 0, step: 1 }), "the stream was cut");
    assert!(seen(Seen::Call { n: 1 }), "the next call");
    let msgs: Vec<(String, String)> = model.calls()[1]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["role"].as_str().unwrap().to_string(),
                m["content"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    let texts: Vec<&str> = msgs.iter().map(|(_, t)| t.as_str()).collect();
    assert!(
        !texts.contains(&"no"),
        "the observer's message never arrived"
    );
    assert_eq!(
        &msgs[msgs.len() - 1],
        &("user".to_string(), "use the replica instead".to_string()),
        "{msgs:?}"
    );
    assert!(
        msgs[msgs.len() - 2].1.starts_with("[interrupted"),
        "{msgs:?}"
    );
    // A budget change goes the same way: stored, the open call cut, applied at the boundary.
    let r = post(&op, "budget", json!({"turns": 4}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["stored"], true, "{}", r.body);
    assert!(
        seen(Seen::Call { n: 2 }),
        "the call after the budget change"
    );
    let t = c.get("/api/v1/trajectories/traj-c").json();
    assert_eq!(
        t["budget"]["dimensions"][0],
        json!({"dimension": "turns", "spent": 3, "limit": 4}),
        "{t}"
    );
    let r = post(&op, "cancel", json!({"reason": "enough"}));
    assert_eq!(r.status, 200, "{}", r.body);
    let out = runner.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.starts_with("traj-c CANCELED"), "{stdout}");
    let t = c.get("/api/v1/trajectories/traj-c").json();
    assert_eq!(t["state"], "CANCELED", "{t}");
    assert_eq!(t["exit"]["exit"], "CANCELED", "{t}");
    // The runner is gone: nothing listens for its actions.
    let r = post(&op, "interrupt", json!({"message": "still there?"}));
    assert_eq!(
        (r.status, r.code().as_str()),
        (503, "unavailable"),
        "{}",
        r.body
    );
    assert_eq!(model.calls().len(), 3, "no call after the cancel");
}

/// What a runner's control socket is handed is a grant, never a token: a fake runner that
/// reads it can have the daemon vouch for it (as the acting operator) only while the ask is
/// open; once answered, or timed out, it authenticates nothing. Asks are bounded: four at once
/// (a fifth `429 limit_exceeded`, at once), and a runner that never answers is `503
/// unavailable` after the ask's 15 s.
#[test]
fn the_console_hands_a_runner_a_grant_that_ends_with_the_ask_and_bounds_its_asks() {
    use std::os::unix::net::UnixListener;
    let c = Console::start();
    let dir = c.d.data().join("harness");
    std::fs::create_dir_all(&dir).unwrap();
    let listener = UnixListener::bind(dir.join("control.sock")).unwrap();
    // The fake runner: reads each request line, answers only when told to.
    let (lines_tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let s = s.unwrap();
            let mut line = String::new();
            BufReader::new(s.try_clone().unwrap())
                .read_line(&mut line)
                .unwrap();
            lines_tx.send((line, s)).unwrap();
        }
    });
    let op = session_of(&c, &c.d.token("operator.token"));
    let origin = format!("http://{}", c.addr);
    let interrupt = |n: usize| {
        let (addr, op, origin) = (c.addr.clone(), op.clone(), origin.clone());
        std::thread::spawn(move || {
            let body = json!({ "message": format!("message {n}") }).to_string();
            let h = [
                ("X-Estop-Session", op.0.as_str()),
                ("X-CSRF-Token", op.1.as_str()),
                ("Origin", origin.as_str()),
            ];
            http(
                &addr,
                "POST",
                "/api/v1/trajectories/t-1/interrupt",
                &h,
                &body,
            )
        })
    };
    let asks: Vec<_> = (0..4).map(interrupt).collect();
    let mut held = Vec::new();
    for _ in 0..4 {
        let (line, stream) = lines.recv_timeout(Duration::from_secs(30)).unwrap();
        let req: Value = serde_json::from_str(&line).unwrap();
        held.push((req, stream));
    }
    let operator = c.d.token("operator.token");
    for (req, _) in &held {
        let token = req["token"].as_str().unwrap();
        assert_ne!(token.trim(), operator.trim(), "never the operator's token");
        assert!(token.starts_with("estop_gr_"), "{req}");
        assert_eq!(req["ask"], "interrupt");
    }
    // The asks reach the runner in any order: the first ask's is the one answered below.
    let first_ask = held
        .iter()
        .position(|(req, _)| req["message"] == "message 0")
        .expect("the first ask reached the runner");
    // While its ask is open, the daemon vouches for a grant as the acting operator.
    let grant = held[first_ask].0["token"].as_str().unwrap().to_string();
    let mut peer = estop_server::client::Client::connect(&c.d.socket()).unwrap();
    let hello = peer.hello(&grant).unwrap();
    assert_eq!(
        (hello.role.as_str(), hello.principal.as_str()),
        ("operator", "admin")
    );
    // A fifth ask is refused at once, not queued.
    let fifth = interrupt(4).join().unwrap();
    assert_eq!(
        (fifth.status, fifth.code().as_str()),
        (429, "limit_exceeded"),
        "{}",
        fifth.body
    );
    // The runner answers the first: the console passes the answer on, and the grant is over.
    let (_, mut first) = held.remove(first_ask);
    first
        .write_all(b"{\"ok\": {\"stored\": true, \"state\": \"CALLING_MODEL\"}}\n")
        .unwrap();
    let mut asks = asks.into_iter();
    let r = asks.next().unwrap().join().unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json(), json!({"stored": true, "state": "CALLING_MODEL"}));
    let mut late = estop_server::client::Client::connect(&c.d.socket()).unwrap();
    assert!(late.hello(&grant).is_err(), "a grant ends with its ask");
    // The others are never answered: unavailable once the ask's time is up, their grants over.
    for ask in asks {
        let r = ask.join().unwrap();
        assert_eq!(
            (r.status, r.code().as_str()),
            (503, "unavailable"),
            "{}",
            r.body
        );
        assert!(
            r.body.contains("did not answer within 15000 ms"),
            "{}",
            r.body
        );
    }
    for (req, _) in &held {
        let mut late = estop_server::client::Client::connect(&c.d.socket()).unwrap();
        assert!(late.hello(req["token"].as_str().unwrap()).is_err());
    }
}
