//! The OpenAI-compatible chat-completions client, streaming (SSE). A reply counts only once its
//! terminal event arrived (a `finish_reason`, then `[DONE]` or the end of the body): tool calls
//! are assembled from their deltas and handed over only then. A stream that ends early, an
//! HTTP error, the call deadline or a cut is a [`Reply::Failed`] or [`Reply::Cut`], whose
//! partial output is discarded — never parsed into a call. What a reply may make the harness
//! hold is bounded ([`Bounds`]: tool calls, bytes per event, per tool call and per response),
//! and scanned in linear time; past a bound the stream is cut and the reply is a
//! [`Reply::Overflow`].

use crate::budget::Usage;
use crate::chat::{Finish, Message, Overflow, Reply, ToolCall};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use serde_json::{Value, json};
use std::time::Duration;
use tokio::sync::watch;

/// Where the provider is, and how to reach it.
#[derive(Clone, Debug)]
pub struct ModelClient {
    ep: Endpoint,
}

/// An HTTP(S) endpoint JSON is posted to: the model provider, or an HTTP tool.
#[derive(Clone)]
pub struct Endpoint {
    https: bool,
    host: String,
    port: u16,
    /// The base path (`/v1`): calls go to `BASE/chat/completions`.
    base_path: String,
    api_key: Option<String>,
    tls: Option<tokio_rustls::TlsConnector>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Endpoint({}:{}{})", self.host, self.port, self.base_path)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("the model base URL {0:?} is not an http:// or https:// URL with a host")]
    Url(String),
    #[error("TLS set-up: {0}")]
    Tls(String),
}

/// One call: the context, the tools offered, and its ceilings.
#[derive(Debug, Clone)]
pub struct CallRequest {
    pub model: String,
    pub messages: Vec<Message>,
    /// Tool definitions as the API takes them (`{"type": "function", "function": {…}}`).
    pub tools: Vec<Value>,
    pub max_tokens: u64,
    pub deadline: Duration,
}

impl ModelClient {
    /// `base_url` like `https://api.openai.com/v1` or `http://127.0.0.1:8080/v1`.
    pub fn new(base_url: &str, api_key: Option<String>) -> Result<ModelClient, ModelError> {
        Ok(ModelClient {
            ep: Endpoint::new(base_url, api_key)?,
        })
    }
}

impl Endpoint {
    /// `url` like `https://api.openai.com/v1` or `http://127.0.0.1:8080/lookup`.
    pub fn new(base_url: &str, api_key: Option<String>) -> Result<Endpoint, ModelError> {
        let bad = || ModelError::Url(base_url.to_string());
        let uri: hyper::Uri = base_url.parse().map_err(|_| bad())?;
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err(bad()),
        };
        let host = uri.host().ok_or_else(bad)?.to_string();
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        let tls = if https {
            Some(estop_egress::tls::connector(None).map_err(|e| ModelError::Tls(e.to_string()))?)
        } else {
            None
        };
        Ok(Endpoint {
            https,
            host,
            port,
            base_path: uri.path().trim_end_matches('/').to_string(),
            api_key,
            tls,
        })
    }

    async fn post(
        &self,
        path: &str,
        accept: &str,
        body: String,
    ) -> Result<hyper::Response<hyper::body::Incoming>, String> {
        let tcp = tokio::net::TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|e| format!("connect {}:{}: {e}", self.host, self.port))?;
        tcp.set_nodelay(true).ok();
        let mut builder = Request::post(format!("{}{path}", self.base_path))
            .header("host", &self.host)
            .header("content-type", "application/json")
            .header("accept", accept);
        if let Some(k) = &self.api_key {
            builder = builder.header("authorization", format!("Bearer {k}"));
        }
        let request = builder
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        macro_rules! send {
            ($io:expr) => {{
                let (mut sender, conn) =
                    hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new($io))
                        .await
                        .map_err(|e| format!("handshake: {e}"))?;
                tokio::spawn(conn);
                sender
                    .send_request(request)
                    .await
                    .map_err(|e| format!("request: {e}"))
            }};
        }
        match (&self.tls, self.https) {
            (Some(tls), true) => {
                let name = rustls::pki_types::ServerName::try_from(self.host.clone())
                    .map_err(|e| format!("server name: {e}"))?;
                let io = tls
                    .connect(name, tcp)
                    .await
                    .map_err(|e| format!("TLS: {e}"))?;
                send!(io)
            }
            _ => send!(tcp),
        }
    }
}

