//! HTTP undos end to end (issue 14 item 2): an agent in `estop run` creates a resource on an
//! HTTP upstream (the test's own, on 127.0.0.2) through the proxy, the run is cancelled after
//! `estop run` has gone, and `estop egress-executor` sends the DELETE the policy's
//! `compensate_args` built from the recorded response. Plus what must not be sent: an undo the
//! policy refuses, one to a refused destination, and another principal's run.

mod common;

use common::{Daemon, admit, bin, ok, verdict};
use estop_server::client::Client;
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};

const POLICY: &str = r#"
[[rules]]
tool = "sandbox.run"
action = "allow"

# An order is undone by deleting it, at the id the upstream answered with.
[[rules]]
tool = "http.POST"
when = 'args.path == "/orders"'
action = "allow"
compensate = "http.DELETE"
compensate_args = '{"url": args.scheme + "://" + args.host + ":" + string(args.port) + "/orders/" + result.body.id, "host": args.host}'

# A charge is refunded with the amount its own request asked for: the undo's body needs the
# forward request's body (result.request_body), which the proxy records for it.
[[rules]]
tool = "http.POST"
when = 'args.path == "/charges"'
action = "allow"
compensate = "http.PUT"
compensate_args = '{"url": args.scheme + "://" + args.host + ":" + string(args.port) + "/refunds/" + result.body.id, "host": args.host, "body": {"amount": result.request_body.amount, "currency": result.request_body.currency}}'

# An upstream that says itself where its undo goes.
[[rules]]
tool = "http.POST"
when = 'args.path == "/elsewhere"'
action = "allow"
compensate = "http.DELETE"
compensate_args = '{"url": result.body.undo_url, "host": result.body.undo_host}'

# An order posted with an Idempotency-Key is found by it when its outcome is unknown.
[[rules]]
tool = "http.POST"
when = 'args.path == "/keyed"'
action = "allow"
compensate = "http.DELETE"
compensate_args = '{"url": args.scheme + "://" + args.host + ":" + string(args.port) + "/orders/" + result.body.id, "host": args.host}'
lookup = "http.GET"
lookup_args = '{"path": "/lookup/" + idempotency_key, "not_found": [404]}'

[[rules]]
tool = "http.DELETE"
when = 'args.host == "127.0.0.3"'
action = "deny"

[[rules]]
tool = "wire_money"
action = "approve"

[[rules]]
tool = "http.*"
action = "allow"
"#;

/// The upstream: `POST /orders` makes an order (201, `Location`, `{"id"}`), `DELETE
/// /orders/ID` removes it (204; 404 when there is none). Records every request's head.
struct Upstream {
    port: u16,
    orders: Arc<Mutex<BTreeSet<String>>>,
    heads: Arc<Mutex<Vec<String>>>,
}

impl Upstream {
    fn start(ip: &str) -> Upstream {
        let listener = TcpListener::bind((ip, 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let orders = Arc::new(Mutex::new(BTreeSet::new()));
        let heads = Arc::new(Mutex::new(Vec::new()));
        let (o, h) = (orders.clone(), heads.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { break };
                let (o, h) = (o.clone(), h.clone());
                std::thread::spawn(move || serve(conn, &o, &h));
            }
        });
        Upstream {
            port,
            orders,
            heads,
        }
    }

    fn heads(&self) -> Vec<String> {
        self.heads.lock().unwrap().clone()
    }
}

