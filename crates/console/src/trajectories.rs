//! `GET /api/v1/trajectories` and `/api/v1/trajectories/{id}`: the harness's trajectories
//! (`estop agent run`), read from its journal in `DATA/harness/journal` without its lock and
//! without changing it (`estop_harness::view`), beside a runner that appends and compacts. Not
//! the gate's state: the daemon only reads what the runner journalled. For operators and
//! observers (like every run); an agent token is refused, since a trajectory's task and answer
//! are another agent's text. Bounded: journal bytes per read, trajectories per page, text per
//! field, and reads at once (the others are refused `limit_exceeded`, never queued).

use crate::http::{AppState, caller, error};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use estop_harness::journal::JournalError;
use estop_harness::view::{self, ViewLimits, Which};
use estop_kernel::Role;
use estop_protocol::ErrorCode;
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::Semaphore;

/// Journal reads in flight at once (each up to `ViewLimits::bytes_max`).
pub const READS_MAX: usize = 2;

/// The reads in flight.
pub fn reads() -> Arc<Semaphore> {
    Arc::new(Semaphore::new(READS_MAX))
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
