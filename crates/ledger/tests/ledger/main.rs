//! Integration tests of estop-ledger at its public boundary: round trips, torn tails, corruption,
//! fail-closed recovery, group commit, snapshots, preallocation, and a seeded randomized crash test.

mod basic;
mod caller_syncs;
mod common;
mod concurrent;
mod corruption;
mod crash_fuzz;
mod failure;
mod prealloc;
mod snapshots;
