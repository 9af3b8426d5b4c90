//! One front door: what a typed request asks of the gate, decided in one place for every
//! transport. [`route`] checks who may ask (before `hello`, by role), applies the rules every
//! front door shares (the `wait` bound, `cascade=false`, an admission token's shape, listing
//! pages, policy for an `admit`) and maps the verb to what serves it: an answer at once, a core
//! message, work beside the core (a read of the ledger, a token change), or a verb about the
//! connection itself. Protocol v1 (`conn`) and the HTTP API (the console) only add their
//! transport: where the answer goes and what a connection holds.

use crate::core::{Answer, CoreMsg, Query, ReplyTo};
use crate::shared::Shared;
use estop_kernel::vocab::{PolicyAction, RefusalReason};
use estop_kernel::{
    Admit as KAdmit, Command, EffectKey, Principal, PrincipalName, Role, RunId, RunLimits,
    SagaStep, Token,
};
use estop_ledger::{FileStorage, inspect};
use estop_policy::{EvalError, Policy};
use estop_protocol::page::Weight;
use estop_protocol::server_line as wire;
use estop_protocol::{CloseOutcome, ErrorCode, Op, PageBudget, Secret, Verb};
use std::sync::Arc;
use std::time::Duration;

/// What serves a request.
// `Ask` carries the command inline (an admission with its policy decision); a route is built
// and moved once per request, so boxing it would cost an allocation on the hot path to save
// bytes that are never copied in bulk.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Route {
    /// Answered at once, without the core: a refusal, or `ping`.
    Answer(Answer),
    /// A message for the core, once the front door says where its answer goes.
    Core(Ask),
    /// Work beside the core that the front door awaits ([`Work::run`]).
    Work(Work),
    /// A verb about the connection itself: served by a front door with connections, refused
    /// by one without.
    Conn(ConnVerb),
}

/// A core message without its reply address ([`Ask::message`] adds it).
// Inline for the reason `Route` is: built and moved once per request.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Ask {
    Apply { principal: Principal, cmd: Command },
    Query { principal: Principal, query: Query },
}

impl Ask {
    /// The message, answered to `to`.
    pub fn message(self, to: ReplyTo) -> CoreMsg {
        match self {
            Ask::Apply { principal, cmd } => CoreMsg::Apply { principal, cmd, to },
            Ask::Query { principal, query } => CoreMsg::Query {
                principal,
                query,
                to,
            },
        }
    }
}

/// Work beside the core: it blocks on a file or waits for the core itself, so the front door
/// runs it where it may wait.
#[derive(Debug)]
pub enum Work {
    /// The `ledger` verb: durable records read from the ledger's files.
    Ledger {
        run: Option<RunId>,
        after: u64,
        page: PageBudget,
    },
    /// `token`: the registry, then a `Command::Token` record (`tokenops`).
    TokenCreate {
        actor: Principal,
        name: PrincipalName,
        role: Role,
        groups: Vec<String>,
    },
    /// `token_revoke`: the registry, then a `Command::Token` record (`tokenops`).
    TokenRevoke {
        actor: Principal,
        name: PrincipalName,
    },
}

impl Work {
    pub async fn run(self, shared: &Arc<Shared>) -> Answer {
        match self {
            Work::Ledger { run, after, page } => {
                let dir = shared.ledger_dir.clone();
                let store = shared.store.clone();
                let durable = shared.durable_rx.borrow().seq;
                let res = tokio::task::spawn_blocking(move || match store {
                    Some(target) => pg_ledger_entries(&target, run.as_ref(), after, durable, page),
                    None => ledger_entries(&dir, run.as_ref(), after, durable, page),
                })
                .await;
                match res {
                    Ok(Ok(reply)) => Answer::Ledger(reply),
                    Ok(Err(e)) => err(ErrorCode::Unavailable, e),
                    Err(e) => err(ErrorCode::Internal, e.to_string()),
                }
            }
            Work::TokenCreate {
                actor,
                name,
                role,
                groups,
            } => crate::tokenops::create(shared, &actor, name, role, groups).await,
            Work::TokenRevoke { actor, name } => {
                crate::tokenops::revoke(shared, &actor, name).await
            }
        }
    }
}

/// A verb about the connection it came on.
#[derive(Debug)]
pub enum ConnVerb {
    /// Authenticate the connection with this secret (as run `run`'s sandbox when given), as
    /// the principal's part `component`.
    Hello {
        token: Secret,
        run: Option<RunId>,
        component: estop_kernel::Part,
    },
    /// Block until the effect settles or `timeout` passes (within `wait_ms_max`); the wait ends
    /// with its connection.
    Wait {
        principal: Principal,
        run: RunId,
        key: EffectKey,
        timeout: Duration,
    },
    /// Events of `run` on this connection, until it ends.
    Subscribe { principal: Principal, run: RunId },
    /// No more events of `run` on this connection; answered at once.
    Unsubscribe { run: RunId },
    /// This connection runs compensations (of `run`, or of every run the principal sees).
    Compensations {
        principal: Principal,
        run: Option<RunId>,
        tool: Option<estop_policy::ToolPattern>,
    },
}

