//! Requests of protocol v1: one JSON object per line, parsed in a single pass into a typed
//! [`Request`] or refused with a [`RequestError`] that carries a stable code.
//!
//! Parsing is deliberately forgiving about what it does not know (unknown fields are skipped,
//! `null` is the same as absent for every field except `args` and `result`) and strict about
//! what it does (types, bounds, vocabularies), so newer clients work with older servers and a
//! bad value never reaches the kernel.

use std::borrow::Cow;
use std::cell::Cell;
use std::collections::BTreeMap;
use std::fmt;

use estop_kernel::ids::{Digest, EffectKey, Part, PrincipalName, Role, RunId, ToolName};
use estop_kernel::vocab::{Decision, Outcome, RunState};
use estop_kernel::{SagaAction, Spend};
use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::Value;
use serde_json::value::RawValue;

use crate::digest::digest_of;
use crate::error::ErrorCode;
use crate::id::Id;
use crate::limits::*;
use crate::page::PendingCursor;

/// A secret (a bearer token) whose `Debug` form never shows it, so it cannot leak into logs.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Secret {
        Secret(s.into())
    }
    /// The secret itself; call only where it is checked or handed to its owner.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// One parsed request line.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Echoed in the reply; `Id::NULL` when the request had none.
    pub id: Id,
    pub op: Op,
}

/// Per-run limits an agent may ask for when its first `admit` creates the run. Policy may
/// tighten them; it never loosens its own.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestedRunLimits {
    /// Absolute deadline, Unix milliseconds.
    pub deadline_ms: Option<u64>,
    /// Deadline relative to the run's creation, milliseconds.
    pub timeout_ms: Option<u64>,
    /// Most effects the run may admit.
    pub max_effects: Option<u64>,
    /// Model spend, micro-USD, of the run and its descendants together.
    pub max_spend: Option<u64>,
    /// Model tokens of the run and its descendants together.
    pub max_tokens: Option<u64>,
}

impl RequestedRunLimits {
    pub fn is_empty(&self) -> bool {
        self.deadline_ms.is_none()
            && self.timeout_ms.is_none()
            && self.max_effects.is_none()
            && self.max_spend.is_none()
            && self.max_tokens.is_none()
    }
}

/// `admit`: ask to run one effect.
#[derive(Debug, Clone, PartialEq)]
pub struct Admit {
    pub run: RunId,
    pub key: EffectKey,
    pub tool: ToolName,
    /// The call's arguments when the client sent them; `None` when it sent only a digest.
    pub args: Option<Value>,
    /// Sent by the client, or computed here from `tool` and `args`.
    pub digest: Digest,
    /// `true` (default): the admission is also the start (one round trip). `false`: two-phase;
    /// the effect starts only at a later `start`.
    pub start: bool,
    pub parent: Option<RunId>,
    /// Shown to operators, never consulted by policy.
    pub labels: BTreeMap<String, String>,
    /// The agent asks for approval even where policy would allow (it can only strengthen).
    pub needs_approval: bool,
    pub limits: RequestedRunLimits,
    /// The client's own word on how the call is undone (it can only add to policy's).
    pub declare: Option<Declare>,
    /// Defaults for what no policy rule set (an MCP gateway's annotation seed); honoured only
    /// where they are at least as strict as policy's own default (docs/PROTOCOL.md).
    pub seed: Option<Seed>,
    /// The model spend the call may cost at worst, counted against the run's and every
    /// ancestor's `max_spend` / `max_tokens` until its `complete` settles it (zero: none).
    pub reserve: Spend,
}

/// `admit`'s `seed`: a class and reversibility the client proposes for a call whose policy rule
/// leaves them to the defaults. Any agent can send it, so the server lets it only make the call
/// more guarded (`Ruling::seed` in the policy crate).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Seed {
    pub class: Option<estop_kernel::vocab::EffectClass>,
    pub reversibility: Option<estop_kernel::vocab::Reversibility>,
}

/// Longest `declare.compensate_args`, in bytes (as a policy's `when`).
pub const COMPENSATE_ARGS_BYTES_MAX: usize = 4096;

/// `admit`'s `declare`: the policy keys a client may add for its own call (docs/POLICY.md).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Declare {
    pub reversibility: Option<estop_kernel::vocab::Reversibility>,
    pub compensate: Option<ToolName>,
    /// CEL text building the compensating call's arguments.
    pub compensate_args: Option<String>,
}

/// `complete`: report what happened to a started effect.
#[derive(Debug, Clone, PartialEq)]
pub struct Complete {
    pub run: RunId,
    pub key: EffectKey,
    pub token: String,
    pub outcome: Outcome,
    pub result: Option<Value>,
    pub error: Option<String>,
    /// What the call cost (model spend), charged on the run and every ancestor.
    pub cost: Spend,
}

/// `reserve` / `cost` as written on the wire.
fn spend_json(s: Spend) -> Value {
    serde_json::json!({"usd_micros": s.usd_micros, "tokens": s.tokens})
}

/// How `close` ends a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CloseOutcome {
    #[default]
    Completed,
    Failed,
}

impl CloseOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            CloseOutcome::Completed => "completed",
            CloseOutcome::Failed => "failed",
        }
    }
    pub fn parse(s: &str) -> Option<CloseOutcome> {
        match s {
            "completed" => Some(CloseOutcome::Completed),
            "failed" => Some(CloseOutcome::Failed),
            _ => None,
        }
    }
    /// The terminal state the run ends in.
    pub fn run_state(self) -> RunState {
        match self {
            CloseOutcome::Completed => RunState::Completed,
            CloseOutcome::Failed => RunState::Failed,
        }
    }
}

/// One verb of protocol v1 with its typed fields.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    Hello {
        token: Secret,
        /// The run whose sandbox this connection speaks for (`estop run`'s supervisor): an
        /// agent token's connection then has the principal `TOKEN/RUN`, with shares of its own.
        run: Option<RunId>,
        /// Which part of the principal speaks (`component`; default `main`): `estop run`'s
        /// supervisor says `egress`, so the effects it admits are not the sandbox's to start,
        /// complete or wait for (docs/PROTOCOL.md, "Who holds an effect").
        component: Part,
    },
    Admit(Admit),
    Start {
        run: RunId,
        key: EffectKey,
        token: String,
    },
    Complete(Complete),
    Wait {
        run: RunId,
        key: EffectKey,
        timeout_ms: u64,
    },
    Subscribe {
        run: RunId,
    },
    Unsubscribe {
        run: RunId,
    },
    Status {
        run: RunId,
    },
    Cancel {
        run: RunId,
        reason: Option<String>,
        cascade: bool,
    },
    Ping,
    Decide {
        run: RunId,
        key: EffectKey,
        decision: Decision,
        reason: Option<String>,
    },
    Pause {
        run: RunId,
    },
    Resume {
        run: RunId,
    },
    Kill {
        run: RunId,
        reason: Option<String>,
    },
    Close {
        run: RunId,
        outcome: CloseOutcome,
    },
    /// A page of runs, in id order, after `cursor` (the last run of the previous page).
    Runs {
        state: Option<RunState>,
        limit: Option<u32>,
        cursor: Option<RunId>,
    },
    /// A page of the inbox, in its order, after `cursor`.
    Pending {
        run: Option<RunId>,
        limit: Option<u32>,
        cursor: Option<PendingCursor>,
    },
    Ledger {
        run: Option<RunId>,
        limit: Option<u32>,
        after: Option<u64>,
    },
    /// A page of the report: the effects after `cursor` (the last key of the previous page).
    Report {
        run: RunId,
        limit: Option<u32>,
        cursor: Option<EffectKey>,
    },
    Token {
        name: PrincipalName,
        role: Role,
        groups: Vec<String>,
    },
    TokenRevoke {
        name: PrincipalName,
    },
    /// This connection runs compensations (of `run`, or of every run its principal sees;
    /// only of compensating tools `tool` matches, a glob, when given).
    Compensations {
        run: Option<RunId>,
        tool: Option<ToolName>,
    },
    /// How an attempt of a compensation ended.
    Compensated {
        run: RunId,
        key: EffectKey,
        attempt: u32,
        outcome: Outcome,
        error: Option<String>,
    },
    /// An operator settles, retries, skips or compensates one effect of the reverse saga.
    Saga {
        run: RunId,
        key: EffectKey,
        action: SagaAction,
    },
    /// How a lookup of an unknown outcome ended (`ok` found, with its result; `error` not
    /// found; `unknown` the lookup could not tell).
    LookedUp {
        run: RunId,
        key: EffectKey,
        attempt: u32,
        outcome: Outcome,
        result: Option<Value>,
        error: Option<String>,
    },
}

