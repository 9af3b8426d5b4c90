//! The core as data (issue 12): messages and IO outcomes in, actions out — no ledger, no
//! thread, no clock, no channel but the reply addresses it hands back untouched. Each test
//! feeds the core and compares the actions it queued, written one per line as
//! `append <seq>`, `reply <id> @<generation>/<seq> <answer>`, `commit [inline]`, `fail`,
//! `recover`, `snapshot <seq>`, … so what the core asks of its shell reads as a table.

use estop_kernel::record_codec::RecordDecoder;
use estop_kernel::vocab::{Decision, EffectClass, PolicyAction, Reversibility};
use estop_kernel::{
    Admit, Command, Digest, EffectKey, Gate, Limits, PolicyDecision, Principal, PrincipalName,
    Role, RunId, RunLimits, ToolName,
};
use estop_protocol::{Id, PageBudget, server_line as wire};
use estop_server::core::{Action, Answer, Core, CoreMsg, CoreOptions, Now, Out, Reopened, ReplyTo};
use std::time::Duration;
use tokio::sync::mpsc as tmpsc;

const T0: u64 = 1_800_000_000_000;

fn principal(name: &str, role: Role) -> Principal {
    Principal {
        name: PrincipalName::new(name).unwrap(),
        role,
        groups: vec![],
        part: Default::default(),
    }
}

fn agent() -> Principal {
    principal("agent", Role::Agent)
}

fn admit(key: &str, action: PolicyAction) -> Command {
    admit_in("r", key, action)
}

fn admit_in(run: &str, key: &str, action: PolicyAction) -> Command {
    Command::Admit(Admit {
        run: RunId::new(run).unwrap(),
        key: EffectKey::new(key).unwrap(),
        tool: ToolName::new("pay").unwrap(),
        digest: Digest([3; 32]),
        args: None,
        start: false,
        parent: None,
        labels: vec![],
        limits: RunLimits::default(),
        policy: PolicyDecision {
            action,
            class: EffectClass::Write,
            reversibility: Reversibility::Undeclared,
            compensate: None,
            compensate_args: None,
            lookup: None,
            lookup_args: None,
            quorum: 1,
            groups: vec![],
            expiry_ms: 3_600_000,
            rule: "test".into(),
        }
        .into(),
        reserve: Default::default(),
    })
}

/// A core over an empty gate, with one connection's reply channel.
struct Fixture {
    core: Core,
    tx: tmpsc::UnboundedSender<Out>,
    mono: u64,
    /// The seq of the last append the core asked for (what the ledger holds once they are done).
    last_seq: u64,
}

impl Fixture {
    fn new(opts: CoreOptions) -> Fixture {
        let (tx, _rx) = tmpsc::unbounded_channel();
        Fixture {
            core: Core::new(opts, Gate::new(Limits::default()), 0),
            tx,
            mono: 0,
            last_seq: 0,
        }
    }

    fn now(&self) -> Now {
        Now {
            wall_ms: T0 + self.mono,
            mono_ms: self.mono,
        }
    }

    fn to(&self, id: u64) -> ReplyTo {
        ReplyTo {
            out: self.tx.clone().into(),
            id: Id::from_u64(id),
            charge: None,
        }
    }

    fn apply(&mut self, id: u64, principal: Principal, cmd: Command) -> Vec<String> {
        let to = self.to(id);
        let now = self.now();
        assert!(!self.core.handle(now, CoreMsg::Apply { principal, cmd, to }));
        self.actions()
    }

    fn wait(&mut self, id: u64, key: &str, conn: u64) -> Vec<String> {
        let msg = CoreMsg::Wait {
            principal: agent(),
            run: RunId::new("r").unwrap(),
            key: EffectKey::new(key).unwrap(),
            timeout: Duration::from_secs(60),
            conn,
            to: self.to(id),
        };
        let now = self.now();
        assert!(!self.core.handle(now, msg));
        self.actions()
    }

    fn approve(&mut self, id: u64, key: &str) -> Vec<String> {
        let cmd = Command::Decide {
            run: RunId::new("r").unwrap(),
            key: EffectKey::new(key).unwrap(),
            decision: Decision::Approve,
            reason: None,
        };
        self.apply(id, principal("admin", Role::Operator), cmd)
    }

