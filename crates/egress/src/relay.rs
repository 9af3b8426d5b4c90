//! The gate's protocol socket inside the sandbox (`ESTOP_SOCKET`). A connection on it *is* the
//! run: the supervisor answers `hello` itself (any token, or none, is accepted and ignored: the
//! agent never holds one), opens its own authenticated connection to the daemon, and forwards
//! only the agent verbs that name this run. Another run of the same principal, the listings of
//! all its runs and every operator verb are refused here, before the daemon sees them.
//!
//! The relay speaks as the principal's `main` part; the supervisor's own connection (the
//! launch, the proxy, the metering) speaks as its `egress` part. The gate lets only the part
//! that admitted an effect admit it again, wait for it, start or complete it, so nothing sent
//! here reaches what the proxy recorded (`forbidden`); and the supervisor's tools (`http.*`,
//! `model.call`, `sandbox.run`) are refused here outright, so every such effect on the ledger
//! is the supervisor's.

use estop_protocol::server_line::error_line;
use estop_protocol::{ErrorCode, Id, Op, Verb, parse_request};
use serde_json::json;
use std::sync::Arc;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;
use tokio::sync::mpsc;

/// Longest request line forwarded: the daemon's default, the protocol's one constant.
pub const LINE_BYTES_MAX: usize = estop_protocol::limits::LINE_BYTES_MAX_DEFAULT;

/// The agent verbs that name one run; the relay forwards them only for this run. `pending`
/// counts only with a run (without one it lists all the principal's runs).
const RUN_VERBS: &[Verb] = &[
    Verb::Admit,
    Verb::Start,
    Verb::Complete,
    Verb::Wait,
    Verb::Subscribe,
    Verb::Unsubscribe,
    Verb::Status,
    Verb::Cancel,
    Verb::Close,
    Verb::Report,
    Verb::Pending,
];

/// Whether `tool` is one only the supervisor admits: an HTTP request through the proxy, a
/// metered model call, the sandbox's launch (in any case: a look-alike would read as one).
pub fn supervisor_tool(tool: &str) -> bool {
    tool.get(..5)
        .is_some_and(|p| p.eq_ignore_ascii_case("http."))
        || tool.eq_ignore_ascii_case("model.call")
        || tool.eq_ignore_ascii_case("sandbox.run")
}

#[derive(Clone, Debug)]
pub struct Relay {
    pub target: String,
    pub token: String,
    pub run: String,
    /// The sandbox's principal (`TOKEN/RUN`), as the gate named it.
    pub principal: String,
    /// Connections the sandbox may hold to this socket at once (`[egress] connections_max`).
    pub connections_max: usize,
}

/// Lines queued for an agent that does not read them before the relay stops reading the gate
/// for it (the gate then applies its own output bound to the relay's connection).
const QUEUE_LINES_MAX: usize = 256;

