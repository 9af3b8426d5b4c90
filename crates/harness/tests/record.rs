//! The turn logic on the record: control actions at each boundary, late results dropped,
//! approvals (silence is no), truncated or cut replies never dispatched, budgets at each stage;
//! and a random walk over every input, checked after each step.

use estop_harness::budget::{Budget, Dimension, Limits, Prices, Usage};
use estop_harness::chat::{Finish, Overflow, Reply, ToolCall};
use estop_harness::contract::{AnswerFormat, Contract, World};
use estop_harness::machine::State;
use estop_harness::record::{
    Action, Admission, CallLimits, Control, Decision, Exit, GrantedTool, Grants, HeldRequest,
    Identity, Lease, Record, call_digest,
};
use proptest::prelude::*;

fn record(limits: Limits) -> Record {
    Record::new(
        Identity {
            id: "t1".into(),
            tenant: "acme".into(),
            task: "task".into(),
            ..Identity::default()
        },
        CallLimits {
            model: "m".into(),
            max_output_tokens: 100,
            call_deadline_ms: 1_000,
            tool_deadline_ms: 500,
            retry: Default::default(),
        },
        Budget::new(
            limits,
            Prices {
                input: 1.0,
                cached_input: 0.1,
                output: 2.0,
            },
            0,
        ),
        Grants {
            tools: vec![
                GrantedTool {
                    name: "read".into(),
                    read_only: true,
                },
                GrantedTool {
                    name: "write".into(),
                    read_only: false,
                },
            ],
            restricted: false,
        },
        "log".into(),
    )
}

fn usage() -> Option<Usage> {
    Some(Usage {
        uncached_input: 10,
        cached_input: 0,
        output: 5,
    })
}

fn calls(names: &[(&str, &str)]) -> Reply {
    Reply::Finished {
        finish: Finish::ToolCalls,
        text: String::new(),
        tool_calls: names
            .iter()
            .map(|(id, n)| ToolCall::new(id, n, "{}"))
            .collect(),
        usage: usage(),
    }
}

fn dispatched(a: &[Action]) -> Vec<String> {
    a.iter()
        .filter_map(|a| match a {
            Action::Dispatch { call, .. } => Some(call.id.clone()),
            _ => None,
        })
        .collect()
}

/// The tokens the dispatched calls are started with.
fn dispatched_tokens(a: &[Action]) -> Vec<&str> {
    a.iter()
        .filter_map(|a| match a {
            Action::Dispatch { token, .. } => Some(token.as_str()),
            _ => None,
        })
        .collect()
}

fn observed(a: &[Action]) -> Vec<String> {
    a.iter()
        .filter_map(|a| match a {
            Action::Observe { message } => message.content.clone(),
            _ => None,
        })
        .collect()
}

fn admitted(tok: &str) -> Admission {
    Admission::Admitted { token: tok.into() }
}

#[test]
fn a_turn_dispatches_only_after_admission_and_accepts_only_pending_results() {
    let mut r = record(Limits::default());
    let a = r.begin_turn(0, 10).unwrap();
    assert!(matches!(a[..], [Action::CallModel { .. }]));
    let a = r
        .on_reply(1, calls(&[("c1", "read"), ("c2", "write")]))
        .unwrap();
    assert!(
        dispatched(&a).is_empty(),
        "nothing runs before the gate answers"
    );
    assert!(
        a.iter()
            .any(|a| matches!(a, Action::Admit { calls } if calls.len() == 2))
    );
    assert!(dispatched(&r.on_admission(2, "c1", admitted("k1")).unwrap()).is_empty());
    let a = r.on_admission(2, "c2", admitted("k2")).unwrap();
    assert_eq!(dispatched(&a), ["c1", "c2"]);
    assert_eq!(r.state, State::WaitingTool);
    // An unknown id is dropped and logged, never observed.
    let a = r.on_tool_result(3, "zz", "x".into()).unwrap();
    assert!(matches!(&a[..], [Action::Dropped { call_id, .. }] if call_id == "zz"));
    r.on_tool_result(3, "c1", "one".into()).unwrap();
    assert_eq!(r.state, State::WaitingTool);
    // c2 passes its deadline: removed before its timeout is observed, so its late result
    // finds no match (observation crossing, seed 004).
    let a = r.on_tick(600).unwrap();
    assert!(
        a.iter()
            .any(|a| matches!(a, Action::MarkUnknown { call, .. } if call.id == "c2"))
    );
    assert_eq!(r.state, State::Ready);
    let a = r.on_tool_result(601, "c2", "late".into()).unwrap();
    assert!(matches!(&a[..], [Action::Dropped { .. }]));
    assert!(observed(&a).is_empty());
}

#[test]
fn truncated_cut_and_failed_replies_are_never_dispatched() {
    for reply in [
        Reply::Finished {
            finish: Finish::Length,
            text: String::new(),
            tool_calls: vec![ToolCall::new(
                "c1",
                "write",
                "{\"action\": \"drop_table\", \"target\": \"cust",
            )],
            usage: usage(),
        },
        Reply::Cut { usage: None },
        Reply::Failed {
            error: "503".into(),
            retryable: true,
            usage: None,
            retry_after_ms: None,
        },
        Reply::Overflow {
            overflow: Overflow::ToolCalls {
                index: 1_000_000_000_000,
                max: 128,
            },
            usage: None,
        },
    ] {
        let mut r = record(Limits::default());
        r.begin_turn(0, 10).unwrap();
        let a = r.on_reply(1, reply.clone()).unwrap();
        assert!(
            !a.iter()
                .any(|a| matches!(a, Action::Admit { .. } | Action::Dispatch { .. })),
            "{reply:?} → {a:?}"
        );
        assert_eq!(r.state, State::Ready, "{reply:?}");
        assert!(r.pending.is_empty());
        assert_eq!(r.budget.reserved, None, "the call is settled");
    }
}

