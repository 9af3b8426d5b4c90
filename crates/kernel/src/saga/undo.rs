//! A compensating call a policy `approve` rule holds (docs/POLICY.md): approved like an
//! admission, by a quorum of distinct principals, before anything is sent.
//!
//! When the head's attempt is due and the policy (evaluated by the shell, on the arguments the
//! saga built) says `approve`, the shell records `SagaStep::Held` with the rule's quorum, groups
//! and expiry: the effect gets an approval with an id from the run's approval numbering (shown
//! as `<run>#<id>`, listed by `pending`), and its status does not change (`completed`, or
//! `compensation_failed` for a retried one) — it is not yet undone, and nothing was attempted.
//! The saga waits on it (`Next::Approval`). Operators decide it with `decide`, the same vote as
//! an admission's (`gate::vote`): one vote per principal, groups met. Met, the attempt is due
//! again and the shell begins it; rejected, or expired unmet (`SagaStep::Expired`, taken by the
//! shell at `expires_at`), the effect is `needs_human`, where skip remains, and a retry asks
//! for a new approval. An operator's `retry` never stands in for the votes.

use super::{fresh, saga_error};
use crate::gate::{Gate, Sink, bounded, check_effect, decided, event, vote};
use crate::ids::{EffectKey, Principal, Role, RunId};
use crate::reply::{DecideStatus, EventKind, KernelError, Reply};
use crate::state::{Approval, Effect, Run, Status};
use crate::vocab::Decision;

/// Most approvers a compensation's approval may need (as a policy rule's `quorum`).
pub const UNDO_QUORUM_MAX: u32 = 32;

/// The approval the effect's compensating call waits for: requested, neither met nor rejected,
/// and its effect not moved on (a rejected or expired one leaves it `needs_human`).
pub fn held_approval(e: &Effect) -> Option<&Approval> {
    let a = e.saga.as_ref()?.approval.as_deref()?;
    let waiting = matches!(e.status, Status::Completed | Status::CompensationFailed);
    (waiting && a.rejected_by.is_none() && !a.satisfied()).then_some(a)
}

/// The run's compensating call awaiting approval, if any: at most one, its saga's head. Looked
/// for only in a stopped run that ever asked for an approval, so a listing of many runs stays
/// cheap.
pub fn run_held_approval(run: &Run) -> Option<(&EffectKey, &Effect, &Approval)> {
    if run.stop.is_none() || run.next_approval <= 1 {
        return None;
    }
    let (key, e) = super::head(run)?;
    held_approval(e).map(|a| (key, e, a))
}

/// Whether the compensating call was approved by its quorum.
pub fn approved(e: &Effect) -> bool {
    e.saga
        .as_ref()
        .and_then(|c| c.approval.as_deref())
        .is_some_and(Approval::satisfied)
}

/// What the gate says to an operator's retry of a compensation awaiting its approval: no; the
/// votes decide it.
pub(super) fn awaiting(run_id: &RunId, key: &EffectKey, e: &Effect) -> Result<(), KernelError> {
    match held_approval(e) {
        Some(a) => Err(KernelError::UndoAwaitsApproval {
            run: run_id.clone(),
            key: key.clone(),
            approval: a.id,
        }),
        None => Ok(()),
    }
}

