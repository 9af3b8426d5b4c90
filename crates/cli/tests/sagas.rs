//! The reverse saga end to end (issue 14): a real `estop serve`, an executor client that runs
//! compensations against a downstream system that applies each idempotency key once, a cancel,
//! and a kill -9 in the middle of a compensation.

mod common;

use common::*;
use estop_protocol::{Event, EventKind};
use estop_server::client::Client;
use serde_json::{Value, json};
use std::collections::BTreeMap;

const SAGA_POLICY: &str = r#"
[defaults]
unknown_tool = "approve"

[[rules]]
tool = "refund"
action = "allow"
compensate = "unrefund"
compensate_args = '{"refund": result.id, "amount": args.amount}'

[[rules]]
tool = "charge"
action = "allow"
compensate = "uncharge"

[[rules]]
tool = "email"
action = "allow"
reversibility = "irreversible"
"#;

/// The system the compensating calls reach: like a payment API, it applies a request once per
/// idempotency key and answers a repeat with what it did the first time.
#[derive(Default)]
struct Downstream {
    /// Every call: (idempotency key, attempt).
    calls: Vec<(String, u32)>,
    /// What each key applied.
    applied: BTreeMap<String, Value>,
}

impl Downstream {
    /// Runs the compensation the event asks for; true when it was applied now (not a repeat).
    fn call(&mut self, ev: &Event) -> bool {
        let key = ev
            .idempotency_key
            .clone()
            .expect("a compensate names its key");
        self.calls
            .push((key.clone(), ev.attempt.expect("an attempt")));
        if self.applied.contains_key(&key) {
            return false;
        }
        self.applied
            .insert(key, ev.args.clone().unwrap_or(Value::Null));
        true
    }
}

/// Admits, runs and completes one call with `result`.
fn done(a: &mut Client, run: &str, key: &str, tool: &str, args: Value, result: Value) {
    let v = admit(a, run, key, tool, args);
    assert_eq!(verdict(&v), "admitted", "{v}");
    ok(
        a,
        json!({"op": "complete", "run": run, "key": key, "token": v["token"], "outcome": "ok",
               "result": result}),
    );
}

/// The next `compensate` event the executor is sent (blocks until it comes).
fn next_compensate(ex: &mut Client) -> Event {
    loop {
        let ev = ex.next_event().unwrap().expect("an event, not a reply");
        if ev.event == EventKind::Compensate {
            return ev;
        }
    }
}

fn compensated(ex: &mut Client, run: &str, ev: &Event, outcome: &str) -> Value {
    ok(
        ex,
        json!({"op": "compensated", "run": run, "key": ev.key, "attempt": ev.attempt,
               "outcome": outcome}),
    )
}

fn state(c: &mut Client, run: &str) -> String {
    ok(c, json!({"op": "status", "run": run}))["state"]
        .as_str()
        .unwrap()
        .to_string()
}

