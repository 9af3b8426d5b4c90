//! What every route shares: the console's state (`App`), who is calling (`Caller`, from a bearer
//! token or a session with its CSRF token and the console's own origin), refusals and answers as
//! JSON responses, and `serve`, a v1 verb asked over HTTP (the typed request and its dispatch are
//! `api`'s). The routes themselves are `http`'s.

use crate::api;
use crate::auth::{self, Auth};
use crate::listen::Conns;
use crate::quota::Counted;
use axum::body::Bytes;
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use estop_kernel::{Principal, Role};
use estop_protocol::{ErrorCode, Verb};
use estop_server::conn::Shared;
use estop_server::core::Answer;
use estop_server::service::ServiceContext;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::Arc;

/// What every handler shares.
pub struct App {
    pub shared: Arc<Shared>,
    pub ctx: ServiceContext,
    pub auth: Auth,
    /// Open server-sent-event streams, per principal.
    pub streams: Arc<Counted>,
    /// Open console connections.
    pub conns: Arc<Conns>,
    /// `http://host:port` the console is reached at (for login links).
    pub base_url: String,
    /// Reads of the harness journal in flight (the `trajectories` routes).
    pub trajectory_reads: Arc<tokio::sync::Semaphore>,
    /// Requests to the runner's control socket in flight (the `trajectories` routes).
    pub control_asks: Arc<tokio::sync::Semaphore>,
}

pub type AppState = Arc<App>;

