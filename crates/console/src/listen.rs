//! The console's connections, served with hyper's HTTP/1.1 so that none can hold a slot for
//! nothing: a request head must arrive within `header_read` of the connection being ready for
//! one (a fresh connection, or a kept-alive one after its last answer: the same bound is the
//! idle timeout), a request body within `body_read` of its head, and an answer the client does
//! not read is given up after `write_stall`. At the bound on open connections, the connection
//! idle the longest (no request in flight) is closed to make room, or failing that the one whose
//! request body is still arriving (a legitimate client sends its body with its head): idle or
//! dribbling sockets, however many, never keep the operator's request waiting.

use axum::Router;
use axum::body::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;
use tower::ServiceExt as _;

/// A request head must arrive within this long of the connection being ready for one.
pub const HEADER_READ_MS: u64 = 10_000;
/// A request body must arrive within this long of its head.
pub const BODY_READ_MS: u64 = 10_000;
/// A write the client does not take for this long ends the connection.
pub const WRITE_STALL_MS: u64 = 60_000;
/// How long the accept loop waits for an evicted connection to give its slot back before it
/// looks for another one.
const EVICT_WAIT_MS: u64 = 100;

/// The timeouts of one connection.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    pub header_read: Duration,
    pub body_read: Duration,
    pub write_stall: Duration,
}

struct Conn {
    /// Requests whose answer is not yet fully written.
    busy: AtomicUsize,
    /// Of those, requests whose body is still arriving.
    reading: AtomicUsize,
    idle_since: Mutex<Instant>,
    closing: AtomicBool,
    close: Notify,
}

/// The open connections and their slots.
pub struct Conns {
    slots: Arc<Semaphore>,
    pub max: usize,
    live: Mutex<HashMap<u64, Arc<Conn>>>,
    next: AtomicU64,
}

impl Conns {
    pub fn new(max: usize) -> Arc<Conns> {
        Arc::new(Conns {
            slots: Arc::new(Semaphore::new(max)),
            max,
            live: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
        })
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.max - self.slots.available_permits()
    }

    /// A slot, closing the longest-idle connection when there is none free.
    async fn slot(&self) -> OwnedSemaphorePermit {
        loop {
            if let Ok(p) = Arc::clone(&self.slots).try_acquire_owned() {
                return p;
            }
            self.evict_longest_idle();
            let wait = Arc::clone(&self.slots).acquire_owned();
            if let Ok(p) = tokio::time::timeout(Duration::from_millis(EVICT_WAIT_MS), wait).await {
                return p.expect("the slots semaphore is never closed");
            }
        }
    }

    /// Closes the connection idle the longest, else the one with a body arriving that was idle
    /// the longest before.
    fn evict_longest_idle(&self) {
        let live = self.live.lock().expect("conns lock");
        let victim = live
            .values()
            .filter(|c| !c.closing.load(Ordering::Acquire))
            .filter_map(|c| {
                let reading = c.reading.load(Ordering::Acquire) > 0;
                let idle = c.busy.load(Ordering::Acquire) == 0;
                let since = *c.idle_since.lock().expect("idle lock");
                (idle || reading).then_some((reading, since, c))
            })
            .min_by_key(|(reading, since, _)| (*reading, *since))
            .map(|(_, _, c)| c);
        if let Some(c) = victim {
            c.closing.store(true, Ordering::Release);
            c.close.notify_one();
        }
    }

    fn register(&self) -> (u64, Arc<Conn>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            busy: AtomicUsize::new(0),
            reading: AtomicUsize::new(0),
            idle_since: Mutex::new(Instant::now()),
            closing: AtomicBool::new(false),
            close: Notify::new(),
        });
        self.live
            .lock()
            .expect("conns lock")
            .insert(id, Arc::clone(&conn));
        (id, conn)
    }
}

/// Accepts and serves console connections until the task is dropped.
pub async fn serve(listener: TcpListener, router: Router, conns: Arc<Conns>, t: Timeouts) {
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            // E.g. out of file descriptors: back off instead of spinning.
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let slot = conns.slot().await;
        let _ = stream.set_nodelay(true);
        tokio::spawn(connection(
            stream,
            slot,
            Arc::clone(&conns),
            router.clone(),
            t,
        ));
    }
}

