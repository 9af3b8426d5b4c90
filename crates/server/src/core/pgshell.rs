//! The core's shell over PostgreSQL (`estop serve --store postgres://…`, docs/STORES.md): the
//! same core, its actions executed against the database instead of the embedded ledger.
//!
//! A burst is one transaction in two round trips (`pgconn::BurstConn`, pipelined): `begin` takes
//! the writers' advisory lock and applies the records other nodes committed since this node's
//! last (`Core::catch_up`, page by page for a node far behind); the core then applies the burst's
//! messages, numbering its records on from the database's last; `commit` inserts them and
//! commits (`synchronous_commit = on`), and only then are the replies that depend on them
//! released (G6). Anything the database refuses fails the node closed: what was not committed
//! is answered `unavailable`, and the gate is rebuilt from the database (retried every second).

use super::shell::deliver;
use super::*;
use crate::durable::{DurableState, Release};
use crate::pgconn::{BurstConn, CATCH_UP_PAGE, Snapshot};
use crate::pgstore::{NewRecord, StoreError};
use estop_kernel::record_codec::RecordDecoder;
use std::sync::atomic::AtomicBool;
use tokio::sync::watch;

/// Connects to the database, migrates it and rebuilds the gate (`pgstore::open`).
pub type PgOpenFn = Box<dyn FnMut() -> Result<(BurstConn, Gate, u64), StoreError> + Send>;

/// The core and what executes its actions against PostgreSQL.
pub struct PgShell {
    core: Core,
    /// `None` from a failure until the database is reopened.
    db: Option<BurstConn>,
    open: PgOpenFn,
    /// A burst's transaction is open (the advisory lock is held).
    in_tx: bool,
    /// The burst's records, inserted at its commit.
    pending: Vec<NewRecord>,
    /// A snapshot of the gate the core asked for, written with the burst's commit.
    snapshot: Option<Snapshot>,
    decoder: RecordDecoder,
    durable_tx: Arc<watch::Sender<DurableState>>,
    release: Arc<Release>,
    generation: u64,
    /// Set by the listener when another node committed; cleared when a burst begins (which
    /// catches up), so one wake-up message stands for any number of notifications.
    wake: Arc<AtomicBool>,
    /// Sent with every notification, so the listener ignores this node's own.
    node: String,
    /// A planted bug for the test that must catch it (`CoreOptions::planted_reply_before_commit`):
    /// replies are released before the COMMIT they depend on.
    planted_reply_before_commit: bool,
}

impl PgShell {
    /// Opens the database (`open()`), rebuilds the gate and starts the core on it.
    pub fn new(
        opts: CoreOptions,
        durable_tx: Arc<watch::Sender<DurableState>>,
        mut open: PgOpenFn,
        wake: Arc<AtomicBool>,
        node: String,
    ) -> Result<PgShell, StoreError> {
        let (db, gate, last_seq) = open()?;
        durable_tx.send_modify(|s| {
            s.generation = 0;
            s.seq = last_seq;
            s.failed = false;
        });
        let release = Arc::new(Release::default());
        release.start(0, last_seq);
        Ok(PgShell {
            planted_reply_before_commit: opts.planted_reply_before_commit,
            core: Core::new(opts, gate, last_seq),
            db: Some(db),
            open,
            in_tx: false,
            pending: Vec::new(),
            snapshot: None,
            decoder: RecordDecoder::default(),
            durable_tx,
            release,
            generation: 0,
            wake,
            node,
        })
    }

    pub fn core(&self) -> &Core {
        &self.core
    }

    /// Starts a burst: its transaction, the writers' lock, and the records committed
    /// elsewhere since this node's last, applied first. A connection found broken here is
    /// replaced at once (the failure's recovery) and the burst begins on the new one; with
    /// the database still down the core stays failed closed and answers `unavailable`.
    pub fn begin(&mut self) {
        self.wake.store(false, Ordering::SeqCst);
        for _ in 0..2 {
            self.try_begin();
            self.execute();
            if self.in_tx || !self.core.is_writing() {
                return;
            }
        }
    }

    fn try_begin(&mut self) {
        if !self.core.is_writing() {
            return; // Down: the core answers `unavailable`; recovery runs on its timer.
        }
        let Some(db) = self.db.as_mut() else { return };
        match db.begin(self.core.last_seq()) {
            Ok(records) => {
                self.in_tx = true;
                self.catch_up(records);
            }
            Err(e) => self.fail(&format!("starting a transaction: {e}")),
        }
    }

    /// Applies what other nodes committed, a page at a time: a full page means there may be
    /// more, read in the same transaction once this one is applied (a node far behind holds one
    /// page in memory, not the whole gap).
    fn catch_up(&mut self, mut records: Vec<(u64, Vec<u8>)>) {
        loop {
            let Some((caught_up, _)) = records.last() else {
                return;
            };
            let caught_up = *caught_up;
            match self.core.catch_up(&records) {
                // They were committed by their nodes: durable already.
                Ok(()) => self.durable(caught_up),
                Err(e) => return self.fail(&format!("catching up: {e}")),
            }
            if (records.len() as i64) < CATCH_UP_PAGE {
                return;
            }
            let Some(db) = self.db.as_mut() else { return };
            records = match db.page(caught_up) {
                Ok(r) => r,
                Err(e) => return self.fail(&format!("catching up after seq {caught_up}: {e}")),
            };
        }
    }

    /// Handles one message at `now` and does what it asks; returns true to stop.
    pub fn handle(&mut self, now: Now, msg: CoreMsg) -> bool {
        if matches!(msg, CoreMsg::CatchUp) {
            // Taken in the middle of a burst, it needs no catch-up of its own: while this
            // burst holds the writers' lock no other node commits, so what it announces was
            // read at `begin`. Cleared here too, else the wake-up flag would stay set with no
            // message queued, and the listener would never wake the core again.
            self.wake.store(false, Ordering::SeqCst);
        }
        let stop = self.core.handle(now, msg);
        self.execute();
        stop
    }

