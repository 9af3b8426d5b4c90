//! The small world every harness works in: three runs (`p`, its child `c`, and an unrelated
//! `s`), four keys, six tools with fixed policy decisions, two agents and three operators. An
//! `Op` is one thing a client can do (or time passing); it becomes a kernel `Command` here, and
//! the reference model reads the same `Op` directly. `View` is what both sides must agree on
//! after every step: the observable state of every run and effect.

use estop_kernel::command::{Admit, PolicyDecision, RunLimits, SagaAction, SagaStep};
use estop_kernel::reply::{DecideStatus, Decided, KernelError, Reply, Verdict};
use estop_kernel::state::Status;
use estop_kernel::vocab::{Decision, EffectClass, Outcome, PolicyAction, Reversibility};
use estop_kernel::{
    Command, Digest, EffectKey, Gate, Principal, PrincipalName, Role, RunId, Token, ToolName,
};
use std::collections::BTreeMap;
use std::fmt;

pub const RUNS: [&str; 3] = ["p", "c", "s"];
pub const KEYS: [&str; 4] = ["a", "b", "c", "d"];

/// The parent every admit of a run names (`c` is a sub-agent of `p`).
/// The differential's bounds: tight enough that the per-principal shares of runs and held
/// effects, the operators' reserve and the tombstone bound are all reached in three runs.
pub fn limits() -> estop_kernel::Limits {
    estop_kernel::Limits {
        runs_max: 4,
        runs_per_principal_max: 2,
        held_max: 4,
        held_per_principal_max: 3,
        tombstones_max: 1,
        ..estop_kernel::Limits::default()
    }
}

/// `limits()` as the reference model reads them.
pub fn bounds() -> crate::model::Bounds {
    let l = limits();
    crate::model::Bounds {
        runs_max: l.runs_max,
        runs_per_principal_max: l.runs_per_principal_max,
        held_max: l.held_max,
        held_per_principal_max: l.held_per_principal_max,
        tombstones_max: l.tombstones_max,
    }
}

pub fn parent_of(run: u8) -> Option<u8> {
    (run == 1).then_some(0)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Who {
    Agent,
    Agent2,
    Alice,
    Bob,
    Carol,
    /// An observer: reads, and every command it sends is refused.
    Olive,
}

impl Who {
    pub const ALL: [Who; 6] = [
        Who::Agent,
        Who::Agent2,
        Who::Alice,
        Who::Bob,
        Who::Carol,
        Who::Olive,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Who::Agent => "agent",
            Who::Agent2 => "agent2",
            Who::Alice => "alice",
            Who::Bob => "bob",
            Who::Carol => "carol",
            Who::Olive => "olive",
        }
    }
    pub fn is_operator(self) -> bool {
        matches!(self, Who::Alice | Who::Bob | Who::Carol)
    }
    /// Approver groups the principal's token carries.
    pub fn groups(self) -> &'static [&'static str] {
        match self {
            Who::Bob => &["ops"],
            Who::Carol => &["finance"],
            _ => &[],
        }
    }
    pub fn principal(self) -> Principal {
        Principal {
            name: PrincipalName::new(self.name()).expect("valid"),
            role: match self {
                Who::Olive => Role::Observer,
                w if w.is_operator() => Role::Operator,
                _ => Role::Agent,
            },
            groups: self.groups().iter().map(|g| (*g).into()).collect(),
            part: Default::default(),
        }
    }
}

/// A tool and the policy decision the shell would have evaluated for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tool {
    /// allow, write
    Pay,
    /// allow, read
    Search,
    /// approval by 1, expires after 50 ms
    Refund,
    /// approval by 2 distinct principals, expires after 80 ms
    Wire,
    /// approval by 2, one from `finance` and one from `ops`, expires after 80 ms
    Payout,
    /// deny
    Wipe,
    /// allow, write, undone by `uncharge` (the reverse saga after a cancel)
    Charge,
    /// allow, write, undone by `unbook`; its unknown outcome is looked up by `find_booking`
    Book,
}