/// Who is calling, and how.
#[derive(Debug, Clone)]
pub struct Caller {
    pub principal: Principal,
    /// The session's secret when authenticated by a browser session.
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

pub(crate) fn refuse(code: ErrorCode, message: impl Into<String>) -> Refusal {
    Refusal(code, message.into())
}

pub(crate) fn ok(v: Value) -> Response {
    (StatusCode::OK, axum::Json(v)).into_response()
}

/// An answer of the core as an HTTP response: the v1 payload fields as a JSON object, written
/// straight to bytes (a listing's arguments are copied as they are, never parsed into a tree).
pub fn answer(a: Answer) -> Response {
    let body = match a {
        Answer::Verdict(v) => serde_json::to_vec(&v),
        Answer::Ack(x) => serde_json::to_vec(&x),
        Answer::Subscribed(x) => serde_json::to_vec(&x),
        Answer::Decided(x) => serde_json::to_vec(&x),
        Answer::Run(x) => serde_json::to_vec(&x),
        Answer::Runs(x) => serde_json::to_vec(&x),
        Answer::Pending(x) => serde_json::to_vec(&x),
        Answer::Report(x) => serde_json::to_vec(&x),
        Answer::Ledger(x) => serde_json::to_vec(&x),
        Answer::Hello(x) => serde_json::to_vec(&x),
        Answer::TokenCreated(x) => serde_json::to_vec(&x),
        Answer::TokenRevoked(x) => serde_json::to_vec(&x),
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

pub(crate) fn header_str(h: &HeaderMap, name: header::HeaderName) -> Option<&str> {
    h.get(name).and_then(|v| v.to_str().ok())
}

/// Where a request says it comes from, by the headers a browser sets and a page cannot forge.
#[derive(Debug, PartialEq, Eq)]
enum Site {
    /// `Origin` is this console's, or `Sec-Fetch-Site: same-origin` (and nothing says otherwise).
    Own,
    /// A foreign `Origin`, or `Sec-Fetch-Site` other than `same-origin` (`same-site` is another
    /// port of the same host).
    Elsewhere,
    /// Neither header (curl, or a browser that sends neither).
    Unknown,
}

fn site(h: &HeaderMap) -> Site {
    let fetch = header_str(h, header::HeaderName::from_static("sec-fetch-site"));
    let origin = header_str(h, header::ORIGIN);
    let host = header_str(h, header::HOST);
    if fetch.is_some_and(|s| s != "same-origin") || origin.is_some_and(|o| !same_origin(o, host)) {
        Site::Elsewhere
    } else if fetch.is_some() || origin.is_some() {
        Site::Own
    } else {
        Site::Unknown
    }
}

/// Refuses a browser-session request (or a login) that does not prove it comes from the
/// console's own page.
pub(crate) fn own_page(h: &HeaderMap) -> Result<(), Refusal> {
    match site(h) {
        Site::Own => Ok(()),
        Site::Elsewhere => Err(refuse(
            ErrorCode::Forbidden,
            "cross-origin request refused: only the console's own page may use a session or log in",
        )),
        Site::Unknown => Err(refuse(
            ErrorCode::Forbidden,
            "refused: a session or login request must come from the console's page (an Origin equal to this console, or Sec-Fetch-Site: same-origin; open the console on loopback or over HTTPS); scripts send Authorization: Bearer <token>",
        )),
    }
}

async fn bearer(app: &App, v: &str) -> Result<Caller, Refusal> {
    let token = v
        .strip_prefix("Bearer ")
        .or_else(|| v.strip_prefix("bearer "))
        .unwrap_or("");
    match app.shared.tokens.authenticate_async(token).await {
        // An executor's token runs the reverse saga over the protocol socket and reads
        // nothing: no verb, metric or event stream here is its.
        Ok(Some(principal)) if principal.role == Role::Executor => Err(refuse(
            ErrorCode::Forbidden,
            "an executor token runs compensations and lookups over the protocol socket only",
        )),
        Ok(Some(principal)) => Ok(Caller {
            principal,
            session: None,
        }),
        Err(e) => Err(refuse(ErrorCode::Unavailable, e.to_string())),
        Ok(None) => Err(refuse(
            ErrorCode::Unauthenticated,
            "unknown token in Authorization: use `Bearer <contents of DATA/operator.token>` or a token made by `estop token create`",
        )),
    }
}

/// Authenticates a request: `Authorization: Bearer <token>` (scripts), or a browser session:
/// its secret in `X-Estop-Session`, from the console's own page (`own_page`), and for a
/// state-changing request its CSRF token in `X-CSRF-Token`. No cookie is ever a credential: a
/// cookie reaches every port of the host.
pub async fn caller(app: &App, method: &Method, h: &HeaderMap) -> Result<Caller, Refusal> {
    if let Some(v) = header_str(h, header::AUTHORIZATION) {
        return bearer(app, v).await;
    }
    let Some(id) = header_str(h, header::HeaderName::from_static(auth::SESSION_HEADER)) else {
        return Err(refuse(
            ErrorCode::Unauthenticated,
            "log in: open the link `estop serve` made (DATA/console-login), or send Authorization: Bearer <token>",
        ));
    };
    own_page(h)?;
    let Some(session) = app.auth.session(id) else {
        return Err(refuse(
            ErrorCode::Unauthenticated,
            "the session expired or ended: log in again",
        ));
    };
    if !(method == Method::GET || method == Method::HEAD) {
        let csrf = header_str(h, header::HeaderName::from_static(auth::CSRF_HEADER)).unwrap_or("");
        if !auth::same(csrf, &session.csrf) {
            return Err(refuse(
                ErrorCode::Forbidden,
                "missing or wrong X-CSRF-Token (the console's page sends the one its login returned)",
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

/// Serves one v1 verb over HTTP: the caller, HTTP's own rule that only operators change state,
/// then the typed request (`api`).
pub async fn serve(
    app: &AppState,
    method: Method,
    headers: &HeaderMap,
    verb: Verb,
    path: &[(&str, String)],
    query: &HashMap<String, String>,
    body: &Bytes,
) -> Response {
    let c = match caller(app, &method, headers).await {
        Ok(c) => c,
        Err(r) => return r.into_response(),
    };
    if method != Method::GET && c.principal.role != Role::Operator {
        return error(
            ErrorCode::Forbidden,
            format!(
                "{verb} needs an operator token; over HTTP an agent token may only read its own runs, an observer token only read"
            ),
        );
    }
    match api::request(verb, path, query, body) {
        Ok(op) => answer(api::run(&app.shared, &c.principal, op).await),
        Err(refusal) => answer(refusal),
    }
}