macro_rules! verbs {
    ($($variant:ident = $name:literal, $operator_only:literal;)+) => {
        /// The verb of a request, without its fields.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum Verb { $($variant),+ }

        impl Verb {
            pub const ALL: &'static [Verb] = &[$(Verb::$variant),+];
            pub fn as_str(self) -> &'static str {
                match self { $(Verb::$variant => $name),+ }
            }
            pub fn parse(s: &str) -> Option<Verb> {
                match s { $($name => Some(Verb::$variant),)+ _ => None }
            }
            /// Verbs only an operator token may use (SPEC §4.3, G7).
            pub fn is_operator_only(self) -> bool {
                match self { $(Verb::$variant => $operator_only),+ }
            }
        }
    };
}

verbs! {
    Hello = "hello", false;
    Admit = "admit", false;
    Start = "start", false;
    Complete = "complete", false;
    Wait = "wait", false;
    Subscribe = "subscribe", false;
    Unsubscribe = "unsubscribe", false;
    Status = "status", false;
    Cancel = "cancel", false;
    Ping = "ping", false;
    Decide = "decide", true;
    Pause = "pause", true;
    Resume = "resume", true;
    Kill = "kill", true;
    Close = "close", false;
    Runs = "runs", false;
    Pending = "pending", false;
    Ledger = "ledger", true;
    Report = "report", false;
    Token = "token", true;
    TokenRevoke = "token_revoke", true;
    Compensations = "compensations", false;
    Compensated = "compensated", false;
    Saga = "saga", true;
    LookedUp = "looked_up", false;
}

impl Verb {
    /// Verbs that only read: all an `observer` token may use.
    pub fn is_read_only(self) -> bool {
        matches!(
            self,
            Verb::Hello
                | Verb::Ping
                | Verb::Status
                | Verb::Runs
                | Verb::Pending
                | Verb::Ledger
                | Verb::Report
                | Verb::Subscribe
                | Verb::Unsubscribe
        )
    }

    /// Whether a token of `role` may use this verb (docs/PROTOCOL.md, roles): operators every
    /// verb, agents all but the operator-only ones, observers only the reads, executors only
    /// the reverse saga's (hello, ping, compensations, compensated, looked_up).
    pub fn allowed_for(self, role: Role) -> bool {
        match role {
            Role::Operator => true,
            Role::Agent => !self.is_operator_only(),
            Role::Observer => self.is_read_only(),
            Role::Executor => matches!(
                self,
                Verb::Hello | Verb::Ping | Verb::Compensations | Verb::Compensated | Verb::LookedUp
            ),
        }
    }

    /// Verbs answered with one page of a listing, read on with a cursor (`protocol::page`).
    pub fn is_listing(self) -> bool {
        matches!(
            self,
            Verb::Runs | Verb::Pending | Verb::Report | Verb::Ledger
        )
    }

    /// Before a successful `hello`, only these verbs are answered; the rest get `unauthenticated`.
    pub fn allowed_before_hello(self) -> bool {
        matches!(self, Verb::Hello | Verb::Ping)
    }
}

impl fmt::Display for Verb {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Op {
    pub fn verb(&self) -> Verb {
        match self {
            Op::Hello { .. } => Verb::Hello,
            Op::Admit(_) => Verb::Admit,
            Op::Start { .. } => Verb::Start,
            Op::Complete(_) => Verb::Complete,
            Op::Wait { .. } => Verb::Wait,
            Op::Subscribe { .. } => Verb::Subscribe,
            Op::Unsubscribe { .. } => Verb::Unsubscribe,
            Op::Status { .. } => Verb::Status,
            Op::Cancel { .. } => Verb::Cancel,
            Op::Ping => Verb::Ping,
            Op::Decide { .. } => Verb::Decide,
            Op::Pause { .. } => Verb::Pause,
            Op::Resume { .. } => Verb::Resume,
            Op::Kill { .. } => Verb::Kill,
            Op::Close { .. } => Verb::Close,
            Op::Runs { .. } => Verb::Runs,
            Op::Pending { .. } => Verb::Pending,
            Op::Ledger { .. } => Verb::Ledger,
            Op::Report { .. } => Verb::Report,
            Op::Token { .. } => Verb::Token,
            Op::TokenRevoke { .. } => Verb::TokenRevoke,
            Op::Compensations { .. } => Verb::Compensations,
            Op::Compensated { .. } => Verb::Compensated,
            Op::Saga { .. } => Verb::Saga,
            Op::LookedUp { .. } => Verb::LookedUp,
        }
    }

