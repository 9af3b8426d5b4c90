//! Blocked `wait`s: parked until the effect is decided or the wait's time is up, released when
//! their connection goes, each counted in its principal's share of the waiter pool.

use super::*;

pub(super) struct Waiter {
    pub(super) principal: Principal,
    pub(super) key: EffectKey,
    /// Monotonic ms.
    pub(super) deadline: u64,
    pub(super) conn: u64,
    pub(super) to: ReplyTo,
}

impl Core {
    /// A `wait`: answered now, or parked until the effect is decided or the time is up.
    pub(super) fn wait(
        &mut self,
        principal: Principal,
        run: RunId,
        key: EffectKey,
        timeout: Duration,
        conn: u64,
        mut to: ReplyTo,
    ) {
        match self.wait_verdict(&principal, &run, &key) {
            Ok(Verdict::Held { .. }) if !timeout.is_zero() => {
                if let Err(msg) = self.waiter_shares.take(&principal) {
                    self.send(to, Answer::Error(ErrorCode::LimitExceeded, msg));
                } else {
                    // A parked wait is a small waiter, not its request line.
                    to.charge = None;
                    *self.waiters_of_conn.entry(conn).or_default() += 1;
                    let deadline = self.mono.saturating_add(timeout.as_millis() as u64);
                    self.waiter_deadlines.insert((deadline, run.clone()));
                    self.waiters.entry(run).or_default().push(Waiter {
                        principal,
                        key,
                        deadline,
                        conn,
                        to,
                    });
                }
            }
            Ok(v) => {
                let answer = Answer::Verdict(render::verdict(&run, &key, &self.opts.seal, &v));
                self.send(to, answer);
            }
            Err(answer) => self.send(to, answer),
        }
    }

    /// What `wait` answers now: the admission verdict, except that a prepared effect whose
    /// `start` would be held (pause, sibling) is still held — `wait` then `start` again.
    pub(super) fn wait_verdict(
        &mut self,
        principal: &Principal,
        run: &RunId,
        key: &EffectKey,
    ) -> Result<Verdict, Answer> {
        let cmd = Command::Recheck {
            run: run.clone(),
            key: key.clone(),
        };
        match self.apply_verdict(principal, cmd)? {
            Verdict::Admitted { token } => match self.gate.start_hold(run, key) {
                Some(reason) => Ok(Verdict::Held {
                    reason,
                    approval: None,
                    expires_at: None,
                }),
                None => Ok(Verdict::Admitted { token }),
            },
            v => Ok(v),
        }
    }

    /// One waiter of `conn` was answered.
    pub(super) fn waiter_done(&mut self, conn: u64, principal: &Principal) {
        self.waiter_shares.give_back(principal);
        if let Some(n) = self.waiters_of_conn.get_mut(&conn) {
            *n -= 1;
            if *n == 0 {
                self.waiters_of_conn.remove(&conn);
            }
        }
    }

    /// Re-checks every waiter of a run; answers those whose effect is no longer held.
    pub(super) fn recheck_waiters(&mut self, run: &RunId) {
        let Some(mut list) = self.waiters.remove(run) else {
            return;
        };
        let mut keep = Vec::new();
        for w in list.drain(..) {
            match self.wait_verdict(&w.principal, run, &w.key) {
                Ok(Verdict::Held { .. }) => keep.push(w),
                Ok(v) => {
                    self.waiter_done(w.conn, &w.principal);
                    let answer = Answer::Verdict(render::verdict(run, &w.key, &self.opts.seal, &v));
                    self.send(w.to, answer);
                }
                Err(answer) => {
                    self.waiter_done(w.conn, &w.principal);
                    self.send(w.to, answer);
                }
            }
        }
        if !keep.is_empty() {
            // Waiters added while re-checking (none today) would be in the map already.
            self.waiters.entry(run.clone()).or_default().extend(keep);
        }
    }

    /// The waits of a connection that is gone end with it.
    pub(super) fn disconnect_waiters(&mut self, conn: u64) {
        if self.opts.planted_waiter_leak {
            return;
        }
        if self.waiters_of_conn.remove(&conn).is_some() {
            let shares = &mut self.waiter_shares;
            self.waiters.retain(|_, ws| {
                ws.retain(|w| {
                    let keep = w.conn != conn;
                    if !keep {
                        shares.give_back(&w.principal);
                    }
                    keep
                });
                !ws.is_empty()
            });
        }
    }

    /// Waiters whose time is up get the current verdict (held).
    pub(super) fn expire_waiters(&mut self) {
        let mut expired: Vec<RunId> = Vec::new();
        while let Some((at, _)) = self.waiter_deadlines.first() {
            if *at > self.mono {
                break;
            }
            if let Some((_, run)) = self.waiter_deadlines.pop_first()
                && !expired.contains(&run)
            {
                expired.push(run);
            }
        }
        for run in expired {
            let Some(list) = self.waiters.remove(&run) else {
                continue;
            };
            let (due, keep): (Vec<_>, Vec<_>) =
                list.into_iter().partition(|w| w.deadline <= self.mono);
            if !keep.is_empty() {
                self.waiters.insert(run.clone(), keep);
            }
            for w in due {
                self.waiter_done(w.conn, &w.principal);
                let answer = match self.wait_verdict(&w.principal, &run, &w.key) {
                    Ok(v) => Answer::Verdict(render::verdict(&run, &w.key, &self.opts.seal, &v)),
                    Err(a) => a,
                };
                self.send(w.to, answer);
            }
        }
    }
}
