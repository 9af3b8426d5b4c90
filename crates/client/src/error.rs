//! What a request can end in other than its reply.

use estop_protocol::ErrorCode;

/// Why a request got no reply payload. `Clone`, so one refusal the gate could not tie to a
/// request (`"id": null`) can fail every request in flight on that connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to {target}: {message} (is `estop serve` running?)")]
    Connect { target: String, message: String },
    #[error("connection to the gate failed: {0}")]
    Io(String),
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
    /// Refused here, never sent: the request's line is longer than the gate reads.
    #[error(
        "the request is {bytes} bytes, longer than the gate's line_bytes_max = {max}; it was not sent"
    )]
    LineTooLong { bytes: usize, max: usize },
    /// Refused here, never sent: this many requests already wait for their replies.
    #[error(
        "{max} requests already wait for the gate's replies on this connection; it was not sent"
    )]
    TooManyInFlight { max: usize },
    /// The connection closed after the request went out and before its reply came: the gate
    /// may or may not have acted on it. (Requests that are safe to repeat are sent again on
    /// the next connection instead; see `Session::reconnected`.)
    #[error(
        "the connection to the gate closed before it answered {verb}; it may or may not have been applied"
    )]
    Interrupted { verb: &'static str },
    /// The gate could not be reached again within the patience the caller set.
    #[error("the gate at {target} has not been reachable for {waited_ms} ms: {last}")]
    Unreachable {
        target: String,
        waited_ms: u64,
        last: String,
    },
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

impl From<std::io::Error> for ClientError {
    fn from(e: std::io::Error) -> ClientError {
        ClientError::Io(e.to_string())
    }
}