    /// The run the request is about, for the ownership check (an agent sees only its own runs).
    pub fn run(&self) -> Option<&RunId> {
        match self {
            Op::Admit(a) => Some(&a.run),
            Op::Complete(c) => Some(&c.run),
            Op::Start { run, .. }
            | Op::Wait { run, .. }
            | Op::Subscribe { run }
            | Op::Unsubscribe { run }
            | Op::Status { run }
            | Op::Cancel { run, .. }
            | Op::Decide { run, .. }
            | Op::Pause { run }
            | Op::Resume { run }
            | Op::Kill { run, .. }
            | Op::Close { run, .. }
            | Op::Report { run, .. }
            | Op::Compensated { run, .. }
            | Op::Saga { run, .. }
            | Op::LookedUp { run, .. } => Some(run),
            Op::Pending { run, .. } | Op::Ledger { run, .. } | Op::Compensations { run, .. } => {
                run.as_ref()
            }
            Op::Hello { .. }
            | Op::Ping
            | Op::Runs { .. }
            | Op::Token { .. }
            | Op::TokenRevoke { .. } => None,
        }
    }
}

/// Why a request line was refused. Carries the request's id when it could be read, so the
/// error reply still reaches the right caller.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}")]
pub struct RequestError {
    pub id: Id,
    pub kind: RequestErrorKind,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestErrorKind {
    #[error("malformed request: {detail}")]
    BadJson { detail: String },
    #[error("unknown op {op:?}; protocol v1 has: {}", verb_list())]
    UnknownOp { op: String },
    #[error("missing field `{field}`")]
    MissingField { field: &'static str },
    #[error("invalid field `{field}`: {why}")]
    InvalidField { field: &'static str, why: String },
    #[error("line is longer than {max} bytes; it was discarded")]
    LineTooLong { max: usize },
}

fn verb_list() -> String {
    Verb::ALL
        .iter()
        .map(|v| v.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

impl RequestError {
    /// The error for a line the codec cut off; such a line's id is never read.
    pub fn line_too_long(max: usize) -> RequestError {
        RequestError {
            id: Id::NULL,
            kind: RequestErrorKind::LineTooLong { max },
        }
    }

    pub fn code(&self) -> ErrorCode {
        match self.kind {
            RequestErrorKind::BadJson { .. } => ErrorCode::BadJson,
            RequestErrorKind::UnknownOp { .. } => ErrorCode::UnknownOp,
            RequestErrorKind::MissingField { .. } => ErrorCode::MissingField,
            RequestErrorKind::InvalidField { .. } => ErrorCode::InvalidField,
            RequestErrorKind::LineTooLong { .. } => ErrorCode::LineTooLong,
        }
    }

    /// The field the error names, if any.
    pub fn field(&self) -> Option<&'static str> {
        match self.kind {
            RequestErrorKind::MissingField { field }
            | RequestErrorKind::InvalidField { field, .. } => Some(field),
            _ => None,
        }
    }

    /// The error reply line (`"ok": false`) for this error.
    pub fn to_line(&self) -> Vec<u8> {
        crate::server_line::error_line(&self.id, self.code(), &self.kind.to_string())
    }
}

/// Parses one request line (without or with its trailing newline).
///
/// Never panics, whatever the bytes; refuses with a typed error instead.
pub fn parse_request(line: &[u8]) -> Result<Request, RequestError> {
    parse(line, true)
}

fn parse(line: &[u8], may_retry: bool) -> Result<Request, RequestError> {
    let failed = Cell::new(None);
    let mut de = serde_json::Deserializer::from_slice(line);
    let parsed = de
        .deserialize_map(RawVisitor { failed: &failed })
        .and_then(|raw| {
            de.end()?;
            Ok(raw)
        });
    let raw = match parsed {
        Ok(raw) => raw,
        Err(e) => return classify(line, &e, failed.get(), may_retry),
    };

    raw.finish()
}

/// Maps a serde_json failure to a code. A type error inside a known field names that field;
/// anything else (syntax, truncation, a non-object) is `bad_json`.
fn classify(
    line: &[u8],
    e: &serde_json::Error,
    field: Option<Field>,
    may_retry: bool,
) -> Result<Request, RequestError> {
    let kind = match (e.classify(), field) {
        (serde_json::error::Category::Data, Some(f)) => {
            // A field the verb does not read is ignored whatever its type: drop such fields
            // and parse once more (rare, so the common path stays single-pass). Every field
            // left is one the verb reads, so one retry is all it can take.
            if may_retry && let Some(trimmed) = without_unread_fields(line, f) {
                return parse(&trimmed, false);
            }
            RequestErrorKind::InvalidField {
                field: f.name(),
                why: without_position(e),
            }
        }
        (serde_json::error::Category::Data, None) => RequestErrorKind::BadJson {
            detail: "a request must be a JSON object".to_string(),
        },
        _ => RequestErrorKind::BadJson {
            detail: e.to_string(),
        },
    };
    Err(RequestError {
        id: recover_id(line),
        kind,
    })
}

/// The line with only `id`, `op` and the fields `op` reads, when `failed` is not one of those;
/// `None` otherwise (the type error stands). Values are copied as raw text, so the id stays exact.
fn without_unread_fields(line: &[u8], failed: Field) -> Option<Vec<u8>> {
    struct Entries<'a>(Vec<(Str<'a>, &'a RawValue)>);
    impl<'de> Deserialize<'de> for Entries<'de> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Entries<'de>, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = Entries<'de>;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: MapAccess<'de>>(
                    self,
                    mut map: A,
                ) -> Result<Entries<'de>, A::Error> {
                    let mut out = Vec::new();
                    while let Some(entry) = map.next_entry::<Str<'de>, &'de RawValue>()? {
                        out.push(entry);
                    }
                    Ok(Entries(out))
                }
            }
            d.deserialize_map(V)
        }
    }
    let entries: Entries<'_> = serde_json::from_slice(line).ok()?;
    let op = entries.0.iter().find(|(k, _)| k.0 == "op")?.1;
    let verb = Verb::parse(&serde_json::from_str::<String>(op.get()).ok()?)?;
    let read = verb_fields(verb);
    if read & failed.bit() != 0 {
        return None;
    }
    let mut out = b"{".to_vec();
    for (k, v) in &entries.0 {
        let Some(f) = Field::from_key(&k.0) else {
            continue;
        };
        if read & f.bit() != 0 || matches!(f, Field::Id | Field::Op) {
            if out.len() > 1 {
                out.push(b',');
            }
            out.extend_from_slice(format!("\"{}\":", f.name()).as_bytes());
            out.extend_from_slice(v.get().as_bytes());
        }
    }
    out.push(b'}');
    Some(out)
}

/// The fields each verb reads, as a mask of [`Field`] bits (`id` and `op` are implied).
fn verb_fields(verb: Verb) -> u64 {
    use Field as F;
    let fields: &[Field] = match verb {
        Verb::Hello => &[F::Token, F::Run, F::Component],
        Verb::Admit => &[
            F::Run,
            F::Key,
            F::Tool,
            F::Args,
            F::Digest,
            F::Start,
            F::Parent,
            F::Labels,
            F::NeedsApproval,
            F::Limits,
            F::Declare,
            F::Seed,
            F::Reserve,
        ],
        Verb::Start => &[F::Run, F::Key, F::Token],
        Verb::Complete => &[
            F::Run,
            F::Key,
            F::Token,
            F::Outcome,
            F::Result,
            F::Error,
            F::Cost,
        ],
        Verb::Wait => &[F::Run, F::Key, F::TimeoutMs],
        Verb::Subscribe | Verb::Unsubscribe | Verb::Status | Verb::Pause | Verb::Resume => {
            &[F::Run]
        }
        Verb::Report | Verb::Pending => &[F::Run, F::Limit, F::Cursor],
        Verb::Cancel => &[F::Run, F::Reason, F::Cascade],
        Verb::Ping => &[],
        Verb::Decide => &[F::Run, F::Key, F::Decision, F::Reason],
        Verb::Kill => &[F::Run, F::Reason],
        Verb::Close => &[F::Run, F::Outcome],
        Verb::Runs => &[F::State, F::Limit, F::Cursor],
        Verb::Ledger => &[F::Run, F::Limit, F::After],
        Verb::Token => &[F::Name, F::Role, F::Groups],
        Verb::TokenRevoke => &[F::Name],
        Verb::Compensations => &[F::Run, F::Tool],
        Verb::Compensated => &[F::Run, F::Key, F::Attempt, F::Outcome, F::Error],
        Verb::Saga => &[F::Run, F::Key, F::Action, F::Outcome, F::Reason, F::Result],
        Verb::LookedUp => &[F::Run, F::Key, F::Attempt, F::Outcome, F::Result, F::Error],
    };
    fields.iter().fold(0, |m, f| m | f.bit())
}

impl Verb {
    /// The fields this verb reads besides `id` and `op`; any other field is ignored.
    pub fn fields(self) -> Vec<&'static str> {
        let read = verb_fields(self);
        FIELDS_ALL
            .iter()
            .filter(|f| read & f.bit() != 0)
            .map(|f| f.name())
            .collect()
    }
}

fn without_position(e: &serde_json::Error) -> String {
    let s = e.to_string();
    match s.rfind(" at line ") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

/// Second, lenient look at a line that failed, only to echo its id in the error reply.
fn recover_id(line: &[u8]) -> Id {
    #[derive(Deserialize)]
    struct IdOnly<'a> {
        #[serde(borrow)]
        id: Option<&'a RawValue>,
    }
    serde_json::from_slice::<IdOnly<'_>>(line)
        .ok()
        .and_then(|x| x.id)
        .and_then(|raw| Id::from_raw_json(raw.get()).ok())
        .unwrap_or(Id::NULL)
}

macro_rules! fields {
    ($($variant:ident = $name:literal),+ $(,)?) => {
        /// Every field name any verb reads. Anything else is skipped unread.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        enum Field { $($variant),+ }

        const FIELDS_ALL: &[Field] = &[$(Field::$variant),+];

        impl Field {
            fn name(self) -> &'static str {
                match self { $(Field::$variant => $name),+ }
            }
            fn from_key(s: &str) -> Option<Field> {
                match s { $($name => Some(Field::$variant),)+ _ => None }
            }
            fn bit(self) -> u64 {
                1 << (self as u64)
            }
        }
    };
}

fields! {
    Id = "id", Op = "op", Run = "run", Key = "key", Tool = "tool", Args = "args",
    Digest = "digest", Start = "start", Parent = "parent", Labels = "labels",
    NeedsApproval = "needs_approval", Limits = "limits", Token = "token", Outcome = "outcome",
    Result = "result", Error = "error", TimeoutMs = "timeout_ms", Reason = "reason",
    Cascade = "cascade", Decision = "decision", State = "state", Limit = "limit",
    After = "after", Name = "name", Role = "role", Groups = "groups", Cursor = "cursor",
    Declare = "declare", Attempt = "attempt", Action = "action",
    Seed = "seed", Reserve = "reserve", Cost = "cost", Component = "component",
}

