//! The core against a failing disk (crash-simulating storage): a failed write or fsync fails
//! closed — nothing after the last durable record is acknowledged — and the core recovers by
//! itself when the disk works again, with everything acknowledged intact.

use estop_kernel::vocab::{EffectClass, PolicyAction, Reversibility};
use estop_kernel::{
    Admit, Command, Digest, EffectKey, Limits, PolicyDecision, Principal, PrincipalName, Role,
    RunId, RunLimits, ToolName,
};
use estop_ledger::{CrashStorage, LedgerOptions, Storage};
use estop_protocol::{ErrorCode, Id, server_line as wire};
use estop_server::core::{Answer, CoreMsg, CoreOptions, OpenFn, Out, ReplyTo, Shell};
use estop_server::durable::{self, Durability, DurableState};
use estop_server::journal;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc as tmpsc, watch};

struct Harness {
    tx: mpsc::Sender<CoreMsg>,
    durable: watch::Receiver<DurableState>,
    out_tx: tmpsc::UnboundedSender<Out>,
    out_rx: tmpsc::UnboundedReceiver<Out>,
    rt: tokio::runtime::Runtime,
}

fn agent() -> Principal {
    Principal {
        name: PrincipalName::new("agent").unwrap(),
        role: Role::Agent,
        groups: vec![],
        part: Default::default(),
    }
}

fn admit(key: &str) -> Command {
    Command::Admit(Admit {
        run: RunId::new("r1").unwrap(),
        key: EffectKey::new(key).unwrap(),
        tool: ToolName::new("pay").unwrap(),
        digest: Digest([7; 32]),
        args: None,
        start: true,
        parent: None,
        labels: vec![],
        limits: RunLimits::default(),
        policy: PolicyDecision {
            action: PolicyAction::Allow,
            class: EffectClass::Write,
            reversibility: Reversibility::Undeclared,
            compensate: None,
            compensate_args: None,
            lookup: None,
            lookup_args: None,
            quorum: 1,
            groups: vec![],
            expiry_ms: 60_000,
            rule: "test".into(),
        }
        .into(),
        reserve: Default::default(),
    })
}

impl Harness {
    fn start(storage: Arc<CrashStorage>) -> Harness {
        Harness::start_with(storage, CoreOptions::default())
    }

    fn start_with(storage: Arc<CrashStorage>, opts: CoreOptions) -> Harness {
        Harness::start_with_ledger(storage, opts, LedgerOptions::default())
    }

    fn start_with_ledger(
        storage: Arc<CrashStorage>,
        opts: CoreOptions,
        ledger: LedgerOptions,
    ) -> Harness {
        let (durable_tx, durable) = watch::channel(DurableState::default());
        let (tx, rx) = mpsc::channel();
        let st: Arc<dyn Storage> = storage;
        let open: OpenFn = Box::new(move |discard_after| {
            journal::open(
                Arc::clone(&st),
                &Limits::default(),
                LedgerOptions {
                    discard_after,
                    ..ledger.clone()
                },
            )
        });
        let core = Shell::new(opts, Arc::new(durable_tx), open, tx.clone()).unwrap();
        std::thread::spawn(move || core.run(rx));
        let (out_tx, out_rx) = tmpsc::unbounded_channel();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        Harness {
            tx,
            durable,
            out_tx,
            out_rx,
            rt,
        }
    }

    fn stats(&self) -> estop_server::observe::GateStats {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.tx.send(CoreMsg::Stats { reply: tx }).unwrap();
        self.rt.block_on(rx).unwrap()
    }

    /// Sends a command and returns the answer the client would see (after durability).
    fn call(&mut self, cmd: Command) -> Answer {
        let to = ReplyTo {
            out: self.out_tx.clone().into(),
            id: Id::default(),
            charge: None,
        };
        self.tx
            .send(CoreMsg::Apply {
                principal: agent(),
                cmd,
                to,
            })
            .unwrap();
        let out = self.rt.block_on(self.out_rx.recv()).unwrap();
        let Out::Answer { answer, after, .. } = out else {
            panic!("expected an answer")
        };
        let mut rx = self.durable.clone();
        match self.rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(10), durable::wait(&mut rx, after)).await
        }) {
            Ok(Durability::Durable) => answer,
            Ok(Durability::Lost) => Answer::Error(ErrorCode::Unavailable, "lost".into()),
            Err(_) => panic!("reply never became durable or lost"),
        }
    }
}

fn is_admitted(a: &Answer) -> bool {
    matches!(a, Answer::Verdict(wire::VerdictReply::Admitted { .. }))
}

fn is_duplicate(a: &Answer) -> bool {
    matches!(a, Answer::Verdict(wire::VerdictReply::Duplicate { .. }))
}

fn is_unavailable(a: &Answer) -> bool {
    matches!(a, Answer::Error(ErrorCode::Unavailable, _))
}

