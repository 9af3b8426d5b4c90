//! `estop egress-executor`: the executor of HTTP undos. A long-lived process, apart from any
//! `estop run` (whose proxy ends with the run it sandboxes, before its saga runs), that asks the
//! gate for the compensations whose compensating tool is `http.*` (`compensations` with `tool`,
//! docs/PROTOCOL.md) and sends each as one HTTP request: the destination checks, TLS roots and
//! credential store of the sandbox's `[egress]` settings, the attempt's idempotency key as
//! `Idempotency-Key`, and an outcome that never calls an undo done that may not have landed.
//! docs/EGRESS.md, "Undoing HTTP effects", is the reference.

use crate::credentials::Credentials;
use crate::gate::Gate;
use crate::settings::{Settings, contains, forbidden};
use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request, Uri};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// The compensating tools this executor runs.
pub const TOOLS: &str = "http.*";
/// From the dial to the response's head; past it an undo that was sent is `unknown`.
pub const REQUEST_TIMEOUT_MS: u64 = 30_000;
/// Headers an undo request may carry (`args.headers`).
pub const HEADERS_MAX: usize = 64;
/// The longest error text reported (the gate takes 4 KiB).
const ERROR_BYTES_MAX: usize = 1024;
/// Headers an undo may not set: the connection's own, and what the executor sets itself.
const RESERVED: &[&str] = &[
    "host",
    "connection",
    "proxy-connection",
    "keep-alive",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "idempotency-key",
];

#[derive(Debug)]
pub struct ExecutorOptions {
    pub data: PathBuf,
    pub socket: Option<String>,
    pub token: Option<String>,
    /// The `[egress]` settings: `allow_destinations`, `upstream_roots`, `credentials`,
    /// `body_bytes_max`.
    pub policy: Option<PathBuf>,
    /// Only this run's compensations.
    pub run: Option<String>,
}

