//! `caller_syncs`: no sync thread; every sync runs on the thread that commits, waits or flushes.
//! What the deterministic simulation needs to run the shipped committer: one thread, one order.

use std::sync::{Arc, Mutex};

use estop_ledger::{CrashStorage, LedgerError, LedgerOptions, Storage};

use crate::common::*;

fn caller_syncs() -> LedgerOptions {
    LedgerOptions {
        caller_syncs: true,
        ..small()
    }
}

#[test]
fn each_commit_syncs_on_the_caller_and_notifies_it_in_order() {
    let storage: Arc<dyn Storage> = Arc::new(CrashStorage::new(1));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let me = std::thread::current().id();
    let c = {
        let seen = Arc::clone(&seen);
        open_ok(&storage, caller_syncs())
            .ledger
            .spawn(move |r| {
                assert_eq!(
                    std::thread::current().id(),
                    me,
                    "notified on another thread"
                );
                seen.lock().unwrap().push(r.map_err(|e| e.to_string()));
            })
            .unwrap()
    };
    for i in 1..=50 {
        let seq = c.append_deferred(&payload(i)).unwrap();
        assert_eq!(c.durable(), seq - 1, "nothing syncs before the commit");
        // Even a commit that asks not to be inline syncs here: nobody else would.
        assert!(c.commit(i % 2 == 0));
        assert_eq!(c.durable(), seq);
    }
    let notes = seen.lock().unwrap().clone();
    assert_eq!(notes, (1..=50).map(Ok).collect::<Vec<_>>());
    // A burst, then `wait_durable`: one sync on this thread.
    for i in 51..=60 {
        c.append_deferred(&payload(i)).unwrap();
    }
    c.wait_durable(60).unwrap();
    assert_eq!(c.durable(), 60);
    drop(c);
    let o = open_ok(&storage, caller_syncs());
    assert_eq!(o.report.last_seq, 60);
}

#[test]
fn a_failed_sync_fails_closed_at_once_and_a_wait_says_so() {
    let crash = Arc::new(CrashStorage::new(2));
    let storage: Arc<dyn Storage> = crash.clone();
    let c = open_ok(&storage, caller_syncs())
        .ledger
        .spawn(|_| {})
        .unwrap();
    c.append_deferred(&payload(1)).unwrap();
    c.commit(false);
    crash.fail_next_sync();
    let seq = c.append_deferred(&payload(2)).unwrap();
    assert!(matches!(
        c.wait_durable(seq),
        Err(LedgerError::Failed { .. })
    ));
    assert_eq!(c.durable(), 1);
    assert!(matches!(
        c.append_deferred(&payload(3)),
        Err(LedgerError::Failed { .. })
    ));
}

#[test]
fn dropping_the_last_handle_syncs_what_is_buffered() {
    let storage: Arc<dyn Storage> = Arc::new(CrashStorage::new(3));
    let c = open_ok(&storage, caller_syncs())
        .ledger
        .spawn(|_| {})
        .unwrap();
    for i in 1..=5 {
        c.append_deferred(&payload(i)).unwrap();
    }
    drop(c);
    assert_eq!(open_ok(&storage, caller_syncs()).report.last_seq, 5);
}
