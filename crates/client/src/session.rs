//! The protocol session as data: no socket, no clock. A driver hands it every line it reads
//! and writes every line it returns; the session numbers requests, matches replies to them,
//! keeps what a new connection must be told again, and refuses locally what the gate would
//! refuse without an id.
//!
//! What survives a closed connection ([`Session::closed`], then [`Session::reconnected`]):
//!
//! * the `hello` (with its run and component), said again first;
//! * every run subscribed to and every `compensations` registration, sent again (their
//!   replies come back as [`Received::Restored`], which carry `subscribe`'s replay of the run's
//!   durable state);
//! * every request in flight that is safe to repeat — `wait` (re-parked), reads, `subscribe`,
//!   `unsubscribe`, `compensations`, `ping` — sent again under its own id;
//! * every other request in flight (`admit`, `start`, `complete`, `cancel`, `decide`, …)
//!   fails with [`ClientError::Interrupted`]: the gate may have acted on it, and only its
//!   caller can tell whether to ask again (an `admit` repeated is a `duplicate`, not the
//!   first verdict).

use crate::error::ClientError;
use estop_protocol::server_line::{ServerLine, parse_server_line};
use estop_protocol::{ErrorCode, Event, Id, Op, ReplyBody, Verb};
use std::collections::BTreeMap;

/// The session's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest request line the gate reads (its `line_bytes_max`, without the newline), until
    /// a hello's reply says the gate's own. A longer request is refused here and never sent.
    pub line_bytes_max: usize,
    /// Requests waiting for replies at once; one more is refused here. Under the gate's
    /// `outstanding_per_connection_max` (1024), so the gate never refuses one for that.
    pub in_flight_max: usize,
    /// Longest line accepted from the gate; a longer one ends the connection.
    pub reply_bytes_max: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            line_bytes_max: estop_protocol::limits::LINE_BYTES_MAX_DEFAULT,
            in_flight_max: 1000,
            reply_bytes_max: 8 << 20,
        }
    }
}

/// Why a request waits for its reply: a caller's, or one the session sent itself to restore
/// the connection.
#[derive(Debug, Clone, PartialEq)]
enum Asker {
    Caller,
    Hello,
    Restore,
}

#[derive(Debug, Clone)]
struct InFlight {
    op: Op,
    asker: Asker,
}

/// What one line from the gate was.
// Each is moved once, from the line it came in on to its owner: boxing the large variants
// would cost an allocation per reply for nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Received {
    /// The reply to a caller's request `id`.
    Reply {
        id: u64,
        result: Result<ReplyBody, ClientError>,
    },
    /// An event of a run subscribed to (or an executor's `compensate`/`lookup`).
    Event(Event),
    /// A refusal the gate could not tie to a request (`"id": null`: a line too long, not
    /// JSON, a revoked token, an idle close): every caller request in flight fails with it.
    Unsolicited {
        failed: Vec<u64>,
        error: ClientError,
    },
    /// The `hello` of a new connection was answered: `Ok` — the connection is restored (the
    /// lines [`Session::reconnected`] returned after the hello are on their way); `Err` — the
    /// gate no longer takes the token, and every caller request failed with it (`failed`).
    Hello {
        result: Result<ReplyBody, ClientError>,
        failed: Vec<u64>,
    },
    /// A subscription or `compensations` registration sent again on a new connection was
    /// answered (for `subscribe`, the reply replays the run's durable state).
    Restored {
        op: Op,
        result: Result<ReplyBody, ClientError>,
    },
    /// A reply to no request in flight (a request failed locally before its reply came).
    Stray,
}

/// One connection's worth of protocol state, and what outlives the connection.
#[derive(Debug)]
pub struct Session {
    limits: Limits,
    next_id: u64,
    in_flight: BTreeMap<u64, InFlight>,
    hello: Option<Op>,
    /// Standing registrations said again on every new connection: `subscribe` by run,
    /// `compensations` by its filter.
    standing: BTreeMap<String, Op>,
}

