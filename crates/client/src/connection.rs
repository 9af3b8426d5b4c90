//! The tokio driver: one connection shared by every task of a process, requests pipelined
//! and matched to replies by id (a long `wait` holds up nothing else), events and the
//! connection's own news handed to one channel of [`Notice`]s.
//!
//! It survives the gate. When the connection closes (a restart, an idle close, the network)
//! it connects again with exponential backoff and jitter, says its `hello` again, subscribes
//! again to every run it was subscribed to, registers again as an executor, and sends again
//! every request in flight that is safe to repeat (a `wait` is parked again); a request that
//! is not fails with [`ClientError::Interrupted`] (see [`crate::session`]). A request made
//! while the gate is away waits for it, at most the `patience` of [`Options`], then fails
//! with [`ClientError::Unreachable`]. A `hello` refused on a new connection (the token was
//! revoked) ends the connection for good: [`Notice::Dead`].

use crate::error::ClientError;
use crate::session::{Limits, Received, Session};
use estop_protocol::line_codec::{Line, LineReader};
use estop_protocol::{Event, HelloReply, Op, ReplyBody};
use std::collections::HashMap;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

/// How long to wait between attempts to reach the gate again: `initial`, doubling up to `max`,
/// each wait between half and all of that (jitter, so a fleet does not come back at once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff {
            initial: Duration::from_millis(50),
            max: Duration::from_secs(2),
        }
    }
}

impl Backoff {
    /// The wait before attempt `n` (0 first).
    pub fn delay(&self, n: u32) -> Duration {
        let full = self.initial.saturating_mul(1u32 << n.min(20)).min(self.max);
        let half = full / 2;
        half + full.mul_f64(rand::random::<f64>() / 2.0)
    }
}

/// How to reach the gate and how hard to try.
#[derive(Debug, Clone)]
pub struct Options {
    /// A socket path, or `host:port`.
    pub target: String,
    pub limits: Limits,
    pub backoff: Backoff,
    /// How long a request waits for a gate that is away before it fails with
    /// [`ClientError::Unreachable`]; `None`: as long as it takes. Reconnecting goes on either way.
    pub patience: Option<Duration>,
    /// Whether to connect again when the connection closes (`false`: every request in flight
    /// fails with [`ClientError::Interrupted`] or [`ClientError::Closed`], and so does every
    /// later one).
    pub reconnect: bool,
}

impl Options {
    pub fn new(target: &str) -> Options {
        Options {
            target: target.to_string(),
            limits: Limits::default(),
            backoff: Backoff::default(),
            patience: Some(Duration::from_secs(30)),
            reconnect: true,
        }
    }
}

/// What the connection has to tell besides replies.
// Each is moved once, from the line it came in on to its owner: boxing the large variants
// would cost an allocation per reply for nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Notice {
    /// An event of a run subscribed to, or an executor's `compensate`/`lookup`.
    Event(Event),
    /// The connection closed; reconnecting.
    Disconnected { reason: String },
    /// A new connection said its `hello`; the registrations follow as [`Notice::Restored`].
    Reconnected(HelloReply),
    /// A `subscribe` (with its replay of the run's durable state) or `compensations` sent
    /// again on a new connection was answered. Whatever happened while away is learnt here:
    /// a run stopped in between says so in the replay.
    Restored {
        op: Op,
        result: Result<ReplyBody, ClientError>,
    },
    /// The gate no longer takes the token; nothing more will come.
    Dead(ClientError),
}

type Reply = oneshot::Sender<Result<ReplyBody, ClientError>>;

struct Ask {
    op: Op,
    reply: Reply,
}

/// A cheap handle; clones share the connection. The connection ends when every handle is gone.
#[derive(Clone, Debug)]
pub struct Connection {
    asks: mpsc::UnboundedSender<Ask>,
}

/// A connection's read and write halves.
pub type Halves = (
    Box<dyn AsyncRead + Send + Unpin>,
    Box<dyn AsyncWrite + Send + Unpin>,
);

async fn open(target: &str) -> Result<Halves, ClientError> {
    let failed = |e: std::io::Error| ClientError::Connect {
        target: target.to_string(),
        message: e.to_string(),
    };
    Ok(if crate::is_socket_path(target) {
        let (r, w) = tokio::net::UnixStream::connect(target)
            .await
            .map_err(failed)?
            .into_split();
        (Box::new(r), Box::new(w))
    } else {
        let s = tokio::net::TcpStream::connect(target)
            .await
            .map_err(failed)?;
        s.set_nodelay(true).map_err(failed)?;
        let (r, w) = s.into_split();
        (Box::new(r), Box::new(w))
    })
}

