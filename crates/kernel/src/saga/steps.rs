//! The saga's steps the shell takes for the gate (`Command::SagaStep`): settling an unknown
//! outcome by the tool's declared lookup, and finding that a due compensation cannot be issued
//! (or must be approved first: `undo.rs`).
//!
//! A call a stopped run's agent left in flight and never reported (`Unreported`) becomes
//! `unknown` once the gate's deadline after the stop has passed, and is settled the same way.
//!
//! A lookup asks the tool's `lookup` (through an executor, as a compensation is run) whether
//! the call with this idempotency key happened. Found, the effect is `completed` with the
//! result the lookup returned (so a compensation built from `result` can be built); not found,
//! it is `failed` (it did not happen: nothing to undo); and when the lookup cannot tell (it is
//! unavailable, it failed, its own outcome is unknown) the effect stays `unknown` for an
//! operator to settle. A lookup reads and changes nothing downstream, yet it is not repeated by
//! itself: one lookup per grant, and an operator's retry grants another.

use super::{Next, fresh, saga_error, settles_after};
use crate::command::{SagaAction, SagaStep};
use crate::gate::{Gate, Sink, bounded, check_effect, event, settles};
use crate::ids::{EffectKey, Principal, Role, RunId};
use crate::reply::{EventKind, KernelError, Reply};
use crate::state::{Effect, OutcomeRecord, Status};
use crate::vocab::Outcome;

/// What an unknown outcome with a declared lookup waits for (`None`: no lookup left, a human
/// settles it).
pub(super) fn lookup_next(e: &Effect) -> Option<Next> {
    e.lookup.as_ref()?;
    let c = e.saga.as_deref();
    let lookups = c.map_or(0, |c| c.lookups);
    if c.is_some_and(|c| c.lookup_open) {
        return Some(Next::LookingUp { attempt: lookups });
    }
    let granted = c.map_or(1, |c| c.lookups_granted);
    (lookups < granted).then_some(Next::Lookup {
        attempt: lookups + 1,
    })
}

/// Whether a lookup of the effect's outcome is under way.
pub(super) fn looking_up(e: &Effect) -> bool {
    e.status == Status::Unknown && e.saga.as_ref().is_some_and(|c| c.lookup_open)
}

/// An operator's retry of an unknown outcome whose lookup could not tell asks the lookup again
/// (`Some`: this is that retry, or why it may not be).
pub(super) fn lookup_retry(
    run_id: &RunId,
    key: &EffectKey,
    e: &Effect,
    action: &SagaAction,
) -> Option<Result<(), KernelError>> {
    if *action != SagaAction::Retry || e.status != Status::Unknown || e.lookup.is_none() {
        return None;
    }
    Some(match lookup_next(e) {
        None => Ok(()),
        Some(Next::LookingUp { attempt }) => Err(saga_error(
            run_id,
            key,
            format!("retry: its lookup {attempt} is under way"),
        )),
        Some(_) => Err(saga_error(run_id, key, "retry: its lookup is due already")),
    })
}

fn lookup_reply(e: &Effect) -> Reply {
    Reply::Compensation {
        status: e.status.kind(),
        attempt: e.saga.as_ref().map_or(0, |c| c.lookups),
        retry_at: None,
    }
}

impl Gate {
    /// The operator's retry of a lookup that could not tell: one more lookup is granted.
    pub(super) fn retry_lookup(
        &mut self,
        now: u64,
        p: &Principal,
        run_id: &RunId,
        key: &EffectKey,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        let e = self.effect_mut(run_id, key);
        let c = e.saga.get_or_insert_with(fresh);
        c.lookups_granted = c.lookups + 1;
        c.by = Some(p.name.clone());
        e.updated_at = now;
        let answer = lookup_reply(e);
        ev.push(|| event(run_id, Some(key), EventKind::Compensation));
        Ok((answer, true))
    }

