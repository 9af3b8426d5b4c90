//! estop server: the imperative shell around the pure kernel. A single core thread owns the
//! state (no lock on the hot path); connections parse, authenticate and evaluate policy in
//! parallel; the ledger's sync thread group-commits; replies leave only once durable.

pub mod answer;
pub mod client;
pub mod clock;
pub mod conn;
pub mod core;
pub mod describe;
pub mod dispatch;
pub mod durable;
pub mod fatal;
pub mod handoff;
pub mod journal;
pub mod log;
pub mod observe;
pub mod outbox;
pub mod pgconn;
pub mod pgnode;
pub mod pgstore;
pub mod pgtls;
pub mod quota;
pub mod render;
pub mod seal;
pub mod serve;
pub mod service;
pub mod shared;
pub mod soundgate;
pub mod storemove;
pub mod tokenops;
pub mod tokens;
pub mod uds;

pub use serve::{Ready, ServeError, ServeOptions, run, run_with};
