//! The tiny `Storage` trait through which the ledger reaches disk (one flat directory of files),
//! and its real (`FileStorage`) and in-memory (`MemStorage`) implementations.
//! The crash-simulating one is in `crash_storage.rs`.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::LedgerError;

/// A flat directory of files, as the ledger needs it and no more.
///
/// Durability contract (the one `CrashStorage` simulates):
/// * bytes written through a `StorageFile` survive a crash only after its `sync_data` returned Ok
///   (until then, each written range may read back after a crash as its old or its new bytes);
/// * `create`, `rename` and `remove` survive a crash only after `sync_dir` returned Ok;
/// * `truncate` and `sync` are durable when they return Ok.
///
/// Reads see the latest writes (the "page cache"), durable or not.
pub trait Storage: Send + Sync + fmt::Debug {
    /// Names of the files in the directory, in no particular order.
    fn list(&self) -> io::Result<Vec<String>>;
    /// Current length of a file.
    fn file_len(&self, name: &str) -> io::Result<u64>;
    /// Reads up to `buf.len()` bytes at `offset`; returns how many were read (0 at the end).
    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> io::Result<usize>;
    /// Creates an empty file, replacing any file of that name, and opens it for writing.
    fn create(&self, name: &str) -> io::Result<Box<dyn StorageFile>>;
    /// Cuts a file to `len` bytes and makes the result durable (`ftruncate` + `fsync`).
    fn truncate(&self, name: &str, len: u64) -> io::Result<()>;
    /// Makes the file's current contents durable (`fsync`).
    fn sync(&self, name: &str) -> io::Result<()>;
    /// Renames a file, atomically replacing `to` if it exists.
    fn rename(&self, from: &str, to: &str) -> io::Result<()>;
    /// Removes a file.
    fn remove(&self, name: &str) -> io::Result<()>;
    /// Makes the directory's entries (creates, renames, removes) durable (`fsync` of the directory).
    fn sync_dir(&self) -> io::Result<()>;
}

/// A file opened for writing by `Storage::create`; the handle is the file's only writer. It
/// stays valid across a rename.
pub trait StorageFile: Send {
    /// Appends all of `buf` at the end of the file (a failure may leave any prefix of it written).
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()>;
    /// Writes all of `buf` at `offset` (`pwrite`): overwrites what is there and extends the file
    /// if it runs past the end (`offset` must not be past the end). A failure may leave any prefix
    /// of it written.
    fn write_all_at(&mut self, offset: u64, buf: &[u8]) -> io::Result<()>;
    /// Makes everything written so far durable (`fdatasync`).
    fn sync_data(&mut self) -> io::Result<()>;
}

/// Reads a whole file into memory.
pub fn read_file(storage: &dyn Storage, name: &str) -> io::Result<Vec<u8>> {
    let len = storage.file_len(name)?;
    let len = usize::try_from(len).map_err(|_| io::Error::other("file too large for memory"))?;
    let mut buf = vec![0u8; len];
    let mut at = 0;
    while at < len {
        let n = storage.read_at(name, at as u64, &mut buf[at..])?;
        if n == 0 {
            buf.truncate(at);
            break;
        }
        at += n;
    }
    Ok(buf)
}

/// Real files in one directory. `sync_data` is `fdatasync`, `sync_dir` is `fsync` of the
/// directory. `open` holds an exclusive lock on `LOCK` so two writers cannot share a ledger.
#[derive(Debug)]
pub struct FileStorage {
    dir: PathBuf,
    dir_handle: File,
    // Held for its lock; released when the storage is dropped.
    _lock: Option<File>,
}

/// Mode of every ledger file: the records name principals and hold agents' arguments.
const FILE_MODE: u32 = 0o600;

/// Makes the ledger directory 0700 and every file in it 0600 (files an older version created
/// 0644 included). A chmod that fails is an error: the ledger is not opened half private.
fn make_private(dir: &Path) -> Result<(), LedgerError> {
    let shown = dir.display().to_string();
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
        .map_err(|e| LedgerError::io("make private (chmod 700)", &shown, e))?;
    let entries = fs::read_dir(dir).map_err(|e| LedgerError::io("list", &shown, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| LedgerError::io("list", &shown, e))?;
        let path = entry.path();
        let is_file = entry.file_type().is_ok_and(|t| t.is_file());
        if is_file {
            fs::set_permissions(&path, fs::Permissions::from_mode(FILE_MODE)).map_err(|e| {
                LedgerError::io("make private (chmod 600)", &path.display().to_string(), e)
            })?;
        }
    }
    Ok(())
}

