//! Kernel state and replies turned into the protocol's reply payloads, and answers into the
//! SoundGate wire's verdicts: the only place where the vocabularies meet.

use estop_kernel::reply::DecideStatus;
use estop_kernel::report::{self, Section, Undo};
use estop_kernel::state::{Effect, Run, Status, Tombstone};
use estop_kernel::vocab::{EffectStatus, HoldReason, RefusalReason};
use estop_kernel::{EffectKey, RunId, Verdict};
use estop_protocol::page::Weight;
use estop_protocol::server_line as wire;
use estop_protocol::{PageBudget, SgReply};
use std::collections::BTreeMap;
use std::ops::Bound;

pub fn approval_id(run: &RunId, n: u64) -> String {
    format!("{run}#{n}")
}

/// A verdict on effect `key` of `run` as the wire says it; an admission's token sealed with
/// `seal` (`estop_protocol::effect_token`).
pub fn verdict(
    run: &RunId,
    key: &EffectKey,
    seal: &estop_protocol::effect_token::TokenSeal,
    v: &Verdict,
) -> wire::VerdictReply {
    match v {
        Verdict::Admitted { token } => wire::VerdictReply::Admitted {
            token: seal.seal(run, key, *token),
            epoch: u64::from(token.epoch),
        },
        Verdict::Go => wire::VerdictReply::Go,
        Verdict::Held {
            reason,
            approval,
            expires_at,
        } => wire::VerdictReply::Held {
            approval: approval.map(|n| approval_id(run, n)),
            expires_at: *expires_at,
            reason: *reason,
        },
        Verdict::Refused { reason, over } => wire::VerdictReply::Refused {
            reason: *reason,
            message: over.as_ref().map(|o| {
                format!(
                    "the model budget ({}) of run {} cannot cover this call: {} used of {}",
                    o.dimension.as_str(),
                    o.run,
                    o.used,
                    o.limit
                )
            }),
            rule: None,
            budget: over.as_ref().map(|o| wire::BudgetOver {
                dimension: o.dimension.as_str().to_string(),
                run: o.run.to_string(),
                limit: o.limit,
                used: o.used,
            }),
        },
        Verdict::Duplicate {
            status,
            outcome,
            result,
            error,
        } => wire::VerdictReply::Duplicate {
            status: match status {
                EffectStatus::Started | EffectStatus::Admitted => "in_progress".to_string(),
                s => s.as_str().to_string(),
            },
            outcome: outcome.map(|o| o.as_str().to_string()),
            result: result.as_deref().and_then(|r| serde_json::from_str(r).ok()),
            error: error.as_deref().map(str::to_string),
        },
    }
}

pub fn run_view(id: &RunId, run: &Run) -> wire::RunView {
    let mut counts = wire::EffectCounts::default();
    for e in run.effects.values() {
        match e.status {
            Status::Held(_) | Status::Approved => counts.held += 1,
            Status::Admitted => counts.admitted += 1,
            Status::Started => counts.started += 1,
            Status::Completed
            | Status::Compensating
            | Status::Compensated
            | Status::CompensationFailed
            | Status::NeedsHuman
            | Status::CompensationSkipped => counts.completed += 1,
            Status::Failed => counts.failed += 1,
            Status::Unknown => counts.unknown += 1,
            Status::Refused(_) => counts.refused += 1,
        }
    }
    wire::RunView {
        run: id.to_string(),
        state: run.state.as_str().to_string(),
        epoch: u64::from(run.epoch),
        owner: run
            .owner
            .as_ref()
            .map_or_else(|| "-".to_string(), ToString::to_string),
        parent: run.parent.as_ref().map(ToString::to_string),
        labels: run
            .labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<BTreeMap<_, _>>(),
        created_at: run.created_at,
        cause: run.stop.as_ref().map(|s| s.cause.as_str().to_string()),
        reason: run
            .stop
            .as_ref()
            .and_then(|s| s.reason.as_deref().map(str::to_string)),
        stopped_at: run.stop.as_ref().map(|s| s.at),
        deadline_at: run.limits.deadline_at,
        max_effects: run.limits.max_effects,
        effects: counts,
        budget: budget_lines(run),
        forgotten: false,
    }
}

