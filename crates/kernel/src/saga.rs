//! The reverse saga (SPEC G8, §4.8): after a cancel (never after a kill) a run stays
//! `finalizing` while its completed compensable effects are undone, newest first, one at a time.
//!
//! The saga is computed from the run's effects, never stored beside them: its members are the
//! effects that name a compensating tool and did (or may have) happen, ordered by admission
//! (token serial), and its *head* is the newest member not yet settled. Walking strictly one
//! at a time is what makes "newest first" and "unknown outcomes first" hold: a member whose
//! outcome is unknown is the head until an operator settles it, so nothing older is
//! compensated before it. An executor begins an attempt on the head (`CompensationBegin`,
//! numbered, so a repeated begin or end is recognised and applied once) and reports its end
//! (`CompensationEnd`); a failed attempt is retried after an exponential backoff, up to a
//! bound, then a human is asked (`needs_human`). Time is the command's `now`, so replay is
//! exact; the bounds are constants for the same reason (a changed setting must not change
//! the past).
//!
//! An unknown outcome at the head is settled first: by the tool's declared `lookup`, asked by
//! the call's idempotency key through an executor like a compensation (`steps.rs`), and when
//! there is none or it cannot tell, by an operator. Never by a blind retry.
//!
//! A run stopped without a saga (a kill, a close, a deadline or budget) compensates nothing by
//! itself; an operator may ask for one effect's compensation (`SagaAction::Compensate`), which
//! gives that effect a saga of its own (`Compensation::chosen`), walked the same way.

mod steps;
mod undo;

pub use undo::{UNDO_QUORUM_MAX, approved, held_approval, run_held_approval};

use crate::command::SagaAction;
use crate::gate::{Gate, Sink, check_effect, event, settles};
use crate::ids::{EffectKey, Principal, Role, RunId};
use crate::reply::{EventKind, KernelError, Reply};
use crate::state::{Compensation, Effect, Run, Status};
use crate::vocab::{Outcome, RunState, StopCause};

/// Attempts of one compensation before a human is asked.
pub const COMPENSATION_ATTEMPTS_MAX: u32 = 5;
/// The wait after the first failed attempt; it doubles after each further failure.
pub const COMPENSATION_BACKOFF_MS: u64 = 1_000;
/// The longest wait between two attempts.
pub const COMPENSATION_BACKOFF_MAX_MS: u64 = 300_000;

/// The wait after `failed` failed attempts (≥ 1): 1 s, 2 s, 4 s, … capped at 5 minutes.
pub fn backoff_ms(failed: u32) -> u64 {
    let doublings = failed.saturating_sub(1).min(32);
    COMPENSATION_BACKOFF_MS
        .saturating_mul(1u64 << doublings)
        .min(COMPENSATION_BACKOFF_MAX_MS)
}

/// The idempotency key the compensating call carries downstream: the same for every attempt,
/// so a retry of an attempt that did land is deduplicated by the system it reaches.
pub fn derived_key(key: &EffectKey) -> String {
    format!("{key}/undo")
}

/// Whether the effect belongs to the saga: it names a compensating tool and it did, or may
/// have, happened (a failed or refused call is not undone; one still in flight may yet land).
pub fn member(e: &Effect) -> bool {
    e.compensate.is_some()
        && matches!(
            e.status,
            Status::Started
                | Status::Unknown
                | Status::Completed
                | Status::Compensating
                | Status::Compensated
                | Status::CompensationFailed
                | Status::NeedsHuman
                | Status::CompensationSkipped
        )
}

/// Whether a member still needs something (an outcome, a compensation, a human).
fn open(e: &Effect) -> bool {
    open_as(e, e.status)
}

/// Whether the effect would be an open member with status `status`.
fn open_as(e: &Effect, status: Status) -> bool {
    e.compensate.is_some()
        && matches!(
            status,
            Status::Started
                | Status::Unknown
                | Status::Completed
                | Status::Compensating
                | Status::CompensationFailed
                | Status::NeedsHuman
        )
}

