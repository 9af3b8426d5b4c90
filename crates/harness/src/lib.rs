//! estop-harness: the agent loop run by estop itself (SPEC §4.9, seed 004). Every control fact
//! of a trajectory — its state, budget, pending work, control requests — lives in a
//! [`record::Record`] outside the model, changes only through the guarded
//! [`machine::transition`], and is journalled before the harness acts on it.
//!
//! The core (`machine`, `record`, `retry`, `budget`, `scheduler`, `compact`) is pure: no IO, no clock
//! (time is an argument in Unix milliseconds), no threads, deterministic, and so is the
//! completion check (`contract`, but for `files_present`, which the runner calls). The IO lives
//! in other modules.

pub mod agent;
pub mod budget;
pub mod chat;
pub mod compact;
pub mod config;
pub mod contract;
pub mod control;
pub mod env;
pub mod fence;
pub mod gate;
pub mod http;
pub mod journal;
pub mod machine;
pub mod mcp;
pub mod model;
pub mod mux;
pub mod record;
pub mod retry;
pub mod runner;
pub mod scheduler;
pub mod scripted;
pub mod subagent;
pub mod view;
