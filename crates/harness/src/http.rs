//! HTTP tools through the egress proxy. An HTTP tool call is admitted at the gate under the
//! trajectory's run like any tool call (its name, key = the call's id); at dispatch it gets a
//! run of its own, `TRAJECTORY/CALL_ID`, a child of the trajectory's (as a sandboxed command
//! does), and its request — the tool's `method` to its `url` and `path` (filled from the
//! arguments, [`Request::build`]), the arguments as the JSON body or the query — goes through
//! `estop_egress::tool`'s proxy for that run. So the request itself is an `http.METHOD` effect
//! the gate's policy admits by host and path (`estop report TRAJECTORY/CALL_ID`). It is admitted
//! by the harness first, two-phase, at the call's admission (CALLING_MODEL), with the arguments
//! the proxy will see ([`Request::effect`], `estop_egress::proxy::request_args`): a request the
//! policy holds makes the trajectory AWAITING_APPROVAL like a held tool call, and the proxy
//! starts the admitted effect rather than admitting it again. The tool's `[egress] credentials` are
//! injected for the exact destination after admission (never in the arguments the model wrote,
//! the journal or the ledger), refused destinations stay refused, and a cancel of the
//! trajectory (which the gate cascades to the call's run) or a cut of the call fences the proxy
//! and cuts the request in flight.

use crate::chat::ToolCall;
use crate::gate::GateConfig;
use crate::record::{Admission, HeldRequest};
use bytes::Bytes;
use estop_egress::credentials::Credentials;
use estop_egress::settings::Settings;
use estop_egress::tool::{ToolProxy, ToolProxyOptions};
use http_body_util::{BodyExt, Full};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Largest answer an HTTP tool may give (what the model will read of it).
pub const HTTP_TOOL_BYTES_MAX: usize = 1 << 20;

/// How an HTTP tool's requests go out: the `[egress]` settings (`egress_policy` in the tool's
/// config; the defaults without it) and the credential store they name, loaded once at start.
#[derive(Debug, Clone, Default)]
pub struct Egress {
    pub settings: Settings,
    pub credentials: Arc<Credentials>,
}

impl Egress {
    /// Loads the settings file and its credential store (a store others can read, or a
    /// variable it names that is not set, is an error that names the file, never a secret).
    pub fn load(path: &std::path::Path) -> anyhow::Result<Egress> {
        let settings = Settings::load(path)?;
        let credentials = match &settings.credentials {
            Some(p) => Credentials::load(p, &|name| std::env::var(name).ok())?,
            None => Credentials::default(),
        };
        Ok(Egress {
            settings,
            credentials: Arc::new(credentials),
        })
    }
}

/// An HTTP tool's method (`method` in its `[[tool]]`; POST when not given).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Method {
    Get,
    #[default]
    Post,
    Put,
    Patch,
    Delete,
}

impl std::str::FromStr for Method {
    type Err = String;

    /// `GET`, `POST`, `PUT`, `PATCH` or `DELETE`, in any case.
    fn from_str(s: &str) -> Result<Method, String> {
        Ok(match s.to_ascii_uppercase().as_str() {
            "GET" => Method::Get,
            "POST" => Method::Post,
            "PUT" => Method::Put,
            "PATCH" => Method::Patch,
            "DELETE" => Method::Delete,
            _ => {
                return Err(format!(
                    "method {s:?} is not one of GET, POST, PUT, PATCH, DELETE"
                ));
            }
        })
    }
}

impl Method {
    fn hyper(self) -> hyper::Method {
        match self {
            Method::Get => hyper::Method::GET,
            Method::Post => hyper::Method::POST,
            Method::Put => hyper::Method::PUT,
            Method::Patch => hyper::Method::PATCH,
            Method::Delete => hyper::Method::DELETE,
        }
    }

    /// GET and DELETE send no body: the arguments go in the query.
    fn has_body(self) -> bool {
        !matches!(self, Method::Get | Method::Delete)
    }
}

/// How an HTTP tool's request is made beyond its `url`: the method, a path template filled
/// from the arguments, and static headers (`[[tool]]` `method`, `path`, `headers`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HttpSpec {
    #[serde(default)]
    pub method: Method,
    /// Appended to the URL's path, each `{name}` replaced by the argument `name`, percent-
    /// encoded as one segment (a missing, empty, `.`, `..` or `/`-holding value is refused).
    #[serde(default)]
    pub path: Option<String>,
    /// Sent with every request; never a credential (those come from the egress credential
    /// store), a hop-by-hop header, `Host`, `Content-Length` or `Proxy-*` ([`HttpSpec::check`]).
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

