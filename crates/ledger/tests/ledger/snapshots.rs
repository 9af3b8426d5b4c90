//! Snapshots: written only once durable, retention of snapshots and segments, recovery from the
//! newest valid snapshot (falling back to an older one).

use std::sync::Arc;

use estop_ledger::{CrashStorage, LedgerOptions, Storage, format};

use crate::common::*;

#[test]
fn snapshot_bounds_recovery_and_retention_removes_covered_segments() {
    let (m, s) = mem();
    let c = open_ok(&s, small()).ledger.spawn(|_| {}).expect("spawn");
    append_batched(&c, 1, 1000, 10);
    let segs_before = segment_names(&m).len();
    let r = c.snapshot(600, b"state@600").expect("snapshot");
    assert_eq!(r.snapshot.seq, 600);
    assert!(!r.removed.is_empty());
    let segs = segment_names(&m);
    assert_eq!(segs_before - segs.len(), r.removed.len());
    // The oldest remaining segment starts at or before 601; the one it replaced is gone.
    let first = format::parse_segment_name(&segs[0]).expect("name");
    let second = format::parse_segment_name(&segs[1]).expect("name");
    assert!(first <= 601 && second > 601, "{first} {second}");
    drop(c);

    let o = open_ok(&s, small());
    assert_eq!(o.snapshot, Some((600, b"state@600".to_vec())));
    assert_eq!(
        o.records,
        (601..=1000).map(|i| (i, payload(i))).collect::<Vec<_>>()
    );
    assert_eq!(o.report.records_replayed, 400);
    assert_eq!(o.report.segments_read, segs.len());

    // Two more snapshots: snap-600 is dropped (keep 2), segments up to 900 go.
    let c = o.ledger.spawn(|_| {}).expect("spawn");
    append_n(&c, 1001, 10);
    c.snapshot(900, b"state@900").expect("snapshot");
    let r = c.snapshot(950, b"state@950").expect("snapshot");
    assert!(r.removed.contains(&format::snapshot_name(600)));
    let snaps: Vec<_> = m
        .files()
        .into_keys()
        .filter(|n| n.starts_with("snap-"))
        .collect();
    assert_eq!(
        snaps,
        vec![format::snapshot_name(900), format::snapshot_name(950)]
    );
    drop(c);

    // The newest snapshot damaged: recovery falls back to the older one and still has the records.
    let name = format::snapshot_name(950);
    let mut bytes = m.files()[&name].clone();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    m.put(&name, bytes);
    let o = open_ok(&s, small());
    assert_eq!(o.snapshot, Some((900, b"state@900".to_vec())));
    assert_eq!(o.report.snapshots_invalid.len(), 1);
    assert_eq!(o.report.snapshots_invalid[0].file, name);
    assert_eq!(
        o.records,
        (901..=1010).map(|i| (i, payload(i))).collect::<Vec<_>>()
    );
}

#[test]
fn a_partial_snapshot_is_ignored() {
    let (m, s) = mem();
    let c = open_ok(&s, LedgerOptions::default())
        .ledger
        .spawn(|_| {})
        .expect("spawn");
    append_n(&c, 1, 20);
    c.snapshot(10, b"ten").expect("snapshot");
    drop(c);
    let mut bytes = m.files()[&format::snapshot_name(10)].clone();
    bytes.truncate(bytes.len() - 1);
    m.put(&format::snapshot_name(10), bytes);
    // A leftover tmp file from a crash mid-snapshot is removed.
    m.put("snap-00000000000000000015.snap.tmp", b"half".to_vec());
    let o = open_ok(&s, LedgerOptions::default());
    assert_eq!(o.snapshot, None);
    assert_eq!(o.records.len(), 20);
    assert_eq!(
        o.report.removed,
        vec!["snap-00000000000000000015.snap.tmp".to_owned()]
    );
}

#[test]
fn snapshot_waits_until_its_seq_is_durable() {
    let disk = CrashStorage::new(5);
    let s: Arc<dyn Storage> = Arc::new(disk.clone());
    let c = open_ok(&s, LedgerOptions::default())
        .ledger
        .spawn(|_| {})
        .expect("spawn");
    disk.pause_syncs(true);
    let seq = c.append(b"one").expect("append");
    let c2 = c.clone();
    let t = std::thread::spawn(move || c2.snapshot(seq, b"after one"));
    // Syncs are held, so the snapshot must still be waiting.
    for _ in 0..10_000 {
        std::thread::yield_now();
    }
    assert!(!t.is_finished());
    assert!(
        disk.file(&format::snapshot_name(seq)).is_none(),
        "snapshot written before its seq was durable"
    );
    disk.pause_syncs(false);
    t.join().expect("thread").expect("snapshot");
    assert!(c.durable() >= seq);
    assert!(disk.file(&format::snapshot_name(seq)).is_some());
}

#[test]
fn a_failed_committer_writes_no_snapshot() {
    let disk = CrashStorage::new(9);
    let s: Arc<dyn Storage> = Arc::new(disk.clone());
    let c = open_ok(&s, LedgerOptions::default())
        .ledger
        .spawn(|_| {})
        .expect("spawn");
    append_n(&c, 1, 3);
    disk.fail_next_sync();
    let seq = c.append(b"four").expect("append");
    assert!(c.wait_durable(seq).is_err());
    assert_eq!(
        c.snapshot(3, b"x").expect_err("failed").code(),
        "ledger_failed"
    );
}