impl ConnVerb {
    pub fn verb(&self) -> Verb {
        match self {
            ConnVerb::Hello { .. } => Verb::Hello,
            ConnVerb::Wait { .. } => Verb::Wait,
            ConnVerb::Subscribe { .. } => Verb::Subscribe,
            ConnVerb::Unsubscribe { .. } => Verb::Unsubscribe,
            ConnVerb::Compensations { .. } => Verb::Compensations,
        }
    }
}

fn err(code: ErrorCode, msg: impl Into<String>) -> Answer {
    Answer::Error(code, msg.into())
}

/// What serves `op` asked by `principal` (`None`: a connection that has not said `hello`).
pub fn route(shared: &Shared, principal: Option<&Principal>, op: Op) -> Route {
    match (op, principal) {
        (
            Op::Hello {
                token,
                run,
                component,
            },
            _,
        ) => Route::Conn(ConnVerb::Hello {
            token,
            run,
            component,
        }),
        (Op::Ping, _) => Route::Answer(Answer::Pong),
        (_, None) => Route::Answer(err(ErrorCode::Unauthenticated, "send hello {token} first")),
        (op, Some(p)) if !op.verb().allowed_for(p.role) => Route::Answer(forbidden(op.verb(), p)),
        (op, Some(p)) => authorized(shared, p, op),
    }
}

/// What serves `op`, once `principal` may use its verb.
fn authorized(shared: &Shared, principal: &Principal, op: Op) -> Route {
    let apply = |cmd| {
        Route::Core(Ask::Apply {
            principal: principal.clone(),
            cmd,
        })
    };
    let query = |query| {
        Route::Core(Ask::Query {
            principal: principal.clone(),
            query,
        })
    };
    // Listings come in pages: the default and the bounds of a page, for every front door.
    let page = |limit| shared.opts.page(limit);
    let refused = Route::Answer;
    match op {
        Op::Hello { .. } | Op::Ping => unreachable!("routed before the principal is known"),
        Op::Admit(a) => admit_command(&shared.policy, principal, a).map_or_else(refused, apply),
        Op::Start { run, key, token } => admission_token(shared, &run, &key, &token)
            .map(|token| Command::Start { run, key, token })
            .map_or_else(refused, apply),
        Op::Complete(c) => admission_token(shared, &c.run, &c.key, &c.token)
            .map(|token| Command::Complete {
                run: c.run,
                key: c.key,
                token,
                outcome: c.outcome,
                result: c.result.map(|v| v.to_string().into_boxed_str()),
                error: c.error.map(String::into_boxed_str),
                cost: c.cost,
            })
            .map_or_else(refused, apply),
        Op::Wait {
            run,
            key,
            timeout_ms,
        } => wait_timeout(shared, timeout_ms).map_or_else(refused, |timeout| {
            Route::Conn(ConnVerb::Wait {
                principal: principal.clone(),
                run,
                key,
                timeout,
            })
        }),
        Op::Subscribe { run } => Route::Conn(ConnVerb::Subscribe {
            principal: principal.clone(),
            run,
        }),
        Op::Unsubscribe { run } => Route::Conn(ConnVerb::Unsubscribe { run }),
        Op::Status { run } => query(Query::Status { run }),
        Op::Report { run, limit, cursor } => query(Query::Report {
            run,
            cursor,
            page: page(limit),
        }),
        Op::Runs {
            state,
            limit,
            cursor,
        } => query(Query::Runs {
            state,
            cursor,
            page: page(limit),
        }),
        Op::Pending { run, limit, cursor } => query(Query::Pending {
            run,
            cursor,
            page: page(limit),
        }),
        Op::Ledger { run, limit, after } => Route::Work(Work::Ledger {
            run,
            after: after.unwrap_or(0),
            page: page(limit),
        }),
        Op::Cancel { cascade: false, .. } => refused(err(
            ErrorCode::InvalidField,
            "cascade=false is not supported: a cancel always fences the run's descendants (G4)",
        )),
        Op::Cancel { run, reason, .. } => apply(Command::Cancel {
            run,
            reason: reason.map(String::into_boxed_str),
            kill: false,
        }),
        Op::Kill { run, reason } => apply(Command::Cancel {
            run,
            reason: reason.map(String::into_boxed_str),
            kill: true,
        }),
        Op::Decide {
            run,
            key,
            decision,
            reason,
        } => apply(Command::Decide {
            run,
            key,
            decision,
            reason: reason.map(String::into_boxed_str),
        }),
        Op::Pause { run } => apply(Command::Pause { run }),
        Op::Resume { run } => apply(Command::Resume { run }),
        Op::Close { run, outcome } => apply(Command::Close {
            run,
            failed: outcome == CloseOutcome::Failed,
        }),
        Op::Token { name, role, groups } => Route::Work(Work::TokenCreate {
            actor: principal.clone(),
            name,
            role,
            groups,
        }),
        Op::TokenRevoke { name } => Route::Work(Work::TokenRevoke {
            actor: principal.clone(),
            name,
        }),
        Op::Compensations { run, tool } => {
            match tool
                .map(|t| estop_policy::ToolPattern::parse(t.as_str()))
                .transpose()
            {
                Ok(tool) => Route::Conn(ConnVerb::Compensations {
                    principal: principal.clone(),
                    run,
                    tool,
                }),
                Err(m) => refused(err(ErrorCode::InvalidField, m)),
            }
        }
        Op::Compensated {
            run,
            key,
            attempt,
            outcome,
            error,
        } => apply(Command::CompensationEnd {
            run,
            key,
            attempt,
            outcome,
            error: error.map(String::into_boxed_str),
        }),
        Op::Saga { run, key, action } => apply(Command::Saga { run, key, action }),
        Op::LookedUp {
            run,
            key,
            attempt,
            outcome,
            result,
            error,
        } => apply(Command::SagaStep {
            run,
            key,
            step: SagaStep::LookupEnd {
                attempt,
                outcome,
                result: result.map(|v| v.to_string().into_boxed_str()),
                error: error.map(String::into_boxed_str),
            },
        }),
    }
}

