//! The core: the single owner of the gate's state. It applies every command in order and decides
//! what must happen — append this record, commit, release this reply once that record is durable,
//! snapshot, reopen the ledger — as [`Action`]s, tagged with the ledger position each depends on.
//! It does no IO: no ledger, no release queue, no thread, no clock, no environment. Time comes in
//! as an argument (`Now`) and the outcomes of IO come back as inputs (`append_failed`,
//! `reopened`, `snapshot_done`, …). The shell (`shell::Shell`) executes the actions; its driver
//! (`driver`) is the core thread's loop. Waiters, subscriptions and timers live here too.

use crate::durable::After;
use crate::quota::{ShareOptions, Shares};
use crate::render;
use estop_kernel::reply::DecideStatus;
use estop_kernel::vocab::RunState;
use estop_kernel::{
    Command, EffectKey, Gate, KernelError, Principal, PrincipalName, Record, Reply, Role, RunId,
    Verdict,
};
use estop_protocol::effect_token::TokenSeal;
use estop_protocol::page::{PageBudget, PendingCursor, Weight};
use estop_protocol::server_line as wire;
use estop_protocol::{ErrorCode, Id};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

mod actions;
mod catchup;
mod compat;
mod driver;
mod pgshell;
mod queries;
mod recovery;
mod sagas;
mod shell;
mod subscriptions;
mod timers;
mod waiters;

use actions::Actions;
use queries::not_found;
use sagas::{Executor, Offered};
use subscriptions::Subscriber;
use waiters::Waiter;

pub use crate::answer::{Answer, Out, unavailable};
pub use crate::outbox::Outbox;
pub use actions::Action;
pub use compat::{SOUNDGATE_PRINCIPAL_NAME, soundgate_principal};
pub use pgshell::{PgOpenFn, PgShell};
pub use recovery::Reopened;
pub use shell::{OpenFn, Shell};

/// Where a reply goes.
#[derive(Debug)]
pub struct ReplyTo {
    pub out: Outbox,
    pub id: Id,
    /// The request's share of its connection's input bound, given back when this is dropped:
    /// once the core has answered (or parked it as a waiter).
    pub charge: Option<crate::answer::Charge>,
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

// The command inline, as in `dispatch::Route`: a message is built and moved once per request,
// and boxing it would allocate on the hot path to save bytes never copied in bulk.
#[allow(clippy::large_enum_variant)]
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
        /// How many of the run's effects awaiting a decision the reply may list.
        page: PageBudget,
        to: ReplyTo,
    },
    Unsubscribe {
        run: RunId,
        conn: u64,
    },
    /// `compensations`: the connection runs compensations (of `run`, or of every run its
    /// principal may see) until it ends (`sagas`).
    Executor {
        principal: Principal,
        run: Option<RunId>,
        /// Only compensations whose compensating tool this matches (`None`: every one).
        tool: Option<estop_policy::ToolPattern>,
        conn: u64,
        out: Outbox,
        backlog: Arc<AtomicUsize>,
        to: ReplyTo,
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
    /// Another node committed records (the PostgreSQL store): the burst this message starts
    /// catches up with them (`PgShell::begin`); the core itself has nothing more to do.
    CatchUp,
    /// Finish what is in flight, make it durable, and stop.
    Shutdown {
        done: mpsc::Sender<()>,
    },
}