/// The run's model budget as the wire has it (status and report).
fn budget_lines(run: &Run) -> Vec<wire::BudgetLine> {
    report::budget(run)
        .into_iter()
        .map(|b| wire::BudgetLine {
            dimension: b.dimension.as_str().to_string(),
            spent: b.spent,
            reserved: b.reserved,
            limit: b.limit,
        })
        .collect()
}

/// What `subscribe` replays of a run: its state and stop, and the effects awaiting a
/// decision, in key order, as many as `page` holds.
pub fn run_replay(id: &RunId, run: &Run, mut page: PageBudget) -> wire::RunReplay {
    let mut r = wire::RunReplay {
        run: id.to_string(),
        state: run.state.as_str().to_string(),
        epoch: u64::from(run.epoch),
        cause: run.stop.as_ref().map(|s| s.cause.as_str().to_string()),
        reason: run
            .stop
            .as_ref()
            .and_then(|s| s.reason.as_deref().map(str::to_string)),
        ..wire::RunReplay::default()
    };
    for (key, e) in &run.effects {
        let Some(item) = awaiting(id, key, e) else {
            continue;
        };
        if !page.take(item.weight()) {
            r.more = true;
            break;
        }
        r.awaiting.push(item);
    }
    r
}

/// An effect as `subscribe` replays it, if it awaits a decision: held (for an approval, a
/// sibling or a pause), approved and not yet admitted, or its compensating call awaiting
/// approval.
fn awaiting(run: &RunId, key: &EffectKey, e: &Effect) -> Option<wire::Awaiting> {
    let approval = match e.status {
        Status::Held(HoldReason::Approval) | Status::Approved => e.approval.as_ref().map(|a| a.id),
        Status::Held(_) => None,
        _ => Some(estop_kernel::saga::held_approval(e)?.id),
    };
    Some(wire::Awaiting {
        key: key.to_string(),
        status: e.status.kind().as_str().to_string(),
        approval: approval.map(|n| approval_id(run, n)),
    })
}

/// What `subscribe` replays of a forgotten run: how it stopped; nothing awaits any more.
pub fn tombstone_replay(id: &RunId, t: &Tombstone) -> wire::RunReplay {
    wire::RunReplay {
        run: id.to_string(),
        state: t.cause.terminal_state().as_str().to_string(),
        epoch: u64::from(t.epoch),
        cause: Some(t.cause.as_str().to_string()),
        ..wire::RunReplay::default()
    }
}

/// What `status` says of a forgotten run: its fence, and that the rest is gone.
pub fn tombstone_view(id: &RunId, t: &Tombstone) -> wire::RunView {
    wire::RunView {
        run: id.to_string(),
        state: t.cause.terminal_state().as_str().to_string(),
        epoch: u64::from(t.epoch),
        owner: t
            .owner
            .as_ref()
            .map_or_else(|| "-".to_string(), ToString::to_string),
        parent: None,
        labels: BTreeMap::new(),
        created_at: t.created_at,
        cause: Some(t.cause.as_str().to_string()),
        stopped_at: Some(t.stopped_at),
        deadline_at: None,
        max_effects: None,
        effects: wire::EffectCounts::default(),
        budget: Vec::new(),
        forgotten: true,
        // The stop's free text is not kept in a tombstone (its cause is).
        reason: None,
    }
}

/// What `report` says of a forgotten run: how and when it stopped; its effects are gone.
pub fn tombstone_report(id: &RunId, t: &Tombstone) -> wire::Report {
    wire::Report {
        run: id.to_string(),
        state: t.cause.terminal_state().as_str().to_string(),
        cause: Some(t.cause.as_str().to_string()),
        stopped_at: Some(t.stopped_at),
        forgotten: true,
        ..wire::Report::default()
    }
}

/// When the approval an effect awaits expires, if it awaits one: its place in the inbox.
pub fn pending_expiry(e: &Effect) -> Option<u64> {
    if e.status != Status::Held(HoldReason::Approval) {
        return None;
    }
    e.approval.as_ref().map(|a| a.expires_at)
}

