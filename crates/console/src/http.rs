//! The HTTP surface: routes, authentication (bearer token or session cookie + CSRF token),
//! the mapping from HTTP requests to v1 request objects and from answers to JSON responses,
//! and security headers. Every route is documented in docs/HTTP.md and docs/openapi.yaml.

use crate::auth::{self, Auth};
use crate::{events, gate, metrics, ui};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use estop_kernel::{Principal, Role};
use estop_protocol::ErrorCode;
use estop_server::conn::Shared;
use estop_server::core::Answer;
use estop_server::service::ServiceContext;
use serde_json::{Map, Value, json};
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::Semaphore;

/// What every handler shares.
pub struct App {
    pub shared: Arc<Shared>,
    pub ctx: ServiceContext,
    pub auth: Auth,
    /// Open server-sent-event streams.
    pub streams: Arc<Semaphore>,
    pub streams_max: usize,
    /// Open console connections.
    pub conns: Arc<Semaphore>,
    pub conns_max: usize,
    /// `http://host:port` the console is reached at (for login links).
    pub base_url: String,
    /// Name of the session cookie (per port: browsers share cookies across ports).
    pub cookie: String,
}

pub type AppState = Arc<App>;

/// Who is calling, and how.
#[derive(Debug, Clone)]
pub struct Caller {
    pub principal: Principal,
    /// The session's secret when authenticated by cookie.
    pub session: Option<String>,
}

/// An error response with the v1 error shape: `{"error": {"code", "message"}}`.
pub fn error(code: ErrorCode, message: impl Into<String>) -> Response {
    let status = match code {
        ErrorCode::BadJson
        | ErrorCode::MissingField
        | ErrorCode::InvalidField
        | ErrorCode::ArgsRequired => StatusCode::BAD_REQUEST,
        ErrorCode::LineTooLong => StatusCode::PAYLOAD_TOO_LARGE,
        ErrorCode::UnknownOp | ErrorCode::NotFound => StatusCode::NOT_FOUND,
        ErrorCode::Unauthenticated => StatusCode::UNAUTHORIZED,
        ErrorCode::Forbidden => StatusCode::FORBIDDEN,
        ErrorCode::NotPending | ErrorCode::Conflict | ErrorCode::BadToken => StatusCode::CONFLICT,
        ErrorCode::LimitExceeded => StatusCode::TOO_MANY_REQUESTS,
        ErrorCode::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        ErrorCode::Internal => StatusCode::INTERNAL_SERVER_ERROR,
    };
    let body = json!({"error": {"code": code.as_str(), "message": message.into()}});
    (status, axum::Json(body)).into_response()
}

/// An error before any response exists (small, unlike `Response`); becomes one at the edge.
#[derive(Debug)]
pub struct Refusal(pub ErrorCode, pub String);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        error(self.0, self.1)
    }
}

fn refuse(code: ErrorCode, message: impl Into<String>) -> Refusal {
    Refusal(code, message.into())
}

fn ok(v: Value) -> Response {
    (StatusCode::OK, axum::Json(v)).into_response()
}

/// An answer of the core as an HTTP response: the v1 payload fields as a JSON object, written
/// straight to bytes (a listing's arguments are copied as they are, never parsed into a tree).
pub fn answer(a: Answer) -> Response {
    let body = match a {
        Answer::Verdict(v) => serde_json::to_vec(&v),
        Answer::Ack(x) => serde_json::to_vec(&x),
        Answer::Decided(x) => serde_json::to_vec(&x),
        Answer::Run(x) => serde_json::to_vec(&x),
        Answer::Runs(x) => serde_json::to_vec(&x),
        Answer::Pending(x) => serde_json::to_vec(&x),
        Answer::Report(x) => serde_json::to_vec(&x),
        Answer::Ledger(x) => serde_json::to_vec(&x),
        Answer::Hello(x) => serde_json::to_vec(&x),
        Answer::TokenCreated(x) => serde_json::to_vec(&x),
        Answer::Pong => serde_json::to_vec(&json!({"pong": true})),
        Answer::Error(code, msg) => return error(code, msg),
    };
    match body {
        Ok(body) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response(),
        Err(e) => error(ErrorCode::Internal, e.to_string()),
    }
}

