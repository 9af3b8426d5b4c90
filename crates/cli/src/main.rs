//! The `estop` binary: flags and wiring only. Exit codes: 0 ok, 1 error, 2 usage, 3 refused,
//! 4 not found (docs in README.md).

mod bench;
mod run;

use anyhow::{Context, Result, anyhow};
use clap::{Args, Parser, Subcommand};
use estop_kernel::Limits;
use estop_protocol::ErrorCode;
use estop_server::client::Client;
use serde_json::{Value, json};
use std::borrow::Cow;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "estop", version, about = "estop: make \"stop\" mean stop for AI agents", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Args, Clone)]
struct Conn {
    /// Data directory of the daemon (its socket and operator token live there).
    #[arg(long, env = "ESTOP_DATA", default_value = "estop-data", global = true)]
    data: PathBuf,
    /// Socket path or host:port of the daemon (default: DATA/estop.sock).
    #[arg(long, env = "ESTOP_SOCKET", global = true)]
    socket: Option<String>,
    /// Token to authenticate with (default: the contents of DATA/operator.token).
    #[arg(long, env = "ESTOP_TOKEN", global = true, hide_env_values = true)]
    token: Option<String>,
    /// Print JSON for scripts instead of tables.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the gate daemon on the embedded ledger.
    Serve(Box<ServeArgs>),
    /// Manage named tokens.
    Token {
        #[command(subcommand)]
        command: TokenCmd,
        #[command(flatten)]
        conn: Conn,
    },
    /// List runs.
    Runs {
        /// Only runs in this state (active, paused, finalizing, completed, failed, cancelled).
        #[arg(long)]
        state: Option<String>,
        /// Show at most this many (default: every run, read page by page).
        #[arg(long)]
        limit: Option<u32>,
        #[command(flatten)]
        conn: Conn,
    },
    /// List effects awaiting approval.
    Pending {
        #[arg(long)]
        run: Option<String>,
        /// Show at most this many (default: every one, read page by page).
        #[arg(long)]
        limit: Option<u32>,
        #[command(flatten)]
        conn: Conn,
    },
    /// Approve a held effect (your token is the approver).
    Approve(DecideArgs),
    /// Reject a held effect (final; the same call is refused in this run from now on).
    Reject(DecideArgs),
    /// Cancel a run and its descendants (a fence: nothing new starts).
    Cancel(StopArgs),
    /// Cancel a run without compensation.
    Kill(StopArgs),
    /// Hold new admissions and starts of a run and its descendants.
    Pause(RunArgs),
    /// Let a paused run proceed.
    Resume(RunArgs),
    /// Close a run normally.
    Close {
        run: String,
        /// Close it as failed.
        #[arg(long)]
        failed: bool,
        #[command(flatten)]
        conn: Conn,
    },
    /// Show one run.
    Status(RunArgs),
    /// The after-stop report of a run: done, refused, in flight, unknown, undoable.
    Report(RunArgs),
    /// Inspect the ledger files (works with or without a running daemon).
    Ledger {
        #[command(subcommand)]
        command: LedgerCmd,
    },
    /// Measure: closed-loop durable admissions (default), or `kernel` / `recovery` figures.
    Bench(bench::BenchArgs),
    /// Run a command in a sandbox whose only way out is the gate (docs/EGRESS.md).
    Run(run::RunArgs),
}

