//! The core: one thread that owns the gate's state and applies every command in order, appends
//! each state change to the ledger (group-committed by the ledger's sync thread), and hands each
//! reply to its connection tagged with the ledger position it depends on. No lock guards the
//! state: it has exactly one owner. Waiters, subscriptions and timers live here too.

use crate::durable::{After, DurableState};
use crate::journal::{Journal, JournalError, Opened};
use crate::quota::{ShareOptions, Shares};
use crate::render;
use estop_kernel::codec::encode_record;
use estop_kernel::reply::{DecideStatus, EventKind};
use estop_kernel::vocab::RunState;
use estop_kernel::{
    Command, EffectKey, Gate, KernelError, Principal, PrincipalName, Record, Reply, Role, RunId,
    Verdict,
};
use estop_ledger::LedgerError;
use estop_protocol::page::{PageBudget, PendingCursor, Weight};
use estop_protocol::reply as wire;
use estop_protocol::{ErrorCode, Id};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::watch;

pub use crate::outbox::Outbox;

/// Something to write to a client once `after` is durable.
#[derive(Debug)]
pub enum Out {
    Answer {
        id: Id,
        answer: Answer,
        after: After,
    },
    Event {
        event: wire::Event,
        after: After,
    },
    /// The rest of a durable reply that [`Outbox::release`] could not write whole: written as
    /// it is, before anything behind it.
    Rendered(Vec<u8>),
}

/// A reply payload, rendered by the connection in its own protocol.
#[derive(Debug, Clone)]
pub enum Answer {
    Verdict(wire::Verdict),
    Ack(wire::Ack),
    Decided(wire::DecideReply),
    Run(Box<wire::RunView>),
    Runs(wire::RunsReply),
    Pending(wire::PendingReply),
    Report(Box<wire::Report>),
    Ledger(wire::LedgerReply),
    Hello(wire::HelloReply),
    TokenCreated(wire::TokenCreated),
    TokenRevoked(wire::TokenRevoked),
    Pong,
    Error(ErrorCode, String),
}

/// Where a reply goes.
#[derive(Debug)]
pub struct ReplyTo {
    pub out: Outbox,
    pub id: Id,
    /// The request's share of its connection's input bound, given back when this is dropped:
    /// once the core has answered (or parked it as a waiter).
    pub charge: Option<crate::conn::Charge>,
}

/// A read. Listings come in pages: where the page starts (`cursor`) and its item and byte
/// bounds (`page`).
#[derive(Debug)]
pub enum Query {
    Status {
        run: RunId,
    },
    Runs {
        state: Option<RunState>,
        cursor: Option<RunId>,
        page: PageBudget,
    },
    Pending {
        run: Option<RunId>,
        cursor: Option<PendingCursor>,
        page: PageBudget,
    },
    Report {
        run: RunId,
        cursor: Option<EffectKey>,
        page: PageBudget,
    },
}

#[derive(Debug)]
pub enum CoreMsg {
    Apply {
        principal: Principal,
        cmd: Command,
        to: ReplyTo,
    },
    Wait {
        principal: Principal,
        run: RunId,
        key: EffectKey,
        timeout: Duration,
        /// The connection waiting: its waits end when it disconnects.
        conn: u64,
        to: ReplyTo,
    },
    Subscribe {
        principal: Principal,
        run: RunId,
        conn: u64,
        out: Outbox,
        /// Events queued for this connection and not yet written (the writer counts down).
        backlog: Arc<AtomicUsize>,
        to: ReplyTo,
    },
    Unsubscribe {
        run: RunId,
        conn: u64,
    },
    Disconnect {
        conn: u64,
    },
    Query {
        principal: Principal,
        query: Query,
        to: ReplyTo,
    },
    /// A SoundGate `cancel` (or `close`): reaches only runs created over that listener.
    SgStop {
        run: RunId,
        close: bool,
        to: ReplyTo,
    },
    /// A SoundGate `decide`: the decision and, once approved, the release in one step.
    SgDecide {
        run: RunId,
        key: EffectKey,
        approved: bool,
        to: ReplyTo,
    },
    /// A gate-wide feed of changes (the console's server-sent events); agents see their own
    /// runs only. Dropped when it falls `observe::FEED_QUEUE_MAX` events behind.
    Feed {
        principal: Principal,
        tx: crate::observe::FeedTx,
    },
    /// Counters and gauges for `/metrics`.
    Stats {
        reply: tokio::sync::oneshot::Sender<crate::observe::GateStats>,
    },
    /// The ledger's sync thread reported a failure.
    LedgerFailed,
    /// Finish what is in flight, make it durable, and stop.
    Shutdown {
        done: mpsc::Sender<()>,
    },
}

/// Bounds the core enforces.
#[derive(Debug, Clone)]
pub struct CoreOptions {
    pub subscriptions_per_run_max: usize,
    /// Subscriptions in all (a subscription may name a run that does not exist yet), what one
    /// principal may hold, and the operators' reserve.
    pub subscriptions: ShareOptions,
    /// Events a subscriber's connection may have queued and unwritten before it loses the
    /// subscription: a client that stops reading must not grow the daemon's memory.
    pub event_backlog_max: usize,
    /// `wait`s blocked in all, per principal, and the operators' reserve.
    pub waiters: ShareOptions,
    /// A stopped run is kept whole this long (after its stop), then forgotten: its fence stays
    /// as a tombstone.
    pub retention_ms: u64,
    /// A forgotten run's tombstone stays this long (after its stop); then the id is unknown.
    pub tombstone_retention_ms: u64,
    /// Take a snapshot after this many records (bounds recovery time).
    pub snapshot_every_records: u64,
    /// The core syncs a burst itself while the ledger's sync thread is idle (see
    /// `Core::commit`); off, every sync runs on the sync thread.
    pub inline_sync: bool,
    /// After a lone request whose record it synced itself, the core watches its queue this
    /// long before it sleeps (see `Core::run`); zero never.
    pub idle_spin: Duration,
    /// A planted bug for the tests of the fatal panic hook: the core panics once it has
    /// appended this many records. Set only by debug builds (`ESTOP_DEBUG_PANIC_CORE_AFTER`,
    /// read in `serve`); `None` in every release build.
    pub planted_panic_after_records: Option<u64>,
}

