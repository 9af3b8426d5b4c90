//! What the core tells the console: a gate-wide feed of changes (for server-sent events) and the
//! counters behind `/metrics`. Lives on the core thread, next to the state it observes: plain
//! integers, no locks; a scrape copies them out through `CoreMsg::Stats`. With no feed
//! subscriber, observing a change costs one length check.

use crate::durable::After;
use estop_kernel::reply::{DecideStatus, Event, EventKind};
use estop_kernel::vocab::{HoldReason, RefusalReason, RunState};
use estop_kernel::{Gate, Principal, Role, RunId};
use estop_ledger::{Histogram, HistogramSnapshot};
use estop_protocol::server_line as wire;

/// Events buffered for one feed subscriber; a subscriber that falls this far behind is dropped
/// (its stream ends, and the console reconnects and re-reads the state).
pub const FEED_QUEUE_MAX: usize = 4096;
/// Feed subscribers at once (each is one open server-sent-events stream).
pub const FEEDS_MAX: usize = 256;
/// Upper bounds (ms) of the decision-latency buckets: how long an approval waited for its
/// final decision.
pub const DECISION_MS_BUCKETS: &[u64] = &[
    1_000, 5_000, 15_000, 30_000, 60_000, 120_000, 300_000, 600_000, 1_800_000, 3_600_000,
];

/// One change, as the feed reports it. `event` is a kernel event kind (`held`, `decided`,
/// `expired`, `admitted`, `completed`, `paused`, `resumed`, `cancelled`, `finalizing`,
/// `closed`) or `changed` for a recorded change that raised no event (e.g. a refusal).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeedEvent {
    pub event: &'static str,
    pub run: String,
    pub key: Option<String>,
    pub detail: Option<&'static str>,
    pub at: u64,
    /// Show it only once this is durable (G6).
    pub after: After,
}

pub type FeedTx = tokio::sync::mpsc::Sender<FeedEvent>;
pub type FeedRx = tokio::sync::mpsc::Receiver<FeedEvent>;

