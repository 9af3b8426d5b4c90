//! The `estop` binary: flags and wiring only. Exit codes: 0 ok, 1 error, 2 usage, 3 refused,
//! 4 not found (docs in README.md).
//!
//! Each command group lives in its own module: `serve`, `ledger` (the files), `read` (runs,
//! pending, status, report) and `act` (decisions, stops, tokens) over `remote` (the typed
//! client session), `run` (the sandbox, crates/egress), `mcp` (the MCP gateway, crates/mcp)
//! and `bench`.

mod act;
mod agent;
mod bench;
mod bench_agents;
mod bench_store;
mod ledger;
mod mcp;
mod read;
mod remote;
mod run;
mod serve;
mod show;
mod store;

use clap::{Args, Parser, Subcommand};
use estop_protocol::Verb;
use remote::{Ask, Conn, Failure};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "estop", version, about = "estop: make \"stop\" mean stop for AI agents", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the gate daemon on the embedded ledger.
    Serve(Box<serve::ServeArgs>),
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
    /// Move a reverse saga where it waits for a human, or compensate one effect of a stopped
    /// run (operator).
    Compensate {
        #[command(subcommand)]
        action: CompensateCmd,
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
        command: ledger::LedgerCmd,
    },
    /// Move the gate's records between the embedded ledger and PostgreSQL (daemons stopped).
    Store {
        #[command(subcommand)]
        command: store::StoreCmd,
    },
    /// Measure: closed-loop durable admissions (default), or `kernel` / `recovery` figures.
    Bench(bench::BenchArgs),
    /// Run a command in a sandbox whose only way out is the gate (docs/EGRESS.md).
    Run(run::RunArgs),
    /// Run the HTTP undos (`compensate = "http.…"`) of stopped runs, long after `estop run`
    /// has ended (docs/EGRESS.md, "Undoing HTTP effects").
    EgressExecutor(run::ExecutorArgs),
    /// The sandboxes' egress CA: rotate it, end a rotation's overlap (docs/EGRESS.md).
    Egress {
        #[command(subcommand)]
        command: run::EgressCmd,
    },
    /// Serve MCP on stdio, fronting upstream MCP servers; every tool call admitted by the gate (docs/MCP.md).
    Mcp(mcp::McpArgs),
    /// Run agent loops under the gate: trajectories, budgets, approvals (docs/HARNESS.md).
    Agent {
        #[command(subcommand)]
        command: agent::AgentCmd,
    },
}