/// Name of the lock file `FileStorage::open` holds.
pub const LOCK_FILE: &str = "LOCK";

impl FileStorage {
    /// Opens (creating if needed) a ledger directory for writing, taking its lock.
    pub fn open(dir: impl AsRef<Path>) -> Result<FileStorage, LedgerError> {
        let dir = dir.as_ref().to_path_buf();
        let shown = dir.display().to_string();
        if !dir.is_dir() {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&dir)
                .map_err(|e| LedgerError::io("create directory", &shown, e))?;
            // The new directory's own entry must be durable too, or a power loss loses the ledger.
            if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                File::open(parent).and_then(|p| p.sync_all()).map_err(|e| {
                    LedgerError::io("sync directory", &parent.display().to_string(), e)
                })?;
            }
        }
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(dir.join(LOCK_FILE))
            .map_err(|e| LedgerError::io("open", LOCK_FILE, e))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => return Err(LedgerError::Locked { dir: shown }),
            Err(fs::TryLockError::Error(e)) => return Err(LedgerError::io("lock", LOCK_FILE, e)),
        }
        // Only the lock's holder touches the modes: a second opener changes nothing.
        make_private(&dir)?;
        let dir_handle =
            File::open(&dir).map_err(|e| LedgerError::io("open directory", &shown, e))?;
        Ok(FileStorage {
            dir,
            dir_handle,
            _lock: Some(lock),
        })
    }

    /// Opens an existing ledger directory without taking its lock, for read-only inspection
    /// (`estop ledger verify` while the server runs). Use it only with `inspect`/`verify`.
    pub fn open_read_only(dir: impl AsRef<Path>) -> Result<FileStorage, LedgerError> {
        let dir = dir.as_ref().to_path_buf();
        let shown = dir.display().to_string();
        let dir_handle =
            File::open(&dir).map_err(|e| LedgerError::io("open directory", &shown, e))?;
        Ok(FileStorage {
            dir,
            dir_handle,
            _lock: None,
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, name: &str) -> PathBuf {
        // The ledger only uses flat names it built itself.
        assert!(!name.contains('/') && !name.is_empty() && name != "." && name != "..");
        self.dir.join(name)
    }
}

struct RealFile {
    file: File,
    /// End of the file as this handle (its only writer) wrote it: where `write_all` appends.
    len: u64,
}

impl StorageFile for RealFile {
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.write_all_at(self.len, buf)
    }
    fn write_all_at(&mut self, offset: u64, buf: &[u8]) -> io::Result<()> {
        assert!(offset <= self.len, "a write may not leave a hole");
        // pwrite: the file cursor is not used, so appends and overwrites can interleave.
        FileExt::write_all_at(&self.file, buf, offset)?;
        self.len = self.len.max(offset + buf.len() as u64);
        Ok(())
    }
    fn sync_data(&mut self) -> io::Result<()> {
        self.file.sync_data()
    }
}

impl Storage for FileStorage {
    fn list(&self) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in fs::read_dir(&self.dir)? {
            let entry = entry?;
            if let Ok(name) = entry.file_name().into_string() {
                names.push(name);
            }
        }
        Ok(names)
    }
    fn file_len(&self, name: &str) -> io::Result<u64> {
        Ok(fs::metadata(self.path(name))?.len())
    }
    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        // One open per call: callers read in large chunks, so this is cheap.
        let file = File::open(self.path(name))?;
        loop {
            match file.read_at(buf, offset) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                other => return other,
            }
        }
    }
    fn create(&self, name: &str) -> io::Result<Box<dyn StorageFile>> {
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(FILE_MODE)
            .open(self.path(name))?;
        // The umask can only narrow `mode`; an existing file keeps its old mode until set.
        file.set_permissions(fs::Permissions::from_mode(FILE_MODE))?;
        Ok(Box::new(RealFile { file, len: 0 }))
    }
    fn truncate(&self, name: &str, len: u64) -> io::Result<()> {
        let file = OpenOptions::new().write(true).open(self.path(name))?;
        file.set_len(len)?;
        file.sync_all()
    }
    fn sync(&self, name: &str) -> io::Result<()> {
        File::open(self.path(name))?.sync_all()
    }
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        fs::rename(self.path(from), self.path(to))
    }
    fn remove(&self, name: &str) -> io::Result<()> {
        fs::remove_file(self.path(name))
    }
    fn sync_dir(&self) -> io::Result<()> {
        self.dir_handle.sync_all()
    }
}

