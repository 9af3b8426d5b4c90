//! The runner: drives trajectories through the record's turn logic. One task owns every record
//! (no lock); everything slow — model calls, admissions, tool runs, approval waits, the gate's
//! run events — runs elsewhere and comes back as an [`Input`]. Each input changes a record, the
//! change (and the messages it adds) is journalled and fsync'd, and only then are its actions
//! carried out. The scheduler picks READY trajectories; a waiting one holds no model slot.

use crate::budget::{Budget, Limits, Prices};
use crate::chat::{Message, Reply};
use crate::gate::GateConfig;
use crate::journal::{Entry, Journal, JournalError, Recovered};
use crate::machine::State;
use crate::model::{CallRequest, ModelClient};
use crate::record::{
    Action, Admission, CallLimits, Control, Decision, GrantedTool, Grants, Identity, Phase, Record,
};
use crate::scheduler::{Class, Next, Scheduler, TokenBucket, Weights};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, watch};

/// A tool: a command (the arguments, JSON, on its stdin; its stdout the result), an HTTP tool
/// (a request to `url` as `http` says — method, path, static headers — through the egress
/// proxy, as the child run `TRAJECTORY/CALL_ID`: crate::http; the answer's body the result) or an MCP server's
/// tool (`mcp`, sent upstream through [`crate::mcp::Upstreams`]). Exactly one of `command`,
/// `url` and `mcp`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Tool {
    pub name: String,
    pub description: String,
    pub parameters: Value,
    #[serde(default)]
    pub command: Vec<String>,
    #[serde(default)]
    pub url: Option<String>,
    /// An HTTP tool's method, path template and static headers (with `url`).
    #[serde(default)]
    pub http: crate::http::HttpSpec,
    #[serde(default)]
    pub mcp: Option<crate::mcp::McpTool>,
    /// The command runs inside `estop run`'s sandbox, as a child run of the trajectory's run
    /// (`TRAJECTORY/CALL_ID`): its network effects go through the sandbox's proxy and are
    /// admitted there; `sandbox_policy` is the sandbox's settings (`estop run --policy`).
    #[serde(default)]
    pub sandbox: bool,
    #[serde(default)]
    pub sandbox_policy: Option<PathBuf>,
    /// Reads only: still allowed once the budget restricts the trajectory.
    #[serde(default)]
    pub read_only: bool,
    /// An HTTP tool's `[egress]` settings and credential store (`egress_policy`; the defaults
    /// when `None`): its requests go out through the egress proxy under them (crate::http).
    #[serde(skip)]
    pub egress: Option<crate::http::Egress>,
    /// The hosts of `egress`'s credential store this tool may be leased a handle to (each
    /// trajectory is granted them when it starts: crate::record::Lease); `None`: every host of
    /// the store.
    #[serde(default)]
    pub credentials: Option<Vec<String>>,
    /// A command tool's environment beyond the allow-list (`env`, `env_pass`: crate::env);
    /// nothing else of the runner's environment reaches it.
    #[serde(default)]
    pub env: crate::env::ToolEnv,
    /// A sandboxed command's `sandbox_policy` credential store's source variables: given to
    /// `estop run` (which loads the store and keeps them from the command), never to the tool.
    #[serde(skip)]
    pub store_vars: Vec<String>,
}

/// What `estop run` needs to start a sandboxed command on the trajectory's daemon.
#[derive(Debug, Clone)]
pub struct SandboxLaunch {
    /// The `estop` binary.
    pub estop: PathBuf,
    /// The daemon's data directory (`estop run --data`).
    pub data: PathBuf,
    /// The daemon's socket (`estop run --socket`).
    pub socket: String,
    /// The agent token the trajectory's run belongs to: handed to `estop run` in its
    /// environment (`ESTOP_TOKEN`), never on its command line, which other users can read.
    pub token: String,
}

#[derive(Debug, Clone)]
pub struct RunnerOptions {
    pub data: PathBuf,
    pub gate: GateConfig,
    pub model: ModelClient,
    pub call_limits: CallLimits,
    pub limits: Limits,
    pub prices: Prices,
    pub tools: Vec<Tool>,
    /// How `sandbox = true` commands are started (`None`: such a tool is an error observation).
    pub sandbox: Option<SandboxLaunch>,
    /// The MCP servers the `mcp` tools are sent to (started by [`crate::mcp::Upstreams::start`]).
    pub upstreams: crate::mcp::Upstreams,
    /// The sub-agent tool (`[subagents]`; its [`Tool`] is among `tools`), if the config has one.
    pub subagents: Option<crate::subagent::Subagents>,
    /// Where each trajectory's workspace lease is made (`[harness] workspaces`): the directory
    /// `ROOT/ID`, its command tools' working directory, kept read-only once released.
    pub workspaces: Option<PathBuf>,
    /// The task contract a trajectory started here carries in its identity (`[contract]`, or
    /// `estop agent run --contract`): its completion check (crate::contract).
    pub contract: Option<crate::contract::Contract>,
    pub system: String,
    /// How long a cut stream may still be read for its terminal event.
    pub grace: Duration,
    /// Model calls in flight at once.
    pub workers: usize,
    pub tpm: u64,
    pub rpm: u64,
    /// When the journal compacts and which ended trajectories it keeps.
    pub journal: crate::journal::JournalOptions,
}

/// What comes back to the runner.
#[derive(Debug)]
pub enum Input {
    Reply {
        id: String,
        reply: Reply,
    },
    Admitted {
        id: String,
        call: String,
        admission: Admission,
    },
    Decided {
        id: String,
        call: String,
        decision: Decision,
    },
    /// An approval of a held HTTP tool call whose request was then admitted and not held:
    /// the decision stands (`Decided`, without asking about the request again).
    RequestAdmitted {
        id: String,
        call: String,
        decision: Decision,
    },
    /// A held HTTP tool call's tool was approved and its request is held in turn.
    RequestHeld {
        id: String,
        call: String,
        expires_at_ms: u64,
        request: crate::record::HeldRequest,
    },
    /// A held call's approval request as the gate's inbox shows it (crate::mux).
    Quorum {
        id: String,
        call: String,
        approval: String,
        quorum: u32,
        approvers: Vec<String>,
    },
    ToolDone {
        id: String,
        call: String,
        result: String,
        /// The call settled `ok` at the gate (the contract's `must_call` counts those).
        ok: bool,
    },
    Control {
        id: String,
        control: Control,
    },
    /// An audit line for the journal.
    Note {
        id: String,
        line: String,
    },
    /// After a restart: a dispatched call the gate holds prepared and never started.
    Restart {
        id: String,
        call: String,
        token: String,
    },
    /// A request from another terminal, through the control socket (crate::control).
    Ask(crate::control::Asked),
    /// A sub-agent call was started at the gate: the child trajectory may be created.
    Spawn {
        id: String,
        call: crate::chat::ToolCall,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum RunnerError {
    #[error(transparent)]
    Journal(#[from] JournalError),
    #[error("{0}")]
    Other(String),
}

/// A tool call's identity in the runner: (trajectory, call id).
type CallKey = (String, String);

/// A random draw for a retry's jitter (crate::retry): std's per-process random hash keys,
/// mixed with a counter, so no two draws repeat.
fn draw() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    static COUNT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    h.write_u64(now_ms());
    (h.finish() >> 32) as u32
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

pub struct Runner {
    opts: RunnerOptions,
    journal: Journal,
    recs: BTreeMap<String, Record>,
    ctx: BTreeMap<String, Vec<Message>>,
    sched: Scheduler<String>,
    cuts: BTreeMap<String, watch::Sender<bool>>,
    /// Tools running, by (trajectory, call id): a call id is the model's, unique only within
    /// its trajectory (a sub-agent's model may reuse its parent's).
    tools: BTreeMap<CallKey, tokio::task::JoinHandle<()>>,
    /// MCP calls in flight: cut (not aborted) on a cancel, so that the upstream is told.
    mcp_cuts: BTreeMap<CallKey, watch::Sender<bool>>,
    /// Cut MCP calls still telling their upstream; awaited (bounded) before `run` returns.
    closing: Vec<tokio::task::JoinHandle<()>>,
    tokens: BTreeMap<CallKey, String>,
    /// READY trajectories backing off (crate::retry), queued once their time comes.
    delayed: BTreeMap<String, u64>,
    in_flight: usize,
    tx: mpsc::UnboundedSender<Input>,
    rx: mpsc::UnboundedReceiver<Input>,
    /// The control socket's server; stopped (and the socket removed) with the runner.
    control: tokio::task::AbortHandle,
    /// Subscriptions and approval waits, on one connection (crate::mux).
    gate_asks: mpsc::UnboundedSender<crate::mux::GateAsk>,
    gate_task: tokio::task::AbortHandle,
}

impl Drop for Runner {
    fn drop(&mut self) {
        self.control.abort();
        self.gate_task.abort();
        let _ = std::fs::remove_file(self.opts.data.join(crate::control::SOCKET));
    }
}

impl std::fmt::Debug for Runner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Runner({} trajectories)", self.recs.len())
    }
}

impl Runner {
    /// Opens the journal in `DATA/journal`, listens on `DATA/control.sock` (crate::control)
    /// and resumes every live trajectory found there. Call it inside a tokio runtime.
    pub fn open(opts: RunnerOptions) -> Result<Runner, RunnerError> {
        let (
            journal,
            Recovered {
                records, contexts, ..
            },
        ) = Journal::open_with(&opts.data.join("journal"), opts.journal)?;
        let (tx, rx) = mpsc::unbounded_channel();
        // Bound only now: the journal's lock says no other runner owns this directory.
        let listener = crate::control::bind(&opts.data).map_err(|e| {
            RunnerError::Other(format!(
                "cannot listen on {}: {e}",
                opts.data.join(crate::control::SOCKET).display()
            ))
        })?;
        let control = tokio::spawn(crate::control::serve(
            listener,
            opts.gate.clone(),
            tx.clone(),
        ))
        .abort_handle();
        let (gate_asks, asks) = mpsc::unbounded_channel();
        let gate_task =
            tokio::spawn(crate::mux::gate_task(opts.gate.clone(), asks, tx.clone())).abort_handle();
        let bucket = TokenBucket::new(opts.tpm, opts.rpm, now_ms());
        let mut r = Runner {
            sched: Scheduler::new(Weights::default(), 4_096, bucket),
            opts,
            journal,
            recs: records,
            ctx: contexts,
            cuts: BTreeMap::new(),
            tools: BTreeMap::new(),
            mcp_cuts: BTreeMap::new(),
            closing: Vec::new(),
            tokens: BTreeMap::new(),
            delayed: BTreeMap::new(),
            in_flight: 0,
            tx,
            rx,
            control,
            gate_asks,
            gate_task,
        };
        let live: Vec<String> = r
            .recs
            .iter()
            .filter(|(_, x)| !x.state.is_terminal())
            .map(|(k, _)| k.clone())
            .collect();
        for id in live {
            r.resume(&id)?;
        }
        Ok(r)
    }