/// The clocks as the driver read them for one message (the core reads no clock itself).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Now {
    /// Wall-clock Unix milliseconds (made monotonic and step-proof by the core's `Clock`).
    pub wall_ms: u64,
    /// Monotonic milliseconds since any fixed origin.
    pub mono_ms: u64,
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
    /// long before it sleeps (see `Shell::run`); zero never.
    pub idle_spin: Duration,
    /// A planted bug for the tests of the fatal panic hook: the core panics once it has
    /// appended this many records. Set only by debug builds (`ESTOP_DEBUG_PANIC_CORE_AFTER`,
    /// read in `serve`); `None` in every release build.
    pub planted_panic_after_records: Option<u64>,
    /// A planted bug for the simulation's test that it bites: replies released one record
    /// before their fdatasync (`durable::Release::plant_early_release`). Never set by `serve`.
    pub planted_early_release: bool,
    /// A planted bug for the PostgreSQL store's test that it bites: replies are released
    /// before the COMMIT they depend on (`core::PgShell`). Set only by debug builds
    /// (`ESTOP_DEBUG_PLANT_REPLY_BEFORE_COMMIT=1`, read in `serve`).
    pub planted_reply_before_commit: bool,
    /// A planted bug for the simulation's test that it bites: a connection's waits are kept
    /// when it disconnects. Never set by `serve`.
    pub planted_waiter_leak: bool,
    /// A planted bug for the simulation's test that it bites: retention forgets a stopped run
    /// without leaving its tombstone (its fence). Never set by `serve`.
    pub planted_tombstones_dropped: bool,
    /// A call a stopped run's agent left `started` and has not reported this long after the
    /// stop becomes `unknown` (`SagaStep::Unreported`, `sagas`): its lookup or a human settles
    /// it. Within `IN_FLIGHT_TIMEOUT_MIN_MS..=IN_FLIGHT_TIMEOUT_MAX_MS`.
    pub in_flight_timeout_ms: u64,
    /// The policy each compensating call is checked against before it is offered (`sagas`);
    /// `serve` sets the one it admits by. `None`: not checked.
    pub compensation_policy: Option<Arc<estop_policy::Policy>>,
    /// Seals the admission tokens the core hands out (`estop_protocol::effect_token`). `serve`
    /// always sets the daemon's own key; the default (zeros) is for tests and the simulation.
    pub seal: TokenSeal,
}

/// Retention runs at most this often, and at least as often as `COMPACTION_PERIOD_MAX_MS`.
const COMPACTION_PERIOD_MIN_MS: u64 = 1_000;
const COMPACTION_PERIOD_MAX_MS: u64 = 60_000;

impl CoreOptions {
    /// The wire form of `token`, issued for effect `key` of `run` (sealed with the daemon's key).
    pub fn seal(&self, run: &RunId, key: &EffectKey, token: estop_kernel::Token) -> String {
        self.seal.seal(run, key, token)
    }

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
            inline_sync: true,
            idle_spin: Duration::from_micros(150),
            planted_panic_after_records: None,
            planted_early_release: false,
            planted_reply_before_commit: false,
            planted_waiter_leak: false,
            planted_tombstones_dropped: false,
            in_flight_timeout_ms: IN_FLIGHT_TIMEOUT_DEFAULT_MS,
            compensation_policy: None,
            seal: TokenSeal::for_tests(),
        }
    }
}

/// The bounds and default of `CoreOptions::in_flight_timeout_ms` (`estop serve
/// --in-flight-timeout`): long enough for a slow call to report after a cancel, short enough
/// that a dead agent's call does not hold its saga for long.
pub const IN_FLIGHT_TIMEOUT_DEFAULT_MS: u64 = 10 * 60 * 1000;
pub const IN_FLIGHT_TIMEOUT_MIN_MS: u64 = 1_000;
pub const IN_FLIGHT_TIMEOUT_MAX_MS: u64 = 7 * 24 * 3600 * 1000;

pub(crate) fn system_principal() -> Principal {
    Principal {
        name: PrincipalName::new("estop").expect("valid name"),
        role: Role::Operator,
        groups: Vec::new(),
        part: Default::default(),
    }
}

pub fn kernel_error(e: &KernelError) -> (ErrorCode, String) {
    let code = match e {
        KernelError::RunNotFound(_)
        | KernelError::EffectNotFound(..)
        | KernelError::Forgotten { .. } => ErrorCode::NotFound,
        KernelError::NotAwaitingApproval { .. } => ErrorCode::NotPending,
        KernelError::BadToken { .. } => ErrorCode::BadToken,
        KernelError::Limit { .. } => ErrorCode::LimitExceeded,
        KernelError::Forbidden | KernelError::NotHolder { .. } => ErrorCode::Forbidden,
        KernelError::DuplicateApprover { .. }
        | KernelError::NotStarted { .. }
        | KernelError::ParentMismatch { .. }
        | KernelError::InvalidState { .. }
        // A step of the reverse saga that is not due or not in a state the action takes
        // (docs/PROTOCOL.md, `conflict`): the message says what comes first.
        | KernelError::Saga { .. }
        // The message names the approval to decide instead.
        | KernelError::UndoAwaitsApproval { .. } => ErrorCode::Conflict,
        KernelError::IllegalTransition { .. } => ErrorCode::Internal,
    };
    (code, e.to_string())
}

