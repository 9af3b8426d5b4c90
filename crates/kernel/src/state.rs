//! The gate's state: runs, their effects, fences and approvals. Only `apply` mutates it.

use crate::command::{PolicyDecision, RunLimits, Spend, Token};
use crate::ids::{Digest, PrincipalName, RunId, ToolName};
use crate::vocab::{
    EffectClass, EffectStatus, HoldReason, Outcome, PolicyAction, RefusalReason, Reversibility,
    RunState, StopCause,
};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

pub use crate::ids::EffectKey;

/// Lifecycle of one effect, with the data each state needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Held(HoldReason),
    /// Quorum reached; consumed (atomically with the admission) by the next `admit`/`wait`.
    Approved,
    /// Prepared: a token is out, `start` not yet called.
    Admitted,
    /// In flight.
    Started,
    Completed,
    Failed,
    Unknown,
    Refused(RefusalReason),
    Compensating,
    Compensated,
    CompensationFailed,
    NeedsHuman,
    CompensationSkipped,
}

impl Status {
    pub fn kind(self) -> EffectStatus {
        match self {
            Status::Held(_) => EffectStatus::Held,
            Status::Approved => EffectStatus::Approved,
            Status::Admitted => EffectStatus::Admitted,
            Status::Started => EffectStatus::Started,
            Status::Completed => EffectStatus::Completed,
            Status::Failed => EffectStatus::Failed,
            Status::Unknown => EffectStatus::Unknown,
            Status::Refused(_) => EffectStatus::Refused,
            Status::Compensating => EffectStatus::Compensating,
            Status::Compensated => EffectStatus::Compensated,
            Status::CompensationFailed => EffectStatus::CompensationFailed,
            Status::NeedsHuman => EffectStatus::NeedsHuman,
            Status::CompensationSkipped => EffectStatus::CompensationSkipped,
        }
    }

    /// Held before admission (for approval, a sibling or a pause), or approved and not yet
    /// consumed: what counts against `held_max` and `held_per_principal_max`.
    pub fn is_held(self) -> bool {
        matches!(self, Status::Held(_) | Status::Approved)
    }

    /// Still waiting for something before it may start.
    pub fn is_held_or_prepared(self) -> bool {
        matches!(self, Status::Held(_) | Status::Approved | Status::Admitted)
    }
}

/// One approver's vote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Approver {
    pub name: PrincipalName,
    pub groups: Vec<Box<str>>,
    pub at: u64,
}

/// The approval an effect needs and how far it got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Approval {
    /// Unique within the run; shown as `<run>#<id>`.
    pub id: u64,
    pub quorum: u32,
    pub groups: Vec<Box<str>>,
    pub expiry_ms: u64,
    /// When the request was made (0 before the effect is held for approval).
    pub requested_at: u64,
    /// Silence is no: after this instant the approval can neither be given nor consumed.
    pub expires_at: u64,
    pub approvers: Vec<Approver>,
    pub rejected_by: Option<PrincipalName>,
    pub reason: Option<Box<str>>,
}

impl Approval {
    /// Whether the recorded approvers satisfy the quorum and the group constraints:
    /// `quorum` distinct principals, and a distinct approver for every group.
    pub fn satisfied(&self) -> bool {
        if (self.approvers.len() as u64) < u64::from(self.quorum) {
            return false;
        }
        // Assign a distinct approver to each group (tiny sizes: backtracking is exact and cheap).
        fn assign(groups: &[Box<str>], approvers: &[Approver], used: &mut Vec<bool>) -> bool {
            let Some((first, rest)) = groups.split_first() else {
                return true;
            };
            for (i, a) in approvers.iter().enumerate() {
                if !used[i] && a.groups.iter().any(|g| g == first) {
                    used[i] = true;
                    if assign(rest, approvers, used) {
                        return true;
                    }
                    used[i] = false;
                }
            }
            false
        }
        let mut used = vec![false; self.approvers.len()];
        assign(&self.groups, &self.approvers, &mut used)
    }
}

/// A recorded result or error of an effect.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OutcomeRecord {
    pub outcome: Option<Outcome>,
    pub result: Option<Box<str>>,
    pub error: Option<Box<str>>,
}