impl Tool {
    pub const ALL: [Tool; 8] = [
        Tool::Pay,
        Tool::Search,
        Tool::Refund,
        Tool::Wire,
        Tool::Payout,
        Tool::Wipe,
        Tool::Charge,
        Tool::Book,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Tool::Pay => "pay",
            Tool::Search => "search",
            Tool::Refund => "refund",
            Tool::Wire => "wire",
            Tool::Payout => "payout",
            Tool::Wipe => "wipe",
            Tool::Charge => "charge",
            Tool::Book => "book",
        }
    }
    pub fn action(self) -> PolicyAction {
        match self {
            Tool::Pay | Tool::Search | Tool::Charge | Tool::Book => PolicyAction::Allow,
            Tool::Refund | Tool::Wire | Tool::Payout => PolicyAction::Approve,
            Tool::Wipe => PolicyAction::Deny,
        }
    }
    pub fn is_write(self) -> bool {
        self != Tool::Search
    }
    /// Whether a cancel owes its undo (the run stays finalizing until the saga settles).
    pub fn compensable(self) -> bool {
        matches!(self, Tool::Charge | Tool::Book)
    }
    /// Whether its rule declares a `lookup` (an unknown outcome is looked up before a human is
    /// asked).
    pub fn has_lookup(self) -> bool {
        self == Tool::Book
    }
    pub fn quorum(self) -> u32 {
        match self {
            Tool::Wire | Tool::Payout => 2,
            _ => 1,
        }
    }
    pub fn groups(self) -> &'static [&'static str] {
        match self {
            Tool::Payout => &["finance", "ops"],
            _ => &[],
        }
    }
    pub fn expiry_ms(self) -> u64 {
        match self {
            Tool::Refund => 50,
            _ => 80,
        }
    }
    /// The generated policy's `approve` rule on this tool's compensating call (docs/POLICY.md
    /// "A compensating call is checked against the policy like any call"): quorum, groups and
    /// expiry. `uncharge` needs two approvers, one of them from `finance`, within 3 s; `unbook`
    /// one approver, and its expiry is long enough never to pass in a trace. `None`: no rule.
    pub fn undo_rule(self) -> Option<(u32, &'static [&'static str], u64)> {
        match self {
            Tool::Charge => Some((2, &["finance"], 3_000)),
            Tool::Book => Some((1, &[], 3_600_000)),
            _ => None,
        }
    }
    /// The approval a hold of this tool's compensating call asks for (`undo_rule`, else quorum
    /// 1 within 50 ms).
    pub fn undo_approval(self) -> (u32, &'static [&'static str], u64) {
        self.undo_rule().unwrap_or((1, &[], 50))
    }
    pub fn policy(self) -> PolicyDecision {
        PolicyDecision {
            action: self.action(),
            class: if self.is_write() {
                EffectClass::Write
            } else {
                EffectClass::Read
            },
            reversibility: if self.compensable() {
                Reversibility::Compensable
            } else {
                Reversibility::Undeclared
            },
            compensate: match self {
                Tool::Charge => Some(ToolName::new("uncharge").expect("valid")),
                Tool::Book => Some(ToolName::new("unbook").expect("valid")),
                _ => None,
            },
            compensate_args: None,
            lookup: self
                .has_lookup()
                .then(|| ToolName::new("find_booking").expect("valid")),
            lookup_args: None,
            quorum: self.quorum(),
            groups: self.groups().iter().map(|g| (*g).into()).collect(),
            expiry_ms: self.expiry_ms(),
            rule: self.name().into(),
        }
    }
}

/// The digest of a call: tool and argument (two calls are the same call iff both match).
pub fn digest(tool: Tool, arg: u8) -> Digest {
    let mut d = [0u8; 32];
    d[0] = tool as u8 + 1;
    d[1] = arg;
    Digest(d)
}

/// Which token a `start`/`complete` presents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tok {
    /// The one the gate issued for this effect (what an honest agent sends).
    Issued,
    /// One the gate never issued.
    Bogus,
}

pub const BOGUS_TOKEN: Token = Token {
    epoch: 7,
    serial: 999,
};

