//! A scripted OpenAI-compatible chat-completions server, for tests and the README example: the
//! n-th call gets the n-th scripted response, streamed step by step; a step may wait for the
//! test's signal (so a test knows exactly where the stream is when it acts), and a response
//! may be an HTTP error (with headers: `Retry-After`), a stream cut short, or a `length` finish
//! in the middle of a tool call. It records every request body, when it arrived, and whether
//! the client went away mid-stream.

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::sync::{Semaphore, mpsc};

/// One step of a scripted response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "step", rename_all = "snake_case")]
pub enum Step {
    /// One SSE event `data: <chunk>`.
    Event { chunk: Value },
    /// `data: [DONE]`.
    Done,
    /// Wait for one [`Scripted::release`] before the next step.
    Gate,
    /// The whole response is this status and body (only as the first step, or after the
    /// `Header` steps).
    Status { status: u16, body: String },
    /// A header of a `Status` response (before it).
    Header { name: String, value: String },
    /// End the body here, without a terminal event.
    Hangup,
    /// These bytes as they are, `repeat` times, each time a chunk of its own (a hostile
    /// provider: an event that never ends, a frame split anywhere). Stops early once the
    /// client is gone.
    Raw {
        data: String,
        #[serde(default = "once")]
        repeat: u32,
    },
}

fn once() -> u32 {
    1
}

/// What the server saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// Call `n` began (its body is in [`Scripted::calls`]).
    Call { n: usize },
    /// The client went away during call `n`, before step `step` was sent.
    Gone { n: usize, step: usize },
    /// Call `n` was served to its end.
    Served { n: usize },
}

#[derive(Debug, Default)]
struct Shared {
    calls: Vec<Value>,
    /// Each call's headers (names lower-case), in order.
    headers: Vec<Vec<(String, String)>>,
    /// Each call's method and request target (`PUT /orders/7?x=1`), in order.
    targets: Vec<String>,
    /// When each call arrived, in order.
    times: Vec<std::time::Instant>,
    seen: Vec<Seen>,
}

/// A running scripted server; dropped, it stops.
#[derive(Debug)]
pub struct Scripted {
    pub addr: SocketAddr,
    shared: Arc<Mutex<Shared>>,
    gates: Arc<Semaphore>,
    changed: Arc<tokio::sync::Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Scripted {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The script file of the `estop-harness-scripted` binary: one response per call.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Script {
    pub responses: Vec<Vec<Step>>,
}

impl Scripted {
    /// Binds `listen` (port 0 for any) and serves `script` on the current tokio runtime.
    pub async fn start(listen: &str, script: Script) -> std::io::Result<Scripted> {
        let listener = tokio::net::TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Mutex::new(Shared::default()));
        let gates = Arc::new(Semaphore::new(0));
        let changed = Arc::new(tokio::sync::Notify::new());
        let script = Arc::new(script);
        let (sh, g, ch) = (shared.clone(), gates.clone(), changed.clone());
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (sh, g, ch, script) = (sh.clone(), g.clone(), ch.clone(), script.clone());
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        serve(req, script.clone(), sh.clone(), g.clone(), ch.clone())
                    });
                    let io = hyper_util::rt::TokioIo::new(tcp);
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(io, svc)
                        .await;
                });
            }
        });
        Ok(Scripted {
            addr,
            shared,
            gates,
            changed,
            task,
        })
    }

    /// The base URL a client is given (`http://ADDR/v1`).
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Every request body received, in order.
    pub fn calls(&self) -> Vec<Value> {
        self.shared.lock().expect("not poisoned").calls.clone()
    }

    /// Every request's headers (names lower-case), in order.
    pub fn headers(&self) -> Vec<Vec<(String, String)>> {
        self.shared.lock().expect("not poisoned").headers.clone()
    }

    /// Every request's method and target as received (`PUT /orders/7?x=1`), in order.
    pub fn targets(&self) -> Vec<String> {
        self.shared.lock().expect("not poisoned").targets.clone()
    }

    /// When each request arrived (its body read), in order.
    pub fn call_times(&self) -> Vec<std::time::Instant> {
        self.shared.lock().expect("not poisoned").times.clone()
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.shared.lock().expect("not poisoned").seen.clone()
    }

    /// Lets `n` gated steps proceed.
    pub fn release(&self, n: usize) {
        self.gates.add_permits(n);
    }

    /// Waits until the server has seen `what` (no sleep: woken by each change).
    pub async fn wait_for(&self, what: &Seen) {
        loop {
            let notified = self.changed.notified();
            if self.seen().contains(what) {
                return;
            }
            notified.await;
        }
    }
}

type Body = BoxBody<Bytes, Infallible>;

