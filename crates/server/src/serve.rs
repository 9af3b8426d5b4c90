//! `estop serve`: opens the data dir (tokens, policy, ledger), recovers the state, starts the
//! core thread and the listeners, prints the ready line, and runs until SIGTERM or SIGINT.

use crate::conn::{self, ConnOptions, Shared};
use crate::core::{CoreMsg, CoreOptions, Shell};
use crate::durable::DurableState;
use crate::journal;
use crate::tokens::{TokenError, Tokens};
use estop_kernel::Limits;
use estop_ledger::{FileStorage, LedgerError, LedgerOptions, Storage};
use estop_policy::{Policy, PolicyError};
use std::net::SocketAddr;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, mpsc};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{Semaphore, watch};

#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub data: PathBuf,
    /// Optional TCP address for protocol v1.
    pub listen: Option<String>,
    /// Optional TCP address for the SoundGate-compatible protocol.
    pub soundgate_listen: Option<String>,
    /// HMAC secret for SoundGate `decide` tags.
    pub soundgate_secret: Option<String>,
    /// Without a secret, accept SoundGate `decide` unauthenticated (off by default: holds are
    /// then decided on the operator channel only).
    pub soundgate_unauthenticated_decide: bool,
    pub policy: Option<PathBuf>,
    /// Allow every tool (benchmarks); ignored when `policy` is given.
    pub allow_all: bool,
    pub connections_max: usize,
    /// Protocol v1 connections one principal may hold (default: a quarter of `connections_max`).
    pub connections_per_principal_max: Option<usize>,
    /// What one token and its sandboxes may hold of it (default: half).
    pub connections_per_token_max: Option<usize>,
    /// Connections of the SoundGate listener, a pool of its own (it has no principals).
    pub soundgate_connections_max: usize,
    /// Threads serving connections (1: a single IO thread).
    pub io_threads: usize,
    pub conn: ConnOptions,
    pub core: CoreOptions,
    pub limits: Limits,
    pub ledger: LedgerOptions,
    /// `Some(url)`: the PostgreSQL store (docs/STORES.md) instead of the embedded ledger.
    pub store: Option<String>,
    /// Write fresh bootstrap tokens although the registry is missing and the ledger was
    /// written (the way out of `TokenError::Missing`; every other token stays revoked).
    pub reset_tokens: bool,
}

impl ServeOptions {
    pub fn new(data: PathBuf) -> ServeOptions {
        ServeOptions {
            data,
            listen: None,
            soundgate_listen: None,
            soundgate_secret: None,
            soundgate_unauthenticated_decide: false,
            policy: None,
            allow_all: false,
            connections_max: 4096,
            connections_per_principal_max: None,
            connections_per_token_max: None,
            soundgate_connections_max: 1024,
            io_threads: 1,
            conn: ConnOptions::default(),
            core: CoreOptions::default(),
            limits: Limits::default(),
            ledger: LedgerOptions::default(),
            store: None,
            reset_tokens: false,
        }
    }
}