/// A step of the reverse saga (docs/PROTOCOL.md `compensated`, `looked_up`, `saga`): an
/// executor's, the gate's own, or an operator's. Attempts are absolute numbers, so a repeated,
/// stale or future report is as easy to draw as the due one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SagaOp {
    /// An executor begins attempt `attempt` of the effect's compensation.
    Begin { attempt: u8 },
    /// An executor reports how attempt `attempt` ended.
    End { attempt: u8, outcome: Outcome },
    /// An executor begins lookup `attempt` of an unknown outcome.
    LookupBegin { attempt: u8 },
    /// An executor reports what lookup `attempt` found.
    LookupEnd { attempt: u8, outcome: Outcome },
    /// The due attempt `attempt` cannot be issued (its arguments, or a policy rule).
    Blocked { attempt: u8 },
    /// The shell finds the due attempt `attempt` matched by an `approve` rule (the rule of
    /// `of`'s compensating call, `Tool::undo_rule`; quorum 1 within 50 ms for a tool without
    /// one) and holds it for an approval.
    Held { attempt: u8, of: Tool },
    /// The shell finds approval `approval` of the compensating call expired unmet.
    Expired { approval: u8 },
    /// An operator settles an unknown outcome or a call left in flight.
    Settle { outcome: Outcome },
    /// An operator retries a failed or abandoned compensation, or an inconclusive lookup.
    Retry,
    /// An operator skips the effect's compensation (with a reason).
    Skip,
    /// An operator asks for this one effect's compensation in a run stopped without a saga.
    Compensate,
    /// The gate takes a call left in flight `after_ms` after the stop for unreported.
    Unreported { after_ms: u16 },
}

impl SagaOp {
    /// Whether only an operator may ask for it (the `saga` verb).
    pub fn operators_only(self) -> bool {
        matches!(
            self,
            SagaOp::Settle { .. } | SagaOp::Retry | SagaOp::Skip | SagaOp::Compensate
        )
    }

    /// Whether only an operator may take it: the `saga` verb's, and the steps the gate's own
    /// shell takes (as its system operator) after evaluating the policy or a deadline.
    pub fn by_operator(self) -> bool {
        self.operators_only()
            || matches!(
                self,
                SagaOp::Unreported { .. } | SagaOp::Held { .. } | SagaOp::Expired { .. }
            )
    }
}

/// `limits = 3`: a run's `max_spend` (micro-USD) in traces.
pub const SPEND_LIMIT_USD: u64 = 50;
/// `limits = 4`: a run's `max_tokens` in traces.
pub const SPEND_LIMIT_TOKENS: u64 = 18;

/// The model spend a trace's `reserve` / `cost` of `n` stands for: (micro-USD, tokens). A
/// run limits one dimension (`limits` 3 or 4), its parent possibly the other.
pub fn spend(n: u8) -> (u64, u64) {
    let n = u64::from(n);
    (10 * n, 4 * n)
}

fn spend_of(n: u8) -> estop_kernel::Spend {
    let (usd_micros, tokens) = spend(n);
    estop_kernel::Spend { usd_micros, tokens }
}

/// One step of a trace: a client request, or time passing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// `limits`: 0 none, 1 `max_effects = 2`, 2 deadline 100 ms from now, 3 `max_spend =
    /// SPEND_LIMIT_USD`, 4 `max_tokens = SPEND_LIMIT_TOKENS` (apply at creation). `reserve`:
    /// the model reservation, `spend(reserve)` (0: none).
    Admit {
        who: Who,
        run: u8,
        key: u8,
        tool: Tool,
        arg: u8,
        start: bool,
        limits: u8,
        reserve: u8,
    },
    Wait {
        who: Who,
        run: u8,
        key: u8,
    },
    Start {
        who: Who,
        run: u8,
        key: u8,
        tok: Tok,
    },
    /// `cost`: the model spend settled, `spend(cost)` (0: none).
    Complete {
        who: Who,
        run: u8,
        key: u8,
        tok: Tok,
        outcome: Outcome,
        cost: u8,
    },
    Decide {
        who: Who,
        run: u8,
        key: u8,
        approve: bool,
    },
    Cancel {
        who: Who,
        run: u8,
        kill: bool,
    },
    Pause {
        who: Who,
        run: u8,
    },
    Resume {
        who: Who,
        run: u8,
    },
    Close {
        who: Who,
        run: u8,
        failed: bool,
    },
    Tick {
        run: u8,
    },
    /// A step of the reverse saga of effect `key`.
    Saga {
        who: Who,
        run: u8,
        key: u8,
        step: SagaOp,
    },
    Advance {
        ms: u16,
    },
    /// Retention: forget runs stopped `retention` ms ago or earlier, drop the fences of runs
    /// stopped `grave_retention` ms ago or earlier.
    Compact {
        retention: u16,
        grave_retention: u16,
    },
}