/// Retention runs at most this often, and at least as often as `COMPACTION_PERIOD_MAX_MS`.
const COMPACTION_PERIOD_MIN_MS: u64 = 1_000;
const COMPACTION_PERIOD_MAX_MS: u64 = 60_000;

impl CoreOptions {
    /// How often retention runs: a quarter of the shorter retention, within one second and a
    /// minute, so a stopped run is forgotten at most that long after its retention passed.
    pub fn compaction_period_ms(&self) -> u64 {
        (self.retention_ms.min(self.tombstone_retention_ms) / 4)
            .clamp(COMPACTION_PERIOD_MIN_MS, COMPACTION_PERIOD_MAX_MS)
    }
}

impl Default for CoreOptions {
    fn default() -> Self {
        CoreOptions {
            subscriptions_per_run_max: 64,
            subscriptions: ShareOptions::derived(100_000, 1024),
            event_backlog_max: 4096,
            waiters: ShareOptions::derived(100_000, 1024),
            retention_ms: 7 * 24 * 3600 * 1000,
            tombstone_retention_ms: 28 * 24 * 3600 * 1000,
            snapshot_every_records: 1_000_000,
            inline_sync: std::env::var("ESTOP_INLINE_SYNC").map_or(true, |v| v != "0"),
            idle_spin: Duration::from_micros(
                std::env::var("ESTOP_CORE_SPIN_US")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(150),
            ),
            planted_panic_after_records: None,
        }
    }
}

/// One `subscribe` of one connection.
struct Subscriber {
    conn: u64,
    principal: Principal,
    out: Outbox,
    backlog: Arc<AtomicUsize>,
}

struct Waiter {
    principal: Principal,
    key: EffectKey,
    deadline: Instant,
    conn: u64,
    to: ReplyTo,
}

pub(crate) fn system_principal() -> Principal {
    Principal {
        name: PrincipalName::new("estop").expect("valid name"),
        role: Role::Operator,
        groups: Vec::new(),
    }
}

fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

pub fn kernel_error(e: &KernelError) -> (ErrorCode, String) {
    let code = match e {
        KernelError::RunNotFound(_)
        | KernelError::EffectNotFound(..)
        | KernelError::Forgotten { .. } => ErrorCode::NotFound,
        KernelError::NotAwaitingApproval { .. } => ErrorCode::NotPending,
        KernelError::BadToken { .. } => ErrorCode::BadToken,
        KernelError::Limit { .. } => ErrorCode::LimitExceeded,
        KernelError::Forbidden => ErrorCode::Forbidden,
        KernelError::DuplicateApprover { .. }
        | KernelError::NotStarted { .. }
        | KernelError::AlreadyCompleted { .. }
        | KernelError::ParentMismatch { .. }
        | KernelError::InvalidState { .. } => ErrorCode::Conflict,
        KernelError::IllegalTransition { .. } => ErrorCode::Internal,
    };
    (code, e.to_string())
}

/// The core's state. Runs on its own thread (`run`).
pub struct Core {
    gate: Gate,
    journal: Option<Journal>,
    open: OpenFn,
    self_tx: mpsc::Sender<CoreMsg>,
    durable_tx: Arc<watch::Sender<DurableState>>,
    /// Replies waiting for their record's fsync; released on the IO runtime once durable.
    release: Arc<crate::durable::Release>,
    generation: u64,
    last_seq: u64,
    /// `last_seq` at the last `commit`.
    committed_seq: u64,
    records_since_snapshot: u64,
    /// Records this core appended (for `planted_panic_after_records`).
    appended: u64,
    now: u64,
    clock: crate::clock::Clock,
    /// The monotonic clock's origin for `clock`.
    started: Instant,
    waiters: HashMap<RunId, Vec<Waiter>>,
    /// Blocked waits, by principal (the count of all of them is `waiter_shares.total()`).
    waiter_shares: Shares,
    /// Waiters per connection that has any: a disconnect looks for its waiters only then.
    waiters_of_conn: HashMap<u64, usize>,
    /// When some waiter of a run times out. Entries of waiters answered early go stale and are
    /// dropped when they come due; each waiter adds at most one, so this stays bounded.
    waiter_deadlines: BTreeSet<(Instant, RunId)>,
    subscribers: HashMap<RunId, Vec<Subscriber>>,
    /// Subscriptions, by principal.
    subscription_shares: Shares,
    timers: BTreeSet<(u64, RunId)>,
    timer_of: HashMap<RunId, u64>,
    next_compaction: u64,
    /// After a failed snapshot: when the next may be tried, and the wait after that one.
    snapshot_retry: Option<(Instant, Duration)>,
    /// While the ledger is down, recovery is attempted at most this often.
    next_recovery: Instant,
    opts: CoreOptions,
    buf: Vec<u8>,
    /// The console's feed and the metrics counters.
    obs: crate::observe::Observer,
}

