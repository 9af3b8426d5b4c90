//! 2025-11-25's own task form (SEP-1686 as published in that revision: `params.task` on
//! `tools/call`, `tasks/get`, `tasks/result`, `tasks/list`, `tasks/cancel`,
//! `notifications/tasks/status`, the `tasks` capability), carried at estop's own edge: rmcp
//! 3.11 models only the SEP-2663 extension, drops the `task` field while parsing a `tools/call`,
//! and has no `tasks` capability or tool `execution` field. So the gateway rewrites messages as
//! bytes, before rmcp parses them and after it wrote them, on stdio (`edge`) and over HTTP
//! (`front.rs`, which already holds each body):
//!
//! * in: a `tools/call` with a `task` object becomes the request [`CALL`] (rmcp hands it to the
//!   gateway whole, `task` included); a `tasks/get` or `tasks/cancel` naming a task of this form
//!   becomes [`GET`] / [`CANCEL`] (the SEP-2663 ones keep their names and rmcp's shapes);
//!   `tasks/result` and `tasks/list` reach the gateway as they are (rmcp does not know them).
//!   A request that carries its own protocol version in `_meta` (2026-07-28, which has no such
//!   form) is never rewritten.
//! * out: an `initialize` result at 2025-11-25 gains the `tasks` capability (list, cancel,
//!   task-augmented `tools/call`); a `tools/list` result marks every tool
//!   `execution.taskSupport: "optional"` (older clients ignore the field).
//!
//! Lines and bodies are bounded: a message longer than [`LINE_BYTES_MAX`] passes unchanged (a
//! call in it is not a task: the bounded wait answers it).

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::Mutex;

/// A task-augmented `tools/call`, renamed so that rmcp passes its params whole.
pub const CALL: &str = "io.estop/sep1686/tools/call";
/// `tasks/get` of a 2025-11-25 task.
pub const GET: &str = "io.estop/sep1686/tasks/get";
/// `tasks/cancel` of a 2025-11-25 task.
pub const CANCEL: &str = "io.estop/sep1686/tasks/cancel";
/// Blocks until the task ends, then answers what the call answered.
pub const RESULT: &str = "tasks/result";
pub const LIST: &str = "tasks/list";
/// The notification a task's end is told by.
pub const STATUS: &str = "notifications/tasks/status";
/// The revision whose form this is.
pub const REVISION: &str = "2025-11-25";

/// The longest stdio line the edge parses; a longer one passes unchanged.
pub const LINE_BYTES_MAX: usize = 4 << 20;

/// Rewrites one client message for rmcp; `None` when it stays as it is. `ours` says whether a
/// task id is one of this form's.
pub fn inbound(msg: &[u8], ours: &dyn Fn(&str) -> bool) -> Option<Vec<u8>> {
    // Cheap test first: most messages are not about tasks and are not parsed twice.
    if !contains(msg, b"\"task") {
        return None;
    }
    let mut v: Value = serde_json::from_slice(msg).ok()?;
    let params = v.get("params")?;
    if params
        .pointer("/_meta/io.modelcontextprotocol~1protocolVersion")
        .is_some()
    {
        return None;
    }
    let renamed = match v.get("method")?.as_str()? {
        "tools/call" if params.get("task").is_some_and(Value::is_object) => CALL,
        "tasks/get" if params["taskId"].as_str().is_some_and(ours) => GET,
        "tasks/cancel" if params["taskId"].as_str().is_some_and(ours) => CANCEL,
        _ => return None,
    };
    v["method"] = json!(renamed);
    serde_json::to_vec(&v).ok()
}

