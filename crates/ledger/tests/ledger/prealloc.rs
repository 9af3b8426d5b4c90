//! Preallocation: the sync thread writes zeros ahead of the write position and overwrites them
//! with records. A zero tail is the clean end of a segment, a zero header followed by anything
//! else is a bad record, tails are cut when a segment stops being written, and a power loss at
//! any step of zero-extension, overwrite, sync or roll loses no acknowledged record.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use estop_ledger::format::{self, SEGMENT_HEADER_BYTES};
use estop_ledger::{
    CrashStorage, FileStorage, LedgerError, LedgerOptions, MemStorage, Preallocated, Storage,
    verify,
};

use crate::common::*;

const SEG1: &str = "seg-00000000000000000001.log";
const SEG6: &str = "seg-00000000000000000006.log";

/// Records 1..=5 written with preallocation on, the writer stopped: seg-1 still holds its zeros.
/// Returns the files and where the records end.
fn five_with_zeros() -> (BTreeMap<String, Vec<u8>>, usize) {
    let (m, s) = mem();
    let c = open_ok(&s, LedgerOptions::default())
        .ledger
        .spawn(|_| {})
        .expect("spawn");
    append_n(&c, 1, 5);
    drop(c);
    let v = verify(&*s);
    assert!(v.is_ok(), "{:?}", v.error);
    let seg = &v.segments[0];
    assert_eq!(seg.name, SEG1);
    let end = (seg.bytes - seg.preallocated_bytes) as usize;
    (m.files(), end)
}

fn storage_with(files: &BTreeMap<String, Vec<u8>>) -> (MemStorage, Arc<dyn Storage>) {
    let m = MemStorage::from_files(files.clone());
    let s: Arc<dyn Storage> = Arc::new(m.clone());
    (m, s)
}

fn segment(first: u64, seqs: &[u64], zeros: usize) -> Vec<u8> {
    let mut v = format::encode_segment_header(first).to_vec();
    for &s in seqs {
        let p = payload(s);
        format::append_record(&mut v, s, &p, crc32c::crc32c(&p));
    }
    v.resize(v.len() + zeros, 0);
    v
}

#[test]
fn records_overwrite_zeros_written_ahead_and_verify_reports_them() {
    let (files, end) = five_with_zeros();
    let seg = &files[SEG1];
    let want_end: usize =
        SEGMENT_HEADER_BYTES + (1..=5).map(|i| 16 + payload(i).len()).sum::<usize>();
    assert_eq!(end, want_end, "records are back to back from the header");
    assert_eq!(
        seg.len() as u64,
        SEGMENT_HEADER_BYTES as u64 + LedgerOptions::default().preallocate_bytes,
        "one default chunk of zeros from the first batch on"
    );
    assert!(seg[end..].iter().all(|b| *b == 0));
    let (_, s) = storage_with(&files);
    let v = verify(&*s);
    assert_eq!((v.records, v.last_seq), (5, 5));
    assert_eq!(v.torn_tail, None, "zeros are not a torn tail");
    assert!(v.superseded.is_empty(), "zeros are not superseded bytes");
    assert_eq!(v.segments[0].preallocated_bytes, (seg.len() - end) as u64);
}

#[test]
fn open_cuts_the_zero_tail_of_the_previous_last_segment() {
    let (files, end) = five_with_zeros();
    let (m, s) = storage_with(&files);
    let o = open_ok(&s, LedgerOptions::default());
    assert_eq!(
        o.records,
        (1..=5).map(|i| (i, payload(i))).collect::<Vec<_>>()
    );
    assert_eq!(o.report.torn_tail, None);
    assert_eq!(
        o.report.preallocated_cut,
        vec![Preallocated {
            segment: SEG1.to_owned(),
            offset: end as u64,
            bytes: (files[SEG1].len() - end) as u64,
        }]
    );
    assert_eq!(m.files()[SEG1], files[SEG1][..end]);
    // The fresh segment gets its zeros with its first batch, not before.
    assert_eq!(m.files()[SEG6].len(), SEGMENT_HEADER_BYTES);
    let c = o.ledger.spawn(|_| {}).expect("spawn");
    append_n(&c, 6, 2);
    drop(c);
    let v = verify(&*s);
    assert_eq!(v.records, 7);
    assert_eq!(v.segments[0].preallocated_bytes, 0);
    assert!(v.segments[1].preallocated_bytes > 0);
}