fn header_str(h: &HeaderMap, name: header::HeaderName) -> Option<&str> {
    h.get(name).and_then(|v| v.to_str().ok())
}

/// Authenticates a request: `Authorization: Bearer <token>`, or the session cookie. For a
/// state-changing request by cookie, the `X-CSRF-Token` header must carry the session's CSRF
/// token and an `Origin` header, if sent, must be this console's.
pub fn caller(app: &App, method: &Method, h: &HeaderMap) -> Result<Caller, Refusal> {
    if let Some(v) = header_str(h, header::AUTHORIZATION) {
        let token = v
            .strip_prefix("Bearer ")
            .or_else(|| v.strip_prefix("bearer "))
            .unwrap_or("");
        return match app.shared.tokens.authenticate(token) {
            Some(principal) => Ok(Caller {
                principal,
                session: None,
            }),
            None => Err(refuse(
                ErrorCode::Unauthenticated,
                "unknown token in Authorization: use `Bearer <contents of DATA/operator.token>` or a token made by `estop token create`",
            )),
        };
    }
    let Some(id) = header_str(h, header::COOKIE).and_then(|c| auth::cookie(c, &app.cookie)) else {
        return Err(refuse(
            ErrorCode::Unauthenticated,
            "log in: open the link `estop serve` printed, or send Authorization: Bearer <token>",
        ));
    };
    let Some(session) = app.auth.session(id) else {
        return Err(refuse(
            ErrorCode::Unauthenticated,
            "the session expired or ended: log in again",
        ));
    };
    if !(method == Method::GET || method == Method::HEAD) {
        if let Some(origin) = header_str(h, header::ORIGIN)
            && !same_origin(origin, header_str(h, header::HOST))
        {
            return Err(refuse(
                ErrorCode::Forbidden,
                "cross-origin request refused (Origin does not match this console)",
            ));
        }
        let csrf = header_str(h, "x-csrf-token".parse().expect("valid name")).unwrap_or("");
        if !auth::same(csrf, &session.csrf) {
            return Err(refuse(
                ErrorCode::Forbidden,
                "missing or wrong X-CSRF-Token (the console sends the one GET /api/v1/session returns)",
            ));
        }
    }
    Ok(Caller {
        principal: session.principal,
        session: Some(id.to_string()),
    })
}

fn same_origin(origin: &str, host: Option<&str>) -> bool {
    let Some(host) = host else { return false };
    origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"))
        .is_some_and(|o| o == host)
}

/// Builds the v1 request object: query parameters and JSON body fields, then the verb and the
/// ids from the path (which win). Numeric query values become numbers, as v1 expects.
fn request(
    op: &str,
    path: &[(&str, String)],
    query: &HashMap<String, String>,
    body: &Bytes,
) -> Result<Value, Refusal> {
    let mut obj = if body.iter().all(u8::is_ascii_whitespace) {
        Map::new()
    } else {
        match serde_json::from_slice::<Value>(body) {
            Ok(Value::Object(m)) => m,
            Ok(_) => return Err(refuse(ErrorCode::BadJson, "the body must be a JSON object")),
            Err(e) => return Err(refuse(ErrorCode::BadJson, format!("the body: {e}"))),
        }
    };
    for (k, v) in query {
        // A listing's cursor is an opaque string, whatever it looks like.
        let value = match v.parse::<u64>() {
            Ok(n) if k != "cursor" => json!(n),
            _ => json!(v),
        };
        obj.insert(k.clone(), value);
    }
    obj.insert("op".into(), json!(op));
    for (k, v) in path {
        obj.insert((*k).into(), json!(v));
    }
    Ok(Value::Object(obj))
}

