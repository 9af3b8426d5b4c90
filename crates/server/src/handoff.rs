//! The way into the core, and batched hand-off from the IO thread.
//!
//! The core is faster than the IO thread that parses requests, so under load it often empties
//! its queue and sleeps between requests; each time, the next request costs the IO thread a futex
//! wake and the core a wakeup. On the single IO thread, [`CoreTx::send`] therefore queues the message on the thread; the
//! queue goes to the core in one go when the thread is about to wait for IO ([`flush`], the
//! runtime's park hook) or holds [`BATCH_MAX`] messages. Requests that arrive together wake the
//! core once, and a lone request is handed over as soon as the IO thread has nothing else to do.
//! Messages of one connection keep their order: one thread queues them, first in, first out.
//! Any other thread (a multi-threaded runtime, blocking tasks, the ledger's sync thread) sends
//! straight away.

use crate::core::{Answer, CoreMsg, Out};
use crate::durable::After;
use std::cell::RefCell;
use std::sync::mpsc;

/// The most messages the IO thread holds before handing them to the core even while it is
/// busy: bounds the wait a request adds to a burst (a few µs of parsing each).
pub const BATCH_MAX: usize = 16;

/// The core has stopped (the daemon is shutting down).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoreGone;

/// A sender to the core.
#[derive(Debug, Clone)]
pub struct CoreTx {
    tx: mpsc::Sender<CoreMsg>,
}

struct Batch {
    tx: mpsc::Sender<CoreMsg>,
    msgs: Vec<CoreMsg>,
}

impl Drop for Batch {
    /// A batching thread that ends hands over what it still holds.
    fn drop(&mut self) {
        hand_over(self);
    }
}

thread_local! {
    static BATCH: RefCell<Option<Batch>> = const { RefCell::new(None) };
}

impl From<mpsc::Sender<CoreMsg>> for CoreTx {
    fn from(tx: mpsc::Sender<CoreMsg>) -> CoreTx {
        CoreTx { tx }
    }
}

impl CoreTx {
    /// Sends `msg` to the core: queued on a batching thread (see the module documentation),
    /// else sent at once. An error means the core has stopped; a batched message that finds
    /// the core stopped when its batch goes is answered `unavailable` instead.
    pub fn send(&self, msg: CoreMsg) -> Result<(), CoreGone> {
        let msg = BATCH.with_borrow_mut(|b| match b {
            Some(b) => {
                b.msgs.push(msg);
                if b.msgs.len() >= BATCH_MAX {
                    hand_over(b);
                }
                None
            }
            None => Some(msg),
        });
        match msg {
            Some(m) => self.tx.send(m).map_err(|_| CoreGone),
            None => Ok(()),
        }
    }

    /// Makes the calling thread batch what it sends to the core until [`flush`] runs. The
    /// thread must call [`flush`] before it waits for anything (the runtime's park hook).
    pub fn batch_on_this_thread(&self) {
        BATCH.set(Some(Batch {
            tx: self.tx.clone(),
            msgs: Vec::with_capacity(BATCH_MAX),
        }));
    }
}

/// Hands over what the calling thread holds and stops batching on it.
pub fn end_batching() {
    flush();
    BATCH.set(None);
}

/// Hands the calling thread's queued messages to the core. Runs from the IO runtime's park hook;
/// does nothing on a thread that does not batch.
pub fn flush() {
    BATCH.with_borrow_mut(|b| {
        if let Some(b) = b {
            hand_over(b);
        }
    });
}

fn hand_over(b: &mut Batch) {
    for msg in b.msgs.drain(..) {
        if let Err(mpsc::SendError(msg)) = b.tx.send(msg) {
            refuse(msg);
        }
    }
}

