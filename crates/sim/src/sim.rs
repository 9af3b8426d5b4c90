//! Deterministic simulation of the server loop: the real kernel (`Gate::apply`), the real record
//! codec, the real ledger recovery (`estop_server::journal::open`: snapshot + replay, torn-tail
//! truncation, `discard_after` after a failure) on `CrashStorage`, and a group-commit writer that
//! follows docs/LEDGER.md step by step (buffer → one write → one fdatasync → replies released;
//! segment roll through a synced tmp file, rename and directory fsync; snapshots). The request
//! handling mirrors `crates/server/src/core.rs`: apply, record if changed, tag the reply with the
//! seq it depends on, release it only once that seq is durable, fail closed on any IO error and
//! reopen with `discard_after = durable`.
//!
//! Everything — clients, the network, the clock, the disk, every fault — is driven by one seeded
//! PRNG, so a seed replays exactly (`ESTOP_SIM_SEED=<n>`). Fault rates are drawn per seed. An
//! auditor checks every acknowledged reply against the state recovered after every crash, and the
//! guarantees over the whole acknowledged history (no double admission, no admission after an
//! acknowledged cancel or reject).

use crate::rng::Rng;
use crate::world::{Tool, Who, digest};
use estop_kernel::codec::{encode_record, encode_snapshot};
use estop_kernel::command::{Admit, RunLimits};
use estop_kernel::reply::{DecideStatus, Verdict};
use estop_kernel::state::Status;
use estop_kernel::vocab::{Decision, HoldReason, Outcome};
use estop_kernel::{
    Command, EffectKey, Gate, Limits, Principal, Record, Reply, RunId, Token, ToolName,
};
use estop_ledger::format;
use estop_ledger::{CrashStorage, LedgerOptions, Storage, StorageFile};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

/// Fault rates and sizes, drawn per seed.
#[derive(Debug, Clone)]
pub struct Faults {
    pub kill: f64,
    pub power_loss: f64,
    pub write_error: f64,
    pub sync_error: f64,
    pub disk_full: f64,
    pub snapshot: f64,
    pub segment_bytes_max: u64,
    pub clients: usize,
}

impl Faults {
    fn draw(rng: &mut Rng) -> Faults {
        Faults {
            kill: rng.rate(0.0, 0.01),
            power_loss: rng.rate(0.0, 0.01),
            write_error: rng.rate(0.0, 0.01),
            sync_error: rng.rate(0.0, 0.01),
            disk_full: rng.rate(0.0, 0.005),
            snapshot: rng.rate(0.0, 0.01),
            segment_bytes_max: *rng.pick(&[2_000u64, 8_000, 64 << 20]),
            clients: 2 + rng.index(14),
        }
    }
}

/// What one simulated seed did.
#[derive(Debug, Clone, Default)]
pub struct SimReport {
    pub seed: u64,
    pub steps: u64,
    pub requests: u64,
    pub acked: u64,
    pub records: u64,
    pub kills: u64,
    pub power_losses: u64,
    /// Crashes that found records buffered but not yet written.
    pub crash_buffered: u64,
    /// Crashes between a batch's write and its fdatasync.
    pub crash_written_unsynced: u64,
    /// Crashes right after a write failed part-way (a torn write on disk).
    pub crash_mid_write: u64,
    /// Crashes in the middle of a segment roll.
    pub crash_mid_roll: u64,
    pub io_errors: u64,
    pub disk_full: u64,
    pub recoveries: u64,
    pub torn_tails: u64,
    pub snapshots: u64,
    pub unavailable: u64,
}

impl std::fmt::Display for SimReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "seed {}: {} steps, {} requests, {} acked, {} records; crashes: {} kill -9 + {} power loss (buffered {}, written-unsynced {}, mid-write {}, mid-roll {}); {} IO errors, {} disk full, {} unavailable; {} recoveries ({} torn tails), {} snapshots",
            self.seed,
            self.steps,
            self.requests,
            self.acked,
            self.records,
            self.kills,
            self.power_losses,
            self.crash_buffered,
            self.crash_written_unsynced,
            self.crash_mid_write,
            self.crash_mid_roll,
            self.io_errors,
            self.disk_full,
            self.unavailable,
            self.recoveries,
            self.torn_tails,
            self.snapshots
        )
    }
}

/// A request a client sends.
#[derive(Debug, Clone)]
enum Req {
    Admit {
        run: String,
        parent: Option<String>,
        key: String,
        tool: Tool,
        arg: u8,
        start: bool,
    },
    Wait {
        run: String,
        key: String,
    },
    Start {
        run: String,
        key: String,
        token: Token,
    },
    Complete {
        run: String,
        key: String,
        token: Token,
        outcome: Outcome,
    },
    Decide {
        run: String,
        key: String,
        approve: bool,
    },
    Cancel {
        run: String,
    },
    Pause {
        run: String,
    },
    Resume {
        run: String,
    },
}

