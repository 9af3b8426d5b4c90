//! The reverse saga's executors (`compensations`): connections that run compensating calls.
//!
//! The kernel says what a cancelled run's saga waits for (`Gate::saga_next`); offering it is
//! the core's job. When the head's next attempt is due, the core builds its arguments then
//! (the effect's recorded `compensate_args`, from the forward call's args and result), claims
//! the attempt with a `CompensationBegin` record under the executor's principal, and sends that
//! executor a `compensate` event once the record is durable. One attempt is offered to one
//! executor at a time; an attempt under way whose executor is gone (its connection ended or
//! stopped reading, or the gate restarted) is offered again as it was — same attempt, same
//! arguments, same derived idempotency key — so the system downstream applies it once.
//! Offering happens in `fire_timers`, after the burst of messages that made a saga due, never
//! in the middle of applying another command.

use super::*;
use estop_kernel::saga::{Next, derived_key};
use estop_kernel::vocab::Outcome;

/// One connection that said `compensations`.
pub(super) struct Executor {
    pub(super) conn: u64,
    pub(super) principal: Principal,
    /// Only this run's compensations (`None`: every run the principal may see).
    pub(super) run: Option<RunId>,
    pub(super) out: Outbox,
    pub(super) backlog: Arc<AtomicUsize>,
}

/// The attempt a run's saga head was offered, and to which connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Offered {
    key: EffectKey,
    attempt: u32,
    conn: u64,
}

impl Core {
    /// `compensations`: the connection becomes an executor; every saga it may run is looked at.
    pub(super) fn add_executor(&mut self, ex: Executor, to: ReplyTo) {
        if self.executors.iter().any(|x| x.conn == ex.conn) {
            self.send(to, Answer::Ack(wire::Ack::default()));
            return;
        }
        // Executors count against the subscriptions' bounds: each holds a queue of events.
        if let Err(m) = self.subscription_shares.take(&ex.principal) {
            self.send(to, Answer::Error(ErrorCode::LimitExceeded, m));
            return;
        }
        match &ex.run {
            Some(run) => {
                self.saga_due.insert(run.clone());
            }
            None => self.saga_due.extend(finalizing(&self.gate)),
        }
        self.executors.push(ex);
        self.send(to, Answer::Ack(wire::Ack::default()));
    }

    /// The connection is no longer an executor (it ended or stopped reading): what it was
    /// offered and did not report is offered again.
    pub(super) fn executor_gone(&mut self, conn: u64) {
        let shares = &mut self.subscription_shares;
        self.executors.retain(|x| {
            let keep = x.conn != conn;
            if !keep {
                shares.give_back(&x.principal);
            }
            keep
        });
        let orphaned: Vec<RunId> = self
            .offered
            .iter()
            .filter(|(_, o)| o.conn == conn)
            .map(|(run, _)| run.clone())
            .collect();
        for run in orphaned {
            self.offered.remove(&run);
            self.saga_due.insert(run);
        }
    }

    /// After a restart or a recovery nothing is offered to anyone: every open saga is looked
    /// at again (an attempt under way is offered again as it was).
    pub(super) fn restart_sagas(&mut self) {
        self.offered.clear();
        self.saga_timers.clear();
        self.saga_due = finalizing(&self.gate).collect();
    }

    /// A change to these runs may have made their sagas due.
    pub(super) fn saga_touched(&mut self, events: &[estop_kernel::Event]) {
        for e in events {
            let finalizing = self
                .gate
                .run(&e.run)
                .is_some_and(|r| r.state == RunState::Finalizing);
            if finalizing && !self.saga_due.contains(&e.run) {
                self.saga_due.insert(e.run.clone());
            }
        }
    }

    /// When the next failed attempt's backoff ends, and whether a saga is due now.
    pub(super) fn saga_timeout(&self, gate_now: u64) -> Option<u64> {
        if !self.writing {
            return None;
        }
        if !self.saga_due.is_empty() {
            return Some(0);
        }
        self.saga_timers
            .first()
            .map(|(at, _)| at.saturating_sub(gate_now))
    }

    /// Offers every saga that is due (`fire_timers`).
    pub(super) fn offer_due(&mut self) {
        if !self.writing {
            return;
        }
        while let Some((at, run)) = self.saga_timers.first().cloned() {
            if at > self.now {
                break;
            }
            self.saga_timers.remove(&(at, run.clone()));
            self.saga_due.insert(run);
        }
        for run in std::mem::take(&mut self.saga_due) {
            self.offer(&run);
        }
    }