/// How long a `wait` may block: what it asked for, within `wait_ms_max`.
fn wait_timeout(shared: &Shared, timeout_ms: u64) -> Result<Duration, Answer> {
    let max = shared.opts.wait_ms_max;
    if timeout_ms > max {
        return Err(err(
            ErrorCode::LimitExceeded,
            format!(
                "timeout_ms {timeout_ms} is above wait_ms_max = {max}; wait again after it returns"
            ),
        ));
    }
    Ok(Duration::from_millis(timeout_ms))
}

/// The refusal of a verb the principal's role may not use.
pub fn forbidden(verb: Verb, p: &Principal) -> Answer {
    let needs = if verb.is_operator_only() {
        "an operator token"
    } else {
        "an agent or operator token (observers only read)"
    };
    err(
        ErrorCode::Forbidden,
        format!(
            "{} needs {needs}; {} is an {}",
            verb.as_str(),
            p.name,
            p.role.as_str()
        ),
    )
}

/// The admission token of a `start` or `complete` of effect `key` of `run`, if the gate sealed
/// it for that effect (`estop_protocol::effect_token`): nothing else reaches the kernel.
fn admission_token(
    shared: &Shared,
    run: &RunId,
    key: &EffectKey,
    token: &str,
) -> Result<Token, Answer> {
    shared.seal.open(run, key, token).ok_or_else(|| {
        err(
            ErrorCode::BadToken,
            format!(
                "the token was not issued for effect {key} of run {run}: present the token of this effect's admitted verdict"
            ),
        )
    })
}

