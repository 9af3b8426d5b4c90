//! Differential conformance: the kernel and the reference model driven by the same seeded random
//! operation streams, comparing every answer (verdict, reply, error code, and whether a change was
//! recorded) and the whole observable state after every step. A divergence is shrunk to the
//! shortest trace that still diverges and printed with its seed.

use crate::model::Model;
use crate::rng::Rng;
use crate::world::{
    self, Answer, Op, SagaOp, Tok, Tool, View, Who, answer_of, command, target, view_of,
};
use estop_kernel::record_codec::{decode_record, decode_snapshot, encode_record, encode_snapshot};
use estop_kernel::reply::Verdict;
use estop_kernel::vocab::Outcome;
use estop_kernel::{Gate, Limits, Record, Reply, Token};
use std::collections::BTreeMap;
use std::fmt::Write;

/// Draws one random op of the small world. Two times in three it aims at an effect that exists
/// (so traces go deep: approvals, starts, completions), otherwise anywhere; one op in six is a
/// step of the reverse saga (`saga_op`).
pub fn random_op(rng: &mut Rng, model: &Model) -> Op {
    let known: Vec<(u8, u8)> = model
        .runs
        .iter()
        .flat_map(|(r, run)| run.effects.keys().map(move |k| (*r, *k)))
        .collect();
    let (run, key) = if !known.is_empty() && rng.below(3) != 0 {
        *rng.pick(&known)
    } else {
        (*rng.pick(&[0u8, 0, 0, 1, 1, 1, 2, 2]), rng.below(4) as u8)
    };
    let agentish = |rng: &mut Rng| {
        *rng.pick(&[
            Who::Agent,
            Who::Agent,
            Who::Agent,
            Who::Agent,
            Who::Agent,
            Who::Agent,
            Who::Agent,
            Who::Agent2,
            Who::Alice,
            Who::Olive,
        ])
    };
    let operator = |rng: &mut Rng| {
        *rng.pick(&[
            Who::Alice,
            Who::Alice,
            Who::Bob,
            Who::Bob,
            Who::Carol,
            Who::Carol,
            Who::Agent,
            Who::Olive,
        ])
    };
    let tok = |rng: &mut Rng| {
        if rng.below(12) == 0 {
            Tok::Bogus
        } else {
            Tok::Issued
        }
    };
    let existing = model
        .runs
        .get(&run)
        .and_then(|r| r.effects.get(&key))
        .map(|e| (e.tool, e.arg));
    // An open saga draws more of its own steps, so sagas run to their end (the attempt bound
    // needs five failed attempts and their backoffs).
    let saga_open = model.runs.values().any(|r| r.head().is_some());
    if saga_open && rng.below(3) == 0 {
        return saga_op(rng, model, run, key);
    }
    match rng.below(120) {
        0..=31 => {
            // A repeat of a known call (retry, replay) most of the time; a new call otherwise.
            let (tool, arg) = match existing {
                Some(call) if rng.below(4) != 0 => call,
                _ => (
                    *rng.pick(&[
                        Tool::Pay,
                        Tool::Pay,
                        Tool::Search,
                        Tool::Refund,
                        Tool::Refund,
                        Tool::Wire,
                        Tool::Payout,
                        Tool::Wipe,
                        Tool::Charge,
                        Tool::Charge,
                        Tool::Book,
                        Tool::Book,
                    ]),
                    u8::from(rng.below(5) == 0),
                ),
            };
            Op::Admit {
                who: agentish(rng),
                run,
                key,
                tool,
                arg,
                start: rng.below(2) == 0,
                limits: *rng.pick(&[0u8, 0, 0, 0, 1, 2, 3, 3, 4, 4]),
                reserve: *rng.pick(&[0u8, 0, 1, 2, 3, 4, 1, 2]),
            }
        }
        32..=39 => Op::Wait {
            who: agentish(rng),
            run,
            key,
        },
        40..=51 => Op::Start {
            who: agentish(rng),
            run,
            key,
            tok: tok(rng),
        },
        52..=59 => Op::Complete {
            who: agentish(rng),
            run,
            key,
            tok: tok(rng),
            outcome: *rng.pick(&[Outcome::Ok, Outcome::Ok, Outcome::Error, Outcome::Unknown]),
            cost: *rng.pick(&[0u8, 0, 1, 2, 3, 5]),
        },
        60..=74 => Op::Decide {
            who: operator(rng),
            run,
            key,
            approve: rng.below(5) != 0,
        },
        75..=76 => Op::Cancel {
            who: *rng.pick(&[Who::Agent, Who::Alice, Who::Agent2]),
            run,
            kill: rng.below(4) == 0,
        },
        77..=80 => Op::Pause {
            who: operator(rng),
            run,
        },
        81..=84 => Op::Resume {
            who: operator(rng),
            run,
        },
        85 => Op::Close {
            who: agentish(rng),
            run,
            failed: rng.below(3) == 0,
        },
        86..=88 => Op::Tick { run },
        89 => Op::Compact {
            retention: *rng.pick(&[0u16, 0, 20, 60]),
            grave_retention: *rng.pick(&[0u16, 40, 100, 300, 300]),
        },
        90..=99 => Op::Advance {
            ms: *rng.pick(&[1u16, 5, 10, 20, 30, 45, 60]),
        },
        _ => saga_op(rng, model, run, key),
    }
}

