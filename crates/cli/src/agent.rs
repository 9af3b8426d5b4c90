//! `estop agent run`: the command's flags, handed to `estop_harness::agent::run`
//! (docs/HARNESS.md). Exit 0 when the trajectory completed, 3 when it ended otherwise.

use clap::{Args, Subcommand};
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum AgentCmd {
    /// Run one trajectory for TASK until it ends (or resume it by --id after a crash).
    Run(AgentRunArgs),
}

#[derive(Args)]
pub struct AgentRunArgs {
    /// The harness config (TOML: [harness], [[model]] with prices and limits, [budget],
    /// [[tool]]).
    #[arg(long)]
    config: PathBuf,
    /// The [[model]] of the config to call.
    #[arg(long)]
    model: String,
    /// Tools of the config to offer, comma-separated (default: all).
    #[arg(long, value_delimiter = ',')]
    tools: Vec<String>,
    /// The trajectory's id (its run at the gate; default: a fresh `agent-…`). An id found live
    /// in the journal is resumed.
    #[arg(long)]
    id: Option<String>,
    /// The parent run (a cancel of the parent reaches this trajectory).
    #[arg(long)]
    parent: Option<String>,
    /// Data directory of the daemon (its socket and agent token; the journal goes in
    /// DATA/harness unless --journal says otherwise).
    #[arg(long, env = "ESTOP_DATA", default_value = "estop-data")]
    data: PathBuf,
    #[arg(long)]
    journal: Option<PathBuf>,
    /// Socket path of the daemon (default: DATA/estop.sock).
    #[arg(long, env = "ESTOP_SOCKET")]
    socket: Option<String>,
    /// The agent token the run belongs to (default: DATA/agent.token).
    #[arg(long, env = "ESTOP_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Print the final record as JSON.
    #[arg(long)]
    json: bool,
    /// The task.
    task: String,
}

pub fn run(cmd: AgentCmd) -> anyhow::Result<u8> {
    let AgentCmd::Run(a) = cmd;
    let token = match a.token {
        Some(t) => t,
        None => std::fs::read_to_string(a.data.join("agent.token"))
            .map_err(|e| {
                anyhow::anyhow!(
                    "cannot read {}/agent.token: {e} (pass --token)",
                    a.data.display()
                )
            })?
            .trim()
            .to_string(),
    };
    let target = a
        .socket
        .unwrap_or_else(|| a.data.join("estop.sock").display().to_string());
    let out = estop_harness::agent::run(estop_harness::agent::AgentRun {
        config: a.config,
        model: a.model,
        tools: a.tools,
        task: a.task,
        id: a.id,
        parent: a.parent,
        journal: a.journal.unwrap_or_else(|| a.data.join("harness")),
        gate: estop_harness::gate::GateConfig { target, token },
    })?;
    let r = &out.record;
    if a.json {
        println!("{}", serde_json::to_string_pretty(r)?);
    } else {
        let s = &r.budget.spend;
        println!(
            "{} {} turns={} tokens={} (uncached {} cached {} output {}) usd={:.6}",
            estop_protocol::text::escape(&r.identity.id),
            r.state,
            s.turns,
            s.tokens(),
            s.uncached_input,
            s.cached_input,
            s.output,
            s.usd_micros as f64 / 1e6
        );
        if let Some(exit) = &r.exit {
            println!(
                "exit {}",
                estop_protocol::text::escape(&serde_json::to_string(exit)?)
            );
        }
        if let Some(answer) = &out.answer {
            println!("{}", estop_protocol::text::escape(answer));
        }
    }
    Ok(if r.state == estop_harness::machine::State::Completed {
        0
    } else {
        3
    })
}