    fn timers(&mut self) -> Vec<String> {
        let now = self.now();
        self.core.fire_timers(now);
        self.actions()
    }

    /// The burst ends: the core's commit, with the ledger's last sync carrying `last_batch`.
    fn commit(&mut self, last_batch: u64) -> Vec<String> {
        self.core.commit(|| last_batch);
        self.actions()
    }

    /// Every action queued, taken as the shell takes them, one line each. Checked on the way,
    /// whatever the test: appends are numbered one by one, as the ledger numbers them, and
    /// nothing is tagged with a record that was not asked for before it.
    fn actions(&mut self) -> Vec<String> {
        let mut lines = Vec::new();
        while let Some(a) = self.core.poll_action() {
            match &a {
                Action::Append { seq, .. } => {
                    assert_eq!(*seq, self.last_seq + 1, "appends out of sequence");
                    self.last_seq = *seq;
                }
                Action::Reply { after, .. } | Action::Event { after, .. } => {
                    assert!(
                        after.seq <= self.last_seq,
                        "tagged with a record not appended"
                    );
                }
                _ => {}
            }
            lines.push(show(&self.core, &a));
        }
        lines
    }
}

fn show(core: &Core, a: &Action) -> String {
    match a {
        Action::Append { seq, bytes } => {
            // The bytes are the record itself, as recovery will read it back.
            let rec = RecordDecoder::default().decode(core.record(bytes)).unwrap();
            format!("append {seq} {}", command(&rec.command))
        }
        Action::Commit { inline: true } => "commit inline".into(),
        Action::Commit { inline: false } => "commit".into(),
        Action::Reply { to, answer, after } => format!(
            "reply {} @{}/{} {}",
            to.id,
            after.generation,
            after.seq,
            answered(answer)
        ),
        Action::Event {
            event, after, conn, ..
        } => {
            format!(
                "event {:?} to {conn} @{}/{}",
                event.event, after.generation, after.seq
            )
        }
        Action::Feed { event, .. } => format!("feed {}", event.event),
        Action::Snapshot { seq, .. } => format!("snapshot {seq}"),
        Action::FailLedger => "fail".into(),
        Action::Recover => "recover".into(),
        Action::Stats { stats, .. } => format!("stats waiters={}", stats.waiters),
        Action::Flush => "flush".into(),
        Action::Stopped { .. } => "stopped".into(),
    }
}

fn command(c: &Command) -> String {
    match c {
        Command::Admit(a) => format!("admit {}", a.key),
        Command::Decide { key, .. } => format!("decide {key}"),
        Command::Recheck { key, .. } => format!("recheck {key}"),
        other => format!("{other:?}")
            .split([' ', '{'])
            .next()
            .unwrap()
            .to_lowercase(),
    }
}

fn answered(a: &Answer) -> String {
    match a {
        Answer::Verdict(wire::VerdictReply::Admitted { .. }) => "admitted".into(),
        Answer::Verdict(wire::VerdictReply::Held { reason, .. }) => format!("held:{reason}"),
        Answer::Verdict(wire::VerdictReply::Duplicate { .. }) => "duplicate".into(),
        Answer::Verdict(v) => format!("{v:?}"),
        Answer::Decided(d) => format!("decided:{}", d.status),
        Answer::Error(code, _) => format!("error:{code:?}"),
        Answer::Subscribed(s) => match &s.replay {
            None => "subscribed".into(),
            Some(r) => replayed(r),
        },
        _ => "other".into(),
    }
}

/// A `subscribe` reply's replay as one line: state, epoch, cause, and each `key:status(approval)`.
fn replayed(r: &wire::RunReplay) -> String {
    let mut s = format!("subscribed {} epoch {}", r.state, r.epoch);
    if let Some(c) = &r.cause {
        s += &format!(" cause {c}");
    }
    for a in &r.awaiting {
        s += &format!(" {}:{}", a.key, a.status);
        if let Some(id) = &a.approval {
            s += &format!("({id})");
        }
    }
    if r.more {
        s += " more";
    }
    s
}

