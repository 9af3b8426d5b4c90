//! The differential through the PostgreSQL store: the kernel against the reference model as in
//! [`crate::diff`], with every record the kernel makes committed to a real database by the
//! store's own code (`estop_server::pgstore`: the columns, one `INSERT` per burst, the bytea
//! round trip), and the kernel's gate replaced, at random steps, by what a node gets from the
//! database: a node that starts (`pgstore::load`, every record replayed) or the other of two
//! nodes, which catches up with what this one committed (`pgstore::records_after`, applied by
//! the replay recovery uses). Snapshots are written too, so a restart after one starts from the
//! newest. The gate from the database must equal the kernel's, and then go on agreeing with the
//! model. A burst whose transaction never commits (a node killed before
//! `COMMIT`) must leave nothing behind.

use crate::diff::{Pair, random_op};
use crate::rng::Rng;
use crate::world;
use estop_kernel::Gate;
use estop_kernel::record_codec::{RecordDecoder, encode_record, encode_snapshot};
use estop_server::journal::replay_record;
use estop_server::pgstore::{self, NewRecord};
use postgres::Client;

/// What a run through the database did.
#[derive(Debug, Default, Clone)]
pub struct PgDiffStats {
    pub cases: u64,
    pub ops: u64,
    /// Records committed, and the bursts (transactions) they went in.
    pub records: u64,
    pub bursts: u64,
    /// The kernel's gate replaced by one rebuilt from every record (a node starting).
    pub restarts: u64,
    /// The kernel's gate replaced by the other node's, caught up from the database.
    pub switches: u64,
    /// Snapshots written (a restart after one starts from it).
    pub snapshots: u64,
    /// Bursts inserted and rolled back (a node killed before COMMIT).
    pub killed_bursts: u64,
}

/// A node: its gate and the seq of the last record it applied.
struct Node {
    gate: Gate,
    last: u64,
}

/// Runs one case on the (empty) database `db`: a seeded random trace of up to `len_max` ops.
pub fn run_case(
    db: &mut Client,
    seed: u64,
    len_max: usize,
    stats: &mut PgDiffStats,
) -> Result<(), String> {
    let fail = |step: usize, what: String| format!("seed {seed}, step {step}: {what}");
    pgstore::migrate(db).map_err(|e| e.to_string())?;
    let limits = world::limits();
    let mut rng = Rng::new(seed);
    let len = 1 + rng.index(len_max);
    let mut pair = Pair::tight();
    let mut other = Node {
        gate: Gate::new(limits.clone()),
        last: 0,
    };
    let mut committed = 0u64;
    let mut pending: Vec<NewRecord> = Vec::new();
    let mut decoder = RecordDecoder::default();
    for step in 0..len {
        let op = random_op(&mut rng, &pair.model);
        let logged = pair.log.len();
        pair.step(&op).map_err(|e| fail(step, e))?;
        stats.ops += 1;
        if let Some(rec) = pair.log.get(logged) {
            let mut bytes = Vec::new();
            encode_record(rec, &mut bytes);
            let seq = committed + pending.len() as u64 + 1;
            let new =
                NewRecord::new(seq, &bytes, &mut decoder).map_err(|e| fail(step, e.to_string()))?;
            pending.push(new);
        }
        match rng.below(30) {
            // A burst ends: its records committed in one transaction, as `PgShell` does.
            0..=2 => {
                committed = commit(db, &mut pending, committed, stats).map_err(|e| fail(step, e))?
            }
            3 => {
                committed =
                    commit(db, &mut pending, committed, stats).map_err(|e| fail(step, e))?;
                let (gate, last) =
                    pgstore::load(db, &limits).map_err(|e| fail(step, e.to_string()))?;
                same(
                    &gate,
                    last,
                    &pair.gate,
                    committed,
                    "a node rebuilt from the database",
                )
                .map_err(|e| fail(step, e))?;
                pair.gate = gate;
                stats.restarts += 1;
            }
            4 => {
                committed =
                    commit(db, &mut pending, committed, stats).map_err(|e| fail(step, e))?;
                catch_up(db, &mut other).map_err(|e| fail(step, e))?;
                same(
                    &other.gate,
                    other.last,
                    &pair.gate,
                    committed,
                    "the other node, caught up",
                )
                .map_err(|e| fail(step, e))?;
                std::mem::swap(&mut other.gate, &mut pair.gate);
                stats.switches += 1;
            }
            6 => {
                // A node's snapshot, written as `PgShell` writes one; the next restart starts
                // from it.
                committed =
                    commit(db, &mut pending, committed, stats).map_err(|e| fail(step, e))?;
                if committed > 0 {
                    let mut bytes = Vec::new();
                    encode_snapshot(&pair.gate, &mut bytes);
                    db.execute(pgstore::SNAPSHOT, &[&(committed as i64), &bytes])
                        .map_err(|e| fail(step, e.to_string()))?;
                    stats.snapshots += 1;
                }
            }
            5 => {
                killed_burst(db, &pending, &pair).map_err(|e| fail(step, e))?;
                stats.killed_bursts += 1;
            }
            _ => {}
        }
    }
    commit(db, &mut pending, committed, stats).map_err(|e| fail(len, e))?;
    pair.check_replay().map_err(|e| fail(len, e))?;
    stats.cases += 1;
    Ok(())
}

