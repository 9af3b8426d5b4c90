//! What the kernel answers: verdicts, acknowledgements, typed errors, and events for subscribers.

use crate::command::{SpendDimension, Token};
use crate::ids::{EffectKey, PrincipalName, RunId};
use crate::vocab::{EffectStatus, HoldReason, Outcome, RefusalReason, RunState};

/// The answer to `admit`, `wait` and `start`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Admitted {
        token: Token,
    },
    /// `start` said go (or `admit` with `start` admitted *and* started it).
    Go,
    Held {
        reason: HoldReason,
        approval: Option<u64>,
        expires_at: Option<u64>,
    },
    Refused {
        reason: RefusalReason,
        /// For a model reservation refused (`budget`): the dimension and the run whose limit
        /// it would pass. Given with the refusal only; a repeat of the admission says `budget`.
        over: Option<Box<Over>>,
    },
    /// The identity was admitted before: its recorded status and outcome (a receipt).
    Duplicate {
        status: EffectStatus,
        outcome: Option<Outcome>,
        result: Option<Box<str>>,
        error: Option<Box<str>>,
    },
}

/// A model budget a reservation would pass: its dimension and the run whose limit it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Over {
    pub dimension: SpendDimension,
    pub run: RunId,
    pub limit: u64,
    /// Spent plus reserved on that run (its subtree) before this reservation.
    pub used: u64,
}

impl Verdict {
    /// A refusal without a budget's detail.
    pub fn refused(reason: RefusalReason) -> Verdict {
        Verdict::Refused { reason, over: None }
    }
}

/// Progress of a decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecideStatus {
    /// Quorum reached: the agent's `wait` now admits it.
    Approved,
    /// More approvers are needed (`missing_groups`: groups no approver so far belongs to).
    Pending {
        approvals: u32,
        quorum: u32,
        missing_groups: Vec<Box<str>>,
    },
    Rejected,
}

/// The answer to `decide`: its progress, and what the wire shows of the approval after it (so
/// the shell renders it without reading the gate's state).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decided {
    pub status: DecideStatus,
    /// Who has approved so far, in order.
    pub approvers: Vec<PrincipalName>,
    pub quorum: u32,
    /// When the approval was requested (gate time, ms): how long the decision took.
    pub requested_at: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Verdict(Verdict),
    /// `complete` was recorded; `late` when the run had been stopped before it arrived.
    Completed {
        late: bool,
    },
    /// `complete` contradicted the outcome (or the cost) already settled: refused, and the
    /// attempt recorded (`Effect::disputes`) rather than dropped. `settled` is the outcome that
    /// stands.
    Disputed {
        settled: &'static str,
    },
    Decided(Decided),
    /// The run's state after a cancel, pause, resume, close or tick, and how many runs changed.
    RunState {
        state: RunState,
        runs_changed: u32,
    },
    /// Retention: stopped runs forgotten (each leaving a tombstone, unless its tombstone's
    /// retention had passed too), and tombstones dropped.
    Compacted {
        runs: u32,
        tombstones: u32,
    },
    /// A token change was recorded.
    TokenRecorded,
    /// Where the compensation of one effect stands after a saga command: its status, the
    /// attempt it is at, and when a failed attempt may be retried.
    Compensation {
        status: EffectStatus,
        attempt: u32,
        retry_at: Option<u64>,
    },
}

/// Errors a client, an agent or an operator can cause. Each writes nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    #[error("run {0} not found")]
    RunNotFound(RunId),
    #[error("effect {1} of run {0} not found")]
    EffectNotFound(RunId, EffectKey),
    #[error("effect {key} of run {run} is not awaiting approval (it is {status})")]
    NotAwaitingApproval {
        run: RunId,
        key: EffectKey,
        status: &'static str,
    },
    #[error(
        "{principal} has already approved effect {key} of run {run}; a quorum needs distinct approvers"
    )]
    DuplicateApprover {
        run: RunId,
        key: EffectKey,
        principal: String,
    },
    #[error("the token does not belong to effect {key} of run {run}")]
    BadToken { run: RunId, key: EffectKey },
    #[error("effect {key} of run {run} was not started (call start first)")]
    NotStarted { run: RunId, key: EffectKey },
    #[error("run {run} already has parent {existing}, not {given}")]
    ParentMismatch {
        run: RunId,
        existing: String,
        given: RunId,
    },
    #[error("run {run} is {state}: {what} is not possible")]
    InvalidState {
        run: RunId,
        state: &'static str,
        what: &'static str,
    },
    /// `hint` says what to do, starting with "; " (or is empty).
    #[error("limit reached: {limit} = {max}{hint}")]
    Limit {
        limit: &'static str,
        max: u64,
        hint: &'static str,
    },
    /// A change the tables in `transitions` do not allow: of effect `key` of the run, or of the
    /// run itself when `key` is `None`. A bug, refused before anything changed.
    #[error("illegal transition of {} from {from} to {to}", subject(.run, .key.as_ref()))]
    IllegalTransition {
        run: RunId,
        key: Option<EffectKey>,
        from: &'static str,
        to: &'static str,
    },
    /// A saga command that does not fit where the saga stands (`what` says why and what to do).
    #[error("effect {key} of run {run}: {what}")]
    Saga {
        run: RunId,
        key: EffectKey,
        what: String,
    },
    /// An operator's `retry` of a compensation whose compensating call awaits approval: the
    /// approvers' quorum decides it, never one retry.
    #[error(
        "the compensation of effect {key} of run {run} awaits approval {run}#{approval}: decide it with approve or reject (a quorum of distinct approvers), not retry"
    )]
    UndoAwaitsApproval {
        run: RunId,
        key: EffectKey,
        approval: u64,
    },
    #[error("operation requires the operator role")]
    Forbidden,
    /// A per-effect verb (`admit` again, `wait`, `start`, `complete`) from a part of the run's
    /// principal other than the one that admitted the effect (`Effect::holder`): the egress
    /// proxy's requests are its own, never the sandbox's.
    #[error(
        "effect {key} of run {run} was admitted by the run's {holder} part: only that part may admit it again, wait for it, start or complete it"
    )]
    NotHolder {
        run: RunId,
        key: EffectKey,
        holder: &'static str,
    },
    #[error(
        "run {run} was forgotten after its retention period (only its fence is kept: see status); {what} has nothing left to act on"
    )]
    Forgotten { run: RunId, what: &'static str },
}