/// Whether the run's saga would still keep it `finalizing` once effect `key` moves to `to`
/// (asked before the move, so the run's settling is checked before anything changes).
pub fn open_after(run: &Run, key: &EffectKey, to: Status) -> bool {
    applies(run)
        && run
            .effects
            .iter()
            .any(|(k, e)| if k == key { open_as(e, to) } else { open(e) })
}

/// Whether an operator gave the effect a saga of its own (`SagaAction::Compensate`).
pub fn chosen(e: &Effect) -> bool {
    e.saga.as_ref().is_some_and(|c| c.chosen)
}

/// Whether the run has an open saga of an effect an operator chose (its run compensates
/// nothing by itself).
pub fn chosen_open(run: &Run) -> bool {
    // Only a stopped run's effect can be chosen: a running one is not looked into.
    run.stop.is_some() && !applies(run) && run.effects.values().any(|e| chosen(e) && open(e))
}

/// Whether the run runs a saga of all its compensable effects: it was cancelled (a kill, a
/// deadline, a budget or a close compensates nothing unless an operator asks, one effect at a
/// time).
pub fn applies(run: &Run) -> bool {
    run.stop
        .as_ref()
        .is_some_and(|s| s.cause == StopCause::Cancelled)
}

/// Whether anything of the run would keep a saga open (checked when the cancel lands).
pub fn owed(run: &Run) -> bool {
    run.effects.values().any(open)
}

/// Whether the run's saga keeps it `finalizing`.
pub fn unsettled(run: &Run) -> bool {
    applies(run) && owed(run)
}

/// The saga's head: the newest open member (by admission) of a cancelled run's saga, or of the
/// effects an operator chose in a run stopped otherwise.
pub fn head(run: &Run) -> Option<(&EffectKey, &Effect)> {
    let all = applies(run);
    if !all && run.stop.is_none() {
        return None;
    }
    run.effects
        .iter()
        .filter(|(_, e)| open(e) && (all || chosen(e)))
        .max_by_key(|(_, e)| e.token.map(|t| t.serial))
}

/// The members of a run's saga, newest first (what the report lists as its timeline order).
pub fn members(run: &Run) -> Vec<(&EffectKey, &Effect)> {
    let mut v: Vec<_> = run.effects.iter().filter(|(_, e)| member(e)).collect();
    v.sort_by_key(|(_, e)| std::cmp::Reverse(e.token.map(|t| t.serial)));
    v
}

/// What the saga of a run waits for next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// The head is in flight: its outcome is awaited from the agent.
    InFlight,
    /// The head's outcome is unknown and no lookup may tell: an operator must settle it.
    Settle,
    /// The head's outcome is unknown: an executor may begin lookup `attempt` (its tool's
    /// `lookup`, by the call's idempotency key).
    Lookup { attempt: u32 },
    /// A lookup of the head's unknown outcome is under way.
    LookingUp { attempt: u32 },
    /// An executor may begin attempt `attempt` from `at` on.
    Begin { attempt: u32, at: u64 },
    /// The compensating call waits for approval `id` of the run (a policy `approve` rule),
    /// open until `expires_at`; operators decide it (`saga::undo`).
    Approval { id: u64, expires_at: u64 },
    /// An attempt is under way.
    Running { attempt: u32 },
    /// The bound was reached or the compensation's outcome is unknown: an operator decides.
    Human,
}

/// The head and what it waits for, if the run's saga is open.
pub fn next(run: &Run) -> Option<(&EffectKey, Next)> {
    let (key, e) = head(run)?;
    let c = e.saga.as_deref();
    let attempts = c.map_or(0, |c| c.attempts);
    if let Some(a) = held_approval(e) {
        let (id, expires_at) = (a.id, a.expires_at);
        return Some((key, Next::Approval { id, expires_at }));
    }
    let next = match e.status {
        Status::Started => Next::InFlight,
        Status::Unknown => steps::lookup_next(e).unwrap_or(Next::Settle),
        Status::Completed => Next::Begin {
            attempt: attempts + 1,
            at: c.map_or(0, |c| c.retry_at),
        },
        Status::CompensationFailed => Next::Begin {
            attempt: attempts + 1,
            at: c.map_or(0, |c| c.retry_at),
        },
        Status::Compensating => Next::Running { attempt: attempts },
        Status::NeedsHuman => Next::Human,
        s => unreachable!("an open member is never {}", s.kind()),
    };
    Some((key, next))
}

