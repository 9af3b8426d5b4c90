//! End-to-end tests: the real `estop serve` over its Unix socket, as an agent and operators
//! would use it, including kill -9 and restart.

mod common;

use common::{Daemon, Wire, admit, err_code, ok, verdict};
use serde_json::json;
use std::time::{Duration, Instant};

#[test]
fn ready_line_names_socket_tcp_soundgate_and_data() {
    let d = Daemon::start_with(&[
        "--listen",
        "127.0.0.1:0",
        "--soundgate-listen",
        "127.0.0.1:0",
    ]);
    assert!(d.ready.starts_with("estop ready socket="), "{}", d.ready);
    assert_eq!(
        d.ready_field("socket"),
        d.socket().replace(
            &*d.data().display().to_string(),
            &std::fs::canonicalize(d.data())
                .unwrap()
                .display()
                .to_string()
        )
    );
    assert!(d.ready_field("tcp").starts_with("127.0.0.1:"));
    assert!(d.ready_field("soundgate").starts_with("127.0.0.1:"));
    assert_ne!(
        d.ready_field("tcp"),
        "127.0.0.1:0",
        "the real port is resolved"
    );
    // The TCP listener speaks protocol v1 too.
    let mut c =
        estop_server::client::Client::connect_as(&d.ready_field("tcp"), &d.token("agent.token"))
            .unwrap();
    assert_eq!(
        verdict(&admit(&mut c, "r", "k", "pay", json!({}))),
        "admitted"
    );
}

#[test]
fn hello_is_required_and_roles_are_reported() {
    let d = Daemon::start();
    let mut c = estop_server::client::Client::connect(&d.socket()).unwrap();
    assert_eq!(
        err_code(&mut c, json!({"op": "status", "run": "r"})),
        "unauthenticated"
    );
    assert_eq!(
        err_code(&mut c, json!({"op": "hello", "token": "wrong"})),
        "unauthenticated"
    );
    ok(&mut c, json!({"op": "ping"}));
    let h = ok(
        &mut c,
        json!({"op": "hello", "token": d.token("agent.token")}),
    );
    assert_eq!(
        (h["role"].as_str(), h["principal"].as_str()),
        (Some("agent"), Some("agent"))
    );
    let h = ok(
        &mut d.operator(),
        json!({"op": "hello", "token": d.token("operator.token")}),
    );
    assert_eq!(
        (h["role"].as_str(), h["principal"].as_str()),
        (Some("operator"), Some("admin"))
    );
}

#[test]
fn approval_flow_with_sibling_hold_and_receipts() {
    let d = Daemon::start();
    let mut a = d.agent();
    let mut op = d.operator();
    let held = admit(&mut a, "r1", "k1", "refund", json!({"amount": 120}));
    assert_eq!(
        (verdict(&held), held["reason"].as_str()),
        ("held", Some("approval"))
    );
    assert!(held["expires_at"].as_u64().unwrap() > 0);
    // A parallel sibling write is held too (G1); a read proceeds.
    let sib = admit(&mut a, "r1", "k2", "pay", json!({"to": "bob"}));
    assert_eq!(
        (verdict(&sib), sib["reason"].as_str()),
        ("held", Some("sibling"))
    );
    assert_eq!(
        verdict(&admit(&mut a, "r1", "k3", "search_web", json!({"q": "x"}))),
        "admitted"
    );
    // The inbox shows the exact call.
    let p = ok(&mut op, json!({"op": "pending"}));
    let item = &p["pending"][0];
    assert_eq!(
        (item["tool"].as_str(), item["args"]["amount"].as_i64()),
        (Some("refund"), Some(120))
    );
    assert_eq!(item["digest"].as_str().unwrap().len(), 64);
    let dec = ok(
        &mut op,
        json!({"op": "decide", "run": "r1", "key": "k1", "decision": "approve"}),
    );
    assert_eq!(dec["status"], "approved");
    // wait returns admitted exactly once; the sibling proceeds.
    let w = ok(
        &mut a,
        json!({"op": "wait", "run": "r1", "key": "k1", "timeout_ms": 5000}),
    );
    assert_eq!(verdict(&w), "admitted");
    let w = ok(
        &mut a,
        json!({"op": "wait", "run": "r1", "key": "k2", "timeout_ms": 5000}),
    );
    assert_eq!(verdict(&w), "admitted");
    let token = w["token"].as_str().unwrap().to_string();
    ok(
        &mut a,
        json!({"op": "complete", "run": "r1", "key": "k2", "token": token, "outcome": "ok", "result": {"id": 7}}),
    );
    let again = admit(&mut a, "r1", "k2", "pay", json!({"to": "bob"}));
    assert_eq!(
        (
            verdict(&again),
            again["status"].as_str(),
            again["result"]["id"].as_i64()
        ),
        ("duplicate", Some("completed"), Some(7))
    );
    let mismatch = admit(&mut a, "r1", "k2", "pay", json!({"to": "eve"}));
    assert_eq!(
        (verdict(&mismatch), mismatch["reason"].as_str()),
        ("refused", Some("mismatch"))
    );
    let again = admit(&mut a, "r1", "k1", "refund", json!({"amount": 120}));
    assert_eq!(
        (verdict(&again), again["status"].as_str()),
        ("duplicate", Some("in_progress"))
    );
}