/// The core's state. Its shell runs it on its own thread (`Shell::run`), or a simulation steps it.
pub struct Core {
    gate: Gate,
    /// The ledger takes appends: false from a failure until the shell reports it reopened.
    writing: bool,
    /// What the shell is to do next, in order (`poll_action`).
    actions: Actions,
    generation: u64,
    /// The seq of the last record appended (or queued to be: the ledger numbers them in order).
    last_seq: u64,
    /// `last_seq` at the last `commit`.
    committed_seq: u64,
    records_since_snapshot: u64,
    /// Records this core appended (for `planted_panic_after_records`).
    appended: u64,
    now: u64,
    clock: crate::clock::Clock,
    /// The driver's monotonic time (ms) at the message being handled.
    mono: u64,
    waiters: HashMap<RunId, Vec<Waiter>>,
    /// Blocked waits, by principal (the count of all of them is `waiter_shares.total()`).
    waiter_shares: Shares,
    /// Waiters per connection that has any: a disconnect looks for its waiters only then.
    waiters_of_conn: HashMap<u64, usize>,
    /// When (monotonic ms) some waiter of a run times out. Entries of waiters answered early go
    /// stale and are dropped when they come due; each waiter adds at most one, so this stays
    /// bounded.
    waiter_deadlines: BTreeSet<(u64, RunId)>,
    subscribers: HashMap<RunId, Vec<Subscriber>>,
    /// Subscriptions, by principal.
    subscription_shares: Shares,
    timers: BTreeSet<(u64, RunId)>,
    timer_of: HashMap<RunId, u64>,
    /// Connections that run compensations (`sagas`).
    executors: Vec<Executor>,
    /// The attempt each run's saga head was offered, and to whom.
    offered: HashMap<RunId, Offered>,
    /// Runs whose saga may have something to offer, looked at in `fire_timers`.
    saga_due: BTreeSet<RunId>,
    /// When a failed compensation's backoff ends (gate time), by run; stale entries are
    /// looked at once and dropped.
    saga_timers: BTreeSet<(u64, RunId)>,
    next_compaction: u64,
    /// After a failed snapshot: when (monotonic ms) the next may be tried, and the wait after
    /// that one.
    snapshot_retry: Option<(u64, Duration)>,
    /// While the ledger is down: when (monotonic ms) recovery may be tried again.
    next_recovery: u64,
    opts: CoreOptions,
    /// The console's feed and the metrics counters.
    obs: crate::observe::Observer,
}

impl Core {
    /// A core over `gate`, rebuilt from a ledger whose last record is `last_seq` (generation 0).
    pub fn new(opts: CoreOptions, gate: Gate, last_seq: u64) -> Core {
        let mut core = Core {
            gate,
            writing: true,
            actions: Actions::default(),
            generation: 0,
            last_seq,
            committed_seq: last_seq,
            records_since_snapshot: 0,
            appended: 0,
            now: 0,
            clock: crate::clock::Clock::default(),
            mono: 0,
            waiters: HashMap::new(),
            waiter_shares: Shares::new("waiters", opts.waiters),
            waiters_of_conn: HashMap::new(),
            waiter_deadlines: BTreeSet::new(),
            subscribers: HashMap::new(),
            subscription_shares: Shares::new("subscriptions", opts.subscriptions),
            timers: BTreeSet::new(),
            timer_of: HashMap::new(),
            executors: Vec::new(),
            offered: HashMap::new(),
            saga_due: BTreeSet::new(),
            saga_timers: BTreeSet::new(),
            next_compaction: 0,
            snapshot_retry: None,
            next_recovery: 0,
            opts,
            obs: crate::observe::Observer::default(),
        };
        core.rearm_all_timers();
        core.restart_sagas();
        core
    }

    pub fn gate(&self) -> &Gate {
        &self.gate
    }

    pub fn options(&self) -> &CoreOptions {
        &self.opts
    }

    /// The ledger takes appends (false from a failure until it is reopened).
    pub fn is_writing(&self) -> bool {
        self.writing
    }

