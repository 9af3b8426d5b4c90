//! What the core asks its shell to do. The core decides and never does IO itself: each input
//! (`Core::handle`, `Core::fire_timers`, `Core::commit`, and the outcomes the shell reports back)
//! queues actions, and the shell (`core::shell::Shell`, the one executor, used by the daemon's
//! core thread and by the simulation alike) takes them in order with `Core::poll_action` and
//! carries them out. The queue and the bytes of the records it appends are reused from one
//! message to the next: in steady state queueing an action allocates nothing.

use super::{Answer, ReplyTo};
use crate::durable::After;
use crate::observe::{FeedEvent, FeedTx, GateStats};
use crate::outbox::Outbox;
use estop_kernel::{Record, RunId};
use estop_protocol::server_line as wire;
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

/// One thing for the shell to do. In the order they are queued: a reply is queued after the
/// append of the record it depends on, and is tagged with that record's seq.
#[derive(Debug)]
pub enum Action {
    /// Append the record whose bytes are `Core::record(&bytes)`. The ledger numbers records one
    /// by one from the last it recovered, so the core knows the seq it will get: `seq`. An
    /// append that fails is reported with `Core::append_failed`.
    Append { seq: u64, bytes: Range<usize> },
    /// Start syncing everything appended; `inline`: on the shell's thread, now (a light burst
    /// while the sync thread is idle, see `Core::commit`).
    Commit { inline: bool },
    /// Answer a request once `after` is durable (`durable::Release`).
    Reply {
        to: ReplyTo,
        answer: Answer,
        after: After,
    },
    /// Send connection `conn`'s subscription of `run` an event once `after` is durable — unless
    /// the connection is gone or has `event_backlog_max` events unwritten (`backlog`, which the
    /// writer counts down): that is reported with `Core::subscriber_gone`.
    Event {
        run: RunId,
        conn: u64,
        out: Outbox,
        backlog: Arc<AtomicUsize>,
        event: wire::Event,
        after: After,
    },
    /// Offer an event to one of the console's feeds; a feed that is full or gone is reported
    /// with `Core::feed_gone`.
    Feed { tx: FeedTx, event: FeedEvent },
    /// Write a snapshot (`bytes`) covering records `1..=seq`; the outcome is reported with
    /// `Core::snapshot_done` or `Core::snapshot_failed`.
    Snapshot { seq: u64, bytes: Vec<u8> },
    /// The ledger failed (fail closed): stop writing to it; nothing past its durable seq is
    /// acknowledged — replies waiting for such a record are answered `unavailable`.
    FailLedger,
    /// Reopen the ledger, dropping every record past the durable one, and rebuild the gate
    /// from it; reported with `Core::reopened` when the ledger opened.
    Recover,
    /// Hand the counters to `/metrics`.
    Stats {
        reply: tokio::sync::oneshot::Sender<GateStats>,
        stats: Box<GateStats>,
    },
    /// Make everything appended durable (shutdown).
    Flush,
    /// Shutdown is complete: tell whoever asked for it.
    Stopped { done: std::sync::mpsc::Sender<()> },
}

/// The core's queue of actions, and the encoded records its appends refer to.
#[derive(Debug, Default)]
pub(super) struct Actions {
    queue: VecDeque<Action>,
    records: Vec<u8>,
}

impl Actions {
    pub(super) fn push(&mut self, action: Action) {
        self.queue.push_back(action);
    }

    /// Encodes `record` after the others of this round and queues its append.
    pub(super) fn append(&mut self, seq: u64, record: &Record) {
        let start = self.records.len();
        estop_kernel::record_codec::encode_record(record, &mut self.records);
        self.push(Action::Append {
            seq,
            bytes: start..self.records.len(),
        });
    }

    /// The oldest action. Once none is left the records' bytes are dropped too (the shell has
    /// appended them all); their buffer is kept for the next round.
    pub(super) fn pop(&mut self) -> Option<Action> {
        let next = self.queue.pop_front();
        if next.is_none() {
            self.records.clear();
        }
        next
    }

    pub(super) fn record(&self, bytes: &Range<usize>) -> &[u8] {
        &self.records[bytes.clone()]
    }
}