/// Rewrites one message rmcp wrote to the client; `None` when it stays as it is.
pub fn outbound(msg: &[u8]) -> Option<Vec<u8>> {
    if !contains(msg, b"\"serverInfo\"") && !contains(msg, b"\"tools\"") {
        return None;
    }
    let mut v: Value = serde_json::from_slice(msg).ok()?;
    let result = v.get_mut("result")?.as_object_mut()?;
    if result.contains_key("serverInfo") {
        if result.get("protocolVersion")?.as_str()? != REVISION {
            return None;
        }
        let caps = result.get_mut("capabilities")?.as_object_mut()?;
        caps.insert(
            "tasks".into(),
            json!({"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}}),
        );
    } else {
        for tool in result.get_mut("tools")?.as_array_mut()? {
            if let Some(tool) = tool.as_object_mut() {
                tool.entry("execution")
                    .or_insert_with(|| json!({"taskSupport": "optional"}));
            }
        }
    }
    serde_json::to_vec(&v).ok()
}

/// `outbound` on one frame of an HTTP response: a JSON body, or the `data:` lines of SSE.
pub fn outbound_frame(bytes: &[u8]) -> Option<Vec<u8>> {
    if let Some(out) = outbound(bytes) {
        return Some(out);
    }
    let text = std::str::from_utf8(bytes).ok()?;
    let mut changed = false;
    let mut out = String::with_capacity(text.len() + 256);
    for line in text.split_inclusive('\n') {
        let (body, end) = match line.strip_suffix('\n') {
            Some(b) => (b, "\n"),
            None => (line, ""),
        };
        let rewritten = body
            .strip_prefix("data:")
            .and_then(|d| outbound(d.trim_start().as_bytes()))
            .and_then(|d| String::from_utf8(d).ok());
        match rewritten {
            Some(d) => {
                changed = true;
                out.push_str("data: ");
                out.push_str(&d);
                out.push_str(end);
            }
            None => out.push_str(line),
        }
    }
    changed.then(|| out.into_bytes())
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Puts the edge between a byte stream (stdio) and rmcp: returns the stream rmcp serves on.
/// Two tasks pump the lines, rewriting each; they end when either side closes. A client line
/// that is not JSON is answered here, `-32700` with id null, and not passed on (rmcp drops
/// such a line without a word, and its sender would wait for ever).
pub fn edge<R, W>(
    (from_client, to_client): (R, W),
    ours: std::sync::Arc<dyn Fn(&str) -> bool + Send + Sync>,
) -> (
    tokio::io::ReadHalf<tokio::io::DuplexStream>,
    tokio::io::WriteHalf<tokio::io::DuplexStream>,
)
where
    R: AsyncRead + Send + Unpin + 'static,
    W: AsyncWrite + Send + Unpin + 'static,
{
    let (rmcp_side, edge_side) = tokio::io::duplex(1 << 16);
    let (from_rmcp, to_rmcp) = tokio::io::split(edge_side);
    // Both pumps write to the client: rmcp's lines, and the edge's own parse errors.
    let to_client = std::sync::Arc::new(Mutex::new(to_client));
    let back = to_client.clone();
    tokio::spawn(async move {
        let rewrite = move |m: &[u8]| inbound(m, &*ours);
        pump_lines(from_client, &Mutex::new(to_rmcp), rewrite, Some(&*back)).await;
    });
    tokio::spawn(async move {
        pump_lines(
            from_rmcp,
            &*to_client,
            outbound,
            None::<&Mutex<tokio::io::Sink>>,
        )
        .await;
    });
    tokio::io::split(rmcp_side)
}

/// Copies newline-delimited messages from `r` to `w`, each through `rewrite`; a line over
/// `LINE_BYTES_MAX` is copied unchanged. Closes `w` at the end of `r`. Public for the fuzz
/// target `mcp_framing` (fuzz/), which feeds it untrusted bytes.
pub async fn pump<R, W>(r: R, w: W, rewrite: impl Fn(&[u8]) -> Option<Vec<u8>>)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    pump_lines(r, &Mutex::new(w), rewrite, None::<&Mutex<tokio::io::Sink>>).await;
}

/// `pump`, writing to a `w` another pump may share (a line is written under its lock, held
/// from its first byte to its newline), and with `back`, answering each line that is not JSON
/// there (a JSON-RPC parse error) instead of passing it on.
async fn pump_lines<R, W, B>(
    r: R,
    w: &Mutex<W>,
    rewrite: impl Fn(&[u8]) -> Option<Vec<u8>>,
    back: Option<&Mutex<B>>,
) where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
    B: AsyncWrite + Unpin,
{
    let mut r = tokio::io::BufReader::new(r);
    let mut line = Vec::new();
    // Inside a line too long to parse: copy the rest of it as it comes, under the same lock.
    let mut oversized = false;
    let mut unfinished = None;
    loop {
        line.clear();
        let limit = (LINE_BYTES_MAX + 1) as u64;
        let n = match (&mut r).take(limit).read_until(b'\n', &mut line).await {
            Ok(n) => n,
            Err(_) => break,
        };
        if n == 0 {
            break;
        }
        let whole = line.ends_with(b"\n");
        let parsed = !oversized && (whole || n <= LINE_BYTES_MAX);
        let body = line.strip_suffix(b"\n").unwrap_or(&line);
        if parsed
            && let Some(back) = back
            && let Some(answer) = parse_error(body)
        {
            let mut b = back.lock().await;
            if b.write_all(&answer).await.is_err() || b.flush().await.is_err() {
                break;
            }
            oversized = !whole;
            continue;
        }
        // A last line without its newline stays without one: one line out per line in.
        let out = parsed.then(|| rewrite(body)).flatten().map(|mut m| {
            if whole {
                m.push(b'\n');
            }
            m
        });
        let mut guard = match unfinished.take() {
            Some(g) => g,
            None => w.lock().await,
        };
        let sent = guard.write_all(out.as_deref().unwrap_or(&line)).await;
        if sent.is_err() || guard.flush().await.is_err() {
            break;
        }
        oversized = !whole;
        unfinished = oversized.then_some(guard);
    }
    drop(unfinished);
    let _ = w.lock().await.shutdown().await;
}

/// The JSON-RPC parse error (`-32700`, id null) for a line that is not JSON; `None` for JSON
/// (what is not a message rmcp answers itself, `-32600`) and for a blank line.
fn parse_error(body: &[u8]) -> Option<Vec<u8>> {
    let body = body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(body);
    if body.iter().all(u8::is_ascii_whitespace) {
        return None;
    }
    let e = serde_json::from_slice::<serde::de::IgnoredAny>(body).err()?;
    let mut out = serde_json::to_vec(&json!({"jsonrpc": "2.0", "id": null,
        "error": {"code": -32700, "message": format!("Parse error: {e}")}}))
    .expect("a JSON value serializes");
    out.push(b'\n');
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rewritten(msg: Value, ours: bool) -> Option<Value> {
        let out = inbound(msg.to_string().as_bytes(), &|_| ours)?;
        Some(serde_json::from_slice(&out).unwrap())
    }

    #[test]
    fn only_task_shaped_requests_are_renamed() {
        let call = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "a__b", "arguments": {}, "task": {"ttl": 5}}});
        let v = rewritten(call.clone(), false).unwrap();
        assert_eq!(v["method"], CALL);
        assert_eq!(v["params"]["task"]["ttl"], 5, "the params pass whole");
        // No task, a task that is not an object, or a 2026-07-28 request: unchanged.
        let mut plain = call.clone();
        plain["params"].as_object_mut().unwrap().remove("task");
        plain["params"]["arguments"] = json!({"task": 1});
        assert_eq!(rewritten(plain, false), None);
        let mut odd = call.clone();
        odd["params"]["task"] = json!(true);
        assert_eq!(rewritten(odd, false), None);
        let mut stateless = call;
        stateless["params"]["_meta"] =
            json!({"io.modelcontextprotocol/protocolVersion": "2026-07-28"});
        assert_eq!(rewritten(stateless, false), None);
        // tasks/get and tasks/cancel only for this form's task ids.
        let get = json!({"jsonrpc": "2.0", "id": 2, "method": "tasks/get",
            "params": {"taskId": "t"}});
        assert_eq!(rewritten(get.clone(), true).unwrap()["method"], GET);
        assert_eq!(rewritten(get, false), None);
        let cancel = json!({"jsonrpc": "2.0", "id": 3, "method": "tasks/cancel",
            "params": {"taskId": "t"}});
        assert_eq!(rewritten(cancel, true).unwrap()["method"], CANCEL);
    }

    #[test]
    fn the_tasks_capability_is_told_at_2025_11_25_only() {
        let init = |version: &str| {
            json!({"jsonrpc": "2.0", "id": 0, "result": {"protocolVersion": version,
                "capabilities": {"tools": {}}, "serverInfo": {"name": "estop", "version": "1"}}})
        };
        let out = outbound(init(REVISION).to_string().as_bytes()).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            v["result"]["capabilities"]["tasks"]["requests"]["tools"]["call"],
            json!({})
        );
        assert_eq!(outbound(init("2025-06-18").to_string().as_bytes()), None);
        let tools = json!({"jsonrpc": "2.0", "id": 1, "result": {"tools": [{"name": "a"}]}});
        let sse = format!("id: 1\ndata: {tools}\n\n");
        let out = String::from_utf8(outbound_frame(sse.as_bytes()).unwrap()).unwrap();
        let data = out.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
        let v: Value = serde_json::from_str(data).unwrap();
        assert_eq!(
            v["result"]["tools"][0]["execution"]["taskSupport"],
            "optional"
        );
        assert!(
            out.starts_with("id: 1\n") && out.ends_with("\n\n"),
            "{out:?}"
        );
    }

    #[tokio::test]
    async fn a_rewritten_last_line_without_its_newline_gets_none() {
        // Found writing the fuzz target `mcp_framing` (its framing property fails at once on
        // the old pump): a newline was added after a rewritten last line the client had not
        // ended, so one line in was two out.
        let call = json!({"method": "tools/call", "params": {"name": "x", "task": {}}});
        let mut out = Vec::new();
        pump(call.to_string().as_bytes(), &mut out, |m| {
            inbound(m, &|_| false)
        })
        .await;
        let out = String::from_utf8(out).unwrap();
        assert!(out.contains(CALL) && !out.contains('\n'), "{out:?}");
    }

    #[tokio::test]
    async fn the_pump_rewrites_lines_and_passes_oversized_ones_whole() {
        let call = json!({"method": "tools/call", "params": {"name": "x", "task": {}}});
        let big = format!("{{\"task\": \"{}\"}}", "a".repeat(LINE_BYTES_MAX + 10));
        let input = format!("{call}\n{big}\n{call}\n");
        let mut out = Vec::new();
        pump(input.as_bytes(), &mut out, |m| inbound(m, &|_| false)).await;
        let out = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(
            lines[0].contains(CALL) && lines[2].contains(CALL),
            "{}",
            lines[0]
        );
        assert_eq!(lines[1], big);
    }
}
