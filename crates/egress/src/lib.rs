//! `estop run`: runs an agent's command in a sandbox whose only way out is the gate — its
//! network namespace has loopback only, and on that loopback the supervisor serves the egress
//! proxy, a DNS stub that refuses everything, and the gate's protocol socket for this run.
//! Everything here is described in docs/EGRESS.md, with what is not built yet.

pub mod cgroup;
pub mod credentials;
pub mod dns;
pub mod fsrules;
pub mod gate;
pub mod pool;
pub mod proxy;
pub mod record;
pub mod relay;
pub mod sandbox;
pub mod seccomp;
pub mod settings;
pub mod tls;
pub mod tool;
pub mod undo;
pub mod upstream;

use anyhow::{Context, Result, bail};
use estop_kernel::Part;
use gate::Gate;
use serde_json::{Value, json};
use settings::Settings;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::watch;

/// The proxy's port on the sandbox's loopback (`HTTP_PROXY=http://127.0.0.1:3128`).
pub const PROXY_PORT: u16 = 3128;

/// Worker threads of the runtime that serves a sandbox's proxy, DNS stub and protocol socket;
/// 0 is one current-thread runtime. Chosen by `estop bench egress --proxy-workers`
/// (docs/PERFORMANCE.md, "Egress").
pub const PROXY_WORKERS: usize = 0;

/// The runtime `estop run` (and `estop bench egress`) serves the proxy on: `workers` threads,
/// or the calling thread alone for 0.
pub fn proxy_runtime(workers: usize) -> std::io::Result<tokio::runtime::Runtime> {
    match workers {
        0 => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
        n => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(n)
            .enable_all()
            .build(),
    }
}

#[derive(Debug)]
pub struct RunOptions {
    pub data: PathBuf,
    pub socket: Option<String>,
    pub token: Option<String>,
    pub run: Option<String>,
    pub parent: Option<String>,
    pub policy: Option<PathBuf>,
    pub argv: Vec<String>,
}

/// Where the sandbox's host-facing pieces are.
struct Plan {
    target: String,
    token: String,
    run: String,
    settings: Settings,
    credentials: Arc<credentials::Credentials>,
}

/// A sandbox serves its run and the sub-runs named under it (`RUN/…`, docs/EGRESS.md): a run
/// named `X/Y` must be started with `--parent X`, so that names and the run tree agree and no
/// sandbox's prefix covers a run outside its tree.
fn check_run_name(run: &str, parent: Option<&str>) -> Result<()> {
    if let Some((above, _)) = run.rsplit_once('/')
        && parent != Some(above)
    {
        bail!(
            "run {run:?} has a `/` in its name: that names a sub-run, so pass --parent with \
             the run it is under (e.g. --parent {above:?}), or choose a name without `/`"
        );
    }
    Ok(())
}

/// Runs `opts.argv` in a sandbox; returns its exit code (128 + signal when killed).
pub fn run(opts: RunOptions) -> Result<i32> {
    let settings = match &opts.policy {
        Some(p) => Settings::load(p)?,
        None => Settings::default(),
    };
    let target = opts
        .socket
        .clone()
        .unwrap_or_else(|| opts.data.join("estop.sock").display().to_string());
    if !target.contains('/') {
        bail!("estop run talks to the gate over its Unix socket; --socket must be a path");
    }
    let token = match &opts.token {
        Some(t) => t.clone(),
        None => std::fs::read_to_string(opts.data.join("agent.token"))
            .with_context(|| {
                format!(
                    "reading {}/agent.token (or pass --token)",
                    opts.data.display()
                )
            })?
            .trim()
            .to_string(),
    };
    let run = opts
        .run
        .clone()
        .unwrap_or_else(|| format!("run-{}", random_hex(8)));
    check_run_name(&run, opts.parent.as_deref())?;
    let credentials = match &settings.credentials {
        Some(p) => credentials::Credentials::load(p, &|name| std::env::var(name).ok())?,
        None => credentials::Credentials::default(),
    };
    let plan = Plan {
        target,
        token,
        run,
        settings,
        credentials: Arc::new(credentials),
    };
    proxy_runtime(PROXY_WORKERS)?.block_on(supervise(&opts, plan))
}

