//! estop protocol: the only place that knows JSON shapes on the wire (SPEC §4.3).
//!
//! * [`parse_request`] turns one request line into a typed [`Request`] or a [`RequestError`]
//!   with a stable [`ErrorCode`]; ids, keys, digests and vocabularies arrive as kernel types.
//!   [`Fields`] builds the same request from named values (the HTTP API), through the same checks.
//! * [`server_line`] renders replies (`ok_line`, `error_line`) and events, and decodes them for clients.
//! * [`line_codec::LineReader`] frames lines over any `AsyncRead`, bounded by `line_bytes_max`.
//! * [`soundgate`] speaks the reference system's wire for its unchanged clients.
//! * [`text`] says which characters of agent text must be escaped on a terminal, and escapes them.
//! * [`digest_of`] is the effect digest: SHA-256 of the RFC 8785 canonical `{tool, args}`.
//!
//! docs/PROTOCOL.md is the prose version of this crate and changes with it.

pub mod digest;
pub mod effect_token;
pub mod error;
pub mod id;
pub mod limits;
pub mod line_codec;
pub mod page;
pub mod request;
pub mod server_line;
pub mod soundgate;
pub mod text;

/// The kernel's ids and vocabulary words that requests and replies carry, so a client needs
/// this crate only.
pub use estop_kernel::{ids, vocab};

pub use digest::{canonical_input, digest_of, write_canonical};
pub use error::{ErrorCode, WireError};
pub use id::Id;
pub use line_codec::{Line, LineReader};
pub use page::{PageBudget, PendingCursor, Weight};
pub use request::{
    Admit, CloseOutcome, Complete, Declare, Fields, Op, Request, RequestError, RequestErrorKind,
    RequestedRunLimits, Secret, Seed, Verb, parse_request,
};
pub use server_line::{
    Ack, Awaiting, BudgetLine, ClientReply, DecideReply, EffectCounts, Event, EventKind,
    HelloReply, IN_FLIGHT_LISTED_MAX, InFlight, InFlightList, LedgerEntry, LedgerReply,
    PendingItem, PendingReply, Pong, RawJson, ReplyBody, Report, ReportItem, RunReplay, RunView,
    RunsReply, SagaNext, ServerLine, SubscribeReply, TokenCreated, TokenRevoked, VerdictReply,
    parse_server_line,
};
pub use soundgate::{SgError, SgReply, SgRequest, parse_soundgate};
