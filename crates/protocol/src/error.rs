//! The stable error codes of protocol v1: every `"ok": false` reply carries one of these.
//! Each code is documented in docs/PROTOCOL.md (meaning, cause, what to do).

use serde::{Deserialize, Serialize};

macro_rules! codes {
    ($($(#[$doc:meta])* $variant:ident = $name:literal),+ $(,)?) => {
        /// A stable, machine-readable error code. New codes may be added; existing ones never
        /// change meaning.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum ErrorCode { $($(#[$doc])* $variant),+ }

        impl ErrorCode {
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant),+];
            pub fn as_str(self) -> &'static str {
                match self { $(ErrorCode::$variant => $name),+ }
            }
            pub fn parse(s: &str) -> Option<ErrorCode> {
                match s { $($name => Some(ErrorCode::$variant),)+ _ => None }
            }
        }
    };
}

codes! {
    /// The line is not valid JSON, or not a JSON object.
    BadJson = "bad_json",
    /// The `op` names no verb of this protocol version.
    UnknownOp = "unknown_op",
    /// A required field is absent (or `null`).
    MissingField = "missing_field",
    /// A field has the wrong type, an out-of-range value, or conflicts with another field.
    InvalidField = "invalid_field",
    /// The line is longer than the server's `line_bytes_max`.
    LineTooLong = "line_too_long",
    /// No successful `hello` yet on this connection, or the token in `hello` is not known.
    Unauthenticated = "unauthenticated",
    /// The verb needs the operator role.
    Forbidden = "forbidden",
    /// No such run or effect visible to this principal.
    NotFound = "not_found",
    /// `decide` on an effect that is not awaiting approval (decided, expired, voided,
    /// sibling-held, or never held); nothing was written.
    NotPending = "not_pending",
    /// `start`/`complete` presented a token that was not issued for this effect.
    BadToken = "bad_token",
    /// The request conflicts with recorded state: a token name in use, a second approval by the
    /// same principal, `complete` of an effect never started or already complete, an existing
    /// run given another parent.
    Conflict = "conflict",
    /// An admit sent only a digest, but the policy has a `when` condition for this tool and
    /// needs the arguments.
    ArgsRequired = "args_required",
    /// A bound was reached (runs, pending approvals per run, subscriptions, connections).
    LimitExceeded = "limit_exceeded",
    /// The gate cannot make changes durable right now (disk full, fsync failure, shutting
    /// down); nothing was applied. Retry later.
    Unavailable = "unavailable",
    /// A bug in the gate; nothing was applied.
    Internal = "internal",
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The `error` object of an `"ok": false` reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireError {
    pub code: String,
    pub message: String,
}

impl WireError {
    /// The code as a known variant; `None` for a code from a newer server.
    pub fn kind(&self) -> Option<ErrorCode> {
        ErrorCode::parse(&self.code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for &c in ErrorCode::ALL {
            assert_eq!(ErrorCode::parse(c.as_str()), Some(c));
        }
        assert_eq!(ErrorCode::parse("nope"), None);
    }
}
