//! A bounded, exhaustive model checker of the kernel (our own breadth-first explorer with state
//! hashing). The world: runs `p` and its child `c`; approvers `alice` and `bob`; a clock that
//! ticks (the server's timer then ticks both runs); crash + recovery through the real ledger
//! (`estop_server::journal::open` on `CrashStorage`), clean and with a torn last record. Two
//! alphabets are explored ([`Alphabet`]): the approvals one (keys `a`, a quorum-2 `wire` call
//! admitted with `start`, `b` the *same* call two-phase, `c` an allowed `pay`; approve, reject,
//! expiry, cancel, pause/resume, start, complete `ok`) and the ends one (kill, close completed
//! and failed, a deadline that passes, a budget of two admissions reached, complete `ok`,
//! `error` and `unknown`).
//!
//! Every transition runs the kernel *and* the reference model (their answers and states must
//! agree), and a monitor checks the guarantees as properties of the trace of acknowledged
//! answers, not only of states:
//! * P1 no start (or admission) of an effect before a satisfying approval (quorum of distinct
//!   approvers, acknowledged) was recorded for it;
//! * P2 no other write effect of the run, or of a descendant, starts while an approval is pending;
//! * P3 a rejected digest is never admitted, nor started, again in the run;
//! * P4 at most one admission (one token) and one start per identity;
//! * P5 nothing admitted or started after an acknowledged cancel, kill or close of the run or
//!   an ancestor;
//! * P6 an expired approval is never given nor consumed;
//! * P7 terminal run states and refused effects absorb;
//! * P8 recovery from the ledger rebuilds exactly the acknowledged state; a torn last record
//!   rebuilds exactly the state before it;
//! * P9 a run makes no more admissions than its budget (`max_effects`);
//! * P10 nothing is admitted or started once the deadline of the run or an ancestor has passed;
//! * P11 (saga alphabet) newest first: no compensation attempt, lookup or blocked step is taken
//!   up while a newer effect of the saga is still owed (in flight, unknown, done, compensating,
//!   failed or waiting for a human);
//! * P12 a cancelled run is `cancelled` only with its saga settled, and `finalizing` until then;
//! * P13 a kill runs no saga: only an effect an operator asked to compensate is taken up;
//! * P14 each compensation attempt and each lookup begins once, numbered from 1 without a gap;
//! * P15 a compensation attempt never begins while the approval a policy `approve` rule asked
//!   for its compensating call is unmet (the acknowledged votes short of the rule's quorum or
//!   groups), rejected or expired; a retry acknowledged after a refusal spends it.
//!
//! A planted bug ([`Plant`]) forges one answer the monitor reads; tests show the monitor names
//! exactly the property it breaks (P5, P9, P10, P15).

use crate::diff::Pair;
use crate::world::{EffectView, Op, SagaOp, Tok, Tool, View, Who, digest, run_of};
use estop_kernel::record_codec::encode_record;
use estop_kernel::vocab::Outcome;
use estop_kernel::{Digest, Limits, Record};
use estop_ledger::format;
use estop_ledger::{CrashStorage, LedgerOptions, Storage};
use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

const P: u8 = 0;
const C: u8 = 1;
/// One clock tick.
pub const TICK_MS: u64 = 40;
/// Wire approvals expire after 80 ms: two ticks.
const T0: u64 = 1000;

/// The fixed call each key makes: `a` a quorum-2 `wire` admitted with `start`, `b` the same
/// call two-phase, `c` and `d` the same allowed `pay` call, two-phase.
fn call(key: u8) -> (Tool, u8, bool) {
    match key {
        0 => (Tool::Wire, 0, true),
        1 => (Tool::Wire, 0, false),
        _ => (Tool::Pay, 0, false),
    }
}

/// A transition of the checked world.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    Op(Op),
    /// The clock moves one tick and the server's timer ticks both runs.
    Tick,
}

/// Which steps a check explores from every state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alphabet {
    /// Approvals and their quorum, rejection, expiry, cancel, pause/resume, start and a
    /// successful complete.
    Approvals,
    /// How runs and effects end: kill, close (completed and failed), a deadline passing, a
    /// budget (`max_effects`) reached, and complete with `error` and `unknown` as well as `ok`;
    /// with one approver's approval and cancel, so the fences meet the approvals.
    Ends,
    /// The reverse saga: two compensable calls (`charge`; `book`, whose unknown outcome has a
    /// lookup) started on admission, completed `ok`/`error`/`unknown`, a cancel or a kill, the
    /// executor's attempts (begin, end `ok`/`error`/`unknown`, blocked) and lookups, the
    /// gate's unreported step and the operator's settle, retry, skip and compensate; the
    /// shell's hold of a compensating call for its `approve` rule and operators' votes on it.
    Saga,
}