impl Core {
    /// `open(discard_after)` opens (or, after a failure, reopens) the ledger and rebuilds the
    /// gate; `self_tx` is the core's own queue (the ledger reports failures through it).
    pub fn new(
        opts: CoreOptions,
        durable_tx: Arc<watch::Sender<DurableState>>,
        mut open: OpenFn,
        self_tx: mpsc::Sender<CoreMsg>,
    ) -> Result<Core, JournalError> {
        let opened = open(None)?;
        let last_seq = opened.report.last_seq;
        durable_tx.send_modify(|s| {
            s.generation = 0;
            s.seq = last_seq;
            s.failed = false;
        });
        let release = Arc::new(crate::durable::Release::default());
        release.start(0, last_seq);
        let journal = Journal::start(opened.ledger, notifier(&durable_tx, &release, 0, &self_tx))?;
        let mut core = Core {
            gate: opened.gate,
            journal: Some(journal),
            open,
            self_tx,
            durable_tx,
            release,
            generation: 0,
            last_seq,
            committed_seq: last_seq,
            records_since_snapshot: 0,
            appended: 0,
            now: 0,
            clock: crate::clock::Clock::default(),
            started: Instant::now(),
            waiters: HashMap::new(),
            waiter_shares: Shares::new("waiters", opts.waiters),
            waiters_of_conn: HashMap::new(),
            waiter_deadlines: BTreeSet::new(),
            subscribers: HashMap::new(),
            subscription_shares: Shares::new("subscriptions", opts.subscriptions),
            timers: BTreeSet::new(),
            timer_of: HashMap::new(),
            next_compaction: 0,
            snapshot_retry: None,
            next_recovery: Instant::now(),
            opts,
            buf: Vec::with_capacity(1024),
            obs: crate::observe::Observer::default(),
        };
        core.rearm_all_timers();
        Ok(core)
    }

    pub fn gate(&self) -> &Gate {
        &self.gate
    }

    fn after(&self) -> After {
        After {
            generation: self.generation,
            seq: self.last_seq,
        }
    }

    /// The gate's time now (`clock::Clock`: monotonic, not pushed ahead by one bad reading of
    /// the wall clock).
    fn tick_clock(&mut self) -> u64 {
        let mono = self.started.elapsed().as_millis() as u64;
        self.now = self.clock.read(wall_ms(), mono);
        self.now
    }

