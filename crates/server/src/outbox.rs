//! A connection's outgoing queue, and the straight path around it.
//!
//! Everything a connection is owed goes to its writer task through one channel, in order. A
//! reply that is durable already can skip the writer: [`Outbox::release`] renders it and writes
//! it to the socket on the thread that learned it is durable — the ledger's sync thread, or the
//! core after an inline commit — so no reply wakes the IO thread only to be written there. Order
//! is kept by one count per connection: items handed to the writer and not yet written. Only
//! when it is zero, under the same lock that every hand-over takes, may a reply go straight to
//! the socket; anything it could not write whole goes to the writer next. Writes never block: a
//! full socket sends the rest to the writer, which waits for the client to read.
//!
//! What the writer holds is bounded by bytes ([`Unwritten`]). A connection's requests are paced
//! by it: its next request is read only while less than a quarter of `output_bytes_max` is
//! unwritten, so a client that asks and does not read stops being read. What arrives anyway
//! (events, replies to requests already in flight) past `output_bytes_max` closes the
//! connection, rather than growing the daemon's memory.

use crate::answer::{Answer, Out};
use estop_protocol::page::{Weight, value_weight};
use estop_protocol::{Id, server_line as wire};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use tokio::sync::Semaphore;
use tokio::sync::mpsc::UnboundedSender;

/// A connection's outgoing queue. Unbounded in type, bounded in use: each connection may have at
/// most `outstanding_per_connection_max` requests in flight, and its writer may hold at most
/// `output_bytes_max` bytes it has not written ([`Unwritten`]).
#[derive(Debug, Clone)]
pub struct Outbox {
    tx: UnboundedSender<Out>,
    direct: Option<Arc<Direct>>,
    unwritten: Option<Arc<Unwritten>>,
}

/// The bytes a connection's writer holds and has not written, against the connection's bound.
/// Past the bound the connection is closed: its reader and writer stop, the client sees the
/// socket close, and the core forgets its waits and subscriptions (`CoreMsg::Disconnect`).
#[derive(Debug)]
pub struct Unwritten {
    /// Everything unwritten: what the connection's reader is paced by.
    bytes: AtomicUsize,
    /// Of which pages of listings.
    pages: AtomicUsize,
    max: usize,
    conn: u64,
    /// Closed (never acquired) once the bound is crossed: a one-shot signal any task can await.
    over: Semaphore,
    /// Woken when the writer has written something: a paced reader looks again.
    drained: tokio::sync::Notify,
}

impl Unwritten {
    pub fn new(conn: u64, max: usize) -> Arc<Unwritten> {
        Arc::new(Unwritten {
            bytes: AtomicUsize::new(0),
            pages: AtomicUsize::new(0),
            max,
            conn,
            over: Semaphore::new(0),
            drained: tokio::sync::Notify::new(),
        })
    }

    /// Below this, a connection's next request may be read.
    fn pace_bytes(&self) -> usize {
        self.max / 4
    }

    /// Returns once less than a quarter of the bound is unwritten (or the bound was crossed):
    /// the connection's reader waits here before it reads the next request.
    pub async fn paced(&self) {
        loop {
            // The common case first, without taking the `Notify`'s lock: a `notified()` enabled
            // and dropped for every request costs the IO threads more than the request's parse.
            if self.below_pace() {
                return;
            }
            let drained = self.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            // Written between the check above and `enable`: the wake may have been missed.
            if self.below_pace() {
                return;
            }
            drained.await;
        }
    }

    fn below_pace(&self) -> bool {
        self.bytes.load(Ordering::Acquire) < self.pace_bytes() || self.is_over()
    }