/// The run an op names, if it names one.
pub fn run_of(op: &Op) -> Option<u8> {
    match op {
        Op::Admit { run, .. }
        | Op::Wait { run, .. }
        | Op::Start { run, .. }
        | Op::Complete { run, .. }
        | Op::Decide { run, .. }
        | Op::Cancel { run, .. }
        | Op::Pause { run, .. }
        | Op::Resume { run, .. }
        | Op::Close { run, .. }
        | Op::Saga { run, .. }
        | Op::Tick { run } => Some(*run),
        Op::Advance { .. } | Op::Compact { .. } => None,
    }
}

impl Op {
    /// Who sends it (`None` for time passing).
    pub fn who(&self) -> Option<Who> {
        match *self {
            Op::Admit { who, .. }
            | Op::Wait { who, .. }
            | Op::Start { who, .. }
            | Op::Complete { who, .. }
            | Op::Decide { who, .. }
            | Op::Cancel { who, .. }
            | Op::Pause { who, .. }
            | Op::Resume { who, .. }
            | Op::Saga { who, .. }
            | Op::Close { who, .. } => Some(who),
            Op::Tick { .. } | Op::Advance { .. } | Op::Compact { .. } => None,
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = |i: &u8| RUNS[*i as usize];
        let k = |i: &u8| KEYS[*i as usize];
        match self {
            Op::Admit {
                who,
                run,
                key,
                tool,
                arg,
                start,
                limits,
                reserve,
            } => {
                write!(
                    f,
                    "{} admit {} {} {} arg={arg}",
                    who.name(),
                    r(run),
                    k(key),
                    tool.name()
                )?;
                if !start {
                    f.write_str(" start=false")?;
                }
                if *reserve > 0 {
                    write!(f, " reserve={:?}", spend(*reserve))?;
                }
                match limits {
                    1 => f.write_str(" max=2"),
                    2 => f.write_str(" deadline=+100"),
                    3 => write!(f, " max_spend={SPEND_LIMIT_USD}"),
                    4 => write!(f, " max_tokens={SPEND_LIMIT_TOKENS}"),
                    _ => Ok(()),
                }
            }
            Op::Wait { who, run, key } => write!(f, "{} wait {} {}", who.name(), r(run), k(key)),
            Op::Start { who, run, key, tok } => {
                write!(f, "{} start {} {} {tok:?}", who.name(), r(run), k(key))
            }
            Op::Complete {
                who,
                run,
                key,
                tok,
                outcome,
                cost,
            } => {
                write!(
                    f,
                    "{} complete {} {} {tok:?} {outcome}",
                    who.name(),
                    r(run),
                    k(key)
                )?;
                if *cost > 0 {
                    write!(f, " cost={:?}", spend(*cost))?;
                }
                Ok(())
            }
            Op::Decide {
                who,
                run,
                key,
                approve,
            } => {
                let d = if *approve { "approve" } else { "reject" };
                write!(f, "{} {d} {} {}", who.name(), r(run), k(key))
            }
            Op::Cancel { who, run, kill } => {
                write!(
                    f,
                    "{} {} {}",
                    who.name(),
                    if *kill { "kill" } else { "cancel" },
                    r(run)
                )
            }
            Op::Pause { who, run } => write!(f, "{} pause {}", who.name(), r(run)),
            Op::Resume { who, run } => write!(f, "{} resume {}", who.name(), r(run)),
            Op::Close { who, run, failed } => {
                write!(
                    f,
                    "{} {} {}",
                    who.name(),
                    if *failed { "fail" } else { "close" },
                    r(run)
                )
            }
            Op::Tick { run } => write!(f, "tick {}", r(run)),
            Op::Saga {
                who,
                run,
                key,
                step,
            } => write!(f, "{} saga {} {} {step:?}", who.name(), r(run), k(key)),
            Op::Advance { ms } => write!(f, "+{ms}ms"),
            Op::Compact {
                retention,
                grave_retention,
            } => write!(f, "compact -{retention}ms -{grave_retention}ms"),
        }
    }
}

fn run_id(i: u8) -> RunId {
    RunId::new(RUNS[i as usize]).expect("valid")
}

fn key_id(i: u8) -> EffectKey {
    EffectKey::new(KEYS[i as usize]).expect("valid")
}

/// The kernel command for an op (`None` for time passing). `issued` is the token the gate gave
/// this effect, if any.
pub fn command(op: &Op, now: u64, issued: Option<Token>) -> Option<(Principal, Command)> {
    let tok = |t: &Tok| match t {
        Tok::Issued => issued.unwrap_or(Token {
            epoch: 1,
            serial: 0,
        }),
        Tok::Bogus => BOGUS_TOKEN,
    };
    let cmd = match op {
        Op::Admit {
            who,
            run,
            key,
            tool,
            arg,
            start,
            limits,
            reserve,
        } => (
            *who,
            Command::Admit(Admit {
                run: run_id(*run),
                key: key_id(*key),
                tool: ToolName::new(tool.name()).expect("valid"),
                digest: digest(*tool, *arg),
                args: None,
                start: *start,
                parent: parent_of(*run).map(run_id),
                labels: vec![],
                limits: RunLimits {
                    deadline_at: (*limits == 2).then_some(now + 100),
                    max_effects: (*limits == 1).then_some(2),
                    max_spend: (*limits == 3).then_some(SPEND_LIMIT_USD),
                    max_tokens: (*limits == 4).then_some(SPEND_LIMIT_TOKENS),
                },
                policy: Box::new(tool.policy()),
                reserve: spend_of(*reserve),
            }),
        ),
        Op::Wait { who, run, key } => (
            *who,
            Command::Recheck {
                run: run_id(*run),
                key: key_id(*key),
            },
        ),
        Op::Start {
            who,
            run,
            key,
            tok: t,
        } => (
            *who,
            Command::Start {
                run: run_id(*run),
                key: key_id(*key),
                token: tok(t),
            },
        ),
        Op::Complete {
            who,
            run,
            key,
            tok: t,
            outcome,
            cost,
        } => (
            *who,
            Command::Complete {
                run: run_id(*run),
                key: key_id(*key),
                token: tok(t),
                outcome: *outcome,
                result: None,
                error: None,
                cost: spend_of(*cost),
            },
        ),
        Op::Decide {
            who,
            run,
            key,
            approve,
        } => (
            *who,
            Command::Decide {
                run: run_id(*run),
                key: key_id(*key),
                decision: if *approve {
                    Decision::Approve
                } else {
                    Decision::Reject
                },
                reason: None,
            },
        ),
        Op::Cancel { who, run, kill } => (
            *who,
            Command::Cancel {
                run: run_id(*run),
                reason: None,
                kill: *kill,
            },
        ),
        Op::Pause { who, run } => (*who, Command::Pause { run: run_id(*run) }),
        Op::Resume { who, run } => (*who, Command::Resume { run: run_id(*run) }),
        Op::Close { who, run, failed } => (
            *who,
            Command::Close {
                run: run_id(*run),
                failed: *failed,
            },
        ),
        Op::Saga {
            who,
            run,
            key,
            step,
        } => (*who, saga_command(run_id(*run), key_id(*key), *step)),
        // The server's timer ticks as the system operator.
        Op::Tick { run } => (Who::Alice, Command::Tick { run: run_id(*run) }),
        // The server's retention runs as the system operator.
        Op::Compact {
            retention,
            grave_retention,
        } => (
            Who::Alice,
            Command::Compact {
                before: now.saturating_sub(u64::from(*retention)),
                tombstones_before: now.saturating_sub(u64::from(*grave_retention)),
            },
        ),
        Op::Advance { .. } => return None,
    };
    Some((cmd.0.principal(), cmd.1))
}

/// The kernel command of a saga step.
fn saga_command(run: RunId, key: EffectKey, step: SagaOp) -> Command {
    let saga_step = |step| Command::SagaStep {
        run: run.clone(),
        key: key.clone(),
        step,
    };
    let action = |action| Command::Saga {
        run: run.clone(),
        key: key.clone(),
        action,
    };
    match step {
        SagaOp::Begin { attempt } => Command::CompensationBegin {
            run: run.clone(),
            key: key.clone(),
            attempt: u32::from(attempt),
            args: None,
        },
        SagaOp::End { attempt, outcome } => Command::CompensationEnd {
            run: run.clone(),
            key: key.clone(),
            attempt: u32::from(attempt),
            outcome,
            error: None,
        },
        SagaOp::LookupBegin { attempt } => saga_step(SagaStep::LookupBegin {
            attempt: u32::from(attempt),
        }),
        SagaOp::LookupEnd { attempt, outcome } => saga_step(SagaStep::LookupEnd {
            attempt: u32::from(attempt),
            outcome,
            result: None,
            error: None,
        }),
        SagaOp::Blocked { attempt } => saga_step(SagaStep::Blocked {
            attempt: u32::from(attempt),
            reason: "the policy refuses it".into(),
        }),
        SagaOp::Held { attempt, of } => {
            let (quorum, groups, expiry_ms) = of.undo_approval();
            saga_step(SagaStep::Held {
                attempt: u32::from(attempt),
                quorum,
                groups: groups.iter().map(|g| (*g).into()).collect(),
                expiry_ms,
                args: None,
                reason: "the policy's undo rule asks for approval".into(),
            })
        }
        SagaOp::Expired { approval } => saga_step(SagaStep::Expired {
            approval: u64::from(approval),
        }),
        SagaOp::Unreported { after_ms } => saga_step(SagaStep::Unreported {
            after_ms: u64::from(after_ms),
        }),
        SagaOp::Settle { outcome } => action(SagaAction::Settle {
            outcome,
            result: None,
        }),
        SagaOp::Retry => action(SagaAction::Retry),
        SagaOp::Skip => action(SagaAction::Skip {
            reason: "not worth undoing".into(),
        }),
        SagaOp::Compensate => action(SagaAction::Compensate),
    }
}

/// The run and key an op addresses (for looking up its issued token).
pub fn target(op: &Op) -> Option<(u8, u8)> {
    match op {
        Op::Admit { run, key, .. }
        | Op::Wait { run, key, .. }
        | Op::Start { run, key, .. }
        | Op::Complete { run, key, .. }
        | Op::Decide { run, key, .. } => Some((*run, *key)),
        _ => None,
    }
}

/// A normalized answer: what a client sees, plus whether the gate recorded a change.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Answer {
    pub text: String,
    pub changed: bool,
}

