//! The blocking driver: one connection, one request at a time, for the CLI and tests. It does
//! not reconnect (each CLI command is one short connection); a closed connection is an error.
//!
//! It speaks typed requests and replies through the [`Session`]: a request is a protocol
//! [`Op`]; a reply is decoded into the payload type of the verb that was asked
//! ([`ReplyBody`]); a refusal is a typed [`ClientError::Refused`] with its code, and a refusal
//! the gate could not tie to a request (`"id": null`) fails the request in flight. Tests of the
//! wire itself (malformed lines, exact shapes) have the `raw_*` methods.

use crate::error::ClientError;
use crate::session::{Limits, Received, Session};
use estop_protocol::{Event, HelloReply, Op, ReplyBody, Secret};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;

trait Stream: Read + Write + Send {}
impl<T: Read + Write + Send> Stream for T {}

pub struct Client {
    reader: BufReader<Box<dyn Stream>>,
    writer: Box<dyn Stream>,
    session: Session,
    /// The id of the last request sent.
    last_id: u64,
    /// Events that arrived while waiting for a reply.
    pub events: Vec<Event>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("last_id", &self.last_id)
            .finish()
    }
}

/// A connection's read and write halves.
type Halves = (Box<dyn Stream>, Box<dyn Stream>);

/// Opens `target`: a socket path, or `host:port` for TCP.
fn open(target: &str) -> Result<Halves, ClientError> {
    let connect_err = |e: std::io::Error| ClientError::Connect {
        target: target.to_string(),
        message: e.to_string(),
    };
    Ok(if crate::is_socket_path(target) {
        let s = UnixStream::connect(target).map_err(connect_err)?;
        (Box::new(s.try_clone()?), Box::new(s))
    } else {
        let s = TcpStream::connect(target).map_err(connect_err)?;
        s.set_nodelay(true)?;
        (Box::new(s.try_clone()?), Box::new(s))
    })
}

impl Client {
    /// Connects to `target`: a socket path, or `host:port` for TCP.
    pub fn connect(target: &str) -> Result<Client, ClientError> {
        Client::connect_with(target, Limits::default())
    }

    /// [`Client::connect`] with other bounds (the gate's `line_bytes_max`, when not the default).
    pub fn connect_with(target: &str, limits: Limits) -> Result<Client, ClientError> {
        let (r, w) = open(target)?;
        Ok(Client {
            reader: BufReader::new(r),
            writer: w,
            session: Session::new(limits),
            last_id: 0,
            events: Vec::new(),
        })
    }

    /// Connects and authenticates; a token the gate refuses is [`ClientError::Refused`].
    pub fn connect_as(target: &str, token: &str) -> Result<Client, ClientError> {
        let mut c = Client::connect(target)?;
        c.hello(token)?;
        Ok(c)
    }

    /// Authenticates this connection.
    pub fn hello(&mut self, token: &str) -> Result<HelloReply, ClientError> {
        self.ask(&Op::Hello {
            token: Secret::new(token),
            run: None,
            component: Default::default(),
        })
    }

    /// Sends one request and returns its reply's payload, decoded as the type its verb answers
    /// with; a refusal is an error. Events that arrive first are kept in `events`.
    pub fn request(&mut self, op: &Op) -> Result<ReplyBody, ClientError> {
        let (id, line) = self.session.request(op.clone())?;
        self.last_id = id;
        self.writer.write_all(&line)?;
        self.writer.flush()?;
        loop {
            let line = self.read_line()?;
            match self.session.receive(line.as_bytes()) {
                Received::Event(e) => self.events.push(e),
                Received::Reply { id: got, result } if got == id => return result,
                Received::Unsolicited { failed, error } if failed.contains(&id) => {
                    return Err(error);
                }
                _ => {}
            }
        }
    }

    /// [`Client::request`], with the payload as the type the caller expects of its verb
    /// (`RunsReply` for `runs`, …); another payload is a protocol error.
    pub fn ask<T: TryFrom<ReplyBody, Error = ReplyBody>>(
        &mut self,
        op: &Op,
    ) -> Result<T, ClientError> {
        T::try_from(self.request(op)?).map_err(|other| {
            ClientError::Protocol(format!("unexpected reply to {}: {other:?}", op.verb()))
        })
    }

    /// The id the last request went out with (`None` before the first).
    pub fn last_id(&self) -> Option<u64> {
        (self.last_id > 0).then_some(self.last_id)
    }

    /// Blocks until the next event line (`None` if a reply came instead).
    pub fn next_event(&mut self) -> Result<Option<Event>, ClientError> {
        if !self.events.is_empty() {
            return Ok(Some(self.events.remove(0)));
        }
        let line = self.read_line()?;
        match self.session.receive(line.as_bytes()) {
            Received::Event(e) => Ok(Some(e)),
            Received::Unsolicited { error, .. } => Err(error),
            _ => Ok(None),
        }
    }

    /// For tests of the wire itself: takes an id for a request the test writes by hand, so it
    /// never collides with the ids of typed requests on the same connection.
    pub fn raw_next_id(&mut self) -> u64 {
        self.last_id = self.session.take_id();
        self.last_id
    }

    /// For tests of the wire itself: writes `line` exactly as given (malformed input
    /// included), then a newline.
    pub fn raw_send_line(&mut self, line: &[u8]) -> Result<(), ClientError> {
        self.writer.write_all(line)?;
        self.writer.write_all(b"\n")?;
        self.writer.flush()?;
        Ok(())
    }

    /// For tests of the wire itself: the next line the gate sent, event or reply, as it came
    /// (without its newline).
    pub fn raw_read_line(&mut self) -> Result<String, ClientError> {
        self.read_line()
    }

    /// The next line, bounded by the session's `reply_bytes_max`.
    fn read_line(&mut self) -> Result<String, ClientError> {
        let max = self.session.limits().reply_bytes_max;
        let mut line = Vec::new();
        let n = (&mut self.reader)
            .take(max as u64 + 1)
            .read_until(b'\n', &mut line)?;
        if n == 0 {
            return Err(ClientError::Closed);
        }
        if !line.ends_with(b"\n") {
            return Err(if line.len() > max {
                ClientError::Protocol(format!("a line longer than {max} bytes"))
            } else {
                ClientError::Closed
            });
        }
        line.pop();
        if line.ends_with(b"\r") {
            line.pop();
        }
        String::from_utf8(line).map_err(|e| ClientError::Protocol(e.to_string()))
    }
}
