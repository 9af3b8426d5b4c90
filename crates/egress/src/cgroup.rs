//! The run's cgroups: a cgroup v2 directory for `cgroup.kill` (every process at once), a
//! `pids.max` bound against fork bombs and a `memory.max` bound against memory bombs, each
//! wherever its controller is (v2, or the v1 hierarchy of a hybrid host). Each is best effort:
//! without one, the PID namespace still ends every process when its PID 1 is killed, and
//! `notes` says what is missing and how to get it. The sandbox joins them before it unshares
//! its cgroup namespace, so they are the roots of what it sees (docs/EGRESS.md).

use std::path::{Path, PathBuf};

#[derive(Debug, Default)]
pub struct Cgroups {
    /// The v2 cgroup (has `cgroup.kill`).
    pub v2: Option<PathBuf>,
    /// The cgroup holding `pids.max` (the v2 one, or one in the v1 pids hierarchy).
    pub pids: Option<PathBuf>,
    /// The cgroup holding the memory bound (the v2 one's `memory.max`, or one in the v1 memory
    /// hierarchy with `memory.limit_in_bytes`).
    pub memory: Option<PathBuf>,
    /// What could not be set up, for the user.
    pub notes: Vec<String>,
}

impl Cgroups {
    /// Creates `estop-run-<id>` under this process's own cgroup in each hierarchy it can.
    pub fn create(id: &str, pids_max: u32, memory_max: u64) -> Cgroups {
        let mut cg = Cgroups::default();
        let name = format!("estop-run-{id}");
        match hierarchy("cgroup2", None).and_then(|dir| make(&dir.join(&name))) {
            Ok(dir) => cg.v2 = Some(dir),
            Err(e) => cg.notes.push(format!(
                "no cgroup v2 of its own ({e}): kill ends the sandbox through its PID namespace; \
                 to get one, give estop a delegated cgroup (systemd-run --user --scope -p \
                 Delegate=yes estop run …)"
            )),
        }
        let pids = cg.bounded("pids", &name, |dir, _| {
            std::fs::write(dir.join("pids.max"), pids_max.to_string())
        });
        match pids {
            Ok(dir) => cg.pids = Some(dir),
            Err(e) => cg.notes.push(format!(
                "no pids controller ({e}): a fork bomb is bounded only by the kernel's limits \
                 until kill ends it; enable the pids controller for estop's cgroup"
            )),
        }
        match cg.bounded("memory", &name, |dir, v2| set_memory(dir, v2, memory_max)) {
            Ok(dir) => cg.memory = Some(dir),
            Err(e) => cg.notes.push(format!(
                "no memory controller ({e}): memory_max does not hold, the sandbox's memory is \
                 bounded only by the host's; enable the memory controller for estop's cgroup"
            )),
        }
        cg
    }

    /// The cgroup for `controller` with its bound set by `set(dir, is_v2)`: the v2 one when
    /// the controller is enabled there, or a new one in the controller's v1 hierarchy (removed
    /// again when the bound cannot be set).
    fn bounded(
        &self,
        controller: &str,
        name: &str,
        set: impl FnOnce(&Path, bool) -> std::io::Result<()>,
    ) -> std::io::Result<PathBuf> {
        if let Some(dir) = self.v2.as_ref().filter(|d| has_controller(d, controller)) {
            set(dir, true)?;
            return Ok(dir.clone());
        }
        let dir = make(&hierarchy("cgroup", Some(controller))?.join(name))?;
        if let Err(e) = set(&dir, false) {
            let _ = std::fs::remove_dir(&dir);
            return Err(e);
        }
        Ok(dir)
    }

    /// Each cgroup directory once (a controller may share the v2 one).
    fn dirs(&self) -> Vec<&PathBuf> {
        let mut dirs: Vec<&PathBuf> = Vec::new();
        for dir in [&self.v2, &self.pids, &self.memory].into_iter().flatten() {
            if !dirs.contains(&dir) {
                dirs.push(dir);
            }
        }
        dirs
    }

    /// The `cgroup.procs` files the sandbox joins.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs()
            .into_iter()
            .map(|d| d.join("cgroup.procs"))
            .collect()
    }

    /// Kills every process in the v2 cgroup at once; false when there is none.
    pub fn kill(&self) -> bool {
        self.v2
            .as_ref()
            .is_some_and(|d| std::fs::write(d.join("cgroup.kill"), "1").is_ok())
    }

    /// Whether any process is left in the v2 cgroup (None without one).
    pub fn populated(&self) -> Option<bool> {
        let text = std::fs::read_to_string(self.v2.as_ref()?.join("cgroup.events")).ok()?;
        Some(text.lines().any(|l| l == "populated 1"))
    }

    /// Removes the cgroups; they are empty once the sandbox's PID 1 was reaped (or when it
    /// never started), but the kernel may take a moment to let go of a dead task's membership.
    fn remove(&self) {
        for dir in self.dirs() {
            for _ in 0..200 {
                match std::fs::remove_dir(dir) {
                    Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                        std::thread::sleep(std::time::Duration::from_millis(5))
                    }
                    _ => break,
                }
            }
        }
    }
}

/// The memory bound, swap included: v2 `memory.max` and `memory.swap.max = 0`; v1
/// `memory.limit_in_bytes` and, with swap accounting, `memory.memsw.limit_in_bytes` equal to it.
fn set_memory(dir: &Path, v2: bool, bytes: u64) -> std::io::Result<()> {
    let (limit, swap, swap_value) = if v2 {
        ("memory.max", "memory.swap.max", "0".to_string())
    } else {
        (
            "memory.limit_in_bytes",
            "memory.memsw.limit_in_bytes",
            bytes.to_string(),
        )
    };
    std::fs::write(dir.join(limit), bytes.to_string())?;
    if dir.join(swap).exists() {
        std::fs::write(dir.join(swap), swap_value)?;
    }
    Ok(())
}

/// Whatever way `estop run` ends (a sandbox that did not start included), its cgroups go.
impl Drop for Cgroups {
    fn drop(&mut self) {
        self.remove();
    }
}

fn make(dir: &Path) -> std::io::Result<PathBuf> {
    std::fs::create_dir(dir)?;
    Ok(dir.to_path_buf())
}

fn has_controller(dir: &Path, name: &str) -> bool {
    std::fs::read_to_string(dir.join("cgroup.controllers"))
        .is_ok_and(|c| c.split_whitespace().any(|x| x == name))
}

/// This process's own cgroup directory in the hierarchy of type `fstype` (`cgroup2`, or
/// `cgroup` with the v1 controller `controller`).
fn hierarchy(fstype: &str, controller: Option<&str>) -> std::io::Result<PathBuf> {
    let missing = || std::io::Error::new(std::io::ErrorKind::NotFound, "not mounted");
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    let mount = mountinfo
        .lines()
        .find_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let mut r = right.split_whitespace();
            let (fs, _src, opts) = (r.next()?, r.next()?, r.next().unwrap_or(""));
            let ok = fs == fstype && controller.is_none_or(|c| opts.split(',').any(|o| o == c));
            ok.then(|| left.split_whitespace().nth(4).map(PathBuf::from))?
        })
        .ok_or_else(missing)?;
    let own = std::fs::read_to_string("/proc/self/cgroup")?;
    let path = own
        .lines()
        .find_map(|line| {
            let mut parts = line.splitn(3, ':');
            let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
            let ok = match controller {
                None => ctrls.is_empty(),
                Some(c) => ctrls.split(',').any(|x| x == c),
            };
            ok.then(|| path.to_string())
        })
        .ok_or_else(missing)?;
    Ok(mount.join(path.trim_start_matches('/')))
}
