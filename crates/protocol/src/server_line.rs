//! Replies and events of protocol v1: typed payloads, one-line rendering with the echoed id,
//! and the decoding side for clients (the CLI, tests).
//!
//! A reply is `{"id":…,"ok":true,…payload fields}` or
//! `{"id":…,"ok":false,"error":{"code":…,"message":…}}`; an event is `{"event":…,"run":…,"at":…}`
//! with no `id`. Payloads are plain structs with string and number fields: the server fills them
//! from kernel state (kernel types stay free of serde).

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;
use serde_json::value::RawValue;

use estop_kernel::vocab::{HoldReason, RefusalReason};

use crate::error::{ErrorCode, WireError};
use crate::id::Id;
use crate::request::{Secret, Verb};

/// The protocol version `hello` reports.
pub const PROTOCOL_VERSION: u32 = 1;

/// Appends `{"id":…,"ok":true,…fields of body}\n` to `out`.
///
/// `body` must serialize as a JSON object whose fields are not `id` or `ok`; anything else is a
/// bug in the caller (asserted).
pub fn write_ok<T: Serialize + ?Sized>(out: &mut Vec<u8>, id: &Id, body: &T) {
    out.extend_from_slice(b"{\"id\":");
    out.extend_from_slice(id.as_json().as_bytes());
    out.extend_from_slice(b",\"ok\":true");
    let start = out.len();
    serde_json::to_writer(&mut *out, body).expect("reply payloads serialize");
    assert!(
        out.get(start) == Some(&b'{'),
        "a reply payload must be a JSON object"
    );
    if out.len() - start == 2 {
        // `{}`: nothing to add after "ok".
        out.truncate(start);
        out.push(b'}');
    } else {
        // Splice the payload's fields into the envelope; its closing brace closes the reply.
        out[start] = b',';
    }
    out.push(b'\n');
}

/// `{"id":…,"ok":true,…fields of body}\n`.
pub fn ok_line<T: Serialize + ?Sized>(id: &Id, body: &T) -> Vec<u8> {
    let mut out = Vec::with_capacity(96);
    write_ok(&mut out, id, body);
    out
}

/// Appends `{"id":…,"ok":false,"error":{"code":…,"message":…}}\n` to `out`.
pub fn write_error(out: &mut Vec<u8>, id: &Id, code: ErrorCode, message: &str) {
    out.extend_from_slice(b"{\"id\":");
    out.extend_from_slice(id.as_json().as_bytes());
    out.extend_from_slice(b",\"ok\":false,\"error\":{\"code\":\"");
    out.extend_from_slice(code.as_str().as_bytes());
    out.extend_from_slice(b"\",\"message\":");
    serde_json::to_writer(&mut *out, message).expect("a str serializes");
    out.extend_from_slice(b"}}\n");
}

/// `{"id":…,"ok":false,"error":{"code":…,"message":…}}\n`.
pub fn error_line(id: &Id, code: ErrorCode, message: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(96 + message.len());
    write_error(&mut out, id, code, message);
    out
}

/// `{"id":…,"ok":true}\n`: the plain acknowledgement.
pub fn ack_line(id: &Id) -> Vec<u8> {
    ok_line(id, &Ack::default())
}

/// The reply to `ping`: `{"id":…,"ok":true,"pong":true}\n`.
pub fn pong_line(id: &Id) -> Vec<u8> {
    ok_line(id, &Pong { pong: true })
}

/// One unsolicited event line for a subscriber: `{"event":…,…}\n`.
pub fn event_line(event: &Event) -> Vec<u8> {
    let mut out = serde_json::to_vec(event).expect("events serialize");
    out.push(b'\n');
    out
}

/// `hello` succeeded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloReply {
    /// `agent` or `operator`.
    pub role: String,
    /// The token's name: the run owner for an agent, the approver for an operator.
    pub principal: String,
    #[serde(default = "protocol_v1")]
    pub protocol: u32,
    /// The part of the principal this connection speaks as, when not `main`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub component: Option<String>,
    /// The longest request line this gate reads (without its newline): a client refuses a
    /// longer one itself instead of sending it (the gate's refusal of it has no id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub line_bytes_max: Option<usize>,
}

fn protocol_v1() -> u32 {
    PROTOCOL_VERSION
}

