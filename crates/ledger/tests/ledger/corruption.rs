//! Torn tails at every byte, bit flips, seq gaps, bad headers: what opens, what is refused.

use std::collections::BTreeMap;
use std::sync::Arc;

use estop_ledger::format::{self, SEGMENT_HEADER_BYTES};
use estop_ledger::{LedgerOptions, MemStorage, Preallocated, Storage, verify};

use crate::common::*;

const SEG1: &str = "seg-00000000000000000001.log";

/// A ledger with records 1..=n in seg-1 (the last segment), and the offsets of its records.
/// Written without preallocation, so the file ends with the last record (as every segment did
/// before preallocation, and as every segment does once it is no longer written to).
fn five_records(n: u64) -> (BTreeMap<String, Vec<u8>>, Vec<u64>) {
    let (m, s) = mem();
    let no_zeros = LedgerOptions {
        preallocate_bytes: 0,
        ..LedgerOptions::default()
    };
    let c = open_ok(&s, no_zeros).ledger.spawn(|_| {}).expect("spawn");
    append_n(&c, 1, n);
    drop(c);
    let offsets = positions(&*s).into_iter().map(|(seg, off, _)| {
        assert_eq!(seg, SEG1);
        off
    });
    (m.files(), offsets.collect())
}

fn storage_with(files: &BTreeMap<String, Vec<u8>>) -> (MemStorage, Arc<dyn Storage>) {
    let m = MemStorage::from_files(files.clone());
    let s: Arc<dyn Storage> = Arc::new(m.clone());
    (m, s)
}

#[test]
fn torn_tail_at_every_byte_of_the_last_record() {
    let (files, offsets) = five_records(5);
    let last = offsets[4];
    let full = files[SEG1].len() as u64;
    for cut in last..full {
        let mut files = files.clone();
        files.get_mut(SEG1).expect("seg").truncate(cut as usize);
        let (m, s) = storage_with(&files);

        let v = verify(&*s);
        assert!(v.is_ok(), "cut {cut}: {:?}", v.error);
        assert_eq!(m.files()[SEG1].len() as u64, cut, "verify changes nothing");

        let o = open_ok(&s, LedgerOptions::default());
        let want: Vec<_> = (1..=4).map(|i| (i, payload(i))).collect();
        assert_eq!(o.records, want, "cut {cut}");
        if cut == last {
            assert_eq!(o.report.torn_tail, None);
        } else {
            let t = o.report.torn_tail.clone().expect("torn tail reported");
            assert_eq!(
                (t.segment.as_str(), t.offset, t.bytes_dropped),
                (SEG1, last, cut - last),
                "cut {cut}"
            );
        }
        assert_eq!(
            m.files()[SEG1].len() as u64,
            last,
            "truncated at the torn record"
        );

        let c = o.ledger.spawn(|_| {}).expect("spawn");
        assert_eq!(c.append(b"after the tear").expect("append"), 5);
        c.flush().expect("flush");
        drop(c);
        let o = open_ok(&s, LedgerOptions::default());
        assert_eq!(o.records.len(), 5);
        assert_eq!(o.records[4], (5, b"after the tear".to_vec()));
        assert_eq!(o.report.torn_tail, None);
    }
}

#[test]
fn a_zero_filled_tail_is_the_clean_end_and_is_cut() {
    let (mut files, _) = five_records(5);
    let len = files[SEG1].len();
    files.get_mut(SEG1).expect("seg").resize(len + 4096, 0);
    let (m, s) = storage_with(&files);
    let v = verify(&*s);
    assert!(v.is_ok() && v.torn_tail.is_none() && v.superseded.is_empty());
    assert_eq!(v.segments[0].preallocated_bytes, 4096);
    let o = open_ok(&s, LedgerOptions::default());
    assert_eq!(o.records.len(), 5);
    assert_eq!(o.report.torn_tail, None);
    assert_eq!(
        o.report.preallocated_cut,
        vec![Preallocated {
            segment: SEG1.to_owned(),
            offset: len as u64,
            bytes: 4096
        }]
    );
    assert_eq!(m.files()[SEG1].len(), len);
}

#[test]
fn fewer_zeros_than_a_record_header_are_a_torn_tail() {
    let (mut files, _) = five_records(5);
    let len = files[SEG1].len();
    files.get_mut(SEG1).expect("seg").resize(len + 15, 0);
    let (m, s) = storage_with(&files);
    let o = open_ok(&s, LedgerOptions::default());
    assert_eq!(o.records.len(), 5);
    let t = o.report.torn_tail.expect("torn");
    assert_eq!((t.offset, t.bytes_dropped), (len as u64, 15));
    assert_eq!(m.files()[SEG1].len(), len);
}