    pub fn record(&self, id: &str) -> Option<&Record> {
        self.recs.get(id)
    }

    pub fn context(&self, id: &str) -> &[Message] {
        self.ctx.get(id).map_or(&[], Vec::as_slice)
    }

    /// The context as the next model call sends it: compacted before the record's
    /// `compacted_before` (crate::compact), the rest as journalled.
    pub fn sent_context(&self, id: &str) -> Vec<Message> {
        let before = self.recs.get(id).map_or(0, |r| r.pointers.compacted_before);
        crate::compact::compacted(self.context(id), before)
    }

    /// A sender of inputs (control requests from outside).
    pub fn inputs(&self) -> mpsc::UnboundedSender<Input> {
        self.tx.clone()
    }

    /// Starts a new trajectory for `task` in the standard class.
    pub fn start(&mut self, id: &str, parent: Option<&str>, task: &str) -> Result<(), RunnerError> {
        self.start_in(id, parent, task, Class::Standard)
    }

    /// Starts a new trajectory for `task` whose turns the scheduler weighs as `class`.
    pub fn start_in(
        &mut self,
        id: &str,
        parent: Option<&str>,
        task: &str,
        class: Class,
    ) -> Result<(), RunnerError> {
        let budget = Budget::new(self.opts.limits, self.opts.prices, now_ms());
        let contract = self.opts.contract.clone();
        self.begin(id, parent, task, None, budget, contract, class)
    }

    /// Starts `id` as a retry of the ended trajectory `of` (seed 004: a retry is a new
    /// trajectory with a parent link whose budget carries over): the same parent run and task
    /// (unless `task` gives another), `retry_of` naming `of`, and `of`'s budget — its ceilings
    /// and everything it spent (turns, tokens, dollars, and the wall clock up to its end), so a
    /// retry never buys a fresh budget. `of` must have ended other than COMPLETED. Its class is
    /// `of`'s unless `class` names one.
    pub fn start_retry(
        &mut self,
        id: &str,
        of: &str,
        task: Option<&str>,
        class: Option<Class>,
    ) -> Result<(), RunnerError> {
        let Some(orig) = self.recs.get(of) else {
            return Err(RunnerError::Other(format!(
                "no trajectory {of:?} in the journal to retry"
            )));
        };
        if !orig.state.is_terminal() {
            return Err(RunnerError::Other(format!(
                "trajectory {of:?} has not ended ({}): resume it (`--id {of}`) or stop it first",
                orig.state
            )));
        }
        if orig.state == State::Completed {
            return Err(RunnerError::Other(format!(
                "trajectory {of:?} completed: there is nothing to retry"
            )));
        }
        // One retry per trajectory: a second retry of the same one would start from its spend
        // again, and so buy back what the first retry spent.
        if let Some(r) = self
            .recs
            .values()
            .find(|r| r.identity.retry_of.as_deref() == Some(of))
        {
            return Err(RunnerError::Other(format!(
                "trajectory {of:?} was retried already as {:?}: retry that one",
                r.identity.id
            )));
        }
        let now = now_ms();
        let wall = orig.budget.wall_ms(orig.ended_at_ms.unwrap_or(now));
        let mut budget = Budget::new(
            orig.budget.limits,
            self.opts.prices,
            now.saturating_sub(wall),
        );
        budget.spend = orig.budget.spend;
        let parent = orig.identity.parent.clone();
        let task = task.unwrap_or(&orig.identity.task).to_string();
        // The contract goes with the task: the one given now, else the retried one's.
        let contract = self
            .opts
            .contract
            .clone()
            .or_else(|| orig.identity.contract.clone());
        let class = class.unwrap_or(orig.class);
        let retry_of = Some(of.to_string());
        self.begin(
            id,
            parent.as_deref(),
            &task,
            retry_of,
            budget,
            contract,
            class,
        )
    }

    // Each a part of the new record; a struct for them would be built at two call sites only.
    #[allow(clippy::too_many_arguments)]
    fn begin(
        &mut self,
        id: &str,
        parent: Option<&str>,
        task: &str,
        retry_of: Option<String>,
        budget: Budget,
        contract: Option<crate::contract::Contract>,
        class: Class,
    ) -> Result<(), RunnerError> {
        for run in std::iter::once(id).chain(parent) {
            crate::gate::check_run_id(run)
                .map_err(|e| RunnerError::Other(format!("{run:?} cannot be a run id: {e}")))?;
        }
        if self.recs.contains_key(id) {
            return Err(RunnerError::Other(format!(
                "trajectory {id:?} exists already"
            )));
        }
        let o = &self.opts;
        let grants = Grants {
            tools: o
                .tools
                .iter()
                .map(|t| GrantedTool {
                    name: t.name.clone(),
                    read_only: t.read_only,
                })
                .collect(),
            restricted: false,
        };
        let identity = Identity {
            id: id.into(),
            parent: parent.map(Into::into),
            tenant: "default".into(),
            task: task.into(),
            retry_of,
            depth: 0,
            spawned_by: None,
            contract,
        };
        let mut rec = Record::new(
            identity,
            o.call_limits.clone(),
            budget,
            grants,
            "journal".into(),
        );
        rec.class = class;
        lease_workspace(o.workspaces.as_deref(), &mut rec)?;
        lease_credentials(&o.tools, &mut rec);
        let msgs = vec![Message::system(o.system.clone()), Message::user(task)];
        self.commit(
            rec,
            msgs.into_iter()
                .map(|m| Action::Observe { message: m })
                .collect(),
        )?;
        // Queued by `commit`: the record is new and READY.
        self.watch(id);
        Ok(())
    }

    /// Runs until every trajectory is terminal.
    pub async fn run(&mut self) -> Result<(), RunnerError> {
        loop {
            self.schedule()?;
            if self.recs.values().all(|r| r.state.is_terminal()) {
                self.drain_closing().await;
                return Ok(());
            }
            // The next backoff that ends, if sooner than the tick.
            let now = now_ms();
            let wake = self
                .delayed
                .values()
                .min()
                .map_or(100, |until| (until.saturating_sub(now) + 1).min(100));
            let next_tick = tokio::time::sleep(Duration::from_millis(wake));
            tokio::select! {
                Some(input) = self.rx.recv() => self.on_input(input)?,
                _ = next_tick => self.tick()?,
            }
        }
    }

    /// Waits (at most `CANCEL_TELL_MS_MAX` in all) for cut MCP calls to tell their upstream.
    async fn drain_closing(&mut self) {
        let until = tokio::time::Instant::now() + Duration::from_millis(CANCEL_TELL_MS_MAX);
        for h in self.closing.drain(..) {
            let _ = tokio::time::timeout_at(until, h).await;
        }
    }