impl Relay {
    /// At most `connections_max` at once; one past it gets a `limit_exceeded` line and is
    /// closed.
    pub async fn serve(self, listener: UnixListener) {
        let slots = Arc::new(Semaphore::new(self.connections_max));
        while let Ok((conn, _)) = listener.accept().await {
            let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                let message = format!(
                    "this sandbox already holds connections_max = {} connections to the gate's socket; close one (or pipeline on one) and retry",
                    self.connections_max
                );
                // Best effort and without waiting: the accept loop never stalls on it.
                let _ = conn.try_write(&error_line(&Id::NULL, ErrorCode::LimitExceeded, &message));
                continue;
            };
            let relay = self.clone();
            tokio::spawn(async move {
                if let Err(e) = relay.connection(conn).await {
                    eprintln!("estop run: protocol socket: {e:#}");
                }
                drop(slot);
            });
        }
    }

    async fn connection(self, conn: UnixStream) -> anyhow::Result<()> {
        let upstream = UnixStream::connect(&self.target).await?;
        let (up_r, mut up_w) = upstream.into_split();
        let mut up_r = BufReader::new(up_r);
        // As the sandbox's own principal, like the supervisor's connection: the agent's
        // connections take that principal's shares, not those of the token's other sandboxes.
        let hello = json!({"id": 0, "op": "hello", "token": self.token, "run": self.run});
        let hello = hello.to_string() + "\n";
        up_w.write_all(hello.as_bytes()).await?;
        let mut answer = String::new();
        up_r.read_line(&mut answer).await?;
        anyhow::ensure!(
            answer.contains("\"ok\":true"),
            "the gate refused the run's token"
        );
        let (client_r, mut client_w) = conn.into_split();
        let (tx, mut rx) = mpsc::channel::<Vec<u8>>(QUEUE_LINES_MAX);
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
                if back.send(std::mem::take(&mut line)).await.is_err() {
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
                    if tx.send(reply).await.is_err() {
                        return Ok(()); // The agent's side is gone.
                    }
                }
            }
        }
    }

    /// A sub-run of this run: `RUN/NAME`, one level, `NAME` without `/`. Only this sandbox's
    /// relay serves names under its run's prefix, so another sandbox cannot create or reach
    /// them. One level, because a deeper sub-run's parent would be a sub-run the kernel may
    /// have made on the spot, unlinked, which this run's cancel would not reach.
    fn in_tree(&self, run: &str) -> bool {
        run.strip_prefix(self.run.as_str())
            .and_then(|rest| rest.strip_prefix('/'))
            .is_some_and(|name| !name.is_empty() && !name.contains('/'))
    }

    /// None: forward the line as it is. Some: the answer given here instead (a whole line).
    ///
    /// The line is read by the gate's own parser (`estop_protocol::parse_request`), and only a
    /// line it accepts is forwarded: a second reading of JSON here (duplicate keys, escapes)
    /// could disagree with the gate's about which run a line names, and such a line must not
    /// reach the gate unchecked. A line the parser refuses gets the gate's own refusal.
    pub fn check(&self, line: &[u8]) -> Option<Vec<u8>> {
        let line = line.strip_suffix(b"\n").unwrap_or(line);
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let req = match parse_request(line) {
            Ok(req) => req,
            Err(e) => return Some(error_line(&e.id, e.code(), &e.to_string())),
        };
        let refuse = |message: String| Some(error_line(&req.id, ErrorCode::Forbidden, &message));
        match &req.op {
            Op::Hello { component, .. } if *component != estop_kernel::Part::Main => {
                refuse(format!(
                    "inside `estop run` this socket speaks as the run's main part only, not {:?}",
                    component.as_str()
                ))
            }
            Op::Hello { .. } => Some(
                (json!({"id": req.id, "ok": true, "role": "agent",
                    "principal": self.principal, "protocol": 1, "run": self.run})
                .to_string()
                    + "\n")
                    .into_bytes(),
            ),
            Op::Ping => None,
            op if RUN_VERBS.contains(&op.verb()) => {
                let run = op.run().map_or("", |r| r.as_str());
                if let Op::Admit(a) = op
                    && supervisor_tool(a.tool.as_str())
                {
                    return refuse(format!(
                        "tool {:?} is the supervisor's (its proxy's requests, metered model calls and the launch): send the request through the proxy instead",
                        a.tool.as_str()
                    ));
                }
                if run == self.run {
                    return None;
                }
                if !self.in_tree(run) {
                    return refuse(format!(
                        "inside `estop run` this socket serves run {:?} and its sub-runs \
                         {:?} only",
                        self.run,
                        format!("{}/…", self.run)
                    ));
                }
                // A sub-run names this run as its parent on every admit (the first creates it):
                // a cancel of this run reaches it.
                match op {
                    Op::Admit(a)
                        if a.parent.as_ref().map(|p| p.as_str()) != Some(self.run.as_str()) =>
                    {
                        refuse(format!(
                            "an admit to sub-run {run:?} names its parent: \"parent\": {:?}",
                            self.run
                        ))
                    }
                    _ => None,
                }
            }
            _ => refuse(format!(
                "inside `estop run` only the verbs of run {:?} are served",
                self.run
            )),
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
            connections_max: 1,
        };
        let pass = |l: &str| r.check(l.as_bytes()).is_none();
        let answer = |l: &str| -> serde_json::Value {
            serde_json::from_slice(&r.check(l.as_bytes()).expect("answered here")).unwrap()
        };
        assert!(pass(
            r#"{"id":1,"op":"admit","run":"r1","key":"k","tool":"t","args":{}}"#
        ));
        assert!(pass(r#"{"op":"ping"}"#));
        // A line the gate's parser refuses is answered here with the gate's own refusal.
        assert_eq!(answer("not json")["error"]["code"], "bad_json");
        // Two readings of one line must not disagree about its run: a duplicate `run` is the
        // gate's refusal here, never forwarded (a last-wins reader would see r1).
        let dup =
            answer(r#"{"id":2,"op":"admit","run":"r2","run":"r1","key":"k","tool":"t","args":{}}"#);
        assert_eq!(dup["ok"], false, "{dup}");
        assert_eq!(dup["id"], 2, "{dup}");
        assert!(pass(r#"{"id":3,"op":"pending","run":"r1"}"#));
        assert!(
            !pass(r#"{"id":3,"op":"ledger","run":"r1"}"#),
            "ledger is not an agent verb here"
        );
        assert!(!pass(
            r#"{"id":1,"op":"admit","run":"r2","key":"k","tool":"t","args":{}}"#
        ));
        assert!(!pass(r#"{"id":1,"op":"runs"}"#));
        assert!(!pass(r#"{"id":1,"op":"pending"}"#));
        assert!(!pass(
            r#"{"id":1,"op":"decide","run":"r1","key":"k","decision":"approve"}"#
        ));
        // Sub-runs: `r1/NAME`, each admit naming r1 as its parent.
        assert!(pass(
            r#"{"id":1,"op":"admit","run":"r1/a","parent":"r1","key":"k","tool":"t","args":{}}"#
        ));
        assert!(pass(r#"{"id":1,"op":"cancel","run":"r1/a"}"#));
        for refused in [
            // No parent: the sub-run would not be in this run's tree.
            r#"{"id":1,"op":"admit","run":"r1/a","key":"k","tool":"t","args":{}}"#,
            // Deeper than one level: its parent could be a run the kernel makes unlinked.
            r#"{"id":1,"op":"admit","run":"r1/a/b","parent":"r1/a","key":"k","tool":"t","args":{}}"#,
            r#"{"id":1,"op":"admit","run":"r1/a/b","parent":"r1","key":"k","tool":"t","args":{}}"#,
            r#"{"id":1,"op":"admit","run":"r1//b","parent":"r1/","key":"k","tool":"t","args":{}}"#,
            // A parent other than this run.
            r#"{"id":1,"op":"admit","run":"r1/a","parent":"r2","key":"k","tool":"t","args":{}}"#,
            // Names that only look like sub-runs.
            r#"{"id":1,"op":"admit","run":"r10","parent":"r1","key":"k","tool":"t","args":{}}"#,
            r#"{"id":1,"op":"admit","run":"r1/","parent":"r1","key":"k","tool":"t","args":{}}"#,
            r#"{"id":1,"op":"cancel","run":"r2/a"}"#,
        ] {
            let v = answer(refused);
            assert_eq!(v["error"]["code"], "forbidden", "{refused}: {v}");
        }
        let hello = answer(r#"{"id":7,"op":"hello","token":"x"}"#);
        assert_eq!(hello["ok"], true);
        assert_eq!(hello["id"], 7);
        assert!(
            !hello.to_string().contains("secret"),
            "the run's token never reaches the agent"
        );
    }

    /// The sandbox cannot become the supervisor: a hello as its `egress` part is refused, and
    /// so is every admit of a tool only the supervisor admits, in the run or a sub-run.
    #[test]
    fn the_supervisors_part_and_tools_are_refused() {
        let r = Relay {
            target: String::new(),
            token: "secret".into(),
            run: "r1".into(),
            principal: "agent/r1".into(),
            connections_max: 1,
        };
        let answer = |l: &str| -> serde_json::Value {
            serde_json::from_slice(&r.check(l.as_bytes()).expect("answered here")).unwrap()
        };
        let v = answer(r#"{"id":1,"op":"hello","token":"x","component":"egress"}"#);
        assert_eq!(v["error"]["code"], "forbidden", "{v}");
        for tool in ["http.GET", "HTTP.post", "model.call", "Sandbox.Run"] {
            for run in [r#""run":"r1""#, r#""run":"r1/a","parent":"r1""#] {
                let line = format!(
                    r#"{{"id":2,"op":"admit",{run},"key":"k","tool":"{tool}","args":{{}}}}"#
                );
                let v = answer(&line);
                assert_eq!(v["error"]["code"], "forbidden", "{line}: {v}");
                assert_eq!(v["id"], 2, "{v}");
            }
        }
        // Its own tools pass (the gate then decides).
        assert!(
            r.check(br#"{"id":3,"op":"admit","run":"r1","key":"k","tool":"httpx","args":{}}"#)
                .is_none()
        );
    }
}