impl ModelClient {
    /// Makes one streamed call. When `cut` turns true, the stream is read on for at most
    /// `grace` (a terminal event already on its way still counts) and then dropped, which
    /// closes the connection so the provider stops generating (and billing).
    pub async fn call(
        &self,
        req: &CallRequest,
        mut cut: watch::Receiver<bool>,
        grace: Duration,
    ) -> Reply {
        let deadline = tokio::time::Instant::now() + req.deadline;
        // The usage seen so far, for a call cut or timed out before its end.
        let seen = std::sync::Arc::new(std::sync::Mutex::new(None));
        let work = self.stream(req, seen.clone());
        let seen_now = || *seen.lock().expect("not poisoned");
        tokio::pin!(work);
        let cut_now = async {
            // A closed sender never cuts.
            if cut.wait_for(|c| *c).await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            r = &mut work => return r,
            _ = tokio::time::sleep_until(deadline) => {
                return Reply::Failed { error: "the call passed its deadline".into(), retryable: true, usage: seen_now(), retry_after_ms: None };
            }
            _ = cut_now => {}
        }
        match tokio::time::timeout(grace, &mut work).await {
            Ok(r) => r,
            Err(_) => Reply::Cut { usage: seen_now() },
        }
    }

    async fn stream(
        &self,
        req: &CallRequest,
        seen: std::sync::Arc<std::sync::Mutex<Option<Usage>>>,
    ) -> Reply {
        let mut acc = Accumulator::new(Bounds::default());
        let failed = |error: String, retryable: bool| Reply::Failed {
            error,
            retryable,
            usage: None,
            retry_after_ms: None,
        };
        let mut body = json!({
            "model": req.model,
            "messages": req.messages,
            "max_tokens": req.max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if !req.tools.is_empty() {
            body["tools"] = Value::Array(req.tools.clone());
        }
        let resp = match self
            .ep
            .post("/chat/completions", "text/event-stream", body.to_string())
            .await
        {
            Ok(r) => r,
            Err(e) => return failed(e, true),
        };
        let status = resp.status();
        let retry_after_ms = resp
            .headers()
            .get(hyper::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| retry_after_ms(v, std::time::SystemTime::now()));
        let mut incoming = resp.into_body();
        if !status.is_success() {
            let text = read_some(&mut incoming).await;
            let retryable = status.as_u16() == 429 || status.is_server_error();
            return Reply::Failed {
                error: format!("HTTP {status}: {text}"),
                retryable,
                usage: None,
                retry_after_ms: retry_after_ms.filter(|_| retryable),
            };
        }
        loop {
            match incoming.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        // A reply here (terminal, or past a bound) returns, which drops the
                        // body and closes the connection: the rest is never read.
                        let done = acc.push(&data);
                        *seen.lock().expect("not poisoned") = acc.usage();
                        if let Some(done) = done {
                            return done;
                        }
                    }
                }
                Some(Err(e)) => {
                    return Reply::Failed {
                        error: format!("stream: {e}"),
                        retryable: true,
                        usage: acc.usage(),
                        retry_after_ms: None,
                    };
                }
                None => return acc.end(),
            }
        }
    }
}

/// The longest `Retry-After` taken as it is (a day); a longer one is this (the retry policy
/// caps it further: crate::record::Retry).
pub const RETRY_AFTER_MS_MAX: u64 = 86_400_000;

/// A `Retry-After` value in milliseconds from `now`: delay-seconds or an HTTP date (RFC 9110
/// §10.2.3); a date in the past is 0; anything else is `None` (ignored).
pub fn retry_after_ms(value: &str, now: std::time::SystemTime) -> Option<u64> {
    let value = value.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        let secs: u64 = value.parse().unwrap_or(u64::MAX);
        return Some(secs.saturating_mul(1000).min(RETRY_AFTER_MS_MAX));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    let ms = at.duration_since(now).map_or(0, |d| d.as_millis());
    Some(
        u64::try_from(ms)
            .unwrap_or(u64::MAX)
            .min(RETRY_AFTER_MS_MAX),
    )
}

async fn read_some(b: &mut hyper::body::Incoming) -> String {
    let mut out = Vec::new();
    while out.len() < 2048 {
        match b.frame().await {
            Some(Ok(f)) => {
                if let Ok(d) = f.into_data() {
                    out.extend_from_slice(&d)
                }
            }
            _ => break,
        }
    }
    out.truncate(2048);
    String::from_utf8_lossy(&out).into_owned()
}

