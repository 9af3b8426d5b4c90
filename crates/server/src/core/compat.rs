//! The SoundGate listener's rules in the core: its own tenant (only runs created over it), and
//! `decide` that releases the approved effect in the same step, as the reference does.

use super::*;
use estop_kernel::reply::Decided;
use estop_kernel::vocab::{HoldReason, RefusalReason};

impl Core {
    /// A SoundGate `cancel` or `close`. The listener is its own tenant: a run it did not create
    /// (a v1 run, or an id nobody used yet) is not found there, and it never pre-fences an
    /// unseen id.
    pub(super) fn sg_stop(&mut self, run: RunId, close: bool, to: ReplyTo) {
        let answer = if self.sg_owns(&run) {
            let cmd = if close {
                Command::Close { run, failed: false }
            } else {
                Command::Cancel {
                    run,
                    reason: Some("soundgate cancel".into()),
                    kill: false,
                }
            };
            self.apply(&soundgate_principal(Role::Agent), cmd)
        } else {
            not_found(run)
        };
        self.send(to, answer);
    }

    /// The reference releases an approved effect in the `decide` itself; estop records the
    /// approval and then consumes it for the compatibility client in the same step.
    pub(super) fn sg_decide(&mut self, run: RunId, key: EffectKey, approved: bool) -> Answer {
        if !self.sg_owns(&run) {
            // Exactly what a missing run gets: the listener learns nothing of other tenants.
            return not_found(run);
        }
        let operator = soundgate_principal(Role::Operator);
        let decision = if approved {
            estop_kernel::vocab::Decision::Approve
        } else {
            estop_kernel::vocab::Decision::Reject
        };
        let cmd = Command::Decide {
            run: run.clone(),
            key: key.clone(),
            decision,
            reason: None,
        };
        match self.apply_reply(&operator, cmd) {
            Ok((
                Reply::Decided(Decided {
                    status: DecideStatus::Approved,
                    ..
                }),
                _,
            )) => {
                let agent = soundgate_principal(Role::Agent);
                match self.apply_verdict(
                    &agent,
                    Command::Recheck {
                        run: run.clone(),
                        key: key.clone(),
                    },
                ) {
                    Ok(v) => Answer::Verdict(render::verdict(&run, &key, &self.opts.seal, &v)),
                    Err(a) => a,
                }
            }
            Ok((
                Reply::Decided(Decided {
                    status: DecideStatus::Rejected,
                    ..
                }),
                _,
            )) => Answer::Verdict(wire::VerdictReply::Refused {
                reason: RefusalReason::Rejected,
                message: None,
                rule: None,
                budget: None,
            }),
            Ok((
                Reply::Decided(Decided {
                    status: DecideStatus::Pending { .. },
                    ..
                }),
                _,
            )) => Answer::Verdict(wire::VerdictReply::Held {
                approval: None,
                expires_at: None,
                reason: HoldReason::Approval,
            }),
            Ok(_) => Answer::Error(
                ErrorCode::Internal,
                "unexpected kernel reply to decide".into(),
            ),
            Err(answer) => {
                // Say what the effect's state is, in the reference's vocabulary where it has one.
                let Some(r) = self.gate.run(&run) else {
                    return answer;
                };
                if r.stop.is_some() {
                    return Answer::Verdict(wire::VerdictReply::Refused {
                        reason: RefusalReason::Cancelled,
                        message: None,
                        rule: None,
                        budget: None,
                    });
                }
                match r.effects.get(&key).map(|e| e.status) {
                    Some(estop_kernel::state::Status::Refused(reason)) => {
                        Answer::Verdict(wire::VerdictReply::Refused {
                            reason,
                            message: None,
                            rule: None,
                            budget: None,
                        })
                    }
                    Some(s) if !s.is_held_or_prepared() => {
                        Answer::Verdict(wire::VerdictReply::Duplicate {
                            status: s.kind().as_str().into(),
                            outcome: None,
                            result: None,
                            error: None,
                        })
                    }
                    _ => answer,
                }
            }
        }
    }

    /// Whether the SoundGate listener created `run` (its runs belong to its principal).
    pub(super) fn sg_owns(&self, run: &RunId) -> bool {
        self.gate
            .run(run)
            .and_then(|r| r.owner.as_ref())
            .is_some_and(|o| o.as_str() == SOUNDGATE_PRINCIPAL_NAME)
    }
}

/// The name of the principal the compatibility clients act as; their runs are its own.
pub const SOUNDGATE_PRINCIPAL_NAME: &str = "soundgate";

/// The principal every compatibility client acts as (one shared identity, as in the reference).
pub fn soundgate_principal(role: Role) -> Principal {
    Principal {
        name: PrincipalName::new(SOUNDGATE_PRINCIPAL_NAME).expect("valid"),
        role,
        groups: Vec::new(),
        part: Default::default(),
    }
}
