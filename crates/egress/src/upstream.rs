//! One client connection from the proxy to an upstream origin, over HTTP/1.1 or HTTP/2. Which
//! one is the origin's choice: over TLS the proxy offers `h2` and `http/1.1` (ALPN) and speaks
//! what the server picks; plain `http://` origins get HTTP/1.1 (no upgrade, no prior
//! knowledge). An HTTP/2 connection carries many requests at once, so the pool hands out a
//! clone of it rather than the connection itself (`pool.rs`).
//!
//! Each connection counts what it writes (`Wire`), and a request's body notes when the
//! connection has taken its end (`Mark`): after a cut, the proxy tells a request that was not
//! written at all (`not sent`: nothing happened upstream) from one written whole (`sent, no
//! answer`). A cut connection writes nothing more.

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::{Request, Response};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

type H1 = hyper::client::conn::http1::SendRequest<Tracked>;
type H2 = hyper::client::conn::http2::SendRequest<Tracked>;

/// The sending half of an upstream connection; its connection is driven by its own task.
#[derive(Debug)]
pub struct Sender {
    conn: Conn,
    wire: Arc<Wire>,
}

#[derive(Debug)]
enum Conn {
    Http1(H1),
    Http2(H2),
}

/// The ALPN protocol ids the proxy offers upstream, most preferred first.
pub const ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

/// What one upstream connection wrote: bytes handed to the socket (or to TLS), flushes done,
/// and whether it was cut. Read and changed under one lock, so a cut and a write are ordered:
/// what the cut reads was written, and nothing is written after it.
#[derive(Debug, Default)]
pub struct Wire(Mutex<Written>);

/// A connection's counts at one instant.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    pub bytes: u64,
    pub flushes: u64,
    pub cut: bool,
}

impl Wire {
    pub fn now(&self) -> Written {
        *self.0.lock().expect("not poisoned")
    }

    /// Cuts the connection: every later write or flush fails. Returns what was written.
    pub fn cut(&self) -> Written {
        let mut w = self.0.lock().expect("not poisoned");
        w.cut = true;
        *w
    }
}

/// How far one request got on its connection (`Sender::send_marked`).
#[derive(Debug, Clone)]
pub struct Mark {
    wire: Arc<Wire>,
    before: Written,
    /// The connection's flush count when it took the body's end, plus one; 0: not yet.
    ended: Arc<AtomicU64>,
}

/// What became of a request whose answer never came.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Not one byte of it was written: nothing happened upstream.
    NotSent,
    /// Some of it was written, not all (or another request shares the connection).
    Partly,
    /// All of it was written and flushed; no answer came.
    Sent,
}

impl Mark {
    /// Cuts the connection (nothing more of the request goes out) and says how far it got.
    pub fn cut(&self) -> Progress {
        let now = self.wire.cut();
        let ended = self.ended.load(Ordering::SeqCst);
        if ended != 0 && now.flushes >= ended {
            Progress::Sent
        } else if now.bytes == self.before.bytes {
            Progress::NotSent
        } else {
            Progress::Partly
        }
    }
}

/// A request's body (whole, buffered) that notes when the connection takes its end.
#[derive(Debug)]
pub struct Tracked {
    inner: Full<Bytes>,
    end: Option<(Arc<Wire>, Arc<AtomicU64>)>,
}

impl Tracked {
    fn note_end(&self) {
        if let Some((wire, ended)) = &self.end {
            let flushes = wire.now().flushes;
            let _ = ended.compare_exchange(0, flushes + 1, Ordering::SeqCst, Ordering::SeqCst);
        }
    }
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) || self.inner.is_end_stream() {
            self.note_end();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        let end = self.inner.is_end_stream();
        if end {
            self.note_end();
        }
        end
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// An IO that counts into its connection's [`Wire`] and fails once it is cut.
struct Counted<IO> {
    io: IO,
    wire: Arc<Wire>,
}

fn cut_error() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the request was cut")
}