/// The alphabet explored from every state.
pub fn alphabet(kind: Alphabet) -> Vec<Step> {
    match kind {
        Alphabet::Approvals => approvals_alphabet(),
        Alphabet::Ends => ends_alphabet(),
        Alphabet::Saga => saga_alphabet(),
    }
}

fn admit(run: u8, key: u8, limits: u8) -> Step {
    let (tool, arg, start) = call(key);
    Step::Op(Op::Admit {
        who: Who::Agent,
        run,
        key,
        tool,
        arg,
        start,
        limits,
        reserve: 0,
    })
}

fn complete(run: u8, key: u8, outcome: Outcome) -> Step {
    Step::Op(Op::Complete {
        who: Who::Agent,
        run,
        key,
        tok: Tok::Issued,
        outcome,
        cost: 0,
    })
}

fn start(run: u8, key: u8) -> Step {
    Step::Op(Op::Start {
        who: Who::Agent,
        run,
        key,
        tok: Tok::Issued,
    })
}

fn approvals_alphabet() -> Vec<Step> {
    let mut out = Vec::new();
    for run in [P, C] {
        for key in 0..3u8 {
            let (tool, _, _) = call(key);
            out.push(admit(run, key, 0));
            out.push(Step::Op(Op::Wait {
                who: Who::Agent,
                run,
                key,
            }));
            out.push(start(run, key));
            out.push(complete(run, key, Outcome::Ok));
            if tool == Tool::Wire {
                out.push(Step::Op(Op::Decide {
                    who: Who::Alice,
                    run,
                    key,
                    approve: true,
                }));
                out.push(Step::Op(Op::Decide {
                    who: Who::Bob,
                    run,
                    key,
                    approve: true,
                }));
                out.push(Step::Op(Op::Decide {
                    who: Who::Alice,
                    run,
                    key,
                    approve: false,
                }));
            }
        }
        out.push(Step::Op(Op::Cancel {
            who: Who::Alice,
            run,
            kill: false,
        }));
        out.push(Step::Op(Op::Pause {
            who: Who::Alice,
            run,
        }));
        out.push(Step::Op(Op::Resume {
            who: Who::Alice,
            run,
        }));
    }
    out.push(Step::Tick);
    out
}

/// Keys `b` (wire, two-phase), `c` and `d` (the same allowed `pay` call, two-phase): three
/// admissions reach a budget of two. The run is created with a deadline (`limits` 2: 100 ms,
/// passed in three ticks) or a budget (`limits` 1: two admissions) by `c`'s admit, or with
/// neither by any of them.
fn ends_alphabet() -> Vec<Step> {
    let mut out = Vec::new();
    for run in [P, C] {
        out.push(admit(run, 1, 0));
        out.push(admit(run, 3, 0));
        for limits in 0..3u8 {
            out.push(admit(run, 2, limits));
        }
        out.push(start(run, 1));
        out.push(complete(run, 1, Outcome::Ok));
        for key in [2u8, 3] {
            out.push(start(run, key));
            for outcome in [Outcome::Ok, Outcome::Error, Outcome::Unknown] {
                out.push(complete(run, key, outcome));
            }
        }
        for who in [Who::Alice, Who::Bob] {
            out.push(Step::Op(Op::Decide {
                who,
                run,
                key: 1,
                approve: true,
            }));
        }
        for kill in [false, true] {
            out.push(Step::Op(Op::Cancel {
                who: Who::Alice,
                run,
                kill,
            }));
        }
        for failed in [false, true] {
            out.push(Step::Op(Op::Close {
                who: Who::Agent,
                run,
                failed,
            }));
        }
    }
    out.push(Step::Tick);
    out
}

/// The saga alphabet's calls: `a` a `charge`, `b` a `book` (with a lookup), each started on
/// admission, in run `p`.
fn saga_call(key: u8) -> Tool {
    if key == 0 { Tool::Charge } else { Tool::Book }
}

