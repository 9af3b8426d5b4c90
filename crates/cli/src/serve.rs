//! `estop serve`: the daemon's flags turned into its options, then the daemon run until it
//! stops.

use anyhow::{Context, Result, anyhow};
use clap::Args;
use estop_kernel::Limits;
use estop_server::ServeOptions;
use std::path::PathBuf;

#[derive(Args)]
pub struct ServeArgs {
    /// Data directory (ledger, tokens, socket).
    #[arg(long, env = "ESTOP_DATA", default_value = "estop-data")]
    pub data: PathBuf,
    /// Also listen for protocol v1 on this TCP address (e.g. 127.0.0.1:7420).
    #[arg(long)]
    pub listen: Option<String>,
    /// Listen for the SoundGate-compatible protocol on this TCP address.
    #[arg(long)]
    pub soundgate_listen: Option<String>,
    /// Accept unauthenticated `decide` on the SoundGate listener (as the reference does): anyone
    /// who reaches it can approve that listener's own effects. Off by default; prefer
    /// ESTOP_SOUNDGATE_SECRET (HMAC tags).
    #[arg(long)]
    pub soundgate_unauthenticated_decide: bool,
    /// Policy file (TOML). Without one, every tool needs one approval.
    #[arg(long)]
    pub policy: Option<PathBuf>,
    /// Allow every tool (benchmarks only; ignored with --policy).
    #[arg(long)]
    pub allow_all: bool,
    /// Most simultaneous protocol v1 connections (Unix socket and TCP); 1/64 of them (4 to 64)
    /// are kept for operators.
    #[arg(long, default_value_t = 4096)]
    pub connections_max: usize,
    /// Protocol v1 connections one principal may hold (default: a quarter of the pool).
    #[arg(long)]
    pub connections_per_principal_max: Option<usize>,
    /// Protocol v1 connections one token may hold with every sandbox that speaks for it
    /// (`hello {token, run}`; default: half of the pool).
    #[arg(long)]
    pub connections_per_token_max: Option<usize>,
    /// Most simultaneous SoundGate connections (a pool of their own).
    #[arg(long, default_value_t = 1024)]
    pub soundgate_connections_max: usize,
    /// A connection must send `hello` this soon after connecting (e.g. 10s).
    #[arg(long, default_value = "10s")]
    pub hello_timeout: String,
    /// A connection with nothing in flight and no subscription is closed after this long silent.
    #[arg(long, default_value = "10m")]
    pub idle_timeout: String,
    /// Blocked `wait`s in all; 1/64 of them (up to 1024) are kept for operators.
    #[arg(long, default_value_t = 100_000)]
    pub waiters_max: usize,
    /// Blocked `wait`s one principal may hold (default: a quarter of --waiters-max).
    #[arg(long)]
    pub waiters_per_principal_max: Option<usize>,
    /// Blocked `wait`s one token may hold with its sandboxes (default: half of --waiters-max).
    #[arg(long)]
    pub waiters_per_token_max: Option<usize>,
    /// Subscriptions in all; 1/64 of them (up to 1024) are kept for operators.
    #[arg(long, default_value_t = 100_000)]
    pub subscriptions_max: usize,
    /// Subscriptions one principal may hold (default: a quarter of --subscriptions-max).
    #[arg(long)]
    pub subscriptions_per_principal_max: Option<usize>,
    /// Subscriptions (executors included) one token may hold with its sandboxes (default: half
    /// of --subscriptions-max).
    #[arg(long)]
    pub subscriptions_per_token_max: Option<usize>,
    /// Longest request line in bytes.
    #[arg(long, default_value_t = 64 * 1024)]
    pub line_bytes_max: usize,
    /// Bytes of replies one connection may leave unread: past a quarter of it the connection
    /// is not read further; past all of it (events, say) it is disconnected.
    #[arg(long, default_value_t = 4 << 20)]
    pub output_bytes_max: usize,
    /// Bytes of request lines one connection may have in flight (the gate stops reading it).
    #[arg(long, default_value_t = 4 << 20)]
    pub inflight_bytes_max: usize,
    /// A page of a listing (runs, pending, report, ledger) ends once it reaches this many bytes.
    #[arg(long, default_value_t = 1 << 20)]
    pub page_bytes_max: usize,
    /// How long a stopped run is kept whole (e.g. 7d, 12h); then it is forgotten and its
    /// fence stays as a tombstone.
    #[arg(long, default_value = "7d")]
    pub retention: String,
    /// How long a forgotten run's tombstone keeps refusing its id (at least --retention);
    /// after that the id is new to the gate.
    #[arg(long, default_value = "28d")]
    pub tombstone_retention: String,
    /// A call a stopped run's agent left in flight and has not reported this long after the
    /// stop becomes `unknown` (then its lookup, or a human, settles it); 1s to 7d.
    #[arg(long, default_value = "10m")]
    pub in_flight_timeout: String,
    /// Most runs held in state (live, and stopped ones not yet forgotten); 1% is reserved for
    /// operators.
    #[arg(long, default_value_t = Limits::default().runs_max)]
    pub runs_max: usize,
    /// Most runs held in state for one principal.
    #[arg(long, default_value_t = Limits::default().runs_per_principal_max)]
    pub runs_per_principal_max: usize,
    /// Most held effects (awaiting approval, behind a sibling or a pause) in all runs.
    #[arg(long, default_value_t = Limits::default().held_max)]
    pub held_max: usize,
    /// Most held effects in the runs of one principal.
    #[arg(long, default_value_t = Limits::default().held_per_principal_max)]
    pub held_per_principal_max: usize,
    /// Most runs held in state for one token and every sandbox that speaks for it together
    /// (`estop run`'s sandboxes are principals of their own, TOKEN/RUN).
    #[arg(long, default_value_t = Limits::default().runs_per_token_max)]
    pub runs_per_token_max: usize,
    /// Most held effects in the runs of one token and its sandboxes together.
    #[arg(long, default_value_t = Limits::default().held_per_token_max)]
    pub held_per_token_max: usize,
    /// Most tombstones; at the bound, stopped runs are kept whole instead of forgotten.
    #[arg(long, default_value_t = Limits::default().tombstones_max)]
    pub tombstones_max: usize,
    /// Write a snapshot after this many ledger records (bounds recovery time).
    #[arg(long, default_value_t = 1_000_000)]
    pub snapshot_every: u64,
    /// The operator console and HTTP API: host:port (port 0 picks one) or `off`; default
    /// 127.0.0.1:7421, and if that is taken the gate starts without a console and says so.
    #[arg(long, value_name = "ADDR")]
    pub console: Option<String>,
    /// Write fresh bootstrap tokens (admin, agent) although DATA/tokens is missing and the ledger
    /// was written: the way out when the registry is lost. Every other token stays revoked.
    #[arg(long)]
    pub reset_tokens: bool,
    /// Where the gate's truth lives: the embedded ledger in DATA/ledger (default), or a
    /// PostgreSQL database shared by several `estop serve` nodes: `postgres://USER@HOST:PORT/DB`
    /// (docs/STORES.md; no TLS yet: a local socket or a trusted network). A URL with a
    /// password belongs in ESTOP_STORE, not on the command line, which every local user can
    /// read in the process list.
    #[arg(long, value_name = "URL", env = "ESTOP_STORE", hide_env_values = true)]
    pub store: Option<String>,
}