#[test]
fn a_zero_header_followed_by_non_zero_bytes_in_the_last_segment_is_a_torn_tail() {
    let (files, end) = five_with_zeros();
    let len = files[SEG1].len();
    for at in [end + 16, end + 100, len - 1] {
        let mut bad = files.clone();
        bad.get_mut(SEG1).expect("seg")[at] = 0x5a;
        let (m, s) = storage_with(&bad);
        let v = verify(&*s);
        assert!(v.is_ok(), "{:?}", v.error);
        assert_eq!(v.torn_tail.as_ref().map(|t| t.offset), Some(end as u64));
        let o = open_ok(&s, LedgerOptions::default());
        assert_eq!(o.records.len(), 5, "at {at}");
        let t = o.report.torn_tail.expect("torn");
        assert_eq!(
            (t.offset, t.bytes_dropped),
            (end as u64, (len - end) as u64)
        );
        assert!(t.reason.contains("zero record header"), "{}", t.reason);
        assert!(o.report.preallocated_cut.is_empty());
        assert_eq!(m.files()[SEG1].len(), end, "truncated at the zero header");
    }
}

#[test]
fn a_zero_header_followed_by_a_valid_record_is_corruption() {
    let (files, end) = five_with_zeros();
    let mut bad = files.clone();
    let mut rec = Vec::new();
    let p = payload(6);
    format::append_record(&mut rec, 6, &p, crc32c::crc32c(&p));
    bad.get_mut(SEG1).expect("seg")[end + 64..end + 64 + rec.len()].copy_from_slice(&rec);
    let (m, s) = storage_with(&bad);
    let e = open(&s, LedgerOptions::default()).expect_err("refused");
    let LedgerError::Corrupt { file, offset, .. } = &e else {
        panic!("{e}")
    };
    assert_eq!((file.as_str(), *offset), (SEG1, end as u64));
    assert!(e.to_string().contains("followed by a valid record"), "{e}");
    assert_eq!(m.files(), bad, "a refused open changes nothing");
    assert_eq!(verify(&*s).error.map(|e| e.code()), Some("ledger_corrupt"));
}

#[test]
fn a_never_written_sector_before_later_records_of_the_last_batch_is_a_torn_tail() {
    // What a power loss leaves when the disk persisted a later sector of the unsynced batch but
    // not an earlier one: the earlier one still holds the preallocated zeros.
    let (files, end) = five_with_zeros();
    let mut holed = files.clone();
    let mut rec = Vec::new();
    let p = payload(7);
    format::append_record(&mut rec, 7, &p, crc32c::crc32c(&p));
    let at = (end / 512 + 2) * 512; // a whole zero sector lies between `end` and `at`
    holed.get_mut(SEG1).expect("seg")[at..at + rec.len()].copy_from_slice(&rec);
    let (m, s) = storage_with(&holed);
    let o = open_ok(&s, LedgerOptions::default());
    assert_eq!(
        o.records.len(),
        5,
        "records 1..=5 are kept, the torn batch is dropped"
    );
    let t = o.report.torn_tail.as_ref().expect("torn tail");
    assert_eq!((t.segment.as_str(), t.offset), (SEG1, end as u64));
    assert!(t.reason.contains("never written"), "{}", t.reason);
    assert_eq!(
        m.files()[SEG1].len(),
        end,
        "cut at the start of the torn batch"
    );

    // The same shape further from the end than one batch can be is not a torn write: refused.
    let (_, s) = storage_with(&holed);
    let small = LedgerOptions {
        record_bytes_max: 64,
        buffer_bytes_max: 256,
        ..LedgerOptions::default()
    };
    let e = open(&s, small).expect_err("refused");
    assert!(e.to_string().contains("followed by a valid record"), "{e}");

    // Non-zero garbage in place of the hole is corruption, whatever the distance.
    let mut garbled = holed.clone();
    garbled.get_mut(SEG1).expect("seg")[end..at].fill(0x5a);
    let (_, s) = storage_with(&garbled);
    let e = open(&s, LedgerOptions::default()).expect_err("refused");
    assert!(e.to_string().contains("followed by a valid record"), "{e}");
}

