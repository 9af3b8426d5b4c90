//! The byte format of segment and snapshot files (headers, record framing, file names).
//! docs/LEDGER.md is the specification; this file must match it byte for byte.

/// Magic bytes at the start of every segment file.
pub const SEGMENT_MAGIC: [u8; 8] = *b"ESTOPSEG";
/// Magic bytes at the start of every snapshot file.
pub const SNAPSHOT_MAGIC: [u8; 8] = *b"ESTOPSNP";
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Size of the segment header.
pub const SEGMENT_HEADER_BYTES: usize = 32;
/// Size of the header in front of every record's payload.
pub const RECORD_HEADER_BYTES: usize = 16;
/// Size of the snapshot header.
pub const SNAPSHOT_HEADER_BYTES: usize = 40;
/// Largest payload the format allows (`record_bytes_max` may not exceed it).
pub const RECORD_PAYLOAD_BYTES_LIMIT: usize = 1 << 30;

/// Suffix of a file that is being written and is not part of the ledger yet.
pub const TMP_SUFFIX: &str = ".tmp";

const SEG_PREFIX: &str = "seg-";
const SEG_SUFFIX: &str = ".log";
const SNAP_PREFIX: &str = "snap-";
const SNAP_SUFFIX: &str = ".snap";
const SEQ_DIGITS: usize = 20;

/// `seg-<first_seq, 20 digits>.log`
pub fn segment_name(first_seq: u64) -> String {
    format!("{SEG_PREFIX}{first_seq:020}{SEG_SUFFIX}")
}

/// `snap-<seq, 20 digits>.snap`
pub fn snapshot_name(seq: u64) -> String {
    format!("{SNAP_PREFIX}{seq:020}{SNAP_SUFFIX}")
}

/// The first seq of a segment file name, or `None` if `name` is not a segment name.
pub fn parse_segment_name(name: &str) -> Option<u64> {
    parse_seq_name(name, SEG_PREFIX, SEG_SUFFIX)
}

/// The seq of a snapshot file name, or `None` if `name` is not a snapshot name.
pub fn parse_snapshot_name(name: &str) -> Option<u64> {
    parse_seq_name(name, SNAP_PREFIX, SNAP_SUFFIX)
}

fn parse_seq_name(name: &str, prefix: &str, suffix: &str) -> Option<u64> {
    let digits = name.strip_prefix(prefix)?.strip_suffix(suffix)?;
    if digits.len() != SEQ_DIGITS || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(b)
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(b)
}

