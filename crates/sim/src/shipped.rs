//! The shipped path under power loss: the daemon's own core and the one executor of its actions
//! (`estop_server::core::Shell`, as the daemon's core thread runs it), its
//! own committer (`estop_ledger::Committer`, syncing on the caller: `caller_syncs`) and its own
//! reply release (`durable::Release` → `Outbox`), driven step by step on one thread by a seeded
//! world of clients, a clock, and a crash-simulating disk. No copy of the pipeline: what runs is
//! what ships. How often each step and fault happens is drawn per seed (swarm testing), and so
//! are the ledger's segment size (rolls every few records), the snapshot interval, retention,
//! approval expiry, run deadlines and budgets, and wait timeouts.
//!
//! * Clients (`clients`): agents admit (some with `start`, some with a deadline or a budget),
//!   start, complete (`ok`, `error`, `unknown`), park `wait`s on held effects, cancel, kill and
//!   close their runs, and reconnect; two operators approve (a quorum of two for `wire`),
//!   reject, cancel, pause and resume. The clock moves by milliseconds and by jumps past
//!   expiries, deadlines and retention.
//! * Faults: power loss with torn writes, kill -9 (page cache kept), failed writes and fsyncs,
//!   a disk that fills and frees, and the process cut short at a chosen disk operation
//!   (`disk`): any step of an append, a segment roll, a snapshot, retention's removals or
//!   recovery itself.
//! * The auditor (`auditor`) checks the whole history as answers arrive and every
//!   acknowledged fact after every recovery; at the end the world heals (`heal`): every
//!   pending request must be answered, new work admitted, retention must have run, no wait
//!   may outlive its connection, and a last power loss must keep everything.
//!
//! Bugs planted in the shipped code (`Planted`) must be caught within the CI seeds (tests in
//! `tests/shipped.rs`). Replay one seed with `ESTOP_SHIPPED_SEED=<n>`.

use crate::rng::Rng;
use estop_kernel::{Command, Limits, Principal};
use estop_ledger::{CrashStorage, LedgerOptions, Storage};
use estop_protocol::Id;
use estop_server::core::{CoreMsg, CoreOptions, Now, OpenFn, Out, ReplyTo, Shell};
use estop_server::durable::DurableState;
use estop_server::journal;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, mpsc};
use tokio::sync::{mpsc as tmpsc, watch};

mod auditor;
mod clients;
mod disk;
mod executor;
mod heal;

use auditor::Auditor;
use clients::{Asked, Held};
pub use disk::ROLL_AND_SNAPSHOT_POINTS;
use disk::{Cut, Disk, Phase};

/// The run ids clients use (`c0` and `c1` are sub-agents of `r0` and `r1`), and `fresh`, where
/// new work goes after healing.
const RUNS: [&str; 6] = ["r0", "r1", "r2", "r3", "c0", "c1"];
const FRESH: &str = "fresh";

/// The `&'static` name of a run id the world uses.
pub fn run_name(id: &str) -> Option<&'static str> {
    RUNS.iter().chain(&[FRESH]).find(|r| **r == id).copied()
}

fn parent_of(run: &str) -> Option<&'static str> {
    match run {
        "c0" => Some("r0"),
        "c1" => Some("r1"),
        _ => None,
    }
}

/// A bug planted in the shipped code for a run (the tests show the auditor catches each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Planted {
    None,
    /// Replies released one record before their fdatasync.
    EarlyRelease,
    /// A connection's waits kept after it disconnects.
    WaiterLeak,
    /// Retention forgets a stopped run with no tombstone (its fence gone with it).
    TombstonesDropped,
}
const WALL0: u64 = 1_800_000_000_000;

/// The kinds of step the world takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Admit,
    FollowUp,
    /// A client becomes an executor of compensations.
    Serve,
    Approve,
    Reject,
    Cancel,
    Close,
    Pause,
    Wait,
    Reconnect,
    Commit,
    Timers,
    Clock,
    Cut,
    FailSync,
    FailWrite,
    PowerLoss,
    Kill,
    DiskFull,
}

