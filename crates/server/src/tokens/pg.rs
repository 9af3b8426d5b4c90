//! The token registry in the PostgreSQL store (docs/STORES.md "Tokens"): one table of every
//! node's tokens, `estop_token` (the SHA-256 of each secret, never the secret), so a token made
//! on one node works on every node and a revocation on one refuses it on all.
//!
//! Every change is one transaction under the registry's advisory lock: the live tokens are read,
//! the change is computed on them by the same code as the file registry's (`Tokens::change`),
//! the difference is written with a `pg_notify` on `TOKEN_CHANNEL`, and it commits before the
//! node answers. Authentication looks the secret's hash up in the table (no cache decides it);
//! the node's copy of the live tokens, refreshed on every notification, serves only the
//! per-request checks of connections already open, and fires their revoke signals.
//!
//! The postgres client blocks on a runtime of its own, which panics inside another runtime, so
//! every database call runs on a thread of its own (`off_runtime`) with the caller waiting.

use super::{Entry, TokenError, new_entry, parse};
use crate::pgstore::{StoreError, Target};
use estop_kernel::{Principal, PrincipalName, Role};
use postgres::{Client, GenericClient};
use std::path::Path;
use std::sync::Mutex;

/// `pg_advisory_xact_lock` key of the registry ("estop" in ASCII, then 3; the ledger's are 1
/// and 2): one change of the registry at a time, across all nodes.
pub const TOKEN_LOCK: i64 = 0x6573_746f_7003;
/// The channel a change of the registry notifies: every node refreshes its copy.
pub const TOKEN_CHANNEL: &str = "estop_tokens";

/// The registry's connection to the database (opened again after a failure).
pub struct Registry {
    target: Target,
    conn: Mutex<Option<Client>>,
}

fn store(e: impl std::fmt::Display) -> TokenError {
    TokenError::Store(e.to_string())
}

fn db(e: postgres::Error) -> TokenError {
    store(StoreError::Db(e))
}

/// Runs `f` on a thread of its own and waits for it: the blocking client may not run on a
/// thread that drives a tokio runtime.
fn off_runtime<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| match s.spawn(f).join() {
        Ok(t) => t,
        Err(panic) => std::panic::resume_unwind(panic),
    })
}

fn entry(row: &postgres::Row) -> Result<Entry, TokenError> {
    let bad = |what: &str| store(format!("estop_token holds a bad {what}"));
    let hash: Vec<u8> = row.get(0);
    let name: String = row.get(1);
    let role: String = row.get(2);
    let groups: Vec<String> = row.get(3);
    Ok(Entry {
        principal: Principal {
            name: PrincipalName::new(&name).map_err(|_| bad("name"))?,
            role: Role::parse(&role).ok_or_else(|| bad("role"))?,
            groups: groups.into_iter().map(Into::into).collect(),
            part: Default::default(),
        },
        hash: hash.try_into().map_err(|_| bad("hash"))?,
    })
}

const LIVE: &str = "SELECT hash, name, role, groups FROM estop_token WHERE revoked_at IS NULL";

/// The live (not revoked) tokens, oldest first.
fn live(db_: &mut impl GenericClient) -> Result<Vec<Entry>, TokenError> {
    let rows = db_
        .query(&format!("{LIVE} ORDER BY created_at, name"), &[])
        .map_err(db)?;
    rows.iter().map(entry).collect()
}

fn insert(db_: &mut impl GenericClient, e: &Entry) -> Result<(), TokenError> {
    let groups: Vec<&str> = e.principal.groups.iter().map(|g| &**g).collect();
    db_.execute(
        "INSERT INTO estop_token (hash, name, role, groups) VALUES ($1, $2, $3, $4)",
        &[
            &&e.hash[..],
            &e.principal.name.as_str(),
            &e.principal.role.as_str(),
            &groups,
        ],
    )
    .map_err(db)?;
    Ok(())
}

