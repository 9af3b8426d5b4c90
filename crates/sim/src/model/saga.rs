//! The reverse saga in the reference model, written from docs/PROTOCOL.md (`cancel`,
//! `compensations`, `compensated`, `looked_up`, `saga`) and SPEC §4.8, not from the kernel's
//! `saga.rs`: after a cancel (never a kill) a run's compensable effects that did or may have
//! happened are undone newest first, one at a time; a call still in flight or of unknown
//! outcome blocks everything older until it is settled (by its lookup, else by a human); a
//! failed attempt is offered again after a backoff of 1 s doubling up to 5 minutes, and after
//! 5 failed attempts a human is asked; the run is `cancelled` only once nothing is left.
//! A compensating call a policy `approve` rule matches (docs/POLICY.md) is held before anything
//! is sent: an approval numbered among the run's, met by the rule's quorum of distinct
//! operators covering its groups (`decide`, as an admission's); rejected, or found expired by
//! the shell, the effect is `needs_human`; a retry is refused while it is open, spends it once
//! refused (the next attempt asks anew), and leaves a met one standing.
//! Nothing here is stored that can be derived: the saga's head is found again at every step.

use super::{Cause, Eff, MRun, Model, Res, St, changed, groups_covered, verdict};
use crate::world::{SagaOp, Who};
use estop_kernel::vocab::Outcome;

/// Attempts of one compensation before a human is asked (PROTOCOL `compensated`).
const ATTEMPTS: u32 = 5;

/// Where an effect's compensation stands once its saga began working on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    Compensating,
    Compensated,
    Failed,
    NeedsHuman,
    Skipped,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Compensating => "compensating",
            Phase::Compensated => "compensated",
            Phase::Failed => "compensation_failed",
            Phase::NeedsHuman => "needs_human",
            Phase::Skipped => "compensation_skipped",
        }
    }
}

/// The saga's counters of one effect.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Undo {
    /// Compensation attempts begun (numbered from 1).
    pub attempts: u32,
    /// Attempts allowed before a human is asked.
    pub granted: u32,
    /// When a failed attempt is offered again.
    pub retry_at: u64,
    /// Lookups begun (numbered from 1).
    pub lookups: u32,
    /// Lookups allowed before a human settles the outcome.
    pub lookups_granted: u32,
    /// The latest lookup has not reported.
    pub looking: bool,
    /// An operator asked for this one compensation (a run stopped without a saga).
    pub chosen: bool,
    /// The approval a policy `approve` rule asked for the compensating call (docs/POLICY.md),
    /// until a retry spends an unmet one.
    pub approval: Option<UndoApproval>,
}

/// The approval of a compensating call: numbered among the run's approvals, met by a quorum of
/// distinct operators covering the rule's groups, refused by one rejection or by its expiry.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct UndoApproval {
    pub id: u64,
    pub until: u64,
    pub quorum: u32,
    pub groups: &'static [&'static str],
    pub approvers: Vec<Who>,
    pub rejected: Option<Who>,
}

impl UndoApproval {
    /// Its quorum of distinct approvers, each of its groups among them.
    pub fn met(&self) -> bool {
        self.approvers.len() as u32 >= self.quorum && groups_covered(self.groups, &self.approvers)
    }
}

impl Default for Undo {
    fn default() -> Undo {
        Undo {
            attempts: 0,
            granted: ATTEMPTS,
            retry_at: 0,
            lookups: 0,
            lookups_granted: 1,
            looking: false,
            chosen: false,
            approval: None,
        }
    }
}

/// The wait after `failed` failed attempts: 1 s, doubling, at most 5 minutes.
fn backoff_ms(failed: u32) -> u64 {
    let mut ms: u64 = 1_000;
    for _ in 1..failed {
        ms = (ms * 2).min(300_000);
    }
    ms
}

/// What the saga's head waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// Its agent's report (it is in flight).
    Agent,
    /// Lookup `n` may begin.
    Lookup(u32),
    /// Lookup `n` is under way.
    LookingUp(u32),
    /// Attempt `n` may begin from `at`.
    Begin(u32, u64),
    /// Approval `id` of the compensating call, open until `until`, is decided by operators.
    Approval(u64, u64),
    /// Attempt `n` is under way.
    Running(u32),
    /// An operator settles its unknown outcome (no lookup may tell).
    Settle,
    /// An operator (the attempts' bound, an undo of unknown outcome, a refusal).
    Human,
}

