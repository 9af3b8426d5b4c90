//! The simulated disk as the shipped core sees it: `CrashStorage` behind a thin `Storage` that
//! can cut the process short at a chosen disk operation — the power fails (unsynced bytes lost
//! or torn) or the process is killed (the page cache survives) just before it — and says which
//! operation that was: a write or fdatasync of an append, one of the steps of a segment roll
//! (cut the preallocated tail, create the tmp segment, write and sync its header, rename, fsync
//! the directory), of a snapshot, of retention's removals, or of recovery. After the cut the
//! process is dead: every operation fails until the world starts a new one (`revive`).

use estop_ledger::{CrashStorage, Storage, StorageFile, format};
use std::collections::BTreeMap;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

/// How the process ends at the cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    PowerLoss,
    Kill,
}

/// What the core was doing when its disk operation ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Starting: recovery opens the ledger.
    Recovery,
    Serving,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpKind {
    Create,
    Write,
    Sync,
    Truncate,
    Rename,
    Remove,
    SyncDir,
}

#[derive(Debug)]
struct State {
    /// The cut: how, and after how many more operations.
    armed: Option<(Cut, u64)>,
    dead: bool,
    phase: Phase,
    /// The last operation that changed the directory (what a directory fsync makes durable).
    last_dir_op: &'static str,
    /// Where the last cut fell, until the world takes it.
    fired: Option<(Cut, String)>,
    /// Every cut so far, by where it fell.
    points: BTreeMap<String, u64>,
    /// Files renamed since they were opened: a handle writes under the new name.
    renamed: BTreeMap<String, String>,
}

#[derive(Debug)]
struct Shared {
    inner: Arc<CrashStorage>,
    state: Mutex<State>,
}

/// A `Storage` over a `CrashStorage` that cuts the process short at an armed operation.
#[derive(Debug, Clone)]
pub struct Disk {
    shared: Arc<Shared>,
}

fn dead() -> io::Error {
    io::Error::other("the simulated process is dead")
}

/// What a file is, by its name.
fn file_kind(name: &str) -> &'static str {
    let tmp = name.ends_with(format::TMP_SUFFIX);
    match (name.starts_with("seg-"), name.starts_with("snap-"), tmp) {
        (true, _, true) => "tmp segment",
        (true, _, false) => "segment",
        (_, true, true) => "tmp snapshot",
        (_, true, false) => "snapshot",
        _ => "file",
    }
}

/// The name of an operation point: what it is part of, and the step.
fn point(kind: OpKind, name: &str, last_dir_op: &str) -> (&'static str, &'static str) {
    match (kind, file_kind(name)) {
        (OpKind::Create, "tmp segment") => ("roll", "create the tmp segment"),
        (OpKind::Write, "tmp segment") => ("roll", "write the header"),
        (OpKind::Sync, "tmp segment") => ("roll", "fdatasync the tmp segment"),
        (OpKind::Rename, "tmp segment") => ("roll", "rename into place"),
        (OpKind::Truncate, "segment") => ("roll", "cut the preallocated tail"),
        (OpKind::Write, "segment") => ("append", "write"),
        (OpKind::Sync, "segment") => ("append", "fdatasync"),
        (OpKind::Create, "tmp snapshot") => ("snapshot", "create the tmp snapshot"),
        (OpKind::Write, "tmp snapshot") => ("snapshot", "write"),
        (OpKind::Sync, "tmp snapshot") => ("snapshot", "fdatasync"),
        (OpKind::Rename, "tmp snapshot") => ("snapshot", "rename into place"),
        (OpKind::Remove, _) => ("retention of files", "remove an old file"),
        (OpKind::SyncDir, _) => match last_dir_op {
            "roll" => ("roll", "fsync the directory"),
            "snapshot" => ("snapshot", "fsync the directory"),
            _ => ("retention of files", "fsync the directory"),
        },
        _ => ("other", "other"),
    }
}

/// Every point of a segment roll and of a snapshot while serving: CI must cut at each.
pub const ROLL_AND_SNAPSHOT_POINTS: [&str; 10] = [
    "roll: cut the preallocated tail",
    "roll: create the tmp segment",
    "roll: write the header",
    "roll: fdatasync the tmp segment",
    "roll: rename into place",
    "roll: fsync the directory",
    "snapshot: create the tmp snapshot",
    "snapshot: write",
    "snapshot: fdatasync",
    "snapshot: rename into place",
];

