//! estop-sim: the harnesses that prove the gate's guarantees on the code that ships.
//!
//! * [`world`] — the small world (runs, keys, tools, principals) and its operations.
//! * [`model`] — an independent reference model written from SPEC and docs/PROTOCOL.md.
//! * [`diff`] — differential conformance of kernel and model over seeded random traces.
//! * [`check`] — a bounded, exhaustive model checker of the kernel with trace properties
//!   (G1–G5) and crash + recovery through the real ledger.
//! * [`shipped`] — the shipped path (the daemon's core, committer and reply release) driven on
//!   one thread under power loss and disk faults, with an auditor of everything acknowledged.
//!
//! docs/TESTING.md says what each proves and how to run the long modes.

#[cfg(feature = "server")]
pub mod check;
pub mod diff;
pub mod model;
pub mod rng;
#[cfg(feature = "server")]
pub mod shipped;
pub mod world;