impl Wait {
    /// As docs/PROTOCOL.md's report names it (`saga_next`), with its numbers.
    fn text(self) -> String {
        match self {
            Wait::Agent => "in_flight".into(),
            Wait::Settle => "settle".into(),
            Wait::Lookup(n) => format!("lookup {n}"),
            Wait::LookingUp(n) => format!("looking_up {n}"),
            Wait::Begin(n, at) => format!("begin {n} at {at}"),
            Wait::Approval(id, until) => format!("approval #{id} until {until}"),
            Wait::Running(n) => format!("running {n}"),
            Wait::Human => "human".into(),
        }
    }
}

impl Eff {
    /// Whether the effect still owes its saga something: a compensable call that is in flight,
    /// of unknown outcome, done and not yet undone, or whose undo failed or waits for a human.
    pub fn owes(&self) -> bool {
        self.tool.compensable()
            && matches!(
                self.st,
                St::Started
                    | St::Done(Outcome::Ok)
                    | St::Done(Outcome::Unknown)
                    | St::Undo(Phase::Compensating | Phase::Failed | Phase::NeedsHuman)
            )
    }

    /// The approval its compensating call waits for: requested, neither met nor rejected, and
    /// the effect not moved on (still not undone: done, or its last attempt failed). Expired
    /// but not yet found so by the shell, it still holds the saga (and votes are refused).
    pub fn held_undo(&self) -> Option<&UndoApproval> {
        let a = self.undo.approval.as_ref()?;
        let waiting = matches!(self.st, St::Done(Outcome::Ok) | St::Undo(Phase::Failed));
        (waiting && a.rejected.is_none() && !a.met()).then_some(a)
    }

    fn looking(&self) -> bool {
        self.st == St::Done(Outcome::Unknown) && self.undo.looking
    }

    fn wait(&self) -> Wait {
        let u = &self.undo;
        if let Some(a) = self.held_undo() {
            return Wait::Approval(a.id, a.until);
        }
        match self.st {
            St::Started => Wait::Agent,
            St::Done(Outcome::Unknown) if self.tool.has_lookup() => {
                if u.looking {
                    Wait::LookingUp(u.lookups)
                } else if u.lookups < u.lookups_granted {
                    Wait::Lookup(u.lookups + 1)
                } else {
                    Wait::Settle
                }
            }
            St::Done(Outcome::Unknown) => Wait::Settle,
            St::Done(Outcome::Ok) | St::Undo(Phase::Failed) => {
                Wait::Begin(u.attempts + 1, u.retry_at)
            }
            St::Undo(Phase::Compensating) => Wait::Running(u.attempts),
            _ => Wait::Human,
        }
    }

    /// The answer of a compensation step: the status, the attempts, and when a failed one is
    /// offered again.
    fn undo_answer(&self) -> String {
        let retry = match self.st {
            St::Undo(Phase::Failed) => Some(self.undo.retry_at),
            _ => None,
        };
        format!(
            "compensation {} attempt={} retry_at={retry:?}",
            self.st.name(),
            self.undo.attempts
        )
    }

    /// The answer of a lookup step (its attempts are the lookups).
    fn lookup_answer(&self) -> String {
        format!(
            "compensation {} attempt={} retry_at=None",
            self.st.name(),
            self.undo.lookups
        )
    }
}

impl MRun {
    /// The saga's head: the newest (by admission) effect still owed something, of a cancelled
    /// run's whole saga, or among the effects an operator chose in a run stopped otherwise.
    pub fn head(&self) -> Option<u8> {
        let (cause, _) = self.stop?;
        let all = cause == Cause::Cancelled;
        self.effects
            .iter()
            .filter(|(_, e)| e.owes() && (all || e.undo.chosen))
            .max_by_key(|(_, e)| e.token.map(|t| t.1))
            .map(|(k, _)| *k)
    }

    /// The saga's head and what it waits for, as the view shows it.
    pub fn saga_next(&self) -> Option<(String, String)> {
        let key = self.head()?;
        Some((
            crate::world::KEYS[key as usize].to_string(),
            self.effects[&key].wait().text(),
        ))
    }

    /// Whether an effect an operator chose still owes its own saga (the run is then kept).
    pub fn chosen_open(&self) -> bool {
        self.stop.is_some_and(|(c, _)| c != Cause::Cancelled)
            && self.effects.values().any(|e| e.undo.chosen && e.owes())
    }

    /// What the head `key` waits for, if `key` is the head.
    fn head_waits(&self, key: u8) -> Option<Wait> {
        (self.head() == Some(key)).then(|| self.effects[&key].wait())
    }
}

