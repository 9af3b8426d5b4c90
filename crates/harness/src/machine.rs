//! The trajectory state machine of seed 004 (Table 5, listing 2): a closed set of states, the
//! legal transitions as data, and one guarded [`transition`] through which every state change
//! of a [`Record`] passes. An illegal move is a typed [`TransitionError`] that changes nothing.

use crate::record::{Exit, Record};
use serde::{Deserialize, Serialize};

/// The closed state set: six live states, one cleanup barrier and three terminal states.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum State {
    /// Queued for its next model call; holds only the record.
    Ready,
    /// One model call in flight, with an output bound and a deadline.
    CallingModel,
    /// Tool calls dispatched, results not all back.
    WaitingTool,
    /// An irreversible call held for a decision.
    AwaitingApproval,
    /// Paused at a turn boundary, waiting for a human.
    Paused,
    /// Cleanup before exit: outstanding work cancelled, leases released, completion check run.
    Finalizing,
    Completed,
    Failed,
    Canceled,
}

use State::*;

impl State {
    pub const ALL: [State; 9] = [
        Ready,
        CallingModel,
        WaitingTool,
        AwaitingApproval,
        Paused,
        Finalizing,
        Completed,
        Failed,
        Canceled,
    ];

    /// The live states: every one may leave for `FINALIZING`.
    pub const LIVE: [State; 5] = [Ready, CallingModel, WaitingTool, AwaitingApproval, Paused];

    pub fn is_terminal(self) -> bool {
        matches!(self, Completed | Failed | Canceled)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Ready => "READY",
            CallingModel => "CALLING_MODEL",
            WaitingTool => "WAITING_TOOL",
            AwaitingApproval => "AWAITING_APPROVAL",
            Paused => "PAUSED",
            Finalizing => "FINALIZING",
            Completed => "COMPLETED",
            Failed => "FAILED",
            Canceled => "CANCELED",
        }
    }
}

impl std::fmt::Display for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Seed 004, Table 5 and listing 2: the legal transitions, as data. `PAUSED` is entered only
/// from `READY`; every exit goes through `FINALIZING`; terminal states have no way out.
pub const LEGAL: &[(State, State)] = &[
    (Ready, CallingModel),
    (Ready, Paused),
    (Ready, Finalizing),
    (CallingModel, Ready),
    (CallingModel, WaitingTool),
    (CallingModel, AwaitingApproval),
    (CallingModel, Finalizing),
    (WaitingTool, Ready),
    (WaitingTool, Finalizing),
    (AwaitingApproval, WaitingTool),
    (AwaitingApproval, Ready),
    (AwaitingApproval, Finalizing),
    (Paused, Ready),
    (Paused, Finalizing),
    (Finalizing, Completed),
    (Finalizing, Failed),
    (Finalizing, Canceled),
];

pub fn is_legal(from: State, to: State) -> bool {
    LEGAL.contains(&(from, to))
}

/// Why a move is asked for: the event that drives it. Guards read it; the journal keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Cause {
    /// The scheduler gave the trajectory a turn.
    Scheduled,
    /// The model's reply had nothing to dispatch (text, truncation, refusal, failed call) or
    /// the call was cut for a control request.
    Observed,
    /// Tool calls were admitted and dispatched.
    Dispatched,
    /// A call was held for approval.
    Held,
    /// Every held call is decided: the approved ones (re-checked) are dispatched.
    Decided,
    /// The held call was refused (denied, expired, cancelled): a refusal observation instead.
    Refused,
    /// Every pending tool result is in (or timed out).
    ToolsDone,
    /// A pause request applied at a boundary.
    Pause,
    /// A resume request.
    Resume,
    /// An exit begins (its reason is in the record's `exit`).
    Exit,
    /// The cleanup is done; the record's exit says which terminal state follows.
    Finalized,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    #[error("illegal transition {from} -> {to} ({cause:?})")]
    Illegal {
        from: State,
        to: State,
        cause: Cause,
    },
    #[error("guard refused {from} -> {to}: {why}")]
    Guard {
        from: State,
        to: State,
        why: &'static str,
    },
}

