//! Group commit under concurrency: distinct contiguous seqs, every wait returns, few syncs;
//! backpressure at the buffer bound; drop flushes.

use std::collections::BTreeMap;
use std::sync::Arc;

use estop_ledger::{CrashStorage, FileStorage, LedgerOptions, Storage};

use crate::common::*;

/// How each thread makes its records durable.
#[derive(Clone, Copy, PartialEq)]
enum Commit {
    /// `append` (the sync thread syncs).
    Append,
    /// `append_deferred` + `commit(inline)`: threads of even number sync inline when the sync
    /// thread is idle, the others leave it to the sync thread.
    Mixed,
}

fn many_threads(storage: Arc<dyn Storage>, threads: u64, per_thread: u64, mode: Commit) {
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
                let seq = match mode {
                    Commit::Append => c.append(&p).expect("append"),
                    Commit::Mixed => {
                        let seq = c.append_deferred(&p).expect("append");
                        c.commit(t % 2 == 0);
                        seq
                    }
                };
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
    many_threads(mem().1, 16, 2000, Commit::Append);
}

#[test]
fn group_commit_on_real_files_with_many_threads() {
    let dir = tempfile::tempdir().expect("tempdir");
    many_threads(
        Arc::new(FileStorage::open(dir.path()).expect("open")),
        8,
        200,
        Commit::Append,
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

#[test]
fn a_deferred_append_waits_for_a_commit_and_an_inline_commit_syncs_on_the_callers_thread() {
    let disk = CrashStorage::new(3);
    let s: Arc<dyn Storage> = Arc::new(disk.clone());
    let notified = Arc::new(std::sync::Mutex::new(Vec::new()));
    let n2 = notified.clone();
    let c = open_ok(&s, LedgerOptions::default())
        .ledger
        .spawn(move |r| {
            n2.lock()
                .expect("lock")
                .push((r.expect("ok"), std::thread::current().id()))
        })
        .expect("spawn");
    // Let the sync thread go idle, then append without starting a sync.
    std::thread::sleep(std::time::Duration::from_millis(20));
    let syncs = disk.stats().syncs;
    for i in 1..=3 {
        assert_eq!(c.append_deferred(&payload(i)).expect("append"), i);
    }
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(c.durable(), 0, "nothing is synced before a commit");
    assert_eq!(disk.stats().syncs, syncs);
    assert!(c.commit(true), "synced on this thread");
    assert_eq!(
        c.durable(),
        3,
        "an inline commit returns once it is durable"
    );
    assert_eq!(disk.stats().syncs, syncs + 1, "one sync for the burst");
    assert_eq!(
        *notified.lock().expect("lock"),
        vec![(3, std::thread::current().id())],
        "notified once, from the committing thread"
    );
    // Without `inline` the sync thread does it.
    c.append_deferred(&payload(4)).expect("append");
    assert!(!c.commit(false));
    c.wait_durable(4).expect("durable");
    assert_ne!(
        notified.lock().expect("lock")[1].1,
        std::thread::current().id()
    );
    // A waiter starts the sync of what it waits for: a deferred append is never stranded.
    let seq = c.append_deferred(&payload(5)).expect("append");
    c.wait_durable(seq).expect("durable");
    drop(c);
    let o = open_ok(&s, LedgerOptions::default());
    assert_eq!(
        o.records,
        (1..=5).map(|i| (i, payload(i))).collect::<Vec<_>>()
    );
}

#[test]
fn inline_commits_and_the_sync_thread_write_every_record_once_in_order() {
    let dir = tempfile::tempdir().expect("tempdir");
    many_threads(
        Arc::new(FileStorage::open(dir.path()).expect("open")),
        6,
        150,
        Commit::Mixed,
    );
}

#[test]
fn a_failed_inline_sync_fails_the_committer_closed() {
    let disk = CrashStorage::new(4);
    let s: Arc<dyn Storage> = Arc::new(disk.clone());
    let c = open_ok(&s, LedgerOptions::default())
        .ledger
        .spawn(|_| {})
        .expect("spawn");
    let first = c.append(&payload(1)).expect("append");
    c.wait_durable(first).expect("durable");
    std::thread::sleep(std::time::Duration::from_millis(20));
    disk.fail_next_sync();
    let seq = c.append_deferred(&payload(2)).expect("append");
    c.commit(true);
    assert_eq!(c.durable(), 1);
    assert_eq!(
        c.wait_durable(seq).expect_err("lost").code(),
        "ledger_failed"
    );
    assert_eq!(
        c.append_deferred(b"more").expect_err("failed").code(),
        "ledger_failed"
    );
    let syncs = disk.stats().syncs;
    assert!(!c.commit(true), "nothing to sync after the failure");
    std::thread::sleep(std::time::Duration::from_millis(5));
    assert_eq!(disk.stats().syncs, syncs, "no sync after the failure");
}
