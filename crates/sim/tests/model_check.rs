//! Bounded exhaustive model checking of the kernel in CI: every trace of up to 6 steps over the
//! checked world (2 runs, parent and child; 3 keys; quorum 2 with 2 approvers; cancel,
//! pause/resume, expiry ticks, start/complete), with the trace properties P1–P8 and ledger
//! recovery (clean and torn) at every distinct state. The long mode explores deeper:
//! `estop-sim check --depth 9` (docs/TESTING.md).

use estop_sim::check::{CheckOptions, explore};
use estop_sim::rng::env_u64;

#[test]
fn guarantees_hold_on_every_trace_of_the_checked_world() {
    let opts = CheckOptions {
        depth_max: env_u64("ESTOP_CHECK_DEPTH").unwrap_or(6) as usize,
        states_max: u64::MAX,
        ticks_max: 3,
        crash: true,
    };
    match explore(&opts) {
        Ok(s) => {
            println!(
                "model check: {} states explored, {} transitions, depth {}, {} recoveries + {} torn-tail recoveries checked",
                s.states, s.transitions, s.depth, s.recoveries, s.torn_recoveries
            );
            assert!(
                s.states > 100_000 || opts.depth_max < 6,
                "explored only {} states",
                s.states
            );
        }
        Err(v) => panic!("{v}"),
    }
}