    fn schedule(&mut self) -> Result<(), RunnerError> {
        self.release_delayed();
        while self.in_flight < self.opts.workers {
            let Next::Run(id) = self.sched.next(now_ms()) else {
                return Ok(());
            };
            if self.recs.get(&id).is_none_or(|r| r.state != State::Ready) {
                continue;
            }
            // The run's fence, read at the gate right before the call: a stop acknowledged
            // there is acted on here, whatever order its event and a refusal reach the runner.
            if !self.fence_open(&id)? {
                continue;
            }
            let mut rec = self.recs[&id].clone();
            match rec.begin_turn(now_ms(), self.prompt_estimate(&id)) {
                Ok(actions) => {
                    // From the steer stage on (the call carries a budget notice), the tool
                    // results before the last turns are sent compacted; the boundary is
                    // journalled with the record, before the call, so a resume sends the same.
                    let steered = actions
                        .iter()
                        .any(|a| matches!(a, Action::CallModel { steer: Some(_), .. }));
                    if steered {
                        let at =
                            crate::compact::boundary(self.context(&id), crate::compact::KEEP_TURNS);
                        let p = &mut rec.pointers;
                        p.compacted_before = p.compacted_before.max(at);
                    }
                    self.commit(rec, actions)?
                }
                Err(e) => self.log(&id, format!("turn refused: {e}"))?,
            }
        }
        Ok(())
    }

    /// Reads the run's fence at the gate (crate::fence::Fence). Open: the turn may begin.
    /// Closed: the stop, kill or pause is applied to the record now (no model call starts).
    /// Unknown: no call starts on a guess; the turn backs off as a failed call does.
    fn fence_open(&mut self, id: &str) -> Result<bool, RunnerError> {
        let gate = self.opts.gate.clone();
        match tokio::task::block_in_place(|| gate.fence(id)) {
            crate::fence::Fence::Open => Ok(true),
            crate::fence::Fence::Closed(control) => {
                self.apply(id, |r, now| r.on_control(now, control))?;
                Ok(false)
            }
            crate::fence::Fence::Unknown(why) => {
                self.apply(id, |r, now| r.on_fence_unknown(now, why, draw()))?;
                // Still READY (backing off) unless the retries ran out: queued again.
                if self.recs.get(id).is_some_and(|r| r.state == State::Ready) {
                    self.queue(id);
                }
                Ok(false)
            }
        }
    }