async fn verb(
    app: &AppState,
    method: Method,
    headers: &HeaderMap,
    op: &str,
    path: &[(&str, String)],
    query: &HashMap<String, String>,
    body: &Bytes,
) -> Response {
    let c = match caller(app, &method, headers) {
        Ok(c) => c,
        Err(r) => return r.into_response(),
    };
    if method != Method::GET && c.principal.role != Role::Operator {
        return error(
            ErrorCode::Forbidden,
            format!(
                "{op} needs an operator token; over HTTP an agent token may only read its own runs"
            ),
        );
    }
    let req = match request(op, path, query, body) {
        Ok(r) => r,
        Err(r) => return r.into_response(),
    };
    answer(gate::run(&app.shared, &c.principal, req).await).into_response()
}

type Q = Query<HashMap<String, String>>;

async fn runs(State(app): State<AppState>, h: HeaderMap, Query(q): Q) -> Response {
    verb(&app, Method::GET, &h, "runs", &[], &q, &Bytes::new()).await
}

async fn status(
    State(app): State<AppState>,
    h: HeaderMap,
    Path(run): Path<String>,
    Query(q): Q,
) -> Response {
    verb(
        &app,
        Method::GET,
        &h,
        "status",
        &[("run", run)],
        &q,
        &Bytes::new(),
    )
    .await
}

async fn report(
    State(app): State<AppState>,
    h: HeaderMap,
    Path(run): Path<String>,
    Query(q): Q,
) -> Response {
    verb(
        &app,
        Method::GET,
        &h,
        "report",
        &[("run", run)],
        &q,
        &Bytes::new(),
    )
    .await
}

async fn run_ledger(
    State(app): State<AppState>,
    h: HeaderMap,
    Path(run): Path<String>,
    Query(q): Q,
) -> Response {
    verb(
        &app,
        Method::GET,
        &h,
        "ledger",
        &[("run", run)],
        &q,
        &Bytes::new(),
    )
    .await
}

async fn ledger(State(app): State<AppState>, h: HeaderMap, Query(q): Q) -> Response {
    verb(&app, Method::GET, &h, "ledger", &[], &q, &Bytes::new()).await
}

async fn pending(State(app): State<AppState>, h: HeaderMap, Query(q): Q) -> Response {
    verb(&app, Method::GET, &h, "pending", &[], &q, &Bytes::new()).await
}

async fn run_action(
    State(app): State<AppState>,
    h: HeaderMap,
    Path((run, action)): Path<(String, String)>,
    Query(q): Q,
    body: Bytes,
) -> Response {
    let op = match action.as_str() {
        "cancel" | "kill" | "pause" | "resume" | "close" => action.as_str(),
        _ => {
            return error(
                ErrorCode::UnknownOp,
                format!("no run action {action:?}: use cancel, kill, pause, resume or close"),
            );
        }
    };
    verb(&app, Method::POST, &h, op, &[("run", run)], &q, &body).await
}

async fn effect_action(
    State(app): State<AppState>,
    h: HeaderMap,
    Path((run, key, action)): Path<(String, String, String)>,
    Query(q): Q,
    body: Bytes,
) -> Response {
    let mut path = vec![("run", run), ("key", key)];
    match action.as_str() {
        "decide" => {}
        "approve" | "reject" => path.push(("decision", action.clone())),
        _ => {
            return error(
                ErrorCode::UnknownOp,
                format!("no effect action {action:?}: use decide, approve or reject"),
            );
        }
    }
    verb(&app, Method::POST, &h, "decide", &path, &q, &body).await
}

async fn tokens(State(app): State<AppState>, h: HeaderMap, Query(q): Q, body: Bytes) -> Response {
    verb(&app, Method::POST, &h, "token", &[], &q, &body).await
}

fn session_json(p: &Principal, csrf: Option<&str>, expires_at: Option<u64>) -> Value {
    json!({
        "principal": p.name.as_str(),
        "role": p.role.as_str(),
        "groups": p.groups.iter().map(|g| &**g).collect::<Vec<_>>(),
        "csrf": csrf,
        "expires_at": expires_at,
    })
}