/// A reply the client cut past a bound of the stream (issue 27): the model is told which bound,
/// as a message it reads at its next turn, nothing is admitted or dispatched, the trajectory is
/// READY to plan again and the call paid its reservation (no usage came).
#[test]
fn a_reply_over_a_bound_tells_the_model_and_dispatches_nothing() {
    let mut r = record(Limits::default());
    r.begin_turn(0, 10).unwrap();
    let o = Overflow::ToolCalls {
        index: 1_000_000_000_000,
        max: 128,
    };
    let a = r
        .on_reply(
            1,
            Reply::Overflow {
                overflow: o,
                usage: None,
            },
        )
        .unwrap();
    assert!(
        !a.iter()
            .any(|a| matches!(a, Action::Admit { .. } | Action::Dispatch { .. })),
        "{a:?}"
    );
    let seen = observed(&a);
    assert_eq!(seen.len(), 1, "{a:?}");
    assert!(
        seen[0].contains("REPLY_OVERFLOW") && seen[0].contains("1000000000000"),
        "{}",
        seen[0]
    );
    assert_eq!(r.state, State::Ready);
    assert!(r.pending.is_empty());
    assert_eq!(r.budget.reserved, None, "the call is settled");
}

#[test]
fn cancel_at_each_boundary_ends_canceled_through_finalizing() {
    // At READY: at once.
    let mut r = record(Limits::default());
    let a = r
        .on_control(
            0,
            Control::Cancel {
                reason: "stop".into(),
            },
        )
        .unwrap();
    assert_eq!(r.state, State::Canceled);
    assert!(matches!(
        a.last(),
        Some(Action::Ended {
            state: State::Canceled
        })
    ));
    // During a model call: the stream is cut; the cut reply reaches READY, where it applies.
    let mut r = record(Limits::default());
    r.begin_turn(0, 10).unwrap();
    assert_eq!(
        r.on_control(
            1,
            Control::Cancel {
                reason: "stop".into()
            }
        )
        .unwrap(),
        [Action::CutModel]
    );
    assert_eq!(r.state, State::CallingModel);
    r.on_reply(2, Reply::Cut { usage: None }).unwrap();
    assert_eq!(r.state, State::Canceled);
    // A reply that finished before the cut arrived: parsed, nothing dispatched.
    let mut r = record(Limits::default());
    r.begin_turn(0, 10).unwrap();
    r.on_control(
        1,
        Control::Cancel {
            reason: "stop".into(),
        },
    )
    .unwrap();
    let a = r.on_reply(2, calls(&[("c1", "write")])).unwrap();
    assert!(dispatched(&a).is_empty() && !a.iter().any(|a| matches!(a, Action::Admit { .. })));
    assert_eq!(r.state, State::Canceled);
    // While tools run: outstanding calls cancelled and marked unknown, with an observation.
    let mut r = record(Limits::default());
    r.begin_turn(0, 10).unwrap();
    r.on_reply(1, calls(&[("c1", "write")])).unwrap();
    r.on_admission(1, "c1", admitted("k")).unwrap();
    let a = r
        .on_control(
            2,
            Control::Cancel {
                reason: "stop".into(),
            },
        )
        .unwrap();
    assert!(a.contains(&Action::CancelTool {
        call_id: "c1".into()
    }));
    assert!(a.iter().any(|a| matches!(a, Action::MarkUnknown { .. })));
    assert_eq!(r.state, State::Canceled);
    assert!(r.pending.is_empty());
}

#[test]
fn pause_waits_for_ready_and_resume_returns() {
    let mut r = record(Limits::default());
    r.begin_turn(0, 10).unwrap();
    r.on_reply(1, calls(&[("c1", "read")])).unwrap();
    r.on_admission(1, "c1", admitted("k")).unwrap();
    r.on_control(2, Control::Pause).unwrap();
    assert_eq!(
        r.state,
        State::WaitingTool,
        "a pause waits for the boundary"
    );
    r.on_tool_result(3, "c1", "ok".into()).unwrap();
    assert_eq!(r.state, State::Paused);
    assert!(r.begin_turn(4, 10).is_err(), "no turn while paused");
    // An interrupt while paused waits for the resume.
    r.on_control(
        5,
        Control::Interrupt {
            message: "new plan".into(),
        },
    )
    .unwrap();
    r.on_control(6, Control::Resume).unwrap();
    assert_eq!(r.state, State::Ready);
    let a = r.begin_turn(7, 10).unwrap();
    assert_eq!(observed(&a), ["new plan"]);
    assert_eq!(r.state, State::CallingModel);
}

/// A control request that arrives while the gate answers the admissions applies at the last
/// boundary before dispatch: nothing is dispatched, each call gets a marker, and the pause
/// takes effect. The same after an approval.
#[test]
fn a_control_waiting_at_dispatch_stops_the_dispatch() {
    let mut r = record(Limits::default());
    r.begin_turn(0, 10).unwrap();
    r.on_reply(1, calls(&[("c1", "read")])).unwrap();
    r.on_control(2, Control::Pause).unwrap();
    let a = r.on_admission(3, "c1", admitted("k")).unwrap();
    assert!(dispatched(&a).is_empty(), "{a:?}");
    assert!(observed(&a).iter().any(|o| o.contains("INTERRUPTED")));
    assert_eq!(r.state, State::Paused);

    let mut r = record(Limits::default());
    r.begin_turn(0, 10).unwrap();
    r.on_reply(1, calls(&[("c1", "write")])).unwrap();
    r.on_admission(1, "c1", Admission::Held { expires_at_ms: 100 })
        .unwrap();
    r.on_control(
        2,
        Control::Interrupt {
            message: "wait, not that".into(),
        },
    )
    .unwrap();
    let a = r
        .on_decision(3, "c1", Decision::Approved { token: "k".into() })
        .unwrap();
    assert!(dispatched(&a).is_empty(), "{a:?}");
    assert_eq!(r.state, State::Ready);
    assert_eq!(observed(&a).last().unwrap(), "wait, not that");
}

#[test]
fn kill_is_immediate_even_mid_call() {
    let mut r = record(Limits::default());
    r.begin_turn(0, 10).unwrap();
    let a = r
        .on_control(
            1,
            Control::Kill {
                reason: "escape".into(),
            },
        )
        .unwrap();
    assert_eq!(a[0], Action::CutModel);
    assert_eq!(r.state, State::Failed);
    assert_eq!(
        r.exit,
        Some(Exit::Killed {
            reason: "escape".into()
        })
    );
    // The cut reply that arrives after is not expected: a typed error, nothing changes.
    let before = r.clone();
    assert!(r.on_reply(2, Reply::Cut { usage: None }).is_err());
    assert_eq!(r, before);
}

