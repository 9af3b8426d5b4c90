//! `CrashStorage`: an in-memory `Storage` that simulates power loss, torn writes and IO errors,
//! deterministically from a seed, so recovery can be tested at every crash point.
//!
//! Model: every file (inode) has *durable* bytes (as of its last successful sync) and *volatile*
//! bytes (what reads see), and the byte range written since its last sync (appends and overwrites
//! alike); the directory likewise has a durable and a volatile set of entries. `crash()` keeps
//! only durable entries and durable bytes, except that with torn writes on, each file's unsynced
//! range is torn: in offset order, a seeded prefix of it holds the new bytes and the rest the old
//! ones (the durable bytes where the file already had them, nothing where it grew), and where
//! the file grew its length may then run on in zeros (a size that reached the disk before the
//! data did). With reordered writes on as well, each 512-byte sector of the unsynced range
//! independently holds its old or its new bytes instead, and the length is any value between the
//! durable and the volatile one: holes. After a crash, files opened before it refuse every
//! operation, like the file descriptors of a dead process.

use std::collections::BTreeMap;
use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::storage::{Storage, StorageFile};

const EIO: i32 = 5;
const ENOSPC: i32 = 28;
/// The unit in which the disk persists bytes when writes are reordered.
const SECTOR_BYTES: usize = 512;

/// A crash-simulating storage. Clones share the same simulated disk.
#[derive(Debug, Clone)]
pub struct CrashStorage {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    state: Mutex<SimState>,
    // Wakes syncs blocked by `pause_syncs(true)`.
    resume: Condvar,
}

impl Inner {
    /// Counts an operation that changes the disk on the locked state; if the power fails just
    /// before it, wakes whoever waits on `resume` and returns the error.
    fn begin_op<'a>(
        &self,
        mut st: MutexGuard<'a, SimState>,
    ) -> io::Result<MutexGuard<'a, SimState>> {
        match st.op() {
            Ok(()) => Ok(st),
            Err(e) => {
                drop(st);
                self.resume.notify_all();
                Err(e)
            }
        }
    }
}

#[derive(Debug, Default)]
struct Inode {
    durable: Vec<u8>,
    volatile: Vec<u8>,
    /// The byte range written since the last sync, `None` if nothing was. Outside it durable and
    /// volatile bytes agree; the durable bytes are never longer than the volatile ones.
    dirty: Option<(usize, usize)>,
}

impl Inode {
    fn clean(bytes: Vec<u8>) -> Inode {
        Inode {
            durable: bytes.clone(),
            volatile: bytes,
            dirty: None,
        }
    }

    /// Writes `buf` at `at` (at most the current length) and marks it unsynced.
    fn write(&mut self, at: usize, buf: &[u8]) {
        crate::storage::write_at(&mut self.volatile, at as u64, buf);
        if buf.is_empty() {
            return;
        }
        let (lo, hi) = (at, at + buf.len());
        self.dirty = Some(match self.dirty {
            Some((a, b)) => (a.min(lo), b.max(hi)),
            None => (lo, hi),
        });
    }

    /// Makes the unsynced bytes in `lo..hi` durable (`hi` at most the volatile length).
    fn persist(&mut self, lo: usize, hi: usize) {
        if self.durable.len() < hi {
            self.durable.resize(hi, 0);
        }
        self.durable[lo..hi].copy_from_slice(&self.volatile[lo..hi]);
    }
}

#[derive(Debug)]
struct SimState {
    inodes: BTreeMap<u64, Inode>,
    inode_next: u64,
    dir: BTreeMap<String, u64>,
    dir_durable: BTreeMap<String, u64>,
    rng: u64,
    torn_writes: bool,
    reordered_writes: bool,
    /// Operations that change the disk left before a simulated power loss (`crash_at_op`).
    crash_at_op: Option<u64>,
    // Bumped by every crash; handles from an older epoch are dead.
    epoch: u64,
    fail_next_write: bool,
    fail_next_sync: bool,
    fail_next_dir_sync: bool,
    space_left_bytes: Option<u64>,
    syncs_paused: bool,
    stats: CrashStats,
}