/// The answer to `admit`, `wait` and `start` (SPEC §4.3).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum VerdictReply {
    /// Go ahead (with `start=false`: prepared; present `token` at `start`).
    Admitted { token: String, epoch: u64 },
    /// Not yet: call `wait`, then ask again.
    Held {
        /// The approval this effect waits for; `null` when held for a pause.
        approval: Option<String>,
        /// When the approval expires (Unix ms); `null` for `sibling` and `paused` holds.
        expires_at: Option<u64>,
        /// `approval`, `sibling` or `paused`.
        #[serde(with = "hold_reason")]
        reason: HoldReason,
    },
    /// Never, for this effect.
    Refused {
        #[serde(with = "refusal_reason")]
        reason: RefusalReason,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        message: Option<String>,
        /// The policy rule that decided, when one did.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rule: Option<String>,
        /// A model reservation refused (`budget`): the dimension and the run whose limit it
        /// would pass.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        budget: Option<BudgetOver>,
    },
    /// This identity was admitted before: the recorded status (and outcome once complete).
    Duplicate {
        /// `in_progress` while the first admission has not completed, else an effect status.
        status: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        outcome: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        result: Option<Value>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
    /// `start` only: the effect may run now.
    Go,
}

/// A kernel vocabulary word on the wire: its stable name (`as_str`), read back with `parse`.
/// (Kernel types stay free of serde; the protocol says how they are written.)
macro_rules! vocab_serde {
    ($module:ident, $ty:ty, $what:literal) => {
        mod $module {
            use super::*;

            pub fn serialize<S: Serializer>(v: &$ty, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(v.as_str())
            }

            pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<$ty, D::Error> {
                let name = std::borrow::Cow::<str>::deserialize(d)?;
                <$ty>::parse(&name).ok_or_else(|| {
                    serde::de::Error::custom(format!(concat!("unknown ", $what, " {:?}"), name))
                })
            }
        }
    };
}

vocab_serde!(hold_reason, HoldReason, "hold reason");
vocab_serde!(refusal_reason, RefusalReason, "refusal reason");

/// `{"ok":true}` plus what the verb has to add.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ack {
    /// `complete` arrived after the run was stopped: recorded, and flagged in the report.
    #[serde(default, skip_serializing_if = "is_false")]
    pub late: bool,
    /// The run's state after the request (cancel, pause, resume, kill, close).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// Every run the request fenced or changed (a cascading cancel lists the descendants).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub runs: Vec<String>,
    /// `compensated` and `saga`: the effect's status now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
    /// `compensated` and `saga`: the compensation's latest attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    /// `compensated` and `saga`: when a failed compensation is offered again (Unix ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_at: Option<u64>,
    /// A stop (`cancel`, `kill`, `close`): the effects of the stopped runs still in flight
    /// (started, not yet reported), at most `IN_FLIGHT_LISTED_MAX` (the report lists every
    /// one), with their recorded arguments where the gate keeps them (an egress request's
    /// method and URL). Boxed: every answer carries this field, few use it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_flight: Option<Box<InFlightList>>,
}

/// The effects a stop's answer names in flight (`Ack::in_flight`), as a JSON array.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct InFlightList(pub Vec<InFlight>);

/// The most in-flight effects a stop's answer lists (`Ack::in_flight`); the report has all.
pub const IN_FLIGHT_LISTED_MAX: usize = 32;

/// One effect still in flight when its run was stopped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InFlight {
    pub run: String,
    pub key: String,
    pub tool: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<RawJson>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// The reply to `ping`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pong {
    pub pong: bool,
}

/// How many of a run's effects are in each state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct EffectCounts {
    pub held: u64,
    pub admitted: u64,
    pub started: u64,
    pub completed: u64,
    pub failed: u64,
    pub unknown: u64,
    pub refused: u64,
}

/// One run as `status` and `runs` show it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunView {
    pub run: String,
    /// A kernel `RunState`.
    pub state: String,
    pub epoch: u64,
    /// The agent principal that created the run.
    pub owner: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    pub created_at: u64,
    /// Why the run stopped (a kernel `StopCause`), once it has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cause: Option<String>,
    /// The reason given with the stop (cancel, kill), exactly as sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped_at: Option<u64>,
    /// The effective deadline (Unix ms), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_at: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_effects: Option<u64>,
    #[serde(default)]
    pub effects: EffectCounts,
    /// The run's model budget (its subtree's spend), per dimension with a limit or any spend;
    /// as in the report.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub budget: Vec<BudgetLine>,
    /// Retention forgot the run: only its fence is left (state, cause, `stopped_at`, owner,
    /// epoch, `created_at`); labels, limits and effects are gone.
    #[serde(default, skip_serializing_if = "is_false")]
    pub forgotten: bool,
}