fn rid(s: &str) -> RunId {
    RunId::new(s).expect("valid run id")
}

fn kid(s: &str) -> EffectKey {
    EffectKey::new(s).expect("valid key")
}

impl Req {
    fn command(&self, now: u64) -> Command {
        match self {
            Req::Admit {
                run,
                parent,
                key,
                tool,
                arg,
                start,
            } => Command::Admit(Admit {
                run: rid(run),
                key: kid(key),
                tool: ToolName::new(tool.name()).expect("valid"),
                digest: digest(*tool, *arg),
                args: None,
                start: *start,
                parent: parent.as_deref().map(rid),
                labels: vec![],
                limits: RunLimits {
                    deadline_at: None,
                    max_effects: None,
                },
                policy: {
                    let _ = now;
                    tool.policy()
                },
            }),
            Req::Wait { run, key } => Command::Recheck {
                run: rid(run),
                key: kid(key),
            },
            Req::Start { run, key, token } => Command::Start {
                run: rid(run),
                key: kid(key),
                token: *token,
            },
            Req::Complete {
                run,
                key,
                token,
                outcome,
            } => Command::Complete {
                run: rid(run),
                key: kid(key),
                token: *token,
                outcome: *outcome,
                result: None,
                error: None,
            },
            Req::Decide { run, key, approve } => Command::Decide {
                run: rid(run),
                key: kid(key),
                decision: if *approve {
                    Decision::Approve
                } else {
                    Decision::Reject
                },
                reason: None,
            },
            Req::Cancel { run } => Command::Cancel {
                run: rid(run),
                reason: None,
                kill: false,
            },
            Req::Pause { run } => Command::Pause { run: rid(run) },
            Req::Resume { run } => Command::Resume { run: rid(run) },
        }
    }
}

/// What a client was told.
#[derive(Debug, Clone)]
enum Ans {
    Reply(Reply),
    Error,
    Unavailable,
}

#[derive(Debug)]
struct Client {
    who: Who,
    principal: Principal,
    run: String,
    parent: Option<String>,
    runs_made: u32,
    next_key: u32,
    /// The request in flight (at most one per client) and whether it was answered.
    outstanding: Option<Req>,
    /// Follow-ups to send (start after prepare, complete after go, wait while held).
    todo: VecDeque<Req>,
}

/// One pending reply inside the server: released once `seq` is durable.
#[derive(Debug)]
struct Outgoing {
    client: usize,
    req: Req,
    answer: Ans,
    seq: u64,
    order: u64,
}

/// The group-commit writer of one server generation (docs/LEDGER.md "Write path").
struct Writer {
    file: Box<dyn StorageFile>,
    segment_bytes: u64,
    buf: Vec<u8>,
    buf_last: u64,
    written: u64,
    durable: u64,
    next_seq: u64,
    /// A roll in progress: the tmp segment exists, synced, not yet renamed.
    rolling: Option<(String, Box<dyn StorageFile>, u64)>,
}

struct Server {
    gate: Gate,
    w: Writer,
    out: Vec<Outgoing>,
    failed: bool,
}

/// The acknowledged history, and the checks on it.
#[derive(Debug, Default)]
struct Auditor {
    tokens: BTreeMap<(String, String), Token>,
    started: BTreeSet<(String, String)>,
    completed: BTreeMap<(String, String), Outcome>,
    held: BTreeSet<(String, String)>,
    approvals: BTreeMap<(String, String), BTreeSet<String>>,
    rejected: BTreeSet<(String, [u8; 32])>,
    rejected_keys: BTreeSet<(String, String)>,
    /// The digest of every call a client sent (client-side knowledge).
    calls: BTreeMap<(String, String), [u8; 32]>,
    cancelled: BTreeSet<String>,
    /// Parent of each run, as the clients created them.
    parents: BTreeMap<String, String>,
    acked_seq: u64,
}

fn ancestors_and_self(parents: &BTreeMap<String, String>, run: &str) -> Vec<String> {
    let mut out = vec![run.to_string()];
    while let Some(p) = parents.get(out.last().expect("non-empty")) {
        out.push(p.clone());
    }
    out
}

