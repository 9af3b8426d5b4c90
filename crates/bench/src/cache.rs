//! Cold reads for the recovery benchmark: evict a directory's files from the page cache, and
//! check that they are out. Dropping every cache (`/proc/sys/vm/drop_caches`, root only) is tried
//! first; then `posix_fadvise(DONTNEED)` on each file. Whatever was used, the files' resident
//! bytes are counted afterwards (`mincore`), so a warm read is never reported as cold.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// How the page cache was emptied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// `sync`, then `3` written to `/proc/sys/vm/drop_caches`: every clean page of the machine.
    DropCaches,
    /// `fdatasync` and `posix_fadvise(POSIX_FADV_DONTNEED)` on each file.
    Fadvise,
}

impl Method {
    pub fn name(self) -> &'static str {
        match self {
            Method::DropCaches => "drop_caches",
            Method::Fadvise => "fadvise_dontneed",
        }
    }
}

/// What an eviction left in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Evicted {
    pub method: Method,
    pub file_bytes: u64,
    /// Bytes of those files still in the page cache afterwards.
    pub resident_bytes: u64,
}

impl Evicted {
    /// At most 1% of the files is still cached: what is read next comes from the disk.
    pub fn is_cold(&self) -> bool {
        self.resident_bytes * 100 <= self.file_bytes
    }
}

/// Every regular file under `dir` (recursively).
fn files(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            let t = e.file_type()?;
            if t.is_dir() {
                todo.push(e.path());
            } else if t.is_file() {
                out.push(e.path());
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Evicts the files under `dir` from the page cache: with `drop_caches` if `first` is that
/// method and it is permitted, else with `fadvise`. `Err` if neither could run.
pub fn evict(dir: &Path, first: Method) -> io::Result<Evicted> {
    let paths = files(dir)?;
    // Dirty pages cannot be dropped: write everything back first.
    for p in &paths {
        File::open(p)?.sync_all()?;
    }
    let dropped = first == Method::DropCaches && {
        sync_all_filesystems();
        std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
    };
    let method = if dropped {
        Method::DropCaches
    } else {
        for p in &paths {
            fadvise_dontneed(&File::open(p)?)?;
        }
        Method::Fadvise
    };
    let (file_bytes, resident_bytes) = residency(&paths)?;
    Ok(Evicted {
        method,
        file_bytes,
        resident_bytes,
    })
}

/// Total and resident bytes of `paths`.
pub fn residency(paths: &[PathBuf]) -> io::Result<(u64, u64)> {
    let (mut total, mut resident) = (0, 0);
    for p in paths {
        let f = File::open(p)?;
        let len = f.metadata()?.len();
        total += len;
        resident += resident_bytes(&f, len)?;
    }
    Ok((total, resident))
}

/// Resident bytes of every file under `dir`.
pub fn residency_of_dir(dir: &Path) -> io::Result<(u64, u64)> {
    residency(&files(dir)?)
}

#[allow(unsafe_code)]
fn sync_all_filesystems() {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() }
}

#[allow(unsafe_code)]
fn fadvise_dontneed(f: &File) -> io::Result<()> {
    // SAFETY: the descriptor is open for the call's duration (borrowed from `f`); offset 0 and
    // length 0 mean the whole file.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}

/// Bytes of `f` (of length `len`) in the page cache, by `mincore` over a read-only mapping.
#[allow(unsafe_code)]
fn resident_bytes(f: &File, len: u64) -> io::Result<u64> {
    if len == 0 {
        return Ok(0);
    }
    let len = usize::try_from(len).map_err(io::Error::other)?;
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    // SAFETY: a fresh shared read-only mapping of an open file, at an address the kernel picks;
    // it is never dereferenced (mincore only asks the kernel about it) and unmapped below.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let mut vec = vec![0u8; len.div_ceil(page)];
    // SAFETY: `addr..addr+len` is the mapping made above; `vec` has one byte per page of it.
    let rc = unsafe { libc::mincore(addr, len, vec.as_mut_ptr()) };
    let err = io::Error::last_os_error();
    // SAFETY: unmaps exactly the mapping made above, which nothing else refers to.
    unsafe { libc::munmap(addr, len) };
    if rc != 0 {
        return Err(err);
    }
    let pages = vec.iter().filter(|b| **b & 1 == 1).count();
    Ok((pages * page).min(len) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn a_file_just_read_is_resident_and_eviction_reports_what_stayed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sub = dir.path().join("sub");
        std::fs::create_dir(&sub).expect("mkdir");
        let path = sub.join("f");
        let mut f = File::create(&path).expect("create");
        f.write_all(&vec![7u8; 1 << 20]).expect("write");
        f.sync_all().expect("sync");
        let mut back = Vec::new();
        File::open(&path)
            .expect("open")
            .read_to_end(&mut back)
            .expect("read");
        let (total, resident) = residency_of_dir(dir.path()).expect("residency");
        assert_eq!(total, 1 << 20);
        assert!(resident > 0 && resident <= total, "{resident} of {total}");
        // Not drop_caches here: a unit test must not empty the whole machine's page cache.
        match evict(dir.path(), Method::Fadvise) {
            Ok(e) => {
                assert_eq!(e.method, Method::Fadvise);
                assert_eq!(e.file_bytes, 1 << 20);
                // Both methods drop clean pages of a regular file on Linux's usual filesystems;
                // a filesystem that keeps them (tmpfs) is reported as not cold, which is the point.
                if e.is_cold() {
                    assert!(e.resident_bytes * 100 <= e.file_bytes);
                } else {
                    assert!(e.resident_bytes * 100 > e.file_bytes);
                }
            }
            Err(e) => panic!("fadvise is always permitted on a file one can open: {e}"),
        }
    }

    #[test]
    fn cold_means_at_most_one_percent_resident() {
        let e = |resident_bytes| Evicted {
            method: Method::Fadvise,
            file_bytes: 1000,
            resident_bytes,
        };
        assert!(e(0).is_cold());
        assert!(e(10).is_cold());
        assert!(!e(11).is_cold());
        assert!(!e(1000).is_cold());
    }
}
