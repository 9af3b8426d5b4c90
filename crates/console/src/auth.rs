//! Who is calling: a bearer token (scripts), or a browser session made from a one-time login
//! link or a pasted token. Sessions live in memory only (a restart logs everyone out), are
//! bounded, expire, and carry a CSRF token that every state-changing request must echo.
//! Secrets are compared by hash; no secret is logged.

use estop_kernel::Principal;
use sha2::{Digest as _, Sha256};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Sessions held at once; at the bound the one closest to expiry is dropped.
pub const SESSIONS_MAX: usize = 1024;
/// Unused login links held at once; at the bound the oldest is dropped.
pub const LOGIN_LINKS_MAX: usize = 64;
/// The session cookie's name.
pub const COOKIE: &str = "estop_session";

/// A fresh random secret: 32 bytes from the OS, hex.
pub fn random_hex() -> String {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b).expect("the OS provides randomness");
    hex(&b)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn digest(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Compares without an early exit (the CSRF token is a secret).
pub fn same(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

#[derive(Debug, Clone)]
pub struct Session {
    pub principal: Principal,
    pub csrf: String,
    pub expires: Instant,
    /// Unix ms, for the UI.
    pub expires_at: u64,
}

struct Link {
    principal: Principal,
    expires: Instant,
}

/// Sessions and unused login links, keyed by the SHA-256 of their secret.
pub struct Auth {
    sessions: Mutex<HashMap<[u8; 32], Session>>,
    links: Mutex<Vec<([u8; 32], Link)>>,
    pub session_ttl: Duration,
    pub link_ttl: Duration,
}

impl Auth {
    pub fn new(session_ttl: Duration, link_ttl: Duration) -> Auth {
        Auth {
            sessions: Mutex::new(HashMap::new()),
            links: Mutex::new(Vec::new()),
            session_ttl,
            link_ttl,
        }
    }

    /// A one-time login code for `principal`, valid `link_ttl`. Returns the code and its expiry
    /// (Unix ms).
    pub fn login_link(&self, principal: Principal) -> (String, u64) {
        let code = random_hex();
        let mut links = self.links.lock().expect("links lock");
        let now = Instant::now();
        links.retain(|(_, l)| l.expires > now);
        if links.len() >= LOGIN_LINKS_MAX {
            links.remove(0);
        }
        links.push((
            digest(&code),
            Link {
                principal,
                expires: now + self.link_ttl,
            },
        ));
        (code, wall_ms() + self.link_ttl.as_millis() as u64)
    }

    /// Consumes a login code (once); the principal it was made for.
    pub fn redeem(&self, code: &str) -> Option<Principal> {
        let h = digest(code);
        let mut links = self.links.lock().expect("links lock");
        let i = links.iter().position(|(k, _)| *k == h)?;
        let (_, link) = links.remove(i);
        (link.expires > Instant::now()).then_some(link.principal)
    }

    /// Starts a session; returns its secret (for the cookie) and the session.
    pub fn start(&self, principal: Principal) -> (String, Session) {
        let id = random_hex();
        let session = Session {
            principal,
            csrf: random_hex(),
            expires: Instant::now() + self.session_ttl,
            expires_at: wall_ms() + self.session_ttl.as_millis() as u64,
        };
        let mut sessions = self.sessions.lock().expect("sessions lock");
        let now = Instant::now();
        sessions.retain(|_, s| s.expires > now);
        if sessions.len() >= SESSIONS_MAX
            && let Some(oldest) = sessions
                .iter()
                .min_by_key(|(_, s)| s.expires)
                .map(|(k, _)| *k)
        {
            sessions.remove(&oldest);
        }
        sessions.insert(digest(&id), session.clone());
        (id, session)
    }

    /// The live session a cookie names.
    pub fn session(&self, id: &str) -> Option<Session> {
        let h = digest(id);
        let mut sessions = self.sessions.lock().expect("sessions lock");
        match sessions.get(&h) {
            Some(s) if s.expires > Instant::now() => Some(s.clone()),
            Some(_) => {
                sessions.remove(&h);
                None
            }
            None => None,
        }
    }

    /// Ends every session of, and drops every unused login link for, principal `name` (its
    /// token was revoked).
    pub fn end_principal(&self, name: &str) {
        self.sessions
            .lock()
            .expect("sessions lock")
            .retain(|_, s| s.principal.name.as_str() != name);
        self.links
            .lock()
            .expect("links lock")
            .retain(|(_, l)| l.principal.name.as_str() != name);
    }

    pub fn end(&self, id: &str) {
        self.sessions
            .lock()
            .expect("sessions lock")
            .remove(&digest(id));
    }

    pub fn session_count(&self) -> usize {
        let now = Instant::now();
        self.sessions
            .lock()
            .expect("sessions lock")
            .values()
            .filter(|s| s.expires > now)
            .count()
    }
}

/// The value of cookie `name` in a `Cookie` header.
pub fn cookie<'a>(header: &'a str, name: &str) -> Option<&'a str> {
    header.split(';').find_map(|kv| {
        let (k, v) = kv.trim().split_once('=')?;
        (k == name).then_some(v)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use estop_kernel::{PrincipalName, Role};

    fn admin() -> Principal {
        Principal {
            name: PrincipalName::new("admin").unwrap(),
            role: Role::Operator,
            groups: Vec::new(),
        }
    }

    #[test]
    fn a_login_link_works_once_and_not_after_it_expires() {
        let auth = Auth::new(Duration::from_secs(60), Duration::from_secs(60));
        let (code, _) = auth.login_link(admin());
        assert_eq!(auth.redeem(&code).unwrap().name.as_str(), "admin");
        assert!(auth.redeem(&code).is_none(), "one-time");
        let auth = Auth::new(Duration::from_secs(60), Duration::ZERO);
        let (code, _) = auth.login_link(admin());
        assert!(auth.redeem(&code).is_none(), "expired");
        assert!(auth.redeem("nope").is_none());
    }

    #[test]
    fn sessions_expire_and_end() {
        let auth = Auth::new(Duration::from_secs(60), Duration::from_secs(60));
        let (id, s) = auth.start(admin());
        assert_eq!(auth.session(&id).unwrap().csrf, s.csrf);
        auth.end(&id);
        assert!(auth.session(&id).is_none());
        let auth = Auth::new(Duration::ZERO, Duration::from_secs(60));
        let (id, _) = auth.start(admin());
        assert!(auth.session(&id).is_none(), "expired");
    }

    #[test]
    fn sessions_are_bounded() {
        let auth = Auth::new(Duration::from_secs(60), Duration::from_secs(60));
        let (first, _) = auth.start(admin());
        for _ in 0..SESSIONS_MAX {
            auth.start(admin());
        }
        assert_eq!(auth.session_count(), SESSIONS_MAX);
        assert!(auth.session(&first).is_none(), "the oldest went first");
    }

    #[test]
    fn cookies_and_constant_time_compare() {
        assert_eq!(cookie("a=1; estop_session=xyz; b=2", COOKIE), Some("xyz"));
        assert_eq!(cookie("a=1", COOKIE), None);
        assert!(same("abc", "abc"));
        assert!(!same("abc", "abd"));
        assert!(!same("abc", "ab"));
    }
}