/// How often each step is taken: drawn per seed (swarm testing), so some seeds have no faults
/// of a kind at all and others many, and a bug that needs one kind of fault without another is
/// not drowned out.
#[derive(Debug, Clone)]
struct Mix {
    weights: Vec<(Step, u64)>,
    total: u64,
}

impl Mix {
    fn draw(rng: &mut Rng) -> Mix {
        // A fault is off in a quarter of the seeds; on, at one of several rates.
        let mut fault = |max: u64| {
            if rng.chance(0.25) {
                0
            } else {
                1 + rng.below(max)
            }
        };
        let faults = [
            (Step::FailSync, fault(4)),
            (Step::FailWrite, fault(3)),
            (Step::PowerLoss, fault(3)),
            (Step::Kill, fault(2)),
            (Step::DiskFull, fault(2)),
            (Step::Cut, fault(6)),
        ];
        let mut weights = vec![
            (Step::Admit, 30 + rng.below(30)),
            (Step::FollowUp, 10 + rng.below(20)),
            (Step::Serve, 1 + rng.below(3)),
            (Step::Approve, 2 + rng.below(8)),
            (Step::Reject, rng.below(3)),
            (Step::Cancel, 1 + rng.below(5)),
            (Step::Close, rng.below(3)),
            (Step::Pause, rng.below(3)),
            (Step::Wait, 2 + rng.below(8)),
            (Step::Reconnect, 1 + rng.below(3)),
            (Step::Commit, 10 + rng.below(30)),
            (Step::Timers, 2 + rng.below(8)),
            (Step::Clock, 1 + rng.below(4)),
        ];
        weights.extend(faults);
        let total = weights.iter().map(|(_, w)| w).sum();
        Mix { weights, total }
    }

    fn pick(&self, rng: &mut Rng) -> Step {
        let mut x = rng.below(self.total);
        for (step, w) in &self.weights {
            if x < *w {
                return *step;
            }
            x -= w;
        }
        unreachable!("x is below the total of the weights")
    }
}

/// Sizes and times drawn per seed.
#[derive(Debug, Clone)]
struct Shape {
    segment_bytes_max: u64,
    expiry_ms: u64,
    /// Longest `wait` timeout and deadline a client asks for.
    wait_ms_max: u64,
}

/// What one seed did.
#[derive(Debug, Clone, Default)]
pub struct ShippedReport {
    pub seed: u64,
    pub steps: u64,
    pub requests: u64,
    pub acked: u64,
    pub power_losses: u64,
    /// The process killed (kill -9): what was written stays in the page cache.
    pub kills: u64,
    /// Steps begun with the disk full.
    pub disk_full: u64,
    pub failed_syncs: u64,
    pub failed_writes: u64,
    pub recoveries: u64,
    /// Starts that failed on a fault of their own (and were started again).
    pub failed_starts: u64,
    /// Waits answered, by the answer: `admitted` (approved), `refused expired` (the
    /// approval's expiry), `refused deadline` (the run's deadline), `refused cancelled`,
    /// `held` (the wait's timeout) …
    pub waits: BTreeMap<String, u64>,
    /// Run lives forgotten by retention (seen at a recovery).
    pub forgotten: u64,
    /// Completions acknowledged with an outcome other than `ok`.
    pub completed_not_ok: u64,
    /// Where the process was cut short (power loss or kill at that disk operation).
    pub cuts: BTreeMap<String, u64>,
    /// Compensation attempts and lookups offered to an executor, reported by one, and
    /// executors that died in the middle of one (`executor.rs`).
    pub saga_offers: u64,
    pub saga_reports: u64,
    pub executors_died: u64,
}