/// Static headers a tool's config may not set: hop-by-hop ones, those the request's framing
/// or the proxy owns, the idempotency key the harness sets, and credentials — which come only
/// from the egress credential store, injected after admission for the exact destination.
const HEADERS_REFUSED: &[&str] = &[
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "idempotency-key",
    "authorization",
    "cookie",
];

/// Longest path template, and most static headers, a tool may have.
const PATH_BYTES_MAX: usize = 2048;
const HEADERS_MAX: usize = 32;

impl HttpSpec {
    /// What the config loader checks: a refusal names what is wrong (the caller names the
    /// tool). `url` is the tool's URL.
    pub fn check(&self, url: &str) -> Result<(), String> {
        if let Some(path) = &self.path {
            if !path.starts_with('/') {
                return Err(format!("path {path:?} must start with /"));
            }
            if path.len() > PATH_BYTES_MAX {
                return Err(format!("path is over {PATH_BYTES_MAX} bytes"));
            }
            if path.contains(['?', '#']) {
                return Err(format!("path {path:?} may not hold ? or #"));
            }
            if url.contains(['?', '#']) {
                return Err("a url with a query or fragment takes no path".into());
            }
            for piece in template(path)? {
                if let Piece::Text(t) = piece
                    && t.bytes().any(|b| !b.is_ascii_graphic())
                {
                    return Err(format!("path {path:?}: only visible ASCII outside {{…}}"));
                }
            }
        }
        if self.headers.len() > HEADERS_MAX {
            return Err(format!("more than {HEADERS_MAX} headers"));
        }
        for (name, value) in &self.headers {
            let lower = name.to_ascii_lowercase();
            if HEADERS_REFUSED.contains(&lower.as_str()) || lower.starts_with("proxy-") {
                return Err(format!(
                    "header {name:?} may not be set here (credentials come only from the \
                     egress credential store; hop-by-hop, Host, Content-Length and Proxy-* \
                     headers belong to the request's framing)"
                ));
            }
            hyper::header::HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| format!("header {name:?} is not a header name"))?;
            hyper::header::HeaderValue::from_str(value)
                .map_err(|_| format!("header {name:?}: its value is not a header value"))?;
        }
        Ok(())
    }
}

enum Piece<'a> {
    Text(&'a str),
    Arg(&'a str),
}

/// A path template's pieces: text, and `{name}` placeholders.
fn template(path: &str) -> Result<Vec<Piece<'_>>, String> {
    let mut out = Vec::new();
    let mut rest = path;
    while !rest.is_empty() {
        match rest.find(['{', '}']) {
            None => {
                out.push(Piece::Text(rest));
                rest = "";
            }
            Some(i) if rest.as_bytes()[i] == b'}' => {
                return Err(format!("path {path:?}: a }} without its {{"));
            }
            Some(i) => {
                if i > 0 {
                    out.push(Piece::Text(&rest[..i]));
                }
                let after = &rest[i + 1..];
                let end = after
                    .find('}')
                    .ok_or_else(|| format!("path {path:?}: a {{ without its }}"))?;
                let name = &after[..end];
                if name.is_empty()
                    || !name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
                {
                    return Err(format!(
                        "path {path:?}: {{{name}}} is not an argument name (letters, digits, _ and -)"
                    ));
                }
                out.push(Piece::Arg(name));
                rest = &after[end + 1..];
            }
        }
    }
    Ok(out)
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// An argument as text for the path or the query: a string as it is, a number or a boolean
/// as JSON writes it; anything else (an object, an array, null) is refused in the path and
/// written as JSON in the query.
fn text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// Why an HTTP tool's request was not made: the reason and message of seed 004's refusal the
/// model reads. Nothing was sent, nothing asked of the gate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotSent {
    pub reason: &'static str,
    pub message: String,
}

fn invalid(message: String) -> NotSent {
    NotSent {
        reason: "INVALID_ARGUMENTS",
        message,
    }
}

/// The request an HTTP tool call makes, built from the tool's config and the model's
/// arguments; the same build gives the pre-admission's arguments and what is sent.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: hyper::Method,
    pub uri: hyper::Uri,
    /// POST, PUT and PATCH: the arguments as the model wrote them (JSON); GET and DELETE: none.
    pub body: Bytes,
    pub headers: Vec<(hyper::header::HeaderName, hyper::header::HeaderValue)>,
}