async fn supervise(opts: &RunOptions, plan: Plan) -> Result<i32> {
    // The supervisor's own part: the launch, the proxy's requests and the metered calls are
    // effects the sandbox (the relay's `main` part) cannot start, complete or wait for.
    let (gate, events, principal) =
        Gate::connect(&plan.target, &plan.token, &plan.run, Part::Egress).await?;
    let cwd = std::env::current_dir()?;
    let key = format!("sandbox:{}", random_hex(6));
    let (token, launched_at) = admit_launch(&gate, opts, &plan, &key, &cwd).await?;
    let tmp = tempfile::Builder::new().prefix("estop-run-").tempdir()?;
    std::fs::write(
        tmp.path().join("resolv.conf"),
        "nameserver 127.0.0.1\noptions attempts:1 timeout:1\n",
    )?;
    let private_dir = tmp.path().join("sandbox");
    std::fs::create_dir(&private_dir)?;
    let cgroups = cgroup::Cgroups::create(
        &format!("{}", std::process::id()),
        plan.settings.pids_max,
        plan.settings.memory_max,
    );
    for note in &cgroups.notes {
        eprintln!("estop run: {note}");
    }
    // The CA the sandbox trusts for HTTPS through the proxy (its key stays in the data dir).
    let ca = Arc::new(tls::Ca::load_or_create(&opts.data)?);
    std::fs::write(tmp.path().join("ca.pem"), &ca.bundle_pem)?;
    let cfg = stage_config(opts, &plan, &cgroups, private_dir, tmp.path(), &cwd)?;
    let socket_path = cfg.socket_path();
    let launched = sandbox::launch(cfg)?;
    let pid1 = launched.pid1;
    let (fence_tx, fence) = watch::channel(false);
    let l = launched.listeners;
    use std::os::fd::AsFd;
    for s in [l.proxy.as_fd(), l.dns.as_fd(), l.protocol.as_fd()] {
        rustix::io::ioctl_fionbio(s, true)?;
    }
    let connector = tls::connector(plan.settings.upstream_roots.as_deref())?;
    let proxy = Arc::new(proxy::Proxy {
        ca: Some(ca),
        connector,
        gate: gate.clone(),
        run: plan.run.clone(),
        parent: None,
        settings: plan.settings.clone(),
        credentials: plan.credentials.clone(),
        fence: fence.clone(),
        nonce: random_hex(6),
        seq: 0.into(),
        pool: pool::Pool::default(),
        access: None,
    });
    tokio::spawn(proxy.serve(tokio::net::TcpListener::from_std(l.proxy)?));
    tokio::spawn(dns::serve(tokio::net::UdpSocket::from_std(l.dns)?));
    let relay = relay::Relay {
        target: plan.target.clone(),
        token: plan.token.clone(),
        run: plan.run.clone(),
        principal,
        connections_max: plan.settings.connections_max,
    };
    tokio::spawn(relay.serve(tokio::net::UnixListener::from_std(l.protocol)?));
    let cg = cgroups;
    let killed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    tokio::spawn(watch_run(
        gate.clone(),
        plan.run.clone(),
        events,
        fence_tx,
        pid1,
        killed.clone(),
    ));
    tokio::spawn(on_signal(pid1, killed.clone()));
    eprintln!(
        "estop run: run {} in a sandbox (pid {pid1}); proxy http://127.0.0.1:{PROXY_PORT}, socket {}",
        plan.run,
        socket_path.display()
    );
    let mut stage1 = launched.stage1;
    let status = tokio::task::spawn_blocking(move || stage1.wait()).await??;
    let code = status.code().unwrap_or(125);
    // PID 1's namespace is empty now; anything still in the cgroup got there some other way.
    if cg.populated() == Some(true) {
        cg.kill();
    }
    let killed = killed.load(std::sync::atomic::Ordering::SeqCst);
    record_end(
        &gate,
        &plan.run,
        &key,
        &token,
        code,
        killed,
        cg.populated(),
        launched_at,
    )
    .await;
    drop(cg);
    Ok(code)
}

/// The proxy `estop run` serves, on a listener of the caller's and with no sandbox around it,
/// for run `run` (its requests are admitted and completed like a sandbox's, with the credential
/// store of `settings` injected): what `estop bench egress` measures against a direct
/// connection. Serves until the task is dropped. (A harness HTTP tool call's proxy, which is
/// also fenced and closed with its run, is [`tool::ToolProxy`].)
pub async fn serve_proxy(
    target: &str,
    token: &str,
    run: &str,
    data: &Path,
    settings: Settings,
    listener: tokio::net::TcpListener,
) -> Result<()> {
    let (gate, _events, _) = Gate::connect(target, token, run, Part::Egress).await?;
    // Never stopped: the sender lives as long as the proxy (a dropped one would read as a stop).
    let (_fence_tx, fence) = watch::channel(false);
    let credentials = match &settings.credentials {
        Some(p) => credentials::Credentials::load(p, &|name| std::env::var(name).ok())?,
        None => credentials::Credentials::default(),
    };
    let proxy = Arc::new(proxy::Proxy {
        ca: Some(Arc::new(tls::Ca::load_or_create(data)?)),
        connector: tls::connector(settings.upstream_roots.as_deref())?,
        gate,
        run: run.to_string(),
        parent: None,
        settings,
        credentials: Arc::new(credentials),
        fence,
        nonce: random_hex(6),
        seq: 0.into(),
        pool: pool::Pool::default(),
        access: None,
    });
    proxy.serve(listener).await;
    Ok(())
}

