//! Ledger records described for people and scripts (`ledger` verb, `estop ledger show`).

use estop_kernel::{Command, Record, SagaAction, SagaStep, TokenAction};
use estop_protocol::server_line::LedgerEntry;
use serde_json::{Map, Value, json};

pub fn kind(c: &Command) -> &'static str {
    match c {
        Command::Admit(_) => "admit",
        Command::Recheck { .. } => "recheck",
        Command::Start { .. } => "start",
        Command::Complete { .. } => "complete",
        Command::Decide { .. } => "decide",
        Command::Cancel { kill: false, .. } => "cancel",
        Command::Cancel { kill: true, .. } => "kill",
        Command::Pause { .. } => "pause",
        Command::Resume { .. } => "resume",
        Command::Close { .. } => "close",
        Command::Tick { .. } => "tick",
        Command::Compact { .. } => "compact",
        Command::Token(t) => match t.action {
            TokenAction::Create => "token_create",
            TokenAction::Revoke => "token_revoke",
        },
        Command::CompensationBegin { .. } => "compensation_begin",
        Command::CompensationEnd { .. } => "compensation_end",
        Command::Saga { action, .. } => match action {
            SagaAction::Settle { .. } => "saga_settle",
            SagaAction::Retry => "saga_retry",
            SagaAction::Skip { .. } => "saga_skip",
            SagaAction::Compensate => "saga_compensate",
        },
        Command::SagaStep { step, .. } => match step {
            SagaStep::LookupBegin { .. } => "lookup_begin",
            SagaStep::LookupEnd { .. } => "lookup_end",
            SagaStep::Blocked { .. } => "compensation_blocked",
            SagaStep::Unreported { .. } => "unreported",
            SagaStep::Held { .. } => "compensation_held",
            SagaStep::Expired { .. } => "compensation_expired",
        },
    }
}

pub fn entry(seq: u64, rec: &Record) -> LedgerEntry {
    let mut fields = Map::new();
    fields.insert("principal".into(), json!(rec.principal.name.as_str()));
    if rec.principal.part != estop_kernel::Part::Main {
        fields.insert("component".into(), json!(rec.principal.part.as_str()));
    }
    let mut key = None;
    match &rec.command {
        Command::Admit(a) => {
            key = Some(a.key.to_string());
            fields.insert("tool".into(), json!(a.tool.as_str()));
            fields.insert("digest".into(), json!(a.digest.to_hex()));
            fields.insert("action".into(), json!(a.policy.action.as_str()));
            fields.insert("rule".into(), json!(&*a.policy.rule));
            fields.insert("class".into(), json!(a.policy.class.as_str()));
            if !a.start {
                fields.insert("start".into(), json!(false));
            }
            if let Some(p) = &a.parent {
                fields.insert("parent".into(), json!(p.as_str()));
            }
            if let Some(args) = &a.args {
                // Recorded as the gate's compact JSON text: shown as the value it is.
                let value = serde_json::from_str(args).unwrap_or_else(|_| json!(&**args));
                fields.insert("args".into(), value);
            }
        }
        Command::Recheck { key: k, .. } => key = Some(k.to_string()),
        Command::Start { key: k, token, .. } => {
            key = Some(k.to_string());
            fields.insert("token".into(), json!(token.to_string()));
        }
        Command::Complete {
            key: k,
            outcome,
            result,
            error,
            ..
        } => {
            key = Some(k.to_string());
            fields.insert("outcome".into(), json!(outcome.as_str()));
            if let Some(answer) = result.as_deref().and_then(http_answer) {
                fields.extend(answer);
            }
            if let Some(e) = error {
                fields.insert("error".into(), json!(&**e));
            }
        }
        Command::Decide {
            key: k,
            decision,
            reason,
            ..
        } => {
            key = Some(k.to_string());
            fields.insert("decision".into(), json!(decision.as_str()));
            if let Some(r) = reason {
                fields.insert("reason".into(), json!(&**r));
            }
        }
        Command::Cancel { reason, .. } => {
            if let Some(r) = reason {
                fields.insert("reason".into(), json!(&**r));
            }
        }
        Command::Close { failed, .. } => {
            fields.insert(
                "outcome".into(),
                json!(if *failed { "failed" } else { "completed" }),
            );
        }
        Command::Compact {
            before,
            tombstones_before,
        } => {
            fields.insert("before".into(), Value::from(*before));
            fields.insert("tombstones_before".into(), Value::from(*tombstones_before));
        }
        Command::Token(t) => {
            // Who did it is the record's principal; the secret and its hash are never here.
            fields.insert("name".into(), json!(t.name.as_str()));
            fields.insert("role".into(), json!(t.role.as_str()));
            if !t.groups.is_empty() {
                let groups: Vec<&str> = t.groups.iter().map(|g| &**g).collect();
                fields.insert("groups".into(), json!(groups.join(",")));
            }
        }
        Command::CompensationBegin {
            key: k, attempt, ..
        } => {
            key = Some(k.to_string());
            fields.insert("attempt".into(), Value::from(*attempt));
        }
        Command::CompensationEnd {
            key: k,
            attempt,
            outcome,
            error,
            ..
        } => {
            key = Some(k.to_string());
            fields.insert("attempt".into(), Value::from(*attempt));
            fields.insert("outcome".into(), json!(outcome.as_str()));
            if let Some(e) = error {
                fields.insert("error".into(), json!(&**e));
            }
        }
        Command::Saga { key: k, action, .. } => {
            key = Some(k.to_string());
            match action {
                SagaAction::Settle { outcome, result } => {
                    fields.insert("outcome".into(), json!(outcome.as_str()));
                    if let Some(r) = result {
                        fields.insert("result".into(), json!(&**r));
                    }
                }
                SagaAction::Retry | SagaAction::Compensate => {}
                SagaAction::Skip { reason } => {
                    fields.insert("reason".into(), json!(&**reason));
                }
            }
        }
        Command::SagaStep { key: k, step, .. } => {
            key = Some(k.to_string());
            step_fields(step, &mut fields);
        }
        Command::Pause { .. } | Command::Resume { .. } | Command::Tick { .. } => {}
    }
    LedgerEntry {
        seq,
        at: rec.at,
        kind: kind(&rec.command).into(),
        run: rec.command.run().map(ToString::to_string),
        key,
        fields,
    }
}

