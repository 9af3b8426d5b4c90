//! The console's way into the gate: the same core messages protocol v1 sends, parsed by the same
//! request parser, answered only once durable. An HTTP request is turned into a v1 request
//! object (`{"op": …, fields}`), parsed by `estop_protocol::parse_request`, and dispatched here,
//! so both front doors have one set of rules, limits and errors.

use estop_kernel::{Command, Principal};
use estop_protocol::{CloseOutcome, ErrorCode, Op};
use estop_server::conn::{Shared, ledger_entries};
use estop_server::core::{Answer, CoreMsg, Query};
use estop_server::tokenops;
pub use estop_server::tokenops::ask;
use serde_json::Value;
use std::sync::Arc;

fn err(code: ErrorCode, msg: impl Into<String>) -> Answer {
    Answer::Error(code, msg.into())
}

/// Parses a v1 request object (the HTTP layer built it) and runs it as `principal`.
pub async fn run(shared: &Arc<Shared>, principal: &Principal, request: Value) -> Answer {
    let line = serde_json::to_vec(&request).expect("a JSON value serializes");
    let req = match estop_protocol::parse_request(&line) {
        Ok(r) => r,
        Err(e) => return err(e.code(), e.to_string()),
    };
    let verb = req.op.verb();
    if !verb.allowed_for(principal.role) {
        return estop_server::conn::forbidden(verb, principal);
    }
    let p = principal.clone();
    let apply = |cmd: Command| {
        let p = p.clone();
        async move {
            ask(shared, |to| CoreMsg::Apply {
                principal: p,
                cmd,
                to,
            })
            .await
        }
    };
    let query = |query: Query| {
        let p = p.clone();
        async move {
            ask(shared, |to| CoreMsg::Query {
                principal: p,
                query,
                to,
            })
            .await
        }
    };
    match req.op {
        Op::Status { run } => query(Query::Status { run }).await,
        // Listings in pages, bounded as over v1 (`ConnOptions::page`).
        Op::Report { run, limit, cursor } => {
            let page = shared.opts.page(limit);
            query(Query::Report { run, cursor, page }).await
        }
        Op::Runs {
            state,
            limit,
            cursor,
        } => {
            let page = shared.opts.page(limit);
            query(Query::Runs {
                state,
                cursor,
                page,
            })
            .await
        }
        Op::Pending { run, limit, cursor } => {
            let page = shared.opts.page(limit);
            query(Query::Pending { run, cursor, page }).await
        }
        Op::Cancel {
            run,
            reason,
            cascade,
        } => {
            if !cascade {
                return err(
                    ErrorCode::InvalidField,
                    "cascade=false is not supported: a cancel always fences the run's descendants (G4)",
                );
            }
            apply(Command::Cancel {
                run,
                reason: reason.map(String::into_boxed_str),
                kill: false,
            })
            .await
        }
        Op::Kill { run, reason } => {
            apply(Command::Cancel {
                run,
                reason: reason.map(String::into_boxed_str),
                kill: true,
            })
            .await
        }
        Op::Decide {
            run,
            key,
            decision,
            reason,
        } => {
            apply(Command::Decide {
                run,
                key,
                decision,
                reason: reason.map(String::into_boxed_str),
            })
            .await
        }
        Op::Pause { run } => apply(Command::Pause { run }).await,
        Op::Resume { run } => apply(Command::Resume { run }).await,
        Op::Close { run, outcome } => {
            apply(Command::Close {
                run,
                failed: outcome == CloseOutcome::Failed,
            })
            .await
        }
        Op::Ledger { run, limit, after } => {
            let dir = shared.ledger_dir.clone();
            let durable = shared.durable_rx.borrow().seq;
            let page = shared.opts.page(limit);
            let res = tokio::task::spawn_blocking(move || {
                ledger_entries(&dir, run.as_ref(), after.unwrap_or(0), durable, page)
            })
            .await;
            match res {
                Ok(Ok(reply)) => Answer::Ledger(reply),
                Ok(Err(e)) => err(ErrorCode::Unavailable, e),
                Err(e) => err(ErrorCode::Internal, e.to_string()),
            }
        }
        Op::Token { name, role, groups } => {
            tokenops::create(shared, principal, name, role, groups).await
        }
        Op::TokenRevoke { name } => tokenops::revoke(shared, principal, name).await,
        Op::Hello { .. }
        | Op::Ping
        | Op::Admit(_)
        | Op::Start { .. }
        | Op::Complete(_)
        | Op::Wait { .. }
        | Op::Subscribe { .. }
        | Op::Unsubscribe { .. } => err(
            ErrorCode::UnknownOp,
            format!(
                "{} is an agent verb of protocol v1; the HTTP API carries operator verbs and reads",
                verb.as_str()
            ),
        ),
    }
}
