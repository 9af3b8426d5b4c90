//! The trajectory record (seed 004, Table 2) and the turn logic that reads and writes it.
//!
//! The record is estop's, never the model's: what the model says is an observation the harness
//! evaluates, not an update. Every method takes the time as an argument, changes the record
//! only through [`transition`] and returns [`Action`]s for the runner to carry out once the
//! record is journalled. Control requests are stored on arrival and applied at the next turn
//! boundary (before a model call, after a reply is parsed and before anything is dispatched,
//! after tool results are accepted, on entering an approval wait); kill and resume act at once.

use crate::budget::{Budget, Dimension, Reservation, Stage};
use crate::chat::{Finish, Message, Reply, ToolCall};
use crate::contract::{CheckResult, Contract, World};
use crate::machine::{Cause, State, TransitionError, transition};
use serde::{Deserialize, Serialize};

/// Why a trajectory exits; recorded before it enters FINALIZING.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "exit", rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Exit {
    /// The model ended its turn; the completion check decides COMPLETED or FAILED.
    Completed {
        check_passed: bool,
    },
    /// The model ended its turn and the completion check failed with no further attempt left
    /// (the task contract's `attempts`): the checks that failed, by name. FAILED.
    CompletionCheckFailed {
        failed: Vec<String>,
    },
    Canceled {
        reason: String,
    },
    Killed {
        reason: String,
    },
    BudgetExceeded {
        dimension: Dimension,
    },
    Error {
        error: String,
    },
}

/// Per-call ceilings (seed 004: the call contract).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallLimits {
    pub model: String,
    pub max_output_tokens: u64,
    pub call_deadline_ms: u64,
    /// How long a dispatched tool call may take before it is timed out.
    pub tool_deadline_ms: u64,
    /// How a failed call is retried (a record journalled before there were retries has the
    /// defaults).
    #[serde(default)]
    pub retry: crate::retry::Retry,
}

/// Identity: routes control requests, bills the right tenant, links retries and sub-agents.
/// `Default` is for examples and tests (`..Identity::default()`); the runner names every field.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// Also the gate's run id: every tool call is an effect of this run.
    pub id: String,
    pub parent: Option<String>,
    pub tenant: String,
    pub task: String,
    /// The trajectory this one retries (seed 004: a retry is a new trajectory with a parent
    /// link, and the budget carries over: it starts with what the one it retries spent).
    #[serde(default)]
    pub retry_of: Option<String>,
    /// How deep in a tree of sub-agents: 0 for a trajectory started from outside, its
    /// parent's + 1 for one a trajectory started itself (bounded by `[subagents] depth_max`).
    #[serde(default)]
    pub depth: u32,
    /// A sub-agent started by its parent's tool call: that call's id (the parent waits for
    /// this trajectory's answer as the call's result; the id is `PARENT/CALL_ID`).
    #[serde(default)]
    pub spawned_by: Option<String>,
    /// The task contract (seed 004): what the final answer must satisfy for the trajectory to
    /// complete (crate::contract). `None`: only a non-empty answer, and no further attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub contract: Option<Contract>,
}

/// Tool grants; restriction narrows them to read-only tools (the 90% stage).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grants {
    pub tools: Vec<GrantedTool>,
    pub restricted: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantedTool {
    pub name: String,
    pub read_only: bool,
}

impl Grants {
    pub fn allows(&self, tool: &str) -> bool {
        self.tools
            .iter()
            .any(|t| t.name == tool && (t.read_only || !self.restricted))
    }
}

/// A resource held on the trajectory's behalf (a workspace, a credential handle), released in
/// FINALIZING. A credential handle (`kind = "credential"`) names the tool and the destination
/// whose credential the egress proxy may inject for that tool's calls (`id` = `TOOL@HOST`,
/// `HOST:PORT` when the store names a port), never the secret; the restrict stage (90%)
/// releases the handles of tools that are not read-only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub id: String,
    pub kind: String,
    /// The tool a credential handle is for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
}

/// The kind of a credential handle lease.
pub const CREDENTIAL: &str = "credential";

/// A tool call in the pending set, from proposal to result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingCall {
    pub call: ToolCall,
    pub phase: Phase,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "phase", rename_all = "snake_case")]
pub enum Phase {
    /// Proposed in a reply that ended normally; admission not yet answered.
    Proposed,
    /// Admitted by the gate (two-phase: not started).
    Admitted { token: String },
    /// Dispatched; its result is accepted until the deadline. The token is kept so that a
    /// call cancelled or timed out (or found started after a restart) is completed `unknown`.
    Dispatched { deadline_ms: u64, token: String },
}

/// A call held by the gate for approval (seed 004, the approval gate): the call, its expiry,
/// the approval request as the gate last showed it (id, quorum, approvers so far) and the
/// preconditions the harness recorded when it was held, re-checked before it is dispatched.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldCall {
    pub call: ToolCall,
    pub expires_at_ms: u64,
    /// The gate's approval id (from its approvals inbox; `None` until read).
    #[serde(default)]
    pub approval: Option<String>,
    /// Distinct approvers the gate needs (0 until read).
    #[serde(default)]
    pub quorum: u32,
    /// Who approved so far.
    #[serde(default)]
    pub approvers: Vec<String>,
    #[serde(default)]
    pub preconditions: Option<Preconditions>,
    /// An HTTP tool call whose tool the gate admitted and whose request it holds: the held
    /// effect is this request's (`None`: the tool call itself is held).
    #[serde(default)]
    pub request: Option<HeldRequest>,
}

/// The request of an HTTP tool call, held by the gate at its pre-admission (crate::http): the
/// effect `key` (`idem:CALL_ID`) of the call's run (`TRAJECTORY/CALL_ID`), what it is, and the
/// token of the tool call itself, admitted and not started, which an approval dispatches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldRequest {
    pub run: String,
    pub key: String,
    /// `http.METHOD`.
    pub tool: String,
    pub url: String,
    pub token: String,
}

impl HeldCall {
    pub fn new(call: ToolCall, expires_at_ms: u64) -> HeldCall {
        HeldCall {
            call,
            expires_at_ms,
            approval: None,
            quorum: 0,
            approvers: Vec::new(),
            preconditions: None,
            request: None,
        }
    }
}