/// A string borrowed from the line when it has no escapes, owned otherwise.
struct Str<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Str<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Str<'de>, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Str<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Owned(v.to_string())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDeclare {
    reversibility: Option<String>,
    compensate: Option<String>,
    compensate_args: Option<String>,
}

impl RawDeclare {
    fn parse(self) -> Result<Declare, Kind> {
        let bad = |why: String| invalid(Field::Declare, why);
        let reversibility = self
            .reversibility
            .map(|r| {
                estop_kernel::vocab::Reversibility::parse(&r).ok_or_else(|| {
                    bad(format!(
                        "reversibility {:?} is not one of reversible, compensable, irreversible, \
                         undeclared",
                        truncated(&r)
                    ))
                })
            })
            .transpose()?;
        let compensate = self
            .compensate
            .map(|t| ToolName::new(&t).map_err(|e| bad(format!("compensate: {e}"))))
            .transpose()?;
        if let Some(m) = &self.compensate_args
            && m.len() > COMPENSATE_ARGS_BYTES_MAX
        {
            return Err(bad(format!(
                "compensate_args is longer than {COMPENSATE_ARGS_BYTES_MAX} bytes"
            )));
        }
        Ok(Declare {
            reversibility,
            compensate,
            compensate_args: self.compensate_args,
        })
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSeed {
    class: Option<String>,
    reversibility: Option<String>,
}

impl RawSeed {
    fn parse(self) -> Result<Seed, Kind> {
        use estop_kernel::vocab::{EffectClass, Reversibility};
        let bad = |what: &str, v: &str, allowed: &str| {
            invalid(
                Field::Seed,
                format!("{what} {:?} is not one of {allowed}", truncated(v)),
            )
        };
        let class = self
            .class
            .map(|c| EffectClass::parse(&c).ok_or_else(|| bad("class", &c, "read, write")))
            .transpose()?;
        let reversibility = self
            .reversibility
            .map(|r| {
                Reversibility::parse(&r).ok_or_else(|| {
                    bad(
                        "reversibility",
                        &r,
                        "reversible, compensable, irreversible, undeclared",
                    )
                })
            })
            .transpose()?;
        Ok(Seed {
            class,
            reversibility,
        })
    }
}

#[derive(Deserialize)]
struct RawLimits {
    deadline_ms: Option<u64>,
    timeout_ms: Option<u64>,
    max_effects: Option<u64>,
    max_spend: Option<u64>,
    max_tokens: Option<u64>,
}

/// `reserve` / `cost`: model spend in micro-USD and tokens (either may be left out: zero).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSpend {
    #[serde(default)]
    usd_micros: u64,
    #[serde(default)]
    tokens: u64,
}

impl RawSpend {
    fn parse(self, field: Field) -> Result<Spend, Kind> {
        let s = Spend {
            usd_micros: self.usd_micros,
            tokens: self.tokens,
        };
        if s.usd_micros > SPEND_USD_MICROS_MAX || s.tokens > SPEND_TOKENS_MAX {
            return Err(invalid(
                field,
                format!("at most {SPEND_USD_MICROS_MAX} usd_micros and {SPEND_TOKENS_MAX} tokens"),
            ));
        }
        Ok(s)
    }
}

/// The union of every verb's fields, filled in one pass over the line.
#[derive(Default)]
struct Raw<'a> {
    /// Borrowed from a line; owned when given as a value ([`Fields`]).
    id: Option<Cow<'a, RawValue>>,
    op: Option<Str<'a>>,
    run: Option<Str<'a>>,
    key: Option<Str<'a>>,
    tool: Option<Str<'a>>,
    /// `Some(Value::Null)` when the client sent `"args": null` (a valid argument value).
    args: Option<Value>,
    digest: Option<Str<'a>>,
    start: Option<bool>,
    parent: Option<Str<'a>>,
    labels: Option<BTreeMap<String, String>>,
    needs_approval: Option<bool>,
    limits: Option<RawLimits>,
    declare: Option<RawDeclare>,
    seed: Option<RawSeed>,
    reserve: Option<RawSpend>,
    cost: Option<RawSpend>,
    token: Option<Str<'a>>,
    component: Option<Str<'a>>,
    outcome: Option<Str<'a>>,
    /// Borrowed from a line; owned when given as a value ([`Fields`]).
    result: Option<Cow<'a, RawValue>>,
    error: Option<Str<'a>>,
    timeout_ms: Option<u64>,
    reason: Option<Str<'a>>,
    cascade: Option<bool>,
    decision: Option<Str<'a>>,
    state: Option<Str<'a>>,
    limit: Option<u64>,
    after: Option<u64>,
    cursor: Option<Str<'a>>,
    name: Option<Str<'a>>,
    role: Option<Str<'a>>,
    groups: Option<Vec<String>>,
    attempt: Option<u64>,
    action: Option<Str<'a>>,
    seen: u64,
    /// Fields given more than once.
    duplicates: u64,
}

struct FieldSeed;

impl<'de> DeserializeSeed<'de> for FieldSeed {
    type Value = Option<Field>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<Field>, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Option<Field>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Option<Field>, E> {
                Ok(Field::from_key(v))
            }
        }
        d.deserialize_identifier(V)
    }
}

/// Fills [`Raw`]; records which field was being read so a type error can name it.
struct RawVisitor<'c> {
    failed: &'c Cell<Option<Field>>,
}

impl<'de> Visitor<'de> for RawVisitor<'_> {
    type Value = Raw<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Raw<'de>, A::Error> {
        let mut raw = Raw::default();
        while let Some(field) = map.next_key_seed(FieldSeed)? {
            let Some(field) = field else {
                map.next_value::<IgnoredAny>()?;
                continue;
            };
            if raw.seen & field.bit() != 0 {
                // Which copy wins is parser-dependent elsewhere; refuse rather than guess.
                raw.duplicates |= field.bit();
                map.next_value::<IgnoredAny>()?;
                continue;
            }
            raw.seen |= field.bit();
            self.failed.set(Some(field));
            map.next_value_seed(Slot {
                raw: &mut raw,
                field,
            })?;
            self.failed.set(None);
        }
        Ok(raw)
    }
}

/// One field's value, read into its slot of [`Raw`].
struct Slot<'r, 'a> {
    raw: &'r mut Raw<'a>,
    field: Field,
}

impl<'de> DeserializeSeed<'de> for Slot<'_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        let raw = self.raw;
        match self.field {
            Field::Id => raw.id = Some(Cow::Borrowed(Deserialize::deserialize(d)?)),
            Field::Op => raw.op = Deserialize::deserialize(d)?,
            Field::Run => raw.run = Deserialize::deserialize(d)?,
            Field::Key => raw.key = Deserialize::deserialize(d)?,
            Field::Tool => raw.tool = Deserialize::deserialize(d)?,
            Field::Args => raw.args = Some(Deserialize::deserialize(d)?),
            Field::Digest => raw.digest = Deserialize::deserialize(d)?,
            Field::Start => raw.start = Deserialize::deserialize(d)?,
            Field::Parent => raw.parent = Deserialize::deserialize(d)?,
            Field::Labels => raw.labels = Deserialize::deserialize(d)?,
            Field::NeedsApproval => raw.needs_approval = Deserialize::deserialize(d)?,
            Field::Limits => raw.limits = Deserialize::deserialize(d)?,
            Field::Declare => raw.declare = Deserialize::deserialize(d)?,
            Field::Seed => raw.seed = Deserialize::deserialize(d)?,
            Field::Reserve => raw.reserve = Deserialize::deserialize(d)?,
            Field::Cost => raw.cost = Deserialize::deserialize(d)?,
            Field::Token => raw.token = Deserialize::deserialize(d)?,
            Field::Component => raw.component = Deserialize::deserialize(d)?,
            Field::Outcome => raw.outcome = Deserialize::deserialize(d)?,
            Field::Result => raw.result = Some(Cow::Borrowed(Deserialize::deserialize(d)?)),
            Field::Error => raw.error = Deserialize::deserialize(d)?,
            Field::TimeoutMs => raw.timeout_ms = Deserialize::deserialize(d)?,
            Field::Reason => raw.reason = Deserialize::deserialize(d)?,
            Field::Cascade => raw.cascade = Deserialize::deserialize(d)?,
            Field::Decision => raw.decision = Deserialize::deserialize(d)?,
            Field::State => raw.state = Deserialize::deserialize(d)?,
            Field::Limit => raw.limit = Deserialize::deserialize(d)?,
            Field::After => raw.after = Deserialize::deserialize(d)?,
            Field::Cursor => raw.cursor = Deserialize::deserialize(d)?,
            Field::Name => raw.name = Deserialize::deserialize(d)?,
            Field::Role => raw.role = Deserialize::deserialize(d)?,
            Field::Groups => raw.groups = Deserialize::deserialize(d)?,
            Field::Attempt => raw.attempt = Deserialize::deserialize(d)?,
            Field::Action => raw.action = Deserialize::deserialize(d)?,
        }
        Ok(())
    }
}