fn session_cookie(app: &App, id: &str, max_age_s: u64) -> HeaderValue {
    HeaderValue::from_str(&format!(
        "{}={id}; HttpOnly; SameSite=Strict; Path=/; Max-Age={max_age_s}",
        app.cookie
    ))
    .expect("a cookie of hex and ascii")
}

/// `GET /api/v1/session`: who am I (and, for a browser session, its CSRF token).
async fn whoami(State(app): State<AppState>, h: HeaderMap) -> Response {
    match caller(&app, &Method::GET, &h) {
        Ok(c) => {
            let s = c.session.as_deref().and_then(|id| app.auth.session(id));
            ok(session_json(
                &c.principal,
                s.as_ref().map(|s| s.csrf.as_str()),
                s.as_ref().map(|s| s.expires_at),
            ))
        }
        Err(r) => r.into_response(),
    }
}

/// `POST /api/v1/session {token}`: log in by pasting a token (the fallback when the one-time
/// link is used up). JSON only, same origin only.
async fn login_with_token(State(app): State<AppState>, h: HeaderMap, body: Bytes) -> Response {
    if let Some(origin) = header_str(&h, header::ORIGIN)
        && !same_origin(origin, header_str(&h, header::HOST))
    {
        return error(ErrorCode::Forbidden, "cross-origin login refused");
    }
    if !header_str(&h, header::CONTENT_TYPE).is_some_and(|c| c.starts_with("application/json")) {
        return error(
            ErrorCode::BadJson,
            "send {\"token\": …} as application/json",
        );
    }
    let token = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v.get("token").and_then(Value::as_str).map(str::to_string));
    let Some(token) = token else {
        return error(ErrorCode::MissingField, "token");
    };
    let Some(principal) = app.shared.tokens.authenticate(&token) else {
        return error(ErrorCode::Unauthenticated, "unknown token");
    };
    let (id, s) = app.auth.start(principal);
    estop_server::log::info(&format!(
        "console: {} logged in with a token",
        s.principal.name
    ));
    let mut r = ok(session_json(
        &s.principal,
        Some(&s.csrf),
        Some(s.expires_at),
    ));
    r.headers_mut().insert(
        header::SET_COOKIE,
        session_cookie(&app, &id, app.auth.session_ttl.as_secs()),
    );
    r
}

/// `DELETE /api/v1/session`: log out.
async fn logout(State(app): State<AppState>, h: HeaderMap) -> Response {
    let c = match caller(&app, &Method::DELETE, &h) {
        Ok(c) => c,
        Err(r) => return r.into_response(),
    };
    if let Some(id) = &c.session {
        app.auth.end(id);
    }
    let mut r = ok(json!({}));
    r.headers_mut()
        .insert(header::SET_COOKIE, session_cookie(&app, "", 0));
    r
}

/// `POST /api/v1/login-links`: a fresh one-time login link for the caller (operators).
async fn new_login_link(State(app): State<AppState>, h: HeaderMap) -> Response {
    let c = match caller(&app, &Method::POST, &h) {
        Ok(c) => c,
        Err(r) => return r.into_response(),
    };
    if c.principal.role != Role::Operator {
        return error(ErrorCode::Forbidden, "login links are for operators");
    }
    let (code, expires_at) = app.auth.login_link(c.principal);
    ok(json!({"url": format!("{}/login?code={code}", app.base_url), "expires_at": expires_at}))
}