#[test]
fn an_admit_appends_its_record_and_replies_tagged_with_that_seq_then_the_burst_commits() {
    let mut f = Fixture::new(CoreOptions::default());
    assert_eq!(
        f.apply(1, agent(), admit("a", PolicyAction::Allow)),
        ["append 1 admit a", "reply 1 @0/1 admitted"]
    );
    assert_eq!(
        f.apply(2, agent(), admit("b", PolicyAction::Allow)),
        ["append 2 admit b", "reply 2 @0/2 admitted"]
    );
    // Nothing asks for a sync until the burst ends; then one commit covers both.
    assert_eq!(f.commit(0), ["commit inline"]);
    // The same admit again changes nothing: no record, and its answer waits for the last
    // record (the state it reports may rest on it).
    assert_eq!(
        f.apply(3, agent(), admit("a", PolicyAction::Allow)),
        ["reply 3 @0/2 admitted"]
    );
    assert_eq!(f.commit(0), Vec::<String>::new(), "nothing new to commit");
}

#[test]
fn a_lone_request_is_synced_inline_and_a_stream_of_them_on_the_sync_thread() {
    let mut f = Fixture::new(CoreOptions::default());
    f.apply(1, agent(), admit("a", PolicyAction::Allow));
    assert_eq!(
        f.commit(1),
        ["commit inline"],
        "a light burst, the syncer idle"
    );
    f.apply(2, agent(), admit("b", PolicyAction::Allow));
    assert_eq!(
        f.commit(40),
        ["commit"],
        "the last sync carried many: under load"
    );
    for k in ["c", "d", "e"] {
        f.apply(3, agent(), admit(k, PolicyAction::Allow));
    }
    assert_eq!(f.commit(1), ["commit"], "a burst of three");
    let mut off = Fixture::new(CoreOptions {
        inline_sync: false,
        ..CoreOptions::default()
    });
    off.apply(1, agent(), admit("a", PolicyAction::Allow));
    assert_eq!(off.commit(0), ["commit"]);
}

#[test]
fn a_parked_wait_is_answered_by_the_decision_unless_its_connection_is_gone() {
    for disconnect in [false, true] {
        let mut f = Fixture::new(CoreOptions::default());
        assert_eq!(
            f.apply(1, agent(), admit("k", PolicyAction::Approve)),
            ["append 1 admit k", "reply 1 @0/1 held:approval"]
        );
        assert_eq!(f.wait(2, "k", 7), Vec::<String>::new(), "parked");
        if disconnect {
            let now = f.now();
            f.core.handle(now, CoreMsg::Disconnect { conn: 7 });
            assert_eq!(f.actions(), Vec::<String>::new());
        }
        let expected = if disconnect {
            vec!["append 2 decide k", "reply 3 @0/2 decided:approved"]
        } else {
            // The waiter's recheck consumes the approval: a record, and its verdict after it;
            // the decision's reply then waits for that record too (it follows it).
            vec![
                "append 2 decide k",
                "append 3 recheck k",
                "reply 2 @0/3 admitted",
                "reply 3 @0/3 decided:approved",
            ]
        };
        assert_eq!(f.approve(3, "k"), expected, "disconnect: {disconnect}");
        let (tx, _rx) = tokio::sync::oneshot::channel();
        let now = f.now();
        f.core.handle(now, CoreMsg::Stats { reply: tx });
        assert_eq!(f.actions(), ["stats waiters=0"]);
    }
}

