//! The shipped simulation's executor of compensations (`compensations`, docs/PROTOCOL.md): a
//! client registers as an executor through the core's own message, receives `compensate` and
//! `lookup` events as the shipped core offers them (`server::core::sagas`), and reports each
//! (`compensated`: ok, error or unknown; `looked_up`: found, not found, could not tell), or
//! dies mid-attempt (its connection drops; the attempt must be offered again as it was).
//!
//! The saga's auditor checks every offer as it arrives, and the state at the end of every step
//! and after every recovery, with predicates of its own (not the kernel's `saga.rs`):
//! * an offer names the derived idempotency key (`<key>/undo`; a lookup, the call's own key);
//! * newest first: nothing of the run admitted after the offered effect is still owed
//!   (in flight, unknown, done and not undone, compensating, failed, waiting for a human);
//! * a kill (or a close, a deadline, a budget) runs no saga: only a cancelled run's effects
//!   are offered (no operator asks for one here);
//! * each attempt is begun once: attempt numbers of an effect never go back, and an attempt is
//!   offered again only once the executor it went to is gone (a disconnect or a restart);
//! * a cancelled run is `cancelled` only with nothing of its saga owed.

use super::clients::Asked;
use super::{ShippedWorld, run_name};
use crate::world::Who;
use estop_kernel::vocab::{Outcome, RunState, StopCause};
use estop_kernel::{Command, EffectKey, Gate, RunId, SagaStep};
use estop_protocol::server_line as wire;
use estop_server::answer::After;
use estop_server::core::CoreMsg;
use estop_server::durable::Durability;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

/// An attempt (or lookup) an executor was offered and has not reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    run: &'static str,
    key: String,
    attempt: u32,
    lookup: bool,
}

/// What the saga's auditor remembers across steps and restarts.
#[derive(Debug, Default)]
pub struct SagaAudit {
    /// The highest attempt offered per (run, key, lookup), and the connection it went to
    /// (`None` once that executor is gone).
    offered: BTreeMap<(&'static str, String, bool), (u32, Option<u64>)>,
}

/// Whether the effect's saga still owes it something (the auditor's own reading of
/// docs/PROTOCOL.md: a compensable call in flight, of unknown outcome, done and not undone, or
/// whose undo is under way, failed or waits for a human).
fn owed(e: &estop_kernel::state::Effect) -> bool {
    e.compensate.is_some() && crate::check::OWED.contains(&e.status.kind().as_str())
}

/// A cancelled run is `cancelled` only with nothing of its saga owed.
pub fn check_settled(gate: &Gate) -> Result<(), String> {
    for (id, run) in gate.runs() {
        let cancelled = run
            .stop
            .as_ref()
            .is_some_and(|s| s.cause == StopCause::Cancelled);
        if cancelled
            && run.state == RunState::Cancelled
            && let Some((k, e)) = run.effects.iter().find(|(_, e)| owed(e))
        {
            return Err(format!(
                "run {id} is cancelled while its saga still owes {k} ({})",
                e.status.kind()
            ));
        }
    }
    Ok(())
}

impl SagaAudit {
    /// Checks an offer against the gate and the offers before it, then records it.
    fn offered(&mut self, gate: &Gate, conn: u64, o: &Offer, idem: &str) -> Result<(), String> {
        let what = format!(
            "{} {}/{} attempt {}",
            if o.lookup { "lookup" } else { "compensation" },
            o.run,
            o.key,
            o.attempt
        );
        let derived = if o.lookup {
            o.key.clone()
        } else {
            format!("{}/undo", o.key)
        };
        if idem != derived {
            return Err(format!(
                "{what} carries idempotency key {idem:?}, not {derived:?}"
            ));
        }
        let run = gate
            .run(&RunId::new(o.run).expect("valid"))
            .ok_or_else(|| format!("{what} offered for a run the gate does not hold"))?;
        let key = EffectKey::new(&o.key).expect("valid");
        let effect = run
            .effects
            .get(&key)
            .ok_or_else(|| format!("{what} offered for an effect the gate does not hold"))?;
        let cause = run.stop.as_ref().map(|s| s.cause);
        if cause != Some(StopCause::Cancelled) {
            return Err(format!(
                "{what} offered in a run stopped by {cause:?}: only a cancel runs a saga"
            ));
        }
        let serial = effect.token.map_or(0, |t| t.serial);
        if let Some((newer, e)) = run
            .effects
            .iter()
            .find(|(_, e)| e.token.is_some_and(|t| t.serial > serial) && owed(e))
        {
            return Err(format!(
                "{what} offered while the newer {newer} is still owed ({})",
                e.status.kind()
            ));
        }
        let slot = (o.run, o.key.clone(), o.lookup);
        if let Some((last, holder)) = self.offered.get(&slot) {
            if o.attempt < *last {
                return Err(format!("{what} offered after attempt {last} was"));
            }
            if o.attempt == *last && holder.is_some() {
                return Err(format!(
                    "{what} offered again while the executor it went to is still there"
                ));
            }
        }
        self.offered.insert(slot, (o.attempt, Some(conn)));
        Ok(())
    }

