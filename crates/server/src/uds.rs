//! A Unix stream socket registered with the runtime for readability only.
//!
//! Linux wakes every epoll that watches a Unix socket for writability each time the peer reads
//! from it (`unix_write_space` has no "was the writer ever blocked" check, unlike TCP). A
//! `tokio::net::UnixStream` is always registered for both directions, so on a request/reply
//! connection each side is woken once for the reply it waits for and once more, for nothing,
//! when the other side reads. On this project's VMs such a wakeup costs as much as the useful
//! one. [`UnixConn`] registers for readability only and writes straight to the non-blocking
//! socket; only when the socket buffer is full does it register (a duplicate of the descriptor)
//! for writability, until the write goes through.

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

/// A connected Unix stream socket; see the module documentation.
#[derive(Debug)]
pub struct UnixConn {
    io: AsyncFd<UnixStream>,
    /// Registered for writability only while a write would block.
    write_blocked: Option<AsyncFd<OwnedFd>>,
}

impl UnixConn {
    /// Wraps a connected socket (it is made non-blocking). Needs a tokio runtime with IO.
    pub fn new(stream: UnixStream) -> io::Result<UnixConn> {
        stream.set_nonblocking(true)?;
        Ok(UnixConn {
            io: register_stream(stream)?,
            write_blocked: None,
        })
    }

    /// Takes a socket over from tokio (deregistering it there).
    pub fn from_tokio(stream: tokio::net::UnixStream) -> io::Result<UnixConn> {
        UnixConn::new(stream.into_std()?)
    }

    /// Connects to `path`.
    pub async fn connect(path: impl AsRef<std::path::Path>) -> io::Result<UnixConn> {
        UnixConn::from_tokio(tokio::net::UnixStream::connect(path).await?)
    }
}

impl AsFd for UnixConn {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.io.get_ref().as_fd()
    }
}

impl AsyncRead for UnixConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            let mut guard = ready!(this.io.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            let want = unfilled.len();
            match guard.try_io(|s| retry_interrupted(|| s.get_ref().read(unfilled))) {
                Ok(Ok(n)) => {
                    if n > 0 && n < want {
                        // A short read drained the socket: the next read would only say
                        // WouldBlock (tokio does the same; an event that arrived meanwhile is
                        // not lost, its readiness has a newer tick).
                        guard.clear_ready();
                    }
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => {}
            }
        }
    }
}

impl AsyncWrite for UnixConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        loop {
            let Some(blocked) = &this.write_blocked else {
                match retry_interrupted(|| this.io.get_ref().write(data)) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        let fd = this.io.get_ref().as_fd().try_clone_to_owned()?;
                        this.write_blocked = Some(register_for_writing(fd)?);
                        continue;
                    }
                    r => return Poll::Ready(r),
                }
            };
            let mut guard = ready!(blocked.poll_write_ready(cx))?;
            let mut stream = this.io.get_ref();
            if let Ok(r) = guard.try_io(|_| retry_interrupted(|| stream.write(data))) {
                // Written (or failed for good): stop watching for writability.
                this.write_blocked = None;
                return Poll::Ready(r);
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(
            match self.io.get_ref().shutdown(std::net::Shutdown::Write) {
                Err(e) if e.kind() == io::ErrorKind::NotConnected => Ok(()),
                r => r,
            },
        )
    }
}

/// Registers the socket for readability.
#[allow(unsafe_code)]
fn register_stream(stream: UnixStream) -> io::Result<AsyncFd<UnixStream>> {
    // SAFETY: a `UnixStream` owns its descriptor and returns that same one from `as_raw_fd`
    // until it is dropped, which is all `register_with_interest` asks of it.
    Ok(unsafe { AsyncFd::register_with_interest(stream, Interest::READABLE) }?)
}

/// Registers a duplicate of the socket's descriptor for writability.
#[allow(unsafe_code)]
fn register_for_writing(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: an `OwnedFd` owns its descriptor and returns that same one from `as_raw_fd` until
    // it is dropped.
    Ok(unsafe { AsyncFd::register_with_interest(fd, Interest::WRITABLE) }?)
}

fn retry_interrupted<T>(mut f: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    loop {
        match f() {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            r => return r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn a_write_larger_than_the_socket_buffer_waits_for_the_reader_and_arrives_whole() {
        let (a, b) = UnixStream::pair().unwrap();
        let (mut a, mut b) = (UnixConn::new(a).unwrap(), UnixConn::new(b).unwrap());
        let data: Vec<u8> = (0..8 << 20).map(|i| (i % 251) as u8).collect();
        let expected = data.clone();
        let writer = tokio::spawn(async move {
            a.write_all(&data).await.unwrap();
            a.shutdown().await.unwrap();
            a
        });
        let mut got = Vec::new();
        b.read_to_end(&mut got).await.unwrap();
        let a = writer.await.unwrap();
        assert_eq!(got.len(), expected.len());
        assert!(got == expected, "bytes arrive in order, none lost");
        assert!(
            a.write_blocked.is_none(),
            "the writability registration is dropped once the write went through"
        );
    }

    #[tokio::test]
    async fn request_reply_in_both_directions_and_eof() {
        let (a, b) = UnixStream::pair().unwrap();
        let (mut a, mut b) = (UnixConn::new(a).unwrap(), UnixConn::new(b).unwrap());
        for i in 0..1000u32 {
            a.write_all(&i.to_le_bytes()).await.unwrap();
            let mut x = [0u8; 4];
            b.read_exact(&mut x).await.unwrap();
            b.write_all(&(u32::from_le_bytes(x) + 1).to_le_bytes())
                .await
                .unwrap();
            a.read_exact(&mut x).await.unwrap();
            assert_eq!(u32::from_le_bytes(x), i + 1);
        }
        drop(a);
        let mut rest = Vec::new();
        assert_eq!(
            b.read_to_end(&mut rest).await.unwrap(),
            0,
            "EOF once the peer is gone"
        );
    }
}
