//! The sandbox's seccomp filter, installed by its PID 1 just before it runs the command, so
//! every process of the sandbox inherits it and none can lift it (docs/EGRESS.md, "What is
//! enforced"). It refuses what the namespaces do not contain:
//!
//! * sockets of any family but `AF_INET`, `AF_INET6`, `AF_UNIX` and `AF_NETLINK` with
//!   `NETLINK_ROUTE` (`EAFNOSUPPORT`): `AF_VSOCK` reaches the hypervisor and is not namespaced;
//!   route netlink sees the sandbox's own network namespace only (glibc's `if_nameindex`,
//!   `getifaddrs` and `getaddrinfo`'s `AI_ADDRCONFIG` use it);
//! * `io_uring_setup` (`EPERM`): a ring's `IORING_OP_SOCKET` makes sockets without `socket()`;
//! * a new cgroup namespace (`unshare`/`clone` with `CLONE_NEWCGROUP`, `EPERM`): a root agent
//!   owning one could mount its cgroup afresh and raise `pids.max`; `clone3`, whose flags a
//!   filter cannot read, answers `ENOSYS`, and the C library falls back to `clone`;
//! * another architecture's entry (i386's `int 0x80`: the process is killed) and, on x86-64,
//!   every x32 system call (`EPERM`): the same calls under other numbers.
//!
//! The programs are built with `seccompiler` (rust-vmm) except the x32 guard, six instructions.

use anyhow::{Context, Result, anyhow};
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op,
    SeccompCondition as Cond, SeccompFilter, SeccompRule, TargetArch,
};
use std::collections::BTreeMap;

/// `NETLINK_ROUTE`, the one netlink protocol the sandbox may open.
const NETLINK_ROUTE: u64 = 0;

/// Whether the filter is in force, or the kernel has no seccomp to enforce it with.
#[derive(Debug, PartialEq, Eq)]
pub enum Installed {
    Filter,
    NoKernelSupport,
}

/// Installs the filters on the calling thread (and so on every process it starts from now on),
/// with `no_new_privs` set. Fails when the kernel has seccomp and refuses them.
pub fn install() -> Result<Installed> {
    if !kernel_has_seccomp()? {
        return Ok(Installed::NoKernelSupport);
    }
    for (what, program) in programs()? {
        seccompiler::apply_filter(&program)
            .map_err(|e| anyhow!("{e}"))
            .with_context(|| format!("installing the sandbox's seccomp filter ({what})"))?;
    }
    Ok(Installed::Filter)
}

/// A kernel built without `CONFIG_SECCOMP` has no `Seccomp:` line in `/proc/self/status`.
fn kernel_has_seccomp() -> Result<bool> {
    let status = std::fs::read_to_string("/proc/self/status").context("/proc/self/status")?;
    Ok(status.lines().any(|l| l.starts_with("Seccomp:")))
}

/// The programs, each with what it refuses; the kernel applies the strictest answer of all.
pub fn programs() -> Result<Vec<(&'static str, BpfProgram)>> {
    let arch = TargetArch::try_from(std::env::consts::ARCH)
        .map_err(|e| anyhow!("no seccomp filter for this architecture: {e}"))?;
    let always = Vec::new;
    let newcgroup = || -> Result<Vec<SeccompRule>> {
        let flag = libc::CLONE_NEWCGROUP as u64;
        Ok(vec![rule(vec![cond(0, Op::MaskedEq(flag), flag)?])?])
    };
    let families = socket_rules()?;
    let mut out = vec![
        (
            "socket families",
            program(
                [
                    (libc::SYS_socket, families.clone()),
                    (libc::SYS_socketpair, families),
                ],
                libc::EAFNOSUPPORT,
                arch,
            )?,
        ),
        (
            "io_uring and cgroup namespaces",
            program(
                [
                    (libc::SYS_io_uring_setup, always()),
                    (libc::SYS_unshare, newcgroup()?),
                    (libc::SYS_clone, newcgroup()?),
                ],
                libc::EPERM,
                arch,
            )?,
        ),
        (
            "clone3",
            program([(libc::SYS_clone3, always())], libc::ENOSYS, arch)?,
        ),
    ];
    // The order does not matter: the kernel runs every filter and the strictest answer wins.
    #[cfg(target_arch = "x86_64")]
    out.insert(0, ("x32 system calls", x32_guard()));
    Ok(out)
}