/// The step an effect's state calls for (what an executor or an operator would do next).
fn fitting(rng: &mut Rng, e: &crate::model::Eff) -> Option<SagaOp> {
    use crate::model::{Phase, St};
    let u = &e.undo;
    let outcome = *rng.pick(&[Outcome::Ok, Outcome::Ok, Outcome::Error, Outcome::Unknown]);
    Some(match e.st {
        St::Started if rng.below(2) == 0 => SagaOp::Unreported { after_ms: 0 },
        St::Started => SagaOp::Settle { outcome },
        St::Done(Outcome::Unknown) if e.tool.has_lookup() && rng.below(4) != 0 => {
            if u.looking {
                SagaOp::LookupEnd {
                    attempt: u.lookups as u8,
                    outcome,
                }
            } else if u.lookups < u.lookups_granted {
                SagaOp::LookupBegin {
                    attempt: (u.lookups + 1) as u8,
                }
            } else {
                SagaOp::Retry
            }
        }
        St::Done(Outcome::Unknown) => SagaOp::Settle {
            outcome: *rng.pick(&[Outcome::Ok, Outcome::Error]),
        },
        St::Done(Outcome::Ok) | St::Undo(Phase::Failed) if rng.below(12) == 0 => SagaOp::Blocked {
            attempt: (u.attempts + 1) as u8,
        },
        // The policy's `approve` rule on the compensating tool: the shell holds the due attempt
        // unless an approval met stands (mostly; an executor may race it). Now and then a hold
        // on a met approval, which both must refuse (it stands for every attempt).
        St::Done(Outcome::Ok) | St::Undo(Phase::Failed)
            if e.tool.undo_rule().is_some()
                && if u.approval.as_ref().is_some_and(|a| a.met()) {
                    rng.below(16) == 0
                } else {
                    rng.below(6) != 0
                } =>
        {
            SagaOp::Held {
                attempt: (u.attempts + 1) as u8,
                of: e.tool,
            }
        }
        St::Done(Outcome::Ok) | St::Undo(Phase::Failed) => SagaOp::Begin {
            attempt: (u.attempts + 1) as u8,
        },
        St::Undo(Phase::Compensating) => SagaOp::End {
            attempt: u.attempts as u8,
            outcome: *rng.pick(&[
                Outcome::Ok,
                Outcome::Error,
                Outcome::Error,
                Outcome::Error,
                Outcome::Unknown,
            ]),
        },
        St::Undo(Phase::NeedsHuman) if rng.below(3) == 0 => SagaOp::Skip,
        St::Undo(Phase::NeedsHuman) => SagaOp::Retry,
        _ => return None,
    })
}

