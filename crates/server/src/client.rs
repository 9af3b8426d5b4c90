//! A small blocking client for protocol v1 over the Unix socket or TCP: what the CLI and the
//! end-to-end tests use to talk to a daemon.
//!
//! It speaks typed requests and replies: a request is a protocol [`Op`], written by the
//! protocol crate's own encoder ([`Op::to_line`]); a reply is decoded by the protocol crate's
//! parser into the payload type of the verb that was asked ([`ReplyBody`]), and a refusal is a
//! typed [`ClientError::Refused`] with its [`ErrorCode`]. Tests of the wire itself (malformed
//! lines, exact shapes) have the `raw_*` methods, which send and read lines as bytes.

use estop_protocol::server_line::{ServerLine, parse_server_line};
use estop_protocol::{ErrorCode, Event, HelloReply, Id, Op, ReplyBody, Secret};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to {target}: {source} (is `estop serve` running?)")]
    Connect {
        target: String,
        source: std::io::Error,
    },
    #[error("connection to the gate failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("the gate sent a line that is not protocol v1: {0}")]
    Protocol(String),
    #[error("the gate closed the connection")]
    Closed,
    /// The gate answered `"ok": false` with one of protocol v1's codes.
    #[error("{code}: {message}")]
    Refused { code: ErrorCode, message: String },
    /// The gate answered `"ok": false` with a code this client does not know (a newer gate).
    #[error("{code}: {message}")]
    RefusedUnknown { code: String, message: String },
}

impl ClientError {
    /// The refusal's code, when the gate refused with a known one.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Refused { code, .. } => Some(*code),
            _ => None,
        }
    }
}

trait Stream: std::io::Read + std::io::Write + Send {}
impl<T: std::io::Read + std::io::Write + Send> Stream for T {}

pub struct Client {
    reader: BufReader<Box<dyn Stream>>,
    writer: Box<dyn Stream>,
    /// The id of the last request sent (ids count up from 1).
    last_id: u64,
    /// Events that arrived while waiting for a reply.
    pub events: Vec<Event>,
}

impl Client {
    /// Connects to `target`: a socket path, or `host:port` for TCP.
    pub fn connect(target: &str) -> Result<Client, ClientError> {
        let connect_err = |source| ClientError::Connect {
            target: target.to_string(),
            source,
        };
        let (r, w): (Box<dyn Stream>, Box<dyn Stream>) =
            if target.contains('/') || Path::new(target).exists() {
                let s = UnixStream::connect(target).map_err(connect_err)?;
                (Box::new(s.try_clone()?), Box::new(s))
            } else {
                let s = TcpStream::connect(target).map_err(connect_err)?;
                s.set_nodelay(true)?;
                (Box::new(s.try_clone()?), Box::new(s))
            };
        Ok(Client {
            reader: BufReader::new(r),
            writer: w,
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
        self.last_id += 1;
        let id = self.last_id;
        // The encoded line ends in its newline.
        self.writer.write_all(&op.to_line(&Id::from_u64(id)))?;
        self.writer.flush()?;
        let reply = loop {
            match self.read_server_line()? {
                ServerLine::Event(e) => self.events.push(e),
                // A reply without an id answers a line the gate could not read (or says why
                // it closes the connection): it is this request's answer too.
                ServerLine::Reply(r) if r.id.as_u64() == Some(id) || r.id.is_null() => break r,
                ServerLine::Reply(_) => continue,
            }
        };
        if !reply.ok {
            let e = reply.error.ok_or_else(|| {
                ClientError::Protocol(format!("a refusal without an error: {}", reply.raw))
            })?;
            return Err(match e.kind() {
                Some(code) => ClientError::Refused {
                    code,
                    message: e.message,
                },
                None => ClientError::RefusedUnknown {
                    code: e.code,
                    message: e.message,
                },
            });
        }
        ReplyBody::decode(op.verb(), &reply)
            .map_err(|e| ClientError::Protocol(format!("{e}: {}", reply.raw)))
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

    /// Blocks until the next event line (`None` if a stray reply came instead).
    pub fn next_event(&mut self) -> Result<Option<Event>, ClientError> {
        if !self.events.is_empty() {
            return Ok(Some(self.events.remove(0)));
        }
        match self.read_server_line()? {
            ServerLine::Event(e) => Ok(Some(e)),
            ServerLine::Reply(_) => Ok(None),
        }
    }

    /// For tests of the wire itself: takes an id for a request the test writes by hand, so it
    /// never collides with the ids of typed requests on the same connection.
    pub fn raw_next_id(&mut self) -> u64 {
        self.last_id += 1;
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
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Err(ClientError::Closed);
        }
        line.truncate(line.trim_end_matches(['\n', '\r']).len());
        Ok(line)
    }

    fn read_server_line(&mut self) -> Result<ServerLine, ClientError> {
        let line = self.raw_read_line()?;
        parse_server_line(line.as_bytes())
            .map_err(|e| ClientError::Protocol(format!("{e}: {line}")))
    }
}
