//! Bounded exhaustive model checking of the kernel in CI, over both alphabets of the checked
//! world (2 runs, parent and child; quorum 2 with 2 approvers): every trace of up to 6 steps of
//! approvals, rejection, expiry ticks, cancel, pause/resume, start/complete; and every trace of
//! up to 5 steps of kill, close, deadlines (passed in three ticks), budgets (reached at the
//! third admission) and outcomes `ok`/`error`/`unknown`. Trace
//! properties P1–P10 and ledger recovery (clean and torn) at every distinct state. The long mode
//! explores deeper: `ESTOP_CHECK_DEPTH=8 ESTOP_CHECK_ENDS_DEPTH=6`, or `estop-sim check --depth
//! 9 [--ends]` (docs/TESTING.md). And the monitor bites: a forged admission after a cancel is
//! reported as P5.

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
fn the_monitor_reports_a_forged_admission_after_a_cancel_as_p5() {
    for alphabet in [Alphabet::Approvals, Alphabet::Ends] {
        let o = CheckOptions {
            plant: Some(Plant::AdmitAfterCancel),
            ..opts(alphabet, 4)
        };
        let v = explore(&o).expect_err("the forged admission went unnoticed");
        println!("{alphabet:?}: {v}");
        assert!(v.what.starts_with("P5 violated"), "{v}");
        // The shortest trace: the run is stopped, then the allowed call is admitted.
        assert_eq!(v.trace.len(), 2, "{v}");
    }
}
