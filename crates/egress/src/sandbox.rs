//! The sandbox: fresh user, mount, network, PID, IPC and UTS namespaces around the agent's
//! command, with only loopback up, the daemon's data hidden, and the listeners the supervisor
//! serves created *inside* the network namespace and handed out by file descriptor.
//!
//! Processes (docs/EGRESS.md, "How `estop run` is built"):
//!
//! * the supervisor (`estop run`, host namespaces) spawns **stage 1** (`estop __estop-sandbox
//!   stage1 CONFIG`), a fresh single-threaded process: it joins the run's cgroups, unshares every
//!   namespace (a new user namespace too, also as root, so the sandbox has capabilities over its
//!   own namespaces only; a cgroup namespace whose roots are the run's cgroups), maps its ids,
//!   brings `lo` up, sets up the mounts (every cgroup filesystem covered read-only), binds the
//!   proxy, DNS-stub and protocol listeners and sends them to the supervisor over a socketpair;
//! * stage 1 spawns **stage 2**, PID 1 of the new PID namespace: it mounts `/proc`, unshares a
//!   second user and mount namespace (so every mount above is *locked*: the agent cannot unmount
//!   what hides the data directory or the host's cgroups), installs the seccomp filter
//!   (`seccomp.rs`), then runs the command and reaps orphans until it exits.
//!
//! When PID 1 ends, the kernel kills everything left in its PID namespace and stage 1's wait
//! returns only after all of it is gone: that is how the supervisor knows the whole tree ended.

use anyhow::{Context, Result, anyhow, bail};
use serde::{Deserialize, Serialize};
use std::io::{IoSlice, IoSliceMut};
use std::net::{TcpListener, UdpSocket};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};

/// The argument that marks the binary's hidden sandbox stages.
pub const STAGE_ARG: &str = "__estop-sandbox";

/// Where the DNS stub listens inside the sandbox (resolv.conf points here).
pub const DNS_PORT: u16 = 53;

/// Everything stage 1 and stage 2 need, passed as one JSON argument.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct StageConfig {
    /// Stage 1's end of the socketpair to the supervisor.
    pub fd: RawFd,
    /// `cgroup.procs` files stage 1 writes itself into before it unshares.
    pub cgroup_procs: Vec<PathBuf>,
    /// The ids outside: the agent runs as these (root stays root inside its own namespace).
    pub uid: u32,
    pub gid: u32,
    /// Covered with a tmpfs only the sandbox sees; the protocol socket is bound there.
    pub private_dir: PathBuf,
    /// Directories covered with an empty read-only tmpfs (the daemon's data directory,
    /// host resolver sockets).
    pub hide_dirs: Vec<PathBuf>,
    /// Files covered with /dev/null (a daemon socket outside the data directory).
    pub hide_files: Vec<PathBuf>,
    /// Bound over /etc/resolv.conf.
    pub resolv_conf: PathBuf,
    pub proxy_port: u16,
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    pub cwd: PathBuf,
    /// The Landlock ruleset, when `[egress.filesystem]` gives one.
    pub filesystem: Option<crate::fsrules::Filesystem>,
    /// Files the ruleset must leave readable (the egress CA's certificate).
    pub readable: Vec<PathBuf>,
}

impl StageConfig {
    pub fn socket_path(&self) -> PathBuf {
        self.private_dir.join("estop.sock")
    }
}

/// The listeners stage 1 created inside the sandbox's network and mount namespaces.
#[derive(Debug)]
pub struct Listeners {
    pub proxy: TcpListener,
    pub dns: UdpSocket,
    pub protocol: UnixListener,
}

/// A launched sandbox, seen from the supervisor.
#[derive(Debug)]
pub struct Launched {
    pub stage1: Child,
    /// PID 1 of the sandbox's PID namespace, as the host numbers it: SIGKILL to it ends every
    /// process of the sandbox.
    pub pid1: i32,
    pub listeners: Listeners,
}

