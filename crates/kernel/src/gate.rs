//! The transition function: `Gate::apply(now, principal, command)` (and `Gate::replay`, the same
//! transition without events, for recovery). Every check happens before any mutation, so a
//! command that returns an error has changed nothing.

use crate::command::{Admit, Command, PolicyDecision, SagaStep, Token};
use crate::ids::PrincipalName;
use crate::ids::Role;
use crate::ids::{EffectKey, Principal, RunId};
use crate::limits::Limits;
use crate::reply::{Applied, DecideStatus, Event, EventKind, KernelError, Reply, Verdict};
use crate::runs::{Due, Runs};
use crate::state::{
    Approval, Approver, Effect, OutcomeRecord, Run, Status, Stop, Tombstone, Usage,
};
use crate::tombstones::Tombstones;
use crate::transitions::{self, check_run, effect_legal};
use crate::vocab::{
    Decision, EffectClass, EffectStatus, HoldReason, Outcome, PolicyAction, RefusalReason,
    RunState, StopCause,
};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// The whole state of the gate. Commands touch one run, its ancestor chain and (for stops) its
/// descendants, never the rest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gate {
    pub(crate) runs: Runs,
    /// Fences of forgotten runs.
    pub(crate) tombstones: Tombstones,
    pub(crate) limits: Limits,
    pub(crate) interned: crate::state::Interner,
    /// Per owner: runs held in state and held effects (derived; absent when both are zero).
    usage: BTreeMap<PrincipalName, Usage>,
    /// The same per token: its own and all its sandboxes' (`PrincipalName::token_name`;
    /// derived, absent when both are zero).
    token_usage: BTreeMap<Box<str>, Usage>,
    /// Held effects in all runs (derived).
    held_total: u64,
}

/// `Gate::count` on the two maps (apart, so that a caller holding a run can count for it),
/// dropping entries that fall to zero.
fn count_in(
    usage: &mut BTreeMap<PrincipalName, Usage>,
    token_usage: &mut BTreeMap<Box<str>, Usage>,
    owner: &PrincipalName,
    runs: i64,
    held: i64,
) {
    fn apply(u: &mut Usage, runs: i64, held: i64) {
        u.runs = u
            .runs
            .checked_add_signed(runs)
            .expect("usage stays counted");
        u.held = u
            .held
            .checked_add_signed(held)
            .expect("usage stays counted");
    }
    let u = usage.entry(owner.clone()).or_default();
    apply(u, runs, held);
    if *u == Usage::default() {
        usage.remove(owner);
    }
    let token = owner.token_name();
    let t = token_usage.entry(token.into()).or_default();
    apply(t, runs, held);
    if *t == Usage::default() {
        token_usage.remove(token);
    }
}

/// What the parent chain of a run says (see `Gate::chain_flags`).
struct ChainFlags<'a> {
    overdue: Option<&'a RunId>,
    paused: bool,
    pending: bool,
}

/// Why `start` holds a prepared effect (a pause, then a pending approval for a write).
fn start_hold_in(chain: &ChainFlags, effect: &Effect) -> Option<HoldReason> {
    if chain.paused {
        Some(HoldReason::Paused)
    } else if effect.class == EffectClass::Write && chain.pending {
        Some(HoldReason::Sibling)
    } else {
        None
    }
}

/// What admission decided for an effect that is new or held behind a sibling or a pause.
enum Plan {
    /// The run is stopped; the effect is refused with the stop's reason.
    Fenced(RefusalReason),
    /// A deadline in the run's chain passed: fence that run's subtree first (planned).
    FenceDeadline(StopPlan),
    /// The run's effect budget is used up: fence it (planned).
    FenceBudget(StopPlan),
    /// The effect's model reservation would pass a limit in the run's chain: refused
    /// (`budget`), nothing fenced (a smaller call may still fit).
    OverBudget(Box<crate::reply::Over>),
    Refuse(RefusalReason),
    Hold(HoldReason),
    HoldApproval,
    Admit,
}

fn terminal_state(cause: StopCause) -> RunState {
    cause.terminal_state()
}

/// What a stop will do: each run of the subtree not stopped yet, parents before children, and
/// the state it moves to. Only `Gate::stop_plan` builds one, checking every move against the
/// table, so carrying it out (`Gate::stop_subtree`) cannot fail half-way.
struct StopPlan {
    root: RunId,
    cause: StopCause,
    moves: Vec<(RunId, RunState)>,
}

/// Where a command's events go: the caller's `Vec` (`apply`), or nowhere (`replay`). An event
/// is built by a closure only when it is kept, so replay clones no ids for them.
pub(crate) struct Sink<'a>(Option<&'a mut Vec<Event>>);

impl Sink<'_> {
    pub(crate) fn push(&mut self, event: impl FnOnce() -> Event) {
        if let Some(events) = &mut self.0 {
            events.push(event());
        }
    }
}

pub(crate) fn event(run: &RunId, key: Option<&EffectKey>, kind: EventKind) -> Event {
    Event {
        run: run.clone(),
        key: key.cloned(),
        kind,
        detail: None,
    }
}

pub(crate) fn check_effect(
    run: &RunId,
    key: &EffectKey,
    from: Option<Status>,
    to: Status,
) -> Result<(), KernelError> {
    transitions::check_effect(run, key, from.map(Status::kind), to.kind())
}

/// The terminal state a run in `state` with `in_flight` effects left after an outcome reaches:
/// a stopped run whose last effect in flight settled and whose saga (after a cancel) is not
/// open (`saga_open`, computed as it will be after the change). Checked before the change is
/// recorded, so a refusal changes nothing.
pub(crate) fn settles(
    run_id: &RunId,
    state: RunState,
    in_flight: u32,
    saga_open: bool,
    stop: Option<&Stop>,
) -> Result<Option<RunState>, KernelError> {
    if state != RunState::Finalizing || in_flight > 0 || saga_open {
        return Ok(None);
    }
    let stop = stop.expect("finalizing runs are stopped");
    let to = terminal_state(stop.cause);
    check_run(run_id, state, to)?;
    Ok(Some(to))
}

/// Refuses a per-effect verb from a part of the principal other than the one that admitted the
/// effect (`Effect::holder`).
fn holds(p: &Principal, run: &RunId, key: &EffectKey, e: &Effect) -> Result<(), KernelError> {
    if e.holder == p.part {
        return Ok(());
    }
    Err(KernelError::NotHolder {
        run: run.clone(),
        key: key.clone(),
        holder: e.holder.as_str(),
    })
}

/// Whether a repeated completion's `cost` is the one already charged (none charged and a zero
/// cost are the same).
fn same_cost(e: &Effect, cost: crate::command::Spend) -> bool {
    e.spend.as_ref().and_then(|s| s.cost).unwrap_or_default() == cost
}

fn outcome_name(o: Option<Outcome>) -> &'static str {
    o.map_or("none", Outcome::as_str)
}

/// Agents see only their own runs (and operator fences, which have no owner).
fn hidden_from(principal: &Principal, run: &Run) -> bool {
    hidden_owner(principal, &run.owner)
}

fn hidden_owner(principal: &Principal, owner: &Option<PrincipalName>) -> bool {
    principal.role == Role::Agent
        && owner
            .as_ref()
            .is_some_and(|o| !principal.name.sees_runs_of(o))
}

pub(crate) fn bounded(
    text: &Option<Box<str>>,
    max: usize,
    limit: &'static str,
) -> Result<(), KernelError> {
    match text {
        Some(t) if t.len() > max => Err(KernelError::limit(limit, max)),
        _ => Ok(()),
    }
}

impl Gate {
    pub fn new(limits: Limits) -> Gate {
        Gate::from_parts(
            Runs::default(),
            Tombstones::default(),
            limits,
            Default::default(),
        )
    }

    /// A gate of these runs and tombstones, its derived state computed (snapshot decoding).
    pub(crate) fn from_parts(
        runs: Runs,
        tombstones: Tombstones,
        limits: Limits,
        interned: crate::state::Interner,
    ) -> Gate {
        let mut usage: BTreeMap<PrincipalName, Usage> = BTreeMap::new();
        let mut token_usage: BTreeMap<Box<str>, Usage> = BTreeMap::new();
        let mut held_total = 0;
        for (_, run) in runs.iter() {
            held_total += u64::from(run.held);
            if let Some(owner) = &run.owner {
                for u in [
                    usage.entry(owner.clone()).or_default(),
                    token_usage.entry(owner.token_name().into()).or_default(),
                ] {
                    u.runs += 1;
                    u.held += u64::from(run.held);
                }
            }
        }
        Gate {
            runs,
            tombstones,
            limits,
            interned,
            usage,
            token_usage,
            held_total,
        }
    }

    /// The fence left of a forgotten run, if `id` is one.
    pub fn tombstone(&self, id: &RunId) -> Option<&Tombstone> {
        self.tombstones.get(id)
    }

    /// Fences of forgotten runs, oldest stop first.
    pub fn tombstones(&self) -> impl Iterator<Item = (&RunId, &Tombstone)> {
        self.tombstones.iter()
    }

    pub fn tombstone_count(&self) -> usize {
        self.tombstones.len()
    }

    /// A forgotten run's fence as the principal may see it (as `visible_run`).
    pub fn visible_tombstone(
        &self,
        principal: &Principal,
        id: &RunId,
    ) -> Result<&Tombstone, KernelError> {
        match self.tombstones.get(id) {
            Some(t) if !self.runs.contains_key(id) && !hidden_owner(principal, &t.owner) => Ok(t),
            _ => Err(KernelError::RunNotFound(id.clone())),
        }
    }

