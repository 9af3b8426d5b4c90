//! The after-stop report (G8): what a run did, what was refused and why, what is in flight or of
//! unknown outcome, and what can be undone.

use crate::command::SpendDimension;
use crate::ids::EffectKey;
use crate::state::{Effect, Run, Status};
use crate::vocab::Reversibility;

/// Where an effect stands in the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Section {
    Done,
    Failed,
    Refused,
    InFlight,
    Unknown,
    Held,
    /// Admitted (a token is out) but not started.
    Prepared,
    Compensation,
}

impl Section {
    pub fn as_str(self) -> &'static str {
        match self {
            Section::Done => "done",
            Section::Failed => "failed",
            Section::Refused => "refused",
            Section::InFlight => "in_flight",
            Section::Unknown => "unknown",
            Section::Held => "held",
            Section::Prepared => "prepared",
            Section::Compensation => "compensation",
        }
    }
}

pub fn section(e: &Effect) -> Section {
    match e.status {
        Status::Completed => Section::Done,
        Status::Failed => Section::Failed,
        Status::Refused(_) => Section::Refused,
        Status::Started => Section::InFlight,
        Status::Unknown => Section::Unknown,
        Status::Held(_) | Status::Approved => Section::Held,
        Status::Admitted => Section::Prepared,
        Status::Compensating
        | Status::Compensated
        | Status::CompensationFailed
        | Status::NeedsHuman
        | Status::CompensationSkipped => Section::Compensation,
    }
}

/// What can be done about an effect that did (or may have) happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Undo {
    /// It has a declared way back (a compensating tool, or it is reversible).
    Compensable,
    Irreversible,
    /// Nobody said: never assumed undoable.
    Undeclared,
    /// Nothing happened that needs undoing.
    NotApplicable,
}

pub fn undo(e: &Effect) -> Undo {
    let happened = matches!(
        e.status,
        Status::Completed | Status::Unknown | Status::Started
    ) || (matches!(e.status, Status::Refused(_)) && e.late && e.outcome.is_some());
    if !happened {
        return Undo::NotApplicable;
    }
    match e.reversibility {
        Reversibility::Reversible | Reversibility::Compensable => Undo::Compensable,
        Reversibility::Irreversible => Undo::Irreversible,
        Reversibility::Undeclared => Undo::Undeclared,
    }
}

/// Effects of a run in report order: by section, then key.
pub fn entries(run: &Run) -> Vec<(Section, &EffectKey, &Effect)> {
    let mut v: Vec<_> = run
        .effects
        .iter()
        .map(|(k, e)| (section(e), k, e))
        .collect();
    v.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
    v
}

/// One dimension of a run's model budget: what its subtree spent and has reserved, and its
/// limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetLine {
    pub dimension: SpendDimension,
    pub spent: u64,
    pub reserved: u64,
    pub limit: Option<u64>,
}

/// The run's model budget, per dimension that has a limit or any spend (none for a run that
/// never touched a model budget).
pub fn budget(run: &Run) -> Vec<BudgetLine> {
    SpendDimension::ALL
        .iter()
        .map(|&dimension| BudgetLine {
            dimension,
            spent: dimension.of(run.spent),
            reserved: dimension.of(run.reserved),
            limit: dimension.limit(&run.limits),
        })
        .filter(|b| b.limit.is_some() || b.spent > 0 || b.reserved > 0)
        .collect()
}
