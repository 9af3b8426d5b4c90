//! Round trips, reopening, limits and the notify callback.

use std::sync::{Arc, Mutex};

use estop_ledger::{FileStorage, LedgerOptions, Storage, verify};

use crate::common::*;

fn round_trip(storage: Arc<dyn Storage>) {
    let o = open_ok(&storage, LedgerOptions::default());
    assert_eq!(o.report.last_seq, 0);
    assert_eq!(o.report.segment, "seg-00000000000000000001.log");
    assert!(o.records.is_empty() && o.snapshot.is_none());
    let c = o.ledger.spawn(|_| {}).expect("spawn");
    append_n(&c, 1, 100);
    drop(c);

    let o = open_ok(&storage, LedgerOptions::default());
    let want: Vec<_> = (1..=100).map(|i| (i, payload(i))).collect();
    assert_eq!(o.records, want);
    assert_eq!(o.report.records_replayed, 100);
    assert_eq!(o.ledger.next_seq(), 101);
    let c = o.ledger.spawn(|_| {}).expect("spawn");
    append_n(&c, 101, 5);
    drop(c);
    let o = open_ok(&storage, LedgerOptions::default());
    assert_eq!(o.records.len(), 105);
    assert_eq!(o.records[104], (105, payload(105)));
}

#[test]
fn round_trip_in_memory() {
    round_trip(mem().1);
}

#[test]
fn round_trip_on_real_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    round_trip(Arc::new(FileStorage::open(dir.path()).expect("open")));
    let v = verify(&FileStorage::open_read_only(dir.path()).expect("open"));
    assert!(v.is_ok(), "{:?}", v.error);
    assert_eq!((v.records, v.first_seq, v.last_seq), (105, Some(1), 105));
}

#[test]
fn a_second_writer_is_locked_out() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _first = FileStorage::open(dir.path()).expect("open");
    let e = FileStorage::open(dir.path()).expect_err("locked");
    assert_eq!(e.code(), "ledger_locked");
}

#[test]
fn many_reopens_roll_segments_and_keep_every_record() {
    let (m, s) = mem();
    let mut next = 1;
    for round in 0..6 {
        let o = open_ok(&s, small());
        assert_eq!(o.records.len() as u64, next - 1, "round {round}");
        for (i, (seq, p)) in o.records.iter().enumerate() {
            assert_eq!((*seq, p), (i as u64 + 1, &payload(i as u64 + 1)));
        }
        let c = o.ledger.spawn(|_| {}).expect("spawn");
        for _ in 0..10 {
            append_n(&c, next, 7);
            next += 7;
        }
    }
    assert!(segment_names(&m).len() > 6, "small segments roll");
    let v = verify(&*s);
    assert!(v.is_ok(), "{:?}", v.error);
    assert_eq!(v.records, next - 1);
}

#[test]
fn reopening_without_appends_does_not_pile_up_segments() {
    let (m, s) = mem();
    let c = open_ok(&s, small()).ledger.spawn(|_| {}).expect("spawn");
    append_n(&c, 1, 3);
    drop(c);
    for _ in 0..5 {
        let o = open_ok(&s, small());
        assert_eq!(o.records.len(), 3);
    }
    assert_eq!(
        segment_names(&m).len(),
        2,
        "the data segment and one empty fresh one"
    );
}

#[test]
fn oversized_records_and_bad_options_are_refused() {
    let (_, s) = mem();
    let c = open_ok(&s, small()).ledger.spawn(|_| {}).expect("spawn");
    let e = c.append(&[0u8; 101]).expect_err("too large");
    assert_eq!(e.code(), "record_too_large");
    assert!(e.to_string().contains("record_bytes_max"));
    assert_eq!(c.append(&[0u8; 100]).expect("fits"), 1);
    drop(c);
    let bad = LedgerOptions {
        buffer_bytes_max: 10,
        ..small()
    };
    assert_eq!(open(&s, bad).expect_err("options").code(), "ledger_options");
    let bad = LedgerOptions {
        segment_bytes_max: 10,
        ..small()
    };
    assert_eq!(open(&s, bad).expect_err("options").code(), "ledger_options");
}

#[test]
fn notify_reports_each_durable_seq_in_order() {
    let (_, s) = mem();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    let c = open_ok(&s, LedgerOptions::default())
        .ledger
        .spawn(move |r| seen2.lock().expect("lock").push(r.map_err(|e| e.code())))
        .expect("spawn");
    append_n(&c, 1, 50);
    // `flush` returns once seq 50 is durable, which the sync thread publishes just before it
    // calls `notify`: stop the thread (drop joins it) so the last call has happened.
    drop(c);
    let seen = seen.lock().expect("lock").clone();
    assert!(!seen.is_empty());
    let oks: Vec<u64> = seen.iter().map(|r| *r.as_ref().expect("ok")).collect();
    assert!(oks.windows(2).all(|w| w[0] < w[1]), "{oks:?}");
    assert_eq!(*oks.last().expect("one"), 50);
}

#[test]
fn sync_stats_count_every_record_once_across_batches() {
    let (_, s) = mem();
    let stats = Arc::new(estop_ledger::SyncStats::default());
    let opts = LedgerOptions {
        sync_stats: estop_ledger::SyncObserver(Some(stats.clone())),
        ..LedgerOptions::default()
    };
    let c = open_ok(&s, opts).ledger.spawn(|_| {}).expect("spawn");
    append_n(&c, 1, 50);
    drop(c);
    let batches = stats.batch_records.snapshot();
    assert_eq!(batches.sum, 50, "every record is in exactly one batch");
    assert_eq!(
        stats.sync_us.snapshot().count(),
        batches.count(),
        "one sync per batch"
    );
    assert!(stats.bytes.load(std::sync::atomic::Ordering::Relaxed) > 50 * 8);
}

#[test]
fn replay_callback_errors_stop_recovery_and_change_nothing() {
    let (m, s) = mem();
    let c = open_ok(&s, LedgerOptions::default())
        .ledger
        .spawn(|_| {})
        .expect("spawn");
    append_n(&c, 1, 10);
    drop(c);
    let before = m.files();
    let e = estop_ledger::Ledger::open(
        s.clone(),
        LedgerOptions::default(),
        |_, _| Ok::<(), String>(()),
        |seq, _| {
            if seq == 7 {
                Err("bad command".to_owned())
            } else {
                Ok(())
            }
        },
    )
    .expect_err("refused");
    assert_eq!(e.code(), "ledger_replay");
    assert!(e.to_string().contains("seq 7") && e.to_string().contains("bad command"));
    assert_eq!(m.files(), before);
}
