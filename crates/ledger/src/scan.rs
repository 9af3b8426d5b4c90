//! Reading the log: a chunked segment reader and the walk over all segments that applies the
//! supersede rule and tells a torn tail from mid-log corruption. Shared by recovery (`open`) and
//! inspection (`verify`/`inspect`); it never modifies anything.

use crate::error::LedgerError;
use crate::format::{self, HeaderError, RECORD_HEADER_BYTES, SEGMENT_HEADER_BYTES};
use crate::storage::{self, Storage};

/// Bytes read per `read_at` call while scanning.
const READ_CHUNK_BYTES: usize = 4 << 20;

/// A file of the directory with the seq in its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Named {
    pub name: String,
    pub seq: u64,
}

/// The ledger's files, classified by name.
#[derive(Debug, Default)]
pub(crate) struct Listing {
    /// Segments by ascending `first_seq`.
    pub segments: Vec<Named>,
    /// Snapshots by descending seq.
    pub snapshots: Vec<Named>,
    /// `*.tmp` leftovers.
    pub tmp: Vec<String>,
}

pub(crate) fn list(storage: &dyn Storage) -> Result<Listing, LedgerError> {
    let names = storage
        .list()
        .map_err(|e| LedgerError::io("list", "ledger directory", e))?;
    let mut l = Listing::default();
    for name in names {
        if let Some(seq) = format::parse_segment_name(&name) {
            l.segments.push(Named { name, seq });
        } else if let Some(seq) = format::parse_snapshot_name(&name) {
            l.snapshots.push(Named { name, seq });
        } else if name.ends_with(format::TMP_SUFFIX)
            && (name.starts_with("seg-") || name.starts_with("snap-"))
        {
            l.tmp.push(name);
        }
    }
    l.segments.sort_by_key(|n| n.seq);
    l.snapshots.sort_by_key(|n| std::cmp::Reverse(n.seq));
    Ok(l)
}

/// One step of a segment reader.
pub(crate) enum Next<'a> {
    Record {
        offset: u64,
        seq: u64,
        payload: &'a [u8],
    },
    /// Clean end of file, exactly after a record.
    End,
    /// Clean end of the records: a record header of 16 zero bytes at `offset`, and only zeros
    /// after it up to the end of the file (preallocation).
    ZeroTail { offset: u64 },
    /// An incomplete or checksum-failing record at `offset`.
    Bad { offset: u64, reason: &'static str },
}

/// Reads one segment sequentially in large chunks; no allocation per record.
pub(crate) struct SegmentReader<'s> {
    storage: &'s dyn Storage,
    name: &'s str,
    file_len: u64,
    buf: Vec<u8>,
    /// File offset of `buf[0]`.
    buf_offset: u64,
    pos: usize,
    end: usize,
}