/// The reply to `subscribe`: the run's durable state at the instant the subscription took
/// hold, so a client that (re)subscribes learns of a stop or a decision it missed. A run that
/// does not exist yet, or that the subscriber may not see, answers the plain `{"ok":true}`
/// (`replay` `None`), byte for byte the same whichever it is.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubscribeReply {
    #[serde(flatten, default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<RunReplay>,
}

/// A run's durable state as `subscribe` replays it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunReplay {
    pub run: String,
    /// A kernel `RunState`: `active` `paused` `finalizing` `completed` `failed` `cancelled`.
    pub state: String,
    pub epoch: u64,
    /// Why the run stopped (a kernel `StopCause`, as `status` shows it), once it has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cause: Option<String>,
    /// The reason given with the stop (cancel, kill), exactly as sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The run's effects awaiting a decision (held for an approval, a sibling or a pause;
    /// approved and not yet admitted; a compensating call awaiting its approval), in key
    /// order, as many as one page holds.
    pub awaiting: Vec<Awaiting>,
    /// More effects await than `awaiting` lists (`pending {run}` pages through them all).
    #[serde(default, skip_serializing_if = "is_false")]
    pub more: bool,
}

/// One effect awaiting a decision, as `subscribe` replays it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Awaiting {
    pub key: String,
    /// The effect's status as the report shows it (`held`, `approved`, or the status of an
    /// effect whose compensating call awaits approval).
    pub status: String,
    /// The approval it awaits, while it awaits one (the id `pending` and `decide` use).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<String>,
}

/// The reply to `runs`: one page.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunsReply {
    pub runs: Vec<RunView>,
    /// More runs follow this page: pass `next` as `cursor` to read them.
    #[serde(default, skip_serializing_if = "is_false")]
    pub more: bool,
    /// The cursor of the next page, present exactly when `more`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
}

/// JSON text the gate validated when it received it, written out as it is and never parsed
/// into a tree again: the arguments of a held effect, shared with the gate's state (a listing
/// copies a pointer, not the text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawJson(Arc<str>);

impl RawJson {
    /// `text` must be one JSON value: the gate's own compact rendering of a value it parsed.
    pub fn new(text: Arc<str>) -> RawJson {
        RawJson(text)
    }

    pub fn get(&self) -> &str {
        &self.0
    }

    /// The value as a tree, for clients that want to look inside.
    pub fn to_value(&self) -> Value {
        serde_json::from_str(&self.0).unwrap_or(Value::Null)
    }
}

impl Serialize for RawJson {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // Borrowed: a validating scan, no allocation, then the bytes are copied as they are.
        let raw: &RawValue = serde_json::from_str(&self.0).map_err(serde::ser::Error::custom)?;
        raw.serialize(s)
    }
}

impl<'de> Deserialize<'de> for RawJson {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<RawJson, D::Error> {
        let raw = Box::<RawValue>::deserialize(d)?;
        Ok(RawJson(Arc::from(raw.get())))
    }
}

/// One effect awaiting approval, as the approvals inbox shows it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PendingItem {
    pub approval: String,
    pub run: String,
    pub key: String,
    pub tool: String,
    /// The exact arguments, when the agent sent them (absent for digest-only admits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<RawJson>,
    /// Hex SHA-256 the approval is bound to.
    pub digest: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    /// Distinct approvers needed.
    pub quorum: u32,
    /// Principals who approved so far.
    #[serde(default)]
    pub approvals: Vec<String>,
    /// Groups an approver must come from, if the rule names any.
    #[serde(default)]
    pub groups: Vec<String>,
    pub expires_at: u64,
    pub created_at: u64,
    /// Present when the approval is of a compensating call: the tool of the effect `key` of
    /// run `run` that it undoes (`tool` and `args` are then the compensating call's, `digest`
    /// the forward call's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compensates: Option<String>,
}

/// The reply to `pending`: one page.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PendingReply {
    pub pending: Vec<PendingItem>,
    /// More items follow this page: pass `next` as `cursor` to read them.
    #[serde(default, skip_serializing_if = "is_false")]
    pub more: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
}

/// The reply to `decide`: where the approval stands after this vote.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecideReply {
    /// `held` (quorum not reached yet), `approved` or `rejected`.
    pub status: String,
    #[serde(default)]
    pub approvals: Vec<String>,
    pub quorum: u32,
}

