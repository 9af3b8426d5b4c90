//! The PostgreSQL store (`estop serve --store postgres://…`, docs/STORES.md): the database
//! holds the one truth, an append-only table of ledger records in the embedded ledger's own
//! encoding (`estop_kernel::record_codec`); each node keeps the gate in memory and commits a
//! burst of commands in one transaction under an advisory lock (`core::PgShell`). This module
//! is the database side: connecting, the migrations estop owns, reading and inserting records,
//! and rebuilding a gate from them.

use crate::journal::replay_record;
use estop_kernel::record_codec::{RecordDecoder, decode_snapshot};
use estop_kernel::{Gate, Limits};
use postgres::{Client, Config, GenericClient};
use std::time::Duration;

/// The schema version this binary writes and reads (`estop_schema`).
pub const SCHEMA_VERSION: i32 = 5;

/// Migrations, in order: each brings the schema from the version before it to its own.
const MIGRATIONS: &[(i32, &str)] = &[
    (
        1,
        "CREATE TABLE estop_ledger (
         seq bigint PRIMARY KEY CHECK (seq > 0),
         at_ms bigint NOT NULL,
         run_id text,
         principal text NOT NULL,
         command text NOT NULL,
         record bytea NOT NULL
     );
     CREATE INDEX estop_ledger_run ON estop_ledger (run_id, seq) WHERE run_id IS NOT NULL;",
    ),
    (
        2,
        // The newest snapshot of the gate (`record_codec`'s snapshot bytes) and the last seq it
        // covers: a node that starts replays only the records after it.
        "CREATE TABLE estop_snapshot (
             seq bigint PRIMARY KEY CHECK (seq > 0),
             taken_at timestamptz NOT NULL DEFAULT now(),
             snapshot bytea NOT NULL
         );",
    ),
    (
        3,
        // The token registry of every node (`tokens::pg`): the SHA-256 of each secret, never
        // the secret; a revoked token keeps its row (revoked_at), so a secret once revoked
        // never comes back. One live token per name.
        "CREATE TABLE estop_token (
             hash bytea PRIMARY KEY CHECK (length(hash) = 32),
             name text NOT NULL,
             role text NOT NULL CHECK (role IN ('operator', 'agent', 'observer')),
             groups text[] NOT NULL,
             created_at timestamptz NOT NULL DEFAULT now(),
             revoked_at timestamptz
         );
         CREATE UNIQUE INDEX estop_token_live_name ON estop_token (name) WHERE revoked_at IS NULL;",
    ),
    (
        4,
        // The effect a record is about, for the operators' queries (an effect's admission,
        // decisions, start and outcome); filled in for the records before it by
        // `backfill_effect_keys`, in the same transaction.
        "ALTER TABLE estop_ledger ADD COLUMN effect_key text;
         CREATE INDEX estop_ledger_effect ON estop_ledger (run_id, effect_key, seq)
             WHERE effect_key IS NOT NULL;",
    ),
    (
        5,
        // Every node's secrets (`seal`: the key admission tokens are sealed with), made by the
        // first node that needs one.
        "CREATE TABLE estop_secret (
             name text PRIMARY KEY,
             secret bytea NOT NULL CHECK (length(secret) = 32),
             created_at timestamptz NOT NULL DEFAULT now()
         );",
    ),
];

/// `pg_advisory_xact_lock` keys ("estop" in ASCII, then a number): the writers' lock every
/// burst takes, and the migrations' lock taken at start.
pub const LEDGER_LOCK: i64 = 0x6573_746f_7001;
pub const MIGRATION_LOCK: i64 = 0x6573_746f_7002;

/// The channel a node notifies after each commit that inserted records (payload: its node id
/// and the last seq), so the other nodes catch up at once.
pub const CHANNEL: &str = "estop_ledger";

/// How long connecting may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("bad database URL: {0}")]
    Url(String),
    #[error("database: {}", chain(.0))]
    Db(#[from] postgres::Error),
    #[error(
        "the database holds estop schema version {found}, newer than this estop knows ({known}): run a newer estop, or point this one at another database"
    )]
    Newer { found: i32, known: i32 },
    #[error("the ledger in the database cannot be replayed: {0}")]
    Corrupt(String),
    #[error("cannot start the node: {0}")]
    Node(String),
    #[error("{0}")]
    Move(String),
    #[error("the database did not answer within {0:?}")]
    Timeout(Duration),
}

