//! The differential against the reference model through the PostgreSQL store (`pgdiff`): seeded
//! traces whose records a real server (`scripts/postgres`, shared with the CLI's tests) holds,
//! the gate rebuilt from it at random steps. Fails when the server cannot start, unless
//! `ESTOP_TEST_SKIP_POSTGRES=1`. Replay one seed with `ESTOP_PGDIFF_SEED=<n>`; more ops with
//! `ESTOP_PGDIFF_OPS=<n>`.

// The CLI tests' helper, shared: the same server for the whole test run.
#[path = "../../cli/tests/common/pg.rs"]
#[allow(dead_code)]
mod pg;

use estop_sim::pgdiff::{PgDiffStats, run_case};
use estop_sim::rng::env_u64;

#[test]
fn kernel_agrees_with_the_model_through_postgresql_across_restarts_and_nodes() {
    let Some(server) = pg::server() else { return };
    let seeds: Box<dyn Iterator<Item = u64>> = match env_u64("ESTOP_PGDIFF_SEED") {
        Some(seed) => Box::new(std::iter::once(seed)),
        None => Box::new(0..),
    };
    let ops = env_u64("ESTOP_PGDIFF_OPS").unwrap_or(6_000);
    let mut stats = PgDiffStats::default();
    for seed in seeds {
        let mut db = pg::sql(&pg::database_on(server));
        if let Err(e) = run_case(&mut db, seed, 300, &mut stats) {
            panic!("{e} (replay: ESTOP_PGDIFF_SEED={seed})");
        }
        if stats.ops >= ops || env_u64("ESTOP_PGDIFF_SEED").is_some() {
            break;
        }
    }
    println!("{stats:#?}");
    // It reached what it claims: bursts of several records, restarts, switches, killed bursts.
    assert!(stats.records > stats.bursts, "{stats:?}");
    assert!(
        stats.restarts > 20
            && stats.switches > 20
            && stats.killed_bursts > 20
            && stats.snapshots > 20,
        "{stats:?}"
    );
}