    /// Timer work due at `now` (`Core::fire_timers`), done.
    pub fn fire_timers(&mut self, now: Now) {
        self.core.fire_timers(now);
        self.execute();
    }

    /// Ends the burst: its records inserted and committed, then their replies released.
    /// Never syncs "inline" in the ledger's sense: returns `Some(false)` when it committed
    /// records, `None` when there were none.
    pub fn commit(&mut self) -> Option<bool> {
        let asked = self.core.commit(|| u64::MAX);
        self.execute();
        // A burst that appended nothing still ends its transaction (and the lock).
        self.finish();
        // What a failed commit queued (the `unavailable` answers, the recovery).
        self.execute();
        asked.then_some(false)
    }

    /// See `Core::next_timeout`.
    pub fn next_timeout(&mut self, now: Now) -> Option<Duration> {
        self.core.next_timeout(now)
    }

    fn execute(&mut self) {
        while let Some(action) = self.core.poll_action() {
            match action {
                Action::Append { seq, bytes } => self.append(seq, &bytes),
                Action::Commit { .. } | Action::Flush => self.finish(),
                // Written with the burst's commit; the core asks for it from its timers, which
                // run inside a burst.
                Action::Snapshot { seq, bytes } => self.snapshot = Some(Snapshot { seq, bytes }),
                Action::FailLedger => self.fail_store(),
                Action::Recover => self.recover(),
                other => deliver(&mut self.core, &self.release, other),
            }
        }
    }

    fn append(&mut self, seq: u64, bytes: &std::ops::Range<usize>) {
        if !self.core.is_writing() {
            return; // After a failure the rest of the round is not kept: the core failed closed.
        }
        if !self.in_tx {
            // The store failed and recovered in the middle of this burst: the lock is not held,
            // so this record's seq may be another node's. Fail closed again; the next burst
            // begins afresh.
            self.fail(&format!("record {seq} outside a transaction"));
            return;
        }
        let next = self.durable_tx.borrow().seq + self.pending.len() as u64 + 1;
        assert_eq!(
            seq, next,
            "the core numbered a record otherwise than the store"
        );
        match NewRecord::new(seq, self.core.record(bytes), &mut self.decoder) {
            Ok(r) => self.pending.push(r),
            Err(e) => self.fail(&e.to_string()),
        }
    }

    /// Commits the burst's transaction; then what it made durable is released.
    fn finish(&mut self) {
        if !std::mem::take(&mut self.in_tx) {
            return;
        }
        let records = std::mem::take(&mut self.pending);
        if self.planted_reply_before_commit
            && let Some(r) = records.last()
        {
            self.durable(r.seq);
        }
        let snapshot = self.snapshot.take();
        let Some(db) = self.db.as_mut() else { return };
        // A burst that appended nothing still ends its transaction (and the lock): then only
        // `COMMIT` is sent.
        let last = records.last().map(|r| r.seq);
        let payload = format!("{} {}", self.node, last.unwrap_or(0));
        match db.commit(&records, snapshot.as_ref(), &payload) {
            Ok(()) => {
                if let Some(last) = last {
                    self.durable(last);
                }
                if snapshot.is_some() {
                    self.core.snapshot_done();
                }
            }
            Err(e) => self.fail(&format!(
                "committing the burst after seq {}: {e}",
                self.durable_tx.borrow().seq
            )),
        }
    }

    /// Records up to `seq` are committed: their replies and events go out.
    fn durable(&mut self, seq: u64) {
        let generation = self.generation;
        self.durable_tx.send_if_modified(|s| {
            let advance = s.generation == generation && seq > s.seq;
            if advance {
                s.seq = seq;
            }
            advance
        });
        self.release.durable(generation, seq);
    }

    /// The database refused something: fail closed (the core answers what was not committed
    /// `unavailable` and asks to recover).
    fn fail(&mut self, why: &str) {
        crate::log::error(&format!(
            "store failed: {why}; failing closed, nothing past seq {} is acknowledged until the gate is rebuilt from the database",
            self.durable_tx.borrow().seq
        ));
        self.in_tx = false;
        self.pending.clear();
        self.snapshot = None;
        self.core.append_failed();
    }

    /// `Action::FailLedger`: the connection is dropped (its transaction, if any, rolls back
    /// with it) and the replies waiting for a commit are answered `unavailable`.
    fn fail_store(&mut self) {
        self.db = None;
        self.in_tx = false;
        self.pending.clear();
        let generation = self.generation;
        self.durable_tx.send_modify(|s| {
            if s.generation == generation {
                s.failed = true;
            }
        });
        self.release.fail();
    }

    /// Reconnects and rebuilds the gate from the database, in a new generation.
    fn recover(&mut self) {
        let (db, gate, seq) = match (self.open)() {
            Ok(o) => o,
            Err(e) => {
                crate::log::error(&format!("store still unavailable: {e}; retrying in 1s"));
                return;
            }
        };
        let generation = self.generation + 1;
        self.durable_tx.send_modify(|s| {
            let end = s.seq;
            s.ended.push(end);
            assert_eq!(s.ended.len() as u64, generation, "one end per generation");
            s.generation = generation;
            s.seq = seq;
            s.failed = false;
        });
        self.generation = generation;
        self.release.start(generation, seq);
        self.db = Some(db);
        crate::log::info(&format!(
            "store recovered at seq {seq}; accepting changes again"
        ));
        self.core.reopened(Reopened {
            gate,
            generation,
            last_seq: seq,
            writing: true,
        });
    }
}
