//! Read-only questions to the core: `status`, `runs`, `pending`, `report`, one page at a time.

use super::*;

/// One page of the inbox of `runs`: soonest to expire first, then by run and key, after
/// `cursor`. Only the page's items are built; their arguments are shared, not copied. A
/// stopped run's compensating call awaiting approval is listed too (at most one per run: the
/// saga's head), looked for only in runs that ever asked for an approval.
pub(super) fn pending_page<'a>(
    runs: impl IntoIterator<Item = (&'a RunId, &'a estop_kernel::state::Run)>,
    cursor: Option<PendingCursor>,
    mut page: PageBudget,
) -> wire::PendingReply {
    let mut held = Vec::new();
    for (id, r) in runs {
        if let Some((k, e, a)) = estop_kernel::saga::run_held_approval(r) {
            held.push((a.expires_at, id, k, e));
        }
        if r.pending_approvals == 0 {
            continue;
        }
        for (k, e) in &r.effects {
            if let Some(expires_at) = render::pending_expiry(e) {
                held.push((expires_at, id, k, e));
            }
        }
    }
    held.sort_unstable_by(|a, b| (a.0, a.1, a.2).cmp(&(b.0, b.1, b.2)));
    let start = cursor.map_or(0, |c| {
        held.partition_point(|h| (h.0, h.1, h.2) <= (c.expires_at, &c.run, &c.key))
    });
    let mut reply = wire::PendingReply::default();
    let mut last = None;
    for &(expires_at, id, k, e) in &held[start..] {
        let item = render::pending_item(id, k, e).or_else(|| render::undo_pending_item(id, k, e));
        let Some(item) = item else {
            continue;
        };
        if !page.take(item.weight()) {
            reply.more = true;
            break;
        }
        last = Some((expires_at, id, k));
        reply.pending.push(item);
    }
    if reply.more {
        reply.next = last.map(|(expires_at, run, key)| {
            PendingCursor {
                expires_at,
                run: run.clone(),
                key: key.clone(),
            }
            .encode()
        });
    }
    reply
}

/// The answer for a run that does not exist (or that the asker may not see: the same answer).
pub(super) fn not_found(run: RunId) -> Answer {
    let (c, m) = kernel_error(&KernelError::RunNotFound(run));
    Answer::Error(c, m)
}

impl Core {
    /// The counters and gauges for `/metrics`.
    pub(super) fn stats(&self) -> crate::observe::GateStats {
        self.obs.stats(
            &self.gate,
            self.waiter_shares.total(),
            self.last_seq,
            self.after(),
        )
    }

    pub(super) fn query(&mut self, principal: &Principal, q: Query) -> Answer {
        let err = |e: KernelError| {
            let (c, m) = kernel_error(&e);
            Answer::Error(c, m)
        };
        match q {
            Query::Status { run } => match self.gate.visible_run(principal, &run) {
                Ok(r) => Answer::Run(Box::new(render::run_view(&run, r))),
                Err(e) => match self.gate.visible_tombstone(principal, &run) {
                    Ok(t) => Answer::Run(Box::new(render::tombstone_view(&run, t))),
                    Err(_) => err(e),
                },
            },
            Query::Report { run, cursor, page } => match self.gate.visible_run(principal, &run) {
                Ok(r) => Answer::Report(Box::new(render::report(&run, r, cursor.as_ref(), page))),
                Err(e) => match self.gate.visible_tombstone(principal, &run) {
                    Ok(t) => Answer::Report(Box::new(render::tombstone_report(&run, t))),
                    Err(_) => err(e),
                },
            },
            Query::Runs {
                state,
                cursor,
                mut page,
            } => {
                let mut runs: Vec<wire::RunView> = Vec::new();
                let mut next = None;
                for (id, r) in self.gate.runs_after(cursor.as_ref()) {
                    if principal.role == Role::Agent
                        && !r
                            .owner
                            .as_ref()
                            .is_some_and(|o| principal.name.sees_runs_of(o))
                    {
                        continue;
                    }
                    if state.is_some_and(|s| s != r.state) {
                        continue;
                    }
                    let view = render::run_view(id, r);
                    if !page.take(view.weight()) {
                        next = runs.last().map(|v| v.run.clone());
                        break;
                    }
                    runs.push(view);
                }
                Answer::Runs(wire::RunsReply {
                    runs,
                    more: next.is_some(),
                    next,
                })
            }
            Query::Pending { run, cursor, page } => match &run {
                Some(id) => match self.gate.visible_run(principal, id) {
                    Ok(r) => Answer::Pending(pending_page([(id, r)], cursor, page)),
                    Err(e) => err(e),
                },
                None => {
                    let visible = self.gate.runs().filter(|(_, r)| {
                        principal.role != Role::Agent
                            || r.owner
                                .as_ref()
                                .is_some_and(|o| principal.name.sees_runs_of(o))
                    });
                    Answer::Pending(pending_page(visible, cursor, page))
                }
            },
        }
    }
}