type Kind = RequestErrorKind;

fn invalid(field: Field, why: impl Into<String>) -> Kind {
    Kind::InvalidField {
        field: field.name(),
        why: why.into(),
    }
}

fn required<T>(slot: Option<T>, field: Field) -> Result<T, Kind> {
    slot.ok_or(Kind::MissingField {
        field: field.name(),
    })
}

/// Refuses an identifier holding a character that would show as something else on an
/// operator's screen (control, bidi, zero-width: [`crate::text::is_hidden`]). Ids are compared
/// by people; free text (reasons, errors, results, args, label values) keeps every character
/// and is escaped where it is shown.
fn visible(s: &str, field: Field) -> Result<(), Kind> {
    if crate::text::has_hidden(s) {
        return Err(invalid(
            field,
            "contains a control, bidi or zero-width character (ids must look like what they are)",
        ));
    }
    Ok(())
}

fn run_id(s: Str<'_>, field: Field) -> Result<RunId, Kind> {
    visible(&s.0, field)?;
    RunId::new(&s.0).map_err(|e| invalid(field, e.to_string()))
}

fn bounded(s: Str<'_>, field: Field, max: usize) -> Result<String, Kind> {
    if s.0.len() > max {
        return Err(invalid(field, format!("longer than {max} bytes")));
    }
    Ok(s.0.into_owned())
}

fn opt_bounded(s: Option<Str<'_>>, field: Field, max: usize) -> Result<Option<String>, Kind> {
    s.map(|s| bounded(s, field, max)).transpose()
}

fn vocab<T>(
    s: Str<'_>,
    field: Field,
    parse: fn(&str) -> Option<T>,
    names: &str,
) -> Result<T, Kind> {
    parse(&s.0).ok_or_else(|| {
        invalid(
            field,
            format!("{:?} is not one of {names}", truncated(&s.0)),
        )
    })
}