/// Tool calls one reply may propose (a delta's `index` must be below it).
pub const TOOL_CALLS_MAX: usize = 128;
/// Bytes of one server-sent event, up to its blank line.
pub const EVENT_BYTES_MAX: usize = 1 << 20;
/// Bytes of one tool call: its id, name and arguments together.
pub const TOOL_CALL_BYTES_MAX: usize = 1 << 20;
/// Bytes of one whole response body.
pub const RESPONSE_BYTES_MAX: usize = 16 << 20;

/// What one streamed reply may make the harness hold; past any of them the stream is cut and
/// the reply is a [`Reply::Overflow`] (docs/HARNESS.md, "Bounds on a model reply").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub tool_calls_max: usize,
    pub event_bytes_max: usize,
    pub tool_call_bytes_max: usize,
    pub response_bytes_max: usize,
}

impl Default for Bounds {
    fn default() -> Self {
        Bounds {
            tool_calls_max: TOOL_CALLS_MAX,
            event_bytes_max: EVENT_BYTES_MAX,
            tool_call_bytes_max: TOOL_CALL_BYTES_MAX,
            response_bytes_max: RESPONSE_BYTES_MAX,
        }
    }
}

/// A streamed chat-completions reply assembled from its SSE body, chunk by chunk, within its
/// [`Bounds`]; only the terminal event (or [`Accumulator::end`]) hands a reply out. Each byte
/// is scanned for an event's end a bounded number of times (the scan resumes where the last
/// chunk's left off), so an endless event costs linear time until its bound cuts it.
#[derive(Debug, Default)]
pub struct Accumulator {
    bounds: Bounds,
    /// The bytes of the event not yet complete (complete ones are consumed at once).
    buf: Vec<u8>,
    /// How far `buf` was scanned for an event's end without finding one.
    scanned: usize,
    /// Bytes of the body so far.
    received: usize,
    /// Bytes examined by the event scanner so far (linear in `received`; a test checks it).
    examined: usize,
    text: String,
    calls: Vec<ToolCall>,
    finish: Option<Finish>,
    usage: Option<Usage>,
    /// A reply was handed out (terminal, failed or over a bound): nothing more is taken.
    over: bool,
}

impl Accumulator {
    /// An empty reply under `bounds`.
    pub fn new(bounds: Bounds) -> Accumulator {
        Accumulator {
            bounds,
            ..Accumulator::default()
        }
    }