    /// What `owner` holds: runs not yet forgotten and held effects.
    pub fn usage(&self, owner: &PrincipalName) -> Usage {
        self.usage.get(owner).copied().unwrap_or_default()
    }

    /// What `owner`'s token and all its sandboxes hold together.
    pub fn token_usage(&self, owner: &PrincipalName) -> Usage {
        self.token_usage
            .get(owner.token_name())
            .copied()
            .unwrap_or_default()
    }

    /// Changes what `owner` holds by `runs` and `held` (signed), for it and for its token.
    fn count(&mut self, owner: &PrincipalName, runs: i64, held: i64) {
        count_in(&mut self.usage, &mut self.token_usage, owner, runs, held);
    }

    /// Held effects in all runs.
    pub fn held_count(&self) -> u64 {
        self.held_total
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Changes the bounds (after recovering under `Limits::for_replay`). State already over a
    /// new bound stays; new work is refused until it is back under.
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
    }

    pub fn run(&self, id: &RunId) -> Option<&Run> {
        self.runs.get(id)
    }

    pub fn runs(&self) -> impl Iterator<Item = (&RunId, &Run)> {
        self.runs.iter()
    }

    /// The runs after `after` in id order (every run without it): where a listing's page starts.
    pub fn runs_after(&self, after: Option<&RunId>) -> impl Iterator<Item = (&RunId, &Run)> {
        self.runs.iter_after(after)
    }

    pub fn run_count(&self) -> usize {
        self.runs.len()
    }

    /// A run as the principal may see it: agents see only their own runs (and operator fences).
    pub fn visible_run(&self, principal: &Principal, id: &RunId) -> Result<&Run, KernelError> {
        match self.runs.get(id) {
            Some(run) if !hidden_from(principal, run) => Ok(run),
            _ => Err(KernelError::RunNotFound(id.clone())),
        }
    }

    /// A visible run's effect, with its run: `RunNotFound` or `EffectNotFound` otherwise.
    pub(crate) fn visible_effect(
        &self,
        principal: &Principal,
        run_id: &RunId,
        key: &EffectKey,
    ) -> Result<(&Run, &Effect), KernelError> {
        let run = self.visible_run(principal, run_id)?;
        let effect = run
            .effects
            .get(key)
            .ok_or_else(|| KernelError::EffectNotFound(run_id.clone(), key.clone()))?;
        Ok((run, effect))
    }

    /// `visible_effect` for a verb only the effect's holder may send (`holds`).
    fn held_effect(
        &self,
        principal: &Principal,
        run_id: &RunId,
        key: &EffectKey,
    ) -> Result<(&Run, &Effect), KernelError> {
        let (run, effect) = self.visible_effect(principal, run_id, key)?;
        holds(principal, run_id, key, effect)?;
        Ok((run, effect))
    }

    /// `visible_run` for a command about to change the run (one lookup for both).
    fn visible_run_mut(
        &mut self,
        principal: &Principal,
        id: &RunId,
    ) -> Result<&mut Run, KernelError> {
        match self.runs.get_mut(id) {
            Some(run) if !hidden_from(principal, run) => Ok(run),
            _ => Err(KernelError::RunNotFound(id.clone())),
        }
    }

    /// The run and all its descendants, parents before children.
    pub fn subtree(&self, root: &RunId) -> Vec<RunId> {
        let mut out = vec![root.clone()];
        let mut i = 0;
        while i < out.len() {
            if let Some(run) = self.runs.get(&out[i]) {
                out.extend(run.children.iter().cloned());
            }
            i += 1;
        }
        out
    }

