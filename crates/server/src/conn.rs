//! One client connection speaking protocol v1: a reader that parses, authenticates and hands
//! each request to the one dispatcher (`dispatch`; policy and digest work happens on this
//! thread, in parallel, not in the core), adding what is the connection's, and a writer that
//! renders replies once what they depend on is durable.

use crate::core::{Answer, CoreMsg, Out, ReplyTo};
use crate::dispatch::{self, ConnVerb, Route};
use crate::durable::{self, After, Durability, DurableState};
use crate::outbox::{Direct, Outbox, Unwritten};
use crate::quota::Slot;
use crate::tokens::RevokeSignal;
use estop_kernel::{Principal, PrincipalName, Role, RunId};
use estop_protocol::server_line::{self as wire};
use estop_protocol::{ErrorCode, Id, Line, LineReader, Op, Request, Secret, parse_request};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Semaphore, mpsc as tmpsc, watch};

pub use crate::answer::{Charge, render};
pub use crate::shared::{ConnOptions, Shared, wall_ms};

fn err(code: ErrorCode, msg: impl Into<String>) -> Answer {
    Answer::Error(code, msg.into())
}

/// Serves one connection until the client closes it. `socket`, a duplicate of the stream's
/// descriptor when it has one, lets durable replies be written straight to it
/// ([`Outbox::release`]).
pub async fn serve<S>(stream: S, socket: Option<OwnedFd>, shared: Arc<Shared>, mut slot: Slot)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let Opened {
        conn,
        mut reader,
        out_tx,
        permits,
        inflight,
        listings,
        backlog,
        unwritten,
        writer,
    } = open(stream, socket, &shared, render);
    let requests = async {
        let mut principal: Option<Authed> = None;
        let idle_for = Duration::from_millis(shared.opts.idle_ms_max);
        // One timer for the connection's life, re-armed only when it fires: registering a
        // timeout for every line read costs the IO threads a lock on the timer wheel per request.
        let deadline = tokio::time::sleep_until(
            tokio::time::Instant::now() + Duration::from_millis(shared.opts.hello_ms_max),
        );
        tokio::pin!(deadline);
        // Whether the connection ever subscribed or registered as an executor of compensations
        // (`compensations`): a subscriber or an executor may sit silent for as long as it likes.
        let mut subscribed = false;
        // Since when the connection has waited for its next line, and whether a line was read
        // since that was last noted.
        let mut waiting_since = tokio::time::Instant::now();
        let mut line_read = false;
        loop {
            // A client that does not read what it asked for stops being read.
            unwritten.paced().await;
            // Idle is counted from here, where the connection starts waiting for a line.
            if line_read {
                waiting_since = tokio::time::Instant::now();
                line_read = false;
            }
            // An idle connection whose token is revoked is woken and closed at once; so is one
            // that never authenticated when it is evicted to make room.
            let read = tokio::select! {
                biased;
                read = reader.next_line() => Some(read),
                () = &mut deadline => None,
                () = RevokeSignal::wait(principal.as_ref().map(|a| &*a.revoked)) => {
                    // Said once, unasked (`id` null, as for a discarded line), then closed.
                    say_and_close(&out_tx, revoked_answer());
                    break;
                }
                () = slot.evicted(), if !slot.is_authenticated() => {
                    say_and_close(
                        &out_tx,
                        err(ErrorCode::LimitExceeded, crate::quota::EVICTED_MESSAGE),
                    );
                    break;
                }
            };
            let line = match read {
                Some(Ok(Some(l))) => {
                    line_read = true;
                    l
                }
                Some(Ok(None) | Err(_)) => break,
                None if principal.is_some() && waiting_since + idle_for > deadline.deadline() => {
                    // Armed before the last line: idle only once that line is idle_for old.
                    deadline.as_mut().reset(waiting_since + idle_for);
                    continue;
                }
                None => match idle_close(&shared.opts, principal.is_some(), subscribed, &permits) {
                    Some(why) => {
                        crate::log::info(&format!("connection {conn} closed: {why}"));
                        say_and_close(&out_tx, err(ErrorCode::LimitExceeded, why));
                        break;
                    }
                    None => {
                        deadline
                            .as_mut()
                            .reset(tokio::time::Instant::now() + idle_for);
                        continue;
                    }
                },
            };
            // Bounded pipelining: a permit per request, returned when its reply is written.
            match permits.try_acquire() {
                Ok(p) => p.forget(),
                Err(tokio::sync::TryAcquireError::Closed) => break,
                Err(tokio::sync::TryAcquireError::NoPermits) => match permits.acquire().await {
                    Ok(p) => p.forget(),
                    Err(_) => break,
                },
            }
            let bound = shared.opts.inflight_bytes_max.max(1);
            let Some(charge) = Charge::acquire(&inflight, bound, line_bytes(&line)).await else {
                break;
            };
            let call = Call {
                conn,
                out: &out_tx,
                backlog: &backlog,
                listings: &listings,
                charge: &std::sync::Mutex::new(Some(charge)),
            };
            let authenticated = principal.is_some();
            let conn_state = ConnState {
                principal: &mut principal,
                slot: &mut slot,
                subscribed: &mut subscribed,
            };
            if !request(line, conn_state, call, &shared).await {
                break;
            }
            if !authenticated && principal.is_some() {
                // From the hello's deadline to the idle one.
                deadline
                    .as_mut()
                    .reset(tokio::time::Instant::now() + idle_for);
            }
        }
    };
    // A connection that falls too far behind its replies is closed whatever its reader does.
    // Biased: the requests first, without drawing a random number on every wake.
    tokio::select! {
        biased;
        () = requests => {}
        () = unwritten.crossed() => {}
    }
    close(&shared, conn, out_tx, writer).await;
    drop(slot);
}