/// An error and its causes ("error performing TLS handshake: invalid peer certificate: …").
fn chain(e: &postgres::Error) -> String {
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        text.push_str(&format!(": {c}"));
        cause = c.source();
    }
    text
}

impl StoreError {
    pub fn code(&self) -> &'static str {
        match self {
            StoreError::Url(_) => "store_url",
            StoreError::Db(_) => "store_unavailable",
            StoreError::Newer { .. } => "store_schema_newer",
            StoreError::Corrupt(_) => "store_corrupt",
            StoreError::Node(_) => "setup",
            StoreError::Move(_) => "store_move",
            StoreError::Timeout(_) => "store_unavailable",
        }
    }
}

/// Where the store is: a parsed `postgres://` URL (or libpq key=value string).
#[derive(Clone)]
pub struct Target {
    config: tokio_postgres::Config,
    /// The TLS connector for the URL's `sslmode` and `sslrootcert` (`pgtls`); not used when
    /// the mode is `disable`.
    tls: tokio_postgres_rustls::MakeRustlsConnect,
    pub tls_mode: crate::pgtls::Mode,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The config may hold a password: show where, never it.
        write!(
            f,
            "Target({:?} {:?})",
            self.config.get_hosts(),
            self.config.get_dbname()
        )
    }
}

impl Target {
    pub fn parse(url: &str) -> Result<Target, StoreError> {
        let (rest, tls) = crate::pgtls::split(url).map_err(|e| StoreError::Url(e.0))?;
        let tls_mode = tls.mode;
        let mut config: tokio_postgres::Config = rest
            .parse()
            .map_err(|e: postgres::Error| StoreError::Url(e.to_string()))?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        config.application_name("estop");
        config.ssl_mode(tls_mode.ssl_mode());
        let tls = crate::pgtls::connector(&tls).map_err(|e| StoreError::Url(e.0))?;
        Ok(Target {
            config,
            tls,
            tls_mode,
        })
    }

    /// A connection with durability forced on for its session: a commit returns only once
    /// its WAL is flushed (and replicated, where the server is set up so), whatever the
    /// server's default says (G6: a reply never precedes a durable commit).
    pub fn connect(&self) -> Result<Client, StoreError> {
        let mut client = Config::from(self.config.clone()).connect(self.tls.clone())?;
        client.batch_execute(SESSION)?;
        Ok(client)
    }

    /// `connect` for `tokio-postgres` (a node's pipelined connection, `pgconn`): the connection's
    /// task is spawned on the runtime this is awaited on.
    pub async fn connect_async(&self) -> Result<tokio_postgres::Client, StoreError> {
        let (client, connection) = self.config.connect(self.tls.clone()).await?;
        tokio::spawn(async move {
            // Its end is seen by the client's next request, which fails.
            let _ = connection.await;
        });
        client.batch_execute(SESSION).await?;
        Ok(client)
    }
}

/// Every session's settings: durability forced on; no statement that runs longer than 10 s (a
/// lost network must not hold the core forever: past it the node fails closed and retries);
/// and a session idle inside a transaction for 5 s ended by the server, so a node frozen
/// in the middle of a burst (SIGSTOP, a paused VM) frees the writers' lock for the others
/// before their own statements time out.
const SESSION: &str = "SET synchronous_commit = on; SET statement_timeout = 10000; \
                       SET idle_in_transaction_session_timeout = 5000";