    /// Offers what the saga of `run` has for an executor, if anything.
    fn offer(&mut self, run: &RunId) {
        let Some((key, next)) = self.gate.saga_next(run) else {
            self.offered.remove(run);
            return;
        };
        let key = key.clone();
        let attempt = match next {
            Next::Begin { at, .. } if at > self.now => {
                self.saga_timers.insert((at, run.clone()));
                return;
            }
            Next::Begin { attempt, .. } => attempt,
            Next::Running { attempt } => {
                let live = self.offered.get(run).is_some_and(|o| {
                    o.key == key
                        && o.attempt == attempt
                        && self.executors.iter().any(|x| x.conn == o.conn)
                });
                if live {
                    return;
                }
                attempt
            }
            Next::InFlight | Next::Settle | Next::Human => {
                self.offered.remove(run);
                return;
            }
        };
        let Some(i) = self.executor_for(run) else {
            return; // Offered when an executor that may run it connects.
        };
        if matches!(next, Next::Begin { .. }) && !self.begin(run, &key, attempt, i) {
            return;
        }
        let event = self.compensate_event(run, &key, attempt);
        let ex = &self.executors[i];
        let conn = ex.conn;
        self.actions.push(Action::Event {
            run: run.clone(),
            conn,
            out: ex.out.clone(),
            backlog: Arc::clone(&ex.backlog),
            event,
            after: self.after(),
        });
        self.saga_due.remove(run);
        self.offered
            .insert(run.clone(), Offered { key, attempt, conn });
    }

    /// Claims attempt `attempt` for executor `i`: its arguments built now, its begin recorded.
    /// False when there is nothing to send (the arguments could not be built: the attempt is
    /// recorded as failed with the reason, so the bound asks a human; or the kernel refused).
    fn begin(&mut self, run: &RunId, key: &EffectKey, attempt: u32, i: usize) -> bool {
        let principal = self.executors[i].principal.clone();
        let args = match self.compensation_args(run, key) {
            Ok(args) => args,
            Err(why) => {
                let system = system_principal();
                let begin = Command::CompensationBegin {
                    run: run.clone(),
                    key: key.clone(),
                    attempt,
                    args: None,
                };
                let end = Command::CompensationEnd {
                    run: run.clone(),
                    key: key.clone(),
                    attempt,
                    outcome: Outcome::Error,
                    error: Some(why.into_boxed_str()),
                };
                let _ = self.apply_reply(&system, begin);
                let _ = self.apply_reply(&system, end);
                return false;
            }
        };
        let cmd = Command::CompensationBegin {
            run: run.clone(),
            key: key.clone(),
            attempt,
            args,
        };
        self.apply_reply(&principal, cmd).is_ok()
    }

    /// The compensating call's arguments, from the effect's recorded mapping (none without).
    fn compensation_args(&self, run: &RunId, key: &EffectKey) -> Result<Option<Box<str>>, String> {
        let e = self.effect(run, key);
        let Some(source) = e.compensate_args.as_deref() else {
            return Ok(None);
        };
        let forward: serde_json::Value = e
            .args
            .as_deref()
            .and_then(|a| serde_json::from_str(a).ok())
            .unwrap_or(serde_json::Value::Null);
        let result = e.outcome.as_ref().and_then(|o| o.result.as_deref());
        let args = estop_policy::compensation_args(source, e.tool.as_str(), &forward, result)?;
        let args = args.to_string();
        // Refused by the kernel, it would never begin: an error an operator sees instead.
        let max = self.gate.limits().args_bytes_max;
        if args.len() > max {
            return Err(format!(
                "`compensate_args` built {} bytes of arguments, above args_bytes_max = {max}",
                args.len()
            ));
        }
        Ok(Some(args.into_boxed_str()))
    }

    fn effect(&self, run: &RunId, key: &EffectKey) -> &estop_kernel::state::Effect {
        self.gate
            .run(run)
            .and_then(|r| r.effects.get(key))
            .expect("the saga's head is an effect of the run")
    }

    /// The `compensate` event of the attempt under way, as its begin recorded it.
    fn compensate_event(&self, run: &RunId, key: &EffectKey, attempt: u32) -> wire::Event {
        let e = self.effect(run, key);
        let args = e
            .saga
            .as_ref()
            .and_then(|c| c.args.as_deref())
            .and_then(|a| serde_json::from_str(a).ok());
        wire::Event {
            event: wire::EventKind::Compensate,
            run: run.to_string(),
            key: Some(key.to_string()),
            reason: None,
            decision: None,
            outcome: None,
            attempt: Some(attempt),
            tool: e.compensate.as_ref().map(ToString::to_string),
            args,
            idempotency_key: Some(derived_key(key)),
            at: self.now,
        }
    }

    /// The executor that runs `run`'s compensation: one that may see the run and asked for
    /// it, with the fewest attempts offered to it.
    fn executor_for(&self, run: &RunId) -> Option<usize> {
        self.executors
            .iter()
            .enumerate()
            .filter(|(_, x)| x.run.as_ref().is_none_or(|r| r == run))
            .filter(|(_, x)| self.gate.visible_run(&x.principal, run).is_ok())
            .min_by_key(|(_, x)| self.offered.values().filter(|o| o.conn == x.conn).count())
            .map(|(i, _)| i)
    }
}

/// The runs that may have a saga open.
fn finalizing(gate: &Gate) -> impl Iterator<Item = RunId> + '_ {
    gate.runs()
        .filter(|(_, r)| r.state == RunState::Finalizing)
        .map(|(id, _)| id.clone())
}