/// The launch is itself an effect of the run (tool `sandbox.run`): it creates the run, the
/// gate's policy decides whether the command may start at all, and its completion records the
/// exit status. Returns the effect's token and the time it was admitted.
async fn admit_launch(
    gate: &Gate,
    opts: &RunOptions,
    plan: &Plan,
    key: &str,
    cwd: &Path,
) -> Result<(String, u64)> {
    let mut req = json!({"op": "admit", "run": plan.run, "key": key, "tool": "sandbox.run",
        "args": {"argv": opts.argv, "cwd": cwd.display().to_string()}, "start": true});
    if let Some(p) = &opts.parent {
        req["parent"] = json!(p);
    }
    // The model budget is the gate's: it applies when this admission creates the run (a run
    // that exists keeps its own, and what it spent, across `estop run`s).
    if let Some(m) = &plan.settings.model
        && (m.budget_usd_micros.is_some() || m.budget_tokens.is_some())
    {
        req["limits"] = json!({"max_spend": m.budget_usd_micros, "max_tokens": m.budget_tokens});
    }
    let mut v = gate.call(req).await?;
    let mut told = false;
    while v["ok"] == true && v["verdict"] == "held" {
        if !told {
            eprintln!(
                "estop run: starting the sandbox awaits approval (estop approve {} {key})",
                plan.run
            );
            told = true;
        }
        v = gate
            .call(json!({"op": "wait", "run": plan.run, "key": key, "timeout_ms": 600_000}))
            .await?;
    }
    if v["ok"] != true {
        bail!("the gate did not admit the sandbox: {}", v["error"]);
    }
    match v["verdict"].as_str() {
        Some("admitted") => Ok((
            v["token"].as_str().unwrap_or_default().to_string(),
            now_ms(),
        )),
        _ => bail!(
            "the gate refused to start the sandbox: {} {}",
            v["reason"].as_str().unwrap_or("?"),
            v["message"].as_str().unwrap_or("")
        ),
    }
}

fn stage_config(
    opts: &RunOptions,
    plan: &Plan,
    cgroups: &cgroup::Cgroups,
    private_dir: PathBuf,
    tmp: &Path,
    cwd: &Path,
) -> Result<sandbox::StageConfig> {
    let data = opts
        .data
        .canonicalize()
        .with_context(|| format!("the data directory {}", opts.data.display()))?;
    let mut hide_dirs = vec![data.clone()];
    // Host resolvers reached through Unix sockets would resolve (and leak) names for the agent.
    for dir in ["/run/systemd/resolve", "/run/nscd", "/var/run/nscd"] {
        if let Ok(d) = Path::new(dir).canonicalize()
            && d.is_dir()
            && !hide_dirs.contains(&d)
        {
            hide_dirs.push(d);
        }
    }
    let socket = Path::new(&plan.target).canonicalize()?;
    // The daemon's socket and the credential store: /dev/null inside (unless already under a
    // hidden directory).
    let mut hide_files = vec![socket];
    if let Some(store) = &plan.settings.credentials {
        hide_files.push(store.canonicalize()?);
    }
    hide_files.retain(|f| !hide_dirs.iter().any(|d| f.starts_with(d)));
    let proxy_url = format!("http://127.0.0.1:{PROXY_PORT}");
    // Variables a credential was read from stay with the supervisor.
    let secret_vars = &plan.credentials.env_names;
    let mut env: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| !k.starts_with("ESTOP_") && !k.to_ascii_lowercase().ends_with("_proxy"))
        .filter(|(k, _)| !secret_vars.contains(k))
        .collect();
    let sock = private_dir.join("estop.sock").display().to_string();
    let ca = tmp.join("ca.pem").display().to_string();
    for (k, v) in [
        ("ESTOP_SOCKET", sock.as_str()),
        ("ESTOP_RUN", plan.run.as_str()),
        ("ESTOP_PROXY", proxy_url.as_str()),
        ("HTTP_PROXY", proxy_url.as_str()),
        ("http_proxy", proxy_url.as_str()),
        ("HTTPS_PROXY", proxy_url.as_str()),
        ("https_proxy", proxy_url.as_str()),
        ("NO_PROXY", "localhost,127.0.0.1,::1"),
        ("no_proxy", "localhost,127.0.0.1,::1"),
        ("NODE_USE_ENV_PROXY", "1"),
        ("SSL_CERT_FILE", ca.as_str()),
        ("REQUESTS_CA_BUNDLE", ca.as_str()),
        ("CURL_CA_BUNDLE", ca.as_str()),
        ("NODE_EXTRA_CA_CERTS", ca.as_str()),
    ] {
        env.push((k.into(), v.into()));
    }
    if plan.settings.model.is_some() {
        // SDKs insist on a key; the provider's real one is the credential store's.
        env.retain(|(k, _)| k != "OPENAI_BASE_URL" && k != "OPENAI_API_KEY");
        env.push(("OPENAI_BASE_URL".into(), format!("{proxy_url}/v1")));
        env.push(("OPENAI_API_KEY".into(), "estop-metered".into()));
    }
    Ok(sandbox::StageConfig {
        fd: -1,
        cgroup_procs: cgroups.procs_files(),
        uid: rustix::process::geteuid().as_raw(),
        gid: rustix::process::getegid().as_raw(),
        private_dir,
        hide_dirs,
        hide_files,
        resolv_conf: tmp.join("resolv.conf"),
        proxy_port: PROXY_PORT,
        argv: opts.argv.clone(),
        env,
        cwd: cwd.to_path_buf(),
        filesystem: plan.settings.filesystem.clone(),
        readable: vec![tmp.join("ca.pem")],
    })
}