#[test]
fn a_failed_append_fails_closed_answers_the_waits_and_recovers_with_the_ledgers_seqs() {
    let mut f = Fixture::new(CoreOptions::default());
    f.apply(1, agent(), admit("held", PolicyAction::Approve));
    f.wait(2, "held", 7);
    assert_eq!(
        f.apply(3, agent(), admit_in("s", "a", PolicyAction::Allow)),
        ["append 2 admit a", "reply 3 @0/2 admitted"]
    );
    // The shell could not append record 2: nothing past the durable prefix is acknowledged
    // (the shell's `fail` turns reply 3 into `unavailable`), the wait is answered, and the
    // ledger is to be reopened.
    f.core.append_failed();
    assert_eq!(
        f.actions(),
        ["fail", "reply 2 @0/2 error:Unavailable", "recover"]
    );
    assert!(!f.core.is_writing());
    // While it is down a change is refused at once, with no record and no commit.
    assert_eq!(
        f.apply(4, agent(), admit_in("s", "b", PolicyAction::Allow)),
        ["reply 4 @0/2 error:Unavailable"]
    );
    assert_eq!(f.commit(0), Vec::<String>::new());
    // The reopening failed (nothing reported): the next attempt comes a second later.
    f.mono += 999;
    assert!(!f.timers().contains(&"recover".to_string()));
    f.mono += 1;
    assert!(f.timers().contains(&"recover".to_string()));
    // It reopened with record 1 only (record 2 never reached the disk): the next record is 2
    // again, in generation 1.
    let mut gate = Gate::new(Limits::default());
    gate.apply(T0, &agent(), &admit("held", PolicyAction::Approve))
        .unwrap();
    f.core.reopened(Reopened {
        gate,
        generation: 1,
        last_seq: 1,
        writing: true,
    });
    f.last_seq = 1;
    assert!(f.core.is_writing());
    assert_eq!(
        f.apply(5, agent(), admit_in("s", "b", PolicyAction::Allow)),
        ["append 2 admit b", "reply 5 @1/2 admitted"]
    );
}

#[test]
fn a_failed_snapshot_is_retried_after_a_backoff_that_doubles() {
    let mut f = Fixture::new(CoreOptions {
        snapshot_every_records: 1,
        ..CoreOptions::default()
    });
    f.apply(1, agent(), admit("a", PolicyAction::Allow));
    let snapshots = |lines: Vec<String>| {
        lines
            .into_iter()
            .filter(|l| l.starts_with("snapshot"))
            .collect::<Vec<_>>()
    };
    assert_eq!(snapshots(f.timers()), ["snapshot 1"]);
    assert_eq!(f.core.snapshot_failed(), Duration::from_secs(1));
    f.mono += 999;
    assert!(
        snapshots(f.timers()).is_empty(),
        "retried before its backoff"
    );
    f.mono += 1;
    assert_eq!(snapshots(f.timers()), ["snapshot 1"]);
    assert_eq!(f.core.snapshot_failed(), Duration::from_secs(2));
    f.mono += 1_999;
    assert!(snapshots(f.timers()).is_empty());
    f.mono += 1;
    assert_eq!(snapshots(f.timers()), ["snapshot 1"]);
    f.core.snapshot_done();
    assert!(snapshots(f.timers()).is_empty(), "no record since");
    f.apply(2, agent(), admit("b", PolicyAction::Allow));
    assert_eq!(snapshots(f.timers()), ["snapshot 2"]);
}

#[test]
fn a_feed_hears_each_change_until_it_is_gone_and_shutdown_flushes_then_stops() {
    let mut f = Fixture::new(CoreOptions::default());
    let (feed, _feed_rx) = tokio::sync::mpsc::channel(8);
    let now = f.now();
    f.core.handle(
        now,
        CoreMsg::Feed {
            principal: principal("admin", Role::Operator),
            tx: feed.clone(),
        },
    );
    assert_eq!(
        f.apply(1, agent(), admit("a", PolicyAction::Allow)),
        ["append 1 admit a", "feed admitted", "reply 1 @0/1 admitted"]
    );
    f.core.feed_gone(&feed);
    assert_eq!(
        f.apply(2, agent(), admit("b", PolicyAction::Allow)),
        ["append 2 admit b", "reply 2 @0/2 admitted"]
    );
    let (done, _) = std::sync::mpsc::channel();
    let now = f.now();
    assert!(f.core.handle(now, CoreMsg::Shutdown { done }), "stops");
    assert_eq!(f.actions(), ["flush", "stopped"]);
}