impl Auditor {
    /// Records an acknowledged answer, checking the history-wide guarantees first.
    fn ack(&mut self, req: &Req, ans: &Ans, seq: u64) -> Result<(), String> {
        self.acked_seq = self.acked_seq.max(seq);
        let Ans::Reply(reply) = ans else {
            return Ok(());
        };
        // The run tree as the gate acknowledged it: a parent named by an admit that was answered.
        // (A run created implicitly by its child's admit has no parent of its own.)
        if let Req::Admit {
            run,
            parent: Some(p),
            ..
        } = req
        {
            self.parents.entry(run.clone()).or_insert_with(|| p.clone());
        }
        match (req, reply) {
            (
                Req::Admit { run, key, .. } | Req::Wait { run, key } | Req::Start { run, key, .. },
                Reply::Verdict(v),
            ) => {
                let id = (run.clone(), key.clone());
                let admitted = match v {
                    Verdict::Admitted { token } => Some(*token),
                    Verdict::Go => None,
                    Verdict::Held {
                        reason: HoldReason::Approval,
                        ..
                    } => {
                        self.held.insert(id);
                        return Ok(());
                    }
                    _ => return Ok(()),
                };
                let new_admission = admitted.is_some_and(|t| self.tokens.get(&id) != Some(&t));
                if new_admission || admitted.is_none() {
                    for r in ancestors_and_self(&self.parents, run) {
                        if self.cancelled.contains(&r) {
                            return Err(format!(
                                "G4: {run}/{key} admitted or started after the acknowledged cancel of {r}"
                            ));
                        }
                    }
                    if let Some(d) = self.calls.get(&id)
                        && self.rejected.contains(&(run.clone(), *d))
                    {
                        return Err(format!(
                            "G2: {run}/{key} admitted or started a call rejected earlier in the run"
                        ));
                    }
                }
                match admitted {
                    Some(t) => {
                        if let Some(old) = self.tokens.get(&id)
                            && *old != t
                        {
                            return Err(format!("G3: {run}/{key} admitted twice ({old} then {t})"));
                        }
                        self.tokens.insert(id, t);
                    }
                    None => {
                        if !self.started.insert(id) {
                            return Err(format!("G3: {run}/{key} got go twice"));
                        }
                    }
                }
            }
            (
                Req::Complete {
                    run, key, outcome, ..
                },
                Reply::Completed { .. },
            ) => {
                self.completed
                    .entry((run.clone(), key.clone()))
                    .or_insert(*outcome);
            }
            (
                Req::Decide {
                    run,
                    key,
                    approve: true,
                },
                Reply::Decided(_),
            ) => {
                self.approvals
                    .entry((run.clone(), key.clone()))
                    .or_default()
                    .insert(String::new());
            }
            (
                Req::Decide {
                    run,
                    key,
                    approve: false,
                },
                Reply::Decided(DecideStatus::Rejected),
            ) => {
                self.rejected_keys.insert((run.clone(), key.clone()));
                if let Some(d) = self.calls.get(&(run.clone(), key.clone())) {
                    self.rejected.insert((run.clone(), *d));
                }
            }
            (Req::Cancel { run }, Reply::RunState { .. }) => {
                self.cancelled.insert(run.clone());
            }
            _ => {}
        }
        Ok(())
    }

    /// Every acknowledged fact must be in the recovered state.
    fn check_recovered(&self, gate: &Gate, last_seq: u64) -> Result<(), String> {
        if last_seq < self.acked_seq {
            return Err(format!(
                "recovered up to seq {last_seq}, but seq {} was acknowledged",
                self.acked_seq
            ));
        }
        let effect =
            |run: &str, key: &str| gate.run(&rid(run)).and_then(|r| r.effects.get(&kid(key)));
        for ((run, key), token) in &self.tokens {
            match effect(run, key) {
                Some(e) if e.token == Some(*token) => {}
                other => {
                    return Err(format!(
                        "acknowledged admission {run}/{key} ({token}) lost after recovery: {:?}",
                        other.map(|e| e.status)
                    ));
                }
            }
        }
        for (run, key) in &self.started {
            match effect(run, key).map(|e| e.status) {
                Some(Status::Started | Status::Completed | Status::Failed | Status::Unknown) => {}
                other => {
                    return Err(format!(
                        "acknowledged start {run}/{key} lost after recovery: {other:?}"
                    ));
                }
            }
        }
        for ((run, key), outcome) in &self.completed {
            let got = effect(run, key).and_then(|e| e.outcome_kind());
            if got.is_none() {
                return Err(format!(
                    "acknowledged completion {run}/{key} ({outcome}) lost after recovery"
                ));
            }
        }
        for (run, key) in &self.held {
            if effect(run, key).is_none() {
                return Err(format!(
                    "acknowledged hold of {run}/{key} lost after recovery"
                ));
            }
        }
        for (run, key) in self.approvals.keys() {
            let e = effect(run, key).ok_or_else(|| format!("approved effect {run}/{key} lost"))?;
            let n = e.approval.as_ref().map_or(0, |a| a.approvers.len());
            if n == 0 {
                return Err(format!(
                    "acknowledged approval of {run}/{key} lost after recovery"
                ));
            }
        }
        for (run, d) in &self.rejected {
            if !gate
                .run(&rid(run))
                .is_some_and(|r| r.rejected.contains(&estop_kernel::Digest(*d)))
            {
                return Err(format!(
                    "acknowledged rejection in {run} lost after recovery"
                ));
            }
        }
        for (run, key) in &self.rejected_keys {
            let st = effect(run, key).map(|e| e.status);
            if st
                != Some(Status::Refused(
                    estop_kernel::vocab::RefusalReason::Rejected,
                ))
            {
                return Err(format!(
                    "acknowledged rejection of {run}/{key} lost after recovery: {st:?}"
                ));
            }
        }
        for run in &self.cancelled {
            if gate.run(&rid(run)).is_none_or(|r| r.stop.is_none()) {
                return Err(format!("acknowledged cancel of {run} lost after recovery"));
            }
        }
        Ok(())
    }
}

