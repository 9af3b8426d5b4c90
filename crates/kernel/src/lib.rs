//! estop kernel: the pure per-run state machine and admission logic.
//! No IO, no clock (time is an argument), no threads, no randomness; same inputs, same outputs.
pub mod command;
pub mod gate;
pub mod ids;
pub mod limits;
pub mod record_codec;
pub mod reply;
pub mod report;
mod runs;
pub mod saga;
pub mod state;
mod tombstones;
pub mod transitions;
pub mod vocab;

pub use command::{
    Admit, Command, PolicyDecision, Record, RunLimits, SagaAction, SagaStep, Spend, SpendDimension,
    Token, TokenAction, TokenChange,
};
pub use gate::Gate;
pub use ids::{
    Digest, EffectKey, NAME_BYTES_MAX, Part, Principal, PrincipalName, Role, RunId,
    SANDBOX_SEPARATOR, ToolName,
};
pub use limits::Limits;
pub use reply::{Applied, DecideStatus, Event, EventKind, KernelError, Reply, Verdict};