/// Brings the schema to `SCHEMA_VERSION` under the migrations' advisory lock (nodes starting
/// together migrate once); refuses a database whose schema is newer than this binary.
pub fn migrate(client: &mut Client) -> Result<i32, StoreError> {
    let mut tx = client.transaction()?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS estop_schema (
             version integer PRIMARY KEY,
             applied_at timestamptz NOT NULL DEFAULT now()
         )",
    )?;
    let found: i32 = tx
        .query_one("SELECT coalesce(max(version), 0) FROM estop_schema", &[])?
        .get(0);
    if found > SCHEMA_VERSION {
        return Err(StoreError::Newer {
            found,
            known: SCHEMA_VERSION,
        });
    }
    for (version, sql) in MIGRATIONS.iter().filter(|(v, _)| *v > found) {
        tx.batch_execute(sql)?;
        if *version == 4 {
            backfill_effect_keys(&mut tx)?;
        }
        tx.execute("INSERT INTO estop_schema (version) VALUES ($1)", &[version])?;
        crate::log::info(&format!("store: migrated the schema to version {version}"));
    }
    tx.commit()?;
    Ok(SCHEMA_VERSION)
}

/// The records after `seq`, in order; an error if they are not numbered on from it.
/// Sets `effect_key` of the records written before the column existed (migration 4), read
/// out of their bytes a page at a time.
fn backfill_effect_keys(tx: &mut postgres::Transaction<'_>) -> Result<(), StoreError> {
    let mut decoder = RecordDecoder::default();
    let mut after: i64 = 0;
    loop {
        let rows = tx.query(
            "SELECT seq, record FROM estop_ledger WHERE seq > $1 ORDER BY seq LIMIT $2",
            &[&after, &LOAD_PAGE],
        )?;
        let Some(last) = rows.last() else {
            return Ok(());
        };
        after = last.get(0);
        let (mut seqs, mut keys) = (Vec::new(), Vec::new());
        for row in &rows {
            let rec = decoder.decode(row.get(1)).map_err(|e| {
                StoreError::Corrupt(format!("record {}: {e}", row.get::<_, i64>(0)))
            })?;
            if let Some(key) = rec.command.key() {
                seqs.push(row.get::<_, i64>(0));
                keys.push(key.as_str().to_string());
            }
        }
        tx.execute(
            "UPDATE estop_ledger l SET effect_key = u.k
               FROM unnest($1::bigint[], $2::text[]) AS u(s, k) WHERE l.seq = u.s",
            &[&seqs, &keys],
        )?;
    }
}

pub fn records_after(
    db: &mut impl GenericClient,
    seq: u64,
) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
    let rows = db.query(
        "SELECT seq, record FROM estop_ledger WHERE seq > $1 ORDER BY seq",
        &[&(seq as i64)],
    )?;
    numbered_on(seq, rows)
}

/// Rows of (seq, record) that must number on from `seq`; an error at the first gap.
pub fn numbered_on(seq: u64, rows: Vec<postgres::Row>) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
    let mut out = Vec::with_capacity(rows.len());
    for (expect, row) in (seq + 1..).zip(rows) {
        let got = row.get::<_, i64>(0) as u64;
        if got != expect {
            return Err(StoreError::Corrupt(format!(
                "seq {expect} is missing (the next record is {got})"
            )));
        }
        out.push((got, row.get::<_, Vec<u8>>(1)));
    }
    Ok(out)
}

/// Up to 1024 records after `after` and not past `upto` (of `run`, if given), in order: a page
/// for the operators' readers (the `ledger` verb, `estop ledger show`).
pub fn records_page(
    db: &mut Client,
    after: u64,
    upto: u64,
    run: Option<&str>,
) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
    let rows = db.query(
        "SELECT seq, record FROM estop_ledger
          WHERE seq > $1 AND seq <= $2 AND ($3::text IS NULL OR run_id = $3)
          ORDER BY seq LIMIT 1024",
        &[&(after as i64), &(upto.min(i64::MAX as u64) as i64), &run],
    )?;
    Ok(rows
        .into_iter()
        .map(|r| (r.get::<_, i64>(0) as u64, r.get(1)))
        .collect())
}

/// The file in a node's data directory that names its store (`DATA/store.url`, mode 0600: the
/// URL may hold a password), so `estop ledger show|verify --data DIR` read where the node
/// writes.
pub const STORE_FILE: &str = "store.url";

