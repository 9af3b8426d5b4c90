//! Fail closed: a failed sync, write or directory sync, or a full disk, stops the committer for
//! good; reopening with discard_after = the last durable seq recovers exactly what was durable.

use std::sync::{Arc, Mutex};

use estop_ledger::{CrashStorage, LedgerError, LedgerOptions, Storage};

use crate::common::*;

fn crash_disk(seed: u64) -> (CrashStorage, Arc<dyn Storage>) {
    let d = CrashStorage::new(seed);
    let s: Arc<dyn Storage> = Arc::new(d.clone());
    (d, s)
}

enum Fault {
    Sync,
    Write,
    DirSyncOnRoll,
}

fn fail_closed_then_recover(seed: u64, fault: Fault) {
    let (disk, s) = crash_disk(seed);
    let opts = small();
    let notes = Arc::new(Mutex::new(Vec::new()));
    let notes2 = notes.clone();
    let c = open_ok(&s, opts.clone())
        .ledger
        .spawn(move |r| {
            notes2
                .lock()
                .expect("lock")
                .push(r.map_err(|e| e.root().code()))
        })
        .expect("spawn");
    append_n(&c, 1, 10);
    match fault {
        Fault::Sync => disk.fail_next_sync(),
        Fault::Write => disk.fail_next_write(),
        Fault::DirSyncOnRoll => disk.fail_next_dir_sync(),
    }
    // Enough records that a small segment rolls (so the directory sync is reached).
    let mut last = 0;
    for i in 11..=30 {
        match c.append(&payload(i)) {
            Ok(seq) => last = seq,
            Err(e) => {
                assert_eq!(e.code(), "ledger_failed");
                break;
            }
        }
    }
    let e = c.wait_durable(last).expect_err("not durable");
    assert_eq!(e.code(), "ledger_failed", "{e}");
    assert_eq!(e.root().code(), "ledger_io");
    assert!(e.to_string().contains("discard_after"));
    let durable = c.durable();
    assert!(
        (10..last).contains(&durable),
        "seed {seed}: durable {durable}"
    );
    // Every later append is refused with the original cause; there is no retry.
    let e = c.append(b"more").expect_err("failed");
    assert_eq!((e.code(), e.root().code()), ("ledger_failed", "ledger_io"));
    assert_eq!(c.flush().expect_err("failed").code(), "ledger_failed");
    let syncs = disk.stats().syncs;
    std::thread::sleep(std::time::Duration::from_millis(5));
    assert_eq!(disk.stats().syncs, syncs, "no sync after the failure");
    assert_eq!(notes.lock().expect("lock").last(), Some(&Err("ledger_io")));
    drop(c);

    let o = open_ok(
        &s,
        LedgerOptions {
            discard_after: Some(durable),
            ..opts.clone()
        },
    );
    let want: Vec<_> = (1..=durable).map(|i| (i, payload(i))).collect();
    assert_eq!(o.records, want, "seed {seed}");
    assert_eq!(o.ledger.next_seq(), durable + 1);
    let c = o.ledger.spawn(|_| {}).expect("spawn");
    for i in 0..3 {
        assert_eq!(
            c.append(format!("new {i}").as_bytes()).expect("append"),
            durable + 1 + i
        );
    }
    c.flush().expect("flush");
    drop(c);
    // Power loss now: the failed file may hold anything after `durable`; it stays superseded.
    disk.crash();
    let o = open_ok(&s, opts);
    assert_eq!(o.records.len() as u64, durable + 3, "seed {seed}");
    assert_eq!(o.records[..durable as usize], want[..]);
    for i in 0..3 {
        assert_eq!(
            o.records[(durable + i) as usize],
            (durable + 1 + i, format!("new {i}").into_bytes())
        );
    }
}

#[test]
fn failed_sync_fails_closed_and_discard_after_recovers() {
    for seed in 0..20 {
        fail_closed_then_recover(seed, Fault::Sync);
    }
}

