//! Commands: the only way state changes. Each accepted command is recorded in the ledger with
//! the time it was applied at, so replay reproduces the state exactly.

use crate::ids::{Digest, EffectKey, Principal, PrincipalName, Role, RunId, ToolName};
use crate::vocab::{Decision, EffectClass, Outcome, PolicyAction, Reversibility};
use std::fmt;

/// What the policy decided for a proposed effect, evaluated by the shell and recorded with the
/// admission so that a policy file edited later never changes the past.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyDecision {
    /// Already strengthened by the agent's `needs_approval` where it asked.
    pub action: PolicyAction,
    pub class: EffectClass,
    pub reversibility: Reversibility,
    pub compensate: Option<ToolName>,
    /// How the compensating call's arguments are built (`compensate_args`, CEL text), kept as
    /// the policy said it at admission; the shell evaluates it when the saga gets there.
    pub compensate_args: Option<std::sync::Arc<str>>,
    /// The tool that finds out, by the call's idempotency key, whether a call whose outcome is
    /// unknown happened (`lookup`); the saga asks it before asking a human.
    pub lookup: Option<ToolName>,
    /// How the lookup's arguments are built from the forward call (`lookup_args`, CEL text),
    /// kept as the policy said it at admission; only with `lookup`.
    pub lookup_args: Option<std::sync::Arc<str>>,
    /// Distinct approvers needed (≥ 1 when `action` is approve).
    pub quorum: u32,
    /// Each group needs at least one distinct approver carrying it.
    pub groups: Vec<Box<str>>,
    pub expiry_ms: u64,
    /// The name of the rule that matched (or `unknown_tool`).
    pub rule: std::sync::Arc<str>,
}

/// Per-run limits fixed when the run is created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunLimits {
    /// Absolute deadline, Unix ms.
    pub deadline_at: Option<u64>,
    /// Admissions the run may make in all.
    pub max_effects: Option<u64>,
    /// Model spend, micro-USD, of the run and all its descendants together (`model_usd`).
    pub max_spend: Option<u64>,
    /// Model tokens of the run and all its descendants together (`model_tokens`).
    pub max_tokens: Option<u64>,
}

/// Model spend in each budgeted dimension: a reservation an admission carries, or the cost a
/// completion settles. Bounded by `limits::SPEND_USD_MICROS_MAX` / `SPEND_TOKENS_MAX` at the
/// edge of the kernel, so sums of them never overflow in practice (and saturate if they did).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Spend {
    pub usd_micros: u64,
    pub tokens: u64,
}

impl Spend {
    pub fn is_zero(self) -> bool {
        self == Spend::default()
    }
    pub fn saturating_add(self, o: Spend) -> Spend {
        Spend {
            usd_micros: self.usd_micros.saturating_add(o.usd_micros),
            tokens: self.tokens.saturating_add(o.tokens),
        }
    }
    /// `self - o`; a reservation is only ever released once, so this never goes below zero
    /// (asserted in debug builds, floored otherwise).
    pub fn release(self, o: Spend) -> Spend {
        debug_assert!(
            self.usd_micros >= o.usd_micros && self.tokens >= o.tokens,
            "released more than reserved: {self:?} - {o:?}"
        );
        Spend {
            usd_micros: self.usd_micros.saturating_sub(o.usd_micros),
            tokens: self.tokens.saturating_sub(o.tokens),
        }
    }
}

/// A dimension of the model budget (`RunLimits::max_spend`, `RunLimits::max_tokens`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SpendDimension {
    ModelUsd,
    ModelTokens,
}

impl SpendDimension {
    pub const ALL: &'static [SpendDimension] =
        &[SpendDimension::ModelUsd, SpendDimension::ModelTokens];
    pub fn as_str(self) -> &'static str {
        match self {
            SpendDimension::ModelUsd => "model_usd",
            SpendDimension::ModelTokens => "model_tokens",
        }
    }
    /// The run's limit in this dimension.
    pub fn limit(self, l: &RunLimits) -> Option<u64> {
        match self {
            SpendDimension::ModelUsd => l.max_spend,
            SpendDimension::ModelTokens => l.max_tokens,
        }
    }
    /// The amount of `s` in this dimension.
    pub fn of(self, s: Spend) -> u64 {
        match self {
            SpendDimension::ModelUsd => s.usd_micros,
            SpendDimension::ModelTokens => s.tokens,
        }
    }
}