impl Model {
    /// One saga step on effect `run/key`.
    pub(super) fn saga(&mut self, now: u64, who: Who, run: u8, key: u8, step: SagaOp) -> Res {
        if step.by_operator() && !who.is_operator() {
            return Err("forbidden");
        }
        let r = self.visible(who, run)?;
        let e = r.effects.get(&key).ok_or("not_found")?;
        let waits = r.head_waits(key);
        let stop = r.stop.map(|(cause, _)| (cause, r.stopped_at));
        let e = e.clone();
        let mut next = e.clone();
        let approvals = r.approvals_requested;
        let answer = match step {
            SagaOp::Begin { attempt } => {
                let attempt = u32::from(attempt);
                if e.st == St::Undo(Phase::Compensating) && e.undo.attempts == attempt {
                    return verdict(e.undo_answer());
                }
                match waits {
                    Some(Wait::Begin(due, at)) if due == attempt && now >= at => {}
                    _ => return Err("saga"),
                }
                next.st = St::Undo(Phase::Compensating);
                next.undo.attempts = attempt;
                next.undo_answer()
            }
            SagaOp::End { attempt, outcome } => {
                let attempt = u32::from(attempt);
                let running = e.st == St::Undo(Phase::Compensating);
                if !running || attempt != e.undo.attempts {
                    // The same report again answers as things stand; an attempt never begun,
                    // or not the one under way, is a conflict.
                    if !running && attempt != 0 && attempt <= e.undo.attempts {
                        return verdict(e.undo_answer());
                    }
                    return Err("saga");
                }
                next.st = St::Undo(match outcome {
                    Outcome::Ok => Phase::Compensated,
                    // Whether an undo landed is never guessed by a blind retry.
                    Outcome::Unknown => Phase::NeedsHuman,
                    Outcome::Error if attempt >= e.undo.granted => Phase::NeedsHuman,
                    Outcome::Error => {
                        next.undo.retry_at = now + backoff_ms(attempt);
                        Phase::Failed
                    }
                });
                next.undo_answer()
            }
            SagaOp::LookupBegin { attempt } => {
                let attempt = u32::from(attempt);
                if e.looking() && e.undo.lookups == attempt {
                    return verdict(e.lookup_answer());
                }
                if waits != Some(Wait::Lookup(attempt)) {
                    return Err("saga");
                }
                next.undo.lookups = attempt;
                next.undo.looking = true;
                next.lookup_answer()
            }
            SagaOp::LookupEnd { attempt, outcome } => {
                let attempt = u32::from(attempt);
                if !e.looking() || attempt != e.undo.lookups {
                    if !e.looking() && attempt != 0 && attempt <= e.undo.lookups {
                        return verdict(e.lookup_answer());
                    }
                    return Err("saga");
                }
                next.undo.looking = false;
                if outcome != Outcome::Unknown {
                    // Found (it happened) or not found (it did not): the lookup settles it.
                    next.st = St::Done(outcome);
                    next.outcome = Some(outcome);
                }
                next.lookup_answer()
            }
            SagaOp::Blocked { attempt } => {
                match waits {
                    Some(Wait::Begin(due, at)) if due == u32::from(attempt) && now >= at => {}
                    _ => return Err("saga"),
                }
                // Nothing was sent: no attempt is spent, a human is asked at once.
                next.st = St::Undo(Phase::NeedsHuman);
                next.undo_answer()
            }
            SagaOp::Held { attempt, of } => {
                match waits {
                    Some(Wait::Begin(due, at)) if due == u32::from(attempt) && now >= at => {}
                    _ => return Err("saga"),
                }
                // A met approval stands for every later attempt: it is not asked again.
                if e.undo
                    .approval
                    .as_ref()
                    .is_some_and(|a| a.rejected.is_none() && a.met())
                {
                    return Err("saga");
                }
                // Nothing is sent, no attempt is spent: an approval numbered among the run's.
                let (quorum, groups, expiry) = of.undo_approval();
                let id = approvals + 1;
                self.runs.get_mut(&run).expect("run").approvals_requested = id;
                next.undo.approval = Some(UndoApproval {
                    id,
                    until: now + expiry,
                    quorum,
                    groups,
                    approvers: vec![],
                    rejected: None,
                });
                next.undo_answer()
            }
            SagaOp::Expired { approval } => {
                match e.held_undo() {
                    Some(a) if a.id == u64::from(approval) && now >= a.until => {}
                    _ => return Err("saga"),
                }
                // Silence is no: a human is asked.
                next.st = St::Undo(Phase::NeedsHuman);
                next.undo_answer()
            }
            SagaOp::Unreported { after_ms } => {
                let Some((_, at)) = stop else {
                    return Err("saga");
                };
                if e.st != St::Started || now < at + u64::from(after_ms) {
                    return Err("saga");
                }
                next.st = St::Done(Outcome::Unknown);
                next.outcome = Some(Outcome::Unknown);
                next.lookup_answer()
            }
            SagaOp::Settle { outcome } => {
                let settles = match e.st {
                    St::Done(Outcome::Unknown) => !e.looking() && outcome != Outcome::Unknown,
                    St::Started => stop.is_some(),
                    _ => false,
                };
                if !settles {
                    return Err("saga");
                }
                next.st = St::Done(outcome);
                next.outcome = Some(outcome);
                next.undo_answer()
            }
            SagaOp::Retry if e.st == St::Done(Outcome::Unknown) && e.tool.has_lookup() => {
                // An inconclusive lookup is asked once more; never while one is due or under way.
                if e.looking() || e.undo.lookups < e.undo.lookups_granted {
                    return Err("saga");
                }
                next.undo.lookups_granted = e.undo.lookups + 1;
                next.lookup_answer()
            }
            SagaOp::Retry => {
                // A retry never stands in for the votes.
                if e.held_undo().is_some() {
                    return Err("undo_awaits_approval");
                }
                if !e.tool.compensable()
                    || !matches!(e.st, St::Undo(Phase::Failed | Phase::NeedsHuman))
                {
                    return Err("saga");
                }
                operator_retry(&mut next, now);
                next.undo_answer()
            }
            SagaOp::Skip => {
                let takes = matches!(
                    e.st,
                    St::Done(Outcome::Ok) | St::Undo(Phase::Failed | Phase::NeedsHuman)
                );
                if !e.tool.compensable() || !takes {
                    return Err("saga");
                }
                next.st = St::Undo(Phase::Skipped);
                next.undo_answer()
            }
            SagaOp::Compensate => {
                let Some((cause, _)) = stop else {
                    return Err("saga");
                };
                if !e.tool.compensable() || cause == Cause::Cancelled {
                    return Err("saga");
                }
                if e.undo.chosen && e.owes() {
                    return verdict(e.undo_answer());
                }
                if !matches!(e.st, St::Done(Outcome::Ok | Outcome::Unknown)) {
                    return Err("saga");
                }
                next.undo.chosen = true;
                next.undo_answer()
            }
        };
        *self.eff(run, key) = next;
        changed(answer)
    }