/// Draws a step of the reverse saga: three times in four at the head of a stopped run's saga
/// when there is one, with the attempt the model expects most of the time and a repeated,
/// stale or future one otherwise; or time enough for a backoff to pass; or a cancel to start
/// a saga when none is open.
fn saga_op(rng: &mut Rng, model: &Model, run: u8, key: u8) -> Op {
    let heads: Vec<(u8, u8)> = model
        .runs
        .iter()
        .filter_map(|(id, r)| r.head().map(|k| (*id, k)))
        .collect();
    if heads.is_empty() && rng.below(3) == 0 {
        return Op::Cancel {
            who: *rng.pick(&[Who::Alice, Who::Agent]),
            run,
            kill: rng.below(5) == 0,
        };
    }
    let (run, key) = if !heads.is_empty() && rng.below(4) != 0 {
        *rng.pick(&heads)
    } else {
        (run, key)
    };
    let effect = model.runs.get(&run).and_then(|r| r.effects.get(&key));
    let undo = effect.map(|e| e.undo.clone()).unwrap_or_default();
    if let Some(a) = effect.and_then(|e| e.held_undo())
        && rng.below(4) != 0
    {
        // A compensating call held for approval: operators vote (some twice, some not
        // operators), one rejects, a retry tries to stand in, time passes its expiry, and the
        // shell finds it expired (on time or early, with its id or another).
        let id = a.id;
        return match rng.below(16) {
            0..=8 => Op::Decide {
                who: *rng.pick(&[Who::Alice, Who::Bob, Who::Carol, Who::Carol, Who::Agent]),
                run,
                key,
                approve: true,
            },
            9 => Op::Decide {
                who: *rng.pick(&[Who::Alice, Who::Bob, Who::Carol]),
                run,
                key,
                approve: false,
            },
            10 | 11 => Op::Saga {
                who: *rng.pick(&[Who::Alice, Who::Bob]),
                run,
                key,
                step: SagaOp::Retry,
            },
            // `uncharge`'s approval is open 3 s (`unbook`'s never expires in a trace).
            12 => Op::Advance { ms: 3_000 },
            _ => Op::Saga {
                who: Who::Alice,
                run,
                key,
                step: SagaOp::Expired {
                    approval: if rng.below(4) == 0 {
                        rng.below(4) as u8
                    } else {
                        id as u8
                    },
                },
            },
        };
    }
    if effect.is_some_and(|e| e.st == crate::model::St::Undo(crate::model::Phase::Failed))
        && rng.below(3) == 0
    {
        // Past any backoff (at most 16 s before the attempt bound).
        return Op::Advance { ms: 16_000 };
    }
    if rng.below(2) == 0
        && let Some(e) = effect
        && let Some(step) = fitting(rng, e)
    {
        // The step the effect's state calls for (so sagas run to their end), by its executor
        // or an operator.
        let who = if step.by_operator() {
            Who::Alice
        } else {
            Who::Agent
        };
        return Op::Saga {
            who,
            run,
            key,
            step,
        };
    }
    // The next number, the current one (a repeat), or any small one.
    let number = |rng: &mut Rng, current: u32| -> u8 {
        let n = match rng.below(8) {
            0 => rng.below(7) as u32,
            1 | 2 => current,
            _ => current + 1,
        };
        n.min(u32::from(u8::MAX)) as u8
    };
    let executor = *rng.pick(&[
        Who::Agent,
        Who::Agent,
        Who::Agent,
        Who::Alice,
        Who::Agent2,
        Who::Olive,
    ]);
    let operator = *rng.pick(&[
        Who::Alice,
        Who::Alice,
        Who::Bob,
        Who::Carol,
        Who::Agent,
        Who::Olive,
    ]);
    let outcome = *rng.pick(&[
        Outcome::Ok,
        Outcome::Ok,
        Outcome::Error,
        Outcome::Error,
        Outcome::Unknown,
    ]);
    let (who, step) = match rng.below(25) {
        0..=4 => (
            executor,
            SagaOp::Begin {
                attempt: number(rng, undo.attempts),
            },
        ),
        5..=8 => {
            let current = undo.attempts.saturating_sub(u32::from(rng.below(6) == 0));
            let attempt = if rng.below(8) == 0 {
                rng.below(7) as u8
            } else {
                current as u8
            };
            (executor, SagaOp::End { attempt, outcome })
        }
        9..=10 => (
            executor,
            SagaOp::LookupBegin {
                attempt: number(rng, undo.lookups),
            },
        ),
        11..=12 => {
            let attempt = if rng.below(6) == 0 {
                rng.below(4) as u8
            } else {
                undo.lookups as u8
            };
            (executor, SagaOp::LookupEnd { attempt, outcome })
        }
        13 => (
            executor,
            SagaOp::Blocked {
                attempt: number(rng, undo.attempts),
            },
        ),
        14 => (operator, SagaOp::Settle { outcome }),
        21 | 22 => (
            *rng.pick(&[Who::Alice, Who::Alice, Who::Alice, Who::Agent]),
            SagaOp::Held {
                attempt: number(rng, undo.attempts),
                of: effect.map_or(Tool::Charge, |e| e.tool),
            },
        ),
        23 => (
            *rng.pick(&[Who::Alice, Who::Alice, Who::Agent]),
            SagaOp::Expired {
                approval: rng.below(5) as u8,
            },
        ),
        24 => {
            return Op::Decide {
                who: operator,
                run,
                key,
                approve: rng.below(4) != 0,
            };
        }
        15 => (operator, SagaOp::Retry),
        16 => (operator, SagaOp::Skip),
        17 => (operator, SagaOp::Compensate),
        18 => (
            *rng.pick(&[Who::Alice, Who::Alice, Who::Agent]),
            SagaOp::Unreported {
                after_ms: *rng.pick(&[0u16, 30, 200]),
            },
        ),
        _ => {
            // Long enough for a failed attempt's backoff (1 s doubling) to pass.
            return Op::Advance {
                ms: *rng.pick(&[1_000u16, 2_000, 4_000, 8_000, 16_000]),
            };
        }
    };
    Op::Saga {
        who,
        run,
        key,
        step,
    }
}