    /// Backoffs that ended: their trajectories, still READY, are queued for a turn.
    fn release_delayed(&mut self) {
        let now = now_ms();
        let due: Vec<String> = self
            .delayed
            .iter()
            // Strictly after: `now_ms` is whole milliseconds, so the wait is never cut short.
            .filter(|(_, until)| **until < now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in due {
            self.delayed.remove(&id);
            if self.recs.get(&id).is_some_and(|r| r.state == State::Ready) {
                self.queue(&id);
            }
        }
    }

    /// The prompt's tokens, estimated from its characters (about four per token); the
    /// provider's usage report settles the truth after the call.
    fn prompt_estimate(&self, id: &str) -> u64 {
        let chars: usize = self
            .sent_context(id)
            .iter()
            .map(|m| m.content.as_deref().map_or(0, str::len) + 16)
            .sum();
        chars as u64 / 4
    }

    /// Queues a READY trajectory, charged by its next turn's estimated tokens; one backing off
    /// waits in `delayed` until its backoff ends.
    fn queue(&mut self, id: &str) {
        let until = self
            .recs
            .get(id)
            .and_then(|r| r.backoff.as_ref())
            .map(|b| b.until_ms);
        if let Some(until) = until.filter(|u| *u >= now_ms()) {
            self.sched.remove(&id.to_string());
            self.delayed.insert(id.to_string(), until);
            return;
        }
        self.delayed.remove(id);
        let (out, class) = self.recs.get(id).map_or((0, Class::Standard), |r| {
            (r.limits.max_output_tokens, r.class)
        });
        let est = self.prompt_estimate(id) + out;
        self.sched.push(id.to_string(), class, est);
    }

    fn tick(&mut self) -> Result<(), RunnerError> {
        let ids: Vec<String> = self
            .recs
            .iter()
            .filter(|(_, r)| matches!(r.state, State::WaitingTool | State::AwaitingApproval))
            .map(|(k, _)| k.clone())
            .collect();
        for id in ids {
            self.apply(&id, |r, now| r.on_tick(now))?;
        }
        Ok(())
    }

    fn on_input(&mut self, input: Input) -> Result<(), RunnerError> {
        match input {
            Input::Reply { id, reply } => {
                self.in_flight -= 1;
                self.cuts.remove(&id);
                // What the completion check needs of the world, seen now (the record does no IO).
                let world = match (self.recs.get(&id), &reply) {
                    (Some(r), Reply::Finished { .. }) => crate::contract::World {
                        files_present: r.identity.contract.as_ref().map_or(Vec::new(), |c| {
                            crate::contract::files_present(
                                r.pointers.workspace.as_deref().map(std::path::Path::new),
                                &c.workspace_files,
                            )
                        }),
                    },
                    _ => crate::contract::World::default(),
                };
                self.apply(&id, |r, now| r.on_reply_seen(now, reply, &world, draw()))
            }
            Input::Admitted {
                id,
                call,
                admission,
            } => {
                if let Admission::Admitted { token } = &admission {
                    self.tokens
                        .insert((id.clone(), call.clone()), token.clone());
                }
                self.apply(&id, |r, now| r.on_admission(now, &call, admission))
            }
            Input::Decided { id, call, decision }
                if self.tool_approved_before_its_request(&id, &call, &decision) =>
            {
                // Its request was not admitted yet: it is now, before the approval dispatches
                // anything, so a hold of the request keeps the trajectory AWAITING_APPROVAL.
                let Decision::Approved { token } = decision.clone() else {
                    unreachable!("checked: an approval")
                };
                let c = self.held_call(&id, &call).cloned();
                let tool = c.as_ref().and_then(|c| {
                    self.opts
                        .tools
                        .iter()
                        .find(|t| t.name == c.function.name)
                        .cloned()
                });
                let (gate, tx) = (self.opts.gate.clone(), self.tx.clone());
                if let (Some(tool), Some(c)) = (tool, c) {
                    tokio::task::spawn_blocking(move || {
                        let input =
                            match crate::http::admit_after_approval(&gate, &id, &c, &tool, token) {
                                Admission::RequestHeld {
                                    expires_at_ms,
                                    request,
                                } => Input::RequestHeld {
                                    id,
                                    call,
                                    expires_at_ms,
                                    request,
                                },
                                _ => Input::RequestAdmitted { id, call, decision },
                            };
                        let _ = tx.send(input);
                    });
                }
                Ok(())
            }
            Input::RequestHeld {
                id,
                call,
                expires_at_ms,
                request,
            } => self.apply(&id, |r, now| {
                r.on_request_held(now, &call, expires_at_ms, request)
            }),
            Input::Decided { id, call, decision }
            | Input::RequestAdmitted { id, call, decision } => {
                let request = self
                    .recs
                    .get(&id)
                    .and_then(|r| r.held.iter().find(|h| h.call.id == call))
                    .and_then(|h| h.request.clone());
                match (&decision, &request) {
                    // A held request's approval is the request's; the tool call's own token
                    // was kept with it.
                    (Decision::Approved { .. }, Some(r)) => {
                        self.tokens
                            .insert((id.clone(), call.clone()), r.token.clone());
                    }
                    (Decision::Approved { token }, None) => {
                        self.tokens
                            .insert((id.clone(), call.clone()), token.clone());
                    }
                    // Refused: nothing will be sent under the call's run; it is closed.
                    (_, Some(r)) => {
                        let (gate, run) = (self.opts.gate.clone(), r.run.clone());
                        tokio::task::spawn_blocking(move || gate.close(&run, false));
                    }
                    (_, None) => {}
                }
                self.apply(&id, |r, now| r.on_decision(now, &call, decision))
            }
            Input::Quorum {
                id,
                call,
                approval,
                quorum,
                approvers,
            } => self.apply(&id, |r, _| r.on_quorum(&call, approval, quorum, approvers)),
            Input::ToolDone {
                id,
                call,
                result,
                ok,
            } => {
                let key = (id.clone(), call.clone());
                self.tools.remove(&key);
                self.mcp_cuts.remove(&key);
                self.apply(&id, |r, now| r.on_tool_outcome(now, &call, result, ok))
            }
            Input::Control { id, control } => self.apply(&id, |r, now| r.on_control(now, control)),
            Input::Note { id, line } => self.log(&id, line),
            Input::Ask(asked) => self.on_ask(asked),
            Input::Spawn { id, call } => self.spawn(&id, &call),
            Input::Restart { id, call, token } => {
                let Some(rec) = self.recs.get(&id).cloned() else {
                    return Ok(());
                };
                let found = rec
                    .pending
                    .iter()
                    .find(|p| p.call.id == call && matches!(p.phase, Phase::Dispatched { .. }));
                if let (State::WaitingTool, Some(p)) = (rec.state, found) {
                    self.tokens.insert((id.clone(), call), token.clone());
                    self.act(
                        &rec,
                        Action::Dispatch {
                            call: p.call.clone(),
                            token,
                        },
                    );
                }
                Ok(())
            }
        }
    }

    /// The call `call` of `id`, held.
    fn held_call(&self, id: &str, call: &str) -> Option<&crate::chat::ToolCall> {
        self.recs
            .get(id)
            .and_then(|r| r.held.iter().find(|h| h.call.id == call))
            .map(|h| &h.call)
    }

    /// An approval of a held HTTP tool call whose tool was held (not yet its request).
    fn tool_approved_before_its_request(&self, id: &str, call: &str, d: &Decision) -> bool {
        let Some(r) = self.recs.get(id) else {
            return false;
        };
        matches!(d, Decision::Approved { .. })
            && r.state == State::AwaitingApproval
            && r.held.iter().any(|h| {
                h.call.id == call
                    && h.request.is_none()
                    && self
                        .opts
                        .tools
                        .iter()
                        .any(|t| t.name == h.call.function.name && t.url.is_some())
            })
    }

    /// A request from another terminal: the status is read; an interrupt or a budget change is
    /// stored in the record (applied now where the trajectory is at a boundary, else at the
    /// next one) and answered once the record is durable.
    fn on_ask(&mut self, asked: crate::control::Asked) -> Result<(), RunnerError> {
        use crate::control::{Ask, budget_control, refusal};
        let crate::control::Asked {
            trajectory: id,
            ask,
            reply,
        } = asked;
        let Some(rec) = self.recs.get(&id) else {
            let _ = reply.send(Err(refusal(
                "unknown_trajectory",
                format!("this runner has no trajectory {id:?}"),
            )));
            return Ok(());
        };
        let control = match ask {
            Ask::Status => {
                let (children, count) = crate::view::children(&self.recs, &id, now_ms());
                let status = json!({"record": rec, "context_len": self.context(&id).len(),
                                    "children": children, "children_count": count});
                let _ = reply.send(Ok(status));
                return Ok(());
            }
            _ if rec.state.is_terminal() || rec.state == State::Finalizing => {
                let why = format!("trajectory {id:?} is {} already", rec.state);
                let _ = reply.send(Err(refusal("ended", why)));
                return Ok(());
            }
            Ask::Interrupt { message } => Control::Interrupt { message },
            Ask::Budget { change } => budget_control(rec.budget.limits, &rec.control, change),
        };
        let mut rec = rec.clone();
        match rec.on_control(now_ms(), control) {
            Ok(actions) => {
                self.commit(rec, actions)?;
                let state = self.recs[&id].state;
                let _ = reply.send(Ok(json!({"stored": true, "state": state})));
            }
            Err(e) => {
                let _ = reply.send(Err(refusal("refused", e.to_string())));
            }
        }
        Ok(())
    }

    /// One input on one record: computed on a copy, journalled, then acted on.
    fn apply(
        &mut self,
        id: &str,
        f: impl FnOnce(&mut Record, u64) -> Result<Vec<Action>, crate::record::RecordError>,
    ) -> Result<(), RunnerError> {
        let Some(rec) = self.recs.get(id) else {
            return self.log(id, "input for an unknown trajectory".into());
        };
        let mut rec = rec.clone();
        match f(&mut rec, now_ms()) {
            Ok(actions) if actions.is_empty() && &rec == self.recs.get(id).expect("present") => {
                Ok(())
            }
            Ok(actions) => self.commit(rec, actions),
            Err(e) => self.log(id, format!("refused input: {e}")),
        }
    }

    fn log(&mut self, id: &str, line: String) -> Result<(), RunnerError> {
        let entry = Entry::Log {
            trajectory: id.into(),
            line,
        };
        tokio::task::block_in_place(|| self.journal.write(&[entry]))?;
        Ok(())
    }

    /// Journals the record and the messages it adds (durable), then carries out the actions.
    fn commit(&mut self, rec: Record, actions: Vec<Action>) -> Result<(), RunnerError> {
        self.commit_all(vec![(rec, actions)])
    }

    /// Journals several records and the messages they add in one durable write (a parent and
    /// the sub-agent it starts), then carries out each one's actions in order. A sub-agent
    /// that ended is delivered to its parent.
    fn commit_all(&mut self, mut items: Vec<(Record, Vec<Action>)>) -> Result<(), RunnerError> {
        let mut entries = Vec::new();
        for (rec, actions) in &mut items {
            let id = rec.identity.id.clone();
            if rec.state.is_terminal() && rec.ended_at_ms.is_none() {
                rec.ended_at_ms = Some(now_ms());
            }
            for a in actions.iter() {
                match a {
                    Action::Observe { message } => {
                        rec.pointers.context_len += 1;
                        entries.push(Entry::Context {
                            trajectory: id.clone(),
                            message: message.clone(),
                        });
                    }
                    Action::Dropped { call_id, why } => entries.push(Entry::Log {
                        trajectory: id.clone(),
                        line: format!("dropped {call_id}: {why}"),
                    }),
                    Action::Checked { call_id, outcome } => entries.push(Entry::Log {
                        trajectory: id.clone(),
                        line: format!("checked {call_id}: {outcome}"),
                    }),
                    Action::Retry {
                        attempt,
                        delay_ms,
                        error,
                    } => entries.push(Entry::Log {
                        trajectory: id.clone(),
                        line: format!(
                            "retry {attempt} of the model call in {delay_ms} ms: {error}"
                        ),
                    }),
                    _ => {}
                }
            }
            entries.push(Entry::Record {
                record: Box::new(rec.clone()),
            });
        }
        tokio::task::block_in_place(|| self.journal.write(&entries))?;
        let mut ended = Vec::new();
        for (rec, actions) in items {
            let id = rec.identity.id.clone();
            let before = self.recs.get(&id).map(|r| r.state);
            let was_ready = before == Some(State::Ready);
            self.recs.insert(id.clone(), rec.clone());
            for a in actions {
                self.act(&rec, a);
            }
            if rec.state == State::Ready && !was_ready {
                self.queue(&id);
            } else if rec.state != State::Ready {
                self.sched.remove(&id);
                self.delayed.remove(&id);
            }
            if rec.state.is_terminal() && !before.is_some_and(State::is_terminal) {
                ended.push(id);
            }
        }
        for id in ended {
            self.deliver(&id)?;
        }
        Ok(())
    }

    fn act(&mut self, rec: &Record, a: Action) {
        let (id, gate, tx) = (
            rec.identity.id.clone(),
            self.opts.gate.clone(),
            self.tx.clone(),
        );
        match a {
            Action::Observe { message } => self.ctx.entry(id).or_default().push(message),
            Action::CallModel { reservation, steer } => {
                self.call_model(rec, reservation.max_output_tokens, steer)
            }
            Action::CutModel => {
                if let Some(c) = self.cuts.get(&id) {
                    let _ = c.send(true);
                }
            }
            Action::Dispatch { call, token } if self.is_subagent_tool(&call.function.name) => {
                // The gate's start is the commit point; the child is created by the runner,
                // which owns every record, once it is (`Input::Spawn`).
                let key = (id.clone(), call.id.clone());
                let handle = tokio::spawn(async move {
                    let (g, r, k) = (gate.clone(), id.clone(), call.id.clone());
                    let started = tokio::task::spawn_blocking(move || g.start(&r, &k, &token))
                        .await
                        .unwrap_or_else(|e| Err(e.to_string()));
                    let input = match started {
                        Ok(()) => Input::Spawn { id, call },
                        Err(why) => Input::ToolDone {
                            id,
                            call: call.id,
                            result: json!({"status": "REFUSED", "reason": "NOT_STARTED",
                                "message": why})
                            .to_string(),
                            ok: false,
                        },
                    };
                    let _ = tx.send(input);
                });
                self.tools.insert(key, handle);
            }
            Action::Dispatch { call, token } => {
                // An MCP tool as its server lists it now (it may have gone since it was offered).
                let named = |t: &&Tool| t.name == call.function.name;
                let tool = match self
                    .opts
                    .tools
                    .iter()
                    .filter(|t| t.mcp.is_none())
                    .find(named)
                {
                    Some(t) => Some(t.clone()),
                    None => self.opts.upstreams.current().iter().find(named).cloned(),
                }
                .map(|t| credential_scope(t, &rec.leases));
                let credentials_released = tool.as_ref().is_some_and(|(_, released)| *released);
                let tool = tool.map(|(t, _)| t);
                let call_id = call.id.clone();
                let reach = Reach {
                    upstreams: self.opts.upstreams.clone(),
                    sandbox: self.opts.sandbox.clone(),
                    workspace: rec.pointers.workspace.as_ref().map(PathBuf::from),
                    credentials_released,
                };
                let (cut_tx, cut) = watch::channel(false);
                if tool.as_ref().is_some_and(|t| t.mcp.is_some()) {
                    self.mcp_cuts.insert((id.clone(), call_id.clone()), cut_tx);
                }
                let handle = tokio::spawn(async move {
                    let result = dispatch(&gate, &id, &call, &token, tool, &reach, cut).await;
                    if let Some((ok, result)) = result {
                        let _ = tx.send(Input::ToolDone {
                            id,
                            call: call.id,
                            result,
                            ok,
                        });
                    }
                });
                self.tools
                    .insert((rec.identity.id.clone(), call_id), handle);
            }
            // On a cancel, a kill or the deadline: an MCP call is cut (its upstream is sent
            // `notifications/cancelled`), any other tool's task aborted (a command's process
            // group killed with it). The record has settled the call (`unknown` at the gate).
            Action::CancelTool { call_id } => {
                // A sub-agent's call: the child is stopped as its parent is (cancel cascades).
                let child = format!("{id}/{call_id}");
                if self.recs.get(&child).is_some_and(|c| {
                    c.identity.spawned_by.as_deref() == Some(&call_id) && !c.state.is_terminal()
                }) {
                    let control = match &rec.exit {
                        Some(crate::record::Exit::Killed { reason }) => Control::Kill {
                            reason: reason.clone(),
                        },
                        _ => Control::Cancel {
                            reason: format!("its parent {id} stopped waiting for it"),
                        },
                    };
                    if let Err(e) = self.apply(&child, |r, now| r.on_control(now, control)) {
                        let line = format!("the sub-agent {child} was not stopped: {e}");
                        let _ = self.tx.send(Input::Note {
                            id: id.clone(),
                            line,
                        });
                    }
                }
                let key = (id.clone(), call_id);
                let cut = self.mcp_cuts.remove(&key);
                if let Some(h) = self.tools.remove(&key) {
                    match cut {
                        Some(cut) => {
                            let _ = cut.send(true);
                            self.closing.push(h);
                        }
                        None => h.abort(),
                    }
                }
            }
            // FINALIZING released the lease: the workspace is kept for the caller (seed 004:
            // partial work kept) and made read-only, so nothing of the ended trajectory — a
            // process that outlived it — changes what it left.
            Action::Release { lease } if lease.kind == WORKSPACE => {
                let dir = PathBuf::from(&lease.id);
                tokio::task::spawn_blocking(move || {
                    if let Err(e) = freeze(&dir, WORKSPACE_ENTRIES_MAX) {
                        let line = format!("workspace {} not made read-only: {e}", dir.display());
                        let _ = tx.send(Input::Note { id, line });
                    }
                });
            }
            Action::Release { .. }
            | Action::Dropped { .. }
            | Action::Checked { .. }
            | Action::Retry { .. } => {}
            other => self.gate_work(rec, other),
        }
    }

    fn is_subagent_tool(&self, name: &str) -> bool {
        self.opts.subagents.as_ref().is_some_and(|s| s.tool == name)
    }

    /// A sub-agent call was started at the gate: the child `PARENT/CALL_ID` is created with
    /// the task, its budget carved out of the parent's, the parent's record and the child's
    /// journalled in one write — or the call is refused (depth, count, restriction, budget,
    /// arguments) with a structured observation. Never twice: a child that exists is left be.
    fn spawn(&mut self, id: &str, call: &crate::chat::ToolCall) -> Result<(), RunnerError> {
        self.tools.remove(&(id.to_string(), call.id.clone()));
        let child_id = format!("{id}/{}", call.id);
        let Some(parent) = self.recs.get(id) else {
            return Ok(());
        };
        let waiting = parent.state == State::WaitingTool
            && parent
                .pending
                .iter()
                .any(|p| p.call.id == call.id && matches!(p.phase, Phase::Dispatched { .. }));
        if !waiting || self.recs.contains_key(&child_id) {
            return self.log(id, format!("sub-agent {child_id} not started again"));
        }
        let Some(sub) = self.opts.subagents.clone() else {
            return Ok(());
        };
        let children = self
            .recs
            .values()
            .filter(|r| r.identity.parent.as_deref() == Some(id) && r.identity.spawned_by.is_some())
            .count() as u32;
        let now = now_ms();
        let mut parent = parent.clone();
        let admitted = sub
            .admit(&parent, children, &call.function.arguments)
            .and_then(|task| {
                // The call's id is the model's: one path segment, never `.` or `..` (the
                // child's id names its workspace, `ROOT/PARENT/CALL_ID`).
                if !one_segment(&call.id) {
                    return Err(crate::subagent::Refused::BadId(format!(
                        "the call id {:?} is not one plain segment (no '/', not . or ..)",
                        call.id
                    )));
                }
                crate::gate::check_run_id(&child_id).map_err(crate::subagent::Refused::BadId)?;
                let limits = parent
                    .budget
                    .carve(now, &child_id, sub.share_permille)
                    .map_err(|e| crate::subagent::Refused::Budget {
                        dimension: e.0.as_str(),
                    })?;
                Ok((task, limits))
            });
        let (task, limits) = match admitted {
            Ok(x) => x,
            Err(why) => {
                let text = crate::record::refusal(call, why.reason(), &why.message())
                    .content
                    .unwrap_or_default();
                return self.settle_subagent_call(id, &call.id, "error", text, None);
            }
        };
        let identity = Identity {
            id: child_id.clone(),
            parent: Some(id.to_string()),
            tenant: parent.identity.tenant.clone(),
            task: task.clone(),
            retry_of: None,
            depth: parent.identity.depth + 1,
            spawned_by: Some(call.id.clone()),
            // The contract is the caller's task's; a sub-agent's answer is its parent's to judge.
            contract: None,
        };
        let o = &self.opts;
        let mut child = Record::new(
            identity,
            o.call_limits.clone(),
            Budget::new(limits, parent.budget.prices, now),
            Grants {
                tools: parent.grants.tools.clone(),
                restricted: false,
            },
            "journal".into(),
        );
        child.class = parent.class;
        if let Err(e) = lease_workspace(o.workspaces.as_deref(), &mut child) {
            let text = crate::record::refusal(call, "WORKSPACE", &e.to_string())
                .content
                .unwrap_or_default();
            return self.settle_subagent_call(id, &call.id, "error", text, None);
        }
        lease_credentials(&self.opts.tools, &mut child);
        let o = &self.opts;
        let msgs = [Message::system(o.system.clone()), Message::user(task)]
            .into_iter()
            .map(|m| Action::Observe { message: m })
            .collect();
        self.commit_all(vec![(parent, Vec::new()), (child, msgs)])?;
        self.watch(&child_id);
        Ok(())
    }

    /// The sub-agent `child_id` ended: its spend becomes its parent's (once), and its answer
    /// is the parent's call's result, completed at the gate, if the parent still waits for it.
    fn deliver(&mut self, child_id: &str) -> Result<(), RunnerError> {
        let Some(child) = self.recs.get(child_id) else {
            return Ok(());
        };
        let (Some(parent), Some(call)) = (
            child.identity.parent.clone(),
            child.identity.spawned_by.clone(),
        ) else {
            return Ok(());
        };
        let (outcome, text) = crate::subagent::outcome(child, self.context(child_id));
        let spend = child.budget.spend;
        self.settle_subagent_call(&parent, &call, outcome, text, Some((child_id, spend)))
    }

    /// Completes a sub-agent call at the gate (when still dispatched: a call already cut was
    /// settled `unknown`) and hands its result to the parent's record, absorbing the child's
    /// spend first when it ran.
    fn settle_subagent_call(
        &mut self,
        parent: &str,
        call: &str,
        outcome: &'static str,
        text: String,
        spent: Option<(&str, crate::budget::Spend)>,
    ) -> Result<(), RunnerError> {
        let Some(rec) = self.recs.get(parent) else {
            return Ok(());
        };
        let token = rec.pending.iter().find_map(|p| match &p.phase {
            Phase::Dispatched { token, .. } if p.call.id == call => Some(token.clone()),
            _ => None,
        });
        if let Some(token) = token {
            let (g, r, k, x) = (
                self.opts.gate.clone(),
                parent.to_string(),
                call.to_string(),
                text.clone(),
            );
            let told = tokio::task::block_in_place(|| g.complete(&r, &k, &token, outcome, &x));
            if let Err(e) = told {
                self.log(
                    parent,
                    format!("the gate was not told {call}'s outcome: {e}"),
                )?;
            }
        }
        let child = spent.map(|(c, s)| (c.to_string(), s));
        self.apply(parent, move |r, now| {
            if let Some((c, s)) = &child {
                r.budget.absorb(c, *s);
            }
            r.on_tool_outcome(now, call, text, outcome == "ok")
        })
    }

    /// The actions that are a conversation with the gate, each on the blocking pool.
    fn gate_work(&self, rec: &Record, a: Action) {
        let (id, gate, tx) = (
            rec.identity.id.clone(),
            self.opts.gate.clone(),
            self.tx.clone(),
        );
        let tokens = &self.tokens;
        match a {
            Action::Admit { calls } => {
                let parent = rec.identity.parent.clone();
                let tools = self.opts.tools.clone();
                let upstreams = self.opts.upstreams.clone();
                tokio::task::spawn_blocking(move || {
                    for c in calls {
                        let http = tools
                            .iter()
                            .find(|t| t.name == c.function.name && t.url.is_some());
                        let admission = match http {
                            Some(t) => crate::http::admit(&gate, &id, parent.as_deref(), &c, t),
                            // An MCP tool whose words changed since they were pinned: held for
                            // an operator whatever the policy says (`estop mcp` holds it the
                            // same way).
                            None => gate.admit_held_for(
                                &id,
                                parent.as_deref(),
                                &c.id,
                                &c.function.name,
                                &c.function.arguments,
                                upstreams.hold_for(&c.function.name),
                            ),
                        };
                        let _ = tx.send(Input::Admitted {
                            id: id.clone(),
                            call: c.id,
                            admission,
                        });
                    }
                });
            }
            Action::AwaitDecision { call } => {
                // A held HTTP request is its own run's effect.
                let request = rec
                    .held
                    .iter()
                    .find(|h| h.call.id == call.id)
                    .and_then(|h| h.request.as_ref());
                let (run, key) = match request {
                    Some(r) => (r.run.clone(), r.key.clone()),
                    None => (id.clone(), call.id.clone()),
                };
                let ask = crate::mux::GateAsk::Decision {
                    run,
                    key,
                    trajectory: id,
                    call: call.id,
                };
                let _ = self.gate_asks.send(ask);
            }
            Action::MarkUnknown { call, token } => {
                // Told before the runner goes on, like the run's end: the gate's report must
                // not show the call in flight once the trajectory has ended.
                let key = (id.clone(), call.id.clone());
                if let Some(token) = token.or_else(|| tokens.get(&key).cloned()) {
                    let told = tokio::task::block_in_place(|| {
                        gate.complete(&id, &call.id, &token, "unknown", "cancelled by the harness")
                    });
                    if let Err(e) = told {
                        let line = format!("the gate was not told {} is unknown: {e}", call.id);
                        let _ = tx.send(Input::Note { id, line });
                    }
                }
            }
            // The run's end is told before the runner can return (a process that exits right
            // after must not lose it); a gate that cannot be told is logged, not fatal: the
            // trajectory's end is already durable in the journal.
            Action::Ended { state } => {
                let told = tokio::task::block_in_place(|| match state {
                    State::Canceled => gate.cancel(&id, "the trajectory was cancelled"),
                    s => gate.close(&id, s == State::Completed),
                });
                if let Err(e) = told {
                    let _ = tx.send(Input::Note {
                        id,
                        line: format!("the gate was not told the end: {e}"),
                    });
                }
            }
            other => unreachable!("not the gate's: {other:?}"),
        }
    }

    /// Sends the context (and a budget notice for this call only) with the tools the grants
    /// allow now; the reply comes back as an input.
    fn call_model(&mut self, rec: &Record, max_tokens: u64, steer: Option<String>) {
        let (id, tx) = (rec.identity.id.clone(), self.tx.clone());
        let before = rec.pointers.compacted_before;
        let mut messages = crate::compact::compacted(self.context(&id), before);
        if let Some(s) = steer {
            messages.push(Message::system(s));
        }
        // The MCP tools as their servers list them now (listed again first where a server said
        // they changed), after the config's own; either within the grants.
        let fixed: Vec<Tool> = self
            .opts
            .tools
            .iter()
            .filter(|t| t.mcp.is_none())
            .cloned()
            .collect();
        let (upstreams, grants) = (self.opts.upstreams.clone(), rec.grants.clone());
        let mut req = CallRequest {
            model: rec.limits.model.clone(),
            messages,
            tools: Vec::new(),
            max_tokens,
            deadline: Duration::from_millis(rec.limits.call_deadline_ms),
        };
        let (cut_tx, cut) = watch::channel(false);
        self.cuts.insert(id.clone(), cut_tx);
        self.in_flight += 1;
        let (model, grace) = (self.opts.model.clone(), self.opts.grace);
        tokio::spawn(async move {
            let mcp = upstreams.offered().await;
            req.tools = fixed.iter().chain(&mcp).filter(|t| grants.allows(&t.name)).map(|t| {
                json!({"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}})
            }).collect();
            let reply = model.call(&req, cut, grace).await;
            let _ = tx.send(Input::Reply { id, reply });
        });
    }

    /// The gate's stops, pauses and resumes of this run reach the loop as control requests.
    fn watch(&self, id: &str) {
        let _ = self.gate_asks.send(crate::mux::GateAsk::Watch {
            run: id.to_string(),
        });
    }

    /// A trajectory found live in the journal after a restart: nothing it did is done again.
    /// A model call in flight is lost (settled at its reservation, retried); proposals are
    /// admitted again under the same keys (the gate answers what it answered); a dispatched
    /// call is asked about by its key — a recorded outcome is its result, a start without a
    /// completion is unknown — and held calls are waited for again.
    fn resume(&mut self, id: &str) -> Result<(), RunnerError> {
        self.watch(id);
        let rec = self.recs[id].clone();
        // A sub-agent whose parent ended meanwhile (the runner stopped between the two) is
        // stopped as the parent's end would have stopped it.
        let orphaned = rec.identity.spawned_by.is_some()
            && rec
                .identity
                .parent
                .as_ref()
                .and_then(|p| self.recs.get(p))
                .is_none_or(|p| p.state.is_terminal());
        if orphaned {
            let reason = "its parent ended while the harness was down".to_string();
            let rec_state = rec.state;
            self.apply(id, |r, now| r.on_control(now, Control::Cancel { reason }))?;
            if rec_state != State::CallingModel {
                return Ok(());
            }
        }
        match rec.state {
            State::Ready => self.queue(id),
            State::CallingModel if rec.budget.reserved.is_some() => {
                self.in_flight += 1;
                let reply = Reply::Failed {
                    error: "the harness restarted during the call".into(),
                    retryable: true,
                    usage: None,
                    retry_after_ms: None,
                };
                self.tx
                    .send(Input::Reply {
                        id: id.into(),
                        reply,
                    })
                    .ok();
            }
            State::CallingModel => {
                let calls = rec
                    .pending
                    .iter()
                    .filter(|p| p.phase == Phase::Proposed)
                    .map(|p| p.call.clone())
                    .collect();
                self.act(&rec, Action::Admit { calls });
            }
            State::WaitingTool => {
                self.resume_dispatched(&rec);
                self.resume_subagents(&rec)?;
            }
            State::AwaitingApproval => {
                for h in &rec.held {
                    self.act(
                        &rec,
                        Action::AwaitDecision {
                            call: h.call.clone(),
                        },
                    );
                }
            }
            State::Paused => {}
            State::Finalizing | State::Completed | State::Failed | State::Canceled => {}
        }
        Ok(())
    }

    /// After a restart, a dispatched sub-agent call is never started twice: its child found
    /// live in the journal resumes on its own (and is delivered when it ends), one found ended
    /// is delivered now, and one not found (the runner stopped between the gate's start and
    /// the child's record) is created now.
    fn resume_subagents(&mut self, rec: &Record) -> Result<(), RunnerError> {
        let id = rec.identity.id.clone();
        for p in &rec.pending {
            if !self.is_subagent_tool(&p.call.function.name)
                || !matches!(p.phase, Phase::Dispatched { .. })
            {
                continue;
            }
            let child = format!("{id}/{}", p.call.id);
            match self.recs.get(&child).map(|c| c.state.is_terminal()) {
                Some(true) => self.deliver(&child)?,
                Some(false) => {}
                None => {
                    let call = p.call.clone();
                    let _ = self.tx.send(Input::Spawn {
                        id: id.clone(),
                        call,
                    });
                }
            }
        }
        Ok(())
    }

    /// After a restart, each dispatched call is asked about by its key: a recorded outcome is
    /// its result; prepared and never started, it may start now; started and never completed,
    /// its outcome is unknown and it is never run again.
    fn resume_dispatched(&self, rec: &Record) {
        let id = rec.identity.id.as_str();
        let (gate, tx, id) = (self.opts.gate.clone(), self.tx.clone(), id.to_string());
        let calls: Vec<_> = rec
            .pending
            .iter()
            .filter(|p| !self.is_subagent_tool(&p.call.function.name))
            .map(|p| {
                let token = match &p.phase {
                    Phase::Dispatched { token, .. } => token.clone(),
                    _ => String::new(),
                };
                (p.call.clone(), token)
            })
            .collect();
        tokio::task::spawn_blocking(move || {
            for (c, token) in calls {
                let (ok, result) = match gate.admit(
                    &id,
                    None,
                    &c.id,
                    &c.function.name,
                    &c.function.arguments,
                ) {
                    Admission::Duplicate {
                        outcome: Some(o),
                        status,
                    } => (status == "completed", o),
                    Admission::Admitted { token } => {
                        // Prepared, never started: it may run now.
                        let _ = tx.send(Input::Restart {
                            id: id.clone(),
                            call: c.id.clone(),
                            token,
                        });
                        continue;
                    }
                    // Started and never completed: its outcome is unknown, and the gate is
                    // told so (the report shows it; nothing runs it again).
                    other => {
                        let _ = gate.complete(
                            &id,
                            &c.id,
                            &token,
                            "unknown",
                            "the harness restarted while the call ran",
                        );
                        (false, json!({"status": "UNKNOWN", "message": format!("the harness restarted while this call ran; its outcome is unknown ({other:?})")}).to_string())
                    }
                };
                let _ = tx.send(Input::ToolDone {
                    id: id.clone(),
                    call: c.id,
                    result,
                    ok,
                });
            }
        });
    }
}

/// What a dispatched tool may need beyond its own definition: the MCP servers and how to start
/// a sandbox.
struct Reach {
    upstreams: crate::mcp::Upstreams,
    sandbox: Option<SandboxLaunch>,
    /// The trajectory's workspace lease: command tools run in it (`ESTOP_WORKSPACE`).
    workspace: Option<PathBuf>,
    /// The HTTP tool's credential handles were all released (crate::record::Lease): the call
    /// is refused, nothing sent.
    credentials_released: bool,
}

/// Start at the gate (the commit point), run the tool, complete with its outcome.
async fn dispatch(
    gate: &GateConfig,
    run: &str,
    call: &crate::chat::ToolCall,
    token: &str,
    tool: Option<Tool>,
    reach: &Reach,
    cut: watch::Receiver<bool>,
) -> Option<(bool, String)> {
    let (g, r, k, t) = (
        gate.clone(),
        run.to_string(),
        call.id.clone(),
        token.to_string(),
    );
    let started = tokio::task::spawn_blocking(move || g.start(&r, &k, &t))
        .await
        .unwrap_or_else(|e| Err(e.to_string()));
    if let Err(why) = started {
        let refused = json!({"status": "REFUSED", "reason": "NOT_STARTED", "message": why});
        return Some((false, refused.to_string()));
    }
    let (outcome, text) = match tool {
        Some(Tool { url: Some(_), .. }) if reach.credentials_released => {
            let message = "the trajectory's handles to this tool's credentials were released \
                           (the budget's restrict stage, or its end); nothing was sent";
            let m = crate::record::refusal(call, "CREDENTIAL_RELEASED", message);
            ("error", m.content.unwrap_or_default())
        }
        Some(Tool {
            url: Some(url),
            egress,
            http,
            ..
        }) => {
            crate::http::dispatch(gate, run, call, &url, &http, &egress.unwrap_or_default()).await
        }
        Some(Tool { mcp: Some(m), .. }) => {
            // Cut: the runner settled the call already (`unknown`); nothing more to say.
            reach
                .upstreams
                .call(&m, &call.function.arguments, cut)
                .await?
        }
        Some(tool) if tool.sandbox => match sandboxed(&tool, reach.sandbox.as_ref(), run, &call.id)
        {
            Ok(mut cmd) => {
                in_workspace(&mut cmd, reach.workspace.as_deref());
                run_command(cmd, &call.function.arguments, true).await
            }
            Err(why) => ("error", why),
        },
        Some(tool) => match tool.command.split_first() {
            Some((prog, rest)) => {
                let mut cmd = tokio::process::Command::new(prog);
                cmd.args(rest);
                crate::env::apply(&mut cmd, &crate::env::for_tool(&tool.env));
                in_workspace(&mut cmd, reach.workspace.as_deref());
                run_command(cmd, &call.function.arguments, false).await
            }
            None => ("error", "empty command".into()),
        },
        None => ("error", format!("no tool named {}", call.function.name)),
    };
    let (g, r, k, t, o, x) = (
        gate.clone(),
        run.to_string(),
        call.id.clone(),
        token.to_string(),
        outcome,
        text.clone(),
    );
    let settled = tokio::task::spawn_blocking(move || g.complete(&r, &k, &t, o, &x)).await;
    Some((outcome == "ok" && matches!(settled, Ok(Ok(_))), text))
}

/// The kind of a workspace lease.
pub const WORKSPACE: &str = "workspace";

/// Entries of a released workspace made read-only at most (a workspace larger than this keeps
/// the rest writable, and the journal says so).
const WORKSPACE_ENTRIES_MAX: usize = 100_000;

/// Makes the trajectory's workspace lease: `ROOT/ID` (a sub-agent's inside its parent's),
/// created 0700, recorded as a lease and as the record's workspace pointer before the record
/// is journalled. Existing (a resume, a retry's id reused) is fine.
fn lease_workspace(root: Option<&std::path::Path>, rec: &mut Record) -> Result<(), RunnerError> {
    use std::os::unix::fs::PermissionsExt;
    let Some(root) = root else { return Ok(()) };
    // Inside the root, always: every segment of the id a plain name (a sub-agent's id ends
    // with a call id the model chose; `..` would lease, and later freeze, any directory).
    if !rec.identity.id.split('/').all(one_segment) {
        return Err(RunnerError::Other(format!(
            "workspace: the trajectory id {:?} is not plain path segments (no empty, . or ..)",
            rec.identity.id
        )));
    }
    let dir = root.join(&rec.identity.id);
    std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)))
        .map_err(|e| RunnerError::Other(format!("workspace {}: {e}", dir.display())))?;
    let path = dir.display().to_string();
    rec.leases.push(crate::record::Lease {
        tool: None,
        id: path.clone(),
        kind: WORKSPACE.into(),
    });
    rec.pointers.workspace = Some(path);
    Ok(())
}

/// Whether `s` is one plain path segment: not empty, not `.` or `..`, no `/` or NUL.
fn one_segment(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && !s.contains(['/', '\0'])
}

/// The credential handle of `c` for `tool`: the tool and the destination, never the secret.
fn credential_handle(tool: &str, c: &estop_egress::credentials::Credential) -> String {
    match c.port {
        Some(p) => format!("{tool}@{}:{p}", c.host),
        None => format!("{tool}@{}", c.host),
    }
}

/// The credential handles `t` may be leased: one per destination of its store that its
/// `credentials` names (all of them when it names none).
fn leasable(t: &Tool) -> Vec<String> {
    let Some(e) = &t.egress else {
        return Vec::new();
    };
    let mut out: Vec<String> = Vec::new();
    for c in &e.credentials.entries {
        if t.credentials
            .as_ref()
            .is_some_and(|hosts| !hosts.contains(&c.host))
        {
            continue;
        }
        let id = credential_handle(&t.name, c);
        if !out.contains(&id) {
            out.push(id);
        }
    }
    out
}

/// Grants the trajectory a handle to each credential its HTTP tools may use ([`leasable`]),
/// recorded as leases in the record that starts it.
fn lease_credentials(tools: &[Tool], rec: &mut Record) {
    for t in tools {
        for id in leasable(t) {
            if !rec.leases.iter().any(|l| l.id == id) {
                rec.leases.push(crate::record::Lease {
                    id,
                    kind: crate::record::CREDENTIAL.into(),
                    tool: Some(t.name.clone()),
                });
            }
        }
    }
}

/// The tool as a call of this trajectory may use it: its credential store narrowed to the
/// handles the trajectory holds now (a credential it was never leased is not injected; the
/// request goes without it), and whether the tool had handles and every one was released (the
/// restrict stage for a tool that is not read-only, or FINALIZING): then the call is refused
/// (`CREDENTIAL_RELEASED`) and nothing is sent.
fn credential_scope(mut t: Tool, leases: &[crate::record::Lease]) -> (Tool, bool) {
    let mine = leasable(&t);
    let held = |id: &String| {
        leases
            .iter()
            .any(|l| l.kind == crate::record::CREDENTIAL && &l.id == id)
    };
    let released = !mine.is_empty() && !mine.iter().any(held);
    if let Some(e) = &mut t.egress {
        let entries = e
            .credentials
            .entries
            .iter()
            .filter(|c| held(&credential_handle(&t.name, c)))
            .cloned()
            .collect();
        e.credentials = std::sync::Arc::new(estop_egress::credentials::Credentials {
            entries,
            env_names: e.credentials.env_names.clone(),
        });
    }
    (t, released)
}

/// A command tool runs in the trajectory's workspace, named in `ESTOP_WORKSPACE`.
fn in_workspace(cmd: &mut tokio::process::Command, workspace: Option<&std::path::Path>) {
    if let Some(w) = workspace {
        cmd.current_dir(w).env("ESTOP_WORKSPACE", w);
    }
}

/// Takes the write bits off everything under `dir` (not following symlinks), at most `max`
/// entries.
fn freeze(dir: &std::path::Path, max: usize) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mut stack = vec![dir.to_path_buf()];
    let mut seen = 0usize;
    while let Some(p) = stack.pop() {
        seen += 1;
        if seen > max {
            return Err(std::io::Error::other(format!("over {max} entries")));
        }
        let meta = std::fs::symlink_metadata(&p)?;
        if meta.is_symlink() {
            continue;
        }
        if meta.is_dir() {
            for e in std::fs::read_dir(&p)? {
                stack.push(e?.path());
            }
        }
        let mode = meta.permissions().mode() & !0o222;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode))?;
    }
    Ok(())
}

