//! The operator console against a hostile agent on the same host (issue 11): a page served on
//! another local port must get nothing that acts on estop (finding 2); idle sockets, a login
//! flood and a stream hog must not lock the operator out (finding 5); query values stay strings
//! (finding 8); the one-time login link goes to a 0600 file, not to a log (deliver 7). Each test
//! drives a real `estop serve` over plain TCP with a tiny HTTP/1.1 client.

mod common;

use common::*;
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Resp {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    fn code(&self) -> String {
        serde_json::from_str::<Value>(&self.body)
            .ok()
            .and_then(|v| v["error"]["code"].as_str().map(str::to_string))
            .unwrap_or_default()
    }

    fn set_cookie(&self) -> Vec<String> {
        self.headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case("set-cookie"))
            .map(|(_, v)| v.clone())
            .collect()
    }
}

/// One request (`Connection: close`), the whole response read back, or an error if none came
/// within `within`.
fn http_within(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
    within: Duration,
) -> std::io::Result<Resp> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(within))?;
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() {
        req.push_str("Content-Type: application/json\r\n");
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes())?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other(format!("no response head: {raw:?}")))?;
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line: {head}")))?;
    let headers = lines
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Ok(Resp {
        status,
        headers,
        body: body.to_string(),
    })
}

fn http(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Resp {
    http_within(addr, method, path, headers, body, Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

struct Console {
    d: Daemon,
    addr: String,
    /// `Authorization: Bearer <operator token>`, as a script sends it.
    op: String,
    /// The console's own origin, as its page sends it.
    origin: String,
}

impl Console {
    fn start() -> Console {
        let d = Daemon::start_with(&["--console", "127.0.0.1:0"]);
        let addr = d.ready_field("console");
        assert!(addr.starts_with("127.0.0.1:"), "{}", d.ready);
        let op = format!("Bearer {}", d.token("operator.token"));
        let origin = format!("http://{addr}");
        Console {
            d,
            addr,
            op,
            origin,
        }
    }

    fn bearer(&self, method: &str, path: &str, body: Value) -> Resp {
        let body = if body.is_null() {
            String::new()
        } else {
            body.to_string()
        };
        http(
            &self.addr,
            method,
            path,
            &[("Authorization", &self.op)],
            &body,
        )
    }

    /// A fresh one-time login code, minted by a script with the operator token.
    fn login_code(&self) -> String {
        let link = self.bearer("POST", "/api/v1/login-links", json!({})).json();
        let url = link["url"].as_str().unwrap().to_string();
        let (_, code) = url
            .split_once("code=")
            .unwrap_or_else(|| panic!("no code in {url}"));
        code.to_string()
    }

    /// What the console's own page does to log in: `POST /api/v1/session` from its origin.
    fn page_login(&self, body: Value) -> Resp {
        http(
            &self.addr,
            "POST",
            "/api/v1/session",
            &[("Origin", &self.origin), ("Sec-Fetch-Site", "same-origin")],
            &body.to_string(),
        )
    }
}

/// A logged-in page's session: its secret and CSRF token (what the page keeps in sessionStorage).
struct Session {
    secret: String,
    csrf: String,
}

fn session_of(r: &Resp) -> Session {
    assert_eq!(r.status, 200, "login: {}", r.body);
    let v = r.json();
    Session {
        secret: v["session"].as_str().expect("a session secret").to_string(),
        csrf: v["csrf"].as_str().expect("a CSRF token").to_string(),
    }
}

/// Finding 2: everything a page on another port (or curl replaying what it saw) can send — the
/// cookies the login set, no `Origin`, a foreign `Origin`, `Sec-Fetch-Site: cross-site` or
/// `same-site` — yields no secret and no action; the console's own page and scripts with a
/// bearer token still work.
#[test]
fn another_origin_gets_nothing_that_acts_on_estop() {
    let c = Console::start();
    let mut a = c.d.agent();
    let held = admit(&mut a, "r", "k", "refund", json!({"amount": 5}));
    assert_eq!(verdict(&held), "held");

    // The link is opened: the page is served, and no response of the login sets a cookie (a
    // cookie is host-scoped: every port of 127.0.0.1 would receive it).
    let code = c.login_code();
    let page = http(&c.addr, "GET", &format!("/login?code={code}"), &[], "");
    assert!(page.set_cookie().is_empty(), "{:?}", page.set_cookie());
    let login = c.page_login(json!({"code": code}));
    assert!(login.set_cookie().is_empty(), "{:?}", login.set_cookie());
    let s = session_of(&login);
    // The link worked once.
    assert_eq!(c.page_login(json!({"code": code})).status, 401);

    // What another origin could replay: any cookie, no session header.
    let cookies = [
        format!("estop_session={}", s.secret),
        format!(
            "estop_session_{}={}",
            c.addr.rsplit(':').next().unwrap(),
            s.secret
        ),
    ];
    for cookie in &cookies {
        let who = http(&c.addr, "GET", "/api/v1/session", &[("Cookie", cookie)], "");
        assert_eq!(who.status, 401, "a cookie is no credential: {}", who.body);
        assert!(!who.body.contains(&s.csrf));
    }

    // The session secret itself, sent from elsewhere: every combination is refused, reads
    // included, and nothing that returns a secret answers.
    let foreign = "http://127.0.0.1:1";
    let hostile: Vec<Vec<(&str, &str)>> = vec![
        vec![],
        vec![("Origin", foreign)],
        vec![("Origin", "null")],
        vec![("Sec-Fetch-Site", "cross-site")],
        vec![("Sec-Fetch-Site", "same-site")],
        vec![("Origin", foreign), ("Sec-Fetch-Site", "same-origin")],
        vec![("Origin", &c.origin), ("Sec-Fetch-Site", "same-site")],
    ];
    for extra in &hostile {
        let mut with = vec![("X-Estop-Session", s.secret.as_str())];
        with.extend_from_slice(extra);
        with.push(("X-CSRF-Token", s.csrf.as_str()));
        for (method, path, body) in [
            ("GET", "/api/v1/session", ""),
            ("GET", "/api/v1/pending", ""),
            (
                "POST",
                "/api/v1/tokens",
                r#"{"name":"stolen","role":"operator"}"#,
            ),
            ("POST", "/api/v1/login-links", "{}"),
            ("POST", "/api/v1/runs/r/effects/k/approve", "{}"),
            ("POST", "/api/v1/runs/r/cancel", "{}"),
        ] {
            let r = http(&c.addr, method, path, &with, body);
            assert!(
                r.status == 401 || r.status == 403,
                "{method} {path} with {extra:?}: {} {}",
                r.status,
                r.body
            );
            assert!(
                !r.body.contains(&s.csrf) && !r.body.contains("\"token\""),
                "{}",
                r.body
            );
        }
        // Logging in (a code or a token) from there is refused too, and burns no code.
        let fresh = c.login_code();
        for body in [
            json!({"code": fresh}),
            json!({"token": c.d.token("operator.token")}),
        ] {
            let mut h = vec![];
            h.extend_from_slice(extra);
            let r = http(&c.addr, "POST", "/api/v1/session", &h, &body.to_string());
            assert!(
                r.status == 403,
                "login with {extra:?}: {} {}",
                r.status,
                r.body
            );
            assert!(!r.body.contains("csrf"), "{}", r.body);
        }
        assert_eq!(
            c.page_login(json!({"code": fresh})).status,
            200,
            "not burnt"
        );
    }

    // Nothing happened: the effect is still held, no token was minted.
    let pending = c.bearer("GET", "/api/v1/pending", Value::Null).json();
    assert_eq!(pending["pending"].as_array().unwrap().len(), 1, "{pending}");
    assert!(
        !std::fs::read_to_string(c.d.data().join("tokens"))
            .unwrap_or_default()
            .contains("stolen")
    );

    // The console's own page acts: session header, CSRF token, its own origin.
    let own = [
        ("X-Estop-Session", s.secret.as_str()),
        ("Origin", c.origin.as_str()),
        ("Sec-Fetch-Site", "same-origin"),
    ];
    let who = http(&c.addr, "GET", "/api/v1/session", &own, "");
    assert_eq!(who.status, 200, "{}", who.body);
    assert_eq!(who.json()["principal"], "admin");
    assert!(
        !who.body.contains(&s.secret) && !who.body.contains(&s.csrf),
        "no secret echoed"
    );
    let no_csrf = http(
        &c.addr,
        "POST",
        "/api/v1/runs/r/effects/k/approve",
        &own,
        "{}",
    );
    assert_eq!(no_csrf.status, 403, "the CSRF token is still needed");
    let mut with_csrf = own.to_vec();
    with_csrf.push(("X-CSRF-Token", &s.csrf));
    let ok = http(
        &c.addr,
        "POST",
        "/api/v1/runs/r/effects/k/approve",
        &with_csrf,
        "{}",
    );
    assert_eq!(ok.status, 200, "{}", ok.body);
    // A script with a bearer token needs no origin at all.
    let t = c.bearer(
        "POST",
        "/api/v1/tokens",
        json!({"name": "ci", "role": "agent"}),
    );
    assert_eq!(t.status, 200, "{}", t.body);
}

fn operator_answered_promptly(c: &Console, while_: &str) {
    let started = Instant::now();
    let r = http_within(
        &c.addr,
        "GET",
        "/api/v1/runs",
        &[("Authorization", &c.op)],
        "",
        Duration::from_secs(5),
    )
    .unwrap_or_else(|e| panic!("the operator's request is not answered while {while_}: {e}"));
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "answered after {:?} while {while_}",
        started.elapsed()
    );
}

/// Finding 5: 300 idle TCP connections (more than the console's bound), some with half a
/// request head, then 300 that dribble a request body, do not keep the operator's request
/// waiting; under the bound, the header- and body-read timeouts close slow ones.
#[test]
fn idle_connections_do_not_lock_the_operator_out() {
    let c = Console::start();
    let mut idle = Vec::new();
    for i in 0..300 {
        let mut s = TcpStream::connect(&c.addr).unwrap();
        if i % 3 == 0 {
            // A slow client: half a request head, never finished.
            s.write_all(b"GET /api/v1/runs HTTP/1.1\r\nHost: x\r\n")
                .unwrap();
        }
        idle.push(s);
    }
    operator_answered_promptly(&c, "300 idle sockets are open");
    // The idle ones that were let in are closed within the header-read timeout: a read on the
    // oldest returns end of stream (or an error), not a hang.
    let oldest = &mut idle[1];
    oldest
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut buf = [0u8; 256];
    let started = Instant::now();
    match oldest.read(&mut buf) {
        Ok(n) => assert!(
            n == 0 || buf.starts_with(b"HTTP/1.1 408"),
            "{:?}",
            &buf[..n]
        ),
        Err(e) => assert!(
            e.kind() != std::io::ErrorKind::WouldBlock && e.kind() != std::io::ErrorKind::TimedOut,
            "the idle socket was never closed: {e}"
        ),
    }
    assert!(started.elapsed() < Duration::from_secs(25));

    // 300 clients that send a whole head and then dribble the body (no token needed: the body
    // is read before anything else): none holds a slot the operator needs.
    drop(idle);
    let mut slow = Vec::new();
    for _ in 0..300 {
        let mut s = TcpStream::connect(&c.addr).unwrap();
        s.write_all(b"POST /api/v1/session HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
            .unwrap();
        slow.push(s);
    }
    operator_answered_promptly(&c, "300 clients dribble a body");

    // Under the bound, a slow head is cut by the header-read timeout alone, a slow body by the
    // body-read timeout (an answer, then the end).
    drop(slow);
    let mut lone = TcpStream::connect(&c.addr).unwrap();
    lone.write_all(b"GET / HTTP/1.1\r\n").unwrap();
    let mut dribble = TcpStream::connect(&c.addr).unwrap();
    let head = format!(
        "POST /api/v1/runs/r/pause HTTP/1.1\r\nHost: {}\r\nAuthorization: {}\r\nContent-Length: 100\r\n\r\n{{",
        c.addr, c.op
    );
    dribble.write_all(head.as_bytes()).unwrap();
    let started = Instant::now();
    lone.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let n = lone.read(&mut buf).unwrap_or(0);
    assert!(
        n == 0 || buf.starts_with(b"HTTP/1.1 408"),
        "{:?}",
        &buf[..n]
    );
    dribble
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut answer = String::new();
    let read = dribble.read_to_string(&mut answer);
    assert!(
        read.is_ok(),
        "the slow body was cut, not waited for: {read:?}"
    );
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "closed after {:?}",
        started.elapsed()
    );
}

/// Finding 5: one agent logging in 1,030 times, then enough agents to fill every session slot
/// agents may use, neither evict the operator's session nor keep the operator from logging in;
/// the agents get a typed refusal.
#[test]
fn an_agent_login_flood_never_evicts_or_blocks_an_operator_session() {
    let c = Console::start();
    let op = session_of(&c.page_login(json!({"token": c.d.token("operator.token")})));
    let agent = c.d.token("agent.token");
    let mut granted = 0;
    let mut refused = None;
    for _ in 0..1030 {
        let r = c.page_login(json!({"token": agent}));
        match r.status {
            200 => granted += 1,
            _ => refused = Some(r),
        }
    }
    let refused = refused.expect("an agent cannot hold 1,030 sessions");
    assert_eq!(
        (refused.status, refused.code().as_str()),
        (429, "limit_exceeded"),
        "{}",
        refused.body
    );
    assert!((1..1030).contains(&granted), "{granted}");
    let alive = |s: &Session| {
        http(
            &c.addr,
            "GET",
            "/api/v1/session",
            &[
                ("X-Estop-Session", &s.secret),
                ("Sec-Fetch-Site", "same-origin"),
            ],
            "",
        )
        .status
    };
    assert_eq!(alive(&op), 200, "the operator's session survived the flood");

    // More agents until a fresh one cannot log in at all: the agents' share is full.
    let mut full = false;
    for i in 0..64 {
        let name = format!("flood-{i}");
        let t = c.bearer(
            "POST",
            "/api/v1/tokens",
            json!({"name": name, "role": "agent"}),
        );
        let token = t.json()["token"].as_str().unwrap().to_string();
        let first = c.page_login(json!({"token": token}));
        if first.status != 200 {
            assert_eq!(first.code(), "limit_exceeded", "{}", first.body);
            full = true;
            break;
        }
        while c.page_login(json!({"token": token})).status == 200 {}
    }
    assert!(full, "agents filled every session slot");
    assert_eq!(alive(&op), 200, "the operator's session survived");
    let again = c.page_login(json!({"token": c.d.token("operator.token")}));
    assert_eq!(
        again.status, 200,
        "the operator still logs in: {}",
        again.body
    );
}

/// Opens `GET /api/v1/events` and returns the status, keeping the stream open in `held`.
fn open_stream(addr: &str, auth: &str, held: &mut Vec<BufReader<TcpStream>>) -> u16 {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "GET /api/v1/events HTTP/1.1\r\nHost: {addr}\r\nAuthorization: {auth}\r\nAccept: text/event-stream\r\n\r\n"
    )
    .unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status = line.split(' ').nth(1).unwrap().parse().unwrap();
    if status == 200 {
        held.push(r);
    }
    status
}

/// Finding 5: one token cannot hold every event stream, nor can a few agents together: the
/// operator still gets one.
#[test]
fn agents_cannot_hold_every_event_stream() {
    let c = Console::start();
    let mut held = Vec::new();
    let agent = format!("Bearer {}", c.d.token("agent.token"));
    let mut mine = 0;
    while open_stream(&c.addr, &agent, &mut held) == 200 {
        mine += 1;
        assert!(mine < 64, "one agent token holds every stream");
    }
    let mut others = 0;
    loop {
        let t = c.bearer(
            "POST",
            "/api/v1/tokens",
            json!({"name": format!("s{others}"), "role": "agent"}),
        );
        let auth = format!("Bearer {}", t.json()["token"].as_str().unwrap());
        let mut n = 0;
        while open_stream(&c.addr, &auth, &mut held) == 200 {
            n += 1;
        }
        others += 1;
        if n == 0 {
            break;
        }
        assert!(others < 64, "agents hold every stream");
    }
    assert_eq!(
        open_stream(&c.addr, &c.op, &mut held),
        200,
        "the operator gets a stream"
    );
    let r = http(
        &c.addr,
        "GET",
        "/api/v1/events",
        &[("Authorization", &agent)],
        "",
    );
    assert_eq!(
        (r.status, r.code().as_str()),
        (429, "limit_exceeded"),
        "{}",
        r.body
    );
}

/// Finding 8: `?run=123` names run "123"; it is not turned into a number and refused.
#[test]
fn query_values_stay_strings() {
    let c = Console::start();
    let mut a = c.d.agent();
    assert_eq!(
        verdict(&admit(&mut a, "123", "k", "refund", json!({}))),
        "held"
    );
    let r = c.bearer("GET", "/api/v1/pending?run=123", Value::Null);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["pending"][0]["run"], "123");
    let r = c.bearer("GET", "/api/v1/ledger?run=123&limit=5", Value::Null);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.json()["entries"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["run"] == "123")
    );
    // A number where a number belongs is still one; a word there is a clear error.
    let r = c.bearer("GET", "/api/v1/runs?limit=abc", Value::Null);
    assert_eq!(
        (r.status, r.code().as_str()),
        (400, "invalid_field"),
        "{}",
        r.body
    );
}