fn saga_alphabet() -> Vec<Step> {
    let mut out = Vec::new();
    let saga = |key, step| {
        Step::Op(Op::Saga {
            who: if step_by_operator(step) {
                Who::Alice
            } else {
                Who::Agent
            },
            run: P,
            key,
            step,
        })
    };
    for key in 0..2u8 {
        out.push(Step::Op(Op::Admit {
            who: Who::Agent,
            run: P,
            key,
            tool: saga_call(key),
            arg: 0,
            start: true,
            limits: 0,
            reserve: 0,
        }));
        for outcome in [Outcome::Ok, Outcome::Error, Outcome::Unknown] {
            out.push(complete(P, key, outcome));
            out.push(saga(
                key,
                SagaOp::End {
                    attempt: 1,
                    outcome,
                },
            ));
        }
        out.push(saga(key, SagaOp::Begin { attempt: 1 }));
        out.push(saga(key, SagaOp::Begin { attempt: 2 }));
        out.push(saga(
            key,
            SagaOp::End {
                attempt: 2,
                outcome: Outcome::Ok,
            },
        ));
        out.push(saga(key, SagaOp::Blocked { attempt: 1 }));
        for outcome in [Outcome::Ok, Outcome::Error] {
            out.push(saga(key, SagaOp::Settle { outcome }));
        }
        for step in [SagaOp::Retry, SagaOp::Skip, SagaOp::Compensate] {
            out.push(saga(key, step));
        }
        // The policy's `approve` rule on the compensating tool (`Tool::undo_rule`): the shell
        // holds the due first attempt for an approval.
        out.push(saga(
            key,
            SagaOp::Held {
                attempt: 1,
                of: saga_call(key),
            },
        ));
        out.push(saga(key, SagaOp::Unreported { after_ms: 0 }));
        if saga_call(key).has_lookup() {
            out.push(saga(key, SagaOp::LookupBegin { attempt: 1 }));
            for outcome in [Outcome::Ok, Outcome::Error, Outcome::Unknown] {
                out.push(saga(
                    key,
                    SagaOp::LookupEnd {
                        attempt: 1,
                        outcome,
                    },
                ));
            }
        }
    }
    for kill in [false, true] {
        out.push(Step::Op(Op::Cancel {
            who: Who::Alice,
            run: P,
            kill,
        }));
    }
    // Votes on a held compensation: `uncharge` needs two, one from finance (carol); bob
    // rejects; `unbook` needs one.
    for (who, key, approve) in [
        (Who::Alice, 0, true),
        (Who::Carol, 0, true),
        (Who::Bob, 0, false),
        (Who::Alice, 1, true),
    ] {
        out.push(Step::Op(Op::Decide {
            who,
            run: P,
            key,
            approve,
        }));
    }
    out.push(Step::Tick);
    out
}

/// Whether a saga step is an operator's (or the gate's own, which runs as one).
fn step_by_operator(step: SagaOp) -> bool {
    step.by_operator()
}

/// What the clients have been told so far: the trace the properties are about.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Monitor {
    token: BTreeMap<(u8, u8), String>,
    started: BTreeSet<(u8, u8)>,
    /// Approval requested: until when.
    until: BTreeMap<(u8, u8), u64>,
    approvers: BTreeMap<(u8, u8), BTreeSet<Who>>,
    approved: BTreeSet<(u8, u8)>,
    /// The decision no longer awaits anyone (approved, rejected, expired, voided).
    settled: BTreeSet<(u8, u8)>,
    rejected: BTreeSet<(u8, Digest)>,
    /// Runs whose cancel, kill or close was acknowledged.
    stopped: BTreeSet<u8>,
    /// Admissions a run may make (`max_effects`, set by the admit that created it).
    budget: BTreeMap<u8, u64>,
    admissions: BTreeMap<u8, u64>,
    /// When a run's deadline passes (set by the admit that created it).
    deadline: BTreeMap<u8, u64>,
    /// Runs whose kill was acknowledged (no saga of their own).
    killed: BTreeSet<u8>,
    /// Effects an operator's `compensate` was acknowledged for.
    chosen: BTreeSet<(u8, u8)>,
    /// Compensation attempts and lookups acknowledged as begun: (run, key, lookup?, attempt).
    begun: BTreeSet<(u8, u8, bool, u32)>,
    /// The saga alphabet's calls are explored (`call_of`).
    saga: bool,
    /// Compensating calls whose hold for approval was acknowledged: the tool whose undo rule
    /// asked (its quorum and groups), the approvers acknowledged, and whether a rejection or
    /// the expiry refused it. An acknowledged retry spends an unmet one.
    undo_votes: BTreeMap<(u8, u8), (Tool, BTreeSet<Who>, bool)>,
}

/// Whether the approvers acknowledged meet the approval `tool`'s undo rule asks for: its
/// quorum of distinct approvers, each of its groups carried by one (the rules here name one
/// group at most).
fn undo_met(tool: Tool, approvers: &BTreeSet<Who>) -> bool {
    let (quorum, groups, _) = tool.undo_approval();
    approvers.len() as u32 >= quorum
        && groups
            .iter()
            .all(|g| approvers.iter().any(|w| w.groups().contains(g)))
}

