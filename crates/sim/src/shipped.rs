//! The shipped path under power loss: the daemon's own core and the one executor of its actions
//! (`estop_server::core::Shell`, as the daemon's core thread runs it), its
//! own committer (`estop_ledger::Committer`, syncing on the caller: `caller_syncs`) and its own
//! reply release (`durable::Release` → `Outbox`), driven step by step on one thread by a seeded
//! world of clients, a clock, and a crash-simulating disk (power loss with torn writes, kill -9,
//! failed writes and fsyncs, a full disk). An auditor checks, after every recovery and at the end, that everything a
//! client was told is still true: an admission, a hold, a cancel, an approval that was
//! acknowledged survives any crash (G6). No copy of the pipeline: what runs is what ships. How
//! often each step and fault happens is drawn per seed (swarm testing).
//!
//! A planted bug (`CoreOptions::planted_early_release`: replies released one record before
//! their fdatasync) must be caught within the CI seeds (test `simulation::the_shipped_path_*`).

use crate::rng::Rng;
use estop_kernel::state::Status;
use estop_kernel::vocab::{EffectClass, PolicyAction, Reversibility};
use estop_kernel::{
    Admit, Command, Digest, EffectKey, Limits, PolicyDecision, Principal, PrincipalName, Role,
    RunId, RunLimits, ToolName,
};
use estop_ledger::{CrashStorage, LedgerOptions, Storage};
use estop_protocol::{Id, reply as wire};
use estop_server::core::{Answer, CoreMsg, CoreOptions, Now, OpenFn, Out, ReplyTo, Shell};
use estop_server::durable::DurableState;
use estop_server::journal;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, mpsc};
use tokio::sync::{mpsc as tmpsc, watch};

const RUNS: [&str; 4] = ["r0", "r1", "r2", "r3"];

/// A bug planted in the shipped code for a run (the tests show the auditor catches each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Planted {
    None,
    /// Replies released one record before their fdatasync.
    EarlyRelease,
    /// A connection's waits kept after it disconnects.
    WaiterLeak,
}
const WALL0: u64 = 1_800_000_000_000;

/// The kinds of step the world takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Admit,
    Approve,
    Cancel,
    Wait,
    Reconnect,
    Commit,
    Timers,
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
        ];
        let mut weights = vec![
            (Step::Admit, 30 + rng.below(30)),
            (Step::Approve, 2 + rng.below(8)),
            (Step::Cancel, 1 + rng.below(5)),
            (Step::Wait, 2 + rng.below(8)),
            (Step::Reconnect, 1 + rng.below(3)),
            (Step::Commit, 10 + rng.below(30)),
            (Step::Timers, 2 + rng.below(8)),
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
}