impl ShippedReport {
    /// Adds another seed's counts to these.
    pub fn add(&mut self, r: &ShippedReport) {
        self.steps += r.steps;
        self.requests += r.requests;
        self.acked += r.acked;
        self.power_losses += r.power_losses;
        self.kills += r.kills;
        self.disk_full += r.disk_full;
        self.failed_syncs += r.failed_syncs;
        self.failed_writes += r.failed_writes;
        self.recoveries += r.recoveries;
        self.failed_starts += r.failed_starts;
        for (k, n) in &r.waits {
            *self.waits.entry(k.clone()).or_default() += n;
        }
        self.forgotten += r.forgotten;
        self.completed_not_ok += r.completed_not_ok;
        self.saga_offers += r.saga_offers;
        self.saga_reports += r.saga_reports;
        self.executors_died += r.executors_died;
        for (k, n) in &r.cuts {
            *self.cuts.entry(k.clone()).or_default() += n;
        }
    }
}

struct Client {
    tx: tmpsc::UnboundedSender<Out>,
    rx: tmpsc::UnboundedReceiver<Out>,
    asked: BTreeMap<u64, Asked>,
    /// Follow-ups to send (start after an admission, complete after go, wait while held).
    todo: VecDeque<Asked>,
    /// Its connection's id (a new one after each reconnect).
    conn: u64,
    /// It said `compensations` on this connection.
    executor: bool,
    /// Attempts and lookups it was offered and has not reported.
    offers: VecDeque<executor::Offer>,
}

pub struct ShippedWorld {
    rng: Rng,
    storage: Arc<CrashStorage>,
    disk: Disk,
    core: Option<Shell>,
    /// The core's own queue: the committer reports a failed sync through it.
    self_rx: mpsc::Receiver<CoreMsg>,
    self_tx: mpsc::Sender<CoreMsg>,
    opts: CoreOptions,
    shape: Shape,
    clients: Vec<Client>,
    next_id: u64,
    next_key: u64,
    mono: u64,
    storage_full: bool,
    mix: Mix,
    /// Whether this seed cuts the process short at disk operations.
    cuts_on: bool,
    /// Effects acknowledged as held for approval (what operators decide on).
    held: BTreeSet<Held>,
    /// Clients whose admission in `fresh` (after healing) was answered `admitted`.
    fresh_admitted: BTreeSet<usize>,
    auditor: Auditor,
    /// The saga's auditor (`executor.rs`).
    saga: executor::SagaAudit,
    /// What the running core made durable (a connection writes an event only once its record
    /// is: `executor.rs` reads events as a connection would).
    durable: Arc<watch::Sender<DurableState>>,
    report: ShippedReport,
}

/// Opens the ledger on `disk`: recovery, at a start and inside a running core after a failure
/// (its disk operations are named as recovery's).
fn open_fn(disk: Disk, segment_bytes_max: u64) -> OpenFn {
    let storage: Arc<dyn Storage> = Arc::new(disk.clone());
    Box::new(move |discard_after| {
        disk.set_phase(Phase::Recovery);
        let opened = journal::open(
            Arc::clone(&storage),
            &Limits::default(),
            LedgerOptions {
                discard_after,
                caller_syncs: true,
                // Small segments and records: rolls, preallocation and torn tails happen often.
                record_bytes_max: 512,
                segment_bytes_max,
                preallocate_bytes: 256,
                ..LedgerOptions::default()
            },
        );
        disk.set_phase(Phase::Serving);
        opened
    })
}