/// One undo, as it will be sent.
#[derive(Debug)]
pub struct Undo {
    pub method: Method,
    pub uri: Uri,
    pub scheme: String,
    pub host: String,
    pub port: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// How an attempt ended, for `compensated`.
pub type Outcome = (&'static str, Option<String>);

/// How a lookup ended, for `looked_up`: the outcome, the result found, the error.
pub type LookedUp = (&'static str, Option<Value>, Option<String>);

/// The most of a found lookup's answer read (the result records at most
/// `record::BODY_BYTES_MAX` of it; past this the rest is not waited for).
pub const LOOKUP_BYTES_MAX: usize = 1 << 20;

/// Statuses a lookup's `not_found` may list.
const NOT_FOUND_MAX: usize = 16;

/// One HTTP lookup, as it will be sent: the request, and which statuses mean "not found".
#[derive(Debug)]
pub struct Lookup {
    pub request: Undo,
    pub not_found: Vec<u16>,
}

/// What became of a request.
enum Sent {
    /// Never sent, and why.
    Not(String),
    /// Sent, and no answer came (why).
    NoAnswer(String),
    Answered(hyper::Response<hyper::body::Incoming>),
}

/// Builds the request of a `lookup` event for tool `http.METHOD`, with the `args` the gate
/// built from the rule's `lookup_args` (`{url, host, headers?, not_found?}`: the URL is the
/// forward request's origin and the mapped path). No body and no `Idempotency-Key`: a lookup
/// names the call it looks for by its path or headers.
pub fn build_lookup(tool: &str, args: &Value) -> Result<Lookup, String> {
    let mut args = args.clone();
    let not_found = match args.as_object_mut().and_then(|m| m.remove("not_found")) {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(codes)) if codes.len() <= NOT_FOUND_MAX => codes
            .iter()
            .map(|c| {
                c.as_u64()
                    .filter(|c| (400..600).contains(c))
                    .map(|c| c as u16)
                    .ok_or_else(|| format!("`not_found` lists {c}, not a 4xx or 5xx status"))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(format!(
                "`not_found` is not a list of at most {NOT_FOUND_MAX} statuses"
            ));
        }
    };
    if args.get("body").is_some() {
        return Err("a lookup sends no body".into());
    }
    let mut request = build(tool, &args, "-", 0)?;
    request.headers.remove("idempotency-key");
    Ok(Lookup { request, not_found })
}

/// What sends undos: the sandbox's settings and credentials, and the upstream TLS roots.
pub struct Executor {
    pub settings: Settings,
    pub credentials: Credentials,
    pub connector: tokio_rustls::TlsConnector,
}

/// Builds the request of a `compensate` event for tool `http.METHOD` with `args = {url,
/// headers?, body?}` (and optionally `method`, `scheme`, `host`, `port`, which must agree with
/// the tool and the URL: a policy that judged them judged where it goes). An error says why it
/// cannot be sent; nothing is.
pub fn build(tool: &str, args: &Value, key: &str, body_max: usize) -> Result<Undo, String> {
    let method = tool
        .strip_prefix("http.")
        .and_then(|m| Method::from_bytes(m.as_bytes()).ok())
        .filter(|m| *m != Method::CONNECT)
        .ok_or_else(|| format!("{tool} is not an HTTP method this executor sends"))?;
    let Some(args) = args.as_object() else {
        return Err("the undo's arguments are not an object with a `url`".into());
    };
    if let Some(k) = args.keys().find(|k| {
        !matches!(
            k.as_str(),
            "url" | "headers" | "body" | "method" | "scheme" | "host" | "port"
        )
    }) {
        return Err(format!(
            "unknown argument {k:?}: an HTTP undo takes url, headers, body (and method, scheme, \
             host, port, which must agree with the url)"
        ));
    }
    let url = args
        .get("url")
        .and_then(Value::as_str)
        .ok_or("the undo's `url` is missing")?;
    let uri: Uri = url.parse().map_err(|e| format!("url {url:?}: {e}"))?;
    let (scheme, default_port) = match uri.scheme_str() {
        Some("http") => ("http", 80),
        Some("https") => ("https", 443),
        _ => {
            return Err(format!(
                "url {url:?}: not an absolute http:// or https:// URL"
            ));
        }
    };
    let host = uri
        .host()
        .ok_or_else(|| format!("url {url:?}: no host"))?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_ascii_lowercase();
    let port = uri.port_u16().unwrap_or(default_port);
    let agrees = |name: &str, want: &Value| {
        args.get(name).is_none_or(|v| {
            v == want
                || v.as_str()
                    .is_some_and(|s| json!(s.to_ascii_lowercase()) == *want)
        })
    };
    for (name, want) in [
        ("method", json!(method.as_str())),
        ("scheme", json!(scheme)),
        ("host", json!(host)),
        ("port", json!(port)),
    ] {
        if !agrees(name, &want) {
            return Err(format!(
                "the undo's `{name}` is {} but its tool and url say {want}",
                args[name]
            ));
        }
    }
    let mut headers = HeaderMap::new();
    let (body, json_body) = match args.get("body") {
        None | Some(Value::Null) => (Bytes::new(), false),
        Some(Value::String(s)) => (Bytes::from(s.clone()), false),
        Some(v) => (Bytes::from(v.to_string()), true),
    };
    if body.len() > body_max {
        return Err(format!(
            "the undo's body is {} bytes, over body_bytes_max = {body_max}",
            body.len()
        ));
    }
    if json_body {
        headers.insert(
            hyper::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
    }
    add_headers(args.get("headers"), &mut headers)?;
    let idem =
        HeaderValue::from_str(key).map_err(|_| "the idempotency key is not a header value")?;
    headers.insert("idempotency-key", idem);
    let authority = uri.authority().expect("a URL with a host").as_str();
    let authority = HeaderValue::from_str(authority).expect("an authority is a header value");
    headers.insert(hyper::header::HOST, authority);
    Ok(Undo {
        method,
        uri,
        scheme: scheme.into(),
        host,
        port,
        headers,
        body,
    })
}

/// `args.headers`: an object of strings, at most `HEADERS_MAX`, none of the reserved ones.
fn add_headers(given: Option<&Value>, to: &mut HeaderMap) -> Result<(), String> {
    let given = match given {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Object(m)) => m,
        Some(_) => return Err("the undo's `headers` is not an object of strings".into()),
    };
    if given.len() > HEADERS_MAX {
        return Err(format!("the undo has more than {HEADERS_MAX} headers"));
    }
    for (name, value) in given {
        let n = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("header {name:?} is not a header name"))?;
        if RESERVED.contains(&n.as_str()) {
            return Err(format!(
                "header {name:?} is set by the executor, not by the undo"
            ));
        }
        let v = value
            .as_str()
            .and_then(|v| HeaderValue::from_str(v).ok())
            .ok_or_else(|| format!("header {name:?}: the value is not header text"))?;
        to.insert(n, v);
    }
    Ok(())
}

impl Executor {
    /// Sends one undo and says how it ended: `ok` for a 2xx answer; `error` when it was not
    /// sent (no address, a refused destination, no connection, TLS failed) or was answered
    /// with anything else (the gate offers it again after a backoff, with the same
    /// `Idempotency-Key`); `unknown` when it was sent and no answer came (cut, timed out):
    /// whether it landed is for a human to find out, never for a blind retry.
    pub async fn send(&self, undo: Undo) -> Outcome {
        let what = format!("{} {}", undo.method, undo.uri);
        match self.request(undo).await {
            Sent::Not(why) => ("error", Some(format!("{what}: not sent: {why}"))),
            Sent::NoAnswer(why) => ("unknown", Some(format!("{what}: sent, {why}"))),
            Sent::Answered(res) if res.status().is_success() => ("ok", None),
            Sent::Answered(res) => ("error", Some(format!("{what}: answered {}", res.status()))),
        }
    }

    /// Looks up whether a call of unknown outcome happened, by the request its `lookup_args`
    /// built (`lookup`): found (2xx) is `ok`, with what the answer says recorded as the call's
    /// result (as the proxy records one, "What an undo needs"); a status the rule lists in
    /// `not_found` is `error`, it did not happen; anything else — another status, not sent, no
    /// answer — is `unknown`, for a human. Never a retry of the forward call.
    pub async fn look_up(&self, lookup: Lookup) -> LookedUp {
        let what = format!("{} {}", lookup.request.method, lookup.request.uri);
        let (scheme, host, port) = (
            lookup.request.scheme.clone(),
            lookup.request.host.clone(),
            lookup.request.port,
        );
        let res = match self.request(lookup.request).await {
            Sent::Not(why) => return ("unknown", None, Some(format!("{what}: not sent: {why}"))),
            Sent::NoAnswer(why) => return ("unknown", None, Some(format!("{what}: sent, {why}"))),
            Sent::Answered(res) => res,
        };
        let status = res.status();
        if lookup.not_found.contains(&status.as_u16()) {
            return (
                "error",
                None,
                Some(format!(
                    "{what}: answered {status}: not found, it did not happen"
                )),
            );
        }
        if !status.is_success() {
            return (
                "unknown",
                None,
                Some(format!("{what}: answered {status}: the lookup cannot tell")),
            );
        }
        let mut record = crate::record::Recorder::new(res.headers());
        let mut body = res.into_body();
        let mut bytes = 0usize;
        let timeout = Duration::from_millis(REQUEST_TIMEOUT_MS);
        loop {
            use http_body_util::BodyExt;
            match tokio::time::timeout(timeout, body.frame()).await {
                Ok(None) => break,
                Ok(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        bytes += data.len();
                        record.feed(&data);
                        if bytes > LOOKUP_BYTES_MAX {
                            break;
                        }
                    }
                }
                // Found, whatever the rest of the body: the head said so.
                Ok(Some(Err(_))) | Err(_) => break,
            }
        }
        let secrets = self.credentials.secrets_for(&scheme, &host, port);
        (
            "ok",
            Some(record.finish(status.as_u16(), bytes, &secrets)),
            None,
        )
    }

    /// Dials and sends one request (credentials injected for its destination only).
    async fn request(&self, undo: Undo) -> Sent {
        let timeout = Duration::from_millis(REQUEST_TIMEOUT_MS);
        let mut sender = match tokio::time::timeout(timeout, self.dial(&undo)).await {
            Ok(Ok(s)) => s,
            Ok(Err(why)) => return Sent::Not(why),
            Err(_) => return Sent::Not("no connection in time".into()),
        };
        let mut req = Request::builder()
            .method(undo.method.clone())
            .uri(undo.uri.path_and_query().map_or("/", |p| p.as_str()))
            .body(Full::new(undo.body))
            .expect("parts of a parsed URL");
        *req.headers_mut() = undo.headers;
        // Only for the destination itself; replaces a header of the same name.
        for (name, value) in self
            .credentials
            .for_request(&undo.scheme, &undo.host, undo.port)
        {
            req.headers_mut().insert(name.clone(), value.clone());
        }
        match tokio::time::timeout(timeout, sender.send(req, &undo.scheme)).await {
            Err(_) => Sent::NoAnswer(format!("no answer in {REQUEST_TIMEOUT_MS} ms")),
            Ok(Err(e)) => Sent::NoAnswer(format!("then {e}")),
            Ok(Ok(res)) => Sent::Answered(res),
        }
    }

    /// Resolves, checks every address as the proxy does (refused destinations unless
    /// `allow_destinations`), dials the first allowed one, and speaks HTTP (over TLS for https).
    async fn dial(&self, undo: &Undo) -> Result<crate::upstream::Sender, String> {
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host((undo.host.as_str(), undo.port))
            .await
            .map_err(|e| format!("cannot resolve {}: {e}", undo.host))?
            .collect();
        let allowed = |a: &SocketAddr| {
            !forbidden(a.ip()) || self.settings.allow.iter().any(|n| contains(*n, a.ip()))
        };
        let Some(addr) = addrs.iter().find(|a| allowed(a)).copied() else {
            return Err(format!(
                "{} resolves only to refused destinations (loopback, link-local, metadata…)",
                undo.host
            ));
        };
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("cannot connect to {addr}: {e}"))?;
        if undo.scheme == "https" {
            let name = rustls::pki_types::ServerName::try_from(undo.host.clone())
                .map_err(|e| format!("{}: {e}", undo.host))?;
            let tls = self
                .connector
                .connect(name, stream)
                .await
                .map_err(|e| format!("TLS with {}: {e}", undo.host))?;
            crate::upstream::over_tls(tls).await
        } else {
            crate::upstream::http1(stream).await
        }
        .map_err(|e| format!("{addr}: {e}"))
    }