/// How long a runner that is done waits, in all, for cut MCP calls to tell their upstreams.
const CANCEL_TELL_MS_MAX: u64 = 2_000;

/// Ends the tool's whole process group when dropped: a tool cancelled (its task aborted),
/// timed out or finished leaves no process behind. A plain command's group is killed at once.
/// A sandboxed command's group (`estop run`, the leader, and its sandbox) is asked to end
/// (SIGTERM): `estop run` then ends its sandbox, settles its `sandbox.run` effect with the exit
/// status and closes its run, which a SIGKILL would leave in flight at the gate; the group is
/// killed if it is still there `SANDBOX_TERM_GRACE_MS` later.
struct Group {
    pid: Option<rustix::process::Pid>,
    sandboxed: bool,
}

/// How long a sandboxed command's `estop run` has to end its sandbox and close its run after a
/// SIGTERM before its group is killed.
const SANDBOX_TERM_GRACE_MS: u64 = 5_000;

impl Drop for Group {
    fn drop(&mut self) {
        use rustix::process::{Signal, kill_process_group};
        let Some(pid) = self.pid else { return };
        if !self.sandboxed {
            let _ = kill_process_group(pid, Signal::KILL);
            return;
        }
        if kill_process_group(pid, Signal::TERM).is_ok() {
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(SANDBOX_TERM_GRACE_MS));
                let _ = kill_process_group(pid, Signal::KILL);
            });
        }
    }
}

