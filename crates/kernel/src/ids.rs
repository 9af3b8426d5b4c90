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
    ($(#[$doc:meta])* $name:ident, $what:literal, $store:ty) => {
        $(#[$doc])*
        #[derive(Clone)]
        pub struct $name($store);

        /// The string's hash (as derived; written out because `PartialEq` is).
        impl std::hash::Hash for $name {
            fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
                self.0.hash(state);
            }
        }

        /// The string's equality; two handles on one shared copy are equal without comparing
        /// bytes (the gate's lookups nearly always compare an id with its own copy).
        impl PartialEq for $name {
            fn eq(&self, other: &Self) -> bool {
                std::sync::Arc::ptr_eq(&self.0, &other.0) || *self.0 == *other.0
            }
        }

        impl Eq for $name {}

        impl PartialOrd for $name {
            fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
                Some(self.cmp(other))
            }
        }

        /// The string's order.
        impl Ord for $name {
            fn cmp(&self, other: &Self) -> std::cmp::Ordering {
                if std::sync::Arc::ptr_eq(&self.0, &other.0) {
                    std::cmp::Ordering::Equal
                } else {
                    self.0.cmp(&other.0)
                }
            }
        }

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
/// Effect keys of at most this many bytes are stored inline, without an allocation.
pub const KEY_INLINE_MAX: usize = 22;

/// The idempotency key of one effect within its run.
///
/// Stored inline when it is at most `KEY_INLINE_MAX` bytes (nearly every key: a step name, a
/// counter, a tool-call id), otherwise boxed. A run's effects map holds its keys, so an inline
/// key costs no allocation when an effect is admitted and none to free when retention compacts
/// the run; a search of the map compares keys without following a pointer. It behaves exactly
/// as the string it holds: equality, order and hash are the string's.
#[derive(Clone)]
pub struct EffectKey(KeyRepr);

/// The representation is canonical: a key that fits inline is always inline.
#[derive(Clone)]
enum KeyRepr {
    Inline {
        len: u8,
        bytes: [u8; KEY_INLINE_MAX],
    },
    Heap(Box<str>),
}

impl EffectKey {
    pub fn new(s: &str) -> Result<Self, IdError> {
        // `check` refuses control characters, NUL among them: `Ord` relies on it.
        check("effect key", s)?;
        let repr = if s.len() <= KEY_INLINE_MAX {
            let mut bytes = [0u8; KEY_INLINE_MAX];
            bytes[..s.len()].copy_from_slice(s.as_bytes());
            KeyRepr::Inline {
                len: s.len() as u8,
                bytes,
            }
        } else {
            KeyRepr::Heap(s.into())
        };
        Ok(EffectKey(repr))
    }

    /// `new` for a key read as bytes (a decoder's): a short key of printable ASCII (which is
    /// valid UTF-8 with no control character, so `new` would accept it and store it inline)
    /// is built in one pass; anything else is `None`, for the caller to take the general
    /// path (`from_utf8`, then `new`).
    pub(crate) fn from_short_printable(b: &[u8]) -> Option<EffectKey> {
        if b.is_empty() || b.len() > KEY_INLINE_MAX {
            return None;
        }
        let mut bytes = [0u8; KEY_INLINE_MAX];
        let mut printable = true;
        for (to, &from) in bytes.iter_mut().zip(b) {
            printable &= matches!(from, b' '..=b'~');
            *to = from;
        }
        printable.then_some(EffectKey(KeyRepr::Inline {
            len: b.len() as u8,
            bytes,
        }))
    }

    /// The key's bytes (UTF-8).
    #[inline]
    pub fn as_bytes(&self) -> &[u8] {
        match &self.0 {
            KeyRepr::Inline { len, bytes } => &bytes[..usize::from(*len)],
            KeyRepr::Heap(s) => s.as_bytes(),
        }
    }

    pub fn as_str(&self) -> &str {
        match &self.0 {
            KeyRepr::Inline { .. } => {
                std::str::from_utf8(self.as_bytes()).expect("an inline key was copied from a str")
            }
            KeyRepr::Heap(s) => s,
        }
    }
}

impl PartialEq for EffectKey {
    #[inline]
    fn eq(&self, other: &EffectKey) -> bool {
        match (&self.0, &other.0) {
            (KeyRepr::Inline { len: m, bytes: a }, KeyRepr::Inline { len: n, bytes: b }) => {
                m == n && a == b
            }
            _ => self.as_bytes() == other.as_bytes(),
        }
    }
}

impl Eq for EffectKey {}

impl PartialOrd for EffectKey {
    fn partial_cmp(&self, other: &EffectKey) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// The order of `str` (which compares bytes).
impl Ord for EffectKey {
    #[inline]
    fn cmp(&self, other: &EffectKey) -> std::cmp::Ordering {
        match (&self.0, &other.0) {
            // No key contains a NUL (a control character), so the zero padding sorts before
            // every byte of a longer key: the padded arrays, compared as big-endian integers,
            // are in the order of the strings (without a call to `memcmp`).
            (KeyRepr::Inline { bytes: a, .. }, KeyRepr::Inline { bytes: b, .. }) => {
                inline_words(a).cmp(&inline_words(b))
            }
            _ => self.as_bytes().cmp(other.as_bytes()),
        }
    }
}

/// An inline key's padded bytes as two big-endian integers (most significant first).
#[inline]
fn inline_words(bytes: &[u8; KEY_INLINE_MAX]) -> (u128, u64) {
    let mut hi = [0u8; 16];
    let mut lo = [0u8; 8];
    hi.copy_from_slice(&bytes[..16]);
    lo[..KEY_INLINE_MAX - 16].copy_from_slice(&bytes[16..]);
    (u128::from_be_bytes(hi), u64::from_be_bytes(lo))
}

/// The hash of `str`.
impl std::hash::Hash for EffectKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write(self.as_bytes());
        state.write_u8(0xff);
    }
}