async fn connection(
    stream: TcpStream,
    slot: OwnedSemaphorePermit,
    conns: Arc<Conns>,
    router: Router,
    t: Timeouts,
) {
    let (id, conn) = conns.register();
    let io = TokioIo::new(Guarded {
        stream,
        write_stall: t.write_stall,
        stall: None,
    });
    let state = Arc::clone(&conn);
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let busy = Busy::new(Arc::clone(&state));
        let router = router.clone();
        let req = req.map(|b| Deadline::new(b, t.body_read, &state));
        async move {
            let resp = router.oneshot(req).await.unwrap_or_else(|e| match e {});
            Ok::<_, Infallible>(resp.map(|inner| Tracked { inner, _busy: busy }))
        }
    });
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(t.header_read)
        .keep_alive(true);
    let served = builder.serve_connection(io, service);
    tokio::select! {
        _ = served => {}
        _ = conn.close.notified() => {}
    }
    conns.live.lock().expect("conns lock").remove(&id);
    drop(slot);
}

/// A request in flight on a connection, from its head until its answer is written.
struct Busy(Arc<Conn>);

impl Busy {
    fn new(c: Arc<Conn>) -> Busy {
        c.busy.fetch_add(1, Ordering::AcqRel);
        Busy(c)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        *self.0.idle_since.lock().expect("idle lock") = Instant::now();
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An answer's body; the request counts as in flight until it is dropped (a server-sent-event
/// stream is in flight for as long as it is open).
struct Tracked {
    inner: axum::body::Body,
    _busy: Busy,
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request body that must arrive by a deadline; while it arrives its connection may be
/// evicted (a client dribbling its body holds no slot).
struct Deadline {
    inner: Incoming,
    by: Instant,
    timer: Option<Pin<Box<Sleep>>>,
    reading: Option<Reading>,
}

impl Deadline {
    fn new(inner: Incoming, within: Duration, conn: &Arc<Conn>) -> Deadline {
        let reading = (!inner.is_end_stream()).then(|| {
            conn.reading.fetch_add(1, Ordering::AcqRel);
            Reading(Arc::clone(conn))
        });
        Deadline {
            inner,
            by: Instant::now() + within,
            timer: None,
            reading,
        }
    }
}

/// A request body still arriving on a connection.
struct Reading(Arc<Conn>);

impl Drop for Reading {
    fn drop(&mut self) {
        self.0.reading.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Body for Deadline {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(f) => {
                if !matches!(f, Some(Ok(_))) || this.inner.is_end_stream() {
                    this.reading = None;
                }
                Poll::Ready(f.map(|r| r.map_err(Into::into)))
            }
            Poll::Pending => {
                let by = this.by.into();
                let timer = this
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(by)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        Poll::Ready(Some(Err("the request body did not arrive in time".into())))
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A connection's socket; a write that stays blocked for `write_stall` fails.
struct Guarded<S> {
    stream: S,
    write_stall: Duration,
    stall: Option<Pin<Box<Sleep>>>,
}

impl<S> Guarded<S> {
    fn stalled<T>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if r.is_ready() {
            self.stall = None;
            return r;
        }
        let within = self.write_stall;
        let timer = self
            .stall
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(within)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client did not read its answer",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Guarded<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Guarded<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.stalled(cx, r)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.stream).poll_flush(cx);
        self.stalled(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.stalled(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt as _;

    #[tokio::test]
    async fn a_write_the_peer_does_not_take_fails_after_the_stall_bound() {
        let (near, _far) = tokio::io::duplex(64);
        let mut g = Guarded {
            stream: near,
            write_stall: Duration::from_millis(200),
            stall: None,
        };
        let started = Instant::now();
        let mut written = 0;
        let err = loop {
            match g.write(&[0u8; 16]).await {
                Ok(n) => written += n,
                Err(e) => break e,
            }
        };
        assert_eq!(written, 64, "what the peer's buffer takes is written");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= Duration::from_millis(200));
    }
}