/// Evaluates policy for an admit and builds the kernel command (policy decided here, recorded
/// with the admission, so replay never consults the policy file again).
fn admit_command(
    policy: &Policy,
    p: &Principal,
    a: estop_protocol::Admit,
) -> Result<Command, Answer> {
    let mut ruling = match policy.evaluate(&a.tool, a.args.as_ref(), p.name.as_str()) {
        Ok(v) => v,
        Err(e @ EvalError::ArgsRequired { .. }) => {
            return Err(err(ErrorCode::ArgsRequired, e.to_string()));
        }
        Err(e) => {
            // A condition that cannot be evaluated fails closed: refused, nothing recorded.
            return Err(Answer::Verdict(wire::VerdictReply::Refused {
                reason: RefusalReason::Denied,
                message: Some(e.to_string()),
                rule: Some(e.rule().to_string()),
                budget: None,
            }));
        }
    };
    ruling.strengthen(a.needs_approval);
    if let Some(d) = &a.declare {
        // The client's word may only add to policy's; a conflict refuses the admit, unrecorded.
        let declared = estop_policy::Declared {
            reversibility: d.reversibility,
            compensate: d.compensate.clone(),
            compensate_args: d.compensate_args.clone(),
        };
        ruling
            .declare(&declared)
            .map_err(|e| err(ErrorCode::InvalidField, format!("declare: {e}")))?;
    }
    if let Some(s) = a.seed {
        // After the declaration: the seed fills only what neither policy nor the client's own
        // word set, and only upwards (any agent can send one).
        ruling.seed(s.class, s.reversibility);
    }
    let now = crate::shared::wall_ms();
    let mut limits: RunLimits = policy.run_limits(now);
    let min = |x: Option<u64>, y: Option<u64>| match (x, y) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    limits.deadline_at = min(
        limits.deadline_at,
        min(
            a.limits.deadline_ms,
            a.limits.timeout_ms.map(|t| now.saturating_add(t)),
        ),
    );
    limits.max_effects = min(limits.max_effects, a.limits.max_effects);
    limits.max_spend = min(limits.max_spend, a.limits.max_spend);
    limits.max_tokens = min(limits.max_tokens, a.limits.max_tokens);
    // Kept for an operator's review, or for the saga when the compensation is built from them
    // or a lookup may need them, or as the record of what an egress effect reached (its method
    // and URL: `args_kept`).
    let args = if ruling.action == PolicyAction::Approve
        || ruling.compensate_args.is_some()
        || ruling.lookup.is_some()
        || estop_kernel::state::args_kept(a.tool.as_str())
    {
        a.args.as_ref().map(|v| v.to_string().into_boxed_str())
    } else {
        None
    };
    Ok(Command::Admit(KAdmit {
        run: a.run,
        key: a.key,
        tool: a.tool,
        digest: a.digest,
        args,
        start: a.start,
        parent: a.parent,
        labels: a
            .labels
            .into_iter()
            .map(|(k, v)| (k.into_boxed_str(), v.into_boxed_str()))
            .collect(),
        limits,
        policy: Box::new(ruling.into()),
        reserve: a.reserve,
    }))
}

/// Reads the ledger on disk (durable records only) for the `ledger` verb.
fn ledger_entries(
    dir: &std::path::Path,
    run: Option<&RunId>,
    after: u64,
    durable: u64,
    mut page: PageBudget,
) -> Result<wire::LedgerReply, String> {
    let storage = FileStorage::open_read_only(dir).map_err(|e| e.to_string())?;
    let mut entries = Vec::new();
    let mut next_after = None;
    let report = inspect(&storage, |rv| {
        if rv.seq <= after || rv.seq > durable || next_after.is_some() {
            return;
        }
        let Ok(rec) = estop_kernel::record_codec::decode_record(rv.payload) else {
            return;
        };
        if run.is_some_and(|r| rec.command.run() != Some(r)) {
            return;
        }
        let entry = crate::describe::entry(rv.seq, &rec);
        if !page.take(entry.weight()) {
            next_after = Some(entries.last().map_or(after, |e: &wire::LedgerEntry| e.seq));
            return;
        }
        entries.push(entry);
    });
    if let Some(e) = report.error {
        return Err(format!("the ledger cannot be read: {e}"));
    }
    Ok(wire::LedgerReply {
        entries,
        next_after,
    })
}

/// `ledger_entries` for the PostgreSQL store: the committed records read from the database, a
/// page of them at a time.
fn pg_ledger_entries(
    target: &crate::pgstore::Target,
    run: Option<&RunId>,
    mut after: u64,
    durable: u64,
    mut page: PageBudget,
) -> Result<wire::LedgerReply, String> {
    let mut db = target.connect().map_err(|e| e.to_string())?;
    let run = run.map(|r| r.as_str());
    let mut entries = Vec::new();
    loop {
        let rows = crate::pgstore::records_page(&mut db, after, durable, run)
            .map_err(|e| e.to_string())?;
        let Some(last) = rows.last().map(|(seq, _)| *seq) else {
            return Ok(wire::LedgerReply {
                entries,
                next_after: None,
            });
        };
        for (seq, bytes) in &rows {
            let rec = estop_kernel::record_codec::decode_record(bytes)
                .map_err(|e| format!("record {seq} in the database does not decode: {e}"))?;
            let entry = crate::describe::entry(*seq, &rec);
            if !page.take(entry.weight()) {
                let next_after = entries.last().map_or(after, |e: &wire::LedgerEntry| e.seq);
                return Ok(wire::LedgerReply {
                    entries,
                    next_after: Some(next_after),
                });
            }
            entries.push(entry);
        }
        after = last;
    }
}

pub use crate::shared::{ask, send};

#[cfg(test)]
mod tests {
    //! The dispatcher as data: for every verb (and the requests a rule refuses), what each
    //! principal gets. A front door that routes through `route` cannot drift from this table;
    //! a new verb fails to compile in `sample` until it has a row.

    use super::*;
    use crate::durable::DurableState;
    use crate::shared::ConnOptions;
    use crate::tokens::Tokens;
    use estop_kernel::SagaAction;
    use estop_kernel::vocab::{Decision, Outcome};
    use estop_protocol::{Admit, Complete, RequestedRunLimits};
    use std::fmt::Write as _;
    use std::sync::atomic::AtomicU64;

