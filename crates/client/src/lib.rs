//! estop's one client of protocol v1 (docs/PROTOCOL.md). Every edge — the harness, the MCP
//! gateway, the egress proxy and its executor, `estop run`'s supervisor, the CLI — talks to
//! the gate through this crate:
//!
//! * [`session::Session`]: the protocol as data (ids, replies matched to requests, events,
//!   refusals without an id, local bounds, what a new connection must say again);
//! * [`connection::Connection`]: the tokio driver, which survives the gate (reconnects with
//!   backoff and jitter, says hello again, re-subscribes, re-parks waits);
//! * [`blocking::Client`]: the blocking driver for one short connection (the CLI, tests);
//! * [`Admission`]: what an `admit` (or `wait`, `start`) came to, as one typed outcome.

pub mod admission;
pub mod blocking;
pub mod connection;
pub mod error;
pub mod session;

pub use admission::Admission;
pub use blocking::Client;
pub use connection::{Backoff, Connection, Notice, Options};
pub use error::ClientError;
pub use session::{Limits, Received, Session};

/// Whether `target` names a Unix socket (a path) rather than `host:port`.
pub fn is_socket_path(target: &str) -> bool {
    target.contains('/') || std::path::Path::new(target).exists()
}