    /// `decide` on an effect whose compensating call awaits approval: an approval counted as an
    /// admission's (one per operator, the rule's groups), or a rejection that asks a human.
    pub(super) fn decide_undo(
        &mut self,
        now: u64,
        who: Who,
        run: u8,
        key: u8,
        approve: bool,
    ) -> Res {
        let e = self.eff(run, key);
        let a = e.undo.approval.as_mut().expect("held");
        if now >= a.until {
            return Err("not_awaiting_approval");
        }
        if !approve {
            a.rejected = Some(who);
            e.st = St::Undo(Phase::NeedsHuman);
            return changed("decided rejected".into());
        }
        if a.approvers.contains(&who) {
            return Err("duplicate_approver");
        }
        a.approvers.push(who);
        if a.met() {
            return changed("decided approved".into());
        }
        let missing: Vec<&str> = a
            .groups
            .iter()
            .copied()
            .filter(|g| !a.approvers.iter().any(|w| w.groups().contains(g)))
            .collect();
        changed(format!(
            "decided pending {}/{} missing=[{}]",
            a.approvers.len(),
            a.quorum,
            missing.join(",")
        ))
    }
}

/// An operator's `retry` of a compensation that failed or waits for a human: a fresh budget of
/// attempts, the next offered at once. The one place the model says how a compensation a
/// human was asked about (blocked by a `deny` rule, or its approval rejected or expired) goes
/// on; a compensation whose approval is open is never retried (`saga`'s `Retry`).
fn operator_retry(e: &mut Eff, now: u64) {
    // A rejected or expired approval is spent (the next attempt asks for a new one); a met one
    // still stands (a later retry of a failed attempt needs no new approval).
    if e.undo.approval.as_ref().is_some_and(|a| !a.met()) {
        e.undo.approval = None;
    }
    e.st = St::Undo(Phase::Failed);
    e.undo.granted = e.undo.attempts + ATTEMPTS;
    e.undo.retry_at = now;
}