    fn rearm_all_timers(&mut self) {
        self.timers.clear();
        self.timer_of.clear();
        let ids: Vec<RunId> = self
            .gate
            .runs()
            .filter(|(_, r)| r.stop.is_none())
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            self.rearm(&id);
        }
    }

    fn rearm(&mut self, run: &RunId) {
        let next = self.gate.next_timer(run);
        let current = self.timer_of.get(run).copied();
        if next == current {
            return;
        }
        if let Some(old) = current {
            self.timers.remove(&(old, run.clone()));
            self.timer_of.remove(run);
        }
        if let Some(at) = next {
            self.timers.insert((at, run.clone()));
            self.timer_of.insert(run.clone(), at);
        }
    }

    /// Runs the core until shutdown. `rx` is the only way in.
    pub fn run(mut self, rx: mpsc::Receiver<CoreMsg>) {
        let mut lone_synced = false;
        loop {
            // A client that sends one request at a time sends its next one within tens of µs
            // of its reply, which the core has just written itself (after an inline sync):
            // watching the queue that long spares the next request a wakeup of the core
            // (15–30 µs on a VM). Only then, so under load the core never burns CPU the IO
            // thread needs.
            let spin = if lone_synced {
                self.opts.idle_spin
            } else {
                Duration::ZERO
            };
            let Some(msg) = self.next_message(&rx, spin) else {
                return; // Every sender is gone.
            };
            let mut handled = 0;
            if let Some(msg) = msg {
                handled += 1;
                if self.handle(msg) {
                    return;
                }
                // Drain what else is queued before doing timer work: batching keeps the sync
                // thread's group commits large under load.
                while let Ok(msg) = rx.try_recv() {
                    handled += 1;
                    if self.handle(msg) {
                        return;
                    }
                }
            }
            self.fire_timers();
            if self.journal.is_none() && Instant::now() >= self.next_recovery {
                self.recover();
            }
            let synced_here = self.commit() == Some(true);
            lone_synced = synced_here && handled == 1;
        }
    }

    /// The next message, after watching the queue for up to `spin` first; `Some(None)` when a
    /// timer is due first; `None` when every sender is gone.
    fn next_message(
        &mut self,
        rx: &mpsc::Receiver<CoreMsg>,
        spin: Duration,
    ) -> Option<Option<CoreMsg>> {
        if !spin.is_zero() {
            let until = Instant::now() + spin;
            loop {
                match rx.try_recv() {
                    Ok(m) => return Some(Some(m)),
                    Err(mpsc::TryRecvError::Disconnected) => return None,
                    Err(mpsc::TryRecvError::Empty) if Instant::now() < until => {
                        std::hint::spin_loop();
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                }
            }
        }
        let (at, now) = self.next_wakeup();
        let timeout = at.map(|at| Duration::from_millis(at.saturating_sub(now)));
        match timeout {
            Some(t) => match rx.recv_timeout(t) {
                Ok(m) => Some(Some(m)),
                Err(mpsc::RecvTimeoutError::Timeout) => Some(None),
                Err(mpsc::RecvTimeoutError::Disconnected) => None,
            },
            None => rx.recv().ok().map(Some),
        }
    }

    /// Syncs the burst just applied. Under light load — this burst and the last sync each
    /// carry at most `INLINE_SYNC_RECORDS_MAX` records, and the sync thread is idle — the core
    /// syncs it itself and writes the replies it releases straight to their sockets: two thread
    /// handoffs less for a lone request (to the sync thread, and back to the IO thread), and
    /// nothing else is waiting for the core meanwhile. Under load the sync thread syncs while the core goes on applying
    /// the next burst (pipelining: were the core to sync, the disk would idle while it applies).
    /// Returns whether it synced the burst itself (`None`: nothing to commit).
    fn commit(&mut self) -> Option<bool> {
        const INLINE_SYNC_RECORDS_MAX: u64 = 2;
        let burst = self.last_seq.saturating_sub(self.committed_seq);
        if burst == 0 {
            return None; // Nothing appended since the last commit (a query, a timer that fired nothing).
        }
        let journal = self.journal.as_ref()?;
        let inline = self.opts.inline_sync
            && burst <= INLINE_SYNC_RECORDS_MAX
            && journal.last_batch_records() <= INLINE_SYNC_RECORDS_MAX;
        let synced_here = if inline {
            // Its replies are handed over here too, straight to their sockets.
            journal.commit(true)
        } else {
            journal.commit(false);
            false
        };
        self.committed_seq = self.last_seq;
        Some(synced_here)
    }

    /// When (gate time) the core must wake next, and the gate time now.
    fn next_wakeup(&mut self) -> (Option<u64>, u64) {
        let now = self.tick_clock();
        let timer = self.timers.first().map(|(at, _)| *at);
        let waiter = self
            .waiter_deadlines
            .first()
            .map(|(d, _)| now + d.saturating_duration_since(Instant::now()).as_millis() as u64);
        let compaction = Some(self.next_compaction.max(now + COMPACTION_PERIOD_MIN_MS));
        let recovery = self.journal.is_none().then(|| now + 1000);
        let at = [timer, waiter, compaction, recovery]
            .into_iter()
            .flatten()
            .min();
        (at, now)
    }

    /// Handles one message; returns true to stop.
    fn handle(&mut self, msg: CoreMsg) -> bool {
        match msg {
            CoreMsg::Apply { principal, cmd, to } => {
                let answer = self.apply(&principal, cmd);
                self.send(to, answer);
            }
            CoreMsg::Wait {
                principal,
                run,
                key,
                timeout,
                conn,
                mut to,
            } => match self.wait_verdict(&principal, &run, &key) {
                Ok(Verdict::Held { .. }) if !timeout.is_zero() => {
                    if let Err(msg) = self.waiter_shares.take(&principal) {
                        self.send(to, Answer::Error(ErrorCode::LimitExceeded, msg));
                    } else {
                        // A parked wait is a small waiter, not its request line.
                        to.charge = None;
                        *self.waiters_of_conn.entry(conn).or_default() += 1;
                        let deadline = Instant::now() + timeout;
                        self.waiter_deadlines.insert((deadline, run.clone()));
                        self.waiters.entry(run).or_default().push(Waiter {
                            principal,
                            key,
                            deadline,
                            conn,
                            to,
                        });
                    }
                }
                Ok(v) => {
                    let answer = Answer::Verdict(render::verdict(&run, &v));
                    self.send(to, answer);
                }
                Err(answer) => self.send(to, answer),
            },
            CoreMsg::Subscribe {
                principal,
                run,
                conn,
                out,
                backlog,
                to,
            } => {
                let sub = Subscriber {
                    conn,
                    principal,
                    out,
                    backlog,
                };
                let answer = match self.gate.visible_run(&sub.principal, &run) {
                    // Not created yet — or another principal's, which must look the same, so
                    // `subscribe` tells no one which run ids others use: the subscription
                    // waits, and hears only of runs its principal may see (`publish`).
                    Err(_) => self
                        .add_subscription(run, sub)
                        .unwrap_or_else(|| Answer::Ack(wire::Ack::default())),
                    Ok(r) => {
                        let view = render::run_view(&run, r);
                        self.add_subscription(run, sub)
                            .unwrap_or(Answer::Run(Box::new(view)))
                    }
                };
                self.send(to, answer);
            }
            CoreMsg::Unsubscribe { run, conn } => {
                if let Some(subs) = self.subscribers.get_mut(&run) {
                    let shares = &mut self.subscription_shares;
                    subs.retain(|x| {
                        let keep = x.conn != conn;
                        if !keep {
                            shares.give_back(&x.principal);
                        }
                        keep
                    });
                    if subs.is_empty() {
                        self.subscribers.remove(&run);
                    }
                }
            }
            CoreMsg::Disconnect { conn } => {
                // Its waits end with it: nobody is left to answer, and each would keep the
                // connection's writer (and its descriptors and slot) alive until it timed out.
                if self.waiters_of_conn.remove(&conn).is_some() {
                    let shares = &mut self.waiter_shares;
                    self.waiters.retain(|_, ws| {
                        ws.retain(|w| {
                            let keep = w.conn != conn;
                            if !keep {
                                shares.give_back(&w.principal);
                            }
                            keep
                        });
                        !ws.is_empty()
                    });
                }
                let shares = &mut self.subscription_shares;
                self.subscribers.retain(|_, subs| {
                    subs.retain(|x| {
                        let keep = x.conn != conn;
                        if !keep {
                            shares.give_back(&x.principal);
                        }
                        keep
                    });
                    !subs.is_empty()
                });
            }
            CoreMsg::Query {
                principal,
                query,
                to,
            } => {
                let answer = self.query(&principal, query);
                self.send(to, answer);
            }
            CoreMsg::SgStop { run, close, to } => {
                // The listener is its own tenant: a run it did not create (a v1 run, or an id
                // nobody used yet) is not found there, and it never pre-fences an unseen id.
                let answer = if self.sg_owns(&run) {
                    let cmd = if close {
                        Command::Close { run, failed: false }
                    } else {
                        Command::Cancel {
                            run,
                            reason: Some("soundgate cancel".into()),
                            kill: false,
                        }
                    };
                    self.apply(&crate::soundgate::principal(Role::Agent), cmd)
                } else {
                    not_found(run)
                };
                self.send(to, answer);
            }
            CoreMsg::SgDecide {
                run,
                key,
                approved,
                to,
            } => {
                let answer = self.sg_decide(run, key, approved);
                self.send(to, answer);
            }
            CoreMsg::Feed { principal, tx } => {
                // At the bound the sender is dropped: the stream ends at once.
                let _ = self.obs.subscribe(principal, tx);
            }
            CoreMsg::Stats { reply } => {
                let stats = self.obs.stats(
                    &self.gate,
                    self.waiter_shares.total(),
                    self.last_seq,
                    self.after(),
                );
                let _ = reply.send(stats);
            }
            CoreMsg::LedgerFailed => self.fail_journal(),
            CoreMsg::Shutdown { done } => {
                if let Some(j) = self.journal.take() {
                    let _ = j.flush();
                }
                let _ = done.send(());
                return true;
            }
        }
        false
    }

    fn send(&mut self, to: ReplyTo, answer: Answer) {
        if let Answer::Verdict(v) = &answer {
            self.obs.answered(v);
        }
        let after = self.after();
        self.release.send(
            after,
            &to.out,
            Out::Answer {
                id: to.id,
                answer,
                after,
            },
        );
    }

    /// Applies a command and records it if it changed state. `Err` is a ready error answer.
    fn apply_reply(
        &mut self,
        principal: &Principal,
        cmd: Command,
    ) -> Result<(Reply, Vec<estop_kernel::Event>), Answer> {
        if self.journal.is_none() {
            return Err(unavailable());
        }
        let now = self.tick_clock();
        let applied = self.gate.apply(now, principal, &cmd).map_err(|e| {
            let (c, m) = kernel_error(&e);
            Answer::Error(c, m)
        })?;
        if applied.changed {
            let record = Record {
                at: now,
                principal: principal.clone(),
                command: cmd,
            };
            self.buf.clear();
            encode_record(&record, &mut self.buf);
            let journal = self.journal.as_ref().expect("checked above");
            match journal.append(&self.buf) {
                Ok(seq) => {
                    self.last_seq = seq;
                    self.records_since_snapshot += 1;
                    self.appended += 1;
                    if self.opts.planted_panic_after_records == Some(self.appended) {
                        panic!(
                            "planted bug: ESTOP_DEBUG_PANIC_CORE_AFTER={}",
                            self.appended
                        );
                    }
                }
                Err(e) => {
                    // The state moved but the record did not: fail closed and rebuild from disk.
                    crate::log::error(&format!(
                        "ledger append failed: {e}; failing closed and recovering"
                    ));
                    self.fail_journal();
                    return Err(unavailable());
                }
            }
            if let Some(run) = record.command.run() {
                let run = run.clone();
                self.rearm(&run);
            }
            self.publish(&applied.events);
            let after = self.after();
            self.obs.changed(
                &self.gate,
                record.command.run(),
                &applied.events,
                after,
                now,
            );
        }
        Ok((applied.reply, applied.events))
    }

    fn apply_verdict(&mut self, principal: &Principal, cmd: Command) -> Result<Verdict, Answer> {
        match self.apply_reply(principal, cmd)? {
            (Reply::Verdict(v), _) => Ok(v),
            (other, _) => Err(Answer::Error(
                ErrorCode::Internal,
                format!("unexpected kernel reply {other:?}"),
            )),
        }
    }

    fn apply(&mut self, principal: &Principal, cmd: Command) -> Answer {
        let run = cmd.run().cloned();
        let decide_key = match &cmd {
            Command::Decide { key, decision, .. } => Some((key.clone(), *decision)),
            _ => None,
        };
        let (reply, events) = match self.apply_reply(principal, cmd) {
            Ok(r) => r,
            Err(a) => return a,
        };
        let run_id = run.unwrap_or_else(|| RunId::new("-").expect("valid"));
        match reply {
            Reply::Verdict(v) => Answer::Verdict(render::verdict(&run_id, &v)),
            Reply::Completed { late } => Answer::Ack(wire::Ack {
                late,
                ..wire::Ack::default()
            }),
            Reply::Decided(status) => {
                let (key, _) = decide_key.expect("decide");
                let approval = self
                    .gate
                    .run(&run_id)
                    .and_then(|r| r.effects.get(&key))
                    .and_then(|e| e.approval.as_ref());
                let approvals = approval
                    .map(|a| a.approvers.iter().map(|x| x.name.to_string()).collect())
                    .unwrap_or_default();
                let quorum = approval.map_or(1, |a| a.quorum);
                if let Some(a) = approval {
                    self.obs
                        .decided(&status, self.now.saturating_sub(a.requested_at));
                }
                let status = match status {
                    DecideStatus::Approved => "approved",
                    DecideStatus::Rejected => "rejected",
                    DecideStatus::Pending { .. } => "held",
                };
                Answer::Decided(wire::DecideReply {
                    status: status.into(),
                    approvals,
                    quorum,
                })
            }
            Reply::RunState { state, .. } => {
                let runs = events
                    .iter()
                    .filter(|e| {
                        e.key.is_none()
                            && matches!(
                                e.kind,
                                EventKind::Cancelled
                                    | EventKind::Closed
                                    | EventKind::Paused
                                    | EventKind::Resumed
                            )
                    })
                    .map(|e| e.run.to_string())
                    .collect();
                Answer::Ack(wire::Ack {
                    late: false,
                    state: Some(state.as_str().into()),
                    runs,
                })
            }
            Reply::Compacted { .. } | Reply::TokenRecorded => Answer::Ack(wire::Ack::default()),
        }
    }

    /// The wire event for a kernel event, with what the state now says about it.
    fn wire_event(&self, e: &estop_kernel::Event) -> Option<wire::Event> {
        use estop_kernel::state::Status;
        let event = match e.kind {
            EventKind::Cancelled => wire::EventKind::Cancelled,
            EventKind::Paused => wire::EventKind::Paused,
            EventKind::Resumed => wire::EventKind::Resumed,
            EventKind::Decided => wire::EventKind::Decided,
            EventKind::Held => wire::EventKind::Held,
            EventKind::Completed => wire::EventKind::Completed,
            EventKind::Closed => wire::EventKind::Closed,
            EventKind::Finalizing => wire::EventKind::Finalizing,
            EventKind::Expired => wire::EventKind::Expired,
            EventKind::Settled => wire::EventKind::Settled,
            EventKind::Admitted => return None,
        };
        let run = self.gate.run(&e.run);
        let effect = e.key.as_ref().and_then(|k| run?.effects.get(k));
        let mut out = wire::Event {
            event,
            run: e.run.to_string(),
            key: e.key.as_ref().map(ToString::to_string),
            reason: None,
            decision: None,
            outcome: None,
            at: self.now,
        };
        match e.kind {
            EventKind::Cancelled | EventKind::Finalizing | EventKind::Closed => {
                let stop = run.and_then(|r| r.stop.as_ref());
                out.reason = stop
                    .and_then(|s| s.reason.as_deref().map(str::to_string))
                    .or_else(|| e.detail.map(str::to_string));
            }
            EventKind::Held => {
                if let Some(Status::Held(reason)) = effect.map(|x| x.status) {
                    out.reason = Some(reason.as_str().to_string());
                }
            }
            EventKind::Decided => {
                out.decision = effect.map(|x| {
                    match x.status {
                        Status::Refused(estop_kernel::vocab::RefusalReason::Rejected) => "reject",
                        _ => "approve",
                    }
                    .to_string()
                });
            }
            EventKind::Completed => {
                out.outcome = effect
                    .and_then(|x| x.outcome_kind())
                    .map(|o| o.as_str().to_string());
            }
            EventKind::Expired => out.reason = Some("expired".into()),
            EventKind::Paused | EventKind::Resumed | EventKind::Admitted => {}
            EventKind::Settled => {
                out.reason = run.map(|r| r.state.as_str().to_string());
            }
        }
        Some(out)
    }

    /// Tells subscribers and wakes the waiters a change concerns. A subscriber hears only of
    /// runs it may see (a subscription may precede the run's first admit).
    fn publish(&mut self, events: &[estop_kernel::Event]) {
        let after = self.after();
        let mut wake: Vec<RunId> = Vec::new();
        for e in events {
            if self.subscribers.contains_key(&e.run)
                && let Some(event) = self.wire_event(e)
                && let Some(subs) = self.subscribers.get_mut(&e.run)
            {
                // A connection that is gone, or has stopped reading its events, loses the
                // subscription rather than growing a queue without bound.
                let max = self.opts.event_backlog_max;
                let shares = &mut self.subscription_shares;
                subs.retain(|x| {
                    let keep = !x.out.is_closed() && x.backlog.load(Ordering::Relaxed) < max;
                    if !keep {
                        shares.give_back(&x.principal);
                    }
                    keep
                });
                for x in subs.iter() {
                    if self.gate.visible_run(&x.principal, &e.run).is_ok() {
                        x.backlog.fetch_add(1, Ordering::Relaxed);
                        let item = Out::Event {
                            event: event.clone(),
                            after,
                        };
                        self.release.send(after, &x.out, item);
                    }
                }
            }
            if e.kind.wakes_waiters() && !wake.contains(&e.run) {
                wake.push(e.run.clone());
            }
        }
        for run in wake {
            for id in self.gate.subtree(&run) {
                self.recheck_waiters(&id);
            }
        }
    }

    /// Adds a subscription; `Some(error)` when a bound is reached.
    fn add_subscription(&mut self, run: RunId, sub: Subscriber) -> Option<Answer> {
        let per_run = self.opts.subscriptions_per_run_max;
        let subs = self.subscribers.entry(run.clone()).or_default();
        if subs.iter().any(|x| x.conn == sub.conn) {
            return None;
        }
        let refused = if subs.len() >= per_run {
            Some(format!(
                "limit reached: subscriptions_per_run_max = {per_run}; unsubscribe from runs you no longer follow"
            ))
        } else {
            self.subscription_shares.take(&sub.principal).err()
        };
        if let Some(m) = refused {
            if subs.is_empty() {
                self.subscribers.remove(&run);
            }
            return Some(Answer::Error(ErrorCode::LimitExceeded, m));
        }
        subs.push(sub);
        None
    }

    /// What `wait` answers now: the admission verdict, except that a prepared effect whose
    /// `start` would be held (pause, sibling) is still held — `wait` then `start` again.
    fn wait_verdict(
        &mut self,
        principal: &Principal,
        run: &RunId,
        key: &EffectKey,
    ) -> Result<Verdict, Answer> {
        let cmd = Command::Recheck {
            run: run.clone(),
            key: key.clone(),
        };
        match self.apply_verdict(principal, cmd)? {
            Verdict::Admitted { token } => match self.gate.start_hold(run, key) {
                Some(reason) => Ok(Verdict::Held {
                    reason,
                    approval: None,
                    expires_at: None,
                }),
                None => Ok(Verdict::Admitted { token }),
            },
            v => Ok(v),
        }
    }

    /// One waiter of `conn` was answered.
    fn waiter_done(&mut self, conn: u64, principal: &Principal) {
        self.waiter_shares.give_back(principal);
        if let Some(n) = self.waiters_of_conn.get_mut(&conn) {
            *n -= 1;
            if *n == 0 {
                self.waiters_of_conn.remove(&conn);
            }
        }
    }

    /// Re-checks every waiter of a run; answers those whose effect is no longer held.
    fn recheck_waiters(&mut self, run: &RunId) {
        let Some(mut list) = self.waiters.remove(run) else {
            return;
        };
        let mut keep = Vec::new();
        for w in list.drain(..) {
            match self.wait_verdict(&w.principal, run, &w.key) {
                Ok(Verdict::Held { .. }) => keep.push(w),
                Ok(v) => {
                    self.waiter_done(w.conn, &w.principal);
                    let answer = Answer::Verdict(render::verdict(run, &v));
                    self.send(w.to, answer);
                }
                Err(answer) => {
                    self.waiter_done(w.conn, &w.principal);
                    self.send(w.to, answer);
                }
            }
        }
        if !keep.is_empty() {
            // Waiters added while re-checking (none today) would be in the map already.
            self.waiters.entry(run.clone()).or_default().extend(keep);
        }
    }

    fn fire_timers(&mut self) {
        let now = self.tick_clock();
        // Deadlines and approval expiries.
        while let Some((at, run)) = self.timers.first().cloned() {
            if at > now {
                break;
            }
            self.timers.remove(&(at, run.clone()));
            self.timer_of.remove(&run);
            if self.journal.is_none() {
                break;
            }
            let _ = self.apply_reply(&system_principal(), Command::Tick { run: run.clone() });
            self.rearm(&run);
        }
        // Waiters whose time is up get the current verdict (held).
        let mut expired: Vec<RunId> = Vec::new();
        while let Some((at, _)) = self.waiter_deadlines.first() {
            if *at > Instant::now() {
                break;
            }
            if let Some((_, run)) = self.waiter_deadlines.pop_first()
                && !expired.contains(&run)
            {
                expired.push(run);
            }
        }
        for run in expired {
            let Some(list) = self.waiters.remove(&run) else {
                continue;
            };
            let (due, keep): (Vec<_>, Vec<_>) =
                list.into_iter().partition(|w| w.deadline <= Instant::now());
            if !keep.is_empty() {
                self.waiters.insert(run.clone(), keep);
            }
            for w in due {
                self.waiter_done(w.conn, &w.principal);
                let answer = match self.wait_verdict(&w.principal, &run, &w.key) {
                    Ok(v) => Answer::Verdict(render::verdict(&run, &v)),
                    Err(a) => a,
                };
                self.send(w.to, answer);
            }
        }
        // Retention and snapshots.
        if now >= self.next_compaction && self.journal.is_some() {
            self.next_compaction = now + self.opts.compaction_period_ms();
            let cmd = Command::Compact {
                before: now.saturating_sub(self.opts.retention_ms),
                tombstones_before: now.saturating_sub(self.opts.tombstone_retention_ms),
            };
            let _ = self.apply_reply(&system_principal(), cmd);
        }
        let due = self
            .snapshot_retry
            .is_none_or(|(at, _)| Instant::now() >= at);
        if self.records_since_snapshot >= self.opts.snapshot_every_records && due {
            self.snapshot();
        }
    }

    /// Writes a snapshot of the current state (covering every record so far). A failure is
    /// retried after a backoff (1 s, doubling up to 10 min), never on every loop: encoding the
    /// whole state again each time would starve every client of the core.
    fn snapshot(&mut self) {
        const RETRY_FIRST: Duration = Duration::from_secs(1);
        const RETRY_MAX: Duration = Duration::from_secs(600);
        let Some(journal) = &self.journal else { return };
        let mut bytes = Vec::new();
        estop_kernel::codec::encode_snapshot(&self.gate, &mut bytes);
        let size = bytes.len();
        match journal.snapshot(self.last_seq, bytes) {
            Ok(()) => {
                self.records_since_snapshot = 0;
                self.snapshot_retry = None;
            }
            Err(e) => {
                let wait = self
                    .snapshot_retry
                    .map_or(RETRY_FIRST, |(_, w)| (w * 2).min(RETRY_MAX));
                self.snapshot_retry = Some((Instant::now() + wait, wait));
                self.obs.snapshot_failed();
                let advice = match &e {
                    LedgerError::Options { .. } => format!(
                        "the gate's state is {size} bytes, more than a snapshot may hold: shorten --retention so stopped runs are compacted sooner, and close finished runs"
                    ),
                    _ => "see the error; the disk may be full or failing".to_string(),
                };
                crate::log::error(&format!(
                    "snapshot at seq {} failed: {e}; {advice}. Nothing is lost (the ledger holds every record), but recovery replays more until a snapshot succeeds; retrying in {}s",
                    self.last_seq,
                    wait.as_secs()
                ));
            }
        }
    }

    fn fail_journal(&mut self) {
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
        // Everything waiting is answered now: the state it waited on may not survive recovery.
        let waiters: Vec<Waiter> = self.waiters.drain().flat_map(|(_, ws)| ws).collect();
        for w in &waiters {
            self.waiter_shares.give_back(&w.principal);
        }
        self.waiters_of_conn.clear();
        self.waiter_deadlines.clear();
        for w in waiters {
            self.send(w.to, unavailable());
        }
        self.recover();
    }

    /// Reopens the ledger after a failure, dropping every record that was not durable, and
    /// rebuilds the state from disk. Retried every second until the disk is back.
    fn recover(&mut self) {
        // Each attempt re-reads the ledger: never more than once a second while the disk is down.
        self.next_recovery = Instant::now() + Duration::from_secs(1);
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
        self.gate = opened.gate;
        self.last_seq = seq;
        self.committed_seq = seq;
        self.release.start(generation, seq);
        match Journal::start(
            opened.ledger,
            notifier(&self.durable_tx, &self.release, generation, &self.self_tx),
        ) {
            Ok(journal) => {
                self.durable_tx.send_modify(|s| s.failed = false);
                self.journal = Some(journal);
                self.rearm_all_timers();
                crate::log::info(&format!(
                    "ledger recovered at seq {seq}; accepting changes again"
                ));
            }
            Err(e) => crate::log::error(&format!(
                "ledger reopened but cannot start writing: {e}; retrying in 1s"
            )),
        }
    }

    /// The reference releases an approved effect in the `decide` itself; estop records the
    /// approval and then consumes it for the compatibility client in the same step.
    fn sg_decide(&mut self, run: RunId, key: EffectKey, approved: bool) -> Answer {
        if !self.sg_owns(&run) {
            // Exactly what a missing run gets: the listener learns nothing of other tenants.
            return not_found(run);
        }
        let operator = crate::soundgate::principal(Role::Operator);
        let decision = if approved {
            estop_kernel::vocab::Decision::Approve
        } else {
            estop_kernel::vocab::Decision::Reject
        };
        let cmd = Command::Decide {
            run: run.clone(),
            key: key.clone(),
            decision,
            reason: None,
        };
        match self.apply_reply(&operator, cmd) {
            Ok((Reply::Decided(DecideStatus::Approved), _)) => {
                let agent = crate::soundgate::principal(Role::Agent);
                match self.apply_verdict(
                    &agent,
                    Command::Recheck {
                        run: run.clone(),
                        key,
                    },
                ) {
                    Ok(v) => Answer::Verdict(render::verdict(&run, &v)),
                    Err(a) => a,
                }
            }
            Ok((Reply::Decided(DecideStatus::Rejected), _)) => {
                Answer::Verdict(wire::Verdict::Refused {
                    reason: "rejected".into(),
                    message: None,
                    rule: None,
                })
            }
            Ok((Reply::Decided(DecideStatus::Pending { .. }), _)) => {
                Answer::Verdict(wire::Verdict::Held {
                    approval: None,
                    expires_at: None,
                    reason: "approval".into(),
                })
            }
            Ok(_) => Answer::Error(
                ErrorCode::Internal,
                "unexpected kernel reply to decide".into(),
            ),
            Err(answer) => {
                // Say what the effect's state is, in the reference's vocabulary where it has one.
                let Some(r) = self.gate.run(&run) else {
                    return answer;
                };
                if r.stop.is_some() {
                    return Answer::Verdict(wire::Verdict::Refused {
                        reason: "cancelled".into(),
                        message: None,
                        rule: None,
                    });
                }
                match r.effects.get(&key).map(|e| e.status) {
                    Some(estop_kernel::state::Status::Refused(reason)) => {
                        Answer::Verdict(wire::Verdict::Refused {
                            reason: reason.as_str().into(),
                            message: None,
                            rule: None,
                        })
                    }
                    Some(s) if !s.is_held_or_prepared() => {
                        Answer::Verdict(wire::Verdict::Duplicate {
                            status: s.kind().as_str().into(),
                            outcome: None,
                            result: None,
                            error: None,
                        })
                    }
                    _ => answer,
                }
            }
        }
    }

    /// Whether the SoundGate listener created `run` (its runs belong to its principal).
    fn sg_owns(&self, run: &RunId) -> bool {
        self.gate
            .run(run)
            .and_then(|r| r.owner.as_ref())
            .is_some_and(|o| o.as_str() == crate::soundgate::PRINCIPAL_NAME)
    }

    fn query(&mut self, principal: &Principal, q: Query) -> Answer {
        let err = |e: KernelError| {
            let (c, m) = kernel_error(&e);
            Answer::Error(c, m)
        };
        match q {
            Query::Status { run } => match self.gate.visible_run(principal, &run) {
                Ok(r) => Answer::Run(Box::new(render::run_view(&run, r))),
                Err(e) => match self.gate.visible_tombstone(principal, &run) {
                    Ok(t) => Answer::Run(Box::new(render::tombstone_view(&run, t))),
                    Err(_) => err(e),
                },
            },
            Query::Report { run, cursor, page } => match self.gate.visible_run(principal, &run) {
                Ok(r) => Answer::Report(Box::new(render::report(&run, r, cursor.as_ref(), page))),
                Err(e) => match self.gate.visible_tombstone(principal, &run) {
                    Ok(t) => Answer::Report(Box::new(render::tombstone_report(&run, t))),
                    Err(_) => err(e),
                },
            },
            Query::Runs {
                state,
                cursor,
                mut page,
            } => {
                let mut runs: Vec<wire::RunView> = Vec::new();
                let mut next = None;
                for (id, r) in self.gate.runs_after(cursor.as_ref()) {
                    if principal.role == Role::Agent && r.owner.as_ref() != Some(&principal.name) {
                        continue;
                    }
                    if state.is_some_and(|s| s != r.state) {
                        continue;
                    }
                    let view = render::run_view(id, r);
                    if !page.take(view.weight()) {
                        next = runs.last().map(|v| v.run.clone());
                        break;
                    }
                    runs.push(view);
                }
                Answer::Runs(wire::RunsReply {
                    runs,
                    more: next.is_some(),
                    next,
                })
            }
            Query::Pending { run, cursor, page } => match &run {
                Some(id) => match self.gate.visible_run(principal, id) {
                    Ok(r) => Answer::Pending(pending_page([(id, r)], cursor, page)),
                    Err(e) => err(e),
                },
                None => {
                    let visible = self.gate.runs().filter(|(_, r)| {
                        principal.role != Role::Agent || r.owner.as_ref() == Some(&principal.name)
                    });
                    Answer::Pending(pending_page(visible, cursor, page))
                }
            },
        }
    }
}