/// `estop run … --run RUN/CALL --parent RUN -- command…`: the sandbox's run is a child of the
/// trajectory's, so a cancel of the trajectory's run reaches it at the gate too; `estop run`
/// passes stdin and stdout through and exits with the command's status (or says why the
/// sandbox could not start, e.g. the kernel refusing user namespaces, on stderr, which the
/// error observation carries).
fn sandboxed(
    tool: &Tool,
    launch: Option<&SandboxLaunch>,
    run: &str,
    call_id: &str,
) -> Result<tokio::process::Command, String> {
    let Some(l) = launch else {
        return Err("this runner starts no sandboxed commands (no daemon data directory)".into());
    };
    if tool.command.is_empty() {
        return Err("empty command".into());
    }
    let child = format!("{run}/{call_id}");
    crate::gate::check_run_id(&child)
        .map_err(|e| format!("the sandbox's run {child:?} cannot be a run id: {e}"))?;
    let mut cmd = tokio::process::Command::new(&l.estop);
    // `estop run` starts from the tool's explicit environment, plus the variables its own
    // credential store reads (which it keeps from the command) and the token.
    let mut env = tool.env.clone();
    env.pass.extend(tool.store_vars.iter().cloned());
    crate::env::apply(&mut cmd, &crate::env::for_tool(&env));
    cmd.arg("run")
        .arg("--data")
        .arg(&l.data)
        .arg("--socket")
        .arg(&l.socket);
    if let Some(p) = &tool.sandbox_policy {
        cmd.arg("--policy").arg(p);
    }
    cmd.args(["--run", &child, "--parent", run, "--"])
        .args(&tool.command)
        .env("ESTOP_TOKEN", &l.token);
    Ok(cmd)
}