impl fmt::Display for EffectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for EffectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.as_str())
    }
}

impl std::str::FromStr for EffectKey {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, IdError> {
        Self::new(s)
    }
}
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
    /// Reads every run (metrics, dashboards) and changes nothing: no admission, decision,
    /// stop or token change.
    Observer,
    /// Runs the reverse saga's compensations and lookups (`compensations`, `compensated`,
    /// `looked_up`) of every run, and nothing else: no admission, decision, stop, read or
    /// token change (`estop egress-executor`'s own credential).
    Executor,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Agent => "agent",
            Role::Operator => "operator",
            Role::Observer => "observer",
            Role::Executor => "executor",
        }
    }
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "agent" => Some(Role::Agent),
            "operator" => Some(Role::Operator),
            "observer" => Some(Role::Observer),
            "executor" => Some(Role::Executor),
            _ => None,
        }
    }
}

/// Who sent a command: the name and role of the token that authenticated the connection,
/// plus the approver groups the token carries, and which part of that principal's software
/// speaks (`Part`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub name: PrincipalName,
    pub role: Role,
    pub groups: Vec<Box<str>>,
    pub part: Part,
}

/// Which part of a principal speaks on a connection, said at `hello` (`component`). An effect
/// belongs to the part that admitted it (`Effect::holder`): only that part may start it,
/// complete it, wait for it or admit it again (`KernelError::NotHolder`). The sandbox of `estop
/// run` speaks as `Main` through its relay, which never lets it say anything else; the
/// supervisor outside it (the launch, the egress proxy, the model metering) speaks as `Egress`,
/// so nothing inside the sandbox can start, complete or re-admit what the proxy recorded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Part {
    /// The principal itself: an agent's client, a sandboxed command through its relay.
    #[default]
    Main,
    /// The egress supervisor of a sandbox: `estop run`'s launch effect, its proxy's requests
    /// and its metered model calls.
    Egress,
}

impl Part {
    pub const ALL: &'static [Part] = &[Part::Main, Part::Egress];
    pub fn as_str(self) -> &'static str {
        match self {
            Part::Main => "main",
            Part::Egress => "egress",
        }
    }
    pub fn parse(s: &str) -> Option<Part> {
        Part::ALL.iter().copied().find(|p| p.as_str() == s)
    }
}