/// Counters of what the simulated disk has seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CrashStats {
    pub writes: u64,
    pub bytes_written: u64,
    pub syncs: u64,
    pub dir_syncs: u64,
    /// Creates, truncates, renames and removes.
    pub namespace_ops: u64,
    pub crashes: u64,
    pub injected_errors: u64,
}

fn eio(what: &str) -> io::Error {
    let kind = io::Error::from_raw_os_error(EIO).kind();
    io::Error::new(kind, format!("simulated I/O error ({what})"))
}

fn enospc() -> io::Error {
    io::Error::from_raw_os_error(ENOSPC)
}

fn dead() -> io::Error {
    io::Error::other("simulated crash: this file handle belongs to a process that died")
}

fn not_found(name: &str) -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, format!("no file {name}"))
}

impl SimState {
    // splitmix64: tiny, deterministic, good enough for choosing crash outcomes.
    fn next_u64(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }

    fn inode_of(&self, name: &str) -> io::Result<u64> {
        self.dir.get(name).copied().ok_or_else(|| not_found(name))
    }

    fn inode(&mut self, id: u64) -> &mut Inode {
        self.inodes
            .get_mut(&id)
            .expect("directory entry points at a live inode")
    }

    fn sync_inode(&mut self, id: u64) -> io::Result<()> {
        self.stats.syncs += 1;
        let dirty = self.inode(id).dirty;
        if self.fail_next_sync {
            self.fail_next_sync = false;
            self.stats.injected_errors += 1;
            // The kernel wrote back some pages and dropped the others, yet reads still show the
            // volatile bytes: the case that makes a retried sync lie.
            if let Some((lo, hi)) = dirty {
                let cut = lo + self.below((hi - lo) as u64 + 1) as usize;
                let ino = self.inode(id);
                ino.persist(lo, cut);
                ino.dirty = (cut < hi).then_some((cut, hi));
            }
            return Err(eio("sync"));
        }
        if let Some((lo, hi)) = dirty {
            let ino = self.inode(id);
            ino.persist(lo, hi);
            ino.dirty = None;
            debug_assert_eq!(ino.durable.len(), ino.volatile.len());
        }
        Ok(())
    }

    /// What a power loss leaves of one file.
    fn crashed(&mut self, ino: Inode) -> Vec<u8> {
        let Inode {
            mut durable,
            volatile,
            dirty,
        } = ino;
        assert!(
            durable.len() <= volatile.len(),
            "only a truncate shrinks a file, and it is durable at once"
        );
        let Some((lo, hi)) = dirty.filter(|_| self.torn_writes) else {
            return durable;
        };
        assert!(lo <= durable.len() && hi <= volatile.len() && lo < hi);
        if self.reordered_writes {
            // Each sector old or new on its own; the size anywhere from the old to the new one.
            let len = if self.below(2) == 0 {
                volatile.len()
            } else {
                durable.len() + self.below((volatile.len() - durable.len()) as u64 + 1) as usize
            };
            durable.resize(len.max(durable.len()), 0);
            let mut at = lo;
            while at < hi.min(len) {
                let end = ((at / SECTOR_BYTES + 1) * SECTOR_BYTES).min(hi).min(len);
                if self.below(2) == 0 {
                    durable[at..end].copy_from_slice(&volatile[at..end]);
                }
                at = end;
            }
            return durable;
        }
        // A prefix of the unsynced range (in offset order) reached the disk, the rest did not.
        let cut = lo + self.below((hi - lo) as u64 + 1) as usize;
        if durable.len() < cut {
            durable.resize(cut, 0);
        }
        durable[lo..cut].copy_from_slice(&volatile[lo..cut]);
        if self.below(4) == 0 && volatile.len() > durable.len() {
            let zeros = self.below((volatile.len() - durable.len()) as u64 + 1) as usize;
            durable.resize(durable.len() + zeros, 0);
        }
        durable
    }