/// Renders a kernel result the way `Answer`s are compared.
pub fn answer_of(r: &Result<estop_kernel::Applied, KernelError>) -> Answer {
    match r {
        Err(e) => Answer {
            text: format!("error {}", e.code()),
            changed: false,
        },
        Ok(a) => Answer {
            text: render_reply(&a.reply),
            changed: a.changed,
        },
    }
}

pub fn render_verdict(v: &Verdict) -> String {
    match v {
        Verdict::Admitted { token } => format!("admitted {token}"),
        Verdict::Go => "go".into(),
        Verdict::Held {
            reason,
            approval,
            expires_at,
        } => {
            let mut s = format!("held {reason}");
            if let Some(a) = approval {
                s.push_str(&format!(" #{a}"));
            }
            if let Some(e) = expires_at {
                s.push_str(&format!(" until {e}"));
            }
            s
        }
        Verdict::Refused { reason, over } => match over {
            None => format!("refused {reason}"),
            Some(o) => format!(
                "refused {reason} {} of {} used={} limit={}",
                o.dimension.as_str(),
                o.run,
                o.used,
                o.limit
            ),
        },
        Verdict::Duplicate {
            status, outcome, ..
        } => match outcome {
            Some(o) => format!("duplicate {status} {o}"),
            None => format!("duplicate {status}"),
        },
    }
}

