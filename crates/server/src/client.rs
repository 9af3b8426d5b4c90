//! A small blocking client for protocol v1 over the Unix socket or TCP: what the CLI and the
//! end-to-end tests use to talk to a daemon.

use estop_protocol::reply::{ServerLine, parse_server_line};
use estop_protocol::{ClientReply, Event};
use serde_json::{Value, json};
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
}

trait Stream: std::io::Read + std::io::Write + Send {}
impl<T: std::io::Read + std::io::Write + Send> Stream for T {}

pub struct Client {
    reader: BufReader<Box<dyn Stream>>,
    writer: Box<dyn Stream>,
    next_id: u64,
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
            next_id: 1,
            events: Vec::new(),
        })
    }

    /// Connects and authenticates.
    pub fn connect_as(target: &str, token: &str) -> Result<Client, ClientError> {
        let mut c = Client::connect(target)?;
        c.call(json!({"op": "hello", "token": token}))?;
        Ok(c)
    }

    /// Sends one request (an `id` is added) and returns its reply; events that arrive first are
    /// kept in `events`.
    pub fn call(&mut self, mut request: Value) -> Result<ClientReply, ClientError> {
        let id = self.next_id;
        self.next_id += 1;
        request["id"] = json!(id);
        self.send_raw(
            &serde_json::to_vec(&request).map_err(|e| ClientError::Protocol(e.to_string()))?,
        )?;
        loop {
            match self.read_line()? {
                ServerLine::Event(e) => self.events.push(e),
                ServerLine::Reply(r) if r.id.as_u64() == Some(id) || r.id.is_null() => {
                    return Ok(r);
                }
                ServerLine::Reply(_) => continue,
            }
        }
    }

    /// Writes raw bytes plus a newline (for tests of malformed input).
    pub fn send_raw(&mut self, line: &[u8]) -> Result<(), ClientError> {
        self.writer.write_all(line)?;
        self.writer.write_all(b"\n")?;
        self.writer.flush()?;
        Ok(())
    }

    pub fn read_line(&mut self) -> Result<ServerLine, ClientError> {
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Err(ClientError::Closed);
        }
        parse_server_line(line.trim_end().as_bytes())
            .map_err(|e| ClientError::Protocol(format!("{e}: {line}")))
    }

    /// Blocks until the next event line (`None` if a stray reply came instead).
    pub fn next_event(&mut self) -> Result<Option<Event>, ClientError> {
        if !self.events.is_empty() {
            return Ok(Some(self.events.remove(0)));
        }
        match self.read_line()? {
            ServerLine::Event(e) => Ok(Some(e)),
            ServerLine::Reply(_) => Ok(None),
        }
    }
}
