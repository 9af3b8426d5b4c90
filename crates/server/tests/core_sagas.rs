//! The core's executors of the reverse saga (`core::sagas`), driven through the shell with
//! clocks the test makes up (as `core_time.rs`): a failed attempt is offered again exactly when
//! its backoff ends, never before; a `compensate_args` that cannot be built from the recorded
//! result asks a human at once (no attempt spent, no executor sent a call without its
//! arguments), and an operator's settle that carries the result lets it be built; an unknown
//! outcome is looked up through an executor before anything is undone; the policy's rules on
//! the compensating tool are applied; an operator's compensation of one effect of a killed run
//! is offered like a saga's.

use estop_kernel::state::Status;
use estop_kernel::vocab::{Decision, EffectClass, Outcome, PolicyAction, Reversibility};
use estop_kernel::{
    Admit, Command, Digest, EffectKey, Limits, PolicyDecision, Principal, PrincipalName, Role,
    RunId, RunLimits, SagaAction, ToolName,
};
use estop_ledger::{LedgerOptions, MemStorage, Storage};
use estop_protocol::{Id, server_line as wire};
use estop_server::core::{CoreMsg, CoreOptions, Now, OpenFn, Out, ReplyTo, Shell};
use estop_server::durable::DurableState;
use estop_server::journal;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, mpsc};
use tokio::sync::{mpsc as tmpsc, watch};

const T0: u64 = 1_800_000_000_000;

fn agent() -> Principal {
    Principal {
        name: PrincipalName::new("agent").unwrap(),
        role: Role::Agent,
        groups: vec![],
        part: Default::default(),
    }
}

fn run() -> RunId {
    RunId::new("r").unwrap()
}

fn key() -> EffectKey {
    EffectKey::new("k").unwrap()
}

fn alice() -> Principal {
    Principal {
        name: PrincipalName::new("alice").unwrap(),
        role: Role::Operator,
        groups: vec![],
        part: Default::default(),
    }
}

/// A refund whose undo is `unrefund`, its arguments built from the result's `id`.
fn refund() -> Command {
    refund_looked_up_by(None)
}

