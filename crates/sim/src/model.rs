//! The reference model: the gate as SPEC §2–§3 and docs/PROTOCOL.md describe it, written
//! independently of `crates/kernel` and deliberately naive — flat maps, counters *derived* from
//! effect statuses instead of stored, one function per verb following the precedence table line
//! by line. It reads `Op`s of the small world directly. The differential runner and the model
//! checker compare it with the kernel after every step; where they disagree, one of them is wrong.

mod saga;

use crate::world::{
    Answer, BOGUS_TOKEN, EffectView, KEYS, Op, RUNS, RunView, SPEND_LIMIT_TOKENS, SPEND_LIMIT_USD,
    SagaView, Tok, Tool, View, Who, digest, parent_of, spend,
};
use estop_kernel::Digest;
use estop_kernel::vocab::Outcome;
pub use saga::{Phase, Undo};
use std::collections::{BTreeMap, BTreeSet};

/// How many approvals may await a decision in one run (the kernel's default bound).
pub const PENDING_PER_RUN_MAX: usize = 64;
/// The gate's bounds on runs, held effects and tombstones (docs/PROTOCOL.md "Limits").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bounds {
    pub runs_max: usize,
    pub runs_per_principal_max: usize,
    pub held_max: usize,
    pub held_per_principal_max: usize,
    pub tombstones_max: usize,
}