/// What the harness itself held true when a call was held; before an approved call is
/// dispatched each is checked again (the gate re-checks its own: expiry, digest, fence, budget).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Preconditions {
    /// [`call_digest`] of the call as held: the approval is for this call and no other.
    pub digest: String,
    /// The tool was granted (the budget below the restrict stage, or the tool read-only).
    pub granted: bool,
}

/// JSON with every object's keys sorted, whatever order the map type keeps.
fn canonical(v: &serde_json::Value) -> String {
    use serde_json::Value;
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            let fields: Vec<String> = keys
                .into_iter()
                .map(|k| format!("{}:{}", Value::String(k.clone()), canonical(&m[k])))
                .collect();
            format!("{{{}}}", fields.join(","))
        }
        Value::Array(a) => {
            let items: Vec<String> = a.iter().map(canonical).collect();
            format!("[{}]", items.join(","))
        }
        other => other.to_string(),
    }
}

/// The canonical digest of a call: hex SHA-256 of its tool name and its arguments as
/// canonical JSON (keys sorted; arguments that are not JSON as written).
pub fn call_digest(call: &ToolCall) -> String {
    use sha2::{Digest, Sha256};
    let args = serde_json::from_str::<serde_json::Value>(&call.function.arguments)
        .map(|v| canonical(&v))
        .unwrap_or_else(|_| call.function.arguments.clone());
    let mut h = Sha256::new();
    h.update(call.function.name.as_bytes());
    h.update([0]);
    h.update(args.as_bytes());
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// A control request from outside the loop (seed 004, "Control actions").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "control", rename_all = "snake_case")]
pub enum Control {
    Cancel { reason: String },
    Interrupt { message: String },
    Pause,
    Resume,
    Kill { reason: String },
    Budget { limits: crate::budget::Limits },
}

/// Where the bulky state lives: the record points at it, never holds it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pointers {
    /// Messages of the context journalled so far.
    pub context_len: u64,
    pub log: String,
    pub workspace: Option<String>,
    /// Tool results before this context index are sent compacted (crate::compact): set from
    /// the budget's steer stage on, never lowered, journalled before the call it shapes.
    #[serde(default, skip_serializing_if = "nothing_compacted")]
    pub compacted_before: u64,
}

/// A record that compacted nothing is written as before there was compaction.
fn nothing_compacted(before: &u64) -> bool {
    *before == 0
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub identity: Identity,
    pub state: State,
    pub exit: Option<Exit>,
    /// Model calls made.
    pub turns: u64,
    pub limits: CallLimits,
    pub budget: Budget,
    pub grants: Grants,
    pub leases: Vec<Lease>,
    pub pending: Vec<PendingCall>,
    pub held: Vec<HeldCall>,
    pub control: Vec<Control>,
    pub pointers: Pointers,
    /// Transitions taken (the journal keeps each one).
    pub transitions: u64,
    /// When the trajectory reached its terminal state (Unix ms; set as that record is
    /// journalled): a retry carries the wall clock spent up to here.
    #[serde(default)]
    pub ended_at_ms: Option<u64>,
    /// The completion check's last result (crate::contract): what was checked, what failed,
    /// how many further turns it has given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub check: Option<CheckResult>,
    /// Tools named by the contract's `must_call` with a call settled `ok` at the gate so far.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub called_ok: Vec<String>,
    /// The scheduler's class of its turns (`estop agent run --class`): kept by a resume,
    /// inherited by a retry (unless it names one) and by its sub-agents.
    #[serde(default, skip_serializing_if = "crate::scheduler::Class::is_standard")]
    pub class: crate::scheduler::Class,
    /// Backing off after failed model calls in a row: no turn before its `until_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<crate::retry::Backoff>,
}

/// What the runner is to do, in order, once the record is durable.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// Append to the context the next call sees.
    Observe {
        message: Message,
    },
    /// Make the model call with these ceilings; `steer` is a notice for this call only.
    CallModel {
        reservation: Reservation,
        steer: Option<String>,
    },
    /// Cut the open model stream within the grace (a control request is pending).
    CutModel,
    /// Ask the gate to admit these calls (run = trajectory, key = the call's id).
    Admit {
        calls: Vec<ToolCall>,
    },
    /// Start and run an admitted call.
    Dispatch {
        call: ToolCall,
        token: String,
    },
    /// Wait for the gate's decision on a held call.
    AwaitDecision {
        call: ToolCall,
    },
    /// Cancel a dispatched call; its outcome is unknown unless the tool settles it.
    CancelTool {
        call_id: String,
    },
    /// Record at the gate that a dispatched call's outcome is unknown.
    MarkUnknown {
        call: ToolCall,
        token: Option<String>,
    },
    Release {
        lease: Lease,
    },
    /// A late or unknown tool result was dropped: an audit line, never an observation.
    Dropped {
        call_id: String,
        why: String,
    },
    /// The harness's own preconditions of an approved call were checked before its dispatch:
    /// an audit line (the journal keeps it), never an observation.
    Checked {
        call_id: String,
        outcome: String,
    },
    /// The trajectory reached a terminal state (FINALIZING ran).
    Ended {
        state: State,
    },
    /// A failed model call (or a fence that could not be read) is retried after `delay_ms`:
    /// an audit line; the wait itself is the record's `backoff`.
    Retry {
        attempt: u32,
        delay_ms: u64,
        error: String,
    },
}

/// How the gate answered one admission.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum Admission {
    Admitted {
        token: String,
    },
    Held {
        expires_at_ms: u64,
    },
    /// An HTTP tool call: the tool admitted (`request.token`), its request held.
    RequestHeld {
        expires_at_ms: u64,
        request: HeldRequest,
    },
    Refused {
        reason: String,
    },
    /// The harness refused the call itself before asking the gate (an HTTP tool's path
    /// argument that is not one segment, a refused destination): nothing was sent.
    NotSent {
        reason: String,
        message: String,
    },
    /// Already recorded (a resume): its recorded outcome stands in for a run.
    Duplicate {
        status: String,
        outcome: Option<String>,
    },
}