/// Proof of one admission: bound to the run's epoch at admission time and to a serial unique in
/// the run. A cancel bumps the epoch, so no token issued before it can start anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Token {
    pub epoch: u32,
    pub serial: u64,
}

impl Token {
    /// Parses the wire form `"<epoch>.<serial>"`.
    pub fn parse(s: &str) -> Option<Token> {
        let (e, n) = s.split_once('.')?;
        Some(Token {
            epoch: e.parse().ok()?,
            serial: n.parse().ok()?,
        })
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.epoch, self.serial)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admit {
    pub run: RunId,
    pub key: EffectKey,
    pub tool: ToolName,
    pub digest: Digest,
    /// Canonical argument JSON, kept for operators while the effect awaits a decision.
    pub args: Option<Box<str>>,
    /// With `start`, the admission is the exactly-once start point itself.
    pub start: bool,
    pub parent: Option<RunId>,
    pub labels: Vec<(Box<str>, Box<str>)>,
    pub limits: RunLimits,
    /// Boxed: it is most of an admission's bytes, and every command (in channels, in the
    /// core's queues) would otherwise be that large.
    pub policy: Box<PolicyDecision>,
    /// The model spend this effect may cost at worst (`reserve`), counted on the run and every
    /// ancestor from its admission until its completion settles it. Zero: none.
    pub reserve: Spend,
}

/// An operator's word on one effect of the reverse saga (`saga.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SagaAction {
    /// Settles an effect of unknown outcome: it happened (`ok`, with its result if the
    /// operator knows it, so a compensation built from `result` can be built) or it did not
    /// (`error`). The saga waits for this before compensating anything older.
    Settle {
        outcome: Outcome,
        result: Option<Box<str>>,
    },
    /// Gives a failed or abandoned compensation a fresh budget of attempts, due at once.
    Retry,
    /// Leaves the effect uncompensated, for the recorded reason; the saga goes on past it.
    Skip { reason: Box<str> },
    /// Compensates one effect of a run stopped without a saga (killed, closed, out of time or
    /// budget): opens a saga of that one effect, run like a cancelled run's.
    Compensate,
}

/// A step of the reverse saga the shell takes for the gate itself: settling an unknown outcome
/// by the tool's lookup, or finding that the due compensation cannot be issued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SagaStep {
    /// An executor begins lookup `attempt` of an unknown outcome (the effect's `lookup` tool,
    /// asked by its idempotency key).
    LookupBegin { attempt: u32 },
    /// How lookup `attempt` ended: `ok` it happened (with its result), `error` it did not,
    /// `unknown` the lookup could not tell (a human settles it).
    LookupEnd {
        attempt: u32,
        outcome: Outcome,
        result: Option<Box<str>>,
        error: Option<Box<str>>,
    },
    /// Attempt `attempt` of the compensation is due but cannot be issued: its arguments cannot
    /// be built, or the policy refuses the compensating call. Deterministic, so no backoff: a
    /// human is asked at once, with `reason`.
    Blocked { attempt: u32, reason: Box<str> },
    /// Attempt `attempt` of the compensation is due and a policy `approve` rule holds the
    /// compensating call: an approval is requested with the rule's `quorum`, `groups` and
    /// `expiry_ms` (as the policy says now, recorded so replay does not depend on it), the
    /// arguments the saga built (`args`, shown to the approvers) and `reason`. Nothing is sent
    /// until it is approved; rejected or expired, a human is asked.
    Held {
        attempt: u32,
        quorum: u32,
        groups: Vec<Box<str>>,
        expiry_ms: u64,
        args: Option<Box<str>>,
        reason: Box<str>,
    },
    /// The compensation's approval `approval` (its id in the run) expired unmet: a human is
    /// asked. Taken by the gate once its `expires_at` has passed.
    Expired { approval: u64 },
    /// The call a stopped run's agent left `started` was not reported within `after_ms` of the
    /// stop (the gate's `in_flight_timeout` setting, recorded here so replay does not depend on
    /// today's setting): its outcome becomes `unknown`, settled by its lookup or a human.
    Unreported { after_ms: u64 },
}

/// Whether a token was made or revoked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenAction {
    Create,
    Revoke,
}

impl TokenAction {
    pub const ALL: &'static [TokenAction] = &[TokenAction::Create, TokenAction::Revoke];
    pub fn as_str(self) -> &'static str {
        match self {
            TokenAction::Create => "create",
            TokenAction::Revoke => "revoke",
        }
    }
}