/// A request a client is waiting on, by id.
#[derive(Debug, Clone)]
enum Asked {
    Admit { run: &'static str, key: String },
    Cancel { run: &'static str },
    Approve { run: &'static str, key: String },
}

/// Facts a client was told, which must survive every crash.
#[derive(Debug, Default)]
struct Acked {
    /// Admitted (token handed out): the effect is past its admission.
    admitted: BTreeSet<(&'static str, String)>,
    /// Held for approval: the effect exists and was not admitted without a decision.
    held: BTreeSet<(&'static str, String)>,
    /// Cancelled: the run is stopped.
    cancelled: BTreeSet<&'static str>,
    /// Approved by the operator: the approval is recorded.
    approved: BTreeSet<(&'static str, String)>,
}

struct Client {
    tx: tmpsc::UnboundedSender<Out>,
    rx: tmpsc::UnboundedReceiver<Out>,
    asked: BTreeMap<u64, Asked>,
    /// Its connection's id (a new one after each reconnect).
    conn: u64,
}

pub struct ShippedWorld {
    rng: Rng,
    storage: Arc<CrashStorage>,
    core: Option<Shell>,
    /// The core's own queue: the committer reports a failed sync through it.
    self_rx: mpsc::Receiver<CoreMsg>,
    self_tx: mpsc::Sender<CoreMsg>,
    opts: CoreOptions,
    clients: Vec<Client>,
    next_id: u64,
    next_key: u64,
    mono: u64,
    storage_full: bool,
    mix: Mix,
    acked: Acked,
    report: ShippedReport,
}

fn agent() -> Principal {
    Principal {
        name: PrincipalName::new("agent").expect("valid"),
        role: Role::Agent,
        groups: Vec::new(),
    }
}

fn admin() -> Principal {
    Principal {
        name: PrincipalName::new("admin").expect("valid"),
        role: Role::Operator,
        groups: Vec::new(),
    }
}

fn open_fn(storage: Arc<CrashStorage>) -> OpenFn {
    let st: Arc<dyn Storage> = storage;
    Box::new(move |discard_after| {
        journal::open(
            Arc::clone(&st),
            &Limits::default(),
            LedgerOptions {
                discard_after,
                caller_syncs: true,
                // Small segments and records: rolls, preallocation and torn tails happen often.
                record_bytes_max: 1024,
                segment_bytes_max: 8192,
                preallocate_bytes: 2048,
                ..LedgerOptions::default()
            },
        )
    })
}

impl ShippedWorld {
    pub fn new(seed: u64, planted: Planted) -> ShippedWorld {
        let mut rng = Rng::new(seed);
        let storage = Arc::new(CrashStorage::new(rng.next_u64()));
        let mut mix_rng = Rng::new(rng.next_u64());
        storage.set_torn_writes(true);
        let opts = CoreOptions {
            planted_early_release: planted == Planted::EarlyRelease,
            planted_waiter_leak: planted == Planted::WaiterLeak,
            snapshot_every_records: 50,
            ..CoreOptions::default()
        };
        let (self_tx, self_rx) = mpsc::channel();
        let clients = (0..3)
            .map(|i| {
                let (tx, rx) = tmpsc::unbounded_channel();
                Client {
                    tx,
                    rx,
                    asked: BTreeMap::new(),
                    conn: i,
                }
            })
            .collect();
        let mut w = ShippedWorld {
            rng,
            storage,
            core: None,
            self_rx,
            self_tx,
            opts,
            clients,
            next_id: 1,
            next_key: 0,
            mono: 0,
            storage_full: false,
            mix: Mix::draw(&mut mix_rng),
            acked: Acked::default(),
            report: ShippedReport {
                seed,
                ..ShippedReport::default()
            },
        };
        w.boot();
        w
    }

    fn now(&self) -> Now {
        Now {
            wall_ms: WALL0 + self.mono,
            mono_ms: self.mono,
        }
    }

    /// Starts a core on what the disk holds (after a crash: recovery). A start can fail on a
    /// fault of its own (an injected failed sync, a full disk): the daemon would exit and its
    /// supervisor start it again, so the world heals the disk and starts again; a start that
    /// keeps failing is a finding.
    fn boot(&mut self) {
        let mut last = None;
        for _ in 0..3 {
            let (durable_tx, _) = watch::channel(DurableState::default());
            match Shell::new(
                self.opts.clone(),
                Arc::new(durable_tx),
                open_fn(Arc::clone(&self.storage)),
                self.self_tx.clone(),
            ) {
                Ok(core) => {
                    self.core = Some(core);
                    return;
                }
                Err(e) => {
                    self.report.failed_starts += 1;
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

    fn send(&mut self, client: usize, principal: Principal, cmd: Command, asked: Asked) {
        let id = self.next_id;
        self.next_id += 1;
        let to = ReplyTo {
            out: self.clients[client].tx.clone().into(),
            id: Id::from_u64(id),
            charge: None,
        };
        self.clients[client].asked.insert(id, asked);
        self.report.requests += 1;
        let now = self.now();
        self.core()
            .handle(now, CoreMsg::Apply { principal, cmd, to });
    }

    fn admit(&mut self, client: usize) {
        let run = *self.rng.pick(&RUNS);
        let key = format!("k{}", self.next_key);
        self.next_key += 1;
        let approve = self.rng.chance(0.3);
        let cmd = Command::Admit(Admit {
            run: RunId::new(run).expect("valid"),
            key: EffectKey::new(&key).expect("valid"),
            tool: ToolName::new(if approve { "refund" } else { "pay" }).expect("valid"),
            digest: Digest([self.next_key as u8; 32]),
            args: None,
            start: false,
            parent: None,
            labels: Vec::new(),
            limits: RunLimits::default(),
            policy: PolicyDecision {
                action: if approve {
                    PolicyAction::Approve
                } else {
                    PolicyAction::Allow
                },
                class: EffectClass::Write,
                reversibility: Reversibility::Undeclared,
                compensate: None,
                quorum: 1,
                groups: Vec::new(),
                expiry_ms: 3_600_000,
                rule: "sim".into(),
            },
        });
        self.send(client, agent(), cmd, Asked::Admit { run, key });
    }

    fn approve(&mut self, client: usize) {
        let Some((run, key)) = self.acked.held.iter().next().cloned() else {
            return;
        };
        let cmd = Command::Decide {
            run: RunId::new(run).expect("valid"),
            key: EffectKey::new(&key).expect("valid"),
            decision: estop_kernel::vocab::Decision::Approve,
            reason: None,
        };
        self.send(client, admin(), cmd, Asked::Approve { run, key });
    }

    /// A long `wait` on an effect held for approval: parked in the core.
    fn wait(&mut self, client: usize) {
        if self.acked.held.is_empty() {
            return;
        }
        let pick = self.rng.index(self.acked.held.len());
        let Some((run, key)) = self.acked.held.iter().nth(pick).cloned() else {
            return;
        };
        let id = self.next_id;
        self.next_id += 1;
        let to = ReplyTo {
            out: self.clients[client].tx.clone().into(),
            id: Id::from_u64(id),
            charge: None,
        };
        self.report.requests += 1;
        let msg = CoreMsg::Wait {
            principal: agent(),
            run: RunId::new(run).expect("valid"),
            key: EffectKey::new(&key).expect("valid"),
            timeout: std::time::Duration::from_secs(3_600),
            conn: self.clients[client].conn,
            to,
        };
        let now = self.now();
        self.core().handle(now, msg);
    }

    /// The client's connection goes; it comes back as a new one.
    fn reconnect(&mut self, client: usize) {
        let conn = self.clients[client].conn;
        let now = self.now();
        self.core().handle(now, CoreMsg::Disconnect { conn });
        self.clients[client].conn += 1_000;
        self.clients[client].asked.clear();
    }

    /// Every client disconnects: the core must hold no wait of theirs.
    fn all_leave(&mut self) -> Result<(), String> {
        for c in 0..self.clients.len() {
            self.reconnect(c);
        }
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        let now = self.now();
        self.core().handle(now, CoreMsg::Stats { reply: tx });
        let stats = rx.try_recv().map_err(|e| format!("no stats: {e}"))?;
        if stats.waiters != 0 {
            return Err(format!(
                "seed {}: every connection is gone, the core still holds {} waits",
                self.report.seed, stats.waiters
            ));
        }
        Ok(())
    }

    fn cancel(&mut self, client: usize) {
        let run = *self.rng.pick(&RUNS);
        let cmd = Command::Cancel {
            run: RunId::new(run).expect("valid"),
            reason: None,
            kill: false,
        };
        self.send(client, agent(), cmd, Asked::Cancel { run });
    }

    /// Reads what every client received: the facts it was told.
    fn collect(&mut self) {
        for c in &mut self.clients {
            while let Ok(out) = c.rx.try_recv() {
                let Out::Answer { id, answer, .. } = out else {
                    continue;
                };
                let Some(asked) = id.as_u64().and_then(|id| c.asked.remove(&id)) else {
                    continue;
                };
                self.report.acked += 1;
                match (asked, answer) {
                    (Asked::Admit { run, key }, Answer::Verdict(v)) => match v {
                        wire::Verdict::Admitted { .. } => {
                            self.acked.admitted.insert((run, key));
                        }
                        wire::Verdict::Held { reason, .. } if reason == "approval" => {
                            self.acked.held.insert((run, key));
                        }
                        _ => {}
                    },
                    (Asked::Cancel { run }, Answer::Ack(_)) => {
                        self.acked.cancelled.insert(run);
                    }
                    (Asked::Approve { run, key }, Answer::Decided(d)) if d.status == "approved" => {
                        self.acked.held.remove(&(run, key.clone()));
                        self.acked.approved.insert((run, key));
                    }
                    (Asked::Approve { run, key }, Answer::Error(..)) => {
                        // Not pending any more (cancelled, or the run stopped): stop asking.
                        self.acked.held.remove(&(run, key));
                    }
                    _ => {}
                }
            }
        }
    }

    /// Everything a client was told is true of the state the core holds now.
    fn audit(&self, when: &str) -> Result<(), String> {
        let gate = self.core.as_ref().expect("booted").gate();
        let effect = |run: &str, key: &str| {
            gate.run(&RunId::new(run).expect("valid"))
                .and_then(|r| r.effects.get(&EffectKey::new(key).expect("valid")))
                .map(|e| e.status)
        };
        let seed = self.report.seed;
        for (run, key) in &self.acked.admitted {
            match effect(run, key) {
                Some(Status::Held(_)) | None => {
                    return Err(format!(
                        "seed {seed}, {when}: admission of {run}/{key} was acknowledged, state has {:?}",
                        effect(run, key)
                    ));
                }
                Some(_) => {}
            }
        }
        for (run, key) in self.acked.held.iter().chain(&self.acked.approved) {
            if effect(run, key).is_none() {
                return Err(format!(
                    "seed {seed}, {when}: hold of {run}/{key} was acknowledged, the effect is gone"
                ));
            }
        }
        for (run, key) in &self.acked.approved {
            if matches!(effect(run, key), Some(Status::Held(_))) {
                return Err(format!(
                    "seed {seed}, {when}: approval of {run}/{key} was acknowledged, still held"
                ));
            }
        }
        for run in &self.acked.cancelled {
            let stopped = gate
                .run(&RunId::new(run).expect("valid"))
                .is_some_and(|r| r.stop.is_some());
            if !stopped {
                return Err(format!(
                    "seed {seed}, {when}: cancel of {run} was acknowledged, the run is not stopped"
                ));
            }
        }
        Ok(())
    }

    /// Power loss: unsynced writes are lost (torn), the process is gone; then recovery.
    fn power_loss(&mut self) -> Result<(), String> {
        self.report.power_losses += 1;
        self.restart(true, "after a power loss")
    }

    /// kill -9: the process is gone, what it wrote stays (the page cache survives); then
    /// recovery.
    fn kill(&mut self) -> Result<(), String> {
        self.report.kills += 1;
        self.restart(false, "after kill -9")
    }

    fn restart(&mut self, power_loss: bool, when: &str) -> Result<(), String> {
        self.collect();
        // The process dies with everything in flight: no handle syncs on its way out.
        std::mem::forget(self.core.take());
        if power_loss {
            self.storage.crash();
        }
        for c in &mut self.clients {
            c.asked.clear();
            while c.rx.try_recv().is_ok() {}
        }
        self.boot();
        self.report.recoveries += 1;
        self.audit(when)
    }

    /// One step of the world.
    fn step(&mut self) -> Result<(), String> {
        self.report.steps += 1;
        self.report.disk_full += u64::from(self.storage_full);
        self.mono += self.rng.below(5);
        let client = self.rng.index(self.clients.len());
        match self.mix.pick(&mut self.rng) {
            Step::Admit => self.admit(client),
            Step::Approve => self.approve(client),
            Step::Cancel => self.cancel(client),
            Step::Wait => self.wait(client),
            Step::Reconnect => self.reconnect(client),
            Step::Commit => {
                let now = self.now();
                let core = self.core();
                core.fire_timers(now);
                core.commit();
            }
            Step::FailSync => {
                self.storage.fail_next_sync();
                self.report.failed_syncs += 1;
            }
            Step::FailWrite => {
                self.storage.fail_next_write();
                self.report.failed_writes += 1;
            }
            Step::PowerLoss => return self.power_loss(),
            Step::Kill => return self.kill(),
            Step::DiskFull => {
                // The disk fills up for a while: changes fail closed until it frees.
                let full = self.storage_full;
                self.storage
                    .set_space_left(if full { None } else { Some(0) });
                self.storage_full = !full;
            }
            Step::Timers => {
                let now = self.now();
                self.core().fire_timers(now);
            }
        }
        // What the committer reported (a failed sync) reaches the core as the daemon's would.
        while let Ok(msg) = self.self_rx.try_recv() {
            let now = self.now();
            self.core().handle(now, msg);
        }
        self.collect();
        Ok(())
    }
}

/// Runs one seed for `steps` steps; `Err` says what the auditor found.
pub fn run_seed(seed: u64, steps: u64, planted: Planted) -> Result<ShippedReport, String> {
    let mut w = ShippedWorld::new(seed, planted);
    for _ in 0..steps {
        w.step()?;
    }
    w.all_leave()?;
    // Heal, and check the last word after one more power loss.
    w.storage.set_space_left(None);
    w.storage_full = false;
    w.power_loss()?;
    Ok(w.report)
}