/// A copy of the gate's counters and gauges at one moment.
#[derive(Debug, Clone)]
pub struct GateStats {
    /// Runs in each state (every state listed, zeros included).
    pub runs_by_state: Vec<(&'static str, u64)>,
    pub approvals_pending: u64,
    pub effects_in_flight: u64,
    /// Effects held (approval, sibling, pause) or approved and not yet consumed.
    pub effects_held: u64,
    /// Fences of forgotten runs.
    pub tombstones: u64,
    /// Verdicts answered (admit, wait, start) by verdict and reason (`""` when it has none).
    pub verdicts: Vec<(&'static str, &'static str, u64)>,
    /// Final decisions by outcome (`approved`, `rejected`): time from hold to decision.
    pub decisions: Vec<(&'static str, HistogramSnapshot)>,
    pub approvals_expired: u64,
    pub waiters: usize,
    pub feeds: usize,
    /// Snapshots that failed (each is retried later, with backoff).
    pub snapshot_failures: u64,
    /// The last ledger seq the core appended.
    pub ledger_seq: u64,
    /// The gauges may reflect changes up to here: show them once it is durable.
    pub after: After,
}

struct Feed {
    principal: Principal,
    tx: FeedTx,
}

/// The core's observer.
pub struct Observer {
    feeds: Vec<Feed>,
    verdicts: Vec<(&'static str, &'static str, u64)>,
    approved: Histogram,
    rejected: Histogram,
    expired: u64,
    snapshot_failures: u64,
}

impl Default for Observer {
    fn default() -> Self {
        let mut verdicts = vec![("admitted", "", 0), ("go", "", 0), ("duplicate", "", 0)];
        verdicts.extend(HoldReason::ALL.iter().map(|r| ("held", r.as_str(), 0)));
        verdicts.extend(
            RefusalReason::ALL
                .iter()
                .map(|r| ("refused", r.as_str(), 0)),
        );
        verdicts.push(("refused", "other", 0));
        Observer {
            feeds: Vec::new(),
            verdicts,
            approved: Histogram::new(DECISION_MS_BUCKETS),
            rejected: Histogram::new(DECISION_MS_BUCKETS),
            expired: 0,
            snapshot_failures: 0,
        }
    }
}

impl Observer {
    /// Adds a feed subscriber; `false` when `FEEDS_MAX` are open already.
    pub fn subscribe(&mut self, principal: Principal, tx: FeedTx) -> bool {
        self.feeds.retain(|f| !f.tx.is_closed());
        if self.feeds.len() >= FEEDS_MAX {
            return false;
        }
        self.feeds.push(Feed { principal, tx });
        true
    }

    /// Counts a verdict the core answered.
    pub fn answered(&mut self, v: &wire::VerdictReply) {
        let (verdict, reason) = match v {
            wire::VerdictReply::Admitted { .. } => ("admitted", ""),
            wire::VerdictReply::Go => ("go", ""),
            wire::VerdictReply::Duplicate { .. } => ("duplicate", ""),
            wire::VerdictReply::Held { reason, .. } => ("held", reason.as_str()),
            wire::VerdictReply::Refused { reason, .. } => ("refused", reason.as_str()),
        };
        let slot = self
            .verdicts
            .iter()
            .position(|(v, r, _)| *v == verdict && *r == reason)
            .or_else(|| {
                self.verdicts
                    .iter()
                    .position(|(v, r, _)| *v == "refused" && *r == "other")
            })
            .expect("the catch-all slot exists");
        self.verdicts[slot].2 += 1;
    }

    /// Counts a decision that ended an approval: how long it waited since it was held.
    pub fn decided(&mut self, status: &DecideStatus, waited_ms: u64) {
        match status {
            DecideStatus::Approved => self.approved.record(waited_ms),
            DecideStatus::Rejected => self.rejected.record(waited_ms),
            DecideStatus::Pending { .. } => {}
        }
    }

    /// A snapshot failed.
    pub fn snapshot_failed(&mut self) {
        self.snapshot_failures += 1;
    }

    /// A feed that was full or gone when offered an event: it is dropped (its stream ends; the
    /// client re-reads the state when it reconnects).
    pub fn feed_gone(&mut self, tx: &FeedTx) {
        self.feeds.retain(|f| !f.tx.same_channel(tx));
    }

    /// A recorded change of `run` (with the events it raised) at ledger position `after`: each
    /// feed that may see it is to be offered its events (`offer`, which the core turns into
    /// actions; the observer sends nothing itself).
    pub fn changed(
        &mut self,
        gate: &Gate,
        run: Option<&RunId>,
        events: &[Event],
        after: After,
        at: u64,
        mut offer: impl FnMut(FeedTx, FeedEvent),
    ) {
        self.expired += events
            .iter()
            .filter(|e| e.kind == EventKind::Expired)
            .count() as u64;
        if self.feeds.is_empty() {
            return;
        }
        let mut out: Vec<FeedEvent> = events
            .iter()
            .map(|e| FeedEvent {
                event: e.kind.as_str(),
                run: e.run.to_string(),
                key: e.key.as_ref().map(ToString::to_string),
                detail: e.detail,
                at,
                after,
            })
            .collect();
        if out.is_empty() {
            let Some(run) = run else { return };
            out.push(FeedEvent {
                event: "changed",
                run: run.to_string(),
                key: None,
                detail: None,
                at,
                after,
            });
        }
        let owner = |run: &str| {
            RunId::new(run)
                .ok()
                .and_then(|id| gate.run(&id).and_then(|r| r.owner.clone()))
        };
        for f in &self.feeds {
            for e in &out {
                if f.principal.role == Role::Agent
                    && owner(&e.run).as_ref() != Some(&f.principal.name)
                {
                    continue;
                }
                offer(f.tx.clone(), e.clone());
            }
        }
    }

    /// Counters and gauges now. Scans the runs: O(runs), on a scrape only.
    pub fn stats(&self, gate: &Gate, waiters: usize, ledger_seq: u64, after: After) -> GateStats {
        let mut by_state: Vec<(&'static str, u64)> =
            RunState::ALL.iter().map(|s| (s.as_str(), 0)).collect();
        let (mut pending, mut in_flight) = (0u64, 0u64);
        for (_, r) in gate.runs() {
            if let Some(slot) = by_state.iter_mut().find(|(s, _)| *s == r.state.as_str()) {
                slot.1 += 1;
            }
            pending += u64::from(r.pending_approvals);
            // A compensating call a policy holds for approval is pending too.
            pending += u64::from(estop_kernel::saga::run_held_approval(r).is_some());
            in_flight += u64::from(r.in_flight);
        }
        GateStats {
            runs_by_state: by_state,
            approvals_pending: pending,
            effects_in_flight: in_flight,
            effects_held: gate.held_count(),
            tombstones: gate.tombstone_count() as u64,
            verdicts: self.verdicts.clone(),
            decisions: vec![
                ("approved", self.approved.snapshot()),
                ("rejected", self.rejected.snapshot()),
            ],
            approvals_expired: self.expired,
            waiters,
            feeds: self.feeds.len(),
            snapshot_failures: self.snapshot_failures,
            ledger_seq,
            after,
        }
    }
}
