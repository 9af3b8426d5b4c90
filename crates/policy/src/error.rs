//! The two error types of the policy: loading a file, and evaluating a call. Each has a stable
//! `code()` for operators and clients (documented in docs/POLICY.md).

use std::path::PathBuf;

/// A policy file that cannot be used. Nothing of it is applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// The text is not a valid policy; `line` is 1-based and points at the offending key.
    #[error(
        "{origin}:{line}: {reason} (fix the policy file and load it again; see docs/POLICY.md)"
    )]
    Invalid {
        origin: String,
        line: usize,
        reason: String,
    },
    /// The file could not be read.
    #[error("cannot read policy file {}: {reason}", path.display())]
    Unreadable { path: PathBuf, reason: String },
}

impl PolicyError {
    pub fn code(&self) -> &'static str {
        match self {
            PolicyError::Invalid { .. } => "policy_invalid",
            PolicyError::Unreadable { .. } => "policy_unreadable",
        }
    }

    /// The 1-based line of the problem, when it is in the text.
    pub fn line(&self) -> Option<usize> {
        match self {
            PolicyError::Invalid { line, .. } => Some(*line),
            PolicyError::Unreadable { .. } => None,
        }
    }
}

/// Why a call could not be decided. The caller refuses the effect: a policy that cannot decide
/// never admits (fail closed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EvalError {
    /// Only a digest was sent, but a rule for this tool has a `when` that must see the arguments.
    #[error(
        "policy rule {rule:?} has a `when` condition for tool {tool:?}: send the call's `args`, \
         not only its digest"
    )]
    ArgsRequired { tool: String, rule: String },
    /// A rule's `when` could not be evaluated to true or false.
    #[error(
        "policy rule {rule:?}: its `when` failed to evaluate, so the call is refused: {message} \
         (fix the arguments or the rule)"
    )]
    WhenFailed { rule: String, message: String },
}

impl EvalError {
    pub fn code(&self) -> &'static str {
        match self {
            EvalError::ArgsRequired { .. } => "policy_args_required",
            EvalError::WhenFailed { .. } => "policy_when_failed",
        }
    }

    /// The name of the rule that could not be applied.
    pub fn rule(&self) -> &str {
        match self {
            EvalError::ArgsRequired { rule, .. } | EvalError::WhenFailed { rule, .. } => rule,
        }
    }
}