    /// Power loss: keep durable directory entries and what `crashed` leaves of each file.
    fn crash(&mut self) {
        self.epoch += 1;
        self.stats.crashes += 1;
        self.syncs_paused = false;
        self.fail_next_write = false;
        self.fail_next_sync = false;
        self.fail_next_dir_sync = false;
        self.crash_at_op = None;
        self.dir = self.dir_durable.clone();
        let live: Vec<u64> = self.dir.values().copied().collect();
        let mut kept = BTreeMap::new();
        for id in live {
            if kept.contains_key(&id) {
                continue;
            }
            let Some(ino) = self.inodes.remove(&id) else {
                continue;
            };
            let bytes = self.crashed(ino);
            kept.insert(id, Inode::clean(bytes));
        }
        self.inodes = kept;
    }

    /// Counts one operation that changes the disk; `Err` if the power fails just before it.
    fn op(&mut self) -> io::Result<()> {
        match self.crash_at_op {
            Some(0) => {
                self.crash();
                Err(io::Error::other(
                    "simulated power loss before this operation",
                ))
            }
            Some(n) => {
                self.crash_at_op = Some(n - 1);
                Ok(())
            }
            None => Ok(()),
        }
    }
}

impl CrashStorage {
    /// An empty simulated disk; `seed` decides every random outcome (torn tails, failed syncs).
    /// Torn writes are on.
    pub fn new(seed: u64) -> CrashStorage {
        let state = SimState {
            inodes: BTreeMap::new(),
            inode_next: 1,
            dir: BTreeMap::new(),
            dir_durable: BTreeMap::new(),
            rng: seed,
            torn_writes: true,
            reordered_writes: false,
            crash_at_op: None,
            epoch: 0,
            fail_next_write: false,
            fail_next_sync: false,
            fail_next_dir_sync: false,
            space_left_bytes: None,
            syncs_paused: false,
            stats: CrashStats::default(),
        };
        CrashStorage {
            inner: Arc::new(Inner {
                state: Mutex::new(state),
                resume: Condvar::new(),
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, SimState> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Locks the state for an operation that changes the disk (see `crash_at_op`).
    fn begin_op(&self) -> io::Result<MutexGuard<'_, SimState>> {
        self.inner.begin_op(self.state())
    }

    /// Whether a crash keeps a random part of the unsynced tail (on by default).
    pub fn set_torn_writes(&self, on: bool) {
        self.state().torn_writes = on;
    }

    /// Whether a crash persists the unsynced sectors of a file in any order (off by default:
    /// in offset order). Reordered writes leave holes, which recovery refuses when a valid record
    /// follows one (docs/LEDGER.md, "What we assume about the media").
    pub fn set_reordered_writes(&self, on: bool) {
        self.state().reordered_writes = on;
    }

    /// Power loss: keep durable directory entries and durable bytes (plus, with torn writes, a
    /// random part of each file's unsynced bytes); every open file handle dies.
    pub fn crash(&self) {
        self.state().crash();
        self.inner.resume.notify_all();
    }

    /// Power loss just before the `ops`-th next operation that changes the disk (0: the very
    /// next one), counting file writes and syncs, creates, truncates, renames, removes and
    /// directory syncs; that operation fails. `None` cancels. A test can so crash a writer at
    /// every point of a sequence.
    pub fn crash_at_op(&self, ops: Option<u64>) {
        self.state().crash_at_op = ops;
    }

    /// Operations that changed the disk so far (what `crash_at_op` counts).
    pub fn ops(&self) -> u64 {
        let s = self.state().stats;
        s.writes + s.syncs + s.dir_syncs + s.namespace_ops
    }

    /// The next write fails with EIO after writing a random prefix of its buffer.
    pub fn fail_next_write(&self) {
        self.state().fail_next_write = true;
    }

    /// The next file sync fails with EIO after persisting a random prefix of the unsynced bytes.
    pub fn fail_next_sync(&self) {
        self.state().fail_next_sync = true;
    }

    /// The next directory sync fails with EIO (the directory changes stay volatile).
    pub fn fail_next_dir_sync(&self) {
        self.state().fail_next_dir_sync = true;
    }

    /// Disk full after `bytes` more bytes are written (`None`: unlimited). A write that does not
    /// fit writes what fits and fails with ENOSPC.
    pub fn set_space_left(&self, bytes: Option<u64>) {
        self.state().space_left_bytes = bytes;
    }

    /// While paused, file syncs block (until resumed or a crash), so tests can hold a sync open.
    pub fn pause_syncs(&self, paused: bool) {
        self.state().syncs_paused = paused;
        self.inner.resume.notify_all();
    }

    /// What reads of `name` currently see.
    pub fn file(&self, name: &str) -> Option<Vec<u8>> {
        let st = self.state();
        let id = *st.dir.get(name)?;
        st.inodes.get(&id).map(|i| i.volatile.clone())
    }

    /// Replaces a file with `bytes`, durably (entry and contents), to damage a ledger on purpose.
    pub fn put(&self, name: &str, bytes: Vec<u8>) {
        let mut st = self.state();
        let id = st.inode_next;
        st.inode_next += 1;
        st.inodes.insert(id, Inode::clean(bytes));
        st.dir.insert(name.to_owned(), id);
        st.dir_durable.insert(name.to_owned(), id);
    }

    /// Counters.
    pub fn stats(&self) -> CrashStats {
        self.state().stats
    }
}

struct SimFile {
    inner: Arc<Inner>,
    inode: u64,
    epoch: u64,
}

impl SimFile {
    /// Locks the state for an operation that changes the disk (see `crash_at_op`).
    fn begin_op(&self) -> io::Result<MutexGuard<'_, SimState>> {
        self.inner.begin_op(self.state()?)
    }

    fn state(&self) -> io::Result<MutexGuard<'_, SimState>> {
        let st = self
            .inner
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if st.epoch != self.epoch {
            Err(dead())
        } else {
            Ok(st)
        }
    }

    /// A write of `buf` at `at` (`None`: at the end), with the injected faults.
    fn write(&mut self, at: Option<u64>, buf: &[u8]) -> io::Result<()> {
        let mut st = self.begin_op()?;
        let id = self.inode;
        let len = st.inode(id).volatile.len();
        let at = at.map_or(len, |a| usize::try_from(a).expect("offset fits in memory"));
        assert!(at <= len, "a write may not leave a hole");
        st.stats.writes += 1;
        let mut n = buf.len();
        let mut err = None;
        if st.fail_next_write {
            st.fail_next_write = false;
            st.stats.injected_errors += 1;
            n = st.below(buf.len() as u64 + 1) as usize;
            err = Some(eio("write"));
        }
        // Every byte written takes space, overwrites included (as on a copy-on-write file
        // system; ext4 or xfs would take none for an overwrite of written blocks).
        if let Some(left) = st.space_left_bytes {
            if (n as u64) > left {
                n = left as usize;
                err = Some(enospc());
            }
            st.space_left_bytes = Some(left - n as u64);
        }
        st.stats.bytes_written += n as u64;
        st.inode(id).write(at, &buf[..n]);
        match err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl StorageFile for SimFile {
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.write(None, buf)
    }

    fn write_all_at(&mut self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.write(Some(offset), buf)
    }

    fn sync_data(&mut self) -> io::Result<()> {
        let mut st = self.state()?;
        while st.syncs_paused {
            st = self
                .inner
                .resume
                .wait(st)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if st.epoch != self.epoch {
                return Err(dead());
            }
        }
        if let Err(e) = st.op() {
            drop(st);
            self.inner.resume.notify_all();
            return Err(e);
        }
        st.sync_inode(self.inode)
    }
}

impl Storage for CrashStorage {
    fn list(&self) -> io::Result<Vec<String>> {
        Ok(self.state().dir.keys().cloned().collect())
    }
    fn file_len(&self, name: &str) -> io::Result<u64> {
        let mut st = self.state();
        let id = st.inode_of(name)?;
        Ok(st.inode(id).volatile.len() as u64)
    }
    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        let mut st = self.state();
        let id = st.inode_of(name)?;
        let data = &st.inode(id).volatile;
        let start = usize::try_from(offset)
            .unwrap_or(usize::MAX)
            .min(data.len());
        let n = buf.len().min(data.len() - start);
        buf[..n].copy_from_slice(&data[start..start + n]);
        Ok(n)
    }
    fn create(&self, name: &str) -> io::Result<Box<dyn StorageFile>> {
        let mut st = self.begin_op()?;
        st.stats.namespace_ops += 1;
        let id = st.inode_next;
        st.inode_next += 1;
        st.inodes.insert(id, Inode::default());
        st.dir.insert(name.to_owned(), id);
        Ok(Box::new(SimFile {
            inner: self.inner.clone(),
            inode: id,
            epoch: st.epoch,
        }))
    }
    fn truncate(&self, name: &str, len: u64) -> io::Result<()> {
        let mut st = self.begin_op()?;
        let id = st.inode_of(name)?;
        st.stats.namespace_ops += 1;
        let ino = st.inode(id);
        ino.volatile
            .resize(usize::try_from(len).unwrap_or(usize::MAX), 0);
        ino.durable = ino.volatile.clone();
        ino.dirty = None;
        Ok(())
    }
    fn sync(&self, name: &str) -> io::Result<()> {
        let mut st = self.begin_op()?;
        let id = st.inode_of(name)?;
        st.sync_inode(id)
    }
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let mut st = self.begin_op()?;
        st.stats.namespace_ops += 1;
        let id = st.dir.remove(from).ok_or_else(|| not_found(from))?;
        st.dir.insert(to.to_owned(), id);
        Ok(())
    }
    fn remove(&self, name: &str) -> io::Result<()> {
        let mut st = self.begin_op()?;
        st.stats.namespace_ops += 1;
        st.dir
            .remove(name)
            .map(|_| ())
            .ok_or_else(|| not_found(name))
    }
    fn sync_dir(&self) -> io::Result<()> {
        let mut st = self.begin_op()?;
        st.stats.dir_syncs += 1;
        if st.fail_next_dir_sync {
            st.fail_next_dir_sync = false;
            st.stats.injected_errors += 1;
            return Err(eio("directory sync"));
        }
        // Unreachable inodes stay until the next crash: an open handle may still point at one.
        st.dir_durable = st.dir.clone();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crash_keeps_only_synced_bytes_and_entries() {
        let s = CrashStorage::new(1);
        s.set_torn_writes(false);
        let mut f = s.create("a").expect("create");
        f.write_all(b"durable").expect("write");
        f.sync_data().expect("sync");
        s.sync_dir().expect("dir sync");
        f.write_all(b" volatile").expect("write");
        let mut g = s.create("b").expect("create");
        g.write_all(b"never in dir").expect("write");
        g.sync_data().expect("sync");
        assert_eq!(s.file("a").as_deref(), Some(&b"durable volatile"[..]));
        s.crash();
        assert_eq!(s.file("a").as_deref(), Some(&b"durable"[..]));
        assert_eq!(s.file("b"), None);
        assert!(
            f.write_all(b"x").is_err(),
            "handles of the dead process are dead"
        );
    }

    #[test]
    fn torn_crash_keeps_a_prefix_of_the_tail() {
        for seed in 0..50 {
            let s = CrashStorage::new(seed);
            let mut f = s.create("a").expect("create");
            s.sync_dir().expect("dir sync");
            f.write_all(b"0123").expect("write");
            f.sync_data().expect("sync");
            f.write_all(b"456789").expect("write");
            s.crash();
            let got = s.file("a").expect("file");
            assert!(got.starts_with(b"0123"));
            let tail = &got[4..];
            let keep = tail.iter().take_while(|b| **b != 0).count();
            assert!(b"456789".starts_with(&tail[..keep]), "seed {seed}: {got:?}");
            assert!(tail[keep..].iter().all(|b| *b == 0) && got.len() <= 10);
        }
    }

    /// A file holding "head" and 2044 zeros, all durable, with `fill` overwritten (unsynced)
    /// over bytes 4..1504.
    fn overwritten(s: &CrashStorage, fill: u8) -> Box<dyn StorageFile> {
        let mut f = s.create("a").expect("create");
        s.sync_dir().expect("dir sync");
        f.write_all(b"head").expect("write");
        f.write_all(&[0; 2044]).expect("zeros");
        f.sync_data().expect("sync");
        f.write_all_at(4, &[fill; 1500]).expect("overwrite");
        f
    }

    #[test]
    fn a_synced_overwrite_survives_and_an_unsynced_one_is_lost_or_torn_in_offset_order() {
        let s = CrashStorage::new(3);
        let mut f = overwritten(&s, 0xAA);
        f.sync_data().expect("sync");
        s.crash();
        let got = s.file("a").expect("file");
        assert!(got[4..1504].iter().all(|b| *b == 0xAA) && got.len() == 2048);

        let s = CrashStorage::new(3);
        s.set_torn_writes(false);
        let _f = overwritten(&s, 0xAA);
        s.crash();
        let got = s.file("a").expect("file");
        assert_eq!((&got[..4], got.len()), (&b"head"[..], 2048));
        assert!(got[4..].iter().all(|b| *b == 0), "only the old bytes");

        let mut partial = 0;
        for seed in 0..50 {
            let s = CrashStorage::new(seed);
            let _f = overwritten(&s, 0xAA);
            s.crash();
            let got = s.file("a").expect("file");
            assert_eq!(got.len(), 2048, "an overwrite does not change the size");
            let new = got[4..].iter().take_while(|b| **b == 0xAA).count();
            assert!(
                got[4 + new..].iter().all(|b| *b == 0),
                "seed {seed}: a prefix"
            );
            partial += u64::from(new > 0 && new < 1500);
        }
        assert!(partial > 10);
    }

    #[test]
    fn reordered_writes_tear_by_sector_and_leave_holes() {
        let mut holes = 0;
        for seed in 0..50 {
            let s = CrashStorage::new(seed);
            s.set_reordered_writes(true);
            let _f = overwritten(&s, 0xAA);
            s.crash();
            let got = s.file("a").expect("file");
            assert_eq!(&got[..4], b"head");
            // Sectors 0..512, 512..1024, 1024..1504 (the written part of each).
            let sectors: Vec<bool> = [4..512, 512..1024, 1024..1504]
                .into_iter()
                .map(|r| {
                    let new = got[r.clone()].iter().all(|b| *b == 0xAA);
                    assert!(
                        new || got[r].iter().all(|b| *b == 0),
                        "seed {seed}: whole sectors"
                    );
                    new
                })
                .collect();
            holes += u64::from(sectors.windows(2).any(|w| !w[0] && w[1]));
        }
        assert!(holes > 5, "{holes}");
    }

    #[test]
    fn crash_at_op_fails_that_operation_and_loses_power() {
        let s = CrashStorage::new(1);
        s.set_torn_writes(false);
        let mut f = s.create("a").expect("create");
        s.sync_dir().expect("dir sync");
        f.write_all(b"kept").expect("write");
        f.sync_data().expect("sync");
        let ops = s.ops();
        s.crash_at_op(Some(1));
        f.write_all(b" lost").expect("op 0 happens");
        assert!(f.sync_data().is_err(), "op 1 does not");
        assert_eq!(s.ops(), ops + 1);
        assert_eq!(s.stats().crashes, 1);
        assert_eq!(s.file("a").as_deref(), Some(&b"kept"[..]));
        assert!(f.write_all(b"x").is_err(), "the writer died with the power");
        assert!(s.create("b").is_ok(), "the next boot works");
    }

    #[test]
    fn injected_errors_fire_once() {
        let s = CrashStorage::new(7);
        let mut f = s.create("a").expect("create");
        s.fail_next_sync();
        f.write_all(b"abc").expect("write");
        assert!(f.sync_data().is_err());
        assert!(f.sync_data().is_ok());
        s.set_space_left(Some(2));
        let e = f.write_all(b"xyz").expect_err("full");
        assert_eq!(e.raw_os_error(), Some(ENOSPC));
        assert_eq!(s.file("a").as_deref(), Some(&b"abcxy"[..]));
    }
}