#[test]
fn zeros_before_a_segments_live_range_ends_are_corruption() {
    let files: BTreeMap<_, _> = [
        (format::segment_name(1), segment(1, &[1, 2, 3], 100)),
        (format::segment_name(5), segment(5, &[5], 0)),
    ]
    .into_iter()
    .collect();
    let (_, s) = storage_with(&files);
    let e = open(&s, LedgerOptions::default()).expect_err("refused");
    assert!(
        e.to_string()
            .contains("(zeros follow), but the next segment starts at 5"),
        "{e}"
    );
    let end = files[SEG1].len() - 100;
    assert!(matches!(&e, LedgerError::Corrupt { offset, .. } if *offset == end as u64));
}

#[test]
fn a_non_last_segments_zero_tail_is_cut_at_open_but_not_with_discard_after() {
    let seg4 = format::segment_name(4);
    let files: BTreeMap<_, _> = [
        (format::segment_name(1), segment(1, &[1, 2, 3], 100)),
        (seg4.clone(), segment(4, &[4, 5], 50)),
    ]
    .into_iter()
    .collect();
    let (m, s) = storage_with(&files);
    let v = verify(&*s);
    assert!(v.is_ok() && v.superseded.is_empty() && v.torn_tail.is_none());
    let zeros: Vec<u64> = v.segments.iter().map(|s| s.preallocated_bytes).collect();
    assert_eq!(zeros, vec![100, 50]);

    // After a writer failure nothing old is written: the zeros stay (reported, not cut).
    let o = open_ok(
        &s,
        LedgerOptions {
            discard_after: Some(5),
            ..LedgerOptions::default()
        },
    );
    assert_eq!(o.records.len(), 5);
    assert!(o.report.preallocated_cut.is_empty() && o.report.superseded.is_empty());
    assert_eq!(m.files()[SEG1], files[SEG1]);
    assert_eq!(m.files()[&seg4], files[&seg4]);
    drop(o);

    let o = open_ok(&s, LedgerOptions::default());
    assert_eq!(o.records.len(), 5);
    let cut: Vec<(String, u64)> = o
        .report
        .preallocated_cut
        .iter()
        .map(|p| (p.segment.clone(), p.bytes))
        .collect();
    assert_eq!(cut, vec![(SEG1.to_owned(), 100), (seg4.clone(), 50)]);
    assert_eq!(m.files()[SEG1].len(), files[SEG1].len() - 100);
    assert_eq!(m.files()[&seg4].len(), files[&seg4].len() - 50);
}

#[test]
fn segments_stay_within_segment_bytes_max_and_lose_their_zeros_at_roll() {
    let (m, s) = mem();
    let opts = LedgerOptions {
        preallocate_bytes: 200,
        ..small()
    };
    let c = open_ok(&s, opts.clone())
        .ledger
        .spawn(|_| {})
        .expect("spawn");
    append_batched(&c, 1, 80, 3);
    // While the writer runs: every segment but the active one ends with its last record.
    let v = verify(&*s);
    assert!(v.is_ok(), "{:?}", v.error);
    assert!(v.segments.len() > 5, "small segments roll");
    let (active, done) = v.segments.split_last().expect("segments");
    for seg in done {
        assert_eq!(
            seg.preallocated_bytes, 0,
            "{} was cut at the roll",
            seg.name
        );
        assert!(seg.bytes <= opts.segment_bytes_max, "{}", seg.name);
    }
    assert!(active.preallocated_bytes >= 16);
    assert!(active.bytes <= opts.segment_bytes_max + 16);
    for (name, bytes) in m.files() {
        assert!(bytes.len() as u64 <= opts.segment_bytes_max + 16, "{name}");
    }
    drop(c);
    let o = open_ok(&s, opts);
    assert_eq!(o.records.len(), 80);
    assert_eq!(o.report.preallocated_cut.len(), 1);
}

