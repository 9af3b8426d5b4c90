//! The OpenAI-compatible chat-completions client, streaming (SSE). A reply counts only once its
//! terminal event arrived (a `finish_reason`, then `[DONE]` or the end of the body): tool calls
//! are assembled from their deltas and handed over only then. A stream that ends early, an
//! HTTP error, the call deadline or a cut is a [`Reply::Failed`] or [`Reply::Cut`], whose
//! partial output is discarded — never parsed into a call.

use crate::budget::Usage;
use crate::chat::{Finish, Message, Reply, ToolCall};
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
                return Reply::Failed { error: "the call passed its deadline".into(), retryable: true, usage: seen_now() };
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
        let mut acc = Accumulator::default();
        let failed = |error: String, retryable: bool| Reply::Failed {
            error,
            retryable,
            usage: None,
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
        let mut incoming = resp.into_body();
        if !status.is_success() {
            let text = read_some(&mut incoming).await;
            let retryable = status.as_u16() == 429 || status.is_server_error();
            return failed(format!("HTTP {status}: {text}"), retryable);
        }
        let mut buf: Vec<u8> = Vec::new();
        loop {
            match incoming.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        buf.extend_from_slice(&data);
                        let done = acc.feed(&mut buf);
                        *seen.lock().expect("not poisoned") = acc.usage;
                        if let Some(done) = done {
                            return done;
                        }
                    }
                }
                Some(Err(e)) => {
                    return Reply::Failed {
                        error: format!("stream: {e}"),
                        retryable: true,
                        usage: acc.usage,
                    };
                }
                None => return acc.end(),
            }
        }
    }
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

/// The reply assembled from its deltas; only [`Accumulator::finish`] hands it out.
#[derive(Debug, Default)]
struct Accumulator {
    text: String,
    calls: Vec<ToolCall>,
    finish: Option<Finish>,
    usage: Option<Usage>,
}

impl Accumulator {
    /// Consumes the complete SSE events in `buf`; returns the reply at the terminal event.
    fn feed(&mut self, buf: &mut Vec<u8>) -> Option<Reply> {
        while let Some(end) = find_event_end(buf) {
            let event: Vec<u8> = buf.drain(..end.0 + end.1).collect();
            let text = String::from_utf8_lossy(&event[..end.0]).into_owned();
            for line in text.lines() {
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim();
                if data == "[DONE]" {
                    return Some(self.end());
                }
                match serde_json::from_str::<Value>(data) {
                    Ok(v) => self.chunk(&v),
                    Err(e) => {
                        return Some(Reply::Failed {
                            error: format!("a stream event that is not JSON: {e}"),
                            retryable: true,
                            usage: self.usage,
                        });
                    }
                }
            }
        }
        None
    }

    fn chunk(&mut self, v: &Value) {
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
            return;
        };
        let delta = &choice["delta"];
        if let Some(t) = delta["content"].as_str() {
            self.text.push_str(t);
        }
        for tc in delta["tool_calls"].as_array().into_iter().flatten() {
            let i = tc["index"].as_u64().unwrap_or(0) as usize;
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
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            self.finish = Some(Finish::parse(f));
        }
    }

    /// The body ended: a reply only if its finish reason came; otherwise it was truncated.
    fn end(&mut self) -> Reply {
        let Some(finish) = self.finish.take() else {
            return Reply::Failed {
                error: "the stream ended before its finish reason (truncated)".into(),
                retryable: true,
                usage: self.usage,
            };
        };
        let mut calls = std::mem::take(&mut self.calls);
        // Only a `tool_calls` finish hands calls over: what a `length` or a filter cut off
        // mid-call is discarded here, before anything could parse it.
        if finish != Finish::ToolCalls {
            calls.clear();
        }
        // A call without an id or a name, or whose arguments are not JSON, was not finished.
        if finish == Finish::ToolCalls
            && calls.iter().any(|c| {
                c.id.is_empty()
                    || c.function.name.is_empty()
                    || serde_json::from_str::<Value>(&c.function.arguments).is_err()
            })
        {
            return Reply::Failed {
                error: "a tool call in the reply is incomplete".into(),
                retryable: true,
                usage: self.usage,
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

/// The end of the first SSE event in `buf`: (its length, the separator's length).
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    for i in 0..buf.len() {
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
        let mut acc = Accumulator::default();
        let mut buf = Vec::new();
        for e in events {
            buf.extend_from_slice(e.as_bytes());
            if let Some(r) = acc.feed(&mut buf) {
                return Some(r);
            }
        }
        Some(acc.end())
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
}
