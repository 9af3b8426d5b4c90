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
//!
//! A call a stopped run's agent left in flight and never reported becomes `unknown`
//! `in_flight_timeout_ms` after the stop (`unreported`), without a human.
//!
//! An unknown outcome whose tool declares a `lookup` is offered the same way: a `lookup` event
//! (the forward call's arguments and idempotency key) claimed by a `LookupBegin` record, and
//! answered with `looked_up`. A due compensation that cannot be issued — its arguments cannot
//! be built, or the policy refuses the compensating call — is recorded `Blocked` at once and
//! waits for a human; nothing is sent. One a policy `approve` rule holds is recorded `Held`:
//! an approval operators decide by quorum (`decide`, listed by `pending`); met, it is offered
//! like any attempt; at its expiry unmet it is recorded `Expired` and waits for a human.

use super::*;
use estop_kernel::SagaStep;
use estop_kernel::saga::{self, Next, derived_key};
use estop_kernel::vocab::PolicyAction;

/// One connection that said `compensations`.
pub(super) struct Executor {
    pub(super) conn: u64,
    pub(super) principal: Principal,
    /// Only this run's compensations (`None`: every run the principal may see).
    pub(super) run: Option<RunId>,
    /// Only compensations whose compensating tool (or, for a lookup, lookup tool) this
    /// matches: an executor that can run only some tools (`estop egress-executor`: `http.*`).
    pub(super) tool: Option<estop_policy::ToolPattern>,
    pub(super) out: Outbox,
    pub(super) backlog: Arc<AtomicUsize>,
}

/// What becomes of a due compensating call (`Core::compensation_allowed`).
enum Issue {
    /// Sent, with these arguments.
    Send(Option<Box<str>>),
    /// Never sent as it stands: a human is asked, with why.
    Blocked(String),
    /// Held for an approval as the ruling says, with the arguments built and why.
    Hold(estop_policy::Ruling, Option<Box<str>>, String),
}

/// `Offered::conn` of an attempt another node began (PostgreSQL store): no connection here.
const ELSEWHERE: u64 = u64::MAX;