/// Why a connection whose read timed out is closed: not authenticated in time, or idle with
/// nothing in flight and no subscription. `None`: it stays (a `wait` is pending, or it listens:
/// a subscription or an executor's registration).
pub fn idle_close(
    opts: &ConnOptions,
    authenticated: bool,
    subscribed: bool,
    permits: &Semaphore,
) -> Option<String> {
    if !authenticated {
        return Some(format!(
            "no hello within hello_ms_max = {} ms of connecting; the connection is closed",
            opts.hello_ms_max
        ));
    }
    let in_flight = permits.available_permits() < opts.outstanding_per_connection_max;
    (!subscribed && !in_flight).then(|| {
        format!(
            "idle: nothing sent for idle_ms_max = {} ms and nothing in flight; the connection is closed (reconnect when needed)",
            opts.idle_ms_max
        )
    })
}

fn revoked_answer() -> Answer {
    err(
        ErrorCode::Unauthenticated,
        "this connection's token was revoked; the connection is closed",
    )
}

/// Who a connection authenticated as, and the signal that its token was revoked.
struct Authed {
    principal: Principal,
    revoked: Arc<RevokeSignal>,
}

/// Sends a last line, unasked (`id` null), before the connection closes.
fn say_and_close(out: &Outbox, answer: Answer) {
    let _ = out.send(Out::Answer {
        id: Id::default(),
        answer,
        after: After::default(),
    });
}

/// What a request may change of its connection: who it is, its pool slot, whether it listens.
struct ConnState<'a> {
    principal: &'a mut Option<Authed>,
    slot: &'a mut Slot,
    subscribed: &'a mut bool,
}

fn line_bytes(line: &Line<'_>) -> usize {
    match line {
        Line::Text(bytes) => bytes.len(),
        Line::TooLong { .. } => 0,
    }
}

