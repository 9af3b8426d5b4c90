//! Runs end (issue 11, finding 4): against a real `estop serve` with small bounds, one agent's
//! flood of runs or held approvals takes only its own share (another principal and the operator
//! still get through), stopped runs are forgotten after retention so their ids stop counting,
//! and a cancelled run's id stays fenced after it is forgotten, also after kill -9 and recovery.

mod common;

use common::{Daemon, Wire, admit, ok, verdict};
use estop_server::client::Client;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// The error of a request that must fail: (code, message).
fn refusal(c: &mut Client, req: Value) -> (String, String) {
    let r = c.call(req.clone()).unwrap();
    assert!(!r.ok, "request {req} unexpectedly succeeded: {}", r.raw);
    let e = r.error.unwrap();
    (e.code, e.message)
}

fn admit_req(run: &str, key: &str, tool: &str) -> Value {
    json!({"op": "admit", "run": run, "key": key, "tool": tool, "args": {}})
}

/// A new agent token's secret.
fn agent_token(d: &Daemon, name: &str) -> String {
    let mut op = d.operator();
    ok(
        &mut op,
        json!({"op": "token", "name": name, "role": "agent"}),
    )["token"]
        .as_str()
        .unwrap()
        .to_string()
}

/// A new agent principal's client.
fn new_agent(d: &Daemon, name: &str) -> Client {
    d.client_with(&agent_token(d, name))
}

#[test]
fn one_agent_cannot_take_every_run_or_every_held_slot() {
    let d = Daemon::start_with(&[
        "--console",
        "off",
        "--runs-max",
        "16",
        "--runs-per-principal-max",
        "8",
        "--held-per-principal-max",
        "3",
    ]);
    let mut a = d.agent();
    for i in 0..8 {
        let v = admit(&mut a, &format!("a{i}"), "k", "pay", json!({}));
        assert_eq!(verdict(&v), "admitted", "{v}");
    }
    // The ninth fresh run id of the same agent: its own share is used up.
    let (code, msg) = refusal(&mut a, admit_req("a8", "k", "pay"));
    assert_eq!(code, "limit_exceeded");
    assert!(msg.contains("runs_per_principal_max = 8"), "{msg}");

    // Another agent still gets runs.
    let mut b = new_agent(&d, "bob-agent");
    assert_eq!(
        verdict(&admit(&mut b, "b0", "k", "pay", json!({}))),
        "admitted"
    );

    // Held approvals: the agent's share of held effects, not the gate's.
    for i in 0..3 {
        let v = admit(&mut a, "a0", &format!("h{i}"), "refund", json!({"n": i}));
        assert_eq!(verdict(&v), "held", "{v}");
    }
    let (code, msg) = refusal(&mut a, admit_req("a0", "h3", "refund"));
    assert_eq!(code, "limit_exceeded");
    assert!(msg.contains("held_per_principal_max = 3"), "{msg}");
    assert_eq!(
        verdict(&admit(&mut b, "b0", "h0", "refund", json!({}))),
        "held"
    );
    // Deciding frees the slot.
    let mut op = d.operator();
    ok(
        &mut op,
        json!({"op": "decide", "run": "a0", "key": "h0", "decision": "reject"}),
    );
    assert_eq!(
        verdict(&admit(&mut a, "a0", "h3", "refund", json!({"n": 3}))),
        "held"
    );

    // Agents together may fill the gate only up to its operator reserve (1 of 16 here): the
    // operator can still fence a run id nobody has used yet.
    let mut c = new_agent(&d, "carol-agent");
    let mut made = 0;
    let msg = loop {
        let r = c.call(admit_req(&format!("c{made}"), "k", "pay")).unwrap();
        if !r.ok {
            let e = r.error.unwrap();
            assert_eq!(e.code, "limit_exceeded");
            break e.message;
        }
        made += 1;
        assert!(made <= 8, "carol got more than her share");
    };
    assert_eq!(
        made,
        16 - 1 - 8 - 1,
        "8 of agent, 1 of bob-agent, 1 reserved"
    );
    assert!(msg.contains("runs_max = 16"), "{msg}");
    assert!(msg.contains("reserved for operators"), "{msg}");
    let v = ok(&mut op, json!({"op": "cancel", "run": "squatted-later"}));
    assert_eq!(v["state"], "cancelled", "{v}");
    let (code, msg) = refusal(&mut op, json!({"op": "cancel", "run": "one-too-many"}));
    assert_eq!(code, "limit_exceeded");
    assert!(msg.contains("runs_max = 16"), "{msg}");
    // The agent's fence still refuses it: the operator's fence is a real one.
    assert_eq!(
        verdict(&admit(&mut a, "squatted-later", "k", "pay", json!({}))),
        "refused"
    );
}

