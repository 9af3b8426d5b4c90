//! `estop agent run`: one trajectory from the command line, under a config file, against a
//! running gate. Returns when the trajectory is terminal (or resumes it, when its id is found
//! live in the journal).

use crate::config::Config;
use crate::gate::GateConfig;
use crate::machine::State;
use crate::model::ModelClient;
use crate::record::{CallLimits, Record};
use crate::runner::{Runner, RunnerOptions};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct AgentRun {
    pub config: PathBuf,
    pub model: String,
    /// Tool names from the config (all of them when empty).
    pub tools: Vec<String>,
    pub task: String,
    /// The trajectory (and gate run) id; a fresh one when `None`.
    pub id: Option<String>,
    pub parent: Option<String>,
    /// Retry this ended trajectory: a new one with its task (unless `task` is not empty), its
    /// parent and its budget carried over (`Runner::start_retry`).
    pub retry_of: Option<String>,
    /// The journal directory.
    pub journal: PathBuf,
    pub gate: GateConfig,
    /// The daemon's data directory: `sandbox = true` commands are started by `estop run` on it.
    pub data: PathBuf,
    /// A task contract file (crate::contract), in place of the config's `[contract]`.
    pub contract: Option<PathBuf>,
    /// The scheduler's class (`--class`): standard for a new trajectory unless given, the
    /// retried one's for a retry unless given; a resume keeps the recorded one.
    pub class: Option<crate::scheduler::Class>,
}

/// How the trajectory ended: its record and the model's last answer.
#[derive(Debug)]
pub struct Outcome {
    pub record: Record,
    pub answer: Option<String>,
}

pub fn run(a: AgentRun) -> anyhow::Result<Outcome> {
    let config = Config::load(&a.config)?;
    let contract = match &a.contract {
        Some(p) => {
            let c = crate::contract::Contract::load(p).map_err(anyhow::Error::msg)?;
            if !c.workspace_files.is_empty() && config.harness.workspaces.is_none() {
                anyhow::bail!(
                    "the contract {}: workspace_files needs [harness] workspaces (the \
                     workspace lease)",
                    p.display()
                );
            }
            Some(c)
        }
        None => config.contract.clone(),
    };
    let m = config.model(&a.model)?;
    let key = match &m.api_key_env {
        Some(var) => Some(
            std::env::var(var)
                .map_err(|_| anyhow::anyhow!("the model's api_key_env {var} is not set"))?,
        ),
        None => None,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    if a.retry_of.is_some() && a.parent.is_some() {
        anyhow::bail!("a retry keeps the parent of the trajectory it retries: leave out --parent");
    }
    if a.retry_of.is_none() && a.task.trim().is_empty() {
        anyhow::bail!("no task: give the task, or --retry-of a trajectory to retry its task");
    }
    let id = a.id.clone().unwrap_or_else(|| match &a.retry_of {
        Some(of) => format!("{of}-retry-{}", crate::runner::now_ms()),
        None => format!("agent-{}", crate::runner::now_ms()),
    });
    let sandbox = crate::runner::SandboxLaunch {
        estop: std::env::current_exe()?,
        data: a.data.clone(),
        socket: a.gate.target.clone(),
        token: a.gate.token.clone(),
    };
    // The MCP servers are started (and their tools listed) before the trajectory starts; a
    // sandboxed one as a child run of the trajectory's.
    let sandboxed = crate::mcp::SandboxedServers {
        launch: &sandbox,
        run: &id,
    };
    // MCP tools' words are pinned beside the journal (`estop mcp` pins its own in DATA).
    let pins = if config.servers.is_empty() {
        None
    } else {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&a.journal)?;
        Some(estop_mcp::pins::Pins::open(
            &a.journal.join("mcp-pins.json"),
        )?)
    };
    let (upstreams, mcp_tools) = rt.block_on(crate::mcp::Upstreams::start(
        &config.servers,
        Some(sandboxed),
        pins,
    ))?;
    let opts = RunnerOptions {
        data: a.journal.clone(),
        gate: a.gate.clone(),
        model: ModelClient::new(&m.base_url, key)?,
        call_limits: CallLimits {
            model: m.name.clone(),
            max_output_tokens: m.max_output_tokens,
            call_deadline_ms: m.call_deadline_ms,
            tool_deadline_ms: config.harness.tool_deadline_ms,
            retry: m.retry(),
        },
        limits: config.limits(),
        prices: m.prices(),
        tools: config.tools(&a.tools, mcp_tools)?,
        upstreams,
        subagents: config.subagents.clone(),
        workspaces: config.harness.workspaces.clone(),
        contract,
        sandbox: Some(sandbox.clone()),
        system: config.harness.system.clone(),
        grace: Duration::from_millis(config.harness.grace_ms),
        workers: config.harness.workers,
        // A local bucket a tenth under the provider's limits.
        tpm: (m.tpm - m.tpm / 10).max(1),
        rpm: (m.rpm - m.rpm / 10).max(1),
        journal: config.journal,
    };
    rt.block_on(async move {
        let mut runner = Runner::open(opts)?;
        match runner.record(&id) {
            None => match &a.retry_of {
                Some(of) => {
                    let task = Some(a.task.as_str()).filter(|t| !t.trim().is_empty());
                    runner.start_retry(&id, of, task, a.class)?
                }
                None => {
                    let class = a.class.unwrap_or_default();
                    runner.start_in(&id, a.parent.as_deref(), &a.task, class)?
                }
            },
            Some(r) if r.state.is_terminal() => {
                anyhow::bail!("trajectory {id} already ended ({})", r.state)
            }
            Some(r) => {
                if let Some(c) = a.class.filter(|c| *c != r.class) {
                    anyhow::bail!(
                        "trajectory {id} is live in class {}: a resume keeps it (leave out \
                         --class {})",
                        r.class.as_str(),
                        c.as_str()
                    );
                }
            }
        }
        runner.run().await?;
        let record = runner.record(&id).expect("started").clone();
        let answer = runner
            .context(&id)
            .iter()
            .rev()
            .find(|m| m.role == crate::chat::Role::Assistant && m.content.is_some())
            .and_then(|m| m.content.clone())
            .filter(|_| record.state == State::Completed);
        Ok(Outcome { record, answer })
    })
}