/// Encodes a segment header.
pub fn encode_segment_header(first_seq: u64) -> [u8; SEGMENT_HEADER_BYTES] {
    let mut h = [0u8; SEGMENT_HEADER_BYTES];
    h[0..8].copy_from_slice(&SEGMENT_MAGIC);
    h[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h[16..24].copy_from_slice(&first_seq.to_le_bytes());
    let crc = crc32c::crc32c(&h[0..28]);
    h[28..32].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Why a header was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderError {
    /// Magic, CRC or a reserved field is wrong, or the header is cut short.
    Bad(&'static str),
    /// The header is intact but written by another format version.
    Version(u32),
}

/// Decodes a segment header and returns its `first_seq`.
pub fn decode_segment_header(h: &[u8]) -> Result<u64, HeaderError> {
    if h.len() < SEGMENT_HEADER_BYTES {
        return Err(HeaderError::Bad("segment header is incomplete"));
    }
    if h[0..8] != SEGMENT_MAGIC {
        return Err(HeaderError::Bad("segment header has the wrong magic"));
    }
    if crc32c::crc32c(&h[0..28]) != u32_at(h, 28) {
        return Err(HeaderError::Bad("segment header checksum mismatch"));
    }
    let version = u32_at(h, 8);
    if version != FORMAT_VERSION {
        return Err(HeaderError::Version(version));
    }
    if u32_at(h, 12) != 0 || u32_at(h, 24) != 0 {
        return Err(HeaderError::Bad(
            "segment header has non-zero reserved fields",
        ));
    }
    Ok(u64_at(h, 16))
}

/// The record CRC: CRC-32C of the payload, continued over `len ‖ seq` (little-endian).
/// `payload_crc` is `crc32c(payload)`, computed by the caller so it can happen outside a lock.
#[inline]
pub fn record_crc(payload_crc: u32, len: u32, seq: u64) -> u32 {
    let mut tail = [0u8; 12];
    tail[0..4].copy_from_slice(&len.to_le_bytes());
    tail[4..12].copy_from_slice(&seq.to_le_bytes());
    crc32c::crc32c_append(payload_crc, &tail)
}

/// Appends one framed record to `buf`. `payload_crc` must be `crc32c(payload)`.
#[inline]
pub fn append_record(buf: &mut Vec<u8>, seq: u64, payload: &[u8], payload_crc: u32) {
    assert!(
        payload.len() <= RECORD_PAYLOAD_BYTES_LIMIT,
        "payload over the format limit"
    );
    debug_assert_eq!(payload_crc, crc32c::crc32c(payload));
    let len = payload.len() as u32;
    let crc = record_crc(payload_crc, len, seq);
    let mut h = [0u8; RECORD_HEADER_BYTES];
    h[0..4].copy_from_slice(&len.to_le_bytes());
    h[4..8].copy_from_slice(&crc.to_le_bytes());
    h[8..16].copy_from_slice(&seq.to_le_bytes());
    buf.extend_from_slice(&h);
    buf.extend_from_slice(payload);
}

/// The fields of a record header, not yet checked against the payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    pub len: u32,
    pub crc: u32,
    pub seq: u64,
}

/// Splits a 16-byte record header into its fields (no check).
#[inline]
pub fn decode_record_header(h: &[u8]) -> RecordHeader {
    RecordHeader {
        len: u32_at(h, 0),
        crc: u32_at(h, 4),
        seq: u64_at(h, 8),
    }
}

/// True if `payload` matches the header's CRC.
#[inline]
pub fn record_ok(h: &RecordHeader, payload: &[u8]) -> bool {
    debug_assert_eq!(h.len as usize, payload.len());
    record_crc(crc32c::crc32c(payload), h.len, h.seq) == h.crc
}

/// Encodes a snapshot header for `payload`.
pub fn encode_snapshot_header(seq: u64, payload: &[u8]) -> [u8; SNAPSHOT_HEADER_BYTES] {
    let mut h = [0u8; SNAPSHOT_HEADER_BYTES];
    h[0..8].copy_from_slice(&SNAPSHOT_MAGIC);
    h[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&crc32c::crc32c(payload).to_le_bytes());
    h[16..24].copy_from_slice(&seq.to_le_bytes());
    h[24..32].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    let crc = crc32c::crc32c(&h[0..36]);
    h[36..40].copy_from_slice(&crc.to_le_bytes());
    h
}

/// A decoded snapshot header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotHeader {
    pub seq: u64,
    pub payload_len: u64,
    pub payload_crc: u32,
}

/// Decodes a snapshot header (the payload is checked separately).
pub fn decode_snapshot_header(h: &[u8]) -> Result<SnapshotHeader, HeaderError> {
    if h.len() < SNAPSHOT_HEADER_BYTES {
        return Err(HeaderError::Bad("snapshot header is incomplete"));
    }
    if h[0..8] != SNAPSHOT_MAGIC {
        return Err(HeaderError::Bad("snapshot header has the wrong magic"));
    }
    if crc32c::crc32c(&h[0..36]) != u32_at(h, 36) {
        return Err(HeaderError::Bad("snapshot header checksum mismatch"));
    }
    let version = u32_at(h, 8);
    if version != FORMAT_VERSION {
        return Err(HeaderError::Version(version));
    }
    if u32_at(h, 32) != 0 {
        return Err(HeaderError::Bad(
            "snapshot header has non-zero reserved fields",
        ));
    }
    Ok(SnapshotHeader {
        seq: u64_at(h, 16),
        payload_len: u64_at(h, 24),
        payload_crc: u32_at(h, 12),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_sort() {
        assert_eq!(segment_name(1), "seg-00000000000000000001.log");
        assert_eq!(parse_segment_name(&segment_name(u64::MAX)), Some(u64::MAX));
        assert_eq!(parse_snapshot_name(&snapshot_name(42)), Some(42));
        assert_eq!(parse_segment_name("seg-1.log"), None);
        assert_eq!(parse_segment_name("seg-0000000000000000000x.log"), None);
        assert_eq!(parse_segment_name("seg-00000000000000000001.log.tmp"), None);
        assert!(segment_name(9) < segment_name(10));
    }

    #[test]
    fn headers_round_trip_and_detect_flips() {
        let h = encode_segment_header(77);
        assert_eq!(decode_segment_header(&h), Ok(77));
        for bit in 0..SEGMENT_HEADER_BYTES * 8 {
            let mut bad = h;
            bad[bit / 8] ^= 1 << (bit % 8);
            assert!(decode_segment_header(&bad).is_err(), "bit {bit}");
        }
        let s = encode_snapshot_header(5, b"state");
        let d = decode_snapshot_header(&s).expect("valid");
        assert_eq!(
            (d.seq, d.payload_len, d.payload_crc),
            (5, 5, crc32c::crc32c(b"state"))
        );
    }

    #[test]
    fn record_crc_covers_header_and_payload() {
        let mut buf = Vec::new();
        append_record(&mut buf, 9, b"hello", crc32c::crc32c(b"hello"));
        assert_eq!(buf.len(), RECORD_HEADER_BYTES + 5);
        let h = decode_record_header(&buf);
        assert_eq!((h.len, h.seq), (5, 9));
        assert!(record_ok(&h, &buf[16..]));
        for bit in 0..buf.len() * 8 {
            let mut bad = buf.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            let h = decode_record_header(&bad);
            let ok = h.len as usize == bad.len() - 16 && record_ok(&h, &bad[16..]);
            assert!(!ok, "bit {bit}");
        }
    }
}