    /// The usage the provider reported so far.
    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }

    /// Bytes of the reply held now: the unfinished event, the text and the tool calls. Never
    /// more than the bounds allow: `buf` ≤ `event_bytes_max`, each call ≤ its bound, the whole
    /// ≤ `response_bytes_max` (a test and the `model_stream` fuzz target check it).
    pub fn retained_bytes(&self) -> usize {
        let calls: usize = self.calls.iter().map(call_bytes).sum();
        self.buf.len() + self.text.len() + calls
    }

    /// The bytes of the unfinished event held now.
    pub fn pending_event_bytes(&self) -> usize {
        self.buf.len()
    }

    /// Tool calls assembled so far (at most `tool_calls_max`).
    pub fn calls_len(&self) -> usize {
        self.calls.len()
    }

    /// Bytes the event scanner examined so far: at most the bytes received plus 3 per chunk.
    pub fn examined_bytes(&self) -> usize {
        self.examined
    }

    /// Takes one chunk of the body; returns the reply once it is decided: at the terminal
    /// event, on an event that is not JSON, or past a bound (a [`Reply::Overflow`], after
    /// which everything held is dropped). After a reply, chunks are ignored.
    pub fn push(&mut self, chunk: &[u8]) -> Option<Reply> {
        if self.over {
            return None;
        }
        self.received = self.received.saturating_add(chunk.len());
        if self.received > self.bounds.response_bytes_max {
            let max = self.bounds.response_bytes_max;
            return Some(self.overflow(Overflow::ResponseBytes { max }));
        }
        self.buf.extend_from_slice(chunk);
        let mut buf = std::mem::take(&mut self.buf);
        let reply = self.consume(&mut buf);
        if reply.is_none() {
            self.buf = buf;
        }
        reply
    }

    /// Handles every complete event in `buf` and drains them; the scan starts where the last
    /// one stopped (less a separator's length, which may straddle two chunks).
    fn consume(&mut self, buf: &mut Vec<u8>) -> Option<Reply> {
        let mut start = 0;
        let mut from = self.scanned;
        while let Some((end, sep)) = find_event_end(buf, from, &mut self.examined) {
            if end - start > self.bounds.event_bytes_max {
                let max = self.bounds.event_bytes_max;
                return Some(self.overflow(Overflow::EventBytes { max }));
            }
            if let Some(r) = self.event(&buf[start..end]) {
                return Some(r);
            }
            start = end + sep;
            from = start;
        }
        buf.drain(..start);
        if buf.len() > self.bounds.event_bytes_max {
            let max = self.bounds.event_bytes_max;
            return Some(self.overflow(Overflow::EventBytes { max }));
        }
        self.scanned = buf.len().saturating_sub(3);
        None
    }

    /// One complete event: its `data:` lines.
    fn event(&mut self, event: &[u8]) -> Option<Reply> {
        let text = String::from_utf8_lossy(event);
        for line in text.lines() {
            let Some(data) = line.strip_prefix("data:") else {
                continue;
            };
            let data = data.trim();
            if data == "[DONE]" {
                return Some(self.end());
            }
            match serde_json::from_str::<Value>(data) {
                Ok(v) => {
                    if let Err(o) = self.chunk(&v) {
                        return Some(self.overflow(o));
                    }
                }
                Err(e) => {
                    self.over = true;
                    return Some(Reply::Failed {
                        error: format!("a stream event that is not JSON: {e}"),
                        retryable: true,
                        usage: self.usage,
                        retry_after_ms: None,
                    });
                }
            }
        }
        None
    }

    /// Past a bound: everything held is dropped, the reply is the overflow.
    fn overflow(&mut self, overflow: Overflow) -> Reply {
        self.over = true;
        self.buf = Vec::new();
        self.text = String::new();
        self.calls = Vec::new();
        Reply::Overflow {
            overflow,
            usage: self.usage,
        }
    }

    fn chunk(&mut self, v: &Value) -> Result<(), Overflow> {
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            let input = u["prompt_tokens"].as_u64().unwrap_or(0);
            let cached = u["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0)
                .min(input);
            self.usage = Some(Usage {
                uncached_input: input - cached,
                cached_input: cached,
                output: u["completion_tokens"].as_u64().unwrap_or(0),
            });
        }
        let Some(choice) = v["choices"].get(0) else {
            return Ok(());
        };
        let delta = &choice["delta"];
        if let Some(t) = delta["content"].as_str() {
            self.text.push_str(t);
        }
        for tc in delta["tool_calls"].as_array().into_iter().flatten() {
            self.tool_delta(tc)?;
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            self.finish = Some(Finish::parse(f));
        }
        Ok(())
    }

    /// One tool call delta, appended to the call its `index` names (within the bounds).
    fn tool_delta(&mut self, tc: &Value) -> Result<(), Overflow> {
        let index = tc["index"].as_u64().unwrap_or(0);
        let max = self.bounds.tool_calls_max;
        let i = match usize::try_from(index) {
            Ok(i) if i < max => i,
            _ => return Err(Overflow::ToolCalls { index, max }),
        };
        while self.calls.len() <= i {
            self.calls.push(ToolCall::new("", "", ""));
        }
        let c = &mut self.calls[i];
        if let Some(id) = tc["id"].as_str() {
            c.id = id.to_string();
        }
        if let Some(n) = tc["function"]["name"].as_str() {
            c.function.name.push_str(n);
        }
        if let Some(a) = tc["function"]["arguments"].as_str() {
            c.function.arguments.push_str(a);
        }
        let max = self.bounds.tool_call_bytes_max;
        if call_bytes(c) > max {
            return Err(Overflow::ToolCallBytes { index: i, max });
        }
        Ok(())
    }

    /// The body ended: a reply only if its finish reason came; otherwise it was truncated.
    pub fn end(&mut self) -> Reply {
        if self.over {
            return Reply::Failed {
                error: "the reply was handed out already".into(),
                retryable: true,
                usage: self.usage,
                retry_after_ms: None,
            };
        }
        self.over = true;
        self.buf = Vec::new();
        let Some(finish) = self.finish.take() else {
            return Reply::Failed {
                error: "the stream ended before its finish reason (truncated)".into(),
                retryable: true,
                usage: self.usage,
                retry_after_ms: None,
            };
        };
        let mut calls = std::mem::take(&mut self.calls);
        // Only a `tool_calls` finish hands calls over: what a `length` or a filter cut off
        // mid-call is discarded here, before anything could parse it.
        if finish != Finish::ToolCalls {
            calls.clear();
        }
        // A call without an id or a name was not finished (it cannot be answered). Arguments
        // that are not a JSON object are the model's mistake, answered to it as a tool error
        // (crate::chat::argument_problem), not a reason to send the same request again.
        if finish == Finish::ToolCalls
            && calls
                .iter()
                .any(|c| c.id.is_empty() || c.function.name.is_empty())
        {
            return Reply::Failed {
                error: "a tool call in the reply is incomplete".into(),
                retryable: true,
                usage: self.usage,
                retry_after_ms: None,
            };
        }
        Reply::Finished {
            finish,
            text: std::mem::take(&mut self.text),
            tool_calls: calls,
            usage: self.usage,
        }
    }
}