/// The simulated world of one seed.
pub struct World {
    rng: Rng,
    disk: CrashStorage,
    storage: Arc<dyn Storage>,
    faults: Faults,
    now: u64,
    server: Option<Server>,
    /// Last durable seq of the generation that failed (for `discard_after`).
    discard_after: Option<u64>,
    clients: Vec<Client>,
    inbox: VecDeque<(usize, Req)>,
    audit: Auditor,
    order: u64,
    disk_full_until: Option<u64>,
    /// A planted bug (tests prove the auditor catches it): replies leave before their fdatasync.
    pub mutant_ack_before_sync: bool,
    pub report: SimReport,
}

fn payload_of(rec: &Record) -> Vec<u8> {
    let mut b = Vec::new();
    encode_record(rec, &mut b);
    b
}

impl World {
    pub fn new(seed: u64) -> World {
        let mut rng = Rng::new(seed);
        let faults = Faults::draw(&mut rng);
        let disk = CrashStorage::new(seed);
        let storage: Arc<dyn Storage> = Arc::new(disk.clone());
        let clients = (0..faults.clients)
            .map(|i| {
                let who = if i % 5 == 4 {
                    Who::Alice
                } else if i % 5 == 3 && i > 5 {
                    Who::Bob
                } else {
                    Who::Agent
                };
                Client {
                    who,
                    principal: who.principal(),
                    run: format!("r{i}-0"),
                    parent: None,
                    runs_made: 0,
                    next_key: 0,
                    outstanding: None,
                    todo: VecDeque::new(),
                }
            })
            .collect();
        let mut w = World {
            rng,
            disk,
            storage,
            faults,
            now: 1_000,
            server: None,
            discard_after: None,
            clients,
            inbox: VecDeque::new(),
            audit: Auditor::default(),
            order: 0,
            disk_full_until: None,
            mutant_ack_before_sync: false,
            report: SimReport {
                seed,
                ..SimReport::default()
            },
        };
        w.boot().expect("the first boot on an empty disk succeeds");
        w
    }

    /// Opens the ledger (recovery) and starts a server generation. `Ok(false)`: the disk is still
    /// full; try again later.
    fn boot(&mut self) -> Result<bool, String> {
        let opts = LedgerOptions {
            discard_after: self.discard_after,
            ..LedgerOptions::default()
        };
        let opened = match estop_server::journal::open(
            Arc::clone(&self.storage),
            &Limits::default(),
            opts,
        ) {
            Ok(o) => o,
            Err(estop_server::journal::JournalError::Ledger(e))
                if matches!(e.code(), "ledger_full" | "ledger_io" | "ledger_failed") =>
            {
                return Ok(false);
            }
            Err(e) => return Err(format!("recovery refused to open: {e}")),
        };
        self.report.recoveries += 1;
        if opened.report.torn_tail.is_some() {
            self.report.torn_tails += 1;
        }
        let last = opened.report.last_seq;
        self.audit.check_recovered(&opened.gate, last)?;
        drop(opened.ledger);
        // The ledger made seg-(last+1) for appends; this generation's writer appends to it.
        let name = format::segment_name(last + 1);
        let existing = estop_ledger::read_file(&*self.storage, &name)
            .map_err(|e| format!("read fresh segment: {e}"))?;
        let file = self.reopen_append(&name, &existing)?;
        let Some(file) = file else { return Ok(false) };
        self.discard_after = None;
        self.server = Some(Server {
            gate: opened.gate,
            w: Writer {
                file,
                segment_bytes: existing.len() as u64,
                buf: Vec::new(),
                buf_last: last,
                written: last,
                durable: last,
                next_seq: last + 1,
                rolling: None,
            },
            out: Vec::new(),
            failed: false,
        });
        Ok(true)
    }