#[test]
fn wait_blocks_until_decided_without_blocking_the_connection() {
    let d = Daemon::start();
    let mut a = d.agent();
    admit(&mut a, "r1", "k1", "refund", json!({}));
    // Send a long wait, then a ping on the same connection: the ping is answered first.
    a.send_raw(br#"{"id":"w","op":"wait","run":"r1","key":"k1","timeout_ms":60000}"#)
        .unwrap();
    a.send_raw(br#"{"id":"p","op":"ping"}"#).unwrap();
    let first = match a.read_line().unwrap() {
        estop_protocol::ServerLine::Reply(r) => r,
        e => panic!("{e:?}"),
    };
    assert_eq!(first.id.as_json(), "\"p\"");
    let started = Instant::now();
    let mut op = d.operator();
    ok(
        &mut op,
        json!({"op": "decide", "run": "r1", "key": "k1", "decision": "reject", "reason": "no"}),
    );
    let w = match a.read_line().unwrap() {
        estop_protocol::ServerLine::Reply(r) => r,
        e => panic!("{e:?}"),
    };
    assert_eq!(w.id.as_json(), "\"w\"");
    assert_eq!(
        (w.raw["verdict"].as_str(), w.raw["reason"].as_str()),
        (Some("refused"), Some("rejected"))
    );
    assert!(started.elapsed() < Duration::from_secs(30));
    // A timed-out wait answers held again.
    admit(&mut a, "r1", "k9", "refund", json!({"n": 1}));
    let w = ok(
        &mut a,
        json!({"op": "wait", "run": "r1", "key": "k9", "timeout_ms": 50}),
    );
    assert_eq!(verdict(&w), "held");
}

#[test]
fn reject_sticks_for_the_same_call_under_a_new_key() {
    let d = Daemon::start();
    let mut a = d.agent();
    let mut op = d.operator();
    admit(&mut a, "r1", "k1", "refund", json!({"amount": 9}));
    ok(
        &mut op,
        json!({"op": "decide", "run": "r1", "key": "k1", "decision": "reject"}),
    );
    let v = admit(&mut a, "r1", "k-new", "refund", json!({"amount": 9}));
    assert_eq!(
        (verdict(&v), v["reason"].as_str()),
        ("refused", Some("rejected"))
    );
    let v = admit(&mut a, "r1", "k-other", "refund", json!({"amount": 10}));
    assert_eq!(verdict(&v), "held");
}

#[test]
fn quorum_two_needs_two_operator_principals() {
    let d = Daemon::start();
    let (code, secret, stderr) = d.cli(&["token", "create", "bob", "--role", "operator"]);
    assert_eq!(code, 0, "{stderr}");
    let bob_token = secret.trim().to_string();
    let mut a = d.agent();
    let mut admin = d.operator();
    let mut bob = d.client_with(&bob_token);
    assert_eq!(
        verdict(&admit(&mut a, "r1", "k1", "wire", json!({"usd": 1000000}))),
        "held"
    );
    let v = ok(
        &mut admin,
        json!({"op": "decide", "run": "r1", "key": "k1", "decision": "approve"}),
    );
    assert_eq!(v["status"], "held");
    // The same principal deciding twice never meets a quorum.
    assert_eq!(
        err_code(
            &mut admin,
            json!({"op": "decide", "run": "r1", "key": "k1", "decision": "approve"})
        ),
        "conflict"
    );
    let mut admin2 = d.operator();
    assert_eq!(
        err_code(
            &mut admin2,
            json!({"op": "decide", "run": "r1", "key": "k1", "decision": "approve"})
        ),
        "conflict"
    );
    assert_eq!(
        verdict(&ok(
            &mut a,
            json!({"op": "wait", "run": "r1", "key": "k1", "timeout_ms": 0})
        )),
        "held"
    );
    let v = ok(
        &mut bob,
        json!({"op": "decide", "run": "r1", "key": "k1", "decision": "approve"}),
    );
    assert_eq!(v["status"], "approved");
    assert_eq!(v["approvals"], json!(["admin", "bob"]));
    assert_eq!(
        verdict(&ok(
            &mut a,
            json!({"op": "wait", "run": "r1", "key": "k1", "timeout_ms": 1000})
        )),
        "admitted"
    );
}

#[test]
fn agents_cannot_approve_resume_or_touch_other_agents_runs() {
    let d = Daemon::start();
    let (_, other, _) = d.cli(&["token", "create", "agent2", "--role", "agent"]);
    let mut a = d.agent();
    let mut b = d.client_with(other.trim());
    admit(&mut a, "r1", "k1", "refund", json!({}));
    assert_eq!(
        err_code(
            &mut a,
            json!({"op": "decide", "run": "r1", "key": "k1", "decision": "approve"})
        ),
        "forbidden"
    );
    assert_eq!(
        err_code(&mut a, json!({"op": "resume", "run": "r1"})),
        "forbidden"
    );
    assert_eq!(
        err_code(
            &mut a,
            json!({"op": "token", "name": "x", "role": "operator"})
        ),
        "forbidden"
    );
    assert_eq!(
        err_code(&mut b, json!({"op": "status", "run": "r1"})),
        "not_found"
    );
    assert_eq!(
        err_code(&mut b, json!({"op": "cancel", "run": "r1"})),
        "not_found"
    );
    assert_eq!(
        err_code(
            &mut b,
            json!({"op": "admit", "run": "r1", "key": "x", "tool": "pay", "args": {}})
        ),
        "not_found"
    );
    // An agent may always stop itself.
    let v = ok(
        &mut a,
        json!({"op": "cancel", "run": "r1", "reason": "done"}),
    );
    assert_eq!(v["state"], "cancelled");
}

#[test]
fn cancel_fences_children_and_two_phase_tokens() {
    let d = Daemon::start();
    let mut a = d.agent();
    let mut op = d.operator();
    let prep = ok(
        &mut a,
        json!({"op": "admit", "run": "root", "key": "p", "tool": "pay", "args": {}, "start": false}),
    );
    let token = prep["token"].as_str().unwrap().to_string();
    let child = ok(
        &mut a,
        json!({"op": "admit", "run": "child", "key": "c", "tool": "pay", "args": {}, "parent": "root"}),
    );
    let ctoken = child["token"].as_str().unwrap().to_string();
    let mut sub = d.agent();
    ok(&mut sub, json!({"op": "subscribe", "run": "child"}));
    let v = ok(
        &mut op,
        json!({"op": "cancel", "run": "root", "reason": "operator stop"}),
    );
    assert_eq!(v["runs"], json!(["root", "child"]));
    let ev = sub.next_event().unwrap().unwrap();
    assert_eq!(ev.run, "child");
    let v = ok(
        &mut a,
        json!({"op": "start", "run": "root", "key": "p", "token": token}),
    );
    assert_eq!(
        (verdict(&v), v["reason"].as_str()),
        ("refused", Some("cancelled"))
    );
    let v = admit(&mut a, "child", "new", "pay", json!({}));
    assert_eq!(
        (verdict(&v), v["reason"].as_str()),
        ("refused", Some("cancelled"))
    );
    let v = ok(
        &mut a,
        json!({"op": "admit", "run": "grandchild", "key": "g", "tool": "pay", "args": {}, "parent": "child"}),
    );
    assert_eq!(verdict(&v), "refused");
    // The in-flight child effect settles late and shows in the report.
    let v = ok(
        &mut a,
        json!({"op": "complete", "run": "child", "key": "c", "token": ctoken, "outcome": "ok"}),
    );
    assert_eq!(v["late"], true);
    let r = ok(&mut op, json!({"op": "report", "run": "child"}));
    assert_eq!(r["state"], "cancelled");
    assert_eq!(r["done"][0]["late"], true);
    let r = ok(&mut op, json!({"op": "report", "run": "root"}));
    assert_eq!(r["refused"][0]["reason"], "cancelled");
}

#[test]
fn held_approval_survives_kill9_and_is_admitted_once_after_restart() {
    let mut d = Daemon::start();
    {
        let mut a = d.agent();
        assert_eq!(
            verdict(&admit(&mut a, "r1", "k1", "refund", json!({"amount": 500}))),
            "held"
        );
        assert_eq!(
            verdict(&admit(&mut a, "r2", "k1", "pay", json!({}))),
            "admitted"
        );
        let mut op = d.operator();
        ok(&mut op, json!({"op": "cancel", "run": "r2"}));
        assert_eq!(
            verdict(&admit(&mut a, "r3", "k1", "wire", json!({"usd": 5}))),
            "held"
        );
        ok(
            &mut op,
            json!({"op": "decide", "run": "r3", "key": "k1", "decision": "approve"}),
        );
    }
    d.restart();
    let mut a = d.agent();
    let mut op = d.operator();
    let p = ok(&mut op, json!({"op": "pending"}));
    let keys: Vec<_> = p["pending"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x["run"].as_str().unwrap().to_string(),
                x["approvals"].clone(),
            )
        })
        .collect();
    assert_eq!(
        keys,
        vec![
            ("r1".to_string(), json!([])),
            ("r3".to_string(), json!(["admin"]))
        ]
    );
    // The cancel acknowledged before the crash still fences.
    let v = admit(&mut a, "r2", "k2", "pay", json!({}));
    assert_eq!(
        (verdict(&v), v["reason"].as_str()),
        ("refused", Some("cancelled"))
    );
    // Approve after restart: wait admits exactly once.
    ok(
        &mut op,
        json!({"op": "decide", "run": "r1", "key": "k1", "decision": "approve"}),
    );
    assert_eq!(
        verdict(&ok(
            &mut a,
            json!({"op": "wait", "run": "r1", "key": "k1", "timeout_ms": 1000})
        )),
        "admitted"
    );
    d.restart();
    let mut a = d.agent();
    let v = ok(
        &mut a,
        json!({"op": "wait", "run": "r1", "key": "k1", "timeout_ms": 100}),
    );
    assert_eq!(
        (verdict(&v), v["status"].as_str()),
        ("duplicate", Some("in_progress"))
    );
}

