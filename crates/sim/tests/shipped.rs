//! The shipped path under power loss (issue 12): the daemon's own core, committer and reply
//! release on a crash-simulating disk, many seeds, with the process cut short at every disk
//! operation of an append, a segment roll and a snapshot, retention, deadlines, expiries and
//! waits, and liveness after healing; and bugs planted in the shipped code that the auditor
//! must catch within the same seeds. Replay one seed with `ESTOP_SHIPPED_SEED=<n>`; more with
//! `ESTOP_SHIPPED_SEEDS=<count>`, longer with `ESTOP_SHIPPED_STEPS=<steps>`.

use estop_sim::rng::env_u64;
use estop_sim::shipped::{Planted, ROLL_AND_SNAPSHOT_POINTS, ShippedReport, run_seed};

fn steps() -> u64 {
    env_u64("ESTOP_SHIPPED_STEPS").unwrap_or(2_000)
}

fn seeds() -> u64 {
    env_u64("ESTOP_SHIPPED_SEEDS").unwrap_or(150)
}

#[test]
fn the_shipped_path_keeps_everything_acknowledged_across_power_loss() {
    if let Some(seed) = env_u64("ESTOP_SHIPPED_SEED") {
        let r = run_seed(seed, steps(), Planted::None).unwrap_or_else(|e| panic!("{e}"));
        println!("{r:#?}");
        return;
    }
    let seeds = seeds();
    let mut total = ShippedReport::default();
    for seed in 0..seeds {
        let r = run_seed(seed, steps(), Planted::None).unwrap_or_else(|e| panic!("{e}"));
        total.add(&r);
    }
    println!("shipped path, {seeds} seeds: {total:#?}");
    // The world must have reached what it tests: acknowledgements, and crashes after them.
    assert!(total.acked > total.requests / 2, "{total:?}");
    assert!(total.power_losses > seeds, "{total:?}");
    assert!(
        total.failed_syncs > 0 && total.failed_writes > 0,
        "{total:?}"
    );
    // The process was cut short at every step of a segment roll and of a snapshot.
    for point in ROLL_AND_SNAPSHOT_POINTS {
        assert!(
            total.cuts.get(point).is_some_and(|n| *n > 0),
            "never cut at {point}: {:?}",
            total.cuts
        );
    }
    // Waits were answered every way, retention forgot runs, outcomes other than ok completed.
    for how in [
        "admitted",
        "refused expired",
        "refused deadline",
        "refused cancelled",
        "held",
    ] {
        assert!(
            total.waits.get(how).is_some_and(|n| *n > 0),
            "no wait answered {how}: {:?}",
            total.waits
        );
    }
    assert!(
        total.forgotten > 0 && total.completed_not_ok > 0,
        "{total:?}"
    );
    // The reverse saga ran through the shipped core: attempts and lookups offered to
    // executors, reported, and executors dying in the middle of one.
    assert!(
        total.saga_offers > 0 && total.saga_reports > 0 && total.executors_died > 0,
        "{total:?}"
    );
}

fn caught(planted: Planted) -> String {
    let seeds = seeds();
    let e = (0..seeds)
        .find_map(|seed| run_seed(seed, steps(), planted).err())
        .unwrap_or_else(|| panic!("the planted {planted:?} went unnoticed in {seeds} seeds"));
    println!("caught: {e}");
    e
}

#[test]
fn a_reply_released_one_record_before_its_fdatasync_is_caught() {
    let e = caught(Planted::EarlyRelease);
    assert!(e.contains("acknowledged") && e.contains("lost"), "{e}");
}

#[test]
fn a_wait_kept_after_its_connection_is_gone_is_caught() {
    let e = caught(Planted::WaiterLeak);
    assert!(e.contains("still holds"), "{e}");
}

#[test]
fn a_run_forgotten_without_its_tombstone_is_caught() {
    let e = caught(Planted::TombstonesDropped);
    assert!(
        e.contains("before its tombstone retention") || e.contains("after the acknowledged cancel"),
        "{e}"
    );
}
