//! Idle upstream connections of one run's proxy, kept for the next request to the same origin.
//! A request through the proxy would otherwise open a new TCP connection (and for `https` a
//! new TLS session) per request, which costs more than the proxy's own work. Only the
//! connection is shared: every request is still admitted on its own before it is sent, and a
//! pooled connection goes only to the origin (scheme, host, port) it was dialled and checked
//! for. Bounded: `PER_ORIGIN_MAX` idle connections per origin and `ORIGINS_MAX` origins; past
//! either, a connection is closed instead of kept. An HTTP/2 connection is not taken but shared:
//! each request gets a handle on it (a stream of its own), and one connection per origin is kept.

use crate::upstream::Sender;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;

/// Idle connections kept per origin.
pub const PER_ORIGIN_MAX: usize = 16;
/// Origins with idle connections kept at once.
pub const ORIGINS_MAX: usize = 64;

/// Where a connection goes: what the gate admitted, not what it resolved to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Origin {
    pub scheme: String,
    pub host: String,
    pub port: u16,
}

#[derive(Default)]
pub struct Pool {
    idle: Mutex<HashMap<Origin, Vec<(Sender, SocketAddr)>>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("origins", &self.lock().len())
            .finish()
    }
}

impl Pool {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Origin, Vec<(Sender, SocketAddr)>>> {
        self.idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// An idle connection to `origin` that can take a request now, if there is one; closed
    /// ones met on the way are dropped.
    pub async fn take(&self, origin: &Origin) -> Option<(Sender, SocketAddr)> {
        loop {
            let (mut sender, addr) = {
                let mut idle = self.lock();
                let list = idle.get_mut(origin)?;
                let shared = list
                    .last()
                    .and_then(|(s, a)| s.share().map(|s| (s, *a)))
                    .filter(|(s, _)| !s.is_closed());
                let next = shared.or_else(|| list.pop());
                if list.is_empty() {
                    idle.remove(origin);
                }
                next?
            };
            // Ours alone: ready as soon as its last response was read, or an error if the
            // server closed it meanwhile.
            if !sender.is_closed() && sender.ready().await.is_ok() {
                return Some((sender, addr));
            }
        }
    }

    /// Keeps a connection whose response was read whole, if it is still open and there is room.
    pub fn put(&self, origin: Origin, sender: Sender, addr: SocketAddr) {
        if sender.is_closed() {
            return;
        }
        let mut idle = self.lock();
        if !idle.contains_key(&origin) && idle.len() >= ORIGINS_MAX {
            return;
        }
        let list = idle.entry(origin).or_default();
        // The connection another request shares is kept already: a closed one is replaced.
        if sender.is_shared() {
            list.retain(|(s, _)| !s.is_shared() || !s.is_closed());
            if list.iter().any(|(s, _)| s.is_shared()) {
                return;
            }
        }
        if list.len() < PER_ORIGIN_MAX {
            list.push((sender, addr));
        }
    }

    /// Idle connections kept, over every origin.
    pub fn len(&self) -> usize {
        self.lock().values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Closes every idle connection (the run was stopped).
    pub fn clear(&self) {
        self.lock().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A keep-alive server on loopback answering every request `ok`; counts connections.
    async fn server() -> (SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let conns = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = conns.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let mut have = Vec::new();
                    loop {
                        let Ok(n) = s.read(&mut buf).await else {
                            return;
                        };
                        if n == 0 {
                            return;
                        }
                        have.extend_from_slice(&buf[..n]);
                        while let Some(end) = have.windows(4).position(|w| w == b"\r\n\r\n") {
                            have.drain(..end + 4);
                            let reply = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                            if s.write_all(reply).await.is_err() {
                                return;
                            }
                        }
                    }
                });
            }
        });
        (addr, conns)
    }

    async fn get(sender: &mut Sender) -> bytes::Bytes {
        use http_body_util::BodyExt;
        let req = hyper::Request::builder()
            .uri("/")
            .header("host", "upstream.test")
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap();
        let res = sender.send(req, "http").await.unwrap();
        res.into_body().collect().await.unwrap().to_bytes()
    }

    fn origin(host: &str) -> Origin {
        Origin {
            scheme: "http".into(),
            host: host.into(),
            port: 80,
        }
    }

    #[tokio::test]
    async fn a_kept_connection_serves_the_next_request_to_its_origin_only() {
        let (addr, conns) = server().await;
        let pool = Pool::default();
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut sender = crate::upstream::http1(stream).await.unwrap();
        assert_eq!(get(&mut sender).await, "ok");
        pool.put(origin("a.test"), sender, addr);
        assert!(
            pool.take(&origin("b.test")).await.is_none(),
            "another origin"
        );
        let (mut again, at) = pool.take(&origin("a.test")).await.expect("kept");
        assert_eq!(at, addr);
        assert_eq!(get(&mut again).await, "ok");
        assert_eq!(conns.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert!(
            pool.take(&origin("a.test")).await.is_none(),
            "taken, not shared"
        );
    }

    /// A connection the server closed after its response is never handed out: the next
    /// request dials anew rather than failing on a dead connection.
    #[tokio::test]
    async fn a_connection_the_server_closed_is_not_handed_out() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let _ = s.read(&mut buf).await;
            let reply = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok";
            let _ = s.write_all(reply).await;
            // Closed here.
        });
        let pool = Pool::default();
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut sender = crate::upstream::http1(stream).await.unwrap();
        assert_eq!(get(&mut sender).await, "ok");
        pool.put(origin("a.test"), sender, addr);
        assert!(pool.take(&origin("a.test")).await.is_none());
        assert!(pool.is_empty());
    }

    #[tokio::test]
    async fn the_pool_is_bounded_per_origin_and_in_origins() {
        let (addr, _) = server().await;
        let pool = Pool::default();
        for i in 0..(ORIGINS_MAX + 2) {
            for _ in 0..2 {
                let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
                let sender = crate::upstream::http1(stream).await.unwrap();
                pool.put(origin(&format!("h{i}.test")), sender, addr);
            }
        }
        assert_eq!(pool.len(), ORIGINS_MAX * 2);
        for _ in 0..(PER_ORIGIN_MAX + 3) {
            let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            let sender = crate::upstream::http1(stream).await.unwrap();
            pool.put(origin("h0.test"), sender, addr);
        }
        assert_eq!(pool.len(), ORIGINS_MAX * 2 - 2 + PER_ORIGIN_MAX);
        pool.clear();
        assert!(pool.is_empty());
    }
}