/// Answers one line, or hands it to the core (with the line's charge, held until the core
/// answers). False when the connection must close after it (its token was revoked, or its
/// `hello` found its principal's share of connections full).
async fn request(
    line: Line<'_>,
    state: ConnState<'_>,
    call: Call<'_>,
    shared: &Arc<Shared>,
) -> bool {
    let out_tx = call.out;
    let mut keep = true;
    let (id, answer) = match line {
        Line::TooLong { bytes } => (
            Id::default(),
            Some(err(
                ErrorCode::LineTooLong,
                format!(
                    "line of {bytes} bytes is longer than line_bytes_max = {}; it was discarded",
                    shared.opts.line_bytes_max
                ),
            )),
        ),
        Line::Text(bytes) => match parse_request(bytes) {
            Err(e) => (e.id.clone(), Some(err(e.code(), e.to_string()))),
            Ok(req) if state.principal.as_ref().is_some_and(|a| a.revoked.is_set()) => {
                keep = false;
                (req.id.clone(), Some(revoked_answer()))
            }
            Ok(req) => {
                let id = req.id.clone();
                *state.subscribed |=
                    matches!(req.op, Op::Subscribe { .. } | Op::Compensations { .. });
                let is_hello = matches!(req.op, Op::Hello { .. });
                let answer = dispatch(req, state.principal, call, shared).await;
                match state.principal.as_ref() {
                    Some(a) if is_hello => match state.slot.authenticate(&a.principal) {
                        Ok(()) => (id, answer),
                        Err(why) => {
                            // Over its share: the connection ends here, before it can hold
                            // anything.
                            *state.principal = None;
                            keep = false;
                            (id, Some(err(ErrorCode::LimitExceeded, why)))
                        }
                    },
                    _ => (id, answer),
                }
            }
        },
    };
    if let Some(answer) = answer {
        let _ = out_tx.send(Out::Answer {
            id,
            answer,
            after: After::default(),
        });
    }
    keep
}

/// One accepted connection, set up: its id, line reader, outgoing queue, pipelining permits and
/// writer task (rendering with `render`, the listener's protocol).
pub struct Opened<S> {
    pub conn: u64,
    pub reader: LineReader<tokio::io::ReadHalf<S>>,
    pub out_tx: Outbox,
    pub permits: Arc<Semaphore>,
    /// Bytes of request lines in flight ([`ConnOptions::inflight_bytes_max`], see [`Charge`]).
    pub inflight: Arc<Semaphore>,
    /// Listings in flight ([`LISTINGS_IN_FLIGHT_MAX`]).
    pub listings: Arc<Semaphore>,
    /// Events queued for this connection and not yet written (bounds a non-reading subscriber).
    pub backlog: Arc<AtomicUsize>,
    /// Bytes its writer holds unwritten ([`ConnOptions::output_bytes_max`]).
    pub unwritten: Arc<Unwritten>,
    pub writer: tokio::task::JoinHandle<()>,
}

pub fn open<S>(
    stream: S,
    socket: Option<OwnedFd>,
    shared: &Shared,
    render: fn(&Id, &Answer) -> Vec<u8>,
) -> Opened<S>
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let conn = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    let (rd, wr) = tokio::io::split(stream);
    let (tx, out_rx) = tmpsc::unbounded_channel::<Out>();
    let permits = Arc::new(Semaphore::new(shared.opts.outstanding_per_connection_max));
    let inflight = Arc::new(Semaphore::new(shared.opts.inflight_bytes_max.max(1)));
    let listings = Arc::new(Semaphore::new(LISTINGS_IN_FLIGHT_MAX));
    let backlog = Arc::new(AtomicUsize::new(0));
    let unwritten = Unwritten::new(conn, shared.opts.output_bytes_max);
    let direct = socket.map(|s| Direct::new(s, render, Arc::clone(&permits)));
    let out_tx = Outbox::new(tx, direct.clone(), Some(Arc::clone(&unwritten)));
    let write = write_loop(
        wr,
        out_rx,
        shared.durable_rx.clone(),
        Arc::clone(&permits),
        Arc::clone(&backlog),
        render,
        direct,
        Some(Arc::clone(&unwritten)),
    );
    let crossed = Arc::clone(&unwritten);
    // Past its output bound the connection is closed: the writer stops where it is.
    let writer = tokio::spawn(async move {
        tokio::select! {
            () = write => {}
            () = crossed.crossed() => {}
        }
    });
    let reader = LineReader::new(rd, shared.opts.line_bytes_max);
    Opened {
        conn,
        reader,
        out_tx,
        permits,
        inflight,
        listings,
        backlog,
        unwritten,
        writer,
    }
}

