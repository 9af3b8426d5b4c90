//! The closed tables of legal transitions, as data: printable, testable, and checked before
//! every change of state (an illegal one is a typed refusal, never a panic). `check_effect` and
//! `check_run` are the guards: the gate calls one before each change of an effect's status or a
//! run's state, and for a change of several runs (a stop reaches the whole subtree) it checks
//! every one before it changes any.

use crate::ids::{EffectKey, RunId};
use crate::reply::KernelError;
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
    // A due compensation that cannot be issued (its arguments cannot be built, the policy
    // refuses the compensating call) asks a human at once: the reason is deterministic.
    (Some(E::Completed), E::NeedsHuman),
    (Some(E::CompensationFailed), E::NeedsHuman),
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

/// The guard of effect `key` of `run` moving `from` (`None`: its creation) `to`.
pub fn check_effect(
    run: &RunId,
    key: &EffectKey,
    from: Option<E>,
    to: E,
) -> Result<(), KernelError> {
    if effect_legal(from, to) {
        return Ok(());
    }
    Err(KernelError::IllegalTransition {
        run: run.clone(),
        key: Some(key.clone()),
        from: from.map_or("new", E::as_str),
        to: to.as_str(),
    })
}

/// The guard of `run` moving `from` `to`.
pub fn check_run(run: &RunId, from: R, to: R) -> Result<(), KernelError> {
    if run_legal(from, to) {
        return Ok(());
    }
    Err(KernelError::IllegalTransition {
        run: run.clone(),
        key: None,
        from: from.as_str(),
        to: to.as_str(),
    })
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
    fn every_move_a_stop_makes_is_in_the_table() {
        use crate::vocab::StopCause;
        // What `Gate::stop_plan` and the settling of a finalizing run ask for, from every state
        // a run that is not stopped can be in; a missing entry would make every stop refused.
        for &cause in StopCause::ALL {
            let end = cause.terminal_state();
            for from in [R::Active, R::Paused] {
                assert!(run_legal(from, R::Finalizing), "{from} -> finalizing");
                assert!(run_legal(from, end), "{from} -> {end}");
            }
            assert!(run_legal(R::Finalizing, end), "finalizing -> {end}");
        }
        assert!(run_legal(R::Active, R::Paused) && run_legal(R::Paused, R::Active));
    }

    #[test]
    fn the_guards_refuse_with_the_typed_error_what_the_tables_leave_out() {
        let run = RunId::new("r").expect("valid");
        let key = EffectKey::new("k").expect("valid");
        for &from in R::ALL {
            for &to in R::ALL {
                match check_run(&run, from, to) {
                    Ok(()) => assert!(RUN_TRANSITIONS.contains(&(from, to))),
                    Err(e) => {
                        assert!(!RUN_TRANSITIONS.contains(&(from, to)));
                        assert_eq!(e.code(), "illegal_transition");
                        assert_eq!(
                            e.to_string(),
                            format!("illegal transition of run r from {from} to {to}")
                        );
                    }
                }
            }
        }
        let from = Some(E::Refused);
        let e = check_effect(&run, &key, from, E::Started).expect_err("refused absorbs");
        assert_eq!(
            e.to_string(),
            "illegal transition of effect k of run r from refused to started"
        );
        let e = check_effect(&run, &key, None, E::Completed).expect_err("no creation as done");
        assert!(e.to_string().ends_with("from new to completed"), "{e}");
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