/// The attempt a run's saga head was offered, and to which connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Offered {
    key: EffectKey,
    attempt: u32,
    /// A lookup of an unknown outcome, not a compensation.
    lookup: bool,
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
            None => self.saga_due.extend(open_sagas(&self.gate)),
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

    /// Several nodes (PostgreSQL): a begin of an attempt or a lookup another node recorded, as
    /// this node catches up, makes that attempt the other node's. Each begin is recorded under
    /// the writers' lock after catching up, so only one node ever begins an attempt, and only
    /// the node that began it offers it (again, if its executor goes); this node looks at it
    /// again only after its own restart or recovery (as after a crash of a single node).
    pub(super) fn begun_elsewhere(&mut self, cmd: &Command) {
        let (run, key, attempt, lookup) = match cmd {
            Command::CompensationBegin {
                run, key, attempt, ..
            } => (run, key, *attempt, false),
            Command::SagaStep {
                run,
                key,
                step: SagaStep::LookupBegin { attempt },
            } => (run, key, *attempt, true),
            _ => return,
        };
        let offered = Offered {
            key: key.clone(),
            attempt,
            lookup,
            conn: ELSEWHERE,
        };
        self.offered.insert(run.clone(), offered);
    }

    /// After a restart or a recovery every open saga is looked at again: an attempt under way
    /// is offered again as it was, unless the executor it went to is still connected (a
    /// recovery inside a running core, after a failed write: the begin it was offered after
    /// was durable, so it is still that executor's; offering it again would send one attempt
    /// to two executors at once). After a restart no executor is connected yet.
    pub(super) fn restart_sagas(&mut self) {
        let executors = &self.executors;
        self.offered
            .retain(|_, o| o.conn != ELSEWHERE && executors.iter().any(|x| x.conn == o.conn));
        self.saga_timers.clear();
        self.saga_due = open_sagas(&self.gate).collect();
    }

    /// A change to these runs may have made their sagas due: a finalizing run's, or the saga
    /// of the one effect an operator chose in a stopped run (looked at through the event's
    /// effect, so this stays constant work per event).
    pub(super) fn saga_touched(&mut self, events: &[estop_kernel::Event]) {
        for e in events {
            let Some(run) = self.gate.run(&e.run) else {
                continue;
            };
            let chosen = || {
                run.stop.is_some()
                    && e.key
                        .as_ref()
                        .and_then(|k| run.effects.get(k))
                        .is_some_and(saga::chosen)
            };
            let due = run.state == RunState::Finalizing || chosen();
            if due && !self.saga_due.contains(&e.run) {
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
        self.unreported(run);
        let Some((key, next)) = self.gate.saga_next(run) else {
            self.offered.remove(run);
            return;
        };
        let key = key.clone();
        let (attempt, lookup) = match next {
            Next::Begin { at, .. } if at > self.now => {
                self.saga_timers.insert((at, run.clone()));
                return;
            }
            Next::Begin { attempt, .. } => (attempt, false),
            Next::Lookup { attempt } => (attempt, true),
            Next::Running { attempt } | Next::LookingUp { attempt } => {
                let lookup = matches!(next, Next::LookingUp { .. });
                let live = self.offered.get(run).is_some_and(|o| {
                    o.key == key
                        && o.attempt == attempt
                        && o.lookup == lookup
                        && (o.conn == ELSEWHERE || self.executors.iter().any(|x| x.conn == o.conn))
                });
                if live {
                    return;
                }
                (attempt, lookup)
            }
            Next::Approval { id, expires_at } => {
                self.offered.remove(run);
                self.undo_expiry(run, &key, id, expires_at);
                return;
            }
            Next::InFlight | Next::Settle | Next::Human => {
                self.offered.remove(run);
                return;
            }
        };
        let Some(i) = self.executor_for(run, &key, lookup) else {
            return; // Offered when an executor that may run it connects.
        };
        let claimed = match next {
            Next::Begin { .. } => self.begin(run, &key, attempt, i),
            Next::Lookup { .. } => self.begin_lookup(run, &key, attempt, i),
            _ => true,
        };
        if !claimed {
            return;
        }
        let event = if lookup {
            self.lookup_event(run, &key, attempt)
        } else {
            self.compensate_event(run, &key, attempt)
        };
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
        self.offered.insert(
            run.clone(),
            Offered {
                key,
                attempt,
                lookup,
                conn,
            },
        );
    }

    /// The calls a stopped run's agent left in flight, once `in_flight_timeout_ms` after the stop
    /// has passed, become `unknown` (recorded `Unreported` with the timeout, so replay is exact),
    /// then are looked up or asked of a human like any unknown outcome; before that, the run is
    /// looked at again at the deadline. Every stopped run with a call in flight is finalizing,
    /// so it passes here whenever it changes and after every restart.
    fn unreported(&mut self, run: &RunId) {
        let after_ms = self.opts.in_flight_timeout_ms;
        let Some(r) = self.gate.run(run) else {
            return;
        };
        let Some(at) = saga::unreported_at(r, after_ms) else {
            return;
        };
        if at > self.now {
            self.saga_timers.insert((at, run.clone()));
            return;
        }
        let keys: Vec<EffectKey> = saga::left_in_flight(r).cloned().collect();
        for key in keys {
            let cmd = Command::SagaStep {
                run: run.clone(),
                key,
                step: SagaStep::Unreported { after_ms },
            };
            let _ = self.apply_reply(&system_principal(), cmd);
        }
    }

    /// The compensating call's approval `id` expires unmet at `expires_at`: recorded
    /// (`Expired`, a human is asked) once that has passed; before, the run is looked at again
    /// then. Votes come through `decide`, which makes the saga due again when they meet it.
    fn undo_expiry(&mut self, run: &RunId, key: &EffectKey, id: u64, expires_at: u64) {
        if expires_at > self.now {
            self.saga_timers.insert((expires_at, run.clone()));
            return;
        }
        let cmd = Command::SagaStep {
            run: run.clone(),
            key: key.clone(),
            step: SagaStep::Expired { approval: id },
        };
        let _ = self.apply_reply(&system_principal(), cmd);
    }

    /// Claims attempt `attempt` for executor `i`: its arguments built now and checked against
    /// the policy, its begin recorded. False when there is nothing to send: the call cannot be
    /// issued (recorded `Blocked` with the reason: a human is asked at once, since building it
    /// again would fail again), it must be approved first (recorded `Held`: an approval is
    /// requested), or the kernel refused.
    fn begin(&mut self, run: &RunId, key: &EffectKey, attempt: u32, i: usize) -> bool {
        let principal = self.executors[i].principal.clone();
        let issue = match self.compensation_args(run, key) {
            Ok(args) => self.compensation_allowed(run, key, &principal, args),
            Err(why) => Issue::Blocked(why),
        };
        let step = match issue {
            Issue::Send(args) => Ok(args),
            Issue::Blocked(why) => Err(SagaStep::Blocked {
                attempt,
                reason: why.into_boxed_str(),
            }),
            Issue::Hold(ruling, args, why) => Err(SagaStep::Held {
                attempt,
                quorum: ruling.quorum,
                groups: ruling
                    .groups
                    .into_iter()
                    .map(String::into_boxed_str)
                    .collect(),
                expiry_ms: ruling.expiry_ms,
                args,
                reason: why.into_boxed_str(),
            }),
        };
        let args = match step {
            Ok(args) => args,
            Err(step) => {
                let cmd = Command::SagaStep {
                    run: run.clone(),
                    key: key.clone(),
                    step,
                };
                let _ = self.apply_reply(&system_principal(), cmd);
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

    /// Claims lookup `attempt` of an unknown outcome for executor `i`. A lookup whose recorded
    /// `lookup_args` cannot be built is begun and ended `unknown` at once, with why: nothing
    /// is sent, and a human settles it (or asks it again, `saga retry`).
    fn begin_lookup(&mut self, run: &RunId, key: &EffectKey, attempt: u32, i: usize) -> bool {
        let principal = self.executors[i].principal.clone();
        let built = self.lookup_args(run, key);
        let cmd = Command::SagaStep {
            run: run.clone(),
            key: key.clone(),
            step: SagaStep::LookupBegin { attempt },
        };
        if self.apply_reply(&principal, cmd).is_err() {
            return false;
        }
        let Err(why) = built else { return true };
        let cmd = Command::SagaStep {
            run: run.clone(),
            key: key.clone(),
            step: SagaStep::LookupEnd {
                attempt,
                outcome: estop_kernel::vocab::Outcome::Unknown,
                result: None,
                error: Some(format!("the lookup was not sent: {why}").into_boxed_str()),
            },
        };
        let _ = self.apply_reply(&system_principal(), cmd);
        false
    }

    /// The lookup's arguments: built by the effect's recorded `lookup_args` from the forward
    /// call's arguments, tool and idempotency key; without a mapping, the forward call's
    /// arguments as they are (`None`: it had none).
    fn lookup_args(
        &self,
        run: &RunId,
        key: &EffectKey,
    ) -> Result<Option<serde_json::Value>, String> {
        let e = self.effect(run, key);
        let forward: Option<serde_json::Value> =
            e.args.as_deref().and_then(|a| serde_json::from_str(a).ok());
        let Some(source) = e.lookup_args.as_deref() else {
            return Ok(forward);
        };
        let forward = forward.unwrap_or(serde_json::Value::Null);
        let lookup = e.lookup.as_ref().map_or("", |t| t.as_str());
        let args =
            estop_policy::lookup_args(source, e.tool.as_str(), &forward, key.as_str(), lookup)?;
        let max = self.gate.limits().args_bytes_max;
        let len = args.to_string().len();
        if len > max {
            return Err(format!(
                "`lookup_args` built {len} bytes of arguments, above args_bytes_max = {max}"
            ));
        }
        Ok(Some(args))
    }

    /// The compensating call, checked against the policy as any call is, with the arguments the
    /// saga built: a matching `deny` rule refuses it; a matching `approve` rule holds it for an
    /// approval with the rule's quorum, groups and expiry (`saga::undo`), decided by operators'
    /// votes as an admission's — once met, the call is sent. A tool no rule matches is not
    /// refused by `unknown_tool`: naming it as the compensation is what declared it. No policy
    /// (the core's tests): nothing is checked.
    fn compensation_allowed(
        &self,
        run: &RunId,
        key: &EffectKey,
        principal: &Principal,
        args: Option<Box<str>>,
    ) -> Issue {
        let Some(policy) = &self.opts.compensation_policy else {
            return Issue::Send(args);
        };
        let e = self.effect(run, key);
        let tool = e
            .compensate
            .as_ref()
            .expect("a saga member names its compensation");
        let value: serde_json::Value = match args.as_deref() {
            Some(a) => match serde_json::from_str(a) {
                Ok(v) => v,
                Err(err) => return Issue::Blocked(err.to_string()),
            },
            None => serde_json::Value::Object(Default::default()),
        };
        let ruling = match policy.evaluate(tool, Some(&value), principal.name.as_str()) {
            Ok(r) => r,
            Err(err) => {
                return Issue::Blocked(format!(
                    "the policy cannot evaluate the compensating call {tool}: {err}"
                ));
            }
        };
        if !ruling.matched {
            return Issue::Send(args);
        }
        match ruling.action {
            PolicyAction::Allow => Issue::Send(args),
            PolicyAction::Approve if saga::approved(e) => Issue::Send(args),
            PolicyAction::Approve => {
                let why = format!(
                    "policy rule {:?} requires approval of the compensating call {tool} (a \
                     quorum of {})",
                    ruling.rule, ruling.quorum
                );
                Issue::Hold(ruling, args, why)
            }
            PolicyAction::Deny => Issue::Blocked(format!(
                "policy rule {:?} denies the compensating call {tool}",
                ruling.rule
            )),
        }
    }

    /// A completion's `result.request_body` (the egress proxy's record of a write's own body,
    /// docs/EGRESS.md "What an undo needs") is recorded only where the effect's recorded
    /// `compensate_args` reads it, as `request_body_omitted` is (why it is not there): no
    /// other request's body reaches the ledger.
    pub(super) fn keep_for_undo(&self, cmd: &mut Command) {
        let Command::Complete {
            run,
            key,
            result: Some(text),
            ..
        } = cmd
        else {
            return;
        };
        if !text.contains("\"request_body") {
            return;
        }
        let reads = self
            .gate
            .run(run)
            .and_then(|r| r.effects.get(key))
            .and_then(|e| e.compensate_args.as_deref())
            .is_some_and(|m| m.contains("request_body"));
        if reads {
            return;
        }
        if let Ok(serde_json::Value::Object(mut m)) = serde_json::from_str(text) {
            m.remove("request_body");
            m.remove("request_body_omitted");
            *text = serde_json::Value::Object(m).to_string().into_boxed_str();
        }
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
        let args = estop_policy::compensation_args(source, e.tool.as_str(), &forward, result)
            .map_err(|why| match body_omitted(source, result) {
                Some(omitted) => format!(
                    "the undo reads the forward request's body, which was not recorded \
                     ({omitted}: see undo_body_bytes_max, docs/EGRESS.md); {why}"
                ),
                None => why,
            })?;
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

    /// The `lookup` event of the lookup under way: the tool's lookup, asked with the arguments
    /// its `lookup_args` builds (the forward call's own without one) and the call's idempotency
    /// key (the effect's key). The mapping was built when the lookup began (`begin_lookup`) and
    /// builds the same again.
    fn lookup_event(&self, run: &RunId, key: &EffectKey, attempt: u32) -> wire::Event {
        let args = self.lookup_args(run, key).ok().flatten();
        let e = self.effect(run, key);
        wire::Event {
            event: wire::EventKind::Lookup,
            run: run.to_string(),
            key: Some(key.to_string()),
            reason: None,
            decision: None,
            outcome: None,
            attempt: Some(attempt),
            tool: e.lookup.as_ref().map(ToString::to_string),
            args,
            idempotency_key: Some(key.to_string()),
            at: self.now,
        }
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

    /// The executor that runs `run`'s compensation (or lookup) of `key`: one that may see the
    /// run and asked for it and its tool, with the fewest attempts offered to it.
    fn executor_for(&self, run: &RunId, key: &EffectKey, lookup: bool) -> Option<usize> {
        let e = self.effect(run, key);
        let tool = if lookup { &e.lookup } else { &e.compensate };
        let tool = tool.as_ref().map_or("", |t| t.as_str());
        self.executors
            .iter()
            .enumerate()
            .filter(|(_, x)| x.run.as_ref().is_none_or(|r| r == run))
            .filter(|(_, x)| x.tool.as_ref().is_none_or(|p| p.matches(tool)))
            .filter(|(_, x)| self.gate.visible_run(&x.principal, run).is_ok())
            .min_by_key(|(_, x)| self.offered.values().filter(|o| o.conn == x.conn).count())
            .map(|(i, _)| i)
    }
}

/// The runs that may have a saga open: finalizing ones, and stopped ones with an effect an
/// operator chose to compensate. Every run is looked at (and a stopped one's effects): this runs
/// at a restart and when an executor of every run registers, not per request.
fn open_sagas(gate: &Gate) -> impl Iterator<Item = RunId> + '_ {
    gate.runs()
        .filter(|(_, r)| r.state == RunState::Finalizing || saga::chosen_open(r))
        .map(|(id, _)| id.clone())
}

/// Why the forward request's body is not in `result` (`request_body_omitted`), when the
/// mapping reads it.
fn body_omitted(source: &str, result: Option<&str>) -> Option<String> {
    if !source.contains("request_body") {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(result?).ok()?;
    v.get("request_body_omitted")
        .and_then(serde_json::Value::as_str)
        .map(str::to_string)
}
