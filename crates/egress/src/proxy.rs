//! The egress proxy (HTTP/1.1, and CONNECT with TLS terminated here; `HTTP_PROXY` and
//! `HTTPS_PROXY` inside the sandbox). Every request is an
//! effect of the run: the gate admits it (its policy decides, by method, host and path) before
//! anything is resolved or dialled, and its outcome (status, bytes) is completed on the
//! ledger. The mapping is documented in docs/EGRESS.md ("HTTP requests as effects").

pub mod meter;
use crate::gate::Gate;
use crate::settings::{Settings, contains, forbidden};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderMap, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::watch;

/// The types [`request_args`] takes, for its callers outside (the harness, tests).
pub use hyper::{Method as HttpMethod, Uri as HttpUri};

/// A connection's place under `connections_max`.
type Place = Arc<tokio::sync::OwnedSemaphorePermit>;

/// Requests in flight at once (from their head to the head of their answer), over every
/// connection of the proxy: at most `connections_max`. HTTP/1.1 never meets this bound (one
/// request per connection); HTTP/2 streams would otherwise multiply the memory one sandbox can
/// hold in buffered bodies by the streams per connection.
#[derive(Clone)]
struct Requests(Arc<tokio::sync::Semaphore>, usize);

impl Requests {
    fn new(max: usize) -> Requests {
        Requests(Arc::new(tokio::sync::Semaphore::new(max)), max)
    }

    fn try_take(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.0.clone().try_acquire_owned().ok()
    }

    fn refusal(&self) -> Reply {
        refusal(
            StatusCode::SERVICE_UNAVAILABLE,
            json!({"verdict": "refused", "reason": "limit_exceeded",
                "message": format!("this sandbox already has connections_max = {} requests in flight", self.1),
                "what_to_do": "wait for an answer before sending more requests at once"}),
        )
    }
}