/// The child run's key for the call's request.
pub fn effect_key(call_id: &str) -> String {
    format!("idem:{call_id}")
}

impl Request {
    /// The request for `call`: `url`, then `spec.path` with each `{name}` replaced by the
    /// argument `name` as one percent-encoded segment; GET and DELETE put the other arguments
    /// in the query (sorted by name, each percent-encoded), the other methods send the
    /// arguments as the JSON body. A missing, empty, `.`, `..` or `/`-holding path argument,
    /// or arguments that are not a JSON object, are refused (`INVALID_ARGUMENTS`).
    pub fn build(spec: &HttpSpec, url: &str, call: &ToolCall) -> Result<Request, NotSent> {
        let args: serde_json::Map<String, Value> =
            match serde_json::from_str::<Value>(&call.function.arguments) {
                Ok(Value::Object(m)) => m,
                _ => return Err(invalid("the arguments are not a JSON object".into())),
            };
        let mut used = std::collections::BTreeSet::new();
        let mut target = url.to_string();
        if let Some(path) = &spec.path {
            let pieces = template(path).map_err(|e| NotSent {
                reason: "CONFIG",
                message: e,
            })?;
            let base = target.trim_end_matches('/').to_string();
            let mut filled = String::new();
            for piece in pieces {
                match piece {
                    Piece::Text(t) => filled.push_str(t),
                    Piece::Arg(name) => {
                        let v = args.get(name).ok_or_else(|| {
                            invalid(format!("the path needs the argument {name:?}"))
                        })?;
                        let v = text(v).ok_or_else(|| {
                            invalid(format!(
                                "the argument {name:?} must be a string or a number"
                            ))
                        })?;
                        if v.is_empty() || v == "." || v == ".." || v.contains('/') {
                            return Err(invalid(format!(
                                "the argument {name:?} must be one path segment: not empty, \
                                 not . or .., without /"
                            )));
                        }
                        filled.push_str(&encode(&v));
                        used.insert(name.to_string());
                    }
                }
            }
            target = base + &filled;
        }
        // An origin alone gets the root path, so the request has a target to name.
        if !target
            .split_once("://")
            .is_some_and(|(_, rest)| rest.contains('/'))
        {
            target.push('/');
        }
        let method = spec.method;
        if !method.has_body() {
            let query: Vec<String> = args
                .iter()
                .filter(|(k, _)| !used.contains(*k))
                .map(|(k, v)| {
                    let v = text(v).unwrap_or_else(|| v.to_string());
                    format!("{}={}", encode(k), encode(&v))
                })
                .collect();
            if !query.is_empty() {
                let sep = if target.contains('?') { '&' } else { '?' };
                target = format!("{target}{sep}{}", query.join("&"));
            }
        }
        let uri: hyper::Uri = target.parse().map_err(|e| NotSent {
            reason: "INVALID_ARGUMENTS",
            message: format!("the request's URL is not valid: {e}"),
        })?;
        let body = if method.has_body() {
            Bytes::from(call.function.arguments.clone())
        } else {
            Bytes::new()
        };
        let mut headers = Vec::new();
        for (name, value) in &spec.headers {
            // Checked at config load.
            let n = hyper::header::HeaderName::from_bytes(name.as_bytes());
            let v = hyper::header::HeaderValue::from_str(value);
            if let (Ok(n), Ok(v)) = (n, v) {
                headers.push((n, v));
            }
        }
        Ok(Request {
            method: method.hyper(),
            uri,
            body,
            headers,
        })
    }

    fn has_body(&self) -> bool {
        !matches!(self.method, hyper::Method::GET | hyper::Method::DELETE)
    }

    /// The effect the proxy will present for this request (`estop_egress::proxy::request_args`,
    /// the proxy's own function): tool `http.METHOD` and its arguments; a destination the
    /// settings refuse is refused here, before the gate is asked.
    pub fn effect(&self, settings: &Settings) -> Result<(String, Value), NotSent> {
        use estop_egress::proxy::{RequestRefusal, request_args};
        match request_args(&self.method, &self.uri, &self.body, settings) {
            // The method as the proxy normalises it (upper case), so the tool is the proxy's.
            Ok(args) => Ok((
                format!("http.{}", args["method"].as_str().unwrap_or("")),
                args,
            )),
            Err(RequestRefusal::Destination(ip)) => Err(NotSent {
                reason: "DESTINATION",
                message: format!(
                    "{ip} is a refused destination (loopback, link-local, metadata); \
                     nothing was sent"
                ),
            }),
            Err(RequestRefusal::BadRequest(m)) => Err(invalid(m.to_string())),
        }
    }
}

