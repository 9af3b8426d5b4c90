//! estop-sim: the harnesses that prove the gate's guarantees on the code that ships.
//!
//! * [`world`] — the small world (runs, keys, tools, principals) and its operations.
//! * [`model`] — an independent reference model written from SPEC and docs/PROTOCOL.md.
//! * [`diff`] — differential conformance of kernel and model over seeded random traces.
//! * [`check`] — a bounded, exhaustive model checker of the kernel with trace properties
//!   (P1–P10) and crash + recovery through the real ledger.
//! * [`pgdiff`] — the same differential with every record committed to PostgreSQL by the
//!   store's code and the gate rebuilt from the database (a node starting, another catching up).
//! * [`shipped`] — the simulation: the shipped path (the daemon's core, committer, reply
//!   release and recovery) driven on one thread under power loss, kills at every disk
//!   operation and disk faults, with an auditor of the history and of everything acknowledged.
//!
//! docs/TESTING.md says what each proves and how to run the long modes; docs/SIMULATION.md
//! describes the simulation.

#[cfg(feature = "server")]
pub mod check;
pub mod diff;
pub mod model;
#[cfg(feature = "server")]
pub mod pgdiff;
pub mod rng;
#[cfg(feature = "server")]
pub mod shipped;
pub mod world;