    /// Policy: `needs_args` reads its arguments, so an admit with only a digest cannot be
    /// decided.
    const POLICY: &str = r#"
[[rules]]
tool = "needs_args"
when = "args.amount > 1"
action = "approve"
"#;

    /// The expected table: one row per request, one column per principal (`-` has not said
    /// `hello`). `apply X` and `query X` are core messages, `work X` runs beside the core,
    /// `conn X` is the connection's; anything else is the code of an answer given at once.
    const EXPECTED: &str = "
request                    | operator         | agent            | observer         | -
hello                      | conn hello       | conn hello       | conn hello       | conn hello
admit                      | apply admit      | apply admit      | forbidden        | unauthenticated
admit digest-only          | args_required    | args_required    | forbidden        | unauthenticated
start                      | apply start      | apply start      | forbidden        | unauthenticated
start bad-token            | bad_token        | bad_token        | forbidden        | unauthenticated
start unsealed             | bad_token        | bad_token        | forbidden        | unauthenticated
complete                   | apply complete   | apply complete   | forbidden        | unauthenticated
complete bad-token         | bad_token        | bad_token        | forbidden        | unauthenticated
wait                       | conn wait        | conn wait        | forbidden        | unauthenticated
wait over-max              | limit_exceeded   | limit_exceeded   | forbidden        | unauthenticated
subscribe                  | conn subscribe   | conn subscribe   | conn subscribe   | unauthenticated
unsubscribe                | conn unsubscribe | conn unsubscribe | conn unsubscribe | unauthenticated
status                     | query status     | query status     | query status     | unauthenticated
cancel                     | apply cancel     | apply cancel     | forbidden        | unauthenticated
cancel cascade=false       | invalid_field    | invalid_field    | forbidden        | unauthenticated
ping                       | pong             | pong             | pong             | pong
decide                     | apply decide     | forbidden        | forbidden        | unauthenticated
pause                      | apply pause      | forbidden        | forbidden        | unauthenticated
resume                     | apply resume     | forbidden        | forbidden        | unauthenticated
kill                       | apply kill       | forbidden        | forbidden        | unauthenticated
close                      | apply close      | apply close      | forbidden        | unauthenticated
runs                       | query runs 1000  | query runs 1000  | query runs 1000  | unauthenticated
runs limit=5               | query runs 5     | query runs 5     | query runs 5     | unauthenticated
runs limit=4294967295      | query runs 10000 | query runs 10000 | query runs 10000 | unauthenticated
pending                    | query pending 1000 | query pending 1000 | query pending 1000 | unauthenticated
ledger                     | work ledger 1000 | forbidden        | work ledger 1000 | unauthenticated
report                     | query report 1000 | query report 1000 | query report 1000 | unauthenticated
token                      | work token       | forbidden        | forbidden        | unauthenticated
token_revoke               | work token_revoke | forbidden        | forbidden        | unauthenticated
compensations              | conn compensations | conn compensations | forbidden        | unauthenticated
compensated                | apply compensated | apply compensated | forbidden        | unauthenticated
saga settle                | apply saga       | forbidden        | forbidden        | unauthenticated
saga skip                  | apply saga       | forbidden        | forbidden        | unauthenticated
saga retry                 | apply saga       | forbidden        | forbidden        | unauthenticated
saga compensate            | apply saga       | forbidden        | forbidden        | unauthenticated
looked_up                  | apply looked_up  | apply looked_up  | forbidden        | unauthenticated
";

    fn run() -> RunId {
        RunId::new("r").unwrap()
    }

    /// Token 1.1 of effect `key()` of `run()`, sealed as the tests' shared seals it.
    fn sealed() -> String {
        estop_protocol::effect_token::TokenSeal::for_tests().seal(
            &run(),
            &key(),
            estop_kernel::Token {
                epoch: 1,
                serial: 1,
            },
        )
    }

    fn key() -> EffectKey {
        EffectKey::new("k").unwrap()
    }

