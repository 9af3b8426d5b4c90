//! What a reader outside the runner sees of trajectories (the console's `/api/v1/trajectories`,
//! `estop agent list`): read from the journal read-only (`journal::read_only`), bounded, in
//! pages by id. Every text in a view (task, exit reason, answer, control messages) is the
//! agent's or the model's: a reader shows it as text, never as markup.

use crate::budget::Stage;
use crate::chat::Role;
use crate::journal::{JournalError, Recovered, read_only};
use crate::record::{Control, Exit, Phase, Record};
use serde::Serialize;
use serde_json::{Value, json};
use std::path::Path;

/// Bounds of one read. Every limit has its unit last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ViewLimits {
    /// Journal bytes (snapshot and segments) one read may take (default 64 MiB).
    pub bytes_max: u64,
    /// Trajectories one page may hold (default 200).
    pub page_max: usize,
    /// Characters of a text field (task, answer, a control message) shown (default 4,096).
    pub text_chars_max: usize,
}

impl Default for ViewLimits {
    fn default() -> Self {
        ViewLimits {
            bytes_max: 64 << 20,
            page_max: 200,
            text_chars_max: 4_096,
        }
    }
}

/// Which trajectories a page lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Which {
    #[default]
    All,
    /// Not ended (FINALIZING included).
    Live,
    Ended,
}

impl Which {
    pub fn parse(s: &str) -> Option<Which> {
        match s {
            "all" => Some(Which::All),
            "live" => Some(Which::Live),
            "ended" => Some(Which::Ended),
            _ => None,
        }
    }
}

/// One page: trajectories with ids after `after`, in id order, at most `limit`.
#[derive(Debug, Clone, Serialize)]
pub struct Page {
    pub trajectories: Vec<Value>,
    /// The `after` of the next page, when there is one.
    pub next: Option<String>,
}

fn cut(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &s[..at]),
        None => s.to_string(),
    }
}

fn exit_json(e: &Exit) -> Value {
    let (kind, reason) = match e {
        Exit::Completed { check_passed } => (
            "COMPLETED",
            if *check_passed {
                String::new()
            } else {
                "the completion check failed".into()
            },
        ),
        Exit::CompletionCheckFailed { failed } => ("COMPLETION_CHECK_FAILED", failed.join(", ")),
        Exit::Canceled { reason } => ("CANCELED", reason.clone()),
        Exit::Killed { reason } => ("KILLED", reason.clone()),
        Exit::BudgetExceeded { dimension } => ("BUDGET_EXCEEDED", dimension.as_str().to_string()),
        Exit::Error { error } => ("ERROR", error.clone()),
    };
    json!({"exit": kind, "reason": reason})
}

/// A trajectory as JSON: identity, state, exit, turns, the budget vector (spent and limit per
/// dimension, the stage), the stored control requests, pending work (calls in flight with
/// their phase, held calls with their expiry), the task contract and the completion check's
/// result, the leases held, and with `answer` its last model message.
pub fn trajectory(
    r: &Record,
    ctx: Option<&[crate::chat::Message]>,
    now_ms: u64,
    lim: &ViewLimits,
) -> Value {
    let t = |s: &str| cut(s, lim.text_chars_max);
    let b = &r.budget;
    let at = r.ended_at_ms.unwrap_or(now_ms);
    let dims = [
        ("turns", b.spend.turns, b.limits.turns_max),
        ("tokens", b.spend.tokens(), b.limits.tokens_max),
        ("wall_clock_ms", b.wall_ms(at), b.limits.wall_ms_max),
        ("usd_micros", b.spend.usd_micros, b.limits.usd_micros_max),
    ];
    let (stage, binding, permille) = match b.stage(at) {
        Stage::Normal => ("normal", None, b.rho(at).map(|(_, p)| p)),
        Stage::Steer { binding, permille } => ("steer", Some(binding), Some(permille)),
        Stage::Restrict { binding, permille } => ("restrict", Some(binding), Some(permille)),
        Stage::Stop { binding } => ("stop", Some(binding), Some(1000)),
    };
    let control: Vec<Value> = r
        .control
        .iter()
        .map(|c| match c {
            Control::Cancel { reason } => json!({"control": "cancel", "reason": t(reason)}),
            Control::Interrupt { message } => {
                json!({"control": "interrupt", "message": t(message)})
            }
            Control::Pause => json!({"control": "pause"}),
            Control::Resume => json!({"control": "resume"}),
            Control::Kill { reason } => json!({"control": "kill", "reason": t(reason)}),
            Control::Budget { limits } => json!({"control": "budget", "limits": limits}),
        })
        .collect();
    let pending: Vec<Value> = r
        .pending
        .iter()
        .map(|p| {
            let (phase, deadline) = match &p.phase {
                Phase::Proposed => ("proposed", None),
                Phase::Admitted { .. } => ("admitted", None),
                Phase::Dispatched { deadline_ms, .. } => ("dispatched", Some(*deadline_ms)),
            };
            json!({"call": t(&p.call.id), "tool": t(&p.call.function.name), "phase": phase,
                   "deadline_ms": deadline})
        })
        .collect();
    let held: Vec<Value> = r
        .held
        .iter()
        .map(|h| {
            // An HTTP tool's held request: what the approval is for.
            let request = h.request.as_ref().map(|q| {
                json!({"run": t(&q.run), "key": t(&q.key), "tool": t(&q.tool), "url": t(&q.url)})
            });
            json!({"call": t(&h.call.id), "tool": t(&h.call.function.name),
                   "expires_at_ms": h.expires_at_ms, "approval": h.approval,
                   "quorum": h.quorum, "approvers": h.approvers, "request": request})
        })
        .collect();
    let mut v = json!({
        "id": r.identity.id,
        "parent": r.identity.parent,
        "retry_of": r.identity.retry_of,
        "tenant": r.identity.tenant,
        "class": r.class.as_str(),
        "task": t(&r.identity.task),
        "state": r.state.as_str(),
        "live": !r.state.is_terminal(),
        "exit": r.exit.as_ref().map(exit_json),
        "turns": r.turns,
        "model": r.limits.model,
        "started_at_ms": b.started_at_ms,
        "ended_at_ms": r.ended_at_ms,
        "budget": {
            "dimensions": dims.iter().map(|(d, spent, limit)| json!({"dimension": d, "spent": spent, "limit": limit})).collect::<Vec<_>>(),
            "stage": stage,
            "binding": binding.map(|d| d.as_str()),
            "permille": permille,
            "reserved": b.reserved.is_some(),
        },
        "control": control,
        "pending": pending,
        "held": held,
        "context_len": r.pointers.context_len,
        // The task contract (bounded when it was loaded) and the completion check's result.
        "contract": r.identity.contract,
        "check": r.check.as_ref().map(|c| json!({
            "passed": c.passed,
            "checked": c.checked,
            "failed": c.failed.iter().map(|f| json!({"check": f.check, "why": t(&f.why)})).collect::<Vec<_>>(),
            "notices": c.notices,
        })),
        // Leases held: the workspace, credential handles (a tool and a destination, never a
        // secret).
        "leases": r.leases.iter().map(|l| json!({"kind": l.kind, "id": t(&l.id), "tool": l.tool})).collect::<Vec<_>>(),
    });
    if let Some(ctx) = ctx {
        let answer = ctx
            .iter()
            .rev()
            .find(|m| m.role == Role::Assistant && m.content.is_some())
            .and_then(|m| m.content.as_deref());
        v["answer"] = json!(answer.map(t));
    }
    v
}