/// How far the compensation of one effect got (the reverse saga, `saga.rs`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Compensation {
    /// Attempts begun (each numbered from 1; an attempt's begin and end name its number, so a
    /// repeated report is recognised, never applied twice).
    pub attempts: u32,
    /// Attempts allowed before a human is asked (an operator's retry raises it).
    pub granted: u32,
    /// A failed attempt may be retried from this instant (exponential backoff).
    pub retry_at: u64,
    /// The compensating call's arguments as the last attempt began with them.
    pub args: Option<Box<str>>,
    /// The last attempt's error, or the reason an operator skipped it.
    pub note: Option<Box<str>>,
    /// The operator who last retried, skipped or asked for it.
    pub by: Option<PrincipalName>,
    /// Lookups of an unknown outcome begun (the effect's `lookup` tool, numbered from 1).
    pub lookups: u32,
    /// Lookups allowed before a human settles it (1; an operator's retry raises it).
    pub lookups_granted: u32,
    /// The latest lookup is under way.
    pub lookup_open: bool,
    /// An operator asked for this one compensation on a run stopped without a saga (a kill, a
    /// close, a deadline or budget): the effect has a saga of its own.
    pub chosen: bool,
    /// The approval a policy `approve` rule asked for the compensating call (`saga::undo`):
    /// requested when its attempt was due, decided like an admission's (`decide`, a quorum of
    /// distinct principals). Nothing is sent while it is open; a rejected or expired one leaves
    /// the effect `needs_human`.
    pub approval: Option<Box<Approval>>,
}

/// Whether an effect of `tool` keeps its arguments for good: the egress proxy's HTTP requests
/// (`http.METHOD`) and model calls (`model.call`), whose arguments (method, URL, host… of what
/// was sent, docs/EGRESS.md) are the audit trail of what an agent reached. The gate records
/// them with the admission and the report shows them; each is bounded by `args_bytes_max`.
/// Other tools' arguments are kept only for an operator's review or the saga.
pub fn args_kept(tool: &str) -> bool {
    tool.starts_with("http.") || tool == "model.call"
}

/// One side effect of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Effect {
    pub tool: ToolName,
    pub digest: Digest,
    pub class: EffectClass,
    pub reversibility: Reversibility,
    pub compensate: Option<ToolName>,
    /// `compensate_args` as recorded with the admission (CEL text).
    pub compensate_args: Option<Arc<str>>,
    /// The tool that looks up whether the call happened, by its idempotency key (`lookup`).
    pub lookup: Option<ToolName>,
    /// `lookup_args` as recorded with the admission (CEL text).
    pub lookup_args: Option<Arc<str>>,
    /// Shared with every effect the same rule decided (see `Interner`).
    pub rule: Arc<str>,
    pub action: PolicyAction,
    pub approval: Option<Box<Approval>>,
    /// The arguments as the compact JSON text the gate validated at admission, kept only while
    /// an operator may need to review them, or for good when `compensate_args` builds the
    /// compensating call from them. Shared (`Arc`), so a listing copies a pointer, not
    /// the text, and never parses it again: the renderer writes it out as it is.
    pub args: Option<Arc<str>>,
    pub start_on_admit: bool,
    /// The part of the run's principal that admitted it, the only one that may start it,
    /// complete it, wait for it or admit it again (`crate::Part`).
    pub holder: crate::ids::Part,
    /// Completions refused because they contradicted the outcome or cost already settled
    /// (each is on the ledger as the command it was; the report shows the count).
    pub disputes: u32,
    pub status: Status,
    pub token: Option<Token>,
    pub created_at: u64,
    pub updated_at: u64,
    /// Its outcome arrived after the run was stopped.
    pub late: bool,
    pub outcome: Option<Box<OutcomeRecord>>,
    /// Its compensation, once the reverse saga or an operator touched it.
    pub saga: Option<Box<Compensation>>,
    /// Its model spend, when its admission carried a reservation or its completion a cost.
    pub spend: Option<Box<EffectSpend>>,
}

