//! Named tokens with roles (SPEC §3 "Principals"): the registry of who may talk to the gate.
//! Only SHA-256 hashes of secrets are stored (`DATA/tokens`, mode 0600; on a PostgreSQL store,
//! the database's `estop_token`, every node's: `pg`); the secrets themselves are shown once,
//! and the bootstrap ones are written to `operator.token` and `agent.token`.
//!
//! Every change rewrites the registry whole, one writer at a time, through a temp file of its
//! own (fsync, rename, directory fsync), so concurrent creations all survive and a crash leaves
//! the old file or the new one, never a torn one. A revocation takes effect at once: it fires
//! the signal of every connection that authenticated with that secret (one atomic load per
//! request to check, no lock; an idle connection is woken), bumps a counter the console's event
//! streams watch, and runs the hooks the console registered to end that principal's sessions.
//!
//! Beside the registry, **grants**: short-lived secrets the daemon issues, in memory only, for
//! a principal it has already authenticated (a console session that acts on a runner's control
//! socket, which authenticates what it is sent with `hello`). A grant authenticates as that
//! principal until it expires or is ended, and ends with a revocation of the principal.

use estop_kernel::{Principal, PrincipalName, Role};
use sha2::{Digest as _, Sha256};
use std::collections::HashMap;
use std::fs;
use std::future::Future;
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::task::Poll;
use tokio::sync::watch;

pub mod pg;

/// Names the gate uses for itself and the compatibility listener; no token may take them.
pub const RESERVED_NAMES: &[&str] = &["estop", "soundgate"];
/// Tokens the registry holds at most.
pub const TOKENS_MAX: usize = 10_000;
/// Groups one principal may carry, and the bytes of a group (or token) name: the protocol's
/// bounds, so the registry holds what a `token` request may carry.
pub use estop_protocol::limits::{GROUP_BYTES_MAX, GROUPS_MAX};
/// Bytes of a token's name (its principal), bounded as a group name is.
const NAME_BYTES_MAX: usize = GROUP_BYTES_MAX;
/// Grants live at once ([`Tokens::grant`]); at the bound a new one is refused (`Full`).
pub const GRANTS_MAX: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("cannot {op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("{path} line {line}: {problem}")]
    Corrupt {
        path: PathBuf,
        line: usize,
        problem: String,
    },
    #[error(
        "{path} is missing, but {ledger} holds records: the token registry was lost or moved, and starting without it would drop every named token. Restore it from a backup (mode 0600); or start once with `estop serve --reset-tokens` to write fresh bootstrap tokens (admin, agent) — every other token stays revoked"
    )]
    Missing { path: PathBuf, ledger: PathBuf },
    #[error("a token named {0} already exists")]
    Exists(String),
    #[error("no token named {0}")]
    NotFound(String),
    #[error(
        "{0} is the last operator token: revoking it would lock every operator out. Create another first (`estop token create NAME --role operator`), then revoke this one"
    )]
    LastOperator(String),
    #[error("the name {0} is reserved")]
    Reserved(String),
    #[error("invalid token name or group: {0}")]
    Invalid(String),
    #[error("limit reached: tokens_max = {TOKENS_MAX}; revoke tokens no longer used")]
    Full,
    #[error("limit reached: {GRANTS_MAX} short-lived grants at once; try again shortly")]
    GrantsFull,
    #[error("the token registry in the database: {0}")]
    Store(String),
    #[error(
        "the database's token registry (estop_token) is empty, but the database holds {records} records: its tokens were never brought in (a history exported without them, or the table lost). Start one node whose data dir has the old DATA/tokens (it is brought in), or start once with `estop serve --reset-tokens` to make fresh bootstrap tokens (admin, agent)"
    )]
    MissingInDatabase { records: i64 },
}

#[derive(Debug, Clone)]
struct Entry {
    principal: Principal,
    hash: [u8; 32],
}

/// What a connection authenticated with: the principal, and which secret (by hash) it showed,
/// so a revocation — even of a name created again later — is recognised.
#[derive(Debug, Clone)]
pub struct Credential {
    pub principal: Principal,
    hash: [u8; 32],
}

/// Called with the name of every revoked principal (the console ends its sessions).
pub type RevokeHook = Box<dyn Fn(&PrincipalName) + Send + Sync>;