#[test]
fn approvals_dispatch_only_on_approved_and_silence_is_no() {
    for (decision, dispatches) in [
        (Decision::Approved { token: "k".into() }, true),
        (Decision::Denied, false),
        (Decision::Expired, false),
        (Decision::Canceled, false),
    ] {
        let mut r = record(Limits::default());
        r.begin_turn(0, 10).unwrap();
        r.on_reply(1, calls(&[("c1", "write")])).unwrap();
        let a = r
            .on_admission(1, "c1", Admission::Held { expires_at_ms: 100 })
            .unwrap();
        assert_eq!(r.state, State::AwaitingApproval);
        assert!(a.iter().any(|a| matches!(a, Action::AwaitDecision { .. })));
        let a = r.on_decision(2, "c1", decision.clone()).unwrap();
        assert_eq!(!dispatched(&a).is_empty(), dispatches, "{decision:?}");
        if !dispatches {
            assert_eq!(r.state, State::Ready);
            let o = observed(&a);
            assert!(o[0].contains("\"status\":\"REFUSED\""), "{o:?}");
        }
    }
    // No answer by the expiry: refused as expired.
    let mut r = record(Limits::default());
    r.begin_turn(0, 10).unwrap();
    r.on_reply(1, calls(&[("c1", "write")])).unwrap();
    r.on_admission(1, "c1", Admission::Held { expires_at_ms: 100 })
        .unwrap();
    assert!(r.on_tick(99).unwrap().is_empty());
    let a = r.on_tick(100).unwrap();
    assert!(observed(&a)[0].contains("APPROVAL_EXPIRED"));
    assert!(dispatched(&a).is_empty());
    assert_eq!(r.state, State::Ready);
}

/// An HTTP tool call whose tool the gate admitted and whose request it holds is a held call
/// like any (AWAITING_APPROVAL, the wait named by the request): approved, the call dispatches
/// with the tool call's own token (not the request's); refused, the model reads seed 004's
/// refusal and nothing dispatches; a harness refusal (`NotSent`) is read with its reason.
#[test]
fn a_held_http_request_awaits_approval_and_dispatches_with_the_calls_token() {
    let held = |r: &mut Record| {
        r.begin_turn(0, 10).unwrap();
        r.on_reply(1, calls(&[("c1", "write")])).unwrap();
        let request = HeldRequest {
            run: "t/c1".into(),
            key: "idem:c1".into(),
            tool: "http.POST".into(),
            url: "https://a.test/x".into(),
            token: "tool-token".into(),
        };
        let a = r
            .on_admission(
                1,
                "c1",
                Admission::RequestHeld {
                    expires_at_ms: 100,
                    request: request.clone(),
                },
            )
            .unwrap();
        assert_eq!(r.state, State::AwaitingApproval);
        assert!(a.iter().any(|a| matches!(a, Action::AwaitDecision { .. })));
        assert_eq!(r.held[0].request.as_ref(), Some(&request));
    };
    let mut r = record(Limits::default());
    held(&mut r);
    let a = r
        .on_decision(
            2,
            "c1",
            Decision::Approved {
                token: "request-token".into(),
            },
        )
        .unwrap();
    assert_eq!(dispatched_tokens(&a), ["tool-token"]);
    assert_eq!(r.state, State::WaitingTool);

    let mut r = record(Limits::default());
    held(&mut r);
    let a = r.on_decision(2, "c1", Decision::Denied).unwrap();
    assert!(dispatched(&a).is_empty());
    assert!(observed(&a)[0].contains("APPROVAL_DENIED"));
    assert_eq!(r.state, State::Ready);

    let mut r = record(Limits::default());
    r.begin_turn(0, 10).unwrap();
    r.on_reply(1, calls(&[("c1", "write")])).unwrap();
    let a = r
        .on_admission(
            1,
            "c1",
            Admission::NotSent {
                reason: "INVALID_ARGUMENTS".into(),
                message: "the path needs the argument \"id\"".into(),
            },
        )
        .unwrap();
    assert!(dispatched(&a).is_empty());
    let o = observed(&a);
    assert!(
        o.iter()
            .any(|o| o.contains("INVALID_ARGUMENTS") && o.contains("needs the argument")),
        "{o:?}"
    );
    assert_eq!(r.state, State::Ready);
}

/// A held call whose tool is approved and whose request is then held stays held, now for the
/// request (AWAITING_APPROVAL, the request's expiry, the wait named anew); a held request for a
/// call not held is dropped and changes nothing.
#[test]
fn a_tool_approved_whose_request_is_held_stays_awaiting_approval() {
    let mut r = record(Limits::default());
    r.begin_turn(0, 10).unwrap();
    r.on_reply(1, calls(&[("c1", "write")])).unwrap();
    r.on_admission(1, "c1", Admission::Held { expires_at_ms: 100 })
        .unwrap();
    let request = HeldRequest {
        run: "t/c1".into(),
        key: "idem:c1".into(),
        tool: "http.POST".into(),
        url: "https://a.test/x".into(),
        token: "tool-token".into(),
    };
    let a = r.on_request_held(2, "c1", 500, request.clone()).unwrap();
    assert!(
        matches!(&a[..], [Action::AwaitDecision { call }] if call.id == "c1"),
        "{a:?}"
    );
    assert_eq!(r.state, State::AwaitingApproval);
    assert_eq!(
        (r.held[0].expires_at_ms, r.held[0].request.as_ref()),
        (500, Some(&request))
    );
    let before = r.clone();
    let a = r.on_request_held(3, "c9", 500, request).unwrap();
    assert!(matches!(&a[..], [Action::Dropped { .. }]), "{a:?}");
    assert_eq!(r, before);
    let a = r
        .on_decision(
            4,
            "c1",
            Decision::Approved {
                token: "req".into(),
            },
        )
        .unwrap();
    assert_eq!(dispatched_tokens(&a), ["tool-token"]);
}

