//! What an `admit`, `wait` or `start` came to, as one typed outcome: the verdict strings of
//! the wire are read here (and in the protocol crate) and nowhere else.

use estop_protocol::VerdictReply;
use estop_protocol::server_line::BudgetOver;
use estop_protocol::vocab::{HoldReason, RefusalReason};
use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
pub enum Admission {
    /// Go ahead: with a two-phase `admit`, present `token` at `start`. (`start`'s own
    /// go-ahead carries no token: `token` is empty.)
    Admitted { token: String, epoch: u64 },
    /// Not yet: `wait`, then ask again.
    Held {
        /// The approval waited for; `None` for a sibling or pause hold.
        approval: Option<String>,
        /// Unix ms; `None` for a sibling or pause hold.
        expires_at: Option<u64>,
        reason: HoldReason,
    },
    /// The run is stopped (cancelled or killed, closed, past its deadline): nothing of it
    /// runs any more. `reason` says which.
    Stopped { reason: RefusalReason },
    /// Never, for this effect (policy, an operator's rejection, an expired approval, a
    /// budget, another digest under the key).
    Refused {
        reason: RefusalReason,
        message: Option<String>,
        rule: Option<String>,
        budget: Option<BudgetOver>,
    },
    /// This identity was admitted before: its recorded status, and outcome once complete.
    Duplicate {
        status: String,
        outcome: Option<String>,
        result: Option<Value>,
        error: Option<String>,
    },
}

impl Admission {
    /// Whether the effect may run now.
    pub fn is_admitted(&self) -> bool {
        matches!(self, Admission::Admitted { .. })
    }

    /// Whether the answer is final for this effect (not held).
    pub fn is_final(&self) -> bool {
        !matches!(self, Admission::Held { .. })
    }
}

impl From<VerdictReply> for Admission {
    fn from(v: VerdictReply) -> Admission {
        match v {
            VerdictReply::Admitted { token, epoch } => Admission::Admitted { token, epoch },
            VerdictReply::Go => Admission::Admitted {
                token: String::new(),
                epoch: 0,
            },
            VerdictReply::Held {
                approval,
                expires_at,
                reason,
            } => Admission::Held {
                approval,
                expires_at,
                reason,
            },
            VerdictReply::Refused {
                reason:
                    reason
                    @ (RefusalReason::Cancelled | RefusalReason::Closed | RefusalReason::Deadline),
                ..
            } => Admission::Stopped { reason },
            VerdictReply::Refused {
                reason,
                message,
                rule,
                budget,
            } => Admission::Refused {
                reason,
                message,
                rule,
                budget,
            },
            VerdictReply::Duplicate {
                status,
                outcome,
                result,
                error,
            } => Admission::Duplicate {
                status,
                outcome,
                result,
                error,
            },
        }
    }
}