impl<'s> SegmentReader<'s> {
    pub fn new(storage: &'s dyn Storage, name: &'s str) -> Result<SegmentReader<'s>, LedgerError> {
        let file_len = storage
            .file_len(name)
            .map_err(|e| LedgerError::io("stat", name, e))?;
        let cap = usize::try_from(file_len)
            .unwrap_or(usize::MAX)
            .min(READ_CHUNK_BYTES);
        Ok(SegmentReader {
            storage,
            name,
            file_len,
            buf: vec![0; cap],
            buf_offset: 0,
            pos: 0,
            end: 0,
        })
    }

    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// File offset of the next unread byte.
    pub fn offset(&self) -> u64 {
        self.buf_offset + self.pos as u64
    }

    /// Makes at least `need` bytes available at `pos` if the file has them; returns how many are.
    fn fill(&mut self, need: usize) -> Result<usize, LedgerError> {
        let avail = self.end - self.pos;
        if avail >= need {
            return Ok(avail);
        }
        self.buf.copy_within(self.pos..self.end, 0);
        self.buf_offset += self.pos as u64;
        self.pos = 0;
        self.end = avail;
        let file_left = usize::try_from(self.file_len - self.buf_offset).unwrap_or(usize::MAX);
        let want = need.max(READ_CHUNK_BYTES).min(file_left);
        if self.buf.len() < want {
            self.buf.resize(want, 0);
        }
        let limit = self.buf.len().min(file_left);
        while self.end < limit {
            let at = self.buf_offset + self.end as u64;
            let n = self
                .storage
                .read_at(self.name, at, &mut self.buf[self.end..limit])
                .map_err(|e| LedgerError::io("read", self.name, e))?;
            if n == 0 {
                break; // The file shrank under us; what we have is all there is.
            }
            self.end += n;
        }
        Ok(self.end - self.pos)
    }

    /// Reads and checks the segment header; returns its `first_seq`.
    pub fn header(&mut self) -> Result<u64, LedgerError> {
        assert_eq!(self.offset(), 0, "the header is read first");
        if self.fill(SEGMENT_HEADER_BYTES)? < SEGMENT_HEADER_BYTES {
            return Err(LedgerError::corrupt(
                self.name,
                0,
                "segment header is incomplete",
            ));
        }
        let h = &self.buf[self.pos..self.pos + SEGMENT_HEADER_BYTES];
        let first = format::decode_segment_header(h).map_err(|e| match e {
            HeaderError::Bad(reason) => LedgerError::corrupt(self.name, 0, reason),
            HeaderError::Version(version) => LedgerError::UnsupportedVersion {
                file: self.name.to_owned(),
                version,
                supported: format::FORMAT_VERSION,
            },
        })?;
        self.pos += SEGMENT_HEADER_BYTES;
        Ok(first)
    }

    /// Reads to the end of the file; true if every byte from here on is zero (or there is none).
    pub fn rest_is_zero(&mut self) -> Result<bool, LedgerError> {
        loop {
            if self.pos == self.end && self.fill(1)? == 0 {
                return Ok(true);
            }
            if self.buf[self.pos..self.end].iter().any(|b| *b != 0) {
                return Ok(false);
            }
            self.pos = self.end;
        }
    }

    /// The next record.
    pub fn next_record(&mut self) -> Result<Next<'_>, LedgerError> {
        let offset = self.offset();
        let avail = self.fill(RECORD_HEADER_BYTES)?;
        if avail == 0 {
            return Ok(Next::End);
        }
        if avail < RECORD_HEADER_BYTES {
            return Ok(Next::Bad {
                offset,
                reason: "incomplete record header",
            });
        }
        let header = &self.buf[self.pos..self.pos + RECORD_HEADER_BYTES];
        if header.iter().all(|b| *b == 0) {
            // Never a record (no record has seq 0): the preallocated end, or a hole.
            self.pos += RECORD_HEADER_BYTES;
            return Ok(if self.rest_is_zero()? {
                Next::ZeroTail { offset }
            } else {
                Next::Bad {
                    offset,
                    reason: "zero record header followed by non-zero bytes",
                }
            });
        }
        let h = format::decode_record_header(header);
        let len = h.len as usize;
        let file_left = self.file_len - offset - RECORD_HEADER_BYTES as u64;
        if h.len as u64 > file_left || len > format::RECORD_PAYLOAD_BYTES_LIMIT {
            return Ok(Next::Bad {
                offset,
                reason: "record runs past the end of the file",
            });
        }
        let total = RECORD_HEADER_BYTES + len;
        if self.fill(total)? < total {
            return Ok(Next::Bad {
                offset,
                reason: "record runs past the end of the file",
            });
        }
        let start = self.pos + RECORD_HEADER_BYTES;
        if !format::record_ok(&h, &self.buf[start..start + len]) {
            return Ok(Next::Bad {
                offset,
                reason: "record checksum mismatch",
            });
        }
        self.pos += total;
        Ok(Next::Record {
            offset,
            seq: h.seq,
            payload: &self.buf[start..start + len],
        })
    }
}