/// An HTTP response's status and size (`{status, bytes, …}`, the result the egress proxy
/// records): the two fields `ledger show` prints of a completion; none for other results,
/// which are not shown.
fn http_answer(result: &str) -> Option<[(String, Value); 2]> {
    #[derive(serde::Deserialize)]
    struct Answer {
        status: u16,
        bytes: u64,
    }
    let a: Answer = serde_json::from_str(result).ok()?;
    Some([
        ("status".into(), Value::from(a.status)),
        ("bytes".into(), Value::from(a.bytes)),
    ])
}

/// What a shell's step of the saga records: a lookup's attempt and finding, or why a due
/// compensation could not be issued.
fn step_fields(step: &SagaStep, fields: &mut Map<String, Value>) {
    match step {
        SagaStep::LookupBegin { attempt } => {
            fields.insert("attempt".into(), Value::from(*attempt));
        }
        SagaStep::LookupEnd {
            attempt,
            outcome,
            result,
            error,
        } => {
            fields.insert("attempt".into(), Value::from(*attempt));
            fields.insert("outcome".into(), json!(outcome.as_str()));
            if let Some(r) = result {
                fields.insert("result".into(), json!(&**r));
            }
            if let Some(e) = error {
                fields.insert("error".into(), json!(&**e));
            }
        }
        SagaStep::Blocked { attempt, reason } => {
            fields.insert("attempt".into(), Value::from(*attempt));
            fields.insert("reason".into(), json!(&**reason));
        }
        SagaStep::Unreported { after_ms } => {
            fields.insert("after_ms".into(), Value::from(*after_ms));
        }
        SagaStep::Held {
            attempt,
            quorum,
            groups,
            expiry_ms,
            args,
            reason,
        } => {
            fields.insert("attempt".into(), Value::from(*attempt));
            fields.insert("quorum".into(), Value::from(*quorum));
            let groups: Vec<&str> = groups.iter().map(|g| &**g).collect();
            fields.insert("groups".into(), json!(groups));
            fields.insert("expiry_ms".into(), Value::from(*expiry_ms));
            if let Some(a) = args {
                fields.insert("args".into(), json!(&**a));
            }
            fields.insert("reason".into(), json!(&**reason));
        }
        SagaStep::Expired { approval } => {
            fields.insert("approval".into(), Value::from(*approval));
        }
    }
}
