//! The console's way into the gate. An HTTP request's JSON body, query parameters and path ids
//! become a typed v1 request (`estop_protocol::Fields`: the same types, bounds and errors as a
//! line), which the one dispatcher (`estop_server::dispatch::route`) serves as it serves
//! protocol v1's: the same role check, rules, core messages and errors, answered only once
//! durable. What is HTTP's alone: which verbs it carries and which query values are numbers.

use estop_kernel::Principal;
use estop_protocol::{ErrorCode, Fields, Op, Verb};
use estop_server::conn::Shared;
use estop_server::core::Answer;
use estop_server::dispatch::{self, Route};
use serde_json::{Map, Value};
use std::collections::HashMap;
use std::sync::Arc;

fn err(code: ErrorCode, msg: impl Into<String>) -> Answer {
    Answer::Error(code, msg.into())
}

/// Query parameters read as numbers when they are one; every other value stays a string
/// (`?run=123` names run "123").
const NUMERIC_QUERY: &[&str] = &["limit", "after"];

/// The verbs the HTTP API carries: operator verbs and reads. The others are about a
/// connection or an agent's own effects.
fn carried(verb: Verb) -> bool {
    !matches!(
        verb,
        Verb::Hello
            | Verb::Ping
            | Verb::Admit
            | Verb::Start
            | Verb::Complete
            | Verb::Wait
            | Verb::Subscribe
            | Verb::Unsubscribe
            | Verb::Compensations
            | Verb::Compensated
    )
}

fn not_carried(verb: Verb) -> Answer {
    err(
        ErrorCode::UnknownOp,
        format!(
            "{} is an agent verb of protocol v1; the HTTP API carries operator verbs and reads",
            verb.as_str()
        ),
    )
}

/// The typed request for `verb`: the JSON body's fields, then the query parameters, then the
/// ids from the path, each replacing a field of the same name given before it.
pub fn request(
    verb: Verb,
    path: &[(&str, String)],
    query: &HashMap<String, String>,
    body: &[u8],
) -> Result<Op, Answer> {
    if !carried(verb) {
        return Err(not_carried(verb));
    }
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        Map::new()
    } else {
        match serde_json::from_slice::<Value>(body) {
            Ok(Value::Object(m)) => m,
            Ok(_) => return Err(err(ErrorCode::BadJson, "the body must be a JSON object")),
            Err(e) => return Err(err(ErrorCode::BadJson, format!("the body: {e}"))),
        }
    };
    let mut fields = Fields::new();
    for (k, v) in &body {
        fields.json(k, v);
    }
    for (k, v) in query {
        let number = NUMERIC_QUERY
            .contains(&k.as_str())
            .then(|| v.parse::<u64>().ok())
            .flatten();
        match number {
            Some(n) => fields.number(k, n),
            None => fields.text(k, v),
        }
    }
    for (k, v) in path {
        fields.text(k, v);
    }
    match fields.build(verb) {
        Ok(req) => Ok(req.op),
        Err(e) => Err(err(e.code(), e.to_string())),
    }
}

/// Runs `op` as `principal` and waits for its answer (once durable).
pub async fn run(shared: &Arc<Shared>, principal: &Principal, op: Op) -> Answer {
    match dispatch::route(shared, Some(principal), op) {
        Route::Answer(answer) => answer,
        Route::Core(ask) => dispatch::ask(shared, |to| ask.message(to)).await,
        Route::Work(work) => work.run(shared).await,
        Route::Conn(c) => not_carried(c.verb()),
    }
}