    /// Runs one `compensate` event and reports it.
    async fn compensate(self: Arc<Self>, gate: Gate, event: Value) {
        let tool = event["tool"].as_str().unwrap_or_default();
        let key = event["idempotency_key"].as_str().unwrap_or_default();
        let args = event.get("args").cloned().unwrap_or(Value::Null);
        let (outcome, error) = match build(tool, &args, key, self.settings.body_bytes_max) {
            Ok(undo) => self.send(undo).await,
            Err(why) => ("error", Some(format!("not sent: {why}"))),
        };
        let (run, effect, attempt) = (&event["run"], &event["key"], &event["attempt"]);
        eprintln!(
            "estop egress-executor: {run} {effect} attempt {attempt}: {outcome}{}",
            error
                .as_deref()
                .map(|e| format!(" ({e})"))
                .unwrap_or_default()
        );
        let mut report = json!({"op": "compensated", "run": run, "key": effect,
            "attempt": attempt, "outcome": outcome});
        if let Some(e) = error {
            report["error"] = json!(truncate(e, ERROR_BYTES_MAX));
        }
        match gate.call(report).await {
            Ok(v) if v["ok"] == true => {}
            // Not recorded: the gate offers the same attempt again (same key) once this
            // connection is gone, or it is settled already.
            Ok(v) => eprintln!(
                "estop egress-executor: the gate refused the report: {}",
                v["error"]
            ),
            Err(e) => eprintln!("estop egress-executor: reporting: {e:#}"),
        }
    }
}