pub fn serve(a: ServeArgs) -> Result<u8> {
    let console = a.console.clone();
    let opts = options(a)?;
    let mut services: Vec<Box<dyn estop_server::service::Service>> = Vec::new();
    if console.as_deref() != Some("off") {
        services.push(Box::new(estop_console::Console::new(
            estop_console::ConsoleOptions {
                required: console.is_some(),
                addr: console.unwrap_or_else(|| estop_console::DEFAULT_ADDR.to_string()),
                ..Default::default()
            },
        )));
    }
    estop_server::run_with(opts, services, |ready| {
        println!("{}", ready.line());
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        // Notices (where the console's login link is; the link itself only on a terminal): a
        // reader that stopped after the ready line must not kill the daemon (errors ignored).
        for notice in &ready.notices {
            let _ = writeln!(out, "{notice}");
        }
        let _ = out.flush();
    })
    .map_err(|e| anyhow!("{e}"))
    .context("estop serve could not start")?;
    Ok(0)
}

/// The daemon's options from its flags (and `ESTOP_SOUNDGATE_SECRET`); a flag that makes no
/// sense is refused with what to give instead.
fn options(a: ServeArgs) -> Result<ServeOptions> {
    // Checked last, as they always were, but read before the flags are moved out.
    let limits = limits(&a);
    let mut opts = ServeOptions::new(a.data);
    opts.listen = a.listen;
    opts.soundgate_listen = a.soundgate_listen;
    opts.soundgate_unauthenticated_decide = a.soundgate_unauthenticated_decide;
    opts.soundgate_secret = std::env::var("ESTOP_SOUNDGATE_SECRET")
        .ok()
        .filter(|s| !s.is_empty());
    opts.policy = a.policy;
    opts.allow_all = a.allow_all;
    opts.reset_tokens = a.reset_tokens;
    opts.store = a.store;
    opts.connections_max = a.connections_max.max(1);
    opts.connections_per_principal_max = a.connections_per_principal_max;
    opts.connections_per_token_max = a.connections_per_token_max;
    opts.soundgate_connections_max = a.soundgate_connections_max.max(1);
    let ms = |flag: &str, v: &str| {
        estop_policy::parse_duration_ms(v).map_err(|e| anyhow!("--{flag} {v}: {e}"))
    };
    opts.conn.hello_ms_max = ms("hello-timeout", &a.hello_timeout)?.max(1);
    opts.conn.idle_ms_max = ms("idle-timeout", &a.idle_timeout)?.max(1);
    let shares = |max: usize, per: Option<usize>, per_token: Option<usize>| {
        let mut o = estop_server::quota::ShareOptions::derived(max.max(1), 1024);
        if let Some(n) = per {
            o.per_principal_max = n;
        }
        if let Some(n) = per_token {
            o.per_token_max = n;
        }
        o
    };
    opts.core.waiters = shares(
        a.waiters_max,
        a.waiters_per_principal_max,
        a.waiters_per_token_max,
    );
    opts.core.subscriptions = shares(
        a.subscriptions_max,
        a.subscriptions_per_principal_max,
        a.subscriptions_per_token_max,
    );
    opts.conn.line_bytes_max = a.line_bytes_max;
    opts.conn.output_bytes_max = a.output_bytes_max;
    opts.conn.inflight_bytes_max = a.inflight_bytes_max.max(1);
    opts.conn.page_bytes_max = a.page_bytes_max;
    opts.core.snapshot_every_records = a.snapshot_every.max(1);
    opts.core.retention_ms = ms("retention", &a.retention)?;
    opts.core.tombstone_retention_ms = ms("tombstone-retention", &a.tombstone_retention)?;
    if opts.core.tombstone_retention_ms < opts.core.retention_ms {
        return Err(anyhow!(
            "--tombstone-retention {} is shorter than --retention {}: a forgotten run's fence must outlive the run; give a longer --tombstone-retention",
            a.tombstone_retention,
            a.retention
        ));
    }
    opts.core.in_flight_timeout_ms = in_flight_timeout(&a.in_flight_timeout)?;
    opts.limits = limits?;
    Ok(opts)
}

