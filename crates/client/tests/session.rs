//! The session as data: lines in, lines out, no socket.

use estop_client::ClientError;
use estop_client::session::{Limits, Received, Session};
use estop_protocol::ids::{EffectKey, RunId};
use estop_protocol::{ErrorCode, Op, ReplyBody, Secret};

fn run(s: &str) -> RunId {
    RunId::new(s).unwrap()
}

fn key(s: &str) -> EffectKey {
    EffectKey::new(s).unwrap()
}

fn hello() -> Op {
    Op::Hello {
        token: Secret::new("tok"),
        run: None,
        component: Default::default(),
    }
}

fn wait(r: &str, k: &str) -> Op {
    Op::Wait {
        run: run(r),
        key: key(k),
        timeout_ms: 30_000,
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// A refusal without an id (the gate could not read a line) fails the request in flight
/// instead of leaving it waiting for ever.
#[test]
fn a_refusal_without_an_id_fails_what_is_in_flight() {
    let mut s = Session::new(Limits::default());
    let (id, _) = s.request(Op::Status { run: run("r1") }).unwrap();
    let got = s.receive(
        br#"{"id":null,"ok":false,"error":{"code":"line_too_long","message":"too long"}}"#,
    );
    match got {
        Received::Unsolicited { failed, error } => {
            assert_eq!(failed, vec![id]);
            assert_eq!(error.code(), Some(ErrorCode::LineTooLong));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(s.in_flight(), 0);
}

/// A request longer than the gate reads is refused here and never numbered or sent.
#[test]
fn a_line_over_the_bound_is_refused_before_it_is_sent() {
    let mut s = Session::new(Limits {
        line_bytes_max: 100,
        ..Limits::default()
    });
    let long = Op::Status {
        run: run(&"r".repeat(120)),
    };
    match s.request(long) {
        Err(ClientError::LineTooLong { bytes, max: 100 }) => assert!(bytes > 100),
        other => panic!("{other:?}"),
    }
    assert_eq!(s.in_flight(), 0);
    let (id, _) = s.request(Op::Ping).unwrap();
    assert_eq!(id, 1, "the refused request took no id");
}

#[test]
fn requests_in_flight_are_bounded() {
    let mut s = Session::new(Limits {
        in_flight_max: 2,
        ..Limits::default()
    });
    s.request(Op::Ping).unwrap();
    s.request(Op::Ping).unwrap();
    assert_eq!(
        s.request(Op::Ping).unwrap_err(),
        ClientError::TooManyInFlight { max: 2 }
    );
}

/// Replies go to their requests by id, whatever order they come in; events are events.
#[test]
fn replies_match_by_id_and_events_pass() {
    let mut s = Session::new(Limits::default());
    let (a, _) = s.request(Op::Ping).unwrap();
    let (b, _) = s.request(Op::Status { run: run("r1") }).unwrap();
    let ev = s.receive(br#"{"event":"cancelled","run":"r1","at":5}"#);
    assert!(matches!(ev, Received::Event(e) if e.run == "r1"));
    let got = s.receive(
        format!(r#"{{"id":{b},"ok":false,"error":{{"code":"not_found","message":"no"}}}}"#)
            .as_bytes(),
    );
    assert!(
        matches!(got, Received::Reply { id, result: Err(e) } if id == b && e.code() == Some(ErrorCode::NotFound))
    );
    let got = s.receive(format!(r#"{{"id":{a},"ok":true,"pong":true}}"#).as_bytes());
    assert!(
        matches!(got, Received::Reply { id, result: Ok(ReplyBody::Pong(_)) } if id == a),
        "{got:?}"
    );
    assert_eq!(s.receive(br#"{"id":99,"ok":true}"#), Received::Stray);
}

/// After a closed connection: what changes the record fails as interrupted; a wait is parked
/// again under its own id, after the hello and the subscriptions.
#[test]
fn a_new_connection_says_hello_resubscribes_and_reparks_waits() {
    let mut s = Session::new(Limits::default());
    let (h, _) = s.request(hello()).unwrap();
    s.receive(format!(r#"{{"id":{h},"ok":true,"role":"agent","principal":"a"}}"#).as_bytes());
    let (sub, _) = s.request(Op::Subscribe { run: run("r1") }).unwrap();
    s.receive(format!(r#"{{"id":{sub},"ok":true}}"#).as_bytes());
    let (w, _) = s.request(wait("r1", "k1")).unwrap();
    let (c, _) = s
        .request(Op::Cancel {
            run: run("r1"),
            reason: None,
            cascade: true,
        })
        .unwrap();
    let failed = s.closed();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].0, c);
    let lines = text(&s.reconnected());
    let lines: Vec<&str> = lines.lines().collect();
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert!(lines[0].contains(r#""op":"hello""#) && lines[0].contains("tok"));
    assert!(lines[1].contains(r#""op":"subscribe""#) && lines[1].contains("r1"));
    assert!(lines[2].contains(r#""op":"wait""#) && lines[2].contains(&format!(r#""id":{w}"#)));
    // The hello and the subscription are the session's own: their replies are not a caller's.
    let hid: u64 = id_of(lines[0]);
    let got =
        s.receive(format!(r#"{{"id":{hid},"ok":true,"role":"agent","principal":"a"}}"#).as_bytes());
    assert!(
        matches!(got, Received::Hello { result: Ok(_), .. }),
        "{got:?}"
    );
    let sid: u64 = id_of(lines[1]);
    let got = s.receive(format!(r#"{{"id":{sid},"ok":true}}"#).as_bytes());
    assert!(
        matches!(
            got,
            Received::Restored {
                op: Op::Subscribe { .. },
                result: Ok(_)
            }
        ),
        "{got:?}"
    );
    let got = s.receive(
        format!(r#"{{"id":{w},"ok":true,"verdict":"refused","reason":"cancelled"}}"#).as_bytes(),
    );
    assert!(
        matches!(got, Received::Reply { id, result: Ok(_) } if id == w),
        "{got:?}"
    );
}

/// An unsubscribed run is not subscribed to again; a revoked token ends everything.
#[test]
fn unsubscribe_is_remembered_and_a_refused_hello_fails_the_callers() {
    let mut s = Session::new(Limits::default());
    let (h, _) = s.request(hello()).unwrap();
    s.receive(format!(r#"{{"id":{h},"ok":true,"role":"agent","principal":"a"}}"#).as_bytes());
    let (a, _) = s.request(Op::Subscribe { run: run("r1") }).unwrap();
    s.receive(format!(r#"{{"id":{a},"ok":true}}"#).as_bytes());
    let (b, _) = s.request(Op::Unsubscribe { run: run("r1") }).unwrap();
    s.receive(format!(r#"{{"id":{b},"ok":true}}"#).as_bytes());
    let (w, _) = s.request(wait("r2", "k")).unwrap();
    s.closed();
    let lines = text(&s.reconnected());
    assert!(!lines.contains(r#""op":"subscribe""#), "{lines}");
    let hid = id_of(lines.lines().next().unwrap());
    let got = s.receive(
        format!(
            r#"{{"id":{hid},"ok":false,"error":{{"code":"unauthenticated","message":"revoked"}}}}"#
        )
        .as_bytes(),
    );
    match got {
        Received::Hello {
            result: Err(e),
            failed,
        } => {
            assert_eq!(e.code(), Some(ErrorCode::Unauthenticated));
            assert!(failed.contains(&w));
        }
        other => panic!("{other:?}"),
    }
}

fn id_of(line: &str) -> u64 {
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    v["id"].as_u64().unwrap()
}

/// A `duplicate` verdict carries the effect's own `error` text beside `"ok": true`: it is a
/// reply, not a refusal (the envelope once read it as the refusal's error and failed).
#[test]
fn a_duplicate_with_the_effects_error_is_a_reply() {
    let mut s = Session::new(Limits::default());
    let (id, _) = s.request(wait("r1", "k1")).unwrap();
    let got = s.receive(
        format!(r#"{{"id":{id},"ok":true,"verdict":"duplicate","status":"failed","outcome":"error","error":"not sent"}}"#)
            .as_bytes(),
    );
    assert!(
        matches!(
            got,
            Received::Reply {
                result: Ok(ReplyBody::VerdictReply(_)),
                ..
            }
        ),
        "{got:?}"
    );
}

/// The gate's hello says its line bound; a longer request is refused here from then on.
#[test]
fn the_hellos_line_bound_is_kept() {
    let mut s = Session::new(Limits::default());
    let (h, _) = s.request(hello()).unwrap();
    s.receive(
        format!(r#"{{"id":{h},"ok":true,"role":"agent","principal":"a","line_bytes_max":200}}"#)
            .as_bytes(),
    );
    assert_eq!(s.limits().line_bytes_max, 200);
    let long = Op::Status {
        run: run(&"r".repeat(190)),
    };
    assert!(matches!(
        s.request(long),
        Err(ClientError::LineTooLong { max: 200, .. })
    ));
}