/// Runs a command tool with the call's arguments on stdin; `sandboxed`: it is `estop run`,
/// ended by a SIGTERM rather than killed when the call is cut (`Group`).
async fn run_command(
    mut cmd: tokio::process::Command,
    args: &str,
    sandboxed: bool,
) -> (&'static str, String) {
    use tokio::io::AsyncWriteExt;
    let prog = cmd.as_std().get_program().to_string_lossy().into_owned();
    let child = cmd
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .process_group(0)
        .kill_on_drop(!sandboxed)
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => return ("error", format!("cannot start {prog}: {e}")),
    };
    let _group = Group {
        pid: child
            .id()
            .and_then(|p| rustix::process::Pid::from_raw(p as i32)),
        sandboxed,
    };
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(args.as_bytes()).await;
    }
    match child.wait_with_output().await {
        Ok(o) if o.status.success() => ("ok", String::from_utf8_lossy(&o.stdout).into_owned()),
        Ok(o) => (
            "error",
            format!("{}: {}", o.status, String::from_utf8_lossy(&o.stderr)),
        ),
        Err(e) => ("error", e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::{Budget, Limits, Prices};
    use crate::record::{CallLimits, Grants, Identity};

    fn rec(id: &str) -> Record {
        Record::new(
            Identity {
                id: id.into(),
                tenant: "default".into(),
                task: "t".into(),
                ..Identity::default()
            },
            CallLimits {
                model: "m".into(),
                max_output_tokens: 10,
                call_deadline_ms: 1_000,
                tool_deadline_ms: 1_000,
                retry: Default::default(),
            },
            Budget::new(Limits::default(), Prices::default(), 1),
            Grants {
                tools: Vec::new(),
                restricted: false,
            },
            "journal".into(),
        )
    }

    /// Credential handles: every destination of the tool's store its `credentials` names is
    /// leased (the tool and host, never the secret); a call is given only the held ones; with
    /// every handle released it is refused; a tool whose `credentials` names none of the
    /// store's hosts gets no handle and its request goes without.
    #[test]
    fn a_call_gets_only_the_credentials_its_trajectory_holds() {
        let store = "[[credential]]\nhost = \"a.example\"\nheader = \"X-A\"\nvalue = \"secret-a\"\n\
                     [[credential]]\nhost = \"b.example\"\nport = 8443\nheader = \"X-B\"\nvalue = \"secret-b\"\n";
        let creds = estop_egress::credentials::Credentials::parse(store, &|_| None).unwrap();
        let tool = Tool {
            name: "t".into(),
            description: String::new(),
            parameters: serde_json::json!({}),
            url: Some("https://a.example/x".into()),
            egress: Some(crate::http::Egress {
                settings: Default::default(),
                credentials: std::sync::Arc::new(creds),
            }),
            ..Tool::default()
        };
        let hosts = |t: &Tool| -> Vec<String> {
            let e = t.egress.as_ref().unwrap();
            e.credentials
                .entries
                .iter()
                .map(|c| c.host.clone())
                .collect()
        };
        let mut r = rec("x");
        lease_credentials(std::slice::from_ref(&tool), &mut r);
        let ids: Vec<&str> = r.leases.iter().map(|l| l.id.as_str()).collect();
        assert_eq!(ids, ["t@a.example", "t@b.example:8443"]);
        let json = serde_json::to_string(&r).unwrap();
        assert!(!json.contains("secret-"), "{json}");
        let (all, released) = credential_scope(tool.clone(), &r.leases);
        assert_eq!(hosts(&all), ["a.example", "b.example"]);
        assert!(!released);
        r.leases.remove(1);
        let (one, released) = credential_scope(tool.clone(), &r.leases);
        assert_eq!(hosts(&one), ["a.example"]);
        assert!(!released);
        let (gone, released) = credential_scope(tool.clone(), &[]);
        assert!(released && hosts(&gone).is_empty(), "released: refused");
        let mut other = tool;
        other.credentials = Some(vec!["c.example".into()]);
        let mut r = rec("y");
        lease_credentials(std::slice::from_ref(&other), &mut r);
        assert!(r.leases.is_empty());
        let (none, released) = credential_scope(other, &r.leases);
        assert!(
            hosts(&none).is_empty() && !released,
            "never leased: goes without"
        );
    }

    /// A sub-agent's id ends with the model's call id: `..` in it must not lease (and at
    /// FINALIZING freeze) a directory outside the workspaces' root.
    #[test]
    fn a_workspace_lease_stays_inside_its_root() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("ws");
        std::fs::create_dir(&root).unwrap();
        for id in ["a/../../outside", "a/..", "..", "a//b", "./a", "a/."] {
            let mut r = rec(id);
            assert!(lease_workspace(Some(&root), &mut r).is_err(), "{id}");
            assert!(
                r.leases.is_empty() && r.pointers.workspace.is_none(),
                "{id}"
            );
        }
        assert!(!tmp.path().join("outside").exists());
        let mut r = rec("traj/call_1");
        lease_workspace(Some(&root), &mut r).unwrap();
        assert!(root.join("traj/call_1").is_dir());
        assert!(one_segment("call_1") && !one_segment("a/b") && !one_segment(".."));
    }
}
