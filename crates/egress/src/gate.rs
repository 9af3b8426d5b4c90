//! The egress side's way to the gate: the one client's tokio driver (`estop_client`), behind
//! the JSON-shaped calls the proxy, the supervisor, the executor and the MCP gateway make. A
//! request given as a JSON object is read by the protocol crate's own builder into a typed
//! request before it is sent (a malformed one is refused here, as the gate would refuse it);
//! the typed reply comes back as the JSON object the gate sent.
//!
//! Through the client, the connection survives the gate: it reconnects with backoff, says its
//! hello again, subscribes again (each run's `subscribe` answered again comes to the event
//! stream as `{"event":"resubscribed","run":…}`, so a follower looks at the run's state again)
//! and parks its waits again. A request the gate would refuse without an id (a line over its
//! bound) is refused here; a refusal without an id fails what is in flight instead of leaving
//! it waiting.

use anyhow::{Result, bail};
use estop_client::{ClientError, Connection, Notice, Options};
use estop_protocol::{Fields, HelloReply, Op, ReplyBody, Verb};
use serde_json::{Value, json};
use tokio::sync::mpsc;

/// A cheap handle; clones share the connection.
#[derive(Clone, Debug)]
pub struct Gate {
    conn: Connection,
}

impl Gate {
    /// Connects to `target` (a socket path, or host:port) and says hello with `token`, which
    /// must be an agent's, as run `run`'s sandbox: the connection's principal is the
    /// sandbox's own (`TOKEN/RUN`, docs/EGRESS.md), so what it holds of the gate's shares is
    /// not what other sandboxes of the same token hold. `component` is the part of that
    /// principal the connection speaks as: `egress` for `estop run`'s supervisor (its launch,
    /// proxy and metering), whose effects the sandbox behind the relay (`main`) can neither
    /// start, complete nor wait for. Returns the handle, the stream of event lines and the
    /// principal's name.
    pub async fn connect(
        target: &str,
        token: &str,
        run: &str,
        component: estop_kernel::Part,
    ) -> Result<(Gate, mpsc::UnboundedReceiver<Value>, String)> {
        let (gate, events) = Gate::open(target).await?;
        let mut hello = json!({"op": "hello", "token": token, "run": run});
        if component != estop_kernel::Part::Main {
            hello["component"] = json!(component.as_str());
        }
        let hello = gate.call(hello).await?;
        if hello["ok"] != true {
            bail!("the gate refused the token: {}", hello["error"]);
        }
        if hello["role"] != "agent" {
            bail!(
                "an agent token is needed (the run belongs to it), not a {} token; \
                 pass --token or ESTOP_TOKEN, or leave DATA/agent.token in place",
                hello["role"]
            );
        }
        let principal = hello["principal"].as_str().unwrap_or_default().to_string();
        Ok((gate, events, principal))
    }

    /// Connects to `target` (a socket path, or host:port) without saying hello: the caller
    /// authenticates (and reads the reply) itself; the client says that hello again on every
    /// new connection.
    pub async fn open(target: &str) -> Result<(Gate, mpsc::UnboundedReceiver<Value>)> {
        let (conn, notices) = Connection::open(Options::new(target))
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(Gate::wrap(conn, notices))
    }