    /// `SagaStep`: a lookup begins or ends, or a due compensation is found blocked.
    pub(crate) fn saga_step(
        &mut self,
        now: u64,
        p: &Principal,
        run_id: &RunId,
        key: &EffectKey,
        step: &SagaStep,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        match step {
            SagaStep::LookupBegin { attempt } => {
                self.lookup_begin(now, p, run_id, key, *attempt, ev)
            }
            SagaStep::LookupEnd {
                attempt,
                outcome,
                result,
                error,
            } => {
                let limit = self.limits.result_bytes_max;
                bounded(result, limit, "result_bytes_max")?;
                bounded(error, limit, "result_bytes_max")?;
                let found = (*outcome, result.clone(), error.clone());
                self.lookup_end(now, p, run_id, key, *attempt, found, ev)
            }
            SagaStep::Blocked { attempt, reason } => {
                self.blocked(now, p, run_id, key, *attempt, reason, ev)
            }
            SagaStep::Unreported { after_ms } => {
                self.unreported(now, p, run_id, key, *after_ms, ev)
            }
            SagaStep::Held {
                attempt,
                quorum,
                groups,
                expiry_ms,
                args,
                reason,
            } => {
                let step = (*attempt, *quorum, groups.as_slice(), *expiry_ms);
                self.hold_undo(now, p, run_id, key, step, args, reason, ev)
            }
            SagaStep::Expired { approval } => self.expire_undo(now, p, run_id, key, *approval, ev),
        }
    }

    /// A call the stopped run's agent left `started` and did not report within `after_ms` of
    /// the stop becomes `unknown`: the agent is taken for dead, and what happened is found out
    /// by the tool's lookup or asked of a human, never guessed. Only the gate (an operator
    /// principal) takes this step, and only once the deadline has passed at `now`.
    pub(super) fn unreported(
        &mut self,
        now: u64,
        p: &Principal,
        run_id: &RunId,
        key: &EffectKey,
        after_ms: u64,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        if p.role != Role::Operator {
            return Err(KernelError::Forbidden);
        }
        let (run, effect) = self.visible_effect(p, run_id, key)?;
        let Some(stop) = run.stop.as_ref() else {
            return Err(saga_error(
                run_id,
                key,
                "it is in flight and its run is not stopped: its agent reports it",
            ));
        };
        if effect.status != Status::Started {
            return Err(saga_error(
                run_id,
                key,
                format!("it is {}, not left in flight", effect.status.kind()),
            ));
        }
        let due = stop.at.saturating_add(after_ms);
        if now < due {
            return Err(saga_error(
                run_id,
                key,
                format!("its agent may report it until {due} ({after_ms} ms after the stop)"),
            ));
        }
        let to = Status::Unknown;
        check_effect(run_id, key, Some(Status::Started), to)?;
        let settled = settles(
            run_id,
            run.state,
            run.in_flight - 1,
            super::open_after(run, key, to),
            run.stop.as_ref(),
        )?;
        self.runs.get_mut(run_id).expect("visible run").in_flight -= 1;
        let e = self.effect_mut(run_id, key);
        e.status = to;
        e.updated_at = now;
        let answer = lookup_reply(e);
        ev.push(|| event(run_id, Some(key), EventKind::Compensation));
        self.settle_saga(run_id, settled, ev);
        Ok((answer, true))
    }

    fn lookup_begin(
        &mut self,
        now: u64,
        p: &Principal,
        run_id: &RunId,
        key: &EffectKey,
        attempt: u32,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        let (run, effect) = self.visible_effect(p, run_id, key)?;
        if looking_up(effect) && effect.saga.as_ref().is_some_and(|c| c.lookups == attempt) {
            return Ok((lookup_reply(effect), false));
        }
        match super::next(run) {
            Some((head, Next::Lookup { attempt: due })) if head == key => {
                if attempt != due {
                    return Err(saga_error(
                        run_id,
                        key,
                        format!("the next lookup of its outcome is {due}, not {attempt}"),
                    ));
                }
            }
            Some((head, _)) if head != key => {
                return Err(saga_error(
                    run_id,
                    key,
                    format!("the saga settles newest first: {head} comes before it"),
                ));
            }
            _ => {
                return Err(saga_error(
                    run_id,
                    key,
                    format!(
                        "it awaits no lookup (it is {}; only the saga's unknown outcome whose \
                         tool declares a lookup does)",
                        effect.status.kind()
                    ),
                ));
            }
        }
        let e = self.effect_mut(run_id, key);
        let c = e.saga.get_or_insert_with(fresh);
        c.lookups = attempt;
        c.lookup_open = true;
        e.updated_at = now;
        let answer = lookup_reply(e);
        ev.push(|| event(run_id, Some(key), EventKind::Compensation));
        Ok((answer, true))
    }