/// When the calls a stopped run left in flight are taken for unreported (`SagaStep::Unreported`),
/// `after_ms` after the stop; `None` when the run is not stopped or has nothing in flight.
pub fn unreported_at(run: &Run, after_ms: u64) -> Option<u64> {
    let stop = run.stop.as_ref()?;
    (run.in_flight > 0).then(|| stop.at.saturating_add(after_ms))
}

/// The calls a stopped run left in flight (`started`), in key order.
pub fn left_in_flight(run: &Run) -> impl Iterator<Item = &EffectKey> {
    run.effects
        .iter()
        .filter(|(_, e)| run.stop.is_some() && e.status == Status::Started)
        .map(|(k, _)| k)
}

/// A compensation not yet attempted, with the full budget of attempts.
fn fresh() -> Box<Compensation> {
    Box::new(Compensation {
        granted: COMPENSATION_ATTEMPTS_MAX,
        lookups_granted: 1,
        ..Compensation::default()
    })
}

pub(crate) fn saga_error(run: &RunId, key: &EffectKey, what: impl Into<String>) -> KernelError {
    KernelError::Saga {
        run: run.clone(),
        key: key.clone(),
        what: what.into(),
    }
}

fn reply(e: &Effect) -> Reply {
    let c = e.saga.as_deref();
    Reply::Compensation {
        status: e.status.kind(),
        attempt: c.map_or(0, |c| c.attempts),
        retry_at: (e.status == Status::CompensationFailed).then(|| c.map_or(0, |c| c.retry_at)),
    }
}

/// Whether an operator's retry or skip applies to an effect in `status`: a retry to an undo that
/// failed or waits for a human, a skip to those and to one not yet undone.
fn takes(action: &SagaAction, status: Status) -> bool {
    match action {
        SagaAction::Settle { .. } => matches!(status, Status::Unknown | Status::Started),
        SagaAction::Compensate => matches!(status, Status::Completed | Status::Unknown),
        SagaAction::Retry => matches!(status, Status::CompensationFailed | Status::NeedsHuman),
        SagaAction::Skip { .. } => matches!(
            status,
            Status::Completed | Status::CompensationFailed | Status::NeedsHuman
        ),
    }
}

/// When attempt `attempt` of the compensation of `key` may begin, or why it may not: it must
/// be the saga's head, waiting for that very attempt.
fn due(
    run: &Run,
    run_id: &RunId,
    key: &EffectKey,
    effect: &Effect,
    attempt: u32,
) -> Result<u64, KernelError> {
    match next(run) {
        Some((head, Next::Begin { attempt: due, at })) if head == key => {
            if attempt != due {
                return Err(saga_error(
                    run_id,
                    key,
                    format!("the next attempt of its compensation is {due}, not {attempt}"),
                ));
            }
            Ok(at)
        }
        Some((head, Next::Approval { id, .. })) if head == key => Err(saga_error(
            run_id,
            key,
            format!("its compensating call awaits approval {run_id}#{id}"),
        )),
        Some((head, _)) if head == key => Err(saga_error(
            run_id,
            key,
            format!(
                "its compensation cannot begin while it is {}",
                effect.status.kind()
            ),
        )),
        Some((head, _)) => Err(saga_error(
            run_id,
            key,
            format!("the saga compensates newest first: {head} comes before it"),
        )),
        None => Err(saga_error(
            run_id,
            key,
            "it is not awaiting compensation (only a cancelled run's open compensable effects \
             are, and those an operator asked to compensate)",
        )),
    }
}

/// The state the run reaches once effect `key` moves to `to`, if that settles it; checked
/// against the table before anything changes.
fn settles_after(
    run: &Run,
    run_id: &RunId,
    key: &EffectKey,
    to: Status,
) -> Result<Option<RunState>, KernelError> {
    settles(
        run_id,
        run.state,
        run.in_flight,
        open_after(run, key, to),
        run.stop.as_ref(),
    )
}