    /// A gate over a stream already open, that does not reconnect (tests play the gate).
    #[cfg(test)]
    pub(crate) fn start<R, W>(r: R, w: W) -> (Gate, mpsc::UnboundedReceiver<Value>)
    where
        R: tokio::io::AsyncRead + Unpin + Send + 'static,
        W: tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let options = Options {
            reconnect: false,
            ..Options::new("")
        };
        let (conn, notices) = Connection::over((Box::new(r), Box::new(w)), options);
        Gate::wrap(conn, notices)
    }

    fn wrap(
        conn: Connection,
        mut notices: mpsc::UnboundedReceiver<Notice>,
    ) -> (Gate, mpsc::UnboundedReceiver<Value>) {
        let (events_tx, events) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(n) = notices.recv().await {
                let line = match n {
                    Notice::Event(e) => serde_json::to_value(e).unwrap_or(Value::Null),
                    Notice::Restored {
                        op: Op::Subscribe { run },
                        ..
                    } => json!({"event": "resubscribed", "run": run.to_string()}),
                    Notice::Dead(_) => break,
                    _ => continue,
                };
                if events_tx.send(line).is_err() {
                    return;
                }
            }
            // The gate no longer takes the token (or the connection is gone for good): the
            // stream ends, as a closed connection's did.
        });
        (Gate { conn }, events)
    }

    /// Sends one request and returns its reply object (ok or not). An error: the gate could
    /// not be reached, or the connection closed before it answered a request that is not
    /// safe to send again.
    pub async fn call(&self, req: Value) -> Result<Value> {
        self.send(req)?.await
    }

    /// Sends one request now (it is on its way to the gate, after every request sent before
    /// it, when this returns) and returns the wait for its reply.
    pub fn send(
        &self,
        req: Value,
    ) -> Result<impl std::future::Future<Output = Result<Value>> + Send + 'static> {
        let op = typed(&req);
        let sent = op.as_ref().ok().map(|op| self.conn.send(op.clone()));
        Ok(async move {
            let op = match op {
                Ok(op) => op,
                Err(refusal) => return Ok(refusal),
            };
            let answer = sent.expect("sent when typed").await;
            reply_value(&op, answer)
        })
    }
}

/// The typed request a JSON object is, or the refusal the gate would have given it.
fn typed(req: &Value) -> Result<Op, Value> {
    let refuse = |code: &str, message: String| json!({"ok": false, "error": {"code": code, "message": message}});
    let Some(obj) = req.as_object() else {
        return Err(refuse("bad_json", "a request is a JSON object".into()));
    };
    let name = obj.get("op").and_then(Value::as_str).unwrap_or_default();
    let Some(verb) = Verb::parse(name) else {
        return Err(refuse("unknown_op", format!("unknown op {name:?}")));
    };
    let mut f = Fields::new();
    for (k, v) in obj {
        if k != "op" && k != "id" {
            f.json(k, v);
        }
    }
    f.build(verb)
        .map(|r| r.op)
        .map_err(|e| refuse(e.code().as_str(), e.kind.to_string()))
}