#[derive(Args)]
struct ServeArgs {
    /// Data directory (ledger, tokens, socket).
    #[arg(long, env = "ESTOP_DATA", default_value = "estop-data")]
    data: PathBuf,
    /// Also listen for protocol v1 on this TCP address (e.g. 127.0.0.1:7420).
    #[arg(long)]
    listen: Option<String>,
    /// Listen for the SoundGate-compatible protocol on this TCP address.
    #[arg(long)]
    soundgate_listen: Option<String>,
    /// Accept unauthenticated `decide` on the SoundGate listener (as the reference does): anyone
    /// who reaches it can approve that listener's own effects. Off by default; prefer
    /// ESTOP_SOUNDGATE_SECRET (HMAC tags).
    #[arg(long)]
    soundgate_unauthenticated_decide: bool,
    /// Policy file (TOML). Without one, every tool needs one approval.
    #[arg(long)]
    policy: Option<PathBuf>,
    /// Allow every tool (benchmarks only; ignored with --policy).
    #[arg(long)]
    allow_all: bool,
    /// Most simultaneous protocol v1 connections (Unix socket and TCP); 1/64 of them (4 to 64)
    /// are kept for operators.
    #[arg(long, default_value_t = 4096)]
    connections_max: usize,
    /// Protocol v1 connections one principal may hold (default: a quarter of the pool).
    #[arg(long)]
    connections_per_principal_max: Option<usize>,
    /// Most simultaneous SoundGate connections (a pool of their own).
    #[arg(long, default_value_t = 1024)]
    soundgate_connections_max: usize,
    /// A connection must send `hello` this soon after connecting (e.g. 10s).
    #[arg(long, default_value = "10s")]
    hello_timeout: String,
    /// A connection with nothing in flight and no subscription is closed after this long silent.
    #[arg(long, default_value = "10m")]
    idle_timeout: String,
    /// Blocked `wait`s in all; 1/64 of them (up to 1024) are kept for operators.
    #[arg(long, default_value_t = 100_000)]
    waiters_max: usize,
    /// Blocked `wait`s one principal may hold (default: a quarter of --waiters-max).
    #[arg(long)]
    waiters_per_principal_max: Option<usize>,
    /// Subscriptions in all; 1/64 of them (up to 1024) are kept for operators.
    #[arg(long, default_value_t = 100_000)]
    subscriptions_max: usize,
    /// Subscriptions one principal may hold (default: a quarter of --subscriptions-max).
    #[arg(long)]
    subscriptions_per_principal_max: Option<usize>,
    /// Longest request line in bytes.
    #[arg(long, default_value_t = 64 * 1024)]
    line_bytes_max: usize,
    /// Bytes of replies one connection may leave unread: past a quarter of it the connection
    /// is not read further; past all of it (events, say) it is disconnected.
    #[arg(long, default_value_t = 4 << 20)]
    output_bytes_max: usize,
    /// Bytes of request lines one connection may have in flight (the gate stops reading it).
    #[arg(long, default_value_t = 4 << 20)]
    inflight_bytes_max: usize,
    /// A page of a listing (runs, pending, report, ledger) ends once it reaches this many bytes.
    #[arg(long, default_value_t = 1 << 20)]
    page_bytes_max: usize,
    /// How long a stopped run is kept whole (e.g. 7d, 12h); then it is forgotten and its
    /// fence stays as a tombstone.
    #[arg(long, default_value = "7d")]
    retention: String,
    /// How long a forgotten run's tombstone keeps refusing its id (at least --retention);
    /// after that the id is new to the gate.
    #[arg(long, default_value = "28d")]
    tombstone_retention: String,
    /// Most runs held in state (live, and stopped ones not yet forgotten); 1% is reserved for
    /// operators.
    #[arg(long, default_value_t = Limits::default().runs_max)]
    runs_max: usize,
    /// Most runs held in state for one principal.
    #[arg(long, default_value_t = Limits::default().runs_per_principal_max)]
    runs_per_principal_max: usize,
    /// Most held effects (awaiting approval, behind a sibling or a pause) in all runs.
    #[arg(long, default_value_t = Limits::default().held_max)]
    held_max: usize,
    /// Most held effects in the runs of one principal.
    #[arg(long, default_value_t = Limits::default().held_per_principal_max)]
    held_per_principal_max: usize,
    /// Most tombstones; at the bound, stopped runs are kept whole instead of forgotten.
    #[arg(long, default_value_t = Limits::default().tombstones_max)]
    tombstones_max: usize,
    /// Write a snapshot after this many ledger records (bounds recovery time).
    #[arg(long, default_value_t = 1_000_000)]
    snapshot_every: u64,
    /// The operator console and HTTP API: host:port (port 0 picks one) or `off`; default
    /// 127.0.0.1:7421, and if that is taken the gate starts without a console and says so.
    #[arg(long, value_name = "ADDR")]
    console: Option<String>,
    /// Write fresh bootstrap tokens (admin, agent) although DATA/tokens is missing and the ledger
    /// was written: the way out when the registry is lost. Every other token stays revoked.
    #[arg(long)]
    reset_tokens: bool,
}