    /// `Ledger` hands its fresh segment to its own sync thread; the simulation drives the same
    /// bytes itself: it rewrites the (header-only) fresh segment the way `ActiveSegment::create`
    /// does and appends to it.
    fn reopen_append(
        &mut self,
        name: &str,
        existing: &[u8],
    ) -> Result<Option<Box<dyn StorageFile>>, String> {
        let tmp = format!("{name}{}", format::TMP_SUFFIX);
        let step = || -> std::io::Result<Box<dyn StorageFile>> {
            let mut f = self.storage.create(&tmp)?;
            f.write_all(existing)?;
            f.sync_data()?;
            self.storage.rename(&tmp, name)?;
            self.storage.sync_dir()?;
            Ok(f)
        };
        match step() {
            Ok(f) => Ok(Some(f)),
            Err(_) => {
                self.report.io_errors += 1;
                Ok(None)
            }
        }
    }

    fn client_request(&mut self, i: usize) -> Option<Req> {
        let c = &mut self.clients[i];
        if let Some(r) = c.todo.pop_front() {
            return Some(r);
        }
        let rng = &mut self.rng;
        if c.who.is_operator() {
            // Operators look at the inbox (a read) and decide, or stop/pause a run.
            let server = self.server.as_ref()?;
            let mut pending = Vec::new();
            for (id, run) in server.gate.runs() {
                for (k, e) in &run.effects {
                    if e.status == Status::Held(HoldReason::Approval) {
                        pending.push((id.to_string(), k.to_string()));
                    }
                }
            }
            let runs: Vec<String> = server.gate.runs().map(|(id, _)| id.to_string()).collect();
            return match rng.below(10) {
                0..=6 if !pending.is_empty() => {
                    let (run, key) = rng.pick(&pending).clone();
                    Some(Req::Decide {
                        run,
                        key,
                        approve: rng.below(5) != 0,
                    })
                }
                7 if !runs.is_empty() => Some(Req::Cancel {
                    run: rng.pick(&runs).clone(),
                }),
                8 if !runs.is_empty() => Some(Req::Pause {
                    run: rng.pick(&runs).clone(),
                }),
                9 if !runs.is_empty() => Some(Req::Resume {
                    run: rng.pick(&runs).clone(),
                }),
                _ => None,
            };
        }
        match rng.below(20) {
            0 => Some(Req::Cancel { run: c.run.clone() }),
            1 => {
                // A new run, sometimes a sub-agent of the current one.
                c.runs_made += 1;
                let parent = (rng.below(2) == 0).then(|| c.run.clone());
                c.run = format!("r{i}-{}", c.runs_made);
                c.parent = parent;
                None
            }
            _ => {
                c.next_key += 1;
                let tool = *rng.pick(&[
                    Tool::Pay,
                    Tool::Pay,
                    Tool::Pay,
                    Tool::Search,
                    Tool::Refund,
                    Tool::Wire,
                ]);
                Some(Req::Admit {
                    run: c.run.clone(),
                    parent: c.parent.clone(),
                    key: format!("k{}", c.next_key),
                    tool,
                    arg: u8::from(rng.below(4) == 0),
                    start: rng.below(2) == 0,
                })
            }
        }
    }

    /// A client reads its answer and plans what to do next.
    fn deliver(&mut self, o: Outgoing) -> Result<(), String> {
        self.report.acked += u64::from(!matches!(o.answer, Ans::Unavailable));
        self.audit.ack(
            &o.req,
            &o.answer,
            if matches!(o.answer, Ans::Unavailable) {
                0
            } else {
                o.seq
            },
        )?;
        let c = &mut self.clients[o.client];
        c.outstanding = None;
        let (run, key) = match &o.req {
            Req::Admit { run, key, .. } | Req::Wait { run, key } | Req::Start { run, key, .. } => {
                (run.clone(), key.clone())
            }
            _ => return Ok(()),
        };
        match &o.answer {
            Ans::Unavailable => {
                self.report.unavailable += 1;
                c.todo.push_front(o.req.clone());
            }
            Ans::Reply(Reply::Verdict(Verdict::Admitted { token })) => {
                let started = match &o.req {
                    Req::Admit { start, .. } => *start,
                    _ => false,
                };
                if started {
                    c.todo.push_back(Req::Complete {
                        run,
                        key,
                        token: *token,
                        outcome: Outcome::Ok,
                    });
                } else {
                    c.todo.push_back(Req::Start {
                        run,
                        key,
                        token: *token,
                    });
                }
            }
            Ans::Reply(Reply::Verdict(Verdict::Go)) => {
                if let Req::Start { token, .. } = &o.req {
                    c.todo.push_back(Req::Complete {
                        run,
                        key,
                        token: *token,
                        outcome: *self.rng.pick(&[
                            Outcome::Ok,
                            Outcome::Ok,
                            Outcome::Error,
                            Outcome::Unknown,
                        ]),
                    });
                }
            }
            Ans::Reply(Reply::Verdict(Verdict::Duplicate {
                status: estop_kernel::vocab::EffectStatus::Started,
                ..
            })) => {
                if let Req::Start { token, .. } = &o.req {
                    c.todo.push_back(Req::Complete {
                        run,
                        key,
                        token: *token,
                        outcome: Outcome::Ok,
                    });
                }
            }
            Ans::Reply(Reply::Verdict(Verdict::Held { .. })) if self.rng.below(3) != 0 => {
                c.todo.push_back(Req::Wait { run, key });
            }
            _ => {}
        }
        Ok(())
    }