/// The client closed its side: forget its subscriptions, then let the writer drain what is
/// still owed to it.
pub async fn close(
    shared: &Shared,
    conn: u64,
    out_tx: Outbox,
    writer: tokio::task::JoinHandle<()>,
) {
    let _ = shared.core_tx.send(CoreMsg::Disconnect { conn });
    shared.tokens.unwatch(conn);
    drop(out_tx);
    let _ = writer.await;
}

/// Listings (`runs`, `pending`, `report`, `ledger`) one connection may have asked for and not
/// had answered: with the reader paced by unwritten output, this bounds what a burst of
/// pipelined listings can add to a connection's output (a page each) before it is read.
pub const LISTINGS_IN_FLIGHT_MAX: usize = 1;

/// The connection a request came on, and its line's charge ([`Charge`], taken by the core
/// message that carries the request, if any).
struct Call<'a> {
    conn: u64,
    out: &'a Outbox,
    backlog: &'a Arc<AtomicUsize>,
    listings: &'a Arc<Semaphore>,
    charge: &'a std::sync::Mutex<Option<Charge>>,
}

impl Call<'_> {
    /// Waits for a place among the connection's listings in flight; the request's charge holds
    /// it until the listing is answered.
    async fn listing(&self) {
        let permit = Arc::clone(self.listings)
            .acquire_owned()
            .await
            .expect("the listings semaphore is never closed");
        let mut charge = self
            .charge
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(c) = charge.as_mut() {
            c.listing = Some(permit);
        }
    }
}

/// Handles one request through the one dispatcher ([`dispatch::route`]), adding what is the
/// connection's: its listings in flight, its authentication, its waits and subscriptions, and
/// the line's charge (held by the core message that answers it). `Some(answer)` is answered at
/// once; `None` means the core answers.
async fn dispatch(
    req: Request,
    principal: &mut Option<Authed>,
    call: Call<'_>,
    shared: &Arc<Shared>,
) -> Option<Answer> {
    if req.op.verb().is_listing() {
        call.listing().await;
    }
    let Call {
        conn,
        out,
        backlog,
        charge,
        ..
    } = call;
    let Request { id, op } = req;
    // Where the core answers; built only for a request that goes to the core.
    let reply_to = || ReplyTo {
        out: out.clone(),
        id,
        charge: charge
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take(),
    };
    let send = |msg| dispatch::send(shared, msg);
    match dispatch::route(shared, principal.as_ref().map(|a| &a.principal), op) {
        Route::Answer(answer) => Some(answer),
        Route::Core(ask) => send(ask.message(reply_to())),
        Route::Work(work) => Some(work.run(shared).await),
        Route::Conn(ConnVerb::Hello {
            token,
            run,
            component,
        }) => Some(hello(shared, conn, &token, (run.as_ref(), component), principal).await),
        Route::Conn(ConnVerb::Wait {
            principal,
            run,
            key,
            timeout,
        }) => send(CoreMsg::Wait {
            principal,
            run,
            key,
            timeout,
            conn,
            to: reply_to(),
        }),
        Route::Conn(ConnVerb::Subscribe { principal, run }) => send(CoreMsg::Subscribe {
            principal,
            run,
            conn,
            out: out.clone(),
            backlog: Arc::clone(backlog),
            page: shared.opts.page(None),
            to: reply_to(),
        }),
        Route::Conn(ConnVerb::Compensations {
            principal,
            run,
            tool,
        }) => send(CoreMsg::Executor {
            principal,
            run,
            tool,
            conn,
            out: out.clone(),
            backlog: Arc::clone(backlog),
            to: reply_to(),
        }),
        Route::Conn(ConnVerb::Unsubscribe { run }) => {
            let _ = shared.core_tx.send(CoreMsg::Unsubscribe { run, conn });
            Some(Answer::Ack(wire::Ack::default()))
        }
    }
}