fn flip(files: &BTreeMap<String, Vec<u8>>, name: &str, byte: usize) -> BTreeMap<String, Vec<u8>> {
    let mut files = files.clone();
    files.get_mut(name).expect("file")[byte] ^= 1 << (byte % 8);
    files
}

#[test]
fn a_flipped_bit_in_a_middle_record_refuses_to_open_naming_segment_and_offset() {
    let (files, offsets) = five_records(5);
    let (start, end) = (offsets[2], offsets[3]);
    for byte in start..end {
        let bad = flip(&files, SEG1, byte as usize);
        let (m, s) = storage_with(&bad);
        let e = open(&s, LedgerOptions::default()).expect_err("refused");
        assert_eq!(e.code(), "ledger_corrupt", "byte {byte}: {e}");
        let estop_ledger::LedgerError::Corrupt { file, offset, .. } = &e else {
            unreachable!()
        };
        assert_eq!((file.as_str(), *offset), (SEG1, start), "byte {byte}: {e}");
        assert!(e.to_string().contains(SEG1) && e.to_string().contains(&format!("byte {start}")));
        assert_eq!(m.files(), bad, "a refused open changes nothing");
        let v = verify(&*s);
        assert_eq!(v.error.map(|e| e.code()), Some("ledger_corrupt"));
        assert_eq!(v.records, 2);
    }
}

#[test]
fn a_flipped_bit_in_the_last_record_is_treated_as_torn() {
    let (files, offsets) = five_records(5);
    let (start, end) = (offsets[4], files[SEG1].len() as u64);
    for byte in start..end {
        let (_, s) = storage_with(&flip(&files, SEG1, byte as usize));
        let o = open_ok(&s, LedgerOptions::default());
        assert_eq!(o.records.len(), 4, "byte {byte}");
        assert_eq!(o.report.torn_tail.expect("torn").offset, start);
    }
}

#[test]
fn a_bad_segment_header_refuses_to_open() {
    let (files, _) = five_records(3);
    for byte in 0..SEGMENT_HEADER_BYTES {
        let (_, s) = storage_with(&flip(&files, SEG1, byte));
        let e = open(&s, LedgerOptions::default()).expect_err("refused");
        assert_eq!(e.code(), "ledger_corrupt", "byte {byte}");
        let estop_ledger::LedgerError::Corrupt { file, offset, .. } = &e else {
            unreachable!()
        };
        assert_eq!((file.as_str(), *offset), (SEG1, 0));
    }
    // A header from a newer format version is its own error.
    let mut files = files.clone();
    let seg = files.get_mut(SEG1).expect("seg");
    seg[8..12].copy_from_slice(&2u32.to_le_bytes());
    let crc = crc32c::crc32c(&seg[0..28]);
    seg[28..32].copy_from_slice(&crc.to_le_bytes());
    let (_, s) = storage_with(&files);
    let e = open(&s, LedgerOptions::default()).expect_err("refused");
    assert_eq!(e.code(), "ledger_unsupported_version");
}

fn segment(first: u64, seqs: &[u64]) -> Vec<u8> {
    let mut v = format::encode_segment_header(first).to_vec();
    for &s in seqs {
        let p = payload(s);
        format::append_record(&mut v, s, &p, crc32c::crc32c(&p));
    }
    v
}

#[test]
fn seq_gaps_and_missing_segments_refuse_to_open() {
    // (what, segments as (first_seq, record seqs), the file named, index of the bad record)
    type Case = (&'static str, Vec<(u64, Vec<u64>)>, &'static str, u64);
    let cases: Vec<Case> = vec![
        (
            "gap inside a segment",
            vec![(1, vec![1, 2, 4])],
            "seg-00000000000000000001.log",
            2,
        ),
        (
            "first seq does not match",
            vec![(1, vec![2, 3])],
            "seg-00000000000000000001.log",
            0,
        ),
        (
            "segment missing in the middle",
            vec![(1, vec![1, 2]), (5, vec![5, 6])],
            "seg-00000000000000000001.log",
            2,
        ),
        (
            "log does not start at 1",
            vec![(3, vec![3, 4])],
            "seg-00000000000000000003.log",
            0,
        ),
    ];
    for (what, segs, bad_file, bad_record) in cases {
        let mut files = BTreeMap::new();
        let mut offsets = Vec::new();
        for (first, seqs) in &segs {
            let bytes = segment(*first, seqs);
            if format::segment_name(*first) == bad_file {
                let mut at = SEGMENT_HEADER_BYTES as u64;
                for s in seqs {
                    offsets.push(at);
                    at += 16 + payload(*s).len() as u64;
                }
                offsets.push(at);
            }
            files.insert(format::segment_name(*first), bytes);
        }
        let (_, s) = storage_with(&files);
        let e = open(&s, LedgerOptions::default()).expect_err(what);
        let estop_ledger::LedgerError::Corrupt { file, offset, .. } = &e else {
            panic!("{what}: {e}")
        };
        let want = if what == "log does not start at 1" {
            0
        } else {
            offsets[bad_record as usize]
        };
        assert_eq!((file.as_str(), *offset), (bad_file, want), "{what}: {e}");
    }
}

