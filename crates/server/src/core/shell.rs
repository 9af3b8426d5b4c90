//! The core's shell: the one executor of its actions. It owns everything the core must not —
//! the ledger's committer (`Journal`), the release queue (`durable::Release` → `Outbox`), the
//! durable watch the connections' writers read, the way to reopen the ledger — and after each
//! input to the core it takes the core's actions in order and carries them out, reporting the
//! outcomes back as inputs. The daemon's core thread runs it (`Shell::run`, in `driver`); the
//! simulation steps the same `Shell` on a crash-simulating disk, so what it tests is what ships.

use super::*;
use crate::durable::{DurableState, Release};
use crate::journal::{Journal, JournalError, Opened};
use estop_ledger::LedgerError;
use tokio::sync::watch;

/// Opens the ledger (with `Some(discard_after)` after a failure) and rebuilds the gate.
pub type OpenFn = Box<dyn FnMut(Option<u64>) -> Result<Opened, JournalError> + Send>;

/// The core and what executes its actions.
pub struct Shell {
    core: Core,
    /// `None` from a failure (`Action::FailLedger`) until the ledger is reopened.
    journal: Option<Journal>,
    open: OpenFn,
    /// The core's own queue: the ledger's sync thread reports a failure through it.
    self_tx: mpsc::Sender<CoreMsg>,
    durable_tx: Arc<watch::Sender<DurableState>>,
    /// Replies and events waiting for their record's fsync; handed over once durable.
    release: Arc<Release>,
    generation: u64,
    /// The last commit synced on this thread.
    synced_inline: bool,
}

impl Shell {
    /// Opens the ledger with `open(None)`, rebuilds the gate and starts the core on it;
    /// `self_tx` is the core's own queue (the ledger reports failures through it).
    pub fn new(
        opts: CoreOptions,
        durable_tx: Arc<watch::Sender<DurableState>>,
        mut open: OpenFn,
        self_tx: mpsc::Sender<CoreMsg>,
    ) -> Result<Shell, JournalError> {
        let opened = open(None)?;
        let last_seq = opened.report.last_seq;
        durable_tx.send_modify(|s| {
            s.generation = 0;
            s.seq = last_seq;
            s.failed = false;
        });
        let release = Arc::new(Release::default());
        if opts.planted_early_release {
            release.plant_early_release();
        }
        release.start(0, last_seq);
        let journal = Journal::start(opened.ledger, notifier(&durable_tx, &release, 0, &self_tx))?;
        Ok(Shell {
            core: Core::new(opts, opened.gate, last_seq),
            journal: Some(journal),
            open,
            self_tx,
            durable_tx,
            release,
            generation: 0,
            synced_inline: false,
        })
    }

    pub fn core(&self) -> &Core {
        &self.core
    }

    pub fn gate(&self) -> &Gate {
        self.core.gate()
    }

    /// Handles one message at `now` and does what it asks; returns true to stop.
    pub fn handle(&mut self, now: Now, msg: CoreMsg) -> bool {
        let stop = self.core.handle(now, msg);
        self.execute();
        stop
    }

    /// Timer work due at `now` (`Core::fire_timers`), done.
    pub fn fire_timers(&mut self, now: Now) {
        self.core.fire_timers(now);
        self.execute();
    }

    /// Commits the burst just applied (`Core::commit`); `None`: nothing to commit, else
    /// whether the sync ran on this thread.
    pub fn commit(&mut self) -> Option<bool> {
        let journal = &self.journal;
        let asked = self.core.commit(|| {
            journal
                .as_ref()
                .map_or(u64::MAX, Journal::last_batch_records)
        });
        if !asked {
            return None;
        }
        self.synced_inline = false;
        self.execute();
        Some(self.synced_inline)
    }

    /// See `Core::next_timeout`.
    pub fn next_timeout(&mut self, now: Now) -> Option<Duration> {
        self.core.next_timeout(now)
    }

    /// Carries out every action the core has queued, in order, including those queued by the
    /// outcomes it reports back meanwhile.
    fn execute(&mut self) {
        while let Some(action) = self.core.poll_action() {
            match action {
                Action::Append { seq, bytes } => self.append(seq, &bytes),
                Action::Commit { inline } => {
                    if let Some(j) = &self.journal {
                        self.synced_inline = j.commit(inline);
                    }
                }
                Action::Snapshot { seq, bytes } => self.snapshot(seq, &bytes),
                Action::FailLedger => self.fail_ledger(),
                Action::Recover => self.recover(),
                Action::Flush => {
                    if let Some(j) = self.journal.take() {
                        let _ = j.flush();
                    }
                }
                other => deliver(&mut self.core, &self.release, other),
            }
        }
    }

    fn append(&mut self, seq: u64, bytes: &std::ops::Range<usize>) {
        // After a failed append the rest of its round is not appended: the core failed closed.
        let Some(journal) = self.journal.as_ref().filter(|_| self.core.is_writing()) else {
            return;
        };
        match journal.append(self.core.record(bytes)) {
            // Every reply the core tagged with `seq` depends on this record: were the ledger to
            // number it otherwise, replies would be released before their own record is durable.
            Ok(got) => assert_eq!(
                got, seq,
                "the ledger numbered a record otherwise than the core"
            ),
            Err(e) => {
                crate::log::error(&format!(
                    "ledger append failed: {e}; failing closed and recovering"
                ));
                self.core.append_failed();
            }
        }
    }

