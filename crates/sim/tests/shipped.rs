//! The shipped path under power loss (issue 12): the daemon's own core, committer and reply
//! release on a crash-simulating disk, many seeds; and a planted bug — replies released one
//! record before their fdatasync — that the auditor must catch within the same seeds. Replay
//! one seed with `ESTOP_SHIPPED_SEED=<n>`; more with `ESTOP_SHIPPED_SEEDS=<count>`.

use estop_sim::rng::env_u64;
use estop_sim::shipped::{Planted, ShippedReport, run_seed};

fn steps() -> u64 {
    env_u64("ESTOP_SHIPPED_STEPS").unwrap_or(2_000)
}

#[test]
fn the_shipped_path_keeps_everything_acknowledged_across_power_loss() {
    if let Some(seed) = env_u64("ESTOP_SHIPPED_SEED") {
        let r = run_seed(seed, steps(), Planted::None).unwrap_or_else(|e| panic!("{e}"));
        println!("{r:?}");
        return;
    }
    let seeds = env_u64("ESTOP_SHIPPED_SEEDS").unwrap_or(60);
    let mut total = ShippedReport::default();
    for seed in 0..seeds {
        let r = run_seed(seed, steps(), Planted::None).unwrap_or_else(|e| panic!("{e}"));
        total.steps += r.steps;
        total.requests += r.requests;
        total.acked += r.acked;
        total.power_losses += r.power_losses;
        total.kills += r.kills;
        total.disk_full += r.disk_full;
        total.failed_syncs += r.failed_syncs;
        total.failed_writes += r.failed_writes;
        total.recoveries += r.recoveries;
    }
    println!("shipped path, {seeds} seeds: {total:?}");
    // The world must have reached what it tests: acknowledgements, and crashes after them.
    assert!(total.acked > total.requests / 2, "{total:?}");
    assert!(total.power_losses > seeds, "{total:?}");
    assert!(
        total.failed_syncs > 0 && total.failed_writes > 0,
        "{total:?}"
    );
}

#[test]
fn a_reply_released_one_record_before_its_fdatasync_is_caught() {
    let seeds = env_u64("ESTOP_SHIPPED_SEEDS").unwrap_or(60);
    let caught = (0..seeds).find_map(|seed| run_seed(seed, steps(), Planted::EarlyRelease).err());
    let e = caught
        .unwrap_or_else(|| panic!("the planted early release went unnoticed in {seeds} seeds"));
    println!("caught: {e}");
    assert!(e.contains("acknowledged"), "{e}");
}

#[test]
fn a_wait_kept_after_its_connection_is_gone_is_caught() {
    let seeds = env_u64("ESTOP_SHIPPED_SEEDS").unwrap_or(60);
    let caught = (0..seeds).find_map(|seed| run_seed(seed, steps(), Planted::WaiterLeak).err());
    let e =
        caught.unwrap_or_else(|| panic!("the planted waiter leak went unnoticed in {seeds} seeds"));
    println!("caught: {e}");
    assert!(e.contains("still holds"), "{e}");
}