/// Both sides in lockstep.
#[derive(Debug, Clone)]
pub struct Pair {
    pub now: u64,
    pub gate: Gate,
    pub model: Model,
    /// The commands the kernel recorded (replayed at the end to check determinism).
    pub log: Vec<Record>,
    /// The kernel's observable state after the last step (equal to the model's).
    pub view: View,
}

/// One step where the sides disagree.
#[derive(Debug, Clone)]
pub struct Mismatch {
    pub step: usize,
    pub what: String,
}

impl Default for Pair {
    fn default() -> Self {
        Pair::new()
    }
}

impl Pair {
    pub fn new() -> Pair {
        Pair::with_limits(Limits::default())
    }

    /// A pair whose kernel runs with other limits (tests use it to plant a divergence).
    pub fn with_limits(limits: Limits) -> Pair {
        Pair {
            now: 1000,
            gate: Gate::new(limits),
            model: Model::new(),
            log: Vec::new(),
            view: View::new(),
        }
    }

    /// Both sides under the small world's tight bounds (`world::limits`): the differential.
    pub fn tight() -> Pair {
        Pair::tight_with(world::limits())
    }

    /// The model under the tight bounds, the kernel under `limits`.
    pub fn tight_with(limits: Limits) -> Pair {
        Pair {
            model: Model::with_bounds(world::bounds()),
            ..Pair::with_limits(limits)
        }
    }

