//! The shipped simulation's auditor: what clients were told, checked two ways.
//!
//! * **Over the whole history, as each answer arrives**: no identity admitted twice (two
//!   tokens) or started twice; nothing admitted or started in a run, or a child of a run, whose
//!   cancel was acknowledged, while its fence lasts (its stop plus the tombstone retention); no
//!   call admitted again in the run life that rejected it; no `wait` answered `held` before its
//!   timeout.
//! * **Against the state after every recovery**: every admission, start, completion, hold,
//!   approval, rejection and cancel that was acknowledged is still there — unless retention
//!   forgot its run, which it may only do once the run stopped `retention_ms` ago (its
//!   tombstone then stays until `tombstone_retention_ms` after the stop).
//!
//! A run id can live several lives (forgotten, then created again once its tombstone is
//! gone): facts are kept per life, `(run, created_at)`.

use estop_kernel::state::Status;
use estop_kernel::vocab::RefusalReason;
use estop_kernel::{Digest, EffectKey, Gate, RunId};
use std::collections::{BTreeMap, BTreeSet};

/// One life of a run id: the id and when that life began (gate ms).
pub type Life = (&'static str, u64);

/// What was acknowledged about one run life.
#[derive(Debug, Default)]
struct Facts {
    tokens: BTreeMap<String, String>,
    started: BTreeSet<String>,
    completed: BTreeSet<String>,
    held: BTreeSet<String>,
    approved: BTreeSet<String>,
    rejected_keys: BTreeSet<String>,
    rejected: BTreeSet<Digest>,
    cancelled: bool,
}

/// An answer a client read, as the auditor needs it.
#[derive(Debug, Clone)]
pub enum Told {
    /// `admitted` (a token) to an admit, wait or start.
    Admitted {
        digest: Digest,
        token: String,
    },
    /// `go` to a start.
    Go,
    /// Held for an operator's approval.
    HeldForApproval,
    /// A completion was recorded.
    Completed,
    /// The operator's approval completed the quorum.
    Approved,
    Rejected {
        digest: Digest,
    },
    /// The run's cancel (or kill) was acknowledged.
    Cancelled,
}

#[derive(Debug)]
pub struct Auditor {
    pub retention_ms: u64,
    pub tombstone_retention_ms: u64,
    /// How late retention may run (its period).
    pub compaction_period_ms: u64,
    lives: BTreeMap<Life, Facts>,
    /// Acknowledged cancels, by run id: the run's stop time (gate ms) and the cancel's
    /// request id (requests are applied in id order).
    fences: BTreeMap<&'static str, (u64, u64)>,
    /// The last stop time seen of each life (the live state, every step).
    stops: BTreeMap<Life, u64>,
    parents: BTreeMap<&'static str, &'static str>,
}

fn rid(run: &str) -> RunId {
    RunId::new(run).expect("valid run id")
}

/// The life of `run` the gate holds now.
pub fn life_of(gate: &Gate, run: &'static str) -> Option<Life> {
    gate.run(&rid(run)).map(|r| (run, r.created_at))
}

impl Auditor {
    pub fn new(
        retention_ms: u64,
        tombstone_retention_ms: u64,
        compaction_period_ms: u64,
        parents: BTreeMap<&'static str, &'static str>,
    ) -> Auditor {
        Auditor {
            retention_ms,
            tombstone_retention_ms,
            compaction_period_ms,
            lives: BTreeMap::new(),
            fences: BTreeMap::new(),
            stops: BTreeMap::new(),
            parents,
        }
    }

    /// Run lives with acknowledged facts.
    pub fn lives(&self) -> usize {
        self.lives.len()
    }

    /// Notes when each run of the live state stopped (what retention counts from).
    pub fn observe(&mut self, gate: &Gate) {
        for (id, run) in gate.runs() {
            if let Some(stop) = &run.stop
                && let Some(name) = crate::shipped::run_name(id.as_str())
            {
                self.stops.insert((name, run.created_at), stop.at);
            }
        }
    }

    /// An answer a client read about `run`/`key` to request `id`, sent at gate time `at`, in
    /// the life the gate holds now. Checks it against the history first.
    #[allow(clippy::too_many_arguments)]
    pub fn told(
        &mut self,
        gate: &Gate,
        id: u64,
        at: u64,
        run: &'static str,
        key: &str,
        told: Told,
    ) -> Result<(), String> {
        let Some(life) = life_of(gate, run) else {
            // Forgotten already, in the step that answered: nothing to attribute it to.
            return Ok(());
        };
        if matches!(told, Told::Admitted { .. } | Told::Go) {
            self.check_fences(id, at, run, key)?;
        }
        let facts = self.lives.entry(life).or_default();
        match told {
            Told::Admitted { digest, token } => {
                if let Some(old) = facts.tokens.get(key)
                    && *old != token
                {
                    return Err(format!("{run}/{key} admitted twice ({old}, then {token})"));
                }
                if facts.rejected.contains(&digest) && !facts.tokens.contains_key(key) {
                    return Err(format!(
                        "{run}/{key} admitted a call rejected earlier in the same run"
                    ));
                }
                facts.tokens.insert(key.to_owned(), token);
            }
            Told::Go => {
                if !facts.started.insert(key.to_owned()) {
                    return Err(format!("{run}/{key} got go twice"));
                }
            }
            Told::HeldForApproval => {
                facts.held.insert(key.to_owned());
            }
            Told::Completed => {
                facts.completed.insert(key.to_owned());
            }
            Told::Approved => {
                facts.approved.insert(key.to_owned());
            }
            Told::Rejected { digest } => {
                facts.rejected.insert(digest);
                facts.rejected_keys.insert(key.to_owned());
            }
            Told::Cancelled => {
                facts.cancelled = true;
                let stop = gate
                    .run(&rid(run))
                    .and_then(|r| r.stop.as_ref())
                    .map(|s| s.at);
                if let Some(stop) = stop {
                    self.fences.insert(run, (stop, id));
                }
            }
        }
        Ok(())
    }

    /// Nothing is admitted or started in a run, or a child of a run, whose cancel was
    /// acknowledged, until its tombstone may be gone.
    fn check_fences(&self, id: u64, at: u64, run: &'static str, key: &str) -> Result<(), String> {
        let lineage = [Some(run), self.parents.get(run).copied()];
        for r in lineage.into_iter().flatten() {
            if let Some((stop, cancel)) = self.fences.get(r)
                && id > *cancel
                && at < stop + self.tombstone_retention_ms
            {
                return Err(format!(
                    "{run}/{key} admitted or started at {at}, after the acknowledged cancel of {r} (stopped at {stop}, fenced until {})",
                    stop + self.tombstone_retention_ms
                ));
            }
        }
        Ok(())
    }

    /// Every acknowledged fact holds in `gate` (the state recovery rebuilt), at gate time
    /// `now`, or its run was forgotten no earlier than retention allows. Lives that were
    /// rightly forgotten are dropped.
    pub fn check_recovered(&mut self, gate: &Gate, now: u64) -> Result<(), String> {
        self.observe(gate);
        let mut gone = Vec::new();
        for (life, facts) in &self.lives {
            match life_of(gate, life.0) {
                Some(l) if l == *life => check_facts(gate, life.0, facts)?,
                _ => {
                    self.check_forgotten(gate, *life, now)?;
                    gone.push(*life);
                }
            }
        }
        for life in gone {
            self.lives.remove(&life);
        }
        Ok(())
    }

    /// A run life the state no longer holds was forgotten by retention: no sooner than
    /// `retention_ms` after its stop, and its tombstone no sooner than
    /// `tombstone_retention_ms` after it.
    fn check_forgotten(&self, gate: &Gate, life: Life, now: u64) -> Result<(), String> {
        let (run, created) = life;
        let tomb = gate
            .tombstone(&rid(run))
            .filter(|t| t.created_at == created);
        if let Some(t) = tomb {
            if t.stopped_at + self.retention_ms > now {
                return Err(format!(
                    "run {run} (stopped at {}) forgotten at {now}, before its retention of {} ms",
                    t.stopped_at, self.retention_ms
                ));
            }
            return Ok(());
        }
        match self.stops.get(&life) {
            Some(stop) if stop + self.tombstone_retention_ms <= now => Ok(()),
            Some(stop) => Err(format!(
                "run {run} (stopped at {stop}) forgotten with no tombstone at {now}, before its tombstone retention of {} ms",
                self.tombstone_retention_ms
            )),
            None => Err(format!(
                "run {run} (created at {created}) is gone, but it was never seen stopped"
            )),
        }
    }

    /// Retention keeps up: at `now`, no run stopped more than a retention (and a compaction
    /// period) ago is kept whole, and no tombstone older than its retention is kept.
    pub fn check_retention_ran(&self, gate: &Gate, now: u64) -> Result<(), String> {
        let late = self.compaction_period_ms;
        for (id, run) in gate.runs() {
            if let Some(stop) = &run.stop
                && run.state.is_terminal()
                && stop.at + self.retention_ms + late <= now
            {
                return Err(format!(
                    "run {id} stopped at {}, still kept whole at {now} (retention {} ms)",
                    stop.at, self.retention_ms
                ));
            }
        }
        for (id, t) in gate.tombstones() {
            if t.stopped_at + self.tombstone_retention_ms + late <= now {
                return Err(format!(
                    "tombstone of {id} (stopped at {}) still kept at {now}",
                    t.stopped_at
                ));
            }
        }
        Ok(())
    }
}

fn check_facts(gate: &Gate, run: &str, f: &Facts) -> Result<(), String> {
    let r = gate.run(&rid(run)).expect("the life is held");
    let effect = |key: &str| r.effects.get(&EffectKey::new(key).expect("valid key"));
    let lost = |what: &str, key: &str| Err(format!("acknowledged {what} of {run}/{key} lost"));
    // The tokens told were sealed by the core (with the simulation's test key).
    let seal = estop_protocol::effect_token::TokenSeal::for_tests();
    let sealed = |key: &str, t| seal.seal(&rid(run), &EffectKey::new(key).expect("valid key"), t);
    for (key, token) in &f.tokens {
        match effect(key) {
            Some(e) if e.token.map(|t| sealed(key, t)).as_ref() == Some(token) => {}
            _ => return lost("admission", key),
        }
    }
    for key in &f.started {
        let st = effect(key).map(|e| e.status);
        // Started, then ended, settled or taken up by the reverse saga: never back before it.
        if matches!(
            st,
            None | Some(Status::Held(_) | Status::Approved | Status::Admitted | Status::Refused(_))
        ) {
            return lost("start", key);
        }
    }
    for key in &f.completed {
        if effect(key).and_then(|e| e.outcome_kind()).is_none() {
            return lost("completion", key);
        }
    }
    for key in f.held.iter().chain(&f.approved) {
        if effect(key).is_none() {
            return lost("hold", key);
        }
    }
    for key in &f.approved {
        if matches!(effect(key).map(|e| e.status), Some(Status::Held(_))) {
            return lost("approval", key);
        }
    }
    for key in &f.rejected_keys {
        if effect(key).map(|e| e.status) != Some(Status::Refused(RefusalReason::Rejected)) {
            return lost("rejection", key);
        }
    }
    if f.rejected.iter().any(|d| !r.rejected.contains(d)) {
        return Err(format!("an acknowledged rejected call of {run} lost"));
    }
    if f.cancelled && r.stop.is_none() {
        return Err(format!(
            "acknowledged cancel of {run} lost: the run is not stopped"
        ));
    }
    Ok(())
}