/// Bytes a tool call holds: its id, name and arguments.
fn call_bytes(c: &ToolCall) -> usize {
    c.id.len() + c.function.name.len() + c.function.arguments.len()
}

/// Feeds `chunks` of a chat-completions SSE body to an [`Accumulator`] under `bounds` and
/// returns its reply: the one a chunk decided, or the body's end. The entry point of the
/// `model_stream` fuzz target; after every chunk it asserts that what the accumulator holds is
/// within `bounds` (a panic is a bug).
pub fn parse_stream<'a>(bounds: Bounds, chunks: impl IntoIterator<Item = &'a [u8]>) -> Reply {
    let mut acc = Accumulator::new(bounds);
    let (mut total, mut pushes) = (0usize, 0usize);
    for chunk in chunks {
        total = total.saturating_add(chunk.len());
        pushes += 1;
        let reply = acc.push(chunk);
        assert!(acc.pending_event_bytes() <= bounds.event_bytes_max);
        assert!(acc.calls_len() <= bounds.tool_calls_max);
        assert!(acc.retained_bytes() <= bounds.response_bytes_max);
        // Linear: each byte once, plus a separator's length again per chunk.
        assert!(acc.examined_bytes() <= total + 3 * pushes);
        if let Some(r) = reply {
            return r;
        }
    }
    acc.end()
}