/// Writes `STORE_FILE` into `data`.
pub fn remember(data: &std::path::Path, url: &str) -> Result<(), StoreError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = data.join(STORE_FILE);
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)?;
        // `mode` applies only to a file it creates: one left with a looser mode is narrowed
        // before the URL (its password) is written into it.
        use std::os::unix::fs::PermissionsExt;
        f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
        f.write_all(url.as_bytes())?;
        f.write_all(b"\n")
    };
    write().map_err(|e| StoreError::Node(format!("cannot write {}: {e}", path.display())))
}

/// What `estop ledger verify` finds in the database.
#[derive(Debug)]
pub struct Verified {
    pub records: u64,
    pub last_seq: u64,
    pub snapshot_seq: Option<u64>,
}

/// Checks the database as a node starting on it would: the records numbered 1, 2, … with no
/// gap, each decoding, and the gate rebuilt from the newest snapshot and the records after it
/// (`load`), and every record from the first replayed too (so a bad record hidden behind a
/// snapshot is found).
pub fn verify(target: &Target, limits: &Limits) -> Result<Verified, StoreError> {
    let mut db = target.connect()?;
    let snapshot_seq = newest_snapshot(&mut db)?.map(|(seq, _)| seq);
    let (_, last_seq) = load(&mut db, limits)?;
    let mut gate = Gate::new(limits.for_replay());
    let mut decoder = RecordDecoder::default();
    let mut at = 0;
    while at < last_seq {
        let page = records_page(&mut db, at, last_seq, None)?;
        if page.is_empty() {
            break;
        }
        for (seq, bytes) in &page {
            if *seq != at + 1 {
                return Err(StoreError::Corrupt(format!(
                    "seq {} is missing (the next record is {seq})",
                    at + 1
                )));
            }
            replay_record(&mut gate, &mut decoder, bytes)
                .map_err(|e| StoreError::Corrupt(format!("record {seq}: {e}")))?;
            at = *seq;
        }
    }
    if at != last_seq {
        return Err(StoreError::Corrupt(format!(
            "records end at seq {at}, the gate at {last_seq}"
        )));
    }
    Ok(Verified {
        records: last_seq,
        last_seq,
        snapshot_seq,
    })
}

/// One record to insert, with the columns queries use beside its bytes.
#[derive(Debug)]
pub struct NewRecord {
    pub seq: u64,
    pub at_ms: u64,
    pub run: Option<String>,
    pub principal: String,
    pub command: &'static str,
    /// The effect it is about, if one.
    pub key: Option<String>,
    pub bytes: Vec<u8>,
}

impl NewRecord {
    /// Reads the columns from the encoded record.
    pub fn new(
        seq: u64,
        bytes: &[u8],
        decoder: &mut RecordDecoder,
    ) -> Result<NewRecord, StoreError> {
        let rec = decoder
            .decode(bytes)
            .map_err(|e| StoreError::Corrupt(format!("the core encoded a bad record: {e}")))?;
        Ok(NewRecord {
            seq,
            at_ms: rec.at,
            run: rec.command.run().map(|r| r.as_str().to_string()),
            principal: rec.principal.name.as_str().to_string(),
            command: crate::describe::kind(&rec.command),
            key: rec.command.key().map(|k| k.as_str().to_string()),
            bytes: bytes.to_vec(),
        })
    }
}

/// The statement that inserts records, one array per column (here and in a node's bursts,
/// `pgconn`).
pub const INSERT: &str =
    "INSERT INTO estop_ledger (seq, at_ms, run_id, principal, command, effect_key, record)
     SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::text[], $5::text[],
                          $6::text[], $7::bytea[])";

/// Inserts a burst's records with one statement. A seq another writer took is a
/// primary-key violation: the transaction fails and nothing of it is acknowledged.
pub fn insert(db: &mut impl GenericClient, records: &[NewRecord]) -> Result<(), StoreError> {
    let seqs: Vec<i64> = records.iter().map(|r| r.seq as i64).collect();
    let ats: Vec<i64> = records.iter().map(|r| r.at_ms as i64).collect();
    let runs: Vec<Option<&str>> = records.iter().map(|r| r.run.as_deref()).collect();
    let principals: Vec<&str> = records.iter().map(|r| r.principal.as_str()).collect();
    let commands: Vec<&str> = records.iter().map(|r| r.command).collect();
    let keys: Vec<Option<&str>> = records.iter().map(|r| r.key.as_deref()).collect();
    let bytes: Vec<&[u8]> = records.iter().map(|r| r.bytes.as_slice()).collect();
    db.execute(
        INSERT,
        &[&seqs, &ats, &runs, &principals, &commands, &keys, &bytes],
    )?;
    Ok(())
}

