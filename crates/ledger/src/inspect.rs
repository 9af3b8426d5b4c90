//! Read-only inspection for `estop ledger verify` and `estop ledger show`: walks the same way as
//! recovery but never truncates, removes or creates anything.

use crate::error::LedgerError;
use crate::scan::{self, SegmentSummary, Superseded, TornTail, Walk};
use crate::snapshot::{self, InvalidFile, SnapshotInfo};
use crate::storage::Storage;

/// One record as it sits on disk.
#[derive(Debug, Clone, Copy)]
pub struct RecordView<'a> {
    pub segment: &'a str,
    /// Byte offset of the record header in the segment file.
    pub offset: u64,
    pub seq: u64,
    pub payload: &'a [u8],
}

/// What `verify`/`inspect` found. `error` is the reason a writer would refuse to open.
#[derive(Debug, Clone, Default)]
pub struct VerifyReport {
    /// Segments read, in order (up to the one with the error, if any).
    pub segments: Vec<SegmentSummary>,
    /// Live records read.
    pub records: u64,
    pub first_seq: Option<u64>,
    /// Last seq of the state a recovery would build (snapshot or log).
    pub last_seq: u64,
    /// The snapshot a recovery would use.
    pub snapshot: Option<SnapshotInfo>,
    pub snapshots_invalid: Vec<InvalidFile>,
    /// A torn write a recovery would truncate.
    pub torn_tail: Option<TornTail>,
    pub superseded: Vec<Superseded>,
    /// `*.tmp` files a recovery would remove.
    pub leftover_files: Vec<String>,
    /// Corruption (naming the file and offset) or an IO error.
    pub error: Option<LedgerError>,
}

impl VerifyReport {
    /// True if a writer would open this ledger (a torn tail is fine: it is truncated).
    pub fn is_ok(&self) -> bool {
        self.error.is_none()
    }
}

/// Checks the whole ledger (every segment, every snapshot) without changing anything.
pub fn verify(storage: &dyn Storage) -> VerifyReport {
    inspect(storage, |_| {})
}

/// Like `verify`, and hands every live record, in seq order, to `on_record`.
pub fn inspect(storage: &dyn Storage, mut on_record: impl FnMut(RecordView<'_>)) -> VerifyReport {
    let mut report = VerifyReport::default();
    if let Err(e) = inspect_into(storage, &mut report, None, &mut on_record) {
        report.error = Some(e);
    }
    report
}

/// Like `inspect`, and first hands the snapshot a recovery would use to `on_snapshot(seq,
/// payload)`: the state a recovery would build, read without a lock and without changing
/// anything (a reader beside a live writer: a torn tail is reported, not an error).
pub fn inspect_state(
    storage: &dyn Storage,
    mut on_snapshot: impl FnMut(u64, &[u8]),
    mut on_record: impl FnMut(RecordView<'_>),
) -> VerifyReport {
    let mut report = VerifyReport::default();
    if let Err(e) = inspect_into(storage, &mut report, Some(&mut on_snapshot), &mut on_record) {
        report.error = Some(e);
    }
    report
}

/// Where `inspect_state` hands the snapshot: `(seq, payload)`.
type OnSnapshot<'a> = dyn FnMut(u64, &[u8]) + 'a;

fn inspect_into(
    storage: &dyn Storage,
    report: &mut VerifyReport,
    // `Some`: only the state (the snapshot, then the records it does not cover); `None`: every
    // record of every segment (verify).
    on_snapshot: Option<&mut OnSnapshot<'_>>,
    on_record: &mut dyn FnMut(RecordView<'_>),
) -> Result<(), LedgerError> {
    let listing = scan::list(storage)?;
    report.leftover_files = listing.tmp.clone();
    let (chosen, invalid) =
        snapshot::newest_valid(storage, &listing.snapshots, u64::MAX, u64::MAX)?;
    report.snapshots_invalid = invalid;
    let state = on_snapshot.is_some();
    if let (Some(f), Some((info, payload))) = (on_snapshot, &chosen) {
        f(info.seq, payload);
    }
    report.snapshot = chosen.map(|(info, _)| info);
    let snapshot_seq = report.snapshot.as_ref().map_or(0, |s| s.seq);
    report.last_seq = snapshot_seq;
    let walk = Walk {
        storage,
        segments: &listing.segments,
        snapshot_seq,
        limit: u64::MAX,
        skip_covered: state,
        deliver_from: if state { snapshot_seq + 1 } else { 0 },
        batch_bytes_max: crate::LedgerOptions::default().buffer_bytes_max as u64,
    };
    let mut count = 0u64;
    let mut first = None;
    let mut last = snapshot_seq;
    let result = walk.run(|segment, offset, seq, payload| {
        count += 1;
        first.get_or_insert(seq);
        last = last.max(seq);
        on_record(RecordView {
            segment,
            offset,
            seq,
            payload,
        });
        Ok(())
    });
    report.records = count;
    report.first_seq = first;
    report.last_seq = last;
    let out = result?;
    report.segments = out.segments;
    report.torn_tail = out.torn_tail;
    report.superseded = out.superseded;
    report.last_seq = out.last_seq;
    Ok(())
}