impl ShippedWorld {
    pub fn new(seed: u64, planted: Planted) -> ShippedWorld {
        let mut rng = Rng::new(seed);
        let storage = Arc::new(CrashStorage::new(rng.next_u64()));
        let mut mix_rng = Rng::new(rng.next_u64());
        storage.set_torn_writes(true);
        let retention_ms = *mix_rng.pick(&[500u64, 2_000, 10_000]);
        let opts = CoreOptions {
            planted_early_release: planted == Planted::EarlyRelease,
            planted_waiter_leak: planted == Planted::WaiterLeak,
            planted_tombstones_dropped: planted == Planted::TombstonesDropped,
            snapshot_every_records: *mix_rng.pick(&[5u64, 20]),
            retention_ms,
            tombstone_retention_ms: retention_ms * *mix_rng.pick(&[2u64, 4]),
            ..CoreOptions::default()
        };
        let shape = Shape {
            segment_bytes_max: *mix_rng.pick(&[640u64, 1_024, 4_096]),
            expiry_ms: *mix_rng.pick(&[100u64, 1_000, 10_000]),
            wait_ms_max: *mix_rng.pick(&[500u64, 5_000, 60_000]),
        };
        let (self_tx, self_rx) = mpsc::channel();
        let clients = (0..2 + mix_rng.below(4))
            .map(|i| {
                let (tx, rx) = tmpsc::unbounded_channel();
                Client {
                    tx,
                    rx,
                    asked: BTreeMap::new(),
                    todo: VecDeque::new(),
                    conn: i,
                    executor: false,
                    offers: VecDeque::new(),
                }
            })
            .collect();
        let parents = RUNS
            .iter()
            .filter_map(|r| parent_of(r).map(|p| (*r, p)))
            .collect();
        let auditor = Auditor::new(
            opts.retention_ms,
            opts.tombstone_retention_ms,
            opts.compaction_period_ms(),
            parents,
        );
        let mut w = ShippedWorld {
            rng,
            disk: Disk::new(Arc::clone(&storage)),
            storage,
            core: None,
            self_rx,
            self_tx,
            opts,
            shape,
            clients,
            next_id: 1,
            next_key: 0,
            mono: 0,
            storage_full: false,
            cuts_on: false,
            mix: Mix::draw(&mut mix_rng),
            held: BTreeSet::new(),
            fresh_admitted: BTreeSet::new(),
            auditor,
            saga: executor::SagaAudit::default(),
            durable: Arc::new(watch::channel(DurableState::default()).0),
            report: ShippedReport {
                seed,
                ..ShippedReport::default()
            },
        };
        w.cuts_on = w.mix.weights.iter().any(|(s, n)| *s == Step::Cut && *n > 0);
        w.boot();
        w
    }

    fn now(&self) -> Now {
        Now {
            wall_ms: WALL0 + self.mono,
            mono_ms: self.mono,
        }
    }

    /// The gate's time (the core's clock follows the wall clock this world gives it).
    fn gate_now(&self) -> u64 {
        WALL0 + self.mono
    }

    /// Starts a core on what the disk holds (after a crash: recovery). A start can fail on a
    /// fault of its own (an injected failed sync, a full disk, the process cut short again):
    /// the daemon would exit and its supervisor start it again, so the world heals the disk
    /// and starts again; a start that keeps failing is a finding.
    fn boot(&mut self) {
        let mut last = None;
        for _ in 0..5 {
            self.disk.revive();
            let (durable_tx, _) = watch::channel(DurableState::default());
            let durable_tx = Arc::new(durable_tx);
            self.durable = Arc::clone(&durable_tx);
            match Shell::new(
                self.opts.clone(),
                durable_tx,
                open_fn(self.disk.clone(), self.shape.segment_bytes_max),
                self.self_tx.clone(),
            ) {
                Ok(core) => {
                    self.core = Some(core);
                    return;
                }
                Err(e) => {
                    self.report.failed_starts += 1;
                    self.disk.take_fired();
                    self.storage.set_space_left(None);
                    self.storage_full = false;
                    last = Some(e);
                }
            }
        }
        panic!(
            "seed {}: the ledger does not recover after a crash: {last:?}",
            self.report.seed
        );
    }

    fn core(&mut self) -> &mut Shell {
        self.core.as_mut().expect("booted")
    }

    fn reply_to(&mut self, client: usize, asked: Asked) -> ReplyTo {
        let id = self.next_id;
        self.next_id += 1;
        self.clients[client].asked.insert(id, asked);
        self.report.requests += 1;
        ReplyTo {
            out: self.clients[client].tx.clone().into(),
            id: Id::from_u64(id),
            charge: None,
        }
    }