/// Sub-agents listed per trajectory at most (a parent starts at most `[subagents]
/// children_max` of them; more in a journal are counted, not listed).
pub const CHILDREN_SHOWN_MAX: usize = 64;

/// The sub-agents trajectory `id` started (`ID/CALL_ID`, whose parent is `id`), in id order,
/// each with its state, exit, turns and spend against its ceilings; and how many there are.
pub fn children(
    records: &std::collections::BTreeMap<String, Record>,
    id: &str,
    now_ms: u64,
) -> (Vec<Value>, usize) {
    let prefix = format!("{id}/");
    let mut shown = Vec::new();
    let mut count = 0;
    for (_, r) in records
        .range(prefix.clone()..)
        .take_while(|(k, _)| k.starts_with(&prefix))
        .filter(|(_, r)| {
            r.identity.parent.as_deref() == Some(id) && r.identity.spawned_by.is_some()
        })
    {
        count += 1;
        if shown.len() == CHILDREN_SHOWN_MAX {
            continue;
        }
        let b = &r.budget;
        let at = r.ended_at_ms.unwrap_or(now_ms);
        shown.push(json!({
            "id": r.identity.id,
            "state": r.state.as_str(),
            "exit": r.exit.as_ref().map(exit_json),
            "turns": b.spend.turns,
            "tokens": b.spend.tokens(),
            "usd_micros": b.spend.usd_micros,
            "wall_clock_ms": b.wall_ms(at),
            "limits": b.limits,
        }));
    }
    (shown, count)
}

/// A page of the trajectories in `state`.
pub fn page(
    state: &Recovered,
    which: Which,
    after: Option<&str>,
    limit: usize,
    now_ms: u64,
    lim: &ViewLimits,
) -> Page {
    let limit = limit.clamp(1, lim.page_max);
    let mut out = Vec::new();
    let mut next = None;
    let from = match after {
        Some(a) => std::ops::Bound::Excluded(a.to_string()),
        None => std::ops::Bound::Unbounded,
    };
    for r in state
        .records
        .range((from, std::ops::Bound::Unbounded))
        .map(|(_, r)| r)
    {
        let keep = match which {
            Which::All => true,
            Which::Live => !r.state.is_terminal(),
            Which::Ended => r.state.is_terminal(),
        };
        if !keep {
            continue;
        }
        if out.len() == limit {
            next = out
                .last()
                .and_then(|v: &Value| v["id"].as_str().map(String::from));
            break;
        }
        out.push(trajectory(r, None, now_ms, lim));
    }
    Page {
        trajectories: out,
        next,
    }
}

/// Reads the journal in `dir` (read-only, `lim.bytes_max`) and gives one page.
pub fn list(
    dir: &Path,
    which: Which,
    after: Option<&str>,
    limit: usize,
    now_ms: u64,
    lim: &ViewLimits,
) -> Result<Page, JournalError> {
    let state = read_only(dir, lim.bytes_max)?;
    Ok(page(&state, which, after, limit, now_ms, lim))
}

/// Reads the journal in `dir` and gives trajectory `id` with its answer, if the journal has it.
pub fn one(
    dir: &Path,
    id: &str,
    now_ms: u64,
    lim: &ViewLimits,
) -> Result<Option<Value>, JournalError> {
    let state = read_only(dir, lim.bytes_max)?;
    Ok(state.records.get(id).map(|r| {
        let mut v = trajectory(
            r,
            Some(state.contexts.get(id).map_or(&[], Vec::as_slice)),
            now_ms,
            lim,
        );
        let (shown, count) = children(&state.records, id, now_ms);
        v["children"] = json!(shown);
        v["children_count"] = json!(count);
        v
    }))
}
