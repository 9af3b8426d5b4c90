//! Services served next to the protocol listeners (the HTTP console): `estop serve` starts each
//! one before its ready line, hands it the shared state, and stops it at shutdown. This crate
//! knows nothing of HTTP: the `estop` binary plugs the console in (`serve::run_with`).

use crate::shared::Shared;
use estop_ledger::SyncStats;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

/// What a service is handed when it starts.
#[derive(Debug, Clone)]
pub struct ServiceContext {
    /// The core's queue, tokens, policy and durability watch: the same ones protocol v1 uses.
    pub shared: Arc<Shared>,
    /// The daemon's data directory (canonical).
    pub data: PathBuf,
    /// Protocol v1 connection slots (Unix socket and TCP): `open()` says how many are open.
    pub connections: Arc<crate::quota::ConnectionSlots>,
    pub connections_max: usize,
    /// Group-commit latency and batch sizes of the ledger.
    pub sync_stats: Arc<SyncStats>,
}

/// A started service.
pub struct Started {
    /// `key=value` pairs for the ready line (e.g. `console=127.0.0.1:7421`).
    pub ready: Vec<(String, String)>,
    /// Lines printed on stdout after the ready line (e.g. a one-time login link).
    pub notices: Vec<String>,
    /// Serves until the daemon stops (it is aborted then).
    pub task: Pin<Box<dyn Future<Output = ()> + Send>>,
}

/// Something `estop serve` runs beside its listeners.
pub trait Service: Send {
    /// Binds (called inside the runtime, before the ready line) and returns what to announce
    /// and the task that serves. An error stops `estop serve` from starting.
    fn start(self: Box<Self>, ctx: ServiceContext) -> Result<Started, String>;
}