/// An effect as the inbox shows it. Its arguments are the text the gate validated at admission,
/// shared with the state (a pointer is copied) and written out as they are by the connection's
/// writer: nothing is parsed here, on the core.
pub fn pending_item(run_id: &RunId, key: &EffectKey, e: &Effect) -> Option<wire::PendingItem> {
    pending_expiry(e)?;
    let a = e.approval.as_ref()?;
    Some(wire::PendingItem {
        approval: approval_id(run_id, a.id),
        run: run_id.to_string(),
        key: key.to_string(),
        tool: e.tool.to_string(),
        args: e.args.clone().map(wire::RawJson::new),
        digest: e.digest.to_hex(),
        rule: Some(e.rule.to_string()),
        quorum: a.quorum,
        approvals: a.approvers.iter().map(|x| x.name.to_string()).collect(),
        groups: a.groups.iter().map(ToString::to_string).collect(),
        expires_at: a.expires_at,
        created_at: a.requested_at,
        compensates: None,
    })
}

/// A compensating call awaiting approval as the inbox shows it: marked as the compensation of
/// the effect it undoes, with the arguments the saga built for it.
pub fn undo_pending_item(run_id: &RunId, key: &EffectKey, e: &Effect) -> Option<wire::PendingItem> {
    let a = estop_kernel::saga::held_approval(e)?;
    let args = e.saga.as_ref().and_then(|c| c.args.as_deref());
    Some(wire::PendingItem {
        approval: approval_id(run_id, a.id),
        run: run_id.to_string(),
        key: key.to_string(),
        tool: e
            .compensate
            .as_ref()
            .map_or_else(String::new, ToString::to_string),
        args: args.map(|a| wire::RawJson::new(std::sync::Arc::from(a))),
        digest: e.digest.to_hex(),
        rule: None,
        quorum: a.quorum,
        approvals: a.approvers.iter().map(|x| x.name.to_string()).collect(),
        groups: a.groups.iter().map(ToString::to_string).collect(),
        expires_at: a.expires_at,
        created_at: a.requested_at,
        compensates: Some(e.tool.to_string()),
    })
}

/// One page of a run's after-stop report: the effects after `after`, in key order (so each
/// list is in key order), until `page` is full.
pub fn report(
    id: &RunId,
    run: &Run,
    after: Option<&EffectKey>,
    mut page: PageBudget,
) -> wire::Report {
    let mut r = wire::Report {
        run: id.to_string(),
        state: run.state.as_str().to_string(),
        cause: run.stop.as_ref().map(|s| s.cause.as_str().to_string()),
        reason: run
            .stop
            .as_ref()
            .and_then(|s| s.reason.as_deref().map(str::to_string)),
        stopped_at: run.stop.as_ref().map(|s| s.at),
        budget: budget_lines(run),
        ..wire::Report::default()
    };
    r.saga_next = saga_next(id, run);
    let from = after.map_or(Bound::Unbounded, Bound::Excluded);
    let mut last = None;
    for (key, e) in run.effects.range::<EffectKey, _>((from, Bound::Unbounded)) {
        let section = report::section(e);
        let item = report_item(key, e);
        let undo = report::undo(e);
        let copies = if undo == Undo::NotApplicable { 1 } else { 2 };
        if !page.take(copies * item.weight()) {
            r.more = true;
            r.next = last.map(ToString::to_string);
            break;
        }
        last = Some(key);
        match undo {
            Undo::Compensable => r.compensable.push(item.clone()),
            Undo::Irreversible => r.irreversible.push(item.clone()),
            Undo::Undeclared => r.undeclared.push(item.clone()),
            Undo::NotApplicable => {}
        }
        match section {
            Section::Done | Section::Compensation => r.done.push(item),
            Section::Failed => r.failed.push(item),
            Section::Refused => r.refused.push(item),
            Section::InFlight => r.in_flight.push(item),
            Section::Unknown => r.unknown.push(item),
            Section::Held | Section::Prepared => r.held.push(item),
        }
    }
    r
}