/// Looks for a valid record of seq `>= min_seq` anywhere after `from` in `name`: if there is
/// one, the bad record at `from` is not a torn tail but corruption. Returns (offset, seq).
fn find_valid_after(
    storage: &dyn Storage,
    name: &str,
    from: u64,
    min_seq: u64,
) -> Result<Option<(u64, u64)>, LedgerError> {
    let data = storage::read_file(storage, name).map_err(|e| LedgerError::io("read", name, e))?;
    let start = usize::try_from(from)
        .unwrap_or(usize::MAX)
        .saturating_add(1);
    if data.len() < RECORD_HEADER_BYTES || start > data.len() - RECORD_HEADER_BYTES {
        return Ok(None);
    }
    // A later record of this segment cannot have a seq beyond one per 16 bytes of what follows.
    let max_seq = min_seq.saturating_add((data.len() / RECORD_HEADER_BYTES) as u64);
    for i in start..=data.len() - RECORD_HEADER_BYTES {
        let h = format::decode_record_header(&data[i..i + RECORD_HEADER_BYTES]);
        if h.seq < min_seq || h.seq > max_seq {
            continue;
        }
        let len = h.len as usize;
        if len > data.len() - i - RECORD_HEADER_BYTES {
            continue;
        }
        let p = i + RECORD_HEADER_BYTES;
        if format::record_ok(&h, &data[p..p + len]) {
            return Ok(Some((i as u64, h.seq)));
        }
    }
    Ok(None)
}

/// Size of the sectors a disk writes atomically (the unit in which a power loss can leave some
/// of an unsynced write persisted and some not).
pub(crate) const SECTOR_BYTES: usize = 512;

/// Whether the bad record at `from`, followed by a valid one at `valid_at`, is what a power loss
/// leaves of the last batch when its sectors were persisted out of order: an aligned sector
/// between them (from `from` on, for the first one) holds only zeros — it was never written
/// (preallocated zeros, or past the old end of the file) — and every non-zero byte of the file
/// from `from` on fits in one batch
/// (`batch_bytes_max`). A batch is written only after the one before it was synced, so bytes
/// after such a hole belong to the batch whose sync never returned: none was acknowledged.
fn unsynced_batch_hole(
    storage: &dyn Storage,
    name: &str,
    from: u64,
    valid_at: u64,
    batch_bytes_max: u64,
) -> Result<bool, LedgerError> {
    let data = storage::read_file(storage, name).map_err(|e| LedgerError::io("read", name, e))?;
    let (from, valid_at) = (from as usize, (valid_at as usize).min(data.len()));
    let Some(last_nonzero) = data.iter().rposition(|&b| b != 0) else {
        return Ok(false);
    };
    if (last_nonzero.saturating_sub(from) as u64) >= batch_bytes_max {
        return Ok(false);
    }
    // The batch starts at `from`, maybe inside a sector it shares with the last synced record:
    // that sector counts from `from` on (its start is durable data).
    let first_sector = from / SECTOR_BYTES * SECTOR_BYTES;
    Ok((first_sector..valid_at)
        .step_by(SECTOR_BYTES)
        .take_while(|s| s + SECTOR_BYTES <= valid_at)
        .any(|s| data[s.max(from)..s + SECTOR_BYTES].iter().all(|&b| b == 0)))
}

/// A torn write at the end of the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornTail {
    /// Segment file name.
    pub segment: String,
    /// Byte offset of the first bad record; the file is (or, by `open`, was) cut here.
    pub offset: u64,
    /// Bytes from `offset` to the end of the file.
    pub bytes_dropped: u64,
    /// What was wrong with the record at `offset`.
    pub reason: &'static str,
}

/// Bytes after the live records of a segment, ignored by the supersede rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superseded {
    pub segment: String,
    pub offset: u64,
    pub bytes: u64,
}

/// Zeros after the last live record of a segment: what preallocation wrote ahead of the write
/// position (a record header of 16 zero bytes, then only zeros to the end of the file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preallocated {
    pub segment: String,
    /// Where the records end and the zeros begin.
    pub offset: u64,
    pub bytes: u64,
}

