//! The sandbox's filesystem ruleset (`[egress.filesystem]`), enforced with Landlock: with it,
//! the command and its children may read (and execute) only under `read`, and write only under
//! `write`; everything else on the host filesystem is refused (`EACCES`), whatever the uid's
//! permissions. Without it the sandbox sees the caller's filesystem as the caller
//! (docs/EGRESS.md, "What is not enforced").

use anyhow::{Context, Result, bail};
use landlock::{
    ABI, Access, AccessFs, PathBeneath, PathFd, Ruleset, RulesetAttr, RulesetCreatedAttr,
    RulesetStatus,
};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// What the ruleset lets the sandbox reach.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Filesystem {
    /// Read, list and execute beneath these.
    #[serde(default)]
    pub read: Vec<PathBuf>,
    /// Everything (create, write, remove…) beneath these.
    #[serde(default)]
    pub write: Vec<PathBuf>,
}

/// Device files every program expects, writable (they hold nothing of the host's).
const DEVICES: &[&str] = &[
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
];

/// The newest Landlock ABI this build knows; a kernel with an older one enforces what it has.
const ABI_NEWEST: ABI = ABI::V10;

impl Filesystem {
    /// Refuses what cannot be a rule: a relative path (what it names depends on the working
    /// directory at the sandbox's start).
    pub fn check(&self) -> Result<()> {
        for p in self.read.iter().chain(&self.write) {
            if !p.is_absolute() {
                bail!(
                    "[egress.filesystem]: {} is not an absolute path",
                    p.display()
                );
            }
        }
        Ok(())
    }

    /// Restricts this process and every child it starts from now on. `private_dir` (the run's
    /// protocol socket), `/proc` (the sandbox's own) and the files of `readable` (the egress
    /// CA the variables name) stay reachable. Fails, and the sandbox does not start, when a
    /// listed path does not exist or the kernel enforces no Landlock.
    pub fn restrict(&self, private_dir: &Path, readable: &[PathBuf]) -> Result<()> {
        let all = AccessFs::from_all(ABI_NEWEST);
        let read = AccessFs::from_read(ABI_NEWEST);
        let mut rules = Ruleset::default()
            .handle_access(all)?
            .create()
            .context("creating the Landlock ruleset")?;
        let implicit_read = readable.iter().cloned().chain([PathBuf::from("/proc")]);
        let implicit_write = DEVICES
            .iter()
            .map(PathBuf::from)
            .chain([private_dir.into()]);
        let listed = self
            .read
            .iter()
            .cloned()
            .chain(implicit_read)
            .map(|p| (p, read));
        let writable = self
            .write
            .iter()
            .cloned()
            .chain(implicit_write)
            .map(|p| (p, all));
        for (path, access) in listed.chain(writable) {
            let fd = PathFd::new(&path)
                .with_context(|| format!("[egress.filesystem]: {}", path.display()))?;
            // A file takes only the rights that apply to files.
            let access = if std::fs::metadata(&path).is_ok_and(|m| !m.is_dir()) {
                access & AccessFs::from_file(ABI_NEWEST)
            } else {
                access
            };
            rules = rules
                .add_rule(PathBeneath::new(fd, access))
                .with_context(|| format!("a Landlock rule for {}", path.display()))?;
        }
        let status = rules
            .restrict_self()
            .context("enforcing the Landlock ruleset")?;
        if status.ruleset == RulesetStatus::NotEnforced {
            bail!(
                "[egress.filesystem] needs Landlock, which this kernel does not enforce (it needs \
                 Linux 5.13 or later with `landlock` in the lsm= boot parameter or \
                 CONFIG_LSM); remove [egress.filesystem] to run without a filesystem ruleset"
            );
        }
        Ok(())
    }
}