/// One effect as the report shows it, with how far its undo got.
fn report_item(key: &EffectKey, e: &estop_kernel::state::Effect) -> wire::ReportItem {
    let c = e.saga.as_deref();
    wire::ReportItem {
        key: key.to_string(),
        tool: e.tool.to_string(),
        status: e.status.kind().as_str().to_string(),
        reversibility: e.reversibility.as_str().to_string(),
        compensate: e.compensate.as_ref().map(ToString::to_string),
        late: e.late,
        reason: match e.status {
            Status::Refused(reason) => Some(reason.as_str().to_string()),
            _ => None,
        },
        attempts: c.map(|c| c.attempts),
        attempts_max: c.map(|c| c.granted),
        retry_at: c
            .filter(|_| e.status == Status::CompensationFailed)
            .map(|c| c.retry_at),
        note: c.and_then(|c| c.note.as_deref().map(str::to_string)),
        by: c.and_then(|c| c.by.as_ref().map(ToString::to_string)),
        lookup: e.lookup.as_ref().map(ToString::to_string),
        lookups: c.map(|c| c.lookups).filter(|n| *n > 0),
        chosen: c.is_some_and(|c| c.chosen),
        holder: (e.holder != estop_kernel::Part::Main).then(|| e.holder.as_str().to_string()),
        disputes: (e.disputes > 0).then_some(e.disputes),
        ..egress_item(e)
    }
}

/// What the report adds for an egress effect (`args_kept`): the request it sent (its recorded
/// arguments), the response's status and bytes, or the error it was completed with.
fn egress_item(e: &estop_kernel::state::Effect) -> wire::ReportItem {
    /// The two numbers of an HTTP result (`record.rs` in crates/egress); the rest is skipped.
    #[derive(serde::Deserialize)]
    struct Answer {
        status: Option<u16>,
        bytes: Option<u64>,
    }
    if !estop_kernel::state::args_kept(e.tool.as_str()) {
        return wire::ReportItem::default();
    }
    let outcome = e.outcome.as_deref();
    let answer = outcome
        .and_then(|o| o.result.as_deref())
        .and_then(|r| serde_json::from_str::<Answer>(r).ok());
    wire::ReportItem {
        args: e.args.clone().map(wire::RawJson::new),
        http_status: answer.as_ref().and_then(|a| a.status),
        bytes: answer.and_then(|a| a.bytes),
        error: outcome.and_then(|o| o.error.as_deref().map(str::to_string)),
        ..wire::ReportItem::default()
    }
}

/// What the run's reverse saga waits for, while it is open.
fn saga_next(run_id: &RunId, run: &Run) -> Option<wire::SagaNext> {
    use estop_kernel::saga::{self, Next};
    saga::next(run).map(|(key, next)| {
        let approval = match next {
            Next::Approval { id, .. } => Some(approval_id(run_id, id)),
            _ => None,
        };
        let (waits, attempt, at) = match next {
            Next::Approval { expires_at, .. } => ("approval", None, Some(expires_at)),
            Next::InFlight => ("outcome", None, None),
            Next::Settle => ("settle", None, None),
            Next::Lookup { attempt } => ("lookup", Some(attempt), None),
            Next::LookingUp { attempt } => ("looking_up", Some(attempt), None),
            Next::Begin { attempt, at } => ("executor", Some(attempt), Some(at)),
            Next::Running { attempt } => ("running", Some(attempt), None),
            Next::Human => ("human", None, None),
        };
        wire::SagaNext {
            key: key.to_string(),
            waits: waits.into(),
            attempt,
            at,
            approval,
        }
    })
}