/// Separates a token's name from the run of a sandbox that speaks for it: `agent/order-42` is
/// the principal of `estop run --run order-42`'s sandbox, started with the token `agent`
/// (docs/EGRESS.md). Token names never hold it, so the token's part is what precedes the first.
pub const SANDBOX_SEPARATOR: char = '/';

impl PrincipalName {
    /// The token this principal speaks for: itself, or for a sandbox's principal
    /// (`TOKEN/RUN`) the token that started the sandbox.
    pub fn token_name(&self) -> &str {
        self.as_str()
            .split_once(SANDBOX_SEPARATOR)
            .map_or(self.as_str(), |(token, _)| token)
    }

    /// Whether runs owned by `owner` are this agent's to see: its own, those of the token it
    /// is a sandbox of (a sandbox's run may name one of them as its parent), and those of its
    /// own sandboxes (the token that started a sandbox follows its run). Sibling sandboxes do
    /// not see each other's runs.
    pub fn sees_runs_of(&self, owner: &PrincipalName) -> bool {
        let (me, them) = (self.as_str(), owner.as_str());
        me == them || self.token_name() == them || owner.token_name() == me
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sandbox sees its own runs and its token's (its parent may be one), the token sees its
    /// sandboxes' runs, and sibling sandboxes and other tokens see nothing of each other.
    #[test]
    fn a_sandbox_and_its_token_see_each_others_runs_and_siblings_do_not() {
        let n = |s: &str| PrincipalName::new(s).unwrap();
        let (agent, a, b, other) = (n("agent"), n("agent/a"), n("agent/b"), n("agent2"));
        assert_eq!(a.token_name(), "agent");
        assert_eq!(n("agent/gw/files").token_name(), "agent");
        assert_eq!(agent.token_name(), "agent");
        for (me, owner, sees) in [
            (&a, &a, true),
            (&a, &agent, true),
            (&agent, &a, true),
            (&a, &b, false),
            (&b, &a, false),
            (&other, &a, false),
            (&a, &other, false),
            (&n("agent2/x"), &agent, false),
        ] {
            assert_eq!(
                me.sees_runs_of(owner),
                sees,
                "{me:?} sees runs of {owner:?}"
            );
        }
    }

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

    /// Keys of every length up to the limit, ASCII and not, around the inline boundary.
    fn sample_keys() -> Vec<String> {
        let mut out = Vec::new();
        for len in 1..=NAME_BYTES_MAX {
            out.push("k".repeat(len));
            out.push(format!("{}{}", "a".repeat(len - 1), "z"));
            if len >= 2 {
                // A two-byte character that ends exactly at `len` bytes.
                out.push(format!("{}é", "a".repeat(len - 2)));
            }
            if len >= 3 {
                out.push(format!("{}€", "b".repeat(len - 3)));
            }
        }
        for s in [
            "",
            "a",
            "ab",
            "b",
            "step-000001",
            "step-000010",
            "Z",
            "~",
            "é",
            "a\u{7f}",
        ] {
            out.push(s.to_string());
        }
        out.retain(|s| EffectKey::new(s).is_ok());
        out
    }

    #[test]
    fn an_effect_key_behaves_as_the_string_it_holds() {
        use std::collections::BTreeMap;
        use std::hash::{BuildHasher, RandomState};
        assert_eq!(std::mem::size_of::<EffectKey>(), 24);
        let strings = sample_keys();
        let keys: Vec<EffectKey> = strings
            .iter()
            .map(|s| EffectKey::new(s).expect("valid"))
            .collect();
        let hasher = RandomState::new();
        for (s, k) in strings.iter().zip(&keys) {
            assert_eq!(k.as_str(), s);
            assert_eq!(k.as_bytes(), s.as_bytes());
            assert_eq!(k.to_string(), *s);
            assert_eq!(format!("{k:?}"), format!("{s:?}"));
            assert_eq!(k.clone(), *k);
            assert_eq!(s.parse::<EffectKey>().as_ref(), Ok(k));
            assert_eq!(hasher.hash_one(k), hasher.hash_one(s.as_str()), "{s:?}");
            assert_eq!(
                matches!(k.0, KeyRepr::Inline { .. }),
                s.len() <= KEY_INLINE_MAX,
                "inline exactly when it fits: {s:?}"
            );
        }
        for (a, ka) in strings.iter().zip(&keys) {
            for (b, kb) in strings.iter().zip(&keys) {
                assert_eq!(ka.cmp(kb), a.as_str().cmp(b.as_str()), "{a:?} {b:?}");
                assert_eq!(ka == kb, a == b);
                assert_eq!(ka.partial_cmp(kb), Some(a.as_str().cmp(b.as_str())));
            }
        }
        // A map keyed by effect keys walks in the order of one keyed by the strings.
        let by_key: BTreeMap<EffectKey, usize> = keys.iter().cloned().zip(0..).collect();
        let by_str: BTreeMap<&str, usize> = strings.iter().map(String::as_str).zip(0..).collect();
        assert!(
            by_key
                .iter()
                .map(|(k, i)| (k.as_str(), *i))
                .eq(by_str.into_iter())
        );
    }

    #[test]
    fn effect_keys_refuse_what_names_refuse() {
        for s in ["", "a\nb", &"x".repeat(NAME_BYTES_MAX + 1)] {
            assert_eq!(
                EffectKey::new(s).map(|_| ()),
                check("effect key", s),
                "{s:?}"
            );
        }
        assert!(EffectKey::new(&"x".repeat(NAME_BYTES_MAX)).is_ok());
        assert!(
            EffectKey::new("a\0").is_err(),
            "the inline order needs keys without NUL"
        );
    }

    #[test]
    fn the_decoders_short_path_builds_what_new_builds() {
        let mut inputs: Vec<Vec<u8>> = sample_keys().into_iter().map(String::into_bytes).collect();
        inputs.extend([
            vec![],
            vec![0],
            b"a\0".to_vec(),
            b"tab\there".to_vec(),
            vec![0x7f],
            vec![0xff, b'a'],
            vec![0xc3, 0xa9],
            b"x".repeat(KEY_INLINE_MAX + 1),
        ]);
        for b in 0..=255u8 {
            inputs.push(vec![b]);
            inputs.push(vec![b'k', b, b'k']);
        }
        for b in &inputs {
            let short = EffectKey::from_short_printable(b);
            let printable_ascii = b.iter().all(|c| (b' '..=b'~').contains(c));
            let fits = !b.is_empty() && b.len() <= KEY_INLINE_MAX;
            assert_eq!(short.is_some(), fits && printable_ascii, "{b:?}");
            if let Some(key) = short {
                let s = std::str::from_utf8(b).expect("printable ASCII is UTF-8");
                let general = EffectKey::new(s).expect("new accepts it too");
                assert_eq!(key, general);
                assert_eq!(key.as_bytes(), b.as_slice());
                match (&key.0, &general.0) {
                    (
                        KeyRepr::Inline { len: m, bytes: x },
                        KeyRepr::Inline { len: n, bytes: y },
                    ) => assert_eq!((m, x), (n, y), "the same representation"),
                    _ => panic!("both inline: {b:?}"),
                }
            }
        }
    }

    #[test]
    fn shared_names_compare_as_their_strings() {
        let names = ["a", "ab", "b", "run-1", "run-10", "run-2", "é"];
        for x in names {
            for y in names {
                let (a, b) = (RunId::new(x).expect("valid"), RunId::new(y).expect("valid"));
                assert_eq!(a == b, x == y);
                assert_eq!(a.cmp(&b), x.cmp(y), "{x:?} {y:?}");
                assert_eq!(a.partial_cmp(&b), Some(x.cmp(y)));
                let hasher = std::hash::RandomState::new();
                use std::hash::BuildHasher;
                assert_eq!(hasher.hash_one(&a), hasher.hash_one(x));
                let shared = a.clone();
                assert_eq!(shared, a);
                assert_eq!(shared.cmp(&a), std::cmp::Ordering::Equal);
                let (t, u) = (
                    ToolName::new(x).expect("valid"),
                    ToolName::new(y).expect("valid"),
                );
                assert_eq!((t == u, t.cmp(&u)), (x == y, x.cmp(y)));
                let (p, q) = (
                    PrincipalName::new(x).expect("valid"),
                    PrincipalName::new(y).expect("valid"),
                );
                assert_eq!((p == q, p.cmp(&q)), (x == y, x.cmp(y)));
            }
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