/// If this process was started as a sandbox stage, runs it and returns its exit code.
pub fn stage_main() -> Option<i32> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) != Some(STAGE_ARG) {
        return None;
    }
    let run = || -> Result<i32> {
        let cfg: StageConfig = serde_json::from_str(args.get(3).context("no stage config")?)?;
        match args.get(2).map(String::as_str) {
            Some("stage1") => stage1(&cfg),
            Some("stage2") => stage2(&cfg),
            other => bail!("unknown sandbox stage {other:?}"),
        }
    };
    Some(run().unwrap_or_else(|e| {
        eprintln!("estop run: sandbox: {e:#}");
        125
    }))
}

/// Spawns stage 1 and receives the listeners it made; `cfg.fd` is filled in here.
pub fn launch(mut cfg: StageConfig) -> Result<Launched> {
    let (ours, theirs) = UnixStream::pair()?;
    // Stage 1 inherits its end: clear close-on-exec on that one descriptor only.
    rustix::io::fcntl_setfd(&theirs, rustix::io::FdFlags::empty())?;
    cfg.fd = theirs.as_raw_fd();
    let exe = std::env::current_exe().context("locating the estop binary")?;
    // The stages get the sandbox's environment, not the supervisor's: stage 2 is the
    // sandbox's PID 1, whose /proc/1/environ the agent can read (ESTOP_TOKEN, credentials).
    let stage1 = Command::new(exe)
        .arg(STAGE_ARG)
        .arg("stage1")
        .arg(serde_json::to_string(&cfg)?)
        .env_clear()
        .envs(cfg.env.iter().map(|(k, v)| (k, v)))
        .spawn()
        .context("starting the sandbox")?;
    drop(theirs);
    let mut child = stage1;
    match receive(&ours) {
        Ok((listeners, pid1)) => Ok(Launched {
            stage1: child,
            pid1,
            listeners,
        }),
        Err(e) => {
            // Stage 1 printed why (its diagnostic); collect it so no zombie is left.
            let status = child.wait()?;
            Err(e.context(format!("the sandbox did not start ({status})")))
        }
    }
}

fn receive(sock: &UnixStream) -> Result<(Listeners, i32)> {
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(3))];
    let mut cmsg = rustix::net::RecvAncillaryBuffer::new(&mut space);
    let mut buf = [0u8; 32];
    let n = rustix::net::recvmsg(
        sock,
        &mut [IoSliceMut::new(&mut buf)],
        &mut cmsg,
        rustix::net::RecvFlags::CMSG_CLOEXEC,
    )?
    .bytes;
    let mut fds: Vec<OwnedFd> = Vec::new();
    for msg in cmsg.drain() {
        if let rustix::net::RecvAncillaryMessage::ScmRights(rights) = msg {
            fds.extend(rights);
        }
    }
    if n == 0 || fds.len() != 3 {
        bail!("stage 1 ended before it handed over its listeners");
    }
    let pid1: i32 = std::str::from_utf8(&buf[..n])?.trim().parse()?;
    let mut fds = fds.into_iter();
    let mut next = || fds.next().expect("three descriptors");
    Ok((
        Listeners {
            proxy: TcpListener::from(next()),
            dns: UdpSocket::from(next()),
            protocol: UnixListener::from(next()),
        },
        pid1,
    ))
}

/// What to enable when the kernel refuses a new user namespace.
fn userns_diagnostic(e: rustix::io::Errno) -> anyhow::Error {
    anyhow!(
        "the kernel refused new namespaces ({e}). estop run needs unprivileged user namespaces: \
         `sysctl -w user.max_user_namespaces=15000` (must be > 0), on Debian/older Ubuntu \
         `sysctl -w kernel.unprivileged_userns_clone=1`, on Ubuntu 24.04+ \
         `sysctl -w kernel.apparmor_restrict_unprivileged_userns=0` (or an AppArmor profile \
         allowing `userns` for estop); inside a container, run it with seccomp allowing \
         unshare/clone (e.g. docker --security-opt seccomp=unconfined) or as a privileged one"
    )
}