    /// Lookup `attempt` ended: found, the call happened (`completed`, with its result); not
    /// found, it did not (`failed`); could not tell, it stays `unknown` for a human.
    #[allow(clippy::too_many_arguments)]
    fn lookup_end(
        &mut self,
        now: u64,
        p: &Principal,
        run_id: &RunId,
        key: &EffectKey,
        attempt: u32,
        (outcome, result, error): (Outcome, Option<Box<str>>, Option<Box<str>>),
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        let (run, effect) = self.visible_effect(p, run_id, key)?;
        let lookups = effect.saga.as_ref().map_or(0, |c| c.lookups);
        if !looking_up(effect) || attempt != lookups {
            if attempt != 0 && attempt <= lookups && !looking_up(effect) {
                // A repeated report of a lookup already ended: its answer is the current one.
                return Ok((lookup_reply(effect), false));
            }
            return Err(saga_error(
                run_id,
                key,
                format!("lookup {attempt} of its outcome is not under way"),
            ));
        }
        if result.is_some() && outcome != Outcome::Ok {
            return Err(saga_error(
                run_id,
                key,
                "a lookup's result says the call happened: report it with outcome ok",
            ));
        }
        let to = match outcome {
            Outcome::Ok => Status::Completed,
            Outcome::Error => Status::Failed,
            Outcome::Unknown => Status::Unknown,
        };
        let settled = if to == Status::Unknown {
            None
        } else {
            check_effect(run_id, key, Some(Status::Unknown), to)?;
            settles_after(run, run_id, key, to)?
        };
        let e = self.effect_mut(run_id, key);
        let c = e.saga.as_mut().expect("a lookup began");
        c.lookup_open = false;
        c.note = error.clone();
        if to != Status::Unknown {
            let agent_error = e.outcome.as_ref().and_then(|o| o.error.clone());
            e.outcome = Some(Box::new(OutcomeRecord {
                outcome: Some(outcome),
                result,
                error: error.or(agent_error),
            }));
        }
        e.status = to;
        e.updated_at = now;
        let answer = lookup_reply(e);
        ev.push(|| event(run_id, Some(key), EventKind::Compensation));
        self.settle_saga(run_id, settled, ev);
        Ok((answer, true))
    }

    /// Attempt `attempt` is due and cannot be issued: a human is asked at once, with `reason`
    /// (no attempt is spent, none was sent).
    #[allow(clippy::too_many_arguments)]
    fn blocked(
        &mut self,
        now: u64,
        p: &Principal,
        run_id: &RunId,
        key: &EffectKey,
        attempt: u32,
        reason: &str,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        bounded(
            &Some(reason.into()),
            self.limits.reason_bytes_max,
            "reason_bytes_max",
        )?;
        let (run, effect) = self.visible_effect(p, run_id, key)?;
        let at = super::due(run, run_id, key, effect, attempt)?;
        if now < at {
            return Err(saga_error(
                run_id,
                key,
                format!("attempt {attempt} is due at {at}"),
            ));
        }
        check_effect(run_id, key, Some(effect.status), Status::NeedsHuman)?;
        let e = self.effect_mut(run_id, key);
        let c = e.saga.get_or_insert_with(fresh);
        c.note = Some(reason.into());
        e.status = Status::NeedsHuman;
        e.updated_at = now;
        let answer = super::reply(e);
        ev.push(|| event(run_id, Some(key), EventKind::Compensation));
        Ok((answer, true))
    }
}