/// Echo at most a short prefix of a client's bad value in an error message.
fn truncated(s: &str) -> &str {
    let mut end = s.len().min(64);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn limit_u32(v: Option<u64>) -> Result<Option<u32>, Kind> {
    v.map(|n| u32::try_from(n).map_err(|_| invalid(Field::Limit, "larger than 4294967295")))
        .transpose()
}

impl<'a> Raw<'a> {
    fn run(&mut self) -> Result<RunId, Kind> {
        run_id(required(self.run.take(), Field::Run)?, Field::Run)
    }

    fn key(&mut self) -> Result<EffectKey, Kind> {
        let s = required(self.key.take(), Field::Key)?;
        visible(&s.0, Field::Key)?;
        EffectKey::new(&s.0).map_err(|e| invalid(Field::Key, e.to_string()))
    }

    /// `component` of a hello: a part's name (`Part`), `main` when absent.
    fn component(&mut self) -> Result<Part, Kind> {
        let Some(c) = self.component.take() else {
            return Ok(Part::Main);
        };
        Part::parse(&c.0).ok_or_else(|| {
            let names: Vec<&str> = Part::ALL.iter().map(|p| p.as_str()).collect();
            invalid(Field::Component, format!("one of {}", names.join(", ")))
        })
    }

    fn opt_run(&mut self) -> Result<Option<RunId>, Kind> {
        self.run.take().map(|s| run_id(s, Field::Run)).transpose()
    }

    /// A tool name or pattern (`compensations`): checked as a name here, as a glob by the gate.
    fn opt_tool(&mut self) -> Result<Option<ToolName>, Kind> {
        let Some(tool) = self.tool.take() else {
            return Ok(None);
        };
        visible(&tool.0, Field::Tool)?;
        ToolName::new(&tool.0)
            .map(Some)
            .map_err(|e| invalid(Field::Tool, e.to_string()))
    }

    /// The listing's cursor, as `decode` reads it: a string this gate gave out as `next`.
    fn cursor<T>(&mut self, decode: impl FnOnce(&str) -> Option<T>) -> Result<Option<T>, Kind> {
        let Some(s) = self.cursor.take() else {
            return Ok(None);
        };
        let s = bounded(s, Field::Cursor, CURSOR_BYTES_MAX)?;
        decode(&s).map(Some).ok_or_else(|| {
            invalid(
                Field::Cursor,
                "not a cursor of this listing: pass the `next` of the previous page as it is",
            )
        })
    }

    fn admission_token(&mut self) -> Result<String, Kind> {
        bounded(
            required(self.token.take(), Field::Token)?,
            Field::Token,
            TOKEN_BYTES_MAX,
        )
    }

    fn reason(&mut self) -> Result<Option<String>, Kind> {
        opt_bounded(self.reason.take(), Field::Reason, REASON_BYTES_MAX)
    }

    /// The request: its id checked, then its verb's fields.
    fn finish(mut self) -> Result<Request, RequestError> {
        let id = match self.id.take() {
            None => Id::NULL,
            Some(text) => Id::from_raw_json(text.get()).map_err(|p| RequestError {
                id: Id::NULL,
                kind: RequestErrorKind::InvalidField {
                    field: "id",
                    why: p.why(),
                },
            })?,
        };
        match self.build() {
            Ok(op) => Ok(Request { id, op }),
            Err(kind) => Err(RequestError { id, kind }),
        }
    }

    fn build(mut self) -> Result<Op, Kind> {
        if self.duplicates & Field::Op.bit() != 0 {
            return Err(invalid(Field::Op, "given more than once"));
        }
        let op = required(self.op.take(), Field::Op)?;
        let verb = Verb::parse(&op.0).ok_or_else(|| Kind::UnknownOp {
            op: truncated(&op.0).to_string(),
        })?;
        let dup_read = self.duplicates & (verb_fields(verb) | Field::Id.bit());
        if let Some(field) = FIELDS_ALL.iter().find(|f| dup_read & f.bit() != 0) {
            return Err(invalid(*field, "given more than once"));
        }
        Ok(match verb {
            Verb::Hello => Op::Hello {
                token: Secret(bounded(
                    required(self.token.take(), Field::Token)?,
                    Field::Token,
                    TOKEN_BYTES_MAX,
                )?),
                run: self.opt_run()?,
                component: self.component()?,
            },
            Verb::Admit => Op::Admit(self.admit()?),
            Verb::Start => Op::Start {
                run: self.run()?,
                key: self.key()?,
                token: self.admission_token()?,
            },
            Verb::Complete => Op::Complete(self.complete()?),
            Verb::Wait => Op::Wait {
                run: self.run()?,
                key: self.key()?,
                timeout_ms: required(self.timeout_ms, Field::TimeoutMs)?,
            },
            Verb::Subscribe => Op::Subscribe { run: self.run()? },
            Verb::Unsubscribe => Op::Unsubscribe { run: self.run()? },
            Verb::Status => Op::Status { run: self.run()? },
            Verb::Cancel => Op::Cancel {
                run: self.run()?,
                reason: self.reason()?,
                cascade: self.cascade.unwrap_or(true),
            },
            Verb::Ping => Op::Ping,
            Verb::Decide => Op::Decide {
                run: self.run()?,
                key: self.key()?,
                decision: vocab(
                    required(self.decision.take(), Field::Decision)?,
                    Field::Decision,
                    Decision::parse,
                    "approve, reject",
                )?,
                reason: self.reason()?,
            },
            Verb::Pause => Op::Pause { run: self.run()? },
            Verb::Resume => Op::Resume { run: self.run()? },
            Verb::Kill => Op::Kill {
                run: self.run()?,
                reason: self.reason()?,
            },
            Verb::Close => Op::Close {
                run: self.run()?,
                outcome: match self.outcome.take() {
                    None => CloseOutcome::Completed,
                    Some(s) => vocab(s, Field::Outcome, CloseOutcome::parse, "completed, failed")?,
                },
            },
            Verb::Runs => Op::Runs {
                state: self
                    .state
                    .take()
                    .map(|s| {
                        vocab(
                            s,
                            Field::State,
                            RunState::parse,
                            "active, paused, finalizing, completed, failed, cancelled",
                        )
                    })
                    .transpose()?,
                limit: limit_u32(self.limit)?,
                cursor: self.cursor(|s| RunId::new(s).ok())?,
            },
            Verb::Pending => Op::Pending {
                run: self.opt_run()?,
                limit: limit_u32(self.limit)?,
                cursor: self.cursor(PendingCursor::decode)?,
            },
            Verb::Ledger => Op::Ledger {
                run: self.opt_run()?,
                limit: limit_u32(self.limit)?,
                after: self.after,
            },
            Verb::Report => Op::Report {
                run: self.run()?,
                limit: limit_u32(self.limit)?,
                cursor: self.cursor(|s| EffectKey::new(s).ok())?,
            },
            Verb::Token => self.token_op()?,
            Verb::TokenRevoke => Op::TokenRevoke { name: self.name()? },
            Verb::Compensations => Op::Compensations {
                run: self.opt_run()?,
                tool: self.opt_tool()?,
            },
            Verb::Compensated => self.compensated()?,
            Verb::Saga => self.saga()?,
            Verb::LookedUp => self.looked_up()?,
        })
    }

    fn attempt(&mut self) -> Result<u32, Kind> {
        let attempt = required(self.attempt, Field::Attempt)?;
        u32::try_from(attempt)
            .ok()
            .filter(|a| *a >= 1)
            .ok_or_else(|| invalid(Field::Attempt, "an attempt is numbered from 1 (a u32)"))
    }

    /// `looked_up`: how a lookup of an unknown outcome ended.
    fn looked_up(&mut self) -> Result<Op, Kind> {
        let run = self.run()?;
        let key = self.key()?;
        let attempt = self.attempt()?;
        let outcome = vocab(
            required(self.outcome.take(), Field::Outcome)?,
            Field::Outcome,
            Outcome::parse,
            "ok (found), error (not found), unknown (the lookup could not tell)",
        )?;
        let result = self.result()?;
        if result.is_some() && outcome != Outcome::Ok {
            return Err(invalid(
                Field::Result,
                "a result says the call happened: report it with outcome ok",
            ));
        }
        let error = opt_bounded(self.error.take(), Field::Error, ERROR_BYTES_MAX)?;
        Ok(Op::LookedUp {
            run,
            key,
            attempt,
            outcome,
            result,
            error,
        })
    }

    /// The `result` field: any JSON value, bounded.
    fn result(&mut self) -> Result<Option<Value>, Kind> {
        let Some(raw) = self.result.take() else {
            return Ok(None);
        };
        if raw.get().len() > RESULT_BYTES_MAX {
            return Err(invalid(
                Field::Result,
                format!("larger than {RESULT_BYTES_MAX} bytes"),
            ));
        }
        serde_json::from_str::<Value>(raw.get())
            .map(Some)
            .map_err(|e| invalid(Field::Result, without_position(&e)))
    }

    fn compensated(&mut self) -> Result<Op, Kind> {
        let run = self.run()?;
        let key = self.key()?;
        let attempt = self.attempt()?;
        let outcome = vocab(
            required(self.outcome.take(), Field::Outcome)?,
            Field::Outcome,
            Outcome::parse,
            "ok, error, unknown",
        )?;
        let error = opt_bounded(self.error.take(), Field::Error, ERROR_BYTES_MAX)?;
        Ok(Op::Compensated {
            run,
            key,
            attempt,
            outcome,
            error,
        })
    }

    /// `saga`: the action with what it needs (`settle` an outcome, `skip` a reason).
    fn saga(&mut self) -> Result<Op, Kind> {
        let run = self.run()?;
        let key = self.key()?;
        let action = required(self.action.take(), Field::Action)?;
        let action = match action.0.as_ref() {
            "settle" => {
                let outcome = vocab(
                    required(self.outcome.take(), Field::Outcome)?,
                    Field::Outcome,
                    Outcome::parse,
                    "ok, error (whether it happened), unknown (a call left in flight: stop \
                     waiting for its agent)",
                )?;
                let result = self.result()?;
                if result.is_some() && outcome != Outcome::Ok {
                    return Err(invalid(
                        Field::Result,
                        "a result says the call happened: settle it ok",
                    ));
                }
                SagaAction::Settle {
                    outcome,
                    result: result.map(|v| v.to_string().into_boxed_str()),
                }
            }
            "retry" => SagaAction::Retry,
            "compensate" => SagaAction::Compensate,
            "skip" => {
                let reason = self.reason()?.filter(|r| !r.trim().is_empty());
                let reason = required(reason, Field::Reason)?;
                SagaAction::Skip {
                    reason: reason.into_boxed_str(),
                }
            }
            other => {
                return Err(invalid(
                    Field::Action,
                    format!(
                        "{:?} is not one of settle, retry, skip, compensate",
                        truncated(other)
                    ),
                ));
            }
        };
        Ok(Op::Saga { run, key, action })
    }

    fn admit(&mut self) -> Result<Admit, Kind> {
        let run = self.run()?;
        let key = self.key()?;
        let tool = required(self.tool.take(), Field::Tool)?;
        visible(&tool.0, Field::Tool)?;
        let tool = ToolName::new(&tool.0).map_err(|e| invalid(Field::Tool, e.to_string()))?;
        let (args, digest) = match (self.args.take(), self.digest.take()) {
            (Some(args), None) => {
                let digest = digest_of(&tool, &args);
                (Some(args), digest)
            }
            (None, Some(hex)) => {
                let digest = Digest::from_hex(&hex.0)
                    .ok_or_else(|| invalid(Field::Digest, "must be 64 hex digits (SHA-256)"))?;
                (None, digest)
            }
            (Some(_), Some(_)) => {
                return Err(invalid(Field::Args, "give args or digest, not both"));
            }
            (None, None) => {
                return Err(invalid(Field::Args, "give exactly one of args and digest"));
            }
        };
        let parent = self
            .parent
            .take()
            .map(|s| run_id(s, Field::Parent))
            .transpose()?;
        let labels = self.labels.take().unwrap_or_default();
        check_labels(&labels)?;
        let limits = match self.limits.take() {
            None => RequestedRunLimits::default(),
            Some(l) => RequestedRunLimits {
                deadline_ms: l.deadline_ms,
                timeout_ms: l.timeout_ms,
                max_effects: l.max_effects,
                max_spend: l.max_spend,
                max_tokens: l.max_tokens,
            },
        };
        let reserve = self
            .reserve
            .take()
            .map(|r| r.parse(Field::Reserve))
            .transpose()?
            .unwrap_or_default();
        Ok(Admit {
            run,
            key,
            tool,
            args,
            digest,
            start: self.start.unwrap_or(true),
            parent,
            labels,
            needs_approval: self.needs_approval.unwrap_or(false),
            limits,
            declare: self.declare.take().map(RawDeclare::parse).transpose()?,
            seed: self.seed.take().map(RawSeed::parse).transpose()?,
            reserve,
        })
    }

    fn complete(&mut self) -> Result<Complete, Kind> {
        let run = self.run()?;
        let key = self.key()?;
        let token = self.admission_token()?;
        let outcome = vocab(
            required(self.outcome.take(), Field::Outcome)?,
            Field::Outcome,
            Outcome::parse,
            "ok, error, unknown",
        )?;
        let result = self.result()?;
        let error = opt_bounded(self.error.take(), Field::Error, ERROR_BYTES_MAX)?;
        let cost = self
            .cost
            .take()
            .map(|c| c.parse(Field::Cost))
            .transpose()?
            .unwrap_or_default();
        Ok(Complete {
            run,
            key,
            token,
            outcome,
            result,
            error,
            cost,
        })
    }

    fn name(&mut self) -> Result<PrincipalName, Kind> {
        let name = required(self.name.take(), Field::Name)?;
        visible(&name.0, Field::Name)?;
        PrincipalName::new(&name.0).map_err(|e| invalid(Field::Name, e.to_string()))
    }

    fn token_op(&mut self) -> Result<Op, Kind> {
        let name = self.name()?;
        let role = vocab(
            required(self.role.take(), Field::Role)?,
            Field::Role,
            Role::parse,
            "agent, operator, observer, executor",
        )?;
        let groups = self.groups.take().unwrap_or_default();
        if groups.len() > GROUPS_MAX {
            return Err(invalid(
                Field::Groups,
                format!("more than {GROUPS_MAX} groups"),
            ));
        }
        for g in &groups {
            if g.is_empty() || g.len() > GROUP_BYTES_MAX || crate::text::has_hidden(g) {
                return Err(invalid(
                    Field::Groups,
                    format!(
                        "a group name must be 1 to {GROUP_BYTES_MAX} bytes without control, bidi or zero-width characters"
                    ),
                ));
            }
        }
        Ok(Op::Token { name, role, groups })
    }
}

/// A request assembled from named values rather than read from one line: the HTTP API's path
/// segments, query parameters and JSON body fields. Each value is read into its field exactly
/// as the same value in a line would be (types, bounds, vocabularies, `null` as absent), and
/// [`Fields::build`] checks the verb's fields exactly as [`parse_request`] does, so both front
/// doors refuse the same requests with the same errors. As in a line, a name no verb reads is
/// ignored, and so is a field the verb does not read, whatever it holds; a name given again
/// replaces what it held (a JSON object keeps the last of duplicate keys too).
#[derive(Default)]
pub struct Fields<'a> {
    raw: Raw<'a>,
    /// Fields whose value has the wrong type, and why, in the order given.
    wrong: Vec<(Field, String)>,
}

