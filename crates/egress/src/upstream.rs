//! One client connection from the proxy to an upstream origin, over HTTP/1.1 or HTTP/2. Which
//! one is the origin's choice: over TLS the proxy offers `h2` and `http/1.1` (ALPN) and speaks
//! what the server picks; plain `http://` origins get HTTP/1.1 (no upgrade, no prior
//! knowledge). An HTTP/2 connection carries many requests at once, so the pool hands out a
//! clone of it rather than the connection itself (`pool.rs`).

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response};

type H1 = hyper::client::conn::http1::SendRequest<Full<Bytes>>;
type H2 = hyper::client::conn::http2::SendRequest<Full<Bytes>>;

/// The sending half of an upstream connection; its connection is driven by its own task.
#[derive(Debug)]
pub enum Sender {
    Http1(H1),
    Http2(H2),
}

/// The ALPN protocol ids the proxy offers upstream, most preferred first.
pub const ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

impl Sender {
    pub fn is_closed(&self) -> bool {
        match self {
            Sender::Http1(s) => s.is_closed(),
            Sender::Http2(s) => s.is_closed(),
        }
    }

    /// Whether requests can share this connection (HTTP/2 streams).
    pub fn is_shared(&self) -> bool {
        matches!(self, Sender::Http2(_))
    }

    /// Another handle on a shared connection; `None` for HTTP/1.1, which carries one request
    /// at a time.
    pub fn share(&self) -> Option<Sender> {
        match self {
            Sender::Http2(s) => Some(Sender::Http2(s.clone())),
            Sender::Http1(_) => None,
        }
    }

    /// Ready for a request now: an HTTP/1.1 connection whose last response was read, or an
    /// HTTP/2 one with a stream to spare; an error if the server closed it.
    pub async fn ready(&mut self) -> hyper::Result<()> {
        match self {
            Sender::Http1(s) => s.ready().await,
            Sender::Http2(s) => s.ready().await,
        }
    }

    /// Sends `req`, written as for HTTP/1.1 (origin-form target, `Host` header); for HTTP/2
    /// the target becomes `scheme://host/path` (the `:scheme` and `:authority` pseudo-headers)
    /// and `Host` is dropped.
    pub async fn send(
        &mut self,
        mut req: Request<Full<Bytes>>,
        scheme: &str,
    ) -> hyper::Result<Response<Incoming>> {
        match self {
            Sender::Http1(s) => s.send_request(req).await,
            Sender::Http2(s) => {
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
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io)).await?;
    tokio::spawn(conn);
    Ok(Sender::Http1(sender))
}

/// A client connection over an established TLS session, in the protocol the server chose.
pub async fn over_tls<IO>(tls: tokio_rustls::client::TlsStream<IO>) -> hyper::Result<Sender>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    if tls.get_ref().1.alpn_protocol() == Some(b"h2") {
        let exec = hyper_util::rt::TokioExecutor::new();
        let (sender, conn) =
            hyper::client::conn::http2::handshake(exec, hyper_util::rt::TokioIo::new(tls)).await?;
        tokio::spawn(conn);
        return Ok(Sender::Http2(sender));
    }
    http1(tls).await
}