/// Seed 004: a human's review time is not the agent's compute. The 1 s wall clock is spent
/// 200 ms outside the approval wait and 100 s inside it: the trajectory goes on; then 900 ms
/// more outside a wait and it stops, naming the wall clock.
#[test]
fn time_awaiting_approval_does_not_count_against_the_wall_clock() {
    let mut r = record(Limits {
        wall_ms_max: Some(1_000),
        ..Limits::default()
    });
    r.begin_turn(0, 10).unwrap();
    r.on_reply(100, calls(&[("c1", "write")])).unwrap();
    r.on_admission(
        100,
        "c1",
        Admission::Held {
            expires_at_ms: 10_000_000,
        },
    )
    .unwrap();
    assert_eq!(r.state, State::AwaitingApproval);
    let a = r
        .on_decision(100_100, "c1", Decision::Approved { token: "k".into() })
        .unwrap();
    assert_eq!(dispatched(&a), ["c1"]);
    let a = r.on_tool_result(100_200, "c1", "ok".into()).unwrap();
    assert_eq!(r.state, State::Ready, "{a:?} {:?}", r.exit);
    assert_eq!(r.budget.review_ms, 100_000);
    let a = r.begin_turn(100_200, 10).unwrap();
    assert!(matches!(a[..], [Action::CallModel { .. }]), "{a:?}");
    r.on_reply(101_100, calls(&[("c2", "read")])).unwrap();
    r.on_admission(101_100, "c2", admitted("k2")).unwrap();
    r.on_tool_result(101_100, "c2", "ok".into()).unwrap();
    assert_eq!(
        r.exit,
        Some(Exit::BudgetExceeded {
            dimension: Dimension::WallClock
        })
    );
}

#[test]
fn budget_stages_steer_restrict_then_stop_naming_the_dimension() {
    let mut r = record(Limits {
        turns_max: Some(10),
        ..Limits::default()
    });
    let mut notices = Vec::new();
    for t in 0..10u64 {
        let a = r.begin_turn(t, 10).unwrap();
        let Some(Action::CallModel { steer, .. }) = a.last() else {
            panic!("{a:?}")
        };
        notices.push(steer.clone());
        if t == 9 {
            // Restricted: a write is refused even when the gate admits it.
            r.on_reply(t, calls(&[("w", "write")])).unwrap();
            let a = r.on_admission(t, "w", admitted("k")).unwrap();
            assert!(dispatched(&a).is_empty());
            assert!(observed(&a)[0].contains("NOT_GRANTED"));
        } else {
            r.on_reply(
                t,
                Reply::Finished {
                    finish: Finish::Length,
                    text: String::new(),
                    tool_calls: vec![],
                    usage: usage(),
                },
            )
            .unwrap();
        }
    }
    assert!(notices[..7].iter().all(Option::is_none));
    assert!(notices[7].as_deref().unwrap().contains("turns"));
    assert!(notices[9].as_deref().unwrap().contains("read-only"));
    assert!(r.grants.restricted);
    assert_eq!(r.state, State::Failed);
    assert_eq!(
        r.exit,
        Some(Exit::BudgetExceeded {
            dimension: Dimension::Turns
        })
    );
}

#[test]
fn a_model_end_runs_the_completion_check() {
    let mut r = record(Limits::default());
    r.begin_turn(0, 10).unwrap();
    let done = Reply::Finished {
        finish: Finish::Stop,
        text: "42".into(),
        tool_calls: vec![],
        usage: usage(),
    };
    let a = r.on_reply(1, done).unwrap();
    assert_eq!(r.state, State::Completed);
    assert!(matches!(
        a.last(),
        Some(Action::Ended {
            state: State::Completed
        })
    ));
    let mut r = record(Limits::default());
    r.begin_turn(0, 10).unwrap();
    let empty = Reply::Finished {
        finish: Finish::Stop,
        text: " ".into(),
        tool_calls: vec![],
        usage: usage(),
    };
    r.on_reply(1, empty).unwrap();
    assert_eq!(r.state, State::Failed, "an empty answer fails the check");
}

#[derive(Debug, Clone)]
enum Input {
    Turn,
    Reply(u8),
    Admit(u8, u8),
    Decide(u8, u8),
    Result(u8),
    Tick(u64),
    Control(u8),
}