/// The status an operator's settle, retry or skip moves the effect to, or why it may not.
fn saga_target(
    run: &Run,
    run_id: &RunId,
    key: &EffectKey,
    effect: &Effect,
    action: &SagaAction,
) -> Result<Status, KernelError> {
    let (to, what) = match action {
        SagaAction::Settle { outcome, result } => {
            return settle_target(run, run_id, key, effect, *outcome, result.is_some());
        }
        SagaAction::Retry => (Status::CompensationFailed, "retry"),
        SagaAction::Skip { .. } => (Status::CompensationSkipped, "skip"),
        SagaAction::Compensate => unreachable!("compensate_one"),
    };
    if effect.compensate.is_none() {
        return Err(saga_error(
            run_id,
            key,
            format!("{what}: it declares no compensating tool"),
        ));
    }
    if !takes(action, effect.status) {
        // Refused here, as an operator's mistake, before the table would call it a bug.
        return Err(saga_error(
            run_id,
            key,
            format!("{what}: it is {}", effect.status.kind()),
        ));
    }
    Ok(to)
}

/// What an operator's settle makes of the effect: an unknown outcome becomes what happened; a
/// call a stopped run's agent left in flight (it died, or will never report) becomes what
/// happened, or `unknown` — stop waiting for the agent; its lookup or an operator settles it.
fn settle_target(
    run: &Run,
    run_id: &RunId,
    key: &EffectKey,
    effect: &Effect,
    outcome: Outcome,
    with_result: bool,
) -> Result<Status, KernelError> {
    let refuse = |what: String| Err(saga_error(run_id, key, what));
    if with_result && outcome != Outcome::Ok {
        return refuse("a result settles it as ok: a call that did not happen has none".into());
    }
    let happened = |unknown| match outcome {
        Outcome::Ok => Status::Completed,
        Outcome::Error => Status::Failed,
        Outcome::Unknown => unknown,
    };
    match effect.status {
        Status::Unknown if steps::looking_up(effect) => {
            refuse("its lookup is under way; settle it when the lookup could not tell".into())
        }
        Status::Unknown if outcome == Outcome::Unknown => {
            refuse("it is unknown already: settling says whether it happened: ok or error".into())
        }
        Status::Unknown => Ok(happened(Status::Unknown)),
        Status::Started if run.stop.is_none() => refuse(
            "it is in flight and its run is not stopped: its agent reports it (stop the run to \
             settle it by hand)"
                .into(),
        ),
        Status::Started => Ok(happened(Status::Unknown)),
        s => refuse(format!(
            "only an unknown outcome, or a call a stopped run left in flight, is settled; it is \
             {}",
            s.kind()
        )),
    }
}

impl Gate {
    #[allow(clippy::too_many_arguments)]
    /// `CompensationBegin`: attempt `attempt` of the head's compensation begins. The same
    /// begin again (a retried request) answers as it did and changes nothing.
    pub(crate) fn compensation_begin(
        &mut self,
        now: u64,
        p: &Principal,
        run_id: &RunId,
        key: &EffectKey,
        attempt: u32,
        args: &Option<Box<str>>,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        crate::gate::bounded(args, self.limits.args_bytes_max, "args_bytes_max")?;
        let (run, effect) = self.visible_effect(p, run_id, key)?;
        let attempts = effect.saga.as_ref().map_or(0, |c| c.attempts);
        if effect.status == Status::Compensating && attempts == attempt {
            return Ok((reply(effect), false));
        }
        let at = due(run, run_id, key, effect, attempt)?;
        if now < at {
            return Err(saga_error(
                run_id,
                key,
                format!("the retry is due at {at} (backoff); try again then"),
            ));
        }
        check_effect(run_id, key, Some(effect.status), Status::Compensating)?;
        let e = self.effect_mut(run_id, key);
        let c = e.saga.get_or_insert_with(fresh);
        c.attempts = attempt;
        c.args = args.clone();
        e.status = Status::Compensating;
        e.updated_at = now;
        ev.push(|| event(run_id, Some(key), EventKind::Compensation));
        Ok((reply(e), true))
    }