impl fmt::Debug for Fields<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Values are not shown: a `token` field holds a secret.
        let names: Vec<_> = FIELDS_ALL
            .iter()
            .filter(|x| self.raw.seen & x.bit() != 0)
            .map(|x| x.name())
            .collect();
        f.debug_struct("Fields").field("given", &names).finish()
    }
}

impl<'a> Fields<'a> {
    pub fn new() -> Fields<'a> {
        Fields::default()
    }

    /// A field given as a JSON value (a field of a request body).
    pub fn json(&mut self, name: &str, value: &'a Value) {
        self.put(name, value, || serde_json::value::to_raw_value(value));
    }

    /// A field given as text (a path segment, a query parameter): read as a JSON string.
    pub fn text(&mut self, name: &str, value: &'a str) {
        self.put(name, Text(value), || serde_json::value::to_raw_value(value));
    }

    /// A field given as a number (a query parameter that reads as one).
    pub fn number(&mut self, name: &str, value: u64) {
        self.put(name, Number(value), || {
            serde_json::value::to_raw_value(&value)
        });
    }

    fn put<D: Deserializer<'a, Error = serde_json::Error>>(
        &mut self,
        name: &str,
        value: D,
        raw_json: impl FnOnce() -> Result<Box<RawValue>, serde_json::Error>,
    ) {
        // The verb is `build`'s argument, never a field's.
        let Some(field) = Field::from_key(name).filter(|f| *f != Field::Op) else {
            return;
        };
        self.raw.seen |= field.bit();
        self.wrong.retain(|(f, _)| *f != field);
        let read = match field {
            // Kept as JSON text, as a line's are.
            Field::Id => raw_json().map(|r| self.raw.id = Some(Cow::Owned(r))),
            Field::Result => raw_json().map(|r| self.raw.result = Some(Cow::Owned(r))),
            _ => Slot {
                raw: &mut self.raw,
                field,
            }
            .deserialize(value),
        };
        if let Err(e) = read {
            self.wrong.push((field, without_position(&e)));
        }
    }

    /// The request for `verb`, or why it is refused: a value of the wrong type in a field the
    /// verb reads (the first by name, as in a line whose keys are in order), then the id, then
    /// the verb's fields, in the same order and with the same errors as [`parse_request`].
    pub fn build(mut self, verb: Verb) -> Result<Request, RequestError> {
        let read = verb_fields(verb) | Field::Id.bit();
        let wrong = self
            .wrong
            .iter()
            .filter(|(f, _)| read & f.bit() != 0)
            .min_by_key(|(f, _)| f.name());
        if let Some((field, why)) = wrong {
            let id = self
                .raw
                .id
                .as_deref()
                .and_then(|r| Id::from_raw_json(r.get()).ok())
                .unwrap_or(Id::NULL);
            return Err(RequestError {
                id,
                kind: invalid(*field, why.clone()),
            });
        }
        self.raw.op = Some(Str(Cow::Borrowed(verb.as_str())));
        self.raw.finish()
    }
}

/// A text value as a JSON string would be read (`null` is never text).
struct Text<'a>(&'a str);

impl<'de> Deserializer<'de> for Text<'de> {
    type Error = serde_json::Error;
    fn deserialize_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
        v.visit_borrowed_str(self.0)
    }
    fn deserialize_option<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
        v.visit_some(self)
    }
    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        unit unit_struct newtype_struct seq tuple tuple_struct map struct enum identifier
        ignored_any
    }
}

/// A number value as a JSON number would be read.
struct Number(u64);

impl<'de> Deserializer<'de> for Number {
    type Error = serde_json::Error;
    fn deserialize_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
        v.visit_u64(self.0)
    }
    fn deserialize_option<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
        v.visit_some(self)
    }
    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        unit unit_struct newtype_struct seq tuple tuple_struct map struct enum identifier
        ignored_any
    }
}

fn check_labels(labels: &BTreeMap<String, String>) -> Result<(), Kind> {
    if labels.len() > LABELS_MAX {
        return Err(invalid(
            Field::Labels,
            format!("more than {LABELS_MAX} labels"),
        ));
    }
    for (k, v) in labels {
        if k.is_empty() || k.len() > LABEL_KEY_BYTES_MAX || crate::text::has_hidden(k) {
            return Err(invalid(
                Field::Labels,
                format!(
                    "a label key must be 1 to {LABEL_KEY_BYTES_MAX} bytes without control, bidi or zero-width characters"
                ),
            ));
        }
        if v.len() > LABEL_VALUE_BYTES_MAX {
            return Err(invalid(
                Field::Labels,
                format!(
                    "label {:?}: value longer than {LABEL_VALUE_BYTES_MAX} bytes",
                    truncated(k)
                ),
            ));
        }
    }
    Ok(())
}

impl Request {
    pub fn new(id: Id, op: Op) -> Request {
        Request { id, op }
    }

    /// The request as one JSON line (with `\n`), as a client sends it: [`Op::to_line`] under
    /// this request's id.
    pub fn to_line(&self) -> Vec<u8> {
        self.op.to_line(&self.id)
    }
}