/// `GET /login?code=…`: redeems a one-time link, sets the session cookie, goes to the console.
async fn login_link(State(app): State<AppState>, Query(q): Q) -> Response {
    let page = |title: &str, body: &str| {
        format!(
            "<!doctype html><html lang=en><meta charset=utf-8><meta name=viewport content='width=device-width,initial-scale=1'><meta http-equiv=refresh content='0;url=/'><title>{title}</title><link rel=icon href=/favicon.svg><link rel=stylesheet href=/app.css><main class=narrow><h1>{title}</h1><p>{body}</p><p><a href=/>Open the console</a></p></main></html>"
        )
    };
    let Some(principal) = q.get("code").and_then(|c| app.auth.redeem(c)) else {
        let mut r = axum::response::Html(page(
            "This login link was used or has expired",
            "Each link works once, for a short time. Log in with a token instead, or ask for a new link (POST /api/v1/login-links).",
        ))
        .into_response();
        *r.status_mut() = StatusCode::UNAUTHORIZED;
        return r;
    };
    let (id, s) = app.auth.start(principal);
    estop_server::log::info(&format!(
        "console: {} logged in with a one-time link",
        s.principal.name
    ));
    let mut r = axum::response::Html(page("Logged in", "Opening the console…")).into_response();
    r.headers_mut().insert(
        header::SET_COOKIE,
        session_cookie(&app, &id, app.auth.session_ttl.as_secs()),
    );
    r
}

async fn metrics_route(State(app): State<AppState>, h: HeaderMap) -> Response {
    let c = match caller(&app, &Method::GET, &h) {
        Ok(c) => c,
        Err(r) => return r.into_response(),
    };
    if c.principal.role != Role::Operator {
        return error(ErrorCode::Forbidden, "metrics need an operator token");
    }
    metrics::render(&app).await
}

async fn events_route(State(app): State<AppState>, h: HeaderMap, Query(q): Q) -> Response {
    match caller(&app, &Method::GET, &h) {
        Ok(c) => events::stream(app, c, q.get("run").cloned()).await,
        Err(r) => r.into_response(),
    }
}

async fn not_found() -> Response {
    error(ErrorCode::NotFound, "no such route (see docs/HTTP.md)")
}

/// Security headers on every response; `no-store` on everything but the static assets.
async fn headers(req: Request, next: Next) -> Response {
    let asset = matches!(
        req.uri().path(),
        "/app.js" | "/app.css" | "/favicon.svg" | "/favicon.ico"
    );
    let mut r = next.run(req).await;
    let h = r.headers_mut();
    let set = |h: &mut HeaderMap, k: &'static str, v: &'static str| {
        h.insert(
            header::HeaderName::from_static(k),
            HeaderValue::from_static(v),
        );
    };
    set(h, "x-content-type-options", "nosniff");
    set(h, "referrer-policy", "no-referrer");
    set(h, "x-frame-options", "DENY");
    set(
        h,
        "content-security-policy",
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    );
    if !asset {
        set(h, "cache-control", "no-store");
    }
    r
}

pub fn router(app: AppState) -> Router {
    let body_max = app.shared.opts.line_bytes_max;
    Router::new()
        .route("/", get(ui::index))
        .route("/app.js", get(ui::script))
        .route("/app.css", get(ui::style))
        .route("/favicon.svg", get(ui::favicon))
        .route("/favicon.ico", get(ui::favicon))
        .route("/login", get(login_link))
        .route("/metrics", get(metrics_route))
        .route("/api/v1/openapi.yaml", get(ui::openapi))
        .route(
            "/api/v1/session",
            get(whoami).post(login_with_token).delete(logout),
        )
        .route("/api/v1/login-links", post(new_login_link))
        .route("/api/v1/runs", get(runs))
        .route("/api/v1/runs/{run}", get(status))
        .route("/api/v1/runs/{run}/report", get(report))
        .route("/api/v1/runs/{run}/ledger", get(run_ledger))
        .route("/api/v1/runs/{run}/{action}", post(run_action))
        .route(
            "/api/v1/runs/{run}/effects/{key}/{action}",
            post(effect_action),
        )
        .route("/api/v1/pending", get(pending))
        .route("/api/v1/ledger", get(ledger))
        .route("/api/v1/tokens", post(tokens))
        .route("/api/v1/events", get(events_route))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(body_max))
        .layer(middleware::from_fn(headers))
        .with_state(app)
}
