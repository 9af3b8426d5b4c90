//! Group commit under concurrency: distinct contiguous seqs, every wait returns, few syncs;
//! backpressure at the buffer bound; drop flushes.

use std::collections::BTreeMap;
use std::sync::Arc;

use estop_ledger::{CrashStorage, FileStorage, LedgerOptions, Storage};

use crate::common::*;

fn many_threads(storage: Arc<dyn Storage>, threads: u64, per_thread: u64) {
    let c = open_ok(&storage, LedgerOptions::default())
        .ledger
        .spawn(|_| {})
        .expect("spawn");
    let mut handles = Vec::new();
    for t in 0..threads {
        let c = c.clone();
        handles.push(std::thread::spawn(move || {
            let mut mine = Vec::new();
            for i in 0..per_thread {
                let p = format!("thread {t} record {i}").into_bytes();
                let seq = c.append(&p).expect("append");
                c.wait_durable(seq).expect("durable");
                assert!(c.durable() >= seq);
                mine.push((seq, p));
            }
            mine
        }));
    }
    let mut all = BTreeMap::new();
    for h in handles {
        for (seq, p) in h.join().expect("thread") {
            assert!(all.insert(seq, p).is_none(), "seq {seq} handed out twice");
        }
    }
    let n = threads * per_thread;
    assert_eq!(
        all.keys().copied().collect::<Vec<_>>(),
        (1..=n).collect::<Vec<_>>()
    );
    drop(c);
    let o = open_ok(&storage, LedgerOptions::default());
    assert_eq!(o.records, all.into_iter().collect::<Vec<_>>());
}

#[test]
fn group_commit_in_memory_with_many_threads() {
    many_threads(mem().1, 16, 2000);
}

#[test]
fn group_commit_on_real_files_with_many_threads() {
    let dir = tempfile::tempdir().expect("tempdir");
    many_threads(
        Arc::new(FileStorage::open(dir.path()).expect("open")),
        8,
        200,
    );
}

#[test]
fn one_sync_covers_many_appends() {
    let disk = CrashStorage::new(1);
    let s: Arc<dyn Storage> = Arc::new(disk.clone());
    let c = open_ok(&s, LedgerOptions::default())
        .ledger
        .spawn(|_| {})
        .expect("spawn");
    disk.pause_syncs(true);
    let first = c.append(b"first").expect("append");
    for i in 0..999 {
        c.append(&payload(i)).expect("append");
    }
    disk.pause_syncs(false);
    c.wait_durable(first).expect("durable");
    let syncs_before = disk.stats().syncs;
    assert_eq!(c.flush().expect("flush"), 1000);
    assert!(
        disk.stats().syncs - syncs_before <= 2,
        "the 999 appends made during one sync share one more"
    );
}

#[test]
fn a_full_buffer_is_backpressure_not_a_wait() {
    let disk = CrashStorage::new(2);
    let s: Arc<dyn Storage> = Arc::new(disk.clone());
    let opts = LedgerOptions {
        record_bytes_max: 100,
        buffer_bytes_max: 1000,
        ..LedgerOptions::default()
    };
    let c = open_ok(&s, opts.clone())
        .ledger
        .spawn(|_| {})
        .expect("spawn");
    disk.pause_syncs(true);
    let mut appended = 0;
    let err = loop {
        match c.append(&[1u8; 84]) {
            Ok(_) => appended += 1,
            Err(e) => break e,
        }
        assert!(appended < 100, "the buffer is bounded");
    };
    assert_eq!(err.code(), "backpressure");
    assert!(err.to_string().contains("retry"));
    disk.pause_syncs(false);
    let n = c.flush().expect("flush");
    assert_eq!(n, appended);
    assert_eq!(c.append(&[2u8; 84]).expect("room again"), appended + 1);
}

#[test]
fn dropping_the_last_handle_flushes() {
    let (_, s) = mem();
    let c = open_ok(&s, LedgerOptions::default())
        .ledger
        .spawn(|_| {})
        .expect("spawn");
    let c2 = c.clone();
    for i in 1..=500 {
        assert_eq!(c2.append(&payload(i)).expect("append"), i);
    }
    drop(c);
    drop(c2);
    assert_eq!(open_ok(&s, LedgerOptions::default()).records.len(), 500);
}