#[derive(Subcommand)]
enum TokenCmd {
    /// Create a named token; prints its secret once.
    Create {
        name: String,
        /// agent, operator, observer (reads runs, reports and metrics; changes nothing), or
        /// executor (runs compensations and lookups only: `estop egress-executor --token`).
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
enum CompensateCmd {
    /// Say whether an effect of unknown outcome happened (`ok`: it is undone next; `error`:
    /// nothing to undo), or stop waiting for a call a stopped run's agent left in flight.
    Settle {
        run: String,
        key: String,
        /// ok or error; for a call left in flight also unknown (then its lookup or you settle it).
        #[arg(long)]
        outcome: String,
        /// With `ok`: the call's result as JSON, if known, so an undo built from `result.*`
        /// can be built.
        #[arg(long)]
        result: Option<String>,
    },
    /// Give a failed undo (or one waiting for a human) 5 more attempts, the next at once; of
    /// an unknown outcome whose lookup could not tell, ask the lookup again.
    Retry { run: String, key: String },
    /// Compensate one effect of a run stopped without a saga (killed, closed, out of time or
    /// budget): it gets a saga of its own, run by an executor.
    Effect { run: String, key: String },
    /// Give up undoing an effect, for a reason that is recorded.
    Skip {
        run: String,
        key: String,
        #[arg(long)]
        reason: String,
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

fn main() -> ExitCode {
    if let Some(code) = estop_egress::sandbox::stage_main() {
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    let cli = Cli::parse();
    if prints_and_ends(&cli.command) {
        // Rust ignores SIGPIPE, so `estop runs | head` would panic on the closed pipe. A
        // command that prints and ends dies of the signal instead, as `ls | head` does.
        // The long-lived commands keep it ignored: a daemon, a sandbox supervisor or a
        // gateway must not die because one peer went away.
        // SAFETY: set once at start, before any thread exists.
        #[allow(unsafe_code)]
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    match run(cli.command) {
        Ok(code) => ExitCode::from(code),
        Err(f) => {
            // Error messages quote ids and text the gate was sent: escaped like everything else.
            eprintln!("estop: {}", show::esc(&f.message));
            ExitCode::from(f.code)
        }
    }
}

/// Every command but the long-lived ones (the daemon, `run`, `mcp`, `agent`, `bench`).
fn prints_and_ends(command: &Cmd) -> bool {
    !matches!(
        command,
        Cmd::Serve(_) | Cmd::Run(_) | Cmd::Mcp(_) | Cmd::Agent { .. } | Cmd::Bench(_)
    )
}

fn fail(e: anyhow::Error) -> Failure {
    Failure::new(format!("{e:#}"))
}

fn run(command: Cmd) -> Result<u8, Failure> {
    match command {
        Cmd::Bench(a) => bench::run(a).map_err(fail),
        Cmd::Run(a) => run::run(a).map_err(fail),
        Cmd::EgressExecutor(a) => run::executor(a).map(|()| 0).map_err(fail),
        Cmd::Egress { command } => run::egress(command).map_err(fail),
        Cmd::Mcp(a) => mcp::run(a).map_err(fail),
        Cmd::Agent { command } => agent::run(command),
        Cmd::Serve(a) => serve::serve(*a).map_err(fail),
        Cmd::Ledger { command } => ledger::ledger(command).map_err(fail),
        Cmd::Store { command } => store::run(command).map_err(fail),
        Cmd::Token { command, conn } => match command {
            TokenCmd::Create { name, role, groups } => {
                act::token_create(&conn, name, role, &groups)
            }
            TokenCmd::Revoke { name } => act::token_revoke(&conn, name),
        },
        Cmd::Runs { state, limit, conn } => read::runs(&conn, state, limit),
        Cmd::Pending { run, limit, conn } => read::pending(&conn, run, limit),
        Cmd::Status(a) => read::status(&a.conn, a.run),
        Cmd::Report(a) => read::report(&a.conn, a.run),
        Cmd::Compensate { action, conn } => {
            let ask = |action: &str, run: String, key: String| {
                Ask::new(Verb::Saga)
                    .text("run", run)
                    .text("key", key)
                    .text("action", action)
            };
            let ask = match action {
                CompensateCmd::Settle {
                    run,
                    key,
                    outcome,
                    result,
                } => {
                    let result = match result.as_deref().map(serde_json::from_str) {
                        Some(Err(e)) => {
                            return Err(Failure {
                                code: 2,
                                message: format!("--result is not JSON: {e}"),
                            });
                        }
                        r => r.transpose().expect("errors returned above"),
                    };
                    ask("settle", run, key)
                        .text("outcome", outcome)
                        .json_opt("result", result)
                }
                CompensateCmd::Retry { run, key } => ask("retry", run, key),
                CompensateCmd::Effect { run, key } => ask("compensate", run, key),
                CompensateCmd::Skip { run, key, reason } => {
                    ask("skip", run, key).text("reason", reason)
                }
            };
            act::saga(&conn, ask)
        }
        Cmd::Approve(a) => act::decide(&a.conn, a.run, a.key, "approve", a.reason),
        Cmd::Reject(a) => act::decide(&a.conn, a.run, a.key, "reject", a.reason),
        Cmd::Cancel(a) => stop(&a.conn, Verb::Cancel, a.run, a.reason),
        Cmd::Kill(a) => stop(&a.conn, Verb::Kill, a.run, a.reason),
        Cmd::Pause(a) => stop(&a.conn, Verb::Pause, a.run, None),
        Cmd::Resume(a) => stop(&a.conn, Verb::Resume, a.run, None),
        Cmd::Close { run, failed, conn } => {
            let outcome = if failed { "failed" } else { "completed" };
            let ask = Ask::new(Verb::Close)
                .text("run", run)
                .text("outcome", outcome);
            act::run_state(&conn, ask)
        }
    }
}

/// cancel, kill, pause or resume of `run`.
fn stop(conn: &Conn, verb: Verb, run: String, reason: Option<String>) -> Result<u8, Failure> {
    act::run_state(
        conn,
        Ask::new(verb).text("run", run).text_opt("reason", reason),
    )
}
