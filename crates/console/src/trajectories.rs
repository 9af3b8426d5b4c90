//! `GET /api/v1/trajectories` and `/api/v1/trajectories/{id}`: the harness's trajectories
//! (`estop agent run`), read from its journal in `DATA/harness/journal` without its lock and
//! without changing it (`estop_harness::view`), beside a runner that appends and compacts. Not
//! the gate's state: the daemon only reads what the runner journalled. For operators and
//! observers (like every run); an agent token is refused, since a trajectory's task and answer
//! are another agent's text. Bounded: journal bytes per read, trajectories per page, text per
//! field, and reads at once (the others are refused `limit_exceeded`, never queued).
//!
//! `POST /api/v1/trajectories/{id}/{action}`: an operator acts on a trajectory. Cancel, pause,
//! resume and kill are the gate's verbs on the trajectory's run (whose id is the trajectory's),
//! served exactly as the runs page's are (`http::serve`: the same session, CSRF and origin
//! checks, the same operator rule). An interrupt and a budget change go to the runner's
//! control socket, `DATA/harness/control.sock` (`estop_harness::control`), which authenticates
//! every request with the daemon: the daemon sends no token of anyone's, but a grant
//! (`Tokens::grant`), a fresh secret that speaks for the acting operator for at most
//! `ASK_MS` and is ended as soon as the runner answers. Bounded: the request line (the
//! socket's 64 KiB), asks at once (the others `limit_exceeded`), and the wait for an answer.

use crate::app::{AppState, Refusal, caller, error};
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use estop_harness::budget::Limits;
use estop_harness::control::{self, Ask, AskError};
use estop_harness::journal::JournalError;
use estop_harness::view::{self, ViewLimits, Which};
use estop_kernel::Role;
use estop_protocol::{ErrorCode, Verb};
use serde::Deserialize;
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::Semaphore;

/// Journal reads in flight at once (each up to `ViewLimits::bytes_max`).
pub const READS_MAX: usize = 2;

/// The reads in flight.
pub fn reads() -> Arc<Semaphore> {
    Arc::new(Semaphore::new(READS_MAX))
}

/// Requests to the runner's control socket in flight at once.
pub const ASKS_MAX: usize = 4;
/// How long an ask to the runner may take, connecting to its answer (also its grant's life).
pub const ASK_MS: u64 = 15_000;

/// The asks in flight.
pub fn asks() -> Arc<Semaphore> {
    Arc::new(Semaphore::new(ASKS_MAX))
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Runs `read` on the journal as a caller that may read trajectories.
async fn read<T: Send + 'static>(
    app: &AppState,
    h: &HeaderMap,
    read: impl FnOnce(&std::path::Path, &ViewLimits) -> Result<T, JournalError> + Send + 'static,
) -> Result<T, Response> {
    let c = caller(app, &Method::GET, h)
        .await
        .map_err(IntoResponse::into_response)?;
    // Who may, not who may not: a role added later reads nothing here until it is listed.
    if !matches!(c.principal.role, Role::Operator | Role::Observer) {
        return Err(error(
            ErrorCode::Forbidden,
            "trajectories need an operator or observer token: an agent token reads only its own runs",
        ));
    }
    let Ok(permit) = Arc::clone(&app.trajectory_reads).try_acquire_owned() else {
        return Err(error(
            ErrorCode::LimitExceeded,
            format!("limit reached: {READS_MAX} trajectory reads at once; try again shortly"),
        ));
    };
    let dir = app.ctx.data.join("harness").join("journal");
    let done = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        read(&dir, &ViewLimits::default())
    })
    .await;
    match done {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e @ JournalError::TooLarge { .. })) => Err(error(
            ErrorCode::Unavailable,
            format!("{e}: the runner compacts it as it grows (docs/HARNESS.md, \"Durability\")"),
        )),
        Ok(Err(e)) => Err(error(
            ErrorCode::Unavailable,
            format!("the harness journal: {e}"),
        )),
        Err(e) => Err(error(ErrorCode::Internal, e.to_string())),
    }
}

