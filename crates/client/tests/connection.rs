//! The tokio driver against a gate played by the test over a real Unix socket: what a new
//! connection says after the old one closed, a refusal without an id, a late answer.

use estop_client::{ClientError, Connection, Notice, Options};
use estop_protocol::ids::{EffectKey, RunId};
use estop_protocol::{ErrorCode, Op, ReplyBody, Secret};
use serde_json::{Value, json};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixListener;

/// One accepted connection of the played gate: its lines in, ours out.
struct Peer {
    lines: tokio::io::Lines<BufReader<tokio::net::unix::OwnedReadHalf>>,
    out: tokio::net::unix::OwnedWriteHalf,
}

impl Peer {
    async fn accept(l: &UnixListener) -> Peer {
        let (s, _) = tokio::time::timeout(Duration::from_secs(10), l.accept())
            .await
            .expect("the client connects")
            .unwrap();
        let (r, w) = s.into_split();
        Peer {
            lines: BufReader::new(r).lines(),
            out: w,
        }
    }

    async fn next(&mut self) -> Value {
        let line = tokio::time::timeout(Duration::from_secs(10), self.lines.next_line())
            .await
            .expect("a line in time")
            .unwrap()
            .expect("not closed");
        serde_json::from_str(&line).unwrap()
    }

    async fn say(&mut self, v: Value) {
        let mut line = v.to_string();
        line.push('\n');
        self.out.write_all(line.as_bytes()).await.unwrap();
    }

    /// Reads a hello and answers it.
    async fn hello(&mut self) {
        let h = self.next().await;
        assert_eq!(h["op"], "hello", "{h}");
        self.say(json!({"id": h["id"], "ok": true, "role": "agent", "principal": "a"}))
            .await;
    }
}

fn hello() -> Op {
    Op::Hello {
        token: Secret::new("tok"),
        run: None,
        component: Default::default(),
    }
}

fn options(path: &std::path::Path) -> Options {
    let mut o = Options::new(path.to_str().unwrap());
    o.backoff.initial = Duration::from_millis(10);
    o.backoff.max = Duration::from_millis(50);
    o
}

async fn connected(
    l: &UnixListener,
    path: &std::path::Path,
) -> (
    Connection,
    tokio::sync::mpsc::UnboundedReceiver<Notice>,
    Peer,
) {
    let connecting = tokio::spawn(Connection::connect(options(path), hello()));
    let mut peer = Peer::accept(l).await;
    peer.hello().await;
    let (conn, notices, _) = connecting.await.unwrap().unwrap();
    (conn, notices, peer)
}

/// The gate goes away while a wait is parked and a run subscribed: the new connection says
/// hello, subscribes again and parks the wait again under its id; the wait's caller gets the
/// answer the new connection gives, and the restored subscription is told.
#[tokio::test]
async fn a_closed_connection_comes_back_subscribed_with_its_wait() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gate.sock");
    let l = UnixListener::bind(&path).unwrap();
    let (conn, mut notices, mut peer) = connected(&l, &path).await;
    let run = RunId::new("r1").unwrap();
    let sub = conn.send(Op::Subscribe { run: run.clone() });
    let s = peer.next().await;
    peer.say(json!({"id": s["id"], "ok": true})).await;
    sub.await.unwrap();
    let wait = conn.send(Op::Wait {
        run: run.clone(),
        key: EffectKey::new("k1").unwrap(),
        timeout_ms: 60_000,
    });
    let w = peer.next().await;
    assert_eq!(w["op"], "wait");
    drop(peer); // the gate restarts
    let mut peer = Peer::accept(&l).await;
    peer.hello().await;
    let s2 = peer.next().await;
    assert_eq!(
        (s2["op"].as_str(), s2["run"].as_str()),
        (Some("subscribe"), Some("r1"))
    );
    peer.say(json!({"id": s2["id"], "ok": true})).await;
    let w2 = peer.next().await;
    assert_eq!(
        (&w2["op"], &w2["id"]),
        (&json!("wait"), &w["id"]),
        "the same wait, re-parked"
    );
    peer.say(json!({"id": w2["id"], "ok": true, "verdict": "refused", "reason": "cancelled"}))
        .await;
    let got = wait.await.unwrap();
    assert!(matches!(got, ReplyBody::VerdictReply(_)), "{got:?}");
    let mut seen = Vec::new();
    while let Ok(Some(n)) = tokio::time::timeout(Duration::from_millis(200), notices.recv()).await {
        seen.push(n);
    }
    assert!(
        seen.iter()
            .any(|n| matches!(n, Notice::Disconnected { .. })),
        "{seen:?}"
    );
    assert!(
        seen.iter().any(|n| matches!(n, Notice::Reconnected(_))),
        "{seen:?}"
    );
    assert!(
        seen.iter().any(|n| matches!(
            n,
            Notice::Restored {
                op: Op::Subscribe { .. },
                result: Ok(_)
            }
        )),
        "{seen:?}"
    );
}