type MemFile = Arc<Mutex<Vec<u8>>>;

/// Files in memory; every operation is immediately "durable". For tests and benchmarks.
/// Clones share the same files.
#[derive(Debug, Clone, Default)]
pub struct MemStorage {
    files: Arc<Mutex<BTreeMap<String, MemFile>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks cannot leave the map half-updated.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn not_found(name: &str) -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, format!("no file {name}"))
}

/// Writes `buf` at `offset` of `data`, growing it if needed (`offset` at most `data.len()`).
pub(crate) fn write_at(data: &mut Vec<u8>, offset: u64, buf: &[u8]) {
    let at = usize::try_from(offset).expect("offset fits in memory");
    assert!(at <= data.len(), "a write may not leave a hole");
    let end = at + buf.len();
    if end > data.len() {
        data.resize(end, 0);
    }
    data[at..end].copy_from_slice(buf);
}

impl MemStorage {
    /// An empty directory.
    pub fn new() -> MemStorage {
        MemStorage::default()
    }

    /// A directory holding copies of `files`.
    pub fn from_files(files: BTreeMap<String, Vec<u8>>) -> MemStorage {
        let files = files
            .into_iter()
            .map(|(k, v)| (k, Arc::new(Mutex::new(v))))
            .collect();
        MemStorage {
            files: Arc::new(Mutex::new(files)),
        }
    }

    /// A copy of every file.
    pub fn files(&self) -> BTreeMap<String, Vec<u8>> {
        lock(&self.files)
            .iter()
            .map(|(k, v)| (k.clone(), lock(v).clone()))
            .collect()
    }

    /// Replaces (or creates) a file's contents, for tests that damage a ledger on purpose.
    pub fn put(&self, name: &str, bytes: Vec<u8>) {
        lock(&self.files).insert(name.to_owned(), Arc::new(Mutex::new(bytes)));
    }

    fn get(&self, name: &str) -> io::Result<MemFile> {
        lock(&self.files)
            .get(name)
            .cloned()
            .ok_or_else(|| not_found(name))
    }
}

struct MemHandle {
    file: MemFile,
}

impl StorageFile for MemHandle {
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        lock(&self.file).extend_from_slice(buf);
        Ok(())
    }
    fn write_all_at(&mut self, offset: u64, buf: &[u8]) -> io::Result<()> {
        write_at(&mut lock(&self.file), offset, buf);
        Ok(())
    }
    fn sync_data(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Storage for MemStorage {
    fn list(&self) -> io::Result<Vec<String>> {
        Ok(lock(&self.files).keys().cloned().collect())
    }
    fn file_len(&self, name: &str) -> io::Result<u64> {
        let file = self.get(name)?;
        Ok(lock(&file).len() as u64)
    }
    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        let file = self.get(name)?;
        let data = lock(&file);
        let start = usize::try_from(offset)
            .unwrap_or(usize::MAX)
            .min(data.len());
        let n = buf.len().min(data.len() - start);
        buf[..n].copy_from_slice(&data[start..start + n]);
        Ok(n)
    }
    fn create(&self, name: &str) -> io::Result<Box<dyn StorageFile>> {
        let file: MemFile = Arc::default();
        lock(&self.files).insert(name.to_owned(), file.clone());
        Ok(Box::new(MemHandle { file }))
    }
    fn truncate(&self, name: &str, len: u64) -> io::Result<()> {
        let file = self.get(name)?;
        let mut data = lock(&file);
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        if len > data.len() {
            data.resize(len, 0);
        } else {
            data.truncate(len);
        }
        Ok(())
    }
    fn sync(&self, name: &str) -> io::Result<()> {
        self.get(name).map(|_| ())
    }
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let mut files = lock(&self.files);
        let file = files.remove(from).ok_or_else(|| not_found(from))?;
        files.insert(to.to_owned(), file);
        Ok(())
    }
    fn remove(&self, name: &str) -> io::Result<()> {
        lock(&self.files)
            .remove(name)
            .map(|_| ())
            .ok_or_else(|| not_found(name))
    }
    fn sync_dir(&self) -> io::Result<()> {
        Ok(())
    }
}