    fn next_order(&mut self) -> u64 {
        self.order += 1;
        self.order
    }

    /// The core's `apply`: kernel, then record, then a reply tagged with its seq.
    fn serve_one(&mut self) -> Result<(), String> {
        let Some((client, req)) = self.inbox.pop_front() else {
            return Ok(());
        };
        let order = self.next_order();
        let now = self.now;
        let principal = self.clients[client].principal.clone();
        let Some(s) = self.server.as_mut() else {
            self.clients[client].outstanding = None;
            self.clients[client].todo.push_front(req);
            return Ok(());
        };
        if s.failed {
            s.out.push(Outgoing {
                client,
                req,
                answer: Ans::Unavailable,
                seq: 0,
                order,
            });
            return Ok(());
        }
        let cmd = req.command(now);
        let answer = match s.gate.apply(now, &principal, &cmd) {
            Err(_) => Ans::Error,
            Ok(applied) => {
                if applied.changed {
                    let rec = Record {
                        at: now,
                        principal,
                        command: cmd,
                    };
                    let payload = payload_of(&rec);
                    let seq = s.w.next_seq;
                    s.w.next_seq += 1;
                    format::append_record(&mut s.w.buf, seq, &payload, crc32c::crc32c(&payload));
                    s.w.buf_last = seq;
                    self.report.records += 1;
                }
                Ans::Reply(applied.reply)
            }
        };
        let seq = s.w.next_seq - 1;
        s.out.push(Outgoing {
            client,
            req,
            answer,
            seq,
            order,
        });
        Ok(())
    }

    /// The server's timer: a `Tick` for every run whose deadline or approval expiry passed.
    fn timers(&mut self) {
        let Some(s) = self.server.as_mut() else {
            return;
        };
        if s.failed {
            return;
        }
        let due: Vec<RunId> = s
            .gate
            .runs()
            .filter(|(id, _)| s.gate.next_timer(id).is_some_and(|t| t <= self.now))
            .map(|(id, _)| id.clone())
            .collect();
        for run in due {
            let cmd = Command::Tick { run };
            let principal = Who::Alice.principal();
            if let Ok(a) = s.gate.apply(self.now, &principal, &cmd)
                && a.changed
            {
                let payload = payload_of(&Record {
                    at: self.now,
                    principal,
                    command: cmd,
                });
                let seq = s.w.next_seq;
                s.w.next_seq += 1;
                format::append_record(&mut s.w.buf, seq, &payload, crc32c::crc32c(&payload));
                s.w.buf_last = seq;
                self.report.records += 1;
            }
        }
    }

    /// Fail closed: every reply not yet durable becomes `unavailable`; the state is rebuilt from
    /// the durable prefix (reopen with `discard_after`).
    fn fail(&mut self) -> Result<(), String> {
        self.report.io_errors += 1;
        let Some(mut s) = self.server.take() else {
            return Ok(());
        };
        self.discard_after = Some(s.w.durable);
        let mut out = std::mem::take(&mut s.out);
        out.sort_by_key(|o| o.order);
        for o in out {
            let durable = o.seq <= s.w.durable;
            let answer = if durable { o.answer } else { Ans::Unavailable };
            self.deliver(Outgoing { answer, ..o })?;
        }
        Ok(())
    }