impl ServeOptions {
    /// The tuning knobs the environment may set, read once, here, at start (nothing below
    /// `serve` reads the environment): `ESTOP_INLINE_SYNC=0` (every sync on the ledger's sync
    /// thread), `ESTOP_CORE_SPIN_US` (how long the core watches its queue after a lone request),
    /// `ESTOP_IO_THREADS` (threads serving connections), and in debug builds only
    /// `ESTOP_DEBUG_PANIC_CORE_AFTER` (a planted core panic for the tests of the fatal hook) and
    /// `ESTOP_DEBUG_PLANT_REPLY_BEFORE_COMMIT` (the PostgreSQL store's planted bug).
    pub fn with_environment(mut self) -> ServeOptions {
        let var = |k: &str| std::env::var(k).ok();
        if let Some(v) = var("ESTOP_INLINE_SYNC") {
            self.core.inline_sync = v != "0";
        }
        if let Some(us) = var("ESTOP_CORE_SPIN_US").and_then(|v| v.parse().ok()) {
            self.core.idle_spin = Duration::from_micros(us);
        }
        if let Some(n) = var("ESTOP_IO_THREADS").and_then(|v| v.parse().ok()) {
            self.io_threads = n;
        }
        #[cfg(debug_assertions)]
        {
            self.core.planted_panic_after_records =
                var("ESTOP_DEBUG_PANIC_CORE_AFTER").and_then(|v| v.parse().ok());
            self.core.planted_reply_before_commit =
                var("ESTOP_DEBUG_PLANT_REPLY_BEFORE_COMMIT").is_some_and(|v| v == "1");
        }
        self
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("policy: {0}")]
    Policy(#[from] PolicyError),
    #[error("tokens: {0}")]
    Tokens(#[from] TokenError),
    #[error("ledger: {0}")]
    Ledger(#[from] LedgerError),
    #[error("store: {0}")]
    Store(#[from] crate::pgstore::StoreError),
    #[error("{0}")]
    Setup(String),
}

impl ServeError {
    pub fn code(&self) -> &'static str {
        match self {
            ServeError::Policy(e) => e.code(),
            ServeError::Tokens(_) => "tokens",
            ServeError::Ledger(e) => e.code(),
            ServeError::Store(e) => e.code(),
            ServeError::Setup(_) => "setup",
        }
    }
}

/// What `estop ready` reports.
#[derive(Debug, Clone)]
pub struct Ready {
    pub socket: PathBuf,
    pub tcp: Option<SocketAddr>,
    pub soundgate: Option<SocketAddr>,
    pub data: PathBuf,
    /// `key=value` pairs of the services (`console=…`), appended to the line.
    pub extra: Vec<(String, String)>,
    /// Lines for the operator's terminal after the ready line (a one-time login link).
    pub notices: Vec<String>,
}

impl Ready {
    /// The ready line of SPEC §4.3.
    pub fn line(&self) -> String {
        let addr = |a: &Option<SocketAddr>| a.map_or_else(|| "-".to_string(), |a| a.to_string());
        format!(
            "estop ready socket={} tcp={} soundgate={} data={}",
            self.socket.display(),
            addr(&self.tcp),
            addr(&self.soundgate),
            self.data.display()
        ) + &self
            .extra
            .iter()
            .map(|(k, v)| format!(" {k}={v}"))
            .collect::<String>()
    }
}

fn setup(msg: String) -> ServeError {
    ServeError::Setup(msg)
}

/// Descriptors one connection may hold: its socket, the duplicate durable replies are written
/// to ([`crate::outbox`]), and another while its writer waits for a full socket to drain.
const FDS_PER_CONNECTION: u64 = 3;

/// Raises the soft limit on open files to what `connections_max` connections need (at most the
/// hard limit; many systems start services at a soft limit of 1024), and warns when the hard
/// limit is lower. Past the limit, a new connection is refused at accept, not served half.
#[allow(unsafe_code)]
fn raise_open_file_limit(connections_max: usize) {
    let want = (connections_max as u64)
        .saturating_mul(FDS_PER_CONNECTION)
        .saturating_add(256); // ledger segments, listeners, the console, spare
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit for the duration of the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return;
    }
    let target = want.min(lim.rlim_max);
    if lim.rlim_cur < target {
        let raised = libc::rlimit {
            rlim_cur: target,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: `raised` is a valid rlimit for the duration of the call.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim.rlim_cur = target;
        }
    }
    if lim.rlim_cur < want {
        crate::log::warn(&format!(
            "open-file limit is {} (hard {}); connections_max = {connections_max} needs about {want}: raise the hard limit (ulimit -Hn, LimitNOFILE=) or lower --connections-max",
            lim.rlim_cur, lim.rlim_max
        ));
    }
}

/// Runs the daemon until SIGTERM/SIGINT. `on_ready` is called once everything is listening.
pub fn run(opts: ServeOptions, on_ready: impl FnOnce(&Ready)) -> Result<(), ServeError> {
    run_with(opts, Vec::new(), on_ready)
}

/// `run`, with services (the console) started beside the listeners before the ready line.
pub fn run_with(
    opts: ServeOptions,
    services: Vec<Box<dyn crate::service::Service>>,
    on_ready: impl FnOnce(&Ready),
) -> Result<(), ServeError> {
    crate::fatal::install_panic_hook();
    let mut opts = opts.with_environment();
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&opts.data)
        .map_err(|e| {
            setup(format!(
                "cannot create data dir {}: {e}",
                opts.data.display()
            ))
        })?;
    // The data dir holds the secrets and the socket: only its owner may look inside. An
    // existing dir is narrowed too; a chmod that fails stops the start rather than leave it open.
    make_private(&opts.data, 0o700, "data dir")?;
    raise_open_file_limit(opts.connections_max);
    let data = std::fs::canonicalize(&opts.data)
        .map_err(|e| setup(format!("data dir {}: {e}", opts.data.display())))?;
    let policy = Arc::new(match (&opts.policy, opts.allow_all) {
        (Some(path), _) => Policy::load(path)?,
        (None, true) => Policy::allow_all(),
        (None, false) => Policy::default(),
    });
    // Compensating calls are checked against the policy that admits the calls they undo.
    opts.core.compensation_policy = Some(Arc::clone(&policy));
    // Admission tokens are sealed with the daemon's key (every node's, on PostgreSQL).
    let seal = crate::seal::load(&data, opts.store.as_deref()).map_err(setup)?;
    opts.core.seal = seal.clone();
    // On a PostgreSQL store the tokens are every node's, in the database (docs/STORES.md).
    let (tokens, created) = match &opts.store {
        None => Tokens::open_or_bootstrap(&data, opts.reset_tokens)?,
        Some(url) => Tokens::open_in_database(&data, url, opts.reset_tokens)?,
    };
    let tokens = Arc::new(tokens);
    if created && opts.reset_tokens {
        crate::log::warn(&format!(
            "--reset-tokens: wrote fresh bootstrap tokens in {}; every other token is gone",
            data.display()
        ));
    }
    if created {
        crate::log::info(&format!(
            "first start: wrote {} (operator \"admin\") and {} (agent \"agent\"), mode 0600",
            data.join("operator.token").display(),
            data.join("agent.token").display()
        ));
    }
    let ledger_dir = data.join("ledger");
    let (durable_tx, durable_rx) = watch::channel(DurableState::default());
    let durable_tx = Arc::new(durable_tx);
    let (core_tx, core_rx) = mpsc::channel::<CoreMsg>();
    let sync_stats = Arc::new(estop_ledger::SyncStats::default());
    let run_core: Box<dyn FnOnce() + Send> = match &opts.store {
        None => {
            let core = ledger_shell(&opts, &ledger_dir, &durable_tx, &core_tx, &sync_stats)?;
            Box::new(move || core.run(core_rx))
        }
        Some(url) => {
            let registry = Arc::clone(&tokens);
            let on_tokens: crate::pgnode::OnTokens = Box::new(move || {
                if let Err(e) = registry.refresh() {
                    crate::log::warn(&format!("tokens: {e}"));
                }
            });
            let core = crate::pgnode::shell(
                &opts.core,
                &opts.limits,
                url,
                (&durable_tx, &core_tx),
                on_tokens,
            )?;
            crate::pgstore::remember(&data, url)?;
            Box::new(move || core.run(core_rx))
        }
    };
    let core_thread = std::thread::Builder::new()
        .name(crate::fatal::CORE_THREAD_NAME.into())
        .spawn(run_core)
        .map_err(|e| setup(format!("cannot start the core thread: {e}")))?;

    let shared = Arc::new(Shared {
        core_tx: core_tx.clone().into(),
        tokens,
        policy,
        durable_rx,
        opts: opts.conn.clone(),
        ledger_dir,
        store: match &opts.store {
            Some(url) => Some(crate::pgstore::Target::parse(url)?),
            None => None,
        },
        next_conn: AtomicU64::new(1),
        seal,
    });
    if created {
        crate::tokenops::record_bootstrap(&shared);
    }
    let runtime = match opts.io_threads {
        // One IO thread beside the core and sync threads: no work stealing, fewer wakeups.
        // It hands requests to the core in batches (`handoff`): what it holds goes before it
        // waits for IO.
        1 => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .on_thread_park(crate::handoff::flush)
            .build(),
        n => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(n.max(2))
            .enable_all()
            .thread_name("estop-io")
            .build(),
    }
    .map_err(|e| setup(format!("cannot start the runtime: {e}")))?;
    if opts.io_threads == 1 {
        // This thread runs the runtime.
        shared.core_tx.batch_on_this_thread();
    }
    let mut socket_id = None;
    let result = runtime.block_on(serve_async(
        &opts,
        &data,
        shared,
        on_ready,
        &mut socket_id,
        (services, sync_stats),
    ));
    crate::handoff::end_batching();
    // Finish in-flight syncs before exiting.
    let (done_tx, done_rx) = mpsc::channel();
    if core_tx.send(CoreMsg::Shutdown { done: done_tx }).is_ok() {
        let _ = done_rx.recv();
    }
    let _ = core_thread.join();
    runtime.shutdown_timeout(std::time::Duration::from_millis(500));
    remove_own_socket(&data.join("estop.sock"), socket_id);
    crate::log::info("stopped");
    result
}

/// The core's shell over the embedded ledger in `ledger_dir`.
fn ledger_shell(
    opts: &ServeOptions,
    ledger_dir: &Path,
    durable_tx: &Arc<watch::Sender<DurableState>>,
    core_tx: &mpsc::Sender<CoreMsg>,
    sync_stats: &Arc<estop_ledger::SyncStats>,
) -> Result<Shell, ServeError> {
    let storage: Arc<dyn Storage> = Arc::new(FileStorage::open(ledger_dir)?);
    let limits = opts.limits.clone();
    let mut ledger_opts = opts.ledger.clone();
    ledger_opts.sync_stats = estop_ledger::SyncObserver(Some(Arc::clone(sync_stats)));
    let open: crate::core::OpenFn = Box::new(move |discard_after| {
        let o = journal::open(
            Arc::clone(&storage),
            &limits,
            LedgerOptions {
                discard_after,
                ..ledger_opts.clone()
            },
        )?;
        let r = &o.report;
        crate::log::info(&format!(
            "ledger recovered: {} records replayed{}, last seq {}{}",
            r.records_replayed,
            r.snapshot.as_ref().map_or(String::new(), |s| format!(
                " after snapshot at seq {}",
                s.seq
            )),
            r.last_seq,
            r.torn_tail.as_ref().map_or(String::new(), |t| format!(
                "; truncated a torn tail of {} bytes in {} at offset {}",
                t.bytes_dropped, t.segment, t.offset
            )),
        ));
        Ok(o)
    });
    Shell::new(
        opts.core.clone(),
        Arc::clone(durable_tx),
        open,
        core_tx.clone(),
    )
    .map_err(|e| match e {
        journal::JournalError::Ledger(l) => ServeError::Ledger(l),
    })
}

/// The (device, inode) of a socket file, to recognise our own at shutdown.
fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

/// Removes the socket file only if it is still the one this daemon bound: a successor may
/// already be listening at the same path.
fn remove_own_socket(path: &Path, ours: Option<(u64, u64)>) {
    if ours.is_some() && file_id(path) == ours {
        let _ = std::fs::remove_file(path);
    }
}

async fn bind_unix(path: &Path) -> Result<UnixListener, ServeError> {
    if path.exists() {
        if tokio::net::UnixStream::connect(path).await.is_ok() {
            return Err(setup(format!(
                "another estop serve is listening on {}",
                path.display()
            )));
        }
        let _ = std::fs::remove_file(path);
    }
    let l = UnixListener::bind(path)
        .map_err(|e| setup(format!("cannot listen on {}: {e}", path.display())))?;
    make_private(path, 0o600, "socket")?;
    Ok(l)
}

/// Sets `path`'s mode exactly; a failure is fatal with a message that says what to do.
fn make_private(path: &Path, mode: u32, what: &str) -> Result<(), ServeError> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(|e| {
        setup(format!(
            "cannot make the {what} {} private (chmod {mode:o}): {e}; run estop serve as the owner of its data dir",
            path.display()
        ))
    })
}