impl Gate {
    /// `SagaStep::Held`: the due attempt `attempt` waits for an approval.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn hold_undo(
        &mut self,
        now: u64,
        p: &Principal,
        run_id: &RunId,
        key: &EffectKey,
        step: (u32, u32, &[Box<str>], u64),
        args: &Option<Box<str>>,
        reason: &str,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        let (attempt, quorum, groups, expiry_ms) = step;
        if p.role != Role::Operator {
            return Err(KernelError::Forbidden);
        }
        bounded(args, self.limits.args_bytes_max, "args_bytes_max")?;
        let reason_text = Some(reason.into());
        bounded(
            &reason_text,
            self.limits.reason_bytes_max,
            "reason_bytes_max",
        )?;
        if quorum == 0 || quorum > UNDO_QUORUM_MAX || groups.len() > quorum as usize {
            return Err(saga_error(
                run_id,
                key,
                format!(
                    "an approval needs a quorum of 1 to {UNDO_QUORUM_MAX}, at least one per \
                     group; not {quorum} with {} groups",
                    groups.len()
                ),
            ));
        }
        let (run, effect) = self.visible_effect(p, run_id, key)?;
        let at = super::due(run, run_id, key, effect, attempt)?;
        if now < at {
            return Err(saga_error(
                run_id,
                key,
                format!("attempt {attempt} is due at {at}"),
            ));
        }
        // A met approval stands for this attempt and the later ones: asking again would set
        // it aside and ask the approvers for what they already gave.
        if let Some(a) = effect.saga.as_ref().and_then(|c| c.approval.as_deref())
            && a.rejected_by.is_none()
            && a.satisfied()
        {
            return Err(saga_error(
                run_id,
                key,
                format!(
                    "its compensating call's approval {run_id}#{} is met; it stands for every \
                     attempt",
                    a.id
                ),
            ));
        }
        let run = self.runs.get_mut(run_id).expect("visible run");
        let id = run.next_approval;
        run.next_approval += 1;
        let e = self.effect_mut(run_id, key);
        let c = e.saga.get_or_insert_with(fresh);
        c.approval = Some(Box::new(Approval {
            id,
            quorum,
            groups: groups.to_vec(),
            expiry_ms,
            requested_at: now,
            expires_at: now.saturating_add(expiry_ms),
            approvers: Vec::new(),
            rejected_by: None,
            reason: None,
        }));
        c.args = args.clone();
        c.note = Some(reason.into());
        e.updated_at = now;
        let answer = super::reply(e);
        ev.push(|| event(run_id, Some(key), EventKind::Held));
        ev.push(|| event(run_id, Some(key), EventKind::Compensation));
        Ok((answer, true))
    }

    /// `SagaStep::Expired`: the compensation's approval `id` expired unmet; a human is asked.
    pub(super) fn expire_undo(
        &mut self,
        now: u64,
        p: &Principal,
        run_id: &RunId,
        key: &EffectKey,
        id: u64,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        if p.role != Role::Operator {
            return Err(KernelError::Forbidden);
        }
        let (_, effect) = self.visible_effect(p, run_id, key)?;
        let Some(a) = held_approval(effect).filter(|a| a.id == id) else {
            return Err(saga_error(
                run_id,
                key,
                format!("its compensation does not await approval {run_id}#{id}"),
            ));
        };
        if now < a.expires_at {
            return Err(saga_error(
                run_id,
                key,
                format!("approval {run_id}#{id} is open until {}", a.expires_at),
            ));
        }
        check_effect(run_id, key, Some(effect.status), Status::NeedsHuman)?;
        let e = self.effect_mut(run_id, key);
        let c = e.saga.as_mut().expect("a held compensation");
        c.note =
            Some(format!("approval {run_id}#{id} of the compensating call expired unmet").into());
        e.status = Status::NeedsHuman;
        e.updated_at = now;
        let answer = super::reply(e);
        ev.push(|| event(run_id, Some(key), EventKind::Expired));
        ev.push(|| event(run_id, Some(key), EventKind::Compensation));
        Ok((answer, true))
    }

    /// `decide` on an effect whose compensating call awaits approval (checked by `decide`): a
    /// vote counted as an admission's, or a reject that asks a human.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn decide_undo(
        &mut self,
        now: u64,
        p: &Principal,
        run_id: &RunId,
        key: &EffectKey,
        decision: Decision,
        reason: &Option<Box<str>>,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        let effect = &self.runs[run_id].effects[key];
        let a = held_approval(effect).expect("checked by decide");
        if now >= a.expires_at {
            return Err(KernelError::NotAwaitingApproval {
                run: run_id.clone(),
                key: key.clone(),
                status: "expired",
            });
        }
        let (next, status) = match decision {
            Decision::Approve => vote(a, p, now, reason, run_id, key)?,
            Decision::Reject => {
                check_effect(run_id, key, Some(effect.status), Status::NeedsHuman)?;
                let mut next = a.clone();
                next.rejected_by = Some(p.name.clone());
                next.reason = reason.clone();
                (next, DecideStatus::Rejected)
            }
        };
        let answer = decided(&next, status.clone());
        let id = next.id;
        let e = self.effect_mut(run_id, key);
        let c = e.saga.as_mut().expect("a held compensation");
        c.approval = Some(Box::new(next));
        if status == DecideStatus::Rejected {
            c.note = Some(
                format!(
                    "approval {run_id}#{id} of the compensating call rejected by {}",
                    p.name
                )
                .into(),
            );
            e.status = Status::NeedsHuman;
        }
        e.updated_at = now;
        ev.push(|| event(run_id, Some(key), EventKind::Decided));
        ev.push(|| event(run_id, Some(key), EventKind::Compensation));
        Ok((answer, true))
    }
}