    /// The token the gate issued for the op's effect, if any.
    pub fn issued(&self, op: &Op) -> Option<Token> {
        let (run, key) = target(op)?;
        let r = self
            .gate
            .run(&estop_kernel::RunId::new(world::RUNS[run as usize]).ok()?)?;
        r.effects
            .get(&estop_kernel::EffectKey::new(world::KEYS[key as usize]).ok()?)?
            .token
    }

    /// Applies one op to both sides; `Err` describes a disagreement.
    pub fn step(&mut self, op: &Op) -> Result<Option<Answer>, String> {
        if let Op::Advance { ms } = op {
            self.now += u64::from(*ms);
            return Ok(None);
        }
        let (principal, cmd) = command(op, self.now, self.issued(op)).expect("a command");
        let before = self.gate.clone();
        let result = self.gate.apply(self.now, &principal, &cmd);
        let k = answer_of(&result);
        match &result {
            Ok(a) if a.changed => self.log.push(Record {
                at: self.now,
                principal,
                command: cmd,
            }),
            _ => {
                if before != self.gate {
                    return Err(format!(
                        "`{op}` reported no change ({}) but changed the kernel's state",
                        k.text
                    ));
                }
            }
        }
        let m = self.model.apply(self.now, op).expect("an answer");
        if k != m {
            return Err(format!(
                "`{op}` at t={}: kernel answered {:?} (changed={}), model {:?} (changed={})",
                self.now, k.text, k.changed, m.text, m.changed
            ));
        }
        let (kv, mv) = (view_of(&self.gate), self.model.view());
        if kv != mv {
            return Err(format!(
                "after `{op}` at t={} the states differ:\n{}",
                self.now,
                view_diff(&kv, &mv)
            ));
        }
        self.view = kv;
        Ok(Some(k))
    }

    /// The recorded commands alone, and a snapshot, rebuild the same state (G6 in miniature).
    pub fn check_replay(&self) -> Result<(), String> {
        let mut replayed = Gate::new(self.gate.limits().clone());
        let mut buf = Vec::new();
        for rec in &self.log {
            buf.clear();
            encode_record(rec, &mut buf);
            let back = decode_record(&buf).map_err(|e| format!("record does not decode: {e}"))?;
            if &back != rec {
                return Err(format!("record round trip changed {rec:?}"));
            }
            let changed = replayed
                .replay(back.at, &back.principal, &back.command)
                .map_err(|e| format!("recorded command fails on replay: {e}"))?;
            if !changed {
                return Err("a recorded command changed nothing on replay".into());
            }
        }
        if replayed != self.gate {
            return Err("replaying the log does not rebuild the state".into());
        }
        let mut snap = Vec::new();
        encode_snapshot(&self.gate, &mut snap);
        match decode_snapshot(&snap, self.gate.limits().clone()) {
            Ok(g) if g == self.gate => Ok(()),
            Ok(_) => Err("snapshot round trip changed the state".into()),
            Err(e) => Err(format!("snapshot does not decode: {e}")),
        }
    }
}

fn view_diff(k: &View, m: &View) -> String {
    let mut s = String::new();
    let runs: std::collections::BTreeSet<&String> = k.keys().chain(m.keys()).collect();
    for r in runs {
        match (k.get(r), m.get(r)) {
            (Some(a), Some(b)) if a == b => {}
            (a, b) => {
                let _ = writeln!(s, "  run {r}:\n    kernel {a:?}\n    model  {b:?}");
            }
        }
    }
    s
}

/// Replays a trace on fresh sides; the first disagreement, if any.
pub fn first_mismatch(ops: &[Op]) -> Option<Mismatch> {
    first_mismatch_with(ops, &world::limits())
}