fn lineage(run: u8) -> &'static [u8] {
    if run == C { &[C, P] } else { &[P] }
}

impl Monitor {
    /// The call of an effect: the fixed one of its key, or the saga alphabet's.
    fn call_of(&self, id: (u8, u8)) -> (Tool, u8, bool) {
        if self.saga {
            (saga_call(id.1), 0, true)
        } else {
            call(id.1)
        }
    }

    fn pending(&self, id: (u8, u8), now: u64) -> bool {
        self.until.get(&id).is_some_and(|u| now < *u) && !self.settled.contains(&id)
    }

    /// P1, P6, P3, P5, P10: may this admission (or start) of `id` happen at `now`?
    fn check_admission(&self, now: u64, id: (u8, u8), admitted: bool) -> Result<(), String> {
        let violation = |p: &str, what: String| Err(format!("{p} violated: {what}"));
        let run = id.0;
        let (tool, arg, _) = self.call_of(id);
        if tool.action() == estop_kernel::vocab::PolicyAction::Approve {
            let n = self.approvers.get(&id).map_or(0, BTreeSet::len);
            if !self.approved.contains(&id) || n < tool.quorum() as usize {
                return violation(
                    "P1",
                    format!("{id:?} admitted/started with {n} acknowledged approvals"),
                );
            }
            if admitted && now >= self.until[&id] {
                return violation(
                    "P6",
                    format!("{id:?} consumed an approval expired at {}", self.until[&id]),
                );
            }
        }
        if self.rejected.contains(&(run, digest(tool, arg))) {
            return violation("P3", format!("{id:?} admitted/started a rejected call"));
        }
        if let Some(r) = lineage(run).iter().find(|r| self.stopped.contains(r)) {
            return violation(
                "P5",
                format!("{id:?} admitted/started after the cancel or close of run {r}"),
            );
        }
        if let Some(r) = lineage(run)
            .iter()
            .find(|r| self.deadline.get(r).is_some_and(|d| now >= *d))
        {
            return violation(
                "P10",
                format!("{id:?} admitted/started after the deadline of run {r}"),
            );
        }
        Ok(())
    }