/// Writes the difference from `before` to `after` (new hashes inserted, gone ones revoked) and
/// notifies the other nodes.
fn write_difference(
    tx: &mut postgres::Transaction<'_>,
    before: &[Entry],
    after: &[Entry],
) -> Result<(), TokenError> {
    for e in after
        .iter()
        .filter(|e| !before.iter().any(|b| b.hash == e.hash))
    {
        insert(tx, e)?;
    }
    for e in before
        .iter()
        .filter(|b| !after.iter().any(|e| e.hash == b.hash))
    {
        tx.execute(
            "UPDATE estop_token SET revoked_at = now() WHERE hash = $1 AND revoked_at IS NULL",
            &[&&e.hash[..]],
        )
        .map_err(db)?;
    }
    tx.execute("SELECT pg_notify($1, '')", &[&TOKEN_CHANNEL])
        .map_err(db)?;
    Ok(())
}

impl Registry {
    /// Runs `f` on the registry's connection (connecting first if there is none), off the
    /// runtime; a connection that failed is dropped, so the next call connects again.
    fn with<T: Send>(
        &self,
        f: impl FnOnce(&mut Client) -> Result<T, TokenError> + Send,
    ) -> Result<T, TokenError> {
        off_runtime(|| {
            let mut conn = self.conn.lock().expect("token registry connection");
            if conn.as_ref().is_none_or(Client::is_closed) {
                *conn = Some(self.target.connect().map_err(store)?);
            }
            let client = conn.as_mut().expect("connected above");
            let out = f(client);
            if matches!(out, Err(TokenError::Store(_))) {
                *conn = None;
            }
            out
        })
    }

    /// [`Registry::with`] for a read, which is safe to repeat: a read that fails on a
    /// connection opened before (a restart of the server broke it, and the client only learns
    /// that when it next speaks) is tried once more on a fresh one; a fresh connection's
    /// failure is the answer.
    fn read<T: Send>(
        &self,
        f: impl Fn(&mut Client) -> Result<T, TokenError> + Send + Sync,
    ) -> Result<T, TokenError> {
        off_runtime(|| {
            let mut conn = self.conn.lock().expect("token registry connection");
            loop {
                let fresh = conn.as_ref().is_none_or(Client::is_closed);
                if fresh {
                    *conn = Some(self.target.connect().map_err(store)?);
                }
                let out = f(conn.as_mut().expect("connected above"));
                if !matches!(out, Err(TokenError::Store(_))) {
                    return out;
                }
                *conn = None;
                if fresh {
                    return out;
                }
            }
        })
    }

    /// The live tokens as the database has them now.
    pub(super) fn live(&self) -> Result<Vec<Entry>, TokenError> {
        self.read(live)
    }

    /// The live token whose secret hashes to `hash`, if any.
    pub(super) fn lookup(&self, hash: &[u8; 32]) -> Result<Option<Entry>, TokenError> {
        self.read(|c| {
            let row = c
                .query_opt(&format!("{LIVE} AND hash = $1"), &[&&hash[..]])
                .map_err(db)?;
            row.as_ref().map(entry).transpose()
        })
    }

    /// Applies `f` to the live tokens under the registry's lock and commits the difference;
    /// returns `f`'s result and the live tokens after it. `f` refusing writes nothing.
    pub(super) fn change<T: Send>(
        &self,
        f: impl FnOnce(&mut Vec<Entry>) -> Result<T, TokenError> + Send,
    ) -> Result<(T, Vec<Entry>), TokenError> {
        self.with(|c| {
            let mut tx = c.transaction().map_err(db)?;
            tx.execute("SELECT pg_advisory_xact_lock($1)", &[&TOKEN_LOCK])
                .map_err(db)?;
            let before = live(&mut tx)?;
            let mut after = before.clone();
            let out = f(&mut after)?;
            write_difference(&mut tx, &before, &after)?;
            tx.commit().map_err(db)?;
            Ok((out, after))
        })
    }
}

/// What opening the registry in the database found or did.
pub(super) struct Opened {
    pub registry: Registry,
    pub live: Vec<Entry>,
    /// Bootstrap tokens were made now (their secrets are in `DATA/operator.token` and
    /// `DATA/agent.token`).
    pub created: bool,
}