pub fn render_reply(r: &Reply) -> String {
    match r {
        Reply::Verdict(v) => render_verdict(v),
        Reply::Completed { late } => format!("completed late={late}"),
        Reply::Disputed { .. } => "disputed".into(),
        Reply::Decided(Decided {
            status: DecideStatus::Approved,
            ..
        }) => "decided approved".into(),
        Reply::Decided(Decided {
            status: DecideStatus::Rejected,
            ..
        }) => "decided rejected".into(),
        Reply::Decided(Decided {
            status:
                DecideStatus::Pending {
                    approvals,
                    quorum,
                    missing_groups,
                },
            ..
        }) => {
            format!(
                "decided pending {approvals}/{quorum} missing=[{}]",
                missing_groups.join(",")
            )
        }
        Reply::RunState {
            state,
            runs_changed,
        } => format!("run {state} changed={runs_changed}"),
        Reply::Compacted { runs, tombstones } => format!("forgot {runs} dropped {tombstones}"),
        Reply::TokenRecorded => "token recorded".into(),
        Reply::Compensation {
            status,
            attempt,
            retry_at,
        } => format!("compensation {status} attempt={attempt} retry_at={retry_at:?}"),
    }
}

/// The observable state of one effect.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EffectView {
    pub tool: String,
    /// `held(approval)`, `approved`, `admitted`, `started`, `completed`, `refused(cancelled)`, ...
    pub status: String,
    pub token: Option<(u32, u64)>,
    /// Once requested: (approval id, expires_at, approvers in order).
    pub approval: Option<(u64, u64, Vec<String>)>,
    pub late: bool,
    pub outcome: Option<String>,
    /// The reverse saga's counts: compensation attempts begun, lookups begun, whether an
    /// operator chose it, and when a failed attempt is offered again.
    pub saga: SagaView,
}