/// What the agent gets: a whole body, or (model calls) a stream relayed as it arrives.
pub type Body = http_body_util::combinators::BoxBody<Bytes, std::io::Error>;
pub type Reply = Response<Body>;
/// The answer for the agent, the outcome for the ledger and its error text.
pub(crate) type Failure = (Reply, &'static str, String);
pub(crate) use crate::upstream::Sender;

pub struct Proxy {
    pub gate: Gate,
    pub run: String,
    /// Named in every admission, so the first one creates the run under it (a harness HTTP
    /// tool call's run is a child of its trajectory's: the `tool` module).
    pub parent: Option<String>,
    pub settings: Settings,
    /// Injected per host after admission (never in the effect's arguments).
    pub credentials: Arc<crate::credentials::Credentials>,
    /// Turns true when the run is stopped: every request from then on is refused, and every
    /// request and connection in flight is cut.
    pub fence: watch::Receiver<bool>,
    /// Distinguishes this proxy's keys for requests that are never deduplicated (GET…).
    pub nonce: String,
    pub seq: AtomicU64,
    /// Signs the leaves the proxy presents inside CONNECT tunnels; none: this proxy serves
    /// no tunnel (a harness HTTP tool's, whose one client sends absolute-form requests).
    pub ca: Option<Arc<crate::tls::Ca>>,
    /// Reaches real hosts over TLS.
    pub connector: tokio_rustls::TlsConnector,
    /// Idle upstream connections, by the origin they were dialled for.
    pub pool: crate::pool::Pool,
    /// The secret every request must carry as `Proxy-Authorization: Bearer SECRET`, for a
    /// proxy on the host's loopback (a harness HTTP tool's), which any local process could
    /// otherwise reach and send requests through with the run's credentials. None: the proxy
    /// of `estop run`'s sandbox, reachable only inside the sandbox's own network namespace.
    pub access: Option<String>,
}

/// What the proxy will send, as the gate's policy sees it.
#[derive(Debug)]
pub struct Effect {
    pub tool: String,
    pub key: String,
    pub args: Value,
    /// What the result records of the request's own body, for an undo that needs it
    /// (`record::request_body`): `request_body` or `request_body_omitted`, or nothing.
    pub request_body: Option<(&'static str, Value)>,
}

/// Requests at once on one HTTP/2 connection from the agent (its `SETTINGS_MAX_CONCURRENT_STREAMS`):
/// a connection is one of `connections_max`, and its streams are bounded like them.
pub const H2_STREAMS_MAX: u32 = 32;

/// The first byte of a TLS record carrying a handshake (a ClientHello opens every TLS tunnel).
const TLS_HANDSHAKE: u8 = 0x16;

/// Headers that belong to one hop (RFC 9110 §7.6.1) or to the proxy: never forwarded.
const HOP: &[&str] = &[
    "connection",
    "proxy-connection",
    "keep-alive",
    "proxy-authorization",
    "proxy-authenticate",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "idempotency-key",
];

impl Proxy {
    /// Serves proxy connections; a stop of the run closes every one of them.
    /// At most `connections_max` at once; one past it gets a `503` saying so and is closed.
    pub async fn serve(self: Arc<Self>, listener: tokio::net::TcpListener) {
        let slots = Arc::new(tokio::sync::Semaphore::new(self.settings.connections_max));
        let requests = Requests::new(self.settings.connections_max);
        // A stopped run keeps no connection to anywhere.
        let (proxy, mut fence) = (self.clone(), self.fence.clone());
        tokio::spawn(async move {
            let _ = fence.wait_for(|stopped| *stopped).await;
            proxy.pool.clear();
        });
        while let Ok((stream, _)) = listener.accept().await {
            // A response's head and body (and a relayed stream's chunks) are written as they
            // come, often from different tasks: with Nagle's algorithm a small write waits for
            // the agent's delayed ACK (~40 ms) before it leaves.
            let _ = stream.set_nodelay(true);
            let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                // Best effort and without waiting: the accept loop never stalls on it.
                let _ = stream.try_write(too_many(self.settings.connections_max).as_bytes());
                continue;
            };
            let proxy = self.clone();
            let mut fence = self.fence.clone();
            // Shared with a CONNECT tunnel, which outlives this exchange (hyper hands the
            // connection over at the upgrade): the place is given back when both are done.
            let slot = Arc::new(slot);
            let requests = requests.clone();
            tokio::spawn(async move {
                let place = slot.clone();
                let service = hyper::service::service_fn(move |req| {
                    let (proxy, place) = (proxy.clone(), place.clone());
                    let (requests, permit) = (requests.clone(), requests.try_take());
                    // Its own task: a connection cut by the fence must not cancel the
                    // request's completion on the ledger.
                    let task = tokio::spawn(async move {
                        let Some(_permit) = permit else {
                            return requests.refusal();
                        };
                        proxy.handle(req, place, requests).await
                    });
                    async move { Ok::<_, Infallible>(task.await.unwrap_or_else(|_| internal())) }
                });
                let io = hyper_util::rt::TokioIo::new(stream);
                let conn = hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, service)
                    .with_upgrades();
                // Open when the run stops: cut. Opened after: served, every request refused.
                if *fence.borrow_and_update() {
                    let _ = conn.await;
                    return;
                }
                tokio::select! {
                    _ = conn => {}
                    _ = fence.wait_for(|stopped| *stopped) => {}
                }
                drop(slot);
            });
        }
    }

    async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
        place: Place,
        requests: Requests,
    ) -> Reply {
        if let Some(secret) = &self.access
            && !authorized(&req, secret)
        {
            return refusal(
                StatusCode::PROXY_AUTHENTICATION_REQUIRED,
                json!({"verdict": "refused", "reason": "unauthenticated",
                    "message": "this proxy serves one harness tool call; a request without its Proxy-Authorization is not admitted",
                    "what_to_do": "nothing: only the harness that started the call may use it"}),
            );
        }
        if req.method() == Method::CONNECT {
            return self.tunnel(req, place, requests).await;
        }
        // Origin-form (`POST /v1/chat/completions`): addressed to the proxy itself, which is
        // the metered model endpoint (`OPENAI_BASE_URL`).
        if req.uri().scheme().is_none() && req.uri().path().starts_with("/v1/") {
            return meter::call(self, req).await;
        }
        let (parts, body) = req.into_parts();
        self.request(parts, body).await
    }

    /// CONNECT: nothing is dialled here. The proxy answers 200, terminates TLS itself with a
    /// leaf for the requested host, and every request inside the tunnel is admitted (and
    /// sent) exactly like a plain one, as `https://HOST:PORT/…`.
    async fn tunnel(
        self: Arc<Self>,
        req: Request<Incoming>,
        place: Place,
        requests: Requests,
    ) -> Reply {
        let Some(authority) = req.uri().authority().cloned() else {
            return refusal(
                StatusCode::BAD_REQUEST,
                json!({"verdict": "refused",
                "reason": "bad_request", "message": "CONNECT needs host:port"}),
            );
        };
        if authority.as_str().contains('@') {
            return refusal(
                StatusCode::BAD_REQUEST,
                json!({"verdict": "refused", "reason": "bad_request", "message": USERINFO_REFUSED}),
            );
        }
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_ascii_lowercase();
        if let Ok(ip) = host.parse::<IpAddr>()
            && !self.destination_allowed(ip)
        {
            return destination_refused(ip);
        }
        if *self.fence.borrow() {
            return stopped(&self.run, "-");
        }
        let port = authority.port_u16().unwrap_or(443);
        if self
            .settings
            .passthrough
            .iter()
            .any(|(h, p)| *h == host && *p == port)
        {
            return self.passthrough(req, host, port, place).await;
        }
        let Some(ca) = &self.ca else {
            return refusal(
                StatusCode::BAD_REQUEST,
                json!({"verdict": "refused", "reason": "bad_request",
                "message": "this proxy serves no CONNECT tunnels; send absolute-form requests"}),
            );
        };
        let acceptor = match ca.acceptor(&host) {
            Ok(a) => a,
            Err(e) => {
                return refusal(
                    StatusCode::BAD_GATEWAY,
                    json!({"verdict": "failed",
                    "message": format!("no certificate for {host}: {e:#}")}),
                );
            }
        };
        let origin = format!(
            "{}:{}",
            authority.host(),
            authority.port_u16().unwrap_or(443)
        );
        tokio::spawn(self.serve_tunnel(req, acceptor, origin, (place, requests)));
        Response::new(full(Bytes::new()))
    }

    /// A pass-through tunnel (`passthrough` in `[egress]`): the tunnel itself is the effect,
    /// `http.CONNECT`, admitted before anything is resolved or dialled; the origin is dialled
    /// before the agent gets its `200`, then bytes are copied both ways unseen. Its outcome,
    /// completed when it closes: `ok` with the bytes each way, or `unknown` when a stop cut it
    /// or it broke (what crossed it is not known).
    async fn passthrough(
        self: Arc<Self>,
        req: Request<Incoming>,
        host: String,
        port: u16,
        place: Place,
    ) -> Reply {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let effect = Effect {
            tool: "http.CONNECT".into(),
            key: format!("tunnel:{}:{seq}", self.nonce),
            args: json!({"method": "CONNECT", "url": format!("tunnel://{host}:{port}"),
                "scheme": "tunnel", "host": host, "port": port, "path": "", "query": "",
                "passthrough": true}),
            request_body: None,
        };
        let token = match self.admit(&effect).await {
            Ok(token) => token,
            Err(reply) => return *reply,
        };
        let (mut upstream, _) = match self.connect(&effect).await {
            Ok(c) => c,
            Err(failure) => return self.unstarted(&effect, &token, failure).await.0,
        };
        // The commit point: the origin is dialled, nothing of the agent's has crossed yet.
        if let Err(reply) = self.begin(&effect, &token).await {
            return *reply;
        }
        tokio::spawn(async move {
            let _place = place;
            let mut fence = self.fence.clone();
            let copied = async {
                let upgraded = hyper::upgrade::on(req)
                    .await
                    .map_err(std::io::Error::other)?;
                let mut agent = hyper_util::rt::TokioIo::new(upgraded);
                tokio::io::copy_bidirectional(&mut agent, &mut upstream).await
            };
            let outcome = tokio::select! {
                r = copied => match r {
                    Ok((up, down)) => ("ok", json!({"passthrough": true,
                        "bytes_up": up, "bytes_down": down}), Value::Null),
                    Err(e) => ("unknown", Value::Null, json!(format!("the tunnel broke: {e}"))),
                },
                () = until_stopped(&mut fence) => ("unknown", Value::Null,
                    json!("cut: the run was stopped while the tunnel was open")),
            };
            self.complete(&effect.key, &token, outcome);
        });
        Response::new(full(Bytes::new()))
    }

    /// Inside one CONNECT tunnel: TLS terminated with the host's leaf, then every request
    /// served like a plain one as `https://ORIGIN/…`; a stop of the run closes the tunnel.
    async fn serve_tunnel(
        self: Arc<Self>,
        req: Request<Incoming>,
        acceptor: tokio_rustls::TlsAcceptor,
        origin: String,
        // The place is held until the tunnel ends.
        (_place, requests): (Place, Requests),
    ) {
        use tokio::io::AsyncReadExt;
        let Ok(upgraded) = hyper::upgrade::on(req).await else {
            return;
        };
        let mut io = hyper_util::rt::TokioIo::new(upgraded);
        // TLS or not is the first byte's to say: Node's fetch (undici) tunnels `http://` URLs
        // through CONNECT too, and speaks plain HTTP/1.1 inside.
        let mut first = [0u8; 1];
        if !matches!(io.read(&mut first).await, Ok(1)) {
            return;
        }
        let (r, w) = tokio::io::split(io);
        let io = tokio::io::join(std::io::Cursor::new(first).chain(r), w);
        if first[0] != TLS_HANDSHAKE {
            let io = hyper_util::rt::TokioIo::new(io);
            return self.serve_inside(io, false, "http", origin, requests).await;
        }
        let Ok(tls) = acceptor.accept(io).await else {
            return;
        };
        // The agent's client chose the protocol in its hello (the acceptor offers h2 first).
        let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
        let io = hyper_util::rt::TokioIo::new(tls);
        self.serve_inside(io, h2, "https", origin, requests).await;
    }

    /// Serves the requests inside a tunnel to `origin` (`host:port`) as `scheme://origin/…`,
    /// each admitted as if sent in absolute form; cut when the run stops.
    async fn serve_inside<I>(
        self: Arc<Self>,
        io: I,
        h2: bool,
        scheme: &'static str,
        origin: String,
        requests: Requests,
    ) where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        let mut fence = self.fence.clone();
        let proxy = self.clone();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let (proxy, origin) = (proxy.clone(), origin.clone());
            // Taken in the order the requests (HTTP/2 streams) arrive.
            let (requests, permit) = (requests.clone(), requests.try_take());
            let task = tokio::spawn(async move {
                let Some(_permit) = permit else {
                    return requests.refusal();
                };
                let (mut parts, body) = req.into_parts();
                let pq = parts.uri.path_and_query().map_or("/", |p| p.as_str());
                match format!("{scheme}://{origin}{pq}").parse() {
                    Ok(uri) => parts.uri = uri,
                    Err(_) => {
                        return refusal(
                            StatusCode::BAD_REQUEST,
                            json!({"verdict": "refused",
                        "reason": "bad_request", "message": "not a request target"}),
                        );
                    }
                }
                proxy.request(parts, body).await
            });
            async move { Ok::<_, Infallible>(task.await.unwrap_or_else(|_| internal())) }
        });
        if h2 {
            let conn =
                hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .max_concurrent_streams(H2_STREAMS_MAX)
                    .serve_connection(io, service);
            tokio::select! {
                _ = conn => {}
                _ = fence.wait_for(|stopped| *stopped) => {}
            }
            return;
        }
        let conn = hyper::server::conn::http1::Builder::new().serve_connection(io, service);
        tokio::select! {
            _ = conn => {}
            _ = fence.wait_for(|stopped| *stopped) => {}
        }
    }

    async fn request(
        self: &Arc<Self>,
        mut parts: hyper::http::request::Parts,
        body: Incoming,
    ) -> Reply {
        // Before the policy sees it and as it is sent: `get` is `GET`.
        parts.method = normalised(&parts.method);
        if parts
            .headers
            .get_all(hyper::header::HOST)
            .iter()
            .any(|h| h.as_bytes().contains(&b'@'))
        {
            return refusal(
                StatusCode::BAD_REQUEST,
                json!({"verdict": "refused", "reason": "bad_request", "message": USERINFO_REFUSED}),
            );
        }
        let body = match Limited::new(body, self.settings.body_bytes_max)
            .collect()
            .await
        {
            Ok(b) => b.to_bytes(),
            Err(_) => {
                return refusal(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    json!({"verdict": "refused", "reason": "body_too_large",
                        "message": format!("request bodies over {} bytes are not sent",
                            self.settings.body_bytes_max)}),
                );
            }
        };
        let mut effect = match self.effect(&parts, &body) {
            Ok(e) => e,
            Err(reply) => return *reply,
        };
        // A safe method changes nothing, so nothing undoes it; another's body is kept for the
        // result (the gate keeps it only where the effect's `compensate_args` reads it).
        if !is_safe(&parts.method) {
            let o = origin(&effect);
            let secrets = self.credentials.secrets_for(&o.scheme, &o.host, o.port);
            effect.request_body = crate::record::request_body(
                &parts.headers,
                &body,
                self.settings.undo_body_bytes_max,
                &secrets,
            );
        }
        let token = match self.admit(&effect).await {
            Ok(token) => token,
            Err(reply) => return *reply,
        };
        match self.forward(&parts, body, &effect, &token).await {
            Forwarded::Done(reply, outcome) => {
                self.complete(&effect.key, &token, outcome);
                reply
            }
            Forwarded::Answered(res, sender, addr) => {
                self.relay(res, (sender, addr), effect, token)
            }
        }
    }

    /// Sends the effect's outcome to the gate now and does not wait for it to be durable. It
    /// goes out before the agent learns the request's end, on the one connection whose
    /// requests the gate applies in order, so the agent's next request (a repeat of the same
    /// key included) and the run's close follow it; the agent does not wait for its fdatasync
    /// (the admission had to be durable before anything was sent; a crash in between leaves
    /// the effect `unknown`, docs/EGRESS.md).
    fn complete(&self, key: &str, token: &str, outcome: Outcome) {
        if outcome.0 == NOT_STARTED {
            // The gate refused its start: the effect is settled there, nothing was sent.
            return;
        }
        let complete = json!({"op": "complete", "run": self.run, "key": key,
            "token": token, "outcome": outcome.0, "result": outcome.1, "error": outcome.2});
        match self.gate.send(complete) {
            Ok(reply) => {
                let key = key.to_string();
                tokio::spawn(async move {
                    if let Err(e) = reply.await {
                        eprintln!("estop run: completing {key}: {e:#}");
                    }
                });
            }
            Err(e) => eprintln!("estop run: completing {key}: {e:#}"),
        }
    }

    /// Relays an answered request's response to the agent as it arrives (backpressure through a
    /// short queue), counting its bytes; completes the effect when it ends (`ok`) or is cut
    /// (`unknown`: a stop, a broken upstream, the bound, the agent gone), and keeps the
    /// connection for the next request to the origin if it was read whole.
    fn relay(
        self: &Arc<Self>,
        res: Response<Incoming>,
        (sender, addr): (Sender, SocketAddr),
        effect: Effect,
        token: String,
    ) -> Reply {
        let (rparts, mut rbody) = res.into_parts();
        let status = rparts.status.as_u16();
        let mut record = crate::record::Recorder::new(&rparts.headers);
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(16);
        let proxy = Arc::clone(self);
        tokio::spawn(async move {
            let max = proxy.settings.response_bytes_max;
            let mut fence = proxy.fence.clone();
            let mut bytes = 0usize;
            let end = loop {
                let frame = tokio::select! {
                    f = rbody.frame() => f,
                    () = until_stopped(&mut fence) => {
                        break Some("cut: the run was stopped while the response was relayed".to_string());
                    }
                };
                let data = match frame {
                    None => break None,
                    Some(Err(e)) => break Some(format!("reading the response: {e}")),
                    // Trailers are not relayed.
                    Some(Ok(f)) => match f.into_data() {
                        Ok(d) => d,
                        Err(_) => continue,
                    },
                };
                bytes += data.len();
                record.feed(&data);
                if bytes > max {
                    break Some(format!(
                        "the response is longer than response_bytes_max = {max}; cut"
                    ));
                }
                if tx.send(Ok(data)).await.is_err() {
                    break Some("the agent hung up before the response's end".to_string());
                }
            };
            let outcome = match &end {
                None => (
                    "ok",
                    proxy.recorded(record, &effect, status, bytes),
                    Value::Null,
                ),
                Some(why) => (
                    "unknown",
                    Value::Null,
                    json!(format!("{why} (status {status}, {bytes} bytes relayed)")),
                ),
            };
            // Before the agent sees the end of the body.
            proxy.complete(&effect.key, &token, outcome);
            match end {
                None => proxy.pool.put(origin(&effect), sender, addr),
                Some(why) => {
                    // Waited for, not tried: a full queue must not turn a cut into a clean end
                    // of a chunked body. It cannot hang: a stop closes the agent's connection,
                    // which drops the receiver.
                    let _ = tx.send(Err(std::io::Error::other(why))).await;
                }
            }
        });
        let mut reply = Response::new(BodyExt::boxed(Channel(rx)));
        *reply.status_mut() = rparts.status;
        copy_headers(&rparts.headers, reply.headers_mut());
        reply
            .headers_mut()
            .insert("x-estop-verdict", HeaderValue::from_static("admitted"));
        reply
    }

    /// The result recorded for a response relayed whole (`record.rs`), with nothing in it that
    /// echoes a credential injected into the request.
    fn recorded(
        &self,
        record: crate::record::Recorder,
        effect: &Effect,
        status: u16,
        bytes: usize,
    ) -> Value {
        let o = origin(effect);
        let secrets = self.credentials.secrets_for(&o.scheme, &o.host, o.port);
        let mut result = record.finish(status, bytes, &secrets);
        if let Some((field, value)) = &effect.request_body {
            result[*field] = value.clone();
        }
        result
    }

    /// The request as an effect: tool `http.METHOD`, arguments, idempotency key.
    pub fn effect(
        &self,
        parts: &hyper::http::request::Parts,
        body: &Bytes,
    ) -> Result<Effect, Box<Reply>> {
        let uri = &parts.uri;
        let bad = |message: &str| {
            Box::new(refusal(
                StatusCode::BAD_REQUEST,
                json!({"verdict": "refused", "reason": "bad_request", "message": message}),
            ))
        };
        let args = match request_args(&parts.method, uri, body, &self.settings) {
            Ok(a) => a,
            Err(RequestRefusal::BadRequest(m)) => return Err(bad(m)),
            Err(RequestRefusal::Destination(ip)) => return Err(Box::new(destination_refused(ip))),
        };
        // The key is the request's as sent (its secret parameters included), never recorded
        // whole: only its digest is.
        let (method, url) = (args["method"].as_str().unwrap_or_default(), uri.to_string());
        let body_sha256 = args["body_sha256"].as_str().unwrap_or_default().to_string();
        let key = match parts.headers.get("idempotency-key") {
            Some(v) => format!(
                "idem:{}",
                v.to_str().map_err(|_| bad("Idempotency-Key is not text"))?
            ),
            None if is_safe(&parts.method) => {
                format!(
                    "http:{}:{}",
                    self.nonce,
                    self.seq.fetch_add(1, Ordering::Relaxed)
                )
            }
            None => {
                let id = Sha256::digest(format!("{method} {url} {body_sha256}"));
                format!("http:{}", &hex(&id)[..32])
            }
        };
        Ok(Effect {
            tool: format!("http.{method}"),
            key,
            args,
            request_body: None,
        })
    }

    /// Prepares the effect (admitted with `start: false`, waiting up to the hold bound): the
    /// effect's token, or the answer the agent gets instead. Nothing is sent on it: the
    /// request's commit point is [`Proxy::begin`], just before its first byte is written.
    pub(crate) async fn admit(&self, effect: &Effect) -> Result<String, Box<Reply>> {
        self.admit_with(effect, None).await
    }

    /// `admit`, with a model reservation (`reserve`) the gate counts against the run's and its
    /// ancestors' model budget.
    pub(crate) async fn admit_with(
        &self,
        effect: &Effect,
        reserve: Option<Value>,
    ) -> Result<String, Box<Reply>> {
        if *self.fence.borrow() {
            return Err(Box::new(stopped(&self.run, &effect.key)));
        }
        let mut admit = json!({"op": "admit", "run": self.run, "key": effect.key,
            "tool": effect.tool, "args": effect.args, "start": false});
        if let Some(r) = reserve {
            admit["reserve"] = r;
        }
        if let Some(p) = &self.parent {
            admit["parent"] = json!(p);
        }
        let mut v = self.gate.call(admit).await.map_err(|e| gate_down(&e))?;
        if v["ok"] == true && v["verdict"] == "held" {
            v = self.wait(effect).await?;
        }
        match v["verdict"].as_str() {
            Some("admitted") if v["ok"] == true => {
                Ok(v["token"].as_str().unwrap_or_default().to_string())
            }
            _ => Err(self.not_admitted(effect, &v)),
        }
    }

    /// The commit point: `start` for a prepared effect, sent once its connection is ready,
    /// immediately before the request's first byte is written. A stop ordered before it
    /// refuses it (the gate fences `start` by the run's epoch), and nothing is written; a
    /// pause or a sibling's approval holds it (waited for up to the hold bound, then started
    /// once more).
    pub(crate) async fn begin(&self, effect: &Effect, token: &str) -> Result<(), Box<Reply>> {
        let start = json!({"op": "start", "run": self.run, "key": effect.key, "token": token});
        let mut v = self
            .gate
            .call(start.clone())
            .await
            .map_err(|e| gate_down(&e))?;
        if v["ok"] == true && v["verdict"] == "held" {
            v = self.wait(effect).await?;
            if v["ok"] == true && v["verdict"] == "admitted" {
                v = self.gate.call(start).await.map_err(|e| gate_down(&e))?;
            }
        }
        if v["ok"] == true && v["verdict"] == "go" {
            return Ok(());
        }
        Err(self.not_admitted(effect, &v))
    }

    async fn wait(&self, effect: &Effect) -> Result<Value, Box<Reply>> {
        let wait = json!({"op": "wait", "run": self.run, "key": effect.key,
            "timeout_ms": self.settings.hold_ms});
        self.gate.call(wait).await.map_err(|e| gate_down(&e))
    }

    /// The agent's answer to an admission or a start that did not go: an error, held,
    /// refused (over budget included) or a duplicate.
    fn not_admitted(&self, effect: &Effect, v: &Value) -> Box<Reply> {
        let who = json!({"run": self.run, "key": effect.key, "tool": effect.tool});
        if v["ok"] != true {
            let code = v["error"]["code"].as_str().unwrap_or("");
            let status = match code {
                "invalid_field" | "missing_field" | "bad_json" => StatusCode::BAD_REQUEST,
                "not_found" | "forbidden" => StatusCode::FORBIDDEN,
                _ => StatusCode::SERVICE_UNAVAILABLE,
            };
            return Box::new(refusal(
                status,
                merge(
                    who,
                    json!({"verdict": "error",
                "error": v["error"], "message": "the gate did not admit the request; nothing was sent"}),
                ),
            ));
        }
        Box::new(match v["verdict"].as_str() {
            Some("held" | "admitted") => held(who, v),
            Some("refused") if v["budget"].is_object() => {
                meter::over_budget(&effect.key, &v["budget"])
            }
            Some("duplicate") => refusal(
                StatusCode::CONFLICT,
                merge(
                    who,
                    json!({
                "verdict": "duplicate", "status": v["status"], "outcome": v["outcome"],
                "result": v["result"],
                "message": "this request was sent before (same idempotency key); it is not sent again",
                "what_to_do": "use the recorded outcome; send an Idempotency-Key of your own to send a new request"}),
                ),
            ),
            _ => refusal(
                StatusCode::FORBIDDEN,
                merge(
                    who,
                    json!({
                "verdict": "refused", "reason": v["reason"], "rule": v["rule"], "message": v["message"],
                "what_to_do": "do not retry this request: the gate refused it"}),
                ),
            ),
        })
    }

    fn destination_allowed(&self, ip: IpAddr) -> bool {
        destination_allowed(&self.settings, ip)
    }

    /// Resolves, dials, starts and sends one prepared request, up to the response's head: the
    /// response to relay, or the answer for the agent and the outcome for the ledger. A stop
    /// cuts it wherever it is; what it got to is recorded: `not sent` (`error`: nothing was
    /// written, nothing happened upstream), or `unknown` with `sent, no answer` (written
    /// whole) or `partly sent`.
    async fn forward(
        &self,
        parts: &hyper::http::request::Parts,
        body: Bytes,
        effect: &Effect,
        token: &str,
    ) -> Forwarded {
        let mut fence = self.fence.clone();
        let mark = std::sync::Mutex::new(None);
        let work = self.send(parts, body, effect, token, &mark);
        tokio::select! {
            r = work => match r {
                Ok((res, sender, addr)) => Forwarded::Answered(res, sender, addr),
                Err((reply, outcome, error)) => {
                    Forwarded::Done(reply, (outcome, Value::Null, json!(error)))
                }
            },
            () = until_stopped(&mut fence) => {
                let mark = mark.lock().expect("not poisoned").take();
                let (outcome, error) = cut(mark.as_ref(), "the run was stopped");
                Forwarded::Done(stopped(&self.run, &effect.key), (outcome, Value::Null, json!(error)))
            }
        }
    }

    /// A request that failed before its commit point (no address, a refused destination, no
    /// connection, TLS): recorded `failed` like any request that was not sent — started at the
    /// gate only to be completed `error` at once — unless the gate refuses the start (a stop),
    /// which settles it there. The failure for the agent, with nothing more to complete.
    pub(crate) async fn unstarted(&self, effect: &Effect, token: &str, f: Failure) -> Failure {
        let (reply, outcome, error) = f;
        if self.begin(effect, token).await.is_ok() {
            self.complete(&effect.key, token, (outcome, Value::Null, json!(error)));
        }
        (reply, NOT_STARTED, String::new())
    }

    /// A failure before anything was sent: `502` for the agent, outcome `error`.
    pub(crate) fn failed(&self, effect: &Effect, message: String) -> Failure {
        let body = json!({"verdict": "failed", "run": self.run, "key": effect.key,
            "message": message.clone()});
        (refusal(StatusCode::BAD_GATEWAY, body), "error", message)
    }

    /// A connection to the admitted effect's origin: one kept from an earlier request, or a
    /// new one (over TLS for https, in the protocol the origin picks).
    pub(crate) async fn dial(&self, effect: &Effect) -> Result<(Sender, SocketAddr), Failure> {
        let host = effect.args["host"].as_str().unwrap_or_default();
        let failed = |message: String| self.failed(effect, message);
        if *self.fence.borrow() {
            let message = "not sent: the run was stopped".to_string();
            return Err((stopped(&self.run, &effect.key), "error", message));
        }
        // A connection kept from an earlier request to the same origin: its address was
        // resolved and checked when it was dialled.
        if let Some(kept) = self.pool.take(&origin(effect)).await {
            return Ok(kept);
        }
        let (stream, addr) = self.connect(effect).await?;
        let sender = if effect.args["scheme"] == "https" {
            let name = rustls::pki_types::ServerName::try_from(host.to_string())
                .map_err(|e| failed(format!("{host}: {e}")))?;
            let tls = self
                .connector
                .connect(name, stream)
                .await
                .map_err(|e| failed(format!("TLS with {host}: {e}")))?;
            crate::upstream::over_tls(tls).await
        } else {
            crate::upstream::http1(stream).await
        }
        .map_err(|e| failed(format!("{addr}: {e}")))?;
        Ok((sender, addr))
    }

    /// Resolves (only now, after admission: a name the gate refused is never looked up),
    /// checks the address and the fence once more, and opens a TCP connection.
    pub(crate) async fn connect(
        &self,
        effect: &Effect,
    ) -> Result<(tokio::net::TcpStream, SocketAddr), Failure> {
        let host = effect.args["host"].as_str().unwrap_or_default();
        let port = effect.args["port"].as_u64().unwrap_or(80) as u16;
        let failed = |message: String| self.failed(effect, message);
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
            .await
            .map_err(|e| failed(format!("cannot resolve {host}: {e}")))?
            .collect();
        let Some(addr) = addrs
            .iter()
            .find(|a| self.destination_allowed(a.ip()))
            .copied()
        else {
            let ip = addrs.first().map(|a| a.ip());
            let reply = ip.map_or_else(
                || failed(format!("{host} has no address")).0,
                destination_refused,
            );
            return Err((
                reply,
                "error",
                format!("{host} resolves only to refused destinations"),
            ));
        };
        if *self.fence.borrow() {
            let message = "not sent: the run was stopped".to_string();
            return Err((stopped(&self.run, &effect.key), "error", message));
        }
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| failed(format!("cannot connect to {addr}: {e}")))?;
        // The request's head and body are separate writes: without it the body waits for the
        // origin's delayed ACK of the head (see `serve`).
        stream
            .set_nodelay(true)
            .map_err(|e| failed(format!("cannot set TCP_NODELAY towards {addr}: {e}")))?;
        Ok((stream, addr))
    }

    /// Sends the prepared request (its `start` first, the commit point) and waits for the
    /// response's head; `mark` learns how far the request got on its connection.
    async fn send(
        &self,
        parts: &hyper::http::request::Parts,
        body: Bytes,
        effect: &Effect,
        token: &str,
        mark: &std::sync::Mutex<Option<crate::upstream::Mark>>,
    ) -> Result<(Response<Incoming>, Sender, SocketAddr), Failure> {
        let (mut sender, addr) = match self.dial(effect).await {
            Ok(dialled) => dialled,
            Err(failure) => return Err(self.unstarted(effect, token, failure).await),
        };
        let mut up = Request::builder()
            .method(parts.method.clone())
            .uri(parts.uri.path_and_query().map_or("/", |p| p.as_str()))
            .body(Full::new(body))
            .expect("parts of a parsed request");
        copy_headers(&parts.headers, up.headers_mut());
        if let Some(a) = parts.uri.authority() {
            let value = HeaderValue::from_str(a.as_str()).expect("an authority is a header value");
            up.headers_mut().insert(hyper::header::HOST, value);
        }
        // Only for the admitted destination itself; replaces whatever the agent sent there.
        let (scheme, host) = (effect.args["scheme"].as_str(), effect.args["host"].as_str());
        let port = effect.args["port"]
            .as_u64()
            .and_then(|p| u16::try_from(p).ok());
        if let (Some(scheme), Some(host), Some(port)) = (scheme, host, port) {
            for (name, value) in self.credentials.for_request(scheme, host, port) {
                up.headers_mut().insert(name.clone(), value.clone());
            }
        }
        let scheme = effect.args["scheme"].as_str().unwrap_or("http");
        // The commit point, with everything ready: only the write is left.
        self.begin(effect, token)
            .await
            .map_err(|reply| (*reply, NOT_STARTED, String::new()))?;
        let m = sender.mark();
        *mark.lock().expect("not poisoned") = Some(m.clone());
        let res = sender.send_marked(up, scheme, &m).await.map_err(|e| {
            let (outcome, error) = cut(Some(&m), &format!("{addr}: {e}"));
            (self.failed(effect, e.to_string()).0, outcome, error)
        })?;
        Ok((res, sender, addr))
    }
}