#[test]
fn kill9_under_load_loses_nothing_acknowledged_and_admits_nothing_twice() {
    let mut d = Daemon::start();
    // Approvals are pending while the load runs and the daemon is killed.
    let mut held = d.agent();
    for i in 0..5 {
        assert_eq!(
            verdict(&admit(
                &mut held,
                &format!("held{i}"),
                "k",
                "refund",
                json!({"i": i})
            )),
            "held"
        );
    }
    let threads = 8;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut handles = Vec::new();
    for t in 0..threads {
        let socket = d.socket();
        let token = d.token("agent.token");
        let stop = std::sync::Arc::clone(&stop);
        handles.push(std::thread::spawn(move || {
            let mut acked = Vec::new();
            let Ok(mut c) = estop_server::client::Client::connect_as(&socket, &token) else { return acked };
            for i in 0.. {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                let key = format!("k{i}");
                match c.call(json!({"op": "admit", "run": format!("load{t}"), "key": key, "tool": "pay", "args": {"i": i}})) {
                    Ok(r) if r.raw["verdict"] == "admitted" => acked.push(key),
                    Ok(r) => panic!("unexpected reply under load: {}", r.raw),
                    Err(_) => break,
                }
            }
            acked
        }));
    }
    // Let some load happen (progress is observed, not slept for), then kill -9.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut probe = d.operator();
    loop {
        let runs = ok(&mut probe, json!({"op": "runs"}));
        let admitted: u64 = runs["runs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["effects"]["started"].as_u64().unwrap())
            .sum();
        if admitted >= 500 || Instant::now() > deadline {
            break;
        }
    }
    d.kill9();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let acked: Vec<Vec<String>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let total: usize = acked.iter().map(Vec::len).sum();
    assert!(total > 0, "no admission was acknowledged before the kill");
    d.spawn();
    let mut a = d.agent();
    for (t, keys) in acked.iter().enumerate() {
        for (i, key) in keys.iter().enumerate() {
            let v = ok(
                &mut a,
                json!({"op": "admit", "run": format!("load{t}"), "key": key, "tool": "pay", "args": {"i": i}}),
            );
            assert_eq!(
                (verdict(&v), v["status"].as_str()),
                ("duplicate", Some("in_progress")),
                "acknowledged admission {t}/{key} lost"
            );
        }
    }
    let verify = std::process::Command::new(common::bin())
        .args(["ledger", "verify", "--data"])
        .arg(d.data())
        .output()
        .unwrap();
    assert!(
        verify.status.success(),
        "{}",
        String::from_utf8_lossy(&verify.stdout)
    );
    let mut op = d.operator();
    let pending = ok(&mut op, json!({"op": "pending"}));
    assert_eq!(pending["pending"].as_array().unwrap().len(), 5, "{pending}");
}

#[test]
fn a_bad_policy_is_refused_at_start_with_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("bad.toml");
    std::fs::write(
        &policy,
        "[defaults]\nunknown_tool = \"approve\"\n\n[[rules]]\ntool = \"refund\"\nwhen = \"args.amount >\"\naction = \"approve\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(common::bin())
        .args(["serve", "--data"])
        .arg(dir.path().join("data"))
        .arg("--policy")
        .arg(&policy)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("bad.toml:6:"),
        "the error names the file and line: {stderr}"
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("estop ready"));
}

