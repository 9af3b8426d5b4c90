//! `CrashStorage`: an in-memory `Storage` that simulates power loss, torn writes and IO errors,
//! deterministically from a seed, so recovery can be tested at every crash point.
//!
//! Model: every file (inode) has *durable* bytes (as of its last successful sync) and *volatile*
//! bytes (what reads see); the directory likewise has a durable and a volatile set of entries.
//! Durable bytes are always a prefix of the volatile ones (the ledger only appends and truncates).
//! `crash()` keeps only durable entries and durable bytes, plus (with torn writes on) a random
//! prefix of each file's unsynced tail, sometimes followed by zeros (a size that reached the disk
//! before the data did). After a crash, files opened before it refuse every operation, like the
//! file descriptors of a dead process.

use std::collections::BTreeMap;
use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::storage::{Storage, StorageFile};

const EIO: i32 = 5;
const ENOSPC: i32 = 28;

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

#[derive(Debug, Default)]
struct Inode {
    durable: Vec<u8>,
    volatile: Vec<u8>,
}

#[derive(Debug)]
struct SimState {
    inodes: BTreeMap<u64, Inode>,
    inode_next: u64,
    dir: BTreeMap<String, u64>,
    dir_durable: BTreeMap<String, u64>,
    rng: u64,
    torn_writes: bool,
    // Bumped by every crash; handles from an older epoch are dead.
    epoch: u64,
    fail_next_write: bool,
    fail_next_sync: bool,
    fail_next_dir_sync: bool,
    space_left_bytes: Option<u64>,
    syncs_paused: bool,
    stats: SimStats,
}

/// Counters of what the simulated disk has seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimStats {
    pub writes: u64,
    pub bytes_written: u64,
    pub syncs: u64,
    pub dir_syncs: u64,
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
        if self.fail_next_sync {
            self.fail_next_sync = false;
            self.stats.injected_errors += 1;
            // The kernel wrote back some pages and dropped the others, yet reads still show the
            // volatile bytes: the case that makes a retried sync lie.
            let (d, v) = {
                let ino = self.inode(id);
                (ino.durable.len() as u64, ino.volatile.len() as u64)
            };
            let keep = (d + self.below(v - d + 1)) as usize;
            let ino = self.inode(id);
            let tail = ino.volatile[ino.durable.len()..keep].to_vec();
            ino.durable.extend_from_slice(&tail);
            return Err(eio("sync"));
        }
        let ino = self.inode(id);
        let from = ino.durable.len();
        let tail = ino.volatile[from..].to_vec();
        ino.durable.extend_from_slice(&tail);
        Ok(())
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
            epoch: 0,
            fail_next_write: false,
            fail_next_sync: false,
            fail_next_dir_sync: false,
            space_left_bytes: None,
            syncs_paused: false,
            stats: SimStats::default(),
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

    /// Whether a crash keeps a random part of the unsynced tail (on by default).
    pub fn set_torn_writes(&self, on: bool) {
        self.state().torn_writes = on;
    }

    /// Power loss: keep durable directory entries and durable bytes (plus, with torn writes, a
    /// random prefix of each unsynced tail); every open file handle dies.
    pub fn crash(&self) {
        let mut st = self.state();
        st.epoch += 1;
        st.stats.crashes += 1;
        st.syncs_paused = false;
        st.fail_next_write = false;
        st.fail_next_sync = false;
        st.fail_next_dir_sync = false;
        st.dir = st.dir_durable.clone();
        let live: Vec<u64> = st.dir.values().copied().collect();
        let mut kept = BTreeMap::new();
        for id in live {
            if kept.contains_key(&id) {
                continue;
            }
            let Some(mut ino) = st.inodes.remove(&id) else {
                continue;
            };
            assert!(
                ino.volatile.starts_with(&ino.durable),
                "durable bytes are a prefix of the volatile ones"
            );
            let mut bytes = std::mem::take(&mut ino.durable);
            if st.torn_writes {
                let tail = &ino.volatile[bytes.len()..];
                let keep = st.below(tail.len() as u64 + 1) as usize;
                bytes.extend_from_slice(&tail[..keep]);
                if st.below(4) == 0 {
                    let zeros = st.below((tail.len() - keep) as u64 + 1) as usize;
                    bytes.resize(bytes.len() + zeros, 0);
                }
            }
            kept.insert(
                id,
                Inode {
                    durable: bytes.clone(),
                    volatile: bytes,
                },
            );
        }
        st.inodes = kept;
        drop(st);
        self.inner.resume.notify_all();
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
        st.inodes.insert(
            id,
            Inode {
                durable: bytes.clone(),
                volatile: bytes,
            },
        );
        st.dir.insert(name.to_owned(), id);
        st.dir_durable.insert(name.to_owned(), id);
    }

    /// Counters.
    pub fn stats(&self) -> SimStats {
        self.state().stats
    }
}

struct SimFile {
    inner: Arc<Inner>,
    inode: u64,
    epoch: u64,
}

impl SimFile {
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
}

impl StorageFile for SimFile {
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        let mut st = self.state()?;
        st.stats.writes += 1;
        let mut n = buf.len();
        let mut err = None;
        if st.fail_next_write {
            st.fail_next_write = false;
            st.stats.injected_errors += 1;
            n = st.below(buf.len() as u64 + 1) as usize;
            err = Some(eio("write"));
        }
        if let Some(left) = st.space_left_bytes {
            if (n as u64) > left {
                n = left as usize;
                err = Some(enospc());
            }
            st.space_left_bytes = Some(left - n as u64);
        }
        st.stats.bytes_written += n as u64;
        let id = self.inode;
        st.inode(id).volatile.extend_from_slice(&buf[..n]);
        match err {
            Some(e) => Err(e),
            None => Ok(()),
        }
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
        let mut st = self.state();
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
        let mut st = self.state();
        let id = st.inode_of(name)?;
        let ino = st.inode(id);
        ino.volatile
            .resize(usize::try_from(len).unwrap_or(usize::MAX), 0);
        ino.durable = ino.volatile.clone();
        Ok(())
    }
    fn sync(&self, name: &str) -> io::Result<()> {
        let mut st = self.state();
        let id = st.inode_of(name)?;
        st.sync_inode(id)
    }
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let mut st = self.state();
        let id = st.dir.remove(from).ok_or_else(|| not_found(from))?;
        st.dir.insert(to.to_owned(), id);
        Ok(())
    }
    fn remove(&self, name: &str) -> io::Result<()> {
        let mut st = self.state();
        st.dir
            .remove(name)
            .map(|_| ())
            .ok_or_else(|| not_found(name))
    }
    fn sync_dir(&self) -> io::Result<()> {
        let mut st = self.state();
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