#[derive(Subcommand)]
enum TokenCmd {
    /// Create a named token; prints its secret once.
    Create {
        name: String,
        /// agent, operator, or observer (reads runs, reports and metrics; changes nothing).
        #[arg(long)]
        role: String,
        /// Approver group this principal belongs to (repeatable).
        #[arg(long = "group")]
        groups: Vec<String>,
    },
    /// Revoke a named token at once: its open connections and console sessions end. The last
    /// operator token cannot be revoked.
    Revoke { name: String },
}

#[derive(Subcommand)]
enum LedgerCmd {
    /// Check every segment and snapshot; exit 0 if a daemon would start on it.
    Verify {
        #[arg(long, env = "ESTOP_DATA", default_value = "estop-data")]
        data: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Print the records (optionally of one run).
    Show {
        #[arg(long, env = "ESTOP_DATA", default_value = "estop-data")]
        data: PathBuf,
        #[arg(long)]
        run: Option<String>,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
struct DecideArgs {
    run: String,
    key: String,
    #[arg(long)]
    reason: Option<String>,
    #[command(flatten)]
    conn: Conn,
}

#[derive(Args)]
struct StopArgs {
    run: String,
    #[arg(long)]
    reason: Option<String>,
    #[command(flatten)]
    conn: Conn,
}

#[derive(Args)]
struct RunArgs {
    run: String,
    #[command(flatten)]
    conn: Conn,
}

/// An error with the exit code it maps to.
struct Failure {
    code: u8,
    message: String,
}

fn main() -> ExitCode {
    if let Some(code) = estop_egress::sandbox::stage_main() {
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => ExitCode::from(code),
        Err(f) => {
            // Error messages quote ids and text the gate was sent: escaped like everything else.
            eprintln!("estop: {}", esc(&f.message));
            ExitCode::from(f.code)
        }
    }
}

fn fail(e: anyhow::Error) -> Failure {
    Failure {
        code: 1,
        message: format!("{e:#}"),
    }
}

fn run(cli: Cli) -> Result<u8, Failure> {
    match cli.command {
        Cmd::Bench(a) => bench::run(a).map_err(fail),
        Cmd::Run(a) => run::run(a).map_err(fail),
        Cmd::Serve(a) => serve(*a).map_err(fail),
        Cmd::Ledger { command } => ledger(command).map_err(fail),
        Cmd::Token {
            command: TokenCmd::Create { name, role, groups },
            conn,
        } => {
            let v = request(
                &conn,
                json!({"op": "token", "name": name, "role": role, "groups": groups}),
            )?;
            if conn.json {
                println!("{v}");
            } else {
                println!("{}", v["token"].as_str().unwrap_or(""));
                eprintln!(
                    "created {} token {:?}; the secret above is shown only once",
                    v["role"].as_str().unwrap_or(""),
                    name
                );
            }
            Ok(0)
        }
        Cmd::Token {
            command: TokenCmd::Revoke { name },
            conn,
        } => {
            let v = request(&conn, json!({"op": "token_revoke", "name": name}))?;
            print_or(&conn, &v, || {
                println!("revoked {} token {}", s(&v["role"]), s(&v["name"]));
            });
            Ok(0)
        }
        Cmd::Runs { state, limit, conn } => {
            let mut req = json!({"op": "runs"});
            if let Some(s) = state {
                req["state"] = json!(s);
            }
            let v = listing(&conn, req, &["runs"], limit)?;
            print_or(&conn, &v, || {
                let rows: Vec<Vec<String>> = v["runs"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|r| {
                        let e = &r["effects"];
                        vec![
                            s(&r["run"]),
                            s(&r["state"]),
                            s(&r["owner"]),
                            r["parent"].as_str().unwrap_or("-").into(),
                            format!(
                                "{}/{}/{}/{}",
                                e["completed"], e["started"], e["held"], e["refused"]
                            ),
                            r["cause"].as_str().unwrap_or("-").into(),
                            r["reason"]
                                .as_str()
                                .map_or_else(|| "-".into(), |x| truncate(x, 40)),
                        ]
                    })
                    .collect();
                table(
                    &[
                        "RUN",
                        "STATE",
                        "OWNER",
                        "PARENT",
                        "DONE/FLYING/HELD/REFUSED",
                        "CAUSE",
                        "REASON",
                    ],
                    &rows,
                );
            });
            Ok(0)
        }
        Cmd::Pending { run, limit, conn } => {
            let mut req = json!({"op": "pending"});
            if let Some(r) = run {
                req["run"] = json!(r);
            }
            let v = listing(&conn, req, &["pending"], limit)?;
            print_or(&conn, &v, || {
                let now = now_ms();
                let rows: Vec<Vec<String>> = v["pending"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|p| {
                        let left = p["expires_at"].as_u64().unwrap_or(0).saturating_sub(now) / 1000;
                        let approvals = p["approvals"].as_array().map_or(0, Vec::len);
                        vec![
                            s(&p["run"]),
                            s(&p["key"]),
                            s(&p["tool"]),
                            p.get("args")
                                .map_or("(digest only)".into(), |a| truncate(&a.to_string(), 60)),
                            format!("{approvals}/{}", p["quorum"]),
                            format!("{left}s"),
                            s(&p["digest"])[..12.min(s(&p["digest"]).len())].to_string(),
                        ]
                    })
                    .collect();
                table(
                    &[
                        "RUN",
                        "KEY",
                        "TOOL",
                        "ARGS",
                        "QUORUM",
                        "EXPIRES IN",
                        "DIGEST",
                    ],
                    &rows,
                );
            });
            Ok(0)
        }
        Cmd::Approve(a) => decide(a, "approve"),
        Cmd::Reject(a) => decide(a, "reject"),
        Cmd::Cancel(a) => stop(
            &a.conn,
            json!({"op": "cancel", "run": a.run, "reason": a.reason}),
        ),
        Cmd::Kill(a) => stop(
            &a.conn,
            json!({"op": "kill", "run": a.run, "reason": a.reason}),
        ),
        Cmd::Pause(a) => stop(&a.conn, json!({"op": "pause", "run": a.run})),
        Cmd::Resume(a) => stop(&a.conn, json!({"op": "resume", "run": a.run})),
        Cmd::Close { run, failed, conn } => stop(
            &conn,
            json!({"op": "close", "run": run, "outcome": if failed { "failed" } else { "completed" }}),
        ),
        Cmd::Status(a) => {
            let v = request(&a.conn, json!({"op": "status", "run": a.run}))?;
            print_or(&a.conn, &v, || {
                for k in [
                    "run",
                    "state",
                    "owner",
                    "parent",
                    "cause",
                    "reason",
                    "stopped_at",
                    "forgotten",
                    "epoch",
                    "created_at",
                    "deadline_at",
                    "max_effects",
                ] {
                    if let Some(x) = v.get(k) {
                        println!("{k:<12} {}", s(x));
                    }
                }
                println!("{:<12} {}", "effects", s(&v["effects"]));
            });
            Ok(0)
        }
        Cmd::Report(a) => {
            let v = listing(
                &a.conn,
                json!({"op": "report", "run": a.run}),
                &REPORT_LISTS,
                None,
            )?;
            print_or(&a.conn, &v, || {
                println!(
                    "run {}  state {}  cause {}",
                    s(&v["run"]),
                    s(&v["state"]),
                    v["cause"].as_str().map_or(Cow::Borrowed("-"), esc)
                );
                if let Some(r) = v["reason"].as_str() {
                    println!("reason {}", esc(r));
                }
                if v["forgotten"].as_bool() == Some(true) {
                    println!(
                        "forgotten after retention (stopped at {}): only its fence is kept, so every section is empty; `estop ledger show --run` has what the ledger still holds",
                        v["stopped_at"]
                    );
                }
                for section in REPORT_LISTS {
                    let items = v[section].as_array().cloned().unwrap_or_default();
                    println!("\n{section} ({})", items.len());
                    for i in items {
                        let mut line = format!(
                            "  {:<24} {:<20} {}",
                            s(&i["key"]),
                            s(&i["tool"]),
                            s(&i["status"])
                        );
                        if let Some(r) = i["reason"].as_str() {
                            line.push_str(&format!(" ({})", esc(r)));
                        }
                        if i["late"].as_bool() == Some(true) {
                            line.push_str(" [late]");
                        }
                        if let Some(c) = i["compensate"].as_str() {
                            line.push_str(&format!(" undo: {}", esc(c)));
                        }
                        println!("{line}");
                    }
                }
            });
            Ok(0)
        }
    }
}

/// Agent-supplied text as it may reach a terminal: control, bidi and zero-width characters
/// shown escaped (`\u{202e}`), so a reason cannot forge a line or disguise an id. Every human
/// output goes through it (`--json` prints exact JSON instead).
fn esc(text: &str) -> Cow<'_, str> {
    estop_protocol::text::escape(text)
}

/// A JSON value as table text, escaped.
fn s(v: &Value) -> String {
    let text = v.as_str().map_or_else(|| v.to_string(), str::to_string);
    esc(&text).into_owned()
}

/// At most `n` characters of `s`, escaped (escaping first, so an escape is never cut short).
fn truncate(s: &str, n: usize) -> String {
    let s = esc(s);
    if s.chars().count() <= n {
        s.into_owned()
    } else {
        format!("{}…", s.chars().take(n).collect::<String>())
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(esc(c).chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let out: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{:<w$}", esc(c), w = widths[i]))
            .collect();
        println!("{}", out.join("  ").trim_end());
    };
    line(header.iter().map(|h| (*h).to_string()).collect());
    for r in rows {
        line(r.clone());
    }
    if rows.is_empty() {
        println!("(none)");
    }
}

fn print_or(conn: &Conn, v: &Value, human: impl FnOnce()) {
    if conn.json {
        println!("{v}");
    } else {
        human();
    }
}

fn target(conn: &Conn) -> String {
    conn.socket
        .clone()
        .unwrap_or_else(|| conn.data.join("estop.sock").display().to_string())
}

fn token(conn: &Conn) -> Result<String, Failure> {
    if let Some(t) = &conn.token {
        return Ok(t.clone());
    }
    let path = conn.data.join("operator.token");
    std::fs::read_to_string(&path).map(|t| t.trim().to_string()).map_err(|e| Failure {
        code: 1,
        message: format!("cannot read the operator token {}: {e} (pass --data DIR or --token, or set ESTOP_TOKEN)", path.display()),
    })
}

/// The lists of a report, in the order it is printed.
const REPORT_LISTS: [&str; 9] = [
    "done",
    "failed",
    "refused",
    "in_flight",
    "unknown",
    "held",
    "compensable",
    "irreversible",
    "undeclared",
];

/// Sends one request as the operator; maps error replies to exit codes.
fn request(conn: &Conn, req: Value) -> Result<Value, Failure> {
    call(conn, &mut connect(conn)?, req)
}

fn connect(conn: &Conn) -> Result<Client, Failure> {
    let token = token(conn)?;
    let io = |e: estop_server::client::ClientError| Failure {
        code: 1,
        message: e.to_string(),
    };
    let mut client = Client::connect(&target(conn)).map_err(io)?;
    let hello = client
        .call(json!({"op": "hello", "token": token}))
        .map_err(io)?;
    if let Some(e) = hello.error {
        return Err(Failure {
            code: 1,
            message: format!(
                "the gate refused the token ({}: {}); pass --token or ESTOP_TOKEN, or --data DIR",
                e.code, e.message
            ),
        });
    }
    Ok(client)
}

/// Reads a listing page by page, following its cursor, into one reply whose `lists` hold every
/// page's items: all of them, or the first `limit` of `lists[0]` (then `more` says whether
/// there were others).
fn listing(conn: &Conn, req: Value, lists: &[&str], limit: Option<u32>) -> Result<Value, Failure> {
    let mut client = connect(conn)?;
    let mut req = req;
    let mut all: Option<Value> = None;
    let mut count = 0;
    loop {
        if let Some(l) = limit {
            req["limit"] = json!(l.saturating_sub(count).max(1));
        }
        let mut page = call(conn, &mut client, req.clone())?;
        count += page[lists[0]].as_array().map_or(0, Vec::len) as u32;
        let next = page.get("next").and_then(Value::as_str).map(str::to_string);
        match &mut all {
            None => all = Some(page),
            Some(all) => {
                for list in lists {
                    let items = page[*list].as_array_mut().map(std::mem::take);
                    if let Some(dst) = all[*list].as_array_mut() {
                        dst.extend(items.into_iter().flatten());
                    }
                }
            }
        }
        let all = all.as_mut().expect("set above");
        let done = limit.is_some_and(|l| count >= l);
        match next {
            Some(next) if !done => req["cursor"] = json!(next),
            _ => {
                if let Some(o) = all.as_object_mut() {
                    o.remove("next");
                    if next.is_none() {
                        o.remove("more");
                    }
                }
                return Ok(all.take());
            }
        }
    }
}

/// Sends one request on `client`; maps error replies to exit codes.
fn call(conn: &Conn, client: &mut Client, req: Value) -> Result<Value, Failure> {
    let reply = client.call(req).map_err(|e| Failure {
        code: 1,
        message: e.to_string(),
    })?;
    if reply.ok {
        return Ok(reply.raw);
    }
    let e = reply.error.unwrap_or(estop_protocol::WireError {
        code: "internal".into(),
        message: "no error detail".into(),
    });
    let code = match e.kind() {
        Some(ErrorCode::NotFound) => 4,
        Some(
            ErrorCode::NotPending
            | ErrorCode::Conflict
            | ErrorCode::Forbidden
            | ErrorCode::BadToken,
        ) => 3,
        Some(ErrorCode::Unauthenticated) => 1,
        _ => 1,
    };
    if conn.json {
        println!("{}", reply.raw);
    }
    Err(Failure {
        code,
        message: format!("{}: {}", e.code, e.message),
    })
}

fn decide(a: DecideArgs, decision: &str) -> Result<u8, Failure> {
    let v = request(
        &a.conn,
        json!({"op": "decide", "run": a.run, "key": a.key, "decision": decision, "reason": a.reason}),
    )?;
    print_or(&a.conn, &v, || {
        let approvals = v["approvals"]
            .as_array()
            .map(|a| a.iter().map(s).collect::<Vec<_>>().join(", "))
            .unwrap_or_default();
        match s(&v["status"]).as_str() {
            "held" => println!(
                "recorded; {}/{} approvals so far ({approvals})",
                v["approvals"].as_array().map_or(0, Vec::len),
                v["quorum"]
            ),
            st => println!(
                "{st} ({} {}; approvers: {approvals})",
                esc(&a.run),
                esc(&a.key)
            ),
        }
    });
    Ok(0)
}

fn stop(conn: &Conn, req: Value) -> Result<u8, Failure> {
    let v = request(conn, req)?;
    print_or(conn, &v, || {
        let runs = v["runs"]
            .as_array()
            .map(|a| a.iter().map(s).collect::<Vec<_>>().join(", "))
            .unwrap_or_default();
        if runs.is_empty() {
            println!("run is {} (nothing changed)", s(&v["state"]));
        } else {
            println!("run is {}; changed: {runs}", s(&v["state"]));
        }
    });
    Ok(0)
}

fn serve(a: ServeArgs) -> Result<u8> {
    let mut opts = estop_server::ServeOptions::new(a.data);
    opts.listen = a.listen;
    opts.soundgate_listen = a.soundgate_listen;
    opts.soundgate_unauthenticated_decide = a.soundgate_unauthenticated_decide;
    opts.soundgate_secret = std::env::var("ESTOP_SOUNDGATE_SECRET")
        .ok()
        .filter(|s| !s.is_empty());
    opts.policy = a.policy;
    opts.allow_all = a.allow_all;
    opts.reset_tokens = a.reset_tokens;
    opts.connections_max = a.connections_max.max(1);
    opts.connections_per_principal_max = a.connections_per_principal_max;
    opts.soundgate_connections_max = a.soundgate_connections_max.max(1);
    let ms = |flag: &str, v: &str| {
        estop_policy::parse_duration_ms(v).map_err(|e| anyhow!("--{flag} {v}: {e}"))
    };
    opts.conn.hello_ms_max = ms("hello-timeout", &a.hello_timeout)?.max(1);
    opts.conn.idle_ms_max = ms("idle-timeout", &a.idle_timeout)?.max(1);
    let shares = |max: usize, per: Option<usize>| {
        let mut o = estop_server::quota::ShareOptions::derived(max.max(1), 1024);
        if let Some(n) = per {
            o.per_principal_max = n;
        }
        o
    };
    opts.core.waiters = shares(a.waiters_max, a.waiters_per_principal_max);
    opts.core.subscriptions = shares(a.subscriptions_max, a.subscriptions_per_principal_max);
    opts.conn.line_bytes_max = a.line_bytes_max;
    opts.conn.output_bytes_max = a.output_bytes_max;
    opts.conn.inflight_bytes_max = a.inflight_bytes_max.max(1);
    opts.conn.page_bytes_max = a.page_bytes_max;
    opts.core.snapshot_every_records = a.snapshot_every.max(1);
    opts.core.retention_ms = estop_policy::parse_duration_ms(&a.retention)
        .map_err(|e| anyhow!("--retention {}: {e}", a.retention))?;
    opts.core.tombstone_retention_ms = estop_policy::parse_duration_ms(&a.tombstone_retention)
        .map_err(|e| anyhow!("--tombstone-retention {}: {e}", a.tombstone_retention))?;
    if opts.core.tombstone_retention_ms < opts.core.retention_ms {
        return Err(anyhow!(
            "--tombstone-retention {} is shorter than --retention {}: a forgotten run's fence must outlive the run; give a longer --tombstone-retention",
            a.tombstone_retention,
            a.retention
        ));
    }
    for (flag, v) in [
        ("--runs-max", a.runs_max),
        ("--runs-per-principal-max", a.runs_per_principal_max),
        ("--held-max", a.held_max),
        ("--held-per-principal-max", a.held_per_principal_max),
        ("--tombstones-max", a.tombstones_max),
    ] {
        if v == 0 {
            return Err(anyhow!(
                "{flag} 0: a bound of nothing refuses everything; give at least 1"
            ));
        }
    }
    opts.limits.runs_max = a.runs_max;
    opts.limits.runs_per_principal_max = a.runs_per_principal_max;
    opts.limits.held_max = a.held_max;
    opts.limits.held_per_principal_max = a.held_per_principal_max;
    opts.limits.tombstones_max = a.tombstones_max;
    let mut services: Vec<Box<dyn estop_server::service::Service>> = Vec::new();
    if a.console.as_deref() != Some("off") {
        services.push(Box::new(estop_console::Console::new(
            estop_console::ConsoleOptions {
                required: a.console.is_some(),
                addr: a
                    .console
                    .unwrap_or_else(|| estop_console::DEFAULT_ADDR.to_string()),
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

fn ledger(cmd: LedgerCmd) -> Result<u8> {
    let (data, json_out) = match &cmd {
        LedgerCmd::Verify { data, json } | LedgerCmd::Show { data, json, .. } => {
            (data.clone(), *json)
        }
    };
    let dir = data.join("ledger");
    if !dir.is_dir() {
        return Err(anyhow!("no ledger at {} (pass --data DIR)", dir.display()));
    }
    let storage = estop_ledger::FileStorage::open_read_only(&dir)?;
    match cmd {
        LedgerCmd::Verify { .. } => {
            let r = estop_ledger::verify(&storage);
            let preallocated: u64 = r.segments.iter().map(|s| s.preallocated_bytes).sum();
            let out = json!({
                "ok": r.is_ok(),
                "segments": r.segments.len(),
                "records": r.records,
                "first_seq": r.first_seq,
                "last_seq": r.last_seq,
                "snapshot_seq": r.snapshot.as_ref().map(|s| s.seq),
                "torn_tail": r.torn_tail.as_ref().map(|t| json!({"segment": t.segment, "offset": t.offset, "bytes": t.bytes_dropped, "reason": t.reason})),
                "preallocated_bytes": preallocated,
                "error": r.error.as_ref().map(ToString::to_string),
            });
            if json_out {
                println!("{out}");
            } else {
                println!(
                    "segments {}  records {}  seq {}..{}",
                    r.segments.len(),
                    r.records,
                    r.first_seq.unwrap_or(0),
                    r.last_seq
                );
                if let Some(s) = &r.snapshot {
                    println!("snapshot at seq {}", s.seq);
                }
                if preallocated > 0 {
                    println!("preallocated zeros after the last record: {preallocated} bytes");
                }
                if let Some(t) = &r.torn_tail {
                    println!(
                        "torn tail: {} bytes at {} offset {}: {} (a restart truncates it)",
                        t.bytes_dropped, t.segment, t.offset, t.reason
                    );
                }
                match &r.error {
                    None => println!("ok"),
                    Some(e) => println!("CORRUPT: {e}"),
                }
            }
            Ok(if r.is_ok() { 0 } else { 1 })
        }
        LedgerCmd::Show { run, .. } => {
            let mut bad = None;
            let report = estop_ledger::inspect(&storage, |rv| {
                match estop_kernel::codec::decode_record(rv.payload) {
                    Ok(rec) => {
                        if run
                            .as_deref()
                            .is_some_and(|r| rec.command.run().map(|x| x.as_str()) != Some(r))
                        {
                            return;
                        }
                        let e = estop_server::describe::entry(rv.seq, &rec);
                        if json_out {
                            println!("{}", serde_json::to_string(&e).unwrap_or_default());
                        } else {
                            let fields: Vec<String> = e
                                .fields
                                .iter()
                                .map(|(k, v)| format!("{k}={}", s(v)))
                                .collect();
                            println!(
                                "{:>8} {} {:<8} {} {} {}",
                                e.seq,
                                e.at,
                                e.kind,
                                esc(e.run.as_deref().unwrap_or("-")),
                                esc(e.key.as_deref().unwrap_or("-")),
                                fields.join(" ")
                            );
                        }
                    }
                    Err(err) => {
                        bad = Some(format!(
                            "seq {} in {} at offset {}: {err}",
                            rv.seq, rv.segment, rv.offset
                        ))
                    }
                }
            });
            if let Some(b) = bad {
                return Err(anyhow!("undecodable record: {b}"));
            }
            if let Some(e) = report.error {
                return Err(anyhow!("{e}"));
            }
            Ok(0)
        }
    }
}
