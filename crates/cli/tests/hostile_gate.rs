//! A hostile agent against the gate's own edges (SPEC §6, issue 11): the SoundGate listener as a
//! back door into protocol-v1 runs, existence leaks through `subscribe`, and the gate-wide pools
//! (connections, waiters, subscriptions) that one principal must not be able to take from the
//! others or from the operator. Each test is black-box against a real `estop serve`.

mod common;

use common::{Daemon, admit, err_code, ok, verdict};
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
}