/// `hello`: the connection authenticates as the token's principal (speaking for run `run`'s
/// sandbox, as part `component`, when given) and watches for its revocation.
async fn hello(
    shared: &Shared,
    conn: u64,
    token: &Secret,
    (run, component): (Option<&RunId>, estop_kernel::Part),
    principal: &mut Option<Authed>,
) -> Answer {
    let mut c = match shared.tokens.credential_async(token.expose()).await {
        Ok(Some(c)) => c,
        // The registry is in a database that cannot be asked now: refused, not let in.
        Err(e) => return err(ErrorCode::Unavailable, e.to_string()),
        Ok(None) => {
            return err(
                ErrorCode::Unauthenticated,
                "unknown token: use the contents of DATA/agent.token or DATA/operator.token, or one made by `estop token create`",
            );
        }
    };
    if let Some(run) = run {
        if c.principal.role != Role::Agent {
            return err(
                ErrorCode::Forbidden,
                format!(
                    "hello with a run speaks for that run's sandbox, which only an agent token may do (this one is {})",
                    c.principal.role.as_str()
                ),
            );
        }
        c.principal.name = sandbox_principal(&c.principal.name, run);
    }
    if component != estop_kernel::Part::Main {
        if c.principal.role != Role::Agent {
            return err(
                ErrorCode::Forbidden,
                format!(
                    "hello with a component speaks for a part of an agent's software, which only an agent token may do (this one is {})",
                    c.principal.role.as_str()
                ),
            );
        }
        c.principal.part = component;
    }
    let hello = wire::HelloReply {
        role: c.principal.role.as_str().into(),
        principal: c.principal.name.to_string(),
        protocol: 1,
        component: (component != estop_kernel::Part::Main).then(|| component.as_str().into()),
        line_bytes_max: Some(shared.opts.line_bytes_max),
    };
    let revoked = shared.tokens.watch(conn, &c);
    *principal = Some(Authed {
        principal: c.principal,
        revoked,
    });
    Answer::Hello(hello)
}

/// Writes a connection's replies and events in order, each once what it depends on is durable.
/// With `direct`, it counts down what it has written, so durable replies may go straight to the
/// socket whenever nothing is ahead of them; with `unwritten`, the bytes it still holds.
#[allow(clippy::too_many_arguments)]
pub async fn write_loop<W: AsyncWrite + Unpin>(
    mut wr: W,
    mut rx: tmpsc::UnboundedReceiver<Out>,
    mut durable_rx: watch::Receiver<DurableState>,
    permits: Arc<Semaphore>,
    backlog: Arc<AtomicUsize>,
    render: fn(&Id, &Answer) -> Vec<u8>,
    direct: Option<Arc<Direct>>,
    unwritten: Option<Arc<Unwritten>>,
) {
    let mut buf = Vec::with_capacity(4096);
    // Items whose bytes are in `buf`, not yet written, and what they weigh.
    let mut items = 0;
    let mut weight = 0;
    let mut pages = 0;
    while let Some(out) = rx.recv().await {
        items += 1;
        if unwritten.is_some() {
            let w = crate::outbox::weight(&out);
            weight += w;
            if crate::outbox::is_page(&out) {
                pages += w;
            }
        }
        match out {
            Out::Answer { id, answer, after } => {
                let line = match durable::wait(&mut durable_rx, after).await {
                    Durability::Durable => render(&id, &answer),
                    Durability::Lost => render(&id, &crate::core::unavailable()),
                };
                buf.extend_from_slice(&line);
                permits.add_permits(1);
            }
            Out::Event { event, after } => {
                backlog.fetch_sub(1, Ordering::Relaxed);
                if durable::wait(&mut durable_rx, after).await == Durability::Durable {
                    buf.extend_from_slice(&wire::event_line(&event));
                }
            }
            Out::Rendered(line) => {
                buf.extend_from_slice(&line);
                permits.add_permits(1);
            }
        }
        // Write when nothing else is ready: one syscall for a burst of replies.
        if rx.is_empty() || buf.len() >= 64 * 1024 {
            if wr.write_all(&buf).await.is_err() || wr.flush().await.is_err() {
                return;
            }
            if buf.capacity() > 1 << 20 {
                // A large listing went through: give its buffer back rather than keep it for
                // the connection's life.
                buf = Vec::with_capacity(4096);
            } else {
                buf.clear();
            }
            if let Some(d) = &direct {
                d.written(items);
            }
            if let Some(u) = &unwritten {
                u.written(weight, pages);
            }
            items = 0;
            weight = 0;
            pages = 0;
        }
    }
    let _ = wr.write_all(&buf).await;
    let _ = wr.flush().await;
    let _ = wr.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Request bytes in flight are lent out of the connection's bound and given back when the
    /// request is answered (its charge dropped); a line longer than the whole bound goes alone.
    #[test]
    fn request_bytes_in_flight_are_bounded_and_given_back() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let inflight = Arc::new(Semaphore::new(100));
            let a = Charge::acquire(&inflight, 100, 60).await.unwrap();
            let b = Charge::acquire(&inflight, 100, 40).await.unwrap();
            let third = Charge::acquire(&inflight, 100, 1);
            tokio::pin!(third);
            assert!(
                futures_poll(third.as_mut()).is_none(),
                "the bound is spent: the next line waits"
            );
            drop(a);
            let c = third.await.unwrap();
            drop((b, c));
            assert_eq!(inflight.available_permits(), 100, "everything given back");
            let huge = Charge::acquire(&inflight, 100, 1 << 20).await.unwrap();
            assert_eq!(
                inflight.available_permits(),
                0,
                "a long line takes the whole bound"
            );
            drop(huge);
            assert_eq!(inflight.available_permits(), 100);
        });
    }

    /// Polls a future once.
    fn futures_poll<F: std::future::Future>(f: std::pin::Pin<&mut F>) -> Option<F::Output> {
        let waker = std::task::Waker::noop();
        match f.poll(&mut std::task::Context::from_waker(waker)) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        }
    }
}