/// One connection's line to the registry: set, and the connection's task woken, when the secret
/// it authenticated with is revoked.
#[derive(Debug, Default)]
pub struct RevokeSignal {
    revoked: AtomicBool,
    waker: atomic_waker::AtomicWaker,
}

impl RevokeSignal {
    /// Whether the token was revoked (one atomic load: checked before every request).
    pub fn is_set(&self) -> bool {
        self.revoked.load(Ordering::Acquire)
    }

    /// Ready once the token is revoked; `None` never is (a connection before `hello`).
    pub fn wait(signal: Option<&RevokeSignal>) -> impl Future<Output = ()> + '_ {
        std::future::poll_fn(move |cx| {
            let Some(s) = signal else {
                return Poll::Pending;
            };
            if s.is_set() {
                return Poll::Ready(());
            }
            s.waker.register(cx.waker());
            // Set between the check and the registration: the wake may have been missed.
            if s.is_set() {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
    }

    fn fire(&self) {
        self.revoked.store(true, Ordering::Release);
        self.waker.wake();
    }
}

/// A secret issued for a principal already authenticated, by hash, until `expires`.
#[derive(Debug, Clone)]
struct Grant {
    principal: Principal,
    hash: [u8; 32],
    expires: std::time::Instant,
}

/// Where the registry lives.
enum Store {
    /// `DATA/tokens`: this node's own.
    File(PathBuf),
    /// `estop_token` in the PostgreSQL store: every node's (`pg`).
    Db(Box<pg::Registry>),
}

/// The token registry of one data dir, or of every node of a PostgreSQL store.
pub struct Tokens {
    store: Store,
    entries: RwLock<Vec<Entry>>,
    /// Held while a change is computed and written: one writer of the file at a time, and the
    /// file always holds exactly what memory will.
    writer: Mutex<()>,
    /// Counts revocations; the console's event streams re-check their principal when it moves.
    revocations: watch::Sender<u64>,
    hooks: Mutex<Vec<RevokeHook>>,
    /// The revoke signal of every authenticated protocol connection, by connection id, with
    /// the hash of the secret it showed.
    watchers: Mutex<HashMap<u64, Watcher>>,
    /// Live grants (at most `GRANTS_MAX`; the expired are dropped when one is issued).
    grants: Mutex<Vec<Grant>>,
}

/// A connection registered for revocation: the hash of the secret it showed, and its signal.
struct Watcher {
    hash: [u8; 32],
    signal: Arc<RevokeSignal>,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.store {
            Store::File(path) => f.debug_struct("Tokens").field("path", path).finish(),
            Store::Db(_) => f
                .debug_struct("Tokens")
                .field("store", &"postgres")
                .finish(),
        }
    }
}

fn hash(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A fresh secret: 32 random bytes from the OS, hex-encoded, with a prefix naming the role
/// so a leaked secret is recognisable in a scan.
pub fn new_secret(role: Role) -> Result<String, TokenError> {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b).map_err(|e| TokenError::Io {
        op: "read randomness for",
        path: PathBuf::from("a new token"),
        source: io::Error::other(e.to_string()),
    })?;
    let prefix = match role {
        Role::Operator => "estop_op_",
        Role::Agent => "estop_ag_",
        Role::Observer => "estop_ob_",
        Role::Executor => "estop_ex_",
    };
    Ok(format!("{prefix}{}", hex(&b)))
}

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= NAME_BYTES_MAX
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.@".contains(&b))
}

/// Temp files of this process get distinct names, so two writers never share one.
static TMP_SERIAL: AtomicU64 = AtomicU64::new(0);