    /// The run's ancestors, nearest first.
    fn ancestors<'a>(&'a self, id: &RunId) -> impl Iterator<Item = (&'a RunId, &'a Run)> + 'a {
        let mut next = self.runs.get(id).and_then(|r| r.parent.as_ref());
        std::iter::from_fn(move || {
            let id = next?;
            let (k, run) = self.runs.get_key_value(id)?;
            next = run.parent.as_ref();
            Some((k, run))
        })
    }

    fn chain<'a>(&'a self, id: &'a RunId) -> impl Iterator<Item = (&'a RunId, &'a Run)> + 'a {
        self.runs
            .get_key_value(id)
            .into_iter()
            .chain(self.ancestors(id))
    }

    /// Why `start` of a prepared (admitted, not started) effect would be held now, if it would:
    /// what `wait` on such an effect waits for.
    pub fn start_hold(&self, run_id: &RunId, key: &EffectKey) -> Option<HoldReason> {
        let run = self.runs.get(run_id)?;
        let effect = run.effects.get(key)?;
        if effect.status != Status::Admitted || run.stop.is_some() {
            return None;
        }
        // Only pause and sibling matter here; the deadline is checked by `start` itself.
        start_hold_in(&self.chain_flags(run_id, run, 0), effect)
    }

    /// When time alone next changes this run (deadline or an approval's expiry).
    pub fn next_timer(&self, id: &RunId) -> Option<u64> {
        let run = self.runs.get(id)?;
        if run.stop.is_some() {
            return None;
        }
        let expiry = run.expiries.first().map(|(at, _)| *at);
        run.limits.deadline_at.into_iter().chain(expiry).min()
    }

    /// Applies one command at time `now` (Unix ms) on behalf of `principal`.
    pub fn apply(
        &mut self,
        now: u64,
        principal: &Principal,
        cmd: &Command,
    ) -> Result<Applied, KernelError> {
        let mut events = Vec::new();
        let (reply, changed) = self.step(now, principal, cmd, &mut Sink(Some(&mut events)))?;
        debug_assert!(
            changed || events.is_empty(),
            "events without a change: {events:?}"
        );
        Ok(Applied {
            reply,
            changed,
            events,
        })
    }

    /// `apply` for recovery: the same transition to the same state, but no events are built
    /// (nobody is subscribed yet), so replay allocates neither their `Vec` nor their ids.
    /// Returns whether the command changed the state.
    pub fn replay(
        &mut self,
        now: u64,
        principal: &Principal,
        cmd: &Command,
    ) -> Result<bool, KernelError> {
        let (_, changed) = self.step(now, principal, cmd, &mut Sink(None))?;
        Ok(changed)
    }

    fn step(
        &mut self,
        now: u64,
        principal: &Principal,
        cmd: &Command,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        // An observer reads; every command changes something or may (a recheck consumes an
        // approval), so none is an observer's.
        if principal.role == Role::Observer {
            return Err(KernelError::Forbidden);
        }
        // An executor runs the reverse saga's attempts and lookups, and nothing else.
        if principal.role == Role::Executor
            && !matches!(
                cmd,
                Command::CompensationBegin { .. }
                    | Command::CompensationEnd { .. }
                    | Command::SagaStep {
                        step: SagaStep::LookupBegin { .. } | SagaStep::LookupEnd { .. },
                        ..
                    }
            )
        {
            return Err(KernelError::Forbidden);
        }
        if let Some(run) = cmd.run()
            && !self.runs.contains_key(run)
            && let Some(t) = self.tombstones.get(run)
        {
            return self.on_tombstone(principal, cmd, run, t);
        }
        match cmd {
            Command::Admit(a) => self.admit(now, principal, a, ev),
            Command::Recheck { run, key } => {
                self.held_effect(principal, run, key)?;
                self.existing(now, run, key, ev)
            }
            Command::Start { run, key, token } => self.start(now, principal, run, key, *token, ev),
            Command::Complete {
                run,
                key,
                token,
                outcome,
                result,
                error,
                cost,
            } => self.complete(
                now, principal, run, key, *token, *outcome, result, error, *cost, ev,
            ),
            Command::Decide {
                run,
                key,
                decision,
                reason,
            } => self.decide(now, principal, run, key, *decision, reason, ev),
            Command::Cancel { run, reason, kill } => {
                self.cancel(now, principal, run, reason, *kill, ev)
            }
            Command::Pause { run } => self.pause(principal, run, true, ev),
            Command::Resume { run } => self.pause(principal, run, false, ev),
            Command::Close { run, failed } => self.close(now, principal, run, *failed, ev),
            Command::Tick { run } => self.tick(now, run, ev),
            Command::Compact {
                before,
                tombstones_before,
            } => self.compact(*before, *tombstones_before),
            Command::Token(_) => self.token(principal),
            Command::CompensationBegin {
                run,
                key,
                attempt,
                args,
            } => self.compensation_begin(now, principal, run, key, *attempt, args, ev),
            Command::CompensationEnd {
                run,
                key,
                attempt,
                outcome,
                error,
            } => self.compensation_end(now, principal, run, key, *attempt, *outcome, error, ev),
            Command::Saga { run, key, action } => {
                self.saga_action(now, principal, run, key, action, ev)
            }
            Command::SagaStep { run, key, step } => {
                self.saga_step(now, principal, run, key, step, ev)
            }
        }
    }

    /// A command on the id of a forgotten run: answered from its fence exactly as the stopped
    /// run answered (refused with its stop's reason, or its terminal state), or an error where
    /// it needs what was forgotten. Changes nothing.
    fn on_tombstone(
        &self,
        p: &Principal,
        cmd: &Command,
        id: &RunId,
        t: &Tombstone,
    ) -> Result<(Reply, bool), KernelError> {
        let operator_only = matches!(
            cmd,
            Command::Decide { .. }
                | Command::Pause { .. }
                | Command::Resume { .. }
                | Command::Cancel { kill: true, .. }
                | Command::Saga { .. }
        );
        if operator_only && p.role != Role::Operator {
            return Err(KernelError::Forbidden);
        }
        if hidden_owner(p, &t.owner) {
            return Err(KernelError::RunNotFound(id.clone()));
        }
        let state = t.cause.terminal_state();
        let refused = Reply::Verdict(Verdict::refused(t.cause.refusal()));
        let stopped = Reply::RunState {
            state,
            runs_changed: 0,
        };
        let invalid = |what| KernelError::InvalidState {
            run: id.clone(),
            state: state.as_str(),
            what,
        };
        let forgotten = |what| KernelError::Forgotten {
            run: id.clone(),
            what,
        };
        match cmd {
            Command::Admit(_) | Command::Recheck { .. } | Command::Start { .. } => {
                Ok((refused, false))
            }
            Command::Cancel { .. } | Command::Close { .. } | Command::Tick { .. } => {
                Ok((stopped, false))
            }
            Command::Pause { .. } => Err(invalid("pause")),
            Command::Resume { .. } => Err(invalid("resume")),
            Command::Decide { .. } => Err(forgotten("decide")),
            Command::Complete { .. } => Err(forgotten("complete")),
            Command::CompensationBegin { .. }
            | Command::CompensationEnd { .. }
            | Command::SagaStep { .. } => Err(forgotten("compensation")),
            Command::Saga { .. } => Err(forgotten("saga")),
            Command::Compact { .. } | Command::Token(_) => {
                unreachable!("compaction and token records name no run")
            }
        }
    }

    /// Whether `n` new runs fit: in the gate (agents may not take the operators' reserve),
    /// and in `owner`'s share.
    fn room_for_runs(
        &self,
        role: Role,
        owner: Option<&PrincipalName>,
        n: usize,
    ) -> Result<(), KernelError> {
        let l = &self.limits;
        let live = self.runs.len();
        if live + n > l.runs_max {
            if self.tombstones.len() >= l.tombstones_max {
                // Stopped runs are kept whole for want of tombstone room: say so.
                return Err(KernelError::limit("tombstones_max", l.tombstones_max));
            }
            return Err(KernelError::limit("runs_max", l.runs_max));
        }
        let reserve = l.runs_operator_reserve();
        if role == Role::Agent && live + n > l.runs_max - reserve {
            return Err(KernelError::Limit {
                limit: "runs_max",
                max: l.runs_max as u64,
                hint: "; the rest is reserved for operators (1%): close or cancel runs that are done, a stopped run is forgotten after the retention period",
            });
        }
        if let Some(owner) = owner {
            if self.usage(owner).runs as usize + n > l.runs_per_principal_max {
                return Err(KernelError::limit(
                    "runs_per_principal_max",
                    l.runs_per_principal_max,
                ));
            }
            if self.token_usage(owner).runs as usize + n > l.runs_per_token_max {
                return Err(KernelError::limit(
                    "runs_per_token_max",
                    l.runs_per_token_max,
                ));
            }
        }
        Ok(())
    }

    /// Adds a run that is not in the gate yet, counting it for its owner.
    fn add_run(&mut self, id: RunId, run: Run) {
        debug_assert!(
            run.held == 0 && run.effects.is_empty(),
            "a new run holds nothing"
        );
        if let Some(owner) = &run.owner {
            self.count(owner, 1, 0);
        }
        let old = self.runs.insert(id, run);
        assert!(old.is_none(), "a new run");
    }

    /// Whether one more effect of a run of `owner` may be held.
    fn room_for_held(&self, owner: Option<&PrincipalName>) -> Result<(), KernelError> {
        if self.held_total as usize >= self.limits.held_max {
            return Err(KernelError::limit("held_max", self.limits.held_max));
        }
        if let Some(owner) = owner {
            if self.usage(owner).held as usize >= self.limits.held_per_principal_max {
                return Err(KernelError::limit(
                    "held_per_principal_max",
                    self.limits.held_per_principal_max,
                ));
            }
            if self.token_usage(owner).held as usize >= self.limits.held_per_token_max {
                return Err(KernelError::limit(
                    "held_per_token_max",
                    self.limits.held_per_token_max,
                ));
            }
        }
        Ok(())
    }

    /// One effect of `run_id` became held (`up`) or stopped being held.
    fn held_changed(&mut self, run_id: &RunId, up: bool) {
        let run = self.runs.get_mut(run_id).expect("run exists");
        if up {
            run.held += 1;
            self.held_total += 1;
        } else {
            run.held -= 1;
            self.held_total -= 1;
        }
        if let Some(owner) = &run.owner {
            count_in(
                &mut self.usage,
                &mut self.token_usage,
                owner,
                0,
                if up { 1 } else { -1 },
            );
        }
    }

    /// Records a token change: only an operator makes one. The registry itself lives outside
    /// the gate's state, so this always changes the record and nothing else.
    fn token(&self, p: &Principal) -> Result<(Reply, bool), KernelError> {
        if p.role != Role::Operator {
            return Err(KernelError::Forbidden);
        }
        // Name and groups were checked and bounded by the registry before it got here.
        Ok((Reply::TokenRecorded, true))
    }

    // ---------------------------------------------------------------- admit

    fn admit(
        &mut self,
        now: u64,
        p: &Principal,
        a: &Admit,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        bounded(&a.args, self.limits.args_bytes_max, "args_bytes_max")?;
        spend::check_spend(a.reserve)?;
        // One lookup of the run for the common case (a run that exists and is not adopted
        // here); the prechecks only concern a run this admit creates or adopts.
        let existing = self.runs.get(&a.run);
        if existing.is_none_or(|r| fresh_for(a, r)) {
            self.precheck_held(now, p, a)?;
            self.precheck_fence(now, p, a)?;
        }
        let mut adopted = false;
        let run = if let Some(found) = existing {
            let mut run = found;
            if p.role == Role::Agent && run.owner.as_ref().is_some_and(|o| *o != p.name) {
                return Err(KernelError::RunNotFound(a.run.clone()));
            }
            if let Some(given) = &a.parent
                && run.parent.is_none()
                && run.effects.is_empty()
                && run.stop.is_none()
            {
                // A run that came into being as some sub-agent's parent learns its own parent
                // at its first admit, so a cancel of that ancestor reaches the whole tree.
                self.adopt(now, p, &a.run, given, ev)?;
                adopted = true;
                run = &self.runs[&a.run];
            }
            if let Some(given) = &a.parent
                && run.parent.as_ref() != Some(given)
                && run.stop.is_none()
            {
                return Err(KernelError::ParentMismatch {
                    run: a.run.clone(),
                    existing: run
                        .parent
                        .as_ref()
                        .map_or_else(|| "none".to_string(), |r| r.to_string()),
                    given: given.clone(),
                });
            }
            if let Some(effect) = run.effects.get(&a.key) {
                holds(p, &a.run, &a.key, effect)?;
                if effect.digest != a.digest {
                    return Ok((
                        Reply::Verdict(Verdict::refused(RefusalReason::Mismatch)),
                        false,
                    ));
                }
                if a.start {
                    // `start: true` is the start, also of an effect prepared before (by anyone
                    // with the same key and arguments): the repeat starts it at the commit
                    // point, as `start` would, never answering "admitted" for an effect that
                    // did not start (the client then runs it); a held one starts when admitted.
                    match effect.status {
                        Status::Admitted if run.stop.is_none() => {
                            let token = effect.token.expect("admitted effects carry a token");
                            return match self.start(now, p, &a.run, &a.key, token, ev)? {
                                (Reply::Verdict(Verdict::Go), changed) => {
                                    Ok((Reply::Verdict(Verdict::Admitted { token }), changed))
                                }
                                other => Ok(other),
                            };
                        }
                        Status::Held(_) | Status::Approved if !effect.start_on_admit => {
                            self.runs
                                .get_mut(&a.run)
                                .and_then(|r| r.effects.get_mut(&a.key))
                                .expect("the effect exists")
                                .start_on_admit = true;
                            let (reply, _) = self.existing(now, &a.run, &a.key, ev)?;
                            return Ok((reply, true));
                        }
                        _ => {}
                    }
                }
                return self.existing(now, &a.run, &a.key, ev);
            }
            if let Some(stop) = &run.stop {
                // Nothing new starts in a stopped run; the fence is already on record.
                return Ok((
                    Reply::Verdict(Verdict::refused(stop.cause.refusal())),
                    adopted,
                ));
            }
            if run.effects.len() >= self.limits.effects_per_run_max {
                return Err(KernelError::limit(
                    "effects_per_run_max",
                    self.limits.effects_per_run_max,
                ));
            }
            run
        } else {
            self.create_run(now, p, a)?;
            let run = &self.runs[&a.run];
            if let Some(stop) = &run.stop {
                return Ok((Reply::Verdict(Verdict::refused(stop.cause.refusal())), true));
            }
            run
        };
        // Insert the new effect, then run the same admission as a held effect's re-check.
        let tool = self.interned.tool(&a.tool);
        let rule = self.interned.rule(&a.policy.rule);
        let mut effect = Effect::new(now, tool, rule, a.digest, &a.policy, a.start);
        effect.holder = p.part;
        effect.args = a.args.as_deref().map(Arc::from);
        if !a.reserve.is_zero() {
            effect.spend = Some(Box::new(crate::state::EffectSpend {
                reserve: a.reserve,
                ..Default::default()
            }));
        }
        if a.policy.action == PolicyAction::Approve {
            effect.approval = Some(Box::new(new_approval(&a.policy)));
        }
        let plan = self.plan(now, &a.run, run, &effect)?;
        check_effect(&a.run, &a.key, None, planned_status(&plan, &effect))?;
        if matches!(plan, Plan::Hold(_) | Plan::HoldApproval) {
            self.room_for_held(run.owner.as_ref())?;
        }
        let run = self
            .runs
            .get_mut(&a.run)
            .ok_or_else(|| KernelError::RunNotFound(a.run.clone()))?;
        if let Plan::Admit = plan {
            // The common case, as `carry_out` would do it but with the effect put in the map in
            // its final state (one search of the run's effects fewer).
            let token = run.issue_token(effect.start_on_admit);
            effect.take_token(token, now);
            run.effects.insert(a.key.clone(), effect);
            self.count_reservation(&a.run, &a.key);
            ev.push(|| event(&a.run, Some(&a.key), EventKind::Admitted));
            return Ok((Reply::Verdict(Verdict::Admitted { token }), true));
        }
        // It enters held (its placeholder status, `Effect::new`); `carry_out` moves it on.
        debug_assert!(effect.status.is_held());
        run.effects.insert(a.key.clone(), effect);
        self.held_changed(&a.run, true);
        let verdict = self.carry_out(now, &a.run, &a.key, plan, ev);
        Ok((Reply::Verdict(verdict), true))
    }

    /// For an admit that creates or adopts its run before the effect is planned: when the
    /// effect could be held and there is no room for it, refuses up front, so the refusal
    /// leaves no run behind. (Conservative: such an effect might have been refused instead.)
    fn precheck_held(&self, now: u64, p: &Principal, a: &Admit) -> Result<(), KernelError> {
        let existing = self.runs.get(&a.run);
        let fresh = existing.is_none_or(|r| fresh_for(a, r));
        if !fresh {
            return Ok(()); // Planned before anything changes: `admit` checks exactly.
        }
        let parent = a
            .parent
            .as_ref()
            .and_then(|par| self.runs.get_key_value(par));
        if existing.is_some_and(|r| hidden_from(p, r))
            || parent.is_some_and(|(_, r)| hidden_from(p, r))
        {
            // Another principal's run: `admit` answers `not_found`, and this must not tell more.
            return Ok(());
        }
        let chain = parent.map(|(id, r)| self.chain_flags(id, r, now));
        let paused = chain.as_ref().is_some_and(|c| c.paused)
            || existing.is_some_and(|r| r.state == RunState::Paused);
        let pending = chain.as_ref().is_some_and(|c| c.pending);
        let may_hold = a.policy.action == PolicyAction::Approve
            || paused
            || (a.policy.class == EffectClass::Write && pending);
        if !may_hold {
            return Ok(());
        }
        self.room_for_held(existing.map_or(Some(&p.name), |r| r.owner.as_ref()))
    }

    /// For an admit that creates or adopts its run before the effect is planned: when the plan
    /// will fence a subtree (a deadline passed in the run's new chain, or the run's budget is
    /// spent), checks that stop's moves up front, so a refusal leaves no run created or adopted.
    /// (A stopped parent fences the run in `create_run` or `adopt`, which check it themselves.)
    fn precheck_fence(&self, now: u64, p: &Principal, a: &Admit) -> Result<(), KernelError> {
        let existing = self.runs.get(&a.run);
        let fresh = existing.is_none_or(|r| fresh_for(a, r));
        let parent = a
            .parent
            .as_ref()
            .and_then(|par| self.runs.get_key_value(par));
        if !fresh
            || existing.is_some_and(|r| hidden_from(p, r))
            || parent.is_some_and(|(_, r)| hidden_from(p, r) || r.stop.is_some())
        {
            // Planned before anything changes, answered `not_found`, or fenced on creation.
            return Ok(());
        }
        let above = parent.and_then(|(id, r)| self.chain_flags(id, r, now).overdue);
        let (limits, admitted) = existing.map_or((a.limits, 0), |r| (r.limits, r.admitted));
        let cause = if above.is_some() || limits.deadline_at.is_some_and(|d| now >= d) {
            StopCause::Deadline
        } else if limits.max_effects.is_some_and(|max| admitted >= max) {
            StopCause::Budget
        } else {
            return Ok(());
        };
        // The stop reaches the farthest overdue run's subtree, the run's own subtree under it.
        if let Some(root) = above {
            self.stop_plan(root, cause)?;
        }
        self.stop_plan(&a.run, cause).map(drop)
    }

    /// Gives a parentless, effectless run the parent its first admit names. Checks everything
    /// before changing anything; a stopped parent fences the adopted subtree at once.
    fn adopt(
        &mut self,
        now: u64,
        p: &Principal,
        run_id: &RunId,
        parent: &RunId,
        ev: &mut Sink,
    ) -> Result<(), KernelError> {
        let mismatch = || KernelError::ParentMismatch {
            run: run_id.clone(),
            existing: "none".into(),
            given: parent.clone(),
        };
        let subtree = self.subtree(run_id);
        if subtree.contains(parent) {
            return Err(mismatch());
        }
        if !self.runs.contains_key(parent)
            && let Some(t) = self.tombstones.get(parent)
        {
            // A forgotten parent's fence reaches the run that names it.
            if hidden_owner(p, &t.owner) {
                return Err(KernelError::RunNotFound(parent.clone()));
            }
            let stop = self.stop_plan(run_id, t.cause)?;
            self.runs.get_mut(run_id).expect("exists").parent = Some(parent.clone());
            self.stop_subtree(now, stop, None, None, ev);
            return Ok(());
        }
        // Height of the adopted subtree (1 for a run without children).
        let mut height = 1;
        let mut level = vec![run_id.clone()];
        while !level.is_empty() {
            let next: Vec<RunId> = level
                .iter()
                .filter_map(|r| self.runs.get(r))
                .flat_map(|r| r.children.iter().cloned())
                .collect();
            if !next.is_empty() {
                height += 1;
            }
            level = next;
        }
        let above = if self.runs.contains_key(parent) {
            self.visible_run(p, parent)?;
            self.chain(parent).count()
        } else {
            self.room_for_runs(p.role, Some(&p.name), 1)?;
            1
        };
        if above + height > self.limits.run_depth_max {
            return Err(KernelError::limit(
                "run_depth_max",
                self.limits.run_depth_max,
            ));
        }
        // A stopped parent fences the adopted subtree: planned (checked) before anything changes.
        let fence = match self.runs.get(parent).and_then(|r| r.stop.as_ref()) {
            Some(stop) => Some((self.stop_plan(run_id, stop.cause)?, stop.reason.clone())),
            None => None,
        };
        if !self.runs.contains_key(parent) {
            self.add_run(parent.clone(), Run::new(now, Some(p.name.clone()), None));
        }
        self.runs
            .get_mut(parent)
            .expect("exists")
            .children
            .push(run_id.clone());
        let adopted = self.runs.get_mut(run_id).expect("exists");
        adopted.parent = Some(parent.clone());
        // The adopted subtree's model spend now counts against its new ancestors too.
        let (spent, reserved) = (adopted.spent, adopted.reserved);
        self.each_in_chain(parent, |r| {
            r.spent = r.spent.saturating_add(spent);
            r.reserved = r.reserved.saturating_add(reserved);
        });
        if let Some((stop, reason)) = fence {
            self.stop_subtree(now, stop, reason, None, ev);
        }
        Ok(())
    }

    fn create_run(&mut self, now: u64, p: &Principal, a: &Admit) -> Result<(), KernelError> {
        // A parent that is neither a run nor a forgotten run's fence comes into being too.
        let new_runs =
            1 + usize::from(a.parent.as_ref().is_some_and(|par| {
                !self.runs.contains_key(par) && self.tombstones.get(par).is_none()
            }));
        self.room_for_runs(p.role, Some(&p.name), new_runs)?;
        if a.labels.len() > self.limits.labels_max {
            return Err(KernelError::limit("labels_max", self.limits.labels_max));
        }
        if a.labels
            .iter()
            .any(|(k, v)| k.len() + v.len() > self.limits.label_bytes_max)
        {
            return Err(KernelError::limit(
                "label_bytes_max",
                self.limits.label_bytes_max,
            ));
        }
        let inherited = match &a.parent {
            Some(parent) => self.new_runs_parent(now, p, &a.run, parent)?,
            None => None,
        };
        let mut run = Run::new(now, Some(p.name.clone()), a.parent.clone());
        if let Some(stop) = &inherited {
            // Born under a stopped parent, the run is fenced at once. (`new_runs_parent` changed
            // nothing when it returned a stop, so this refusal leaves nothing behind.)
            check_run(&a.run, run.state, terminal_state(stop.cause))?;
        }
        run.labels = a.labels.clone();
        run.limits = a.limits;
        if let Some(stop) = inherited {
            run.state = terminal_state(stop.cause);
            run.epoch += 1;
            run.stop = Some(stop);
        }
        if let Some(prun) = a.parent.as_ref().and_then(|p| self.runs.get_mut(p)) {
            prun.children.push(a.run.clone());
        }
        self.add_run(a.run.clone(), run);
        Ok(())
    }

    /// Checks the parent a new run names and returns the stop it inherits, if any: a live
    /// parent's, or a forgotten parent's (its tombstone). A parent nobody has seen yet comes
    /// into being (the last step: everything was checked before).
    fn new_runs_parent(
        &mut self,
        now: u64,
        p: &Principal,
        run: &RunId,
        parent: &RunId,
    ) -> Result<Option<Stop>, KernelError> {
        if parent == run {
            return Err(KernelError::ParentMismatch {
                run: run.clone(),
                existing: "none".into(),
                given: parent.clone(),
            });
        }
        if let Some(prun) = self.runs.get(parent) {
            self.visible_run(p, parent)?;
            let depth = 1 + self.chain(parent).count();
            if depth > self.limits.run_depth_max {
                return Err(KernelError::limit(
                    "run_depth_max",
                    self.limits.run_depth_max,
                ));
            }
            return Ok(prun.stop.as_ref().map(|stop| Stop {
                cause: stop.cause,
                reason: stop.reason.clone(),
                by: stop.by.clone(),
                at: now,
                from: Some(stop.from.clone().unwrap_or_else(|| parent.clone())),
            }));
        }
        if let Some(t) = self.tombstones.get(parent) {
            // A forgotten parent's fence: the sub-agent is born stopped, as under the run.
            if hidden_owner(p, &t.owner) {
                return Err(KernelError::RunNotFound(parent.clone()));
            }
            return Ok(Some(Stop {
                cause: t.cause,
                reason: None,
                by: None,
                at: now,
                from: Some(parent.clone()),
            }));
        }
        // A sub-agent may admit before its parent did: the parent run comes into being. A
        // sandbox's principal speaks for its own run's tree only: a parent it names is its
        // token's run (so the token that started the sandbox may use it).
        let owner = match p.name.token_name() {
            token if token.len() < p.name.as_str().len() => {
                PrincipalName::new(token).expect("a prefix of a valid name")
            }
            _ => p.name.clone(),
        };
        self.add_run(parent.clone(), Run::new(now, Some(owner), None));
        Ok(None)
    }

    /// Decides what happens to an effect that is new or held behind a sibling or a pause.
    /// The precedence order is the table in docs/PROTOCOL.md.
    fn plan(
        &self,
        now: u64,
        run_id: &RunId,
        run: &Run,
        effect: &Effect,
    ) -> Result<Plan, KernelError> {
        if let Some(stop) = &run.stop {
            return Ok(Plan::Fenced(stop.cause.refusal()));
        }
        // One walk up the parent chain answers every chain question below.
        let chain = self.chain_flags(run_id, run, now);
        if let Some(root) = chain.overdue {
            return Ok(Plan::FenceDeadline(
                self.stop_plan(root, StopCause::Deadline)?,
            ));
        }
        if run.rejected.contains(&effect.digest) {
            return Ok(Plan::Refuse(RefusalReason::Rejected));
        }
        if effect.action == PolicyAction::Deny {
            return Ok(Plan::Refuse(RefusalReason::Denied));
        }
        if run
            .limits
            .max_effects
            .is_some_and(|max| run.admitted >= max)
        {
            return Ok(Plan::FenceBudget(
                self.stop_plan(run_id, StopCause::Budget)?,
            ));
        }
        if let Some(s) = &effect.spend
            && let Some(over) = self.over_budget(run_id, run, s.reserve)
        {
            return Ok(Plan::OverBudget(Box::new(over)));
        }
        if chain.paused {
            return Ok(Plan::Hold(HoldReason::Paused));
        }
        if effect.action == PolicyAction::Approve && effect.status != Status::Approved {
            if run.pending_approvals as usize >= self.limits.pending_approvals_per_run_max {
                return Err(KernelError::limit(
                    "pending_approvals_per_run_max",
                    self.limits.pending_approvals_per_run_max,
                ));
            }
            return Ok(Plan::HoldApproval);
        }
        if effect.class == EffectClass::Write && chain.pending {
            return Ok(Plan::Hold(HoldReason::Sibling));
        }
        Ok(Plan::Admit)
    }

    /// The run and its ancestors in one walk: the farthest overdue run (its deadline passed and
    /// it is not stopped), whether any is paused, whether any has an approval pending.
    fn chain_flags<'a>(&'a self, run_id: &'a RunId, run: &'a Run, now: u64) -> ChainFlags<'a> {
        let mut flags = ChainFlags {
            overdue: None,
            paused: false,
            pending: false,
        };
        let mut at = Some((run_id, run));
        while let Some((id, r)) = at {
            if r.stop.is_none() && r.limits.deadline_at.is_some_and(|d| now >= d) {
                flags.overdue = Some(id);
            }
            flags.paused |= r.state == RunState::Paused;
            flags.pending |= r.pending_approvals > 0;
            at = r.parent.as_ref().and_then(|p| self.runs.get_key_value(p));
        }
        flags
    }

    /// Carries out a plan on an effect already in the run's map. Infallible: `plan` checked all.
    fn carry_out(
        &mut self,
        now: u64,
        run_id: &RunId,
        key: &EffectKey,
        plan: Plan,
        ev: &mut Sink,
    ) -> Verdict {
        match plan {
            Plan::Fenced(reason) | Plan::Refuse(reason) => {
                self.refuse_effect(now, run_id, key, reason);
                Verdict::refused(reason)
            }
            Plan::FenceDeadline(stop) => {
                self.stop_subtree(now, stop, None, None, ev);
                self.refuse_effect(now, run_id, key, RefusalReason::Deadline);
                Verdict::refused(RefusalReason::Deadline)
            }
            Plan::FenceBudget(stop) => {
                self.stop_subtree(now, stop, None, None, ev);
                self.refuse_effect(now, run_id, key, RefusalReason::Budget);
                Verdict::refused(RefusalReason::Budget)
            }
            Plan::OverBudget(over) => {
                self.refuse_effect(now, run_id, key, RefusalReason::Budget);
                Verdict::Refused {
                    reason: RefusalReason::Budget,
                    over: Some(over),
                }
            }
            Plan::Hold(reason) => {
                let e = self.effect_mut(run_id, key);
                e.status = Status::Held(reason);
                e.updated_at = now;
                ev.push(|| event(run_id, Some(key), EventKind::Held));
                Verdict::Held {
                    reason,
                    approval: None,
                    expires_at: None,
                }
            }
            Plan::HoldApproval => {
                let run = self.runs.get_mut(run_id).map(|r| {
                    r.pending_approvals += 1;
                    r.next_approval += 1;
                    r.next_approval - 1
                });
                let id = run.unwrap_or(0);
                let e = self.effect_mut(run_id, key);
                e.status = Status::Held(HoldReason::Approval);
                e.updated_at = now;
                let approval = e
                    .approval
                    .as_mut()
                    .expect("an effect held for approval has an approval");
                approval.id = id;
                approval.requested_at = now;
                approval.expires_at = now.saturating_add(approval.expiry_ms);
                let expires_at = approval.expires_at;
                if let Some(run) = self.runs.get_mut(run_id) {
                    run.expiries.insert((expires_at, key.clone()));
                }
                ev.push(|| event(run_id, Some(key), EventKind::Held));
                Verdict::Held {
                    reason: HoldReason::Approval,
                    approval: Some(id),
                    expires_at: Some(expires_at),
                }
            }
            Plan::Admit => {
                let run = self.runs.get_mut(run_id).expect("planned run exists");
                let e = run.effects.get(key).expect("planned effect exists");
                let start = e.start_on_admit;
                if e.status == Status::Approved
                    && let Some(a) = &e.approval
                {
                    run.expiries.remove(&(a.expires_at, key.clone()));
                }
                let token = run.issue_token(start);
                let e = run.effects.get_mut(key).expect("planned effect exists");
                debug_assert!(e.status.is_held(), "carried out from held or approved");
                e.take_token(token, now);
                self.held_changed(run_id, false);
                self.count_reservation(run_id, key);
                ev.push(|| event(run_id, Some(key), EventKind::Admitted));
                Verdict::Admitted { token }
            }
        }
    }

    pub(crate) fn effect_mut(&mut self, run: &RunId, key: &EffectKey) -> &mut Effect {
        self.runs
            .get_mut(run)
            .and_then(|r| r.effects.get_mut(key))
            .expect("effect exists")
    }

    fn refuse_effect(&mut self, now: u64, run_id: &RunId, key: &EffectKey, reason: RefusalReason) {
        let run = self.runs.get_mut(run_id).expect("run exists");
        let e = run.effects.get_mut(key).expect("effect exists");
        if e.status == Status::Held(HoldReason::Approval) {
            run.pending_approvals -= 1;
        }
        if matches!(
            e.status,
            Status::Held(HoldReason::Approval) | Status::Approved
        ) && let Some(a) = &e.approval
        {
            run.expiries.remove(&(a.expires_at, key.clone()));
        }
        let was_held = e.status.is_held();
        e.status = Status::Refused(reason);
        e.args = None;
        e.updated_at = now;
        if was_held {
            self.held_changed(run_id, false);
        }
        // Voided before it started: its reservation is free again.
        self.release_reservation(run_id, key);
    }

    /// A repeat `admit` of a known identity, or a `wait` re-check.
    fn existing(
        &mut self,
        now: u64,
        run_id: &RunId,
        key: &EffectKey,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        let run = self
            .runs
            .get(run_id)
            .ok_or_else(|| KernelError::RunNotFound(run_id.clone()))?;
        let effect = run
            .effects
            .get(key)
            .ok_or_else(|| KernelError::EffectNotFound(run_id.clone(), key.clone()))?;
        let verdict = |v| Ok((Reply::Verdict(v), false));
        match effect.status {
            Status::Refused(reason) => verdict(Verdict::refused(reason)),
            Status::Started => verdict(Verdict::Duplicate {
                status: EffectStatus::Started,
                outcome: None,
                result: None,
                error: None,
            }),
            Status::Completed
            | Status::Failed
            | Status::Unknown
            | Status::Compensating
            | Status::Compensated
            | Status::CompensationFailed
            | Status::NeedsHuman
            | Status::CompensationSkipped => verdict(receipt(effect)),
            Status::Admitted => {
                if let Some(stop) = &run.stop {
                    let reason = stop.cause.refusal();
                    check_effect(run_id, key, Some(effect.status), Status::Refused(reason))?;
                    self.refuse_effect(now, run_id, key, reason);
                    return Ok((Reply::Verdict(Verdict::refused(reason)), true));
                }
                // A lost reply costs nothing: the same token again.
                verdict(Verdict::Admitted {
                    token: effect.token.expect("admitted effects carry a token"),
                })
            }
            Status::Held(HoldReason::Approval) => {
                let approval = effect.approval.as_ref().expect("held for approval");
                if now >= approval.expires_at {
                    self.expire(now, run_id, key, ev);
                    return Ok((
                        Reply::Verdict(Verdict::refused(RefusalReason::Expired)),
                        true,
                    ));
                }
                verdict(Verdict::Held {
                    reason: HoldReason::Approval,
                    approval: Some(approval.id),
                    expires_at: Some(approval.expires_at),
                })
            }
            Status::Approved => {
                let expires_at = effect.approval.as_ref().map_or(0, |a| a.expires_at);
                let plan = self.plan(now, run_id, run, effect)?;
                match plan {
                    // An approved effect behind a pause or a sibling keeps its approval and waits.
                    Plan::Hold(reason) => verdict(Verdict::Held {
                        reason,
                        approval: None,
                        expires_at: None,
                    }),
                    Plan::Admit if now >= expires_at => {
                        self.expire(now, run_id, key, ev);
                        Ok((
                            Reply::Verdict(Verdict::refused(RefusalReason::Expired)),
                            true,
                        ))
                    }
                    plan => {
                        check_effect(
                            run_id,
                            key,
                            Some(effect.status),
                            planned_status(&plan, effect),
                        )?;
                        let verdict = self.carry_out(now, run_id, key, plan, ev);
                        Ok((Reply::Verdict(verdict), true))
                    }
                }
            }
            Status::Held(reason) => {
                let plan = self.plan(now, run_id, run, effect)?;
                match plan {
                    Plan::Hold(same) if same == reason => verdict(Verdict::Held {
                        reason,
                        approval: None,
                        expires_at: None,
                    }),
                    plan => {
                        check_effect(
                            run_id,
                            key,
                            Some(effect.status),
                            planned_status(&plan, effect),
                        )?;
                        let verdict = self.carry_out(now, run_id, key, plan, ev);
                        Ok((Reply::Verdict(verdict), true))
                    }
                }
            }
        }
    }

    fn expire(&mut self, now: u64, run_id: &RunId, key: &EffectKey, ev: &mut Sink) {
        self.refuse_effect(now, run_id, key, RefusalReason::Expired);
        ev.push(|| event(run_id, Some(key), EventKind::Expired));
    }

    // ---------------------------------------------------------------- start / complete

    fn start(
        &mut self,
        now: u64,
        p: &Principal,
        run_id: &RunId,
        key: &EffectKey,
        token: Token,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        let (run, effect) = self.held_effect(p, run_id, key)?;
        if effect.token != Some(token) {
            if let Status::Refused(reason) = effect.status {
                return Ok((Reply::Verdict(Verdict::refused(reason)), false));
            }
            return Err(KernelError::BadToken {
                run: run_id.clone(),
                key: key.clone(),
            });
        }
        match effect.status {
            Status::Admitted => {}
            Status::Refused(reason) => {
                return Ok((Reply::Verdict(Verdict::refused(reason)), false));
            }
            _ => return self.existing(now, run_id, key, ev),
        }
        if let Some(stop) = &run.stop {
            // The commit point: a token from before the cancel starts nothing (G4).
            let reason = stop.cause.refusal();
            self.refuse_effect(now, run_id, key, reason);
            return Ok((Reply::Verdict(Verdict::refused(reason)), true));
        }
        let chain = self.chain_flags(run_id, run, now);
        if let Some(root) = chain.overdue {
            let stop = self.stop_plan(root, StopCause::Deadline)?;
            self.stop_subtree(now, stop, None, None, ev);
            self.refuse_effect(now, run_id, key, RefusalReason::Deadline);
            return Ok((
                Reply::Verdict(Verdict::refused(RefusalReason::Deadline)),
                true,
            ));
        }
        if run.rejected.contains(&effect.digest) {
            // G2 at the commit point: the same call was rejected after this one was prepared.
            self.refuse_effect(now, run_id, key, RefusalReason::Rejected);
            return Ok((
                Reply::Verdict(Verdict::refused(RefusalReason::Rejected)),
                true,
            ));
        }
        if let Some(reason) = start_hold_in(&chain, effect) {
            let held = Verdict::Held {
                reason,
                approval: None,
                expires_at: None,
            };
            return Ok((Reply::Verdict(held), false));
        }
        check_effect(run_id, key, Some(Status::Admitted), Status::Started)?;
        let run = self.runs.get_mut(run_id).expect("visible run exists");
        run.in_flight += 1;
        let e = run.effects.get_mut(key).expect("effect exists");
        e.status = Status::Started;
        e.updated_at = now;
        Ok((Reply::Verdict(Verdict::Go), true))
    }

    #[allow(clippy::too_many_arguments)]
    fn complete(
        &mut self,
        now: u64,
        p: &Principal,
        run_id: &RunId,
        key: &EffectKey,
        token: Token,
        outcome: Outcome,
        result: &Option<Box<str>>,
        error: &Option<Box<str>>,
        cost: crate::command::Spend,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        let result_bytes_max = self.limits.result_bytes_max;
        spend::check_spend(cost)?;
        // One lookup: every check below reads through the same borrow before anything changes.
        let run = self.visible_run_mut(p, run_id)?;
        let to = match outcome {
            Outcome::Ok => Status::Completed,
            Outcome::Error => Status::Failed,
            Outcome::Unknown => Status::Unknown,
        };
        // Only a finalizing run can settle, so only its saga is looked at (the hot path is not).
        let saga_open = run.state == RunState::Finalizing && crate::saga::open_after(run, key, to);
        let effect = run
            .effects
            .get_mut(key)
            .ok_or_else(|| KernelError::EffectNotFound(run_id.clone(), key.clone()))?;
        holds(p, run_id, key, effect)?;
        if effect.token != Some(token) {
            return Err(KernelError::BadToken {
                run: run_id.clone(),
                key: key.clone(),
            });
        }
        bounded(result, result_bytes_max, "result_bytes_max")?;
        bounded(error, result_bytes_max, "result_bytes_max")?;
        let late = run.stop.is_some();
        let record = || {
            Box::new(OutcomeRecord {
                outcome: Some(outcome),
                result: result.clone(),
                error: error.clone(),
            })
        };
        match effect.status {
            Status::Started | Status::Unknown => {
                if effect.status == Status::Unknown && to == Status::Unknown {
                    return Ok((Reply::Completed { late }, false));
                }
                check_effect(run_id, key, Some(effect.status), to)?;
                let in_flight = run.in_flight - u32::from(effect.status == Status::Started);
                let settled = settles(run_id, run.state, in_flight, saga_open, run.stop.as_ref())?;
                if effect.status == Status::Started {
                    run.in_flight -= 1;
                }
                effect.status = to;
                // The status says the outcome; only a result or an error needs a record.
                effect.outcome = (result.is_some() || error.is_some()).then(record);
                effect.late |= late;
                effect.updated_at = now;
                ev.push(|| event(run_id, Some(key), EventKind::Completed));
                if let Some(to) = settled {
                    run.state = to;
                    ev.push(|| event(run_id, None, EventKind::Settled));
                }
                // Settled: the reservation is released and the cost charged (which may fence).
                self.release_reservation(run_id, key);
                self.charge(now, run_id, key, cost, ev);
                Ok((Reply::Completed { late }, true))
            }
            Status::Completed
            | Status::Failed
            | Status::Compensating
            | Status::Compensated
            | Status::CompensationFailed
            | Status::NeedsHuman
            | Status::CompensationSkipped => {
                if effect.outcome_kind() == Some(outcome) && same_cost(effect, cost) {
                    Ok((Reply::Completed { late: effect.late }, false))
                } else {
                    // Refused, and kept: a contradicting report is evidence, never dropped.
                    effect.disputes = effect.disputes.saturating_add(1);
                    let settled = effect.status.kind().as_str();
                    Ok((Reply::Disputed { settled }, true))
                }
            }
            Status::Refused(_) => {
                // It was voided before it started, yet the agent ran it: keep the fact, flag it.
                if effect.outcome.is_some() {
                    if effect.outcome_kind() == Some(outcome) && same_cost(effect, cost) {
                        return Ok((Reply::Completed { late: true }, false));
                    }
                    effect.disputes = effect.disputes.saturating_add(1);
                    let settled = outcome_name(effect.outcome_kind());
                    return Ok((Reply::Disputed { settled }, true));
                }
                effect.outcome = Some(record());
                effect.late = true;
                effect.updated_at = now;
                ev.push(|| event(run_id, Some(key), EventKind::Completed));
                // It ran after all: what it cost is charged.
                self.charge(now, run_id, key, cost, ev);
                Ok((Reply::Completed { late: true }, true))
            }
            _ => Err(KernelError::NotStarted {
                run: run_id.clone(),
                key: key.clone(),
            }),
        }
    }

    // ---------------------------------------------------------------- decide

    #[allow(clippy::too_many_arguments)]
    fn decide(
        &mut self,
        now: u64,
        p: &Principal,
        run_id: &RunId,
        key: &EffectKey,
        decision: Decision,
        reason: &Option<Box<str>>,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        if p.role != Role::Operator {
            return Err(KernelError::Forbidden);
        }
        bounded(reason, self.limits.reason_bytes_max, "reason_bytes_max")?;
        let run = self
            .runs
            .get(run_id)
            .ok_or_else(|| KernelError::RunNotFound(run_id.clone()))?;
        let effect = run
            .effects
            .get(key)
            .ok_or_else(|| KernelError::EffectNotFound(run_id.clone(), key.clone()))?;
        let not_awaiting = |status| KernelError::NotAwaitingApproval {
            run: run_id.clone(),
            key: key.clone(),
            status,
        };
        if crate::saga::held_approval(effect).is_some() {
            return self.decide_undo(now, p, run_id, key, decision, reason, ev);
        }
        if effect.status != Status::Held(HoldReason::Approval) {
            let status = match effect.status {
                Status::Held(HoldReason::Sibling) => "held behind a sibling",
                Status::Held(HoldReason::Paused) => "held by a pause",
                Status::Refused(r) => r.as_str(),
                s => s.kind().as_str(),
            };
            return Err(not_awaiting(status));
        }
        let approval = effect.approval.as_ref().expect("held for approval");
        if now >= approval.expires_at {
            return Err(not_awaiting("expired"));
        }
        match decision {
            Decision::Reject => {
                check_effect(
                    run_id,
                    key,
                    Some(effect.status),
                    Status::Refused(RefusalReason::Rejected),
                )?;
                self.reject(now, p, run_id, key, reason, ev);
                Ok((self.decided(run_id, key, DecideStatus::Rejected), true))
            }
            Decision::Approve => self.approve(now, p, run_id, key, reason, ev),
        }
    }

    /// Refuses an effect held for approval (checked by `decide`) and remembers its digest, so
    /// the same call is never admitted again in the run (G2).
    fn reject(
        &mut self,
        now: u64,
        p: &Principal,
        run_id: &RunId,
        key: &EffectKey,
        reason: &Option<Box<str>>,
        ev: &mut Sink,
    ) {
        let digest = self.runs[run_id].effects[key].digest;
        self.refuse_effect(now, run_id, key, RefusalReason::Rejected);
        let run = self.runs.get_mut(run_id).expect("run exists");
        run.rejected.insert(digest);
        let a = run
            .effects
            .get_mut(key)
            .and_then(|e| e.approval.as_mut())
            .expect("approval");
        a.rejected_by = Some(p.name.clone());
        a.reason = reason.clone();
        ev.push(|| event(run_id, Some(key), EventKind::Decided));
    }

    /// Adds `p`'s approval to an effect held for approval (unexpired, checked by `decide`);
    /// the effect is approved once the quorum and every group are met.
    fn approve(
        &mut self,
        now: u64,
        p: &Principal,
        run_id: &RunId,
        key: &EffectKey,
        reason: &Option<Box<str>>,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        let effect = &self.runs[run_id].effects[key];
        let approval = effect.approval.as_ref().expect("held for approval");
        let (next, status) = vote(approval, p, now, reason, run_id, key)?;
        if status == DecideStatus::Approved {
            check_effect(run_id, key, Some(effect.status), Status::Approved)?;
        }
        let answer = decided(&next, status.clone());
        let run = self.runs.get_mut(run_id).expect("run exists");
        let e = run.effects.get_mut(key).expect("effect exists");
        e.approval = Some(Box::new(next));
        e.updated_at = now;
        ev.push(|| event(run_id, Some(key), EventKind::Decided));
        if status == DecideStatus::Approved {
            e.status = Status::Approved;
            run.pending_approvals -= 1;
        }
        Ok((answer, true))
    }

    /// The answer to a decision just applied to `run_id/key`, with its approval as it is now.
    fn decided(&self, run_id: &RunId, key: &EffectKey, status: DecideStatus) -> Reply {
        let approval = self.runs[run_id].effects[key]
            .approval
            .as_deref()
            .expect("a decided effect has an approval");
        decided(approval, status)
    }

    // ---------------------------------------------------------------- stops

    fn cancel(
        &mut self,
        now: u64,
        p: &Principal,
        run_id: &RunId,
        reason: &Option<Box<str>>,
        kill: bool,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        if kill && p.role != Role::Operator {
            return Err(KernelError::Forbidden);
        }
        bounded(reason, self.limits.reason_bytes_max, "reason_bytes_max")?;
        if !self.runs.contains_key(run_id) {
            // An operator may fence a run id before its first admit; it then refuses every
            // admit. An agent may stop only runs it created: pre-fencing an id would let one
            // agent squat on another's run.
            if p.role == Role::Agent {
                return Err(KernelError::RunNotFound(run_id.clone()));
            }
            self.room_for_runs(p.role, None, 1)?;
        } else {
            self.visible_run(p, run_id)?;
        }
        let cause = if kill {
            StopCause::Killed
        } else {
            StopCause::Cancelled
        };
        self.stop_verb(now, run_id, cause, reason.clone(), p, ev)
    }

    /// Stops a visible run unless it is stopped already (a stop is idempotent and never undone).
    /// A run not in the gate yet (an operator's fence of an id before its first admit) is
    /// created, once the stop's every move has been checked.
    fn stop_verb(
        &mut self,
        now: u64,
        run_id: &RunId,
        cause: StopCause,
        reason: Option<Box<str>>,
        p: &Principal,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        if let Some(run) = self.runs.get(run_id)
            && run.stop.is_some()
        {
            let reply = Reply::RunState {
                state: run.state,
                runs_changed: 0,
            };
            return Ok((reply, false));
        }
        let stop = self.stop_plan(run_id, cause)?;
        if !self.runs.contains_key(run_id) {
            self.add_run(run_id.clone(), Run::new(now, None, None));
        }
        let n = self.stop_subtree(now, stop, reason, Some(p), ev);
        let reply = Reply::RunState {
            state: self.runs[run_id].state,
            runs_changed: n,
        };
        Ok((reply, true))
    }

    fn close(
        &mut self,
        now: u64,
        p: &Principal,
        run_id: &RunId,
        failed: bool,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        self.visible_run(p, run_id)?;
        let cause = if failed {
            StopCause::Failed
        } else {
            StopCause::Closed
        };
        self.stop_verb(now, run_id, cause, None, p, ev)
    }

    /// Plans a stop of `root` and every descendant not already stopped: each moves to
    /// finalizing (effects in flight) or its terminal state, and every move is checked against
    /// the table before the first is made. A root not in the gate yet is planned as the new run
    /// an operator's cancel creates (active, nothing in flight). Work is proportional to the
    /// size of the subtree, never to the whole gate.
    fn stop_plan(&self, root: &RunId, cause: StopCause) -> Result<StopPlan, KernelError> {
        let mut moves = Vec::new();
        for id in self.subtree(root) {
            let (from, in_flight) = match self.runs.get(&id) {
                Some(run) if run.stop.is_some() => continue,
                Some(run) => (run.state, run.in_flight),
                None if &id == root => (RunState::Active, 0),
                None => continue,
            };
            // A cancel (not a kill) owes the reverse saga of what already happened.
            let owes =
                cause == StopCause::Cancelled && self.runs.get(&id).is_some_and(crate::saga::owed);
            let to = if in_flight > 0 || owes {
                RunState::Finalizing
            } else {
                terminal_state(cause)
            };
            check_run(&id, from, to)?;
            moves.push((id, to));
        }
        Ok(StopPlan {
            root: root.clone(),
            cause,
            moves,
        })
    }

    /// Carries out a stop planned by `stop_plan`: fences each run (bumps the epoch, voids what
    /// has not started) and moves it as planned. Returns how many runs changed.
    fn stop_subtree(
        &mut self,
        now: u64,
        stop: StopPlan,
        reason: Option<Box<str>>,
        by: Option<&Principal>,
        ev: &mut Sink,
    ) -> u32 {
        let StopPlan { root, cause, moves } = stop;
        let refusal = cause.refusal();
        let mut changed = 0;
        for (id, to) in moves {
            let run = self.runs.get_mut(&id).expect("a planned run exists");
            run.epoch += 1;
            run.stop = Some(Stop {
                cause,
                reason: reason.clone(),
                by: by.map(|p| p.name.clone()),
                at: now,
                from: (id != root).then(|| root.clone()),
            });
            let mut released = crate::command::Spend::default();
            for e in run.effects.values_mut() {
                if e.status.is_held_or_prepared() {
                    debug_assert!(effect_legal(Some(e.status.kind()), EffectStatus::Refused));
                    // Voided before it started: its reservation is free again (one started
                    // and never completed keeps it: the worst case).
                    if let Some(s) = e.spend.as_deref_mut()
                        && std::mem::take(&mut s.counted)
                    {
                        released = released.saturating_add(s.reserve);
                    }
                    e.status = Status::Refused(refusal);
                    e.args = None;
                    e.updated_at = now;
                }
            }
            run.pending_approvals = 0;
            run.expiries.clear();
            // Every held effect was just refused.
            let held = u64::from(std::mem::take(&mut run.held));
            self.held_total -= held;
            if let Some(owner) = &run.owner {
                let held = i64::try_from(held).expect("held effects fit");
                count_in(&mut self.usage, &mut self.token_usage, owner, 0, -held);
            }
            run.state = to;
            changed += 1;
            self.release_in_chain(&id, released);
            self.runs.stopped(&id);
            let kind = match cause {
                StopCause::Closed | StopCause::Failed => EventKind::Closed,
                _ => EventKind::Cancelled,
            };
            ev.push(|| Event {
                run: id.clone(),
                key: None,
                kind,
                detail: Some(cause.as_str()),
            });
            if to == RunState::Finalizing {
                ev.push(|| Event {
                    run: id.clone(),
                    key: None,
                    kind: EventKind::Finalizing,
                    detail: Some(cause.as_str()),
                });
            }
        }
        changed
    }

    fn pause(
        &mut self,
        p: &Principal,
        run_id: &RunId,
        pause: bool,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        if p.role != Role::Operator {
            return Err(KernelError::Forbidden);
        }
        let run = self
            .runs
            .get(run_id)
            .ok_or_else(|| KernelError::RunNotFound(run_id.clone()))?;
        let (from, to) = match (run.state, pause) {
            (RunState::Active, true) => (RunState::Active, RunState::Paused),
            (RunState::Paused, false) => (RunState::Paused, RunState::Active),
            (RunState::Paused, true) | (RunState::Active, false) => {
                return Ok((
                    Reply::RunState {
                        state: run.state,
                        runs_changed: 0,
                    },
                    false,
                ));
            }
            (state, _) => {
                return Err(KernelError::InvalidState {
                    run: run_id.clone(),
                    state: state.as_str(),
                    what: if pause { "pause" } else { "resume" },
                });
            }
        };
        check_run(run_id, from, to)?;
        self.runs.get_mut(run_id).expect("run exists").state = to;
        let kind = if pause {
            EventKind::Paused
        } else {
            EventKind::Resumed
        };
        ev.push(|| event(run_id, None, kind));
        Ok((
            Reply::RunState {
                state: to,
                runs_changed: 1,
            },
            true,
        ))
    }

    fn tick(
        &mut self,
        now: u64,
        run_id: &RunId,
        ev: &mut Sink,
    ) -> Result<(Reply, bool), KernelError> {
        let run = self
            .runs
            .get(run_id)
            .ok_or_else(|| KernelError::RunNotFound(run_id.clone()))?;
        if run.stop.is_some() {
            return Ok((
                Reply::RunState {
                    state: run.state,
                    runs_changed: 0,
                },
                false,
            ));
        }
        let mut changed = 0;
        if let Some(root) = self.chain_flags(run_id, run, now).overdue {
            let stop = self.stop_plan(root, StopCause::Deadline)?;
            changed += self.stop_subtree(now, stop, None, None, ev);
        } else {
            let due: Vec<EffectKey> = run
                .effects
                .iter()
                .filter(|(_, e)| {
                    matches!(
                        e.status,
                        Status::Held(HoldReason::Approval) | Status::Approved
                    ) && e.approval.as_ref().is_some_and(|a| now >= a.expires_at)
                })
                .map(|(k, _)| k.clone())
                .collect();
            for key in due {
                self.expire(now, run_id, &key, ev);
                changed += 1;
            }
        }
        Ok((
            Reply::RunState {
                state: self.runs[run_id].state,
                runs_changed: changed,
            },
            changed > 0,
        ))
    }

    /// Retention. Drops the tombstones of runs stopped at or before `tombstones_before` (their
    /// ids are then unknown), then forgets the terminal runs stopped at or before `before`,
    /// oldest first, each leaving its fence as a tombstone (none if `tombstones_before` has
    /// passed for it too). A finalizing run waits for its effects. At `tombstones_max` no run
    /// is forgotten: a stopped run keeps its whole state rather than lose its fence. Visits
    /// only the runs and tombstones due, never the whole gate.
    fn compact(
        &mut self,
        before: u64,
        tombstones_before: u64,
    ) -> Result<(Reply, bool), KernelError> {
        let expired = self.tombstones.expire(tombstones_before);
        let mut room = self
            .limits
            .tombstones_max
            .saturating_sub(self.tombstones.len());
        let forgotten = self.runs.forget_stopped(before, |run| {
            let stop = run.stop.as_ref().expect("only stopped runs are visited");
            // A run whose saga (or an effect's own saga) is open is kept until it settles, and
            // one whose tree holds a model reservation until that call settles (so it is
            // released on the runs it was counted on: `gate/spend.rs`).
            if !run.state.is_terminal() || crate::saga::chosen_open(run) || !run.reserved.is_zero()
            {
                Due::Keep
            } else if stop.at <= tombstones_before {
                Due::Forget
            } else if room == 0 {
                Due::Halt // Later runs stopped later: none of them fits either.
            } else {
                room -= 1;
                Due::Forget
            }
        });
        let n = forgotten.len() as u32;
        // Children lists must not name forgotten runs: once a tombstone expires its id may
        // belong to a new, unrelated run, which a cancel of the old parent must not reach.
        let mut gone_children: BTreeMap<RunId, BTreeSet<RunId>> = BTreeMap::new();
        for (id, run) in forgotten {
            assert_eq!(run.held, 0, "a stopped run holds nothing");
            if let Some(owner) = &run.owner {
                assert!(self.usage.contains_key(owner), "owners are counted");
                self.count(owner, -1, 0);
            }
            if let Some(parent) = &run.parent
                && self.runs.contains_key(parent)
            {
                gone_children
                    .entry(parent.clone())
                    .or_default()
                    .insert(id.clone());
            }
            let stop = run.stop.expect("only stopped runs are forgotten");
            if stop.at > tombstones_before {
                let tombstone = Tombstone {
                    owner: run.owner,
                    cause: stop.cause,
                    epoch: run.epoch,
                    created_at: run.created_at,
                    stopped_at: stop.at,
                };
                self.tombstones.insert(id, tombstone);
            }
        }
        for (parent, gone) in gone_children {
            if let Some(run) = self.runs.get_mut(&parent) {
                run.children.retain(|c| !gone.contains(c));
            }
        }
        let reply = Reply::Compacted {
            runs: n,
            tombstones: expired,
        };
        Ok((reply, n > 0 || expired > 0))
    }
}