/// Stage 1: namespaces, loopback, mounts, listeners; then stage 2 and its exit status.
fn stage1(cfg: &StageConfig) -> Result<i32> {
    // SAFETY: `cfg.fd` is the socketpair end the supervisor left open for us; nothing else in
    // this fresh process owns it.
    #[allow(unsafe_code)]
    let sup = unsafe { OwnedFd::from_raw_fd(cfg.fd) };
    rustix::io::fcntl_setfd(&sup, rustix::io::FdFlags::CLOEXEC)?;
    for procs in &cfg.cgroup_procs {
        std::fs::write(procs, "0").with_context(|| format!("joining {}", procs.display()))?;
    }
    use rustix::thread::UnshareFlags as U;
    let mut flags = U::NEWUSER | U::NEWNS | U::NEWNET | U::NEWPID | U::NEWIPC | U::NEWUTS;
    // Unshared after joining the run's cgroups: they are the roots of what the sandbox sees.
    let cgroup_ns = Path::new("/proc/self/ns/cgroup").exists();
    if cgroup_ns {
        flags |= U::NEWCGROUP;
    } else {
        eprintln!(
            "estop run: this kernel has no cgroup namespaces (Linux 4.6+, CONFIG_CGROUPS): the \
             sandbox's cgroup filesystems are hidden instead"
        );
    }
    // SAFETY: this process is single-threaded (a fresh exec, no thread spawned yet) and FILES
    // is not among the flags.
    #[allow(unsafe_code)]
    unsafe { rustix::thread::unshare_unsafe(flags) }.map_err(userns_diagnostic)?;
    map_ids(0, cfg.uid, 0, cfg.gid)?;
    loopback_up().context("bringing up lo")?;
    mounts(cfg, cgroup_ns)?;
    let proxy = TcpListener::bind(("127.0.0.1", cfg.proxy_port)).context("proxy listener")?;
    let dns = UdpSocket::bind(("127.0.0.1", DNS_PORT)).context("DNS stub listener")?;
    let protocol = UnixListener::bind(cfg.socket_path()).context("protocol socket")?;
    // Stage 1 must outlive the sandbox's PID 1 to report the end of the whole tree: a Ctrl-C
    // or SIGTERM aimed at the process group reaches the supervisor, which kills PID 1.
    set_stop_signals(libc::SIG_IGN);
    let exe = std::env::current_exe()?;
    let mut stage2 = Command::new(exe)
        .arg(STAGE_ARG)
        .arg("stage2")
        .arg(serde_json::to_string(cfg)?)
        .spawn()
        .context("starting the sandbox's PID 1")?;
    let fds = [proxy.as_fd(), dns.as_fd(), protocol.as_fd()];
    send(&sup, &fds, stage2.id())?;
    drop((proxy, dns, protocol));
    let status = stage2.wait()?;
    Ok(exit_code(status))
}

fn send(sup: &OwnedFd, fds: &[BorrowedFd<'_>], pid: u32) -> Result<()> {
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(3))];
    let mut cmsg = rustix::net::SendAncillaryBuffer::new(&mut space);
    if !cmsg.push(rustix::net::SendAncillaryMessage::ScmRights(fds)) {
        bail!("ancillary buffer too small");
    }
    let text = pid.to_string();
    rustix::net::sendmsg(
        sup,
        &[IoSlice::new(text.as_bytes())],
        &mut cmsg,
        rustix::net::SendFlags::empty(),
    )?;
    Ok(())
}

