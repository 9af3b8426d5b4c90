//! `estop store export|import`: the same records moved between the embedded ledger
//! (`DATA/ledger`) and PostgreSQL (`estop_ledger`). Both stores hold the gate as one numbered
//! sequence of records in the same encoding, so a move copies the bytes; it is checked twice:
//! the records must be the whole history, numbered from 1 with no gap, and they must replay
//! into a gate (the same replay both stores recover with) before anything is written. A move
//! only goes into an empty destination, in one transaction (export) or into a fresh directory
//! (import), so it never mixes two histories and never leaves half of one.

use crate::journal::replay_record;
use crate::pgstore::{self, NewRecord, StoreError, Target};
use estop_kernel::record_codec::RecordDecoder;
use estop_kernel::{Gate, Limits};
use estop_ledger::{FileStorage, Ledger, LedgerError, LedgerOptions, Storage};
use std::path::Path;
use std::sync::Arc;

/// Records inserted per statement on export.
const INSERT_BATCH: usize = 1000;

/// What a move did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Moved {
    pub records: u64,
    pub last_seq: u64,
    /// The tokens moved with the records (`None`: none were: no `DATA/tokens` to export, or
    /// a destination that had a registry already).
    pub tokens: Option<usize>,
}

fn refused(why: impl Into<String>) -> StoreError {
    StoreError::Move(why.into())
}

/// Checks that `records` are the whole history (seq 1, 2, … with no gap) and that they replay
/// into a gate.
fn check(records: &[(u64, Vec<u8>)]) -> Result<(), StoreError> {
    if let Some((first, _)) = records.first()
        && *first != 1
    {
        return Err(refused(format!(
            "the records start at seq {first}: those before it live only in a snapshot (the \
             ledger was compacted), and the other store keeps every record; nothing was moved"
        )));
    }
    for (i, (seq, _)) in records.iter().enumerate() {
        if *seq != i as u64 + 1 {
            return Err(refused(format!(
                "seq {} is missing (the next record is {seq}); nothing was moved",
                i + 1
            )));
        }
    }
    let mut gate = Gate::new(Limits::default().for_replay());
    let mut decoder = RecordDecoder::default();
    for (seq, bytes) in records {
        replay_record(&mut gate, &mut decoder, bytes).map_err(|e| {
            refused(format!(
                "record {seq} does not replay ({e}); nothing was moved"
            ))
        })?;
    }
    Ok(())
}

/// Every record of the embedded ledger in `data`, read under the ledger's lock: a daemon
/// running on it is refused (what it appended after the copy would be lost to it).
fn read_ledger(data: &Path) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
    let dir = data.join("ledger");
    if !dir.is_dir() {
        return Err(refused(format!(
            "no ledger at {} (pass --data DIR)",
            dir.display()
        )));
    }
    let storage = FileStorage::open(&dir).map_err(|e| match e {
        LedgerError::Locked { .. } => refused(format!(
            "{} is in use by a running estop serve: stop it first (what it appends after the              copy would not be moved); nothing was moved",
            dir.display()
        )),
        e => refused(format!("cannot open {}: {e}", dir.display())),
    })?;
    let mut records = Vec::new();
    let report = estop_ledger::inspect(&storage, |r| records.push((r.seq, r.payload.to_vec())));
    if let Some(e) = report.error {
        return Err(refused(format!(
            "the ledger in {} cannot be read: {e}",
            dir.display()
        )));
    }
    Ok(records)
}