/// As `first_mismatch`, with the kernel running under `limits` (the model under the tight
/// bounds).
pub fn first_mismatch_with(ops: &[Op], limits: &Limits) -> Option<Mismatch> {
    let mut pair = Pair::tight_with(limits.clone());
    for (i, op) in ops.iter().enumerate() {
        if let Err(what) = pair.step(op) {
            return Some(Mismatch { step: i, what });
        }
    }
    pair.check_replay().err().map(|what| Mismatch {
        step: ops.len(),
        what,
    })
}

/// Delta debugging: the shortest sub-trace (by removing chunks, then single ops) that still
/// diverges.
pub fn shrink(ops: &[Op]) -> Vec<Op> {
    shrink_with(ops, &world::limits())
}

/// As `shrink`, with the kernel running under `limits`.
pub fn shrink_with(ops: &[Op], limits: &Limits) -> Vec<Op> {
    let first_mismatch = |ops: &[Op]| first_mismatch_with(ops, limits);
    let mut cur: Vec<Op> = match first_mismatch(ops) {
        Some(m) => ops[..(m.step + 1).min(ops.len())].to_vec(),
        None => return ops.to_vec(),
    };
    let mut chunk = cur.len() / 2;
    while chunk >= 1 {
        let mut i = 0;
        let mut progressed = false;
        while i < cur.len() {
            let mut cand = cur.clone();
            let end = (i + chunk).min(cand.len());
            cand.drain(i..end);
            if let Some(m) = first_mismatch(&cand) {
                cand.truncate((m.step + 1).min(cand.len()));
                cur = cand;
                progressed = true;
            } else {
                i += chunk;
            }
        }
        if !progressed {
            chunk /= 2;
        }
    }
    cur
}

/// Formats a (shrunk) failing trace with both sides' answers, for the report.
pub fn explain(ops: &[Op]) -> String {
    let mut pair = Pair::tight();
    let mut s = String::new();
    for op in ops {
        let before = pair.clone();
        match pair.step(op) {
            Ok(Some(a)) => {
                let _ = writeln!(
                    s,
                    "  t={:<5} {op:<44} => {}{}",
                    before.now,
                    a.text,
                    if a.changed { "" } else { " (no change)" }
                );
            }
            Ok(None) => {
                let _ = writeln!(s, "  {op}");
            }
            Err(e) => {
                let _ = writeln!(s, "  t={:<5} {op:<44} => DIVERGES: {e}", before.now);
                break;
            }
        }
    }
    s
}

/// Totals of a differential run.
#[derive(Debug, Default, Clone)]
pub struct DiffStats {
    pub cases: u64,
    pub ops: u64,
    /// How often each kind of answer was seen (so a run proves it reached what it claims).
    pub answers: BTreeMap<String, u64>,
}

/// The failure report of a differential run.
#[derive(Debug, Clone)]
pub struct Divergence {
    pub seed: u64,
    pub shrunk: Vec<Op>,
    pub report: String,
}