/// One request per connection (answered `connection: close`).
fn serve(conn: TcpStream, orders: &Mutex<BTreeSet<String>>, heads: &Mutex<Vec<String>>) {
    let mut r = BufReader::new(conn.try_clone().unwrap());
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        head.push_str(&line);
        if line == "\r\n" {
            break;
        }
    }
    let lower = head.to_ascii_lowercase();
    let length = lower
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|n| n.trim().parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    r.read_exact(&mut body).unwrap();
    heads
        .lock()
        .unwrap()
        .push(format!("{head}{}", String::from_utf8_lossy(&body)));
    let target = head.split_whitespace().nth(1).unwrap_or("").to_string();
    let (status, extra, body) = match head.split_whitespace().next() {
        // A charge, refunded by `PUT /refunds/ID` with the amount it was made for.
        Some("POST") if target == "/charges" => {
            let mut orders = orders.lock().unwrap();
            let id = format!("ch-{}", orders.len() + 1);
            orders.insert(id.clone());
            ("201 Created", String::new(), json!({"id": id}).to_string())
        }
        Some("PUT") => match target.strip_prefix("/refunds/") {
            Some(id) if orders.lock().unwrap().remove(id) => {
                ("204 No Content", String::new(), String::new())
            }
            _ => ("404 Not Found", String::new(), String::new()),
        },
        Some("POST") if target == "/orders" => {
            let mut orders = orders.lock().unwrap();
            let id = format!("o-{}", orders.len() + 1);
            orders.insert(id.clone());
            let body = json!({"id": id}).to_string();
            ("201 Created", format!("location: /orders/{id}\r\n"), body)
        }
        // Lookups by the key the order was posted with: `found-*` is order o-7, `missing-*`
        // was never made, `down-*` cannot be answered now.
        Some("GET") if target.starts_with("/lookup/found-") => {
            ("200 OK", String::new(), json!({"id": "o-7"}).to_string())
        }
        Some("GET") if target.starts_with("/lookup/down-") => {
            ("503 Service Unavailable", String::new(), String::new())
        }
        Some("DELETE") => match target.strip_prefix("/orders/") {
            Some(id) if orders.lock().unwrap().remove(id) => {
                ("204 No Content", String::new(), String::new())
            }
            _ => ("404 Not Found", String::new(), String::new()),
        },
        _ => ("404 Not Found", String::new(), String::new()),
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\n{extra}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = (&conn).write_all(reply.as_bytes());
}

/// The credential store and the `[egress]` settings shared by `estop run` and the executor:
/// 127.0.0.2 allowed, its credential injected over plain HTTP.
fn settings(d: &Daemon) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = d.data().parent().unwrap();
    let store = dir.join("undo-credentials.toml");
    std::fs::write(
        &store,
        "[[credential]]\nhost = \"127.0.0.2\"\nplain_http = true\nbasic_user = \"svc\"\nbasic_password = \"pw-undo-secret\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&store, std::fs::Permissions::from_mode(0o600)).unwrap();
    let path = dir.join("undo-egress.toml");
    std::fs::write(
        &path,
        format!(
            "[egress]\nallow_destinations = [\"127.0.0.2/32\"]\ncredentials = \"{}\"\n",
            store.display()
        ),
    )
    .unwrap();
    path
}

/// `estop egress-executor` under `token` (default: the agent's), once it says it is ready.
struct Executor(Child);

impl Executor {
    fn start(d: &Daemon, settings: &std::path::Path, token: Option<&str>) -> Executor {
        let mut cmd = Command::new(bin());
        cmd.args(["egress-executor", "--data"])
            .arg(d.data())
            .arg("--policy")
            .arg(settings)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(t) = token {
            cmd.args(["--token", t]);
        }
        let mut child = cmd.spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(
            line.contains("ready"),
            "the executor did not start: {line:?}"
        );
        Executor(child)
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Blocks until `run`'s effect `key` has a `compensation` event with `outcome`.
fn wait_compensation(c: &mut Client, run: &str, outcome: &str) {
    loop {
        if let Some(e) = c.next_event().unwrap()
            && e.run == run
            && serde_json::to_value(e.event).unwrap() == "compensation"
            && e.outcome.as_deref() == Some(outcome)
        {
            return;
        }
    }
}

/// The report's item for the run's effect of `tool` (in `done`). The proxy answers the agent
/// before the request's `complete` is durable (docs/EGRESS.md: the outcome follows the
/// response), so an agent that saw its answer may be a moment ahead of the report: read it
/// until the effect is done, for at most 10 s.
fn item(op: &mut Client, run: &str, tool: &str) -> Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let r = ok(op, json!({"op": "report", "run": run}));
        let found = r["done"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["tool"] == tool)
            .cloned();
        match found {
            Some(i) => return i,
            None if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            None => panic!("no {tool} done in {r}"),
        }
    }
}