/// One ledger record, summarized.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LedgerEntry {
    pub seq: u64,
    /// When the gate accepted it (Unix ms), as recorded.
    pub at: u64,
    /// The record kind (e.g. `admit`, `decide`, `cancel`).
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Kind-specific summary fields, inline in the entry.
    #[serde(flatten)]
    pub fields: serde_json::Map<String, Value>,
}

/// The reply to `ledger`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LedgerReply {
    pub entries: Vec<LedgerEntry>,
    /// Pass as `after` to read the next page; absent at the end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_after: Option<u64>,
}

/// One effect in the after-stop report.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReportItem {
    pub key: String,
    pub tool: String,
    /// A kernel `EffectStatus`.
    pub status: String,
    /// A kernel `Reversibility`.
    pub reversibility: String,
    /// The compensating tool, if one is registered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compensate: Option<String>,
    /// Completed after the run was stopped.
    #[serde(default, skip_serializing_if = "is_false")]
    pub late: bool,
    /// For refused effects: the refusal reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Once its undo began or an operator acted on it (the reverse saga): attempts so far, out
    /// of how many before a human is asked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts_max: Option<u32>,
    /// When a failed undo is offered again (Unix ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_at: Option<u64>,
    /// The last attempt's error, or the reason an operator skipped it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// The operator who last retried, skipped or asked for its compensation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    /// The tool that looks up an unknown outcome by its idempotency key, if one is declared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lookup: Option<String>,
    /// Lookups of its unknown outcome asked so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lookups: Option<u32>,
    /// An operator asked for this one compensation (its run was stopped without a saga).
    #[serde(default, skip_serializing_if = "is_false")]
    pub chosen: bool,
    /// The part of the run's principal that admitted it, when not `main` (`egress`: `estop
    /// run`'s proxy, its metering or its launch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    /// Completions refused because they contradicted the outcome or cost already settled
    /// (each on the ledger as it was sent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disputes: Option<u32>,
    /// An egress effect's recorded arguments (`http.METHOD`: method, url, host, port, path,
    /// query…; `model.call`: model, host…), as the gate keeps them (docs/EGRESS.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<RawJson>,
    /// An egress effect's completion: the response's HTTP status and the bytes relayed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_status: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// An egress effect's reported error: why it failed, or what is known of an unknown one
    /// (`not sent`, `sent, no answer`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// What a cancelled run's reverse saga waits for: its head (the newest effect still to undo)
/// and why it is not moving.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SagaNext {
    pub key: String,
    /// `outcome` (the effect is in flight), `lookup` (its outcome is unknown: an executor asks
    /// the tool's lookup, attempt `attempt`), `looking_up` (that lookup is under way), `settle`
    /// (its outcome is unknown and no lookup can tell: an operator settles it), `executor`
    /// (attempt `attempt` may begin from `at`: an executor runs it), `running` (attempt
    /// `attempt` is under way), `human` (an operator retries or skips), `approval` (a policy
    /// `approve` rule holds the compensating call: approval `approval` is decided by operators,
    /// open until `at`).
    pub waits: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<u64>,
    /// The approval id (`<run>#<n>`) the compensating call waits for (`waits: approval`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<String>,
}

/// Which model budget a reservation would pass (docs/PROTOCOL.md, "Model budget").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetOver {
    /// `model_usd` or `model_tokens`.
    pub dimension: String,
    /// The run whose limit it is (the run itself or an ancestor).
    pub run: String,
    pub limit: u64,
    /// Spent plus reserved on that run's subtree before this call.
    pub used: u64,
}

/// One dimension of a run's model budget in the report: its subtree's settled spend, what is
/// reserved and not yet settled, and the run's limit (absent: none).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetLine {
    /// `model_usd` (micro-USD) or `model_tokens`.
    pub dimension: String,
    pub spent: u64,
    pub reserved: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
}

/// The after-stop report of one run (SPEC G8). An effect may appear in several lists (a done
/// effect is also compensable or irreversible).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Report {
    pub run: String,
    pub state: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cause: Option<String>,
    /// The reason given with the stop, exactly as sent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped_at: Option<u64>,
    /// Retention forgot the run: what it did is no longer in the gate's state (the
    /// ledger's history may still hold it); only its fence is left.
    #[serde(default, skip_serializing_if = "is_false")]
    pub forgotten: bool,
    /// The run's model budget (its subtree's spend), per dimension with a limit or any spend.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub budget: Vec<BudgetLine>,
    pub done: Vec<ReportItem>,
    pub failed: Vec<ReportItem>,
    pub refused: Vec<ReportItem>,
    pub in_flight: Vec<ReportItem>,
    pub unknown: Vec<ReportItem>,
    pub compensable: Vec<ReportItem>,
    pub irreversible: Vec<ReportItem>,
    pub undeclared: Vec<ReportItem>,
    pub held: Vec<ReportItem>,
    /// What the reverse saga waits for, while it is open (each effect's own progress is on
    /// its item; the saga's history is in the ledger).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub saga_next: Option<SagaNext>,
    /// More of the run's effects follow this page (its lists hold only this page's effects):
    /// pass `next` as `cursor` to read them.
    #[serde(skip_serializing_if = "is_false")]
    pub more: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
}