    fn send(&mut self, client: usize, principal: Principal, cmd: Command, asked: Asked) {
        let to = self.reply_to(client, asked);
        let now = self.now();
        self.core()
            .handle(now, CoreMsg::Apply { principal, cmd, to });
    }

    /// The client's connection goes; it comes back as a new one.
    fn reconnect(&mut self, client: usize) {
        self.executor_gone(client);
        let conn = self.clients[client].conn;
        let now = self.now();
        self.core().handle(now, CoreMsg::Disconnect { conn });
        self.clients[client].conn += 1_000;
        // A new connection has a socket of its own: what the core still sends the old one
        // (an event released once its record is durable) never reaches it.
        let (tx, rx) = tmpsc::unbounded_channel();
        self.clients[client].tx = tx;
        self.clients[client].rx = rx;
        self.clients[client].asked.clear();
        self.clients[client].todo.clear();
    }

    /// Every client disconnects: the core must hold no wait of theirs.
    fn all_leave(&mut self) -> Result<(), String> {
        for c in 0..self.clients.len() {
            self.reconnect(c);
        }
        self.check_waits_held()
    }

    /// The core holds no more waits than the connected clients still wait on: none of a
    /// connection that is gone.
    fn check_waits_held(&mut self) -> Result<(), String> {
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        let now = self.now();
        self.core().handle(now, CoreMsg::Stats { reply: tx });
        let stats = rx.try_recv().map_err(|e| format!("no stats: {e}"))?;
        let waiting = self
            .clients
            .iter()
            .flat_map(|c| c.asked.values())
            .filter(|a| matches!(a, Asked::Wait { .. }))
            .count();
        if stats.waiters > waiting {
            return Err(format!(
                "seed {}: the connected clients wait on {waiting} waits, the core still holds {} waits",
                self.report.seed, stats.waiters
            ));
        }
        Ok(())
    }

    /// Everything a client was told is true of the state the core holds now.
    fn audit(&mut self, when: &str) -> Result<(), String> {
        let now = self.gate_now();
        let gate = self.core.as_ref().expect("booted").gate();
        let before = self.auditor.lives();
        self.auditor
            .check_recovered(gate, now)
            .map_err(|e| format!("seed {}, {when}: {e}", self.report.seed))?;
        self.report.forgotten += (before - self.auditor.lives()) as u64;
        executor::check_settled(gate).map_err(|e| format!("seed {}, {when}: {e}", self.report.seed))
    }

    /// Power loss: unsynced writes are lost (torn), the process is gone; then recovery.
    fn power_loss(&mut self) -> Result<(), String> {
        self.report.power_losses += 1;
        self.storage.crash();
        self.restart("after a power loss")
    }

    /// kill -9: the process is gone, what it wrote stays (the page cache survives); then
    /// recovery.
    fn kill(&mut self) -> Result<(), String> {
        self.report.kills += 1;
        self.restart("after kill -9")
    }

    /// The process is gone (the disk already crashed, if it did): every connection drops,
    /// what the core queued for itself is lost; then a new process recovers.
    fn restart(&mut self, when: &str) -> Result<(), String> {
        self.collect()?;
        // The process dies with everything in flight: no handle syncs on its way out.
        std::mem::forget(self.core.take());
        while self.self_rx.try_recv().is_ok() {}
        for c in &mut self.clients {
            c.asked.clear();
            c.todo.clear();
            while c.rx.try_recv().is_ok() {}
        }
        self.executors_restarted();
        if self.cuts_on && self.rng.chance(0.3) {
            // The new process may be cut short too, in the middle of its recovery.
            let (cut, ops) = (self.draw_cut(), self.rng.below(8));
            self.disk.arm(cut, ops);
        }
        self.boot();
        self.report.recoveries += 1;
        self.audit(when)
    }

    /// The process was cut short at a disk operation during the last step: a restart.
    fn after_cut(&mut self) -> Result<(), String> {
        let Some((cut, at)) = self.disk.take_fired() else {
            return Ok(());
        };
        match cut {
            Cut::PowerLoss => self.report.power_losses += 1,
            Cut::Kill => self.report.kills += 1,
        }
        self.restart(&format!("after {cut:?} at {at}"))
    }