fn state(c: &mut Client, run: &str) -> String {
    ok(c, json!({"op": "status", "run": run}))["state"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn a_cancelled_runs_http_effect_is_undone_by_the_executor_after_estop_run_has_ended() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let up = Upstream::start("127.0.0.2");
    let settings = settings(&d);
    let script = format!(
        "curl -sS -X POST -H 'content-type: application/json' -d '{{\"item\": 1}}' \
         http://127.0.0.2:{}/orders && echo && echo posted && read _",
        up.port
    );
    let mut agent = Command::new(bin())
        .args(["run", "--data"])
        .arg(d.data())
        .args(["--run", "undo-a", "--policy"])
        .arg(&settings)
        .args(["--", "sh", "-c", &script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(agent.stdout.take().unwrap());
    let mut seen = String::new();
    while !seen.contains("posted") {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "agent ended: {seen}");
        seen.push_str(&line);
    }
    assert!(seen.contains("\"o-1\""), "{seen}");
    let mut op = d.operator();
    let posted = item(&mut op, "undo-a", "http.POST");
    ok(&mut op, json!({"op": "subscribe", "run": "undo-a"}));
    ok(
        &mut op,
        json!({"op": "cancel", "run": "undo-a", "reason": "user pressed stop"}),
    );
    // The agent and its sandbox end: nothing of `estop run` is left to run the undo, and no
    // executor is connected yet, so the run waits in `finalizing`.
    drop(agent.stdin.take());
    agent.wait().unwrap();
    assert_eq!(state(&mut op, "undo-a"), "finalizing");
    assert_eq!(up.heads().len(), 1);
    let _executor = Executor::start(&d, &settings, None);
    wait_compensation(&mut op, "undo-a", "compensated");
    assert_eq!(state(&mut op, "undo-a"), "cancelled");
    assert_eq!(
        item(&mut op, "undo-a", "http.POST")["status"],
        "compensated"
    );
    assert!(up.orders.lock().unwrap().is_empty(), "the order is gone");
    let heads = up.heads();
    assert_eq!(heads.len(), 2, "{heads:?}");
    let delete = heads[1].to_ascii_lowercase();
    assert!(
        delete.starts_with("delete /orders/o-1 http/1.1"),
        "{delete}"
    );
    let key = posted["key"].as_str().unwrap();
    assert!(
        delete.contains(&format!("idempotency-key: {key}/undo")),
        "{delete}"
    );
    // Basic base64("svc:pw-undo-secret"), injected into both, recorded in neither.
    let basic = "authorization: basic c3zjonb3lxvuzg8tc2vjcmv0";
    assert!(delete.contains(basic) && heads[0].to_ascii_lowercase().contains(basic));
    let text = ok(
        &mut op,
        json!({"op": "ledger", "run": "undo-a", "limit": 1000}),
    )
    .to_string();
    assert!(!text.contains("pw-undo-secret") && !text.contains("c3ZjOnB3"));
    // What the DELETE was built from: the recorded result's `body.id` (record.rs's tests
    // pin the rest of what a result records).
    assert_eq!(up.orders.lock().unwrap().len(), 0);
}

/// Admits and completes, as the proxy would, a `POST /elsewhere` of `run` whose recorded
/// response names where its undo goes.
fn posted_elsewhere(a: &mut Client, run: &str, undo_host: &str, port: u16) {
    let args = json!({"method": "POST", "url": "http://127.0.0.2/elsewhere", "scheme": "http",
        "host": "127.0.0.2", "port": 80, "path": "/elsewhere", "query": ""});
    let v = admit(a, run, "post-1", "http.POST", args);
    assert_eq!(verdict(&v), "admitted", "{v}");
    let result = json!({"status": 201, "bytes": 10, "body": {"undo_host": undo_host,
        "undo_url": format!("http://{undo_host}:{port}/orders/o-1")}});
    ok(
        a,
        json!({"op": "complete", "run": run, "key": "post-1", "token": v["token"],
            "outcome": "ok", "result": result}),
    );
}

/// Nothing is sent that should not be: an undo the policy denies (a human is asked), one to
/// a destination the executor's settings refuse (`error`, retried later, never dialled), and
/// another principal's run, which an executor under the agent's token is never offered and
/// cannot report on; an executor under that principal's token runs it.
#[test]
fn undos_the_policy_or_the_destination_refuse_and_other_principals_runs_are_not_sent() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let (denied, unlisted, ours) = (
        Upstream::start("127.0.0.3"),
        Upstream::start("127.0.0.4"),
        Upstream::start("127.0.0.2"),
    );
    // The order `theirs` made, which only its own principal's executor may delete.
    ours.orders.lock().unwrap().insert("o-1".into());
    let settings = settings(&d);
    let mut op = d.operator();
    let other = ok(
        &mut op,
        json!({"op": "token", "name": "mallory", "role": "agent"}),
    )["token"]
        .as_str()
        .unwrap()
        .to_string();
    let mut a = d.agent();
    let mut m = d.client_with(&other);
    posted_elsewhere(&mut m, "theirs", "127.0.0.2", ours.port);
    posted_elsewhere(&mut a, "denied", "127.0.0.3", denied.port);
    posted_elsewhere(&mut a, "unlisted", "127.0.0.4", unlisted.port);
    let status = json!({"op": "status", "run": "theirs"});
    assert_eq!(common::err_code(&mut a, status), "not_found");
    let _executor = Executor::start(&d, &settings, None);
    for run in ["theirs", "denied", "unlisted"] {
        ok(&mut op, json!({"op": "subscribe", "run": run}));
        ok(&mut op, json!({"op": "cancel", "run": run}));
    }
    wait_compensation(&mut op, "denied", "needs_human");
    let note = item(&mut op, "denied", "http.POST")["note"].to_string();
    assert!(note.contains("denies the compensating call"), "{note}");
    wait_compensation(&mut op, "unlisted", "compensation_failed");
    let note = item(&mut op, "unlisted", "http.POST")["note"].to_string();
    assert!(note.contains("refused destinations"), "{note}");
    assert!(denied.heads().is_empty() && unlisted.heads().is_empty());
    // Offered at the same moment as the two above, to no one: no executor may see it.
    assert_eq!(item(&mut op, "theirs", "http.POST")["status"], "completed");
    assert_eq!(state(&mut op, "theirs"), "finalizing");
    let report = json!({"op": "compensated", "run": "theirs", "key": "post-1", "attempt": 1,
        "outcome": "ok"});
    assert_eq!(common::err_code(&mut a, report), "not_found");
    assert!(ours.heads().is_empty());
    let _theirs = Executor::start(&d, &settings, Some(&other));
    wait_compensation(&mut op, "theirs", "compensated");
    assert_eq!(state(&mut op, "theirs"), "cancelled");
    assert_eq!(ours.heads().len(), 1);
    assert!(ours.orders.lock().unwrap().is_empty());
}

/// Blocks until the report says `run`'s effect of `tool` is `status` (checked now and after
/// each of the run's events; `op` is subscribed to it).
fn wait_status(op: &mut Client, run: &str, tool: &str, status: &str) -> Value {
    loop {
        let r = ok(op, json!({"op": "report", "run": run}));
        let found = r
            .as_object()
            .unwrap()
            .values()
            .filter_map(Value::as_array)
            .flatten();
        if let Some(it) = found
            .into_iter()
            .find(|i| i["tool"] == tool && i["status"] == status)
        {
            return it.clone();
        }
        while op.next_event().unwrap().is_none_or(|e| e.run != run) {}
    }
}

/// Lookups of an HTTP call's unknown outcome (the proxy reported it `unknown`: cut after it was
/// sent), by the rule's `lookup = "http.GET"` and `lookup_args`, sent by the executor to the
/// forward request's own host with that host's credentials: found (200) settles it `ok` with
/// the answer as its result and the DELETE built from that result undoes it; 404, which the
/// rule lists as `not_found`, settles it `failed` and nothing is undone; 503 cannot tell, and
/// an operator settles it (no DELETE, no second lookup, no repeat of the POST).
#[test]
fn an_http_calls_unknown_outcome_is_looked_up_by_the_executor() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let up = Upstream::start("127.0.0.2");
    up.orders.lock().unwrap().insert("o-7".into());
    let settings = settings(&d);
    let mut a = d.agent();
    let mut op = d.operator();
    for (run, key) in [
        ("lk-found", "found-1"),
        ("lk-missing", "missing-1"),
        ("lk-down", "down-1"),
    ] {
        let args = json!({"method": "POST", "url": format!("http://127.0.0.2:{}/keyed", up.port),
            "scheme": "http", "host": "127.0.0.2", "port": up.port, "path": "/keyed", "query": ""});
        let v = admit(&mut a, run, &format!("idem:{key}"), "http.POST", args);
        assert_eq!(verdict(&v), "admitted", "{v}");
        ok(
            &mut a,
            json!({"op": "complete", "run": run, "key": format!("idem:{key}"), "token": v["token"],
                "outcome": "unknown", "error": "cut after sending"}),
        );
        ok(&mut op, json!({"op": "subscribe", "run": run}));
        ok(&mut op, json!({"op": "cancel", "run": run}));
    }
    let _executor = Executor::start(&d, &settings, None);
    let found = wait_status(&mut op, "lk-found", "http.POST", "compensated");
    assert_eq!(state(&mut op, "lk-found"), "cancelled");
    assert!(
        up.orders.lock().unwrap().is_empty(),
        "o-7 was deleted: {found}"
    );
    let missing = wait_status(&mut op, "lk-missing", "http.POST", "failed");
    assert_eq!(state(&mut op, "lk-missing"), "cancelled", "{missing}");
    let down = wait_status(&mut op, "lk-down", "http.POST", "unknown");
    let r = ok(&mut op, json!({"op": "report", "run": "lk-down"}));
    assert_eq!(r["saga_next"]["waits"], "settle", "{r}");
    assert!(down["note"].to_string().contains("503"), "{down}");
    let heads: Vec<String> = up.heads().iter().map(|h| h.to_ascii_lowercase()).collect();
    let lines: Vec<&str> = heads.iter().map(|h| h.lines().next().unwrap()).collect();
    let mut sorted = lines.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        [
            "delete /orders/o-7 http/1.1",
            "get /lookup/down-1 http/1.1",
            "get /lookup/found-1 http/1.1",
            "get /lookup/missing-1 http/1.1",
        ],
        "one lookup each, one undo, the POST never repeated"
    );
    // The lookups carried the host's credential and no Idempotency-Key of their own.
    let basic = "authorization: basic c3zjonb3lxvuzg8tc2vjcmv0";
    for h in heads.iter().filter(|h| h.starts_with("get ")) {
        assert!(h.contains(basic) && !h.contains("idempotency-key"), "{h}");
    }
    // Found: the answer is the call's recorded result, without the credential.
    let text = ok(
        &mut op,
        json!({"op": "ledger", "run": "lk-found", "limit": 1000}),
    )
    .to_string();
    assert!(
        text.contains("o-7") && !text.contains("pw-undo-secret"),
        "{text}"
    );
}