    /// A request of each verb, and the variants a rule refuses. Exhaustive over `Verb`.
    fn samples() -> Vec<(String, Op)> {
        let admit = |tool: &str, args: Option<serde_json::Value>| {
            let tool = estop_kernel::ToolName::new(tool).unwrap();
            Op::Admit(Admit {
                run: run(),
                key: key(),
                digest: estop_protocol::digest_of(&tool, &serde_json::json!({"amount": 5})),
                tool,
                args,
                start: true,
                parent: None,
                labels: Default::default(),
                needs_approval: false,
                limits: RequestedRunLimits::default(),
                declare: None,
                seed: None,
                reserve: Default::default(),
            })
        };
        let complete = |token: &str| {
            Op::Complete(Complete {
                run: run(),
                key: key(),
                token: token.into(),
                outcome: Outcome::Ok,
                result: None,
                error: None,
                cost: Default::default(),
            })
        };
        let mut out = Vec::new();
        for verb in Verb::ALL {
            let mut add = |label: &str, op: Op| {
                assert_eq!(op.verb(), *verb);
                out.push((label.to_string(), op));
            };
            let v = verb.as_str();
            match verb {
                Verb::Hello => add(
                    v,
                    Op::Hello {
                        token: Secret::new("whatever"),
                        run: None,
                        component: estop_kernel::Part::Main,
                    },
                ),
                Verb::Admit => {
                    add(v, admit("send", Some(serde_json::json!({"amount": 5}))));
                    add("admit digest-only", admit("needs_args", None));
                }
                Verb::Start => {
                    let start = |token: &str| Op::Start {
                        run: run(),
                        key: key(),
                        token: token.into(),
                    };
                    add(v, start(&sealed()));
                    add("start bad-token", start("nope"));
                    add("start unsealed", start("1.1"));
                }
                Verb::Complete => {
                    add(v, complete(&sealed()));
                    add("complete bad-token", complete("nope"));
                }
                Verb::Wait => {
                    let wait = |timeout_ms| Op::Wait {
                        run: run(),
                        key: key(),
                        timeout_ms,
                    };
                    add(v, wait(1000));
                    add(
                        "wait over-max",
                        wait(ConnOptions::default().wait_ms_max + 1),
                    );
                }
                Verb::Subscribe => add(v, Op::Subscribe { run: run() }),
                Verb::Unsubscribe => add(v, Op::Unsubscribe { run: run() }),
                Verb::Status => add(v, Op::Status { run: run() }),
                Verb::Cancel => {
                    let cancel = |cascade| Op::Cancel {
                        run: run(),
                        reason: None,
                        cascade,
                    };
                    add(v, cancel(true));
                    add("cancel cascade=false", cancel(false));
                }
                Verb::Ping => add(v, Op::Ping),
                Verb::Decide => add(
                    v,
                    Op::Decide {
                        run: run(),
                        key: key(),
                        decision: Decision::Approve,
                        reason: None,
                    },
                ),
                Verb::Pause => add(v, Op::Pause { run: run() }),
                Verb::Resume => add(v, Op::Resume { run: run() }),
                Verb::Kill => add(
                    v,
                    Op::Kill {
                        run: run(),
                        reason: None,
                    },
                ),
                Verb::Close => add(
                    v,
                    Op::Close {
                        run: run(),
                        outcome: CloseOutcome::Completed,
                    },
                ),
                Verb::Runs => {
                    let runs = |limit| Op::Runs {
                        state: None,
                        limit,
                        cursor: None,
                    };
                    add(v, runs(None));
                    add("runs limit=5", runs(Some(5)));
                    add("runs limit=4294967295", runs(Some(u32::MAX)));
                }
                Verb::Pending => add(
                    v,
                    Op::Pending {
                        run: None,
                        limit: None,
                        cursor: None,
                    },
                ),
                Verb::Ledger => add(
                    v,
                    Op::Ledger {
                        run: None,
                        limit: None,
                        after: None,
                    },
                ),
                Verb::Report => add(
                    v,
                    Op::Report {
                        run: run(),
                        limit: None,
                        cursor: None,
                    },
                ),
                Verb::Token => add(
                    v,
                    Op::Token {
                        name: PrincipalName::new("bob").unwrap(),
                        role: Role::Agent,
                        groups: Vec::new(),
                    },
                ),
                Verb::TokenRevoke => add(
                    v,
                    Op::TokenRevoke {
                        name: PrincipalName::new("bob").unwrap(),
                    },
                ),
                Verb::Compensations => add(
                    v,
                    Op::Compensations {
                        run: None,
                        tool: None,
                    },
                ),
                Verb::Compensated => add(
                    v,
                    Op::Compensated {
                        run: run(),
                        key: key(),
                        attempt: 1,
                        outcome: Outcome::Ok,
                        error: None,
                    },
                ),
                Verb::Saga => {
                    // An agent may never settle, skip or retry the undoing of its own effects.
                    let saga = |action| Op::Saga {
                        run: run(),
                        key: key(),
                        action,
                    };
                    add(
                        "saga settle",
                        saga(SagaAction::Settle {
                            outcome: Outcome::Error,
                            result: None,
                        }),
                    );
                    add(
                        "saga skip",
                        saga(SagaAction::Skip {
                            reason: "irrelevant".into(),
                        }),
                    );
                    add("saga retry", saga(SagaAction::Retry));
                    add("saga compensate", saga(SagaAction::Compensate));
                }
                Verb::LookedUp => add(
                    v,
                    Op::LookedUp {
                        run: run(),
                        key: key(),
                        attempt: 1,
                        outcome: Outcome::Ok,
                        result: None,
                        error: None,
                    },
                ),
            }
        }
        out
    }