#[test]
fn malformed_input_gets_errors_and_the_connection_stays_usable() {
    let d = Daemon::start_with(&["--line-bytes-max", "1024"]);
    let mut a = d.agent();
    let cases: &[(&[u8], &str)] = &[
        (b"{not json", "bad_json"),
        (br#"{"id":1,"op":"fly"}"#, "unknown_op"),
        (br#"{"id":2,"op":"admit","run":"r"}"#, "missing_field"),
        (
            br#"{"id":3,"op":"admit","run":"r","key":"k","tool":"pay","args":{},"digest":"00"}"#,
            "invalid_field",
        ),
    ];
    for (line, code) in cases {
        a.send_raw(line).unwrap();
        match a.read_line().unwrap() {
            estop_protocol::ServerLine::Reply(r) => assert_eq!(
                r.error.unwrap().code,
                *code,
                "{}",
                String::from_utf8_lossy(line)
            ),
            e => panic!("{e:?}"),
        }
    }
    let long = format!(r#"{{"id":4,"op":"ping","pad":"{}"}}"#, "x".repeat(4000));
    a.send_raw(long.as_bytes()).unwrap();
    match a.read_line().unwrap() {
        estop_protocol::ServerLine::Reply(r) => assert_eq!(r.error.unwrap().code, "line_too_long"),
        e => panic!("{e:?}"),
    }
    assert_eq!(
        verdict(&admit(&mut a, "r", "k", "pay", json!({}))),
        "admitted"
    );
    // Nothing was half-applied: only the one admission is in the ledger (after the bootstrap
    // tokens' records).
    let mut op = d.operator();
    let l = ok(&mut op, json!({"op": "ledger"}));
    let kinds: Vec<&str> = l["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["token_create", "token_create", "admit"]);
}

#[test]
fn bounds_give_clear_errors() {
    let d = Daemon::start_with(&["--connections-max", "3"]);
    let mut a = d.agent();
    assert_eq!(
        err_code(
            &mut a,
            json!({"op": "wait", "run": "r", "key": "k", "timeout_ms": 999_999_999})
        ),
        "limit_exceeded"
    );
    // Agents may hold 1 of 3 (the rest is the operators' reserve and room to say hello).
    let mut b = estop_server::client::Client::connect(&d.socket()).unwrap();
    let refused = b
        .call(json!({"op": "hello", "token": d.token("agent.token")}))
        .unwrap();
    assert_eq!(refused.error.unwrap().code, "limit_exceeded");
    let _b = d.operator();
    // A second operator session is over the operator's share too (refused at hello), but its
    // connection stays open and holds a slot of the pool.
    let mut _c = estop_server::client::Client::connect(&d.socket()).unwrap();
    let refused = _c
        .call(json!({"op": "hello", "token": d.token("operator.token")}))
        .unwrap();
    assert_eq!(refused.error.unwrap().code, "limit_exceeded");
    let mut over = estop_server::client::Client::connect(&d.socket()).unwrap();
    match over.read_line().unwrap() {
        estop_protocol::ServerLine::Reply(r) => assert_eq!(r.error.unwrap().code, "limit_exceeded"),
        e => panic!("{e:?}"),
    }
    // Policy deny is a refusal, recorded.
    let v = admit(&mut a, "r", "drop", "drop_table", json!({}));
    assert_eq!(
        (verdict(&v), v["reason"].as_str()),
        ("refused", Some("denied"))
    );
}

#[test]
fn sigterm_exits_zero_and_keeps_state() {
    let mut d = Daemon::start();
    let mut a = d.agent();
    admit(&mut a, "r1", "k1", "refund", json!({}));
    drop(a);
    assert_eq!(d.terminate(), Some(0));
    d.spawn();
    let mut op = d.operator();
    assert_eq!(
        ok(&mut op, json!({"op": "pending"}))["pending"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
}

#[test]
fn cli_exit_codes_mean_something() {
    let d = Daemon::start();
    let mut a = d.agent();
    admit(&mut a, "r1", "k1", "refund", json!({"amount": 1}));
    let (code, out, _) = d.cli(&["pending"]);
    assert_eq!(code, 0);
    assert!(out.contains("refund"), "{out}");
    assert_eq!(d.cli(&["approve", "r1", "nope"]).0, 4);
    assert_eq!(d.cli(&["approve", "r1", "k1"]).0, 0);
    assert_eq!(d.cli(&["approve", "r1", "k1"]).0, 3);
    assert_eq!(d.cli(&["bogus"]).0, 2);
    let (code, out, _) = d.cli(&["report", "r1", "--json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["run"], "r1");
    let (code, out, _) = d.cli(&["ledger", "show", "--run", "r1"]);
    assert_eq!(code, 0);
    assert!(out.contains("admit") && out.contains("decide"), "{out}");
}

#[test]
fn soundgate_clients_run_unchanged() {
    let d = Daemon::start_with(&[
        "--soundgate-listen",
        "127.0.0.1:0",
        "--soundgate-unauthenticated-decide",
    ]);
    let addr = d.ready_field("soundgate");
    let s = std::net::TcpStream::connect(&addr).unwrap();
    let mut r = std::io::BufReader::new(s.try_clone().unwrap());
    let mut w = s;
    let mut call = |line: &str| -> serde_json::Value {
        use std::io::{BufRead, Write};
        w.write_all(format!("{line}\n").as_bytes()).unwrap();
        let mut out = String::new();
        r.read_line(&mut out).unwrap();
        serde_json::from_str(&out).unwrap()
    };
    assert_eq!(call(r#"{"op":"ping"}"#)["verdict"], "pong");
    assert_eq!(
        call(r#"{"op":"submit","run_id":"1","effect_key":"a","needs_approval":false}"#)["verdict"],
        "release"
    );
    assert_eq!(
        call(r#"{"op":"submit","run_id":"1","effect_key":"a","needs_approval":false}"#)["verdict"],
        "refused_duplicate"
    );
    // Held effects of a run hold its other writes (estop's sibling rule) — submit b in run 2.
    assert_eq!(
        call(r#"{"op":"submit","run_id":"2","effect_key":"b","needs_approval":true}"#)["verdict"],
        "held_for_approval"
    );
    assert_eq!(
        call(r#"{"op":"decide","run_id":"2","effect_key":"b","approved":true}"#)["verdict"],
        "release"
    );
    assert_eq!(
        call(r#"{"op":"submit","run_id":"2","effect_key":"b","needs_approval":true}"#)["verdict"],
        "refused_duplicate"
    );
    assert_eq!(
        call(r#"{"op":"submit","run_id":"3","effect_key":"c","needs_approval":true}"#)["verdict"],
        "held_for_approval"
    );
    assert_eq!(
        call(r#"{"op":"decide","run_id":"3","effect_key":"c","approved":false}"#)["verdict"],
        "refused_rejected"
    );
    assert_eq!(
        call(r#"{"op":"submit","run_id":"3","effect_key":"c","needs_approval":true}"#)["verdict"],
        "refused_rejected"
    );
    // The listener is its own tenant: it fences its own runs, never an id it has not seen.
    assert_eq!(call(r#"{"op":"cancel","run_id":"4"}"#)["verdict"], "error");
    assert_eq!(
        call(r#"{"op":"submit","run_id":"4","effect_key":"y","needs_approval":false}"#)["verdict"],
        "release"
    );
    assert_eq!(call(r#"{"op":"cancel","run_id":"4"}"#)["verdict"], "ack");
    assert_eq!(
        call(r#"{"op":"submit","run_id":"4","effect_key":"z","needs_approval":false}"#)["verdict"],
        "refused_cancelled"
    );
    // Policy only strengthens: `refund` needs approval whatever the client says.
    assert_eq!(
        call(r#"{"op":"submit","run_id":"5","effect_key":"refund","needs_approval":false}"#)["verdict"],
        "held_for_approval"
    );
    assert_eq!(call(r#"{"op":"nope"}"#)["verdict"], "error");
}

#[test]
fn soundgate_decide_requires_a_valid_mac_when_a_secret_is_set() {
    let dir_secret = "s3cret";
    let mut d = Daemon::start_with(&[]);
    d.kill9();
    d.extra = vec!["--soundgate-listen".into(), "127.0.0.1:0".into()];
    // SAFETY of env: the child inherits this variable; tests in this binary do not rely on it otherwise.
    let mut cmd_env = std::process::Command::new("true");
    cmd_env.env("ESTOP_SOUNDGATE_SECRET", dir_secret);
    unsafe_env_free_spawn(&mut d, dir_secret);
    let addr = d.ready_field("soundgate");
    let s = std::net::TcpStream::connect(&addr).unwrap();
    let mut r = std::io::BufReader::new(s.try_clone().unwrap());
    let mut w = s;
    let mut call = |line: &str| -> serde_json::Value {
        use std::io::{BufRead, Write};
        w.write_all(format!("{line}\n").as_bytes()).unwrap();
        let mut out = String::new();
        r.read_line(&mut out).unwrap();
        serde_json::from_str(&out).unwrap()
    };
    assert_eq!(
        call(r#"{"op":"submit","run_id":"1","effect_key":"a","needs_approval":true}"#)["verdict"],
        "held_for_approval"
    );
    let forged =
        call(r#"{"op":"decide","run_id":"1","effect_key":"a","approved":true,"mac":"00"}"#);
    assert_eq!(forged["verdict"], "error");
    assert_eq!(
        call(r#"{"op":"decide","run_id":"1","effect_key":"a","approved":true}"#)["verdict"],
        "error"
    );
    let mac = estop_protocol::soundgate::decision_tag_hex(dir_secret.as_bytes(), "1", "a", true);
    let good = call(&format!(
        r#"{{"op":"decide","run_id":"1","effect_key":"a","approved":true,"mac":"{mac}"}}"#
    ));
    assert_eq!(good["verdict"], "release");
}

/// Starts the daemon with the SoundGate secret in its environment (not this process's).
fn unsafe_env_free_spawn(d: &mut Daemon, secret: &str) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(common::bin())
        .arg("serve")
        .arg("--data")
        .arg(d.data())
        .args(&d.extra)
        .env("ESTOP_SOUNDGATE_SECRET", secret)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(line.starts_with("estop ready"), "{line}");
    d.ready = line.trim().to_string();
    d.child = Some(child);
}

#[test]
fn approval_expiry_and_deadline_are_enforced_by_the_clock() {
    // Same daemon, restarted on a policy with a short approval expiry.
    let mut d = Daemon::start();
    d.kill9();
    std::fs::write(
        d.data().join("policy.toml"),
        "[defaults]\nunknown_tool = \"approve\"\napproval_expiry = \"300ms\"\n[[rules]]\ntool = \"pay\"\naction = \"allow\"\n",
    )
    .unwrap();
    d.spawn();
    let mut a = d.agent();
    assert_eq!(
        verdict(&admit(&mut a, "r1", "k1", "email", json!({}))),
        "held"
    );
    // Silence is no: the wait returns refused/expired once the approval expires.
    let w = ok(
        &mut a,
        json!({"op": "wait", "run": "r1", "key": "k1", "timeout_ms": 30000}),
    );
    assert_eq!(
        (verdict(&w), w["reason"].as_str()),
        ("refused", Some("expired"))
    );
    let mut op = d.operator();
    assert_eq!(
        err_code(
            &mut op,
            json!({"op": "decide", "run": "r1", "key": "k1", "decision": "approve"})
        ),
        "not_pending"
    );
    // A run deadline fences the run like a cancel, and subscribers hear of it.
    let v = ok(
        &mut a,
        json!({"op": "admit", "run": "r2", "key": "k1", "tool": "pay", "args": {}, "limits": {"timeout_ms": 300}}),
    );
    assert_eq!(verdict(&v), "admitted");
    ok(&mut a, json!({"op": "subscribe", "run": "r2"}));
    let ev = a.next_event().unwrap().unwrap();
    assert_eq!(
        (ev.run.as_str(), ev.reason.as_deref()),
        ("r2", Some("deadline"))
    );
    let v = admit(&mut a, "r2", "k2", "pay", json!({}));
    assert_eq!(
        (verdict(&v), v["reason"].as_str()),
        ("refused", Some("deadline"))
    );
}

#[test]
fn recovery_from_a_snapshot_keeps_everything() {
    let mut d = Daemon::start_with(&["--snapshot-every", "10"]);
    {
        let mut a = d.agent();
        for i in 0..45 {
            assert_eq!(
                verdict(&admit(
                    &mut a,
                    "r1",
                    &format!("k{i}"),
                    "pay",
                    json!({"i": i})
                )),
                "admitted"
            );
        }
        assert_eq!(
            verdict(&admit(&mut a, "r1", "held", "refund", json!({}))),
            "held"
        );
    }
    d.restart();
    let verify = std::process::Command::new(common::bin())
        .args(["ledger", "verify", "--json", "--data"])
        .arg(d.data())
        .output()
        .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&verify.stdout).unwrap();
    assert!(
        report["snapshot_seq"].as_u64().unwrap_or(0) >= 10,
        "{report}"
    );
    let mut a = d.agent();
    for i in 0..45 {
        let v = admit(&mut a, "r1", &format!("k{i}"), "pay", json!({"i": i}));
        assert_eq!(v["status"], "in_progress", "k{i}: {v}");
    }
    let mut op = d.operator();
    assert_eq!(
        ok(&mut op, json!({"op": "pending"}))["pending"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
}

#[test]
fn wait_on_a_held_start_blocks_until_start_would_go() {
    let d = Daemon::start();
    let mut a = d.agent();
    let mut op = d.operator();
    let prep = ok(
        &mut a,
        json!({"op": "admit", "run": "r1", "key": "p", "tool": "pay", "args": {}, "start": false}),
    );
    let token = prep["token"].as_str().unwrap().to_string();
    ok(&mut op, json!({"op": "pause", "run": "r1"}));
    let v = ok(
        &mut a,
        json!({"op": "start", "run": "r1", "key": "p", "token": token}),
    );
    assert_eq!(
        (verdict(&v), v["reason"].as_str()),
        ("held", Some("paused"))
    );
    // While paused, wait holds (it does not answer admitted at once).
    let v = ok(
        &mut a,
        json!({"op": "wait", "run": "r1", "key": "p", "timeout_ms": 100}),
    );
    assert_eq!(
        (verdict(&v), v["reason"].as_str()),
        ("held", Some("paused"))
    );
    a.send_raw(br#"{"id":"w","op":"wait","run":"r1","key":"p","timeout_ms":30000}"#)
        .unwrap();
    ok(&mut op, json!({"op": "resume", "run": "r1"}));
    let w = loop {
        match a.read_line().unwrap() {
            estop_protocol::ServerLine::Reply(r) if r.id.as_json() == "\"w\"" => break r,
            _ => continue,
        }
    };
    assert_eq!(
        (w.raw["verdict"].as_str(), w.raw["token"].as_str()),
        (Some("admitted"), Some(token.as_str()))
    );
    assert_eq!(
        verdict(&ok(
            &mut a,
            json!({"op": "start", "run": "r1", "key": "p", "token": token})
        )),
        "go"
    );
}

#[test]
fn subscribe_before_the_first_admit_and_events_carry_their_details() {
    let d = Daemon::start();
    let mut a = d.agent();
    let mut watcher = d.agent();
    let mut op = d.operator();
    let v = ok(&mut watcher, json!({"op": "subscribe", "run": "later"}));
    assert!(v.get("state").is_none(), "{v}");
    assert_eq!(
        verdict(&admit(&mut a, "later", "k1", "refund", json!({}))),
        "held"
    );
    let ev = watcher.next_event().unwrap().unwrap();
    assert_eq!(
        (ev.event, ev.reason.as_deref()),
        (estop_protocol::EventKind::Held, Some("approval"))
    );
    ok(
        &mut op,
        json!({"op": "decide", "run": "later", "key": "k1", "decision": "reject"}),
    );
    let ev = watcher.next_event().unwrap().unwrap();
    assert_eq!(
        (ev.event, ev.decision.as_deref()),
        (estop_protocol::EventKind::Decided, Some("reject"))
    );
    ok(
        &mut op,
        json!({"op": "cancel", "run": "later", "reason": "user pressed stop"}),
    );
    let ev = watcher.next_event().unwrap().unwrap();
    assert_eq!(
        (ev.event, ev.reason.as_deref()),
        (
            estop_protocol::EventKind::Cancelled,
            Some("user pressed stop")
        )
    );
    // Another agent's subscription to the same id hears nothing of a run it cannot see.
    let (_, other, _) = d.cli(&["token", "create", "agent2", "--role", "agent"]);
    let mut spy = d.client_with(other.trim());
    ok(&mut spy, json!({"op": "subscribe", "run": "fresh"}));
    admit(&mut a, "fresh", "k1", "refund", json!({}));
    ok(&mut spy, json!({"op": "ping"}));
    assert!(spy.events.is_empty(), "events leaked: {:?}", spy.events);
}

/// An agent that goes away while waiting for an approval (killed, crashed) frees its connection
/// at once: its wait is dropped, not kept until it times out holding a connection slot and its
/// descriptors. The others' waits still end as they should.
#[test]
fn a_client_that_disconnects_while_waiting_frees_its_connection() {
    let d = Daemon::start();
    let pid = d.child.as_ref().unwrap().id();
    let fds = || {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .count()
    };
    let mut a = d.agent();
    admit(&mut a, "r1", "k1", "refund", json!({}));
    a.send_raw(br#"{"id":"w","op":"wait","run":"r1","key":"k1","timeout_ms":60000}"#)
        .unwrap();
    let before = fds();
    {
        let mut gone = d.agent();
        gone.send_raw(br#"{"id":"w","op":"wait","run":"r1","key":"k1","timeout_ms":60000}"#)
            .unwrap();
        // It is waiting once a ping behind the wait is answered.
        assert_eq!(ok(&mut gone, json!({"op": "ping"}))["pong"], true);
        assert!(fds() > before);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while fds() > before {
        assert!(
            Instant::now() < deadline,
            "the connection of a client gone while waiting is still held: {} descriptors, {before} before it",
            fds()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The wait still open on the other connection ends with the decision.
    let mut op = d.operator();
    ok(
        &mut op,
        json!({"op": "decide", "run": "r1", "key": "k1", "decision": "approve"}),
    );
    let w = match a.read_line().unwrap() {
        estop_protocol::ServerLine::Reply(r) => r,
        e => panic!("{e:?}"),
    };
    assert_eq!(w.id.as_json(), "\"w\"");
    assert_eq!(w.raw["verdict"].as_str(), Some("admitted"));
}

/// The typed client against the real daemon: every verb it sends is encoded by the protocol's
/// own encoder and its reply decoded as that verb's payload type; a refusal is a typed error.
#[test]
fn typed_client_speaks_every_verb() {
    use estop_kernel::ids::{EffectKey, PrincipalName, Role, RunId, ToolName};
    use estop_kernel::vocab::{Decision, HoldReason};
    use estop_protocol::{
        Ack, Admit, DecideReply, ErrorCode, EventKind, Op, PendingReply, Pong, Report, RunView,
        RunsReply, SubscribeReply, TokenCreated, TokenRevoked, VerdictReply,
    };
    use estop_server::client::ClientError;

    let d = Daemon::start();
    let mut a = d.agent();
    let mut o = d.operator();
    let run = RunId::new("typed").unwrap();
    let key = |k: &str| EffectKey::new(k).unwrap();
    let admit = |k: &str, tool: &str| {
        let tool = ToolName::new(tool).unwrap();
        let args = json!({"n": 1});
        Op::Admit(Admit {
            run: run.clone(),
            key: key(k),
            digest: estop_protocol::digest_of(&tool, &args),
            tool,
            args: Some(args),
            start: true,
            parent: None,
            labels: Default::default(),
            needs_approval: false,
            declare: None,
            seed: None,
            limits: Default::default(),
            reserve: Default::default(),
        })
    };
    let pong: Pong = a.ask(&Op::Ping).unwrap();
    assert!(pong.pong);
    // The run does not exist yet: the plain ack, nothing to replay.
    let sub: SubscribeReply = o.ask(&Op::Subscribe { run: run.clone() }).unwrap();
    assert_eq!(sub, SubscribeReply::default());
    let admitted: VerdictReply = a.ask(&admit("k1", "pay")).unwrap();
    assert!(
        matches!(admitted, VerdictReply::Admitted { epoch: 1, .. }),
        "{admitted:?}"
    );
    let held: VerdictReply = a.ask(&admit("k2", "refund")).unwrap();
    assert!(
        matches!(
            &held,
            VerdictReply::Held {
                reason: HoldReason::Approval,
                approval: Some(_),
                ..
            }
        ),
        "{held:?}"
    );
    let view: RunView = o.ask(&Op::Status { run: run.clone() }).unwrap();
    assert_eq!((view.effects.started, view.effects.held), (1, 1));
    let runs: RunsReply = o
        .ask(&Op::Runs {
            state: None,
            limit: None,
            cursor: None,
        })
        .unwrap();
    assert_eq!(runs.runs.len(), 1);
    let pending: PendingReply = o
        .ask(&Op::Pending {
            run: Some(run.clone()),
            limit: None,
            cursor: None,
        })
        .unwrap();
    assert_eq!(pending.pending[0].key, "k2");
    let decided: DecideReply = o
        .ask(&Op::Decide {
            run: run.clone(),
            key: key("k2"),
            decision: Decision::Approve,
            reason: None,
        })
        .unwrap();
    assert_eq!(decided.status, "approved");
    // The subscription's events arrived among the replies, decoded.
    let ev = o.next_event().unwrap().unwrap();
    assert_eq!((ev.event, ev.key.as_deref()), (EventKind::Held, Some("k2")));
    // A refusal is its code and message, not a payload.
    match o.ask::<DecideReply>(&Op::Decide {
        run: run.clone(),
        key: key("nope"),
        decision: Decision::Approve,
        reason: None,
    }) {
        Err(ClientError::Refused {
            code: ErrorCode::NotFound,
            message,
        }) => {
            assert!(message.contains("nope"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    // Asking for the wrong payload type is a protocol error, not a silent default.
    assert!(matches!(
        o.ask::<RunsReply>(&Op::Status { run: run.clone() }),
        Err(ClientError::Protocol(_))
    ));
    let stopped: Ack = o
        .ask(&Op::Cancel {
            run: run.clone(),
            reason: Some("done".into()),
            cascade: true,
        })
        .unwrap();
    assert_eq!(stopped.runs, ["typed"]);
    let report: Report = o
        .ask(&Op::Report {
            run: run.clone(),
            limit: None,
            cursor: None,
        })
        .unwrap();
    assert_eq!(report.cause.as_deref(), Some("cancelled"));
    let name = PrincipalName::new("typed-bob").unwrap();
    let created: TokenCreated = o
        .ask(&Op::Token {
            name: name.clone(),
            role: Role::Agent,
            groups: vec![],
        })
        .unwrap();
    let revoked: TokenRevoked = o.ask(&Op::TokenRevoke { name }).unwrap();
    assert_eq!(
        (created.role.as_str(), revoked.name.as_str()),
        ("agent", "typed-bob")
    );
    // A token the gate does not know is refused at connect.
    assert!(matches!(
        estop_server::client::Client::connect_as(&d.socket(), created.token.expose()),
        Err(ClientError::Refused {
            code: ErrorCode::Unauthenticated,
            ..
        })
    ));
}

/// The CLI's output, human and `--json`, pinned byte for byte (times masked as `T`, seconds
/// left as `N`): scripts parse it and operators read it, so a change must be deliberate.
#[test]
fn cli_output_is_pinned() {
    let d = Daemon::start();
    let mut a = d.agent();
    admit(&mut a, "r1", "k1", "pay", json!({"b": 1, "a": "x"}));
    admit(
        &mut a,
        "r1",
        "k2",
        "refund",
        json!({"z": [1, 2], "a": {"y": 1, "b": 2}}),
    );
    admit(&mut a, "r1", "k3", "drop_table", json!({}));
    let run = |args: &[&str]| {
        let (code, out, err) = d.cli(args);
        format!("{code}\n{}{}", mask(&out), mask(&err))
    };
    let effects =
        r#"{"admitted":0,"completed":0,"failed":0,"held":1,"refused":1,"started":1,"unknown":0}"#;
    assert_eq!(
        run(&["status", "r1", "--json"]),
        format!(
            "0\n{{\"created_at\":T,\"effects\":{effects},\"epoch\":1,\"id\":2,\"ok\":true,\"owner\":\"agent\",\"run\":\"r1\",\"state\":\"active\"}}\n"
        )
    );
    assert_eq!(
        run(&["status", "r1"]),
        format!(
            "0\nrun          r1\nstate        active\nowner        agent\nepoch        1\ncreated_at   T\neffects      {effects}\n"
        )
    );
    assert_eq!(
        run(&["pending"]),
        "0\nRUN  KEY  TOOL    ARGS                           QUORUM  EXPIRES IN  DIGEST\n\
         r1   k2   refund  {\"a\":{\"b\":2,\"y\":1},\"z\":[1,2]}  0/1     Ns        5963ea93c724\n"
    );
    assert_eq!(
        run(&["pending", "--json"]),
        "0\n{\"id\":2,\"ok\":true,\"pending\":[{\"approval\":\"r1#1\",\"approvals\":[],\"args\":{\"a\":{\"b\":2,\"y\":1},\"z\":[1,2]},\"created_at\":T,\"digest\":\"5963ea93c724b36e0362f47780a2b56de76b75a58800218c860f8a92c958ab16\",\"expires_at\":T,\"groups\":[],\"key\":\"k2\",\"quorum\":1,\"rule\":\"rule 3\",\"run\":\"r1\",\"tool\":\"refund\"}]}\n"
    );
    assert_eq!(
        run(&["approve", "r1", "k2"]),
        "0\napproved (r1 k2; approvers: admin)\n"
    );
    assert_eq!(
        run(&["approve", "r1", "k2", "--json"]),
        "3\n{\"error\":{\"code\":\"not_pending\",\"message\":\"effect k2 of run r1 is not awaiting approval (it is approved)\"},\"id\":2,\"ok\":false}\nestop: not_pending: effect k2 of run r1 is not awaiting approval (it is approved)\n"
    );
    assert_eq!(
        run(&["cancel", "r1", "--reason", "stop \u{202e} it"]),
        "0\nrun is finalizing; changed: r1\n  in flight: r1 k1 pay\n"
    );
    assert_eq!(
        run(&["cancel", "r1", "--json"]),
        "0\n{\"id\":2,\"ok\":true,\"state\":\"finalizing\"}\n"
    );
    assert_eq!(
        run(&["report", "r1"]),
        "0\nrun r1  state finalizing  cause cancelled\nreason stop \\u{202e} it\n\n\
         done (0)\n\nfailed (0)\n\nrefused (2)\n  k2                       refund               refused (cancelled)\n  k3                       drop_table           refused (denied)\n\n\
         in_flight (1)\n  k1                       pay                  started\n\nunknown (0)\n\n\
         held (0)\n\ncompensable (0)\n\n\
         irreversible (0)\n\nundeclared (1)\n  k1                       pay                  started\n"
    );
    assert_eq!(
        run(&["runs"]),
        "0\nRUN  STATE       OWNER  PARENT  DONE/FLYING/HELD/REFUSED  CAUSE      REASON\n\
         r1   finalizing  agent  -       0/1/0/2                   cancelled  stop \\u{202e} it\n"
    );
    assert_eq!(
        run(&["status", "nope", "--json"]),
        "4\n{\"error\":{\"code\":\"not_found\",\"message\":\"run nope not found\"},\"id\":2,\"ok\":false}\nestop: not_found: run nope not found\n"
    );
    // A request the gate would refuse is refused before anything is sent, in its words.
    assert_eq!(
        run(&["runs", "--state", "bogus"]),
        "1\nestop: invalid_field: invalid field `state`: \"bogus\" is not one of active, paused, finalizing, completed, failed, cancelled\n"
    );
    // A reject names no approver, and the line does not pretend there is a list.
    admit(&mut a, "r2", "k4", "refund", json!({"n": 4}));
    assert_eq!(
        run(&["reject", "r2", "k4", "--reason", "no"]),
        "0\nrejected (r2 k4)\n"
    );
}

/// Times (Unix ms) as `T` and seconds left as `Ns`, so output compares exactly.
fn mask(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find(|c: char| c.is_ascii_digit()) {
        let (head, tail) = rest.split_at(i);
        out.push_str(head);
        let n = tail
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(tail.len());
        let (digits, after) = tail.split_at(n);
        let is_time = digits.len() >= 12;
        let is_seconds = after.starts_with("s ") && head.ends_with(' ');
        out.push_str(match () {
            _ if is_time => "T",
            _ if is_seconds => "N",
            _ => digits,
        });
        rest = after;
    }
    out.push_str(rest);
    out
}

/// `estop runs | head -0`: the reader went away before the listing was written. The command
/// ends as a Unix filter does (killed by SIGPIPE, nothing on stderr), not with a panic.
#[test]
fn a_closed_pipe_ends_a_listing_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let d = Daemon::start();
    let mut a = d.agent();
    admit(&mut a, "r1", "k1", "pay", json!({}));
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = std::process::Command::new(common::bin())
        .args(["runs", "--data"])
        .arg(d.data())
        .stdout(writer)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGPIPE),
        "{:?} {stderr}",
        out.status
    );
}
