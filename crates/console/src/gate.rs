//! The console's way into the gate: the same core messages protocol v1 sends, parsed by the same
//! request parser, answered only once durable. An HTTP request is turned into a v1 request
//! object (`{"op": …, fields}`), parsed by `estop_protocol::parse_request`, and dispatched here,
//! so both front doors have one set of rules, limits and errors.

use estop_kernel::{Command, Principal, Role};
use estop_protocol::reply as wire;
use estop_protocol::{CloseOutcome, ErrorCode, Id, Op};
use estop_server::conn::{Shared, ledger_entries};
use estop_server::core::{Answer, CoreMsg, Out, Query, ReplyTo};
use estop_server::durable::{self, Durability};
use serde_json::Value;
use std::sync::Arc;

fn err(code: ErrorCode, msg: impl Into<String>) -> Answer {
    Answer::Error(code, msg.into())
}

/// Sends one message to the core and waits for its answer, then for the ledger position it
/// depends on to be durable (G6), exactly as a v1 connection's writer does.
pub async fn ask(shared: &Shared, msg: impl FnOnce(ReplyTo) -> CoreMsg) -> Answer {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let to = ReplyTo {
        out: tx.into(),
        id: Id::default(),
        charge: None,
    };
    if shared.core_tx.send(msg(to)).is_err() {
        return err(ErrorCode::Unavailable, "the gate is shutting down");
    }
    loop {
        match rx.recv().await {
            Some(Out::Answer { answer, after, .. }) => {
                let mut durable_rx = shared.durable_rx.clone();
                return match durable::wait(&mut durable_rx, after).await {
                    Durability::Durable => answer,
                    Durability::Lost => err(
                        ErrorCode::Unavailable,
                        "the change could not be made durable (ledger failure); it was not applied — retry",
                    ),
                };
            }
            // Events are not asked for here; rendered bytes go only to a socket's writer.
            Some(Out::Event { .. } | Out::Rendered(_)) => {}
            None => return err(ErrorCode::Unavailable, "the gate is shutting down"),
        }
    }
}

/// Parses a v1 request object (the HTTP layer built it) and runs it as `principal`.
pub async fn run(shared: &Arc<Shared>, principal: &Principal, request: Value) -> Answer {
    let line = serde_json::to_vec(&request).expect("a JSON value serializes");
    let req = match estop_protocol::parse_request(&line) {
        Ok(r) => r,
        Err(e) => return err(e.code(), e.to_string()),
    };
    let verb = req.op.verb();
    if verb.is_operator_only() && principal.role != Role::Operator {
        return err(
            ErrorCode::Forbidden,
            format!(
                "{} needs an operator token; {} is an agent",
                verb.as_str(),
                principal.name
            ),
        );
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
            let tokens = Arc::clone(&shared.tokens);
            let res = tokio::task::spawn_blocking(move || {
                tokens
                    .create(name.as_str(), role, &groups)
                    .map(|s| (name, role, groups, s))
            })
            .await;
            use estop_server::tokens::TokenError;
            match res {
                Ok(Ok((name, role, groups, secret))) => {
                    estop_server::log::info(&format!(
                        "token created over the console API: {name} ({})",
                        role.as_str()
                    ));
                    Answer::TokenCreated(wire::TokenCreated {
                        name: name.to_string(),
                        role: role.as_str().into(),
                        token: estop_protocol::Secret::new(secret),
                        groups,
                    })
                }
                Ok(Err(e @ TokenError::Exists(_))) => err(ErrorCode::Conflict, e.to_string()),
                Ok(Err(e @ (TokenError::Reserved(_) | TokenError::Invalid(_)))) => {
                    err(ErrorCode::InvalidField, e.to_string())
                }
                Ok(Err(e @ TokenError::Full)) => err(ErrorCode::LimitExceeded, e.to_string()),
                Ok(Err(e)) => err(ErrorCode::Unavailable, e.to_string()),
                Err(e) => err(ErrorCode::Internal, e.to_string()),
            }
        }
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