/// The tool's outcome at the gate (`ok`, `error`, `unknown`) and the observation the model
/// reads.
pub type Outcome = (&'static str, String);

/// Runs one admitted, started HTTP tool call as the child run `RUN/CALL_ID`; dropped mid-way
/// (the runner aborts a cut call), its proxy is dropped with it, which fences the proxy.
/// The harness may have admitted the request itself ([`Request::effect`], two-phase): the
/// proxy's admission of the same request starts that effect.
pub async fn call(
    gate: &GateConfig,
    run: &str,
    call: &ToolCall,
    request: &Request,
    egress: &Egress,
) -> Outcome {
    let child = format!("{run}/{}", call.id);
    if let Err(e) = crate::gate::check_run_id(&child) {
        return (
            "error",
            format!("the call's run {child:?} cannot be a run id: {e}"),
        );
    }
    let opts = ToolProxyOptions {
        target: gate.target.clone(),
        token: gate.token.clone(),
        run: child.clone(),
        parent: run.to_string(),
        settings: egress.settings.clone(),
        credentials: egress.credentials.clone(),
    };
    let proxy = match ToolProxy::start(opts).await {
        Ok(p) => p,
        Err(e) => return ("error", format!("the tool's proxy could not start: {e:#}")),
    };
    // A request the gate holds waits in the proxy up to `hold_ms`, then is sent again (the
    // same effect: its key is the call's id) until it is decided or the tool deadline cuts it.
    let outcome = loop {
        match send(proxy.addr, &proxy.secret, request, call).await {
            Sent::Held => continue,
            Sent::Done(o) => break o,
        }
    };
    proxy.finish(outcome.0 == "ok").await;
    outcome
}

/// Admits an HTTP tool call (on the blocking pool, as every admission): the request is built
/// first (bad arguments or a refused destination: `NotSent`, nothing asked of the gate), then
/// the tool call under the trajectory's run, then — once that is admitted — the request itself,
/// two-phase, as the proxy will present it: the effect `idem:CALL_ID` of the call's run
/// `RUN/CALL_ID` (its parent `run`, which this admission creates). A hold of the request is
/// `RequestHeld`: the trajectory awaits its approval like a held call's. Any other answer
/// leaves the call admitted; the dispatch admits the request again (the gate answers what it
/// answered) and reads a refusal there.
pub fn admit(
    gate: &GateConfig,
    run: &str,
    parent: Option<&str>,
    call: &ToolCall,
    tool: &crate::runner::Tool,
) -> Admission {
    let default = Settings::default();
    let settings = tool.egress.as_ref().map_or(&default, |e| &e.settings);
    let built = Request::build(&tool.http, tool.url.as_deref().unwrap_or_default(), call)
        .and_then(|r| r.effect(settings));
    let (effect, args) = match built {
        Ok(x) => x,
        Err(n) => {
            return Admission::NotSent {
                reason: n.reason.into(),
                message: n.message,
            };
        }
    };
    let admission = gate.admit(
        run,
        parent,
        &call.id,
        &call.function.name,
        &call.function.arguments,
    );
    let Admission::Admitted { token } = admission else {
        return admission;
    };
    admit_request(gate, run, call, (effect, args), token)
}

/// Admits the request of a call whose tool call is admitted (with `token`), after the gate
/// approved the tool call itself: `RequestHeld` when the policy holds the request too (the
/// call stays held, now for its request), else `Admitted { token }`.
pub fn admit_after_approval(
    gate: &GateConfig,
    run: &str,
    call: &ToolCall,
    tool: &crate::runner::Tool,
    token: String,
) -> Admission {
    let default = Settings::default();
    let settings = tool.egress.as_ref().map_or(&default, |e| &e.settings);
    match Request::build(&tool.http, tool.url.as_deref().unwrap_or_default(), call)
        .and_then(|r| r.effect(settings))
    {
        Ok(effect) => admit_request(gate, run, call, effect, token),
        // Found again at dispatch, which refuses it.
        Err(_) => Admission::Admitted { token },
    }
}

fn admit_request(
    gate: &GateConfig,
    run: &str,
    call: &ToolCall,
    (effect, args): (String, Value),
    token: String,
) -> Admission {
    let child = format!("{run}/{}", call.id);
    if crate::gate::check_run_id(&child).is_err() {
        return Admission::Admitted { token };
    }
    let key = effect_key(&call.id);
    let url = args["url"].as_str().unwrap_or_default().to_string();
    match gate.admit_request(&child, run, &key, &effect, args) {
        Admission::Held { expires_at_ms } => Admission::RequestHeld {
            expires_at_ms,
            request: HeldRequest {
                run: child,
                key,
                tool: effect,
                url,
                token,
            },
        },
        _ => Admission::Admitted { token },
    }
}

/// Runs an admitted, started HTTP tool call: builds its request, admits it as the proxy will
/// present it (again, when the call's admission did: the same key and arguments, so the gate
/// answers what it answered and creates nothing new; first, when the tool call itself was
/// held), and sends it through the proxy, which starts that effect. A refused request is
/// seed 004's refusal, and nothing is dialled.
pub async fn dispatch(
    gate: &GateConfig,
    run: &str,
    call: &ToolCall,
    url: &str,
    spec: &HttpSpec,
    egress: &Egress,
) -> Outcome {
    let not_sent = |n: NotSent| {
        let m = crate::record::refusal(call, n.reason, &n.message);
        ("error", m.content.unwrap_or_default())
    };
    let request = match Request::build(spec, url, call) {
        Ok(r) => r,
        Err(n) => return not_sent(n),
    };
    let (effect, args) = match request.effect(&egress.settings) {
        Ok(x) => x,
        Err(n) => return not_sent(n),
    };
    let child = format!("{run}/{}", call.id);
    if let Err(e) = crate::gate::check_run_id(&child) {
        return (
            "error",
            format!("the call's run {child:?} cannot be a run id: {e}"),
        );
    }
    let (g, c, r, k) = (
        gate.clone(),
        child.clone(),
        run.to_string(),
        effect_key(&call.id),
    );
    let admitted = tokio::task::spawn_blocking(move || g.admit_request(&c, &r, &k, &effect, args))
        .await
        .unwrap_or_else(|e| Admission::Refused {
            reason: e.to_string(),
        });
    if let Admission::Refused { reason } = admitted {
        let (g, c) = (gate.clone(), child);
        let _ = tokio::task::spawn_blocking(move || g.close(&c, false)).await;
        let estop = serde_json::json!({"verdict": "refused", "reason": reason,
            "message": "the gate refused this request; nothing was sent"});
        return ("error", refused(call, &estop));
    }
    self::call(gate, run, call, &request, egress).await
}

enum Sent {
    Held,
    Done(Outcome),
}

/// One request through the proxy (absolute form, over loopback): the request as built, the
/// call's id as `Idempotency-Key` (the child run's effect is `idem:CALL_ID`).
async fn send(
    proxy: std::net::SocketAddr,
    secret: &str,
    request: &Request,
    call: &ToolCall,
) -> Sent {
    let failed = |m: String| Sent::Done(("error", m));
    let tcp = match tokio::net::TcpStream::connect(proxy).await {
        Ok(t) => t,
        Err(e) => return failed(format!("cannot reach the tool's proxy: {e}")),
    };
    tcp.set_nodelay(true).ok();
    let host = request
        .uri
        .authority()
        .map_or("", |a| a.as_str())
        .to_string();
    let mut builder = hyper::Request::builder()
        .method(request.method.clone())
        .uri(request.uri.clone())
        .header("host", host)
        .header("accept", "application/json");
    if request.has_body() {
        builder = builder.header("content-type", "application/json");
    }
    let mut r = match builder.body(Full::new(request.body.clone())) {
        Ok(r) => r,
        Err(e) => return failed(e.to_string()),
    };
    // The tool's static headers (checked at config load), then what only the harness sets.
    for (name, value) in &request.headers {
        r.headers_mut().insert(name.clone(), value.clone());
    }
    let fixed = [
        ("idempotency-key", call.id.clone()),
        ("proxy-authorization", format!("Bearer {secret}")),
    ];
    for (name, value) in fixed {
        match hyper::header::HeaderValue::from_str(&value) {
            Ok(v) => {
                r.headers_mut().insert(name, v);
            }
            Err(e) => return failed(format!("{name}: {e}")),
        }
    }
    let request = r;
    let io = hyper_util::rt::TokioIo::new(tcp);
    let (mut sender, conn) = match hyper::client::conn::http1::handshake(io).await {
        Ok(x) => x,
        Err(e) => return failed(format!("the tool's proxy: {e}")),
    };
    tokio::spawn(conn);
    let resp = match sender.send_request(request).await {
        Ok(r) => r,
        Err(e) => return failed(format!("the tool's proxy: {e}")),
    };
    let status = resp.status().as_u16();
    let verdict = resp
        .headers()
        .get("x-estop-verdict")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body = match read(resp.into_body()).await {
        Ok(b) => b,
        // Sent, and cut before its end (a stop, a broken upstream, the bound): whether it
        // acted is not known.
        Err(e) if verdict == "admitted" => return Sent::Done(("unknown", e)),
        Err(e) => return failed(e),
    };
    if verdict == "admitted" {
        return Sent::Done(match status {
            200..=299 => ("ok", body),
            _ => ("error", format!("HTTP {status}: {body}")),
        });
    }
    let estop: Value = serde_json::from_str::<Value>(&body)
        .map(|v| v["estop"].clone())
        .unwrap_or(Value::Null);
    match estop["verdict"].as_str().unwrap_or(&verdict) {
        "held" => Sent::Held,
        "refused" | "duplicate" => Sent::Done(("error", refused(call, &estop))),
        _ => {
            let why = estop["message"].as_str().unwrap_or(&body);
            match estop.get("error").filter(|e| !e.is_null()) {
                Some(e) => failed(format!(
                    "the request was not answered ({status}): {why}: {e}"
                )),
                None => failed(format!("the request was not answered ({status}): {why}")),
            }
        }
    }
}

/// The structured refusal the model reads (seed 004), from the proxy's `{"estop": …}` answer:
/// a reviewer's rejection or an expiry under the approval gate's names, any other reason as
/// the gate gave it.
fn refused(call: &ToolCall, estop: &Value) -> String {
    let reason = match estop["reason"].as_str() {
        Some("rejected") => "APPROVAL_DENIED".to_string(),
        Some("expired") => "APPROVAL_EXPIRED".to_string(),
        Some(r) => r.to_uppercase(),
        None => estop["verdict"]
            .as_str()
            .unwrap_or("refused")
            .to_uppercase(),
    };
    let message = estop["message"]
        .as_str()
        .unwrap_or("the gate refused this request; nothing was sent");
    let m = crate::record::refusal(call, &reason, message);
    m.content.unwrap_or_default()
}

/// The whole body, up to [`HTTP_TOOL_BYTES_MAX`].
async fn read(mut body: hyper::body::Incoming) -> Result<String, String> {
    let mut out = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("the answer broke off: {e}"))?;
        if let Ok(d) = frame.into_data() {
            out.extend_from_slice(&d);
            if out.len() > HTTP_TOOL_BYTES_MAX {
                return Err(format!("the answer is over {HTTP_TOOL_BYTES_MAX} bytes"));
            }
        }
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call() -> ToolCall {
        serde_json::from_value(json!({"id": "c1", "type": "function",
            "function": {"name": "fetch", "arguments": "{\"id\":7}"}}))
        .unwrap()
    }

    fn args(a: &str) -> ToolCall {
        serde_json::from_value(json!({"id": "c1", "type": "function",
            "function": {"name": "fetch", "arguments": a}}))
        .unwrap()
    }

    fn spec(method: Method, path: Option<&str>) -> HttpSpec {
        HttpSpec {
            method,
            path: path.map(str::to_string),
            headers: BTreeMap::new(),
        }
    }

    #[test]
    fn a_path_is_filled_one_encoded_segment_per_argument() {
        let put = spec(Method::Put, Some("/orders/{order_id}/lines/{n}"));
        let r = Request::build(
            &put,
            "https://api.test/v1/",
            &args(r#"{"order_id": "A 7%2F?#", "n": 3, "qty": 2}"#),
        )
        .unwrap();
        assert_eq!(r.method, hyper::Method::PUT);
        assert_eq!(
            r.uri.to_string(),
            "https://api.test/v1/orders/A%207%252F%3F%23/lines/3"
        );
        assert_eq!(
            &r.body[..],
            br#"{"order_id": "A 7%2F?#", "n": 3, "qty": 2}"#
        );
        // GET: no body; the arguments not in the path are the query, sorted, encoded.
        let get = spec(Method::Get, Some("/orders/{order_id}"));
        let r = Request::build(
            &get,
            "https://api.test",
            &args(r#"{"order_id": "7", "q": "a&b=c", "all": true, "f": {"x": 1}}"#),
        )
        .unwrap();
        assert_eq!(
            r.uri.to_string(),
            "https://api.test/orders/7?all=true&f=%7B%22x%22%3A1%7D&q=a%26b%3Dc"
        );
        assert!(r.body.is_empty());
        // POST without a path: the URL as given, the arguments as the body (as before).
        let r = Request::build(&HttpSpec::default(), "http://h/x", &args("{}")).unwrap();
        assert_eq!(
            (r.method, r.uri.to_string()),
            (hyper::Method::POST, "http://h/x".into())
        );
        let r = Request::build(&spec(Method::Get, None), "http://h", &args(r#"{"a": 1}"#)).unwrap();
        assert_eq!(r.uri.to_string(), "http://h/?a=1");
    }

    #[test]
    fn a_path_argument_that_is_not_one_segment_is_refused() {
        let s = spec(Method::Delete, Some("/orders/{id}"));
        for (a, why) in [
            (r#"{}"#, "needs the argument \"id\""),
            (r#"{"id": ""}"#, "one path segment"),
            (r#"{"id": "."}"#, "one path segment"),
            (r#"{"id": ".."}"#, "one path segment"),
            (r#"{"id": "../admin"}"#, "one path segment"),
            (r#"{"id": "a/b"}"#, "one path segment"),
            (r#"{"id": null}"#, "a string or a number"),
            (r#"{"id": ["x"]}"#, "a string or a number"),
            (r#"["x"]"#, "not a JSON object"),
            ("not json", "not a JSON object"),
        ] {
            let e = Request::build(&s, "https://api.test", &args(a)).unwrap_err();
            assert_eq!(e.reason, "INVALID_ARGUMENTS", "{a}");
            assert!(e.message.contains(why), "{a}: {}", e.message);
        }
    }

    #[test]
    fn the_config_refuses_credentials_framing_headers_and_bad_paths() {
        let with_header = |name: &str| HttpSpec {
            headers: [(name.to_string(), "v".to_string())].into(),
            ..HttpSpec::default()
        };
        for name in [
            "Authorization",
            "cookie",
            "Host",
            "Content-Length",
            "Proxy-Authorization",
            "proxy-anything",
            "Connection",
            "Transfer-Encoding",
            "Upgrade",
            "TE",
            "Idempotency-Key",
        ] {
            let e = with_header(name).check("https://a.test").unwrap_err();
            assert!(e.contains(&format!("header {name:?}")), "{name}: {e}");
        }
        assert!(with_header("X-Tenant").check("https://a.test").is_ok());
        assert!(with_header("bad name").check("https://a.test").is_err());
        let mut h = with_header("X-Tenant");
        h.headers.insert("X-Tenant".into(), "a\nb".into());
        assert!(
            h.check("https://a.test")
                .unwrap_err()
                .contains("not a header value")
        );
        for (path, why) in [
            ("orders/{id}", "must start with /"),
            ("/orders/{id", "without its }"),
            ("/orders/id}", "without its {"),
            ("/orders/{}", "not an argument name"),
            ("/orders/{a b}", "not an argument name"),
            ("/orders?x={id}", "may not hold ?"),
            ("/orders/ {id}", "only visible ASCII"),
        ] {
            let e = spec(Method::Get, Some(path))
                .check("https://a.test")
                .unwrap_err();
            assert!(e.contains(why), "{path}: {e}");
        }
        let e = spec(Method::Get, Some("/x"))
            .check("https://a.test/?q=1")
            .unwrap_err();
        assert!(e.contains("query"), "{e}");
    }

    #[test]
    fn a_refusal_reads_as_seed_004s() {
        let r = refused(
            &call(),
            &json!({"verdict": "refused", "reason": "rejected", "message": "no"}),
        );
        let v: Value = serde_json::from_str(&r).unwrap();
        assert_eq!(
            v,
            json!({"status": "REFUSED", "reason": "APPROVAL_DENIED",
                "call": "fetch({\"id\":7})", "message": "no"})
        );
        let r = refused(
            &call(),
            &json!({"verdict": "refused", "reason": "destination"}),
        );
        assert!(r.contains("\"DESTINATION\""), "{r}");
    }
}