impl Default for Bounds {
    /// The defaults of `estop serve`.
    fn default() -> Bounds {
        Bounds {
            runs_max: 1_000_000,
            runs_per_principal_max: 500_000,
            held_max: 100_000,
            held_per_principal_max: 20_000,
            tombstones_max: 4_000_000,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Cause {
    Cancelled,
    Killed,
    Deadline,
    Budget,
    Closed,
    Failed,
}

impl Cause {
    fn name(self) -> &'static str {
        match self {
            Cause::Cancelled => "cancelled",
            Cause::Killed => "killed",
            Cause::Deadline => "deadline",
            Cause::Budget => "budget",
            Cause::Closed => "closed",
            Cause::Failed => "failed",
        }
    }
    /// What every later admission of a run stopped this way is told (PROTOCOL "refusal reasons").
    fn refusal(self) -> &'static str {
        match self {
            Cause::Cancelled | Cause::Killed => "cancelled",
            Cause::Deadline => "deadline",
            Cause::Budget => "budget",
            Cause::Closed | Cause::Failed => "closed",
        }
    }
    /// The terminal state a stopped run ends in once nothing is in flight.
    fn terminal(self) -> &'static str {
        match self {
            Cause::Closed => "completed",
            Cause::Failed => "failed",
            _ => "cancelled",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum St {
    /// `sibling`, `paused` or `approval`.
    Held(&'static str),
    Approved,
    Admitted,
    Started,
    Done(Outcome),
    Refused(&'static str),
    /// Done (`ok`) and taken up by the reverse saga.
    Undo(Phase),
}

impl St {
    /// The status's name as replies carry it.
    fn name(&self) -> &'static str {
        match self {
            St::Held(_) => "held",
            St::Approved => "approved",
            St::Admitted => "admitted",
            St::Started => "started",
            St::Done(Outcome::Ok) => "completed",
            St::Done(Outcome::Error) => "failed",
            St::Done(Outcome::Unknown) => "unknown",
            St::Refused(_) => "refused",
            St::Undo(p) => p.name(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Eff {
    pub tool: Tool,
    pub arg: u8,
    pub start_on_admit: bool,
    pub st: St,
    pub token: Option<(u32, u64)>,
    /// (id, expires_at, approvers) once an approval was requested.
    pub approval: Option<(u64, u64, Vec<Who>)>,
    pub late: bool,
    pub outcome: Option<Outcome>,
    /// The reverse saga's counters.
    pub undo: Undo,
    /// The model reservation its admission asked for, and whether it is counted on the run
    /// and its ancestors now (from its admission until it settles or is voided unstarted).
    pub reserve: (u64, u64),
    pub counted: bool,
    /// Its settled cost was charged, and what it was ((0, 0) until then).
    pub charged: bool,
    pub cost: (u64, u64),
    /// Completions refused for contradicting what was settled.
    pub disputes: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MRun {
    pub owner: Option<Who>,
    pub parent: Option<u8>,
    pub children: Vec<u8>,
    pub paused: bool,
    /// (cause, inherited from)
    pub stop: Option<(Cause, Option<u8>)>,
    /// When it was stopped (retention counts from here).
    pub stopped_at: u64,
    pub epoch: u32,
    pub deadline: Option<u64>,
    pub max_effects: Option<u64>,
    pub max_spend: Option<u64>,
    pub max_tokens: Option<u64>,
    /// The model spend of the run and its descendants: settled, and reserved (micro-USD,
    /// tokens).
    pub spent: (u64, u64),
    pub reserved: (u64, u64),
    pub admissions: u64,
    pub tokens_issued: u64,
    pub approvals_requested: u64,
    pub effects: BTreeMap<u8, Eff>,
    pub rejected: BTreeSet<Digest>,
}

impl MRun {
    fn new(owner: Option<Who>, parent: Option<u8>) -> MRun {
        MRun {
            owner,
            parent,
            children: vec![],
            paused: false,
            stop: None,
            stopped_at: 0,
            epoch: 1,
            deadline: None,
            max_effects: None,
            max_spend: None,
            max_tokens: None,
            spent: (0, 0),
            reserved: (0, 0),
            admissions: 0,
            tokens_issued: 0,
            approvals_requested: 0,
            effects: BTreeMap::new(),
            rejected: BTreeSet::new(),
        }
    }
    fn awaiting(&self) -> usize {
        self.effects
            .values()
            .filter(|e| e.st == St::Held("approval"))
            .count()
    }
    /// Whether an effect of the run is still owed something by its saga (`saga.rs`).
    fn owes(&self) -> bool {
        self.effects.values().any(Eff::owes)
    }

    fn flying(&self) -> usize {
        self.effects
            .values()
            .filter(|e| e.st == St::Started)
            .count()
    }
    /// The run-level state the spec names.
    fn state(&self) -> &'static str {
        match self.stop {
            Some(_) if self.flying() > 0 => "finalizing",
            // A cancel (never a kill) waits for the reverse saga of what happened.
            Some((Cause::Cancelled, _)) if self.owes() => "finalizing",
            Some((cause, _)) => cause.terminal(),
            None if self.paused => "paused",
            None => "active",
        }
    }
}

/// What is left of a forgotten run: its fence (docs/PROTOCOL.md "Runs end").
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Grave {
    pub owner: Option<Who>,
    pub cause: Cause,
    pub epoch: u32,
    pub stopped_at: u64,
}

/// The whole reference gate.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Model {
    pub runs: BTreeMap<u8, MRun>,
    /// Fences of forgotten runs, in the order the runs were forgotten.
    pub graves: Vec<(u8, Grave)>,
    pub bounds: Bounds,
}

type Res = Result<(String, bool), &'static str>;

fn verdict(s: String) -> Res {
    Ok((s, false))
}

fn changed(s: String) -> Res {
    Ok((s, true))
}

enum Decision {
    Refuse(&'static str),
    /// A model reservation that does not fit: the answer names the dimension and the run.
    OverBudget(String),
    FenceDeadline(u8),
    FenceBudget,
    Hold(&'static str),
    AskApproval,
    Admit,
}

impl Model {
    pub fn new() -> Model {
        Model::default()
    }

    pub fn with_bounds(bounds: Bounds) -> Model {
        Model {
            bounds,
            ..Model::default()
        }
    }

    /// Room for `n` new runs of `owner` (`None`: an operator's fence), asked by `who`: the
    /// gate's bound, minus the operators' reserve (1%, at least one) for agents, and the
    /// owner's share.
    fn room_for_runs(&self, who: Who, owner: Option<Who>, n: usize) -> Result<(), &'static str> {
        let b = &self.bounds;
        let live = self.runs.len();
        let reserve = b.runs_max.div_ceil(100).max(1).min(b.runs_max);
        let mine = self
            .runs
            .values()
            .filter(|r| r.owner.is_some() && r.owner == owner)
            .count();
        if live + n > b.runs_max
            || (!who.is_operator() && live + n > b.runs_max - reserve)
            || (owner.is_some() && mine + n > b.runs_per_principal_max)
        {
            return Err("limit");
        }
        Ok(())
    }

    /// Held effects (held or approved, not yet consumed) in the runs of `owner`, or in all.
    fn held(&self, owner: Option<Option<Who>>) -> usize {
        self.runs
            .values()
            .filter(|r| owner.is_none_or(|o| r.owner == o))
            .flat_map(|r| r.effects.values())
            .filter(|e| matches!(e.st, St::Held(_) | St::Approved))
            .count()
    }

    /// Room for one more held effect in a run of `owner`.
    fn room_for_held(&self, owner: Option<Who>) -> Result<(), &'static str> {
        if self.held(None) >= self.bounds.held_max
            || (owner.is_some() && self.held(Some(owner)) >= self.bounds.held_per_principal_max)
        {
            return Err("limit");
        }
        Ok(())
    }

    /// An admit that would create (or adopt) its run checks for room for a held effect first,
    /// whenever the effect could be held (approval asked, the parent's lineage paused or
    /// awaiting approval, the run itself paused), so a refusal leaves no run behind. Not for
    /// another principal's run or parent: that is `not_found`, answered later.
    fn precheck_held(&self, who: Who, run: u8, tool: Tool) -> Result<(), &'static str> {
        let parent = parent_of(run);
        let existing = self.runs.get(&run);
        let fresh = existing.is_none_or(|r| {
            parent.is_some() && r.parent.is_none() && r.effects.is_empty() && r.stop.is_none()
        });
        let hidden = |r: &MRun| !who.is_operator() && r.owner.is_some_and(|o| o != who);
        let live_parent = parent.filter(|p| self.runs.contains_key(p));
        if !fresh
            || existing.is_some_and(hidden)
            || live_parent.is_some_and(|p| hidden(&self.runs[&p]))
        {
            return Ok(());
        }
        let paused = live_parent.is_some_and(|p| self.paused_lineage(p))
            || existing.is_some_and(|r| r.paused && r.stop.is_none());
        let pending = live_parent.is_some_and(|p| self.awaiting_lineage(p));
        let asks = matches!(tool, Tool::Refund | Tool::Wire | Tool::Payout);
        if asks || paused || (tool.is_write() && pending) {
            return self.room_for_held(existing.map_or(Some(who), |r| r.owner));
        }
        Ok(())
    }

    fn grave(&self, run: u8) -> Option<&Grave> {
        self.graves
            .iter()
            .find(|(id, _)| *id == run)
            .map(|(_, g)| g)
    }

    /// Applies one op; `None` for time passing (nothing to answer).
    pub fn apply(&mut self, now: u64, op: &Op) -> Option<Answer> {
        // SPEC §3: an observer reads and changes nothing; whatever it sends is refused.
        if op.who() == Some(Who::Olive) {
            return Some(Answer {
                text: "error forbidden".into(),
                changed: false,
            });
        }
        let r = match crate::world::run_of(op) {
            Some(run) if !self.runs.contains_key(&run) && self.grave(run).is_some() => {
                self.on_grave(op, run)
            }
            _ => self.apply_live(now, op)?,
        };
        Some(match r {
            Ok((text, changed)) => Answer { text, changed },
            Err(code) => Answer {
                text: format!("error {code}"),
                changed: false,
            },
        })
    }

    /// An op on the id of a forgotten run: answered from its fence as the stopped run would
    /// have answered; what needs the forgotten effects is not found. Nothing changes.
    fn on_grave(&self, op: &Op, run: u8) -> Res {
        let g = self.grave(run).expect("a grave");
        let (who, operator_only) = match *op {
            Op::Decide { who, .. } | Op::Pause { who, .. } | Op::Resume { who, .. } => (who, true),
            Op::Cancel { who, kill, .. } => (who, kill),
            Op::Admit { who, .. }
            | Op::Wait { who, .. }
            | Op::Start { who, .. }
            | Op::Complete { who, .. }
            | Op::Close { who, .. } => (who, false),
            Op::Tick { .. } => (Who::Alice, false),
            Op::Saga { who, step, .. } => (who, step.operators_only()),
            Op::Advance { .. } | Op::Compact { .. } => unreachable!("names no run"),
        };
        if operator_only && !who.is_operator() {
            return Err("forbidden");
        }
        if !who.is_operator() && g.owner.is_some_and(|o| o != who) {
            return Err("not_found");
        }
        match op {
            Op::Admit { .. } | Op::Wait { .. } | Op::Start { .. } => {
                verdict(format!("refused {}", g.cause.refusal()))
            }
            Op::Cancel { .. } | Op::Close { .. } | Op::Tick { .. } => {
                verdict(format!("run {} changed=0", g.cause.terminal()))
            }
            Op::Pause { .. } | Op::Resume { .. } => Err("invalid_state"),
            // The saga needs the forgotten effects.
            Op::Saga { .. } => Err("not_found"),
            _ => Err("not_found"),
        }
    }

    /// Retention: fences of runs stopped at or before `graves_before` go, from the oldest
    /// forgotten on; then stopped, settled runs stopped at or before `before` are forgotten,
    /// earliest stop first (then by id), each leaving a fence unless its own retention passed
    /// too; with no room for a fence, that run and every later one stay whole.
    fn compact(&mut self, before: u64, graves_before: u64) -> Res {
        let old = self.graves.len();
        let keep = self
            .graves
            .iter()
            .position(|(_, g)| g.stopped_at > graves_before)
            .unwrap_or(old);
        self.graves.drain(..keep);
        let dropped = old - self.graves.len();
        let mut due: Vec<(u64, &str, u8)> = self
            .runs
            .iter()
            .filter(|(_, r)| r.stop.is_some() && r.stopped_at <= before)
            .map(|(id, r)| (r.stopped_at, RUNS[*id as usize], *id))
            .collect();
        due.sort();
        let mut forgotten = 0;
        for (_, _, id) in due {
            let r = &self.runs[&id];
            // An effect an operator chose to compensate keeps its run until it is settled, and a
            // reservation outstanding in its tree keeps it until that call settles.
            if r.state() == "finalizing" || r.chosen_open() || r.reserved != (0, 0) {
                continue;
            }
            let needs_grave = r.stopped_at > graves_before;
            if needs_grave && self.graves.len() >= self.bounds.tombstones_max {
                break;
            }
            let r = self.runs.remove(&id).expect("due");
            if let Some(p) = r.parent
                && let Some(pr) = self.runs.get_mut(&p)
            {
                pr.children.retain(|c| *c != id);
            }
            if needs_grave {
                let (cause, _) = r.stop.expect("stopped");
                let grave = Grave {
                    owner: r.owner,
                    cause,
                    epoch: r.epoch,
                    stopped_at: r.stopped_at,
                };
                self.graves.push((id, grave));
            }
            forgotten += 1;
        }
        let text = format!("forgot {forgotten} dropped {dropped}");
        if forgotten + dropped > 0 {
            changed(text)
        } else {
            verdict(text)
        }
    }

    fn apply_live(&mut self, now: u64, op: &Op) -> Option<Res> {
        let r = match *op {
            Op::Advance { .. } => return None,
            Op::Compact {
                retention,
                grave_retention,
            } => self.compact(
                now.saturating_sub(u64::from(retention)),
                now.saturating_sub(u64::from(grave_retention)),
            ),
            Op::Admit {
                who,
                run,
                key,
                tool,
                arg,
                start,
                limits,
                reserve,
            } => self.admit(now, who, run, key, tool, arg, start, limits, reserve),
            Op::Wait { who, run, key } => self.wait(now, who, run, key),
            Op::Start { who, run, key, tok } => self.start(now, who, run, key, tok),
            Op::Complete {
                who,
                run,
                key,
                tok,
                outcome,
                cost,
            } => self.complete(now, who, run, key, tok, outcome, cost),
            Op::Decide {
                who,
                run,
                key,
                approve,
            } => self.decide(now, who, run, key, approve),
            Op::Cancel { who, run, kill } => self.cancel(now, who, run, kill),
            Op::Pause { who, run } => self.pause(who, run, true),
            Op::Resume { who, run } => self.pause(who, run, false),
            Op::Close { who, run, failed } => self.close(now, who, run, failed),
            Op::Tick { run } => self.tick(now, run),
            Op::Saga {
                who,
                run,
                key,
                step,
            } => self.saga(now, who, run, key, step),
        };
        Some(r)
    }

    /// An agent sees only its own runs (and fences an operator set on ids nobody owns).
    fn visible(&self, who: Who, run: u8) -> Result<&MRun, &'static str> {
        let r = self.runs.get(&run).ok_or("not_found")?;
        if !who.is_operator() && r.owner.is_some_and(|o| o != who) {
            return Err("not_found");
        }
        Ok(r)
    }

    /// The run, then its parent, grandparent, ...
    fn lineage(&self, run: u8) -> Vec<u8> {
        let mut out = vec![run];
        while let Some(p) = self
            .runs
            .get(out.last().expect("non-empty"))
            .and_then(|r| r.parent)
        {
            out.push(p);
        }
        out
    }

    fn descendants_and_self(&self, run: u8) -> Vec<u8> {
        let mut out = vec![run];
        let mut i = 0;
        while i < out.len() {
            if let Some(r) = self.runs.get(&out[i]) {
                out.extend(r.children.iter().copied());
            }
            i += 1;
        }
        out
    }

    /// G5: the farthest run up the lineage whose deadline has passed (and is not yet stopped).
    fn overdue_root(&self, run: u8, now: u64) -> Option<u8> {
        self.lineage(run).into_iter().rev().find(|id| {
            let r = &self.runs[id];
            r.stop.is_none() && r.deadline.is_some_and(|d| now >= d)
        })
    }

    fn paused_lineage(&self, run: u8) -> bool {
        self.lineage(run).iter().any(|id| self.runs[id].paused)
    }

    fn awaiting_lineage(&self, run: u8) -> bool {
        self.lineage(run)
            .iter()
            .any(|id| self.runs[id].awaiting() > 0)
    }

    /// G4: fence the run and its descendants; void what has not started.
    fn stop(&mut self, now: u64, root: u8, cause: Cause) -> u32 {
        let mut n = 0;
        for id in self.descendants_and_self(root) {
            let Some(r) = self.runs.get_mut(&id) else {
                continue;
            };
            if r.stop.is_some() {
                continue;
            }
            r.stop = Some((cause, (id != root).then_some(root)));
            r.stopped_at = now;
            r.epoch += 1;
            r.paused = false;
            let mut freed = (0, 0);
            for e in r.effects.values_mut() {
                if matches!(e.st, St::Held(_) | St::Approved | St::Admitted) {
                    e.st = St::Refused(cause.refusal());
                    if std::mem::take(&mut e.counted) {
                        freed = add(freed, e.reserve);
                    }
                }
            }
            self.count(id, |r| r.reserved = sub(r.reserved, freed));
            n += 1;
        }
        n
    }

    /// The run and the ancestors its model spend counts against: up the parent links while
    /// the parent is held and still lists the child (a parent forgotten, its id taken by a new
    /// run, is not the child's ancestor any more).
    fn spend_lineage(&self, run: u8) -> Vec<u8> {
        let mut out = vec![];
        let mut at = Some(run);
        while let Some(id) = at {
            let Some(r) = self.runs.get(&id) else { break };
            out.push(id);
            at = r
                .parent
                .filter(|p| self.runs.get(p).is_some_and(|pr| pr.children.contains(&id)));
        }
        out
    }

    /// Applies `f` to the run and each ancestor its spend counts against.
    fn count(&mut self, run: u8, f: impl Fn(&mut MRun)) {
        for id in self.spend_lineage(run) {
            f(self.runs.get_mut(&id).expect("held"));
        }
    }

    /// Frees a counted reservation of an effect voided before it started, or settled.
    fn release(&mut self, run: u8, key: u8) {
        let e = self.eff(run, key);
        if std::mem::take(&mut e.counted) {
            let rs = e.reserve;
            self.count(run, |r| r.reserved = sub(r.reserved, rs));
        }
    }

    /// Charges a settled cost once on the run and its ancestors, then fences the farthest
    /// run of the lineage, not yet stopped, whose limit the spend reached.
    fn charge(&mut self, now: u64, run: u8, key: u8, cost: u8) {
        let c = spend(cost);
        let e = self.eff(run, key);
        if c == (0, 0) || e.charged {
            return;
        }
        e.charged = true;
        e.cost = c;
        self.count(run, |r| r.spent = add(r.spent, c));
        let mut root = None;
        for id in self.spend_lineage(run) {
            let r = &self.runs[&id];
            let reached = r.max_spend.is_some_and(|l| r.spent.0 >= l)
                || r.max_tokens.is_some_and(|l| r.spent.1 >= l);
            if r.stop.is_none() && reached {
                root = Some(id);
            }
        }
        if let Some(root) = root {
            self.stop(now, root, Cause::Budget);
        }
    }

    /// The nearest run of the lineage whose limit `reserve` would pass (dollars first).
    fn over_budget(&self, run: u8, reserve: (u64, u64)) -> Option<String> {
        if reserve == (0, 0) {
            return None;
        }
        for id in self.spend_lineage(run) {
            let r = &self.runs[&id];
            let dims = [
                (
                    "model_usd",
                    r.max_spend,
                    r.spent.0 + r.reserved.0,
                    reserve.0,
                ),
                (
                    "model_tokens",
                    r.max_tokens,
                    r.spent.1 + r.reserved.1,
                    reserve.1,
                ),
            ];
            for (name, limit, used, more) in dims {
                if let Some(l) = limit
                    && used + more > l
                {
                    return Some(format!(
                        "refused budget {name} of {} used={used} limit={l}",
                        RUNS[id as usize]
                    ));
                }
            }
        }
        None
    }

    /// The admission checks of docs/PROTOCOL.md, rows 3–12, for an effect that is new or held.
    fn decide_admission(
        &self,
        now: u64,
        run: u8,
        tool: Tool,
        arg: u8,
        approved: bool,
        reserve: (u64, u64),
    ) -> Result<Decision, &'static str> {
        let r = &self.runs[&run];
        if let Some((cause, _)) = r.stop {
            return Ok(Decision::Refuse(cause.refusal()));
        }
        if let Some(root) = self.overdue_root(run, now) {
            return Ok(Decision::FenceDeadline(root));
        }
        if r.rejected.contains(&digest(tool, arg)) {
            return Ok(Decision::Refuse("rejected"));
        }
        if tool == Tool::Wipe {
            return Ok(Decision::Refuse("denied"));
        }
        if r.max_effects.is_some_and(|m| r.admissions >= m) {
            return Ok(Decision::FenceBudget);
        }
        if let Some(answer) = self.over_budget(run, reserve) {
            return Ok(Decision::OverBudget(answer));
        }
        if self.paused_lineage(run) {
            return Ok(Decision::Hold("paused"));
        }
        if matches!(tool, Tool::Refund | Tool::Wire | Tool::Payout) && !approved {
            if r.awaiting() >= PENDING_PER_RUN_MAX {
                return Err("limit");
            }
            return Ok(Decision::AskApproval);
        }
        if tool.is_write() && self.awaiting_lineage(run) {
            return Ok(Decision::Hold("sibling"));
        }
        Ok(Decision::Admit)
    }

    /// Carries out an admission decision for the effect `run/key` (already in the map).
    fn carry(&mut self, now: u64, run: u8, key: u8, d: Decision) -> String {
        match d {
            Decision::Refuse(why) => {
                self.eff(run, key).st = St::Refused(why);
                format!("refused {why}")
            }
            Decision::OverBudget(answer) => {
                self.eff(run, key).st = St::Refused("budget");
                answer
            }
            Decision::FenceDeadline(root) => {
                self.stop(now, root, Cause::Deadline);
                self.eff(run, key).st = St::Refused("deadline");
                "refused deadline".into()
            }
            Decision::FenceBudget => {
                self.stop(now, run, Cause::Budget);
                self.eff(run, key).st = St::Refused("budget");
                "refused budget".into()
            }
            Decision::Hold(why) => {
                self.eff(run, key).st = St::Held(why);
                format!("held {why}")
            }
            Decision::AskApproval => {
                let r = self.runs.get_mut(&run).expect("run");
                r.approvals_requested += 1;
                let id = r.approvals_requested;
                let e = r.effects.get_mut(&key).expect("effect");
                let until = now + e.tool.expiry_ms();
                e.approval = Some((id, until, vec![]));
                e.st = St::Held("approval");
                format!("held approval #{id} until {until}")
            }
            Decision::Admit => {
                let r = self.runs.get_mut(&run).expect("run");
                r.admissions += 1;
                r.tokens_issued += 1;
                let token = (r.epoch, r.tokens_issued);
                let e = r.effects.get_mut(&key).expect("effect");
                e.token = Some(token);
                e.st = if e.start_on_admit {
                    St::Started
                } else {
                    St::Admitted
                };
                let rs = e.reserve;
                if rs != (0, 0) {
                    e.counted = true;
                    self.count(run, |r| r.reserved = add(r.reserved, rs));
                }
                format!("admitted {}.{}", token.0, token.1)
            }
        }
    }

    fn eff(&mut self, run: u8, key: u8) -> &mut Eff {
        self.runs
            .get_mut(&run)
            .and_then(|r| r.effects.get_mut(&key))
            .expect("effect exists")
    }

    #[allow(clippy::too_many_arguments, clippy::map_entry)]
    fn admit(
        &mut self,
        now: u64,
        who: Who,
        run: u8,
        key: u8,
        tool: Tool,
        arg: u8,
        start: bool,
        limits: u8,
        reserve: u8,
    ) -> Res {
        let parent = parent_of(run);
        self.precheck_held(who, run, tool)?;
        let mut adopted = false;
        if self.runs.contains_key(&run) {
            let r = self.visible(who, run)?;
            if let Some(p) = parent
                && r.parent.is_none()
                && r.effects.is_empty()
                && r.stop.is_none()
            {
                // A run created as someone's parent takes its own parent at its first admit.
                if !self.runs.contains_key(&p)
                    && let Some(g) = self.grave(p)
                {
                    // A forgotten parent: its fence reaches the run (no children list).
                    if !who.is_operator() && g.owner.is_some_and(|o| o != who) {
                        return Err("not_found");
                    }
                    let cause = g.cause;
                    self.runs.get_mut(&run).expect("run").parent = Some(p);
                    self.stop(now, run, cause);
                    return changed(format!("refused {}", cause.refusal()));
                }
                let inherited = if self.runs.contains_key(&p) {
                    self.visible(who, p)?.stop.map(|(cause, _)| cause)
                } else {
                    self.room_for_runs(who, Some(who), 1)?;
                    self.runs.insert(p, MRun::new(Some(who), None));
                    None
                };
                self.runs.get_mut(&p).expect("parent").children.push(run);
                self.runs.get_mut(&run).expect("run").parent = Some(p);
                // The adopted run's spend now counts against its new ancestors too.
                let (sp, rs) = (self.runs[&run].spent, self.runs[&run].reserved);
                self.count(p, |r| {
                    r.spent = add(r.spent, sp);
                    r.reserved = add(r.reserved, rs);
                });
                if let Some(cause) = inherited {
                    self.stop(now, run, cause);
                }
                adopted = true;
            }
            let r = &self.runs[&run];
            if parent.is_some() && r.parent != parent && r.stop.is_none() {
                return Err("parent_mismatch");
            }
            if let Some(e) = r.effects.get(&key) {
                if digest(e.tool, e.arg) != digest(tool, arg) {
                    return verdict("refused mismatch".into());
                }
                // PROTOCOL: "`start`: `true`: this admission is also the start", also of an
                // effect prepared before with the same key and arguments.
                if start {
                    match e.st {
                        St::Admitted if r.stop.is_none() => {
                            let (ep, n) = e.token.expect("admitted effects have a token");
                            let (answer, changed) = self.start(now, who, run, key, Tok::Issued)?;
                            let answer = if answer == "go" {
                                format!("admitted {ep}.{n}")
                            } else {
                                answer
                            };
                            return Ok((answer, changed));
                        }
                        St::Held(_) | St::Approved if !e.start_on_admit => {
                            self.eff(run, key).start_on_admit = true;
                            let (answer, _) = self.recheck(now, run, key)?;
                            return changed(answer);
                        }
                        _ => {}
                    }
                }
                return self.recheck(now, run, key);
            }
            if let Some((cause, _)) = r.stop {
                let answer = format!("refused {}", cause.refusal());
                return if adopted {
                    changed(answer)
                } else {
                    verdict(answer)
                };
            }
        } else if let Some(cause) = self.create(now, who, run, limits)? {
            return changed(format!("refused {}", cause.refusal()));
        }
        let d = self.decide_admission(now, run, tool, arg, false, spend(reserve))?;
        if matches!(d, Decision::Hold(_) | Decision::AskApproval) {
            self.room_for_held(self.runs[&run].owner)?;
        }
        let e = Eff {
            tool,
            arg,
            start_on_admit: start,
            st: St::Held("new"),
            token: None,
            approval: None,
            late: false,
            outcome: None,
            undo: Undo::default(),
            reserve: spend(reserve),
            counted: false,
            charged: false,
            cost: (0, 0),
            disputes: 0,
        };
        self.runs.get_mut(&run).expect("run").effects.insert(key, e);
        changed(self.carry(now, run, key, d))
    }

    /// The first admit creates the run (and a parent nobody has seen yet); returns the cause
    /// of the stop it is born with, under a stopped or forgotten parent.
    fn create(
        &mut self,
        now: u64,
        who: Who,
        run: u8,
        limits: u8,
    ) -> Result<Option<Cause>, &'static str> {
        let parent = parent_of(run);
        let new_parent =
            parent.is_some_and(|p| !self.runs.contains_key(&p) && self.grave(p).is_none());
        self.room_for_runs(who, Some(who), 1 + usize::from(new_parent))?;
        let mut inherited = None;
        if let Some(p) = parent {
            if self.runs.contains_key(&p) {
                let pr = self.visible(who, p)?;
                if let Some((cause, from)) = pr.stop {
                    inherited = Some((cause, Some(from.unwrap_or(p))));
                }
            } else if let Some(g) = self.grave(p) {
                // A forgotten parent's fence: the child is born stopped.
                if !who.is_operator() && g.owner.is_some_and(|o| o != who) {
                    return Err("not_found");
                }
                inherited = Some((g.cause, Some(p)));
            } else {
                self.runs.insert(p, MRun::new(Some(who), None));
            }
        }
        let mut r = MRun::new(Some(who), parent);
        if limits == 1 {
            r.max_effects = Some(2);
        }
        if limits == 2 {
            r.deadline = Some(now + 100);
        }
        if limits == 3 {
            r.max_spend = Some(SPEND_LIMIT_USD);
        }
        if limits == 4 {
            r.max_tokens = Some(SPEND_LIMIT_TOKENS);
        }
        if let Some(stop) = inherited {
            r.stop = Some(stop);
            r.stopped_at = now;
            r.epoch += 1;
        }
        self.runs.insert(run, r);
        if let Some(p) = parent
            && let Some(pr) = self.runs.get_mut(&p)
        {
            pr.children.push(run);
        }
        Ok(inherited.map(|(cause, _)| cause))
    }

    /// What a repeat admit or a `wait` answers for a known effect (row 2 of the table).
    fn recheck(&mut self, now: u64, run: u8, key: u8) -> Res {
        let r = &self.runs[&run];
        let e = r.effects[&key].clone();
        match e.st {
            St::Refused(why) => verdict(format!("refused {why}")),
            St::Started => verdict("duplicate started".into()),
            St::Done(o) => {
                let status = match o {
                    Outcome::Ok => "completed",
                    Outcome::Error => "failed",
                    Outcome::Unknown => "unknown",
                };
                verdict(format!("duplicate {status} {o}"))
            }
            St::Undo(p) => verdict(format!("duplicate {} ok", p.name())),
            St::Admitted => match r.stop {
                Some((cause, _)) => {
                    self.eff(run, key).st = St::Refused(cause.refusal());
                    self.release(run, key);
                    changed(format!("refused {}", cause.refusal()))
                }
                None => {
                    let (ep, n) = e.token.expect("admitted effects have a token");
                    verdict(format!("admitted {ep}.{n}"))
                }
            },
            St::Held("approval") => {
                let (id, until, _) = e.approval.clone().expect("requested");
                if now >= until {
                    self.eff(run, key).st = St::Refused("expired");
                    return changed("refused expired".into());
                }
                verdict(format!("held approval #{id} until {until}"))
            }
            St::Approved => {
                let until = e.approval.as_ref().expect("approved").1;
                match self.decide_admission(now, run, e.tool, e.arg, true, e.reserve)? {
                    Decision::Hold(why) => verdict(format!("held {why}")),
                    Decision::Admit if now >= until => {
                        self.eff(run, key).st = St::Refused("expired");
                        changed("refused expired".into())
                    }
                    d => changed(self.carry(now, run, key, d)),
                }
            }
            St::Held(why) => {
                match self.decide_admission(now, run, e.tool, e.arg, false, e.reserve)? {
                    Decision::Hold(w) if w == why => verdict(format!("held {why}")),
                    d => changed(self.carry(now, run, key, d)),
                }
            }
        }
    }

    fn wait(&mut self, now: u64, who: Who, run: u8, key: u8) -> Res {
        let r = self.visible(who, run)?;
        if !r.effects.contains_key(&key) {
            return Err("not_found");
        }
        self.recheck(now, run, key)
    }

    fn token_of(&self, run: u8, key: u8, tok: Tok) -> (u32, u64) {
        match tok {
            Tok::Issued => self.runs[&run].effects[&key].token.unwrap_or((1, 0)),
            Tok::Bogus => (BOGUS_TOKEN.epoch, BOGUS_TOKEN.serial),
        }
    }

    fn start(&mut self, now: u64, who: Who, run: u8, key: u8, tok: Tok) -> Res {
        let r = self.visible(who, run)?;
        let e = r.effects.get(&key).ok_or("not_found")?;
        let presented = self.token_of(run, key, tok);
        if e.token != Some(presented) {
            if let St::Refused(why) = e.st {
                return verdict(format!("refused {why}"));
            }
            return Err("bad_token");
        }
        match e.st {
            St::Admitted => {}
            St::Refused(why) => return verdict(format!("refused {why}")),
            _ => return self.recheck(now, run, key),
        }
        let write = e.tool.is_write();
        if let Some((cause, _)) = r.stop {
            self.eff(run, key).st = St::Refused(cause.refusal());
            self.release(run, key);
            return changed(format!("refused {}", cause.refusal()));
        }
        if let Some(root) = self.overdue_root(run, now) {
            self.stop(now, root, Cause::Deadline);
            self.eff(run, key).st = St::Refused("deadline");
            self.release(run, key);
            return changed("refused deadline".into());
        }
        // "One reject is final and also rejects the same call (digest) for the rest of the run":
        // the commit point re-checks it.
        let call = {
            let e = &self.runs[&run].effects[&key];
            digest(e.tool, e.arg)
        };
        if self.runs[&run].rejected.contains(&call) {
            self.eff(run, key).st = St::Refused("rejected");
            self.release(run, key);
            return changed("refused rejected".into());
        }
        if self.paused_lineage(run) {
            return verdict("held paused".into());
        }
        if write && self.awaiting_lineage(run) {
            return verdict("held sibling".into());
        }
        self.eff(run, key).st = St::Started;
        changed("go".into())
    }

    #[allow(clippy::too_many_arguments)]
    fn complete(
        &mut self,
        now: u64,
        who: Who,
        run: u8,
        key: u8,
        tok: Tok,
        outcome: Outcome,
        cost: u8,
    ) -> Res {
        let r = self.visible(who, run)?;
        let e = r.effects.get(&key).ok_or("not_found")?;
        if e.token != Some(self.token_of(run, key, tok)) {
            return Err("bad_token");
        }
        let late = r.stop.is_some();
        match e.st {
            St::Started => {
                let e = self.eff(run, key);
                e.st = St::Done(outcome);
                e.outcome = Some(outcome);
                e.late |= late;
                self.release(run, key);
                self.charge(now, run, key, cost);
                changed(format!("completed late={late}"))
            }
            St::Done(Outcome::Unknown) if outcome == Outcome::Unknown => {
                verdict(format!("completed late={late}"))
            }
            St::Done(Outcome::Unknown) => {
                let e = self.eff(run, key);
                e.st = St::Done(outcome);
                e.outcome = Some(outcome);
                e.late |= late;
                self.release(run, key);
                self.charge(now, run, key, cost);
                changed(format!("completed late={late}"))
            }
            // The same report again changes nothing; one that contradicts the outcome or the
            // cost settled is refused and kept (SPEC: nothing an agent reports is dropped).
            St::Done(o) if o == outcome && e.cost == spend(cost) => {
                verdict(format!("completed late={}", e.late))
            }
            // The saga took up a call that happened: the same report again, or a contradiction.
            St::Undo(_) if outcome == Outcome::Ok && e.cost == spend(cost) => {
                verdict(format!("completed late={}", e.late))
            }
            St::Refused(_) if e.outcome == Some(outcome) && e.cost == spend(cost) => {
                verdict("completed late=true".into())
            }
            St::Done(_) | St::Undo(_) | St::Refused(_)
                if e.outcome.is_some() || !matches!(e.st, St::Refused(_)) =>
            {
                self.eff(run, key).disputes += 1;
                changed("disputed".into())
            }
            St::Refused(_) => {
                let e = self.eff(run, key);
                e.outcome = Some(outcome);
                e.late = true;
                self.charge(now, run, key, cost);
                changed("completed late=true".into())
            }
            _ => Err("not_started"),
        }
    }

    fn decide(&mut self, now: u64, who: Who, run: u8, key: u8, approve: bool) -> Res {
        if !who.is_operator() {
            return Err("forbidden");
        }
        let r = self.runs.get(&run).ok_or("not_found")?;
        let e = r.effects.get(&key).ok_or("not_found")?;
        if e.held_undo().is_some() {
            return self.decide_undo(now, who, run, key, approve);
        }
        if e.st != St::Held("approval") {
            return Err("not_awaiting_approval");
        }
        let (_, until, approvers) = e.approval.clone().expect("requested");
        if now >= until {
            return Err("not_awaiting_approval");
        }
        let (tool, arg) = (e.tool, e.arg);
        if !approve {
            let r = self.runs.get_mut(&run).expect("run");
            r.rejected.insert(digest(tool, arg));
            r.effects.get_mut(&key).expect("effect").st = St::Refused("rejected");
            return changed("decided rejected".into());
        }
        if approvers.contains(&who) {
            return Err("duplicate_approver");
        }
        let mut approvers = approvers;
        approvers.push(who);
        let missing: Vec<&str> = tool
            .groups()
            .iter()
            .copied()
            .filter(|g| !approvers.iter().any(|a| a.groups().contains(g)))
            .collect();
        let enough =
            approvers.len() as u32 >= tool.quorum() && groups_covered(tool.groups(), &approvers);
        let n = approvers.len();
        let e = self.eff(run, key);
        e.approval.as_mut().expect("requested").2 = approvers;
        if enough {
            e.st = St::Approved;
            changed("decided approved".into())
        } else {
            changed(format!(
                "decided pending {n}/{} missing=[{}]",
                tool.quorum(),
                missing.join(",")
            ))
        }
    }

    #[allow(clippy::map_entry)]
    fn cancel(&mut self, now: u64, who: Who, run: u8, kill: bool) -> Res {
        if kill && !who.is_operator() {
            return Err("forbidden");
        }
        if self.runs.contains_key(&run) {
            self.visible(who, run)?;
        } else if who.is_operator() {
            // An operator may fence a run id before its first admit.
            self.room_for_runs(who, None, 1)?;
            self.runs.insert(run, MRun::new(None, None));
        } else {
            // An agent stops only runs it created (no squatting on another's run id).
            return Err("not_found");
        }
        self.stop_verb(
            now,
            run,
            if kill {
                Cause::Killed
            } else {
                Cause::Cancelled
            },
        )
    }

    fn close(&mut self, now: u64, who: Who, run: u8, failed: bool) -> Res {
        self.visible(who, run)?;
        let cause = if failed { Cause::Failed } else { Cause::Closed };
        self.stop_verb(now, run, cause)
    }

    fn stop_verb(&mut self, now: u64, run: u8, cause: Cause) -> Res {
        if self.runs[&run].stop.is_some() {
            return verdict(format!("run {} changed=0", self.runs[&run].state()));
        }
        let n = self.stop(now, run, cause);
        changed(format!("run {} changed={n}", self.runs[&run].state()))
    }

    fn pause(&mut self, who: Who, run: u8, pause: bool) -> Res {
        if !who.is_operator() {
            return Err("forbidden");
        }
        let r = self.runs.get_mut(&run).ok_or("not_found")?;
        let state = r.state();
        match (state, pause) {
            ("active", true) | ("paused", false) => {
                r.paused = pause;
                changed(format!("run {} changed=1", r.state()))
            }
            ("paused", true) | ("active", false) => verdict(format!("run {state} changed=0")),
            _ => Err("invalid_state"),
        }
    }

    fn tick(&mut self, now: u64, run: u8) -> Res {
        let r = self.runs.get(&run).ok_or("not_found")?;
        if r.stop.is_some() {
            return verdict(format!("run {} changed=0", r.state()));
        }
        let n = if let Some(root) = self.overdue_root(run, now) {
            self.stop(now, root, Cause::Deadline)
        } else {
            let mut n = 0;
            for e in self.runs.get_mut(&run).expect("run").effects.values_mut() {
                let due = e.approval.as_ref().is_some_and(|a| now >= a.1);
                if due && matches!(e.st, St::Held("approval") | St::Approved) {
                    e.st = St::Refused("expired");
                    n += 1;
                }
            }
            n
        };
        let text = format!("run {} changed={n}", self.runs[&run].state());
        if n > 0 { changed(text) } else { verdict(text) }
    }

    /// The model's state as a `View`, comparable with the kernel's.
    pub fn view(&self) -> View {
        let mut out = View::new();
        for (id, r) in &self.runs {
            let effects = r
                .effects
                .iter()
                .map(|(k, e)| {
                    let status = match e.st {
                        St::Held(w) => format!("held({w})"),
                        St::Approved => "approved".into(),
                        St::Admitted => "admitted".into(),
                        St::Started => "started".into(),
                        St::Done(Outcome::Ok) => "completed".into(),
                        St::Done(Outcome::Error) => "failed".into(),
                        St::Done(Outcome::Unknown) => "unknown".into(),
                        St::Refused(w) => format!("refused({w})"),
                        St::Undo(p) => p.name().into(),
                    };
                    let approval = e.approval.as_ref().map(|(id, until, who)| {
                        (
                            *id,
                            *until,
                            who.iter().map(|w| w.name().to_string()).collect(),
                        )
                    });
                    (
                        KEYS[*k as usize].to_string(),
                        EffectView {
                            tool: e.tool.name().into(),
                            status,
                            token: e.token,
                            approval,
                            late: e.late,
                            outcome: e.outcome.map(|o| o.to_string()),
                            saga: SagaView {
                                attempts: e.undo.attempts,
                                lookups: e.undo.lookups,
                                chosen: e.undo.chosen,
                                retry_at: (e.st == St::Undo(Phase::Failed))
                                    .then_some(e.undo.retry_at),
                                approval: e.undo.approval.as_ref().map(|a| {
                                    (
                                        a.id,
                                        a.until,
                                        a.approvers.iter().map(|w| w.name().to_string()).collect(),
                                        a.rejected.map(|w| w.name().to_string()),
                                    )
                                }),
                            },
                        },
                    )
                })
                .collect();
            out.insert(
                RUNS[*id as usize].to_string(),
                RunView {
                    owner: r.owner.map(|o| o.name().to_string()),
                    parent: r.parent.map(|p| RUNS[p as usize].to_string()),
                    children: r
                        .children
                        .iter()
                        .map(|c| RUNS[*c as usize].to_string())
                        .collect(),
                    state: r.state().into(),
                    cause: r.stop.map(|(c, _)| c.name().to_string()),
                    from: r
                        .stop
                        .and_then(|(_, f)| f)
                        .map(|f| RUNS[f as usize].to_string()),
                    epoch: r.epoch,
                    admitted: r.admissions,
                    pending: r.awaiting() as u32,
                    in_flight: r.flying() as u32,
                    deadline: r.deadline,
                    max_effects: r.max_effects,
                    max_spend: r.max_spend,
                    max_tokens: r.max_tokens,
                    spent: r.spent,
                    reserved: r.reserved,
                    rejected: r.rejected.iter().copied().collect(),
                    effects,
                    stopped_at: r.stop.map(|_| r.stopped_at),
                    forgotten: false,
                    saga_next: r.saga_next(),
                },
            );
        }
        for (id, g) in &self.graves {
            out.insert(RUNS[*id as usize].to_string(), grave_view(g));
        }
        out
    }
}

/// What is observable of a forgotten run: its fence.
fn grave_view(g: &Grave) -> RunView {
    RunView {
        owner: g.owner.map(|o| o.name().to_string()),
        parent: None,
        children: vec![],
        state: g.cause.terminal().into(),
        cause: Some(g.cause.name().to_string()),
        from: None,
        epoch: g.epoch,
        admitted: 0,
        pending: 0,
        in_flight: 0,
        deadline: None,
        max_effects: None,
        max_spend: None,
        max_tokens: None,
        spent: (0, 0),
        reserved: (0, 0),
        rejected: vec![],
        effects: BTreeMap::new(),
        stopped_at: Some(g.stopped_at),
        forgotten: true,
        saga_next: None,
    }
}

/// Each required group needs its own approver carrying it.
fn groups_covered(groups: &[&str], approvers: &[Who]) -> bool {
    fn go(groups: &[&str], approvers: &[Who], used: &mut Vec<bool>) -> bool {
        let Some((g, rest)) = groups.split_first() else {
            return true;
        };
        for i in 0..approvers.len() {
            if !used[i] && approvers[i].groups().contains(g) {
                used[i] = true;
                if go(rest, approvers, used) {
                    return true;
                }
                used[i] = false;
            }
        }
        false
    }
    go(groups, approvers, &mut vec![false; approvers.len()])
}

fn add(a: (u64, u64), b: (u64, u64)) -> (u64, u64) {
    (a.0 + b.0, a.1 + b.1)
}

fn sub(a: (u64, u64), b: (u64, u64)) -> (u64, u64) {
    (a.0 - b.0, a.1 - b.1)
}