#[test]
fn disk_full_fails_closed_and_recovers_when_space_returns() {
    let storage = Arc::new(CrashStorage::new(7));
    let mut h = Harness::start(Arc::clone(&storage));
    assert!(is_admitted(&h.call(admit("a"))));
    assert!(is_admitted(&h.call(admit("b"))));
    // The disk fills up: the next change cannot be made durable and is not acknowledged.
    storage.set_space_left(Some(0));
    let failed = h.call(admit("c"));
    assert!(is_unavailable(&failed), "{failed:?}");
    // While the disk is full every change is refused with a clear error.
    let still = h.call(admit("d"));
    assert!(is_unavailable(&still), "{still:?}");
    // Space returns: the core recovers on its own (it retries every second).
    storage.set_space_left(None);
    let deadline = Instant::now() + Duration::from_secs(20);
    let e = loop {
        let a = h.call(admit("e"));
        if !is_unavailable(&a) || Instant::now() > deadline {
            break a;
        }
    };
    assert!(is_admitted(&e), "the core did not recover: {e:?}");
    // Everything acknowledged is intact; nothing unacknowledged was resurrected as admitted twice.
    assert!(is_duplicate(&h.call(admit("a"))));
    assert!(is_duplicate(&h.call(admit("b"))));
    assert!(is_duplicate(&h.call(admit("e"))));
    let c = h.call(admit("c"));
    assert!(is_admitted(&c) || is_duplicate(&c), "{c:?}");
}

#[test]
fn a_failed_fsync_is_never_retried_and_the_unsynced_record_is_not_acknowledged() {
    let storage = Arc::new(CrashStorage::new(11));
    let mut h = Harness::start(Arc::clone(&storage));
    assert!(is_admitted(&h.call(admit("a"))));
    storage.fail_next_sync();
    let failed = h.call(admit("b"));
    assert!(is_unavailable(&failed), "{failed:?}");
    // The core reopened the ledger past the last durable record; a crash now keeps `a` and
    // never resurrects `b` (its pages may have been dropped).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let x = h.call(admit("x"));
        if is_admitted(&x) {
            break;
        }
        assert!(Instant::now() < deadline, "no recovery: {x:?}");
    }
    assert!(is_duplicate(&h.call(admit("a"))));
    assert!(
        is_admitted(&h.call(admit("b"))),
        "the unacknowledged record must not count as admitted"
    );
}

fn complete(key: &str, token: &str) -> Command {
    Command::Complete {
        run: RunId::new("r1").unwrap(),
        key: EffectKey::new(key).unwrap(),
        token: estop_kernel::Token::parse(token).unwrap(),
        outcome: estop_kernel::vocab::Outcome::Ok,
        result: None,
        error: None,
        cost: Default::default(),
    }
}

#[test]
fn a_subscriber_that_stops_reading_loses_its_subscription_instead_of_growing_a_queue() {
    let storage = Arc::new(CrashStorage::new(3));
    let opts = CoreOptions {
        event_backlog_max: 5,
        ..CoreOptions::default()
    };
    let mut h = Harness::start_with(Arc::clone(&storage), opts);
    assert!(is_admitted(&h.call(admit("k0"))));
    // A subscriber whose connection never writes anything out (its queue is never drained).
    let (sub_tx, mut sub_rx) = tmpsc::unbounded_channel();
    let backlog = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let to = ReplyTo {
        out: sub_tx.clone().into(),
        id: Id::default(),
        charge: None,
    };
    h.tx.send(CoreMsg::Subscribe {
        principal: agent(),
        run: RunId::new("r1").unwrap(),
        conn: 99,
        out: sub_tx.into(),
        backlog: Arc::clone(&backlog),
        page: estop_protocol::PageBudget::new(1000, 1 << 20),
        to,
    })
    .unwrap();
    for i in 1..=20 {
        let key = format!("k{i}");
        assert!(is_admitted(&h.call(admit(&key))));
        let done = h.call(complete(&key, &format!("1.{}", i + 1)));
        assert!(matches!(done, Answer::Ack(_)), "{done:?}");
    }
    let mut events = 0;
    while let Ok(out) = sub_rx.try_recv() {
        if matches!(out, Out::Event { .. }) {
            events += 1;
        }
    }
    assert_eq!(
        events, 5,
        "the subscription is dropped at the backlog bound, not after 20 events"
    );
    assert_eq!(backlog.load(std::sync::atomic::Ordering::Relaxed), 5);
}

/// Finding 6: a snapshot that fails (here: the state is over the snapshot bound) was retried on
/// every loop of the core, re-encoding the whole state each time — a livelock under load. Now
/// it backs off, and everything else goes on being served.
#[test]
fn a_failing_snapshot_backs_off_instead_of_being_retried_on_every_loop() {
    let storage = Arc::new(CrashStorage::new(5));
    let opts = CoreOptions {
        snapshot_every_records: 1,
        ..CoreOptions::default()
    };
    let ledger = LedgerOptions {
        snapshot_bytes_max: 16,
        ..LedgerOptions::default()
    };
    let mut h = Harness::start_with_ledger(Arc::clone(&storage), opts, ledger);
    for i in 0..40 {
        assert!(is_admitted(&h.call(admit(&format!("k{i}")))));
    }
    let failures = h.stats().snapshot_failures;
    assert!(
        (1..=2).contains(&failures),
        "{failures} snapshot attempts for 40 requests in well under the first backoff"
    );
}