    /// Counts `n` more bytes handed to the writer (`page`: a page of a listing); `false` when
    /// that puts the connection past its bound. Pages count for pacing but never cut a client
    /// off: the connection has one listing in flight at most and reads its next request only
    /// once it has read most of what it was sent, so they are bounded already. Anything else is
    /// taken while nothing else is unwritten, whatever its size (the bound is on falling
    /// behind, not on the size of one reply), and within the bound otherwise.
    fn charge(&self, n: usize, page: bool) -> bool {
        if self.over.is_closed() {
            return false;
        }
        let before = self.bytes.fetch_add(n, Ordering::AcqRel);
        if page {
            self.pages.fetch_add(n, Ordering::AcqRel);
            return true;
        }
        let before = before.saturating_sub(self.pages.load(Ordering::Acquire));
        if before > 0 && before + n > self.max {
            self.bytes.fetch_sub(n, Ordering::AcqRel);
            crate::log::warn(&format!(
                "connection {}: closed, the client is not reading its replies ({} bytes unwritten, {n} more due; output_bytes_max = {})",
                self.conn, before, self.max
            ));
            self.over.close();
            return false;
        }
        true
    }

    /// The writer wrote (or dropped) items worth `n` bytes, `pages` of them pages of listings.
    pub fn written(&self, n: usize, pages: usize) {
        self.pages.fetch_sub(pages, Ordering::AcqRel);
        let before = self.bytes.fetch_sub(n, Ordering::AcqRel);
        if before >= self.pace_bytes() && before - n < self.pace_bytes() {
            self.drained.notify_waiters();
        }
    }

    pub fn is_over(&self) -> bool {
        self.over.is_closed()
    }

    /// Returns once the connection has crossed its bound.
    pub async fn crossed(&self) {
        // Never acquired: `acquire` fails exactly when the semaphore is closed.
        let _ = self.over.acquire().await;
    }
}

/// Whether `item` is a page of a listing (see [`Unwritten::charge`]).
pub fn is_page(item: &Out) -> bool {
    matches!(
        item,
        Out::Answer {
            answer: Answer::Runs(_) | Answer::Pending(_) | Answer::Report(_) | Answer::Ledger(_),
            ..
        }
    )
}

/// About the bytes `item` renders to (see [`Weight`]): what [`Unwritten`] counts.
pub fn weight(item: &Out) -> usize {
    match item {
        Out::Answer { answer, .. } => answer_weight(answer),
        Out::Event { event, .. } => event.weight(),
        Out::Rendered(line) => line.len(),
    }
}

fn answer_weight(answer: &Answer) -> usize {
    fn sum<T: Weight>(items: &[T]) -> usize {
        items.iter().map(Weight::weight).sum()
    }
    const SMALL: usize = 256;
    match answer {
        Answer::Verdict(wire::VerdictReply::Duplicate { result, error, .. }) => {
            SMALL + result.as_ref().map_or(0, value_weight) + error.as_ref().map_or(0, String::len)
        }
        Answer::Ack(a) => SMALL + a.runs.iter().map(|r| r.len() + 4).sum::<usize>(),
        Answer::Error(_, message) => SMALL + message.len(),
        Answer::Verdict(_)
        | Answer::Decided(_)
        | Answer::Hello(_)
        | Answer::TokenCreated(_)
        | Answer::TokenRevoked(_)
        | Answer::Pong => SMALL,
        Answer::Run(r) => r.weight(),
        Answer::Subscribed(s) => {
            SMALL
                + s.replay.as_ref().map_or(0, |r| {
                    sum(&r.awaiting) + r.reason.as_ref().map_or(0, String::len)
                })
        }
        Answer::Runs(r) => SMALL + sum(&r.runs),
        Answer::Pending(p) => SMALL + sum(&p.pending),
        Answer::Report(r) => {
            let lists = [
                &r.done,
                &r.failed,
                &r.refused,
                &r.in_flight,
                &r.unknown,
                &r.compensable,
                &r.irreversible,
                &r.undeclared,
                &r.held,
            ];
            SMALL + lists.into_iter().map(|l| sum(l)).sum::<usize>()
        }
        Answer::Ledger(l) => SMALL + sum(&l.entries),
    }
}

/// The connection's writer is gone (the client went away); the item was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Closed;