/// The principal of run `run`'s sandbox started with token `token` (docs/EGRESS.md, "A
/// principal per sandbox"): `TOKEN/RUN`, or `TOKEN/#` and 32 hex digits of SHA-256 of the run
/// when that would be longer than a name may be. Token names hold no `/`, so no token can be
/// one, and the kernel reads the token back from it.
pub fn sandbox_principal(token: &PrincipalName, run: &RunId) -> PrincipalName {
    use sha2::Digest as _;
    let sep = estop_kernel::SANDBOX_SEPARATOR;
    let plain = format!("{token}{sep}{run}");
    let name = if plain.len() <= estop_kernel::NAME_BYTES_MAX {
        plain
    } else {
        let h = sha2::Sha256::digest(run.as_str().as_bytes());
        let hex: String = h[..16].iter().map(|b| format!("{b:02x}")).collect();
        format!("{token}{sep}#{hex}")
    };
    PrincipalName::new(&name).expect("a token name (at most 64 bytes) and at most 200 bytes")
}

#[cfg(test)]
mod sandbox_tests {
    use super::sandbox_principal;
    use estop_kernel::{NAME_BYTES_MAX, PrincipalName, RunId};

    /// `TOKEN/RUN` while it fits a name; past that the run's digest stands in, still distinct
    /// per run and still read back as the token's.
    #[test]
    fn a_sandbox_principal_names_its_token_and_its_run() {
        let token = PrincipalName::new(&"t".repeat(64)).unwrap();
        let short = RunId::new("order-42").unwrap();
        let p = sandbox_principal(&token, &short);
        assert_eq!(p.as_str(), format!("{}/order-42", "t".repeat(64)));
        let (a, b) = (
            RunId::new(&format!("{}a", "r".repeat(199))).unwrap(),
            RunId::new(&format!("{}b", "r".repeat(199))).unwrap(),
        );
        let (pa, pb) = (sandbox_principal(&token, &a), sandbox_principal(&token, &b));
        assert_ne!(pa, pb);
        assert!(pa.as_str().len() <= NAME_BYTES_MAX, "{pa:?}");
        assert_eq!(pa.token_name(), token.as_str());
    }
}