fn input() -> impl Strategy<Value = Input> {
    prop_oneof![
        2 => Just(Input::Turn),
        2 => (0u8..7).prop_map(Input::Reply),
        3 => (0u8..3, 0u8..6).prop_map(|(c, v)| Input::Admit(c, v)),
        2 => (0u8..3, 0u8..4).prop_map(|(c, v)| Input::Decide(c, v)),
        3 => (0u8..3).prop_map(Input::Result),
        1 => (0u64..2_000).prop_map(Input::Tick),
        1 => (0u8..6).prop_map(Input::Control),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    /// Any sequence of inputs: state invariants hold after every step, terminal states absorb,
    /// a refused input changes nothing, and a call is dispatched only after its admission or
    /// approval, never from a truncated or cut reply.
    #[test]
    fn random_inputs_keep_the_invariants(inputs in proptest::collection::vec(input(), 1..80)) {
        let mut r = record(Limits { turns_max: Some(12), ..Limits::default() });
        // Backoffs within a few steps, so a walk goes on past failed calls.
        r.limits.retry.base_ms = 5;
        let mut now = 0u64;
        let mut cleared: std::collections::BTreeSet<String> = Default::default();
        for i in inputs {
            now += 10;
            let before = r.clone();
            let id = |c: u8| format!("c{c}");
            let res = match i.clone() {
                Input::Turn => r.begin_turn(now, 10),
                Input::Reply(k) => r.on_reply(now, match k {
                    0 => calls(&[("c0", "read"), ("c1", "write")]),
                    1 => calls(&[("c2", "write")]),
                    2 => Reply::Finished { finish: Finish::Length, text: String::new(), tool_calls: vec![ToolCall::new("c0", "read", "{")], usage: usage() },
                    3 => Reply::Cut { usage: None },
                    4 => Reply::Failed { error: "429".into(), retryable: true, usage: None, retry_after_ms: None },
                    5 => Reply::Overflow { overflow: Overflow::ToolCalls { index: 1 << 40, max: 128 }, usage: None },
                    _ => Reply::Finished { finish: Finish::Stop, text: "done".into(), tool_calls: vec![], usage: usage() },
                }),
                Input::Admit(c, v) => r.on_admission(now, &id(c), match v {
                    0 => admitted("k"),
                    1 => Admission::Held { expires_at_ms: now + 100 },
                    2 => Admission::Refused { reason: "denied".into() },
                    3 => Admission::RequestHeld { expires_at_ms: now + 100, request: HeldRequest {
                        run: format!("t/{}", id(c)), key: format!("idem:{}", id(c)),
                        tool: "http.POST".into(), url: "https://a.test/".into(), token: "k".into() } },
                    4 => Admission::NotSent { reason: "INVALID_ARGUMENTS".into(), message: "m".into() },
                    _ => Admission::Duplicate { status: "completed".into(), outcome: Some("r".into()) },
                }),
                Input::Decide(c, v) => r.on_decision(now, &id(c), match v {
                    0 => Decision::Approved { token: "k".into() },
                    1 => Decision::Denied,
                    2 => Decision::Expired,
                    _ => Decision::Canceled,
                }),
                Input::Result(c) => r.on_tool_result(now, &id(c), "ok".into()),
                Input::Tick(dt) => { now += dt; r.on_tick(now) }
                Input::Control(k) => r.on_control(now, match k {
                    0 => Control::Cancel { reason: "x".into() },
                    1 => Control::Interrupt { message: "m".into() },
                    2 => Control::Pause,
                    3 => Control::Resume,
                    4 => Control::Kill { reason: "k".into() },
                    _ => Control::Budget { limits: Limits { turns_max: Some(3), ..Limits::default() } },
                }),
            };
            match &res {
                Err(_) => prop_assert_eq!(&r, &before, "a refused input changed the record"),
                Ok(actions) => {
                    if let Input::Admit(c, 0) = &i
                        && before.pending.iter().any(|p| p.call.id == id(*c))
                    {
                        cleared.insert(id(*c));
                    }
                    if let Input::Decide(c, 0) = &i { cleared.insert(id(*c)); }
                    let waiting = before.control.iter().any(|c| !matches!(c, Control::Budget { .. }));
                    prop_assert!(!waiting || dispatched(actions).is_empty(),
                        "dispatched past a waiting control request: {:?} {:?}", before.control, i);
                    for d in dispatched(actions) {
                        prop_assert!(cleared.contains(&d), "{} dispatched without admission: {:?}", d, i);
                    }
                    if before.state.is_terminal() {
                        prop_assert_eq!(r.state, before.state);
                        prop_assert!(actions.iter().all(|a| matches!(a, Action::Dropped { .. })), "{:?}", actions);
                    }
                }
            }
            match r.state {
                State::WaitingTool => prop_assert!(!r.pending.is_empty() && r.held.is_empty()),
                State::AwaitingApproval => prop_assert!(!r.held.is_empty()),
                State::Ready | State::Paused => prop_assert!(r.pending.is_empty() && r.held.is_empty()),
                State::Finalizing => prop_assert!(false, "FINALIZING is never left standing"),
                State::Completed | State::Failed | State::Canceled => {
                    prop_assert!(r.pending.is_empty() && r.held.is_empty() && r.leases.is_empty());
                    prop_assert_eq!(r.exit.as_ref().unwrap().terminal(), r.state);
                }
                State::CallingModel => {}
            }
            prop_assert!(r.budget.spend.turns <= 12);
        }
    }
}

/// A record whose reply proposing `tool` took the tokens to 92% (the restrict stage), the
/// call then held by the gate.
fn held_past_restrict(tool: &str, args: &str) -> Record {
    let mut r = record(Limits {
        tokens_max: Some(1_000),
        ..Limits::default()
    });
    r.begin_turn(0, 10).unwrap();
    let heavy = Reply::Finished {
        finish: Finish::ToolCalls,
        text: String::new(),
        tool_calls: vec![ToolCall::new("c1", tool, args)],
        usage: Some(Usage {
            uncached_input: 900,
            cached_input: 0,
            output: 20,
        }),
    };
    r.on_reply(1, heavy).unwrap();
    r.on_admission(1, "c1", Admission::Held { expires_at_ms: 100 })
        .unwrap();
    r
}

/// The reply proposing a write took the tokens to 92% (the restrict stage) and the gate held
/// the write. An approval arriving now must not dispatch it: the harness re-checks its own
/// grants before dispatch (the gate's re-check knows nothing of the harness's stages), and the
/// model reads `NOT_GRANTED` naming the restrict stage; the check is an audit line.
#[test]
fn an_approval_after_the_restrict_stage_does_not_dispatch_a_write() {
    let mut r = held_past_restrict("write", "{\"b\": 1, \"a\": 2}");
    let pre = r.held[0].preconditions.clone().expect("recorded when held");
    assert!(!pre.granted, "held after the restrict stage was reached");
    assert_eq!(
        pre.digest,
        call_digest(&ToolCall::new("c1", "write", "{\"a\":2,\"b\":1}"))
    );
    let a = r
        .on_decision(2, "c1", Decision::Approved { token: "k".into() })
        .unwrap();
    assert!(dispatched(&a).is_empty(), "{a:?}");
    let o = observed(&a);
    assert!(
        o[0].contains("NOT_GRANTED") && o[0].contains("restrict"),
        "{o:?}"
    );
    assert!(
        a.iter().any(
            |a| matches!(a, Action::Checked { outcome, .. } if outcome.contains("NOT_GRANTED"))
        ),
        "{a:?}"
    );
    assert_eq!(r.state, State::Ready);
    // A read approved in the same position still goes.
    let mut r = held_past_restrict("read", "{}");
    let a = r
        .on_decision(2, "c1", Decision::Approved { token: "k".into() })
        .unwrap();
    assert_eq!(dispatched(&a), ["c1"]);
    assert!(
        a.iter().any(
            |a| matches!(a, Action::Checked { outcome, .. } if outcome.contains("dispatched"))
        )
    );
}

/// The call approved is the call held: one whose arguments changed in the record since it was
/// held (its digest no longer the recorded one) is refused, not dispatched.
#[test]
fn an_approved_call_whose_digest_changed_is_not_dispatched() {
    let mut r = record(Limits::default());
    r.begin_turn(0, 10).unwrap();
    r.on_reply(1, calls(&[("c1", "write")])).unwrap();
    r.on_admission(1, "c1", Admission::Held { expires_at_ms: 100 })
        .unwrap();
    r.held[0].call.function.arguments = "{\"table\": \"prod\"}".into();
    let a = r
        .on_decision(2, "c1", Decision::Approved { token: "k".into() })
        .unwrap();
    assert!(dispatched(&a).is_empty(), "{a:?}");
    assert!(observed(&a)[0].contains("PRECONDITION_FAILED"), "{a:?}");
}

/// Seed 004's refusal carries the approval request as the gate showed it: the model reads
/// the approval's id, the quorum and who approved so far.
#[test]
fn a_refused_held_call_shows_the_quorum_to_the_model() {
    let mut r = record(Limits::default());
    r.begin_turn(0, 10).unwrap();
    r.on_reply(1, calls(&[("c1", "write")])).unwrap();
    r.on_admission(1, "c1", Admission::Held { expires_at_ms: 100 })
        .unwrap();
    r.on_quorum("c1", "ap-7".into(), 2, vec!["alice".into()])
        .unwrap();
    assert_eq!(r.held[0].quorum, 2);
    let a = r.on_tick(100).unwrap();
    let v: serde_json::Value = serde_json::from_str(&observed(&a)[0]).unwrap();
    assert_eq!(v["reason"], "APPROVAL_EXPIRED");
    assert_eq!(v["approval"], "ap-7");
    assert_eq!(v["quorum"], 2);
    assert_eq!(v["approvers"], serde_json::json!(["alice"]));
    // Quorum news for a call not held is dropped, never applied.
    let a = r.on_quorum("c9", "ap-9".into(), 1, vec![]).unwrap();
    assert!(matches!(a[..], [Action::Dropped { .. }]), "{a:?}");
}

fn answer(text: &str) -> Reply {
    Reply::Finished {
        finish: Finish::Stop,
        text: text.into(),
        tool_calls: vec![],
        usage: usage(),
    }
}

/// A trajectory whose identity carries `contract`.
fn contracted(limits: Limits, contract: Contract) -> Record {
    let mut r = record(limits);
    r.identity.contract = Some(contract);
    r
}

fn json_contract() -> Contract {
    Contract {
        answer_format: AnswerFormat::Json,
        required_keys: vec!["total".into()],
        must_call: vec!["read".into()],
        ..Contract::default()
    }
}

/// A call of `tool` proposed, admitted, dispatched and settled (`ok` or not) in one turn.
fn settle(r: &mut Record, at: u64, id: &str, tool: &str, ok: bool) {
    r.begin_turn(at, 10).unwrap();
    r.on_reply(at, calls(&[(id, tool)])).unwrap();
    r.on_admission(at, id, admitted("k")).unwrap();
    r.on_tool_outcome(at, id, "{}".into(), ok).unwrap();
    assert_eq!(r.state, State::Ready);
}

/// The contract's check fails: the model gets one more turn with a notice naming what failed
/// (model-visible, as a user message); failing again, the trajectory ends FAILED with the exit
/// naming the checks, never COMPLETED, and the record keeps what failed.
#[test]
fn a_failed_completion_check_gets_a_notice_turn_then_fails_naming_the_check() {
    let mut r = contracted(Limits::default(), json_contract());
    settle(&mut r, 0, "c1", "read", true);
    r.begin_turn(1, 10).unwrap();
    let a = r.on_reply(2, answer("{\"sum\": 3}")).unwrap();
    assert_eq!(r.state, State::Ready, "another turn, not an end: {a:?}");
    assert!(r.exit.is_none());
    let notice = observed(&a).pop().unwrap();
    assert!(
        notice.starts_with("[completion check failed: required_keys:") && notice.contains("total"),
        "{notice}"
    );
    let check = r.check.clone().unwrap();
    assert!(!check.passed);
    assert_eq!(check.notices, 1);
    assert_eq!(check.failed[0].check, "required_keys");
    assert!(matches!(
        r.begin_turn(3, 10).unwrap()[..],
        [Action::CallModel { .. }]
    ));
    let a = r.on_reply(4, answer("not json")).unwrap();
    assert_eq!(r.state, State::Failed);
    assert_eq!(
        r.exit,
        Some(Exit::CompletionCheckFailed {
            failed: vec!["answer_format".into()]
        })
    );
    assert!(matches!(
        a.last(),
        Some(Action::Ended {
            state: State::Failed
        })
    ));
    assert_eq!(r.check.as_ref().unwrap().failed[0].check, "answer_format");
    assert_eq!(r.turns, 3);
}

/// An answer that passes every check completes, the record saying what was checked; a call
/// that settled other than `ok` does not count for `must_call`.
#[test]
fn a_passing_completion_check_completes() {
    let mut r = contracted(Limits::default(), json_contract());
    settle(&mut r, 0, "c1", "read", false);
    r.begin_turn(1, 10).unwrap();
    r.on_reply(2, answer("{\"total\": 3}")).unwrap();
    assert_eq!(r.state, State::Ready, "the read did not settle ok");
    assert_eq!(r.check.as_ref().unwrap().failed[0].check, "must_call");
    settle(&mut r, 3, "c2", "read", true);
    r.begin_turn(4, 10).unwrap();
    r.on_reply(5, answer(" {\"total\": 3} ")).unwrap();
    assert_eq!(r.state, State::Completed);
    assert_eq!(r.exit, Some(Exit::Completed { check_passed: true }));
    let check = r.check.unwrap();
    assert!(check.passed && check.failed.is_empty());
    assert_eq!(
        check.checked,
        [
            "answer_nonempty",
            "answer_format",
            "required_keys",
            "must_call"
        ]
    );
    // `workspace_files` and `answer_matches` from what the runner saw.
    let c = Contract {
        answer_matches: Some("^done: \\d+$".into()),
        workspace_files: vec!["report.md".into()],
        attempts: 0,
        ..Contract::default()
    };
    let mut r = contracted(Limits::default(), c.clone());
    r.begin_turn(0, 10).unwrap();
    let world = World {
        files_present: vec!["report.md".into()],
    };
    r.on_reply_seen(1, answer("done: 7"), &world, u32::MAX)
        .unwrap();
    assert_eq!(r.state, State::Completed);
    let mut r = contracted(Limits::default(), c);
    r.begin_turn(0, 10).unwrap();
    r.on_reply_seen(1, answer("done: 7"), &World::default(), u32::MAX)
        .unwrap();
    assert_eq!(
        r.exit,
        Some(Exit::CompletionCheckFailed {
            failed: vec!["workspace_files".into()]
        }),
        "no attempts: FAILED at once"
    );
}

/// The budget decides first: a failed check with an attempt left on the last turn of the
/// budget ends BUDGET_EXCEEDED, with no model call for the attempt.
#[test]
fn the_budget_wins_over_a_completion_check_attempt() {
    let limits = Limits {
        turns_max: Some(1),
        ..Limits::default()
    };
    let mut r = contracted(limits, json_contract());
    r.begin_turn(0, 10).unwrap();
    let a = r.on_reply(1, answer("{}")).unwrap();
    assert!(
        !a.iter().any(|a| matches!(a, Action::CallModel { .. })),
        "{a:?}"
    );
    assert_eq!(r.state, State::Failed);
    assert_eq!(
        r.exit,
        Some(Exit::BudgetExceeded {
            dimension: Dimension::Turns
        })
    );
    assert_eq!(r.check.as_ref().unwrap().notices, 1);
}

/// The contract is in the identity and the check's state in the record: a trajectory resumed
/// from its journalled record (JSON, as the journal keeps it) after a notice turn keeps both,
/// so the attempt given is not given again.
#[test]
fn a_resumed_trajectory_keeps_its_contract_and_attempts() {
    let mut r = contracted(Limits::default(), json_contract());
    r.begin_turn(0, 10).unwrap();
    r.on_reply(1, answer("{}")).unwrap();
    assert_eq!(r.check.as_ref().unwrap().notices, 1);
    let dir = tempfile::tempdir().unwrap();
    {
        let (j, _) = estop_harness::journal::Journal::open(dir.path()).unwrap();
        j.write(&[estop_harness::journal::Entry::Record {
            record: Box::new(r.clone()),
        }])
        .unwrap();
    }
    let (_, got) = estop_harness::journal::Journal::open(dir.path()).unwrap();
    let mut r2 = got.records["t1"].clone();
    assert_eq!(r2, r);
    assert_eq!(r2.identity.contract, Some(json_contract()));
    r2.begin_turn(2, 10).unwrap();
    r2.on_reply(3, answer("{}")).unwrap();
    assert_eq!(
        r2.exit,
        Some(Exit::CompletionCheckFailed {
            failed: vec!["required_keys".into(), "must_call".into()]
        })
    );
}

/// Credential handles: the restrict stage (90%) releases those of tools that are not
/// read-only, FINALIZING the rest; no secret is in a lease.
#[test]
fn credential_leases_are_released_at_the_restrict_stage_and_finalizing() {
    let mut r = record(Limits {
        turns_max: Some(10),
        ..Limits::default()
    });
    let lease = |tool: &str| Lease {
        id: format!("{tool}@api.example"),
        kind: "credential".into(),
        tool: Some(tool.into()),
    };
    r.leases = vec![lease("read"), lease("write")];
    // Failed calls retried without a wait, as often as the budget allows.
    r.limits.retry.base_ms = 0;
    r.limits.retry.retries_max = 100;
    for t in 0..9 {
        r.begin_turn(t, 10).unwrap();
        r.on_reply(
            t,
            Reply::Failed {
                error: "x".into(),
                retryable: true,
                usage: usage(),
                retry_after_ms: None,
            },
        )
        .unwrap();
    }
    assert_eq!(r.leases.len(), 2, "below 90%: both held");
    let a = r.begin_turn(9, 10).unwrap();
    assert!(r.grants.restricted);
    assert_eq!(r.leases, [lease("read")]);
    assert!(
        a.iter()
            .any(|a| matches!(a, Action::Release { lease } if lease.id == "write@api.example")),
        "{a:?}"
    );
    let a = r.on_reply(10, answer("done")).unwrap();
    assert!(r.leases.is_empty());
    assert!(
        a.iter()
            .any(|a| matches!(a, Action::Release { lease } if lease.id == "read@api.example")),
        "{a:?}"
    );
}

fn failed(retry_after_ms: Option<u64>) -> Reply {
    Reply::Failed {
        error: "HTTP 500".into(),
        retryable: true,
        usage: None,
        retry_after_ms,
    }
}

/// Issue 28: failed calls were retried at once (12 in 43 ms). Each failure in a row now waits
/// longer — the ceiling doubles from `base_ms` to `cap_ms` (the jitter drawn at its ceiling
/// here) — no turn begins before the wait ends, each retry is an audit action and the record's
/// `backoff`, and past `retries_max` the trajectory ends FAILED naming the last error.
#[test]
fn failed_calls_back_off_exponentially_and_end_after_the_retry_bound() {
    let mut r = record(Limits::default());
    r.limits.retry = estop_harness::retry::Retry {
        base_ms: 100,
        cap_ms: 1_000,
        retries_max: 5,
        retry_after_max_ms: 10_000,
    };
    let mut now = 0;
    let mut delays = Vec::new();
    for n in 1..=5u32 {
        r.begin_turn(now, 10).unwrap();
        let a = r.on_reply(now, failed(None)).unwrap();
        assert_eq!(r.state, State::Ready);
        let b = r.backoff.clone().expect("backing off");
        assert_eq!((b.failures, b.until_ms), (n, now + b.delay_ms));
        assert!(
            a.iter()
                .any(|a| matches!(a, Action::Retry { attempt, delay_ms, .. }
                if *attempt == n && *delay_ms == b.delay_ms)),
            "{a:?}"
        );
        // Not a moment early.
        assert!(r.begin_turn(b.until_ms - 1, 10).is_err());
        assert_eq!(r.state, State::Ready);
        delays.push(b.delay_ms);
        now = b.until_ms;
    }
    assert_eq!(delays, [100, 200, 400, 800, 1_000]);
    r.begin_turn(now, 10).unwrap();
    r.on_reply(now, failed(None)).unwrap();
    assert_eq!(r.state, State::Failed);
    assert!(
        matches!(&r.exit, Some(Exit::Error { error }) if error.contains("6 failures in a row") && error.contains("HTTP 500")),
        "{:?}",
        r.exit
    );
}

/// A provider's `Retry-After` is a floor of the wait (capped by `retry_after_max_ms`); a
/// reply that comes resets the count; the draw's jitter stays under the ceiling.
#[test]
fn retry_after_is_a_floor_and_a_reply_resets_the_backoff() {
    let mut r = record(Limits::default());
    r.begin_turn(0, 10).unwrap();
    r.on_reply_seen(0, failed(Some(1_000)), &World::default(), 0)
        .unwrap();
    assert_eq!(r.backoff.as_ref().unwrap().delay_ms, 1_000);
    r.begin_turn(1_000, 10).unwrap();
    r.on_reply_seen(1_000, failed(Some(3_600_000)), &World::default(), 0)
        .unwrap();
    let cap = r.limits.retry.retry_after_max_ms;
    assert_eq!(r.backoff.as_ref().unwrap().delay_ms, cap);
    let at = 1_000 + cap;
    r.begin_turn(at, 10).unwrap();
    r.on_reply_seen(at, failed(None), &World::default(), u32::MAX / 2)
        .unwrap();
    let b = r.backoff.clone().unwrap();
    assert_eq!(b.failures, 3);
    assert!(b.delay_ms <= r.limits.retry.ceiling_ms(3) / 2 + 1, "{b:?}");
    r.begin_turn(b.until_ms, 10).unwrap();
    r.on_reply(b.until_ms, calls(&[("c1", "read")])).unwrap();
    assert_eq!(r.backoff, None, "a reply ends the run of failures");
}

/// A stop does not wait out a backoff: READY is a boundary, so a cancel, a pause or a kill
/// applies the moment it arrives.
#[test]
fn a_stop_during_a_backoff_applies_at_once() {
    for control in [
        Control::Cancel {
            reason: "op".into(),
        },
        Control::Pause,
        Control::Kill {
            reason: "op".into(),
        },
    ] {
        let mut r = record(Limits::default());
        r.begin_turn(0, 10).unwrap();
        r.on_reply(0, failed(Some(60_000))).unwrap();
        assert!(r.backoff.is_some());
        r.on_control(1, control.clone()).unwrap();
        let want = match control {
            Control::Cancel { .. } => State::Canceled,
            Control::Pause => State::Paused,
            _ => State::Failed,
        };
        assert_eq!(r.state, want, "{control:?}");
    }
}

/// Issue 28: a call whose arguments are not JSON was dropped and the identical request sent
/// again. Now it is answered to the model as a tool error (role `tool`, its `tool_call_id`,
/// `INVALID_ARGUMENTS` naming the problem, bounded), nothing of it is admitted, an audit line
/// records it; a valid call beside it goes to the gate; with none valid the next turn comes.
#[test]
fn invalid_tool_call_arguments_are_answered_to_the_model() {
    let huge = format!("{{\"t\": \"{}", "x".repeat(100_000));
    let reply = |calls: Vec<ToolCall>| Reply::Finished {
        finish: Finish::ToolCalls,
        text: String::new(),
        tool_calls: calls,
        usage: usage(),
    };
    let mut r = record(Limits::default());
    r.begin_turn(0, 10).unwrap();
    let a = r
        .on_reply(
            1,
            reply(vec![
                ToolCall::new("c1", "write", &huge),
                ToolCall::new("c2", "read", "[1, 2]"),
                ToolCall::new("c3", "read", "{\"q\": 1}"),
            ]),
        )
        .unwrap();
    let admitted: Vec<&str> = a
        .iter()
        .filter_map(|a| match a {
            Action::Admit { calls } => Some(calls.iter().map(|c| c.id.as_str())),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(admitted, ["c3"], "only the valid call goes to the gate");
    let tool_errors: Vec<(String, serde_json::Value)> = a
        .iter()
        .filter_map(|a| match a {
            Action::Observe { message } if message.tool_call_id.is_some() => Some((
                message.tool_call_id.clone().unwrap(),
                serde_json::from_str(message.content.as_deref().unwrap()).unwrap(),
            )),
            _ => None,
        })
        .collect();
    assert_eq!(tool_errors.len(), 2, "{a:?}");
    assert_eq!(tool_errors[0].0, "c1");
    assert_eq!(tool_errors[0].1["reason"], "INVALID_ARGUMENTS");
    let m = tool_errors[0].1["message"].as_str().unwrap();
    assert!(m.contains("not valid JSON"), "{m}");
    assert!(m.len() < 1_024, "bounded: {}", m.len());
    assert_eq!(tool_errors[1].0, "c2");
    assert!(
        tool_errors[1].1["message"]
            .as_str()
            .unwrap()
            .contains("not an object (they are an array)")
    );
    assert_eq!(
        a.iter()
            .filter(|a| matches!(a, Action::Checked { outcome, .. } if outcome.contains("INVALID_ARGUMENTS")))
            .count(),
        2
    );
    assert_eq!(r.pending.len(), 1);
    assert_eq!(r.state, State::CallingModel, "admitting c3");

    // Every call invalid: READY for the next turn, nothing admitted.
    let mut r = record(Limits::default());
    r.begin_turn(0, 10).unwrap();
    let a = r
        .on_reply(1, reply(vec![ToolCall::new("c1", "write", "{")]))
        .unwrap();
    assert!(!a.iter().any(|a| matches!(a, Action::Admit { .. })));
    assert_eq!(r.state, State::Ready);
    assert!(r.pending.is_empty());
    assert_eq!(observed(&a).len(), 1);
}
