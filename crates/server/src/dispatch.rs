//! One front door: what a typed request asks of the gate, decided in one place for every
//! transport. [`route`] checks who may ask (before `hello`, by role), applies the rules every
//! front door shares (the `wait` bound, `cascade=false`, an admission token's shape, listing
//! pages, policy for an `admit`) and maps the verb to what serves it: an answer at once, a core
//! message, work beside the core (a read of the ledger, a token change), or a verb about the
//! connection itself. Protocol v1 (`conn`) and the HTTP API (the console) only add their
//! transport: where the answer goes and what a connection holds.

use crate::conn::Shared;
use crate::core::{Answer, CoreMsg, Out, Query, ReplyTo};
use crate::durable::{self, Durability};
use estop_kernel::vocab::PolicyAction;
use estop_kernel::{
    Admit as KAdmit, Command, EffectKey, Principal, PrincipalName, Role, RunId, RunLimits, Token,
};
use estop_ledger::{FileStorage, inspect};
use estop_policy::{EvalError, Policy};
use estop_protocol::page::Weight;
use estop_protocol::reply as wire;
use estop_protocol::{CloseOutcome, ErrorCode, Id, Op, PageBudget, Secret, Verb};
use std::sync::Arc;
use std::time::Duration;

/// What serves a request.
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
                let durable = shared.durable_rx.borrow().seq;
                let res = tokio::task::spawn_blocking(move || {
                    ledger_entries(&dir, run.as_ref(), after, durable, page)
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
    /// Authenticate the connection with this secret.
    Hello { token: Secret },
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
}

impl ConnVerb {
    pub fn verb(&self) -> Verb {
        match self {
            ConnVerb::Hello { .. } => Verb::Hello,
            ConnVerb::Wait { .. } => Verb::Wait,
            ConnVerb::Subscribe { .. } => Verb::Subscribe,
            ConnVerb::Unsubscribe { .. } => Verb::Unsubscribe,
        }
    }
}

fn err(code: ErrorCode, msg: impl Into<String>) -> Answer {
    Answer::Error(code, msg.into())
}

/// What serves `op` asked by `principal` (`None`: a connection that has not said `hello`).
pub fn route(shared: &Shared, principal: Option<&Principal>, op: Op) -> Route {
    match (op, principal) {
        (Op::Hello { token }, _) => Route::Conn(ConnVerb::Hello { token }),
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
        Op::Start { run, key, token } => admission_token(&token)
            .map(|token| Command::Start { run, key, token })
            .map_or_else(refused, apply),
        Op::Complete(c) => admission_token(&c.token)
            .map(|token| Command::Complete {
                run: c.run,
                key: c.key,
                token,
                outcome: c.outcome,
                result: c.result.map(|v| v.to_string().into_boxed_str()),
                error: c.error.map(String::into_boxed_str),
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

/// The admission token of a `start` or `complete`, as the gate issued it.
fn admission_token(token: &str) -> Result<Token, Answer> {
    Token::parse(token).ok_or_else(|| {
        err(
            ErrorCode::BadToken,
            "token is not one the gate issued (expected <epoch>.<serial>)",
        )
    })
}

/// Evaluates policy for an admit and builds the kernel command (policy decided here, recorded
/// with the admission, so replay never consults the policy file again).
pub fn admit_command(
    policy: &Policy,
    p: &Principal,
    a: estop_protocol::Admit,
) -> Result<Command, Answer> {
    let mut verdict = match policy.evaluate(&a.tool, a.args.as_ref(), p.name.as_str()) {
        Ok(v) => v,
        Err(e @ EvalError::ArgsRequired { .. }) => {
            return Err(err(ErrorCode::ArgsRequired, e.to_string()));
        }
        Err(e) => {
            // A condition that cannot be evaluated fails closed: refused, nothing recorded.
            return Err(Answer::Verdict(wire::Verdict::Refused {
                reason: "denied".into(),
                message: Some(e.to_string()),
                rule: Some(e.rule().to_string()),
            }));
        }
    };
    verdict.strengthen(a.needs_approval);
    let now = crate::conn::wall_ms();
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
    let args = if verdict.action == PolicyAction::Approve {
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
        policy: verdict.into(),
    }))
}

/// Reads the ledger on disk (durable records only) for the `ledger` verb.
pub fn ledger_entries(
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
        let Ok(rec) = estop_kernel::codec::decode_record(rv.payload) else {
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

fn shutting_down() -> Answer {
    err(ErrorCode::Unavailable, "the gate is shutting down")
}

/// Sends `msg` to the core, whose answer goes where the message says; `Some` is the answer
/// when the core has stopped.
pub fn send(shared: &Shared, msg: CoreMsg) -> Option<Answer> {
    shared.core_tx.send(msg).err().map(|_| shutting_down())
}

/// Sends one message to the core and waits for its answer, then for the ledger position it
/// depends on to be durable (G6), exactly as a v1 connection's writer does.
pub async fn ask(shared: &Shared, msg: impl FnOnce(ReplyTo) -> CoreMsg) -> Answer {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let to = ReplyTo {
        out: tx.into(),
        id: Id::default(),
        charge: None,
    };
    if let Some(answer) = send(shared, msg(to)) {
        return answer;
    }
    loop {
        match rx.recv().await {
            Some(Out::Answer { answer, after, .. }) => {
                let mut durable_rx = shared.durable_rx.clone();
                return match durable::wait(&mut durable_rx, after).await {
                    Durability::Durable => answer,
                    Durability::Lost => err(
                        ErrorCode::Unavailable,
                        "the change could not be made durable (ledger failure); it was not applied — retry",
                    ),
                };
            }
            // Events are not asked for here; rendered bytes go only to a socket's writer.
            Some(Out::Event { .. } | Out::Rendered(_)) => {}
            None => return shutting_down(),
        }
    }
}
