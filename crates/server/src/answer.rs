//! What the core hands back to a connection, and the one v1 rendering of it: the reply payload
//! (`Answer`), the item a connection's writer holds until its ledger position is durable
//! (`Out`, `After`), and the request's share of its connection's input bound (`Charge`). A leaf:
//! the core, the release queue, the outboxes and the connections all build on it.

use estop_protocol::server_line::{self as wire, error_line, ok_line, pong_line};
use estop_protocol::{ErrorCode, Id};
use std::sync::Arc;
use tokio::sync::Semaphore;

/// Where a reply must wait: the ledger generation and sequence number it depends on.
/// A generation ends when the ledger fails; records of it past its last durable seq are lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct After {
    pub generation: u64,
    pub seq: u64,
}

/// Something to write to a client once `after` is durable.
#[derive(Debug)]
pub enum Out {
    Answer {
        id: Id,
        answer: Answer,
        after: After,
    },
    Event {
        event: wire::Event,
        after: After,
    },
    /// The rest of a durable reply that [`Outbox::release`] could not write whole: written as
    /// it is, before anything behind it.
    Rendered(Vec<u8>),
}

/// A reply payload, rendered by the connection in its own protocol.
#[derive(Debug, Clone)]
pub enum Answer {
    Verdict(wire::VerdictReply),
    Ack(wire::Ack),
    Subscribed(Box<wire::SubscribeReply>),
    Decided(wire::DecideReply),
    Run(Box<wire::RunView>),
    Runs(wire::RunsReply),
    Pending(wire::PendingReply),
    Report(Box<wire::Report>),
    Ledger(wire::LedgerReply),
    Hello(wire::HelloReply),
    TokenCreated(wire::TokenCreated),
    TokenRevoked(wire::TokenRevoked),
    Pong,
    Error(ErrorCode, String),
}

/// The answer to a change the ledger could not make durable.
pub fn unavailable() -> Answer {
    Answer::Error(
        ErrorCode::Unavailable,
        "the ledger cannot make changes durable right now (see the daemon's log); the change is not acknowledged, retry later with the same key".into(),
    )
}

/// Renders an answer in protocol v1.
pub fn render(id: &Id, answer: &Answer) -> Vec<u8> {
    match answer {
        Answer::Verdict(v) => ok_line(id, v),
        Answer::Ack(a) => ok_line(id, a),
        Answer::Subscribed(a) => ok_line(id, a),
        Answer::Decided(d) => ok_line(id, d),
        Answer::Run(r) => ok_line(id, r),
        Answer::Runs(r) => ok_line(id, r),
        Answer::Pending(p) => ok_line(id, p),
        Answer::Report(r) => ok_line(id, r),
        Answer::Ledger(l) => ok_line(id, l),
        Answer::Hello(h) => ok_line(id, h),
        Answer::TokenCreated(t) => ok_line(id, t),
        Answer::TokenRevoked(t) => ok_line(id, t),
        Answer::Pong => pong_line(id),
        Answer::Error(code, msg) => error_line(id, *code, msg),
    }
}

/// Bytes of a request line counted against its connection's `inflight_bytes_max` until the
/// request is answered (dropped).
#[derive(Debug)]
pub struct Charge {
    inflight: Arc<Semaphore>,
    bytes: u32,
    /// For a listing: its place among the connection's listings in flight.
    pub(crate) listing: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Charge {
    /// Waits until `bytes` more fit in the connection's `bound` (a line larger than the whole
    /// bound waits until nothing else is in flight); `None` if the connection is closing.
    pub async fn acquire(inflight: &Arc<Semaphore>, bound: usize, bytes: usize) -> Option<Charge> {
        let bytes = u32::try_from(bytes.min(bound)).unwrap_or(u32::MAX);
        // Without waiting when the bytes fit, as they nearly always do: no `Acquire` future per
        // request.
        match inflight.try_acquire_many(bytes) {
            Ok(p) => p.forget(),
            Err(tokio::sync::TryAcquireError::NoPermits) => {
                inflight.acquire_many(bytes).await.ok()?.forget();
            }
            Err(tokio::sync::TryAcquireError::Closed) => return None,
        }
        Some(Charge {
            inflight: Arc::clone(inflight),
            bytes,
            listing: None,
        })
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.inflight.add_permits(self.bytes as usize);
    }
}