impl Connection {
    /// Connects and says `hello`: the first connection must succeed (the gate reachable, the
    /// token taken); after that the connection survives the gate, saying the same hello on
    /// every new connection. Returns the handle, the stream of notices and the hello's reply.
    pub async fn connect(
        options: Options,
        hello: Op,
    ) -> Result<(Connection, mpsc::UnboundedReceiver<Notice>, HelloReply), ClientError> {
        let (conn, notices) = Connection::open(options).await?;
        let reply = conn.ask::<HelloReply>(hello).await?;
        Ok((conn, notices, reply))
    }

    /// Connects without a hello: the caller says one (and it is said again on every new
    /// connection once the gate took it).
    pub async fn open(
        options: Options,
    ) -> Result<(Connection, mpsc::UnboundedReceiver<Notice>), ClientError> {
        let halves = open(&options.target).await?;
        Ok(Connection::over(halves, options))
    }

    /// A connection over a stream already open (tests play the gate themselves); with
    /// `options.reconnect`, later connections go to `options.target`.
    pub fn over(halves: Halves, options: Options) -> (Connection, mpsc::UnboundedReceiver<Notice>) {
        let (asks, asked) = mpsc::unbounded_channel();
        let (notices, notice_rx) = mpsc::unbounded_channel();
        let driver = Driver {
            session: Session::new(options.limits),
            waiting: HashMap::new(),
            notices,
            options,
        };
        tokio::spawn(driver.run(halves, asked));
        (Connection { asks }, notice_rx)
    }

    /// Sends `op` now (after every request sent before it on this handle's connection) and
    /// returns the wait for its reply.
    pub fn send(
        &self,
        op: Op,
    ) -> impl std::future::Future<Output = Result<ReplyBody, ClientError>> + Send + 'static {
        let (reply, rx) = oneshot::channel();
        let sent = self.asks.send(Ask { op, reply });
        async move {
            sent.map_err(|_| ClientError::Closed)?;
            rx.await.unwrap_or(Err(ClientError::Closed))
        }
    }

    /// Sends `op` and waits for its reply; a refusal is an error.
    pub async fn request(&self, op: Op) -> Result<ReplyBody, ClientError> {
        self.send(op).await
    }

    /// [`Connection::request`], with the payload as the type the caller expects of its verb.
    pub async fn ask<T: TryFrom<ReplyBody, Error = ReplyBody>>(
        &self,
        op: Op,
    ) -> Result<T, ClientError> {
        let verb = op.verb();
        T::try_from(self.request(op).await?).map_err(|other| {
            ClientError::Protocol(format!("unexpected reply to {verb}: {other:?}"))
        })
    }
}

/// The task that owns the socket and the session.
struct Driver {
    session: Session,
    waiting: HashMap<u64, Reply>,
    notices: mpsc::UnboundedSender<Notice>,
    options: Options,
}

/// How one connection ended.
enum Ended {
    /// Every handle is gone.
    Dropped,
    Closed(String),
    Dead,
}

impl Driver {
    async fn run(mut self, first: Halves, mut asks: mpsc::UnboundedReceiver<Ask>) {
        let mut halves = first;
        let mut pending_lines = Vec::new();
        loop {
            match self.serve(halves, &mut asks, pending_lines).await {
                Ended::Dropped | Ended::Dead => return,
                Ended::Closed(reason) => {
                    for (id, verb) in self.session.closed() {
                        self.answer(
                            id,
                            Err(ClientError::Interrupted {
                                verb: verb.as_str(),
                            }),
                        );
                    }
                    let _ = self.notices.send(Notice::Disconnected { reason });
                }
            }
            if !self.options.reconnect {
                for id in self.session.give_up() {
                    self.answer(id, Err(ClientError::Closed));
                }
                return;
            }
            match self.reconnect(&mut asks).await {
                Some(h) => {
                    halves = h;
                    pending_lines = self.session.reconnected();
                }
                None => return,
            }
        }
    }