/// Answers a message the stopped core will never see.
fn refuse(msg: CoreMsg) {
    let to = match msg {
        CoreMsg::Apply { to, .. }
        | CoreMsg::Wait { to, .. }
        | CoreMsg::Subscribe { to, .. }
        | CoreMsg::Executor { to, .. }
        | CoreMsg::Query { to, .. }
        | CoreMsg::SgStop { to, .. }
        | CoreMsg::SgDecide { to, .. } => to,
        // The rest answer through channels of their own, which dropping them closes, or
        // answer nobody.
        CoreMsg::Unsubscribe { .. }
        | CoreMsg::Disconnect { .. }
        | CoreMsg::Feed { .. }
        | CoreMsg::Stats { .. }
        | CoreMsg::LedgerFailed
        | CoreMsg::CatchUp
        | CoreMsg::Shutdown { .. } => return,
    };
    to.out.release(Out::Answer {
        id: to.id,
        answer: Answer::Error(
            estop_protocol::ErrorCode::Unavailable,
            "the gate is shutting down".into(),
        ),
        after: After::default(),
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::ReplyTo;
    use estop_protocol::Id;

    fn query(out: &tokio::sync::mpsc::UnboundedSender<Out>, n: u64) -> CoreMsg {
        CoreMsg::Query {
            principal: estop_kernel::Principal {
                name: estop_kernel::PrincipalName::new("agent").unwrap(),
                role: estop_kernel::Role::Agent,
                groups: Vec::new(),
                part: Default::default(),
            },
            query: crate::core::Query::Pending {
                run: None,
                cursor: None,
                page: estop_protocol::PageBudget::new(10, 1 << 20),
            },
            to: ReplyTo {
                out: out.clone().into(),
                id: Id::from_u64(n),
                charge: None,
            },
        }
    }

    fn id(msg: CoreMsg) -> String {
        match msg {
            CoreMsg::Query { to, .. } => to.id.to_string(),
            _ => panic!("not a query"),
        }
    }

    #[test]
    fn a_batching_thread_hands_over_at_flush_or_when_full_in_order() {
        let (tx, rx) = mpsc::channel();
        let (out, _out_rx) = tokio::sync::mpsc::unbounded_channel();
        let core = CoreTx::from(tx);
        // A thread that does not batch sends at once.
        core.send(query(&out, 0)).unwrap();
        assert_eq!(rx.try_iter().map(id).collect::<Vec<_>>(), ["0"]);
        // A batching thread that ends hands over what it held. (Joined, not scoped: a scope
        // may return before the thread's thread-locals are dropped, which is when it hands
        // over; `join` waits for the thread to exit.)
        let (thread_core, thread_out) = (core.clone(), out.clone());
        std::thread::spawn(move || {
            thread_core.batch_on_this_thread();
            thread_core.send(query(&thread_out, 1)).unwrap();
            thread_core.send(query(&thread_out, 2)).unwrap();
        })
        .join()
        .unwrap();
        assert_eq!(rx.try_iter().map(id).collect::<Vec<_>>(), ["1", "2"]);

        let (tx, rx) = mpsc::channel();
        let core = CoreTx::from(tx);
        core.batch_on_this_thread();
        for n in 1..=3 {
            core.send(query(&out, n)).unwrap();
        }
        assert!(rx.try_recv().is_err(), "held until the flush");
        flush();
        assert_eq!(rx.try_iter().map(id).collect::<Vec<_>>(), ["1", "2", "3"]);
        for n in 0..BATCH_MAX as u64 {
            core.send(query(&out, n)).unwrap();
        }
        let ids: Vec<String> = rx.try_iter().map(id).collect();
        let expected: Vec<String> = (0..BATCH_MAX as u64).map(|n| n.to_string()).collect();
        assert_eq!(ids, expected, "a full batch goes without a flush");
        end_batching();
    }

    #[test]
    fn a_batched_message_the_stopped_core_never_sees_is_answered_unavailable() {
        let (tx, rx) = mpsc::channel();
        let (out, mut out_rx) = tokio::sync::mpsc::unbounded_channel();
        let core = CoreTx::from(tx);
        core.batch_on_this_thread();
        core.send(query(&out, 7)).unwrap();
        drop(rx);
        flush();
        match out_rx.try_recv() {
            Ok(Out::Answer {
                id,
                answer: Answer::Error(code, _),
                ..
            }) => {
                assert_eq!(id, Id::from_u64(7));
                assert_eq!(code, estop_protocol::ErrorCode::Unavailable);
            }
            other => panic!("expected unavailable, got {other:?}"),
        }
        assert_eq!(core.send(query(&out, 8)), Ok(()), "queued until the flush");
        end_batching();
        assert_eq!(core.send(query(&out, 9)), Err(CoreGone));
    }
}