/// One page of the inbox of `runs`: soonest to expire first, then by run and key, after
/// `cursor`. Only the page's items are built; their arguments are shared, not copied.
fn pending_page<'a>(
    runs: impl IntoIterator<Item = (&'a RunId, &'a estop_kernel::state::Run)>,
    cursor: Option<PendingCursor>,
    mut page: PageBudget,
) -> wire::PendingReply {
    let mut held = Vec::new();
    for (id, r) in runs {
        if r.pending_approvals == 0 {
            continue;
        }
        for (k, e) in &r.effects {
            if let Some(expires_at) = render::pending_expiry(e) {
                held.push((expires_at, id, k, e));
            }
        }
    }
    held.sort_unstable_by(|a, b| (a.0, a.1, a.2).cmp(&(b.0, b.1, b.2)));
    let start = cursor.map_or(0, |c| {
        held.partition_point(|h| (h.0, h.1, h.2) <= (c.expires_at, &c.run, &c.key))
    });
    let mut reply = wire::PendingReply::default();
    let mut last = None;
    for &(expires_at, id, k, e) in &held[start..] {
        let Some(item) = render::pending_item(id, k, e) else {
            continue;
        };
        if !page.take(item.weight()) {
            reply.more = true;
            break;
        }
        last = Some((expires_at, id, k));
        reply.pending.push(item);
    }
    if reply.more {
        reply.next = last.map(|(expires_at, run, key)| {
            PendingCursor {
                expires_at,
                run: run.clone(),
                key: key.clone(),
            }
            .encode()
        });
    }
    reply
}

/// The answer for a run that does not exist (or that the asker may not see: the same answer).
fn not_found(run: RunId) -> Answer {
    let (c, m) = kernel_error(&KernelError::RunNotFound(run));
    Answer::Error(c, m)
}

/// The answer to a change the ledger could not make durable.
pub fn unavailable() -> Answer {
    Answer::Error(
        ErrorCode::Unavailable,
        "the ledger cannot make changes durable right now (see the daemon's log); the change is not acknowledged, retry later with the same key".into(),
    )
}

/// Opens the ledger (with `Some(discard_after)` after a failure) and rebuilds the gate.
pub type OpenFn = Box<dyn FnMut(Option<u64>) -> Result<Opened, JournalError> + Send>;

/// The ledger's sync thread reports here: durable progress to the repliers, failure to the core.
fn notifier(
    durable_tx: &Arc<watch::Sender<DurableState>>,
    release: &Arc<crate::durable::Release>,
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