/// Deliver 7: with stdout not a terminal (journald, `docker logs`), the one-time login link is
/// not printed; it is in DATA/console-login, mode 0600, and it works.
#[test]
fn the_login_link_goes_to_a_0600_file_not_to_the_log() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policy.toml"), POLICY).unwrap();
    let mut child = std::process::Command::new(bin())
        .args(["serve", "--console", "127.0.0.1:0", "--data"])
        .arg(dir.path())
        .arg("--policy")
        .arg(dir.path().join("policy.toml"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut ready = String::new();
    out.read_line(&mut ready).unwrap();
    assert!(ready.starts_with("estop ready"), "{ready}");
    let mut notice = String::new();
    out.read_line(&mut notice).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        !notice.contains("code="),
        "the link is not printed: {notice}"
    );
    let file = dir.path().join("console-login");
    assert!(notice.contains(&file.display().to_string()), "{notice}");
    let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "{mode:o}");
    let link = std::fs::read_to_string(&file).unwrap();
    assert!(link.contains("/login#code="), "{link}");

    // The link in the file logs in (once).
    let c = Console::start();
    let link = std::fs::read_to_string(c.d.data().join("console-login")).unwrap();
    let code = link.trim().split_once("code=").unwrap().1.to_string();
    session_of(&c.page_login(json!({"code": code})));
    assert_eq!(c.page_login(json!({"code": code})).status, 401);
}