/// The reply to `token`: the secret is shown this once and never again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenCreated {
    pub name: String,
    pub role: String,
    pub token: Secret,
    #[serde(default)]
    pub groups: Vec<String>,
}

/// The reply to `token_revoke`: who no longer has a token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRevoked {
    pub name: String,
    pub role: String,
    #[serde(default)]
    pub groups: Vec<String>,
}

/// What an event line reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    Cancelled,
    Paused,
    Resumed,
    Decided,
    Held,
    Completed,
    Closed,
    Finalizing,
    /// An approval expired (silence is no): the effect is refused.
    Expired,
    /// The last in-flight effect of a stopped run settled: the run is now terminal.
    Settled,
    /// The compensation of an effect moved (the reverse saga after a cancel); `outcome` is the
    /// effect's status now (`compensating`, `compensated`, `compensation_failed`, …).
    Compensation,
    /// To an executor (`compensations`) only: run this attempt of a compensation.
    Compensate,
    /// To an executor (`compensations`) only: ask the tool's lookup whether the call with this
    /// `idempotency_key` happened; report with `looked_up`.
    Lookup,
    /// A kind this client does not know yet (from a newer server).
    #[serde(other)]
    Other,
}

/// An unsolicited line to a `subscribe`r. It has no `id`, which is how clients tell it from a
/// reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    pub event: EventKind,
    pub run: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// For `decided`: `approve` or `reject`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<String>,
    /// For `completed`: the effect's outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<String>,
    /// For `compensate`: the attempt, the compensating tool, its arguments (absent: none) and
    /// the idempotency key to pass downstream (the same for every attempt).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// Unix ms.
    pub at: u64,
}

/// A reply as a client receives it: the envelope decoded, the payload kept for [`Self::body`].
#[derive(Debug, Clone, PartialEq)]
pub struct ClientReply {
    pub id: Id,
    pub ok: bool,
    pub error: Option<WireError>,
    /// The whole reply object.
    pub raw: Value,
}

impl ClientReply {
    /// Decodes the payload as the type the request's verb answers with (the caller knows which
    /// verb it sent). Envelope fields are ignored.
    pub fn body<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        T::deserialize(&self.raw)
    }
}

/// The payload of a successful reply, typed by the verb that was asked: what a client gets
/// back for each request (the decoding side of the payload types above).
#[derive(Debug, Clone, PartialEq)]
pub enum ReplyBody {
    Hello(HelloReply),
    /// `admit`, `start` and `wait`.
    VerdictReply(VerdictReply),
    /// `complete`, `unsubscribe`, `cancel`, `pause`, `resume`, `kill`, `close`,
    /// `compensations`, `compensated`, `saga`.
    Ack(Ack),
    Subscribed(SubscribeReply),
    Pong(Pong),
    Status(Box<RunView>),
    Runs(RunsReply),
    Pending(PendingReply),
    Decided(DecideReply),
    Ledger(LedgerReply),
    Report(Box<Report>),
    TokenCreated(TokenCreated),
    TokenRevoked(TokenRevoked),
}

impl ReplyBody {
    /// Decodes the payload of `reply`, a successful answer to a request of `verb`.
    pub fn decode(verb: Verb, reply: &ClientReply) -> Result<ReplyBody, serde_json::Error> {
        Ok(match verb {
            Verb::Hello => ReplyBody::Hello(reply.body()?),
            Verb::Admit | Verb::Start | Verb::Wait => ReplyBody::VerdictReply(reply.body()?),
            Verb::Subscribe => ReplyBody::Subscribed(reply.body()?),
            Verb::Complete
            | Verb::Unsubscribe
            | Verb::Cancel
            | Verb::Pause
            | Verb::Resume
            | Verb::Kill
            | Verb::Close
            | Verb::Compensations
            | Verb::Compensated
            | Verb::Saga
            | Verb::LookedUp => ReplyBody::Ack(reply.body()?),
            Verb::Ping => ReplyBody::Pong(reply.body()?),
            Verb::Status => ReplyBody::Status(Box::new(reply.body()?)),
            Verb::Runs => ReplyBody::Runs(reply.body()?),
            Verb::Pending => ReplyBody::Pending(reply.body()?),
            Verb::Decide => ReplyBody::Decided(reply.body()?),
            Verb::Ledger => ReplyBody::Ledger(reply.body()?),
            Verb::Report => ReplyBody::Report(Box::new(reply.body()?)),
            Verb::Token => ReplyBody::TokenCreated(reply.body()?),
            Verb::TokenRevoke => ReplyBody::TokenRevoked(reply.body()?),
        })
    }