/// What a repeat admit of an effect that has its outcome gets: its status and outcome.
fn receipt(effect: &Effect) -> Verdict {
    let mut rec = effect.outcome.as_deref().cloned().unwrap_or_default();
    rec.outcome = effect.outcome_kind();
    Verdict::Duplicate {
        status: effect.status.kind(),
        outcome: rec.outcome,
        result: rec.result,
        error: rec.error,
    }
}

/// Whether `a` creates its run or adopts it (a run that came into being as some sub-agent's
/// parent, learning its own parent now): what the admit prechecks look at.
fn fresh_for(a: &Admit, r: &Run) -> bool {
    a.parent.is_some() && r.parent.is_none() && r.effects.is_empty() && r.stop.is_none()
}

/// `approval` with `p`'s vote added, and where that leaves it: the one way an approval is
/// given, whether it holds an admission or a compensating call (`saga::undo`). A quorum counts
/// distinct principals, so a second vote of the same principal is refused.
pub(crate) fn vote(
    approval: &Approval,
    p: &Principal,
    now: u64,
    reason: &Option<Box<str>>,
    run_id: &RunId,
    key: &EffectKey,
) -> Result<(Approval, DecideStatus), KernelError> {
    if approval.approvers.iter().any(|a| a.name == p.name) {
        return Err(KernelError::DuplicateApprover {
            run: run_id.clone(),
            key: key.clone(),
            principal: p.name.to_string(),
        });
    }
    let mut next = approval.clone();
    next.approvers.push(Approver {
        name: p.name.clone(),
        groups: p.groups.clone(),
        at: now,
    });
    if reason.is_some() {
        next.reason = reason.clone();
    }
    if next.satisfied() {
        return Ok((next, DecideStatus::Approved));
    }
    let missing_groups: Vec<Box<str>> = next
        .groups
        .iter()
        .filter(|g| !next.approvers.iter().any(|a| a.groups.contains(g)))
        .cloned()
        .collect();
    let status = DecideStatus::Pending {
        approvals: next.approvers.len() as u32,
        quorum: next.quorum,
        missing_groups,
    };
    Ok((next, status))
}