/// `socket(domain, type, protocol)` and `socketpair` refused: a family outside the allowed
/// ones, or netlink with a protocol other than route. (An `int` argument: its low 32 bits are
/// what the kernel reads, and what is compared.)
fn socket_rules() -> Result<Vec<SeccompRule>> {
    let netlink = libc::AF_NETLINK as u64;
    let mut other_family = Vec::new();
    for family in [
        libc::AF_UNIX,
        libc::AF_INET,
        libc::AF_INET6,
        libc::AF_NETLINK,
    ] {
        other_family.push(cond(0, Op::Ne, family as u64)?);
    }
    Ok(vec![
        rule(other_family)?,
        rule(vec![
            cond(0, Op::Eq, netlink)?,
            cond(2, Op::Ne, NETLINK_ROUTE)?,
        ])?,
    ])
}

fn cond(arg: u8, op: Op, value: u64) -> Result<Cond> {
    Cond::new(arg, Len::Dword, op, value).map_err(|e| anyhow!("seccomp condition: {e}"))
}

fn rule(conditions: Vec<Cond>) -> Result<SeccompRule> {
    SeccompRule::new(conditions).map_err(|e| anyhow!("seccomp rule: {e}"))
}

/// A program answering `errno` to these calls when one of their rules matches (no rules:
/// always), and allowing everything else.
fn program<const N: usize>(
    calls: [(i64, Vec<SeccompRule>); N],
    errno: i32,
    arch: TargetArch,
) -> Result<BpfProgram> {
    let rules: BTreeMap<i64, Vec<SeccompRule>> = calls.into_iter().collect();
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(errno as u32),
        arch,
    )
    .map_err(|e| anyhow!("seccomp filter: {e}"))?;
    BpfProgram::try_from(filter).map_err(|e| anyhow!("seccomp program: {e}"))
}