/// The executor's own principal: a token of role `executor` may run compensations and lookups
/// (`compensations`, `compensated`, `looked_up`) of every run, and nothing else: it cannot
/// admit, decide an approval, cancel, subscribe, or read a run or the ledger. `estop
/// egress-executor` under it undoes an agent's HTTP effect.
#[test]
fn an_executor_token_runs_undos_and_nothing_else() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let up = Upstream::start("127.0.0.2");
    up.orders.lock().unwrap().insert("o-1".into());
    let settings = settings(&d);
    let mut op = d.operator();
    let token = ok(
        &mut op,
        json!({"op": "token", "name": "undoer", "role": "executor"}),
    )["token"]
        .as_str()
        .unwrap()
        .to_string();
    let mut a = d.agent();
    posted_elsewhere(&mut a, "ex-run", "127.0.0.2", up.port);
    // An approval waiting, for the executor to try to decide.
    let held = admit(&mut a, "ex-held", "k", "wire_money", json!({}));
    assert_eq!(verdict(&held), "held", "{held}");
    let mut x = d.client_with(&token);
    for req in [
        json!({"op": "admit", "run": "ex-own", "key": "k", "tool": "http.GET", "args": {}}),
        json!({"op": "decide", "run": "ex-held", "key": "k", "decision": "approve"}),
        json!({"op": "cancel", "run": "ex-run"}),
        json!({"op": "subscribe", "run": "ex-run"}),
        json!({"op": "subscribe", "run": "ex-held"}),
        json!({"op": "status", "run": "ex-run"}),
        json!({"op": "report", "run": "ex-run"}),
        json!({"op": "runs"}),
        json!({"op": "ledger", "run": "ex-run"}),
        json!({"op": "token", "name": "more", "role": "operator"}),
    ] {
        assert_eq!(common::err_code(&mut x, req.clone()), "forbidden", "{req}");
    }
    assert_eq!(item(&mut op, "ex-run", "http.POST")["status"], "completed");
    let r = ok(&mut op, json!({"op": "pending"}));
    assert!(r.to_string().contains("ex-held"), "still pending: {r}");
    let _executor = Executor::start(&d, &settings, Some(&token));
    ok(&mut op, json!({"op": "subscribe", "run": "ex-run"}));
    ok(&mut op, json!({"op": "cancel", "run": "ex-run"}));
    wait_compensation(&mut op, "ex-run", "compensated");
    assert!(up.orders.lock().unwrap().is_empty());
}