/// Stage 2, PID 1 of the sandbox: /proc, the locking namespaces, the command, the reaping.
fn stage2(cfg: &StageConfig) -> Result<i32> {
    use rustix::mount::MountFlags as M;
    rustix::mount::mount(
        "proc",
        "/proc",
        "proc",
        M::NOSUID | M::NODEV | M::NOEXEC,
        None,
    )
    .context("mounting /proc for the sandbox's PID namespace")?;
    use rustix::thread::UnshareFlags as U;
    // A mount namespace owned by a less privileged user namespace gets every mount above
    // locked: the agent cannot peel off what hides the daemon's data.
    // SAFETY: single-threaded fresh process; FILES is not among the flags.
    #[allow(unsafe_code)]
    unsafe { rustix::thread::unshare_unsafe(U::NEWUSER | U::NEWNS) }
        .context("locking the sandbox's mounts")?;
    map_ids(cfg.uid, 0, cfg.gid, 0)?;
    // Dispositions survive exec: the command gets the default ones back.
    set_stop_signals(libc::SIG_DFL);
    if let Some(fs) = &cfg.filesystem {
        fs.restrict(&cfg.private_dir, &cfg.readable)?;
    }
    // Last before the command: nothing of the sandbox's own set-up is refused by it.
    if crate::seccomp::install()? == crate::seccomp::Installed::NoKernelSupport {
        eprintln!(
            "estop run: this kernel has no seccomp (CONFIG_SECCOMP): sockets of other families \
             than inet, inet6 and unix, io_uring and new cgroup namespaces are not refused"
        );
    }
    let (program, args) = cfg.argv.split_first().context("no command given")?;
    let child = Command::new(program)
        .args(args)
        .env_clear()
        .envs(cfg.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&cfg.cwd)
        .spawn()
        .with_context(|| format!("cannot run {program:?}"))?;
    let main = rustix::process::Pid::from_raw(child.id() as i32).context("child pid")?;
    // PID 1 reaps every orphan of the sandbox; its own exit ends the rest.
    loop {
        match rustix::process::wait(rustix::process::WaitOptions::empty()) {
            Ok(Some((pid, status))) if pid == main => return Ok(wait_code(status)),
            Ok(_) => continue,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Maps one uid and one gid of the parent user namespace into the new one.
fn map_ids(inner_uid: u32, outer_uid: u32, inner_gid: u32, outer_gid: u32) -> Result<()> {
    std::fs::write("/proc/self/setgroups", "deny").context("setgroups")?;
    std::fs::write("/proc/self/uid_map", format!("{inner_uid} {outer_uid} 1\n"))
        .context("uid_map")?;
    std::fs::write("/proc/self/gid_map", format!("{inner_gid} {outer_gid} 1\n"))
        .context("gid_map")?;
    Ok(())
}

fn tmpfs(dir: &Path, flags: rustix::mount::MountFlags, opts: &str) -> Result<()> {
    let opts = std::ffi::CString::new(opts).expect("no NUL");
    rustix::mount::mount("tmpfs", dir, "tmpfs", flags, Some(opts.as_c_str()))
        .with_context(|| format!("covering {} with a tmpfs", dir.display()))
}

fn mounts(cfg: &StageConfig, cgroup_ns: bool) -> Result<()> {
    use rustix::mount::{MountFlags as M, MountPropagationFlags as P};
    // Nothing done here may reach the host's mount table.
    rustix::mount::mount_change("/", P::REC | P::PRIVATE).context("making / private")?;
    cover_cgroups(cgroup_ns)?;
    tmpfs(&cfg.private_dir, M::NOSUID | M::NODEV, "mode=0755,size=1m")?;
    for dir in &cfg.hide_dirs {
        tmpfs(
            dir,
            M::RDONLY | M::NOSUID | M::NODEV | M::NOEXEC,
            "mode=0555,size=4k",
        )?;
    }
    for file in &cfg.hide_files {
        rustix::mount::mount_bind("/dev/null", file)
            .with_context(|| format!("hiding {}", file.display()))?;
    }
    // /etc/resolv.conf may be a dangling symlink (resolved not running): then name lookups
    // already have nowhere to go inside the sandbox, and the stub is only a nicety.
    if let Err(e) = rustix::mount::mount_bind(&cfg.resolv_conf, "/etc/resolv.conf") {
        eprintln!("estop run: /etc/resolv.conf not replaced ({e}); lookups still fail");
    }
    Ok(())
}

/// Covers every cgroup filesystem of the host's, read-only: a cgroup2 one with a fresh mount of
/// the sandbox's cgroup namespace (rooted at the run's cgroup: its bounds are readable, nothing
/// is writable), any other with an empty tmpfs. A root agent could otherwise write its PID to
/// the host's `cgroup.procs` and leave its bounds. The covers are locked by stage 2's namespaces;
/// no other cgroup filesystem can be mounted without `CAP_SYS_ADMIN` over the cgroup namespace's
/// owner (stage 1's user namespace), and a namespace of the agent's own is refused by seccomp.
fn cover_cgroups(cgroup_ns: bool) -> Result<()> {
    use rustix::mount::MountFlags as M;
    let flags = M::RDONLY | M::NOSUID | M::NODEV | M::NOEXEC;
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").context("mountinfo")?;
    let mut covered: Vec<PathBuf> = Vec::new();
    for (point, fstype) in cgroup_mounts(&mountinfo) {
        if covered.iter().any(|c| point.starts_with(c)) {
            continue;
        }
        let fresh = (fstype == "cgroup2" && cgroup_ns)
            .then(|| rustix::mount::mount("cgroup2", &point, "cgroup2", flags, None))
            .is_some_and(|r| r.is_ok());
        if !fresh {
            tmpfs(&point, flags, "mode=0555,size=4k")
                .with_context(|| format!("hiding the host's cgroups at {}", point.display()))?;
        }
        covered.push(point);
    }
    Ok(())
}

/// Mount points and types of the `cgroup` and `cgroup2` mounts in `/proc/self/mountinfo`.
fn cgroup_mounts(mountinfo: &str) -> Vec<(PathBuf, String)> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let fstype = right.split_whitespace().next()?;
            let point = left.split_whitespace().nth(4)?;
            (fstype == "cgroup" || fstype == "cgroup2")
                .then(|| (PathBuf::from(unescape(point)), fstype.to_string()))
        })
        .collect()
}