    /// `CompensationEnd`: attempt `attempt` ended. The same report again changes nothing.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn compensation_end(
        &mut self,
        now: u64,
        p: &Principal,
        run_id: &RunId,
        key: &EffectKey,
        attempt: u32,
        outcome: Outcome,
        error: &Option<Box<str>>,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        crate::gate::bounded(error, self.limits.result_bytes_max, "result_bytes_max")?;
        let (run, effect) = self.visible_effect(p, run_id, key)?;
        let Some(c) = effect.saga.as_deref() else {
            return Err(saga_error(run_id, key, "no compensation of it began"));
        };
        if attempt != c.attempts || effect.status != Status::Compensating {
            if attempt != 0 && attempt <= c.attempts && effect.status != Status::Compensating {
                // A repeated report of an attempt already ended: its answer is the current one.
                // Attempts are numbered from 1: attempt 0 never began, so it is not a repeat.
                return Ok((reply(effect), false));
            }
            return Err(saga_error(
                run_id,
                key,
                format!(
                    "attempt {attempt} of its compensation is not under way (attempt {} is, \
                     and it is {})",
                    c.attempts,
                    effect.status.kind()
                ),
            ));
        }
        let to = match outcome {
            Outcome::Ok => Status::Compensated,
            // Never a blind retry: whether the undo landed is for a human to find out.
            Outcome::Unknown => Status::NeedsHuman,
            Outcome::Error if attempt >= c.granted => Status::NeedsHuman,
            Outcome::Error => Status::CompensationFailed,
        };
        check_effect(run_id, key, Some(effect.status), to)?;
        let settled = settles_after(run, run_id, key, to)?;
        let e = self.effect_mut(run_id, key);
        let c = e.saga.as_mut().expect("a compensation began");
        c.note = error.clone();
        if to == Status::CompensationFailed {
            c.retry_at = now.saturating_add(backoff_ms(attempt));
        }
        e.status = to;
        e.updated_at = now;
        let answer = reply(e);
        ev.push(|| event(run_id, Some(key), EventKind::Compensation));
        self.settle_saga(run_id, settled, ev);
        Ok((answer, true))
    }

    /// `Saga`: an operator settles an unknown outcome, retries, skips or asks for a
    /// compensation.
    pub(crate) fn saga_action(
        &mut self,
        now: u64,
        p: &Principal,
        run_id: &RunId,
        key: &EffectKey,
        action: &SagaAction,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        if p.role != Role::Operator {
            return Err(KernelError::Forbidden);
        }
        self.saga_text_bounded(run_id, key, action)?;
        let (run, effect) = self.visible_effect(p, run_id, key)?;
        if let Some(retry) = steps::lookup_retry(run_id, key, effect, action) {
            retry?;
            return self.retry_lookup(now, p, run_id, key, ev);
        }
        if *action == SagaAction::Compensate {
            return self.compensate_one(now, p, run_id, key, ev);
        }
        if *action == SagaAction::Retry {
            undo::awaiting(run_id, key, effect)?;
        }
        let to = saga_target(run, run_id, key, effect, action)?;
        check_effect(run_id, key, Some(effect.status), to)?;
        // A call left in flight that an operator settles is no longer in flight.
        let landed = effect.status == Status::Started;
        let settled = settles(
            run_id,
            run.state,
            run.in_flight - u32::from(landed),
            open_after(run, key, to),
            run.stop.as_ref(),
        )?;
        if landed {
            self.runs.get_mut(run_id).expect("visible run").in_flight -= 1;
        }
        let e = self.effect_mut(run_id, key);
        match action {
            SagaAction::Settle { outcome, result } => {
                // What the operator found replaces the unknown: a result lets a compensation
                // built from `result` be built; the agent's error stays for the record.
                let error = e.outcome.as_ref().and_then(|o| o.error.clone());
                if result.is_some() || error.is_some() {
                    e.outcome = Some(Box::new(crate::state::OutcomeRecord {
                        outcome: Some(*outcome),
                        result: result.clone(),
                        error,
                    }));
                }
            }
            SagaAction::Retry => {
                let c = e.saga.get_or_insert_with(fresh);
                c.granted = c.attempts + COMPENSATION_ATTEMPTS_MAX;
                c.retry_at = now;
                c.by = Some(p.name.clone());
                // A rejected or expired approval is spent: the next attempt asks for a new one
                // if the policy still holds the call. A met one still stands.
                if c.approval.as_ref().is_some_and(|a| !a.satisfied()) {
                    c.approval = None;
                }
            }
            SagaAction::Skip { reason } => {
                let c = e.saga.get_or_insert_with(fresh);
                c.note = Some(reason.clone());
                c.by = Some(p.name.clone());
            }
            SagaAction::Compensate => unreachable!("answered above"),
        }
        e.status = to;
        e.updated_at = now;
        let answer = reply(e);
        ev.push(|| event(run_id, Some(key), EventKind::Compensation));
        self.settle_saga(run_id, settled, ev);
        Ok((answer, true))
    }

    /// The operator's text (a skip's reason, a settle's result) within its bound; a skip needs one.
    fn saga_text_bounded(
        &self,
        run_id: &RunId,
        key: &EffectKey,
        action: &SagaAction,
    ) -> Result<(), KernelError> {
        match action {
            SagaAction::Skip { reason } => {
                crate::gate::bounded(
                    &Some(reason.clone()),
                    self.limits.reason_bytes_max,
                    "reason_bytes_max",
                )?;
                if reason.trim().is_empty() {
                    return Err(saga_error(run_id, key, "a skip needs a reason"));
                }
                Ok(())
            }
            SagaAction::Settle { result, .. } => {
                crate::gate::bounded(result, self.limits.result_bytes_max, "result_bytes_max")
            }
            SagaAction::Retry | SagaAction::Compensate => Ok(()),
        }
    }

    /// `Saga compensate`: an operator asks for the compensation of one effect of a run stopped
    /// without a saga; the effect gets a saga of its own (an unknown outcome is settled first,
    /// by its lookup or a human). Asked again while it is open, it answers as it stands.
    fn compensate_one(
        &mut self,
        now: u64,
        p: &Principal,
        run_id: &RunId,
        key: &EffectKey,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        let (run, effect) = self.visible_effect(p, run_id, key)?;
        if effect.compensate.is_none() {
            return Err(saga_error(
                run_id,
                key,
                "compensate: it declares no compensating tool",
            ));
        }
        if run.stop.is_none() {
            return Err(saga_error(
                run_id,
                key,
                "compensate: its run is not stopped (cancel it, or kill or close it first)",
            ));
        }
        if applies(run) {
            return Err(saga_error(
                run_id,
                key,
                "compensate: its run was cancelled, so its saga compensates it (retry or skip \
                 it there)",
            ));
        }
        if chosen(effect) && open(effect) {
            return Ok((reply(effect), false));
        }
        if !matches!(effect.status, Status::Completed | Status::Unknown) {
            return Err(saga_error(
                run_id,
                key,
                format!("compensate: it is {}", effect.status.kind()),
            ));
        }
        let e = self.effect_mut(run_id, key);
        let c = e.saga.get_or_insert_with(fresh);
        c.chosen = true;
        c.by = Some(p.name.clone());
        e.updated_at = now;
        let answer = reply(e);
        ev.push(|| event(run_id, Some(key), EventKind::Compensation));
        Ok((answer, true))
    }

    /// A finalizing run whose saga settled (and with nothing in flight) reaches its end,
    /// `settled` as `settles_after` planned it before the change.
    fn settle_saga(&mut self, run_id: &RunId, settled: Option<RunState>, ev: &mut Sink) {
        if let Some(to) = settled {
            let run = self.runs.get_mut(run_id).expect("run exists");
            run.state = to;
            ev.push(|| event(run_id, None, EventKind::Settled));
        }
    }

    /// The saga's head and what it waits for (`None`: no saga, or it is settled).
    pub fn saga_next(&self, run_id: &RunId) -> Option<(&EffectKey, Next)> {
        next(self.runs.get(run_id)?)
    }
}