/// Writes a snapshot covering the records up to `$1` (`$2`: its bytes). The newest replaces
/// the ones before it (every record is kept, so an older one is never needed: a snapshot that
/// does not decode is passed over for a full replay).
pub const SNAPSHOT: &str = "WITH old AS (DELETE FROM estop_snapshot WHERE seq < $1)
     INSERT INTO estop_snapshot (seq, snapshot) VALUES ($1, $2) ON CONFLICT (seq) DO NOTHING";

/// How many records `load` reads in one query: a node rebuilding its gate holds one page of
/// records in memory at a time, whatever the table's length.
const LOAD_PAGE: i64 = 4096;

/// Rebuilds the gate from the database: the newest snapshot (`estop_snapshot`), then the
/// records after it, page by page, through the replay recovery uses
/// (`journal::replay_record`), under `limits.for_replay()`, then today's limits. A snapshot
/// that does not decode is passed over (logged): every record is kept, so the gate is rebuilt
/// from the first. Returns the gate and the last seq.
pub fn load(db: &mut Client, limits: &Limits) -> Result<(Gate, u64), StoreError> {
    let replay_limits = limits.for_replay();
    let (mut gate, mut last) = match newest_snapshot(db)? {
        Some((seq, bytes)) => match decode_snapshot(&bytes, replay_limits.clone()) {
            Ok(gate) => (gate, seq),
            Err(e) => {
                crate::log::error(&format!(
                    "store: the snapshot at seq {seq} does not decode ({e}); replaying every record instead"
                ));
                (Gate::new(replay_limits), 0)
            }
        },
        None => (Gate::new(replay_limits), 0),
    };
    let snapshot_seq = last;
    let mut decoder = RecordDecoder::default();
    loop {
        let rows = db.query(
            "SELECT seq, record FROM estop_ledger WHERE seq > $1 ORDER BY seq LIMIT $2",
            &[&(last as i64), &LOAD_PAGE],
        )?;
        let page = numbered_on(last, rows)?;
        for (seq, bytes) in &page {
            replay_record(&mut gate, &mut decoder, bytes)
                .map_err(|e| StoreError::Corrupt(format!("record {seq}: {e}")))?;
            last = *seq;
        }
        if (page.len() as i64) < LOAD_PAGE {
            break;
        }
    }
    if snapshot_seq > 0 && last == snapshot_seq && !has_record(db, snapshot_seq)? {
        return Err(StoreError::Corrupt(format!(
            "the snapshot covers seq {snapshot_seq}, and there is no such record"
        )));
    }
    gate.set_limits(limits.clone());
    Ok((gate, last))
}

/// The newest snapshot: its seq and bytes.
fn newest_snapshot(db: &mut Client) -> Result<Option<(u64, Vec<u8>)>, StoreError> {
    let row = db.query_opt(
        "SELECT seq, snapshot FROM estop_snapshot ORDER BY seq DESC LIMIT 1",
        &[],
    )?;
    Ok(row.map(|r| (r.get::<_, i64>(0) as u64, r.get(1))))
}

fn has_record(db: &mut Client, seq: u64) -> Result<bool, StoreError> {
    Ok(db
        .query_opt(
            "SELECT 1 FROM estop_ledger WHERE seq = $1",
            &[&(seq as i64)],
        )?
        .is_some())
}

/// Connects, migrates and rebuilds the gate: what a node does at start and after a failure.
pub fn open(target: &Target, limits: &Limits) -> Result<(Client, Gate, u64), StoreError> {
    let mut client = target.connect()?;
    migrate(&mut client)?;
    let (gate, last) = load(&mut client, limits)?;
    Ok((client, gate, last))
}
