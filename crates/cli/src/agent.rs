//! `estop agent run`: the command's flags, handed to `estop_harness::agent::run`
//! (docs/HARNESS.md). Exit 0 when the trajectory completed, 3 when it ended otherwise.
//! `estop agent interrupt|budget|status` reach a running `estop agent run` through its control
//! socket (`estop_harness::control`); `pause|resume|cancel|kill` are the gate's verbs on the
//! trajectory's run, which the runner hears as control requests.

use crate::remote::{Ask, Conn, Failure};
use clap::{Args, Subcommand};
use estop_harness::control::{self, AskError};
use estop_protocol::Verb;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum AgentCmd {
    /// Run one trajectory for TASK until it ends (or resume it by --id after a crash).
    Run(AgentRunArgs),
    /// Interrupt a running trajectory with a new user message (applied at its next turn
    /// boundary; an open model stream is cut). Operator token.
    Interrupt {
        trajectory: String,
        message: String,
        #[command(flatten)]
        at: Runner,
    },
    /// Change a running trajectory's budget ceilings (applied at its next turn boundary; the
    /// dimensions not given stay). Operator token.
    Budget {
        trajectory: String,
        #[arg(long)]
        turns: Option<u64>,
        #[arg(long)]
        tokens: Option<u64>,
        /// Wall clock from the trajectory's start (less the time awaiting approval), in
        /// milliseconds.
        #[arg(long)]
        wall_ms: Option<u64>,
        /// Dollars.
        #[arg(long)]
        usd: Option<f64>,
        #[command(flatten)]
        at: Runner,
    },
    /// A running trajectory's record: state, budget vector and spend, pending work, stored
    /// control requests.
    Status {
        trajectory: String,
        #[command(flatten)]
        at: Runner,
    },
    /// The trajectories in the journal, live and ended (read from it without its lock, beside a
    /// running runner): id, state, turns, budget stage, pending work, control requests, exit
    /// and task, in id order.
    List {
        /// all, live or ended.
        #[arg(long, default_value = "all")]
        state: String,
        /// Start after this id (the `next` of the previous page).
        #[arg(long)]
        after: Option<String>,
        /// At most this many (1 to 200).
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// (`--json`: one JSON object, {"trajectories": […], "next": …}.)
        #[command(flatten)]
        at: Runner,
    },
    /// Pause the trajectory's run at the gate (the trajectory pauses at its next boundary).
    Pause {
        trajectory: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Resume it.
    Resume {
        trajectory: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Cancel it (at its next boundary; an open model stream is cut).
    Cancel {
        trajectory: String,
        #[arg(long)]
        reason: Option<String>,
        #[command(flatten)]
        conn: Conn,
    },
    /// Kill it (at once: running tools are killed and their outcome is unknown).
    Kill {
        trajectory: String,
        #[arg(long)]
        reason: Option<String>,
        #[command(flatten)]
        conn: Conn,
    },
}

/// Where the runner listens, and as whom to ask it.
#[derive(Args)]
pub struct Runner {
    /// The runner's journal directory (default: DATA/harness), where its control.sock is.
    #[arg(long)]
    journal: Option<PathBuf>,
    #[command(flatten)]
    conn: Conn,
}

#[derive(Args)]
pub struct AgentRunArgs {
    /// The harness config (TOML: [harness], [[model]] with prices and limits, [budget],
    /// [[tool]] (commands, sandboxed or not, and HTTP tools), [[server]] (MCP servers)).
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
    /// Retry this ended trajectory (failed or cancelled): a new trajectory (its id from --id,
    /// else `ID-retry-…`) with the same task (unless TASK is given) and parent, linked to it
    /// (`retry_of`), whose budget carries over: it starts with everything ID spent (turns,
    /// tokens, dollars, wall clock) under ID's ceilings.
    #[arg(long, value_name = "ID")]
    retry_of: Option<String>,
    /// The scheduler's class of its turns: interactive, standard (default) or batch (weights
    /// 4, 2, 1). Recorded: a resume keeps it, a retry inherits it unless given.
    #[arg(long, value_parser = parse_class)]
    class: Option<estop_harness::scheduler::Class>,
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
    /// A task contract (TOML, the fields of the config's [contract]: answer_format,
    /// required_keys, answer_matches, must_call, workspace_files, attempts), in place of the
    /// config's: the completion check the answer must pass for the trajectory to complete.
    #[arg(long, value_name = "FILE")]
    contract: Option<PathBuf>,
    /// Print the final record as JSON.
    #[arg(long)]
    json: bool,
    /// The task (with --retry-of: leave it out to retry the same task).
    #[arg(default_value = "")]
    task: String,
}

pub fn run(cmd: AgentCmd) -> Result<u8, Failure> {
    let gate = |verb, trajectory, reason| {
        Ask::new(verb)
            .text("run", trajectory)
            .text_opt("reason", reason)
    };
    match cmd {
        AgentCmd::Run(a) => run_one(a).map_err(crate::fail),
        AgentCmd::Interrupt {
            trajectory,
            message,
            at,
        } => ask(&at, trajectory, control::Ask::Interrupt { message }),
        AgentCmd::Budget {
            trajectory,
            turns,
            tokens,
            wall_ms,
            usd,
            at,
        } => {
            let usd_micros_max = match usd {
                Some(d) if !(d.is_finite() && d >= 0.0) => {
                    return Err(Failure::new(format!(
                        "--usd {d} is not an amount of dollars"
                    )));
                }
                Some(d) => Some((d * 1e6).round() as u64),
                None => None,
            };
            let change = estop_harness::budget::Limits {
                turns_max: turns,
                tokens_max: tokens,
                wall_ms_max: wall_ms,
                usd_micros_max,
            };
            ask(&at, trajectory, control::Ask::Budget { change })
        }
        AgentCmd::Status { trajectory, at } => ask(&at, trajectory, control::Ask::Status),
        AgentCmd::List {
            state,
            after,
            limit,
            at,
        } => list(&at, &state, after.as_deref(), limit),
        AgentCmd::Pause { trajectory, conn } => {
            crate::act::run_state(&conn, gate(Verb::Pause, trajectory, None))
        }
        AgentCmd::Resume { trajectory, conn } => {
            crate::act::run_state(&conn, gate(Verb::Resume, trajectory, None))
        }
        AgentCmd::Cancel {
            trajectory,
            reason,
            conn,
        } => crate::act::run_state(&conn, gate(Verb::Cancel, trajectory, reason)),
        AgentCmd::Kill {
            trajectory,
            reason,
            conn,
        } => crate::act::run_state(&conn, gate(Verb::Kill, trajectory, reason)),
    }
}

/// `estop agent list`: a page of the journal's trajectories. The texts (task, exit reason) are
/// the agent's and the model's: printed quoted and escaped, never raw to the terminal.
fn list(at: &Runner, state: &str, after: Option<&str>, limit: usize) -> Result<u8, Failure> {
    use estop_harness::view::{self, ViewLimits, Which};
    let which = Which::parse(state)
        .ok_or_else(|| Failure::new(format!("--state {state:?}: use all, live or ended")))?;
    let lim = ViewLimits::default();
    if !(1..=lim.page_max).contains(&limit) {
        return Err(Failure::new(format!(
            "--limit {limit}: from 1 to {}",
            lim.page_max
        )));
    }
    let dir = at
        .journal
        .clone()
        .unwrap_or_else(|| at.conn.data.join("harness"))
        .join("journal");
    let now = estop_harness::runner::now_ms();
    let page = view::list(&dir, which, after, limit, now, &lim)
        .map_err(|e| Failure::new(format!("{}: {e}", dir.display())))?;
    if at.conn.json {
        println!(
            "{}",
            serde_json::to_string(&page).map_err(|e| Failure::new(e.to_string()))?
        );
        return Ok(0);
    }
    for t in &page.trajectories {
        let s = |k: &str| t[k].as_str().unwrap_or("-").to_string();
        let b = &t["budget"];
        let turns = &b["dimensions"][0];
        let turns = match turns["limit"].as_u64() {
            Some(max) => format!("{}/{max}", turns["spent"]),
            None => turns["spent"].to_string(),
        };
        let exit = match t["exit"].as_object() {
            Some(e) => format!(
                " exit={}{}",
                e["exit"].as_str().unwrap_or("-"),
                e["reason"]
                    .as_str()
                    .filter(|r| !r.is_empty())
                    .map(|r| format!(":{r:?}"))
                    .unwrap_or_default()
            ),
            None => String::new(),
        };
        let len = |k: &str| t[k].as_array().map_or(0, Vec::len);
        println!(
            "{} {} turns={turns} stage={} pending={} held={} control={}{exit}{}{} task={:?}",
            s("id"),
            s("state"),
            b["stage"].as_str().unwrap_or("-"),
            len("pending"),
            len("held"),
            len("control"),
            t["parent"]
                .as_str()
                .map(|p| format!(" parent={p}"))
                .unwrap_or_default(),
            t["class"]
                .as_str()
                .filter(|c| *c != "standard")
                .map(|c| format!(" class={c}"))
                .unwrap_or_default(),
            s("task"),
        );
    }
    if let Some(next) = &page.next {
        println!("(more: --after {next})");
    }
    Ok(0)
}

/// One request to the runner's control socket, printed (JSON with --json).
fn ask(at: &Runner, trajectory: String, what: control::Ask) -> Result<u8, Failure> {
    let dir = at
        .journal
        .clone()
        .unwrap_or_else(|| at.conn.data.join("harness"));
    let status = what == control::Ask::Status;
    let req = control::Request {
        token: crate::remote::token(&at.conn)?,
        trajectory,
        ask: what,
    };
    let v = control::ask(&dir, &req).map_err(|e| match e {
        AskError::Refused(r) => Failure::new(format!("refused: {r}")),
        e => Failure::new(e.to_string()),
    })?;
    if at.conn.json {
        println!("{v}");
    } else if status {
        print_status(&v)?;
    } else {
        println!(
            "stored; {} is {}",
            estop_protocol::text::escape(&req.trajectory),
            v["state"].as_str().unwrap_or("?")
        );
    }
    Ok(0)
}

/// The status as text: one line of state and spend against the ceilings, then what waits.
fn print_status(v: &serde_json::Value) -> Result<(), Failure> {
    let r: estop_harness::record::Record = serde_json::from_value(v["record"].clone())
        .map_err(|e| Failure::new(format!("the runner's record is not one: {e}")))?;
    let (s, l) = (&r.budget.spend, &r.budget.limits);
    let dim = |spent: u64, max: Option<u64>| match max {
        Some(m) => format!("{spent}/{m}"),
        None => spent.to_string(),
    };
    println!(
        "{} {} turns={} tokens={} usd_micros={} pending={} held={}{}",
        estop_protocol::text::escape(&r.identity.id),
        r.state,
        dim(s.turns, l.turns_max),
        dim(s.tokens(), l.tokens_max),
        dim(s.usd_micros, l.usd_micros_max),
        r.pending.len(),
        r.held.len(),
        if r.class.is_standard() {
            String::new()
        } else {
            format!(" class={}", r.class.as_str())
        },
    );
    for h in &r.held {
        // What the approval is for: the call, or (an HTTP tool) its request.
        let what = match &h.request {
            Some(q) => format!("request {} {} {} {}", q.run, q.key, q.tool, q.url),
            None => format!("call {}", h.call.function.name),
        };
        println!(
            "held {} {}",
            estop_protocol::text::escape(&h.call.id),
            estop_protocol::text::escape(&what)
        );
    }
    for c in &r.control {
        let c = serde_json::to_string(c).expect("a control serializes");
        println!("control {}", estop_protocol::text::escape(&c));
    }
    // Backing off after failed model calls: the retry, its wait and what failed.
    if let Some(b) = &r.backoff {
        println!(
            "backoff retry={} delay_ms={} until_ms={} error={}",
            b.failures,
            b.delay_ms,
            b.until_ms,
            estop_protocol::text::escape(&b.error)
        );
    }
    // Its sub-agents (`ID/CALL_ID`), each with its state and spend against its own ceilings.
    let children = v["children"].as_array().map_or(&[][..], Vec::as_slice);
    for c in children {
        let n = |k: &str| c[k].as_u64().unwrap_or(0);
        let max = |k: &str| c["limits"][k].as_u64();
        println!(
            "child {} {} turns={} tokens={} usd_micros={}{}",
            estop_protocol::text::escape(c["id"].as_str().unwrap_or("?")),
            c["state"].as_str().unwrap_or("?"),
            dim(n("turns"), max("turns_max")),
            dim(n("tokens"), max("tokens_max")),
            dim(n("usd_micros"), max("usd_micros_max")),
            c["exit"]["exit"]
                .as_str()
                .map(|e| format!(" exit={e}"))
                .unwrap_or_default(),
        );
    }
    let count = v["children_count"].as_u64().unwrap_or(0);
    if count > children.len() as u64 {
        println!("({} more sub-agents)", count - children.len() as u64);
    }
    Ok(())
}

fn parse_class(s: &str) -> Result<estop_harness::scheduler::Class, String> {
    estop_harness::scheduler::Class::parse(s)
        .ok_or_else(|| format!("{s:?}: use interactive, standard or batch"))
}

fn run_one(a: AgentRunArgs) -> anyhow::Result<u8> {
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
        retry_of: a.retry_of,
        class: a.class,
        journal: a.journal.unwrap_or_else(|| a.data.join("harness")),
        gate: estop_harness::gate::GateConfig { target, token },
        data: a.data,
        contract: a.contract,
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