    /// The executor on `conn` is gone: what it held may be offered again.
    fn gone(&mut self, conn: Option<u64>) {
        for (_, holder) in self.offered.values_mut() {
            if conn.is_none() || *holder == conn {
                *holder = None;
            }
        }
    }

    /// An attempt was reported: it is no longer held.
    fn reported(&mut self, o: &Offer) {
        if let Some((last, holder)) = self.offered.get_mut(&(o.run, o.key.clone(), o.lookup))
            && *last == o.attempt
        {
            *holder = None;
        }
    }
}

impl ShippedWorld {
    /// The client becomes an executor of every compensation its principal may see.
    pub(super) fn serve_compensations(&mut self, client: usize) {
        if self.clients[client].executor {
            return;
        }
        self.clients[client].executor = true;
        let to = self.reply_to(client, Asked::Saga);
        let msg = CoreMsg::Executor {
            principal: Who::Agent.principal(),
            run: None,
            tool: None,
            conn: self.clients[client].conn,
            out: self.clients[client].tx.clone().into(),
            backlog: Arc::new(AtomicUsize::new(0)),
            to,
        };
        let now = self.now();
        self.core().handle(now, msg);
    }

    /// The client's connection (and with it its executor) is gone.
    pub(super) fn executor_gone(&mut self, client: usize) {
        let c = &mut self.clients[client];
        if c.executor {
            self.saga.gone(Some(c.conn));
        }
        c.executor = false;
        c.offers.clear();
    }

    /// The process restarted: no executor is left.
    pub(super) fn executors_restarted(&mut self) {
        for c in &mut self.clients {
            c.executor = false;
            c.offers.clear();
        }
        self.saga.gone(None);
    }

    /// An event an executor received: a `compensate` or `lookup` offer, checked, then queued.
    pub(super) fn on_event(
        &mut self,
        client: usize,
        event: wire::Event,
        after: After,
    ) -> Result<(), String> {
        // A connection writes an event only once the record it follows is durable; one that
        // followed a record lost with a failed ledger generation is never written.
        if estop_server::durable::decide(&self.durable.borrow(), after) != Some(Durability::Durable)
        {
            return Ok(());
        }
        let lookup = match event.event {
            wire::EventKind::Compensate => false,
            wire::EventKind::Lookup => true,
            _ => return Ok(()),
        };
        let (Some(run), Some(key), Some(attempt)) =
            (run_name(&event.run), event.key.clone(), event.attempt)
        else {
            return Err(format!(
                "an executor's event lacks its run, key or attempt: {event:?}"
            ));
        };
        let offer = Offer {
            run,
            key,
            attempt,
            lookup,
        };
        let idem = event.idempotency_key.clone().unwrap_or_default();
        let conn = self.clients[client].conn;
        let gate = self.core.as_ref().expect("booted").gate();
        self.saga
            .offered(gate, conn, &offer, &idem)
            .map_err(|e| format!("seed {}: {e}", self.report.seed))?;
        self.clients[client].offers.push_back(offer);
        self.report.saga_offers += 1;
        Ok(())
    }

    /// The executor's next piece of work: run the oldest offer it holds and report it, or die
    /// in the middle of it (its connection drops).
    pub(super) fn execute(&mut self, client: usize) -> bool {
        let Some(offer) = self.clients[client].offers.pop_front() else {
            return false;
        };
        if self.rng.chance(0.15) {
            self.report.executors_died += 1;
            self.reconnect(client);
            return true;
        }
        let outcome = match self.rng.below(10) {
            0..=5 => Outcome::Ok,
            6..=8 => Outcome::Error,
            _ => Outcome::Unknown,
        };
        let (run, key) = (
            RunId::new(offer.run).expect("valid"),
            EffectKey::new(&offer.key).expect("valid"),
        );
        let cmd = if offer.lookup {
            Command::SagaStep {
                run,
                key,
                step: SagaStep::LookupEnd {
                    attempt: offer.attempt,
                    outcome,
                    result: None,
                    error: None,
                },
            }
        } else {
            Command::CompensationEnd {
                run,
                key,
                attempt: offer.attempt,
                outcome,
                error: (outcome == Outcome::Error).then(|| "downstream said no".into()),
            }
        };
        self.saga.reported(&offer);
        self.report.saga_reports += 1;
        self.send(client, Who::Agent.principal(), cmd, Asked::Saga);
        true
    }
}
