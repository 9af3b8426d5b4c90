//! Bounded exhaustive model checking of the kernel in CI, over both alphabets of the checked
//! world (2 runs, parent and child; quorum 2 with 2 approvers): every trace of up to 6 steps of
//! approvals, rejection, expiry ticks, cancel, pause/resume, start/complete; and every trace of
//! up to 5 steps of kill, close, deadlines (passed in three ticks), budgets (reached at the
//! third admission) and outcomes `ok`/`error`/`unknown`. Trace
//! properties P1–P10 and ledger recovery (clean and torn) at every distinct state. The long mode
//! explores deeper: `ESTOP_CHECK_DEPTH=8 ESTOP_CHECK_ENDS_DEPTH=6`, or `estop-sim check --depth
//! 9 [--ends]` (docs/TESTING.md). And the monitor bites: a forged admission after a cancel,
//! over a budget or after a deadline is reported as P5, P9 or P10.

use estop_sim::check::{Alphabet, CheckOptions, Plant, explore};
use estop_sim::rng::env_u64;

fn opts(alphabet: Alphabet, depth: u64) -> CheckOptions {
    CheckOptions {
        depth_max: depth as usize,
        states_max: u64::MAX,
        ticks_max: 3,
        crash: true,
        alphabet,
        plant: None,
    }
}

fn check(opts: &CheckOptions, states_min: u64) {
    match explore(opts) {
        Ok(s) => {
            println!(
                "model check ({:?}): {} states explored, {} transitions, depth {}, {} recoveries + {} torn-tail recoveries checked",
                opts.alphabet, s.states, s.transitions, s.depth, s.recoveries, s.torn_recoveries
            );
            assert!(s.states > states_min, "explored only {} states", s.states);
        }
        Err(v) => panic!("{v}"),
    }
}

#[test]
fn guarantees_hold_on_every_trace_of_approvals() {
    let depth = env_u64("ESTOP_CHECK_DEPTH").unwrap_or(6);
    check(
        &opts(Alphabet::Approvals, depth),
        if depth < 6 { 0 } else { 100_000 },
    );
}

#[test]
fn guarantees_hold_on_every_trace_of_how_runs_end() {
    let depth = env_u64("ESTOP_CHECK_ENDS_DEPTH").unwrap_or(5);
    check(
        &opts(Alphabet::Ends, depth),
        if depth < 5 { 0 } else { 100_000 },
    );
}

#[test]
fn guarantees_hold_on_every_trace_of_the_saga() {
    let depth = env_u64("ESTOP_CHECK_SAGA_DEPTH").unwrap_or(10);
    check(
        &opts(Alphabet::Saga, depth),
        if depth < 10 { 0 } else { 15_000 },
    );
}

/// The monitor has teeth: an admission the kernel refused, forged in the trace it reads, is
/// reported as exactly the property it breaks, on a shortest trace.
#[test]
fn the_monitor_reports_a_forged_admission_after_a_cancel_as_p5() {
    for alphabet in [Alphabet::Approvals, Alphabet::Ends] {
        // The run is stopped, then the allowed call is admitted.
        caught(alphabet, Plant::AdmitAfterCancel, "P5", 2);
    }
}

#[test]
fn the_monitor_reports_a_forged_admission_over_the_budget_as_p9() {
    // Two admissions under a budget of two, a third call fences the run, a fourth is forged.
    caught(Alphabet::Ends, Plant::AdmitOverBudget, "P9", 4);
}

#[test]
fn the_monitor_reports_a_forged_admission_after_the_deadline_as_p10() {
    // The run is created with a deadline, three ticks pass it, then a call is forged admitted.
    caught(Alphabet::Ends, Plant::AdmitAfterDeadline, "P10", 5);
}

fn caught(alphabet: Alphabet, plant: Plant, property: &str, steps: usize) {
    let o = CheckOptions {
        plant: Some(plant),
        // The monitor is what is tested: no ledger recoveries, to keep it quick.
        crash: false,
        ..opts(alphabet, steps as u64)
    };
    let v = explore(&o).expect_err("the forged admission went unnoticed");
    println!("{alphabet:?}, {plant:?}: {v}");
    assert!(v.what.starts_with(&format!("{property} violated")), "{v}");
    assert_eq!(v.trace.len(), steps, "{v}");
}

#[test]
fn the_monitor_reports_a_forged_attempt_begun_while_its_approval_is_open_as_p15() {
    // A charge completed, the run cancelled, the shell holds its compensating call for the
    // undo rule's approval, then an attempt is forged begun before any vote.
    caught(Alphabet::Saga, Plant::BeginWhileHeld, "P15", 5);
}