/// `refund()`, whose unknown outcome `lookup` (if any) finds.
fn refund_looked_up_by(lookup: Option<&str>) -> Command {
    Command::Admit(Admit {
        run: run(),
        key: key(),
        tool: ToolName::new("refund").unwrap(),
        digest: Digest([9; 32]),
        args: Some(r#"{"amount":5}"#.into()),
        start: true,
        parent: None,
        labels: vec![],
        limits: RunLimits::default(),
        policy: PolicyDecision {
            action: PolicyAction::Allow,
            class: EffectClass::Write,
            reversibility: Reversibility::Compensable,
            compensate: Some(ToolName::new("unrefund").unwrap()),
            compensate_args: Some(r#"{"refund": result.id, "amount": args.amount}"#.into()),
            lookup: lookup.map(|l| ToolName::new(l).unwrap()),
            lookup_args: None,
            quorum: 1,
            groups: vec![],
            expiry_ms: 1000,
            rule: "test".into(),
        }
        .into(),
        reserve: Default::default(),
    })
}

fn core() -> Shell {
    core_with(CoreOptions::default())
}

fn core_with(opts: CoreOptions) -> Shell {
    let (durable_tx, _durable_rx) = watch::channel(DurableState::default());
    let st: Arc<dyn Storage> = Arc::new(MemStorage::new());
    let open: OpenFn = Box::new(move |discard_after| {
        journal::open(
            Arc::clone(&st),
            &Limits::default(),
            LedgerOptions {
                discard_after,
                caller_syncs: true,
                ..LedgerOptions::default()
            },
        )
    });
    let (tx, _rx) = mpsc::channel();
    Shell::new(opts, Arc::new(durable_tx), open, tx).unwrap()
}

fn at(ms: u64) -> Now {
    Now {
        wall_ms: T0 + ms,
        mono_ms: ms,
    }
}

fn reply_to(tx: &tmpsc::UnboundedSender<Out>, id: u64) -> ReplyTo {
    ReplyTo {
        out: tx.clone().into(),
        id: Id::from_u64(id),
        charge: None,
    }
}

/// Applies `cmd` at `ms` and makes it durable.
fn apply(c: &mut Shell, ms: u64, cmd: Command, tx: &tmpsc::UnboundedSender<Out>) {
    apply_as(c, agent(), ms, cmd, tx);
}

fn apply_as(
    c: &mut Shell,
    principal: Principal,
    ms: u64,
    cmd: Command,
    tx: &tmpsc::UnboundedSender<Out>,
) {
    c.handle(
        at(ms),
        CoreMsg::Apply {
            principal,
            cmd,
            to: reply_to(tx, 0),
        },
    );
    c.commit();
}

/// An operator's saga action on the effect, at `ms`.
fn operator(c: &mut Shell, ms: u64, action: SagaAction) {
    let (tx, _) = tmpsc::unbounded_channel();
    let cmd = Command::Saga {
        run: run(),
        key: key(),
        action,
    };
    apply_as(c, alice(), ms, cmd, &tx);
}

/// A refund completed with `result`, the run cancelled, an executor connected (conn 7): the
/// saga is due. Returns the executor's line queue.
fn cancelled_with(c: &mut Shell, result: &str) -> tmpsc::UnboundedReceiver<Out> {
    stopped_with(c, refund(), Outcome::Ok, Some(result), false)
}

/// `admit` completed with `outcome` and `result`, the run cancelled (or killed), an executor
/// connected (conn 7). Returns the executor's line queue.
fn stopped_with(
    c: &mut Shell,
    admit: Command,
    outcome: Outcome,
    result: Option<&str>,
    kill: bool,
) -> tmpsc::UnboundedReceiver<Out> {
    let (tx, _) = tmpsc::unbounded_channel();
    apply(c, 0, admit, &tx);
    let token = c.gate().run(&run()).unwrap().effects[&key()].token.unwrap();
    let complete = Command::Complete {
        run: run(),
        key: key(),
        token,
        outcome,
        result: result.map(Into::into),
        error: None,
        cost: Default::default(),
    };
    apply(c, 0, complete, &tx);
    let cancel = Command::Cancel {
        run: run(),
        reason: None,
        kill,
    };
    apply_as(c, alice(), 0, cancel, &tx);
    assert!(c.gate().run(&run()).unwrap().stop.is_some(), "stopped");
    executor(c, 7)
}

/// Connection `conn` becomes an executor of every run; returns its line queue.
fn executor(c: &mut Shell, conn: u64) -> tmpsc::UnboundedReceiver<Out> {
    executor_of(c, conn, None)
}

/// `executor`, of the compensating tools `tool` matches only (`None`: every one).
fn executor_of(c: &mut Shell, conn: u64, tool: Option<&str>) -> tmpsc::UnboundedReceiver<Out> {
    let (ex_tx, ex_rx) = tmpsc::unbounded_channel();
    let executor = CoreMsg::Executor {
        principal: agent(),
        run: None,
        tool: tool.map(|t| estop_policy::ToolPattern::parse(t).unwrap()),
        conn,
        out: ex_tx.clone().into(),
        backlog: Arc::new(AtomicUsize::new(0)),
        to: reply_to(&ex_tx, 1),
    };
    c.handle(at(0), executor);
    ex_rx
}

/// The `compensate` events released to the executor so far, as (attempt, args).
fn offers(rx: &mut tmpsc::UnboundedReceiver<Out>) -> Vec<(u32, Option<serde_json::Value>)> {
    events(rx)
        .into_iter()
        .map(|event| {
            assert_eq!(event.event, wire::EventKind::Compensate);
            assert_eq!(event.idempotency_key.as_deref(), Some("k/undo"));
            (event.attempt.unwrap(), event.args)
        })
        .collect()
}

/// Every event released to the executor so far.
fn events(rx: &mut tmpsc::UnboundedReceiver<Out>) -> Vec<wire::Event> {
    let mut got = Vec::new();
    while let Ok(out) = rx.try_recv() {
        if let Out::Event { event, .. } = out {
            got.push(event);
        }
    }
    got
}

/// Fires the core's timers at `ms` and makes what they recorded durable (events are released
/// only then).
fn fire(c: &mut Shell, ms: u64) {
    c.fire_timers(at(ms));
    c.commit();
}

fn note(c: &Shell) -> String {
    let e = &c.gate().run(&run()).unwrap().effects[&key()];
    e.saga
        .as_deref()
        .and_then(|s| s.note.as_deref())
        .unwrap_or("")
        .to_string()
}

fn status(c: &Shell) -> Status {
    c.gate().run(&run()).unwrap().effects[&key()].status
}

fn ended(c: &mut Shell, ms: u64, attempt: u32) {
    let (tx, _) = tmpsc::unbounded_channel();
    let end = Command::CompensationEnd {
        run: run(),
        key: key(),
        attempt,
        outcome: Outcome::Error,
        error: Some("503".into()),
    };
    apply(c, ms, end, &tx);
}

#[test]
fn a_failed_attempt_is_offered_again_exactly_when_its_backoff_ends() {
    let mut c = core();
    let mut ex = cancelled_with(&mut c, r#"{"id":"re_1"}"#);
    c.fire_timers(at(0));
    assert!(
        offers(&mut ex).is_empty(),
        "an event before its begin is durable"
    );
    c.commit();
    let args = Some(serde_json::json!({"refund": "re_1", "amount": 5}));
    assert_eq!(offers(&mut ex), vec![(1, args.clone())]);
    ended(&mut c, 100, 1);
    // The change is looked at after its burst (as the driver does), and nothing is due yet.
    c.fire_timers(at(100));
    c.commit();
    assert!(
        offers(&mut ex).is_empty(),
        "offered before its backoff ended"
    );
    // The backoff after one failure is 1 s, on the gate's clock: woken then, and not before.
    assert_eq!(
        c.next_timeout(at(100)),
        Some(std::time::Duration::from_millis(1_000))
    );
    c.fire_timers(at(1_099));
    c.commit();
    assert!(
        offers(&mut ex).is_empty(),
        "offered before its backoff ended"
    );
    assert_eq!(status(&c), Status::CompensationFailed);
    c.fire_timers(at(1_100));
    c.commit();
    assert_eq!(offers(&mut ex), vec![(2, args)]);
    assert_eq!(status(&c), Status::Compensating);
}

#[test]
fn arguments_that_cannot_be_built_ask_a_human_at_once() {
    let mut c = core();
    // The result has no `id`: the mapping cannot build the undo's arguments, and never will.
    let mut ex = cancelled_with(&mut c, r#"{"refunded":true}"#);
    fire(&mut c, 0);
    assert_eq!(status(&c), Status::NeedsHuman, "{}", note(&c));
    let e = &c.gate().run(&run()).unwrap().effects[&key()];
    assert_eq!(
        e.saga.as_deref().unwrap().attempts,
        0,
        "no attempt was spent"
    );
    assert!(note(&c).contains("compensate_args"), "{}", note(&c));
    assert!(
        offers(&mut ex).is_empty(),
        "a call was sent without its arguments"
    );
    // Nothing is left for the core to wake for but its routine work.
    fire(&mut c, 600_000);
    assert_eq!(status(&c), Status::NeedsHuman);
    assert_eq!(c.gate().run(&run()).unwrap().state.as_str(), "finalizing");
}

#[test]
fn an_unknown_outcome_settled_with_its_result_is_undone_with_arguments_built_from_it() {
    let mut c = core();
    let mut ex = stopped_with(&mut c, refund(), Outcome::Unknown, None, false);
    fire(&mut c, 0);
    assert!(
        events(&mut ex).is_empty(),
        "nothing is undone before it is settled"
    );
    let settle = SagaAction::Settle {
        outcome: Outcome::Ok,
        result: Some(r#"{"id":"re_9"}"#.into()),
    };
    operator(&mut c, 10, settle);
    fire(&mut c, 10);
    let args = Some(serde_json::json!({"refund": "re_9", "amount": 5}));
    assert_eq!(offers(&mut ex), vec![(1, args)]);
}

#[test]
fn an_unknown_outcome_is_looked_up_through_an_executor_before_it_is_undone() {
    let mut c = core();
    let admit = refund_looked_up_by(Some("find_refund"));
    let mut ex = stopped_with(&mut c, admit, Outcome::Unknown, None, false);
    fire(&mut c, 0);
    let got = events(&mut ex);
    assert_eq!(got.len(), 1, "{got:?}");
    let lookup = &got[0];
    assert_eq!(lookup.event, wire::EventKind::Lookup);
    assert_eq!(lookup.tool.as_deref(), Some("find_refund"));
    assert_eq!(lookup.attempt, Some(1));
    // Asked by the forward call's own key, with its arguments.
    assert_eq!(lookup.idempotency_key.as_deref(), Some("k"));
    assert_eq!(lookup.args, Some(serde_json::json!({"amount": 5})));
    // Its executor goes away: the same lookup is offered again to the next one, not a new one.
    c.handle(at(5), CoreMsg::Disconnect { conn: 7 });
    let mut ex = executor(&mut c, 8);
    fire(&mut c, 5);
    let again = events(&mut ex);
    assert_eq!(again.len(), 1, "{again:?}");
    assert_eq!(
        (again[0].event, again[0].attempt),
        (wire::EventKind::Lookup, Some(1))
    );
    // Found: it happened, with this result, and the undo is built from it.
    let (tx, _) = tmpsc::unbounded_channel();
    let found = Command::SagaStep {
        run: run(),
        key: key(),
        step: estop_kernel::SagaStep::LookupEnd {
            attempt: 1,
            outcome: Outcome::Ok,
            result: Some(r#"{"id":"re_7"}"#.into()),
            error: None,
        },
    };
    apply(&mut c, 20, found, &tx);
    fire(&mut c, 20);
    let args = Some(serde_json::json!({"refund": "re_7", "amount": 5}));
    assert_eq!(offers(&mut ex), vec![(1, args)]);
}

/// A lookup with a recorded `lookup_args` is asked with the arguments it builds from the
/// forward call and its key; one whose mapping cannot be built is sent to no executor and ends
/// `unknown` at once with why, for a human.
#[test]
fn a_mapped_lookup_is_asked_with_the_arguments_its_mapping_builds() {
    let mapped = |source: &str| {
        let Command::Admit(mut a) = refund_looked_up_by(Some("find_refund")) else {
            unreachable!()
        };
        a.policy.lookup_args = Some(source.into());
        Command::Admit(a)
    };
    let mut c = core();
    let admit = mapped(r#"{"path": "/refunds?key=" + key, "amount": args.amount}"#);
    let mut ex = stopped_with(&mut c, admit, Outcome::Unknown, None, false);
    fire(&mut c, 0);
    let got = events(&mut ex);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(
        got[0].args,
        Some(serde_json::json!({"path": "/refunds?key=k", "amount": 5}))
    );

    let mut c = core();
    let admit = mapped(r#"{"path": args.missing}"#);
    let mut ex = stopped_with(&mut c, admit, Outcome::Unknown, None, false);
    fire(&mut c, 0);
    fire(&mut c, 600_000);
    assert!(events(&mut ex).is_empty(), "nothing is sent");
    assert_eq!(status(&c), Status::Unknown);
    let next = c.gate().saga_next(&run()).map(|(_, n)| n);
    assert_eq!(next, Some(estop_kernel::saga::Next::Settle));
    let e = &c.gate().run(&run()).unwrap().effects[&key()];
    let error = e
        .saga
        .as_ref()
        .and_then(|c| c.note.as_deref())
        .unwrap_or("");
    assert!(
        error.contains("the lookup was not sent: `lookup_args` failed"),
        "{error}"
    );
}

#[test]
fn a_lookup_that_cannot_tell_leaves_the_outcome_to_a_human() {
    let mut c = core();
    let admit = refund_looked_up_by(Some("find_refund"));
    let mut ex = stopped_with(&mut c, admit, Outcome::Unknown, None, false);
    fire(&mut c, 0);
    assert_eq!(events(&mut ex).len(), 1);
    let (tx, _) = tmpsc::unbounded_channel();
    let unsure = Command::SagaStep {
        run: run(),
        key: key(),
        step: estop_kernel::SagaStep::LookupEnd {
            attempt: 1,
            outcome: Outcome::Unknown,
            result: None,
            error: Some("provider down".into()),
        },
    };
    apply(&mut c, 20, unsure, &tx);
    fire(&mut c, 20);
    fire(&mut c, 600_000);
    assert!(
        events(&mut ex).is_empty(),
        "no blind retry, of the lookup or the call"
    );
    assert_eq!(status(&c), Status::Unknown);
    let next = c.gate().saga_next(&run()).map(|(_, n)| n);
    assert_eq!(next, Some(estop_kernel::saga::Next::Settle));
}

fn policy(text: &str) -> CoreOptions {
    CoreOptions {
        compensation_policy: Some(Arc::new(estop_policy::Policy::parse(text).unwrap())),
        ..CoreOptions::default()
    }
}

#[test]
fn a_deny_rule_on_the_compensating_tool_refuses_the_compensation() {
    let mut c = core_with(policy(
        r#"
        [[rules]]
        tool = "unrefund"
        when = "args.amount > 1"
        action = "deny"
        name = "no-unrefunds"
        "#,
    ));
    let mut ex = cancelled_with(&mut c, r#"{"id":"re_1"}"#);
    fire(&mut c, 0);
    assert!(offers(&mut ex).is_empty(), "a denied compensation was sent");
    assert_eq!(status(&c), Status::NeedsHuman);
    assert!(note(&c).contains("no-unrefunds"), "{}", note(&c));
    // An operator's retry does not overrule a deny: it is refused again, recorded.
    operator(&mut c, 10, SagaAction::Retry);
    fire(&mut c, 10);
    assert!(offers(&mut ex).is_empty(), "a denied compensation was sent");
    assert_eq!(status(&c), Status::NeedsHuman);
}

fn operator_named(name: &str, groups: &[&str]) -> Principal {
    Principal {
        name: PrincipalName::new(name).unwrap(),
        role: Role::Operator,
        groups: groups.iter().map(|g| (*g).into()).collect(),
        part: Default::default(),
    }
}

/// Applies `cmd` as `who` at `ms`, made durable; returns its answer.
fn answer_of(c: &mut Shell, who: Principal, ms: u64, cmd: Command) -> estop_server::answer::Answer {
    let (tx, mut rx) = tmpsc::unbounded_channel();
    apply_as(c, who, ms, cmd, &tx);
    while let Ok(out) = rx.try_recv() {
        if let Out::Answer { answer, .. } = out {
            return answer;
        }
    }
    panic!("no answer");
}

/// `who` decides the effect's held approval at `ms`; returns the answer.
fn vote(
    c: &mut Shell,
    who: Principal,
    ms: u64,
    decision: Decision,
) -> estop_server::answer::Answer {
    let cmd = Command::Decide {
        run: run(),
        key: key(),
        decision,
        reason: None,
    };
    answer_of(c, who, ms, cmd)
}

/// The approvals inbox as an operator reads it.
fn inbox(c: &mut Shell, ms: u64) -> Vec<wire::PendingItem> {
    let (tx, mut rx) = tmpsc::unbounded_channel();
    let query = estop_server::core::Query::Pending {
        run: None,
        cursor: None,
        page: estop_protocol::PageBudget::new(100, 1 << 20),
    };
    c.handle(
        at(ms),
        CoreMsg::Query {
            principal: alice(),
            query,
            to: reply_to(&tx, 0),
        },
    );
    while let Ok(out) = rx.try_recv() {
        if let Out::Answer {
            answer: estop_server::answer::Answer::Pending(p),
            ..
        } = out
        {
            return p.pending;
        }
    }
    panic!("no inbox");
}

fn error_of(a: &estop_server::answer::Answer) -> (estop_protocol::ErrorCode, String) {
    match a {
        estop_server::answer::Answer::Error(code, m) => (*code, m.clone()),
        other => panic!("expected an error, got {other:?}"),
    }
}

const QUORUM_2: &str = r#"
    [defaults]
    unknown_tool = "deny"

    [[rules]]
    tool = "unrefund"
    action = "approve"
    quorum = 2
    expiry = "1m"
    name = "undo-needs-two"
    "#;

#[test]
fn one_operator_cannot_approve_a_quorum_2_compensation_alone() {
    // Hostile: the approve rule says two approvers. One operator tries everything alone — a
    // vote, the same vote again, a retry, a retry after voting — and an agent tries to vote;
    // nothing is sent until a second, distinct operator votes. (Before: one `retry` sent it.)
    let mut c = core_with(policy(QUORUM_2));
    let mut ex = cancelled_with(&mut c, r#"{"id":"re_1"}"#);
    fire(&mut c, 0);
    assert!(offers(&mut ex).is_empty(), "sent before any approval");
    assert_eq!(
        status(&c),
        Status::Completed,
        "held, not yet a human's problem"
    );
    let held = inbox(&mut c, 1);
    assert_eq!(held.len(), 1, "{held:?}");
    let item = &held[0];
    assert_eq!(
        (item.approval.as_str(), item.tool.as_str()),
        ("r#1", "unrefund")
    );
    assert_eq!(item.compensates.as_deref(), Some("refund"));
    assert_eq!((item.quorum, item.expires_at), (2, T0 + 60_000));
    let args = item.args.as_ref().map(|a| a.to_value());
    assert_eq!(
        args,
        Some(serde_json::json!({"refund": "re_1", "amount": 5}))
    );

    let alice_retry = |c: &mut Shell, ms| {
        let cmd = Command::Saga {
            run: run(),
            key: key(),
            action: SagaAction::Retry,
        };
        answer_of(c, alice(), ms, cmd)
    };
    let (code, m) = error_of(&alice_retry(&mut c, 5));
    assert_eq!(code, estop_protocol::ErrorCode::Conflict);
    assert!(m.contains("awaits approval r#1"), "{m}");
    fire(&mut c, 5);
    assert!(
        offers(&mut ex).is_empty(),
        "a retry stood in for the quorum"
    );

    let (code, _) = error_of(&vote(&mut c, agent(), 6, Decision::Approve));
    assert_eq!(code, estop_protocol::ErrorCode::Forbidden, "an agent voted");
    vote(&mut c, alice(), 7, Decision::Approve);
    fire(&mut c, 7);
    assert!(offers(&mut ex).is_empty(), "sent after one vote of two");
    let (code, m) = error_of(&vote(&mut c, alice(), 8, Decision::Approve));
    assert_eq!(code, estop_protocol::ErrorCode::Conflict, "{m}");
    error_of(&alice_retry(&mut c, 9));
    fire(&mut c, 9);
    assert!(
        offers(&mut ex).is_empty(),
        "one operator met a quorum of two"
    );
    assert_eq!(inbox(&mut c, 9)[0].approvals, vec!["alice".to_string()]);

    vote(&mut c, operator_named("bob", &[]), 10, Decision::Approve);
    fire(&mut c, 10);
    let args = Some(serde_json::json!({"refund": "re_1", "amount": 5}));
    assert_eq!(offers(&mut ex), vec![(1, args)]);
    assert!(
        inbox(&mut c, 11).is_empty(),
        "a met approval stays in the inbox"
    );
}

#[test]
fn a_rejected_or_expired_compensation_approval_asks_a_human_and_a_retry_asks_again() {
    let mut c = core_with(policy(QUORUM_2));
    let mut ex = cancelled_with(&mut c, r#"{"id":"re_1"}"#);
    fire(&mut c, 0);
    vote(&mut c, operator_named("bob", &[]), 1, Decision::Reject);
    fire(&mut c, 1);
    assert!(
        offers(&mut ex).is_empty(),
        "a rejected compensation was sent"
    );
    assert_eq!(status(&c), Status::NeedsHuman);
    assert!(
        note(&c).contains("r#1") && note(&c).contains("bob"),
        "{}",
        note(&c)
    );
    // A retry asks for a new approval; it does not approve.
    operator(&mut c, 2, SagaAction::Retry);
    fire(&mut c, 2);
    assert!(offers(&mut ex).is_empty(), "a retry after a reject sent it");
    let held = inbox(&mut c, 2);
    assert_eq!(
        (held[0].approval.as_str(), held[0].approvals.len()),
        ("r#2", 0)
    );
    vote(&mut c, alice(), 3, Decision::Approve);
    // Unmet at its expiry: a human is asked, nothing is sent.
    fire(&mut c, 60_001);
    assert_eq!(status(&c), Status::CompensationFailed, "expired early");
    fire(&mut c, 60_002);
    assert_eq!(status(&c), Status::NeedsHuman);
    assert!(
        note(&c).contains("r#2 of the compensating call expired"),
        "{}",
        note(&c)
    );
    assert!(offers(&mut ex).is_empty(), "an expired approval sent it");
    assert!(
        inbox(&mut c, 60_003).is_empty(),
        "an expired approval is still listed"
    );
    let (code, _) = error_of(&vote(
        &mut c,
        operator_named("bob", &[]),
        60_003,
        Decision::Approve,
    ));
    assert_eq!(
        code,
        estop_protocol::ErrorCode::NotPending,
        "a vote after the expiry counted"
    );
}

#[test]
fn an_operator_compensates_one_effect_of_a_killed_run() {
    let mut c = core();
    let mut ex = stopped_with(
        &mut c,
        refund(),
        Outcome::Ok,
        Some(r#"{"id":"re_3"}"#),
        true,
    );
    fire(&mut c, 0);
    assert!(
        events(&mut ex).is_empty(),
        "a kill compensates nothing by itself"
    );
    operator(&mut c, 10, SagaAction::Compensate);
    fire(&mut c, 10);
    let args = Some(serde_json::json!({"refund": "re_3", "amount": 5}));
    assert_eq!(offers(&mut ex), vec![(1, args)]);
    assert_eq!(c.gate().run(&run()).unwrap().state.as_str(), "cancelled");
}

#[test]
fn an_operator_asking_for_one_compensation_does_not_approve_it() {
    let mut c = core_with(policy(
        r#"
        [[rules]]
        tool = "unrefund"
        action = "approve"
        name = "undo-needs-a-human"
        "#,
    ));
    let mut ex = stopped_with(
        &mut c,
        refund(),
        Outcome::Ok,
        Some(r#"{"id":"re_4"}"#),
        true,
    );
    operator(&mut c, 10, SagaAction::Compensate);
    fire(&mut c, 10);
    assert!(offers(&mut ex).is_empty(), "asking for it approved it");
    assert_eq!(inbox(&mut c, 11)[0].compensates.as_deref(), Some("refund"));
    vote(&mut c, operator_named("bob", &[]), 12, Decision::Approve);
    fire(&mut c, 12);
    let args = Some(serde_json::json!({"refund": "re_4", "amount": 5}));
    assert_eq!(offers(&mut ex), vec![(1, args)]);
}

/// `admit` started and never reported (its agent died), the run then cancelled (or killed) at
/// 0, an executor connected (conn 7); the core's timeout for calls left in flight is 5 s.
fn left_in_flight(admit: Command, kill: bool) -> (Shell, tmpsc::UnboundedReceiver<Out>) {
    let mut c = core_with(CoreOptions {
        in_flight_timeout_ms: 5_000,
        ..CoreOptions::default()
    });
    let (tx, _) = tmpsc::unbounded_channel();
    apply(&mut c, 0, admit, &tx);
    let cancel = Command::Cancel {
        run: run(),
        reason: None,
        kill,
    };
    apply_as(&mut c, alice(), 0, cancel, &tx);
    let ex = executor(&mut c, 7);
    (c, ex)
}

#[test]
fn a_call_left_in_flight_is_looked_up_once_the_timeout_after_the_stop_has_passed() {
    let admit = refund_looked_up_by(Some("find_refund"));
    let (mut c, mut ex) = left_in_flight(admit, false);
    fire(&mut c, 0);
    assert_eq!(status(&c), Status::Started);
    assert!(events(&mut ex).is_empty(), "looked up while in flight");
    // The core wakes at the deadline, on the gate's clock, and not before.
    fire(&mut c, 10);
    assert_eq!(
        c.next_timeout(at(10)),
        Some(std::time::Duration::from_millis(4_990))
    );
    fire(&mut c, 4_999);
    assert_eq!(status(&c), Status::Started, "unknown before the deadline");
    assert!(events(&mut ex).is_empty());
    fire(&mut c, 5_000);
    assert_eq!(status(&c), Status::Unknown);
    let got = events(&mut ex);
    let lookups: Vec<_> = got
        .iter()
        .filter(|e| e.event == wire::EventKind::Lookup)
        .map(|e| (e.tool.as_deref(), e.attempt))
        .collect();
    assert_eq!(lookups, vec![(Some("find_refund"), Some(1))], "{got:?}");
}

#[test]
fn a_call_a_killed_runs_agent_left_in_flight_settles_the_run_at_the_timeout() {
    // No lookup, and a kill (no saga): the call becomes unknown for a human to look at, and the
    // run, nothing else in flight, reaches its end instead of staying finalizing for ever.
    let (mut c, mut ex) = left_in_flight(refund(), true);
    fire(&mut c, 4_999);
    assert_eq!(c.gate().run(&run()).unwrap().state.as_str(), "finalizing");
    fire(&mut c, 5_000);
    assert_eq!(status(&c), Status::Unknown);
    assert_eq!(c.gate().run(&run()).unwrap().state.as_str(), "cancelled");
    assert!(events(&mut ex).is_empty(), "a kill compensates nothing");
}

/// An executor that asked for some tools only (`estop egress-executor`: `http.*`) is never
/// offered another tool's compensation; one whose pattern matches is.
#[test]
fn an_executor_of_some_tools_is_offered_only_their_compensations() {
    let mut c = core();
    let (tx, _) = tmpsc::unbounded_channel();
    apply(&mut c, 0, refund(), &tx);
    let token = c.gate().run(&run()).unwrap().effects[&key()].token.unwrap();
    let complete = Command::Complete {
        run: run(),
        key: key(),
        token,
        outcome: Outcome::Ok,
        result: Some(r#"{"id":"re_1"}"#.into()),
        error: None,
        cost: Default::default(),
    };
    apply(&mut c, 0, complete, &tx);
    let cancel = Command::Cancel {
        run: run(),
        reason: None,
        kill: false,
    };
    apply(&mut c, 0, cancel, &tx);
    let mut http = executor_of(&mut c, 8, Some("http.*"));
    fire(&mut c, 0);
    assert!(
        events(&mut http).is_empty(),
        "unrefund is not an http.* tool"
    );
    assert_eq!(status(&c), Status::Completed, "nothing began");
    let mut unrefund = executor_of(&mut c, 9, Some("unref*"));
    fire(&mut c, 0);
    assert_eq!(offers(&mut unrefund).len(), 1);
    assert!(events(&mut http).is_empty());
}
