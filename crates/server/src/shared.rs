//! What every connection shares (`Shared`: the core's queue, tokens, policy, the durable
//! watch, the listeners' bounds) and the two ways to reach the core from a front door (`send`,
//! `ask`). Below `conn`, `dispatch`, `tokenops` and `soundgate`, which all build on it.

use crate::answer::{Answer, Out};
use crate::core::{CoreMsg, ReplyTo};
use crate::durable::{self, Durability, DurableState};
use crate::tokens::Tokens;
use estop_policy::Policy;
use estop_protocol::page::{PAGE_BYTES_MAX_DEFAULT, PAGE_ITEMS_DEFAULT, PAGE_ITEMS_MAX};
use estop_protocol::{ErrorCode, Id, PageBudget};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::watch;

/// Bounds of the daemon's listeners.
#[derive(Debug, Clone)]
pub struct ConnOptions {
    pub line_bytes_max: usize,
    /// Requests one connection may have in flight (pipelining depth, waits included).
    pub outstanding_per_connection_max: usize,
    /// Bytes of request lines one connection may have handed to the core and not had answered
    /// yet (a line longer than this is let through alone): pipelining is bounded by bytes as
    /// well as by count.
    pub inflight_bytes_max: usize,
    /// Bytes of replies and events one connection's writer may hold unwritten: its next
    /// request is read only below a quarter of it (a client that asks and does not read stops
    /// being read), and what it is sent anyway past it closes the connection (`outbox`).
    pub output_bytes_max: usize,
    /// Longest `wait` a client may ask for.
    pub wait_ms_max: u64,
    /// A connection that has not authenticated this long after its accept is closed.
    pub hello_ms_max: u64,
    /// A connection with nothing in flight and no subscription that sends nothing for this long
    /// is closed (clients reconnect when they need the gate again).
    pub idle_ms_max: u64,
    /// Most items one page of a listing (`runs`, `pending`, `report`, `ledger`) holds.
    pub page_items_max: usize,
    /// A page of a listing ends once its items reach this many bytes as rendered.
    pub page_bytes_max: usize,
}

impl Default for ConnOptions {
    fn default() -> Self {
        ConnOptions {
            line_bytes_max: estop_protocol::limits::LINE_BYTES_MAX_DEFAULT,
            outstanding_per_connection_max: 1024,
            inflight_bytes_max: 4 << 20,
            output_bytes_max: 4 << 20,
            wait_ms_max: 15 * 60 * 1000,
            hello_ms_max: 10_000,
            idle_ms_max: 10 * 60 * 1000,
            page_items_max: PAGE_ITEMS_MAX,
            page_bytes_max: PAGE_BYTES_MAX_DEFAULT,
        }
    }
}

impl ConnOptions {
    /// The budget of one page of a listing that asked for `limit` items.
    pub fn page(&self, limit: Option<u32>) -> PageBudget {
        let limit = limit.map_or(PAGE_ITEMS_DEFAULT, |l| l as usize);
        PageBudget::new(limit.min(self.page_items_max), self.page_bytes_max)
    }
}

/// What every connection shares.
#[derive(Debug)]
pub struct Shared {
    pub core_tx: crate::handoff::CoreTx,
    pub tokens: Arc<Tokens>,
    pub policy: Arc<Policy>,
    pub durable_rx: watch::Receiver<DurableState>,
    pub opts: ConnOptions,
    pub ledger_dir: PathBuf,
    /// The PostgreSQL store, when the records live there rather than in `ledger_dir`.
    pub store: Option<crate::pgstore::Target>,
    pub next_conn: AtomicU64,
    /// Opens the admission tokens `start` and `complete` present (the core's seal, the same key).
    pub seal: estop_protocol::effect_token::TokenSeal,
}

pub fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn err(code: ErrorCode, msg: impl Into<String>) -> Answer {
    Answer::Error(code, msg.into())
}

fn shutting_down() -> Answer {
    err(ErrorCode::Unavailable, "the gate is shutting down")
}

/// Sends `msg` to the core, whose answer goes where the message says; `Some` is the answer
/// when the core has stopped.
pub fn send(shared: &Shared, msg: CoreMsg) -> Option<Answer> {
    shared.core_tx.send(msg).err().map(|_| shutting_down())
}

/// Sends one message to the core and waits for its answer, then for the ledger position it
/// depends on to be durable (G6), exactly as a v1 connection's writer does.
pub async fn ask(shared: &Shared, msg: impl FnOnce(ReplyTo) -> CoreMsg) -> Answer {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let to = ReplyTo {
        out: tx.into(),
        id: Id::default(),
        charge: None,
    };
    if let Some(answer) = send(shared, msg(to)) {
        return answer;
    }
    loop {
        match rx.recv().await {
            Some(Out::Answer { answer, after, .. }) => {
                let mut durable_rx = shared.durable_rx.clone();
                return match durable::wait(&mut durable_rx, after).await {
                    Durability::Durable => answer,
                    Durability::Lost => err(
                        ErrorCode::Unavailable,
                        "the change could not be made durable (ledger failure); it was not applied — retry",
                    ),
                };
            }
            // Events are not asked for here; rendered bytes go only to a socket's writer.
            Some(Out::Event { .. } | Out::Rendered(_)) => {}
            None => return shutting_down(),
        }
    }
}