/// `--in-flight-timeout` within its bounds.
fn in_flight_timeout(text: &str) -> Result<u64> {
    use estop_server::core::{IN_FLIGHT_TIMEOUT_MAX_MS, IN_FLIGHT_TIMEOUT_MIN_MS};
    let v = estop_policy::parse_duration_ms(text)
        .map_err(|e| anyhow!("--in-flight-timeout {text}: {e}"))?;
    if !(IN_FLIGHT_TIMEOUT_MIN_MS..=IN_FLIGHT_TIMEOUT_MAX_MS).contains(&v) {
        return Err(anyhow!(
            "--in-flight-timeout {text} is outside 1s..=7d: a call left in flight must have time \
             to report, and a dead agent's call must not hold its run's saga for longer"
        ));
    }
    Ok(v)
}

/// The kernel's bounds: its defaults, with the ones the flags set; none may be 0.
fn limits(a: &ServeArgs) -> Result<Limits> {
    for (flag, v) in [
        ("--runs-max", a.runs_max),
        ("--runs-per-principal-max", a.runs_per_principal_max),
        ("--held-max", a.held_max),
        ("--held-per-principal-max", a.held_per_principal_max),
        ("--runs-per-token-max", a.runs_per_token_max),
        ("--held-per-token-max", a.held_per_token_max),
        ("--tombstones-max", a.tombstones_max),
    ] {
        if v == 0 {
            return Err(anyhow!(
                "{flag} 0: a bound of nothing refuses everything; give at least 1"
            ));
        }
    }
    Ok(Limits {
        runs_max: a.runs_max,
        runs_per_principal_max: a.runs_per_principal_max,
        held_max: a.held_max,
        held_per_principal_max: a.held_per_principal_max,
        runs_per_token_max: a.runs_per_token_max,
        held_per_token_max: a.held_per_token_max,
        tombstones_max: a.tombstones_max,
        ..Limits::default()
    })
}

#[cfg(test)]
mod tests {
    use super::in_flight_timeout;

    #[test]
    fn in_flight_timeout_is_bounded() {
        assert_eq!(in_flight_timeout("10m").unwrap(), 600_000);
        assert_eq!(in_flight_timeout("1s").unwrap(), 1_000);
        assert_eq!(in_flight_timeout("7d").unwrap(), 7 * 24 * 3600 * 1000);
        for bad in ["999ms", "0s", "8d", "soon"] {
            let e = in_flight_timeout(bad).unwrap_err().to_string();
            assert!(e.contains("--in-flight-timeout"), "{bad}: {e}");
        }
    }
}