/// mountinfo writes space, tab, newline and backslash in a path as `\ooo` (octal).
fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) if b[i] == b'\\' => {
                out.push(d.iter().fold(0u8, |n, c| n.wrapping_mul(8) + (c - b'0')));
                i += 4;
            }
            _ => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Sets the disposition of SIGINT, SIGTERM, SIGHUP and SIGQUIT (ignore, or default).
fn set_stop_signals(disposition: libc::sighandler_t) {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT] {
        // SAFETY: SIG_IGN and SIG_DFL install no handler code; this process is single-threaded.
        #[allow(unsafe_code)]
        unsafe {
            libc::signal(sig, disposition);
        }
    }
}

/// `ip link set lo up`, through the ioctl every Linux has.
fn loopback_up() -> Result<()> {
    use rustix::net::{AddressFamily, SocketType, socket};
    let sock = socket(AddressFamily::INET, SocketType::DGRAM, None)?;
    // SAFETY: `ifreq` is plain old data; the ioctls read and write only inside it, and `sock`
    // is a valid socket for the duration of the calls.
    #[allow(unsafe_code)]
    unsafe {
        let mut req: libc::ifreq = std::mem::zeroed();
        for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
            *dst = *src as libc::c_char;
        }
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
    }
    Ok(())
}

fn exit_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

fn wait_code(status: rustix::process::WaitStatus) -> i32 {
    if let Some(code) = status.exit_status() {
        code
    } else {
        128 + status.terminating_signal().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_cgroup_mount_is_found_with_its_escaped_path() {
        let mountinfo = "\
25 1 0:23 / /sys rw,nosuid - sysfs sysfs rw
31 25 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
50 1 0:38 / /srv/my\\040cgroups rw - cgroup2 cgroup2 rw
";
        let found: Vec<(PathBuf, String)> = cgroup_mounts(mountinfo);
        let expect = |p: &str, t: &str| (PathBuf::from(p), t.to_string());
        assert_eq!(
            found,
            vec![
                expect("/sys/fs/cgroup/pids", "cgroup"),
                expect("/sys/fs/cgroup/unified", "cgroup2"),
                expect("/srv/my cgroups", "cgroup2"),
            ]
        );
        assert_eq!(unescape("a\\134b\\011"), "a\\b\t");
        assert_eq!(unescape("trailing\\04"), "trailing\\04");
    }
}