/// Why a request cannot be an effect: a malformed request, or a destination the settings
/// refuse (before anything is resolved or dialled).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestRefusal {
    BadRequest(&'static str),
    Destination(IpAddr),
}

/// What a refused userinfo (`http://user:password@host/`) is told: the credential store,
/// not the URL, carries credentials, and a userinfo forwarded as the `Host` would reach the
/// upstream.
pub const USERINFO_REFUSED: &str = "a URL with userinfo (user:password@host) is not sent: \
    credentials come from the credential store, never the URL";

/// What a redacted query parameter's value is recorded as (`secret_params`).
pub const REDACTED: &str = "REDACTED";

/// The method as the policy and the upstream see it: upper case (`get` is `GET`, tool
/// `http.GET`), so a rule on `http.GET` matches whatever case the agent wrote.
pub fn normalised(method: &Method) -> Method {
    let upper = method.as_str().to_ascii_uppercase();
    Method::from_bytes(upper.as_bytes()).unwrap_or_else(|_| method.clone())
}

/// The arguments the gate sees for a request (tool `http.METHOD`): method (upper case), URL,
/// scheme, host, port, path, query and the body's SHA-256 and length; with `secret_params`
/// configured, those parameters' values are `REDACTED` in `url` and `query` and
/// `query_sha256` is the digest of the query as sent (so two requests that differ only in a
/// secret still differ). One function for the proxy and for the harness, which admits an HTTP
/// tool's request before it dispatches the call (crates/harness, `http::Request`): the proxy's
/// admission of what is actually sent then finds the same arguments, so the same digest, or the
/// gate refuses it as a mismatch. A URL with userinfo is refused.
pub fn request_args(
    method: &Method,
    uri: &hyper::Uri,
    body: &[u8],
    settings: &Settings,
) -> Result<Value, RequestRefusal> {
    let (scheme, default_port) = match uri.scheme_str() {
        Some("http") => ("http", 80),
        Some("https") => ("https", 443),
        _ => {
            return Err(RequestRefusal::BadRequest(
                "the proxy takes absolute http:// URLs (set HTTP_PROXY)",
            ));
        }
    };
    let authority = uri
        .authority()
        .ok_or(RequestRefusal::BadRequest("no host in the URL"))?;
    if authority.as_str().contains('@') {
        return Err(RequestRefusal::BadRequest(USERINFO_REFUSED));
    }
    let port = authority.port_u16().unwrap_or(default_port);
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_ascii_lowercase();
    if let Ok(ip) = host.parse::<IpAddr>()
        && !destination_allowed(settings, ip)
    {
        return Err(RequestRefusal::Destination(ip));
    }
    let body_sha256 = hex(&Sha256::digest(body));
    let query = uri.query().unwrap_or("");
    let mut args = json!({"method": normalised(method).as_str(), "url": uri.to_string(),
        "scheme": scheme, "host": host, "port": port, "path": uri.path(), "query": query,
        "body_sha256": body_sha256, "body_bytes": body.len()});
    if let Some(shown) = redact_query(query, &settings.secret_params) {
        args["url"] = json!(format!("{scheme}://{}{}?{shown}", authority, uri.path()));
        args["query"] = json!(shown);
        args["query_sha256"] = json!(hex(&Sha256::digest(query.as_bytes())));
    }
    Ok(args)
}

