//! An asynchronous protocol v1 client to the daemon: one connection, requests pipelined and
//! matched to replies by id (a long `wait` holds up nothing else), events handed to a channel.

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, oneshot};

/// Callers waiting for their reply, by request id; `None` once the connection is gone, so a
/// call made after that fails at once instead of waiting for ever.
type Pending = Arc<Mutex<Option<HashMap<u64, oneshot::Sender<Result<Value, Unread>>>>>>;

/// The gate refused a line without reading its id (`line_too_long`, a line that is not JSON,
/// a revoked token's last word): its reply has `"id": null`, so it cannot be matched to the
/// request that caused it. Every request in flight on the connection fails with it (none of
/// them can be told apart from the one refused, and that one will never be answered).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the gate refused a request line unread ({code}: {message})")]
pub struct Unread {
    /// The refusal's code (`line_too_long`, `parse_error`, `unauthenticated`, …).
    pub code: String,
    pub message: String,
}

/// A cheap handle; clones share the connection.
#[derive(Clone, Debug)]
pub struct Gate {
    lines: mpsc::UnboundedSender<String>,
    pending: Pending,
    next: Arc<std::sync::atomic::AtomicU64>,
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
    /// authenticates (and reads the reply) itself.
    pub async fn open(target: &str) -> Result<(Gate, mpsc::UnboundedReceiver<Value>)> {
        Ok(if target.contains('/') {
            let s = tokio::net::UnixStream::connect(target)
                .await
                .with_context(|| {
                    format!("cannot connect to {target} (is `estop serve` running?)")
                })?;
            let (r, w) = s.into_split();
            Gate::start(r, w)
        } else {
            let s = tokio::net::TcpStream::connect(target)
                .await
                .with_context(|| format!("cannot connect to {target}"))?;
            let (r, w) = s.into_split();
            Gate::start(r, w)
        })
    }

    pub(crate) fn start<R, W>(r: R, mut w: W) -> (Gate, mpsc::UnboundedReceiver<Value>)
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let (lines, mut to_write) = mpsc::unbounded_channel::<String>();
        let (events_tx, events) = mpsc::unbounded_channel();
        let pending: Pending = Arc::new(Mutex::new(Some(HashMap::new())));
        tokio::spawn(async move {
            while let Some(line) = to_write.recv().await {
                if w.write_all(line.as_bytes()).await.is_err() {
                    break;
                }
            }
        });
        let waiting = pending.clone();
        tokio::spawn(async move {
            let mut reader = BufReader::new(r).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                let Ok(v) = serde_json::from_str::<Value>(&line) else {
                    continue;
                };
                if v.get("event").is_some() {
                    let _ = events_tx.send(v);
                } else if v.get("id").is_none_or(Value::is_null) && v["ok"] == false {
                    let unread = Unread {
                        code: v["error"]["code"].as_str().unwrap_or("?").to_string(),
                        message: v["error"]["message"].as_str().unwrap_or("").to_string(),
                    };
                    let all = waiting
                        .lock()
                        .expect("not poisoned")
                        .as_mut()
                        .map(std::mem::take)
                        .unwrap_or_default();
                    for tx in all.into_values() {
                        let _ = tx.send(Err(unread.clone()));
                    }
                } else if let Some(id) = v["id"].as_u64() {
                    let tx = waiting
                        .lock()
                        .expect("not poisoned")
                        .as_mut()
                        .and_then(|p| p.remove(&id));
                    if let Some(tx) = tx {
                        let _ = tx.send(Ok(v));
                    }
                }
            }
            // The gate is gone: every caller still waiting gets an error (dropped sender), and
            // every later call too.
            waiting.lock().expect("not poisoned").take();
        });
        let gate = Gate {
            lines,
            pending,
            next: Arc::new(1.into()),
        };
        (gate, events)
    }

    /// Sends one request and returns its reply object (ok or not).
    pub async fn call(&self, req: Value) -> Result<Value> {
        self.send(req)?.await
    }

    /// Sends one request now (it is on its way to the gate, after every request sent before
    /// it, when this returns) and returns the wait for its reply.
    pub fn send(
        &self,
        mut req: Value,
    ) -> Result<impl std::future::Future<Output = Result<Value>> + Send + 'static> {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        req["id"] = json!(id);
        let (tx, rx) = oneshot::channel();
        match self.pending.lock().expect("not poisoned").as_mut() {
            Some(p) => p.insert(id, tx),
            None => bail!("the connection to the gate is closed"),
        };
        let mut line = req.to_string();
        line.push('\n');
        if self.lines.send(line).is_err() {
            bail!("the connection to the gate is closed");
        }
        Ok(async move { Ok(rx.await.context("the connection to the gate closed")??) })
    }
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

    /// A refusal with id null (`line_too_long`: the gate never read the line) fails every
    /// request in flight with a typed error; it used to match nothing, and they waited for
    /// ever. The connection stays usable.
    #[tokio::test]
    async fn a_refusal_without_an_id_fails_the_requests_in_flight() {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
        let (ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        let (r, w) = ours.into_split();
        let (gate, _events) = super::Gate::start(r, w);
        let (tr, mut tw) = theirs.into_split();
        let mut lines = BufReader::new(tr).lines();
        let first = gate.send(json!({"op": "wait"})).unwrap();
        let second = gate.send(json!({"op": "admit"})).unwrap();
        for _ in 0..2 {
            lines.next_line().await.unwrap().unwrap();
        }
        let refusal = r#"{"id":null,"ok":false,"error":{"code":"line_too_long","message":"line of 70000 bytes is longer than line_bytes_max = 65536; it was discarded"}}"#;
        tw.write_all(format!("{refusal}\n").as_bytes())
            .await
            .unwrap();
        let within = std::time::Duration::from_secs(10);
        for pending in [first, second] {
            let e = tokio::time::timeout(within, pending)
                .await
                .expect("answered")
                .unwrap_err();
            let unread = e.downcast_ref::<super::Unread>().expect("typed");
            assert_eq!(unread.code, "line_too_long");
            assert!(unread.message.contains("65536"), "{unread}");
        }
        let third = gate.send(json!({"op": "ping"})).unwrap();
        let line = lines.next_line().await.unwrap().unwrap();
        let id = serde_json::from_str::<serde_json::Value>(&line).unwrap()["id"].clone();
        tw.write_all(format!("{}\n", json!({"id": id, "ok": true})).as_bytes())
            .await
            .unwrap();
        assert_eq!(third.await.unwrap()["ok"], true);
    }
}