async fn serve(
    req: Request<Incoming>,
    script: Arc<Script>,
    shared: Arc<Mutex<Shared>>,
    gates: Arc<Semaphore>,
    changed: Arc<tokio::sync::Notify>,
) -> Result<Response<Body>, Infallible> {
    let headers: Vec<(String, String)> = req
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).into(),
            )
        })
        .collect();
    let target = format!(
        "{} {}",
        req.method(),
        req.uri().path_and_query().map_or("/", |p| p.as_str())
    );
    let bytes = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let n = {
        let mut s = shared.lock().expect("not poisoned");
        s.calls.push(body);
        s.headers.push(headers);
        s.targets.push(target);
        s.times.push(std::time::Instant::now());
        let n = s.calls.len() - 1;
        s.seen.push(Seen::Call { n });
        n
    };
    changed.notify_waiters();
    let Some(steps) = script.responses.get(n).cloned() else {
        return Ok(whole(500, format!("no scripted response for call {n}")));
    };
    let headers: Vec<(String, String)> = steps
        .iter()
        .map_while(|s| match s {
            Step::Header { name, value } => Some((name.clone(), value.clone())),
            _ => None,
        })
        .collect();
    if let Some(Step::Status { status, body }) = steps.get(headers.len()) {
        let mut response = whole(*status, body.clone());
        for (name, value) in headers {
            let name = hyper::header::HeaderName::try_from(name).expect("a header name");
            let value = hyper::header::HeaderValue::try_from(value).expect("a header value");
            response.headers_mut().append(name, value);
        }
        note(&shared, &changed, Seen::Served { n });
        return Ok(response);
    }
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, Infallible>>(4);
    tokio::spawn(async move {
        for (i, step) in steps.into_iter().enumerate() {
            let data = match step {
                Step::Raw { data, repeat } => {
                    if send_raw(&tx, data, repeat).await {
                        continue;
                    }
                    note(&shared, &changed, Seen::Gone { n, step: i });
                    return;
                }
                Step::Event { chunk } => format!("data: {chunk}\n\n"),
                Step::Done => "data: [DONE]\n\n".to_string(),
                Step::Hangup => break,
                Step::Status { .. } | Step::Header { .. } => continue,
                Step::Gate => {
                    tokio::select! {
                        p = gates.acquire() => { p.expect("never closed").forget(); continue }
                        _ = tx.closed() => { note(&shared, &changed, Seen::Gone { n, step: i }); return }
                    }
                }
            };
            if tx.send(Ok(Frame::data(Bytes::from(data)))).await.is_err() {
                note(&shared, &changed, Seen::Gone { n, step: i });
                return;
            }
        }
        note(&shared, &changed, Seen::Served { n });
    });
    let stream = futures_stream(rx);
    let body = StreamBody::new(stream).boxed();
    Ok(Response::builder()
        .header("content-type", "text/event-stream")
        .body(body)
        .expect("valid response"))
}

/// Sends `data` `repeat` times, a frame each; false once the client is gone.
async fn send_raw(
    tx: &mpsc::Sender<Result<Frame<Bytes>, Infallible>>,
    data: String,
    repeat: u32,
) -> bool {
    let chunk = Bytes::from(data);
    for _ in 0..repeat {
        if tx.send(Ok(Frame::data(chunk.clone()))).await.is_err() {
            return false;
        }
    }
    true
}

fn note(shared: &Mutex<Shared>, changed: &tokio::sync::Notify, s: Seen) {
    shared.lock().expect("not poisoned").seen.push(s);
    changed.notify_waiters();
}

fn whole(status: u16, body: String) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)).boxed())
        .expect("valid response")
}

/// An mpsc receiver as the `Stream` a `StreamBody` takes.
fn futures_stream<T>(rx: mpsc::Receiver<T>) -> impl futures_core::Stream<Item = T> {
    struct S<T>(mpsc::Receiver<T>);
    impl<T> futures_core::Stream for S<T> {
        type Item = T;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<T>> {
            self.0.poll_recv(cx)
        }
    }
    S(rx)
}

// Chunk builders: the shapes OpenAI-compatible providers stream.

pub fn text(delta: &str) -> Step {
    event(json!({"choices": [{"index": 0, "delta": {"content": delta}}]}))
}

/// The first delta of a tool call: its id and name, and the first fragment of its arguments.
pub fn tool_start(index: u64, id: &str, name: &str, args: &str) -> Step {
    event(json!({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": args}}
    ]}}]}))
}

pub fn tool_args(index: u64, args: &str) -> Step {
    event(json!({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": index, "function": {"arguments": args}}
    ]}}]}))
}

pub fn finish(reason: &str) -> Step {
    event(json!({"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}))
}

pub fn usage(prompt: u64, cached: u64, completion: u64) -> Step {
    event(json!({"choices": [], "usage": {
        "prompt_tokens": prompt, "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached}
    }}))
}

fn event(chunk: Value) -> Step {
    Step::Event { chunk }
}

/// A whole error response: `status`, a JSON body, and these headers (`Retry-After`).
pub fn status(status: u16, headers: &[(&str, &str)]) -> Vec<Step> {
    let mut steps: Vec<Step> = headers
        .iter()
        .map(|(name, value)| Step::Header {
            name: name.to_string(),
            value: value.to_string(),
        })
        .collect();
    steps.push(Step::Status {
        status,
        body: json!({"error": {"message": format!("scripted {status}")}}).to_string(),
    });
    steps
}

/// A whole reply that ends the turn with `answer`.
pub fn answer(answer: &str) -> Vec<Step> {
    vec![text(answer), finish("stop"), usage(20, 0, 5), Step::Done]
}

/// A whole reply proposing one tool call.
pub fn call(id: &str, name: &str, args: &str) -> Vec<Step> {
    vec![
        tool_start(0, id, name, args),
        finish("tool_calls"),
        usage(30, 10, 8),
        Step::Done,
    ]
}