/// `GET /api/v1/trajectories?state=all|live|ended&after=ID&limit=N`: a page in id order.
pub async fn list(
    State(app): State<AppState>,
    h: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let which = match q.get("state").map(String::as_str) {
        None => Which::All,
        Some(s) => match Which::parse(s) {
            Some(w) => w,
            None => {
                return error(
                    ErrorCode::InvalidField,
                    format!("state {s:?}: use all, live or ended"),
                );
            }
        },
    };
    let limit = match q.get("limit").map(|l| l.parse::<usize>()) {
        None => 50,
        Some(Ok(n)) if n >= 1 => n,
        Some(_) => return error(ErrorCode::InvalidField, "limit must be a number from 1"),
    };
    let after = q.get("after").cloned();
    let now = now_ms();
    match read(&app, &h, move |dir, lim| {
        view::list(dir, which, after.as_deref(), limit, now, lim)
    })
    .await
    {
        Ok(page) => (StatusCode::OK, axum::Json(page)).into_response(),
        Err(r) => r,
    }
}

/// `GET /api/v1/trajectories/{id}`: one trajectory, with its answer (its last model message).
pub async fn one(State(app): State<AppState>, h: HeaderMap, Path(id): Path<String>) -> Response {
    let now = now_ms();
    let wanted = id.clone();
    match read(&app, &h, move |dir, lim| view::one(dir, &wanted, now, lim)).await {
        Ok(Some(v)) => (StatusCode::OK, axum::Json(v)).into_response(),
        Ok(None) => error(
            ErrorCode::NotFound,
            format!("no trajectory {id:?} in the harness journal (DATA/harness/journal)"),
        ),
        Err(r) => r,
    }
}

/// The body of an interrupt: the new user message.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct InterruptBody {
    message: String,
}

/// The body of a budget change: new ceilings for the dimensions given (the others stay).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BudgetBody {
    turns: Option<u64>,
    tokens: Option<u64>,
    wall_ms: Option<u64>,
    usd_micros: Option<u64>,
}

/// The runner's ask a request's body makes, or why not (nothing is sent then).
fn parse_ask(action: &str, body: &[u8]) -> Result<Ask, Refusal> {
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        body
    };
    let bad = |e: serde_json::Error| Refusal(ErrorCode::BadJson, format!("the body: {e}"));
    match action {
        "interrupt" => {
            let b: InterruptBody = serde_json::from_slice(body).map_err(bad)?;
            if b.message.trim().is_empty() {
                return Err(Refusal(
                    ErrorCode::InvalidField,
                    "an interrupt needs a non-empty message".into(),
                ));
            }
            Ok(Ask::Interrupt { message: b.message })
        }
        _ => {
            let b: BudgetBody = serde_json::from_slice(body).map_err(bad)?;
            let change = Limits {
                turns_max: b.turns,
                tokens_max: b.tokens,
                wall_ms_max: b.wall_ms,
                usd_micros_max: b.usd_micros,
            };
            if change == Limits::default() {
                return Err(Refusal(
                    ErrorCode::InvalidField,
                    "a budget change needs at least one of turns, tokens, wall_ms, usd_micros"
                        .into(),
                ));
            }
            Ok(Ask::Budget { change })
        }
    }
}

/// Ends a grant when the ask is over, however it ends.
struct GrantGuard<'a> {
    tokens: &'a estop_server::tokens::Tokens,
    secret: String,
}

impl Drop for GrantGuard<'_> {
    fn drop(&mut self) {
        self.tokens.end_grant(&self.secret);
    }
}

/// The HTTP error for a refusal of the runner's control socket.
fn refused(r: control::Refusal) -> Response {
    let code = match r.code.as_str() {
        "bad_request" => ErrorCode::InvalidField,
        "forbidden" => ErrorCode::Forbidden,
        "unknown_trajectory" => ErrorCode::NotFound,
        "ended" | "refused" => ErrorCode::Conflict,
        "busy" => ErrorCode::LimitExceeded,
        // `unauthenticated`: the runner could not have the daemon vouch for the grant (it
        // talks to another daemon, or none).
        _ => ErrorCode::Unavailable,
    };
    error(code, format!("the runner refused: {r}"))
}

