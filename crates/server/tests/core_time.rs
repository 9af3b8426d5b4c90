//! Time is an input of the core (issue 12): the test drives the core through the shell that
//! executes its actions, as the daemon's core thread does (`Shell::handle(now, msg)`,
//! `Shell::fire_timers(now)`), with clocks it makes up — no sleep, no
//! thread of the core's own, and the ledger syncing on the test's thread (`caller_syncs`), so
//! every step is deterministic: a reply is out only after the commit that makes it durable, a
//! wait ends exactly when its time is up, an approval expires exactly at its expiry, and one
//! wall-clock reading a year ahead changes nothing.

use estop_kernel::vocab::{EffectClass, PolicyAction, Reversibility};
use estop_kernel::{
    Admit, Command, Digest, EffectKey, Limits, PolicyDecision, Principal, PrincipalName, Role,
    RunId, RunLimits, ToolName,
};
use estop_ledger::{LedgerOptions, MemStorage, Storage};
use estop_protocol::{Id, server_line as wire};
use estop_server::core::{Answer, CoreMsg, CoreOptions, Now, OpenFn, Out, ReplyTo, Shell};
use estop_server::durable::DurableState;
use estop_server::journal;
use std::sync::{Arc, mpsc};
use std::time::Duration;
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

fn held(key: &str, expiry_ms: u64) -> Command {
    Command::Admit(Admit {
        run: RunId::new("r").unwrap(),
        key: EffectKey::new(key).unwrap(),
        tool: ToolName::new("refund").unwrap(),
        digest: Digest([9; 32]),
        args: None,
        start: true,
        parent: None,
        labels: vec![],
        limits: RunLimits::default(),
        policy: PolicyDecision {
            action: PolicyAction::Approve,
            class: EffectClass::Write,
            reversibility: Reversibility::Undeclared,
            compensate: None,
            compensate_args: None,
            lookup: None,
            lookup_args: None,
            quorum: 1,
            groups: vec![],
            expiry_ms,
            rule: "test".into(),
        }
        .into(),
        reserve: Default::default(),
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
                // No sync thread: every step runs, and releases, on this test's thread.
                caller_syncs: true,
                ..LedgerOptions::default()
            },
        )
    });
    let (tx, _rx) = mpsc::channel();
    Shell::new(CoreOptions::default(), Arc::new(durable_tx), open, tx).unwrap()
}

fn at(wall_ms: u64, mono_ms: u64) -> Now {
    Now { wall_ms, mono_ms }
}

/// The answers released so far, as (id, answer).
fn drain(rx: &mut tmpsc::UnboundedReceiver<Out>) -> Vec<(u64, Answer)> {
    let mut got = Vec::new();
    while let Ok(out) = rx.try_recv() {
        if let Out::Answer { id, answer, .. } = out {
            got.push((id.as_u64().unwrap(), answer));
        }
    }
    got
}

fn reply_to(tx: &tmpsc::UnboundedSender<Out>, id: u64) -> ReplyTo {
    ReplyTo {
        out: tx.clone().into(),
        id: Id::from_u64(id),
        charge: None,
    }
}

fn is_held(a: &Answer) -> bool {
    matches!(a, Answer::Verdict(wire::VerdictReply::Held { .. }))
}

#[test]
fn a_wait_ends_exactly_when_its_time_is_up_on_the_clock_it_is_given() {
    let mut c = core();
    let (tx, mut rx) = tmpsc::unbounded_channel();
    let apply = CoreMsg::Apply {
        principal: agent(),
        cmd: held("k", 600_000),
        to: reply_to(&tx, 1),
    };
    assert!(!c.handle(at(T0, 0), apply));
    // Nothing is out before its record is durable; the commit syncs here and releases it.
    assert!(drain(&mut rx).is_empty(), "a reply before its fdatasync");
    c.commit();
    let first = drain(&mut rx);
    assert!(first.len() == 1 && is_held(&first[0].1), "{first:?}");
    let wait = CoreMsg::Wait {
        principal: agent(),
        run: RunId::new("r").unwrap(),
        key: EffectKey::new("k").unwrap(),
        timeout: Duration::from_millis(5_000),
        conn: 7,
        to: reply_to(&tx, 2),
    };
    assert!(!c.handle(at(T0 + 10, 10), wait));
    // The core asks to be woken when the wait ends, measured on the clock it was given.
    assert_eq!(
        c.next_timeout(at(T0 + 10, 10)),
        Some(Duration::from_millis(1_000))
    );
    c.fire_timers(at(T0 + 5_009, 5_009));
    assert!(drain(&mut rx).is_empty(), "answered before its time");
    c.fire_timers(at(T0 + 5_010, 5_010));
    let done = drain(&mut rx);
    assert!(
        done.len() == 1 && done[0].0 == 2 && is_held(&done[0].1),
        "{done:?}"
    );
}

#[test]
fn an_approval_expires_on_the_gate_clock_and_one_bad_wall_reading_changes_nothing() {
    let mut c = core();
    let (tx, mut rx) = tmpsc::unbounded_channel();
    let apply = CoreMsg::Apply {
        principal: agent(),
        cmd: held("k", 60_000),
        to: reply_to(&tx, 1),
    };
    c.handle(at(T0, 0), apply);
    c.commit();
    // One reading a year ahead: no expiry (the gate's time follows the monotonic clock).
    let year = 365 * 24 * 3600 * 1000;
    c.fire_timers(at(T0 + year, 1_000));
    let status = |c: &Shell| {
        let run = c.gate().run(&RunId::new("r").unwrap()).unwrap();
        run.pending_approvals
    };
    assert_eq!(status(&c), 1, "a bad reading expired the approval");
    // Its expiry on the gate's clock: due at T0 + 60 s.
    c.fire_timers(at(T0 + 59_999, 59_999));
    assert_eq!(status(&c), 1);
    c.fire_timers(at(T0 + 60_000, 60_000));
    assert_eq!(status(&c), 0, "the approval did not expire at its time");
    drop(drain(&mut rx));
}