impl Executor {
    /// Runs one `lookup` event and reports it.
    async fn lookup(self: Arc<Self>, gate: Gate, event: Value) {
        let tool = event["tool"].as_str().unwrap_or_default();
        let args = event.get("args").cloned().unwrap_or(Value::Null);
        let (outcome, result, error) = match build_lookup(tool, &args) {
            Ok(lookup) => self.look_up(lookup).await,
            Err(why) => ("unknown", None, Some(format!("not sent: {why}"))),
        };
        let (run, effect, attempt) = (&event["run"], &event["key"], &event["attempt"]);
        eprintln!(
            "estop egress-executor: {run} {effect} lookup {attempt}: {outcome}{}",
            error
                .as_deref()
                .map(|e| format!(" ({e})"))
                .unwrap_or_default()
        );
        let mut report = json!({"op": "looked_up", "run": run, "key": effect,
            "attempt": attempt, "outcome": outcome});
        if let Some(r) = result {
            report["result"] = r;
        }
        if let Some(e) = error {
            report["error"] = json!(truncate(e, ERROR_BYTES_MAX));
        }
        match gate.call(report).await {
            Ok(v) if v["ok"] == true => {}
            Ok(v) => eprintln!(
                "estop egress-executor: the gate refused the lookup's report: {}",
                v["error"]
            ),
            Err(e) => eprintln!("estop egress-executor: reporting: {e:#}"),
        }
    }
}

fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut at = max;
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        s.truncate(at);
    }
    s
}

/// `estop egress-executor`: serves until stopped. A lost gate is reconnected (a restarted
/// daemon offers again what was under way); a refused token or bad settings end it at once.
pub fn serve(opts: ExecutorOptions) -> Result<()> {
    let settings = match &opts.policy {
        Some(p) => Settings::load(p)?,
        None => Settings::default(),
    };
    let credentials = match &settings.credentials {
        Some(p) => Credentials::load(p, &|name| std::env::var(name).ok())?,
        None => Credentials::default(),
    };
    let target = opts
        .socket
        .clone()
        .unwrap_or_else(|| opts.data.join("estop.sock").display().to_string());
    let token = match &opts.token {
        Some(t) => t.clone(),
        None => std::fs::read_to_string(opts.data.join("agent.token"))
            .with_context(|| {
                format!(
                    "reading {}/agent.token (or pass --token)",
                    opts.data.display()
                )
            })?
            .trim()
            .to_string(),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let executor = Arc::new(Executor {
            connector: crate::tls::connector(settings.upstream_roots.as_deref())?,
            settings,
            credentials,
        });
        // Until the first registration, any failure ends it (a wrong socket, a dead daemon);
        // after, a lost gate is waited for.
        let mut registered = false;
        let mut backoff = Duration::from_millis(200);
        loop {
            match session(
                &executor,
                &target,
                &token,
                opts.run.as_deref(),
                &mut registered,
            )
            .await
            {
                Err(Fatal(e)) => return Err(e),
                Ok(lost) if !registered => return Err(lost),
                Ok(lost) => eprintln!("estop egress-executor: {lost:#}; reconnecting"),
            }
            // A reconnect's backoff (the daemon restarting), not a wait for readiness.
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    })
}

/// An error that ends the executor (the others end one session).
struct Fatal(anyhow::Error);