/// `POST /api/v1/trajectories/{id}/{cancel|pause|resume|kill|interrupt|budget}`.
pub async fn act(
    State(app): State<AppState>,
    h: HeaderMap,
    Path((id, action)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
    body: Bytes,
) -> Response {
    let verb = match action.as_str() {
        "cancel" => Some(Verb::Cancel),
        "pause" => Some(Verb::Pause),
        "resume" => Some(Verb::Resume),
        "kill" => Some(Verb::Kill),
        "interrupt" | "budget" => None,
        _ => {
            return error(
                ErrorCode::UnknownOp,
                format!(
                    "no trajectory action {action:?}: use cancel, pause, resume, kill, interrupt or budget"
                ),
            );
        }
    };
    if let Some(verb) = verb {
        // The trajectory's run at the gate: exactly the runs page's action.
        return crate::app::serve(&app, Method::POST, &h, verb, &[("run", id)], &q, &body).await;
    }
    let c = match caller(&app, &Method::POST, &h).await {
        Ok(c) => c,
        Err(r) => return r.into_response(),
    };
    // Who may, not who may not: only an operator changes what a trajectory does or may spend.
    if c.principal.role != Role::Operator {
        return error(
            ErrorCode::Forbidden,
            format!(
                "a trajectory's {action} needs an operator token; an observer only reads, an agent token reads no trajectory"
            ),
        );
    }
    let ask = match parse_ask(&action, &body) {
        Ok(a) => a,
        Err(r) => return r.into_response(),
    };
    let mut req = control::Request {
        token: String::new(),
        trajectory: id,
        ask,
    };
    // The line the socket takes: the grant (`estop_gr_` and 64 hex digits) in place of the
    // empty token, and the newline.
    const GRANT_BYTES: usize = "estop_gr_".len() + 64;
    let line_bytes = serde_json::to_vec(&req).map_or(usize::MAX, |l| l.len()) + GRANT_BYTES + 1;
    if line_bytes > control::LINE_BYTES_MAX {
        return error(
            ErrorCode::LineTooLong,
            format!(
                "the request to the runner would be {line_bytes} bytes; its control socket takes at most {} (shorten the message)",
                control::LINE_BYTES_MAX
            ),
        );
    }
    let Ok(_permit) = Arc::clone(&app.control_asks).try_acquire_owned() else {
        return error(
            ErrorCode::LimitExceeded,
            format!("limit reached: {ASKS_MAX} requests to the runner at once; try again shortly"),
        );
    };
    let within = std::time::Duration::from_millis(ASK_MS);
    let tokens = &app.shared.tokens;
    let secret = match tokens.grant(&c.principal, within) {
        Ok(s) => s,
        Err(e @ estop_server::tokens::TokenError::GrantsFull) => {
            return error(ErrorCode::LimitExceeded, e.to_string());
        }
        Err(e) => {
            return error(
                ErrorCode::Forbidden,
                format!("no grant for the caller: {e}"),
            );
        }
    };
    let _grant = GrantGuard {
        tokens,
        secret: secret.clone(),
    };
    req.token = secret;
    let dir = app.ctx.data.join("harness");
    match control::ask_within(&dir, &req, within).await {
        Ok(v) => {
            estop_server::log::info(&format!(
                "console: {} asked trajectory {:?} to {action}",
                c.principal.name, req.trajectory
            ));
            (StatusCode::OK, axum::Json(v)).into_response()
        }
        Err(AskError::Refused(r)) => refused(r),
        Err(AskError::NoRunner { source, .. })
            if source.kind() == std::io::ErrorKind::PermissionDenied =>
        {
            error(
                ErrorCode::Unavailable,
                "cannot connect to DATA/harness/control.sock: permission denied (the socket is its runner's user's only: run the daemon as that user)",
            )
        }
        Err(AskError::NoRunner { .. }) => error(
            ErrorCode::Unavailable,
            "no runner is listening on DATA/harness/control.sock: the trajectory's `estop agent run --data DATA` is not running (one given --journal elsewhere is not reachable from the console); the gate's cancel, pause, resume and kill still work",
        ),
        Err(e) => error(ErrorCode::Unavailable, format!("the runner: {e}")),
    }
}