/// The end of the first SSE event in `buf` at or after `from`: (its end, the separator's
/// length). `examined` counts the bytes looked at.
fn find_event_end(buf: &[u8], from: usize, examined: &mut usize) -> Option<(usize, usize)> {
    for i in from..buf.len() {
        *examined += 1;
        if buf[i] != b'\n' && buf[i] != b'\r' {
            continue;
        }
        if buf[i..].starts_with(b"\n\n") {
            return Some((i, 2));
        }
        if buf[i..].starts_with(b"\r\n\r\n") {
            return Some((i, 4));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(events: &[&str]) -> Option<Reply> {
        Some(parse_stream(
            Bounds::default(),
            events.iter().map(|e| e.as_bytes()),
        ))
    }

    #[test]
    fn tool_calls_are_assembled_from_deltas_split_anywhere() {
        let all = concat!(
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"c1\",\"function\":{\"name\":\"drop_table\",\"arguments\":\"{\\\"t\\\"\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\": 1}\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":4,\"prompt_tokens_details\":{\"cached_tokens\":6}}}\n\n",
            "data: [DONE]\n\n",
        );
        for cut in [1, 7, 50, 100, all.len() - 3] {
            let r = feed(&[&all[..cut], &all[cut..]]).unwrap();
            let Reply::Finished {
                finish,
                tool_calls,
                usage,
                ..
            } = r
            else {
                panic!("{r:?}")
            };
            assert_eq!(finish, Finish::ToolCalls);
            assert_eq!(
                tool_calls,
                [ToolCall::new("c1", "drop_table", "{\"t\": 1}")]
            );
            assert_eq!(
                usage,
                Some(Usage {
                    uncached_input: 4,
                    cached_input: 6,
                    output: 4
                })
            );
        }
    }

    #[test]
    fn a_stream_without_its_finish_is_never_a_reply() {
        let partial = "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"c1\",\"function\":{\"name\":\"drop_table\",\"arguments\":\"{\\\"target\\\": \\\"cust\"}}]}}]}\n\n";
        assert!(matches!(feed(&[partial]), Some(Reply::Failed { .. })));
        // `[DONE]` without a finish reason: still truncated.
        assert!(matches!(
            feed(&[partial, "data: [DONE]\n\n"]),
            Some(Reply::Failed { .. })
        ));
    }

    fn small() -> Bounds {
        Bounds {
            tool_calls_max: 4,
            event_bytes_max: 256,
            tool_call_bytes_max: 64,
            response_bytes_max: 4096,
        }
    }

    fn delta(index: u64, args: &str) -> String {
        let chunk = json!({"choices": [{"delta": {"tool_calls": [
            {"index": index, "id": "c", "function": {"name": "t", "arguments": args}}
        ]}}]});
        format!("data: {chunk}\n\n")
    }

    /// Issue 27: one delta with `index: 10^12` made the accumulator push empty calls until the
    /// allocator aborted. Now an index at or past the bound is the typed overflow, nothing held.
    #[test]
    fn a_tool_call_index_past_the_bound_is_an_overflow_not_an_allocation() {
        for index in [1_000_000_000_000, u64::MAX, TOOL_CALLS_MAX as u64] {
            let r = parse_stream(Bounds::default(), [delta(index, "{}").as_bytes()]);
            assert_eq!(
                r,
                Reply::Overflow {
                    overflow: Overflow::ToolCalls {
                        index,
                        max: TOOL_CALLS_MAX
                    },
                    usage: None
                }
            );
        }
        let last = delta(TOOL_CALLS_MAX as u64 - 1, "{}");
        assert!(matches!(
            parse_stream(Bounds::default(), [last.as_bytes()]),
            Reply::Failed { .. }
        ));
    }

    /// Each of the other bounds cuts the reply with its own overflow.
    #[test]
    fn each_bound_cuts_the_reply_with_its_own_overflow() {
        let b = small();
        let long = "x".repeat(100);
        let r = parse_stream(b, [delta(0, &long).as_bytes()]);
        assert_eq!(
            r,
            Reply::Overflow {
                overflow: Overflow::ToolCallBytes { index: 0, max: 64 },
                usage: None
            }
        );
        // Two deltas of one call add up.
        let half = "y".repeat(40);
        let r = parse_stream(b, [delta(1, &half).as_bytes(), delta(1, &half).as_bytes()]);
        assert!(matches!(
            r,
            Reply::Overflow {
                overflow: Overflow::ToolCallBytes { index: 1, .. },
                ..
            }
        ));
        let text = |t: &str| {
            format!(
                "data: {}\n\n",
                json!({"choices": [{"delta": {"content": t}}]})
            )
        };
        let big = text(&"z".repeat(300));
        let r = parse_stream(b, [big.as_bytes()]);
        assert_eq!(
            r,
            Reply::Overflow {
                overflow: Overflow::EventBytes { max: 256 },
                usage: None
            }
        );
        let piece = text(&"w".repeat(100));
        let many: Vec<&[u8]> = std::iter::repeat_n(piece.as_bytes(), 40).collect();
        let r = parse_stream(b, many);
        assert_eq!(
            r,
            Reply::Overflow {
                overflow: Overflow::ResponseBytes { max: 4096 },
                usage: None
            }
        );
    }

    /// An event that never ends is cut at its bound, each byte scanned about once: fed one
    /// byte at a time (the old scanner went over the whole buffer again for every frame).
    #[test]
    fn an_endless_event_is_cut_at_its_bound_in_linear_time() {
        let b = Bounds {
            event_bytes_max: 64 << 10,
            ..Bounds::default()
        };
        let mut acc = Accumulator::new(b);
        let mut fed = 0;
        let reply = loop {
            fed += 1;
            if let Some(r) = acc.push(b"d") {
                break r;
            }
            assert!(fed <= b.event_bytes_max + 1, "never cut");
        };
        assert_eq!(
            reply,
            Reply::Overflow {
                overflow: Overflow::EventBytes { max: 64 << 10 },
                usage: None
            }
        );
        assert_eq!(fed, b.event_bytes_max + 1);
        assert!(acc.examined_bytes() <= 4 * fed, "{}", acc.examined_bytes());
        assert_eq!(acc.retained_bytes(), 0, "everything dropped");
        // A separator split across chunks is still found, once.
        let r = parse_stream(
            Bounds::default(),
            [
                b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"},\"finish_reason\":\"stop\"}]}\r\n".as_slice(),
                b"\r".as_slice(),
                b"\ndata: [DONE]\n".as_slice(),
                b"\n".as_slice(),
            ],
        );
        assert!(
            matches!(r, Reply::Finished { ref text, .. } if text == "hi"),
            "{r:?}"
        );
    }
}
