//! The state machine under random moves: no illegal path is reachable, a refused move changes
//! nothing, terminal states absorb, and every terminal state is entered from FINALIZING.

use estop_harness::budget::{Budget, Limits, Prices};
use estop_harness::chat::ToolCall;
use estop_harness::machine::{Cause, LEGAL, State, transition};
use estop_harness::record::{
    CallLimits, Exit, Grants, HeldCall, Identity, Lease, PendingCall, Phase, Record,
};
use proptest::prelude::*;

pub fn record() -> Record {
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
            tool_deadline_ms: 1_000,
            retry: Default::default(),
        },
        Budget::new(Limits::default(), Prices::default(), 0),
        Grants {
            tools: Vec::new(),
            restricted: false,
        },
        "log".into(),
    )
}

#[derive(Debug, Clone)]
enum Step {
    Move(usize, usize),
    Pending(bool),
    Held(bool),
    Lease(bool),
    Exit(usize),
}

fn cause(i: usize) -> Cause {
    [
        Cause::Scheduled,
        Cause::Observed,
        Cause::Dispatched,
        Cause::Held,
        Cause::Decided,
        Cause::Refused,
        Cause::ToolsDone,
        Cause::Pause,
        Cause::Resume,
        Cause::Exit,
        Cause::Finalized,
    ][i % 11]
        .clone()
}

fn exit(i: usize) -> Option<Exit> {
    match i % 6 {
        0 => None,
        1 => Some(Exit::Completed { check_passed: true }),
        2 => Some(Exit::Completed {
            check_passed: false,
        }),
        3 => Some(Exit::Canceled { reason: "r".into() }),
        4 => Some(Exit::Killed { reason: "r".into() }),
        _ => Some(Exit::BudgetExceeded {
            dimension: estop_harness::budget::Dimension::Turns,
        }),
    }
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0usize..9, 0usize..11).prop_map(|(s, c)| Step::Move(s, c)),
        1 => any::<bool>().prop_map(Step::Pending),
        1 => any::<bool>().prop_map(Step::Held),
        1 => any::<bool>().prop_map(Step::Lease),
        1 => (0usize..6).prop_map(Step::Exit),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn no_illegal_path_is_reachable(steps in proptest::collection::vec(step(), 1..60)) {
        let mut rec = record();
        let call = ToolCall::new("c1", "t", "{}");
        for s in steps {
            let before = rec.clone();
            match s {
                Step::Move(to, c) => {
                    let to = State::ALL[to];
                    match transition(&mut rec, to, cause(c)) {
                        Ok(from) => {
                            prop_assert_eq!(from, before.state);
                            prop_assert!(LEGAL.contains(&(from, to)), "{} -> {}", from, to);
                            prop_assert!(!from.is_terminal(), "terminal {} left", from);
                            if to.is_terminal() {
                                prop_assert_eq!(from, State::Finalizing);
                                prop_assert!(rec.pending.is_empty() && rec.held.is_empty());
                                prop_assert!(rec.leases.is_empty());
                                prop_assert_eq!(rec.exit.as_ref().unwrap().terminal(), to);
                            }
                            if to == State::Finalizing {
                                prop_assert!(rec.exit.is_some());
                            }
                            if from == State::AwaitingApproval && to == State::WaitingTool {
                                prop_assert_eq!(cause(c), Cause::Decided);
                            }
                        }
                        Err(_) => prop_assert_eq!(&rec, &before, "a refused move changed the record"),
                    }
                }
                Step::Pending(on) => {
                    rec.pending = if on {
                        vec![PendingCall { call: call.clone(), phase: Phase::Dispatched { deadline_ms: 9, token: "k".into() } }]
                    } else { Vec::new() }
                }
                Step::Held(on) => {
                    rec.held = if on { vec![HeldCall::new(call.clone(), 9)] } else { Vec::new() }
                }
                Step::Lease(on) => {
                    rec.leases = if on { vec![Lease { id: "w".into(), kind: "workspace".into(), tool: None }] } else { Vec::new() }
                }
                Step::Exit(i) => rec.exit = exit(i),
            }
            if before.state.is_terminal() {
                prop_assert_eq!(rec.state, before.state, "a terminal state was left");
            }
        }
    }
}

/// Every (from, to) pair: legal ones pass when their guard's facts hold, the rest are refused
/// and change nothing.
#[test]
fn every_pair_applies_or_is_refused() {
    for from in State::ALL {
        for to in State::ALL {
            let mut rec = record();
            rec.state = from;
            rec.exit = Some(Exit::Canceled { reason: "x".into() });
            if from == State::AwaitingApproval && to == State::WaitingTool {
                rec.pending = vec![PendingCall {
                    call: ToolCall::new("c", "t", "{}"),
                    phase: Phase::Admitted { token: "k".into() },
                }];
            }
            let legal = LEGAL.contains(&(from, to))
                && !(from == State::Finalizing && to != State::Canceled);
            let before = rec.clone();
            let r = transition(&mut rec, to, Cause::Decided);
            assert_eq!(r.is_ok(), legal, "{from} -> {to}: {r:?}");
            if r.is_err() {
                assert_eq!(rec, before);
            }
        }
    }
}

/// Guards: WAITING_TOOL -> READY with a call pending is refused (an observation would be
/// missing); a held call does not leave for dispatch without a decision.
#[test]
fn guards_refuse_what_the_table_allows() {
    let mut rec = record();
    rec.state = State::WaitingTool;
    rec.pending = vec![PendingCall {
        call: ToolCall::new("c", "t", "{}"),
        phase: Phase::Dispatched {
            deadline_ms: 5,
            token: "k".into(),
        },
    }];
    assert!(transition(&mut rec, State::Ready, Cause::ToolsDone).is_err());
    rec.state = State::AwaitingApproval;
    rec.held = vec![HeldCall::new(ToolCall::new("h", "t", "{}"), 5)];
    assert!(transition(&mut rec, State::WaitingTool, Cause::Decided).is_err());
    rec.held.clear();
    assert!(transition(&mut rec, State::WaitingTool, Cause::Scheduled).is_err());
    assert!(transition(&mut rec, State::WaitingTool, Cause::Decided).is_ok());
    // No exit reason, no FINALIZING.
    assert!(transition(&mut rec, State::Finalizing, Cause::Exit).is_err());
}