    /// One group-commit step of the writer: a write of the whole buffer, or the fdatasync after
    /// it (a crash may fall between them), or a segment roll.
    fn commit_step(&mut self) -> Result<(), String> {
        let seg_max = self.faults.segment_bytes_max;
        let storage = Arc::clone(&self.storage);
        let Some(s) = self.server.as_mut() else {
            return Ok(());
        };
        let w = &mut s.w;
        if w.written > w.durable {
            match w.file.sync_data() {
                Ok(()) => w.durable = w.written,
                Err(_) => return self.fail(),
            }
            // Release every reply whose seq is durable, in order.
            let durable = w.durable;
            let (ready, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut s.out)
                .into_iter()
                .partition(|o| o.seq <= durable);
            s.out = keep;
            let mut ready = ready;
            ready.sort_by_key(|o| o.order);
            for o in ready {
                self.deliver(o)?;
            }
            return Ok(());
        }
        if w.buf.is_empty() {
            // Nothing to write: replies that depend on nothing new go out at once.
            let durable = w.durable;
            let (ready, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut s.out)
                .into_iter()
                .partition(|o| o.seq <= durable);
            s.out = keep;
            for o in ready {
                self.deliver(o)?;
            }
            return Ok(());
        }
        if let Some((name, file, bytes)) = w.rolling.take() {
            // Roll, second half: rename the synced tmp into place and sync the directory.
            let tmp = format!("{name}{}", format::TMP_SUFFIX);
            if storage.rename(&tmp, &name).is_err() || storage.sync_dir().is_err() {
                return self.fail();
            }
            w.file = file;
            w.segment_bytes = bytes;
            return Ok(());
        }
        if w.segment_bytes > format::SEGMENT_HEADER_BYTES as u64
            && w.segment_bytes + w.buf.len() as u64 > seg_max
        {
            // Roll, first half: a new segment starting at the batch's first seq, header synced.
            let first = w.written + 1;
            let name = format::segment_name(first);
            let tmp = format!("{name}{}", format::TMP_SUFFIX);
            let made = storage.create(&tmp).and_then(|mut f| {
                f.write_all(&format::encode_segment_header(first))?;
                f.sync_data()?;
                Ok(f)
            });
            match made {
                Ok(f) => w.rolling = Some((name, f, format::SEGMENT_HEADER_BYTES as u64)),
                Err(_) => return self.fail(),
            }
            return Ok(());
        }
        let batch = std::mem::take(&mut w.buf);
        match w.file.write_all(&batch) {
            Ok(()) => {
                w.segment_bytes += batch.len() as u64;
                w.written = w.buf_last;
                if self.mutant_ack_before_sync {
                    let written = w.written;
                    let (ready, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut s.out)
                        .into_iter()
                        .partition(|o| o.seq <= written);
                    s.out = keep;
                    for o in ready {
                        self.deliver(o)?;
                    }
                }
                Ok(())
            }
            Err(_) => {
                // A failed write may have left any prefix of the batch behind: a crash right
                // now leaves a torn write on disk.
                if self.rng.below(2) == 0 {
                    self.report.crash_mid_write += 1;
                    self.fail()?;
                    return self.crash(true);
                }
                self.fail()
            }
        }
    }

    /// Writes a snapshot of the durable state (quiescent: nothing buffered or unsynced).
    fn snapshot(&mut self) -> Result<(), String> {
        let Some(s) = self.server.as_ref() else {
            return Ok(());
        };
        if !s.w.buf.is_empty()
            || s.w.written > s.w.durable
            || s.w.durable == 0
            || s.w.rolling.is_some()
        {
            return Ok(());
        }
        let mut payload = Vec::new();
        encode_snapshot(&s.gate, &mut payload);
        let seq = s.w.durable;
        let name = format::snapshot_name(seq);
        let tmp = format!("{name}{}", format::TMP_SUFFIX);
        let st = &self.storage;
        let r = st.create(&tmp).and_then(|mut f| {
            f.write_all(&format::encode_snapshot_header(seq, &payload))?;
            f.write_all(&payload)?;
            f.sync_data()?;
            st.rename(&tmp, &name)?;
            st.sync_dir()
        });
        match r {
            Ok(()) => {
                self.report.snapshots += 1;
                Ok(())
            }
            // A failed snapshot leaves the ledger as it was; the next open removes the tmp.
            Err(_) => Ok(()),
        }
    }

    /// kill -9 (`power_loss = false`: the page cache survives) or power loss (unsynced bytes
    /// are lost or torn). In-flight requests and unsent replies die with the process.
    fn crash(&mut self, power_loss: bool) -> Result<(), String> {
        if let Some(s) = &self.server {
            if s.w.rolling.is_some() {
                self.report.crash_mid_roll += 1;
            } else if s.w.written > s.w.durable {
                self.report.crash_written_unsynced += 1;
            } else if !s.w.buf.is_empty() {
                self.report.crash_buffered += 1;
            }
        }
        if power_loss {
            self.report.power_losses += 1;
            self.disk.crash();
        } else {
            self.report.kills += 1;
        }
        self.server = None;
        self.inbox.clear();
        for c in &mut self.clients {
            // The connection dropped: whatever was in flight is retried as is.
            if let Some(r) = c.outstanding.take() {
                c.todo.push_front(r);
            }
        }
        // A restarted daemon knows nothing of the failed generation: a plain open.
        self.discard_after = None;
        Ok(())
    }

