//! Helpers shared by the tests: open-and-collect, payload generators, file surgery.

use std::sync::Arc;

use estop_ledger::{
    Ledger, LedgerError, LedgerOptions, MemStorage, RecoveryReport, Storage, inspect,
};

/// Everything one `Ledger::open` handed out.
#[derive(Debug)]
pub struct Opened {
    pub ledger: Ledger,
    pub report: RecoveryReport,
    pub snapshot: Option<(u64, Vec<u8>)>,
    pub records: Vec<(u64, Vec<u8>)>,
}

pub fn open(storage: &Arc<dyn Storage>, options: LedgerOptions) -> Result<Opened, LedgerError> {
    let mut snapshot = None;
    let mut records = Vec::new();
    let rec = Ledger::open(
        storage.clone(),
        options,
        |seq, bytes| {
            snapshot = Some((seq, bytes.to_vec()));
            Ok::<(), String>(())
        },
        |seq, payload| {
            records.push((seq, payload.to_vec()));
            Ok(())
        },
    )?;
    Ok(Opened {
        ledger: rec.ledger,
        report: rec.report,
        snapshot,
        records,
    })
}

pub fn open_ok(storage: &Arc<dyn Storage>, options: LedgerOptions) -> Opened {
    match open(storage, options) {
        Ok(o) => o,
        Err(e) => panic!("open failed: {e}"),
    }
}

pub fn mem() -> (MemStorage, Arc<dyn Storage>) {
    let m = MemStorage::new();
    let s: Arc<dyn Storage> = Arc::new(m.clone());
    (m, s)
}

/// A payload of varying length that names its index.
pub fn payload(i: u64) -> Vec<u8> {
    let mut p = format!("record {i}:").into_bytes();
    p.extend(std::iter::repeat_n(
        b'a' + (i % 26) as u8,
        (i % 37) as usize,
    ));
    p
}

/// Small limits so that tests roll segments often.
pub fn small() -> LedgerOptions {
    LedgerOptions {
        record_bytes_max: 100,
        segment_bytes_max: 512,
        buffer_bytes_max: 4096,
        ..LedgerOptions::default()
    }
}

/// (segment, offset, seq) of every live record.
pub fn positions(storage: &dyn Storage) -> Vec<(String, u64, u64)> {
    let mut v = Vec::new();
    let report = inspect(storage, |r| v.push((r.segment.to_owned(), r.offset, r.seq)));
    assert!(report.is_ok(), "{:?}", report.error);
    v
}

/// Appends `n` payloads `payload(first..first+n)` and waits until they are durable.
pub fn append_n(c: &estop_ledger::Committer, first: u64, n: u64) {
    for i in first..first + n {
        let seq = c.append(&payload(i)).expect("append");
        assert_eq!(seq, i);
    }
    assert_eq!(c.flush().expect("flush"), first + n - 1);
}

pub fn segment_names(m: &MemStorage) -> Vec<String> {
    m.files()
        .into_keys()
        .filter(|n| n.starts_with("seg-"))
        .collect()
}

/// Like `append_n`, flushing every `batch` records (so small segments roll and the buffer stays
/// under its bound).
pub fn append_batched(c: &estop_ledger::Committer, first: u64, n: u64, batch: u64) {
    let mut i = first;
    while i < first + n {
        let k = batch.min(first + n - i);
        append_n(c, i, k);
        i += k;
    }
}