#[test]
fn without_preallocation_records_are_appended() {
    let (m, s) = mem();
    let opts = LedgerOptions {
        preallocate_bytes: 0,
        ..LedgerOptions::default()
    };
    let c = open_ok(&s, opts).ledger.spawn(|_| {}).expect("spawn");
    append_n(&c, 1, 5);
    drop(c);
    let v = verify(&*s);
    assert_eq!(v.segments[0].preallocated_bytes, 0);
    assert_eq!(v.segments[0].bytes, m.files()[SEG1].len() as u64);
    assert_eq!(
        m.files()[SEG1].len(),
        SEGMENT_HEADER_BYTES + (1..=5).map(|i| 16 + payload(i).len()).sum::<usize>()
    );
}

#[test]
fn file_storage_overwrites_in_place_and_appends_at_the_end() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fs = FileStorage::open(dir.path()).expect("open");
    let mut f = fs.create("f").expect("create");
    f.write_all(b"head").expect("write");
    f.write_all_at(4, &[0; 8]).expect("zeros");
    f.write_all_at(4, b"abc").expect("overwrite");
    f.write_all(b"tail").expect("append");
    f.write_all_at(14, b"xyz").expect("overwrite and extend");
    f.sync_data().expect("sync");
    assert_eq!(
        estop_ledger::read_file(&fs, "f").expect("read"),
        b"headabc\0\0\0\0\0taxyz"
    );
}