    fn snapshot(&mut self, seq: u64, bytes: &[u8]) {
        let Some(journal) = &self.journal else { return };
        match journal.snapshot(seq, bytes) {
            Ok(_) => self.core.snapshot_done(),
            Err(e) => {
                let wait = self.core.snapshot_failed();
                let advice = match &e {
                    LedgerError::Options { .. } => format!(
                        "the gate's state is {} bytes, more than a snapshot may hold: shorten --retention so stopped runs are compacted sooner, and close finished runs",
                        bytes.len()
                    ),
                    _ => "see the error; the disk may be full or failing".to_string(),
                };
                crate::log::error(&format!(
                    "snapshot at seq {seq} failed: {e}; {advice}. Nothing is lost (the ledger holds every record), but recovery replays more until a snapshot succeeds; retrying in {}s",
                    wait.as_secs()
                ));
            }
        }
    }

    /// Fails the ledger closed: the connections' writers and the release queue learn that
    /// nothing past its durable seq will be durable in this generation.
    fn fail_ledger(&mut self) {
        let Some(journal) = self.journal.take() else {
            return;
        };
        let durable = journal.durable_seq();
        drop(journal);
        let generation = self.generation;
        self.durable_tx.send_modify(|s| {
            if s.generation == generation {
                s.failed = true;
                s.seq = durable;
            }
        });
        // Replies whose record did not reach the disk are not acknowledged.
        self.release.fail();
    }

    /// Reopens the ledger past its last durable record and hands the rebuilt state to the core.
    fn recover(&mut self) {
        let durable = self.durable_tx.borrow().seq;
        let opened = match (self.open)(Some(durable)) {
            Ok(o) => o,
            Err(e) => {
                crate::log::error(&format!("ledger still unavailable: {e}; retrying in 1s"));
                return;
            }
        };
        let generation = self.generation + 1;
        let seq = opened.report.last_seq;
        self.durable_tx.send_modify(|s| {
            let end = s.seq;
            s.ended.push(end);
            assert_eq!(
                s.ended.len() as u64,
                generation,
                "one end per finished generation"
            );
            s.generation = generation;
            s.seq = seq;
            s.failed = true;
        });
        self.generation = generation;
        self.release.start(generation, seq);
        let notify = notifier(&self.durable_tx, &self.release, generation, &self.self_tx);
        let writing = match Journal::start(opened.ledger, notify) {
            Ok(journal) => {
                self.durable_tx.send_modify(|s| s.failed = false);
                self.journal = Some(journal);
                crate::log::info(&format!(
                    "ledger recovered at seq {seq}; accepting changes again"
                ));
                true
            }
            Err(e) => {
                crate::log::error(&format!(
                    "ledger reopened but cannot start writing: {e}; retrying in 1s"
                ));
                false
            }
        };
        self.core.reopened(Reopened {
            gate: opened.gate,
            generation,
            last_seq: seq,
            writing,
        });
    }
}

/// Carries out the actions every store's shell does alike: replies and events into the release
/// queue (handed over once durable), feeds, stats, the end of a shutdown. The store's own
/// actions (append, commit, snapshot, fail, recover, flush) are the caller's.
pub(super) fn deliver(core: &mut Core, release: &Release, action: Action) {
    match action {
        Action::Reply { to, answer, after } => {
            let item = Out::Answer {
                id: to.id,
                answer,
                after,
            };
            release.send(after, &to.out, item);
        }
        Action::Event {
            run,
            conn,
            out,
            backlog,
            event,
            after,
        } => {
            let max = core.options().event_backlog_max;
            if out.is_closed() || backlog.load(Ordering::Relaxed) >= max {
                core.subscriber_gone(&run, conn);
            } else {
                backlog.fetch_add(1, Ordering::Relaxed);
                release.send(after, &out, Out::Event { event, after });
            }
        }
        Action::Feed { tx, event } => {
            if tx.try_send(event).is_err() {
                // Closed, or too far behind.
                core.feed_gone(&tx);
            }
        }
        Action::Stats { reply, stats } => {
            let _ = reply.send(*stats);
        }
        Action::Stopped { done } => {
            let _ = done.send(());
        }
        Action::Append { .. }
        | Action::Commit { .. }
        | Action::Snapshot { .. }
        | Action::FailLedger
        | Action::Recover
        | Action::Flush => unreachable!("a store's own action: {action:?}"),
    }
}

/// The ledger's sync thread reports here: durable progress to the repliers, failure to the core.
fn notifier(
    durable_tx: &Arc<watch::Sender<DurableState>>,
    release: &Arc<Release>,
    generation: u64,
    core_tx: &mpsc::Sender<CoreMsg>,
) -> impl Fn(Result<u64, LedgerError>) + Send + Sync + 'static {
    let durable_tx = Arc::clone(durable_tx);
    let release = Arc::clone(release);
    let core_tx = core_tx.clone();
    move |r| match r {
        Ok(seq) => {
            // The watch first, so a released reply never waits on it again.
            durable_tx.send_if_modified(|s| {
                let advance = s.generation == generation && seq > s.seq;
                if advance {
                    s.seq = seq;
                }
                advance
            });
            release.durable(generation, seq);
        }
        Err(e) => {
            crate::log::error(&format!(
                "ledger failed: {e}; no change is acknowledged until it recovers"
            ));
            durable_tx.send_modify(|s| {
                if s.generation == generation {
                    s.failed = true;
                }
            });
            let _ = core_tx.send(CoreMsg::LedgerFailed);
        }
    }
}
