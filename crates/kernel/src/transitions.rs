//! The closed tables of legal transitions, as data: printable, testable, and checked before
//! every change of state (an illegal one is a typed refusal, never a panic).

use crate::vocab::{EffectStatus as E, RunState as R};

/// Legal effect transitions. `None` as the source is the creation of the effect.
pub const EFFECT_TRANSITIONS: &[(Option<E>, E)] = &[
    (None, E::Held),
    (None, E::Admitted),
    (None, E::Started),
    (None, E::Refused),
    (Some(E::Held), E::Held),
    (Some(E::Held), E::Approved),
    (Some(E::Held), E::Admitted),
    (Some(E::Held), E::Started),
    (Some(E::Held), E::Refused),
    (Some(E::Approved), E::Admitted),
    (Some(E::Approved), E::Started),
    (Some(E::Approved), E::Refused),
    (Some(E::Admitted), E::Started),
    (Some(E::Admitted), E::Refused),
    (Some(E::Started), E::Completed),
    (Some(E::Started), E::Failed),
    (Some(E::Started), E::Unknown),
    // An unknown outcome may be settled later, by the agent or by a lookup of its key.
    (Some(E::Unknown), E::Completed),
    (Some(E::Unknown), E::Failed),
    // The reverse saga (SPEC §4.8, `saga.rs`): an attempt begins, then ends compensated,
    // failed (retried after a backoff) or with a human to ask (the bound reached, or the
    // compensation's own outcome unknown: never a blind retry).
    (Some(E::Completed), E::Compensating),
    (Some(E::Compensating), E::Compensated),
    (Some(E::Compensating), E::CompensationFailed),
    (Some(E::Compensating), E::NeedsHuman),
    (Some(E::CompensationFailed), E::Compensating),
    // An operator's retry gives a failed or abandoned compensation a fresh budget.
    (Some(E::CompensationFailed), E::CompensationFailed),
    (Some(E::NeedsHuman), E::CompensationFailed),
    // An operator's skip, with a reason: the saga goes on past it.
    (Some(E::Completed), E::CompensationSkipped),
    (Some(E::CompensationFailed), E::CompensationSkipped),
    (Some(E::NeedsHuman), E::CompensationSkipped),
];

/// Legal run transitions. Terminal states have no way out: a stop is never undone.
pub const RUN_TRANSITIONS: &[(R, R)] = &[
    (R::Active, R::Paused),
    (R::Active, R::Finalizing),
    (R::Active, R::Completed),
    (R::Active, R::Failed),
    (R::Active, R::Cancelled),
    (R::Paused, R::Active),
    (R::Paused, R::Finalizing),
    (R::Paused, R::Completed),
    (R::Paused, R::Failed),
    (R::Paused, R::Cancelled),
    (R::Finalizing, R::Completed),
    (R::Finalizing, R::Failed),
    (R::Finalizing, R::Cancelled),
];

pub fn effect_legal(from: Option<E>, to: E) -> bool {
    EFFECT_TRANSITIONS
        .iter()
        .any(|&(f, t)| f == from && t == to)
}

pub fn run_legal(from: R, to: R) -> bool {
    RUN_TRANSITIONS.iter().any(|&(f, t)| f == from && t == to)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_run_states_absorb() {
        for &from in R::ALL.iter().filter(|s| s.is_terminal()) {
            for &to in R::ALL {
                assert!(!run_legal(from, to), "{from} -> {to} must be illegal");
            }
        }
    }

    #[test]
    fn refused_and_compensated_effects_absorb() {
        for &to in E::ALL {
            assert!(!effect_legal(Some(E::Refused), to));
            assert!(!effect_legal(Some(E::Compensated), to));
            assert!(!effect_legal(Some(E::CompensationSkipped), to));
        }
    }

    #[test]
    fn a_compensation_runs_only_after_its_forward_effect_completed() {
        // Compensating is entered from completed (the first attempt) or from a failed attempt
        // (a retry): never from an effect that did not happen or whose outcome is unknown.
        let sources: Vec<_> = EFFECT_TRANSITIONS
            .iter()
            .filter(|(_, t)| *t == E::Compensating)
            .map(|(f, _)| *f)
            .collect();
        assert_eq!(
            sources,
            vec![Some(E::Completed), Some(E::CompensationFailed)]
        );
    }

    #[test]
    fn nothing_starts_without_passing_admission() {
        // Started is reachable only from creation (admit with start), held, approved or admitted.
        let sources: Vec<_> = EFFECT_TRANSITIONS
            .iter()
            .filter(|(_, t)| *t == E::Started)
            .map(|(f, _)| *f)
            .collect();
        assert_eq!(
            sources,
            vec![None, Some(E::Held), Some(E::Approved), Some(E::Admitted)]
        );
    }
}