/// The socket a connection's durable replies may be written to straight, and what writing one
/// needs.
#[derive(Debug)]
pub struct Direct {
    /// A duplicate of the connection's (non-blocking) socket descriptor.
    socket: OwnedFd,
    render: fn(&Id, &Answer) -> Vec<u8>,
    /// The connection's pipelining permits: a reply written gives its request's back.
    permits: Arc<Semaphore>,
    /// Items handed to the writer and not yet written to the socket.
    ahead: Mutex<usize>,
}

impl Direct {
    pub fn new(
        socket: OwnedFd,
        render: fn(&Id, &Answer) -> Vec<u8>,
        permits: Arc<Semaphore>,
    ) -> Arc<Direct> {
        Arc::new(Direct {
            socket,
            render,
            permits,
            ahead: Mutex::new(0),
        })
    }

    fn lock(&self) -> MutexGuard<'_, usize> {
        self.ahead.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The writer wrote `items` of what it was handed.
    pub fn written(&self, items: usize) {
        let mut ahead = self.lock();
        debug_assert!(
            *ahead >= items,
            "the writer wrote more items than it was handed"
        );
        *ahead = ahead.saturating_sub(items);
    }
}

impl From<UnboundedSender<Out>> for Outbox {
    /// An outbox whose every item goes through the channel (no socket to write to straight),
    /// without a byte bound: for one answer awaited in place (the console's requests).
    fn from(tx: UnboundedSender<Out>) -> Outbox {
        Outbox {
            tx,
            direct: None,
            unwritten: None,
        }
    }
}

impl Outbox {
    pub fn new(
        tx: UnboundedSender<Out>,
        direct: Option<Arc<Direct>>,
        unwritten: Option<Arc<Unwritten>>,
    ) -> Outbox {
        Outbox {
            tx,
            direct,
            unwritten,
        }
    }

    /// Hands `item` to the connection's writer, behind everything handed to it before.
    pub fn send(&self, item: Out) -> Result<(), Closed> {
        match &self.direct {
            None => self.to_writer(item),
            Some(d) => {
                let mut ahead = d.lock();
                self.to_writer(item)?;
                *ahead += 1;
                Ok(())
            }
        }
    }

    /// Into the writer's channel, counted against the byte bound. Past it the item is dropped
    /// and the connection closed: the socket is shut down at once, so the client sees it and
    /// the connection's reader ends.
    fn to_writer(&self, item: Out) -> Result<(), Closed> {
        if let Some(u) = &self.unwritten
            && !u.charge(weight(&item), is_page(&item))
        {
            if let Some(d) = &self.direct {
                shutdown(&d.socket);
            }
            return Err(Closed);
        }
        self.tx.send(item).map_err(|_| Closed)
    }

    /// Delivers an item that is durable now: a short answer (a verdict, an acknowledgement, an
    /// error) is written straight to the socket when nothing is ahead of it; anything else goes
    /// to the writer, so a long listing is never rendered on the core or the sync thread.
    pub fn release(&self, item: Out) {
        let (Some(d), Out::Answer { id, answer, .. }) = (&self.direct, &item) else {
            let _ = self.send(item);
            return;
        };
        if !short(answer) {
            let _ = self.send(item);
            return;
        }
        let mut ahead = d.lock();
        if *ahead > 0 || self.is_closed() {
            if self.to_writer(item).is_ok() {
                *ahead += 1;
            }
            return;
        }
        let line = (d.render)(id, answer);
        match send_nowait(&d.socket, &line) {
            Ok(n) if n == line.len() => d.permits.add_permits(1),
            Ok(n) => {
                // The socket took part of it: the writer writes the rest, before anything else.
                if self.to_writer(Out::Rendered(line[n..].to_vec())).is_ok() {
                    *ahead += 1;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if self.to_writer(Out::Rendered(line)).is_ok() {
                    *ahead += 1;
                }
            }
            // The connection is gone: its reader sees that and closes it.
            Err(_) => {}
        }
    }

    /// The connection is gone, or is being closed for falling behind.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed() || self.unwritten.as_ref().is_some_and(|u| u.is_over())
    }
}