/// An undo whose body needs the forward request's body: the proxy records it in the result
/// (the gate keeps it only for an effect whose `compensate_args` reads it) and the executor
/// sends exactly the refund built from it. A body over `undo_body_bytes_max` is not recorded,
/// and its undo asks a human, saying why, instead of sending a wrong one.
#[test]
fn an_undo_built_from_the_forward_requests_body() {
    let d = Daemon::start_with_policy(POLICY, &[]);
    let up = Upstream::start("127.0.0.2");
    let settings = settings(&d);
    let big = format!(
        r#"{{"amount": 9, "currency": "EUR", "memo": "{}"}}"#,
        "m".repeat(17 << 10)
    );
    std::fs::write(d.data().parent().unwrap().join("big.json"), &big).unwrap();
    let script = format!(
        "curl -sS -X POST -H 'content-type: application/json' -d '{{\"amount\": 30, \"currency\": \"EUR\"}}' \
         http://127.0.0.2:{port}/charges && echo && \
         curl -sS -X POST -H 'content-type: application/json' --data-binary @{big} \
         http://127.0.0.2:{port}/charges && echo && \
         curl -sS -X POST -H 'content-type: application/json' -d '{{\"item\": 1}}' \
         http://127.0.0.2:{port}/orders && echo posted",
        port = up.port,
        big = d.data().parent().unwrap().join("big.json").display(),
    );
    let out = Command::new(bin())
        .args(["run", "--data"])
        .arg(d.data())
        .args(["--run", "refund-a", "--policy"])
        .arg(&settings)
        .args(["--", "sh", "-c", &script])
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("ch-1") && text.contains("ch-2") && text.contains("posted"),
        "{text}"
    );
    let mut op = d.operator();
    // Recorded for the charges (one whole, one too large to record), not for the order, whose
    // undo does not read it: read from the ledger's own bytes (results are kept as JSON text).
    let mut ledger = Vec::new();
    for f in std::fs::read_dir(d.data().join("ledger")).unwrap() {
        ledger.extend(std::fs::read(f.unwrap().path()).unwrap());
    }
    let ledger = String::from_utf8_lossy(&ledger);
    assert!(ledger.contains(r#""request_body":{"amount":30,"currency":"EUR"}"#));
    assert!(ledger.contains(r#""request_body_omitted":"too_large""#));
    assert!(
        !ledger.contains(r#""item":1"#),
        "the order's body is not recorded"
    );
    // The run ended `completed`; an operator undoes it, newest first.
    let _executor = Executor::start(&d, &settings, None);
    ok(&mut op, json!({"op": "subscribe", "run": "refund-a"}));
    // One at a time (a run's saga has one head): the charge whose body was recorded first.
    let r = ok(&mut op, json!({"op": "report", "run": "refund-a"}));
    let charges: Vec<String> = r["done"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|it| it["compensate"] == "http.PUT")
        .map(|it| it["key"].as_str().unwrap().to_string())
        .collect();
    // Its completion is the last record naming its key.
    let recorded = |key: &str| {
        let at = ledger.rfind(key).unwrap();
        let next = ledger[at..].find("request_body").unwrap() + at;
        ledger[next..].starts_with("request_body\":{")
    };
    let (good, big) = if recorded(&charges[0]) {
        (&charges[0], &charges[1])
    } else {
        (&charges[1], &charges[0])
    };
    let compensate = |op: &mut Client, key: &str| {
        ok(
            op,
            json!({"op": "saga", "run": "refund-a", "key": key, "action": "compensate"}),
        );
    };
    compensate(&mut op, good);
    let done = wait_status(&mut op, "refund-a", "http.POST", "compensated");
    assert_eq!(done["key"], json!(good), "{done}");
    compensate(&mut op, big);
    let stuck = wait_status(&mut op, "refund-a", "http.POST", "needs_human");
    assert_eq!(stuck["key"], json!(big), "{stuck}");
    assert!(
        stuck["note"]
            .to_string()
            .contains("not recorded (too_large"),
        "{stuck}"
    );
    let heads = up.heads();
    let refunds: Vec<&String> = heads.iter().filter(|h| h.starts_with("PUT ")).collect();
    assert_eq!(refunds.len(), 1, "only the recorded one: {heads:?}");
    assert!(
        refunds[0].starts_with("PUT /refunds/ch-1 HTTP/1.1"),
        "{}",
        refunds[0]
    );
    assert!(
        refunds[0].ends_with(r#"{"amount":30,"currency":"EUR"}"#),
        "{}",
        refunds[0]
    );
}