    /// The payload as a JSON object, as the reply carried it (without `id` and `ok`).
    pub fn to_value(&self) -> Value {
        let v = match self {
            ReplyBody::Hello(b) => serde_json::to_value(b),
            ReplyBody::VerdictReply(b) => serde_json::to_value(b),
            ReplyBody::Ack(b) => serde_json::to_value(b),
            ReplyBody::Subscribed(b) => serde_json::to_value(b),
            ReplyBody::Pong(b) => serde_json::to_value(b),
            ReplyBody::Status(b) => serde_json::to_value(b),
            ReplyBody::Runs(b) => serde_json::to_value(b),
            ReplyBody::Pending(b) => serde_json::to_value(b),
            ReplyBody::Decided(b) => serde_json::to_value(b),
            ReplyBody::Ledger(b) => serde_json::to_value(b),
            ReplyBody::Report(b) => serde_json::to_value(b),
            ReplyBody::TokenCreated(b) => serde_json::to_value(b),
            ReplyBody::TokenRevoked(b) => serde_json::to_value(b),
        };
        v.expect("reply payloads serialize")
    }
}

/// `T::try_from(body)` for the payload type of each verb (the body back when it is another),
/// and `ReplyBody::from(payload)`.
macro_rules! reply_body_is {
    ($($variant:ident($ty:ty) $(boxed $boxed:tt)?;)+) => {$(
        impl TryFrom<ReplyBody> for $ty {
            type Error = ReplyBody;
            fn try_from(body: ReplyBody) -> Result<$ty, ReplyBody> {
                match body {
                    ReplyBody::$variant(b) => Ok(reply_body_is!(@unbox b $($boxed)?)),
                    other => Err(other),
                }
            }
        }

        impl From<$ty> for ReplyBody {
            fn from(b: $ty) -> ReplyBody {
                ReplyBody::$variant(reply_body_is!(@box b $($boxed)?))
            }
        }
    )+};
    (@unbox $b:ident) => { $b };
    (@unbox $b:ident *) => { *$b };
    (@box $b:ident) => { $b };
    (@box $b:ident *) => { Box::new($b) };
}

reply_body_is! {
    Hello(HelloReply);
    VerdictReply(VerdictReply);
    Ack(Ack);
    Subscribed(SubscribeReply);
    Pong(Pong);
    Status(RunView) boxed *;
    Runs(RunsReply);
    Pending(PendingReply);
    Decided(DecideReply);
    Ledger(LedgerReply);
    Report(Report) boxed *;
    TokenCreated(TokenCreated);
    TokenRevoked(TokenRevoked);
}

/// One line from the server: a reply to a request, or an event.
#[derive(Debug, Clone, PartialEq)]
pub enum ServerLine {
    Reply(ClientReply),
    Event(Event),
}

/// Decodes one line the server sent.
pub fn parse_server_line(line: &[u8]) -> Result<ServerLine, serde_json::Error> {
    let raw: Value = serde_json::from_slice(line)?;
    let is_event = raw.get("event").is_some() && raw.get("id").is_none();
    if is_event {
        return Ok(ServerLine::Event(Event::deserialize(&raw)?));
    }
    #[derive(Deserialize)]
    struct Envelope {
        #[serde(default)]
        id: Id,
        ok: bool,
    }
    let env = Envelope::deserialize(&raw)?;
    // `error` is the refusal's only when `ok` is false: a `duplicate` verdict carries the
    // effect's own `error` text beside `"ok": true`.
    let error = match (env.ok, raw.get("error")) {
        (false, Some(e)) if !e.is_null() => Some(WireError::deserialize(e)?),
        _ => None,
    };
    Ok(ServerLine::Reply(ClientReply {
        id: env.id,
        ok: env.ok,
        error,
        raw,
    }))
}