/// What is observable of an effect's compensation (all zero before its saga touched it).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct SagaView {
    pub attempts: u32,
    pub lookups: u32,
    pub chosen: bool,
    pub retry_at: Option<u64>,
    /// The approval a policy `approve` rule asked for its compensating call, once requested
    /// and until a retry spends an unmet one: id, expires_at, approvers in order, who rejected.
    pub approval: Option<(u64, u64, Vec<String>, Option<String>)>,
}

/// The observable state of one run.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RunView {
    pub owner: Option<String>,
    pub parent: Option<String>,
    pub children: Vec<String>,
    pub state: String,
    pub cause: Option<String>,
    pub from: Option<String>,
    pub epoch: u32,
    pub admitted: u64,
    pub pending: u32,
    pub in_flight: u32,
    pub deadline: Option<u64>,
    pub max_effects: Option<u64>,
    pub max_spend: Option<u64>,
    pub max_tokens: Option<u64>,
    /// What the run's subtree spent and has reserved: (micro-USD, tokens).
    pub spent: (u64, u64),
    pub reserved: (u64, u64),
    pub rejected: Vec<Digest>,
    pub effects: BTreeMap<String, EffectView>,
    /// When it was stopped, once it has.
    pub stopped_at: Option<u64>,
    /// Retention forgot it: only its fence is left (owner, state, cause, epoch, stop time).
    pub forgotten: bool,
    /// The saga's head and what it waits for (`saga_next`): `in_flight`, `settle`, `lookup n`,
    /// `looking_up n`, `begin n at t`, `approval #id until t`, `running n`, `human`.
    pub saga_next: Option<(String, String)>,
}

pub type View = BTreeMap<String, RunView>;

pub fn status_text(s: Status) -> String {
    match s {
        Status::Held(r) => format!("held({r})"),
        Status::Refused(r) => format!("refused({r})"),
        other => other.kind().to_string(),
    }
}