/// Runs one case: a fresh pair and a random trace of up to `len_max` ops drawn from `seed`.
pub fn run_case(seed: u64, len_max: usize, stats: &mut DiffStats) -> Result<(), Divergence> {
    let mut rng = Rng::new(seed);
    let len = 1 + rng.index(len_max);
    let mut pair = Pair::tight();
    let mut ops = Vec::with_capacity(len);
    for _ in 0..len {
        let op = random_op(&mut rng, &pair.model);
        ops.push(op);
        let undo = undo_kind(&pair.model, &op);
        match pair.step(&op) {
            Ok(Some(a)) => {
                if let Some(kind) = undo {
                    // What the held compensations' steps answered (coverage of their votes).
                    let seen = if a.changed || a.text.starts_with("error") {
                        format!("{kind} {}", a.text)
                    } else {
                        format!("{kind} {} (no change)", a.text)
                    };
                    let seen: String = seen
                        .split_whitespace()
                        .take(4)
                        .collect::<Vec<_>>()
                        .join(" ");
                    *stats.answers.entry(seen).or_default() += 1;
                }
                let kind: String = a
                    .text
                    .split_whitespace()
                    .take(2)
                    .collect::<Vec<_>>()
                    .join(" ");
                *stats.answers.entry(kind).or_default() += 1;
                if a.text.starts_with("refused budget model_") {
                    // A model reservation refused: which dimension, on the run or its parent.
                    let own = a.text.split_whitespace().nth(4) == Some(op_run_name(&op));
                    let whose = if own { "own" } else { "ancestor's" };
                    let dim = a.text.split_whitespace().nth(2).unwrap_or("");
                    *stats
                        .answers
                        .entry(format!("refused budget {dim} {whose}"))
                        .or_default() += 1;
                }
                if let Op::Complete { run, cost, .. } = op
                    && cost > 0
                    && a.changed
                    && pair.view.values().any(|r| {
                        r.cause.as_deref() == Some("budget") && r.stopped_at == Some(pair.now)
                    })
                    && pair.view.contains_key(crate::world::RUNS[run as usize])
                {
                    // Settled spend reached a limit: the gate fenced a run's tree.
                    *stats.answers.entry("spend fence".into()).or_default() += 1;
                }
                if a.changed && a.text.starts_with("compensation needs_human attempt=5") {
                    // The attempt bound reached (five failed attempts, then a human).
                    *stats.answers.entry(a.text.clone()).or_default() += 1;
                }
            }
            Ok(None) => {}
            Err(_) => return Err(divergence(seed, &ops)),
        }
        stats.ops += 1;
    }
    if pair.check_replay().is_err() {
        return Err(divergence(seed, &ops));
    }
    stats.cases += 1;
    Ok(())
}

/// Whether `op` is a step on a held compensation (a vote, a retry, the shell's expiry), or the
/// shell's hold or an attempt begun on a met approval: what the run's coverage counts.
fn undo_kind(model: &Model, op: &Op) -> Option<&'static str> {
    let (run, key) = match *op {
        Op::Decide { run, key, .. } | Op::Saga { run, key, .. } => (run, key),
        _ => return None,
    };
    let e = model.runs.get(&run)?.effects.get(&key)?;
    match op {
        Op::Saga {
            step: SagaOp::Held { .. },
            ..
        } => Some("undo hold:"),
        Op::Saga {
            step: SagaOp::Begin { .. },
            ..
        } if e.undo.approval.as_ref().is_some_and(|a| a.met()) => Some("undo approved:"),
        _ if e.held_undo().is_some() => Some("undo held:"),
        _ => None,
    }
}

fn divergence(seed: u64, ops: &[Op]) -> Divergence {
    let shrunk = shrink(ops);
    let report = format!(
        "kernel and reference model diverge: seed {seed} (replay: ESTOP_DIFF_SEED={seed}); shrunk from {} to {} ops:\n{}",
        ops.len(),
        shrunk.len(),
        explain(&shrunk)
    );
    Divergence {
        seed,
        shrunk,
        report,
    }
}

/// Runs cases with seeds `first..` until `ops_target` operations were compared.
pub fn run(first_seed: u64, ops_target: u64, len_max: usize) -> Result<DiffStats, Divergence> {
    let mut stats = DiffStats::default();
    let mut seed = first_seed;
    while stats.ops < ops_target {
        run_case(seed, len_max, &mut stats)?;
        seed += 1;
    }
    Ok(stats)
}

/// Whether a verdict is an admission (for coverage summaries).
pub fn is_admission(r: &Reply) -> bool {
    matches!(r, Reply::Verdict(Verdict::Admitted { .. } | Verdict::Go))
}

/// The run an op names, as the answers write it.
fn op_run_name(op: &Op) -> &'static str {
    crate::world::run_of(op).map_or("", |r| crate::world::RUNS[r as usize])
}