/// The model spend of one effect (`Admit::reserve`, `Command::Complete`'s `cost`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EffectSpend {
    /// The reservation its admission asked for.
    pub reserve: Spend,
    /// The reservation is counted in `reserved` of its run and every ancestor: from the
    /// admission (a token issued) until a completion settles it or the effect is voided before
    /// it started. A call started and never completed keeps it counted: the worst case.
    pub counted: bool,
    /// What its completion charged, once.
    pub cost: Option<Spend>,
}

impl Effect {
    /// The outcome the agent reported: recorded explicitly when it came with a result or an
    /// error (or late, after the effect was voided), otherwise implied by the status — which
    /// saves an allocation per completed effect.
    pub fn outcome_kind(&self) -> Option<Outcome> {
        self.outcome
            .as_ref()
            .and_then(|o| o.outcome)
            .or(match self.status {
                Status::Completed
                | Status::Compensating
                | Status::Compensated
                | Status::CompensationFailed
                | Status::NeedsHuman
                | Status::CompensationSkipped => Some(Outcome::Ok),
                Status::Failed => Some(Outcome::Error),
                Status::Unknown => Some(Outcome::Unknown),
                _ => None,
            })
    }

    /// Takes the token `Run::issue_token` gave it: prepared, or in flight if it started on
    /// admission.
    pub(crate) fn take_token(&mut self, token: Token, now: u64) {
        self.status = if self.start_on_admit {
            Status::Started
        } else {
            Status::Admitted
        };
        self.token = Some(token);
        // The arguments were kept for an operator's review; an effect whose compensation is
        // built from them (`compensate_args`), or that a lookup may need to find, keeps them
        // for the saga, and an egress effect for its report (`args_kept`).
        if self.compensate_args.is_none() && self.lookup.is_none() && !args_kept(self.tool.as_str())
        {
            self.args = None;
        }
        self.updated_at = now;
    }

    pub(crate) fn new(
        now: u64,
        tool: ToolName,
        rule: Arc<str>,
        digest: Digest,
        p: &PolicyDecision,
        start: bool,
    ) -> Effect {
        Effect {
            tool,
            digest,
            class: p.class,
            reversibility: p.reversibility,
            compensate: p.compensate.clone(),
            compensate_args: p.compensate_args.clone(),
            lookup: p.lookup.clone(),
            lookup_args: p.lookup_args.clone(),
            rule,
            action: p.action,
            approval: None,
            args: None,
            start_on_admit: start,
            holder: crate::ids::Part::Main,
            disputes: 0,
            status: Status::Held(HoldReason::Paused),
            token: None,
            created_at: now,
            updated_at: now,
            late: false,
            outcome: None,
            saga: None,
            spend: None,
        }
    }
}

/// Why and when a run was stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stop {
    pub cause: StopCause,
    pub reason: Option<Box<str>>,
    pub by: Option<PrincipalName>,
    pub at: u64,
    /// The stop was inherited from this ancestor's stop.
    pub from: Option<RunId>,
}

/// One agent trajectory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    pub parent: Option<RunId>,
    pub children: Vec<RunId>,
    /// The agent principal that created it; `None` for a fence an operator set on a run id not
    /// yet seen (every principal's admit is refused by it).
    pub owner: Option<PrincipalName>,
    pub labels: Vec<(Box<str>, Box<str>)>,
    pub created_at: u64,
    pub state: RunState,
    pub stop: Option<Stop>,
    pub epoch: u32,
    pub limits: RunLimits,
    /// Admissions made (counts against `limits.max_effects`).
    pub admitted: u64,
    /// Model spend settled by the run and all its descendants (forgotten ones too), against
    /// `limits.max_spend` / `limits.max_tokens`.
    pub spent: Spend,
    /// Model spend reserved and not yet settled in the run and all its descendants.
    pub reserved: Spend,
    /// Effects currently held for an operator decision.
    pub pending_approvals: u32,
    /// Effects started and not yet settled.
    pub in_flight: u32,
    pub effects: BTreeMap<EffectKey, Effect>,
    /// Digests of calls an operator rejected in this run (G2: never admitted again).
    pub rejected: BTreeSet<Digest>,
    pub next_serial: u64,
    pub next_approval: u64,
    /// Effects whose status `is_held`. Derived state (rebuilt from effects on decode).
    pub held: u32,
    /// Expiry of every effect held for approval or approved and not yet consumed: the index
    /// that makes `Gate::next_timer` O(log n). Derived state (rebuilt from effects on decode).
    pub expiries: BTreeSet<(u64, EffectKey)>,
}