    /// One step of the world.
    pub fn step(&mut self) -> Result<(), String> {
        self.report.steps += 1;
        let f = self.faults.clone();
        if self.disk_full_until.is_some_and(|t| self.now >= t) {
            self.disk.set_space_left(None);
            self.disk_full_until = None;
        }
        if self.rng.chance(f.kill) {
            return self.crash(false);
        }
        if self.rng.chance(f.power_loss) {
            return self.crash(true);
        }
        if self.rng.chance(f.write_error) {
            self.disk.fail_next_write();
        }
        if self.rng.chance(f.sync_error) {
            self.disk.fail_next_sync();
        }
        if self.disk_full_until.is_none() && self.rng.chance(f.disk_full) {
            self.report.disk_full += 1;
            self.disk.set_space_left(Some(self.rng.below(300)));
            self.disk_full_until = Some(self.now + 50 + self.rng.below(500));
        }
        if self.server.is_none() {
            // The daemon restarts (or the core retries its reopen).
            if !self.boot()? {
                self.now += 10;
                return Ok(());
            }
        }
        match self.rng.below(100) {
            0..=39 => {
                let i = self.rng.index(self.clients.len());
                if self.clients[i].outstanding.is_none()
                    && let Some(req) = self.client_request(i)
                {
                    self.report.requests += 1;
                    if let Req::Admit {
                        run,
                        key,
                        tool,
                        arg,
                        ..
                    } = &req
                    {
                        self.audit
                            .calls
                            .insert((run.clone(), key.clone()), digest(*tool, *arg).0);
                    }
                    self.clients[i].outstanding = Some(req.clone());
                    self.inbox.push_back((i, req));
                }
            }
            40..=64 => {
                for _ in 0..=self.rng.below(4) {
                    self.serve_one()?;
                }
            }
            65..=89 => self.commit_step()?,
            90..=97 => {
                self.now += self.rng.below(25);
                self.timers();
            }
            _ => {
                if self.rng.chance(f.snapshot * 50.0) {
                    self.snapshot()?;
                }
            }
        }
        Ok(())
    }

    /// After the faults: heal the disk and check the gate still makes progress (liveness).
    pub fn heal_and_check_liveness(&mut self) -> Result<(), String> {
        self.disk.set_space_left(None);
        self.disk_full_until = None;
        let mut steps = 0;
        while self.server.as_ref().is_none_or(|s| s.failed) {
            if self.server.as_ref().is_some_and(|s| s.failed) {
                self.server = None;
            }
            if !self.boot()? {
                steps += 1;
                if steps > 10 {
                    return Err("the ledger does not reopen after the disk healed".into());
                }
            }
        }
        let before = self.report.acked;
        for _ in 0..2000 {
            if self.server.is_none() {
                // A fault injected before healing may still fire once; the core reopens.
                self.boot()?;
                continue;
            }
            let i = self.rng.index(self.clients.len());
            if self.clients[i].outstanding.is_none()
                && let Some(req) = self.client_request(i)
            {
                self.clients[i].outstanding = Some(req.clone());
                self.inbox.push_back((i, req));
            }
            self.serve_one()?;
            self.commit_step()?;
        }
        if self.report.acked == before {
            let outstanding = self
                .clients
                .iter()
                .filter(|c| c.outstanding.is_some())
                .count();
            let s = self.server.as_ref();
            return Err(format!(
                "no request was acknowledged after healing (clients {}, outstanding {outstanding}, inbox {}, server up {}, out {:?})",
                self.clients.len(),
                self.inbox.len(),
                s.is_some(),
                s.map(|s| (
                    s.out.len(),
                    s.w.buf.len(),
                    s.w.written,
                    s.w.durable,
                    s.w.rolling.is_some()
                ))
            ));
        }
        // A final crash and recovery must keep everything acknowledged.
        self.crash(true)?;
        if !self.boot()? {
            return Err("final recovery failed".into());
        }
        let v = estop_ledger::verify(&*self.storage);
        if !v.is_ok() {
            return Err(format!("ledger verify fails at the end: {v:?}"));
        }
        Ok(())
    }
}

/// Runs one seed for `steps` steps, then heals and checks liveness.
pub fn run_seed(seed: u64, steps: u64) -> Result<SimReport, String> {
    run_world(World::new(seed), seed, steps)
}

/// Runs a prepared world (e.g. with a planted bug).
pub fn run_world(mut w: World, seed: u64, steps: u64) -> Result<SimReport, String> {
    for _ in 0..steps {
        w.step().map_err(|e| {
            format!(
                "seed {seed} (replay: ESTOP_SIM_SEED={seed}) at step {}: {e}",
                w.report.steps
            )
        })?;
    }
    w.heal_and_check_liveness()
        .map_err(|e| format!("seed {seed} (replay: ESTOP_SIM_SEED={seed}) after healing: {e}"))?;
    Ok(w.report)
}
