//! `subscribe`: event lines for a run's changes, each sent once durable and only to principals
//! that may see the run; a subscriber that stops reading loses the subscription.

use super::*;

/// One `subscribe` of one connection.
pub(super) struct Subscriber {
    pub(super) conn: u64,
    pub(super) principal: Principal,
    /// Where its events go, and how many it has queued and not yet written: the core only
    /// passes them to the shell (`Action::Event`).
    pub(super) out: Outbox,
    pub(super) backlog: Arc<AtomicUsize>,
}

impl Core {
    /// A `subscribe`: the run's durable state (or a plain ack) once the subscription is in
    /// place. Both happen in this one step of the core, so no change falls between the state
    /// replayed and the first event; the reply is released, as every reply, once what it shows
    /// is durable.
    pub(super) fn subscribe(&mut self, run: RunId, sub: Subscriber, page: PageBudget, to: ReplyTo) {
        // Not created yet — or another principal's, which must look the same, so `subscribe`
        // tells no one which run ids others use: the reply is the plain ack, the subscription
        // waits, and hears only of runs its principal may see (`publish`).
        let replay = match self.gate.visible_run(&sub.principal, &run) {
            Ok(r) => Some(render::run_replay(&run, r, page)),
            Err(_) => self
                .gate
                .visible_tombstone(&sub.principal, &run)
                .ok()
                .map(|t| render::tombstone_replay(&run, t)),
        };
        let answer = self
            .add_subscription(run, sub)
            .unwrap_or(Answer::Subscribed(Box::new(wire::SubscribeReply {
                replay,
            })));
        self.send(to, answer);
    }

    pub(super) fn unsubscribe(&mut self, run: &RunId, conn: u64) {
        if let Some(subs) = self.subscribers.get_mut(run) {
            let shares = &mut self.subscription_shares;
            subs.retain(|x| {
                let keep = x.conn != conn;
                if !keep {
                    shares.give_back(&x.principal);
                }
                keep
            });
            if subs.is_empty() {
                self.subscribers.remove(run);
            }
        }
    }

    /// A subscriber's connection was gone, or had `event_backlog_max` events unwritten, when the
    /// shell was to hand it an event: its subscription of `run` ends.
    pub fn subscriber_gone(&mut self, run: &RunId, conn: u64) {
        self.unsubscribe(run, conn);
        // An executor that stops reading misses its `compensate` events: what it was offered
        // goes to another.
        self.executor_gone(conn);
    }

    /// The subscriptions of a connection that is gone end with it.
    pub(super) fn disconnect_subscriptions(&mut self, conn: u64) {
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

    /// Tells subscribers and wakes the waiters a change concerns. A subscriber hears only of
    /// runs it may see (a subscription may precede the run's first admit).
    pub(super) fn publish(&mut self, events: &[estop_kernel::Event]) {
        let after = self.after();
        let mut wake: Vec<RunId> = Vec::new();
        for e in events {
            if self.subscribers.contains_key(&e.run)
                && let Some(event) = render::event(&self.gate, e, self.now)
                && let Some(subs) = self.subscribers.get_mut(&e.run)
            {
                // The shell hands each event over only while the connection reads its events
                // (`Shell::event`): one that is gone or has stopped reading loses the
                // subscription (`subscriber_gone`) rather than growing a queue without bound.
                for x in subs.iter() {
                    if self.gate.visible_run(&x.principal, &e.run).is_ok() {
                        self.actions.push(Action::Event {
                            run: e.run.clone(),
                            conn: x.conn,
                            out: x.out.clone(),
                            backlog: Arc::clone(&x.backlog),
                            event: event.clone(),
                            after,
                        });
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
    pub(super) fn add_subscription(&mut self, run: RunId, sub: Subscriber) -> Option<Answer> {
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
}
