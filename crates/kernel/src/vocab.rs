//! The closed vocabularies of the gate: verdict reasons, classes, outcomes and states.
//! Each has a stable lowercase name used on the wire, in the CLI and in docs.

macro_rules! names {
    ($(#[$doc:meta])* $ty:ident { $($(#[$vdoc:meta])* $variant:ident = $name:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum $ty { $($(#[$vdoc])* $variant),+ }

        impl $ty {
            pub const ALL: &'static [$ty] = &[$($ty::$variant),+];
            pub fn as_str(self) -> &'static str {
                match self { $($ty::$variant => $name),+ }
            }
            pub fn parse(s: &str) -> Option<$ty> {
                match s { $($name => Some($ty::$variant),)+ _ => None }
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

names!(
    /// Why an admission (or a start) was refused. Every reason is final for that effect.
    RefusalReason {
        /// The run or an ancestor was cancelled or killed.
        Cancelled = "cancelled",
        /// An operator rejected this effect, or the same call earlier in the run.
        Rejected = "rejected",
        /// The approval was not given (or not consumed) before it expired: silence is no.
        Expired = "expired",
        /// Policy denies the tool.
        Denied = "denied",
        /// The run used up its effect budget.
        Budget = "budget",
        /// The run passed its deadline.
        Deadline = "deadline",
        /// The key was used before with a different argument digest.
        Mismatch = "mismatch",
        /// The run was closed (normal completion).
        Closed = "closed",
    }
);

names!(
    /// Why an effect is held instead of admitted.
    HoldReason {
        /// It awaits an operator decision.
        Approval = "approval",
        /// Another effect of the run (or an ancestor run) awaits approval (G1).
        Sibling = "sibling",
        /// The run or an ancestor is paused.
        Paused = "paused",
    }
);

names!(
    /// Whether an effect changes the outside world.
    EffectClass {
        Read = "read",
        Write = "write",
    }
);

names!(
    /// What can be done about an effect after the fact.
    Reversibility {
        Reversible = "reversible",
        Compensable = "compensable",
        Irreversible = "irreversible",
        /// Nobody said; reported as such and never assumed undoable.
        Undeclared = "undeclared",
    }
);

names!(
    /// What the agent reports about an effect it ran.
    Outcome {
        Ok = "ok",
        Error = "error",
        /// The agent cannot tell whether the effect happened (e.g. cancelled mid-call).
        Unknown = "unknown",
    }
);

names!(
    /// An operator's decision on a held effect.
    Decision {
        Approve = "approve",
        Reject = "reject",
    }
);

names!(
    /// What the policy says about a call.
    PolicyAction {
        Allow = "allow",
        Approve = "approve",
        Deny = "deny",
    }
);

names!(
    /// Gate-level state of a run (SPEC §3).
    RunState {
        Active = "active",
        Paused = "paused",
        /// Stopped; in-flight effects are being settled.
        Finalizing = "finalizing",
        Completed = "completed",
        Failed = "failed",
        Cancelled = "cancelled",
    }
);

impl RunState {
    /// Terminal states absorb: nothing leaves them.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            RunState::Completed | RunState::Failed | RunState::Cancelled
        )
    }
}

names!(
    /// Why a run was stopped.
    StopCause {
        /// Cancelled by an operator or by the agent itself.
        Cancelled = "cancelled",
        /// Killed: a cancel that skips compensation.
        Killed = "killed",
        /// The run's deadline passed.
        Deadline = "deadline",
        /// The run's effect budget was used up.
        Budget = "budget",
        /// Closed normally.
        Closed = "closed",
        /// Closed as failed.
        Failed = "failed",
    }
);

impl StopCause {
    /// The refusal reason every later admission of a run stopped this way gets.
    pub fn refusal(self) -> RefusalReason {
        match self {
            StopCause::Cancelled | StopCause::Killed => RefusalReason::Cancelled,
            StopCause::Deadline => RefusalReason::Deadline,
            StopCause::Budget => RefusalReason::Budget,
            StopCause::Closed | StopCause::Failed => RefusalReason::Closed,
        }
    }

    /// The state a run stopped this way ends in once nothing of it is in flight.
    pub fn terminal_state(self) -> RunState {
        match self {
            StopCause::Closed => RunState::Completed,
            StopCause::Failed => RunState::Failed,
            StopCause::Cancelled | StopCause::Killed | StopCause::Deadline | StopCause::Budget => {
                RunState::Cancelled
            }
        }
    }
}

names!(
    /// Lifecycle status of one effect (SPEC §3).
    EffectStatus {
        Held = "held",
        Approved = "approved",
        Admitted = "admitted",
        Started = "started",
        Completed = "completed",
        Failed = "failed",
        Unknown = "unknown",
        Refused = "refused",
        Compensating = "compensating",
        Compensated = "compensated",
        CompensationFailed = "compensation_failed",
        NeedsHuman = "needs_human",
        /// An operator decided not to compensate it (the reason is recorded). Listed last: the
        /// codec stores a status by its position.
        CompensationSkipped = "compensation_skipped",
    }
);