/// A change to the token registry, recorded so the ledger says who created or revoked which
/// principal. It names the principal, never its secret or a hash of it, and changes no gate
/// state: the credentials live in the registry (`DATA/tokens`, or `estop_token` on a
/// PostgreSQL store), the audit trail here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenChange {
    pub action: TokenAction,
    pub name: PrincipalName,
    pub role: Role,
    pub groups: Vec<Box<str>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Propose an effect (creates the run on its first admit).
    Admit(Admit),
    /// Re-evaluate a held effect and consume its approval if one is due (`wait`).
    Recheck {
        run: RunId,
        key: EffectKey,
    },
    /// The commit point of a two-phase effect.
    Start {
        run: RunId,
        key: EffectKey,
        token: Token,
    },
    Complete {
        run: RunId,
        key: EffectKey,
        token: Token,
        outcome: Outcome,
        result: Option<Box<str>>,
        error: Option<Box<str>>,
        /// The model spend the effect cost (`cost`), charged on the run and every ancestor;
        /// zero: none.
        cost: Spend,
    },
    Decide {
        run: RunId,
        key: EffectKey,
        decision: Decision,
        reason: Option<Box<str>>,
    },
    /// Fence the run and its descendants. `kill` skips compensation.
    Cancel {
        run: RunId,
        reason: Option<Box<str>>,
        kill: bool,
    },
    Pause {
        run: RunId,
    },
    Resume {
        run: RunId,
    },
    /// Normal end of a run (`failed` closes it as failed).
    Close {
        run: RunId,
        failed: bool,
    },
    /// Apply what time alone decides for a run: deadline fence, approval expiry.
    Tick {
        run: RunId,
    },
    /// Retention: forget terminal runs stopped at or before `before` (each leaves its fence
    /// as a tombstone), and drop tombstones of runs stopped at or before `tombstones_before`.
    Compact {
        before: u64,
        tombstones_before: u64,
    },
    /// A token was created or revoked (by the record's principal, an operator).
    Token(TokenChange),
    /// An executor begins attempt `attempt` of the compensation of `key` (the saga's head),
    /// with the compensating call's arguments as the shell derived them.
    CompensationBegin {
        run: RunId,
        key: EffectKey,
        attempt: u32,
        args: Option<Box<str>>,
    },
    /// The executor reports how attempt `attempt` of the compensation of `key` ended.
    CompensationEnd {
        run: RunId,
        key: EffectKey,
        attempt: u32,
        outcome: Outcome,
        error: Option<Box<str>>,
    },
    /// An operator settles, retries, skips or compensates one effect of the saga.
    Saga {
        run: RunId,
        key: EffectKey,
        action: SagaAction,
    },
    /// The shell's own step of the saga of effect `key` (a lookup, a blocked compensation).
    SagaStep {
        run: RunId,
        key: EffectKey,
        step: SagaStep,
    },
}

impl Command {
    /// The run a command is about (`None` for gate-wide housekeeping).
    pub fn run(&self) -> Option<&RunId> {
        match self {
            Command::Admit(a) => Some(&a.run),
            Command::Recheck { run, .. }
            | Command::Start { run, .. }
            | Command::Complete { run, .. }
            | Command::Decide { run, .. }
            | Command::Cancel { run, .. }
            | Command::Pause { run }
            | Command::Resume { run }
            | Command::Close { run, .. }
            | Command::Tick { run }
            | Command::CompensationBegin { run, .. }
            | Command::CompensationEnd { run, .. }
            | Command::Saga { run, .. }
            | Command::SagaStep { run, .. } => Some(run),
            Command::Compact { .. } | Command::Token(_) => None,
        }
    }

    /// The effect a command is about (`None` for run-wide and gate-wide ones).
    pub fn key(&self) -> Option<&EffectKey> {
        match self {
            Command::Admit(a) => Some(&a.key),
            Command::Recheck { key, .. }
            | Command::Start { key, .. }
            | Command::Complete { key, .. }
            | Command::Decide { key, .. }
            | Command::CompensationBegin { key, .. }
            | Command::CompensationEnd { key, .. }
            | Command::Saga { key, .. }
            | Command::SagaStep { key, .. } => Some(key),
            Command::Cancel { .. }
            | Command::Pause { .. }
            | Command::Resume { .. }
            | Command::Close { .. }
            | Command::Tick { .. }
            | Command::Compact { .. }
            | Command::Token(_) => None,
        }
    }
}

/// One command as the ledger records it: when, by whom, what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub at: u64,
    pub principal: Principal,
    pub command: Command,
}