/// The wire event for a kernel event, with what the state now says about it, stamped `at`.
pub fn event(gate: &estop_kernel::Gate, e: &estop_kernel::Event, at: u64) -> Option<wire::Event> {
    use estop_kernel::reply::EventKind;
    use estop_kernel::state::Status;
    let event = match e.kind {
        EventKind::Cancelled => wire::EventKind::Cancelled,
        EventKind::Paused => wire::EventKind::Paused,
        EventKind::Resumed => wire::EventKind::Resumed,
        EventKind::Decided => wire::EventKind::Decided,
        EventKind::Held => wire::EventKind::Held,
        EventKind::Completed => wire::EventKind::Completed,
        EventKind::Closed => wire::EventKind::Closed,
        EventKind::Finalizing => wire::EventKind::Finalizing,
        EventKind::Expired => wire::EventKind::Expired,
        EventKind::Settled => wire::EventKind::Settled,
        EventKind::Compensation => wire::EventKind::Compensation,
        EventKind::Admitted => return None,
    };
    let run = gate.run(&e.run);
    let effect = e.key.as_ref().and_then(|k| run?.effects.get(k));
    let mut out = wire::Event {
        event,
        run: e.run.to_string(),
        key: e.key.as_ref().map(ToString::to_string),
        reason: None,
        decision: None,
        outcome: None,
        attempt: None,
        tool: None,
        args: None,
        idempotency_key: None,
        at,
    };
    match e.kind {
        EventKind::Cancelled | EventKind::Finalizing | EventKind::Closed => {
            let stop = run.and_then(|r| r.stop.as_ref());
            out.reason = stop
                .and_then(|s| s.reason.as_deref().map(str::to_string))
                .or_else(|| e.detail.map(str::to_string));
        }
        EventKind::Held => match effect.map(|x| x.status) {
            Some(Status::Held(reason)) => out.reason = Some(reason.as_str().to_string()),
            // Its compensating call, held for an approval (`saga::undo`).
            Some(_) => out.reason = Some(HoldReason::Approval.as_str().to_string()),
            None => {}
        },
        EventKind::Decided => {
            out.decision = effect.map(|x| {
                let undo_rejected = x
                    .saga
                    .as_ref()
                    .and_then(|c| c.approval.as_ref())
                    .is_some_and(|a| a.rejected_by.is_some())
                    && x.status == Status::NeedsHuman;
                match x.status {
                    Status::Refused(estop_kernel::vocab::RefusalReason::Rejected) => "reject",
                    _ if undo_rejected => "reject",
                    _ => "approve",
                }
                .to_string()
            });
        }
        EventKind::Completed => {
            out.outcome = effect
                .and_then(|x| x.outcome_kind())
                .map(|o| o.as_str().to_string());
        }
        EventKind::Expired => out.reason = Some("expired".into()),
        EventKind::Paused | EventKind::Resumed | EventKind::Admitted => {}
        EventKind::Settled => {
            out.reason = run.map(|r| r.state.as_str().to_string());
        }
        EventKind::Compensation => {
            out.outcome = effect.map(|x| x.status.kind().as_str().to_string());
        }
    }
    Some(out)
}

/// The answer to a `decide`: the status after it, who has approved, and the quorum.
pub fn decided(d: &estop_kernel::reply::Decided) -> wire::DecideReply {
    let status = match d.status {
        DecideStatus::Approved => "approved",
        DecideStatus::Rejected => "rejected",
        DecideStatus::Pending { .. } => "held",
    };
    wire::DecideReply {
        status: status.into(),
        approvals: d.approvers.iter().map(ToString::to_string).collect(),
        quorum: d.quorum,
    }
}

/// The answer to a stop or pause/resume: the run's state, and every run the command changed.
pub fn run_state(
    state: estop_kernel::vocab::RunState,
    events: &[estop_kernel::Event],
) -> wire::Ack {
    use estop_kernel::reply::EventKind;
    let runs = events
        .iter()
        .filter(|e| {
            e.key.is_none()
                && matches!(
                    e.kind,
                    EventKind::Cancelled
                        | EventKind::Closed
                        | EventKind::Paused
                        | EventKind::Resumed
                )
        })
        .map(|e| e.run.to_string())
        .collect();
    wire::Ack {
        state: Some(state.as_str().into()),
        runs,
        ..wire::Ack::default()
    }
}