/// The one way a record's state changes: the move must be in [`LEGAL`] and pass its guard;
/// otherwise nothing changes. Returns the state left.
pub fn transition(rec: &mut Record, to: State, cause: Cause) -> Result<State, TransitionError> {
    let from = rec.state;
    if !is_legal(from, to) {
        return Err(TransitionError::Illegal { from, to, cause });
    }
    guard(rec, from, to, &cause).map_err(|why| TransitionError::Guard { from, to, why })?;
    rec.state = to;
    rec.transitions += 1;
    Ok(from)
}

/// The guards of seed 004's invariants, each on the move it protects.
fn guard(rec: &Record, from: State, to: State, cause: &Cause) -> Result<(), &'static str> {
    match (from, to) {
        // Tool results are accepted only while pending: leaving WAITING_TOOL for READY needs
        // every pending call settled, so no observation is missing from the next call.
        (WaitingTool, Ready) if !rec.pending.is_empty() => Err("tool calls still pending"),
        // A held call leaves for dispatch only on an approval that passed its re-check.
        (AwaitingApproval, WaitingTool) if *cause != Cause::Decided || !rec.held.is_empty() => {
            Err("a held call is dispatched only after its decision")
        }
        (AwaitingApproval, WaitingTool) if rec.pending.is_empty() => {
            Err("nothing approved to dispatch")
        }
        (AwaitingApproval, Ready) if !rec.held.is_empty() => {
            Err("a held call is still awaiting its decision")
        }
        (_, Finalizing) if rec.exit.is_none() => Err("an exit needs its reason recorded"),
        (Finalizing, _) => finalized(rec, to),
        _ => Ok(()),
    }
}

/// FINALIZING is the cleanup barrier: no outstanding work, no lease, and the terminal state
/// the exit reason calls for (COMPLETED only for a model end whose completion check passed).
fn finalized(rec: &Record, to: State) -> Result<(), &'static str> {
    if !rec.pending.is_empty() || !rec.held.is_empty() {
        return Err("outstanding work not yet cancelled");
    }
    if !rec.leases.is_empty() {
        return Err("leases not yet released");
    }
    let exit = rec.exit.as_ref().ok_or("no exit reason")?;
    if exit.terminal() != to {
        return Err("the exit reason names another terminal state");
    }
    Ok(())
}

impl Exit {
    /// The terminal state this exit ends in (seed 004, "Control actions": cancel → CANCELED,
    /// kill and budget → FAILED; a model end → COMPLETED only if the completion check passed).
    pub fn terminal(&self) -> State {
        match self {
            Exit::Completed { check_passed: true } => Completed,
            Exit::Completed {
                check_passed: false,
            } => Failed,
            Exit::CompletionCheckFailed { .. } => Failed,
            Exit::Canceled { .. } => Canceled,
            Exit::Killed { .. } | Exit::BudgetExceeded { .. } | Exit::Error { .. } => Failed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table as printed in seed 004 (Table 5), written out independently of `LEGAL`.
    #[test]
    fn the_table_is_seed_004s() {
        let next = |s: State| -> Vec<State> {
            match s {
                Ready => vec![CallingModel, Paused, Finalizing],
                CallingModel => vec![Ready, WaitingTool, AwaitingApproval, Finalizing],
                WaitingTool => vec![Ready, Finalizing],
                AwaitingApproval => vec![WaitingTool, Ready, Finalizing],
                Paused => vec![Ready, Finalizing],
                Finalizing => vec![Completed, Failed, Canceled],
                Completed | Failed | Canceled => vec![],
            }
        };
        for from in State::ALL {
            for to in State::ALL {
                assert_eq!(
                    is_legal(from, to),
                    next(from).contains(&to),
                    "{from} -> {to}"
                );
            }
        }
    }
}
