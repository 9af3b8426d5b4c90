//! The request id: a JSON scalar chosen by the client and echoed byte for byte in the reply.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserialize, Deserializer, Visitor};
use serde::ser::{Serialize, Serializer};

/// Longest request id accepted, in bytes of its JSON text (quotes and escapes included).
pub const ID_BYTES_MAX: usize = 128;

/// A request id as JSON text: a number, a string or `null`.
///
/// The server keeps the exact text the client sent (`1.50`, `"\u0041"`) so that the reply carries
/// the same bytes back; clients that compare ids as parsed values or as text both match.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Id(Cow<'static, str>);

/// Why a raw id was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IdProblem {
    TooLong,
    NotScalar,
}

impl IdProblem {
    pub(crate) fn why(self) -> String {
        match self {
            IdProblem::TooLong => format!("longer than {ID_BYTES_MAX} bytes"),
            IdProblem::NotScalar => "must be a number, a string or null".to_string(),
        }
    }
}

impl Id {
    /// The id of a request that had none (or whose id could not be read).
    pub const NULL: Id = Id(Cow::Borrowed("null"));

    /// A numeric id, as clients usually send.
    pub fn from_u64(n: u64) -> Id {
        Id(Cow::Owned(n.to_string()))
    }

    /// A string id; the text is JSON-escaped.
    pub fn from_text(s: &str) -> Id {
        Id(Cow::Owned(serde_json::Value::from(s).to_string()))
    }

    /// Checks raw JSON text (already known to be one well-formed JSON value) and keeps it.
    pub(crate) fn from_raw_json(raw: &str) -> Result<Id, IdProblem> {
        let raw = raw.trim_matches(|c| matches!(c, ' ' | '\t' | '\n' | '\r'));
        if raw.len() > ID_BYTES_MAX {
            return Err(IdProblem::TooLong);
        }
        match raw.as_bytes().first() {
            Some(b'"' | b'-' | b'0'..=b'9') => Ok(Id(Cow::Owned(raw.to_string()))),
            Some(b'n') => Ok(Id::NULL),
            _ => Err(IdProblem::NotScalar),
        }
    }

    /// The JSON text of the id, exactly as it goes on the wire.
    pub fn as_json(&self) -> &str {
        &self.0
    }

    pub fn is_null(&self) -> bool {
        self.0 == "null"
    }

    /// The id as an unsigned integer, when it is one.
    pub fn as_u64(&self) -> Option<u64> {
        self.0.parse().ok()
    }
}

impl Default for Id {
    fn default() -> Self {
        Id::NULL
    }
}

impl fmt::Debug for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Id({})", self.0)
    }
}

impl fmt::Display for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for Id {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        // Re-parse rather than emit raw text so that any serializer (not only serde_json's)
        // produces valid output; the hot reply path writes `as_json` directly instead.
        let value: serde_json::Value =
            serde_json::from_str(&self.0).map_err(serde::ser::Error::custom)?;
        value.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Id {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Id, D::Error> {
        deserializer.deserialize_any(IdVisitor)
    }
}

struct IdVisitor;

impl<'de> Visitor<'de> for IdVisitor {
    type Value = Id;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a number, a string or null")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Id, E> {
        Ok(Id::from_u64(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Id, E> {
        Ok(Id(Cow::Owned(v.to_string())))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Id, E> {
        serde_json::Number::from_f64(v)
            .map(|n| Id(Cow::Owned(n.to_string())))
            .ok_or_else(|| E::custom("id is not a finite number"))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Id, E> {
        Ok(Id::from_text(v))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Id, E> {
        Ok(Id::NULL)
    }
    fn visit_none<E: de::Error>(self) -> Result<Id, E> {
        Ok(Id::NULL)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_ids_are_kept_exactly() {
        assert_eq!(
            Id::from_raw_json("1.50").map(|i| i.as_json().to_string()),
            Ok("1.50".into())
        );
        assert_eq!(
            Id::from_raw_json(r#""\u0041""#).map(|i| i.as_json().to_string()),
            Ok(r#""\u0041""#.into())
        );
        assert_eq!(Id::from_raw_json("null"), Ok(Id::NULL));
        assert_eq!(Id::from_raw_json("true"), Err(IdProblem::NotScalar));
        assert_eq!(Id::from_raw_json("{}"), Err(IdProblem::NotScalar));
        assert_eq!(
            Id::from_raw_json(&"1".repeat(ID_BYTES_MAX + 1)),
            Err(IdProblem::TooLong)
        );
    }

    #[test]
    fn decoded_ids_match_built_ones() {
        let id: Id = serde_json::from_str("7").unwrap_or_default();
        assert_eq!(id, Id::from_u64(7));
        let id: Id = serde_json::from_str(r#""a\"b""#).unwrap_or_default();
        assert_eq!(id, Id::from_text("a\"b"));
        assert_eq!(id.as_json(), r#""a\"b""#);
    }
}