/// Commits the pending records in one transaction (one `INSERT`); the new last seq.
fn commit(
    db: &mut Client,
    pending: &mut Vec<NewRecord>,
    committed: u64,
    stats: &mut PgDiffStats,
) -> Result<u64, String> {
    let Some(last) = pending.last().map(|r| r.seq) else {
        return Ok(committed);
    };
    let mut run = || -> Result<(), pgstore::StoreError> {
        let mut tx = db.transaction()?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&pgstore::LEDGER_LOCK])?;
        pgstore::insert(&mut tx, pending)?;
        tx.commit()?;
        Ok(())
    };
    run().map_err(|e| format!("committing up to {last}: {e}"))?;
    stats.records += pending.len() as u64;
    stats.bursts += 1;
    pending.clear();
    Ok(last)
}

/// A burst inserted and never committed (its node died before `COMMIT`): afterwards the
/// database holds nothing of it, and a node rebuilt from it is the kernel's gate as of the last
/// commit (checked at the next restart or switch; here: that no row of it is visible).
fn killed_burst(db: &mut Client, pending: &[NewRecord], pair: &Pair) -> Result<(), String> {
    let Some(first) = pending.first() else {
        return Ok(());
    };
    let mut run = || -> Result<i64, pgstore::StoreError> {
        let mut tx = db.transaction()?;
        pgstore::insert(&mut tx, pending)?;
        drop(tx); // Rolled back, as the server does when a node's session ends mid-transaction.
        Ok(db
            .query_one(
                "SELECT count(*) FROM estop_ledger WHERE seq >= $1",
                &[&(first.seq as i64)],
            )?
            .get(0))
    };
    match run() {
        Ok(0) => Ok(()),
        Ok(n) => Err(format!(
            "{n} records of a burst that never committed are visible (kernel log {})",
            pair.log.len()
        )),
        Err(e) => Err(format!("a killed burst: {e}")),
    }
}

/// Applies the records after `node.last` (in pages, as a node far behind reads them).
fn catch_up(db: &mut Client, node: &mut Node) -> Result<(), String> {
    let mut decoder = RecordDecoder::default();
    let records = pgstore::records_after(db, node.last).map_err(|e| e.to_string())?;
    for (seq, bytes) in records {
        replay_record(&mut node.gate, &mut decoder, &bytes)
            .map_err(|e| format!("record {seq} does not apply on the other node: {e}"))?;
        node.last = seq;
    }
    Ok(())
}

fn same(got: &Gate, got_last: u64, want: &Gate, want_last: u64, what: &str) -> Result<(), String> {
    if got_last != want_last {
        return Err(format!(
            "{what} ends at seq {got_last}, the kernel at {want_last}"
        ));
    }
    if got != want {
        return Err(format!(
            "{what} differs from the kernel's gate at seq {want_last}"
        ));
    }
    Ok(())
}