impl Op {
    /// The request as one JSON line (with `\n`) under `id` (left out when `Id::NULL`), as a
    /// client sends it; [`parse_request`] reads it back to the same request. An `admit` that
    /// carries `args` sends them and not the digest (the gate computes it); one without sends
    /// the digest.
    pub fn to_line(&self, id: &Id) -> Vec<u8> {
        let mut m = serde_json::Map::new();
        let id: Value = serde_json::from_str(id.as_json()).unwrap_or(Value::Null);
        if !id.is_null() {
            m.insert("id".into(), id);
        }
        m.insert("op".into(), self.verb().as_str().into());
        fn put(m: &mut serde_json::Map<String, Value>, k: &str, v: impl Into<Value>) {
            m.insert(k.to_string(), v.into());
        }
        fn put_opt(m: &mut serde_json::Map<String, Value>, k: &str, v: Option<impl Into<Value>>) {
            if let Some(v) = v {
                m.insert(k.to_string(), v.into());
            }
        }
        match self {
            Op::Hello {
                token,
                run,
                component,
            } => {
                put(&mut m, "token", token.expose());
                put_opt(&mut m, "run", run.as_ref().map(|r| r.as_str()));
                if *component != Part::Main {
                    put(&mut m, "component", component.as_str());
                }
            }
            Op::Admit(a) => {
                put(&mut m, "run", a.run.as_str());
                put(&mut m, "key", a.key.as_str());
                put(&mut m, "tool", a.tool.as_str());
                match &a.args {
                    Some(args) => put(&mut m, "args", args.clone()),
                    None => put(&mut m, "digest", a.digest.to_hex()),
                }
                put(&mut m, "start", a.start);
                put_opt(&mut m, "parent", a.parent.as_ref().map(|p| p.as_str()));
                if !a.labels.is_empty() {
                    let labels: serde_json::Map<String, Value> = a
                        .labels
                        .iter()
                        .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
                        .collect();
                    put(&mut m, "labels", labels);
                }
                if a.needs_approval {
                    put(&mut m, "needs_approval", true);
                }
                if !a.limits.is_empty() {
                    let mut l = serde_json::Map::new();
                    put_opt(&mut l, "deadline_ms", a.limits.deadline_ms);
                    put_opt(&mut l, "timeout_ms", a.limits.timeout_ms);
                    put_opt(&mut l, "max_effects", a.limits.max_effects);
                    put_opt(&mut l, "max_spend", a.limits.max_spend);
                    put_opt(&mut l, "max_tokens", a.limits.max_tokens);
                    put(&mut m, "limits", l);
                }
                if !a.reserve.is_zero() {
                    put(&mut m, "reserve", spend_json(a.reserve));
                }
                if let Some(d) = &a.declare {
                    let mut o = serde_json::Map::new();
                    put_opt(&mut o, "reversibility", d.reversibility.map(|r| r.as_str()));
                    put_opt(
                        &mut o,
                        "compensate",
                        d.compensate.as_ref().map(|t| t.as_str()),
                    );
                    put_opt(&mut o, "compensate_args", d.compensate_args.as_deref());
                    put(&mut m, "declare", o);
                }
                if let Some(d) = &a.seed {
                    let mut o = serde_json::Map::new();
                    put_opt(&mut o, "class", d.class.map(|c| c.as_str()));
                    put_opt(&mut o, "reversibility", d.reversibility.map(|r| r.as_str()));
                    put(&mut m, "seed", o);
                }
            }
            Op::Start { run, key, token } => {
                put(&mut m, "run", run.as_str());
                put(&mut m, "key", key.as_str());
                put(&mut m, "token", token.as_str());
            }
            Op::Complete(c) => {
                put(&mut m, "run", c.run.as_str());
                put(&mut m, "key", c.key.as_str());
                put(&mut m, "token", c.token.as_str());
                put(&mut m, "outcome", c.outcome.as_str());
                put_opt(&mut m, "result", c.result.clone());
                put_opt(&mut m, "error", c.error.as_deref());
                if !c.cost.is_zero() {
                    put(&mut m, "cost", spend_json(c.cost));
                }
            }
            Op::Wait {
                run,
                key,
                timeout_ms,
            } => {
                put(&mut m, "run", run.as_str());
                put(&mut m, "key", key.as_str());
                put(&mut m, "timeout_ms", *timeout_ms);
            }
            Op::Subscribe { run }
            | Op::Unsubscribe { run }
            | Op::Status { run }
            | Op::Pause { run }
            | Op::Resume { run } => put(&mut m, "run", run.as_str()),
            Op::Report { run, limit, cursor } => {
                put(&mut m, "run", run.as_str());
                put_opt(&mut m, "limit", *limit);
                put_opt(&mut m, "cursor", cursor.as_ref().map(|c| c.as_str()));
            }
            Op::Cancel {
                run,
                reason,
                cascade,
            } => {
                put(&mut m, "run", run.as_str());
                put_opt(&mut m, "reason", reason.as_deref());
                put(&mut m, "cascade", *cascade);
            }
            Op::Ping => {}
            Op::Decide {
                run,
                key,
                decision,
                reason,
            } => {
                put(&mut m, "run", run.as_str());
                put(&mut m, "key", key.as_str());
                put(&mut m, "decision", decision.as_str());
                put_opt(&mut m, "reason", reason.as_deref());
            }
            Op::Kill { run, reason } => {
                put(&mut m, "run", run.as_str());
                put_opt(&mut m, "reason", reason.as_deref());
            }
            Op::Close { run, outcome } => {
                put(&mut m, "run", run.as_str());
                put(&mut m, "outcome", outcome.as_str());
            }
            Op::Runs {
                state,
                limit,
                cursor,
            } => {
                put_opt(&mut m, "state", state.map(|s| s.as_str()));
                put_opt(&mut m, "limit", *limit);
                put_opt(&mut m, "cursor", cursor.as_ref().map(|c| c.as_str()));
            }
            Op::Pending { run, limit, cursor } => {
                put_opt(&mut m, "run", run.as_ref().map(|r| r.as_str()));
                put_opt(&mut m, "limit", *limit);
                put_opt(&mut m, "cursor", cursor.as_ref().map(PendingCursor::encode));
            }
            Op::Ledger { run, limit, after } => {
                put_opt(&mut m, "run", run.as_ref().map(|r| r.as_str()));
                put_opt(&mut m, "limit", *limit);
                put_opt(&mut m, "after", *after);
            }
            Op::Token { name, role, groups } => {
                put(&mut m, "name", name.as_str());
                put(&mut m, "role", role.as_str());
                if !groups.is_empty() {
                    put(&mut m, "groups", groups.clone());
                }
            }
            Op::TokenRevoke { name } => put(&mut m, "name", name.as_str()),
            Op::Compensations { run, tool } => {
                put_opt(&mut m, "run", run.as_ref().map(|r| r.as_str()));
                put_opt(&mut m, "tool", tool.as_ref().map(|t| t.as_str()));
            }
            Op::Compensated {
                run,
                key,
                attempt,
                outcome,
                error,
            } => {
                put(&mut m, "run", run.as_str());
                put(&mut m, "key", key.as_str());
                put(&mut m, "attempt", *attempt);
                put(&mut m, "outcome", outcome.as_str());
                put_opt(&mut m, "error", error.as_deref());
            }
            Op::Saga { run, key, action } => {
                put(&mut m, "run", run.as_str());
                put(&mut m, "key", key.as_str());
                match action {
                    SagaAction::Settle { outcome, result } => {
                        put(&mut m, "action", "settle");
                        put(&mut m, "outcome", outcome.as_str());
                        if let Some(r) = result {
                            let v: Value = serde_json::from_str(r).expect("kept as JSON text");
                            put(&mut m, "result", v);
                        }
                    }
                    SagaAction::Retry => put(&mut m, "action", "retry"),
                    SagaAction::Skip { reason } => {
                        put(&mut m, "action", "skip");
                        put(&mut m, "reason", &**reason);
                    }
                    SagaAction::Compensate => put(&mut m, "action", "compensate"),
                }
            }
            Op::LookedUp {
                run,
                key,
                attempt,
                outcome,
                result,
                error,
            } => {
                put(&mut m, "run", run.as_str());
                put(&mut m, "key", key.as_str());
                put(&mut m, "attempt", *attempt);
                put(&mut m, "outcome", outcome.as_str());
                put_opt(&mut m, "result", result.clone());
                put_opt(&mut m, "error", error.as_deref());
            }
        }
        let mut out = serde_json::to_vec(&Value::Object(m)).expect("a Value always serializes");
        out.push(b'\n');
        out
    }
}