impl Session {
    pub fn new(limits: Limits) -> Session {
        Session {
            limits,
            next_id: 0,
            in_flight: BTreeMap::new(),
            hello: None,
            standing: BTreeMap::new(),
        }
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Requests waiting for their replies.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Numbers `op` and returns its id and line (with its newline), or refuses it here: a line
    /// over the gate's bound, or too many requests in flight. A `hello` is remembered and said
    /// again on every new connection; so are `subscribe` and `compensations` (until
    /// `unsubscribe`).
    pub fn request(&mut self, op: Op) -> Result<(u64, Vec<u8>), ClientError> {
        if self.in_flight.len() >= self.limits.in_flight_max {
            return Err(ClientError::TooManyInFlight {
                max: self.limits.in_flight_max,
            });
        }
        let line = self.encode(&op, self.next_id + 1)?;
        self.next_id += 1;
        let id = self.next_id;
        self.remember(&op);
        self.in_flight.insert(
            id,
            InFlight {
                op,
                asker: Asker::Caller,
            },
        );
        Ok((id, line))
    }

    /// Takes the next id without a request, for a line the caller writes by hand (tests of
    /// the wire itself); its reply is [`Received::Stray`].
    pub fn take_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn encode(&self, op: &Op, id: u64) -> Result<Vec<u8>, ClientError> {
        let line = op.to_line(&Id::from_u64(id));
        let bytes = line.len() - 1;
        if bytes > self.limits.line_bytes_max {
            return Err(ClientError::LineTooLong {
                bytes,
                max: self.limits.line_bytes_max,
            });
        }
        Ok(line)
    }

    fn remember(&mut self, op: &Op) {
        match op {
            Op::Hello { .. } => self.hello = Some(op.clone()),
            Op::Subscribe { run } => {
                self.standing.insert(format!("s:{run}"), op.clone());
            }
            Op::Unsubscribe { run } => {
                self.standing.remove(&format!("s:{run}"));
            }
            Op::Compensations { run, tool } => {
                let k = format!("c:{:?}:{:?}", run.as_ref().map(|r| r.to_string()), tool);
                self.standing.insert(k, op.clone());
            }
            _ => {}
        }
    }

    /// Forgets a request whose caller no longer waits for it (its reply will be `Stray`).
    pub fn abandon(&mut self, id: u64) {
        self.in_flight.remove(&id);
    }

    /// Reads one line the gate sent (without its newline).
    pub fn receive(&mut self, line: &[u8]) -> Received {
        let parsed = match parse_server_line(line) {
            Ok(p) => p,
            Err(e) => {
                let error =
                    ClientError::Protocol(format!("{e}: {}", String::from_utf8_lossy(line)));
                return self.fail_callers(error);
            }
        };
        let reply = match parsed {
            ServerLine::Event(e) => return Received::Event(e),
            ServerLine::Reply(r) => r,
        };
        let Some(id) = reply.id.as_u64() else {
            return self.fail_callers(refusal(&reply));
        };
        let Some(asked) = self.in_flight.remove(&id) else {
            return Received::Stray;
        };
        let result = if reply.ok {
            ReplyBody::decode(asked.op.verb(), &reply)
                .map_err(|e| ClientError::Protocol(format!("{e}: {}", reply.raw)))
        } else {
            Err(refusal(&reply))
        };
        match asked.asker {
            Asker::Caller => {
                if result.is_err() && asked.op.verb() == Verb::Hello {
                    // A token the gate refused is not said again on a new connection.
                    self.hello = None;
                }
                self.learn(&result);
                Received::Reply { id, result }
            }
            Asker::Restore => Received::Restored {
                op: asked.op,
                result,
            },
            Asker::Hello => {
                self.learn(&result);
                let failed = match &result {
                    Ok(_) => Vec::new(),
                    Err(e) => self.fail_all(e),
                };
                Received::Hello { result, failed }
            }
        }
    }

    /// A hello's reply says the gate's line bound: longer requests are refused here from now on.
    fn learn(&mut self, result: &Result<ReplyBody, ClientError>) {
        if let Ok(ReplyBody::Hello(h)) = result
            && let Some(max) = h.line_bytes_max
        {
            self.limits.line_bytes_max = max;
        }
    }

    /// Every caller request in flight fails with `error` (the session's own too).
    fn fail_callers(&mut self, error: ClientError) -> Received {
        let failed = self.fail_all(&error);
        Received::Unsolicited { failed, error }
    }

    fn fail_all(&mut self, _error: &ClientError) -> Vec<u64> {
        std::mem::take(&mut self.in_flight)
            .into_iter()
            .filter(|(_, f)| f.asker == Asker::Caller)
            .map(|(id, _)| id)
            .collect()
    }

    /// The connection closed. Returns the caller requests that fail with
    /// [`ClientError::Interrupted`] (those not safe to repeat), by id and verb; the others
    /// stay in flight, to go out again from [`Session::reconnected`].
    pub fn closed(&mut self) -> Vec<(u64, Verb)> {
        let mut failed = Vec::new();
        self.in_flight.retain(|id, f| {
            let keep = f.asker == Asker::Caller && repeatable(f.op.verb());
            if f.asker == Asker::Caller && !keep {
                failed.push((*id, f.op.verb()));
            }
            keep
        });
        failed
    }

    /// The lines a new connection starts with, in order: the `hello` again (if one was said),
    /// every standing registration, then every request still in flight under its own id.
    /// Call after [`Session::closed`].
    pub fn reconnected(&mut self) -> Vec<u8> {
        let mut out = Vec::new();
        let mut lines = Vec::new();
        if let Some(hello) = self.hello.clone() {
            lines.push((hello, Asker::Hello));
        }
        for op in self.standing.values() {
            lines.push((op.clone(), Asker::Restore));
        }
        for (op, asker) in lines {
            self.next_id += 1;
            // Said before on a connection, so within the bound.
            out.extend(op.to_line(&Id::from_u64(self.next_id)));
            self.in_flight.insert(self.next_id, InFlight { op, asker });
        }
        for (id, f) in &self.in_flight {
            if f.asker == Asker::Caller {
                out.extend(f.op.to_line(&Id::from_u64(*id)));
            }
        }
        out
    }

    /// Fails every caller request still in flight (the caller gave up on the gate).
    pub fn give_up(&mut self) -> Vec<u64> {
        self.fail_all(&ClientError::Closed)
    }
}

/// Whether a request may be sent again on a new connection without changing what it means:
/// reads, waits and registrations. Everything that may change the record is not.
pub fn repeatable(verb: Verb) -> bool {
    matches!(
        verb,
        Verb::Wait
            | Verb::Subscribe
            | Verb::Unsubscribe
            | Verb::Status
            | Verb::Ping
            | Verb::Runs
            | Verb::Pending
            | Verb::Report
            | Verb::Ledger
            | Verb::Compensations
    )
}

/// The typed refusal a reply carries (or a protocol error when it carries none).
fn refusal(reply: &estop_protocol::ClientReply) -> ClientError {
    match &reply.error {
        None => ClientError::Protocol(format!("a refusal without an error: {}", reply.raw)),
        Some(e) => match e.kind() {
            Some(code) => ClientError::Refused {
                code,
                message: e.message.clone(),
            },
            None => ClientError::RefusedUnknown {
                code: e.code.clone(),
                message: e.message.clone(),
            },
        },
    }
}

/// Whether a refusal means the token is no longer good on any connection (reconnecting is
/// pointless).
pub fn is_fatal(e: &ClientError) -> bool {
    matches!(
        e.code(),
        Some(ErrorCode::Unauthenticated | ErrorCode::Forbidden)
    )
}