#[test]
fn damage_in_a_segment_that_is_not_the_last_refuses_to_open() {
    let (m, s) = mem();
    let c = open_ok(&s, small()).ledger.spawn(|_| {}).expect("spawn");
    for i in 1..=60 {
        append_n(&c, i, 1);
    }
    drop(c);
    let pos = positions(&*s);
    let first_seg = pos[0].0.clone();
    let last_in_first = pos.iter().rfind(|p| p.0 == first_seg).expect("one").clone();
    assert_ne!(pos.last().expect("one").0, first_seg, "several segments");
    let files = m.files();
    // Its last record torn off.
    let mut cut = files.clone();
    cut.get_mut(&first_seg)
        .expect("seg")
        .truncate(last_in_first.1 as usize + 5);
    let (_, s2) = storage_with(&cut);
    let e = open(&s2, small()).expect_err("refused");
    assert_eq!(e.code(), "ledger_corrupt");
    assert!(
        e.to_string().contains(&first_seg)
            && e.to_string().contains(&format!("byte {}", last_in_first.1)),
        "{e}"
    );
    // Its last record cleanly removed: the next segment no longer follows.
    let mut cut = files.clone();
    cut.get_mut(&first_seg)
        .expect("seg")
        .truncate(last_in_first.1 as usize);
    let (_, s3) = storage_with(&cut);
    let e = open(&s3, small()).expect_err("refused");
    assert!(e.to_string().contains("next segment starts"), "{e}");
}

#[test]
fn garbage_after_a_bad_record_is_torn_but_a_later_valid_record_is_not() {
    let (files, offsets) = five_records(5);
    // Record 5's header damaged, and a valid copy of record 5 placed after it: corruption.
    let mut f = files.clone();
    let seg = f.get_mut(SEG1).expect("seg");
    let rec5 = seg[offsets[4] as usize..].to_vec();
    seg[offsets[4] as usize] ^= 0x40;
    seg.extend_from_slice(&rec5);
    let (_, s) = storage_with(&f);
    let e = open(&s, LedgerOptions::default()).expect_err("refused");
    assert!(e.to_string().contains("followed by a valid record"), "{e}");
}

#[test]
fn every_other_refusal_names_its_reason() {
    let snap = |seq: u64, state: &[u8]| {
        let mut v = format::encode_snapshot_header(seq, state).to_vec();
        v.extend_from_slice(state);
        v
    };
    // (what, files, a phrase the error must contain)
    type Case = (&'static str, Vec<(String, Vec<u8>)>, &'static str);
    let cases: Vec<Case> = vec![
        (
            "header disagrees with the name",
            vec![(format::segment_name(1), segment(2, &[]))],
            "the file name says 1",
        ),
        (
            "segment at seq 0",
            vec![(format::segment_name(0), segment(0, &[]))],
            "seq 0",
        ),
        (
            "log ends before the snapshot",
            vec![
                (format::segment_name(1), segment(1, &[1, 2])),
                (format::snapshot_name(5), snap(5, b"s")),
            ],
            "before the snapshot's seq 5",
        ),
    ];
    for (what, files, needle) in cases {
        let (_, s) = storage_with(&files.into_iter().collect());
        let e = open(&s, LedgerOptions::default()).expect_err(what);
        assert_eq!(e.code(), "ledger_corrupt", "{what}: {e}");
        assert!(e.to_string().contains(needle), "{what}: {e}");
        assert_eq!(
            verify(&*s).error.map(|e| e.code()),
            Some("ledger_corrupt"),
            "{what}"
        );
    }
}