    /// Items a page holds (its byte budget aside).
    fn items(mut page: PageBudget) -> usize {
        std::iter::from_fn(|| page.take(0).then_some(())).count()
    }

    fn kind(route: &Route) -> String {
        match route {
            Route::Answer(Answer::Error(code, _)) => code.as_str().to_string(),
            Route::Answer(Answer::Pong) => "pong".into(),
            Route::Answer(other) => format!("answer {other:?}"),
            Route::Core(Ask::Apply { cmd, .. }) => format!(
                "apply {}",
                match cmd {
                    Command::Admit(_) => "admit",
                    Command::Start { .. } => "start",
                    Command::Complete { .. } => "complete",
                    Command::Decide { .. } => "decide",
                    Command::Cancel { kill: false, .. } => "cancel",
                    Command::Cancel { kill: true, .. } => "kill",
                    Command::Pause { .. } => "pause",
                    Command::Resume { .. } => "resume",
                    Command::Close { .. } => "close",
                    Command::CompensationEnd { .. } => "compensated",
                    Command::Saga { .. } => "saga",
                    Command::SagaStep { .. } => "looked_up",
                    other => unreachable!("no verb sends {other:?}"),
                }
            ),
            Route::Core(Ask::Query { query, .. }) => match query {
                Query::Status { .. } => "query status".into(),
                Query::Runs { page, .. } => format!("query runs {}", items(page.clone())),
                Query::Pending { page, .. } => format!("query pending {}", items(page.clone())),
                Query::Report { page, .. } => format!("query report {}", items(page.clone())),
            },
            Route::Work(Work::Ledger { page, .. }) => {
                format!("work ledger {}", items(page.clone()))
            }
            Route::Work(Work::TokenCreate { .. }) => "work token".into(),
            Route::Work(Work::TokenRevoke { .. }) => "work token_revoke".into(),
            Route::Conn(c) => format!("conn {}", c.verb()),
        }
    }

    fn shared(dir: &std::path::Path) -> Shared {
        let (core_tx, _) = std::sync::mpsc::channel();
        let (tokens, _) = Tokens::open_or_bootstrap(dir, false).unwrap();
        Shared {
            core_tx: core_tx.into(),
            tokens: Arc::new(tokens),
            policy: Arc::new(Policy::parse(POLICY).unwrap()),
            durable_rx: tokio::sync::watch::channel(DurableState::default()).1,
            opts: ConnOptions::default(),
            ledger_dir: dir.to_path_buf(),
            store: None,
            next_conn: AtomicU64::new(1),
            seal: estop_protocol::effect_token::TokenSeal::for_tests(),
        }
    }

    fn principal(role: Role) -> Principal {
        Principal {
            name: PrincipalName::new(role.as_str()).unwrap(),
            role,
            groups: Vec::new(),
            part: Default::default(),
        }
    }

    #[test]
    fn every_verb_routes_by_role_as_the_table_says() {
        let dir = tempfile::tempdir().unwrap();
        let shared = shared(dir.path());
        let who = [
            Some(principal(Role::Operator)),
            Some(principal(Role::Agent)),
            Some(principal(Role::Observer)),
            None,
        ];
        let mut table = String::from(
            "\nrequest                    | operator         | agent            | observer         | -\n",
        );
        for (label, op) in samples() {
            let cells: Vec<String> = who
                .iter()
                .map(|p| kind(&route(&shared, p.as_ref(), op.clone())))
                .collect();
            write!(table, "{label:<26}").unwrap();
            for c in &cells[..3] {
                write!(table, " | {c:<16}").unwrap();
            }
            writeln!(table, " | {}", cells[3]).unwrap();
        }
        assert_eq!(table, EXPECTED, "the routes are now:\n{table}");
    }