/// The reply object the gate sent, from the client's typed answer.
fn reply_value(op: &Op, answer: Result<ReplyBody, ClientError>) -> Result<Value> {
    let refused = |code: &str, message: &str| {
        Ok(json!({"ok": false, "error": {"code": code, "message": message}}))
    };
    let body = match answer {
        Ok(body) => body,
        Err(ClientError::Refused { code, message }) => return refused(code.as_str(), &message),
        Err(ClientError::RefusedUnknown { code, message }) => return refused(&code, &message),
        Err(e @ ClientError::LineTooLong { .. }) => {
            return refused("line_too_long", &e.to_string());
        }
        Err(e @ ClientError::TooManyInFlight { .. }) => {
            return refused("limit_exceeded", &e.to_string());
        }
        Err(e) => bail!("{e} ({})", op.verb()),
    };
    let mut v = match body {
        ReplyBody::Hello(h) => serde_json::to_value::<HelloReply>(h),
        ReplyBody::VerdictReply(v) => serde_json::to_value(v),
        ReplyBody::Ack(a) => serde_json::to_value(a),
        ReplyBody::Pong(p) => serde_json::to_value(p),
        ReplyBody::Status(s) => serde_json::to_value(s),
        ReplyBody::Runs(r) => serde_json::to_value(r),
        ReplyBody::Pending(p) => serde_json::to_value(p),
        ReplyBody::Decided(d) => serde_json::to_value(d),
        ReplyBody::Ledger(l) => serde_json::to_value(l),
        ReplyBody::Report(r) => serde_json::to_value(r),
        ReplyBody::TokenCreated(t) => serde_json::to_value(t),
        ReplyBody::TokenRevoked(t) => serde_json::to_value(t),
        ReplyBody::Subscribed(r) => serde_json::to_value(r),
    }?;
    if !v.is_object() {
        v = json!({});
    }
    v["ok"] = json!(true);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    /// A call made after the gate hung up fails at once (it used to wait for ever, and
    /// `estop run` never exited after recording the end to a daemon that was gone).
    #[tokio::test]
    async fn a_call_after_the_gate_hung_up_fails_at_once() {
        use tokio::io::AsyncWriteExt;
        let (ours, mut theirs) = tokio::net::UnixStream::pair().unwrap();
        let (r, w) = ours.into_split();
        let (gate, _events) = super::Gate::start(r, w);
        // The gate stops talking but still takes our lines: the writer stays alive, so only
        // the reader's hang-up can tell a new call that no reply will ever come.
        theirs.shutdown().await.unwrap();
        assert!(gate.call(json!({"op": "ping"})).await.is_err());
        assert!(gate.call(json!({"op": "ping"})).await.is_err());
        drop(theirs);
    }

    /// A request over the gate's line bound is refused here, as the gate would refuse it,
    /// and never sent (the gate's own refusal has no id and would match nothing).
    #[tokio::test]
    async fn a_request_over_the_line_bound_is_refused_without_sending() {
        let (ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        let (r, w) = ours.into_split();
        let (gate, _events) = super::Gate::start(r, w);
        let big = "x".repeat(70 * 1024);
        let v = gate
            .call(json!({"op": "admit", "run": "r", "key": "k", "tool": "t", "args": {"b": big}}))
            .await
            .unwrap();
        assert_eq!(v["ok"], false);
        assert_eq!(v["error"]["code"], "line_too_long");
        drop(theirs);
    }

    /// A refusal with id null (`line_too_long`: the gate never read the line) fails every
    /// request in flight with that refusal; it used to match nothing, and they waited for
    /// ever. The connection stays usable.
    #[tokio::test]
    async fn a_refusal_without_an_id_fails_the_requests_in_flight() {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
        let (ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        let (r, w) = ours.into_split();
        let (gate, _events) = super::Gate::start(r, w);
        let (tr, mut tw) = theirs.into_split();
        let mut lines = BufReader::new(tr).lines();
        let first = gate
            .send(json!({"op": "wait", "run": "r", "key": "k", "timeout_ms": 1000}))
            .unwrap();
        let second = gate
            .send(json!({"op": "admit", "run": "r", "key": "k2", "tool": "t", "args": {}}))
            .unwrap();
        for _ in 0..2 {
            lines.next_line().await.unwrap().unwrap();
        }
        let refusal = r#"{"id":null,"ok":false,"error":{"code":"line_too_long","message":"line of 70000 bytes is longer than line_bytes_max = 65536; it was discarded"}}"#;
        tw.write_all(format!("{refusal}\n").as_bytes())
            .await
            .unwrap();
        let within = std::time::Duration::from_secs(10);
        for pending in [first, second] {
            let v = tokio::time::timeout(within, pending)
                .await
                .expect("answered")
                .unwrap();
            assert_eq!(v["ok"], false);
            assert_eq!(v["error"]["code"], "line_too_long");
            assert!(
                v["error"]["message"].as_str().unwrap().contains("65536"),
                "{v}"
            );
        }
        let third = gate.send(json!({"op": "ping"})).unwrap();
        let line = lines.next_line().await.unwrap().unwrap();
        let id = serde_json::from_str::<serde_json::Value>(&line).unwrap()["id"].clone();
        tw.write_all(format!("{}\n", json!({"id": id, "ok": true, "pong": true})).as_bytes())
            .await
            .unwrap();
        assert_eq!(third.await.unwrap()["ok"], true);
    }
}