    fn draw_cut(&mut self) -> Cut {
        if self.rng.chance(0.7) {
            Cut::PowerLoss
        } else {
            Cut::Kill
        }
    }

    /// Timer work and a commit, as the driver does at the end of a burst.
    fn tick_and_commit(&mut self) {
        let now = self.now();
        let core = self.core();
        core.fire_timers(now);
        core.commit();
    }

    /// One step of the world.
    fn step(&mut self) -> Result<(), String> {
        self.report.steps += 1;
        self.report.disk_full += u64::from(self.storage_full);
        self.mono += self.rng.below(5);
        let client = self.rng.index(self.clients.len());
        match self.mix.pick(&mut self.rng) {
            Step::Admit => self.admit(client),
            Step::FollowUp => {
                // An executor runs what it was offered first (or dies in the middle of it).
                if !self.execute(client) {
                    self.follow_up(client);
                }
            }
            Step::Serve => self.serve_compensations(client),
            Step::Approve => self.decide(client, true),
            Step::Reject => self.decide(client, false),
            Step::Cancel => self.cancel(client),
            Step::Close => self.close(client),
            Step::Pause => self.pause(client),
            Step::Wait => self.wait_on_held(client),
            Step::Reconnect => {
                self.reconnect(client);
                self.check_waits_held()?;
            }
            Step::Commit => self.tick_and_commit(),
            Step::Clock => {
                // Time jumps: past expiries, deadlines, wait timeouts and retention.
                let far = self.shape.wait_ms_max.max(self.opts.retention_ms);
                self.mono += self.rng.below(far);
                self.tick_and_commit();
            }
            Step::Cut => {
                let cut = self.draw_cut();
                self.disk.arm(cut, self.rng.below(12));
            }
            Step::FailSync => {
                self.storage.fail_next_sync();
                self.report.failed_syncs += 1;
            }
            Step::FailWrite => {
                self.storage.fail_next_write();
                self.report.failed_writes += 1;
            }
            Step::PowerLoss => {
                self.disk.disarm();
                return self.power_loss();
            }
            Step::Kill => {
                self.disk.disarm();
                return self.kill();
            }
            Step::DiskFull => {
                // The disk fills up for a while (a write that does not fit writes what fits):
                // changes fail closed until it frees.
                let full = self.storage_full;
                let left = self.rng.below(600);
                self.storage
                    .set_space_left(if full { None } else { Some(left) });
                self.storage_full = !full;
            }
            Step::Timers => {
                let now = self.now();
                self.core().fire_timers(now);
            }
        }
        self.settle_step()
    }

    /// The end of a step: a cut process restarts; otherwise what the committer reported (a
    /// failed sync) reaches the core as the daemon's would, and the clients read their answers.
    fn settle_step(&mut self) -> Result<(), String> {
        if self.disk.fired() {
            return self.after_cut();
        }
        while let Ok(msg) = self.self_rx.try_recv() {
            let now = self.now();
            self.core().handle(now, msg);
            if self.disk.fired() {
                return self.after_cut();
            }
        }
        self.collect()?;
        let gate = self.core.as_ref().expect("booted").gate();
        self.auditor.observe(gate);
        executor::check_settled(gate).map_err(|e| format!("seed {}: {e}", self.report.seed))
    }
}

/// Runs one seed for `steps` steps, then heals; `Err` says what the auditor found.
pub fn run_seed(seed: u64, steps: u64, planted: Planted) -> Result<ShippedReport, String> {
    let replay = |e: String| format!("{e} (replay: ESTOP_SHIPPED_SEED={seed})");
    let mut w = ShippedWorld::new(seed, planted);
    for _ in 0..steps {
        w.step().map_err(replay)?;
    }
    w.heal_and_check().map_err(replay)?;
    w.report.cuts = w.disk.points();
    Ok(w.report)
}
