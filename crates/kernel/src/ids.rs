//! Typed identifiers, parsed at the edge: a value of these types is always valid.

use std::fmt;

/// Longest run id, effect key, tool name or principal name, in bytes.
pub const NAME_BYTES_MAX: usize = 200;

/// Why a string was refused as an identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("{what} is empty")]
    Empty { what: &'static str },
    #[error("{what} is {len} bytes, longer than the limit of {max}")]
    TooLong {
        what: &'static str,
        len: usize,
        max: usize,
    },
    #[error("{what} contains a control character")]
    Control { what: &'static str },
}

fn check(what: &'static str, s: &str) -> Result<(), IdError> {
    if s.is_empty() {
        return Err(IdError::Empty { what });
    }
    if s.len() > NAME_BYTES_MAX {
        return Err(IdError::TooLong {
            what,
            len: s.len(),
            max: NAME_BYTES_MAX,
        });
    }
    // Ids are nearly always printable ASCII: one pass over the bytes proves that; decoding
    // characters is left for the rest.
    let printable = s.bytes().all(|b| matches!(b, b' '..=b'~'));
    if !printable && s.chars().any(char::is_control) {
        return Err(IdError::Control { what });
    }
    Ok(())
}

macro_rules! name_type {
    ($(#[$doc:meta])* $name:ident, $what:literal) => {
        name_type!($(#[$doc])* $name, $what, Box<str>);
    };
    ($(#[$doc:meta])* $name:ident, $what:literal, $store:ty) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name($store);

        impl $name {
            pub fn new(s: &str) -> Result<Self, IdError> {
                check($what, s)?;
                Ok(Self(s.into()))
            }
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:?}", &*self.0)
            }
        }

        impl std::str::FromStr for $name {
            type Err = IdError;
            fn from_str(s: &str) -> Result<Self, IdError> {
                Self::new(s)
            }
        }
    };
}

name_type!(
    /// One agent trajectory. Shared (`Arc`): the gate's index, its ordered walk, parents,
    /// children and events all point at one copy of the id.
    RunId, "run id", std::sync::Arc<str>
);
name_type!(
    /// The idempotency key of one effect within its run.
    EffectKey, "effect key"
);
name_type!(
    /// The name of the tool an effect calls. Shared (`Arc`): the gate keeps one copy of each
    /// name for all the effects that call it.
    ToolName, "tool name", std::sync::Arc<str>
);
name_type!(
    /// The name of a token holder (an approver is a principal). Shared (`Arc`): every run a
    /// principal owns, and every record replay decodes for it, point at one copy of the name.
    PrincipalName, "principal name", std::sync::Arc<str>
);

/// SHA-256 of the canonical JSON (RFC 8785) of `{tool, args}`.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    /// Parses 64 lowercase or uppercase hex digits.
    pub fn from_hex(s: &str) -> Option<Digest> {
        let b = s.as_bytes();
        if b.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, pair) in b.chunks_exact(2).enumerate() {
            let hi = (pair[0] as char).to_digit(16)?;
            let lo = (pair[1] as char).to_digit(16)?;
            out[i] = (hi * 16 + lo) as u8;
        }
        Some(Digest(out))
    }

    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(64);
        for byte in self.0 {
            s.push(char::from_digit(u32::from(byte >> 4), 16).unwrap_or('0'));
            s.push(char::from_digit(u32::from(byte & 0xf), 16).unwrap_or('0'));
        }
        s
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({})", &self.to_hex()[..12])
    }
}

/// The role a token carries (SPEC §3, G7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// Can admit, start, complete, wait on and cancel its own runs.
    Agent,
    /// A person: can decide approvals, pause, resume, cancel and read every run.
    Operator,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Agent => "agent",
            Role::Operator => "operator",
        }
    }
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "agent" => Some(Role::Agent),
            "operator" => Some(Role::Operator),
            _ => None,
        }
    }
}

/// Who sent a command: the name and role of the token that authenticated the connection,
/// plus the approver groups the token carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub name: PrincipalName,
    pub role: Role,
    pub groups: Vec<Box<str>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_hex_round_trips() {
        let d = Digest([0xab; 32]);
        assert_eq!(Digest::from_hex(&d.to_hex()), Some(d));
        assert_eq!(Digest::from_hex("zz"), None);
    }

    #[test]
    fn control_characters_are_refused_exactly_as_char_is_control_says() {
        for c in (0..=0x10ffff).filter_map(char::from_u32) {
            let s = format!("a{c}b");
            assert_eq!(check("id", &s).is_err(), c.is_control(), "{c:?}");
        }
    }

    #[test]
    fn names_refuse_empty_long_and_control() {
        assert!(RunId::new("").is_err());
        assert!(RunId::new(&"x".repeat(NAME_BYTES_MAX + 1)).is_err());
        assert!(RunId::new("a\nb").is_err());
        assert_eq!(
            RunId::new("run-1").map(|r| r.to_string()),
            Ok("run-1".to_string())
        );
    }
}