/// Writes `bytes` to `path` atomically with mode 0600: a temp file of its own beside it, fsync,
/// rename, directory fsync. On failure the temp file is removed and `path` is unchanged.
pub fn write_private(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let name = path
        .file_name()
        .map_or_else(|| "file".into(), |n| n.to_string_lossy().into_owned());
    let serial = TMP_SERIAL.fetch_add(1, Ordering::Relaxed);
    let tmp = path.with_file_name(format!(".{name}.{}.{serial}.tmp", std::process::id()));
    let written = (|| {
        let mut f = fs::OpenOptions::new()
            .create_new(true)
            .write(true)
            .mode(0o600)
            .open(&tmp)?;
        // The umask may have narrowed the mode, never widened it; set it exactly.
        f.set_permissions(fs::Permissions::from_mode(0o600))?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    if let Some(dir) = path.parent() {
        fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// Whether the ledger in `data` has been written (a segment or a snapshot exists).
fn ledger_written(data: &Path) -> bool {
    fs::read_dir(data.join("ledger")).is_ok_and(|d| {
        d.flatten().any(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            n.starts_with("seg-") || n.starts_with("snap-")
        })
    })
}

/// A checked new entry and its secret.
fn new_entry(name: &str, role: Role, groups: &[String]) -> Result<(Entry, String), TokenError> {
    if RESERVED_NAMES.contains(&name) {
        return Err(TokenError::Reserved(name.into()));
    }
    if !valid_name(name) {
        return Err(TokenError::Invalid(format!(
            "{name:?}: use 1-{NAME_BYTES_MAX} of A-Z a-z 0-9 - _ . @"
        )));
    }
    if groups.len() > GROUPS_MAX || groups.iter().any(|g| !valid_name(g)) {
        return Err(TokenError::Invalid(format!(
            "groups {groups:?}: at most {GROUPS_MAX}, each 1-{GROUP_BYTES_MAX} of A-Z a-z 0-9 - _ . @"
        )));
    }
    let principal = Principal {
        name: PrincipalName::new(name).map_err(|e| TokenError::Invalid(e.to_string()))?,
        role,
        groups: groups.iter().map(|g| g.as_str().into()).collect(),
        part: Default::default(),
    };
    let secret = new_secret(role)?;
    let hash = hash(&secret);
    Ok((Entry { principal, hash }, secret))
}

fn parse(path: &Path, text: &str) -> Result<Vec<Entry>, TokenError> {
    let mut entries = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let corrupt = |problem: &str| TokenError::Corrupt {
            path: path.to_path_buf(),
            line: i + 1,
            problem: problem.into(),
        };
        if line.trim().is_empty() || line.starts_with('#') {
            continue;
        }
        let f: Vec<&str> = line.split('\t').collect();
        if f.len() != 4 {
            return Err(corrupt(
                "expected name, role, groups, sha256 separated by tabs",
            ));
        }
        let name = PrincipalName::new(f[0]).map_err(|e| corrupt(&e.to_string()))?;
        let role = Role::parse(f[1])
            .ok_or_else(|| corrupt("role must be agent, operator, observer or executor"))?;
        let groups = f[2]
            .split(',')
            .filter(|g| !g.is_empty())
            .map(Into::into)
            .collect();
        let mut h = [0u8; 32];
        let digest = estop_kernel::Digest::from_hex(f[3]).ok_or_else(|| corrupt("bad sha256"))?;
        h.copy_from_slice(&digest.0);
        entries.push(Entry {
            principal: Principal {
                name,
                role,
                groups,
                part: Default::default(),
            },
            hash: h,
        });
    }
    Ok(entries)
}

fn render(entries: &[Entry]) -> String {
    let mut text = String::from(
        "# estop tokens: name, role, groups, sha256(secret). Secrets are never stored.\n",
    );
    for e in entries {
        let groups: Vec<&str> = e.principal.groups.iter().map(|g| &**g).collect();
        text.push_str(&format!(
            "{}\t{}\t{}\t{}\n",
            e.principal.name,
            e.principal.role.as_str(),
            groups.join(","),
            hex(&e.hash)
        ));
    }
    text
}

impl Tokens {
    fn with(store: Store, entries: Vec<Entry>) -> Tokens {
        Tokens {
            store,
            entries: RwLock::new(entries),
            writer: Mutex::new(()),
            revocations: watch::Sender::new(0),
            hooks: Mutex::new(Vec::new()),
            watchers: Mutex::new(HashMap::new()),
            grants: Mutex::new(Vec::new()),
        }
    }

    /// Opens the registry of `data`, creating the bootstrap tokens (`admin` operator and `agent`)
    /// on first start. A registry that is missing although the ledger was written is refused
    /// (`Missing`) unless `reset` asks for fresh bootstrap tokens. Returns the registry and
    /// whether it was created now.
    pub fn open_or_bootstrap(data: &Path, reset: bool) -> Result<(Tokens, bool), TokenError> {
        let path = data.join("tokens");
        let io = |op: &'static str, p: &Path| {
            let p = p.to_path_buf();
            move |source| TokenError::Io {
                op,
                path: p,
                source,
            }
        };
        let exists = fs::symlink_metadata(&path).is_ok();
        if !exists {
            if ledger_written(data) && !reset {
                return Err(TokenError::Missing {
                    path,
                    ledger: data.join("ledger"),
                });
            }
            let (admin, op) = new_entry("admin", Role::Operator, &[])?;
            let (agent, ag) = new_entry("agent", Role::Agent, &[])?;
            // Secrets first, registry last: a crash in between leaves no registry (and no
            // ledger yet), so the next start bootstraps again and overwrites the secret files.
            write_private(&data.join("operator.token"), format!("{op}\n").as_bytes())
                .map_err(io("write", &data.join("operator.token")))?;
            write_private(&data.join("agent.token"), format!("{ag}\n").as_bytes())
                .map_err(io("write", &data.join("agent.token")))?;
            let entries = vec![admin, agent];
            write_private(&path, render(&entries).as_bytes()).map_err(io("write", &path))?;
            let tokens = Tokens::with(Store::File(path), entries);
            return Ok((tokens, true));
        }
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).map_err(io(
            "make private (chmod 600; run estop serve as the owner of its data dir)",
            &path,
        ))?;
        let text = fs::read_to_string(&path).map_err(io(
            "read the token registry (restore it from a backup; it is never re-created over named tokens)",
            &path,
        ))?;
        let entries = parse(&path, &text)?;
        Ok((Tokens::with(Store::File(path), entries), false))
    }

    /// Opens the registry in the PostgreSQL store at `url` (`pg::open`: the first node
    /// bootstraps `admin` and `agent` into `data`). Returns it and whether bootstrap tokens
    /// were made now.
    pub fn open_in_database(
        data: &Path,
        url: &str,
        reset: bool,
    ) -> Result<(Tokens, bool), TokenError> {
        let opened = pg::open(data, url, reset)?;
        let tokens = Tokens::with(Store::Db(Box::new(opened.registry)), opened.live);
        Ok((tokens, opened.created))
    }

    /// Computes a change on a copy of the entries, writes it, and only then makes it current;
    /// the file and memory never disagree, and writers never overlap.
    fn change<T: Send>(
        &self,
        f: impl FnOnce(&mut Vec<Entry>) -> Result<T, TokenError> + Send,
    ) -> Result<T, TokenError> {
        let _writer = self.writer.lock().expect("tokens writer");
        let (out, next) = match &self.store {
            Store::File(path) => {
                let mut next = self.entries.read().expect("tokens lock").clone();
                let out = f(&mut next)?;
                write_private(path, render(&next).as_bytes()).map_err(|source| TokenError::Io {
                    op: "write",
                    path: path.clone(),
                    source,
                })?;
                (out, next)
            }
            // Computed on the database's live tokens, under its lock, and committed.
            Store::Db(db) => db.change(f)?,
        };
        self.install(next);
        Ok(out)
    }

    /// Makes `next` the live tokens; every token no longer among them is revoked here: the
    /// connections that hold its secret are told and the revoke hooks run (whichever node
    /// revoked it).
    fn install(&self, next: Vec<Entry>) {
        let gone: Vec<Entry> = {
            let mut live = self.entries.write().expect("tokens lock");
            let gone = live
                .iter()
                .filter(|e| !next.iter().any(|n| n.hash == e.hash))
                .cloned()
                .collect();
            *live = next;
            gone
        };
        for g in &gone {
            self.revoked(g);
            for hook in self.hooks.lock().expect("tokens hooks").iter() {
                hook(&g.principal.name);
            }
        }
    }

    /// Reads the live tokens from the database again (a node of a PostgreSQL store, when
    /// another node changed the registry: `TOKEN_CHANNEL`); what they no longer hold is revoked
    /// here at once. Nothing to do for the file registry, which only this node changes.
    pub fn refresh(&self) -> Result<(), TokenError> {
        let Store::Db(db) = &self.store else {
            return Ok(());
        };
        let _writer = self.writer.lock().expect("tokens writer");
        let live = db.live()?;
        self.install(live);
        Ok(())
    }

    /// Creates a named token and persists the registry; returns the secret (shown once).
    pub fn create(&self, name: &str, role: Role, groups: &[String]) -> Result<String, TokenError> {
        let (entry, secret) = new_entry(name, role, groups)?;
        self.change(|entries| {
            if entries.iter().any(|e| e.principal.name.as_str() == name) {
                return Err(TokenError::Exists(name.into()));
            }
            if entries.len() >= TOKENS_MAX {
                return Err(TokenError::Full);
            }
            entries.push(entry);
            Ok(())
        })?;
        Ok(secret)
    }

    /// Revokes a named token at once: the registry no longer holds it, every connection that
    /// authenticated with it is refused at its next request (or closed while idle), and the
    /// revoke hooks run. The last operator token cannot be revoked (`LastOperator`).
    pub fn revoke(&self, name: &str) -> Result<Principal, TokenError> {
        let gone = self.remove_where(name, true)?;
        Ok(gone.principal)
    }

    /// Fires the signals of the connections that hold `gone`'s secret, and tells the streams.
    fn revoked(&self, gone: &Entry) {
        // The principal's grants end with it (a grant only speaks for a current principal).
        let mut hashes = vec![gone.hash];
        self.grants.lock().expect("tokens grants").retain(|g| {
            let keep = g.principal.name != gone.principal.name;
            if !keep {
                hashes.push(g.hash);
            }
            keep
        });
        for w in self.watchers.lock().expect("tokens watchers").values() {
            if hashes.contains(&w.hash) {
                w.signal.fire();
            }
        }
        self.revocations.send_modify(|n| *n += 1);
    }

    /// Registers connection `conn`, authenticated with `c`, for revocation (replacing what it
    /// registered before, for a second `hello`). Unregister with [`Tokens::unwatch`].
    pub fn watch(&self, conn: u64, c: &Credential) -> Arc<RevokeSignal> {
        let signal = Arc::new(RevokeSignal::default());
        self.watchers.lock().expect("tokens watchers").insert(
            conn,
            Watcher {
                hash: c.hash,
                signal: Arc::clone(&signal),
            },
        );
        // A revocation between `credential` and the line above found no watcher to fire.
        if !self.is_valid(c) {
            signal.fire();
        }
        signal
    }

    /// Forgets connection `conn` (it closed).
    pub fn unwatch(&self, conn: u64) {
        self.watchers.lock().expect("tokens watchers").remove(&conn);
    }

    /// Takes back a token just created whose creation could not be recorded (nothing
    /// half-applied); its secret was never shown.
    pub fn forget(&self, name: &str) -> Result<Principal, TokenError> {
        let gone = self.remove_where(name, false)?;
        Ok(gone.principal)
    }

    fn remove_where(&self, name: &str, keep_an_operator: bool) -> Result<Entry, TokenError> {
        self.change(|entries| {
            let i = entries
                .iter()
                .position(|e| e.principal.name.as_str() == name)
                .ok_or_else(|| TokenError::NotFound(name.into()))?;
            let operators = entries
                .iter()
                .filter(|e| e.principal.role == Role::Operator)
                .count();
            if keep_an_operator && entries[i].principal.role == Role::Operator && operators <= 1 {
                return Err(TokenError::LastOperator(name.into()));
            }
            Ok(entries.remove(i))
        })
    }

    /// The principal a secret belongs to (`Err`: the database could not be asked).
    pub fn authenticate(&self, secret: &str) -> Result<Option<Principal>, TokenError> {
        Ok(self.credential(secret)?.map(|c| c.principal))
    }

    /// [`Tokens::credential`] for a caller on an async thread (a protocol `hello`, a console
    /// request with a bearer token). On a PostgreSQL store the lookup is a database round trip,
    /// and a slow or unreachable database, or an agent sending unknown tokens in a loop, would
    /// stall every connection that thread serves: the lookup runs on tokio's blocking pool and
    /// only the caller waits for it.
    pub async fn credential_async(
        self: &Arc<Self>,
        secret: &str,
    ) -> Result<Option<Credential>, TokenError> {
        if matches!(self.store, Store::File(_)) {
            return self.credential(secret);
        }
        let (me, secret) = (Arc::clone(self), secret.to_string());
        tokio::task::spawn_blocking(move || me.credential(&secret))
            .await
            .unwrap_or_else(|e| Err(TokenError::Store(format!("the token lookup failed: {e}"))))
    }

    /// [`Tokens::authenticate`] for a caller on an async thread ([`Tokens::credential_async`]).
    pub async fn authenticate_async(
        self: &Arc<Self>,
        secret: &str,
    ) -> Result<Option<Principal>, TokenError> {
        Ok(self.credential_async(secret).await?.map(|c| c.principal))
    }

    /// The principal a secret belongs to, with which secret it was. On a PostgreSQL store the
    /// database is asked every time (a token revoked on another node a moment ago is refused
    /// here), and this node's copy refreshed when it disagrees.
    pub fn credential(&self, secret: &str) -> Result<Option<Credential>, TokenError> {
        let h = hash(secret.trim());
        if let Some(g) = self.granted(&h) {
            return Ok(Some(Credential {
                principal: g.principal,
                hash: h,
            }));
        }
        let found = match &self.store {
            Store::File(_) => self.cached(&h),
            Store::Db(db) => {
                let found = db.lookup(&h)?;
                if found.is_some() != self.cached(&h).is_some() {
                    self.refresh()?;
                }
                found
            }
        };
        Ok(found.map(|e| Credential {
            principal: e.principal,
            hash: h,
        }))
    }

    fn cached(&self, h: &[u8; 32]) -> Option<Entry> {
        self.entries
            .read()
            .expect("tokens lock")
            .iter()
            .find(|e| e.hash == *h)
            .cloned()
    }

    /// Whether a credential is still in the registry (not revoked), or a live grant.
    pub fn is_valid(&self, c: &Credential) -> bool {
        self.entries
            .read()
            .expect("tokens lock")
            .iter()
            .any(|e| e.hash == c.hash)
            || self.granted(&c.hash).is_some()
    }

    fn granted(&self, h: &[u8; 32]) -> Option<Grant> {
        let now = std::time::Instant::now();
        self.grants
            .lock()
            .expect("tokens grants")
            .iter()
            .find(|g| g.hash == *h && g.expires > now)
            .cloned()
    }

    /// Issues a grant: a fresh secret that authenticates as `principal` for `ttl` or until
    /// [`Tokens::end_grant`], in memory only (never in the registry, never on another node).
    /// For a principal the registry still holds (`NotFound` otherwise), at most `GRANTS_MAX`
    /// at once (`GrantsFull`). The secret is for a peer the daemon hands it to directly; it
    /// must never be logged or shown.
    pub fn grant(
        &self,
        principal: &Principal,
        ttl: std::time::Duration,
    ) -> Result<String, TokenError> {
        if !self.is_current(principal) {
            return Err(TokenError::NotFound(principal.name.to_string()));
        }
        let secret = format!("estop_gr_{}", &new_secret(principal.role)?[9..]);
        let now = std::time::Instant::now();
        let mut grants = self.grants.lock().expect("tokens grants");
        grants.retain(|g| g.expires > now);
        if grants.len() >= GRANTS_MAX {
            return Err(TokenError::GrantsFull);
        }
        grants.push(Grant {
            principal: principal.clone(),
            hash: hash(&secret),
            expires: now + ttl,
        });
        Ok(secret)
    }

    /// Ends a grant at once: it authenticates nothing more, and a connection that showed it is
    /// refused at its next request.
    pub fn end_grant(&self, secret: &str) {
        let h = hash(secret);
        self.grants
            .lock()
            .expect("tokens grants")
            .retain(|g| g.hash != h);
        for w in self.watchers.lock().expect("tokens watchers").values() {
            if w.hash == h {
                w.signal.fire();
            }
        }
    }

    /// Whether the registry still holds a token for exactly this principal (name, role and
    /// groups): what a holder of a principal without its secret (a console stream) checks.
    pub fn is_current(&self, p: &Principal) -> bool {
        self.entries
            .read()
            .expect("tokens lock")
            .iter()
            .any(|e| e.principal == *p)
    }

    /// Moves on every revocation: a connection watching it re-checks its credential.
    pub fn revocations(&self) -> watch::Receiver<u64> {
        self.revocations.subscribe()
    }

    /// Runs `hook` with the name of every principal revoked from now on.
    pub fn on_revoke(&self, hook: RevokeHook) {
        self.hooks.lock().expect("tokens hooks").push(hook);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bootstrap_creates_admin_and_agent_with_private_files() {
        let dir = tempfile::tempdir().unwrap();
        let (tokens, created) = Tokens::open_or_bootstrap(dir.path(), false).unwrap();
        assert!(created);
        let op = fs::read_to_string(dir.path().join("operator.token")).unwrap();
        let ag = fs::read_to_string(dir.path().join("agent.token")).unwrap();
        assert_eq!(
            tokens.authenticate(&op).unwrap().unwrap().name.as_str(),
            "admin"
        );
        assert_eq!(tokens.authenticate(&ag).unwrap().unwrap().role, Role::Agent);
        for f in ["operator.token", "agent.token", "tokens"] {
            let mode = fs::metadata(dir.path().join(f))
                .unwrap()
                .permissions()
                .mode()
                & 0o777;
            assert_eq!(mode, 0o600, "{f}");
        }
        let registry = fs::read_to_string(dir.path().join("tokens")).unwrap();
        assert!(
            !registry.contains(op.trim()),
            "the registry must not hold secrets"
        );
        // Reopen: same principals, not re-created.
        let (again, created) = Tokens::open_or_bootstrap(dir.path(), false).unwrap();
        assert!(!created);
        assert_eq!(
            again.authenticate(&op).unwrap().unwrap().name.as_str(),
            "admin"
        );
    }

    #[test]
    fn create_refuses_duplicates_reserved_and_bad_names() {
        let dir = tempfile::tempdir().unwrap();
        let (tokens, _) = Tokens::open_or_bootstrap(dir.path(), false).unwrap();
        let s = tokens
            .create("bob", Role::Operator, &["finance".into()])
            .unwrap();
        let p = tokens.authenticate(&s).unwrap().unwrap();
        assert_eq!(p.groups, vec![Box::<str>::from("finance")]);
        assert!(matches!(
            tokens.create("bob", Role::Agent, &[]),
            Err(TokenError::Exists(_))
        ));
        assert!(matches!(
            tokens.create("estop", Role::Agent, &[]),
            Err(TokenError::Reserved(_))
        ));
        assert!(matches!(
            tokens.create("a b", Role::Agent, &[]),
            Err(TokenError::Invalid(_))
        ));
        assert!(tokens.authenticate("nope").unwrap().is_none());
    }

    #[test]
    fn revoke_keeps_an_operator_and_a_recreated_name_is_another_credential() {
        let dir = tempfile::tempdir().unwrap();
        let (tokens, _) = Tokens::open_or_bootstrap(dir.path(), false).unwrap();
        let seen = tokens.revocations();
        assert!(matches!(
            tokens.revoke("admin"),
            Err(TokenError::LastOperator(_))
        ));
        assert!(matches!(tokens.revoke("x"), Err(TokenError::NotFound(_))));
        assert!(
            !seen.has_changed().unwrap(),
            "a refused revoke changes nothing"
        );
        let old = tokens.create("bob", Role::Operator, &[]).unwrap();
        let cred = tokens.credential(&old).unwrap().unwrap();
        let bob_conn = tokens.watch(1, &cred);
        let admin = fs::read_to_string(dir.path().join("operator.token")).unwrap();
        let admin_conn = tokens.watch(2, &tokens.credential(&admin).unwrap().unwrap());
        let ended = std::sync::Arc::new(Mutex::new(Vec::new()));
        let log = std::sync::Arc::clone(&ended);
        tokens.on_revoke(Box::new(move |n| log.lock().unwrap().push(n.to_string())));
        tokens.revoke("bob").unwrap();
        assert!(seen.has_changed().unwrap());
        assert!(bob_conn.is_set(), "bob's connection is told");
        assert!(!admin_conn.is_set(), "nobody else's");
        assert!(
            tokens.watch(3, &cred).is_set(),
            "a connection that registers after the revocation learns it at once"
        );
        tokens.unwatch(1);
        assert_eq!(*ended.lock().unwrap(), vec!["bob".to_string()]);
        assert!(!tokens.is_valid(&cred));
        let new = tokens.create("bob", Role::Operator, &[]).unwrap();
        assert!(!tokens.is_valid(&cred), "the old secret stays revoked");
        assert!(tokens.authenticate(&new).unwrap().is_some());
        // The file agrees with memory.
        let (again, _) = Tokens::open_or_bootstrap(dir.path(), false).unwrap();
        assert!(again.authenticate(&old).unwrap().is_none());
        assert!(again.authenticate(&new).unwrap().is_some());
    }

    #[test]
    fn a_missing_registry_after_the_ledger_was_written_is_refused_unless_reset() {
        let dir = tempfile::tempdir().unwrap();
        Tokens::open_or_bootstrap(dir.path(), false).unwrap();
        fs::create_dir(dir.path().join("ledger")).unwrap();
        fs::write(dir.path().join("ledger/seg-00000000000000000001.log"), b"x").unwrap();
        fs::remove_file(dir.path().join("tokens")).unwrap();
        let e = Tokens::open_or_bootstrap(dir.path(), false).unwrap_err();
        assert!(matches!(e, TokenError::Missing { .. }), "{e}");
        assert!(!dir.path().join("tokens").exists());
        let (_, created) = Tokens::open_or_bootstrap(dir.path(), true).unwrap();
        assert!(created);
    }

    #[test]
    fn concurrent_changes_all_survive_in_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let (tokens, _) = Tokens::open_or_bootstrap(dir.path(), false).unwrap();
        let tokens = std::sync::Arc::new(tokens);
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let tokens = std::sync::Arc::clone(&tokens);
                std::thread::spawn(move || {
                    (0..10)
                        .map(|i| {
                            tokens
                                .create(&format!("t{t}-{i}"), Role::Agent, &[])
                                .unwrap()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let secrets: Vec<String> = threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        let (again, _) = Tokens::open_or_bootstrap(dir.path(), false).unwrap();
        for s in &secrets {
            assert!(again.authenticate(s).unwrap().is_some());
        }
        let names: Vec<String> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(!names.iter().any(|n| n.ends_with(".tmp")), "{names:?}");
    }

    /// A grant authenticates as its principal until it is ended, expires, or the principal is
    /// revoked; it is never in the registry file, and a connection that showed it is told.
    #[test]
    fn a_grant_speaks_for_its_principal_only_while_it_lives() {
        let dir = tempfile::tempdir().unwrap();
        let (tokens, _) = Tokens::open_or_bootstrap(dir.path(), false).unwrap();
        let secret = tokens.create("ops2", Role::Operator, &[]).unwrap();
        let ops2 = tokens.authenticate(&secret).unwrap().unwrap();
        let g = tokens
            .grant(&ops2, std::time::Duration::from_secs(60))
            .unwrap();
        let c = tokens.credential(&g).unwrap().unwrap();
        assert_eq!(c.principal, ops2);
        let file = fs::read_to_string(dir.path().join("tokens")).unwrap();
        assert!(!file.contains(&hex(&hash(&g))), "never in the registry");
        let signal = tokens.watch(1, &c);
        assert!(!signal.is_set());
        tokens.end_grant(&g);
        assert!(signal.is_set(), "the connection that showed it is told");
        assert!(tokens.authenticate(&g).unwrap().is_none(), "ended");

        let expired = tokens.grant(&ops2, std::time::Duration::ZERO).unwrap();
        assert!(tokens.authenticate(&expired).unwrap().is_none(), "expired");

        let g = tokens
            .grant(&ops2, std::time::Duration::from_secs(60))
            .unwrap();
        tokens.revoke("ops2").unwrap();
        assert!(
            tokens.authenticate(&g).unwrap().is_none(),
            "revoked with it"
        );
        assert!(matches!(
            tokens.grant(&ops2, std::time::Duration::from_secs(60)),
            Err(TokenError::NotFound(_))
        ));

        let admin = tokens
            .authenticate(&fs::read_to_string(dir.path().join("operator.token")).unwrap())
            .unwrap()
            .unwrap();
        let held: Vec<String> = (0..GRANTS_MAX)
            .map(|_| {
                tokens
                    .grant(&admin, std::time::Duration::from_secs(60))
                    .unwrap()
            })
            .collect();
        assert!(matches!(
            tokens.grant(&admin, std::time::Duration::from_secs(60)),
            Err(TokenError::GrantsFull)
        ));
        tokens.end_grant(&held[0]);
        tokens
            .grant(&admin, std::time::Duration::from_secs(60))
            .unwrap();
    }
}