#[test]
fn failed_write_fails_closed_and_discard_after_recovers() {
    for seed in 0..20 {
        fail_closed_then_recover(seed, Fault::Write);
    }
}

#[test]
fn failed_directory_sync_during_a_roll_fails_closed() {
    for seed in 0..5 {
        fail_closed_then_recover(seed, Fault::DirSyncOnRoll);
    }
}

#[test]
fn disk_full_fails_closed_and_reopen_succeeds_once_space_returns() {
    let (disk, s) = crash_disk(3);
    let c = open_ok(&s, LedgerOptions::default())
        .ledger
        .spawn(|_| {})
        .expect("spawn");
    append_n(&c, 1, 10);
    disk.set_space_left(Some(40));
    let seq = c.append(&[7u8; 100]).expect("buffered");
    let e = c.wait_durable(seq).expect_err("disk full");
    assert_eq!(
        (e.code(), e.root().code()),
        ("ledger_failed", "ledger_full")
    );
    assert!(e.to_string().contains("free disk space"), "{e}");
    let durable = c.durable();
    assert_eq!(durable, 10);
    drop(c);

    let opts = LedgerOptions {
        discard_after: Some(durable),
        ..LedgerOptions::default()
    };
    for _ in 0..3 {
        let e = open(&s, opts.clone()).expect_err("still full");
        assert_eq!(e.code(), "ledger_full", "{e}");
        assert!(matches!(e, LedgerError::Full { .. }));
    }
    disk.set_space_left(None);
    let o = open_ok(&s, opts);
    assert_eq!(o.records.len(), 10);
    let c = o.ledger.spawn(|_| {}).expect("spawn");
    assert_eq!(c.append(b"space is back").expect("append"), 11);
    c.flush().expect("flush");
}

#[test]
fn discard_after_beyond_the_log_is_refused() {
    let (_, s) = mem();
    let c = open_ok(&s, LedgerOptions::default())
        .ledger
        .spawn(|_| {})
        .expect("spawn");
    append_n(&c, 1, 5);
    drop(c);
    let e = open(
        &s,
        LedgerOptions {
            discard_after: Some(9),
            ..LedgerOptions::default()
        },
    )
    .expect_err("refused");
    assert_eq!(e.code(), "ledger_corrupt");
    assert!(e.to_string().contains("discard_after = 9"), "{e}");
}

#[test]
fn discard_after_an_older_seq_drops_newer_segments_and_snapshots() {
    let (m, s) = mem();
    let opts = LedgerOptions {
        snapshots_keep: 3,
        ..small()
    };
    let c = open_ok(&s, opts.clone())
        .ledger
        .spawn(|_| {})
        .expect("spawn");
    append_batched(&c, 1, 40, 4);
    c.snapshot(5, b"state@5").expect("snapshot");
    c.snapshot(35, b"state@35").expect("snapshot");
    drop(c);
    assert!(segment_names(&m).len() > 3);
    let o = open_ok(
        &s,
        LedgerOptions {
            discard_after: Some(12),
            ..opts.clone()
        },
    );
    assert_eq!(
        o.snapshot,
        Some((5, b"state@5".to_vec())),
        "snapshot 35 covers discarded records"
    );
    assert_eq!(
        o.records,
        (6..=12).map(|i| (i, payload(i))).collect::<Vec<_>>()
    );
    assert!(
        o.report
            .removed
            .contains(&"snap-00000000000000000035.snap".to_owned())
    );
    let c = o.ledger.spawn(|_| {}).expect("spawn");
    append_n(&c, 13, 2);
    drop(c);
    let o = open_ok(&s, opts);
    assert_eq!(o.snapshot, Some((5, b"state@5".to_vec())));
    assert_eq!(
        o.records,
        (6..=14).map(|i| (i, payload(i))).collect::<Vec<_>>()
    );
}