    /// Checks one acknowledged answer against the trace so far, then records it. `created`:
    /// the op created its run (an admit's limits then bind the run).
    fn observe(&mut self, now: u64, op: &Op, answer: &str, created: bool) -> Result<(), String> {
        if let (true, Op::Admit { run, limits, .. }) = (created, *op) {
            match limits {
                1 => {
                    self.budget.insert(run, 2);
                }
                2 => {
                    self.deadline.insert(run, now + 100);
                }
                _ => {}
            }
        }
        match *op {
            Op::Admit { run, key, .. } | Op::Wait { run, key, .. } | Op::Start { run, key, .. } => {
                return self.observe_verdict(now, (run, key), answer);
            }
            // A vote on a held compensating call (P15, `observe_saga`), not an admission's.
            Op::Decide { run, key, .. } if self.undo_votes.contains_key(&(run, key)) => {}
            Op::Decide {
                who,
                run,
                key,
                approve,
            } => return self.observe_decision(now, who, (run, key), approve, answer),
            Op::Cancel { run, .. } | Op::Close { run, .. } if answer.starts_with("run ") => {
                self.stopped.insert(run);
                for id in self.until.keys().copied().collect::<Vec<_>>() {
                    if lineage(id.0).contains(&run) {
                        self.settled.insert(id);
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// P1–P6, P9, P10 for an answer to an admit, wait or start of `id`, then what it told.
    fn observe_verdict(&mut self, now: u64, id: (u8, u8), answer: &str) -> Result<(), String> {
        let violation = |p: &str, what: String| Err(format!("{p} violated: {what}"));
        let run = id.0;
        let (tool, _, start_on_admit) = self.call_of(id);
        // A repeat admit of a prepared effect returns the same token: not a new admission.
        let admitted = answer
            .strip_prefix("admitted ")
            .is_some_and(|t| self.token.get(&id).is_none_or(|old| old != t));
        let starts = answer == "go" || (admitted && start_on_admit);
        if admitted || starts {
            self.check_admission(now, id, admitted)?;
        }
        if admitted {
            let n = self.admissions.entry(run).or_default();
            *n += 1;
            if let Some(max) = self.budget.get(&run)
                && *n > *max
            {
                return violation(
                    "P9",
                    format!("{id:?} is admission {n} of run {run}, its budget is {max}"),
                );
            }
        }
        if admitted {
            let token = answer["admitted ".len()..].to_string();
            if let Some(t) = self.token.get(&id) {
                return violation("P4", format!("{id:?} admitted twice ({t}, then {token})"));
            }
            self.token.insert(id, token);
        }
        if starts {
            if tool.is_write()
                && let Some(other) = self
                    .until
                    .keys()
                    .find(|o| **o != id && lineage(run).contains(&o.0) && self.pending(**o, now))
            {
                return violation(
                    "P2",
                    format!("write {id:?} started while {other:?} awaits approval"),
                );
            }
            if !self.started.insert(id) {
                return violation("P4", format!("{id:?} started twice"));
            }
        }
        if let Some(rest) = answer.strip_prefix("held approval #") {
            let until: u64 = rest
                .split(" until ")
                .nth(1)
                .and_then(|u| u.parse().ok())
                .expect("held approval has an expiry");
            self.until.entry(id).or_insert(until);
        }
        if answer == "refused expired" || answer.starts_with("refused ") {
            self.settled.insert(id);
        }
        Ok(())
    }

    /// P6 for an operator's decision, then the decision recorded.
    fn observe_decision(
        &mut self,
        now: u64,
        who: Who,
        id: (u8, u8),
        approve: bool,
        answer: &str,
    ) -> Result<(), String> {
        if !answer.starts_with("decided") {
            return Ok(());
        }
        if self.until.get(&id).is_none_or(|u| now >= *u) {
            return Err(format!(
                "P6 violated: {id:?} accepted a decision after its approval expired"
            ));
        }
        if approve {
            self.approvers.entry(id).or_default().insert(who);
            if answer == "decided approved" {
                self.approved.insert(id);
                self.settled.insert(id);
            }
        } else {
            let (tool, arg, _) = self.call_of(id);
            self.rejected.insert((id.0, digest(tool, arg)));
            self.settled.insert(id);
        }
        Ok(())
    }
}

/// A state of the explored world.
#[derive(Debug, Clone)]
pub struct Node {
    pair: Pair,
    monitor: Monitor,
}

fn fingerprint(n: &Node) -> u64 {
    let mut h = DefaultHasher::new();
    n.pair.now.hash(&mut h);
    // When a run stopped matters only to retention, which this world never runs: states that
    // differ only there behave alike (and are checked once).
    let mut model = n.pair.model.clone();
    model.runs.values_mut().for_each(|r| r.stopped_at = 0);
    model.hash(&mut h);
    let mut view = n.pair.view.clone();
    view.values_mut().for_each(|r| r.stopped_at = None);
    view.hash(&mut h);
    for (_, run) in n.pair.gate.runs() {
        (run.next_serial, run.next_approval).hash(&mut h);
    }
    n.monitor.hash(&mut h);
    h.finish()
}

/// Options of a check.
#[derive(Debug, Clone)]
pub struct CheckOptions {
    /// Stop after this many steps from the empty gate.
    pub depth_max: usize,
    /// Stop after this many distinct states.
    pub states_max: u64,
    /// Clock ticks allowed in a trace.
    pub ticks_max: u64,
    /// Check recovery from the ledger at every state.
    pub crash: bool,
    pub alphabet: Alphabet,
    /// A bug planted in the trace the monitor reads (tests show the monitor catches it).
    pub plant: Option<Plant>,
}

/// A bug planted for a test that the monitor bites.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plant {
    /// The monitor is told `admitted` for an allowed call in a run whose cancel (or close) was
    /// acknowledged, where the kernel refused it: P5, and only P5, must report it.
    AdmitAfterCancel,
    /// `admitted` where the kernel refused the call for the run's budget: P9.
    AdmitOverBudget,
    /// `admitted` where the kernel refused the call for the run's deadline: P10.
    AdmitAfterDeadline,
    /// A compensation attempt acknowledged as begun (`compensating`, a change) where the kernel
    /// refused it while its compensating call awaits its approval: P15.
    BeginWhileHeld,
}

/// What a check explored.
#[derive(Debug, Clone, Default)]
pub struct CheckStats {
    pub states: u64,
    pub transitions: u64,
    pub depth: usize,
    /// The frontier emptied: every reachable state (within the tick bound) was explored.
    pub exhaustive: bool,
    pub recoveries: u64,
    pub torn_recoveries: u64,
}

/// A property violation with the trace that leads to it.
#[derive(Debug, Clone)]
pub struct Violation {
    pub what: String,
    pub trace: Vec<Step>,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{}", self.what)?;
        writeln!(f, "trace ({} steps):", self.trace.len())?;
        for s in &self.trace {
            match s {
                Step::Op(op) => writeln!(f, "  {op}")?,
                Step::Tick => writeln!(f, "  tick (+{TICK_MS}ms, timer ticks p and c)")?,
            }
        }
        Ok(())
    }
}

/// The answer the monitor reads for `op`: the kernel's, or, with a planted bug, a forged one.
fn monitored(node: &Node, op: &Op, answer: String, plant: Option<Plant>) -> String {
    if let (
        Some(Plant::BeginWhileHeld),
        Op::Saga {
            run,
            key,
            step: SagaOp::Begin { attempt },
            ..
        },
    ) = (plant, *op)
        && answer == "error saga"
        && node.monitor.undo_votes.contains_key(&(run, key))
    {
        return format!("compensation compensating attempt={attempt} retry_at=None");
    }
    let Op::Admit {
        run,
        tool: Tool::Pay,
        ..
    } = *op
    else {
        return answer;
    };
    let forge = match plant {
        None => false,
        Some(Plant::AdmitAfterCancel) => {
            !answer.starts_with("admitted")
                && lineage(run)
                    .iter()
                    .any(|r| node.monitor.stopped.contains(r))
        }
        Some(Plant::AdmitOverBudget) => answer == "refused budget",
        Some(Plant::AdmitAfterDeadline) => answer == "refused deadline",
        Some(Plant::BeginWhileHeld) => false,
    };
    if forge { "admitted 9.9".into() } else { answer }
}

/// Statuses of a compensable effect its saga still owes something (the checker's and the
/// shipped auditor's reading of docs/PROTOCOL.md, not the kernel's `saga.rs`).
pub(crate) const OWED: [&str; 6] = [
    "started",
    "unknown",
    "completed",
    "compensating",
    "compensation_failed",
    "needs_human",
];

fn compensable(e: &EffectView) -> bool {
    e.tool == Tool::Charge.name() || e.tool == Tool::Book.name()
}

fn owed(e: &EffectView) -> bool {
    compensable(e) && OWED.contains(&e.status.as_str())
}

/// P12: a cancelled run is `cancelled` only once its saga is settled, and `finalizing` until
/// then (never a terminal state with an undo owed, never an open fence without one).
fn saga_settled(view: &View) -> Result<(), String> {
    for (id, r) in view {
        if r.forgotten || r.cause.as_deref() != Some("cancelled") {
            continue;
        }
        let open = r.effects.iter().find(|(_, e)| owed(e));
        match (r.state.as_str(), open) {
            ("cancelled", Some((k, e))) => {
                return Err(format!(
                    "P12 violated: run {id} is cancelled while {k} is {}",
                    e.status
                ));
            }
            ("finalizing", None) if r.in_flight == 0 => {
                return Err(format!(
                    "P12 violated: run {id} is finalizing with its saga settled"
                ));
            }
            _ => {}
        }
    }
    Ok(())
}

impl Monitor {
    /// P11, P13, P14 for an answer to a saga step, then what it told.
    fn observe_saga(
        &mut self,
        op: &Op,
        answer: &str,
        changed: bool,
        before: &View,
    ) -> Result<(), String> {
        // A kill that stopped the run (one after a cancel finds it stopped: its saga goes on).
        if let Op::Cancel {
            run, kill: true, ..
        } = *op
            && answer.starts_with("run ")
            && changed
        {
            self.killed.insert(run);
        }
        if let Op::Decide { who, run, key, .. } = *op
            && changed
            && let Some((_, approvers, refused)) = self.undo_votes.get_mut(&(run, key))
            && !*refused
        {
            match answer {
                "decided rejected" => *refused = true,
                a if a.starts_with("decided") => {
                    approvers.insert(who);
                }
                _ => {}
            }
        }
        let Op::Saga { run, key, step, .. } = *op else {
            return Ok(());
        };
        if !changed {
            return Ok(());
        }
        match step {
            SagaOp::Held { of, .. } => {
                self.undo_votes
                    .insert((run, key), (of, BTreeSet::new(), false));
            }
            SagaOp::Expired { .. } => {
                if let Some(v) = self.undo_votes.get_mut(&(run, key)) {
                    v.2 = true;
                }
            }
            SagaOp::Retry
                if self
                    .undo_votes
                    .get(&(run, key))
                    .is_some_and(|(tool, who, refused)| *refused || !undo_met(*tool, who)) =>
            {
                self.undo_votes.remove(&(run, key));
            }
            // P15: an attempt never begins while the approval asked for its compensating call
            // is unmet (votes acknowledged short of the rule's quorum or groups), rejected or
            // expired.
            SagaOp::Begin { attempt } => {
                if let Some((tool, who, refused)) = self.undo_votes.get(&(run, key))
                    && (*refused || !undo_met(*tool, who))
                {
                    let (name, k) = (
                        crate::world::RUNS[run as usize],
                        crate::world::KEYS[key as usize],
                    );
                    return Err(format!(
                        "P15 violated: {name}/{k}: attempt {attempt} began without its approval \
                         met (approvers {who:?}, refused: {refused})"
                    ));
                }
            }
            _ => {}
        }
        let (attempt, lookup) = match step {
            SagaOp::Compensate => {
                self.chosen.insert((run, key));
                return Ok(());
            }
            SagaOp::Begin { attempt } => (u32::from(attempt), false),
            SagaOp::LookupBegin { attempt } => (u32::from(attempt), true),
            SagaOp::Blocked { .. } => (0, false),
            _ => return Ok(()),
        };
        let name = crate::world::RUNS[run as usize];
        let r = &before[name];
        let k = crate::world::KEYS[key as usize];
        // P13: a kill runs no saga, only what an operator asked for, one effect at a time.
        if self.killed.contains(&run) && !self.chosen.contains(&(run, key)) {
            return Err(format!(
                "P13 violated: {name}/{k} is compensated in a killed run nobody asked to"
            ));
        }
        // P11: newest first, and an unknown outcome (or a call in flight) before anything
        // older: nothing newer of the saga is still owed.
        let serial = r.effects[k].token.map_or(0, |t| t.1);
        if let Some((newer, e)) = r.effects.iter().find(|(j, e)| {
            *j != k
                && e.token.is_some_and(|t| t.1 > serial)
                && owed(e)
                && (!self.killed.contains(&run) || self.chosen.contains(&(run, key_of(j))))
        }) {
            return Err(format!(
                "P11 violated: {name}/{k} is taken up while the newer {newer} is {}",
                e.status
            ));
        }
        // P14: each attempt (and each lookup) begins once, numbered from 1 without a gap.
        if attempt > 0 {
            if !self.begun.insert((run, key, lookup, attempt)) {
                return Err(format!(
                    "P14 violated: {name}/{k}: attempt {attempt} (lookup: {lookup}) begun twice"
                ));
            }
            if attempt > 1 && !self.begun.contains(&(run, key, lookup, attempt - 1)) {
                return Err(format!(
                    "P14 violated: {name}/{k}: attempt {attempt} (lookup: {lookup}) begun before attempt {}",
                    attempt - 1
                ));
            }
        }
        Ok(())
    }
}

fn key_of(k: &str) -> u8 {
    crate::world::KEYS
        .iter()
        .position(|x| *x == k)
        .expect("a key of the world") as u8
}

/// Applies one step; `Err` is a violation or a kernel/model disagreement.
fn advance(node: &mut Node, step: &Step, opts: &CheckOptions) -> Result<bool, String> {
    match step {
        Step::Tick => {
            if node.pair.now >= T0 + opts.ticks_max * TICK_MS {
                return Ok(false);
            }
            node.pair.step(&Op::Advance { ms: TICK_MS as u16 })?;
            for run in [P, C] {
                if node.pair.model.runs.contains_key(&run) {
                    node.pair.step(&Op::Tick { run })?;
                }
            }
            Ok(true)
        }
        Step::Op(op) => {
            let before = node.pair.view.clone();
            let now = node.pair.now;
            let answer = node.pair.step(op)?.expect("an answer");
            let created = run_of(op).is_some_and(|r| {
                let name = crate::world::RUNS[r as usize];
                !before.contains_key(name) && node.pair.view.contains_key(name)
            });
            let text = monitored(node, op, answer.text.clone(), opts.plant);
            // A forged answer is a forged change too.
            let changed = answer.changed || text != answer.text;
            node.monitor.observe(now, op, &text, created)?;
            node.monitor.observe_saga(op, &text, changed, &before)?;
            saga_settled(&node.pair.view)?;
            // P7: terminal states and refusals absorb.
            let after = &node.pair.view;
            for (id, old) in &before {
                let new = &after[id];
                if ["completed", "failed", "cancelled"].contains(&old.state.as_str())
                    && new.state != old.state
                {
                    return Err(format!(
                        "P7 violated: run {id} left terminal state {}",
                        old.state
                    ));
                }
                for (k, e) in &old.effects {
                    if e.status.starts_with("refused") && new.effects[k].status != e.status {
                        return Err(format!("P7 violated: effect {id}/{k} left {}", e.status));
                    }
                }
            }
            Ok(answer.changed)
        }
    }
}

/// Writes `records` as one durable segment (plus, with `torn`, half of the last record only) and
/// recovers a gate from it through the server's recovery code.
pub fn recover(records: &[Record], torn: bool) -> Result<estop_kernel::Gate, String> {
    let disk = CrashStorage::new(records.len() as u64);
    let mut seg = format::encode_segment_header(1).to_vec();
    let mut payload = Vec::new();
    let mut last_start = seg.len();
    for (i, rec) in records.iter().enumerate() {
        payload.clear();
        encode_record(rec, &mut payload);
        last_start = seg.len();
        format::append_record(&mut seg, i as u64 + 1, &payload, crc32c::crc32c(&payload));
    }
    if torn && !records.is_empty() {
        let cut = last_start + (seg.len() - last_start) / 2;
        seg.truncate(cut);
    }
    disk.put(&format::segment_name(1), seg);
    let storage: Arc<dyn Storage> = Arc::new(disk);
    let opened = estop_server::journal::open(storage, &Limits::default(), LedgerOptions::default())
        .map_err(|e| format!("recovery failed: {e}"))?;
    let expect = records.len() as u64 - u64::from(torn && !records.is_empty());
    if opened.report.last_seq != expect {
        return Err(format!(
            "recovery ended at seq {} instead of {expect}",
            opened.report.last_seq
        ));
    }
    if torn && !records.is_empty() && opened.report.torn_tail.is_none() {
        return Err("a torn last record was not reported".into());
    }
    Ok(opened.gate)
}

fn check_recovery(node: &Node, stats: &mut CheckStats) -> Result<(), String> {
    let log = &node.pair.log;
    let g = recover(log, false)?;
    if g != node.pair.gate {
        return Err(
            "P8 violated: recovery from the ledger differs from the acknowledged state".into(),
        );
    }
    stats.recoveries += 1;
    if !log.is_empty() {
        let g = recover(log, true)?;
        let mut expect = estop_kernel::Gate::new(Limits::default());
        for r in &log[..log.len() - 1] {
            expect
                .apply(r.at, &r.principal, &r.command)
                .map_err(|e| format!("replay: {e}"))?;
        }
        if g != expect {
            return Err(
                "P8 violated: recovery after a torn last record differs from the state before it"
                    .into(),
            );
        }
        stats.torn_recoveries += 1;
    }
    Ok(())
}

fn root(opts: &CheckOptions) -> Node {
    let mut pair = Pair::new();
    pair.now = T0;
    Node {
        pair,
        monitor: Monitor {
            saga: opts.alphabet == Alphabet::Saga,
            ..Monitor::default()
        },
    }
}

/// Rebuilds a state by replaying its trace from the empty gate (frontiers hold traces, a few
/// bytes each, not states: memory stays flat however wide the search gets).
fn replay(alphabet: &[Step], trace: &[u8], opts: &CheckOptions) -> Node {
    let mut n = root(opts);
    for &i in trace {
        advance(&mut n, &alphabet[i as usize], opts).expect("a trace that was checked replays");
    }
    n
}

/// Explores breadth first from the empty gate. Returns the statistics, or the first violation
/// with a shortest trace to it.
pub fn explore(opts: &CheckOptions) -> Result<CheckStats, Violation> {
    let alphabet = alphabet(opts.alphabet);
    assert!(alphabet.len() < 256);
    let start = root(opts);
    let mut seen: HashSet<u64> = HashSet::new();
    seen.insert(fingerprint(&start));
    let mut stats = CheckStats {
        states: 1,
        ..CheckStats::default()
    };
    let mut frontier: Vec<Vec<u8>> = vec![Vec::new()];
    while !frontier.is_empty() {
        if stats.depth >= opts.depth_max || stats.states >= opts.states_max {
            return Ok(stats);
        }
        let mut next = Vec::new();
        for trace in &frontier {
            let node = replay(&alphabet, trace, opts);
            for (i, step) in alphabet.iter().enumerate() {
                let mut n = node.clone();
                let fail = |what: String| {
                    let mut t: Vec<Step> = trace.iter().map(|i| alphabet[*i as usize]).collect();
                    t.push(*step);
                    Violation { what, trace: t }
                };
                match advance(&mut n, step, opts) {
                    Err(what) => return Err(fail(what)),
                    Ok(false) if matches!(step, Step::Tick) && n.pair.now == node.pair.now => {
                        continue;
                    }
                    Ok(_) => {}
                }
                stats.transitions += 1;
                if seen.insert(fingerprint(&n)) {
                    stats.states += 1;
                    if opts.crash {
                        check_recovery(&n, &mut stats).map_err(fail)?;
                    }
                    let mut t = trace.clone();
                    t.push(i as u8);
                    next.push(t);
                }
            }
        }
        stats.depth += 1;
        frontier = next;
    }
    stats.exhaustive = true;
    Ok(stats)
}