impl Run {
    pub(crate) fn new(now: u64, owner: Option<PrincipalName>, parent: Option<RunId>) -> Run {
        Run {
            parent,
            children: Vec::new(),
            owner,
            labels: Vec::new(),
            created_at: now,
            state: RunState::Active,
            stop: None,
            epoch: 1,
            limits: RunLimits::default(),
            admitted: 0,
            spent: Spend::default(),
            reserved: Spend::default(),
            pending_approvals: 0,
            in_flight: 0,
            effects: BTreeMap::new(),
            rejected: BTreeSet::new(),
            next_serial: 1,
            next_approval: 1,
            held: 0,
            expiries: BTreeSet::new(),
        }
    }

    /// The token of the run's next admission (which counts against its budget); `start`: the
    /// effect starts with it, so it is in flight.
    pub(crate) fn issue_token(&mut self, start: bool) -> Token {
        self.admitted += 1;
        let token = Token {
            epoch: self.epoch,
            serial: self.next_serial,
        };
        self.next_serial += 1;
        if start {
            self.in_flight += 1;
        }
        token
    }

    pub fn is_stopped(&self) -> bool {
        self.stop.is_some()
    }

    /// Rebuilds the derived state from the effects (after decoding a snapshot).
    pub(crate) fn index(&mut self) {
        self.held = self.effects.values().filter(|e| e.status.is_held()).count() as u32;
        self.expiries = self
            .effects
            .iter()
            .filter(|(_, e)| {
                matches!(
                    e.status,
                    Status::Held(HoldReason::Approval) | Status::Approved
                )
            })
            .filter_map(|(k, e)| e.approval.as_ref().map(|a| (a.expires_at, k.clone())))
            .collect();
    }
}

/// What is left of a forgotten run: its fence. Retention forgets a stopped run's state, and
/// this stays until its own (longer) retention passes, so an admit on the id, or a sub-agent
/// naming it as parent, is refused exactly as the stopped run refused it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tombstone {
    /// As `Run::owner`: agents see only their own.
    pub owner: Option<PrincipalName>,
    pub cause: StopCause,
    /// The run's last epoch (every token it issued is older).
    pub epoch: u32,
    pub created_at: u64,
    pub stopped_at: u64,
}

/// What one principal holds in the gate: its runs not yet forgotten and its held effects.
/// Derived state (kept by `Gate` as runs and effects change, rebuilt on decode).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub runs: u64,
    pub held: u64,
}

/// One shared copy of each tool and rule name, so a million effects that call `pay` under the
/// same rule hold two pointers, not two million strings. Bounded: past the limit names are
/// simply not shared. Derived state: it never takes part in equality.
#[derive(Debug, Clone, Default)]
pub struct Interner {
    tools: BTreeSet<ToolName>,
    rules: BTreeSet<Arc<str>>,
}

impl PartialEq for Interner {
    fn eq(&self, _: &Interner) -> bool {
        true
    }
}

impl Eq for Interner {}

/// Names shared at most (each kind).
pub const INTERNED_MAX: usize = 65_536;

impl Interner {
    pub fn tool(&mut self, tool: &ToolName) -> ToolName {
        if let Some(t) = self.tools.get(tool) {
            return t.clone();
        }
        if self.tools.len() < INTERNED_MAX {
            self.tools.insert(tool.clone());
        }
        tool.clone()
    }

    pub fn rule(&mut self, rule: &str) -> Arc<str> {
        if let Some(r) = self.rules.get(rule) {
            return Arc::clone(r);
        }
        let r: Arc<str> = Arc::from(rule);
        if self.rules.len() < INTERNED_MAX {
            self.rules.insert(Arc::clone(&r));
        }
        r
    }
}
