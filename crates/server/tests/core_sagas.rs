//! The core's executors of the reverse saga (`core::sagas`), driven through the shell with
//! clocks the test makes up (as `core_time.rs`): a failed attempt is offered again exactly when
//! its backoff ends, never before; a `compensate_args` that cannot be built from the recorded
//! result is recorded as failed attempts, on the same backoff, until a human is asked — and no
//! executor is ever sent a call without its arguments.

use estop_kernel::saga::COMPENSATION_ATTEMPTS_MAX;
use estop_kernel::state::Status;
use estop_kernel::vocab::{EffectClass, Outcome, PolicyAction, Reversibility};
use estop_kernel::{
    Admit, Command, Digest, EffectKey, Limits, PolicyDecision, Principal, PrincipalName, Role,
    RunId, RunLimits, ToolName,
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
    }
}

fn run() -> RunId {
    RunId::new("r").unwrap()
}

fn key() -> EffectKey {
    EffectKey::new("k").unwrap()
}

/// A refund whose undo is `unrefund`, its arguments built from the result's `id`.
fn refund() -> Command {
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
            quorum: 1,
            groups: vec![],
            expiry_ms: 1000,
            rule: "test".into(),
        },
    })
}

fn core() -> Shell {
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
    Shell::new(CoreOptions::default(), Arc::new(durable_tx), open, tx).unwrap()
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
    c.handle(
        at(ms),
        CoreMsg::Apply {
            principal: agent(),
            cmd,
            to: reply_to(tx, 0),
        },
    );
    c.commit();
}

/// A refund completed with `result`, the run cancelled, an executor connected (conn 7): the
/// saga is due. Returns the executor's line queue.
fn cancelled_with(c: &mut Shell, result: &str) -> tmpsc::UnboundedReceiver<Out> {
    let (tx, _) = tmpsc::unbounded_channel();
    apply(c, 0, refund(), &tx);
    let token = c.gate().run(&run()).unwrap().effects[&key()].token.unwrap();
    let complete = Command::Complete {
        run: run(),
        key: key(),
        token,
        outcome: Outcome::Ok,
        result: Some(result.into()),
        error: None,
    };
    apply(c, 0, complete, &tx);
    let cancel = Command::Cancel {
        run: run(),
        reason: None,
        kill: false,
    };
    apply(c, 0, cancel, &tx);
    let (ex_tx, ex_rx) = tmpsc::unbounded_channel();
    let executor = CoreMsg::Executor {
        principal: agent(),
        run: None,
        conn: 7,
        out: ex_tx.clone().into(),
        backlog: Arc::new(AtomicUsize::new(0)),
        to: reply_to(&ex_tx, 1),
    };
    c.handle(at(0), executor);
    ex_rx
}

/// The `compensate` events released to the executor so far, as (attempt, args).
fn offers(rx: &mut tmpsc::UnboundedReceiver<Out>) -> Vec<(u32, Option<serde_json::Value>)> {
    let mut got = Vec::new();
    while let Ok(out) = rx.try_recv() {
        if let Out::Event { event, .. } = out {
            assert_eq!(event.event, wire::EventKind::Compensate);
            assert_eq!(event.idempotency_key.as_deref(), Some("k/undo"));
            got.push((event.attempt.unwrap(), event.args));
        }
    }
    got
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
fn arguments_that_cannot_be_built_fail_attempts_on_the_backoff_until_a_human_is_asked() {
    let mut c = core();
    // The result has no `id`: the mapping cannot build the undo's arguments.
    let mut ex = cancelled_with(&mut c, r#"{"refunded":true}"#);
    let mut now = 0;
    for attempt in 1..=COMPENSATION_ATTEMPTS_MAX {
        c.fire_timers(at(now));
        c.commit();
        let e = &c.gate().run(&run()).unwrap().effects[&key()];
        let saga = e.saga.as_deref().unwrap();
        assert_eq!(saga.attempts, attempt);
        assert!(
            saga.note.as_deref().unwrap().contains("compensate_args"),
            "{:?}",
            saga.note
        );
        if attempt < COMPENSATION_ATTEMPTS_MAX {
            assert_eq!(e.status, Status::CompensationFailed);
            now = saga.retry_at - T0;
        }
    }
    assert_eq!(status(&c), Status::NeedsHuman);
    assert!(
        offers(&mut ex).is_empty(),
        "a call was sent without its arguments"
    );
    // Nothing is left for the core to wake for but its routine work.
    c.fire_timers(at(now + 600_000));
    c.commit();
    assert_eq!(status(&c), Status::NeedsHuman);
    assert_eq!(c.gate().run(&run()).unwrap().state.as_str(), "finalizing");
}