/// x86-64 only: the x32 ABI shares the architecture value and sets bit 30 of the call number.
/// Kill a foreign architecture, refuse every x32 call, allow the rest (the other programs then
/// judge it by its x86-64 number).
#[cfg(target_arch = "x86_64")]
fn x32_guard() -> BpfProgram {
    use seccompiler::sock_filter;
    let stmt = |code: u32, k: u32| sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    };
    let jump = |code: u32, k: u32, jt: u8, jf: u8| sock_filter {
        code: code as u16,
        jt,
        jf,
        k,
    };
    const AUDIT_ARCH_X86_64: u32 = 62 | 0x8000_0000 | 0x4000_0000;
    const X32_BIT: u32 = 0x4000_0000;
    // struct seccomp_data: nr at 0, arch at 4.
    vec![
        stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 4),
        jump(
            libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K,
            AUDIT_ARCH_X86_64,
            1,
            0,
        ),
        stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_KILL_PROCESS),
        stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0),
        jump(libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K, X32_BIT, 0, 1),
        stmt(
            libc::BPF_RET | libc::BPF_K,
            libc::SECCOMP_RET_ERRNO | libc::EPERM as u32,
        ),
        stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ALLOW),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::io::Errno;
    use rustix::net::{AddressFamily, SocketFlags, SocketType, socket, socketpair};

    fn family(raw: i32) -> AddressFamily {
        AddressFamily::from_raw(raw as u16)
    }

    fn open(fam: i32, ty: SocketType, protocol: u32) -> Result<(), Errno> {
        let protocol = std::num::NonZeroU32::new(protocol).map(rustix::net::Protocol::from_raw);
        socket(family(fam), ty, protocol).map(drop)
    }

    /// Raw system calls the library does not wrap; `-errno` or the result.
    #[allow(unsafe_code)]
    fn raw(nr: i64, a: u64, b: u64) -> i64 {
        // SAFETY: every call made here takes integers or a null pointer (io_uring_setup's and
        // clone3's arguments), which the kernel checks; none writes memory of this process.
        let r = unsafe { libc::syscall(nr, a, b, 0u64, 0u64, 0u64) };
        if r < 0 {
            -i64::from(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
        } else {
            r
        }
    }

    /// Runs `check` on a thread of its own with the filters installed: a filter binds the
    /// thread that installs it (and what it starts), not the test's other threads.
    fn filtered(check: impl FnOnce() + Send + 'static) {
        std::thread::spawn(move || {
            assert_eq!(install().unwrap(), Installed::Filter);
            check();
        })
        .join()
        .unwrap();
    }

    #[test]
    fn inet_inet6_unix_and_route_netlink_are_the_only_sockets() {
        filtered(|| {
            let stream = SocketType::STREAM;
            let raw_type = SocketType::RAW;
            assert_eq!(open(libc::AF_INET, stream, 0), Ok(()));
            assert_eq!(open(libc::AF_INET6, stream, 0), Ok(()));
            assert_eq!(open(libc::AF_UNIX, stream, 0), Ok(()));
            assert!(socketpair(family(libc::AF_UNIX), stream, SocketFlags::empty(), None).is_ok());
            assert_eq!(open(libc::AF_NETLINK, raw_type, 0), Ok(()));
            let refused = Err(Errno::AFNOSUPPORT);
            assert_eq!(open(libc::AF_VSOCK, stream, 0), refused);
            assert_eq!(open(libc::AF_PACKET, raw_type, 0), refused);
            assert_eq!(open(libc::AF_ALG, SocketType::SEQPACKET, 0), refused);
            // NETLINK_GENERIC (16), NETLINK_AUDIT (9), NETLINK_KOBJECT_UEVENT (15).
            for protocol in [16, 9, 15] {
                assert_eq!(open(libc::AF_NETLINK, raw_type, protocol), refused);
            }
            let pair = socketpair(family(libc::AF_VSOCK), stream, SocketFlags::empty(), None);
            assert_eq!(pair.err(), Some(Errno::AFNOSUPPORT));
        });
    }

    #[test]
    fn io_uring_a_cgroup_namespace_clone3_and_x32_are_refused() {
        filtered(|| {
            let eperm = -i64::from(libc::EPERM);
            assert_eq!(raw(libc::SYS_io_uring_setup, 1, 0), eperm);
            let newcgroup = libc::CLONE_NEWCGROUP as u64;
            assert_eq!(raw(libc::SYS_unshare, newcgroup, 0), eperm);
            let child = raw(libc::SYS_clone, newcgroup | libc::SIGCHLD as u64, 0);
            if child == 0 {
                // Only if the filter let it through: the copy of this thread ends at once.
                #[allow(unsafe_code)]
                // SAFETY: _exit ends the forked child without touching shared state.
                unsafe {
                    libc::_exit(0)
                };
            }
            assert_eq!(child, eperm);
            assert_eq!(raw(libc::SYS_clone3, 0, 0), -i64::from(libc::ENOSYS));
            #[cfg(target_arch = "x86_64")]
            assert_eq!(raw(0x4000_0000 | libc::SYS_getpid, 0, 0), eperm);
        });
    }

    #[test]
    fn threads_and_processes_still_start_under_the_filter() {
        filtered(|| {
            // The C library's clone3 falls back to clone on ENOSYS.
            std::thread::spawn(|| ()).join().unwrap();
            let status = std::process::Command::new("true").status().unwrap();
            assert!(status.success());
            let unshared = raw(libc::SYS_unshare, 0, 0);
            assert_eq!(
                unshared, 0,
                "unshare without CLONE_NEWCGROUP is not refused"
            );
        });
    }
}