/// What the walk saw in one segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentSummary {
    pub name: String,
    pub first_seq: u64,
    /// Live records read.
    pub records: u64,
    /// Seq of the last live record, if any.
    pub last_seq: Option<u64>,
    /// File length in bytes.
    pub bytes: u64,
    /// Preallocated zeros after the last live record (neither torn nor superseded); the records
    /// end at `bytes - preallocated_bytes`.
    pub preallocated_bytes: u64,
}

/// How to walk.
pub(crate) struct Walk<'a> {
    pub storage: &'a dyn Storage,
    pub segments: &'a [Named],
    /// Seq covered by the chosen snapshot (0 if none).
    pub snapshot_seq: u64,
    /// Records with seq greater than this are superseded (`discard_after`), or `u64::MAX`.
    pub limit: u64,
    /// Skip segments whose live records are all covered by the snapshot (recovery) or read
    /// everything (verify).
    pub skip_covered: bool,
    /// Records with seq `>= deliver_from` go to the callback.
    pub deliver_from: u64,
    /// The largest batch the writer could have had in flight (`buffer_bytes_max`): a hole in
    /// the last segment's final batch is a torn tail only within this many bytes of its end.
    pub batch_bytes_max: u64,
}

#[derive(Debug, Default)]
pub(crate) struct WalkOutcome {
    /// Highest seq whose state is known (snapshot or log); appends continue after it.
    pub last_seq: u64,
    pub first_record_seq: Option<u64>,
    pub records_read: u64,
    pub records_delivered: u64,
    pub segments: Vec<SegmentSummary>,
    pub torn_tail: Option<TornTail>,
    pub superseded: Vec<Superseded>,
    /// Name of the last segment that holds live records or could (the one `open` syncs).
    pub last_live_segment: Option<String>,
}

