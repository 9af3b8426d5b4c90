//! `estop run` and `estop egress-executor`: their flags, handed to `estop_egress` (docs/EGRESS.md).

use clap::{Args, Subcommand};
use std::path::PathBuf;

#[derive(Args)]
#[command(trailing_var_arg = true)]
pub struct RunArgs {
    /// The run's id (default: a fresh `run-…`); the sandbox's effects all belong to it.
    #[arg(long)]
    run: Option<String>,
    /// The parent run (a cancel of the parent reaches this run).
    #[arg(long)]
    parent: Option<String>,
    /// The sandbox's settings (TOML, table [egress]: allow_destinations, hold_ms, pids_max,
    /// memory_max, body_bytes_max, response_bytes_max, upstream_roots, credentials). What
    /// requests may do is the gate's policy.
    #[arg(long)]
    policy: Option<PathBuf>,
    /// Data directory of the daemon (its socket and agent token; hidden from the sandbox).
    #[arg(long, env = "ESTOP_DATA", default_value = "estop-data")]
    data: PathBuf,
    /// Socket path of the daemon (default: DATA/estop.sock).
    #[arg(long, env = "ESTOP_SOCKET")]
    socket: Option<String>,
    /// The agent token the run belongs to (default: DATA/agent.token); never shown to the
    /// command.
    #[arg(long, env = "ESTOP_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// The command and its arguments, after `--`.
    #[arg(required = true, num_args = 1.., allow_hyphen_values = true)]
    command: Vec<String>,
}

/// Runs the command in the sandbox and returns its exit status (as estop's own).
pub fn run(a: RunArgs) -> anyhow::Result<u8> {
    let code = estop_egress::run(estop_egress::RunOptions {
        data: a.data,
        socket: a.socket,
        token: a.token,
        run: a.run,
        parent: a.parent,
        policy: a.policy,
        argv: a.command,
    })?;
    Ok(u8::try_from(code).unwrap_or(1))
}

#[derive(Args)]
pub struct ExecutorArgs {
    /// Only this run's compensations (default: every run the token may see).
    #[arg(long)]
    run: Option<String>,
    /// The `[egress]` settings the undos are sent with: allow_destinations, upstream_roots,
    /// credentials, body_bytes_max (give the file the sandboxes use).
    #[arg(long)]
    policy: Option<PathBuf>,
    /// Data directory of the daemon (its socket and agent token).
    #[arg(long, env = "ESTOP_DATA", default_value = "estop-data")]
    data: PathBuf,
    /// Socket path of the daemon (default: DATA/estop.sock).
    #[arg(long, env = "ESTOP_SOCKET")]
    socket: Option<String>,
    /// The token whose runs' undos this executor runs (default: DATA/agent.token, the
    /// principal `estop run`'s runs belong to; an operator token runs every principal's).
    #[arg(long, env = "ESTOP_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

/// Serves HTTP undos until stopped (or until the gate refuses the token).
pub fn executor(a: ExecutorArgs) -> anyhow::Result<()> {
    estop_egress::undo::serve(estop_egress::undo::ExecutorOptions {
        data: a.data,
        socket: a.socket,
        token: a.token,
        policy: a.policy,
        run: a.run,
    })
}

#[derive(Subcommand)]
pub enum EgressCmd {
    /// The egress CA that signs the certificates the proxy shows inside sandboxes.
    Ca {
        #[command(subcommand)]
        command: CaCmd,
    },
}

#[derive(Subcommand)]
pub enum CaCmd {
    /// Make a new CA: sandboxes started from now on get its certificates and trust the old
    /// CA's too until `retire`; the old key is deleted; running sandboxes go on as they were.
    Rotate {
        /// Data directory of the daemon (where the CA lives).
        #[arg(long, env = "ESTOP_DATA", default_value = "estop-data")]
        data: PathBuf,
    },
    /// End the overlap: sandboxes started from now on trust the current CA alone.
    Retire {
        /// Data directory of the daemon (where the CA lives).
        #[arg(long, env = "ESTOP_DATA", default_value = "estop-data")]
        data: PathBuf,
    },
}

/// `estop egress ca rotate|retire`: prints the certificates' SHA-256 fingerprints.
pub fn egress(command: EgressCmd) -> anyhow::Result<u8> {
    let EgressCmd::Ca { command } = command;
    let r = match &command {
        CaCmd::Rotate { data } => estop_egress::tls::rotate(data)?,
        CaCmd::Retire { data } => estop_egress::tls::retire(data)?,
    };
    println!("current  sha256:{}", r.current);
    match (&command, r.previous) {
        (CaCmd::Rotate { .. }, Some(p)) => println!(
            "previous sha256:{p} (still trusted by new sandboxes until `estop egress ca retire`)"
        ),
        (CaCmd::Retire { .. }, Some(p)) => println!("retired  sha256:{p}"),
        (_, None) => println!("no previous CA: nothing was retired"),
    }
    Ok(0)
}
