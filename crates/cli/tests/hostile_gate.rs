//! A hostile agent against the gate's own edges (SPEC §6, issue 11): the SoundGate listener as a
//! back door into protocol-v1 runs, existence leaks through `subscribe`, and the gate-wide pools
//! (connections, waiters, subscriptions) that one principal must not be able to take from the
//! others or from the operator. Each test is black-box against a real `estop serve`.

mod common;

use common::{Daemon, Wire, admit, err_code, ok, verdict};
use estop_protocol::EventKind;
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;

/// A SoundGate-wire client: one line out, one line back.
struct Sg {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl Sg {
    fn connect(d: &Daemon) -> Sg {
        let s = TcpStream::connect(d.ready_field("soundgate")).unwrap();
        Sg {
            r: BufReader::new(s.try_clone().unwrap()),
            w: s,
        }
    }

    fn call(&mut self, line: &str) -> Value {
        self.w.write_all(format!("{line}\n").as_bytes()).unwrap();
        let mut out = String::new();
        self.r.read_line(&mut out).unwrap();
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out:?}"))
    }
}

fn sg_daemon(extra: &[&str]) -> Daemon {
    let mut args = vec!["--soundgate-listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    Daemon::start_with(&args)
}

/// Finding 1: one `decide` line on the SoundGate port counted as an operator's approval of a
/// protocol-v1 agent's held effect, and its `cancel` pre-fenced run ids it had never seen.
#[test]
fn the_soundgate_listener_cannot_decide_cancel_or_close_a_v1_run() {
    let d = sg_daemon(&["--soundgate-unauthenticated-decide"]);
    let mut agent = d.agent();
    let mut op = d.operator();
    // A v1 agent's effect that needs two approvals.
    let held = admit(&mut agent, "v1-run", "w", "wire", json!({"to": "x"}));
    assert_eq!(verdict(&held), "held");

    let mut sg = Sg::connect(&d);
    let missing =
        sg.call(r#"{"op":"decide","run_id":"no-such-run","effect_key":"w","approved":true}"#);
    assert_eq!(missing["verdict"], "error", "{missing}");
    let decide = sg.call(r#"{"op":"decide","run_id":"v1-run","effect_key":"w","approved":true}"#);
    // Exactly what a missing run gets (with the run id in the message swapped).
    assert_eq!(
        decide["verdict"], "error",
        "the SoundGate listener decided a v1 effect: {decide}"
    );
    assert_eq!(
        decide["message"]
            .as_str()
            .unwrap()
            .replace("v1-run", "no-such-run"),
        missing["message"].as_str().unwrap()
    );
    let reject = sg.call(r#"{"op":"decide","run_id":"v1-run","effect_key":"w","approved":false}"#);
    assert_eq!(reject["verdict"], "error", "{reject}");
    // No approval was recorded: the quorum still needs two operators.
    let pending = ok(&mut op, json!({"op": "pending", "run": "v1-run"}));
    let item = &pending["pending"][0];
    assert_eq!(item["approvals"], json!([]), "{pending}");

    // Cancel and close reach only the listener's own runs.
    let cancel = sg.call(r#"{"op":"cancel","run_id":"v1-run"}"#);
    assert_eq!(cancel["verdict"], "error", "{cancel}");
    let close = sg.call(r#"{"op":"close","run_id":"v1-run"}"#);
    assert_eq!(close["verdict"], "error", "{close}");
    let status = ok(&mut op, json!({"op": "status", "run": "v1-run"}));
    assert_eq!(status["state"], "active", "{status}");

    // It cannot pre-fence an id it has not seen: the v1 agent's next run is not fenced.
    let fence = sg.call(r#"{"op":"cancel","run_id":"v1-next"}"#);
    assert_eq!(fence["verdict"], "error", "{fence}");
    let next = admit(&mut agent, "v1-next", "s", "search", json!({}));
    assert_eq!(verdict(&next), "admitted", "{next}");

    // Its own runs it still decides and cancels.
    assert_eq!(
        sg.call(r#"{"op":"submit","run_id":"sg-1","effect_key":"k","needs_approval":true}"#)["verdict"],
        "held_for_approval"
    );
    assert_eq!(
        sg.call(r#"{"op":"decide","run_id":"sg-1","effect_key":"k","approved":true}"#)["verdict"],
        "release"
    );
    assert_eq!(
        sg.call(r#"{"op":"cancel","run_id":"sg-1"}"#)["verdict"],
        "ack"
    );
    assert_eq!(
        sg.call(r#"{"op":"submit","run_id":"sg-1","effect_key":"k2","needs_approval":false}"#)["verdict"],
        "refused_cancelled"
    );
}

/// Unauthenticated decisions over the SoundGate wire are off unless the operator turns them
/// on; the ready line says which mode runs.
#[test]
fn soundgate_decisions_are_off_without_a_secret_or_an_explicit_flag() {
    let d = sg_daemon(&[]);
    assert_eq!(d.ready_field("soundgate_decide"), "off");
    let mut sg = Sg::connect(&d);
    assert_eq!(
        sg.call(r#"{"op":"submit","run_id":"r","effect_key":"k","needs_approval":true}"#)["verdict"],
        "held_for_approval"
    );
    let v = sg.call(r#"{"op":"decide","run_id":"r","effect_key":"k","approved":true}"#);
    assert_eq!(v["verdict"], "error", "{v}");
    assert!(
        v["message"].as_str().unwrap().contains("unauthenticated"),
        "{v}"
    );
    // Still held: an operator decides it on the operator channel.
    let mut op = d.operator();
    let pending = ok(&mut op, json!({"op": "pending"}));
    assert_eq!(pending["pending"].as_array().unwrap().len(), 1, "{pending}");

    let open = sg_daemon(&["--soundgate-unauthenticated-decide"]);
    assert_eq!(open.ready_field("soundgate_decide"), "open");
    let plain = Daemon::start();
    assert_eq!(plain.ready_field("soundgate_decide"), "-");
}

/// Finding 8: `subscribe` answered differently for another principal's run than for a run that
/// does not exist, telling an agent which run ids others use.
#[test]
fn subscribe_does_not_tell_an_agent_whether_another_principals_run_exists() {
    let d = Daemon::start();
    let mut op = d.operator();
    let other = ok(
        &mut op,
        json!({"op": "token", "name": "mallory", "role": "agent"}),
    );
    let mut victim = d.agent();
    admit(&mut victim, "secret-run", "k", "search", json!({}));
    // Something a replay would list: an effect awaiting its approval.
    assert_eq!(
        verdict(&admit(&mut victim, "secret-run", "h", "refund", json!({}))),
        "held"
    );
    // Byte for byte, on the wire: the same id, the same line.
    let mallory_token = other["token"].as_str().unwrap().to_string();
    let same_bytes = || {
        let mut s = connect_raw(&d);
        hello_raw(&mut s, &mallory_token);
        let mut r = BufReader::new(s.try_clone().unwrap());
        let mut line = |run: &str| {
            writeln!(s, "{}", json!({"id": 2, "op": "subscribe", "run": run})).unwrap();
            read_line(&mut r).expect("a reply")
        };
        let (seen, unseen) = (line("secret-run"), line("never-made"));
        assert_eq!(seen, unseen);
        assert_eq!(seen, "{\"id\":2,\"ok\":true}\n");
    };
    same_bytes();
    let mut mallory = d.client_with(other["token"].as_str().unwrap());
    let seen = mallory
        .call(json!({"op": "subscribe", "run": "secret-run"}))
        .unwrap();
    let unseen = mallory
        .call(json!({"op": "subscribe", "run": "never-made"}))
        .unwrap();
    assert_eq!(seen.ok, unseen.ok, "{} vs {}", seen.raw, unseen.raw);
    let strip = |v: &Value| {
        let mut v = v.clone();
        v.as_object_mut().unwrap().remove("id");
        v
    };
    assert_eq!(strip(&seen.raw), strip(&unseen.raw));
    // And it hears nothing of the victim's run.
    ok(
        &mut victim,
        json!({"op": "cancel", "run": "secret-run", "reason": "done"}),
    );
    assert_eq!(
        err_code(&mut mallory, json!({"op": "status", "run": "secret-run"})),
        "not_found"
    );
    // An event would have been released with the victim's reply, before this ping's.
    ok(&mut mallory, json!({"op": "ping"}));
    assert!(mallory.events.is_empty(), "{:?}", mallory.events);
    // Stopped, the victim's run still answers as a run that does not exist.
    same_bytes();
}

/// Issue 28: a client that was away (its connection closed, the gate restarted) subscribes
/// again and the reply replays what it missed: decisions made and the stop, with why.
#[test]
fn subscribe_replays_the_decisions_and_the_stop_made_while_the_subscriber_was_away() {
    let mut d = Daemon::start();
    let mut agent = d.agent();
    for k in ["k1", "k2"] {
        assert_eq!(
            verdict(&admit(&mut agent, "away", k, "refund", json!({}))),
            "held"
        );
    }
    let mut watcher = d.agent();
    let v = ok(&mut watcher, json!({"op": "subscribe", "run": "away"}));
    assert_eq!(
        (&v["state"], &v["epoch"], v.get("cause")),
        (&json!("active"), &json!(1), None),
        "{v}"
    );
    assert_eq!(
        v["awaiting"],
        json!([{"key": "k1", "status": "held", "approval": "away#1"},
               {"key": "k2", "status": "held", "approval": "away#2"}])
    );
    // The gate is killed; while the watcher is away, k1 is approved and k2 rejected.
    d.kill9();
    d.spawn();
    let mut op = d.operator();
    ok(
        &mut op,
        json!({"op": "decide", "run": "away", "key": "k1", "decision": "approve"}),
    );
    ok(
        &mut op,
        json!({"op": "decide", "run": "away", "key": "k2", "decision": "reject"}),
    );
    let mut watcher = d.agent();
    let v = ok(&mut watcher, json!({"op": "subscribe", "run": "away"}));
    assert_eq!(
        v["awaiting"],
        json!([{"key": "k1", "status": "approved", "approval": "away#1"}]),
        "k1 approved, not yet admitted; k2 decided for good: {v}"
    );
    // Killed again; the run is cancelled while the watcher is away.
    d.kill9();
    d.spawn();
    let mut op = d.operator();
    ok(
        &mut op,
        json!({"op": "cancel", "run": "away", "reason": "operator said stop"}),
    );
    let mut watcher = d.agent();
    let v = ok(&mut watcher, json!({"op": "subscribe", "run": "away"}));
    assert_eq!(
        (
            &v["state"],
            &v["epoch"],
            &v["cause"],
            &v["reason"],
            &v["awaiting"]
        ),
        (
            &json!("cancelled"),
            &json!(2),
            &json!("cancelled"),
            &json!("operator said stop"),
            &json!([])
        ),
        "{v}"
    );
}

/// Reads one line from a raw connection: `None` at end of stream.
fn read_line(r: &mut impl BufRead) -> Option<String> {
    let mut line = String::new();
    match r.read_line(&mut line) {
        Ok(0) | Err(_) => None,
        Ok(_) => Some(line),
    }
}

fn connect_raw(d: &Daemon) -> std::os::unix::net::UnixStream {
    std::os::unix::net::UnixStream::connect(d.socket()).unwrap()
}

/// Sends `hello` with `token` on a raw connection; returns the reply line.
fn hello_raw(s: &mut std::os::unix::net::UnixStream, token: &str) -> Value {
    writeln!(s, "{}", json!({"id": 1, "op": "hello", "token": token})).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    serde_json::from_str(&read_line(&mut r).expect("a reply")).unwrap()
}

/// Finding 5: idle SoundGate connections took every slot of the shared pool, so the operator's
/// CLI could not reach the Unix socket to cancel anything.
#[test]
fn idle_soundgate_connections_cannot_lock_the_operator_out() {
    let d = sg_daemon(&["--connections-max", "32"]);
    let mut idle = Vec::new();
    for _ in 0..40 {
        idle.push(TcpStream::connect(d.ready_field("soundgate")).unwrap());
    }
    // Every one of them is really open (each answers a ping), and the CLI still gets in.
    for s in idle.iter_mut().take(33) {
        s.write_all(b"{\"op\":\"ping\"}\n").unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        assert_eq!(read_line(&mut r).unwrap().trim(), r#"{"verdict":"pong"}"#);
    }
    let (code, out, err) = d.cli(&["runs"]);
    assert_eq!(code, 0, "the operator is locked out: {out}{err}");
}

/// Finding 5: one agent token could take every connection of the gate: other agents and the
/// operator were refused `connections_max`.
#[test]
fn one_agent_cannot_take_every_connection_nor_the_operators_reserve() {
    let d = Daemon::start_with(&["--connections-max", "32"]);
    let mut op = d.operator();
    let mut tokens = Vec::new();
    for name in ["a1", "a2", "a3", "a4", "a5"] {
        let t = ok(
            &mut op,
            json!({"op": "token", "name": name, "role": "agent"}),
        );
        tokens.push(t["token"].as_str().unwrap().to_string());
    }
    drop(op);
    let agent = d.token("agent.token");
    let mut held = Vec::new();
    let mut refused = None;
    for _ in 0..32 {
        let mut s = connect_raw(&d);
        let v = hello_raw(&mut s, &agent);
        if v["ok"] == true {
            held.push(s);
        } else {
            refused = Some(v);
            break;
        }
    }
    let refused = refused.expect("one agent took all 32 connections");
    assert_eq!(refused["error"]["code"], "limit_exceeded", "{refused}");
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("connections_per_principal_max"),
        "{refused}"
    );
    let share = held.len();
    assert!((1..32).contains(&share), "a share of {share}");
    // Another agent still gets in; a crowd of agents still leaves the operator's reserve.
    let mut crowd_refused = false;
    for t in &tokens {
        for _ in 0..share {
            let mut s = connect_raw(&d);
            let v = hello_raw(&mut s, t);
            if v["ok"] == true {
                held.push(s);
            } else {
                assert!(
                    v["error"]["message"]
                        .as_str()
                        .unwrap()
                        .contains("reserved for operators"),
                    "{v}"
                );
                crowd_refused = true;
            }
        }
    }
    assert!(crowd_refused, "agents took {} connections", held.len());
    let (code, out, err) = d.cli(&["runs"]);
    assert_eq!(code, 0, "the operator is locked out: {out}{err}");
    let mut op = d.operator();
    ok(&mut op, json!({"op": "ping"}));
    // Closing a connection gives its slot back.
    held.truncate(share - 1);
    let mut s = connect_raw(&d);
    let v = hello_raw(&mut s, &agent);
    assert_eq!(v["ok"], true, "{v}");
}

/// Finding 5: connections that never authenticate held their slots forever. Now each must
/// `hello` within `--hello-timeout`, and a flood of them only ever evicts the oldest silent
/// ones: a client that says `hello` at once (the operator's CLI) always gets in.
#[test]
fn connections_that_never_say_hello_are_closed_and_cannot_lock_the_operator_out() {
    let d = Daemon::start_with(&["--connections-max", "32", "--hello-timeout", "2s"]);
    let started = std::time::Instant::now();
    let silent: Vec<_> = (0..40).map(|_| connect_raw(&d)).collect();
    // The operator gets in while they sit there.
    let (code, out, err) = d.cli(&["runs"]);
    assert_eq!(code, 0, "the operator is locked out: {out}{err}");
    // Every silent one is told why and closed: the oldest evicted to make room at once, the
    // rest when their time is up.
    let (mut evicted, mut timed_out) = (0, 0);
    for s in &silent {
        s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        let line = read_line(&mut r).expect("a reason before the close");
        if line.contains("made room for a newer one") {
            evicted += 1;
        } else {
            assert!(line.contains("no hello within hello_ms_max"), "{line}");
            timed_out += 1;
        }
        assert_eq!(read_line(&mut r), None);
    }
    assert!(
        evicted > 0 && timed_out > 0,
        "{evicted} evicted, {timed_out} timed out"
    );
    assert!(started.elapsed() >= std::time::Duration::from_secs(2));
}

/// Idle connections are closed; one waiting for a decision or listening for events is not.
#[test]
fn idle_connections_are_closed_but_waiters_and_subscribers_stay() {
    let d = Daemon::start_with(&["--idle-timeout", "1s"]);
    let mut agent = d.agent();
    assert_eq!(
        verdict(&admit(&mut agent, "r", "k", "refund", json!({}))),
        "held"
    );
    let mut listener = d.agent();
    ok(&mut listener, json!({"op": "subscribe", "run": "r"}));
    let mut waiter = d.agent();
    waiter
        .send_raw(br#"{"id":7,"op":"wait","run":"r","key":"k","timeout_ms":2500}"#)
        .unwrap();
    // The idle one is told and closed.
    let started = std::time::Instant::now();
    match agent.read_line().unwrap() {
        estop_protocol::ServerLine::Reply(r) => {
            let e = r.error.expect("an error");
            assert_eq!(e.code, "limit_exceeded");
            assert!(e.message.contains("idle"), "{}", e.message);
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        agent.read_line(),
        Err(estop_server::client::ClientError::Closed)
    ));
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    // The waiter gets its answer when the wait ends, past the idle time.
    match waiter.read_line().unwrap() {
        estop_protocol::ServerLine::Reply(r) => assert!(r.ok, "{}", r.raw),
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() >= std::time::Duration::from_millis(1500));
    // The subscriber is still there, past the idle time too.
    ok(&mut listener, json!({"op": "ping"}));
}

/// Issue 28: an executor of compensations that has nothing to do for longer than the idle time
/// keeps its connection, and runs the compensation a cancel issued after that asks for. (It
/// was closed as idle: only `subscribe` kept a connection, so an idle worker lost its socket.)
#[test]
fn an_idle_executor_keeps_its_connection_and_runs_a_compensation_asked_for_later() {
    const UNDO: &str = r#"
[defaults]
unknown_tool = "allow"

[[rules]]
tool = "charge"
action = "allow"
compensate = "uncharge"
compensate_args = '{"charge": result.id}'
"#;
    let d = Daemon::start_with_policy(UNDO, &["--idle-timeout", "1s"]);
    let mut agent = d.agent();
    let v = admit(&mut agent, "undo-me", "c1", "charge", json!({"amount": 5}));
    assert_eq!(verdict(&v), "admitted", "{v}");
    let token = v["token"].as_str().unwrap().to_string();
    ok(
        &mut agent,
        json!({"op": "complete", "run": "undo-me", "key": "c1", "token": token,
               "outcome": "ok", "result": {"id": "ch_1"}}),
    );
    let mut executor = d.agent();
    ok(
        &mut executor,
        json!({"op": "compensations", "run": "undo-me"}),
    );
    // A connection that said nothing more is closed as idle: the idle time has passed.
    match agent.read_line().unwrap() {
        estop_protocol::ServerLine::Reply(r) => {
            let e = r.error.expect("an error");
            assert!(e.message.contains("idle"), "{}", e.message);
        }
        other => panic!("{other:?}"),
    }
    // Another idle time, to be sure the executor's connection outlived it.
    let mut other = d.agent();
    assert!(matches!(
        other.read_line().unwrap(),
        estop_protocol::ServerLine::Reply(r) if !r.ok
    ));
    let mut op = d.operator();
    ok(&mut op, json!({"op": "cancel", "run": "undo-me"}));
    let ev = match executor.read_line().unwrap() {
        estop_protocol::ServerLine::Event(e) => e,
        estop_protocol::ServerLine::Reply(r) => panic!("the executor was told {}", r.raw),
    };
    assert_eq!(
        (ev.event, ev.key.as_deref()),
        (EventKind::Compensate, Some("c1"))
    );
    let done = ok(
        &mut executor,
        json!({"op": "compensated", "run": "undo-me", "key": "c1", "attempt": ev.attempt, "outcome": "ok"}),
    );
    assert_eq!(done["status"], "compensated", "{done}");
}

/// Idle is counted from a connection's last line: one that speaks more often than the idle time
/// stays however long it lives (the daemon re-arms one timer per connection rather than one
/// per line, so this is what that must keep), and is closed once it falls silent.
#[test]
fn a_connection_that_keeps_speaking_is_never_idle() {
    let d = Daemon::start_with(&["--idle-timeout", "1s"]);
    let mut agent = d.agent();
    let started = std::time::Instant::now();
    // Three idle times' worth of pings, each well within one idle time of the last.
    while started.elapsed() < std::time::Duration::from_millis(3000) {
        ok(&mut agent, json!({"op": "ping"}));
        std::thread::sleep(std::time::Duration::from_millis(400));
    }
    let silent_from = std::time::Instant::now();
    match agent.read_line().unwrap() {
        estop_protocol::ServerLine::Reply(r) => {
            let e = r.error.expect("an error");
            assert!(e.message.contains("idle"), "{}", e.message);
        }
        other => panic!("{other:?}"),
    }
    // Closed about one idle time after its last line, not before.
    assert!(silent_from.elapsed() >= std::time::Duration::from_millis(500));
}

/// Finding 5: one connection could take every waiter and every subscription of the gate.
#[test]
fn one_agent_cannot_take_every_waiter_or_subscription() {
    let d = Daemon::start_with(&[
        "--waiters-max",
        "64",
        "--waiters-per-principal-max",
        "16",
        "--subscriptions-max",
        "64",
        "--subscriptions-per-principal-max",
        "16",
    ]);
    let mut op = d.operator();
    let other = ok(
        &mut op,
        json!({"op": "token", "name": "b", "role": "agent"}),
    );
    let mut a = d.agent();
    assert_eq!(
        verdict(&admit(&mut a, "ra", "k", "refund", json!({}))),
        "held"
    );
    for i in 0..16 {
        let line =
            json!({"id": 100 + i, "op": "wait", "run": "ra", "key": "k", "timeout_ms": 60_000});
        a.send_raw(line.to_string().as_bytes()).unwrap();
    }
    let r = a
        .call(json!({"op": "wait", "run": "ra", "key": "k", "timeout_ms": 60_000}))
        .unwrap();
    let e = r.error.expect("the 17th wait is refused");
    assert_eq!(e.code, "limit_exceeded");
    assert!(
        e.message.contains("waiters_per_principal_max = 16"),
        "{}",
        e.message
    );
    for i in 0..16 {
        let v = a
            .call(json!({"op": "subscribe", "run": format!("s{i}")}))
            .unwrap();
        assert!(v.ok, "{}", v.raw);
    }
    let e = a
        .call(json!({"op": "subscribe", "run": "s16"}))
        .unwrap()
        .error
        .expect("the 17th subscription is refused");
    assert!(
        e.message.contains("subscriptions_per_principal_max = 16"),
        "{}",
        e.message
    );
    // Another agent still waits and subscribes.
    let mut b = d.client_with(other["token"].as_str().unwrap());
    assert_eq!(
        verdict(&admit(&mut b, "rb", "k", "refund", json!({}))),
        "held"
    );
    let v = ok(
        &mut b,
        json!({"op": "wait", "run": "rb", "key": "k", "timeout_ms": 50}),
    );
    assert_eq!(verdict(&v), "held");
    ok(&mut b, json!({"op": "subscribe", "run": "rb"}));
    // A's disconnect gives everything back.
    drop(a);
    let mut a = d.agent();
    ok(&mut a, json!({"op": "subscribe", "run": "s16"}));
}

/// Finding 8: a panic on the core thread left a process that answered `unavailable` forever.
/// With a core panic planted (debug builds only), the real daemon ends with status 70 and says
/// why; restarted, it recovers everything that was acknowledged.
#[test]
fn a_panic_on_the_core_ends_the_daemon_and_a_restart_recovers() {
    // A first start without the plant writes the bootstrap tokens (records of their own).
    let mut d = Daemon::start();
    let mut a = d.agent();
    assert_eq!(
        verdict(&admit(&mut a, "r", "k1", "pay", json!({}))),
        "admitted"
    );
    d.kill9();
    d.spawn_env(&[("ESTOP_DEBUG_PANIC_CORE_AFTER", "2")]);
    let mut a = d.agent();
    assert_eq!(
        verdict(&admit(&mut a, "r", "k2", "pay", json!({}))),
        "admitted"
    );
    // The second record of this run panics the core: no reply comes (none is read here), and
    // the process must end rather than sit there half alive.
    a.send_raw(br#"{"id":99,"op":"admit","run":"r","key":"k3","tool":"pay","args":{}}"#)
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut child = d.child.take().unwrap();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("the daemon is still running 30 s after its core panicked (half alive)");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    // The harness copies the daemon's stderr to serve.log as it comes.
    let log = loop {
        let log = std::fs::read_to_string(d.data().join("serve.log")).unwrap_or_default();
        if log.contains("fatal:") || std::time::Instant::now() > deadline {
            break log;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(70), "{log}");
    assert!(
        log.contains("fatal: the estop-core thread panicked"),
        "{log}"
    );
    // A supervisor's restart: everything acknowledged is there.
    d.spawn();
    let mut a = d.agent();
    for k in ["k1", "k2"] {
        assert_eq!(
            verdict(&admit(&mut a, "r", k, "pay", json!({}))),
            "duplicate",
            "{k}"
        );
    }
}