/// Opens the registry in the database at `url` for a node whose data dir is `data`: the first
/// node on an empty registry bootstraps `admin` and `agent` (or, upgrading from per-node
/// registries, brings its `DATA/tokens` in); a registry that is empty while the database holds
/// records is refused unless `reset` (as a missing `DATA/tokens` is). Under the registry's lock,
/// so nodes starting together bootstrap once.
pub(super) fn open(data: &Path, url: &str, reset: bool) -> Result<Opened, TokenError> {
    let target = Target::parse(url).map_err(store)?;
    let mut client = target.connect().map_err(store)?;
    crate::pgstore::migrate(&mut client).map_err(store)?;
    let mut tx = client.transaction().map_err(db)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&TOKEN_LOCK])
        .map_err(db)?;
    let ever: i64 = tx
        .query_one("SELECT count(*) FROM estop_token", &[])
        .map_err(db)?
        .get(0);
    let mut created = false;
    if ever == 0 {
        let file = data.join("tokens");
        if let Some(n) = copy_file_registry(&mut tx, data)? {
            crate::log::info(&format!(
                "store: brought {n} tokens from {} into the database's registry; the file is no longer read",
                file.display()
            ));
        } else {
            let records: i64 = tx
                .query_one("SELECT count(*) FROM estop_ledger", &[])
                .map_err(db)?
                .get(0);
            if records > 0 && !reset {
                return Err(TokenError::MissingInDatabase { records });
            }
            bootstrap(&mut tx, data)?;
            created = true;
        }
    } else if data.join("tokens").exists() {
        crate::log::info(&format!(
            "store: {} is not read: the tokens live in the database (estop_token)",
            data.join("tokens").display()
        ));
    }
    let live = live(&mut tx)?;
    tx.commit().map_err(db)?;
    let registry = Registry {
        target,
        conn: Mutex::new(Some(client)),
    };
    Ok(Opened {
        registry,
        live,
        created,
    })
}

/// Makes `admin` and `agent`, their secrets written to `data` before the rows (a crash in
/// between leaves the registry empty, so the next start bootstraps again).
fn bootstrap(tx: &mut postgres::Transaction<'_>, data: &Path) -> Result<(), TokenError> {
    let (admin, op) = new_entry("admin", Role::Operator, &[])?;
    let (agent, ag) = new_entry("agent", Role::Agent, &[])?;
    for (file, secret) in [("operator.token", op), ("agent.token", ag)] {
        let path = data.join(file);
        super::write_private(&path, format!("{secret}\n").as_bytes()).map_err(|source| {
            TokenError::Io {
                op: "write",
                path,
                source,
            }
        })?;
    }
    insert(tx, &admin)?;
    insert(tx, &agent)
}

/// Inserts the tokens of `DATA/tokens`, if the file exists, into the registry in the database
/// (the upgrade from per-node registries, and `estop store export`); how many.
pub fn copy_file_registry(
    db_: &mut impl GenericClient,
    data: &Path,
) -> Result<Option<usize>, TokenError> {
    let path = data.join("tokens");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(TokenError::Io {
                op: "read",
                path,
                source,
            });
        }
    };
    let entries = parse(&path, &text)?;
    for e in &entries {
        insert(db_, e)?;
    }
    Ok(Some(entries.len()))
}

/// Writes the live tokens of the database into a new `DATA/tokens` (`estop store import`), so
/// the imported data dir takes the same secrets; how many. `None`: `data` has a registry of its
/// own already, which is left alone.
pub fn write_file_registry(
    db_: &mut impl GenericClient,
    data: &Path,
) -> Result<Option<usize>, TokenError> {
    let path = data.join("tokens");
    if std::fs::symlink_metadata(&path).is_ok() {
        return Ok(None);
    }
    let entries = live(db_)?;
    super::write_private(&path, super::render(&entries).as_bytes()).map_err(|source| {
        TokenError::Io {
            op: "write",
            path,
            source,
        }
    })?;
    Ok(Some(entries.len()))
}