/// How many ledger records of `kind` the run has.
fn records(op: &mut Client, run: &str, kind: &str) -> usize {
    let l = ok(op, json!({"op": "ledger", "run": run}));
    l["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == kind)
        .count()
}

#[test]
fn a_cancel_compensates_newest_first_retries_after_backoff_and_ends_cancelled() {
    let d = Daemon::start_with_policy(SAGA_POLICY, &[]);
    let mut a = d.agent();
    let mut op = d.operator();
    done(
        &mut a,
        "r1",
        "k1",
        "refund",
        json!({"amount": 10}),
        json!({"id": "re_1"}),
    );
    done(
        &mut a,
        "r1",
        "k2",
        "refund",
        json!({"amount": 20}),
        json!({"id": "re_2"}),
    );
    done(
        &mut a,
        "r1",
        "k3",
        "email",
        json!({"to": "x"}),
        json!({"sent": true}),
    );
    // An agent may never settle, skip or retry the undoing of its own effects.
    for action in [
        json!({"action": "settle", "outcome": "error"}),
        json!({"action": "skip", "reason": "nothing to see"}),
        json!({"action": "retry"}),
    ] {
        let mut req = json!({"op": "saga", "run": "r1", "key": "k2"});
        req.as_object_mut()
            .unwrap()
            .extend(action.as_object().unwrap().clone());
        assert_eq!(err_code(&mut a, req), "forbidden");
    }
    let mut ex = d.agent();
    ok(&mut ex, json!({"op": "compensations"}));
    let v = ok(&mut a, json!({"op": "cancel", "run": "r1"}));
    assert_eq!(v["state"], "finalizing", "{v}");
    let mut downstream = Downstream::default();

    // Newest first: k2, with its arguments built from the forward call and its result.
    let e = next_compensate(&mut ex);
    assert_eq!(
        (
            e.key.as_deref(),
            e.attempt,
            e.tool.as_deref(),
            e.idempotency_key.as_deref()
        ),
        (Some("k2"), Some(1), Some("unrefund"), Some("k2/undo"))
    );
    assert_eq!(e.args, Some(json!({"refund": "re_2", "amount": 20})));
    assert!(downstream.call(&e));
    // Reporting the older one first is refused: it is not under way.
    let stale = json!({"op": "compensated", "run": "r1", "key": "k1", "attempt": 1,
                       "outcome": "ok"});
    assert_eq!(err_code(&mut ex, stale), "conflict");
    let r = compensated(&mut ex, "r1", &e, "ok");
    assert_eq!(
        (r["status"].as_str(), r["attempt"].as_u64()),
        (Some("compensated"), Some(1))
    );

    // Then k1; its first attempt fails downstream and is offered again after the backoff.
    let e = next_compensate(&mut ex);
    assert_eq!((e.key.as_deref(), e.attempt), (Some("k1"), Some(1)));
    let r = compensated(&mut ex, "r1", &e, "error");
    assert_eq!(r["status"], "compensation_failed", "{r}");
    assert!(r["retry_at"].as_u64().is_some(), "{r}");
    assert_eq!(state(&mut op, "r1"), "finalizing");
    let e = next_compensate(&mut ex);
    assert_eq!(
        (e.key.as_deref(), e.attempt, e.idempotency_key.as_deref()),
        (Some("k1"), Some(2), Some("k1/undo"))
    );
    assert_eq!(e.args, Some(json!({"refund": "re_1", "amount": 10})));
    assert!(downstream.call(&e));
    compensated(&mut ex, "r1", &e, "ok");

    // The saga is settled: the run is cancelled; the irreversible email was never offered.
    assert_eq!(state(&mut op, "r1"), "cancelled");
    assert_eq!(
        downstream.calls,
        vec![("k2/undo".into(), 1), ("k1/undo".into(), 2)]
    );
    assert_eq!(records(&mut op, "r1", "compensation_begin"), 3);
    assert_eq!(records(&mut op, "r1", "compensation_end"), 3);
    // Nothing is left to settle: an operator's settle of a compensated effect is refused.
    let settle = json!({"op": "saga", "run": "r1", "key": "k1", "action": "settle",
                        "outcome": "ok"});
    assert_eq!(err_code(&mut op, settle), "conflict");
}

#[test]
fn an_attempt_under_way_survives_its_executor_and_a_kill9_and_lands_once() {
    let mut d = Daemon::start_with_policy(SAGA_POLICY, &[]);
    let mut downstream = Downstream::default();
    let first = {
        let mut a = d.agent();
        done(
            &mut a,
            "r1",
            "k1",
            "refund",
            json!({"amount": 10}),
            json!({"id": "re_1"}),
        );
        let mut ex_a = d.agent();
        ok(&mut ex_a, json!({"op": "compensations"}));
        let mut ex_b = d.agent();
        ok(&mut ex_b, json!({"op": "compensations", "run": "r1"}));
        ok(&mut a, json!({"op": "cancel", "run": "r1"}));
        // The first executor gets it (its begin is durable before the event is sent), runs
        // it downstream, and dies before it reports.
        let e = next_compensate(&mut ex_a);
        assert_eq!((e.key.as_deref(), e.attempt), (Some("k1"), Some(1)));
        assert!(downstream.call(&e));
        drop(ex_a);
        // The other executor is offered the same attempt, and the gate is killed before it
        // reports either.
        let again = next_compensate(&mut ex_b);
        assert_eq!(
            again,
            Event {
                at: again.at,
                ..e.clone()
            }
        );
        assert!(
            !downstream.call(&again),
            "the downstream applies a key once"
        );
        e
    };
    d.restart(); // kill -9, then start again
    let mut op = d.operator();
    assert_eq!(state(&mut op, "r1"), "finalizing");
    let mut ex = d.agent();
    ok(&mut ex, json!({"op": "compensations"}));
    let e = next_compensate(&mut ex);
    assert_eq!(e, Event { at: e.at, ..first });
    assert!(!downstream.call(&e));
    let r = compensated(&mut ex, "r1", &e, "ok");
    assert_eq!(r["status"], "compensated");
    // A repeated report answers the same and records nothing (counted below).
    let r2 = compensated(&mut ex, "r1", &e, "ok");
    assert_eq!(
        (&r2["status"], &r2["attempt"]),
        (&r["status"], &r["attempt"])
    );
    assert_eq!(state(&mut op, "r1"), "cancelled");
    assert_eq!(downstream.applied.len(), 1);
    assert_eq!(
        downstream.calls,
        vec![("k1/undo".into(), 1); 3],
        "every offer of attempt 1 carried the derived key"
    );
    assert_eq!(records(&mut op, "r1", "compensation_begin"), 1);
    assert_eq!(records(&mut op, "r1", "compensation_end"), 1);
}

/// The operator's part, over the wire: an unknown outcome blocks everything older until it is
/// settled; an undo whose outcome is unknown asks a human, who retries it; one that cannot be
/// undone is skipped with a reason, and the run ends `cancelled`.
#[test]
fn an_operator_settles_retries_and_skips_what_the_saga_cannot_decide() {
    let d = Daemon::start_with_policy(SAGA_POLICY, &[]);
    let mut a = d.agent();
    let mut op = d.operator();
    done(
        &mut a,
        "r1",
        "k1",
        "refund",
        json!({"amount": 10}),
        json!({"id": "re_1"}),
    );
    // k2 was started and never confirmed: its outcome is unknown (and it has no result for a
    // mapping to read: its undo takes no arguments).
    let v = admit(&mut a, "r1", "k2", "charge", json!({"amount": 20}));
    ok(
        &mut a,
        json!({"op": "complete", "run": "r1", "key": "k2", "token": v["token"],
               "outcome": "unknown"}),
    );
    let mut ex = d.agent();
    ok(&mut ex, json!({"op": "compensations", "run": "r1"}));
    ok(&mut a, json!({"op": "cancel", "run": "r1"}));
    // Nothing is offered while k2's outcome is unknown; retrying it is refused (nothing began).
    let retry = |key: &str| json!({"op": "saga", "run": "r1", "key": key, "action": "retry"});
    assert_eq!(err_code(&mut op, retry("k2")), "conflict");
    ok(&mut ex, json!({"op": "ping"}));
    assert!(
        ex.events.is_empty(),
        "offered before the unknown was settled: {:?}",
        ex.events
    );
    // The operator finds it happened: it is undone next.
    let r = ok(
        &mut op,
        json!({"op": "saga", "run": "r1", "key": "k2", "action": "settle", "outcome": "ok"}),
    );
    assert_eq!(r["status"], "completed", "{r}");
    let e = next_compensate(&mut ex);
    assert_eq!(
        (e.key.as_deref(), e.attempt, e.tool.as_deref(), &e.args),
        (Some("k2"), Some(1), Some("uncharge"), &None)
    );
    // Whether the undo landed is unknown: a human is asked, never a blind retry.
    let r = compensated(&mut ex, "r1", &e, "unknown");
    assert_eq!(r["status"], "needs_human", "{r}");
    let r = ok(&mut op, retry("k2"));
    assert_eq!(r["status"], "compensation_failed", "{r}");
    let e = next_compensate(&mut ex);
    assert_eq!((e.key.as_deref(), e.attempt), (Some("k2"), Some(2)));
    compensated(&mut ex, "r1", &e, "ok");
    // k1's undo ends unknown too; the operator skips it, with a reason.
    let e = next_compensate(&mut ex);
    assert_eq!((e.key.as_deref(), e.attempt), (Some("k1"), Some(1)));
    compensated(&mut ex, "r1", &e, "unknown");
    let no_reason = json!({"op": "saga", "run": "r1", "key": "k1", "action": "skip"});
    assert_eq!(err_code(&mut op, no_reason), "missing_field");
    assert_eq!(state(&mut op, "r1"), "finalizing");
    // The report says what the saga waits for, and how far each undo got.
    let (code, out, err) = d.cli(&["report", "r1"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("saga waits for an operator: `estop compensate retry|skip RUN k1`"),
        "{out}"
    );
    let line = |key: &str| {
        out.lines()
            .find(|l| l.trim_start().starts_with(key))
            .unwrap_or_else(|| panic!("no {key} in {out}"))
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(
        line("k1"),
        "k1 refund needs_human undo: unrefund attempts 1/5"
    );
    assert_eq!(
        line("k2"),
        "k2 charge compensated undo: uncharge attempts 2/6 by admin"
    );
    let report = ok(&mut op, json!({"op": "report", "run": "r1"}));
    assert_eq!(report["saga_next"], json!({"key": "k1", "waits": "human"}));
    // The operator skips it from the CLI, with a reason.
    let (code, out, err) = d.cli(&[
        "compensate",
        "skip",
        "r1",
        "k1",
        "--reason",
        "refunded by hand",
    ]);
    assert_eq!(
        (code, out.trim()),
        (0, "compensation_skipped (attempt 1)"),
        "{err}"
    );
    assert_eq!(state(&mut op, "r1"), "cancelled");
    let (_, out, _) = d.cli(&["report", "r1"]);
    assert!(out.contains("note: refunded by hand by admin"), "{out}");
    assert!(!out.contains("saga waits"), "{out}");
    assert_eq!(records(&mut op, "r1", "saga_settle"), 1);
    assert_eq!(records(&mut op, "r1", "saga_retry"), 1);
    assert_eq!(records(&mut op, "r1", "saga_skip"), 1);
}

/// Hostile: another agent that makes itself an executor of "every run it sees" is offered none
/// of this agent's compensations (they are neither sent to it nor claimed under its name), and
/// one agent cannot take more executor places than its share of subscriptions.
#[test]
fn another_agents_executor_gets_nothing_and_executors_are_bounded_per_principal() {
    let d = Daemon::start_with_policy(SAGA_POLICY, &["--subscriptions-per-principal-max", "2"]);
    let mut op = d.operator();
    let b_token = ok(
        &mut op,
        json!({"op": "token", "name": "b", "role": "agent"}),
    );
    let b_secret = b_token["token"].as_str().unwrap().to_string();
    let mut b1 = d.client_with(&b_secret);
    let mut b2 = d.client_with(&b_secret);
    let mut b3 = d.client_with(&b_secret);
    ok(&mut b1, json!({"op": "compensations"}));
    ok(&mut b2, json!({"op": "compensations"}));
    let r = b3.call(json!({"op": "compensations"})).unwrap();
    let e = r
        .error
        .expect("a third executor of the same principal is refused");
    assert_eq!(e.code, "limit_exceeded", "{}", e.message);

    let mut a = d.agent();
    let mut ex = d.agent();
    ok(&mut ex, json!({"op": "compensations", "run": "victim"}));
    done(
        &mut a,
        "victim",
        "c1",
        "charge",
        json!({"amount": 7}),
        json!({"id": "ch_7"}),
    );
    ok(&mut op, json!({"op": "cancel", "run": "victim"}));
    // The attempt is claimed under A's executor, never under B's (bounded: a claim that never
    // comes fails here rather than hanging on the executor's events).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    let begin = loop {
        let l = ok(&mut op, json!({"op": "ledger", "run": "victim"}));
        let begins: Vec<Value> = l["entries"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["kind"] == "compensation_begin")
            .cloned()
            .collect();
        if let Some(b) = begins.first() {
            assert_eq!(begins.len(), 1, "{l}");
            break b.clone();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no compensation began for A's executor: {l}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(begin["principal"], "agent", "{begin}");
    let ev = next_compensate(&mut ex);
    assert_eq!(ev.run, "victim");
    compensated(&mut ex, "victim", &ev, "ok");
    assert_eq!(state(&mut op, "victim"), "cancelled");
    // B's executors were sent nothing: the next line each reads is the reply to its ping.
    for b in [&mut b1, &mut b2] {
        b.send_raw(br#"{"id":77,"op":"ping"}"#).unwrap();
        match b.read_line().unwrap() {
            estop_protocol::ServerLine::Reply(r) => assert!(r.ok, "{}", r.raw),
            other => panic!("another agent's executor was sent {other:?}"),
        }
    }
}

const LOOKUP_POLICY: &str = r#"
[[rules]]
tool = "charge"
action = "allow"
compensate = "uncharge"
compensate_args = '{"charge": result.id}'
lookup = "find_charge"

[[rules]]
tool = "refund"
action = "allow"
compensate = "unrefund"
compensate_args = '{"refund": result.id, "amount": args.amount}'
"#;

/// The next event of `kind` the executor is sent (blocks until it comes).
fn next_of(ex: &mut Client, kind: EventKind) -> Event {
    loop {
        let ev = ex.next_event().unwrap().expect("an event, not a reply");
        if ev.event == kind {
            return ev;
        }
    }
}

#[test]
fn an_unknown_outcome_is_looked_up_by_its_key_then_undone_with_the_result_found() {
    let d = Daemon::start_with_policy(LOOKUP_POLICY, &[]);
    let mut a = d.agent();
    let mut op = d.operator();
    let v = admit(&mut a, "r1", "k1", "charge", json!({"amount": 30}));
    ok(
        &mut a,
        json!({"op": "complete", "run": "r1", "key": "k1", "token": v["token"],
               "outcome": "unknown", "error": "timed out"}),
    );
    let mut ex = d.agent();
    ok(&mut ex, json!({"op": "compensations", "run": "r1"}));
    ok(&mut a, json!({"op": "cancel", "run": "r1"}));
    // Asked by the forward call's own key, before anything is undone.
    let l = next_of(&mut ex, EventKind::Lookup);
    assert_eq!(
        (
            l.key.as_deref(),
            l.attempt,
            l.tool.as_deref(),
            l.idempotency_key.as_deref()
        ),
        (Some("k1"), Some(1), Some("find_charge"), Some("k1"))
    );
    assert_eq!(l.args, Some(json!({"amount": 30})));
    let report = ok(&mut op, json!({"op": "report", "run": "r1"}));
    assert_eq!(
        report["saga_next"],
        json!({"key": "k1", "waits": "looking_up", "attempt": 1})
    );
    // Found: it happened, with this result; the undo is built from it.
    let r = ok(
        &mut ex,
        json!({"op": "looked_up", "run": "r1", "key": "k1", "attempt": 1, "outcome": "ok",
               "result": {"id": "ch_7"}}),
    );
    assert_eq!(r["status"], "completed", "{r}");
    let e = next_compensate(&mut ex);
    assert_eq!(
        (e.key.as_deref(), e.tool.as_deref(), &e.args),
        (
            Some("k1"),
            Some("uncharge"),
            &Some(json!({"charge": "ch_7"}))
        )
    );
    compensated(&mut ex, "r1", &e, "ok");
    assert_eq!(state(&mut op, "r1"), "cancelled");
    assert_eq!(records(&mut op, "r1", "lookup_begin"), 1);
    assert_eq!(records(&mut op, "r1", "lookup_end"), 1);
    let (_, out, _) = d.cli(&["report", "r1"]);
    assert!(out.contains("lookup: find_charge looked up 1x"), "{out}");
}

#[test]
fn an_operator_compensates_one_effect_of_a_killed_run_from_the_cli() {
    let d = Daemon::start_with_policy(LOOKUP_POLICY, &[]);
    let mut a = d.agent();
    let mut op = d.operator();
    done(
        &mut a,
        "r2",
        "k1",
        "refund",
        json!({"amount": 10}),
        json!({"id": "re_1"}),
    );
    done(
        &mut a,
        "r2",
        "k2",
        "refund",
        json!({"amount": 20}),
        json!({"id": "re_2"}),
    );
    let mut ex = d.agent();
    ok(&mut ex, json!({"op": "compensations", "run": "r2"}));
    let (code, _, err) = d.cli(&["kill", "r2"]);
    assert_eq!(code, 0, "{err}");
    ok(&mut ex, json!({"op": "ping"}));
    assert!(
        ex.events.is_empty(),
        "a kill undid something: {:?}",
        ex.events
    );
    // Only the effect asked for, and the run stays killed.
    let (code, out, err) = d.cli(&["compensate", "effect", "r2", "k1"]);
    assert_eq!((code, out.trim()), (0, "completed"), "{err}");
    let e = next_compensate(&mut ex);
    assert_eq!(
        (e.key.as_deref(), &e.args),
        (Some("k1"), &Some(json!({"refund": "re_1", "amount": 10})))
    );
    compensated(&mut ex, "r2", &e, "ok");
    assert_eq!(state(&mut op, "r2"), "cancelled");
    let (_, out, _) = d.cli(&["report", "r2"]);
    let k1 = out
        .lines()
        .find(|l| l.trim_start().starts_with("k1"))
        .unwrap();
    assert!(
        k1.contains("compensated") && k1.contains("[asked for]"),
        "{out}"
    );
    let k2 = out
        .lines()
        .find(|l| l.trim_start().starts_with("k2"))
        .unwrap();
    assert!(k2.contains("completed"), "{out}");
    assert_eq!(records(&mut op, "r2", "saga_compensate"), 1);
    // A cancelled run's effects are its saga's; an effect without an undo has none.
    let (code, _, err) = d.cli(&["compensate", "effect", "r2", "nope"]);
    assert_eq!(code, 4, "{err}");
    let (code, _, err) = d.cli(&[
        "compensate",
        "settle",
        "r2",
        "k2",
        "--outcome",
        "ok",
        "--result",
        "{",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--result is not JSON"), "{err}");
}

#[test]
fn a_call_a_dead_agent_left_in_flight_is_looked_up_after_the_timeout_without_a_human() {
    let mut d = Daemon::start_with_policy(LOOKUP_POLICY, &["--in-flight-timeout", "1s"]);
    {
        let mut a = d.agent();
        done(
            &mut a,
            "r1",
            "k1",
            "refund",
            json!({"amount": 10}),
            json!({"id": "re_1"}),
        );
        // The agent starts a charge and dies before it reports.
        let v = admit(&mut a, "r1", "k2", "charge", json!({"amount": 30}));
        assert_eq!(verdict(&v), "admitted", "{v}");
        let mut op = d.operator();
        ok(&mut op, json!({"op": "cancel", "run": "r1"}));
    }
    // The deadline is counted from the stop, so it outlives the gate's crash and restart.
    d.kill9();
    d.restart();
    let mut op = d.operator();
    let mut ex = d.agent();
    ok(&mut ex, json!({"op": "compensations", "run": "r1"}));
    // Nobody settles k2: a second after the cancel it is unknown and looked up, newest first.
    let l = next_of(&mut ex, EventKind::Lookup);
    assert_eq!(
        (l.key.as_deref(), l.attempt, l.tool.as_deref()),
        (Some("k2"), Some(1), Some("find_charge"))
    );
    let ledger = ok(&mut op, json!({"op": "ledger", "run": "r1"}));
    let unreported: Vec<&Value> = ledger["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "unreported")
        .collect();
    assert_eq!(unreported.len(), 1, "{ledger}");
    assert_eq!(unreported[0]["key"], "k2");
    assert_eq!(unreported[0]["after_ms"], 1000, "{ledger}");
    // Not found: the charge did not happen, so only the refund is undone, and the run ends.
    let r = ok(
        &mut ex,
        json!({"op": "looked_up", "run": "r1", "key": "k2", "attempt": 1, "outcome": "error"}),
    );
    assert_eq!(r["status"], "failed", "{r}");
    let e = next_compensate(&mut ex);
    assert_eq!(
        (e.key.as_deref(), &e.args),
        (Some("k1"), &Some(json!({"refund": "re_1", "amount": 10})))
    );
    compensated(&mut ex, "r1", &e, "ok");
    assert_eq!(state(&mut op, "r1"), "cancelled");
}

const QUORUM_POLICY: &str = r#"
[[rules]]
tool = "refund"
action = "allow"
compensate = "unrefund"
compensate_args = '{"refund": result.id, "amount": args.amount}'

[[rules]]
tool = "unrefund"
action = "approve"
quorum = 2
expiry = "10m"
name = "undo-needs-two"
"#;

/// Hostile, end to end: a compensating call a quorum-2 rule holds is listed by `estop pending`
/// as the undo of its effect; one operator's approve (twice), retry, and an agent's vote do not
/// send it; the vote survives a kill -9 and restart; a second operator's vote sends it.
#[test]
fn a_quorum_2_compensation_needs_two_operators_and_its_votes_survive_a_kill9() {
    let mut d = Daemon::start_with_policy(QUORUM_POLICY, &[]);
    let (code, secret, err) = d.cli(&["token", "create", "bob", "--role", "operator"]);
    assert_eq!(code, 0, "{err}");
    let bob_token = secret.trim().to_string();
    {
        let mut a = d.agent();
        done(
            &mut a,
            "r1",
            "k1",
            "refund",
            json!({"amount": 10}),
            json!({"id": "re_1"}),
        );
        let mut ex = d.agent();
        ok(&mut ex, json!({"op": "compensations"}));
        let mut watcher = d.operator();
        ok(&mut watcher, json!({"op": "subscribe", "run": "r1"}));
        ok(&mut a, json!({"op": "cancel", "run": "r1"}));
        let mut op = d.operator();
        let report = ok(&mut op, json!({"op": "report", "run": "r1"}));
        assert_eq!(report["saga_next"]["waits"], "approval", "{report}");
        assert_eq!(report["saga_next"]["approval"], "r1#1", "{report}");
        let (code, out, err) = d.cli(&["pending"]);
        assert_eq!(code, 0, "{err}");
        assert!(
            out.contains("unrefund (undo of refund)") && out.contains("0/2"),
            "{out}"
        );
        let (code, out, err) = d.cli(&["approve", "r1", "k1"]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("1/2"), "{out}");
        let (code, _, err) = d.cli(&["approve", "r1", "k1"]);
        assert_ne!(code, 0, "the same operator voted twice: {err}");
        let (code, _, err) = d.cli(&["compensate", "retry", "r1", "k1"]);
        assert_ne!(code, 0, "a retry was taken for the second vote");
        assert!(err.contains("awaits approval r1#1"), "{err}");
        let vote = json!({"op": "decide", "run": "r1", "key": "k1", "decision": "approve"});
        assert_eq!(err_code(&mut a, vote), "forbidden");
        ok(&mut ex, json!({"op": "ping"}));
        assert!(
            ex.events.is_empty(),
            "sent on one operator's word: {:?}",
            ex.events
        );
        // Subscribers hear of the hold (reason `approval`) and of the vote.
        ok(&mut watcher, json!({"op": "ping"}));
        let seen: Vec<(EventKind, Option<&str>)> = watcher
            .events
            .iter()
            .filter(|e| e.key.as_deref() == Some("k1"))
            .map(|e| (e.event, e.reason.as_deref().or(e.decision.as_deref())))
            .filter(|(k, _)| matches!(k, EventKind::Held | EventKind::Decided))
            .collect();
        assert_eq!(
            seen,
            [
                (EventKind::Held, Some("approval")),
                (EventKind::Decided, Some("approve"))
            ],
            "{:?}",
            watcher.events
        );
    }
    d.restart(); // kill -9, then start again: the recorded vote stays
    let mut op = d.operator();
    let p = ok(&mut op, json!({"op": "pending"}));
    let item = &p["pending"][0];
    assert_eq!(
        (&item["approval"], &item["compensates"]),
        (&json!("r1#1"), &json!("refund"))
    );
    assert_eq!(item["approvals"].as_array().map(Vec::len), Some(1), "{p}");
    let mut ex = d.agent();
    ok(&mut ex, json!({"op": "compensations"}));
    let mut bob = d.client_with(&bob_token);
    let v = ok(
        &mut bob,
        json!({"op": "decide", "run": "r1", "key": "k1", "decision": "approve"}),
    );
    assert_eq!(v["status"], "approved", "{v}");
    let e = next_compensate(&mut ex);
    assert_eq!(e.args, Some(json!({"refund": "re_1", "amount": 10})));
    compensated(&mut ex, "r1", &e, "ok");
    assert_eq!(state(&mut op, "r1"), "cancelled");
    assert_eq!(records(&mut op, "r1", "compensation_held"), 1);
    assert_eq!(records(&mut op, "r1", "compensation_begin"), 1);
}
