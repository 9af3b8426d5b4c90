//! Deterministic simulation in CI: many seeds of kernel + ledger + group commit + request
//! handling on `CrashStorage` with kill -9, power loss (torn writes), IO errors and a full disk at
//! random points, an auditor after every recovery, then healing and a liveness check. Seeds are
//! printed; replay one exactly with `ESTOP_SIM_SEED=<n>`; run more with `ESTOP_SIM_SEEDS=<count>`
//! (the long mode is `estop-sim sim --seeds 100000`, docs/TESTING.md).

use estop_sim::rng::env_u64;
use estop_sim::sim::{SimReport, run_seed};

#[test]
fn acknowledged_state_survives_every_simulated_crash() {
    let steps = env_u64("ESTOP_SIM_STEPS").unwrap_or(3_000);
    if let Some(seed) = env_u64("ESTOP_SIM_SEED") {
        match run_seed(seed, steps) {
            Ok(r) => println!("{r}"),
            Err(e) => panic!("{e}"),
        }
        return;
    }
    let seeds = env_u64("ESTOP_SIM_SEEDS").unwrap_or(300);
    let first = env_u64("ESTOP_SIM_FIRST_SEED").unwrap_or(0);
    let mut total = SimReport::default();
    for seed in first..first + seeds {
        let r = run_seed(seed, steps).unwrap_or_else(|e| panic!("{e}"));
        total.steps += r.steps;
        total.requests += r.requests;
        total.acked += r.acked;
        total.records += r.records;
        total.kills += r.kills;
        total.power_losses += r.power_losses;
        total.crash_buffered += r.crash_buffered;
        total.crash_written_unsynced += r.crash_written_unsynced;
        total.crash_mid_write += r.crash_mid_write;
        total.crash_mid_roll += r.crash_mid_roll;
        total.io_errors += r.io_errors;
        total.disk_full += r.disk_full;
        total.recoveries += r.recoveries;
        total.torn_tails += r.torn_tails;
        total.snapshots += r.snapshots;
        total.unavailable += r.unavailable;
    }
    println!("simulation: seeds {first}..{} — {total}", first + seeds);
    // The run must have exercised what it claims.
    assert!(
        total.crash_written_unsynced > 0 && total.crash_buffered > 0 && total.crash_mid_write > 0,
        "{total}"
    );
    assert!(
        total.torn_tails > 0 && total.power_losses > 0 && total.kills > 0 && total.disk_full > 0,
        "{total}"
    );
    assert!(total.snapshots > 0 && total.unavailable > 0, "{total}");
}

/// The auditor has teeth: plant the classic bug (a reply released after the write but before
/// its fdatasync) and a power loss must expose an acknowledged change that recovery lost.
#[test]
fn the_auditor_catches_replies_released_before_fsync() {
    let mut caught = None;
    for seed in 0..200 {
        let mut w = estop_sim::sim::World::new(seed);
        w.mutant_ack_before_sync = true;
        if let Err(e) = estop_sim::sim::run_world(w, seed, 3_000) {
            caught = Some(e);
            break;
        }
    }
    let e = caught.expect("the planted bug was not caught in 200 seeds");
    assert!(
        e.contains("lost after recovery") || e.contains("acknowledged"),
        "{e}"
    );
    println!("planted bug caught: {e}");
}