#[test]
fn a_subscriber_hears_each_change_after_its_record_until_the_shell_reports_it_gone() {
    let mut f = Fixture::new(CoreOptions::default());
    let msg = CoreMsg::Subscribe {
        principal: agent(),
        run: RunId::new("r").unwrap(),
        conn: 9,
        out: f.tx.clone().into(),
        backlog: std::sync::Arc::default(),
        page: PageBudget::new(1000, 1 << 20),
        to: f.to(1),
    };
    let now = f.now();
    f.core.handle(now, msg);
    assert_eq!(
        f.actions(),
        ["reply 1 @0/0 subscribed"],
        "an ack: the run is not there yet"
    );
    assert_eq!(
        f.apply(2, agent(), admit("a", PolicyAction::Approve)),
        [
            "append 1 admit a",
            "event Held to 9 @0/1",
            "reply 2 @0/1 held:approval"
        ]
    );
    // The shell found the connection gone (or not reading its events): no more events.
    f.core.subscriber_gone(&RunId::new("r").unwrap(), 9);
    assert_eq!(
        f.apply(3, agent(), admit("b", PolicyAction::Approve)),
        ["append 2 admit b", "reply 3 @0/2 held:approval"]
    );
}

impl Fixture {
    fn subscribe(&mut self, id: u64, who: Principal, conn: u64, page: PageBudget) -> Vec<String> {
        let msg = CoreMsg::Subscribe {
            principal: who,
            run: RunId::new("r").unwrap(),
            conn,
            out: self.tx.clone().into(),
            backlog: std::sync::Arc::default(),
            page,
            to: self.to(id),
        };
        let now = self.now();
        assert!(!self.core.handle(now, msg));
        self.actions()
    }
}

/// Issue 28: a client that subscribes again after a closed connection learns what it missed.
/// The reply replays the run's state and the effects awaiting a decision, taken in the step
/// that puts the subscription in place (nothing falls between it and the first event), tagged
/// with the last record so it is released only once what it shows is durable; at most a page
/// of them (`more`); another principal's run answers the plain ack a missing run gets.
#[test]
fn a_subscribe_replays_the_runs_durable_state_in_the_step_that_subscribes() {
    let mut f = Fixture::new(CoreOptions::default());
    f.apply(1, agent(), admit("a", PolicyAction::Approve));
    f.apply(2, agent(), admit("b", PolicyAction::Approve));
    f.apply(3, agent(), admit("c", PolicyAction::Allow));
    assert_eq!(
        f.approve(4, "a"),
        ["append 4 decide a", "reply 4 @0/4 decided:approved"]
    );
    let page = || PageBudget::new(1000, 1 << 20);
    // `a` approved (not yet admitted), `b` awaiting its approval, `c` held as their sibling.
    assert_eq!(
        f.subscribe(5, agent(), 9, page()),
        ["reply 5 @0/4 subscribed active epoch 1 a:approved(r#1) b:held(r#2) c:held"]
    );
    // The next change comes as an event to the subscription made in that step.
    let cancel = Command::Cancel {
        run: RunId::new("r").unwrap(),
        reason: Some("stop".into()),
        kill: false,
    };
    let after = f.apply(6, agent(), cancel);
    assert!(
        after.contains(&"event Cancelled to 9 @0/5".to_string()),
        "{after:?}"
    );
    // After the stop: the cause, and nothing awaits (the stop refused what was held).
    assert_eq!(
        f.subscribe(7, agent(), 10, page()),
        ["reply 7 @0/5 subscribed cancelled epoch 2 cause cancelled"]
    );
    // Bounded by the page: one item, and `more`.
    f.apply(8, agent(), admit_in("r2", "x", PolicyAction::Approve));
    f.apply(9, agent(), admit_in("r2", "y", PolicyAction::Approve));
    let msg = CoreMsg::Subscribe {
        principal: agent(),
        run: RunId::new("r2").unwrap(),
        conn: 11,
        out: f.tx.clone().into(),
        backlog: std::sync::Arc::default(),
        page: PageBudget::new(1, 1 << 20),
        to: f.to(10),
    };
    let now = f.now();
    f.core.handle(now, msg);
    assert_eq!(
        f.actions(),
        ["reply 10 @0/7 subscribed active epoch 1 x:held(r2#1) more"]
    );
    // Another principal: the plain ack, as for a run that does not exist.
    assert_eq!(
        f.subscribe(11, principal("mallory", Role::Agent), 12, page()),
        ["reply 11 @0/7 subscribed"]
    );
}
