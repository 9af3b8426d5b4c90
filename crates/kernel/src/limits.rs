//! Bounds the kernel enforces; reaching one is a typed refusal (`KernelError::Limit`), never a wait.

/// Every bound of the gate's state, with the unit last in the name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Runs held in state (live and retained terminal ones).
    pub runs_max: usize,
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

impl Default for Limits {
    fn default() -> Self {
        Limits {
            runs_max: 1_000_000,
            effects_per_run_max: 100_000,
            pending_approvals_per_run_max: 64,
            run_depth_max: 16,
            labels_max: 16,
            label_bytes_max: 320,
            result_bytes_max: 64 * 1024,
            args_bytes_max: 64 * 1024,
            reason_bytes_max: 1024,
        }
    }
}
