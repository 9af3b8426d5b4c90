//! The gate's protocol socket inside the sandbox (`ESTOP_SOCKET`). A connection on it *is* the
//! run: the supervisor answers `hello` itself (any token, or none, is accepted and ignored: the
//! agent never holds one), opens its own authenticated connection to the daemon, and forwards
//! only the agent verbs that name this run. Another run of the same principal, the listings of
//! all its runs and every operator verb are refused here, before the daemon sees them.

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;

/// Longest request line forwarded (the daemon's default `line_bytes_max`).
pub const LINE_BYTES_MAX: usize = 64 * 1024;

const RUN_VERBS: &[&str] = &[
    "admit",
    "start",
    "complete",
    "wait",
    "subscribe",
    "unsubscribe",
    "status",
    "cancel",
    "close",
    "report",
    "pending",
];

#[derive(Clone, Debug)]
pub struct Relay {
    pub target: String,
    pub token: String,
    pub run: String,
    pub principal: String,
}

impl Relay {
    pub async fn serve(self, listener: UnixListener) {
        while let Ok((conn, _)) = listener.accept().await {
            let relay = self.clone();
            tokio::spawn(async move {
                if let Err(e) = relay.connection(conn).await {
                    eprintln!("estop run: protocol socket: {e:#}");
                }
            });
        }
    }

    async fn connection(self, conn: UnixStream) -> anyhow::Result<()> {
        let upstream = UnixStream::connect(&self.target).await?;
        let (up_r, mut up_w) = upstream.into_split();
        let mut up_r = BufReader::new(up_r);
        let hello = json!({"id": 0, "op": "hello", "token": self.token}).to_string() + "\n";
        up_w.write_all(hello.as_bytes()).await?;
        let mut answer = String::new();
        up_r.read_line(&mut answer).await?;
        anyhow::ensure!(
            answer.contains("\"ok\":true"),
            "the gate refused the run's token"
        );
        let (client_r, mut client_w) = conn.into_split();
        let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
        tokio::spawn(async move {
            while let Some(line) = rx.recv().await {
                if client_w.write_all(&line).await.is_err() {
                    break;
                }
            }
        });
        let back = tx.clone();
        tokio::spawn(async move {
            let mut line = Vec::new();
            while matches!(up_r.read_until(b'\n', &mut line).await, Ok(n) if n > 0) {
                if back.send(std::mem::take(&mut line)).is_err() {
                    break;
                }
            }
        });
        let mut client_r = BufReader::new(client_r);
        loop {
            let mut line = Vec::new();
            let limit = (LINE_BYTES_MAX + 1) as u64;
            let n = (&mut client_r)
                .take(limit)
                .read_until(b'\n', &mut line)
                .await?;
            if n == 0 {
                return Ok(());
            }
            if line.len() > LINE_BYTES_MAX && line.last() != Some(&b'\n') {
                anyhow::bail!("a request line over {LINE_BYTES_MAX} bytes; connection closed");
            }
            match self.check(&line) {
                None => up_w.write_all(&line).await?,
                Some(reply) => {
                    let _ = tx.send((reply.to_string() + "\n").into_bytes());
                }
            }
        }
    }

    /// None: forward the line as it is. Some: the answer given here instead.
    pub fn check(&self, line: &[u8]) -> Option<Value> {
        // Not JSON: the gate answers it (bad_json) exactly as it would anywhere else.
        let v: Value = serde_json::from_slice(line).ok()?;
        let id = v.get("id").cloned().unwrap_or(Value::Null);
        let op = v.get("op").and_then(Value::as_str).unwrap_or("");
        let refuse = |code: &str, message: String| {
            Some(json!({"id": id, "ok": false, "error": {"code": code, "message": message}}))
        };
        match op {
            "hello" => Some(json!({"id": id, "ok": true, "role": "agent",
                "principal": self.principal, "protocol": 1, "run": self.run})),
            "ping" => None,
            op if RUN_VERBS.contains(&op) => {
                if v.get("run").and_then(Value::as_str) == Some(self.run.as_str()) {
                    None
                } else {
                    refuse(
                        "forbidden",
                        format!(
                            "inside `estop run` this socket serves run {:?} only",
                            self.run
                        ),
                    )
                }
            }
            _ => refuse(
                "forbidden",
                format!(
                    "inside `estop run` only the verbs of run {:?} are served",
                    self.run
                ),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_this_runs_agent_verbs_pass() {
        let r = Relay {
            target: String::new(),
            token: "secret".into(),
            run: "r1".into(),
            principal: "agent".into(),
        };
        let pass = |l: &str| r.check(l.as_bytes()).is_none();
        assert!(pass(
            r#"{"id":1,"op":"admit","run":"r1","key":"k","tool":"t","args":{}}"#
        ));
        assert!(pass(r#"{"op":"ping"}"#));
        assert!(pass("not json"), "the gate answers bad_json itself");
        assert!(!pass(
            r#"{"id":1,"op":"admit","run":"r2","key":"k","tool":"t","args":{}}"#
        ));
        assert!(!pass(r#"{"id":1,"op":"runs"}"#));
        assert!(!pass(r#"{"id":1,"op":"pending"}"#));
        assert!(!pass(
            r#"{"id":1,"op":"decide","run":"r1","key":"k","decision":"approve"}"#
        ));
        let hello = r.check(br#"{"id":7,"op":"hello","token":"x"}"#).unwrap();
        assert_eq!(hello["ok"], true);
        assert_eq!(hello["id"], 7);
        assert!(
            !hello.to_string().contains("secret"),
            "the run's token never reaches the agent"
        );
    }
}