/// A request that changes the record and was in flight when the connection closed fails as
/// interrupted (the gate may have acted on it); it is not sent again.
#[tokio::test]
async fn a_write_in_flight_at_a_close_is_interrupted_not_repeated() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gate.sock");
    let l = UnixListener::bind(&path).unwrap();
    let (conn, _notices, mut peer) = connected(&l, &path).await;
    let cancel = conn.send(Op::Cancel {
        run: RunId::new("r1").unwrap(),
        reason: None,
        cascade: true,
    });
    assert_eq!(peer.next().await["op"], "cancel");
    drop(peer);
    assert_eq!(
        cancel.await.unwrap_err(),
        ClientError::Interrupted { verb: "cancel" }
    );
    let mut peer = Peer::accept(&l).await;
    peer.hello().await;
    let ping = conn.send(Op::Ping);
    let p = peer.next().await;
    assert_eq!(p["op"], "ping", "the cancel was not sent again: {p}");
    peer.say(json!({"id": p["id"], "ok": true, "pong": true}))
        .await;
    ping.await.unwrap();
}

/// The gate's refusal without an id (a line it could not read) fails the request in flight
/// at once instead of leaving it waiting for ever.
#[tokio::test]
async fn a_refusal_without_an_id_fails_the_request_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gate.sock");
    let l = UnixListener::bind(&path).unwrap();
    let (conn, _notices, mut peer) = connected(&l, &path).await;
    let status = conn.send(Op::Status {
        run: RunId::new("r1").unwrap(),
    });
    peer.next().await;
    peer.say(json!({"id": null, "ok": false, "error": {"code": "line_too_long", "message": "x"}}))
        .await;
    let e = tokio::time::timeout(Duration::from_secs(5), status)
        .await
        .expect("no hang")
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::LineTooLong));
}

/// A gate that answers 2 s late: the caller gets its answer, once; a request made meanwhile
/// is not held up behind it.
#[tokio::test]
async fn a_late_answer_is_delivered_once_and_holds_up_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gate.sock");
    let l = UnixListener::bind(&path).unwrap();
    let (conn, _notices, mut peer) = connected(&l, &path).await;
    let slow = conn.send(Op::Ping);
    let first = peer.next().await;
    let fast = conn.send(Op::Ping);
    let second = peer.next().await;
    peer.say(json!({"id": second["id"], "ok": true, "pong": true}))
        .await;
    tokio::time::timeout(Duration::from_secs(1), fast)
        .await
        .expect("not held up")
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pong = json!({"id": first["id"], "ok": true, "pong": true});
    peer.say(pong.clone()).await;
    peer.say(pong).await; // a duplicate is a stray, not a second answer
    assert!(matches!(slow.await, Ok(ReplyBody::Pong(_))));
    let after = conn.send(Op::Ping);
    let third = peer.next().await;
    peer.say(json!({"id": third["id"], "ok": true, "pong": true}))
        .await;
    assert!(
        after.await.is_ok(),
        "the connection goes on after the stray"
    );
}

/// A gate that is away longer than the patience: a request fails as unreachable instead of
/// waiting for ever; once the gate is back, requests go through again.
#[tokio::test]
async fn a_gate_away_past_the_patience_fails_requests_then_comes_back() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gate.sock");
    let l = UnixListener::bind(&path).unwrap();
    let connecting = tokio::spawn(Connection::connect(
        Options {
            patience: Some(Duration::from_millis(300)),
            ..options(&path)
        },
        hello(),
    ));
    let mut peer = Peer::accept(&l).await;
    peer.hello().await;
    let (conn, _notices, _) = connecting.await.unwrap().unwrap();
    drop(peer);
    drop(l);
    std::fs::remove_file(&path).unwrap();
    let e = tokio::time::timeout(Duration::from_secs(5), conn.send(Op::Ping))
        .await
        .expect("no hang")
        .unwrap_err();
    assert!(matches!(e, ClientError::Unreachable { .. }), "{e:?}");
    let l = UnixListener::bind(&path).unwrap();
    let ping = conn.send(Op::Ping);
    let mut peer = Peer::accept(&l).await;
    peer.hello().await;
    let p = peer.next().await;
    peer.say(json!({"id": p["id"], "ok": true, "pong": true}))
        .await;
    ping.await.unwrap();
}