/// An answer whose rendering is bounded and small (at most a few hundred bytes).
fn short(answer: &Answer) -> bool {
    match answer {
        Answer::Verdict(_)
        | Answer::Ack(_)
        | Answer::Decided(_)
        | Answer::Hello(_)
        | Answer::TokenCreated(_)
        | Answer::TokenRevoked(_)
        | Answer::Pong
        | Answer::Error(..) => true,
        Answer::Run(_)
        | Answer::Subscribed(_)
        | Answer::Runs(_)
        | Answer::Pending(_)
        | Answer::Report(_)
        | Answer::Ledger(_) => false,
    }
}

/// Shuts a connection's socket down both ways: the client sees it closed at once (other
/// descriptors of it may live a little longer), and the connection's own reads and writes end.
#[allow(unsafe_code)]
fn shutdown(socket: &OwnedFd) {
    // SAFETY: `socket` is an open descriptor owned for the duration of the call; shutdown(2)
    // touches no memory of ours.
    unsafe {
        libc::shutdown(socket.as_raw_fd(), libc::SHUT_RDWR);
    }
}

/// One `send(2)` that neither blocks nor raises SIGPIPE.
#[allow(unsafe_code)]
fn send_nowait(socket: &OwnedFd, data: &[u8]) -> io::Result<usize> {
    loop {
        // SAFETY: `data` is a live, initialized buffer of `data.len()` bytes, and `socket` an
        // open descriptor owned for the duration of the call.
        let n = unsafe {
            libc::send(
                socket.as_raw_fd(),
                data.as_ptr().cast(),
                data.len(),
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::durable::{After, DurableState};
    use std::io::{BufRead, BufReader};
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;
    use tokio::sync::{mpsc, watch};

    fn answer(n: u64) -> Out {
        Out::Answer {
            id: Id::from_u64(n),
            answer: Answer::Pong,
            after: After::default(),
        }
    }

    fn id_of(line: &str) -> u64 {
        let v: serde_json::Value = serde_json::from_str(line).expect("a reply is JSON");
        v["id"].as_u64().expect("a numeric id")
    }

    #[test]
    fn a_durable_reply_with_nothing_ahead_goes_straight_to_the_socket() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let permits = Arc::new(Semaphore::new(0));
        let direct = Direct::new(
            ours.as_fd().try_clone_to_owned().unwrap(),
            crate::answer::render,
            Arc::clone(&permits),
        );
        let (tx, mut rx) = mpsc::unbounded_channel();
        let out = Outbox::new(tx, Some(Arc::clone(&direct)), None);

        out.release(answer(1));
        let mut lines = BufReader::new(theirs).lines();
        assert_eq!(id_of(&lines.next().unwrap().unwrap()), 1);
        assert!(rx.try_recv().is_err(), "the writer was not involved");
        assert_eq!(
            permits.available_permits(),
            1,
            "its request's permit is back"
        );

        // Behind an item the writer has not written, a durable reply waits its turn.
        out.send(answer(2)).unwrap();
        out.release(answer(3));
        assert!(matches!(rx.try_recv(), Ok(Out::Answer { id, .. }) if id == Id::from_u64(2)));
        assert!(matches!(rx.try_recv(), Ok(Out::Answer { id, .. }) if id == Id::from_u64(3)));
        direct.written(2);
        out.release(answer(4));
        assert_eq!(id_of(&lines.next().unwrap().unwrap()), 4);
        assert!(rx.try_recv().is_err());

        // A listing is rendered by the writer, never on the releasing thread.
        out.release(Out::Answer {
            id: Id::from_u64(5),
            answer: Answer::Runs(estop_protocol::server_line::RunsReply::default()),
            after: After::default(),
        });
        assert!(matches!(rx.try_recv(), Ok(Out::Answer { id, .. }) if id == Id::from_u64(5)));
    }

    /// Replies released from one thread (as the core does) and handed to the writer from the
    /// same thread, through a socket that fills because the client reads slowly: every reply
    /// arrives once, whole, in the order it was given.
    #[test]
    fn replies_keep_their_order_through_a_full_socket_and_the_writer() {
        const N: u64 = 40_000;
        let (ours, theirs) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let socket = ours.as_fd().try_clone_to_owned().unwrap();
        let permits = Arc::new(Semaphore::new(0));
        let direct = Direct::new(socket, crate::answer::render, Arc::clone(&permits));
        let (tx, rx) = mpsc::unbounded_channel();
        let out = Outbox::new(tx, Some(Arc::clone(&direct)), None);
        let (_durable_tx, durable_rx) = watch::channel(DurableState::default());

        let io = std::thread::spawn({
            let permits = Arc::clone(&permits);
            move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async move {
                    let conn = crate::uds::UnixConn::new(ours).unwrap();
                    crate::conn::write_loop(
                        conn,
                        rx,
                        durable_rx,
                        permits,
                        Arc::new(std::sync::atomic::AtomicUsize::new(0)),
                        crate::answer::render,
                        Some(direct),
                        None,
                    )
                    .await;
                });
            }
        });
        let client = std::thread::spawn(move || {
            let mut seen = Vec::new();
            for line in BufReader::new(theirs).lines() {
                seen.push(id_of(&line.unwrap()));
                if seen.len() % 4096 == 0 {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
            }
            seen
        });
        for n in 0..N {
            if n % 7 == 0 {
                out.send(answer(n)).unwrap();
            } else {
                out.release(answer(n));
            }
        }
        drop(out); // The writer drains what it holds, then closes the socket.
        io.join().unwrap();
        let seen = client.join().unwrap();
        assert_eq!(seen, (0..N).collect::<Vec<_>>());
        assert_eq!(permits.available_permits() as u64, N);
    }

    /// A client that does not read falls behind by more than its bound: the item that crosses
    /// it is dropped, the socket is shut down (the client sees it close), and the connection's
    /// tasks are told to stop. Within the bound, what the writer writes makes room again.
    #[test]
    fn a_connection_past_its_output_bound_is_closed() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let socket = ours.as_fd().try_clone_to_owned().unwrap();
        let permits = Arc::new(Semaphore::new(0));
        let direct = Direct::new(socket, crate::answer::render, permits);
        let (tx, mut rx) = mpsc::unbounded_channel();
        let unwritten = Unwritten::new(7, 1000);
        let out = Outbox::new(tx, Some(direct), Some(Arc::clone(&unwritten)));

        // One item is always taken while nothing else waits, whatever its size; written, it
        // makes room; then 1000 bytes in all at most.
        out.send(Out::Rendered(vec![b'x'; 5000])).unwrap();
        assert!(rx.try_recv().is_ok());
        unwritten.written(5000, 0);
        out.send(Out::Rendered(vec![b'y'; 900])).unwrap();
        out.send(Out::Rendered(vec![b'z'; 100])).unwrap();
        assert!(rx.try_recv().is_ok() && rx.try_recv().is_ok());
        assert!(!out.is_closed());
        // A page of a listing counts (the reader is paced by it) but never cuts a client off.
        let page = wire::PendingReply {
            pending: vec![wire::PendingItem {
                args: Some(wire::RawJson::new(
                    format!("\"{}\"", "a".repeat(5000)).into(),
                )),
                ..wire::PendingItem::default()
            }],
            ..wire::PendingReply::default()
        };
        let page = Out::Answer {
            id: Id::from_u64(8),
            answer: Answer::Pending(page),
            after: After::default(),
        };
        let w = weight(&page);
        out.send(page).unwrap();
        assert!(rx.try_recv().is_ok() && !out.is_closed());
        unwritten.written(w, w);

        assert_eq!(out.send(Out::Rendered(vec![b'w'; 1])), Err(Closed));
        assert!(
            rx.try_recv().is_err(),
            "the item past the bound was dropped"
        );
        assert!(out.is_closed() && unwritten.is_over());
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(unwritten.crossed()); // Returns: the connection's tasks stop.
        let mut rest = Vec::new();
        std::io::Read::read_to_end(&mut theirs, &mut rest).unwrap();
        assert!(rest.is_empty(), "the client sees the connection closed");
        // Nothing more is taken, not even a short reply released straight to the socket.
        out.release(answer(9));
        assert!(rx.try_recv().is_err());
    }
}