async fn bind_tcp(addr: &str, what: &str) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| setup(format!("cannot listen for {what} on {addr}: {e}")))
}

async fn serve_async(
    opts: &ServeOptions,
    data: &Path,
    shared: Arc<Shared>,
    on_ready: impl FnOnce(&Ready),
    socket_id: &mut Option<(u64, u64)>,
    (services, sync_stats): (
        Vec<Box<dyn crate::service::Service>>,
        Arc<estop_ledger::SyncStats>,
    ),
) -> Result<(), ServeError> {
    let socket = data.join("estop.sock");
    let unix = bind_unix(&socket).await?;
    *socket_id = file_id(&socket);
    let tcp = match &opts.listen {
        Some(a) => Some(bind_tcp(a, "protocol v1").await?),
        None => None,
    };
    let sg = match &opts.soundgate_listen {
        Some(a) => Some(bind_tcp(a, "the SoundGate-compatible protocol").await?),
        None => None,
    };
    let decisions = match (
        &opts.soundgate_secret,
        opts.soundgate_unauthenticated_decide,
    ) {
        (Some(s), _) => crate::soundgate::Decisions::Hmac(Arc::new(s.as_bytes().to_vec())),
        (None, true) => crate::soundgate::Decisions::Open,
        (None, false) => crate::soundgate::Decisions::Off,
    };
    if let Some(l) = &sg
        && matches!(decisions, crate::soundgate::Decisions::Open)
    {
        crate::log::warn(&format!(
            "the SoundGate-compatible listener on {} accepts unauthenticated decide (--soundgate-unauthenticated-decide): any client that reaches it can approve the effects of its own runs (set ESTOP_SOUNDGATE_SECRET to require HMAC tags instead)",
            l.local_addr().map(|a| a.to_string()).unwrap_or_default()
        ));
    }
    let mut pool = crate::quota::ConnectionOptions::derived(opts.connections_max);
    if let Some(n) = opts.connections_per_token_max {
        pool.shares.per_token_max = n;
    }
    if let Some(n) = opts.connections_per_principal_max {
        pool.shares.per_principal_max = n;
    }
    let slots = crate::quota::ConnectionSlots::new(pool);
    let max = opts.connections_max;
    let sg_slots = Arc::new(Semaphore::new(opts.soundgate_connections_max));
    let sg_max = opts.soundgate_connections_max;
    let mut ready = Ready {
        socket: socket.clone(),
        tcp: tcp.as_ref().and_then(|l| l.local_addr().ok()),
        soundgate: sg.as_ref().and_then(|l| l.local_addr().ok()),
        data: data.to_path_buf(),
        extra: vec![(
            "soundgate_decide".into(),
            if sg.is_some() {
                decisions.as_str()
            } else {
                "-"
            }
            .into(),
        )],
        notices: Vec::new(),
    };
    let mut tasks = Vec::new();
    for service in services {
        let started = service
            .start(crate::service::ServiceContext {
                shared: Arc::clone(&shared),
                data: data.to_path_buf(),
                connections: Arc::clone(&slots),
                connections_max: max,
                sync_stats: Arc::clone(&sync_stats),
            })
            .map_err(setup)?;
        ready.extra.extend(started.ready);
        ready.notices.extend(started.notices);
        tasks.push(tokio::spawn(started.task));
    }
    on_ready(&ready);
    {
        let (shared, slots) = (Arc::clone(&shared), Arc::clone(&slots));
        tasks.push(tokio::spawn(async move {
            loop {
                let stream = match unix.accept().await {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        accept_failed(&e).await;
                        continue;
                    }
                };
                let Ok(stream) = crate::uds::UnixConn::from_tokio(stream) else {
                    continue;
                };
                let socket = duplicate(&stream);
                admit_connection(stream, slots.accept(), |s, slot| {
                    conn::serve(s, socket, Arc::clone(&shared), slot)
                });
            }
        }));
    }
    if let Some(tcp) = tcp {
        let (shared, slots) = (Arc::clone(&shared), Arc::clone(&slots));
        tasks.push(tokio::spawn(async move {
            loop {
                let stream = match tcp.accept().await {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        accept_failed(&e).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let socket = duplicate(&stream);
                admit_connection(stream, slots.accept(), |s, slot| {
                    conn::serve(s, socket, Arc::clone(&shared), slot)
                });
            }
        }));
    }
    if let Some(sg) = sg {
        let shared = Arc::clone(&shared);
        tasks.push(tokio::spawn(async move {
            loop {
                let stream = match sg.accept().await {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        accept_failed(&e).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let decisions = decisions.clone();
                let socket = duplicate(&stream);
                let slot = Arc::clone(&sg_slots).try_acquire_owned().map_err(|_| {
                    format!(
                        "limit reached: soundgate_connections_max = {sg_max}; close idle connections"
                    )
                });
                admit_connection(stream, slot, |s, slot| {
                    crate::soundgate::serve(s, socket, Arc::clone(&shared), decisions, slot)
                });
            }
        }));
    }
    wait_for_signal().await;
    crate::log::info("shutting down: finishing in-flight syncs");
    for t in tasks {
        t.abort();
    }
    Ok(())
}

/// A duplicate of a connection's socket descriptor, for replies written straight to it
/// ([`crate::outbox::Outbox::release`]); without one (the process is out of descriptors) every
/// reply goes through the connection's writer.
fn duplicate(stream: &impl std::os::fd::AsFd) -> Option<std::os::fd::OwnedFd> {
    stream.as_fd().try_clone_to_owned().ok()
}

/// An accept failed. Out of descriptors or memory, the pending connection stays queued and the
/// listener stays readable: pause instead of spinning on it, and say why (at most once a
/// minute). Anything else (the client gave up before it was accepted) concerns one connection.
async fn accept_failed(e: &std::io::Error) {
    use std::sync::atomic::AtomicU64;
    static LAST_WARNED_S: AtomicU64 = AtomicU64::new(0);
    let exhausted = matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    );
    if !exhausted {
        return;
    }
    let now_s = crate::conn::wall_ms() / 1000;
    let last = LAST_WARNED_S.load(std::sync::atomic::Ordering::Relaxed);
    if now_s >= last + 60 {
        LAST_WARNED_S.store(now_s, std::sync::atomic::Ordering::Relaxed);
        crate::log::warn(&format!(
            "cannot accept connections: {e}; new clients wait until some close (see the open-file limit at startup)"
        ));
    }
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
}

/// Serves a connection that got a slot (the slot lives as long as the connection); otherwise
/// tells the client why and closes it.
fn admit_connection<S, T, F, Fut>(mut stream: S, slot: Result<T, String>, serve: F)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    F: FnOnce(S, T) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    match slot {
        Ok(slot) => {
            tokio::spawn(serve(stream, slot));
        }
        Err(why) => {
            tokio::spawn(async move {
                let line = estop_protocol::server_line::error_line(
                    &estop_protocol::Id::default(),
                    estop_protocol::ErrorCode::LimitExceeded,
                    &why,
                );
                let _ = stream.write_all(&line).await;
                let _ = stream.shutdown().await;
            });
        }
    }
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
