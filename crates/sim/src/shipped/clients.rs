//! The shipped simulation's clients: what agents and operators ask the core, what they make of
//! each answer (a follow-up, a fact for the auditor), and the checks on `wait` answers.

use super::auditor::Told;
use super::{FRESH, RUNS, ShippedWorld, parent_of};
use crate::world::{Tool, Who, digest};
use estop_kernel::vocab::{Decision, Outcome};
use estop_kernel::{Admit, Command, Digest, EffectKey, RunId, RunLimits, Token, ToolName};
use estop_protocol::ErrorCode;
use estop_protocol::server_line as wire;
use estop_server::core::{Answer, CoreMsg, Out};

/// An effect acknowledged as held for approval: run, key, and its call's digest.
pub type Held = (&'static str, String, Digest);

/// A request a client sent (or will send, as a follow-up) and waits on.
#[derive(Debug, Clone)]
pub enum Asked {
    Admit {
        run: &'static str,
        key: String,
        digest: Digest,
        start: bool,
        /// Gate time it was sent (and applied) at.
        at: u64,
    },
    Wait {
        run: &'static str,
        key: String,
        digest: Digest,
        /// Monotonic time it was sent at, and its timeout.
        sent: u64,
        timeout: u64,
        at: u64,
    },
    Start {
        run: &'static str,
        key: String,
        token: Token,
        at: u64,
    },
    Complete {
        run: &'static str,
        key: String,
        token: Token,
        outcome: Outcome,
    },
    Decide {
        run: &'static str,
        key: String,
        digest: Digest,
    },
    /// Cancel, kill or close.
    Stop {
        run: &'static str,
        at: u64,
    },
    Pause,
    /// An executor's `compensations`, `compensated` or `looked_up` (the saga's auditor reads
    /// the state, not these answers).
    Saga,
}

fn rid(run: &str) -> RunId {
    RunId::new(run).expect("valid run id")
}

fn kid(key: &str) -> EffectKey {
    EffectKey::new(key).expect("valid key")
}

/// The two operators: `wire` needs both.
fn operator(rng_bit: bool) -> Who {
    if rng_bit { Who::Alice } else { Who::Bob }
}

impl ShippedWorld {
    /// An agent admits a call; the admit that creates a run sometimes gives it a deadline or
    /// a budget.
    pub(super) fn admit(&mut self, client: usize) {
        let run = *self.rng.pick(&RUNS);
        self.admit_in(client, run);
    }

    pub(super) fn admit_in(&mut self, client: usize, run: &'static str) {
        let key = format!("k{}", self.next_key);
        self.next_key += 1;
        let tool = if run == FRESH {
            Tool::Pay
        } else {
            *self.rng.pick(&[
                Tool::Pay,
                Tool::Pay,
                Tool::Search,
                Tool::Refund,
                Tool::Wire,
                Tool::Wipe,
                // Undone by the reverse saga after a cancel (`book` looked up when unknown).
                Tool::Charge,
                Tool::Book,
            ])
        };
        let d = digest(tool, u8::from(self.rng.chance(0.3)));
        let start = self.rng.chance(0.5);
        let at = self.gate_now();
        let limits = match self.rng.below(8) {
            0 => RunLimits {
                deadline_at: Some(at + 1 + self.rng.below(self.shape.wait_ms_max)),
                max_effects: None,
                max_spend: Default::default(),
                max_tokens: Default::default(),
            },
            1 => RunLimits {
                deadline_at: None,
                max_effects: Some(1 + self.rng.below(4)),
                max_spend: Default::default(),
                max_tokens: Default::default(),
            },
            _ => RunLimits::default(),
        };
        let mut policy = tool.policy();
        policy.expiry_ms = self.shape.expiry_ms;
        let cmd = Command::Admit(Admit {
            run: rid(run),
            key: kid(&key),
            tool: ToolName::new(tool.name()).expect("valid"),
            digest: d,
            args: None,
            start,
            parent: parent_of(run).map(rid),
            labels: Vec::new(),
            limits: if run == FRESH {
                RunLimits::default()
            } else {
                limits
            },
            policy: Box::new(policy),
            reserve: Default::default(),
        });
        let asked = Asked::Admit {
            run,
            key,
            digest: d,
            start,
            at,
        };
        self.send(client, Who::Agent.principal(), cmd, asked);
    }

    /// The client's next follow-up (start, complete, wait), if it has one.
    pub(super) fn follow_up(&mut self, client: usize) {
        let Some(next) = self.clients[client].todo.pop_front() else {
            return;
        };
        match next {
            Asked::Wait {
                run, key, digest, ..
            } => self.wait(client, run, key, digest),
            Asked::Start {
                run, key, token, ..
            } => {
                let cmd = Command::Start {
                    run: rid(run),
                    key: kid(&key),
                    token,
                };
                let at = self.gate_now();
                let asked = Asked::Start {
                    run,
                    key,
                    token,
                    at,
                };
                self.send(client, Who::Agent.principal(), cmd, asked);
            }
            Asked::Complete {
                run,
                key,
                token,
                outcome,
            } => {
                let cmd = Command::Complete {
                    run: rid(run),
                    key: kid(&key),
                    token,
                    outcome,
                    result: None,
                    error: None,
                    cost: Default::default(),
                };
                let asked = Asked::Complete {
                    run,
                    key,
                    token,
                    outcome,
                };
                self.send(client, Who::Agent.principal(), cmd, asked);
            }
            other => unreachable!("not a follow-up: {other:?}"),
        }
    }

    /// An operator approves or rejects an effect held for approval.
    pub(super) fn decide(&mut self, client: usize, approve: bool) {
        if self.held.is_empty() {
            return;
        }
        let pick = self.rng.index(self.held.len());
        let Some((run, key, digest)) = self.held.iter().nth(pick).cloned() else {
            return;
        };
        let cmd = Command::Decide {
            run: rid(run),
            key: kid(&key),
            decision: if approve {
                Decision::Approve
            } else {
                Decision::Reject
            },
            reason: None,
        };
        let who = operator(self.rng.chance(0.5));
        let asked = Asked::Decide { run, key, digest };
        self.send(client, who.principal(), cmd, asked);
    }

    /// An agent cancels (or kills) its run, or an operator does.
    pub(super) fn cancel(&mut self, client: usize) {
        let run = *self.rng.pick(&RUNS);
        let who = if self.rng.chance(0.5) {
            Who::Agent
        } else {
            operator(self.rng.chance(0.5))
        };
        let cmd = Command::Cancel {
            run: rid(run),
            reason: None,
            kill: self.rng.chance(0.3),
        };
        let at = self.gate_now();
        self.send(client, who.principal(), cmd, Asked::Stop { run, at });
    }

    /// An agent closes its run (completed or failed).
    pub(super) fn close(&mut self, client: usize) {
        let run = *self.rng.pick(&RUNS);
        let cmd = Command::Close {
            run: rid(run),
            failed: self.rng.chance(0.5),
        };
        let at = self.gate_now();
        self.send(client, Who::Agent.principal(), cmd, Asked::Stop { run, at });
    }

    /// An operator pauses or resumes a run.
    pub(super) fn pause(&mut self, client: usize) {
        let run: &&str = self.rng.pick(&RUNS);
        let run = rid(run);
        let cmd = if self.rng.chance(0.5) {
            Command::Pause { run }
        } else {
            Command::Resume { run }
        };
        self.send(client, Who::Alice.principal(), cmd, Asked::Pause);
    }

    /// A `wait` on an effect held for approval, parked in the core.
    pub(super) fn wait_on_held(&mut self, client: usize) {
        if self.held.is_empty() {
            return;
        }
        let pick = self.rng.index(self.held.len());
        if let Some((run, key, digest)) = self.held.iter().nth(pick).cloned() {
            self.wait(client, run, key, digest);
        }
    }

    fn wait(&mut self, client: usize, run: &'static str, key: String, digest: Digest) {
        let timeout = *self.rng.pick(&[50, 500, self.shape.wait_ms_max, 3_600_000]);
        let asked = Asked::Wait {
            run,
            key: key.clone(),
            digest,
            sent: self.mono,
            timeout,
            at: self.gate_now(),
        };
        let to = self.reply_to(client, asked);
        let msg = CoreMsg::Wait {
            principal: Who::Agent.principal(),
            run: rid(run),
            key: kid(&key),
            timeout: std::time::Duration::from_millis(timeout),
            conn: self.clients[client].conn,
            to,
        };
        let now = self.now();
        self.core().handle(now, msg);
    }

    /// Reads what every client received: facts for the auditor, follow-ups for the client.
    pub(super) fn collect(&mut self) -> Result<(), String> {
        for c in 0..self.clients.len() {
            while let Ok(out) = self.clients[c].rx.try_recv() {
                let (id, answer) = match out {
                    Out::Answer { id, answer, .. } => (id, answer),
                    Out::Event { event, after } => {
                        self.on_event(c, event, after)?;
                        continue;
                    }
                    Out::Rendered(_) => continue,
                };
                let Some(id) = id.as_u64() else { continue };
                let Some(asked) = self.clients[c].asked.remove(&id) else {
                    continue;
                };
                self.report.acked += 1;
                self.read_answer(c, id, asked, answer)
                    .map_err(|e| format!("seed {}: {e}", self.report.seed))?;
            }
        }
        Ok(())
    }

    fn told(
        &mut self,
        id: u64,
        at: u64,
        run: &'static str,
        key: &str,
        t: Told,
    ) -> Result<(), String> {
        let gate = self.core.as_ref().expect("booted").gate();
        self.auditor.told(gate, id, at, run, key, t)
    }

    fn read_answer(
        &mut self,
        c: usize,
        id: u64,
        asked: Asked,
        answer: Answer,
    ) -> Result<(), String> {
        match (asked, answer) {
            (
                Asked::Admit {
                    run,
                    key,
                    digest,
                    start,
                    at,
                },
                Answer::Verdict(v),
            ) => self.on_verdict(c, id, at, run, key, digest, start, v),
            (wait @ Asked::Wait { .. }, Answer::Verdict(v)) => self.on_wait_answer(c, id, wait, v),
            (Asked::Start { run, key, at, .. }, Answer::Verdict(v)) => {
                self.on_start_answer(c, id, at, run, key, v)
            }
            (
                Asked::Complete {
                    run, key, outcome, ..
                },
                Answer::Ack(_),
            ) => {
                self.report.completed_not_ok += u64::from(outcome != Outcome::Ok);
                self.told(id, 0, run, &key, Told::Completed)
            }
            (
                Asked::Decide {
                    run, key, digest, ..
                },
                answer,
            ) => {
                let decided = match &answer {
                    Answer::Decided(d) => d.status.as_str(),
                    // This operator approved already: the other one still may.
                    Answer::Error(ErrorCode::Conflict, _) => "held",
                    Answer::Error(..) => "not pending",
                    _ => "",
                };
                if decided != "held" {
                    // Decided, or not pending any more (expired, cancelled): stop asking.
                    self.held.remove(&(run, key.clone(), digest));
                }
                match decided {
                    "approved" => self.told(id, 0, run, &key, Told::Approved),
                    "rejected" => self.told(id, 0, run, &key, Told::Rejected { digest }),
                    _ => Ok(()),
                }
            }
            (Asked::Stop { run, at }, Answer::Ack(_)) => {
                self.told(id, at, run, "", Told::Cancelled)
            }
            _ => Ok(()),
        }
    }

    /// The answer to a parked `wait`: never `held` before its timeout.
    fn on_wait_answer(
        &mut self,
        c: usize,
        id: u64,
        wait: Asked,
        v: wire::VerdictReply,
    ) -> Result<(), String> {
        let Asked::Wait {
            run,
            key,
            digest,
            sent,
            timeout,
            at,
        } = wait
        else {
            unreachable!("a wait")
        };
        let how = match &v {
            wire::VerdictReply::Held { .. } if self.mono < sent + timeout => {
                return Err(format!(
                    "a wait on {run}/{key} sent at {sent} with a timeout of {timeout} ms was answered held at {}",
                    self.mono
                ));
            }
            wire::VerdictReply::Held { .. } => "held".to_string(),
            wire::VerdictReply::Refused { reason, .. } => format!("refused {reason}"),
            wire::VerdictReply::Admitted { .. } => "admitted".to_string(),
            other => format!("{other:?}"),
        };
        *self.report.waits.entry(how).or_default() += 1;
        self.on_verdict(c, id, at, run, key, digest, false, v)
    }

    /// The answer to a `start`: `go`, then a completion with some outcome.
    fn on_start_answer(
        &mut self,
        c: usize,
        id: u64,
        at: u64,
        run: &'static str,
        key: String,
        v: wire::VerdictReply,
    ) -> Result<(), String> {
        match v {
            wire::VerdictReply::Go => {
                self.told(id, at, run, &key, Told::Go)?;
                let outcome =
                    *self
                        .rng
                        .pick(&[Outcome::Ok, Outcome::Ok, Outcome::Error, Outcome::Unknown]);
                self.complete_later(c, run, key, outcome);
            }
            wire::VerdictReply::Duplicate { status, .. } if status == "started" => {
                self.complete_later(c, run, key, Outcome::Ok);
            }
            _ => {}
        }
        Ok(())
    }

    /// The answer to an admit or a wait: a fact, and what the client does next.
    #[allow(clippy::too_many_arguments)]
    fn on_verdict(
        &mut self,
        c: usize,
        id: u64,
        at: u64,
        run: &'static str,
        key: String,
        digest: Digest,
        started: bool,
        v: wire::VerdictReply,
    ) -> Result<(), String> {
        match v {
            wire::VerdictReply::Admitted { token, .. } => {
                let told = Told::Admitted {
                    digest,
                    token: token.clone(),
                };
                self.told(id, at, run, &key, told)?;
                if run == FRESH {
                    self.fresh_admitted.insert(c);
                }
                // Sealed for this effect by the core (the simulation's options: the test key).
                let token = estop_protocol::effect_token::TokenSeal::for_tests()
                    .open(
                        &RunId::new(run).map_err(|e| e.to_string())?,
                        &EffectKey::new(&key).map_err(|e| e.to_string())?,
                        &token,
                    )
                    .ok_or("a token the gate did not seal for this effect")?;
                if started {
                    self.complete_later(c, run, key, Outcome::Ok);
                } else {
                    let at = self.gate_now();
                    self.clients[c].todo.push_back(Asked::Start {
                        run,
                        key,
                        token,
                        at,
                    });
                }
            }
            wire::VerdictReply::Held { reason, .. } => {
                if reason == estop_kernel::vocab::HoldReason::Approval {
                    self.told(id, at, run, &key, Told::HeldForApproval)?;
                    self.held.insert((run, key.clone(), digest));
                }
                if self.rng.chance(0.5) {
                    self.clients[c].todo.push_back(Asked::Wait {
                        run,
                        key,
                        digest,
                        sent: 0,
                        timeout: 0,
                        at: 0,
                    });
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn complete_later(&mut self, c: usize, run: &'static str, key: String, outcome: Outcome) {
        let Some(token) = self.token_of(run, &key) else {
            return;
        };
        self.clients[c].todo.push_back(Asked::Complete {
            run,
            key,
            token,
            outcome,
        });
    }

    /// The token the gate holds for an effect (what the client was given at its admission).
    fn token_of(&self, run: &str, key: &str) -> Option<Token> {
        let gate = self.core.as_ref()?.gate();
        gate.run(&rid(run))?.effects.get(&kid(key))?.token
    }
}
