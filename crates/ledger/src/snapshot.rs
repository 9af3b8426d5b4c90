//! Snapshot files: writing one atomically, choosing the newest valid one at recovery, and
//! retention (old snapshots and the segments they make unnecessary).

use crate::error::LedgerError;
use crate::format::{self, HeaderError, SNAPSHOT_HEADER_BYTES};
use crate::scan::{self, Named};
use crate::storage::{self, Storage};

/// The snapshot a recovery (or verify) used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub file: String,
    /// The snapshot covers records `1..=seq`.
    pub seq: u64,
    /// Payload bytes.
    pub bytes: u64,
}

/// A file that was skipped, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidFile {
    pub file: String,
    pub reason: String,
}

/// Checks one snapshot file; `Ok(Err(reason))` if it is invalid.
fn load_one(
    storage: &dyn Storage,
    snap: &Named,
    bytes_max: u64,
) -> Result<Result<Vec<u8>, String>, LedgerError> {
    let len = storage
        .file_len(&snap.name)
        .map_err(|e| LedgerError::io("stat", &snap.name, e))?;
    if len < SNAPSHOT_HEADER_BYTES as u64 {
        return Ok(Err(format!("{len} bytes, shorter than the header")));
    }
    if len - SNAPSHOT_HEADER_BYTES as u64 > bytes_max {
        return Ok(Err(format!(
            "{len} bytes, larger than snapshot_bytes_max = {bytes_max}"
        )));
    }
    let data = storage::read_file(storage, &snap.name)
        .map_err(|e| LedgerError::io("read", &snap.name, e))?;
    let h = match format::decode_snapshot_header(&data) {
        Ok(h) => h,
        Err(HeaderError::Bad(reason)) => return Ok(Err(reason.to_owned())),
        Err(HeaderError::Version(v)) => {
            return Ok(Err(format!("format version {v} is not supported")));
        }
    };
    if h.seq != snap.seq {
        return Ok(Err(format!(
            "header says seq {}, the file name says {}",
            h.seq, snap.seq
        )));
    }
    if h.payload_len != (data.len() - SNAPSHOT_HEADER_BYTES) as u64 {
        return Ok(Err(format!(
            "header says {} payload bytes, the file has {}",
            h.payload_len,
            data.len() - SNAPSHOT_HEADER_BYTES
        )));
    }
    if crc32c::crc32c(&data[SNAPSHOT_HEADER_BYTES..]) != h.payload_crc {
        return Ok(Err("payload checksum mismatch".to_owned()));
    }
    let mut data = data;
    data.drain(..SNAPSHOT_HEADER_BYTES);
    Ok(Ok(data))
}

/// A snapshot chosen for recovery, with its payload.
pub(crate) type Chosen = (SnapshotInfo, Vec<u8>);

/// The newest valid snapshot with `seq <= seq_max` (payload included), and the invalid ones
/// that were skipped on the way.
pub(crate) fn newest_valid(
    storage: &dyn Storage,
    snapshots: &[Named],
    seq_max: u64,
    bytes_max: u64,
) -> Result<(Option<Chosen>, Vec<InvalidFile>), LedgerError> {
    let mut invalid = Vec::new();
    for snap in snapshots.iter().filter(|s| s.seq <= seq_max) {
        match load_one(storage, snap, bytes_max)? {
            Ok(payload) => {
                let info = SnapshotInfo {
                    file: snap.name.clone(),
                    seq: snap.seq,
                    bytes: payload.len() as u64,
                };
                return Ok((Some((info, payload)), invalid));
            }
            Err(reason) => invalid.push(InvalidFile {
                file: snap.name.clone(),
                reason,
            }),
        }
    }
    Ok((None, invalid))
}

/// Writes `snap-<seq>.snap` atomically: tmp file, fdatasync, rename, directory fsync.
pub(crate) fn write(
    storage: &dyn Storage,
    seq: u64,
    payload: &[u8],
) -> Result<SnapshotInfo, LedgerError> {
    let name = format::snapshot_name(seq);
    let tmp = format!("{name}{}", format::TMP_SUFFIX);
    let mut file = storage
        .create(&tmp)
        .map_err(|e| LedgerError::io("create", &tmp, e))?;
    let header = format::encode_snapshot_header(seq, payload);
    file.write_all(&header)
        .map_err(|e| LedgerError::io("write", &tmp, e))?;
    file.write_all(payload)
        .map_err(|e| LedgerError::io("write", &tmp, e))?;
    file.sync_data()
        .map_err(|e| LedgerError::io("sync", &tmp, e))?;
    drop(file);
    storage
        .rename(&tmp, &name)
        .map_err(|e| LedgerError::io("rename", &tmp, e))?;
    storage
        .sync_dir()
        .map_err(|e| LedgerError::io("sync directory", &name, e))?;
    Ok(SnapshotInfo {
        file: name,
        seq,
        bytes: payload.len() as u64,
    })
}

/// Keeps the newest `keep` snapshots, then removes every segment whose live records are all
/// covered by the oldest kept one (never the last segment). Returns the removed file names.
pub(crate) fn retain(storage: &dyn Storage, keep: usize) -> Result<Vec<String>, LedgerError> {
    assert!(keep >= 1);
    let listing = scan::list(storage)?;
    let mut removed = Vec::new();
    // Snapshots are listed newest first.
    for old in listing.snapshots.iter().skip(keep) {
        storage
            .remove(&old.name)
            .map_err(|e| LedgerError::io("remove", &old.name, e))?;
        removed.push(old.name.clone());
    }
    if let Some(cutoff) = listing.snapshots.iter().take(keep).map(|s| s.seq).min() {
        for pair in listing.segments.windows(2) {
            // Live records of pair[0] are those below pair[1]'s first seq.
            if pair[1].seq - 1 > cutoff {
                break;
            }
            storage
                .remove(&pair[0].name)
                .map_err(|e| LedgerError::io("remove", &pair[0].name, e))?;
            removed.push(pair[0].name.clone());
        }
    }
    if !removed.is_empty() {
        storage
            .sync_dir()
            .map_err(|e| LedgerError::io("sync directory", "ledger directory", e))?;
    }
    Ok(removed)
}
