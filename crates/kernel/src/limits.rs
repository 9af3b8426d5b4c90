//! Bounds the kernel enforces; reaching one is a typed refusal (`KernelError::Limit`), never a wait.

/// Percentage of `runs_max` that only operators may fill (their fences on run ids not yet
/// seen): agents together may hold at most the rest, so no agent flood locks the operator out.
pub const RUNS_OPERATOR_RESERVE_PERCENT: usize = 1;

/// Default labels per run; the protocol refuses more at parse time
/// (`estop_protocol::limits` re-exports these bounds, so both edges agree by construction).
pub const LABELS_MAX: usize = 16;
/// Default bytes of a label key.
pub const LABEL_KEY_BYTES_MAX: usize = 64;
/// Default bytes of a label value.
pub const LABEL_VALUE_BYTES_MAX: usize = 256;
/// Default bytes of a recorded result (a `complete`'s `result`, measured as sent).
pub const RESULT_BYTES_MAX: usize = 64 * 1024;
/// Default bytes of a reason text (cancel, kill, decide).
pub const REASON_BYTES_MAX: usize = 1024;
/// Most micro-USD one reservation or one cost may name (a million dollars): far above any
/// model call, and low enough that no sum of them a ledger can hold overflows a `u64`.
pub const SPEND_USD_MICROS_MAX: u64 = 1_000_000_000_000;
/// Most model tokens one reservation or one cost may name.
pub const SPEND_TOKENS_MAX: u64 = 1_000_000_000_000;

/// Every bound of the gate's state, with the unit last in the name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Runs held in state: live ones and stopped ones not yet forgotten (retention forgets a
    /// stopped run and keeps its fence as a tombstone, which does not count here).
    pub runs_max: usize,
    /// Runs held in state that one principal created (its share of `runs_max`).
    pub runs_per_principal_max: usize,
    /// Effects held (for approval, behind a sibling or a pause, or approved and not yet
    /// consumed), gate-wide: each keeps its arguments for an operator to review.
    pub held_max: usize,
    /// Held effects in the runs of one principal (its share of `held_max`).
    pub held_per_principal_max: usize,
    /// Runs held in state that one token's principals created together: the token itself and
    /// every sandbox that speaks for it (`TOKEN/RUN`, docs/EGRESS.md), each of which has its
    /// own `runs_per_principal_max`. Without it, the holder of an agent token could open
    /// sandbox principals without end, each with a full share, and take what every other
    /// agent has.
    pub runs_per_token_max: usize,
    /// Held effects in the runs of one token's principals together (as `runs_per_token_max`).
    pub held_per_token_max: usize,
    /// Tombstones: fences of forgotten runs, kept until their own retention passes. At the
    /// bound, stopped runs are not forgotten (they keep their full state and count against
    /// `runs_max`) rather than lose their fence.
    pub tombstones_max: usize,
    /// Effects one run may record (every key ever proposed, refused ones included).
    pub effects_per_run_max: usize,
    /// Effects of one run awaiting an operator decision at the same time.
    pub pending_approvals_per_run_max: usize,
    /// Depth of the parent chain (a root run has depth 1).
    pub run_depth_max: usize,
    /// Labels per run.
    pub labels_max: usize,
    /// Bytes of a label key plus its value.
    pub label_bytes_max: usize,
    /// Bytes of a recorded result or error text.
    pub result_bytes_max: usize,
    /// Bytes of the argument JSON kept for an operator to review.
    pub args_bytes_max: usize,
    /// Bytes of a reason text (cancel, decide).
    pub reason_bytes_max: usize,
}

impl Limits {
    /// The bounds to recover under: every bound that only refuses is lifted (a recorded command
    /// passed the bounds of its day, and a lower bound configured since must not stop the gate
    /// from starting: it refuses new work until the state is back under it). `tombstones_max`
    /// stays: it decides how much a compaction forgets.
    pub fn for_replay(&self) -> Limits {
        Limits {
            tombstones_max: self.tombstones_max,
            ..Limits::unbounded()
        }
    }

    /// No bound at all (but `tombstones_max`, which is set too).
    fn unbounded() -> Limits {
        Limits {
            runs_max: usize::MAX,
            runs_per_principal_max: usize::MAX,
            held_max: usize::MAX,
            held_per_principal_max: usize::MAX,
            runs_per_token_max: usize::MAX,
            held_per_token_max: usize::MAX,
            tombstones_max: usize::MAX,
            effects_per_run_max: usize::MAX,
            pending_approvals_per_run_max: usize::MAX,
            run_depth_max: usize::MAX,
            labels_max: usize::MAX,
            label_bytes_max: usize::MAX,
            result_bytes_max: usize::MAX,
            args_bytes_max: usize::MAX,
            reason_bytes_max: usize::MAX,
        }
    }

    /// Runs (of `runs_max`) that agents cannot take: `RUNS_OPERATOR_RESERVE_PERCENT`, rounded
    /// up, at least one.
    pub fn runs_operator_reserve(&self) -> usize {
        let share = (self.runs_max as u128 * RUNS_OPERATOR_RESERVE_PERCENT as u128).div_ceil(100);
        (share as usize).clamp(1.min(self.runs_max), self.runs_max)
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            runs_max: 1_000_000,
            runs_per_principal_max: 500_000,
            held_max: 100_000,
            held_per_principal_max: 20_000,
            // Half of each pool: one token with all its sandboxes leaves the other half.
            runs_per_token_max: 500_000,
            held_per_token_max: 50_000,
            tombstones_max: 4_000_000,
            effects_per_run_max: 100_000,
            pending_approvals_per_run_max: 64,
            run_depth_max: 16,
            labels_max: LABELS_MAX,
            label_bytes_max: LABEL_KEY_BYTES_MAX + LABEL_VALUE_BYTES_MAX,
            result_bytes_max: RESULT_BYTES_MAX,
            args_bytes_max: 64 * 1024,
            reason_bytes_max: REASON_BYTES_MAX,
        }
    }
}