/// What an illegal transition was of: "effect K of run R", or "run R".
fn subject(run: &RunId, key: Option<&EffectKey>) -> String {
    match key {
        Some(key) => format!("effect {key} of run {run}"),
        None => format!("run {run}"),
    }
}

impl KernelError {
    /// The refusal at bound `limit`, with what to do about it.
    pub fn limit(limit: &'static str, max: usize) -> KernelError {
        let hint = match limit {
            "runs_max" => {
                "; close or cancel runs that are done: a stopped run is forgotten after the retention period (estop serve --retention), or raise --runs-max"
            }
            "runs_per_principal_max" => {
                "; this principal holds that many runs: close or cancel those that are done (a stopped run is forgotten after the retention period), or raise --runs-per-principal-max"
            }
            "runs_per_token_max" => {
                "; this token and the sandboxes that speak for it hold that many runs together: close or cancel those that are done, or raise --runs-per-token-max"
            }
            "held_per_token_max" => {
                "; this token and the sandboxes that speak for it hold that many effects together: wait for them to be decided, expire or be cancelled, or raise --held-per-token-max"
            }
            "held_max" | "held_per_principal_max" => {
                "; wait for held effects to be decided, expire or be cancelled before proposing more"
            }
            "tombstones_max" => {
                "; every stopped run waits for room to leave its fence as a tombstone, so none is forgotten: raise --tombstones-max or shorten --tombstone-retention"
            }
            _ => "",
        };
        KernelError::Limit {
            limit,
            max: max as u64,
            hint,
        }
    }

    /// Stable code for operators and scripts (documented in docs/PROTOCOL.md).
    pub fn code(&self) -> &'static str {
        match self {
            KernelError::RunNotFound(_)
            | KernelError::EffectNotFound(..)
            | KernelError::Forgotten { .. } => "not_found",
            KernelError::NotAwaitingApproval { .. } => "not_awaiting_approval",
            KernelError::DuplicateApprover { .. } => "duplicate_approver",
            KernelError::BadToken { .. } => "bad_token",
            KernelError::NotStarted { .. } => "not_started",
            KernelError::ParentMismatch { .. } => "parent_mismatch",
            KernelError::InvalidState { .. } => "invalid_state",
            KernelError::Limit { .. } => "limit",
            KernelError::IllegalTransition { .. } => "illegal_transition",
            KernelError::Saga { .. } => "saga",
            KernelError::UndoAwaitsApproval { .. } => "undo_awaits_approval",
            KernelError::Forbidden | KernelError::NotHolder { .. } => "forbidden",
        }
    }
}

/// Something a subscriber of a run wants to know, and what wakes its waiters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    Held,
    Decided,
    Expired,
    Admitted,
    Completed,
    Paused,
    Resumed,
    Cancelled,
    Finalizing,
    Closed,
    /// The last in-flight effect of a stopped run settled: the run is now terminal.
    Settled,
    /// The compensation of an effect moved (began, ended, retried, skipped) or its unknown
    /// outcome was settled: executors look for the saga's next step.
    Compensation,
}

impl EventKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Held => "held",
            EventKind::Decided => "decided",
            EventKind::Expired => "expired",
            EventKind::Admitted => "admitted",
            EventKind::Completed => "completed",
            EventKind::Paused => "paused",
            EventKind::Resumed => "resumed",
            EventKind::Cancelled => "cancelled",
            EventKind::Finalizing => "finalizing",
            EventKind::Closed => "closed",
            EventKind::Settled => "settled",
            EventKind::Compensation => "compensation",
        }
    }

    /// Whether waiters of the run (and its descendants) should re-check their held effects.
    pub fn wakes_waiters(self) -> bool {
        !matches!(
            self,
            EventKind::Held
                | EventKind::Admitted
                | EventKind::Completed
                | EventKind::Finalizing
                | EventKind::Settled
                | EventKind::Compensation
        )
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub run: RunId,
    pub key: Option<EffectKey>,
    pub kind: EventKind,
    pub detail: Option<&'static str>,
}

/// The result of applying one command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    pub reply: Reply,
    /// Whether state changed (only then is the command recorded in the ledger).
    pub changed: bool,
    pub events: Vec<Event>,
}