/// Options for the power-loss test: tiny segments and chunks, so a few records reach every
/// step (zero-extension, overwrite, roll with its cut, a batch larger than a chunk).
fn tiny() -> LedgerOptions {
    LedgerOptions {
        record_bytes_max: 100,
        segment_bytes_max: 2000,
        preallocate_bytes: 300,
        buffer_bytes_max: 4096,
        ..LedgerOptions::default()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Media {
    /// Unsynced bytes are simply lost.
    Clean,
    /// A prefix of each file's unsynced range survives (the default model).
    Torn,
    /// Each unsynced sector survives or not on its own (holes).
    Reordered,
}

#[derive(Debug, Default)]
struct Seen {
    runs: u64,
    torn_tails: u64,
    zero_tails: u64,
    holes: u64,
    /// The operation each crash interrupted, as the failed writer named it.
    crashed_in: BTreeSet<&'static str>,
}

/// One run: 3 durable records, then `ROUNDS` groups of appends with a flush after each, the
/// power failing just before the `crash_at`-th disk operation of that phase (or after it, if
/// `None`). Checks recovery against what was appended and acknowledged. Returns the number of
/// disk operations the phase took.
fn power_loss_run(seed: u64, media: Media, crash_at: Option<u64>, seen: &mut Seen) -> u64 {
    const ROUNDS: u64 = 10;
    let disk = CrashStorage::new(seed);
    disk.set_torn_writes(media != Media::Clean);
    disk.set_reordered_writes(media == Media::Reordered);
    let s: Arc<dyn Storage> = Arc::new(disk.clone());
    let c = open_ok(&s, tiny()).ledger.spawn(|_| {}).expect("spawn");
    append_n(&c, 1, 3);
    let mut appended: Vec<Vec<u8>> = (1..=3).map(payload).collect();
    let mut acked = 3;
    let ops_before = disk.ops();
    disk.crash_at_op(crash_at);
    'rounds: for round in 0..ROUNDS {
        // 1 to 4 records, sometimes 12 (a batch over several sectors and larger than a chunk),
        // one of them of the largest size in the last rounds. The first record of a group is a
        // batch of its own and the rest one more (appended while the first one's sync is held),
        // so the sequence of disk operations, and thus each crash point, is the same every run.
        let group = if round % 5 == 4 {
            12
        } else {
            1 + (round + seed) % 4
        };
        for j in 0..group {
            let p = if round >= 8 && j == 0 {
                vec![round as u8; 100]
            } else {
                payload(appended.len() as u64 + 1)
            };
            if j == 0 {
                disk.pause_syncs(true);
            }
            let writes = disk.stats().writes;
            match c.append(&p) {
                Ok(seq) => {
                    assert_eq!(seq as usize, appended.len() + 1);
                    appended.push(p);
                }
                Err(_) => {
                    disk.pause_syncs(false);
                    break 'rounds;
                }
            }
            if j == 0 {
                // The sync thread has taken the first record once it writes.
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                while disk.stats().writes == writes && c.failed().is_none() {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "the sync thread is stuck"
                    );
                    std::thread::yield_now();
                }
            }
        }
        disk.pause_syncs(false);
        match c.flush() {
            Ok(n) => acked = n,
            Err(_) => break,
        }
    }
    if let Some(LedgerError::Io { op, .. }) = c.failed().as_ref().map(LedgerError::root) {
        seen.crashed_in.insert(op);
    }
    let ops = disk.ops() - ops_before;
    drop(c);
    disk.crash_at_op(None);
    disk.crash();
    seen.runs += 1;

    let what = format!("seed {seed}, {media:?}, crash at op {crash_at:?}");
    // Holes (sectors persisted out of order) before later records of the unsynced batch are a
    // torn tail too (docs/LEDGER.md): a power loss never leaves a ledger that refuses to open.
    let o = match open(&s, tiny()) {
        Ok(o) => o,
        Err(e) => panic!("{what}: refused: {e}"),
    };
    if o.report
        .torn_tail
        .as_ref()
        .is_some_and(|t| t.reason.contains("never written"))
    {
        assert_eq!(media, Media::Reordered, "{what}: a hole without reordering");
        seen.holes += 1;
    }
    seen.torn_tails += u64::from(o.report.torn_tail.is_some());
    seen.zero_tails += u64::from(!o.report.preallocated_cut.is_empty());
    let got: Vec<&Vec<u8>> = o.records.iter().map(|(_, p)| p).collect();
    assert!(
        got.len() as u64 >= acked,
        "{what}: lost acknowledged records"
    );
    assert!(
        got.len() <= appended.len(),
        "{what}: a record never appended"
    );
    for (i, (seq, p)) in o.records.iter().enumerate() {
        assert_eq!(*seq, i as u64 + 1, "{what}");
        assert_eq!(
            p, &appended[i],
            "{what}: record {seq} is not what was appended"
        );
    }
    // The recovered ledger is whole: it takes new records and keeps them.
    let n = o.records.len() as u64;
    let c = o.ledger.spawn(|_| {}).expect("spawn");
    append_n(&c, n + 1, 2);
    drop(c);
    disk.crash();
    let o = open_ok(&s, tiny());
    assert_eq!(o.records.len() as u64, n + 2, "{what}");
    assert!(verify(&*s).is_ok(), "{what}");
    ops
}

#[test]
fn a_power_loss_at_every_step_of_preallocation_overwrite_and_roll_loses_nothing_acknowledged() {
    for media in [Media::Clean, Media::Torn, Media::Reordered] {
        let mut seen = Seen::default();
        for seed in 0..10 {
            let ops = power_loss_run(seed, media, None, &mut seen);
            for at in 0..=ops {
                power_loss_run(seed, media, Some(at), &mut seen);
            }
        }
        eprintln!("{media:?}: {seen:?}");
        for op in [
            "preallocate",
            "write",
            "sync",
            "truncate",
            "create",
            "rename",
        ] {
            assert!(
                seen.crashed_in.contains(op),
                "{media:?}: no crash in {op}: {seen:?}"
            );
        }
        assert!(seen.zero_tails > 10, "{media:?}: {seen:?}");
        if media != Media::Clean {
            assert!(seen.torn_tails > 10, "{media:?}: {seen:?}");
        }
        assert_eq!(
            seen.holes > 0,
            media == Media::Reordered,
            "holes recovered as torn tails: {seen:?}"
        );
    }
}
