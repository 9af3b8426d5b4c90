//! The HTTP surface: routes, authentication (bearer token, or a session secret in a header +
//! CSRF token + proof of the console's own origin), the mapping from routes to v1 verbs (the
//! typed request and its dispatch are `api`'s) and from answers to JSON responses, and
//! security headers. Every route is
//! documented in docs/HTTP.md and docs/openapi.yaml.

use crate::app::{AppState, Refusal, caller, error, header_str, ok, own_page, refuse, serve};
use crate::quota::Full;
use crate::{events, metrics, trajectories, ui};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use estop_kernel::{Principal, Role};
use estop_protocol::{ErrorCode, Verb};
use serde_json::{Value, json};
use std::collections::HashMap;

type Q = Query<HashMap<String, String>>;

async fn runs(State(app): State<AppState>, h: HeaderMap, Query(q): Q) -> Response {
    serve(&app, Method::GET, &h, Verb::Runs, &[], &q, &Bytes::new()).await
}

async fn status(
    State(app): State<AppState>,
    h: HeaderMap,
    Path(run): Path<String>,
    Query(q): Q,
) -> Response {
    serve(
        &app,
        Method::GET,
        &h,
        Verb::Status,
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
    serve(
        &app,
        Method::GET,
        &h,
        Verb::Report,
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
    serve(
        &app,
        Method::GET,
        &h,
        Verb::Ledger,
        &[("run", run)],
        &q,
        &Bytes::new(),
    )
    .await
}

async fn ledger(State(app): State<AppState>, h: HeaderMap, Query(q): Q) -> Response {
    serve(&app, Method::GET, &h, Verb::Ledger, &[], &q, &Bytes::new()).await
}

async fn pending(State(app): State<AppState>, h: HeaderMap, Query(q): Q) -> Response {
    serve(&app, Method::GET, &h, Verb::Pending, &[], &q, &Bytes::new()).await
}

async fn run_action(
    State(app): State<AppState>,
    h: HeaderMap,
    Path((run, action)): Path<(String, String)>,
    Query(q): Q,
    body: Bytes,
) -> Response {
    let verb = match action.as_str() {
        "cancel" => Verb::Cancel,
        "kill" => Verb::Kill,
        "pause" => Verb::Pause,
        "resume" => Verb::Resume,
        "close" => Verb::Close,
        _ => {
            return error(
                ErrorCode::UnknownOp,
                format!("no run action {action:?}: use cancel, kill, pause, resume or close"),
            );
        }
    };
    serve(&app, Method::POST, &h, verb, &[("run", run)], &q, &body).await
}

async fn effect_action(
    State(app): State<AppState>,
    h: HeaderMap,
    Path((run, key, action)): Path<(String, String, String)>,
    Query(q): Q,
    body: Bytes,
) -> Response {
    let mut path = vec![("run", run), ("key", key)];
    let verb = match action.as_str() {
        "decide" => Verb::Decide,
        "approve" | "reject" => {
            path.push(("decision", action.clone()));
            Verb::Decide
        }
        // The reverse saga's operator actions (v1 `saga`).
        "settle" | "retry" | "skip" | "compensate" => {
            path.push(("action", action.clone()));
            Verb::Saga
        }
        _ => {
            return error(
                ErrorCode::UnknownOp,
                format!(
                    "no effect action {action:?}: use decide, approve, reject, settle, retry, skip or \
                     compensate"
                ),
            );
        }
    };
    serve(&app, Method::POST, &h, verb, &path, &q, &body).await
}

async fn tokens(State(app): State<AppState>, h: HeaderMap, Query(q): Q, body: Bytes) -> Response {
    serve(&app, Method::POST, &h, Verb::Token, &[], &q, &body).await
}

/// `DELETE /api/v1/tokens/{name}`: revokes a token at once (v1 `token_revoke`).
async fn revoke_token(
    State(app): State<AppState>,
    h: HeaderMap,
    Path(name): Path<String>,
    Query(q): Q,
) -> Response {
    let path = [("name", name)];
    serve(
        &app,
        Method::DELETE,
        &h,
        Verb::TokenRevoke,
        &path,
        &q,
        &Bytes::new(),
    )
    .await
}

fn session_json(p: &Principal, expires_at: Option<u64>) -> Value {
    json!({
        "principal": p.name.as_str(),
        "role": p.role.as_str(),
        "groups": p.groups.iter().map(|g| &**g).collect::<Vec<_>>(),
        "expires_at": expires_at,
    })
}

/// `GET /api/v1/session`: who am I. It returns no secret (the page got the session's secret
/// and CSRF token from its login and keeps them).
async fn whoami(State(app): State<AppState>, h: HeaderMap) -> Response {
    match caller(&app, &Method::GET, &h).await {
        Ok(c) => {
            let s = c.session.as_deref().and_then(|id| app.auth.session(id));
            ok(session_json(&c.principal, s.as_ref().map(|s| s.expires_at)))
        }
        Err(r) => r.into_response(),
    }
}

fn session_full(p: &Principal, full: Full) -> Refusal {
    let what = match full {
        Full::Principal(n) | Full::Token(n) => format!("{n} console sessions for {}", p.name),
        Full::Others(n) => {
            format!("{n} console sessions held by agents (the rest are kept for operators)")
        }
        Full::Total(n) => format!("console sessions = {n}"),
    };
    refuse(
        ErrorCode::LimitExceeded,
        format!(
            "limit reached: {what}; log out of a session (DELETE /api/v1/session) or wait for one to expire"
        ),
    )
}

/// `POST /api/v1/session {code} | {token}`: the console's page logs in, with a one-time login
/// code (from the link) or a pasted token. Only from the console's own page, JSON only. The
/// answer carries the session's secret and CSRF token: the page keeps them in sessionStorage.
async fn login(State(app): State<AppState>, h: HeaderMap, body: Bytes) -> Response {
    if let Err(r) = own_page(&h) {
        return r.into_response();
    }
    if !header_str(&h, header::CONTENT_TYPE).is_some_and(|c| c.starts_with("application/json")) {
        return error(
            ErrorCode::BadJson,
            "send {\"code\": …} or {\"token\": …} as application/json",
        );
    }
    let v = serde_json::from_slice::<Value>(&body).unwrap_or(Value::Null);
    let field = |k: &str| v.get(k).and_then(Value::as_str);
    let (principal, how) = match (field("code"), field("token")) {
        (Some(code), None) => match app.auth.redeem(code) {
            Some(p) => (p, "a one-time link"),
            None => {
                return error(
                    ErrorCode::Unauthenticated,
                    "this login link was used or has expired: log in with a token, or ask for a new link (POST /api/v1/login-links)",
                );
            }
        },
        (None, Some(token)) => match app.shared.tokens.authenticate_async(token).await {
            Ok(Some(p)) => (p, "a token"),
            Err(e) => return error(ErrorCode::Unavailable, e.to_string()),
            Ok(None) => return error(ErrorCode::Unauthenticated, "unknown token"),
        },
        _ => return error(ErrorCode::MissingField, "send one of code or token"),
    };
    let (id, s) = match app.auth.start(principal.clone()) {
        Ok(x) => x,
        Err(full) => return session_full(&principal, full).into_response(),
    };
    estop_server::log::info(&format!(
        "console: {} logged in with {how}",
        s.principal.name
    ));
    let mut v = session_json(&s.principal, Some(s.expires_at));
    v["session"] = json!(id);
    v["csrf"] = json!(s.csrf);
    ok(v)
}

/// `DELETE /api/v1/session`: log out.
async fn logout(State(app): State<AppState>, h: HeaderMap) -> Response {
    let c = match caller(&app, &Method::DELETE, &h).await {
        Ok(c) => c,
        Err(r) => return r.into_response(),
    };
    if let Some(id) = &c.session {
        app.auth.end(id);
    }
    ok(json!({}))
}

/// `POST /api/v1/login-links`: a fresh one-time login link for the caller (operators). The
/// code is in the fragment: the browser never sends it in a request line (no proxy log holds
/// it); the page's script posts it to `POST /api/v1/session`.
async fn new_login_link(State(app): State<AppState>, h: HeaderMap) -> Response {
    let c = match caller(&app, &Method::POST, &h).await {
        Ok(c) => c,
        Err(r) => return r.into_response(),
    };
    if c.principal.role != Role::Operator {
        return error(ErrorCode::Forbidden, "login links are for operators");
    }
    let (code, expires_at) = app.auth.login_link(c.principal);
    ok(json!({"url": format!("{}/login#code={code}", app.base_url), "expires_at": expires_at}))
}

async fn metrics_route(State(app): State<AppState>, h: HeaderMap) -> Response {
    let c = match caller(&app, &Method::GET, &h).await {
        Ok(c) => c,
        Err(r) => return r.into_response(),
    };
    // Prometheus needs a credential that reads, not one that can approve.
    if c.principal.role == Role::Agent {
        return error(
            ErrorCode::Forbidden,
            "metrics need an observer or operator token (`estop token create NAME --role observer`)",
        );
    }
    metrics::render(&app).await
}

async fn events_route(State(app): State<AppState>, h: HeaderMap, Query(q): Q) -> Response {
    match caller(&app, &Method::GET, &h).await {
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
    set(h, "cross-origin-resource-policy", "same-origin");
    set(h, "cross-origin-opener-policy", "same-origin");
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
        .route("/login", get(ui::index))
        .route("/metrics", get(metrics_route))
        .route("/api/v1/openapi.yaml", get(ui::openapi))
        .route("/api/v1/session", get(whoami).post(login).delete(logout))
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
        .route("/api/v1/trajectories", get(trajectories::list))
        .route("/api/v1/trajectories/{id}", get(trajectories::one))
        .route(
            "/api/v1/trajectories/{id}/{action}",
            post(trajectories::act),
        )
        .route("/api/v1/ledger", get(ledger))
        .route("/api/v1/tokens", post(tokens))
        .route("/api/v1/tokens/{name}", axum::routing::delete(revoke_token))
        .route("/api/v1/events", get(events_route))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(body_max))
        .layer(middleware::from_fn(headers))
        .with_state(app)
}