/// A stop's answer names what it did not stop: the effects of the runs it changed that are
/// still in flight (started and not reported), with their recorded arguments (an egress
/// request's method and URL), at most `IN_FLIGHT_LISTED_MAX` of them (the report has all).
pub fn in_flight(gate: &estop_kernel::Gate, ack: &mut wire::Ack) {
    let mut listed = Vec::new();
    for id in &ack.runs {
        let Some(run) = RunId::new(id).ok().and_then(|r| gate.run(&r)) else {
            continue;
        };
        let started = run
            .effects
            .iter()
            .filter(|(_, e)| e.status == Status::Started);
        for (key, e) in started {
            if listed.len() == wire::IN_FLIGHT_LISTED_MAX {
                break;
            }
            listed.push(wire::InFlight {
                run: id.clone(),
                key: key.to_string(),
                tool: e.tool.to_string(),
                args: e.args.clone().map(wire::RawJson::new),
            });
        }
    }
    ack.in_flight = (!listed.is_empty()).then(|| Box::new(wire::InFlightList(listed)));
}

/// What the SoundGate wire says for a verdict (SPEC §4.3): release, hold, or one of the
/// reference's three refusals.
pub fn soundgate_verdict(v: &wire::VerdictReply) -> SgReply {
    match v {
        wire::VerdictReply::Admitted { .. } | wire::VerdictReply::Go => SgReply::Release,
        // The reference has one hold: for a sibling or a pause too, the effect waits.
        wire::VerdictReply::Held { .. } => SgReply::HeldForApproval,
        wire::VerdictReply::Duplicate { .. } => SgReply::RefusedDuplicate,
        wire::VerdictReply::Refused { reason, .. } => soundgate_refusal(*reason),
    }
}

/// The reference's three refusals: the run is over (`refused_cancelled`), the key was used
/// (`refused_duplicate`), or this effect was said no to (`refused_rejected`). Every kernel
/// reason is named here, so a new one does not compile until it is given its word.
pub fn soundgate_refusal(reason: RefusalReason) -> SgReply {
    match reason {
        RefusalReason::Cancelled
        | RefusalReason::Closed
        | RefusalReason::Deadline
        | RefusalReason::Budget => SgReply::RefusedCancelled,
        RefusalReason::Mismatch => SgReply::RefusedDuplicate,
        RefusalReason::Rejected | RefusalReason::Expired | RefusalReason::Denied => {
            SgReply::RefusedRejected
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SoundGate word for every kernel refusal reason, as data: the reference's clients
    /// branch on these, so a change here is a compatibility change (docs/PROTOCOL.md).
    #[test]
    fn every_refusal_reason_has_its_soundgate_word() {
        let words: Vec<String> = RefusalReason::ALL
            .iter()
            .map(|&r| {
                let line = soundgate_verdict(&wire::VerdictReply::Refused {
                    reason: r,
                    message: None,
                    rule: None,
                    budget: None,
                })
                .to_line();
                format!("{r} {}", String::from_utf8(line).unwrap().trim_end())
            })
            .collect();
        assert_eq!(
            words,
            [
                r#"cancelled {"verdict":"refused_cancelled"}"#,
                r#"rejected {"verdict":"refused_rejected"}"#,
                r#"expired {"verdict":"refused_rejected"}"#,
                r#"denied {"verdict":"refused_rejected"}"#,
                r#"budget {"verdict":"refused_cancelled"}"#,
                r#"deadline {"verdict":"refused_cancelled"}"#,
                r#"mismatch {"verdict":"refused_duplicate"}"#,
                r#"closed {"verdict":"refused_cancelled"}"#,
            ]
        );
    }

    #[test]
    fn every_hold_and_admission_has_its_soundgate_word() {
        for &reason in HoldReason::ALL {
            let held = wire::VerdictReply::Held {
                approval: None,
                expires_at: None,
                reason,
            };
            assert_eq!(
                soundgate_verdict(&held),
                SgReply::HeldForApproval,
                "{reason}"
            );
        }
        let admitted = wire::VerdictReply::Admitted {
            token: "t".into(),
            epoch: 1,
        };
        assert_eq!(soundgate_verdict(&admitted), SgReply::Release);
        assert_eq!(soundgate_verdict(&wire::VerdictReply::Go), SgReply::Release);
        let duplicate = wire::VerdictReply::Duplicate {
            status: "completed".into(),
            outcome: None,
            result: None,
            error: None,
        };
        assert_eq!(soundgate_verdict(&duplicate), SgReply::RefusedDuplicate);
    }
}