/// One connection: hello, `compensations` for `http.*`, then every offered attempt run in its
/// own task. `Ok` with why the connection was lost; a refused hello or registration is fatal.
async fn session(
    executor: &Arc<Executor>,
    target: &str,
    token: &str,
    run: Option<&str>,
    registered: &mut bool,
) -> Result<anyhow::Error, Fatal> {
    let (gate, mut events) = match Gate::open(target).await {
        Ok(g) => g,
        Err(e) => return Ok(e),
    };
    let hello = match gate.call(json!({"op": "hello", "token": token})).await {
        Ok(v) => v,
        Err(e) => return Ok(e),
    };
    if hello["ok"] != true {
        return Err(Fatal(anyhow::anyhow!(
            "the gate refused the token: {}",
            hello["error"]
        )));
    }
    let mut ask = json!({"op": "compensations", "tool": TOOLS});
    if let Some(run) = run {
        ask["run"] = json!(run);
    }
    let v = match gate.call(ask).await {
        Ok(v) => v,
        Err(e) => return Ok(e),
    };
    if v["ok"] != true {
        return Err(Fatal(anyhow::anyhow!(
            "the gate refused `compensations`: {}",
            v["error"]
        )));
    }
    *registered = true;
    println!(
        "estop egress-executor: ready, running the {TOOLS} compensations of {} as {} {}",
        run.map_or("every run it may see".to_string(), |r| format!("run {r}")),
        hello["role"].as_str().unwrap_or("?"),
        hello["principal"].as_str().unwrap_or("?"),
    );
    while let Some(event) = events.recv().await {
        match event["event"].as_str() {
            Some("compensate") => {
                tokio::spawn(Arc::clone(executor).compensate(gate.clone(), event));
            }
            Some("lookup") => {
                tokio::spawn(Arc::clone(executor).lookup(gate.clone(), event));
            }
            _ => {}
        }
    }
    Ok(anyhow::anyhow!("the gate closed the connection"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn undo(tool: &str, args: Value) -> Result<Undo, String> {
        build(tool, &args, "orders-1/undo", 1024)
    }

    #[test]
    fn an_undo_is_built_from_its_url_headers_and_body() {
        let u = undo(
            "http.DELETE",
            json!({"url": "https://API.example.com:8443/orders/7?x=1", "host": "api.example.com",
                "headers": {"X-Reason": "cancelled"}, "body": {"why": "cancel"}}),
        )
        .unwrap();
        assert_eq!(u.method, Method::DELETE);
        assert_eq!(
            (u.scheme.as_str(), u.host.as_str(), u.port),
            ("https", "api.example.com", 8443)
        );
        assert_eq!(u.headers["idempotency-key"], "orders-1/undo");
        assert_eq!(u.headers["host"], "API.example.com:8443");
        assert_eq!(u.headers["x-reason"], "cancelled");
        assert_eq!(u.headers["content-type"], "application/json");
        assert_eq!(u.body, r#"{"why":"cancel"}"#);
        let plain = undo(
            "http.POST",
            json!({"url": "http://10.0.0.7/refunds", "body": "raw"}),
        )
        .unwrap();
        assert_eq!((plain.port, &plain.body[..]), (80, &b"raw"[..]));
        assert!(plain.headers.get("content-type").is_none());
    }

    #[test]
    fn an_undo_that_cannot_be_sent_as_judged_is_refused_with_the_reason() {
        for (tool, args, why) in [
            (
                "reverse_refund",
                json!({"url": "http://a/"}),
                "not an HTTP method",
            ),
            (
                "http.CONNECT",
                json!({"url": "http://a/"}),
                "not an HTTP method",
            ),
            ("http.DELETE", json!(["http://a/"]), "not an object"),
            ("http.DELETE", json!({}), "`url` is missing"),
            (
                "http.DELETE",
                json!({"url": "/orders/7"}),
                "not an absolute",
            ),
            (
                "http.DELETE",
                json!({"url": "ftp://a/x"}),
                "not an absolute",
            ),
            (
                "http.DELETE",
                json!({"url": "http://evil.test/", "host": "api.test"}),
                "`host`",
            ),
            (
                "http.DELETE",
                json!({"url": "http://a:81/", "port": 80}),
                "`port`",
            ),
            (
                "http.DELETE",
                json!({"url": "https://a/", "scheme": "http"}),
                "`scheme`",
            ),
            (
                "http.DELETE",
                json!({"url": "http://a/", "method": "POST"}),
                "`method`",
            ),
            (
                "http.DELETE",
                json!({"url": "http://a/", "path": "/x"}),
                "unknown argument",
            ),
            (
                "http.DELETE",
                json!({"url": "http://a/", "headers": {"Host": "b"}}),
                "set by the executor",
            ),
            (
                "http.DELETE",
                json!({"url": "http://a/", "headers": {"Idempotency-Key": "k"}}),
                "set by the executor",
            ),
            (
                "http.DELETE",
                json!({"url": "http://a/", "headers": {"a": 1}}),
                "header text",
            ),
            (
                "http.DELETE",
                json!({"url": "http://a/", "headers": "x"}),
                "object of strings",
            ),
            (
                "http.POST",
                json!({"url": "http://a/", "body": "x".repeat(1025)}),
                "body_bytes_max",
            ),
        ] {
            let e = undo(tool, args.clone()).unwrap_err();
            assert!(e.contains(why), "{tool} {args}: {e}");
        }
    }

    /// A server on 127.0.0.1 that reads one request head per connection and answers `reply`
    /// (or hangs up without answering when it is empty); hands the test each head it read.
    async fn upstream(reply: &'static str) -> (u16, tokio::sync::mpsc::UnboundedReceiver<String>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = tx.send(String::from_utf8_lossy(&head).to_string());
                if !reply.is_empty() {
                    let _ = s.write_all(reply.as_bytes()).await;
                }
            }
        });
        (port, rx)
    }

    fn executor(settings: &str, credentials: &str) -> Executor {
        Executor {
            settings: Settings::parse(settings).unwrap(),
            credentials: Credentials::parse(credentials, &|_| None).unwrap(),
            connector: crate::tls::connector(None).unwrap(),
        }
    }

    /// 2xx is `ok`; any other answer is `error` (offered again after a backoff); sent and
    /// cut before an answer is `unknown`; a refused destination is `error` and nothing is sent.
    #[tokio::test]
    async fn outcomes_say_whether_the_undo_is_done_and_only_2xx_is_ok() {
        let allow = "[egress]\nallow_destinations = [\"127.0.0.1/32\"]\n";
        let creds = "[[credential]]\nhost = \"127.0.0.1\"\nplain_http = true\nbearer = \"tok-1\"\n";
        let ex = executor(allow, creds);
        let send = |port: u16| {
            let args = json!({"url": format!("http://127.0.0.1:{port}/orders/7"),
                "headers": {"authorization": "Bearer agent-guess"}});
            build("http.DELETE", &args, "r/k/undo", 1024).unwrap()
        };
        let (port, mut heads) = upstream("HTTP/1.1 204 No Content\r\n\r\n").await;
        assert_eq!(ex.send(send(port)).await, ("ok", None));
        let head = heads.recv().await.unwrap().to_ascii_lowercase();
        assert!(head.starts_with("delete /orders/7 http/1.1"), "{head}");
        assert!(head.contains("idempotency-key: r/k/undo"), "{head}");
        assert!(head.contains("authorization: bearer tok-1"), "{head}");
        assert!(
            !head.contains("agent-guess"),
            "the credential replaces it: {head}"
        );

        let (port, _) =
            upstream("HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n").await;
        let (outcome, error) = ex.send(send(port)).await;
        assert_eq!(outcome, "error");
        assert!(error.unwrap().contains("503"));
        let (port, _) = upstream("HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n").await;
        assert_eq!(ex.send(send(port)).await.0, "error");

        let (port, mut heads) = upstream("").await;
        let (outcome, error) = ex.send(send(port)).await;
        assert_eq!(outcome, "unknown", "{error:?}");
        assert!(heads.recv().await.is_some(), "it was sent");

        let closed = executor("[egress]\n", "");
        let (port, mut heads) = upstream("HTTP/1.1 204 No Content\r\n\r\n").await;
        let (outcome, error) = closed.send(send(port)).await;
        assert_eq!(outcome, "error");
        assert!(error.unwrap().contains("refused destinations"));
        assert!(heads.try_recv().is_err(), "nothing reached it");
    }

    /// A lookup: 2xx found (`ok`, the answer recorded without the credential), a status the
    /// rule lists in `not_found` did not happen (`error`), anything else cannot tell
    /// (`unknown`): an unlisted 404, a 503, a cut, not sent. No body, no `Idempotency-Key`.
    #[tokio::test]
    async fn a_lookup_says_found_not_found_or_cannot_tell() {
        let allow = "[egress]\nallow_destinations = [\"127.0.0.1/32\"]\n";
        let creds = "[[credential]]\nhost = \"127.0.0.1\"\nplain_http = true\nbearer = \"tok-1\"\n";
        let ex = executor(allow, creds);
        let lookup = |port: u16, not_found: Value| {
            let args = json!({"url": format!("http://127.0.0.1:{port}/orders?key=k1"),
                "host": "127.0.0.1", "not_found": not_found});
            build_lookup("http.GET", &args).unwrap()
        };
        let found = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 35\r\n\r\n{\"id\":\"o-7\",\"echo\":\"Bearer tok-1\"}";
        let (port, mut heads) = upstream(found).await;
        let (outcome, result, error) = ex.look_up(lookup(port, json!([404]))).await;
        assert_eq!((outcome, error), ("ok", None));
        let result = result.unwrap();
        assert_eq!(result["status"], 200);
        assert_eq!(result["body_omitted"], "credential", "{result}");
        let head = heads.recv().await.unwrap().to_ascii_lowercase();
        assert!(head.starts_with("get /orders?key=k1 http/1.1"), "{head}");
        assert!(head.contains("authorization: bearer tok-1"), "{head}");
        assert!(!head.contains("idempotency-key"), "{head}");

        let gone = "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n";
        let (port, _) = upstream(gone).await;
        assert_eq!(ex.look_up(lookup(port, json!([404, 410]))).await.0, "error");
        let (port, _) = upstream(gone).await;
        assert_eq!(ex.look_up(lookup(port, Value::Null)).await.0, "unknown");
        let (port, _) =
            upstream("HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n").await;
        assert_eq!(ex.look_up(lookup(port, json!([404]))).await.0, "unknown");
        let (port, _) = upstream("").await;
        assert_eq!(ex.look_up(lookup(port, json!([404]))).await.0, "unknown");
        let closed = executor("[egress]\n", "");
        let (port, mut heads) = upstream(found).await;
        let (outcome, _, error) = closed.look_up(lookup(port, json!([]))).await;
        assert_eq!(outcome, "unknown");
        assert!(error.unwrap().contains("not sent"));
        assert!(heads.try_recv().is_err(), "nothing reached it");

        for (args, why) in [
            (
                json!({"url": "http://a/", "not_found": [200]}),
                "not a 4xx or 5xx",
            ),
            (
                json!({"url": "http://a/", "not_found": "404"}),
                "not a list",
            ),
            (json!({"url": "http://a/", "body": "x"}), "no body"),
            (
                json!({"url": "http://a/", "path": "/x"}),
                "unknown argument",
            ),
        ] {
            let e = build_lookup("http.GET", &args).unwrap_err();
            assert!(e.contains(why), "{args}: {e}");
        }
    }
}