    /// Serves one connection until it ends: asks out, lines in.
    async fn serve(
        &mut self,
        (r, w): Halves,
        asks: &mut mpsc::UnboundedReceiver<Ask>,
        first: Vec<u8>,
    ) -> Ended {
        let (out, lines) = mpsc::unbounded_channel::<Vec<u8>>();
        tokio::spawn(write_lines(w, lines));
        if !first.is_empty() {
            let _ = out.send(first);
        }
        let mut reader = LineReader::new(r, self.session.limits().reply_bytes_max);
        loop {
            tokio::select! {
                ask = asks.recv() => {
                    let Some(ask) = ask else { return Ended::Dropped };
                    if let Some(line) = self.ask(ask) {
                        let _ = out.send(line);
                    }
                }
                line = reader.next_line() => {
                    let received = match line {
                        Ok(Some(Line::Text(t))) => self.session.receive(t),
                        Ok(Some(Line::TooLong { bytes })) => {
                            return Ended::Closed(format!("the gate sent a line of {bytes} bytes"));
                        }
                        Ok(None) => return Ended::Closed("the gate closed the connection".into()),
                        Err(e) => return Ended::Closed(e.to_string()),
                    };
                    if self.deliver(received) {
                        return Ended::Dead;
                    }
                }
            }
        }
    }

    /// Numbers an ask; its line, or `None` when refused here (answered at once).
    fn ask(&mut self, ask: Ask) -> Option<Vec<u8>> {
        match self.session.request(ask.op) {
            Ok((id, line)) => {
                self.waiting.insert(id, ask.reply);
                Some(line)
            }
            Err(e) => {
                let _ = ask.reply.send(Err(e));
                None
            }
        }
    }

    fn answer(&mut self, id: u64, result: Result<ReplyBody, ClientError>) {
        if let Some(to) = self.waiting.remove(&id) {
            let _ = to.send(result);
        }
    }

    /// Hands one received line on; `true` when the connection is dead for good.
    fn deliver(&mut self, received: Received) -> bool {
        match received {
            Received::Reply { id, result } => self.answer(id, result),
            Received::Event(e) => {
                let _ = self.notices.send(Notice::Event(e));
            }
            Received::Unsolicited { failed, error } => {
                for id in failed {
                    self.answer(id, Err(error.clone()));
                }
            }
            Received::Hello { result, failed } => match result {
                Ok(ReplyBody::Hello(h)) => {
                    let _ = self.notices.send(Notice::Reconnected(h));
                }
                Ok(_) => {}
                Err(e) => {
                    for id in failed {
                        self.answer(id, Err(e.clone()));
                    }
                    let _ = self.notices.send(Notice::Dead(e));
                    return true;
                }
            },
            Received::Restored { op, result } => {
                let _ = self.notices.send(Notice::Restored { op, result });
            }
            Received::Stray => {}
        }
        false
    }

    /// Connects again, with backoff; asks made meanwhile wait in the session. Once the gate
    /// has been away longer than the patience, each failed attempt fails every ask waiting,
    /// and a new ask makes an attempt at once (so it fails fast, or goes through as soon as
    /// the gate is back). `None` when every handle is gone.
    async fn reconnect(&mut self, asks: &mut mpsc::UnboundedReceiver<Ask>) -> Option<Halves> {
        let since = Instant::now();
        let mut attempt = 0u32;
        loop {
            let wake = Instant::now() + self.options.backoff.delay(attempt);
            attempt = attempt.saturating_add(1);
            loop {
                tokio::select! {
                    ask = asks.recv() => {
                        let _ = self.ask(ask?);
                        if self.impatient(since) {
                            break;
                        }
                    }
                    () = tokio::time::sleep_until(wake) => break,
                }
            }
            match open(&self.options.target).await {
                Ok(h) => return Some(h),
                Err(e) if self.impatient(since) => {
                    let error = ClientError::Unreachable {
                        target: self.options.target.clone(),
                        waited_ms: since.elapsed().as_millis() as u64,
                        last: e.to_string(),
                    };
                    for id in self.session.give_up() {
                        self.answer(id, Err(error.clone()));
                    }
                }
                Err(_) => {}
            }
        }
    }

    /// Whether the gate has been away longer than the patience.
    fn impatient(&self, since: Instant) -> bool {
        self.options.patience.is_some_and(|p| since.elapsed() >= p)
    }
}

async fn write_lines(
    mut w: Box<dyn AsyncWrite + Send + Unpin>,
    mut lines: mpsc::UnboundedReceiver<Vec<u8>>,
) {
    while let Some(line) = lines.recv().await {
        if w.write_all(&line).await.is_err() {
            return;
        }
    }
}