    /// The next action for the shell, oldest first; `None` once all are taken. The shell takes
    /// them all after each input, before the next.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop()
    }

    /// The encoded record of an `Action::Append` (valid until `poll_action` returns `None`).
    pub fn record(&self, bytes: &std::ops::Range<usize>) -> &[u8] {
        self.actions.record(bytes)
    }

    fn after(&self) -> After {
        After {
            generation: self.generation,
            seq: self.last_seq,
        }
    }

    /// Takes the driver's reading of the clocks: the gate's time (`clock::Clock`: monotonic,
    /// not pushed ahead by one bad reading of the wall clock) and the monotonic time that
    /// waits, backoffs and retries are measured in.
    fn at(&mut self, now: Now) {
        self.mono = self.mono.max(now.mono_ms);
        self.now = self.clock.read(now.wall_ms, self.mono);
    }

    /// Commits the burst just applied (`Action::Commit`). Under light load — this burst and
    /// the last sync each carry at most `INLINE_SYNC_RECORDS_MAX` records, and the sync thread is
    /// idle — the shell syncs it on the core's thread and writes the replies it releases
    /// straight to their sockets: two thread handoffs less for a lone request (to the sync
    /// thread, and back to the IO thread), and nothing else is waiting for the core meanwhile.
    /// Under load the sync thread syncs while the core goes on applying the next burst
    /// (pipelining: were the core to sync, the disk would idle while it applies).
    /// `last_batch_records`: how many records the ledger's last sync carried (read only when
    /// it matters). Returns whether it queued a commit (false: nothing appended since the last
    /// one, or the ledger is down). The driver calls it at the end of each burst of messages.
    pub fn commit(&mut self, last_batch_records: impl FnOnce() -> u64) -> bool {
        const INLINE_SYNC_RECORDS_MAX: u64 = 2;
        let burst = self.last_seq.saturating_sub(self.committed_seq);
        if burst == 0 || !self.writing {
            return false; // Nothing appended since the last commit (a query, a timer that fired nothing).
        }
        let inline = self.opts.inline_sync
            && burst <= INLINE_SYNC_RECORDS_MAX
            && last_batch_records() <= INLINE_SYNC_RECORDS_MAX;
        self.actions.push(Action::Commit { inline });
        self.committed_seq = self.last_seq;
        true
    }

    /// How long from `now` until the core has timer work to do (deadlines and expiries,
    /// waits that end, retention, a recovery attempt); `None`: nothing but messages.
    pub fn next_timeout(&mut self, now: Now) -> Option<Duration> {
        self.at(now);
        let (gate_now, mono) = (self.now, self.mono);
        let timer = self
            .timers
            .first()
            .map(|(at, _)| at.saturating_sub(gate_now));
        let waiter = self
            .waiter_deadlines
            .first()
            .map(|(d, _)| d.saturating_sub(mono));
        let compaction = Some(
            self.next_compaction
                .saturating_sub(gate_now)
                .max(COMPACTION_PERIOD_MIN_MS),
        );
        let recovery = (!self.writing).then(|| self.next_recovery.saturating_sub(mono));
        let saga = self.saga_timeout(gate_now);
        [timer, waiter, compaction, recovery, saga]
            .into_iter()
            .flatten()
            .min()
            .map(Duration::from_millis)
    }

    /// Handles one message at `now`, queueing what is to be done (`poll_action`); returns true
    /// to stop.
    pub fn handle(&mut self, now: Now, msg: CoreMsg) -> bool {
        self.at(now);
        match msg {
            CoreMsg::Apply {
                principal,
                mut cmd,
                to,
            } => {
                self.keep_for_undo(&mut cmd);
                let answer = self.apply(&principal, cmd);
                self.send(to, answer);
            }
            CoreMsg::Wait {
                principal,
                run,
                key,
                timeout,
                conn,
                to,
            } => self.wait(principal, run, key, timeout, conn, to),
            CoreMsg::Subscribe {
                principal,
                run,
                conn,
                out,
                backlog,
                page,
                to,
            } => {
                let sub = Subscriber {
                    conn,
                    principal,
                    out,
                    backlog,
                };
                self.subscribe(run, sub, page, to);
            }
            CoreMsg::Unsubscribe { run, conn } => self.unsubscribe(&run, conn),
            CoreMsg::Executor {
                principal,
                run,
                tool,
                conn,
                out,
                backlog,
                to,
            } => {
                let ex = Executor {
                    conn,
                    principal,
                    run,
                    tool,
                    out,
                    backlog,
                };
                self.add_executor(ex, to);
            }
            CoreMsg::Disconnect { conn } => {
                // Its waits end with it: nobody is left to answer, and each would keep the
                // connection's writer (and its descriptors and slot) alive until it timed out.
                self.disconnect_waiters(conn);
                self.disconnect_subscriptions(conn);
                self.executor_gone(conn);
            }
            CoreMsg::Query {
                principal,
                query,
                to,
            } => {
                let answer = self.query(&principal, query);
                self.send(to, answer);
            }
            CoreMsg::SgStop { run, close, to } => self.sg_stop(run, close, to),
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
                let stats = Box::new(self.stats());
                self.actions.push(Action::Stats { reply, stats });
            }
            CoreMsg::LedgerFailed => self.fail_journal(),
            CoreMsg::CatchUp => {}
            CoreMsg::Shutdown { done } => {
                if self.writing {
                    self.actions.push(Action::Flush);
                }
                self.actions.push(Action::Stopped { done });
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
        self.actions.push(Action::Reply { to, answer, after });
    }

    /// Applies a command and records it if it changed state. `Err` is a ready error answer.
    fn apply_reply(
        &mut self,
        principal: &Principal,
        cmd: Command,
    ) -> Result<(Reply, Vec<estop_kernel::Event>), Answer> {
        if !self.writing {
            return Err(unavailable());
        }
        let now = self.now;
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
            // The ledger numbers records in order: this one will be `last_seq + 1` (the shell
            // asserts it). An append that fails comes back as `append_failed`: everything
            // tagged with this seq is then answered `unavailable`, and the state rebuilt.
            let seq = self.last_seq + 1;
            self.actions.append(seq, &record);
            self.last_seq = seq;
            self.records_since_snapshot += 1;
            self.appended += 1;
            if self.opts.planted_panic_after_records == Some(self.appended) {
                panic!(
                    "planted bug: ESTOP_DEBUG_PANIC_CORE_AFTER={}",
                    self.appended
                );
            }
            if let Some(run) = record.command.run() {
                let run = run.clone();
                self.rearm(&run);
            }
            self.publish(&applied.events);
            self.saga_touched(&applied.events);
            let after = self.after();
            let actions = &mut self.actions;
            self.obs.changed(
                &self.gate,
                record.command.run(),
                &applied.events,
                after,
                now,
                |tx, event| actions.push(Action::Feed { tx, event }),
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
        let key = match &cmd {
            Command::Admit(a) => Some(a.key.clone()),
            Command::Complete { key, .. }
            | Command::Start { key, .. }
            | Command::Recheck { key, .. } => Some(key.clone()),
            _ => None,
        };
        let (reply, events) = match self.apply_reply(principal, cmd) {
            Ok(r) => r,
            Err(a) => return a,
        };
        let run_id = run.unwrap_or_else(|| RunId::new("-").expect("valid"));
        match reply {
            Reply::Verdict(v) => {
                let key = key.unwrap_or_else(|| EffectKey::new("-").expect("valid"));
                Answer::Verdict(render::verdict(&run_id, &key, &self.opts.seal, &v))
            }
            Reply::Completed { late } => Answer::Ack(wire::Ack {
                late,
                ..wire::Ack::default()
            }),
            Reply::Disputed { settled } => Answer::Error(
                ErrorCode::Conflict,
                format!(
                    "effect {} of run {run_id} already settled as {settled}; this contradicting completion was refused and recorded",
                    key.as_ref().map_or("?", |k| k.as_str())
                ),
            ),
            Reply::Decided(d) => {
                self.obs
                    .decided(&d.status, self.now.saturating_sub(d.requested_at));
                Answer::Decided(render::decided(&d))
            }
            Reply::RunState { state, .. } => {
                let mut ack = render::run_state(state, &events);
                use estop_kernel::vocab::RunState;
                if !matches!(state, RunState::Active | RunState::Paused) {
                    render::in_flight(&self.gate, &mut ack);
                }
                Answer::Ack(ack)
            }
            Reply::Compensation {
                status,
                attempt,
                retry_at,
            } => Answer::Ack(wire::Ack {
                status: Some(status.as_str().into()),
                attempt: Some(attempt),
                retry_at,
                ..wire::Ack::default()
            }),
            Reply::Compacted { .. } | Reply::TokenRecorded => Answer::Ack(wire::Ack::default()),
        }
    }
}