/// Follows the run's events: a stop fences the proxy (and cuts what is in flight); a kill
/// also ends every process of the sandbox.
async fn watch_run(
    gate: Gate,
    run: String,
    mut events: tokio::sync::mpsc::UnboundedReceiver<Value>,
    fence: watch::Sender<bool>,
    pid1: i32,
    killed: Arc<std::sync::atomic::AtomicBool>,
) {
    let _ = gate.call(json!({"op": "subscribe", "run": run})).await;
    // A stop that landed before the subscription is seen here.
    if let Ok(v) = gate.call(json!({"op": "status", "run": run})).await {
        on_state(&v, &fence, pid1, &killed);
    }
    while let Some(ev) = events.recv().await {
        if ev["run"] != run.as_str() {
            continue;
        }
        let stop = [
            "cancelled",
            "closed",
            "finalizing",
            "settled",
            "resubscribed",
        ];
        if stop.contains(&ev["event"].as_str().unwrap_or(""))
            && let Ok(v) = gate.call(json!({"op": "status", "run": run})).await
        {
            on_state(&v, &fence, pid1, &killed);
        }
    }
}

fn on_state(
    status: &Value,
    fence: &watch::Sender<bool>,
    pid1: i32,
    killed: &std::sync::atomic::AtomicBool,
) {
    if status["ok"] != true || status.get("cause").is_none_or(Value::is_null) {
        return;
    }
    fence.send_replace(true);
    if status["cause"] == "killed" {
        kill(pid1, killed);
    }
}

/// Ends every process of the sandbox at once: SIGKILL to its PID 1 makes the kernel stop
/// handing out PIDs in its namespace and kill the rest (a fork bomb included); stage 1's wait
/// returns only once all of them are reaped. PID 1 cannot be recycled meanwhile: stage 1 has
/// not reaped it. (`cgroup.kill` would also take stage 1, which must live to see the end.)
fn kill(pid1: i32, killed: &std::sync::atomic::AtomicBool) {
    killed.store(true, std::sync::atomic::Ordering::SeqCst);
    if let Some(pid) = rustix::process::Pid::from_raw(pid1) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
    }
}

async fn on_signal(pid1: i32, killed: Arc<std::sync::atomic::AtomicBool>) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        return;
    };
    tokio::select! { _ = int.recv() => {}, _ = term.recv() => {} }
    kill(pid1, &killed);
}

/// Records the end on the ledger: the launch effect completes with the exit status (late if
/// the run was stopped meanwhile, which the report shows), and a run still open is closed,
/// `completed` on exit 0 and `failed` otherwise.
#[allow(clippy::too_many_arguments)]
async fn record_end(
    gate: &Gate,
    run: &str,
    key: &str,
    token: &str,
    code: i32,
    killed: bool,
    populated: Option<bool>,
    started: u64,
) {
    let result = json!({"exit_code": code, "killed": killed, "process_tree_ended": true,
        "cgroup_populated": populated, "ran_ms": now_ms().saturating_sub(started)});
    let outcome = if code == 0 { "ok" } else { "error" };
    let mut complete = json!({"op": "complete", "run": run, "key": key, "token": token,
        "outcome": outcome, "result": result});
    if code != 0 {
        complete["error"] = json!(format!("the command exited with status {code}"));
    }
    if let Err(e) = gate.call(complete).await {
        eprintln!("estop run: recording the exit: {e:#}");
    }
    let close = json!({"op": "close", "run": run, "outcome": if code == 0 { "completed" } else { "failed" }});
    let _ = gate.call(close).await;
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

pub(crate) fn random_hex(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    getrandom::fill(&mut b).expect("the OS random source");
    b.iter().map(|x| format!("{x:02x}")).collect()
}