impl Disk {
    pub fn new(inner: Arc<CrashStorage>) -> Disk {
        Disk {
            shared: Arc::new(Shared {
                inner,
                state: Mutex::new(State {
                    armed: None,
                    dead: false,
                    phase: Phase::Serving,
                    last_dir_op: "",
                    fired: None,
                    points: BTreeMap::new(),
                    renamed: BTreeMap::new(),
                }),
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.shared.state()
    }

    /// The process ends just before the `ops`-th next operation that changes the disk.
    pub fn arm(&self, cut: Cut, ops: u64) {
        self.state().armed = Some((cut, ops));
    }

    pub fn disarm(&self) {
        self.state().armed = None;
    }

    /// Where the armed cut fell, once it has (the process is dead from then on).
    pub fn take_fired(&self) -> Option<(Cut, String)> {
        self.state().fired.take()
    }

    /// Whether the armed cut fell (the process is dead).
    pub fn fired(&self) -> bool {
        self.state().fired.is_some()
    }

    /// A new process starts on the disk.
    pub fn revive(&self) {
        self.state().dead = false;
    }

    pub fn set_phase(&self, phase: Phase) {
        self.state().phase = phase;
    }

    /// Every cut so far, by where it fell (`"roll: rename into place"` …).
    pub fn points(&self) -> BTreeMap<String, u64> {
        self.state().points.clone()
    }
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Before an operation that changes the disk: fails if the process is dead or dies now.
    fn op(&self, kind: OpKind, name: &str) -> io::Result<()> {
        let mut st = self.state();
        if st.dead {
            return Err(dead());
        }
        let name = match (kind, st.renamed.get(name)) {
            (OpKind::Write | OpKind::Sync, Some(to)) => to.clone(),
            _ => name.to_owned(),
        };
        let (part, step) = point(kind, &name, st.last_dir_op);
        if matches!(kind, OpKind::Rename | OpKind::Remove) {
            st.last_dir_op = part;
        }
        match st.armed {
            Some((cut, 0)) => {
                st.armed = None;
                st.dead = true;
                let at = match (st.phase, part) {
                    // Recovery makes the segment it appends to the way a roll does.
                    (Phase::Recovery, "roll") => format!("recovery, new segment: {step}"),
                    (Phase::Recovery, _) => format!("recovery, {part}: {step}"),
                    (Phase::Serving, _) => format!("{part}: {step}"),
                };
                *st.points.entry(at.clone()).or_default() += 1;
                st.fired = Some((cut, at));
                drop(st);
                if cut == Cut::PowerLoss {
                    self.inner.crash();
                }
                Err(dead())
            }
            Some((cut, n)) => {
                st.armed = Some((cut, n - 1));
                Ok(())
            }
            None => Ok(()),
        }
    }

    fn read(&self) -> io::Result<()> {
        if self.state().dead {
            return Err(dead());
        }
        Ok(())
    }
}

impl Storage for Disk {
    fn list(&self) -> io::Result<Vec<String>> {
        self.shared.read()?;
        self.shared.inner.list()
    }

    fn file_len(&self, name: &str) -> io::Result<u64> {
        self.shared.read()?;
        self.shared.inner.file_len(name)
    }

    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        self.shared.read()?;
        self.shared.inner.read_at(name, offset, buf)
    }

    fn create(&self, name: &str) -> io::Result<Box<dyn StorageFile>> {
        self.shared.op(OpKind::Create, name)?;
        self.shared.state().renamed.remove(name);
        let file = self.shared.inner.create(name)?;
        Ok(Box::new(DiskFile {
            shared: Arc::clone(&self.shared),
            name: name.to_owned(),
            file,
        }))
    }

    fn truncate(&self, name: &str, len: u64) -> io::Result<()> {
        self.shared.op(OpKind::Truncate, name)?;
        self.shared.inner.truncate(name, len)
    }

    fn sync(&self, name: &str) -> io::Result<()> {
        self.shared.op(OpKind::Sync, name)?;
        self.shared.inner.sync(name)
    }

    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        self.shared.op(OpKind::Rename, from)?;
        self.shared
            .state()
            .renamed
            .insert(from.to_owned(), to.to_owned());
        self.shared.inner.rename(from, to)
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        self.shared.op(OpKind::Remove, name)?;
        self.shared.inner.remove(name)
    }

    fn sync_dir(&self) -> io::Result<()> {
        self.shared.op(OpKind::SyncDir, "")?;
        self.shared.inner.sync_dir()
    }
}

struct DiskFile {
    shared: Arc<Shared>,
    name: String,
    file: Box<dyn StorageFile>,
}

impl StorageFile for DiskFile {
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.shared.op(OpKind::Write, &self.name)?;
        self.file.write_all(buf)
    }

    fn write_all_at(&mut self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.shared.op(OpKind::Write, &self.name)?;
        self.file.write_all_at(offset, buf)
    }

    fn sync_data(&mut self) -> io::Result<()> {
        self.shared.op(OpKind::Sync, &self.name)?;
        self.file.sync_data()
    }
}