/// The query with the values of the `secret` parameters (lower-case names, compared with the
/// query's names percent-decoded and lower-cased) replaced by [`REDACTED`]; `None` when none
/// of them is there.
pub fn redact_query(query: &str, secret: &[String]) -> Option<String> {
    if secret.is_empty() || query.is_empty() {
        return None;
    }
    let mut redacted = false;
    let pairs: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) if secret.contains(&percent_decoded(name).to_lowercase()) => {
                redacted = true;
                format!("{name}={REDACTED}")
            }
            _ => pair.to_string(),
        })
        .collect();
    redacted.then(|| pairs.join("&"))
}

/// A query component decoded as a form does (`%XX`, `+` for a space); a malformed escape is
/// kept as it is, and bytes that are not UTF-8 become U+FFFD.
fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex_at = |j: usize| {
            bytes
                .get(j)
                .and_then(|b| (*b as char).to_digit(16))
                .and_then(|d| u8::try_from(d).ok())
        };
        match (bytes[i], hex_at(i + 1), hex_at(i + 2)) {
            (b'%', Some(hi), Some(lo)) => {
                out.push(hi * 16 + lo);
                i += 3;
            }
            (b'+', _, _) => {
                out.push(b' ');
                i += 1;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn destination_allowed(settings: &Settings, ip: IpAddr) -> bool {
    !forbidden(ip) || settings.allow.iter().any(|net| contains(*net, ip))
}

/// The outcome of a request whose `start` the gate did not answer `go`: the effect is
/// refused (or held, or someone else's start) at the gate, so nothing is completed for it.
pub(crate) const NOT_STARTED: &str = "not_started";

/// The outcome of a request cut (`why`) before its answer, by how far it got (`mark`: none
/// when nothing was started or dialled): `not sent` is `error` (nothing happened upstream,
/// nothing to undo); `sent, no answer` and `partly sent` are `unknown`.
fn cut(mark: Option<&crate::upstream::Mark>, why: &str) -> (&'static str, String) {
    use crate::upstream::Progress;
    match mark.map_or(Progress::NotSent, crate::upstream::Mark::cut) {
        Progress::NotSent => (
            "error",
            format!("not sent: {why} before the request was written"),
        ),
        Progress::Partly => (
            "unknown",
            format!("partly sent: {why} while the request was being written"),
        ),
        Progress::Sent => (
            "unknown",
            format!("sent, no answer: {why} after the request was written, before its answer"),
        ),
    }
}

/// What became of an admitted request: answered (its response to relay), or done.
enum Forwarded {
    Answered(Response<Incoming>, Sender, SocketAddr),
    Done(Reply, Outcome),
}

/// The outcome for the ledger: (outcome, result, error).
type Outcome = (&'static str, Value, Value);

/// A response body fed by a relay task; an error item cuts the agent's stream.
pub(crate) struct Channel(pub(crate) tokio::sync::mpsc::Receiver<Result<Bytes, std::io::Error>>);

impl hyper::body::Body for Channel {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, std::io::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|o| o.map(|r| r.map(hyper::body::Frame::data)))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_closed() && self.0.is_empty()
    }
}

/// Resolves once the run is stopped (the guard `wait_for` hands back is not held across the
/// branch's awaits).
pub(crate) async fn until_stopped(fence: &mut watch::Receiver<bool>) {
    let _ = fence.wait_for(|s| *s).await;
}

/// The origin an admitted effect goes to (its arguments, as the gate saw them).
fn origin(effect: &Effect) -> crate::pool::Origin {
    crate::pool::Origin {
        scheme: effect.args["scheme"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        host: effect.args["host"].as_str().unwrap_or_default().to_string(),
        port: effect.args["port"]
            .as_u64()
            .and_then(|p| u16::try_from(p).ok())
            .unwrap_or(0),
    }
}

/// A whole body for the agent.
pub fn full(bytes: Bytes) -> Body {
    Full::new(bytes).map_err(|never| match never {}).boxed()
}

fn internal() -> Reply {
    refusal(
        StatusCode::INTERNAL_SERVER_ERROR,
        json!({"verdict": "error"}),
    )
}

fn is_safe(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    )
}

fn copy_headers(from: &HeaderMap, to: &mut HeaderMap) {
    for (name, value) in from {
        if !HOP.contains(&name.as_str()) {
            to.append(name.clone(), value.clone());
        }
    }
}

fn merge(mut a: Value, b: Value) -> Value {
    if let (Some(a), Value::Object(b)) = (a.as_object_mut(), b) {
        a.extend(b.into_iter().filter(|(_, v)| !v.is_null()));
    }
    a
}

/// The structured answer the model reads: `{"estop": {...}}`, and `X-Estop-Verdict`.
/// Whether `req` carries `Proxy-Authorization: Bearer SECRET` (compared without an early exit).
fn authorized<B>(req: &Request<B>, secret: &str) -> bool {
    let want = format!("Bearer {secret}");
    req.headers()
        .get(hyper::header::PROXY_AUTHORIZATION)
        .is_some_and(|v| {
            let got = v.as_bytes();
            got.len() == want.len()
                && got
                    .iter()
                    .zip(want.as_bytes())
                    .fold(0u8, |d, (x, y)| d | (x ^ y))
                    == 0
        })
}

pub fn refusal(status: StatusCode, estop: Value) -> Reply {
    let verdict = estop["verdict"].as_str().unwrap_or("refused").to_string();
    let body = json!({"estop": estop}).to_string();
    let mut r = Response::new(full(Bytes::from(body)));
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(
        hyper::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(
        "x-estop-verdict",
        HeaderValue::from_str(&verdict).expect("a verdict word"),
    );
    r
}

fn held(who: Value, v: &Value) -> Reply {
    let run = who["run"].as_str().unwrap_or_default().to_string();
    let key = who["key"].as_str().unwrap_or_default().to_string();
    let mut r = refusal(
        StatusCode::SERVICE_UNAVAILABLE,
        merge(
            who,
            json!({
        "verdict": "held", "reason": v["reason"], "approval": v["approval"],
        "expires_at": v["expires_at"],
        "message": "this request awaits an operator's approval; nothing was sent",
        "what_to_do": format!("retry the same request later: it goes through once approved \
            (operator: estop approve {run} {key}), and is refused if rejected or expired")}),
        ),
    );
    r.headers_mut()
        .insert(hyper::header::RETRY_AFTER, HeaderValue::from_static("30"));
    r
}

pub(crate) fn stopped(run: &str, key: &str) -> Reply {
    refusal(
        StatusCode::FORBIDDEN,
        json!({"verdict": "refused", "reason": "cancelled",
        "run": run, "key": key, "message": "the run was stopped; nothing more is sent",
        "what_to_do": "stop: the run is over"}),
    )
}

fn destination_refused(ip: IpAddr) -> Reply {
    refusal(
        StatusCode::FORBIDDEN,
        json!({"verdict": "refused", "reason": "destination",
        "message": format!("{ip} is a loopback, link-local, metadata or otherwise private \
            destination; the proxy does not reach it"),
        "what_to_do": "use a public address (the operator may allow it with allow_destinations)"}),
    )
}

fn gate_down(e: &anyhow::Error) -> Box<Reply> {
    Box::new(refusal(
        StatusCode::SERVICE_UNAVAILABLE,
        json!({"verdict": "error",
        "message": format!("the gate cannot be reached ({e:#}); nothing was sent")}),
    ))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The whole reply to a connection past `connections_max`.
fn too_many(max: usize) -> String {
    let body = format!(
        "{{\"estop\":{{\"verdict\":\"refused\",\"reason\":\"limit_exceeded\",\"what_to_do\":\"this sandbox already holds connections_max = {max} connections to the proxy; close one (or reuse it) and retry\"}}}}"
    );
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proxy(dir: &std::path::Path) -> (Arc<Proxy>, watch::Sender<bool>) {
        let (proxy, fence, _gate) = proxy_and_gate(dir);
        (proxy, fence)
    }

    /// A proxy whose gate is the test (the other end of its gate connection).
    fn proxy_and_gate(
        dir: &std::path::Path,
    ) -> (Arc<Proxy>, watch::Sender<bool>, tokio::net::UnixStream) {
        let (ours, theirs) = tokio::net::UnixStream::pair().unwrap();
        let (r, w) = ours.into_split();
        let (gate, _events) = crate::gate::Gate::start(r, w);
        let (fence_tx, fence) = watch::channel(false);
        let settings =
            Settings::parse("[egress]\nallow_destinations = [\"127.0.0.1/32\"]\n").unwrap();
        let proxy = Proxy {
            ca: Some(Arc::new(crate::tls::Ca::load_or_create(dir).unwrap())),
            connector: crate::tls::connector(None).unwrap(),
            gate,
            run: "r".into(),
            parent: None,
            settings,
            credentials: Arc::default(),
            fence,
            nonce: "n".into(),
            seq: 0.into(),
            pool: crate::pool::Pool::default(),
            access: None,
        };
        (Arc::new(proxy), fence_tx, theirs)
    }

    /// The test as the gate: reads the proxy's requests one line at a time and answers them.
    struct FakeGate(
        tokio::io::Lines<tokio::io::BufReader<tokio::net::unix::OwnedReadHalf>>,
        tokio::net::unix::OwnedWriteHalf,
    );

    impl FakeGate {
        fn new(s: tokio::net::UnixStream) -> FakeGate {
            use tokio::io::AsyncBufReadExt;
            let (r, w) = s.into_split();
            FakeGate(tokio::io::BufReader::new(r).lines(), w)
        }

        async fn next(&mut self) -> Value {
            let line = self
                .0
                .next_line()
                .await
                .unwrap()
                .expect("a request from the proxy");
            serde_json::from_str(&line).unwrap()
        }

        async fn answer(&mut self, req: &Value, mut reply: Value) {
            use tokio::io::AsyncWriteExt;
            reply["id"] = req["id"].clone();
            let line = format!("{reply}\n");
            self.1.write_all(line.as_bytes()).await.unwrap();
        }
    }

    /// Serves the proxy and sends it one GET for `upstream`; the test then plays the gate.
    async fn one_request(
        dir: &std::path::Path,
        upstream: SocketAddr,
    ) -> (
        FakeGate,
        watch::Sender<bool>,
        tokio::task::JoinHandle<String>,
    ) {
        let (proxy, fence, gate) = proxy_and_gate(dir);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = listener.local_addr().unwrap();
        tokio::spawn(proxy.serve(listener));
        let head = format!("GET http://{upstream}/x HTTP/1.1\r\nhost: {upstream}\r\n\r\n");
        let agent = tokio::spawn(async move { reply_of(at, &head).await });
        (FakeGate::new(gate), fence, agent)
    }

    /// Plays the gate up to the commit point: the proxy's admission (`start: false`) answered
    /// `admitted 1.1`, the origin's accept of its dial, then its `start` with that token, which
    /// is returned unanswered with the origin's side of the connection.
    async fn admit_and_dial(
        gate: &mut FakeGate,
        origin: &tokio::net::TcpListener,
    ) -> (tokio::net::TcpStream, serde_json::Value) {
        let admit = gate.next().await;
        assert_eq!(
            (&admit["op"], &admit["start"]),
            (&json!("admit"), &json!(false))
        );
        assert_eq!(admit["tool"], "http.GET");
        gate.answer(
            &admit,
            json!({"ok": true, "verdict": "admitted", "token": "1.1", "epoch": 1}),
        )
        .await;
        // Dialled (the origin accepts), then the commit point is asked for.
        let (conn, _) = origin.accept().await.unwrap();
        let start = gate.next().await;
        assert_eq!(
            (&start["op"], &start["token"]),
            (&json!("start"), &json!("1.1"))
        );
        (conn, start)
    }

    /// A stop that lands while the request's `start` is on its way (before `go` came back)
    /// sends nothing, and the request is completed `error`, `not sent`: nothing happened
    /// upstream. (The gate answered nothing: the stop may have refused the start, or its `go`
    /// may be lost; either way no byte was written.)
    #[tokio::test]
    async fn a_request_cut_before_its_start_went_is_not_sent() {
        use tokio::io::AsyncReadExt;
        let dir = tempfile::tempdir().unwrap();
        let origin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (mut gate, fence, agent) = one_request(dir.path(), origin.local_addr().unwrap()).await;
        let (mut conn, _start) = admit_and_dial(&mut gate, &origin).await;
        fence.send_replace(true);
        let complete = gate.next().await;
        assert_eq!(complete["op"], "complete");
        assert_eq!(complete["outcome"], "error", "{complete}");
        assert!(
            complete["error"].as_str().unwrap().starts_with("not sent:"),
            "{complete}"
        );
        // Not one byte reached the origin.
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(std::time::Duration::from_secs(5), conn.read(&mut buf))
            .await
            .map_or(0, |r| r.unwrap_or(0));
        assert_eq!(n, 0, "{:?}", String::from_utf8_lossy(&buf[..n]));
        // The agent's connection is closed by the stop (a 403 may or may not reach it first).
        agent.await.unwrap();
    }

    /// A stop after the request was written whole and before its answer: `unknown`, with
    /// `sent, no answer` (the upstream may have acted on it).
    #[tokio::test]
    async fn a_request_cut_after_it_was_written_is_sent_with_no_answer() {
        use tokio::io::AsyncReadExt;
        let dir = tempfile::tempdir().unwrap();
        let origin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (mut gate, fence, agent) = one_request(dir.path(), origin.local_addr().unwrap()).await;
        let (mut conn, start) = admit_and_dial(&mut gate, &origin).await;
        gate.answer(&start, json!({"ok": true, "verdict": "go"}))
            .await;
        // The whole head arrives; no answer is given.
        let mut got = Vec::new();
        while !got.ends_with(b"\r\n\r\n") {
            let mut buf = [0u8; 256];
            let n = conn.read(&mut buf).await.unwrap();
            assert!(n > 0, "the origin saw the request end early");
            got.extend_from_slice(&buf[..n]);
        }
        assert!(got.starts_with(b"GET /x HTTP/1.1\r\n"));
        fence.send_replace(true);
        let complete = gate.next().await;
        assert_eq!(complete["outcome"], "unknown", "{complete}");
        assert!(
            complete["error"]
                .as_str()
                .unwrap()
                .starts_with("sent, no answer:"),
            "{complete}"
        );
        agent.await.unwrap();
    }

    /// A start the gate refuses (a stop ordered before it) writes nothing and completes
    /// nothing: the effect is refused at the gate.
    #[tokio::test]
    async fn a_refused_start_writes_nothing() {
        use tokio::io::AsyncReadExt;
        let dir = tempfile::tempdir().unwrap();
        let origin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (mut gate, _fence, agent) = one_request(dir.path(), origin.local_addr().unwrap()).await;
        let (mut conn, start) = admit_and_dial(&mut gate, &origin).await;
        gate.answer(
            &start,
            json!({"ok": true, "verdict": "refused", "reason": "cancelled"}),
        )
        .await;
        let reply = agent.await.unwrap();
        assert!(
            reply.starts_with("HTTP/1.1 403 ") && reply.contains("cancelled"),
            "{reply}"
        );
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(std::time::Duration::from_secs(2), conn.read(&mut buf))
            .await
            .map_or(0, |r| r.unwrap_or(0));
        assert_eq!(n, 0, "{:?}", String::from_utf8_lossy(&buf[..n]));
        // Nothing more from the proxy: no completion for a refused start.
        let more = tokio::time::timeout(std::time::Duration::from_millis(300), gate.next()).await;
        assert!(more.is_err(), "{more:?}");
    }

    /// The status line of one raw HTTP/1.1 request sent to the proxy at `at`.
    async fn status_of(at: SocketAddr, head: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut c = tokio::net::TcpStream::connect(at).await.unwrap();
        c.write_all(head.as_bytes()).await.unwrap();
        let mut buf = vec![0u8; 512];
        let n = c.read(&mut buf).await.unwrap();
        String::from_utf8_lossy(&buf[..n])
            .lines()
            .next()
            .unwrap_or("")
            .to_string()
    }

    fn args_of(method: &str, url: &str, settings: &Settings) -> Result<Value, RequestRefusal> {
        let method = Method::from_bytes(method.as_bytes()).unwrap();
        request_args(&method, &url.parse().unwrap(), b"", settings)
    }

    /// The method is upper case whatever the agent wrote (a rule on `http.GET` matches `get`),
    /// and what is recorded is the request: method, URL, scheme, host, port, path, query.
    #[test]
    fn the_arguments_name_the_request_with_its_method_in_upper_case() {
        let s = Settings::default();
        let a = args_of("get", "http://Example.COM:8080/a/b?x=1&y=2", &s).unwrap();
        assert_eq!(a["method"], "GET");
        assert_eq!(a["url"], "http://Example.COM:8080/a/b?x=1&y=2");
        assert_eq!(
            (
                &a["scheme"],
                &a["host"],
                &a["port"],
                &a["path"],
                &a["query"]
            ),
            (
                &json!("http"),
                &json!("example.com"),
                &json!(8080),
                &json!("/a/b"),
                &json!("x=1&y=2")
            )
        );
        assert!(a.get("query_sha256").is_none());
        assert_eq!(
            normalised(&Method::from_bytes(b"pAtCh").unwrap()),
            Method::PATCH
        );
        assert_eq!(
            normalised(&Method::from_bytes(b"purge").unwrap()).as_str(),
            "PURGE"
        );
    }

    /// `http://user:password@host/` is refused: forwarded, its authority became the `Host`.
    #[test]
    fn a_url_with_userinfo_is_refused() {
        let s = Settings::default();
        for url in [
            "http://u:p@example.com/",
            "https://u@example.com:8443/x",
            "http://:@example.com/",
        ] {
            assert_eq!(
                args_of("GET", url, &s),
                Err(RequestRefusal::BadRequest(USERINFO_REFUSED)),
                "{url}"
            );
        }
    }

    /// `secret_params` values are not recorded (in `query` nor `url`), in any case or
    /// percent-encoding of their names; `query_sha256` still tells two secrets apart.
    #[test]
    fn secret_parameters_are_redacted_and_their_digest_kept() {
        let s = Settings::parse("[egress]\nsecret_params = [\"api_key\", \"SIG\"]\n").unwrap();
        let a = args_of(
            "GET",
            "https://h.example/p?api_key=k-1&q=cats&Sig=s9&api%5Fkey=k-2",
            &s,
        )
        .unwrap();
        let query = "api_key=REDACTED&q=cats&Sig=REDACTED&api%5Fkey=REDACTED";
        assert_eq!(a["query"], query);
        assert_eq!(a["url"], format!("https://h.example/p?{query}"));
        let text = a.to_string();
        for secret in ["k-1", "k-2", "s9"] {
            assert!(!text.contains(secret), "{secret} in {text}");
        }
        let b = args_of(
            "GET",
            "https://h.example/p?api_key=k-X&q=cats&Sig=s9&api%5Fkey=k-2",
            &s,
        )
        .unwrap();
        assert_eq!(a["query"], b["query"]);
        assert_ne!(a["query_sha256"], b["query_sha256"]);
        assert_ne!(a, b, "two secrets, two digests");
        // Nothing to redact: nothing added.
        let plain = args_of("GET", "https://h.example/p?q=1&api_keyx=2", &s).unwrap();
        assert_eq!(plain["query"], "q=1&api_keyx=2");
        assert!(plain.get("query_sha256").is_none());
    }

    /// A Host header carrying userinfo and a CONNECT to `user@host` are refused with a 400
    /// saying why; a lower-case method goes out upper case.
    #[tokio::test]
    async fn userinfo_in_a_host_or_a_connect_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (proxy, _fence) = proxy(dir.path());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = listener.local_addr().unwrap();
        tokio::spawn(proxy.serve(listener));
        for head in [
            "GET http://u:p@example.com/ HTTP/1.1\r\nhost: example.com\r\n\r\n",
            "GET http://example.com/ HTTP/1.1\r\nhost: u:p@example.com\r\n\r\n",
            "CONNECT u:p@example.com:443 HTTP/1.1\r\nhost: example.com:443\r\n\r\n",
        ] {
            let reply = reply_of(at, head).await;
            assert!(reply.starts_with("HTTP/1.1 400 "), "{head:?}: {reply}");
            assert!(reply.contains("userinfo"), "{head:?}: {reply}");
        }
    }

    /// The whole reply (up to 4 KiB) to one raw request.
    async fn reply_of(at: SocketAddr, head: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut c = tokio::net::TcpStream::connect(at).await.unwrap();
        c.write_all(head.as_bytes()).await.unwrap();
        let mut buf = vec![0u8; 4096];
        let mut n = 0;
        while !String::from_utf8_lossy(&buf[..n]).contains("}}") && n < buf.len() {
            match c.read(&mut buf[n..]).await {
                Ok(0) | Err(_) => break,
                Ok(k) => n += k,
            }
        }
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    /// A proxy on the host's loopback (a harness HTTP tool's) answers only requests that carry
    /// its secret: any local process can reach the port, and would otherwise send requests as
    /// the call's run, with its credentials injected.
    #[tokio::test]
    async fn a_proxy_with_a_secret_refuses_requests_without_it() {
        let dir = tempfile::tempdir().unwrap();
        let (proxy, _fence) = proxy(dir.path());
        let mut proxy = Arc::into_inner(proxy).unwrap();
        proxy.access = Some("s3cret".into());
        let proxy = Arc::new(proxy);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = listener.local_addr().unwrap();
        tokio::spawn(proxy.serve(listener));
        let ask = |auth: &str| {
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n{auth}content-length: 2\r\n\r\n{{}}"
            )
        };
        for auth in [
            "",
            "proxy-authorization: Bearer wrong!\r\n",
            "proxy-authorization: Bearer s3cret2\r\n",
            "authorization: Bearer s3cret\r\n",
        ] {
            let status = status_of(at, &ask(auth)).await;
            assert!(status.contains(" 407 "), "{auth:?}: {status}");
        }
        let connect = "CONNECT example.com:443 HTTP/1.1\r\nhost: example.com:443\r\n\r\n";
        assert!(status_of(at, connect).await.contains(" 407 "));
        // With the secret the request goes on (here to the model endpoint, which has no
        // provider configured: its own refusal, past the check).
        let status = status_of(at, &ask("proxy-authorization: Bearer s3cret\r\n")).await;
        assert!(status.contains(" 404 "), "{status}");
    }

    /// Whether this process's socket connected from `local` to `peer` has TCP_NODELAY set
    /// (found among its own descriptors: the proxy's side of a connection is not the test's).
    #[allow(unsafe_code)]
    fn nodelay_of(local: SocketAddr, peer: SocketAddr) -> Option<bool> {
        for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
            let Ok(n) = entry.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            // SAFETY: a descriptor of this process, used only while the proxy's task holds it
            // open (the connection is kept open until the check is done).
            let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(n) };
            let addr = |a: Option<rustix::net::SocketAddrAny>| {
                a.and_then(|a| SocketAddr::try_from(a).ok())
            };
            if addr(rustix::net::getsockname(fd).ok()) == Some(local)
                && addr(rustix::net::getpeername(fd).ok().flatten()) == Some(peer)
            {
                return rustix::net::sockopt::tcp_nodelay(fd).ok();
            }
        }
        None
    }

    /// Both sides of the proxy write without Nagle's delay: the connection it accepts from
    /// the agent and the one it dials upstream. (Without it, a multi-threaded runtime made
    /// every proxied request ~42 ms: docs/PERFORMANCE.md.)
    #[tokio::test]
    async fn the_agents_and_the_upstream_connections_are_nodelay() {
        let dir = tempfile::tempdir().unwrap();
        let (proxy, _fence) = proxy(dir.path());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = listener.local_addr().unwrap();
        tokio::spawn(proxy.clone().serve(listener));
        let agent = tokio::net::TcpStream::connect(at).await.unwrap();
        assert!(
            !agent.nodelay().unwrap(),
            "a fresh socket starts with Nagle on"
        );
        let mine = agent.local_addr().unwrap();
        let accepted = loop {
            if let Some(v) = nodelay_of(at, mine) {
                break v;
            }
            tokio::task::yield_now().await;
        };
        assert!(accepted, "the agent's connection, on the proxy's side");

        let origin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = origin.local_addr().unwrap().port();
        let effect = Effect {
            tool: "http.GET".into(),
            key: "k".into(),
            args: serde_json::json!({"host": "127.0.0.1", "port": port}),
            request_body: None,
        };
        let (upstream, _) = proxy.connect(&effect).await.map_err(|e| e.2).unwrap();
        assert!(upstream.nodelay().unwrap(), "the connection to the origin");
        drop(agent);
    }
}