/// The kernel's state as a `View`.
pub fn view_of(gate: &Gate) -> View {
    let mut out = View::new();
    for (id, run) in gate.runs() {
        let effects = run
            .effects
            .iter()
            .map(|(k, e)| {
                let approval = e.approval.as_ref().filter(|a| a.id != 0).map(|a| {
                    (
                        a.id,
                        a.expires_at,
                        a.approvers.iter().map(|x| x.name.to_string()).collect(),
                    )
                });
                (
                    k.to_string(),
                    EffectView {
                        tool: e.tool.to_string(),
                        status: status_text(e.status),
                        token: e.token.map(|t| (t.epoch, t.serial)),
                        approval,
                        late: e.late,
                        outcome: e.outcome_kind().map(|o| o.to_string()),
                        saga: e
                            .saga
                            .as_deref()
                            .map_or_else(SagaView::default, |c| SagaView {
                                attempts: c.attempts,
                                lookups: c.lookups,
                                chosen: c.chosen,
                                retry_at: (e.status == Status::CompensationFailed)
                                    .then_some(c.retry_at),
                                approval: c.approval.as_deref().map(|a| {
                                    (
                                        a.id,
                                        a.expires_at,
                                        a.approvers.iter().map(|x| x.name.to_string()).collect(),
                                        a.rejected_by.as_ref().map(ToString::to_string),
                                    )
                                }),
                            }),
                    },
                )
            })
            .collect();
        out.insert(
            id.to_string(),
            RunView {
                owner: run.owner.as_ref().map(ToString::to_string),
                parent: run.parent.as_ref().map(ToString::to_string),
                children: run.children.iter().map(ToString::to_string).collect(),
                state: run.state.to_string(),
                cause: run.stop.as_ref().map(|s| s.cause.to_string()),
                from: run
                    .stop
                    .as_ref()
                    .and_then(|s| s.from.as_ref())
                    .map(ToString::to_string),
                epoch: run.epoch,
                admitted: run.admitted,
                pending: run.pending_approvals,
                in_flight: run.in_flight,
                deadline: run.limits.deadline_at,
                max_effects: run.limits.max_effects,
                max_spend: run.limits.max_spend,
                max_tokens: run.limits.max_tokens,
                spent: (run.spent.usd_micros, run.spent.tokens),
                reserved: (run.reserved.usd_micros, run.reserved.tokens),
                rejected: run.rejected.iter().copied().collect(),
                effects,
                stopped_at: run.stop.as_ref().map(|s| s.at),
                forgotten: false,
                saga_next: estop_kernel::saga::next(run)
                    .map(|(k, n)| (k.to_string(), next_text(n))),
            },
        );
    }
    for (id, t) in gate.tombstones() {
        out.insert(
            id.to_string(),
            RunView {
                owner: t.owner.as_ref().map(ToString::to_string),
                parent: None,
                children: vec![],
                state: t.cause.terminal_state().to_string(),
                cause: Some(t.cause.to_string()),
                from: None,
                epoch: t.epoch,
                admitted: 0,
                pending: 0,
                in_flight: 0,
                deadline: None,
                max_effects: None,
                max_spend: None,
                max_tokens: None,
                spent: (0, 0),
                reserved: (0, 0),
                rejected: vec![],
                effects: BTreeMap::new(),
                stopped_at: Some(t.stopped_at),
                forgotten: true,
                saga_next: None,
            },
        );
    }
    out
}

/// The kernel's `Next` as the view shows it.
fn next_text(n: estop_kernel::saga::Next) -> String {
    use estop_kernel::saga::Next;
    match n {
        Next::InFlight => "in_flight".into(),
        Next::Settle => "settle".into(),
        Next::Lookup { attempt } => format!("lookup {attempt}"),
        Next::LookingUp { attempt } => format!("looking_up {attempt}"),
        Next::Begin { attempt, at } => format!("begin {attempt} at {at}"),
        Next::Approval { id, expires_at } => format!("approval #{id} until {expires_at}"),
        Next::Running { attempt } => format!("running {attempt}"),
        Next::Human => "human".into(),
    }
}