/// Admits `run` until it is admitted or `limit` passes; retention is time-based, so this
/// waits for the daemon's compaction (never for its readiness).
fn admit_when_freed(c: &mut Client, run: &str, limit: Duration) -> Value {
    let start = Instant::now();
    loop {
        let r = c.call(admit_req(run, "k", "pay")).unwrap();
        if r.ok {
            return r.raw;
        }
        let e = r.error.unwrap();
        assert_eq!(e.code, "limit_exceeded", "{}", e.message);
        assert!(
            start.elapsed() < limit,
            "run ids of stopped runs were never freed after retention: {}",
            e.message
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn stopped_runs_are_forgotten_and_a_cancelled_id_stays_fenced_across_kill_9() {
    let mut d = Daemon::start_with(&[
        "--console",
        "off",
        "--runs-per-principal-max",
        "5",
        "--retention",
        "1s",
        "--tombstone-retention",
        "1h",
        "--snapshot-every",
        "7",
    ]);
    let mut a = d.agent();
    for i in 0..5 {
        let run = format!("r{i}");
        let v = admit(&mut a, &run, "k", "pay", json!({}));
        assert_eq!(verdict(&v), "admitted", "{v}");
        // Settled: a run with an effect in flight is never forgotten (it is finalizing).
        let done =
            json!({"op": "complete", "run": run, "key": "k", "token": v["token"], "outcome": "ok"});
        ok(&mut a, done);
    }
    let (code, msg) = refusal(&mut a, admit_req("fresh", "k", "pay"));
    assert_eq!(code, "limit_exceeded");
    assert!(msg.contains("runs_per_principal_max = 5"), "{msg}");

    ok(
        &mut a,
        json!({"op": "cancel", "run": "r0", "reason": "runaway"}),
    );
    for i in 1..5 {
        ok(&mut a, json!({"op": "close", "run": format!("r{i}")}));
    }
    let v = admit_when_freed(&mut a, "fresh", Duration::from_secs(30));
    assert_eq!(verdict(&v), "admitted", "{v}");

    let check_fenced = |a: &mut Client| {
        // The cancelled run's id: forgotten, still fenced, and it says so.
        let v = admit(a, "r0", "k2", "pay", json!({}));
        assert_eq!(verdict(&v), "refused", "{v}");
        assert_eq!(v["reason"], "cancelled", "{v}");
        let v = admit(a, "r0", "k", "pay", json!({}));
        assert_eq!(
            v["reason"], "cancelled",
            "a repeat of a forgotten receipt: {v}"
        );
        let s = ok(a, json!({"op": "status", "run": "r0"}));
        assert_eq!(s["state"], "cancelled", "{s}");
        assert_eq!(s["cause"], "cancelled", "{s}");
        assert_eq!(s["forgotten"], true, "{s}");
        assert!(s["stopped_at"].as_u64().is_some(), "{s}");
        let r = ok(a, json!({"op": "report", "run": "r0"}));
        assert_eq!(r["forgotten"], true, "{r}");
        assert_eq!(r["cause"], "cancelled", "{r}");
        // A sub-agent naming it as parent is fenced too.
        let v = ok(
            a,
            json!({"op": "admit", "run": format!("kid-{}", rand_suffix()), "key": "k",
                   "tool": "pay", "args": {}, "parent": "r0"}),
        );
        assert_eq!(v["reason"], "cancelled", "{v}");
        // A closed run's id refuses as closed.
        let v = admit(a, "r1", "k9", "pay", json!({}));
        assert_eq!(v["reason"], "closed", "{v}");
    };
    check_fenced(&mut a);
    // Another agent does not learn of it.
    let mut b = new_agent(&d, "other-agent");
    let (code, _) = refusal(&mut b, json!({"op": "status", "run": "r0"}));
    assert_eq!(code, "not_found");

    d.restart(); // kill -9, then recovery (snapshot + records)
    let mut a = d.agent();
    check_fenced(&mut a);
    // The forgotten runs stay freed after recovery: new runs of the agent are admitted.
    let v = admit_when_freed(&mut a, "after-restart", Duration::from_secs(30));
    assert_eq!(verdict(&v), "admitted", "{v}");
}

/// A run id no earlier call used (the kid runs are fenced at birth and forgotten later).
fn rand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// Lowering a bound and restarting must not lock the operator out: the recorded runs were
/// admitted under the old bound, recovery replays them, and only new runs are refused.
#[test]
fn a_lower_bound_after_a_restart_refuses_new_runs_and_still_recovers() {
    let mut d = Daemon::start_with(&["--console", "off", "--runs-per-principal-max", "4"]);
    let mut a = d.agent();
    for i in 0..4 {
        let v = admit(&mut a, &format!("r{i}"), "k", "pay", json!({}));
        assert_eq!(verdict(&v), "admitted", "{v}");
    }
    d.extra = ["--console", "off", "--runs-per-principal-max", "2"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    d.restart();
    let mut a = d.agent();
    let s = ok(&mut a, json!({"op": "status", "run": "r3"}));
    assert_eq!(s["state"], "active", "{s}");
    let (code, msg) = refusal(&mut a, admit_req("r4", "k", "pay"));
    assert_eq!(code, "limit_exceeded");
    assert!(msg.contains("runs_per_principal_max = 2"), "{msg}");
}

/// The CLI says a forgotten run is forgotten (status and report), and the fence refuses.
#[test]
fn the_cli_shows_what_is_left_of_a_forgotten_run() {
    let d = Daemon::start_with(&["--console", "off", "--retention", "1s"]);
    let mut a = d.agent();
    let v = admit(&mut a, "gone", "k", "pay", json!({}));
    let done =
        json!({"op": "complete", "run": "gone", "key": "k", "token": v["token"], "outcome": "ok"});
    ok(&mut a, done);
    ok(&mut a, json!({"op": "cancel", "run": "gone"}));
    let start = Instant::now();
    while ok(&mut a, json!({"op": "status", "run": "gone"}))["forgotten"] != true {
        assert!(start.elapsed() < Duration::from_secs(30), "never forgotten");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (code, out, err) = d.cli(&["status", "gone"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("forgotten    true"), "{out}");
    assert!(out.contains("cause        cancelled"), "{out}");
    let (code, out, err) = d.cli(&["report", "gone"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("forgotten after retention"), "{out}");
    let v = admit(&mut a, "gone", "k2", "pay", json!({}));
    assert_eq!(v["reason"], "cancelled", "{v}");
}

/// A connection of `token` that speaks for the sandbox of `run` (`hello {token, run}`): the
/// principal `TOKEN/RUN`, with per-principal shares of its own.
fn sandbox(d: &Daemon, token: &str, run: &str) -> Client {
    let mut c = Client::connect(&d.socket()).unwrap();
    let v = ok(&mut c, json!({"op": "hello", "token": token, "run": run}));
    assert!(
        v["principal"]
            .as_str()
            .unwrap()
            .ends_with(&format!("/{run}")),
        "{v}"
    );
    c
}

/// The holder of an agent token may speak for as many sandboxes as it names runs, each a
/// principal with full shares; together they take only the token's share (`runs_per_token_max`,
/// `held_per_token_max`), and another agent still gets runs and holds. Before the token's
/// bound, a fourth sandbox took its full share again, past what any one agent may hold.
#[test]
fn a_token_cannot_escape_its_share_through_sandbox_principals() {
    let d = Daemon::start_with(&[
        "--console",
        "off",
        "--runs-max",
        "64",
        "--runs-per-principal-max",
        "2",
        "--runs-per-token-max",
        "5",
        "--held-per-principal-max",
        "2",
        "--held-per-token-max",
        "3",
    ]);
    let mut op = d.operator();
    let mallory = agent_token(&d, "mallory");
    let mut made = 0;
    let msg = 'flood: loop {
        let mut s = sandbox(&d, &mallory, &format!("s{made}"));
        for i in 0..2 {
            let r = s
                .call(admit_req(&format!("s{made}-{i}"), "k", "pay"))
                .unwrap();
            if !r.ok {
                let e = r.error.unwrap();
                assert_eq!(e.code, "limit_exceeded", "{}", e.message);
                break 'flood e.message;
            }
            made += 1;
        }
        assert!(
            made < 20,
            "the sandboxes took {made} runs: no bound for the token"
        );
    };
    assert_eq!(made, 5, "{msg}");
    assert!(msg.contains("runs_per_token_max = 5"), "{msg}");

    // Held effects: two sandboxes, each under its own share of 2, stop at the token's 3.
    let (mut s1, mut s2) = (sandbox(&d, &mallory, "s0"), sandbox(&d, &mallory, "s2"));
    for (s, run, key) in [(0, "s0-0", "h0"), (0, "s0-0", "h1"), (1, "s2-0", "h0")] {
        let s = if s == 0 { &mut s1 } else { &mut s2 };
        let v = admit(s, run, key, "refund", json!({"key": key}));
        assert_eq!(verdict(&v), "held", "{v}");
    }
    let (code, msg) = refusal(&mut s2, admit_req("s2-0", "h1", "refund"));
    assert_eq!(code, "limit_exceeded");
    assert!(msg.contains("held_per_token_max = 3"), "{msg}");

    // Another agent is untouched by all of it.
    let mut b = new_agent(&d, "bob-agent");
    assert_eq!(
        verdict(&admit(&mut b, "b0", "k", "pay", json!({}))),
        "admitted"
    );
    assert_eq!(
        verdict(&admit(&mut b, "b0", "h0", "refund", json!({}))),
        "held"
    );
    // Deciding one of mallory's holds gives the token its room back.
    ok(
        &mut op,
        json!({"op": "decide", "run": "s0-0", "key": "h0", "decision": "reject"}),
    );
    let v = admit(&mut s2, "s2-0", "h1", "refund", json!({"key": "h1"}));
    assert_eq!(verdict(&v), "held", "{v}");
}

/// The daemon's own pools (connections, subscriptions, waiters) are shared per token too: the
/// holder of one agent token could speak for ever more sandboxes, each with a principal's full
/// share, until every agent's part of a pool was its own and another agent could not connect,
/// subscribe or wait. With the per-token share (half of each pool by default) the sandboxes
/// stop there and another agent still gets through.
#[test]
fn a_token_cannot_take_a_pool_through_sandbox_principals() {
    let d = Daemon::start_with(&[
        "--console",
        "off",
        "--connections-max",
        "64",
        "--subscriptions-max",
        "16",
        "--waiters-max",
        "16",
    ]);
    let mallory = agent_token(&d, "mallory");

    // Connections: sandbox after sandbox until the gate says no.
    let mut held = Vec::new();
    let refusal = loop {
        let mut c = Client::connect(&d.socket()).unwrap();
        let run = format!("c{}", held.len());
        let r = c
            .call(json!({"op": "hello", "token": mallory, "run": run}))
            .unwrap();
        if !r.ok {
            break r.error.unwrap();
        }
        held.push(c);
        assert!(held.len() <= 64, "the sandboxes took every connection");
    };
    assert_eq!(refusal.code, "limit_exceeded", "{}", refusal.message);
    assert_eq!(held.len(), 32, "{}", refusal.message);
    assert!(
        refusal.message.contains("connections_per_token_max = 32"),
        "{}",
        refusal.message
    );
    let mut b = new_agent(&d, "bob-agent");
    ok(&mut b, json!({"op": "ping"}));
    drop(held);
    // The room comes back as the daemon sees the connections close.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut sandboxes: Vec<Client> = Vec::new();
    while sandboxes.len() < 4 {
        let mut c = Client::connect(&d.socket()).unwrap();
        let run = format!("w{}", sandboxes.len());
        let r = c
            .call(json!({"op": "hello", "token": mallory, "run": run}))
            .unwrap();
        if r.ok {
            sandboxes.push(c);
        } else {
            assert!(Instant::now() < deadline, "no room back: {}", r.raw);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    // Subscriptions and waiters: four sandboxes with four each would take the agents' 15.
    let (mut subs, mut sub_refusal) = (0, None);
    for (i, s) in sandboxes.iter_mut().enumerate() {
        for j in 0..4 {
            let r = s
                .call(json!({"op": "subscribe", "run": format!("w{i}-{j}")}))
                .unwrap();
            match r.error {
                None => subs += 1,
                Some(e) if sub_refusal.is_none() => sub_refusal = Some(e.message),
                Some(_) => {}
            }
        }
    }
    let m = sub_refusal.expect("a subscription past the token's share is refused");
    assert_eq!(subs, 8, "{m}");
    assert!(m.contains("subscriptions_per_token_max = 8"), "{m}");
    ok(&mut b, json!({"op": "subscribe", "run": "b0"}));

    // Four waits then the admission again on each sandbox: the refused waits answer before it,
    // the registered ones keep waiting.
    let (mut waits, mut wait_refusal) = (0, None);
    for (i, s) in sandboxes.iter_mut().enumerate() {
        let run = format!("w{i}-h");
        assert_eq!(verdict(&admit(s, &run, "k", "refund", json!({}))), "held");
        for j in 0..4 {
            let line = json!({"id": 500 + j, "op": "wait", "run": run, "key": "k",
                              "timeout_ms": 60_000});
            s.send_raw(line.to_string().as_bytes()).unwrap();
        }
        // The admission again (answered by the core after the waits, unlike a ping).
        let again = json!({"id": 999, "op": "admit", "run": run, "key": "k", "tool": "refund",
                           "args": {}});
        s.send_raw(again.to_string().as_bytes()).unwrap();
        let mut refused = 0;
        loop {
            match s.read_line().unwrap() {
                estop_protocol::ServerLine::Reply(r) if r.id.as_u64() == Some(999) => break,
                estop_protocol::ServerLine::Reply(r) => {
                    let e = r.error.expect("a wait answers at once only when refused");
                    assert_eq!(e.code, "limit_exceeded", "{}", e.message);
                    wait_refusal.get_or_insert(e.message);
                    refused += 1;
                }
                estop_protocol::ServerLine::Event(_) => {}
            }
        }
        waits += 4 - refused;
    }
    let m = wait_refusal.expect("a wait past the token's share is refused");
    assert_eq!(waits, 8, "{m}");
    assert!(m.contains("waiters_per_token_max = 8"), "{m}");
    assert_eq!(
        verdict(&admit(&mut b, "b0", "h", "refund", json!({}))),
        "held"
    );
    let v = ok(
        &mut b,
        json!({"op": "wait", "run": "b0", "key": "h", "timeout_ms": 50}),
    );
    assert_eq!(verdict(&v), "held");
}