/// How a held call was decided.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "decision", rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Decision {
    Approved { token: String },
    Denied,
    Expired,
    Canceled,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error(transparent)]
    Transition(#[from] TransitionError),
    #[error("{0} is not expected in state {1}")]
    Unexpected(&'static str, State),
}

type Step = Result<Vec<Action>, RecordError>;

/// The refusal observation of seed 004 (approval gate): what the model sees instead of a call
/// that was not run.
pub fn refusal(call: &ToolCall, reason: &str, message: &str) -> Message {
    let v = serde_json::json!({
        "status": "REFUSED",
        "reason": reason,
        "call": format!("{}({})", call.function.name, call.function.arguments),
        "message": message,
    });
    Message::tool(&call.id, v.to_string())
}

/// The refusal of a held call: seed 004's, with the approval request as the gate showed it
/// (its id, the quorum, who approved so far), so the model can tell "nobody answered" from
/// "one of two approvers said yes".
fn held_refusal(h: &HeldCall, reason: &str, message: &str) -> Message {
    let m = refusal(&h.call, reason, message);
    let mut v: serde_json::Value =
        serde_json::from_str(m.content.as_deref().unwrap_or("{}")).expect("refusal is JSON");
    v["approval"] = serde_json::json!(h.approval);
    v["quorum"] = serde_json::json!(h.quorum);
    v["approvers"] = serde_json::json!(h.approvers);
    Message::tool(&h.call.id, v.to_string())
}

/// What the model reads after its reply passed a bound of the stream (`REPLY_OVERFLOW`, the
/// bound and its limit), in place of the discarded reply.
pub fn overflow_notice(o: &crate::chat::Overflow) -> String {
    let v = serde_json::json!({
        "status": "REFUSED",
        "reason": "REPLY_OVERFLOW",
        "overflow": o,
        "message": format!(
            "Your reply was cut and discarded: {o}. Nothing in it was run. Propose fewer or \
             smaller tool calls."
        ),
    });
    format!("[reply cut: {v}]")
}

/// The calls whose arguments are a JSON object, and for each other one its answer: a tool
/// error to the model (`INVALID_ARGUMENTS`, the same `tool_call_id`, the problem named and
/// bounded: crate::chat::argument_problem) and an audit line.
fn invalid_arguments(calls: Vec<ToolCall>) -> (Vec<ToolCall>, Vec<Action>) {
    let mut actions = Vec::new();
    let mut valid = Vec::new();
    for c in calls {
        let Some(problem) = crate::chat::argument_problem(&c) else {
            valid.push(c);
            continue;
        };
        let v = serde_json::json!({
            "status": "REFUSED",
            "reason": "INVALID_ARGUMENTS",
            "tool": crate::chat::truncate(c.function.name.clone(), 128),
            "message": format!("{problem}: nothing was run; call the tool again with a JSON \
                               object as its arguments"),
        });
        actions.push(Action::Observe {
            message: Message::tool(&c.id, v.to_string()),
        });
        actions.push(Action::Checked {
            call_id: c.id.clone(),
            outcome: format!("refused before the gate, INVALID_ARGUMENTS: {problem}"),
        });
    }
    (valid, actions)
}

fn marker(call: &ToolCall, status: &str, message: &str) -> Message {
    let v = serde_json::json!({"status": status, "message": message});
    Message::tool(&call.id, v.to_string())
}

impl Record {
    pub fn new(
        identity: Identity,
        limits: CallLimits,
        budget: Budget,
        grants: Grants,
        log: String,
    ) -> Record {
        Record {
            identity,
            state: State::Ready,
            exit: None,
            turns: 0,
            limits,
            budget,
            grants,
            leases: Vec::new(),
            pending: Vec::new(),
            held: Vec::new(),
            control: Vec::new(),
            pointers: Pointers {
                context_len: 0,
                log,
                workspace: None,
                compacted_before: 0,
            },
            transitions: 0,
            ended_at_ms: None,
            check: None,
            called_ok: Vec::new(),
            class: Default::default(),
            backoff: None,
        }
    }

    /// The review clock follows the state after each input that can enter or leave
    /// AWAITING_APPROVAL (an admission, a decision, a control, a tick): the time spent there
    /// does not count against the wall clock (crate::budget).
    fn note_review(&mut self, now_ms: u64) {
        let awaiting = self.state == State::AwaitingApproval;
        self.budget.note_review(now_ms, awaiting);
    }

    fn go(&mut self, to: State, cause: Cause) -> Result<(), RecordError> {
        transition(self, to, cause)?;
        Ok(())
    }

    /// Begins an exit: records the reason and enters FINALIZING.
    fn exit(&mut self, exit: Exit) -> Result<(), RecordError> {
        let before = self.exit.replace(exit);
        if let Err(e) = self.go(State::Finalizing, Cause::Exit) {
            self.exit = before;
            return Err(e);
        }
        Ok(())
    }

    /// A control request arrives: stored, and applied now where the trajectory is at a
    /// boundary; kill acts at once in every live state, resume at once from PAUSED.
    pub fn on_control(&mut self, now_ms: u64, c: Control) -> Step {
        let step = self.on_control_untimed(now_ms, c);
        if step.is_ok() {
            self.note_review(now_ms);
        }
        step
    }

    fn on_control_untimed(&mut self, now_ms: u64, c: Control) -> Step {
        if self.state.is_terminal() || self.state == State::Finalizing {
            return Ok(Vec::new());
        }
        match c {
            Control::Kill { reason } => return self.kill(reason),
            Control::Resume if self.state == State::Paused => {
                self.control.retain(|c| *c != Control::Pause);
                self.go(State::Ready, Cause::Resume)?;
                return Ok(Vec::new());
            }
            // A resume before the pause took effect withdraws the pause.
            Control::Resume => {
                self.control.retain(|c| *c != Control::Pause);
                return Ok(Vec::new());
            }
            c => self.control.push(c),
        }
        match self.state {
            State::CallingModel => Ok(vec![Action::CutModel]),
            State::Ready | State::Paused => self.boundary(now_ms),
            // A wait for tools or a decision is a boundary for a stop: the outstanding work
            // is cancelled in FINALIZING. A pause or interrupt waits for the results.
            State::WaitingTool | State::AwaitingApproval => {
                match self.control.iter().find_map(|c| match c {
                    Control::Cancel { reason } => Some(reason.clone()),
                    _ => None,
                }) {
                    Some(reason) => {
                        self.control.clear();
                        self.exit(Exit::Canceled { reason })?;
                        self.finalize()
                    }
                    None => Ok(Vec::new()),
                }
            }
            State::Finalizing | State::Completed | State::Failed | State::Canceled => {
                unreachable!("returned above")
            }
        }
    }

    fn kill(&mut self, reason: String) -> Step {
        let mut actions = Vec::new();
        if self.state == State::CallingModel {
            actions.push(Action::CutModel);
        }
        self.control.clear();
        self.exit(Exit::Killed { reason })?;
        actions.extend(self.finalize()?);
        Ok(actions)
    }

    /// The boundary at READY (and PAUSED): stored controls first, then the budget. Leaves the
    /// trajectory READY (to be scheduled), PAUSED, or ended.
    pub fn boundary(&mut self, now_ms: u64) -> Step {
        let mut actions = Vec::new();
        while !self.control.is_empty() {
            let c = self.control.remove(0);
            match c {
                Control::Cancel { reason } => {
                    self.control.clear();
                    self.exit(Exit::Canceled { reason })?;
                    actions.extend(self.finalize()?);
                    return Ok(actions);
                }
                Control::Interrupt { message } => {
                    if self.state == State::Paused {
                        // A paused trajectory keeps the message for when it resumes.
                        self.control.insert(0, Control::Interrupt { message });
                        return Ok(actions);
                    }
                    actions.push(Action::Observe {
                        message: Message::user(message),
                    });
                }
                Control::Pause if self.state == State::Ready => {
                    self.go(State::Paused, Cause::Pause)?
                }
                Control::Pause => {}
                Control::Budget { limits } => self.budget.limits = limits,
                Control::Kill { .. } | Control::Resume => unreachable!("acted on at arrival"),
            }
        }
        if self.state == State::Ready
            && let Stage::Stop { binding } = self.budget.stage(now_ms)
        {
            self.exit(Exit::BudgetExceeded { dimension: binding })?;
            actions.extend(self.finalize()?);
        }
        Ok(actions)
    }

    /// The scheduler gave this READY trajectory a turn: reserve and call the model, or stop
    /// when the budget cannot cover one more call.
    pub fn begin_turn(&mut self, now_ms: u64, prompt_estimate: u64) -> Step {
        if self.state != State::Ready {
            return Err(RecordError::Unexpected("a turn", self.state));
        }
        if self.backoff.as_ref().is_some_and(|b| now_ms < b.until_ms) {
            return Err(RecordError::Unexpected(
                "a turn before its backoff ended",
                self.state,
            ));
        }
        let mut actions = self.boundary(now_ms)?;
        if self.state != State::Ready {
            return Ok(actions);
        }
        let stage = self.budget.stage(now_ms);
        let r = match self
            .budget
            .reserve(now_ms, prompt_estimate, self.limits.max_output_tokens)
        {
            Ok(r) => r,
            Err(e) => {
                self.exit(Exit::BudgetExceeded { dimension: e.0 })?;
                actions.extend(self.finalize()?);
                return Ok(actions);
            }
        };
        if matches!(stage, Stage::Restrict { .. }) && !self.grants.restricted {
            self.grants.restricted = true;
            actions.extend(self.release_write_credentials());
        }
        let steer = match stage {
            Stage::Steer { binding, permille } => Some(format!(
                "Budget notice: {permille}\u{2030} of the {} budget is used. Converge on an answer.",
                binding.as_str()
            )),
            Stage::Restrict { binding, permille } => Some(format!(
                "Budget notice: {permille}\u{2030} of the {} budget is used. Only read-only tools \
                 remain and no sub-agents may start: give your final answer now.",
                binding.as_str()
            )),
            Stage::Normal | Stage::Stop { .. } => None,
        };
        self.turns += 1;
        self.go(State::CallingModel, Cause::Scheduled)?;
        actions.push(Action::CallModel {
            reservation: r,
            steer,
        });
        Ok(actions)
    }

    /// The restrict stage: only read-only tools remain granted, so the credential handles of
    /// the others are released (their calls can no longer be dispatched; one that still were
    /// would go without the credential).
    fn release_write_credentials(&mut self) -> Vec<Action> {
        let grants = &self.grants;
        let (released, kept): (Vec<Lease>, Vec<Lease>) =
            std::mem::take(&mut self.leases).into_iter().partition(|l| {
                l.kind == CREDENTIAL
                    && !l
                        .tool
                        .as_deref()
                        .is_some_and(|t| grants.tools.iter().any(|g| g.name == t && g.read_only))
            });
        self.leases = kept;
        released
            .into_iter()
            .map(|lease| Action::Release { lease })
            .collect()
    }

    /// The model call ended. Usage is charged first (a cut stream pays for what it produced);
    /// a truncated, cut or failed reply is never dispatched. A contract's `workspace_files`
    /// are seen as absent: the runner, which looks at the workspace, calls [`Record::on_reply_seen`].
    /// A retry's jitter is its ceiling (the runner draws it: [`Record::on_reply_seen`]).
    pub fn on_reply(&mut self, now_ms: u64, reply: Reply) -> Step {
        self.on_reply_seen(now_ms, reply, &World::default(), u32::MAX)
    }

    /// [`Record::on_reply`] with what the harness saw of the world when the reply came (for the
    /// completion check), and the random draw of a retry's jitter (crate::retry).
    pub fn on_reply_seen(&mut self, now_ms: u64, reply: Reply, world: &World, draw: u32) -> Step {
        // One reply per call: after it, the turn is admitting what it proposed.
        if self.state != State::CallingModel || self.budget.reserved.is_none() {
            return Err(RecordError::Unexpected("a model reply", self.state));
        }
        let usage = match &reply {
            Reply::Finished { usage, .. }
            | Reply::Cut { usage }
            | Reply::Failed { usage, .. }
            | Reply::Overflow { usage, .. } => *usage,
        };
        self.budget.settle(usage);
        let observe = |text: &str| Action::Observe {
            message: Message::user(text.to_string()),
        };
        let mut actions = Vec::new();
        match reply {
            Reply::Cut { .. } => {
                self.backoff = None;
                actions.push(observe(
                    "[interrupted: the reply was cut by a control request]",
                ));
                self.go(State::Ready, Cause::Observed)?;
            }
            Reply::Failed {
                error, retryable, ..
            } if !retryable => {
                self.backoff = None;
                self.exit(Exit::Error { error })?;
                actions.extend(self.finalize()?);
                return Ok(actions);
            }
            Reply::Failed {
                error,
                retry_after_ms,
                ..
            } => {
                self.go(State::Ready, Cause::Observed)?;
                // A stop asked for meanwhile wins over a retry.
                if !self.control_waiting() {
                    return self.back_off(now_ms, error, retry_after_ms, draw);
                }
            }
            // The model's own reply passed a bound: it is told which (a retry of the same
            // context in silence would likely pass it again), and plans again.
            Reply::Overflow { overflow, .. } => {
                self.backoff = None;
                actions.push(observe(&overflow_notice(&overflow)));
                self.go(State::Ready, Cause::Observed)?;
            }
            Reply::Finished {
                finish,
                text,
                tool_calls,
                ..
            } => {
                self.backoff = None;
                return self.on_finished(now_ms, finish, text, tool_calls, world);
            }
        }
        actions.extend(self.boundary(now_ms)?);
        Ok(actions)
    }

    /// The run's fence could not be read at the gate before a turn (it is not known whether
    /// the run was stopped): no model call starts; the turn is retried as a failed call is.
    pub fn on_fence_unknown(&mut self, now_ms: u64, error: String, draw: u32) -> Step {
        if self.state != State::Ready {
            return Err(RecordError::Unexpected("a fence check", self.state));
        }
        self.back_off(now_ms, format!("the run's fence: {error}"), None, draw)
    }

    /// READY after a failure: the next turn waits (crate::retry: exponential, full jitter, at
    /// least `Retry-After`), or, past `retries_max` failures in a row, the trajectory ends
    /// FAILED. The budget decides first, as at every boundary.
    fn back_off(
        &mut self,
        now_ms: u64,
        error: String,
        retry_after_ms: Option<u64>,
        draw: u32,
    ) -> Step {
        debug_assert_eq!(self.state, State::Ready);
        let mut actions = self.boundary(now_ms)?;
        if self.state != State::Ready {
            return Ok(actions);
        }
        let failures = self.backoff.as_ref().map_or(0, |b| b.failures) + 1;
        let policy = self.limits.retry;
        if failures > policy.retries_max {
            self.backoff = None;
            let error = format!(
                "{} failures in a row (retries_max = {}); the last: {error}",
                failures, policy.retries_max
            );
            self.exit(Exit::Error { error })?;
            actions.extend(self.finalize()?);
            return Ok(actions);
        }
        let delay_ms = policy.delay_ms(failures, retry_after_ms, draw);
        self.backoff = Some(crate::retry::Backoff {
            failures,
            delay_ms,
            until_ms: now_ms.saturating_add(delay_ms),
            error: error.clone(),
        });
        actions.push(Action::Retry {
            attempt: failures,
            delay_ms,
            error,
        });
        Ok(actions)
    }

    fn on_finished(
        &mut self,
        now_ms: u64,
        finish: Finish,
        text: String,
        calls: Vec<ToolCall>,
        world: &World,
    ) -> Step {
        let mut actions = vec![Action::Observe {
            message: Message {
                role: crate::chat::Role::Assistant,
                content: (!text.is_empty()).then(|| text.clone()),
                tool_calls: if finish == Finish::ToolCalls {
                    calls.clone()
                } else {
                    Vec::new()
                },
                tool_call_id: None,
            },
        }];
        // The boundary after the reply is parsed, before anything is dispatched.
        if self.control_waiting() {
            for c in calls.iter().filter(|_| finish == Finish::ToolCalls) {
                actions.push(Action::Observe {
                    message: marker(
                        c,
                        "INTERRUPTED",
                        "not dispatched: a control request came first",
                    ),
                });
            }
            self.go(State::Ready, Cause::Observed)?;
            actions.extend(self.boundary(now_ms)?);
            return Ok(actions);
        }
        match finish {
            Finish::ToolCalls if !calls.is_empty() => {
                actions.extend(self.propose(now_ms, calls)?);
                Ok(actions)
            }
            Finish::Stop | Finish::ToolCalls => {
                actions.extend(self.completion_check(now_ms, &text, world)?);
                Ok(actions)
            }
            Finish::Length => {
                actions.push(Action::Observe {
                    message: Message::user(
                        "[truncated: the reply hit the output limit and nothing in it was run; \
                         answer in shorter steps]",
                    ),
                });
                self.go(State::Ready, Cause::Observed)?;
                actions.extend(self.boundary(now_ms)?);
                Ok(actions)
            }
            Finish::ContentFilter | Finish::Other(_) => {
                self.go(State::Ready, Cause::Observed)?;
                actions.extend(self.boundary(now_ms)?);
                Ok(actions)
            }
        }
    }

    /// A reply's tool calls: arguments that are not a JSON object are answered to the model at
    /// once (a tool error naming the problem) and nothing of them goes to the gate; the others
    /// are proposed for admission. With none left, the next turn comes.
    fn propose(&mut self, now_ms: u64, calls: Vec<ToolCall>) -> Step {
        let (calls, mut actions) = invalid_arguments(calls);
        if calls.is_empty() {
            self.go(State::Ready, Cause::Observed)?;
            actions.extend(self.boundary(now_ms)?);
            return Ok(actions);
        }
        self.pending = calls
            .iter()
            .map(|c| PendingCall {
                call: c.clone(),
                phase: Phase::Proposed,
            })
            .collect();
        actions.push(Action::Admit { calls });
        Ok(actions)
    }

    /// MODEL_ENDED: the completion check from the task contract. Passed: COMPLETED. Failed
    /// with an attempt left: a notice naming what failed (model-visible, as the budget's are)
    /// and another turn, the budget deciding first as at every boundary. Failed with none
    /// left: FAILED, the exit naming the checks.
    fn completion_check(&mut self, now_ms: u64, answer: &str, world: &World) -> Step {
        let contract = self.identity.contract.clone();
        let (attempts, (checked, failed)) = match &contract {
            Some(c) => (c.attempts, c.evaluate(answer, &self.called_ok, world)),
            // No contract: a non-empty answer, and no further attempt.
            None => (0, Contract::default().evaluate(answer, &[], world)),
        };
        let notices = self.check.as_ref().map_or(0, |c| c.notices);
        let passed = failed.is_empty();
        let names: Vec<String> = failed.iter().map(|f| f.check.clone()).collect();
        let notice = failed
            .iter()
            .map(|f| format!("{}: {}", f.check, f.why))
            .collect::<Vec<_>>()
            .join("; ");
        let retry = !passed && notices < attempts;
        self.check = Some(CheckResult {
            passed,
            checked,
            failed,
            notices: notices + u32::from(retry),
        });
        let mut actions = Vec::new();
        if passed {
            self.exit(Exit::Completed { check_passed: true })?;
        } else if retry {
            let left = attempts - notices;
            actions.push(Action::Observe {
                message: Message::user(format!(
                    "[completion check failed: {notice}. The task is not complete; fix this \
                     and answer again ({left} attempt{} left)]",
                    if left == 1 { "" } else { "s" }
                )),
            });
            self.go(State::Ready, Cause::Observed)?;
            actions.extend(self.boundary(now_ms)?);
            return Ok(actions);
        } else {
            self.exit(Exit::CompletionCheckFailed { failed: names })?;
        }
        actions.extend(self.finalize()?);
        Ok(actions)
    }

    /// The gate answered one proposed call's admission. Once every proposal is answered, the
    /// calls are dispatched, or held for approval, or (none left) the turn observes and ends.
    pub fn on_admission(&mut self, now_ms: u64, call_id: &str, a: Admission) -> Step {
        let step = self.on_admission_untimed(now_ms, call_id, a);
        if step.is_ok() {
            self.note_review(now_ms);
        }
        step
    }

    fn on_admission_untimed(&mut self, now_ms: u64, call_id: &str, a: Admission) -> Step {
        if self.state != State::CallingModel {
            return Err(RecordError::Unexpected("an admission", self.state));
        }
        let Some(i) = self
            .pending
            .iter()
            .position(|p| p.call.id == call_id && p.phase == Phase::Proposed)
        else {
            return Ok(vec![Action::Dropped {
                call_id: call_id.to_string(),
                why: "admission for a call not proposed".into(),
            }]);
        };
        let mut actions = Vec::new();
        match a {
            Admission::Admitted { token }
                if self.grants.allows(&self.pending[i].call.function.name) =>
            {
                self.pending[i].phase = Phase::Admitted { token }
            }
            Admission::Admitted { token } => {
                let p = self.pending.remove(i);
                actions.push(Action::Observe {
                    message: refusal(
                        &p.call,
                        "NOT_GRANTED",
                        "this tool is not granted to the trajectory now",
                    ),
                });
                actions.push(Action::MarkUnknown {
                    call: p.call,
                    token: Some(token),
                });
            }
            Admission::Held { .. } | Admission::RequestHeld { .. } => {
                let (expires_at_ms, request) = match a {
                    Admission::RequestHeld {
                        expires_at_ms,
                        request,
                    } => (expires_at_ms, Some(request)),
                    Admission::Held { expires_at_ms } => (expires_at_ms, None),
                    _ => unreachable!("matched above"),
                };
                let p = self.pending.remove(i);
                let preconditions = Preconditions {
                    digest: call_digest(&p.call),
                    granted: self.granted_now(now_ms, &p.call.function.name),
                };
                let mut h = HeldCall::new(p.call, expires_at_ms);
                h.preconditions = Some(preconditions);
                h.request = request;
                self.held.push(h);
            }
            Admission::NotSent { reason, message } => {
                let p = self.pending.remove(i);
                actions.push(Action::Observe {
                    message: refusal(&p.call, &reason, &message),
                });
            }
            Admission::Refused { reason } => {
                let p = self.pending.remove(i);
                actions.push(Action::Observe {
                    message: refusal(
                        &p.call,
                        &reason.to_uppercase(),
                        "the gate refused this call",
                    ),
                });
            }
            Admission::Duplicate { status, outcome } => {
                let p = self.pending.remove(i);
                let text = outcome.unwrap_or_else(|| format!("{{\"status\":\"{status}\"}}"));
                actions.push(Action::Observe {
                    message: Message::tool(&p.call.id, text),
                });
            }
        }
        if self.pending.iter().any(|p| p.phase == Phase::Proposed) {
            return Ok(actions);
        }
        actions.extend(self.after_admissions(now_ms)?);
        Ok(actions)
    }

    fn after_admissions(&mut self, now_ms: u64) -> Step {
        if !self.held.is_empty() {
            self.go(State::AwaitingApproval, Cause::Held)?;
            let mut actions: Vec<Action> = self
                .held
                .iter()
                .map(|h| Action::AwaitDecision {
                    call: h.call.clone(),
                })
                .collect();
            // Entering an approval wait is a boundary: a stop applies now.
            actions.extend(self.stop_if_asked()?);
            return Ok(actions);
        }
        if self.pending.is_empty() || self.control_waiting() {
            let mut actions = self.withhold();
            self.go(State::Ready, Cause::Observed)?;
            actions.extend(self.boundary(now_ms)?);
            return Ok(actions);
        }
        self.go(State::WaitingTool, Cause::Dispatched)?;
        Ok(self.dispatch_admitted(now_ms))
    }

    /// A control request (other than a budget change) is waiting for the next boundary: the
    /// last point before a dispatch is one, so nothing new starts before it applies.
    fn control_waiting(&self) -> bool {
        self.control
            .iter()
            .any(|c| !matches!(c, Control::Budget { .. }))
    }

    /// Admitted calls not dispatched because a control request came first: each gets a
    /// model-visible marker, and the pending set empties.
    fn withhold(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.pending)
            .into_iter()
            .map(|p| Action::Observe {
                message: marker(
                    &p.call,
                    "INTERRUPTED",
                    "not dispatched: a control request came first",
                ),
            })
            .collect()
    }

    fn stop_if_asked(&mut self) -> Step {
        if let Some(reason) = self.control.iter().find_map(|c| match c {
            Control::Cancel { reason } => Some(reason.clone()),
            _ => None,
        }) {
            self.control.clear();
            self.exit(Exit::Canceled { reason })?;
            return self.finalize();
        }
        Ok(Vec::new())
    }

    fn dispatch_admitted(&mut self, now_ms: u64) -> Vec<Action> {
        let deadline_ms = now_ms + self.limits.tool_deadline_ms;
        let mut actions = Vec::new();
        for p in &mut self.pending {
            if let Phase::Admitted { token } = &p.phase {
                actions.push(Action::Dispatch {
                    call: p.call.clone(),
                    token: token.clone(),
                });
                p.phase = Phase::Dispatched {
                    deadline_ms,
                    token: token.clone(),
                };
            }
        }
        actions
    }

    /// The gate decided a held call. Silence is no: only `Approved` dispatches.
    pub fn on_decision(&mut self, now_ms: u64, call_id: &str, d: Decision) -> Step {
        let step = self.on_decision_untimed(now_ms, call_id, d);
        if step.is_ok() {
            self.note_review(now_ms);
        }
        step
    }

    fn on_decision_untimed(&mut self, now_ms: u64, call_id: &str, d: Decision) -> Step {
        let Some(i) = self.held.iter().position(|h| h.call.id == call_id) else {
            return Ok(vec![Action::Dropped {
                call_id: call_id.to_string(),
                why: format!("decision for a call not held (state {})", self.state),
            }]);
        };
        if self.state != State::AwaitingApproval {
            return Err(RecordError::Unexpected("a decision", self.state));
        }
        let h = self.held.remove(i);
        let mut actions = Vec::new();
        let (reason, message) = match d {
            Decision::Approved { token } => match self.recheck(now_ms, &h) {
                Ok(()) => {
                    actions.push(Action::Checked {
                        call_id: h.call.id.clone(),
                        outcome: "approved; preconditions hold (same digest, tool granted, \
                                  budget below its stop): dispatched"
                            .into(),
                    });
                    // A held request's approval is the request's: the tool call dispatches
                    // with its own token, admitted when the request was held.
                    let token = h.request.as_ref().map_or(token, |r| r.token.clone());
                    self.pending.push(PendingCall {
                        call: h.call.clone(),
                        phase: Phase::Admitted { token },
                    });
                    ("", String::new())
                }
                Err((reason, why)) => {
                    actions.push(Action::Checked {
                        call_id: h.call.id.clone(),
                        outcome: format!("approved; not dispatched ({reason}): {why}"),
                    });
                    (reason, why)
                }
            },
            Decision::Denied => ("APPROVAL_DENIED", "A reviewer denied this call.".into()),
            Decision::Expired => (
                "APPROVAL_EXPIRED",
                "No approval was recorded before the request expired.".into(),
            ),
            Decision::Canceled => (
                "APPROVAL_CANCELED",
                "The approval request was cancelled.".into(),
            ),
        };
        if !reason.is_empty() {
            actions.push(Action::Observe {
                message: held_refusal(&h, reason, &message),
            });
        }
        if !self.held.is_empty() {
            return Ok(actions);
        }
        if self.pending.is_empty() || self.control_waiting() {
            actions.extend(self.withhold());
            self.go(State::Ready, Cause::Refused)?;
            actions.extend(self.boundary(now_ms)?);
            return Ok(actions);
        }
        self.go(State::WaitingTool, Cause::Decided)?;
        actions.extend(self.dispatch_admitted(now_ms));
        Ok(actions)
    }

    /// A held call's tool was approved, and its HTTP request, admitted then, is held in turn
    /// (crate::http::admit_after_approval): the call stays held, now for its request, with the
    /// request's expiry — the trajectory stays AWAITING_APPROVAL and waits for that decision.
    pub fn on_request_held(
        &mut self,
        now_ms: u64,
        call_id: &str,
        expires_at_ms: u64,
        request: HeldRequest,
    ) -> Step {
        let state = self.state;
        let found = self
            .held
            .iter_mut()
            .find(|h| h.call.id == call_id && h.request.is_none());
        let (State::AwaitingApproval, Some(h)) = (state, found) else {
            return Ok(vec![Action::Dropped {
                call_id: call_id.to_string(),
                why: format!("a held request for a call not held (state {state})"),
            }]);
        };
        h.expires_at_ms = expires_at_ms;
        h.request = Some(request);
        h.approval = None;
        h.quorum = 0;
        h.approvers.clear();
        let call = h.call.clone();
        self.note_review(now_ms);
        Ok(vec![Action::AwaitDecision { call }])
    }

    /// Whether `tool` is granted now: the grants, narrowed to read-only tools once the budget
    /// is at its restrict stage — also when that stage was reached by the reply that proposed
    /// the call, or by a wait, and no turn has begun since to record it in the grants.
    fn granted_now(&self, now_ms: u64, tool: &str) -> bool {
        let restrict = matches!(
            self.budget.stage(now_ms),
            Stage::Restrict { .. } | Stage::Stop { .. }
        );
        let mut grants = self.grants.clone();
        grants.restricted |= restrict;
        grants.allows(tool)
    }

    /// The harness's own preconditions of an approved call, checked before it is dispatched
    /// (the trajectory being the one that asked — still AWAITING_APPROVAL with no stop or
    /// pause stored — is checked by the caller: such a call is withheld). `Err` names the
    /// refusal the model reads and why.
    fn recheck(&self, now_ms: u64, h: &HeldCall) -> Result<(), (&'static str, String)> {
        if let Some(p) = &h.preconditions
            && call_digest(&h.call) != p.digest
        {
            return Err((
                "PRECONDITION_FAILED",
                "approved, but the call is not the one held (its digest changed)".into(),
            ));
        }
        if let Stage::Stop { binding } = self.budget.stage(now_ms) {
            return Err((
                "BUDGET_EXCEEDED",
                format!(
                    "approved, but the {} budget is spent; nothing was run",
                    binding.as_str()
                ),
            ));
        }
        if !self.granted_now(now_ms, &h.call.function.name) {
            let why = if self
                .grants
                .tools
                .iter()
                .any(|t| t.name == h.call.function.name)
            {
                "approved, but the budget reached its restrict stage (90%) since: only \
                 read-only tools remain granted"
            } else {
                "approved, but the tool is no longer granted"
            };
            return Err(("NOT_GRANTED", why.into()));
        }
        Ok(())
    }

    /// The gate's approvals inbox showed a held call's request: its id, quorum and approvers
    /// so far, kept with the call (the refusal the model may read carries them).
    pub fn on_quorum(
        &mut self,
        call_id: &str,
        approval: String,
        quorum: u32,
        approvers: Vec<String>,
    ) -> Step {
        let Some(h) = self.held.iter_mut().find(|h| h.call.id == call_id) else {
            return Ok(vec![Action::Dropped {
                call_id: call_id.to_string(),
                why: "approval request for a call not held".into(),
            }]);
        };
        h.approval = Some(approval);
        h.quorum = quorum;
        h.approvers = approvers;
        Ok(Vec::new())
    }

    /// A tool result arrives: accepted only in WAITING_TOOL for a call still pending
    /// (seed 004 listing 2); anything else is dropped and logged, never observed.
    pub fn on_tool_result(&mut self, now_ms: u64, call_id: &str, result: String) -> Step {
        self.on_tool_outcome(now_ms, call_id, result, false)
    }

    /// [`Record::on_tool_result`] knowing whether the call settled `ok` at the gate (the
    /// contract's `must_call` counts only those).
    pub fn on_tool_outcome(
        &mut self,
        now_ms: u64,
        call_id: &str,
        result: String,
        ok: bool,
    ) -> Step {
        let found = self
            .pending
            .iter()
            .position(|p| p.call.id == call_id && matches!(p.phase, Phase::Dispatched { .. }));
        let (State::WaitingTool, Some(i)) = (self.state, found) else {
            return Ok(vec![Action::Dropped {
                call_id: call_id.to_string(),
                why: format!("late or unknown tool result (state {})", self.state),
            }]);
        };
        let p = self.pending.remove(i);
        let tool = p.call.function.name;
        if ok
            && self
                .identity
                .contract
                .as_ref()
                .is_some_and(|c| c.must_call.contains(&tool))
            && !self.called_ok.contains(&tool)
        {
            self.called_ok.push(tool);
        }
        let mut actions = vec![Action::Observe {
            message: Message::tool(call_id, result),
        }];
        actions.extend(self.after_result(now_ms)?);
        Ok(actions)
    }

    /// Deadlines: a dispatched call past its deadline leaves the pending set *before* its
    /// timeout is observed, so its late result finds no match; a held call past its expiry is
    /// refused (silence is no).
    pub fn on_tick(&mut self, now_ms: u64) -> Step {
        let step = self.on_tick_untimed(now_ms);
        if step.is_ok() {
            self.note_review(now_ms);
        }
        step
    }

    fn on_tick_untimed(&mut self, now_ms: u64) -> Step {
        let mut actions = Vec::new();
        if self.state == State::AwaitingApproval {
            let due: Vec<String> = self
                .held
                .iter()
                .filter(|h| h.expires_at_ms <= now_ms)
                .map(|h| h.call.id.clone())
                .collect();
            for id in due {
                actions.extend(self.on_decision(now_ms, &id, Decision::Expired)?);
            }
            return Ok(actions);
        }
        if self.state != State::WaitingTool {
            return Ok(actions);
        }
        let (due, keep): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.pending).into_iter().partition(
                |p| matches!(p.phase, Phase::Dispatched { deadline_ms, .. } if deadline_ms <= now_ms),
            );
        self.pending = keep;
        if due.is_empty() {
            return Ok(actions);
        }
        for p in due {
            actions.push(Action::CancelTool {
                call_id: p.call.id.clone(),
            });
            actions.push(Action::Observe {
                message: marker(
                    &p.call,
                    "TIMEOUT",
                    "the call passed its deadline; its outcome is unknown",
                ),
            });
            let token = match p.phase {
                Phase::Dispatched { token, .. } => Some(token),
                _ => None,
            };
            actions.push(Action::MarkUnknown {
                call: p.call,
                token,
            });
        }
        actions.extend(self.after_result(now_ms)?);
        Ok(actions)
    }

    fn after_result(&mut self, now_ms: u64) -> Step {
        if !self.pending.is_empty() {
            return Ok(Vec::new());
        }
        self.go(State::Ready, Cause::ToolsDone)?;
        self.boundary(now_ms)
    }

    /// FINALIZING: cancel outstanding work (dispatched calls become unknown, held calls are
    /// withdrawn), release leases, then the terminal state the exit calls for.
    fn finalize(&mut self) -> Step {
        assert_eq!(self.state, State::Finalizing);
        let mut actions = Vec::new();
        for p in std::mem::take(&mut self.pending) {
            match p.phase {
                Phase::Dispatched { token, .. } => {
                    actions.push(Action::CancelTool {
                        call_id: p.call.id.clone(),
                    });
                    actions.push(Action::Observe {
                        message: marker(
                            &p.call,
                            "INTERRUPTED",
                            "cancelled before its result; outcome unknown",
                        ),
                    });
                    actions.push(Action::MarkUnknown {
                        call: p.call,
                        token: Some(token),
                    });
                }
                Phase::Admitted { .. } | Phase::Proposed => actions.push(Action::Observe {
                    message: marker(&p.call, "INTERRUPTED", "not dispatched"),
                }),
            }
        }
        for h in std::mem::take(&mut self.held) {
            actions.push(Action::Observe {
                message: held_refusal(&h, "APPROVAL_CANCELED", "the trajectory ended"),
            });
        }
        for lease in std::mem::take(&mut self.leases) {
            actions.push(Action::Release { lease });
        }
        let to = self
            .exit
            .as_ref()
            .expect("FINALIZING has its exit")
            .terminal();
        self.go(to, Cause::Finalized)?;
        actions.push(Action::Ended { state: to });
        Ok(actions)
    }
}
