//! A node's connection for its bursts (`core::PgShell`, docs/STORES.md): `tokio-postgres` on a
//! runtime of the core thread's own, its statements prepared once per connection, and each half
//! of a burst sent as one pipelined round trip: `BEGIN` + the writers' lock + the catch-up read
//! together, then `INSERT` + `NOTIFY` + `COMMIT` together. The server runs them in order and
//! answers each; the first that fails fails the burst (a statement after a failed one in the
//! same transaction fails too, and a `COMMIT` there rolls back).

use crate::pgstore::{CHANNEL, LEDGER_LOCK, NewRecord, StoreError, Target};
use std::time::Duration;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Statement};

/// At most this many records are read in one round trip; a node further behind reads page
/// after page in the same transaction, so its memory stays bounded (docs/STORES.md).
pub const CATCH_UP_PAGE: i64 = 4096;

/// Past this, a round trip that has not come back fails the burst and the node fails closed (a
/// lost network must not hold the core forever; the server's `statement_timeout` is shorter).
const ROUND_TRIP_TIMEOUT: Duration = Duration::from_secs(15);

pub struct BurstConn {
    rt: tokio::runtime::Runtime,
    client: Client,
    lock: Statement,
    read: Statement,
    insert: Statement,
    notify: Statement,
    snapshot: Statement,
}

/// A snapshot of the gate to write with a burst: the last seq it covers and its bytes.
pub struct Snapshot {
    pub seq: u64,
    pub bytes: Vec<u8>,
}

use crate::pgstore::INSERT;
const READ: &str = "SELECT seq, record FROM estop_ledger WHERE seq > $1 ORDER BY seq LIMIT $2";

impl BurstConn {
    /// Connects (durability forced on for the session, as `Target::connect`) and prepares the
    /// burst's statements.
    pub fn connect(target: &Target) -> Result<BurstConn, StoreError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| StoreError::Node(format!("no runtime for the connection: {e}")))?;
        let connected = rt.block_on(async {
            let client = target.connect_async().await?;
            let lock = client.prepare("SELECT pg_advisory_xact_lock($1)").await?;
            let read = client.prepare(READ).await?;
            let insert = client.prepare(INSERT).await?;
            let notify = client.prepare("SELECT pg_notify($1, $2)").await?;
            let snapshot = client.prepare(crate::pgstore::SNAPSHOT).await?;
            Ok::<_, StoreError>((client, [lock, read, insert, notify, snapshot]))
        });
        let (client, [lock, read, insert, notify, snapshot]) = connected?;
        Ok(BurstConn {
            rt,
            client,
            lock,
            read,
            insert,
            notify,
            snapshot,
        })
    }

    /// Runs `fut` to its end on this connection's runtime (which also drives the connection),
    /// within `ROUND_TRIP_TIMEOUT`.
    fn run<T>(
        &self,
        fut: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        self.rt.block_on(async {
            match tokio::time::timeout(ROUND_TRIP_TIMEOUT, fut).await {
                Ok(r) => r,
                Err(_) => Err(StoreError::Timeout(ROUND_TRIP_TIMEOUT)),
            }
        })
    }

    /// `BEGIN`, the writers' lock, and the first page of the records after `last`, in one
    /// round trip. The read runs after the lock is granted (statements run in order), so it
    /// sees everything committed by the lock's previous holders.
    pub fn begin(&mut self, last: u64) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
        let c = &self.client;
        let after = last as i64;
        let (lock_args, read_args): (&[&(dyn ToSql + Sync)], &[&(dyn ToSql + Sync)]) =
            (&[&LEDGER_LOCK], &[&after, &CATCH_UP_PAGE]);
        let (begin, lock, rows) = self.run(async {
            Ok(tokio::join!(
                c.batch_execute("BEGIN"),
                c.execute(&self.lock, lock_args),
                c.query(&self.read, read_args),
            ))
        })?;
        begin?;
        lock?;
        crate::pgstore::numbered_on(last, rows?)
    }

    /// The next page after `last`, in the burst's transaction (for a node far behind).
    pub fn page(&mut self, last: u64) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
        let c = &self.client;
        let rows = self.run(async {
            Ok(c.query(&self.read, &[&(last as i64), &CATCH_UP_PAGE])
                .await?)
        })?;
        crate::pgstore::numbered_on(last, rows)
    }

    /// Ends the burst's transaction in one round trip: its records (if any) inserted with one
    /// statement and the other nodes notified (`payload`), the snapshot (if any) written, and
    /// `COMMIT`. The snapshot covers records of this transaction or before: it is visible
    /// exactly when they are.
    pub fn commit(
        &mut self,
        records: &[NewRecord],
        snapshot: Option<&Snapshot>,
        payload: &str,
    ) -> Result<(), StoreError> {
        let seqs: Vec<i64> = records.iter().map(|r| r.seq as i64).collect();
        let ats: Vec<i64> = records.iter().map(|r| r.at_ms as i64).collect();
        let runs: Vec<Option<&str>> = records.iter().map(|r| r.run.as_deref()).collect();
        let principals: Vec<&str> = records.iter().map(|r| r.principal.as_str()).collect();
        let commands: Vec<&str> = records.iter().map(|r| r.command).collect();
        let keys: Vec<Option<&str>> = records.iter().map(|r| r.key.as_deref()).collect();
        let bytes: Vec<&[u8]> = records.iter().map(|r| r.bytes.as_slice()).collect();
        let snap_seq = snapshot.map_or(0, |s| s.seq as i64);
        let snap_bytes = snapshot.map_or(&[][..], |s| s.bytes.as_slice());
        let c = &self.client;
        let insert_args: &[&(dyn ToSql + Sync)] =
            &[&seqs, &ats, &runs, &principals, &commands, &keys, &bytes];
        let notify_args: &[&(dyn ToSql + Sync)] = &[&CHANNEL, &payload];
        let snapshot_args: &[&(dyn ToSql + Sync)] = &[&snap_seq, &snap_bytes];
        let some = !records.is_empty();
        let (inserted, notified, snapshot_done, committed) = self.run(async {
            // Each statement is sent when its future is first polled, which `join!` does in
            // this order, before any answer is awaited: one round trip.
            Ok(tokio::join!(
                execute_if(c, some, &self.insert, insert_args),
                execute_if(c, some, &self.notify, notify_args),
                execute_if(c, snapshot.is_some(), &self.snapshot, snapshot_args),
                c.batch_execute("COMMIT"),
            ))
        })?;
        let inserted = inserted?;
        notified?;
        snapshot_done?;
        committed?;
        // A COMMIT after a statement that failed rolls back without an error: the statements'
        // own results say whether it took.
        assert_eq!(
            inserted,
            records.len() as u64,
            "the insert reported another count"
        );
        Ok(())
    }
}

/// `stmt` run with `args` when `on`; else nothing is sent and the count is 0.
async fn execute_if(
    c: &Client,
    on: bool,
    stmt: &Statement,
    args: &[&(dyn ToSql + Sync)],
) -> Result<u64, tokio_postgres::Error> {
    if !on {
        return Ok(0);
    }
    c.execute(stmt, args).await
}