/// The answer to a decision, with the approval as it is after it.
pub(crate) fn decided(approval: &Approval, status: DecideStatus) -> Reply {
    Reply::Decided(crate::reply::Decided {
        status,
        approvers: approval.approvers.iter().map(|a| a.name.clone()).collect(),
        quorum: approval.quorum,
        requested_at: approval.requested_at,
    })
}

fn new_approval(p: &PolicyDecision) -> Approval {
    Approval {
        id: 0,
        quorum: p.quorum.max(1),
        groups: p.groups.clone(),
        expiry_ms: p.expiry_ms,
        requested_at: 0,
        expires_at: 0,
        approvers: Vec::new(),
        rejected_by: None,
        reason: None,
    }
}

fn planned_status(plan: &Plan, effect: &Effect) -> Status {
    match plan {
        Plan::Fenced(r) | Plan::Refuse(r) => Status::Refused(*r),
        Plan::FenceDeadline(_) => Status::Refused(RefusalReason::Deadline),
        Plan::FenceBudget(_) | Plan::OverBudget(_) => Status::Refused(RefusalReason::Budget),
        Plan::Hold(r) => Status::Held(*r),
        Plan::HoldApproval => Status::Held(HoldReason::Approval),
        Plan::Admit if effect.start_on_admit => Status::Started,
        Plan::Admit => Status::Admitted,
    }
}

mod spend;
#[cfg(test)]
mod tests;