impl Walk<'_> {
    /// Walks the log in seq order, calling `on_record(segment, offset, seq, payload)`.
    pub fn run(
        &self,
        mut on_record: impl FnMut(&str, u64, u64, &[u8]) -> Result<(), LedgerError>,
    ) -> Result<WalkOutcome, LedgerError> {
        let mut out = WalkOutcome {
            last_seq: self.snapshot_seq,
            ..WalkOutcome::default()
        };
        // The next seq the log must contain, once a segment has been read.
        let mut expected: Option<u64> = None;
        for (i, seg) in self.segments.iter().enumerate() {
            if seg.seq == 0 {
                return Err(LedgerError::corrupt(
                    &seg.name,
                    0,
                    "a segment cannot start at seq 0",
                ));
            }
            if seg.seq > self.limit {
                // Wholly after discard_after: superseded, never read.
                break;
            }
            let next_first = self.segments.get(i + 1).map(|s| s.seq);
            let end = next_first.map_or(u64::MAX, |f| f - 1).min(self.limit);
            let open_ended = end == u64::MAX;
            if self.skip_covered && !open_ended && end <= self.snapshot_seq {
                continue;
            }
            match expected {
                Some(e) => assert_eq!(e, seg.seq, "the previous segment was read to its end"),
                None if seg.seq > self.snapshot_seq + 1 => {
                    return Err(LedgerError::corrupt(
                        &seg.name,
                        0,
                        format!(
                            "records {}..{} are missing: no snapshot covers them and no segment holds them",
                            self.snapshot_seq + 1,
                            seg.seq - 1
                        ),
                    ));
                }
                None => {}
            }
            let mut next = seg.seq;
            let mut reader = SegmentReader::new(self.storage, &seg.name)?;
            let first = reader.header()?;
            if first != seg.seq {
                return Err(LedgerError::corrupt(
                    &seg.name,
                    0,
                    format!(
                        "segment header says first seq {first}, the file name says {}",
                        seg.seq
                    ),
                ));
            }
            let mut summary = SegmentSummary {
                name: seg.name.clone(),
                first_seq: seg.seq,
                records: 0,
                last_seq: None,
                bytes: reader.file_len(),
                preallocated_bytes: 0,
            };
            loop {
                if next > end {
                    let offset = reader.offset();
                    let rest = reader.file_len() - offset;
                    if rest >= RECORD_HEADER_BYTES as u64 && reader.rest_is_zero()? {
                        summary.preallocated_bytes = rest;
                    } else if rest > 0 {
                        out.superseded.push(Superseded {
                            segment: seg.name.clone(),
                            offset,
                            bytes: rest,
                        });
                    }
                    break;
                }
                match reader.next_record()? {
                    Next::Record {
                        offset,
                        seq,
                        payload,
                    } => {
                        if seq != next {
                            return Err(LedgerError::corrupt(
                                &seg.name,
                                offset,
                                format!("expected seq {next}, found seq {seq}"),
                            ));
                        }
                        if seq >= self.deliver_from {
                            on_record(&seg.name, offset, seq, payload)?;
                            out.records_delivered += 1;
                        }
                        out.records_read += 1;
                        out.first_record_seq.get_or_insert(seq);
                        summary.records += 1;
                        summary.last_seq = Some(seq);
                        next += 1;
                    }
                    Next::End if open_ended => break,
                    Next::ZeroTail { offset } if open_ended => {
                        summary.preallocated_bytes = reader.file_len() - offset;
                        break;
                    }
                    ended @ (Next::End | Next::ZeroTail { .. }) => {
                        let (offset, zeros) = match ended {
                            Next::ZeroTail { offset } => (offset, " (zeros follow)"),
                            _ => (reader.offset(), ""),
                        };
                        let why = if next_first.is_some_and(|f| f - 1 == end) {
                            format!(
                                "segment ends at seq {}{zeros}, but the next segment starts at {}",
                                next - 1,
                                end + 1
                            )
                        } else {
                            format!(
                                "log ends at seq {}{zeros}, but discard_after = {end} says it was durable",
                                next - 1
                            )
                        };
                        return Err(LedgerError::corrupt(&seg.name, offset, why));
                    }
                    Next::Bad { offset, mut reason } if open_ended => {
                        if let Some((o, s)) =
                            find_valid_after(self.storage, &seg.name, offset, next)?
                        {
                            if !unsynced_batch_hole(
                                self.storage,
                                &seg.name,
                                offset,
                                o,
                                self.batch_bytes_max,
                            )? {
                                return Err(LedgerError::corrupt(
                                    &seg.name,
                                    offset,
                                    format!(
                                        "{reason} (expected seq {next}), followed by a valid record (seq {s} at byte {o})"
                                    ),
                                ));
                            }
                            reason = "a batch torn by a power loss: a sector of it was never written (a hole before later records of the same, unacknowledged batch)";
                        }
                        out.torn_tail = Some(TornTail {
                            segment: seg.name.clone(),
                            offset,
                            bytes_dropped: reader.file_len() - offset,
                            reason,
                        });
                        break;
                    }
                    Next::Bad { offset, reason } => {
                        return Err(LedgerError::corrupt(
                            &seg.name,
                            offset,
                            format!(
                                "{reason} (expected seq {next}, which must exist: it is before seq {})",
                                end + 1
                            ),
                        ));
                    }
                }
            }
            expected = Some(next);
            out.last_seq = next - 1;
            out.last_live_segment = Some(seg.name.clone());
            out.segments.push(summary);
        }
        if out.last_seq < self.snapshot_seq {
            let file = out.last_live_segment.clone().unwrap_or_default();
            return Err(LedgerError::corrupt(
                &file,
                0,
                format!(
                    "the log ends at seq {}, before the snapshot's seq {}",
                    out.last_seq, self.snapshot_seq
                ),
            ));
        }
        if self.limit != u64::MAX && out.last_seq < self.limit {
            let file = out.last_live_segment.clone().unwrap_or_default();
            return Err(LedgerError::corrupt(
                &file,
                0,
                format!(
                    "the log ends at seq {}, but discard_after = {} says records up to it were durable",
                    out.last_seq, self.limit
                ),
            ));
        }
        Ok(out)
    }
}