    /// An admit's `declare` reaches the recorded policy decision when it only adds to policy,
    /// and a declaration that contradicts policy is refused before anything is recorded.
    #[test]
    fn an_admit_declaration_is_recorded_or_refused() {
        let dir = tempfile::tempdir().unwrap();
        let shared = shared(dir.path());
        let agent = principal(Role::Agent);
        let admit = |declare: estop_protocol::Declare| {
            let tool = estop_kernel::ToolName::new("book").unwrap();
            let args = serde_json::json!({"room": 1});
            Op::Admit(Admit {
                run: run(),
                key: key(),
                digest: estop_protocol::digest_of(&tool, &args),
                tool,
                args: Some(args),
                start: true,
                parent: None,
                labels: Default::default(),
                needs_approval: false,
                limits: RequestedRunLimits::default(),
                declare: Some(declare),
                seed: None,
                reserve: Default::default(),
            })
        };
        let unbook = estop_kernel::ToolName::new("unbook").unwrap();
        let added = estop_protocol::Declare {
            compensate: Some(unbook.clone()),
            compensate_args: Some(r#"{"id": result.id}"#.into()),
            ..Default::default()
        };
        match route(&shared, Some(&agent), admit(added)) {
            Route::Core(Ask::Apply {
                cmd: Command::Admit(a),
                ..
            }) => {
                assert_eq!(a.policy.compensate, Some(unbook));
                assert_eq!(
                    a.policy.reversibility,
                    estop_kernel::vocab::Reversibility::Compensable
                );
                assert_eq!(
                    a.policy.compensate_args.as_deref(),
                    Some(r#"{"id": result.id}"#)
                );
                // The saga builds the compensation from the forward arguments: they are kept.
                assert_eq!(a.args.as_deref(), Some(r#"{"room":1}"#));
            }
            other => panic!("{}", kind(&other)),
        }
        let contradicts = estop_protocol::Declare {
            compensate: Some(estop_kernel::ToolName::new("unbook").unwrap()),
            reversibility: Some(estop_kernel::vocab::Reversibility::Irreversible),
            ..Default::default()
        };
        let refused = route(&shared, Some(&agent), admit(contradicts));
        assert_eq!(kind(&refused), "invalid_field");
    }

    /// An admit's `seed` (any agent can send one) never makes a call less guarded. Hostile
    /// first: a read-only, undoable seed for a tool no rule names is admitted exactly as the
    /// same call without it (held for approval, a write, undeclared), and so is one for a tool
    /// whose rule leaves the class to `defaults.class`. Only a stricter seed changes anything.
    #[test]
    fn an_admit_seed_only_makes_a_call_more_guarded() {
        use estop_kernel::vocab::{EffectClass, PolicyAction, Reversibility};
        let dir = tempfile::tempdir().unwrap();
        let mut shared = shared(dir.path());
        let policy =
            "[defaults]\nclass = \"read\"\n[[rules]]\ntool = \"docs_*\"\naction = \"allow\"\n";
        shared.policy = Arc::new(Policy::parse(policy).unwrap());
        let agent = principal(Role::Agent);
        let admitted = |tool: &str, seed: Option<estop_protocol::Seed>| {
            let tool = estop_kernel::ToolName::new(tool).unwrap();
            let args = serde_json::json!({"path": "/"});
            let op = Op::Admit(Admit {
                run: run(),
                key: key(),
                digest: estop_protocol::digest_of(&tool, &args),
                tool,
                args: Some(args),
                start: true,
                parent: None,
                labels: Default::default(),
                needs_approval: false,
                limits: RequestedRunLimits::default(),
                declare: None,
                seed,
                reserve: Default::default(),
            });
            match route(&shared, Some(&agent), op) {
                Route::Core(Ask::Apply {
                    cmd: Command::Admit(a),
                    ..
                }) => a,
                other => panic!("{}", kind(&other)),
            }
        };
        let lowering = estop_protocol::Seed {
            class: Some(EffectClass::Read),
            reversibility: Some(Reversibility::Reversible),
        };
        let plain = admitted("wipe_disk", None);
        assert_eq!(
            (plain.policy.action, plain.policy.class),
            (PolicyAction::Approve, EffectClass::Write)
        );
        assert_eq!(plain.policy.reversibility, Reversibility::Undeclared);
        assert_eq!(admitted("wipe_disk", Some(lowering)), plain);
        assert_eq!(
            admitted("docs_write", Some(lowering)),
            admitted("docs_write", None)
        );
        let stricter = estop_protocol::Seed {
            class: Some(EffectClass::Write),
            reversibility: Some(Reversibility::Irreversible),
        };
        let a = admitted("docs_write", Some(stricter));
        assert_eq!(
            (a.policy.class, a.policy.reversibility),
            (EffectClass::Write, Reversibility::Irreversible)
        );
        assert_eq!(admitted("docs_write", None).policy.class, EffectClass::Read);
    }

    /// The role check is `Verb::allowed_for`, and nothing else: every verb an authenticated
    /// principal may not use is refused `forbidden`, and no other verb is.
    #[test]
    fn forbidden_is_exactly_what_roles_deny() {
        let dir = tempfile::tempdir().unwrap();
        let shared = shared(dir.path());
        for role in [Role::Operator, Role::Agent, Role::Observer, Role::Executor] {
            let p = principal(role);
            for (label, op) in samples() {
                let verb = op.verb();
                let refused = matches!(
                    route(&shared, Some(&p), op),
                    Route::Answer(Answer::Error(ErrorCode::Forbidden, _))
                );
                assert_eq!(refused, !verb.allowed_for(role), "{label} as {role:?}");
            }
        }
    }
}