/// Copies the embedded ledger in `data` into the database at `target`, which must hold no
/// estop record yet, with the tokens of `DATA/tokens` (unless the database has a registry
/// already). A daemon running on `data` is refused.
pub fn export(data: &Path, target: &Target) -> Result<Moved, StoreError> {
    let records = read_ledger(data)?;
    check(&records)?;
    let mut client = target.connect()?;
    pgstore::migrate(&mut client)?;
    let mut tx = client.transaction()?;
    // The writers' lock: no node commits while the emptiness check and the copy run.
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&pgstore::LEDGER_LOCK])?;
    let held: i64 = tx
        .query_one("SELECT count(*) FROM estop_ledger", &[])?
        .get(0);
    if held > 0 {
        return Err(refused(format!(
            "the database already holds {held} estop records: export only into an empty estop \
             database (a second history would be mixed into the first); nothing was moved"
        )));
    }
    let mut decoder = RecordDecoder::default();
    for chunk in records.chunks(INSERT_BATCH) {
        let rows = chunk
            .iter()
            .map(|(seq, bytes)| NewRecord::new(*seq, bytes, &mut decoder))
            .collect::<Result<Vec<_>, _>>()?;
        pgstore::insert(&mut tx, &rows)?;
    }
    // The tokens go with the records, in the same commit, so the nodes know the same
    // secrets; a registry the database already has (a node started on it) is kept.
    let registry: i64 = tx
        .query_one("SELECT count(*) FROM estop_token", &[])?
        .get(0);
    let tokens = match registry {
        0 => crate::tokens::pg::copy_file_registry(&mut tx, data)
            .map_err(|e| refused(format!("{e}; nothing was moved")))?,
        _ => None,
    };
    tx.commit()?;
    Ok(Moved {
        records: records.len() as u64,
        last_seq: records.last().map_or(0, |(seq, _)| *seq),
        tokens,
    })
}

/// Writes every record of the database at `target` into a new embedded ledger in `data`,
/// which must not have one, and the database's live tokens into `DATA/tokens` (unless it has
/// one). The directory then starts a gate with that history and those tokens.
pub fn import(target: &Target, data: &Path) -> Result<Moved, StoreError> {
    let dir = data.join("ledger");
    if std::fs::read_dir(&dir).is_ok_and(|mut d| d.next().is_some()) {
        return Err(refused(format!(
            "{} already holds a ledger: import only into a data directory without one; \
             nothing was moved",
            dir.display()
        )));
    }
    let mut client = target.connect()?;
    pgstore::migrate(&mut client)?;
    let records = pgstore::records_after(&mut client, 0)?;
    check(&records)?;
    std::fs::create_dir_all(&dir)
        .map_err(|e| refused(format!("cannot create {}: {e}", dir.display())))?;
    write_ledger(&dir, &records).map_err(|e| refused(format!("writing {}: {e}", dir.display())))?;
    let tokens = crate::tokens::pg::write_file_registry(&mut client, data).map_err(|e| {
        refused(format!(
            "the records were imported, but not the tokens: {e}"
        ))
    })?;
    Ok(Moved {
        records: records.len() as u64,
        last_seq: records.last().map_or(0, |(seq, _)| *seq),
        tokens,
    })
}

/// Appends `records` to a fresh ledger in `dir` and makes them durable.
fn write_ledger(dir: &Path, records: &[(u64, Vec<u8>)]) -> Result<(), LedgerError> {
    let storage: Arc<dyn Storage> = Arc::new(FileStorage::open(dir)?);
    let none = |_: u64, _: &[u8]| -> Result<(), String> { Ok(()) };
    let recovered = Ledger::open(storage, LedgerOptions::default(), none, none)?;
    let committer = recovered.ledger.spawn(|_| {})?;
    for (seq, bytes) in records {
        let at = match committer.append_deferred(bytes) {
            Err(LedgerError::Backpressure { .. }) => {
                committer.wait_durable(committer.next_seq() - 1)?;
                committer.append_deferred(bytes)?
            }
            other => other?,
        };
        assert_eq!(at, *seq, "a fresh ledger numbers records from 1");
    }
    committer.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn said(r: Result<(), StoreError>) -> String {
        r.expect_err("refused").to_string()
    }

    #[test]
    fn only_a_whole_history_that_replays_is_moved() {
        assert!(check(&[]).is_ok(), "an empty history moves");
        let compacted = said(check(&[(2, vec![])]));
        assert!(
            compacted.contains("start at seq 2") && compacted.contains("snapshot"),
            "{compacted}"
        );
        let garbage = vec![0xff; 8];
        let gap = said(check(&[(1, garbage.clone()), (3, garbage.clone())]));
        assert!(gap.contains("seq 2 is missing"), "{gap}");
        let bad = said(check(&[(1, garbage)]));
        assert!(bad.contains("record 1 does not replay"), "{bad}");
    }
}
