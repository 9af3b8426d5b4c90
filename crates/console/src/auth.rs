//! Who is calling: a bearer token (scripts), or a browser session made from a one-time login
//! code or a pasted token. A session's secret is no cookie: the console's page keeps it in
//! sessionStorage (scoped to the console's origin: a page on another port cannot read it) and
//! sends it in the `X-Estop-Session` header. Sessions live in memory only (a restart logs
//! everyone out), expire, are bounded per principal with a share reserved for operators, and
//! carry a CSRF token that every state-changing request must echo. Secrets are compared by
//! hash; no secret is logged.

use crate::quota::{Full, ShareOptions, is_operator};
use estop_kernel::Principal;
use sha2::{Digest as _, Sha256};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Sessions held at once.
pub const SESSIONS_MAX: usize = 1024;
/// Sessions one principal holds at once (an agent over it is refused; an operator's own
/// session closest to expiry ends instead, so an operator never locks themself out).
pub const SESSIONS_PER_PRINCIPAL_MAX: usize = 64;
/// Sessions only operators may take: agents together hold at most
/// `SESSIONS_MAX - SESSIONS_OPERATOR_RESERVE`.
pub const SESSIONS_OPERATOR_RESERVE: usize = 256;
/// The session pool's shares.
pub const SESSION_SHARES: ShareOptions = ShareOptions {
    max: SESSIONS_MAX,
    per_principal_max: SESSIONS_PER_PRINCIPAL_MAX,
    // A console session is a token's own (no sandbox logs in), so its share is the principal's.
    per_token_max: SESSIONS_MAX,
    operator_reserve: SESSIONS_OPERATOR_RESERVE,
};
/// Unused login links held at once; at the bound the oldest is dropped.
pub const LOGIN_LINKS_MAX: usize = 64;
/// The request header that carries a session's secret.
pub const SESSION_HEADER: &str = "x-estop-session";
/// The request header that carries a session's CSRF token.
pub const CSRF_HEADER: &str = "x-csrf-token";

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

    /// Starts a session; returns its secret (for the page) and the session. Refused when the
    /// principal, or agents together, hold their share; an operator at a bound ends their own
    /// (or, with the pool full, an operator's) session closest to expiry instead.
    pub fn start(&self, principal: Principal) -> Result<(String, Session), Full> {
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
        let name = session.principal.name.as_str();
        let operator = is_operator(&session.principal);
        let agents = sessions
            .values()
            .filter(|s| !is_operator(&s.principal))
            .count();
        let mine = sessions
            .values()
            .filter(|s| s.principal.name.as_str() == name)
            .count();
        if let Err(full) = SESSION_SHARES.admit(operator, sessions.len(), agents, mine, mine) {
            if !operator {
                return Err(full);
            }
            let victim = sessions
                .iter()
                .filter(|(_, s)| match full {
                    Full::Principal(_) | Full::Token(_) => s.principal.name.as_str() == name,
                    Full::Others(_) | Full::Total(_) => is_operator(&s.principal),
                })
                .min_by_key(|(_, s)| s.expires)
                .map(|(k, _)| *k)
                .ok_or(full)?;
            sessions.remove(&victim);
        }
        sessions.insert(digest(&id), session.clone());
        Ok((id, session))
    }

    /// The live session a secret names.
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

#[cfg(test)]
mod tests {
    use super::*;
    use estop_kernel::{PrincipalName, Role};

    fn admin() -> Principal {
        Principal {
            name: PrincipalName::new("admin").unwrap(),
            role: Role::Operator,
            groups: Vec::new(),
            part: Default::default(),
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

    fn agent(name: &str) -> Principal {
        Principal {
            name: PrincipalName::new(name).unwrap(),
            role: Role::Agent,
            groups: Vec::new(),
            part: Default::default(),
        }
    }

    #[test]
    fn sessions_expire_and_end() {
        let auth = Auth::new(Duration::from_secs(60), Duration::from_secs(60));
        let (id, s) = auth.start(admin()).unwrap();
        assert_eq!(auth.session(&id).unwrap().csrf, s.csrf);
        auth.end(&id);
        assert!(auth.session(&id).is_none());
        let auth = Auth::new(Duration::ZERO, Duration::from_secs(60));
        let (id, _) = auth.start(admin()).unwrap();
        assert!(auth.session(&id).is_none(), "expired");
    }

    #[test]
    fn agents_are_refused_at_their_share_and_never_evict_an_operator() {
        let auth = Auth::new(Duration::from_secs(60), Duration::from_secs(60));
        let (op, _) = auth.start(admin()).unwrap();
        for _ in 0..SESSIONS_PER_PRINCIPAL_MAX {
            auth.start(agent("a")).unwrap();
        }
        assert_eq!(
            auth.start(agent("a")).unwrap_err(),
            Full::Principal(SESSIONS_PER_PRINCIPAL_MAX)
        );
        let share = SESSIONS_MAX - SESSIONS_OPERATOR_RESERVE;
        for i in 1..share / SESSIONS_PER_PRINCIPAL_MAX {
            for _ in 0..SESSIONS_PER_PRINCIPAL_MAX {
                auth.start(agent(&format!("a{i}"))).unwrap();
            }
        }
        assert_eq!(auth.start(agent("late")).unwrap_err(), Full::Others(share));
        assert!(
            auth.session(&op).is_some(),
            "the operator's session survived"
        );
        // An operator at their own bound ends their own oldest session, nobody else's.
        let mut first = None;
        for _ in 0..SESSIONS_PER_PRINCIPAL_MAX {
            let (id, _) = auth.start(admin()).unwrap();
            first.get_or_insert(id);
        }
        assert!(
            auth.session(&op).is_none(),
            "the operator's own oldest ended"
        );
        assert!(auth.session(first.as_ref().unwrap()).is_some());
        assert_eq!(auth.session_count(), share + SESSIONS_PER_PRINCIPAL_MAX);
    }

    #[test]
    fn constant_time_compare() {
        assert!(same("abc", "abc"));
        assert!(!same("abc", "abd"));
        assert!(!same("abc", "ab"));
    }
}