impl<IO: AsyncRead + Unpin> AsyncRead for Counted<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Counted<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let mut w = this.wire.0.lock().expect("not poisoned");
        if w.cut {
            return Poll::Ready(Err(cut_error()));
        }
        let r = Pin::new(&mut this.io).poll_write(cx, data);
        if let Poll::Ready(Ok(n)) = r {
            w.bytes += n as u64;
        }
        r
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let mut w = this.wire.0.lock().expect("not poisoned");
        if w.cut {
            return Poll::Ready(Err(cut_error()));
        }
        let r = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = r {
            w.bytes += n as u64;
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let mut w = this.wire.0.lock().expect("not poisoned");
        if w.cut {
            return Poll::Ready(Err(cut_error()));
        }
        let r = Pin::new(&mut this.io).poll_flush(cx);
        if let Poll::Ready(Ok(())) = r {
            w.flushes += 1;
        }
        r
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl Sender {
    pub fn is_closed(&self) -> bool {
        match &self.conn {
            Conn::Http1(s) => s.is_closed(),
            Conn::Http2(s) => s.is_closed(),
        }
    }

    /// Whether requests can share this connection (HTTP/2 streams).
    pub fn is_shared(&self) -> bool {
        matches!(self.conn, Conn::Http2(_))
    }

    /// Another handle on a shared connection; `None` for HTTP/1.1, which carries one request
    /// at a time.
    pub fn share(&self) -> Option<Sender> {
        match &self.conn {
            Conn::Http2(s) => Some(Sender {
                conn: Conn::Http2(s.clone()),
                wire: self.wire.clone(),
            }),
            Conn::Http1(_) => None,
        }
    }

    /// Ready for a request now: an HTTP/1.1 connection whose last response was read, or an
    /// HTTP/2 one with a stream to spare; an error if the server closed it.
    pub async fn ready(&mut self) -> hyper::Result<()> {
        match &mut self.conn {
            Conn::Http1(s) => s.ready().await,
            Conn::Http2(s) => s.ready().await,
        }
    }

    /// How far a request sent from now on gets: take it just before [`Sender::send_marked`].
    pub fn mark(&self) -> Mark {
        Mark {
            wire: self.wire.clone(),
            before: self.wire.now(),
            ended: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Sends `req`, written as for HTTP/1.1 (origin-form target, `Host` header); for HTTP/2
    /// the target becomes `scheme://host/path` (the `:scheme` and `:authority` pseudo-headers)
    /// and `Host` is dropped.
    pub async fn send(
        &mut self,
        req: Request<Full<Bytes>>,
        scheme: &str,
    ) -> hyper::Result<Response<Incoming>> {
        self.send_with(req.map(|inner| Tracked { inner, end: None }), scheme)
            .await
    }

    /// [`Sender::send`], noting on `mark` when the connection takes the body's end.
    pub async fn send_marked(
        &mut self,
        req: Request<Full<Bytes>>,
        scheme: &str,
        mark: &Mark,
    ) -> hyper::Result<Response<Incoming>> {
        let end = Some((mark.wire.clone(), mark.ended.clone()));
        self.send_with(req.map(|inner| Tracked { inner, end }), scheme)
            .await
    }

    async fn send_with(
        &mut self,
        mut req: Request<Tracked>,
        scheme: &str,
    ) -> hyper::Result<Response<Incoming>> {
        match &mut self.conn {
            Conn::Http1(s) => s.send_request(req).await,
            Conn::Http2(s) => {
                if let Some(host) = req.headers_mut().remove(hyper::header::HOST)
                    && let Ok(host) = host.to_str()
                {
                    let pq = req.uri().path_and_query().map_or("/", |p| p.as_str());
                    if let Ok(uri) = format!("{scheme}://{host}{pq}").parse() {
                        *req.uri_mut() = uri;
                    }
                }
                *req.version_mut() = hyper::Version::HTTP_2;
                s.send_request(req).await
            }
        }
    }
}

/// An HTTP/1.1 client connection over `io`, driven by its own task.
pub async fn http1<IO>(io: IO) -> hyper::Result<Sender>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let wire = Arc::new(Wire::default());
    let io = Counted {
        io,
        wire: wire.clone(),
    };
    let (sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io)).await?;
    tokio::spawn(conn);
    Ok(Sender {
        conn: Conn::Http1(sender),
        wire,
    })
}

/// A client connection over an established TLS session, in the protocol the server chose.
pub async fn over_tls<IO>(tls: tokio_rustls::client::TlsStream<IO>) -> hyper::Result<Sender>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    if tls.get_ref().1.alpn_protocol() == Some(b"h2") {
        let wire = Arc::new(Wire::default());
        let io = Counted {
            io: tls,
            wire: wire.clone(),
        };
        let exec = hyper_util::rt::TokioExecutor::new();
        let (sender, conn) =
            hyper::client::conn::http2::handshake(exec, hyper_util::rt::TokioIo::new(io)).await?;
        tokio::spawn(conn);
        return Ok(Sender {
            conn: Conn::Http2(sender),
            wire,
        });
    }
    http1(tls).await
}
