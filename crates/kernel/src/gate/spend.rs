//! The model budget (G5's spend dimension): reservations an admission carries and costs a
//! completion settles, counted on the run and on every ancestor, so a child's spend counts
//! against its parent's `max_spend` / `max_tokens`. A reservation that would take spent +
//! reserved past a limit anywhere in the chain is refused (`budget`, naming the dimension and
//! the run); settled spend that reaches a limit fences that run's subtree (stop cause
//! `budget`, its reason naming the dimension). docs/PROTOCOL.md, "Model budget".

use super::{Gate, Sink};
use crate::command::{Spend, SpendDimension};
use crate::ids::{EffectKey, RunId};
use crate::limits::{SPEND_TOKENS_MAX, SPEND_USD_MICROS_MAX};
use crate::reply::{KernelError, Over};
use crate::state::{EffectSpend, Run};
use crate::vocab::StopCause;

/// Refuses a reservation or a cost above the sane bound of one model call (a typed
/// `limit` refusal, before anything changes).
pub(crate) fn check_spend(s: Spend) -> Result<(), KernelError> {
    if s.usd_micros > SPEND_USD_MICROS_MAX {
        return Err(KernelError::limit(
            "spend_usd_micros_max",
            SPEND_USD_MICROS_MAX as usize,
        ));
    }
    if s.tokens > SPEND_TOKENS_MAX {
        return Err(KernelError::limit(
            "spend_tokens_max",
            SPEND_TOKENS_MAX as usize,
        ));
    }
    Ok(())
}

impl Gate {
    /// The parent a run's spend counts against: its parent while that is held and still lists
    /// it as a child. A parent forgotten by retention whose id a new run has taken since is not
    /// its ancestor any more. (Retention keeps a run while its tree holds a reservation, so a
    /// reservation is released on the same runs it was counted on.)
    fn spend_parent<'a>(&'a self, id: &RunId, run: &'a Run) -> Option<(&'a RunId, &'a Run)> {
        let (pid, parent) = self.runs.get_key_value(run.parent.as_ref()?)?;
        parent.children.contains(id).then_some((pid, parent))
    }

    /// The run and the ancestors its spend counts against, nearest first.
    fn spend_chain(&self, run_id: &RunId) -> Vec<RunId> {
        let mut out = Vec::new();
        let mut at = self.runs.get_key_value(run_id);
        while let Some((id, r)) = at {
            out.push(id.clone());
            at = self.spend_parent(id, r);
        }
        out
    }

    /// Applies `f` to the run and every ancestor its spend counts against.
    pub(crate) fn each_in_chain(&mut self, run_id: &RunId, mut f: impl FnMut(&mut Run)) {
        for id in self.spend_chain(run_id) {
            f(self.runs.get_mut(&id).expect("the chain is held"));
        }
    }

    /// The nearest run of the chain (the run, then its ancestors) whose limit `reserve` would
    /// pass, dollars before tokens; `None` when it fits everywhere (or reserves nothing).
    pub(crate) fn over_budget(&self, run_id: &RunId, run: &Run, reserve: Spend) -> Option<Over> {
        if reserve.is_zero() {
            return None;
        }
        let mut at = Some((run_id, run));
        while let Some((id, r)) = at {
            for &dimension in SpendDimension::ALL {
                let Some(limit) = dimension.limit(&r.limits) else {
                    continue;
                };
                let used = dimension
                    .of(r.spent)
                    .saturating_add(dimension.of(r.reserved));
                if used.saturating_add(dimension.of(reserve)) > limit {
                    return Some(Over {
                        dimension,
                        run: id.clone(),
                        limit,
                        used,
                    });
                }
            }
            at = self.spend_parent(id, r);
        }
        None
    }

    /// At admission (a token issued): counts the effect's reservation on the run and every
    /// ancestor.
    pub(crate) fn count_reservation(&mut self, run_id: &RunId, key: &EffectKey) {
        let e = self.effect_mut(run_id, key);
        let Some(s) = e.spend.as_deref_mut() else {
            return;
        };
        if s.counted || s.reserve.is_zero() {
            return;
        }
        s.counted = true;
        let reserve = s.reserve;
        self.each_in_chain(run_id, |r| r.reserved = r.reserved.saturating_add(reserve));
    }

    /// Releases the effect's counted reservation (it completed, or was voided before it
    /// started).
    pub(crate) fn release_reservation(&mut self, run_id: &RunId, key: &EffectKey) {
        let e = self.effect_mut(run_id, key);
        let Some(s) = e.spend.as_deref_mut() else {
            return;
        };
        if !s.counted {
            return;
        }
        s.counted = false;
        let reserve = s.reserve;
        self.each_in_chain(run_id, |r| r.reserved = r.reserved.release(reserve));
    }

    /// Releases `released` (reservations of a run's effects voided by its stop) on the run and
    /// every ancestor.
    pub(crate) fn release_in_chain(&mut self, run_id: &RunId, released: Spend) {
        if !released.is_zero() {
            self.each_in_chain(run_id, |r| r.reserved = r.reserved.release(released));
        }
    }

    /// A completion's cost: released reservation first (the caller), then `cost` charged once on
    /// the run and every ancestor; the farthest run of the chain, not yet stopped, whose limit
    /// the settled spend reached is then fenced with its subtree (stop cause `budget`, the
    /// reason naming the dimension).
    pub(crate) fn charge(
        &mut self,
        now: u64,
        run_id: &RunId,
        key: &EffectKey,
        cost: Spend,
        ev: &mut Sink,
    ) {
        if cost.is_zero() {
            return;
        }
        let e = self.effect_mut(run_id, key);
        let s = e
            .spend
            .get_or_insert_with(|| Box::new(EffectSpend::default()));
        if s.cost.is_some() {
            return;
        }
        s.cost = Some(cost);
        self.each_in_chain(run_id, |r| r.spent = r.spent.saturating_add(cost));
        let mut reached = None;
        let mut at = self.runs.get_key_value(run_id);
        while let Some((id, r)) = at {
            if r.stop.is_none() {
                for &dimension in SpendDimension::ALL {
                    if let Some(limit) = dimension.limit(&r.limits)
                        && dimension.of(r.spent) >= limit
                    {
                        reached = Some((id.clone(), dimension, limit, dimension.of(r.spent)));
                        break;
                    }
                }
            }
            at = self.spend_parent(id, r);
        }
        let Some((root, dimension, limit, spent)) = reached else {
            return;
        };
        let stop = self
            .stop_plan(&root, StopCause::Budget)
            .expect("a budget stop of runs not yet stopped is legal");
        let reason = format!(
            "{}: run {root} spent {spent} of its limit {limit}",
            dimension.as_str()
        );
        self.stop_subtree(now, stop, Some(reason.into()), None, ev);
    }
}
