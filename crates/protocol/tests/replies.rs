//! Reply and event rendering: exact envelopes, and every payload decodes back to itself
//! through the client-side parser.

use std::collections::BTreeMap;
use std::fmt::Debug;

use estop_kernel::vocab::{HoldReason, RefusalReason};
use estop_protocol::server_line::{ack_line, error_line, event_line, ok_line, pong_line};
use estop_protocol::{
    Ack, Awaiting, BudgetLine, ClientReply, DecideReply, EffectCounts, ErrorCode, Event, EventKind,
    HelloReply, Id, LedgerEntry, LedgerReply, PendingItem, PendingReply, Pong, RawJson, Report,
    ReportItem, RunReplay, RunView, RunsReply, Secret, ServerLine, SubscribeReply, TokenCreated,
    VerdictReply, parse_request, parse_server_line,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

fn text(line: &[u8]) -> &str {
    std::str::from_utf8(line).expect("utf8")
}

fn reply_of(line: &[u8]) -> ClientReply {
    match parse_server_line(line) {
        Ok(ServerLine::Reply(r)) => r,
        other => panic!("{}: {other:?}", text(line)),
    }
}

/// Renders `body` under several ids and checks the client decodes the same id and body.
fn round_trip<T: Serialize + DeserializeOwned + PartialEq + Debug>(body: T) {
    for id in [Id::from_u64(7), Id::from_text("req \"x\""), Id::NULL] {
        let line = ok_line(&id, &body);
        assert_eq!(line.last(), Some(&b'\n'));
        assert_eq!(
            line.iter().filter(|&&b| b == b'\n').count(),
            1,
            "one line: {}",
            text(&line)
        );
        let r = reply_of(&line);
        assert!(r.ok && r.error.is_none());
        assert_eq!(r.id, id);
        assert_eq!(
            r.body::<T>().expect("body decodes"),
            body,
            "{}",
            text(&line)
        );
    }
}

#[test]
fn envelopes_are_exact() {
    assert_eq!(
        text(&ack_line(&Id::from_u64(1))),
        "{\"id\":1,\"ok\":true}\n"
    );
    assert_eq!(
        text(&pong_line(&Id::NULL)),
        "{\"id\":null,\"ok\":true,\"pong\":true}\n"
    );
    assert_eq!(
        text(&ok_line(
            &Id::from_text("a"),
            &VerdictReply::Admitted {
                token: "tk".into(),
                epoch: 3
            }
        )),
        "{\"id\":\"a\",\"ok\":true,\"verdict\":\"admitted\",\"token\":\"tk\",\"epoch\":3}\n"
    );
    assert_eq!(
        text(&ok_line(
            &Id::from_u64(2),
            &VerdictReply::Held {
                approval: None,
                expires_at: None,
                reason: HoldReason::Sibling
            }
        )),
        "{\"id\":2,\"ok\":true,\"verdict\":\"held\",\"approval\":null,\"expires_at\":null,\"reason\":\"sibling\"}\n"
    );
    assert_eq!(
        text(&ok_line(&Id::from_u64(3), &VerdictReply::Go)),
        "{\"id\":3,\"ok\":true,\"verdict\":\"go\"}\n"
    );
    assert_eq!(
        text(&error_line(
            &Id::from_u64(4),
            ErrorCode::NotFound,
            "no run \"r\""
        )),
        "{\"id\":4,\"ok\":false,\"error\":{\"code\":\"not_found\",\"message\":\"no run \\\"r\\\"\"}}\n"
    );
    assert_eq!(
        text(&ok_line(
            &Id::from_u64(5),
            &Ack {
                late: true,
                ..Ack::default()
            }
        )),
        "{\"id\":5,\"ok\":true,\"late\":true}\n"
    );
}

/// `subscribe`'s reply: the plain ack when there is nothing to replay (the same bytes as
/// `ack_line`, so a run not created and another principal's cannot be told apart); otherwise
/// the run's state, with `awaiting` always present.
#[test]
fn a_subscribe_reply_is_the_plain_ack_or_the_replay() {
    let id = Id::from_u64(3);
    assert_eq!(ok_line(&id, &SubscribeReply::default()), ack_line(&id));
    let replay = SubscribeReply {
        replay: Some(RunReplay {
            run: "r".into(),
            state: "active".into(),
            epoch: 1,
            ..RunReplay::default()
        }),
    };
    assert_eq!(
        text(&ok_line(&id, &replay)),
        "{\"id\":3,\"ok\":true,\"run\":\"r\",\"state\":\"active\",\"epoch\":1,\"awaiting\":[]}\n"
    );
    let r = reply_of(&ack_line(&id));
    assert_eq!(
        estop_protocol::ReplyBody::decode(estop_protocol::Verb::Subscribe, &r).unwrap(),
        estop_protocol::ReplyBody::Subscribed(SubscribeReply::default())
    );
}

#[test]
fn the_id_of_a_request_comes_back_byte_for_byte() {
    for raw in ["1.50", "-0", "\"\\u0041\"", "12345678901234567890123"] {
        let req =
            parse_request(format!("{{\"id\":{raw},\"op\":\"ping\"}}").as_bytes()).expect("ping");
        let line = pong_line(&req.id);
        assert!(
            text(&line).starts_with(&format!("{{\"id\":{raw},")),
            "{}",
            text(&line)
        );
    }
}

#[test]
fn error_replies_decode() {
    for &code in ErrorCode::ALL {
        let r = reply_of(&error_line(&Id::from_u64(9), code, "why"));
        assert!(!r.ok);
        assert_eq!(r.id, Id::from_u64(9));
        let e = r.error.expect("error object");
        assert_eq!((e.kind(), e.message.as_str()), (Some(code), "why"));
    }
    let err = parse_request(br#"{"id":"x","op":"status"}"#).expect_err("missing run");
    let r = reply_of(&err.to_line());
    assert_eq!(r.id, Id::from_text("x"));
    assert_eq!(
        r.error.and_then(|e| e.kind()),
        Some(ErrorCode::MissingField)
    );
}

#[test]
fn every_payload_round_trips() {
    round_trip(HelloReply {
        role: "agent".into(),
        principal: "agent".into(),
        protocol: 1,
        component: None,
        line_bytes_max: None,
    });
    round_trip(HelloReply {
        role: "agent".into(),
        principal: "agent/order-42".into(),
        protocol: 1,
        component: Some("egress".into()),
        line_bytes_max: Some(65536),
    });
    round_trip(VerdictReply::Admitted {
        token: "t1".into(),
        epoch: 0,
    });
    round_trip(VerdictReply::Held {
        approval: Some("ap-1".into()),
        expires_at: Some(1_700_000_060_000),
        reason: HoldReason::Approval,
    });
    round_trip(VerdictReply::Held {
        approval: None,
        expires_at: None,
        reason: HoldReason::Paused,
    });
    round_trip(VerdictReply::Refused {
        reason: RefusalReason::Budget,
        message: Some("the model budget".into()),
        rule: None,
        budget: Some(estop_protocol::server_line::BudgetOver {
            dimension: "model_tokens".into(),
            run: "parent".into(),
            limit: 100,
            used: 99,
        }),
    });
    round_trip(VerdictReply::Refused {
        reason: RefusalReason::Cancelled,
        message: None,
        rule: None,
        budget: None,
    });
    round_trip(VerdictReply::Refused {
        reason: RefusalReason::Denied,
        message: Some("when failed".into()),
        rule: Some("no-prod".into()),
        budget: None,
    });
    round_trip(VerdictReply::Duplicate {
        status: "in_progress".into(),
        outcome: None,
        result: None,
        error: None,
    });
    round_trip(VerdictReply::Duplicate {
        status: "completed".into(),
        outcome: Some("ok".into()),
        result: Some(json!({"charge": "ch_1", "n": [1, 2.5]})),
        error: None,
    });
    round_trip(VerdictReply::Go);
    round_trip(Ack::default());
    round_trip(Ack {
        late: true,
        state: Some("finalizing".into()),
        runs: vec!["r1".into(), "r1.child".into()],
        ..Ack::default()
    });
    round_trip(Ack {
        state: Some("finalizing".into()),
        runs: vec!["r1".into()],
        in_flight: Some(Box::new(estop_protocol::InFlightList(vec![
            estop_protocol::InFlight {
                run: "r1".into(),
                key: "http:1".into(),
                tool: "http.POST".into(),
                args: Some(estop_protocol::RawJson::new(std::sync::Arc::from(
                    r#"{"method":"POST","url":"https://h/o"}"#,
                ))),
            },
        ]))),
        ..Ack::default()
    });
    round_trip(Ack {
        status: Some("compensation_failed".into()),
        attempt: Some(2),
        retry_at: Some(1_700_000_002_000),
        ..Ack::default()
    });
    round_trip(Pong { pong: true });
    round_trip(SubscribeReply::default());
    round_trip(SubscribeReply {
        replay: Some(RunReplay {
            run: "r1".into(),
            state: "active".into(),
            epoch: 1,
            awaiting: vec![
                Awaiting {
                    key: "k1".into(),
                    status: "held".into(),
                    approval: Some("r1#1".into()),
                },
                Awaiting {
                    key: "k2".into(),
                    status: "held".into(),
                    approval: None,
                },
            ],
            more: true,
            ..RunReplay::default()
        }),
    });
    round_trip(SubscribeReply {
        replay: Some(RunReplay {
            run: "r1".into(),
            state: "cancelled".into(),
            epoch: 2,
            cause: Some("killed".into()),
            reason: Some("stop".into()),
            awaiting: vec![],
            more: false,
        }),
    });
    let view = RunView {
        run: "r1".into(),
        state: "active".into(),
        epoch: 2,
        owner: "agent".into(),
        parent: Some("r0".into()),
        labels: BTreeMap::from([("team".into(), "pay".into())]),
        created_at: 1_700_000_000_000,
        cause: None,
        reason: None,
        stopped_at: None,
        deadline_at: Some(1_700_000_100_000),
        max_effects: Some(50),
        effects: EffectCounts {
            held: 1,
            admitted: 2,
            started: 3,
            completed: 4,
            failed: 5,
            unknown: 6,
            refused: 7,
        },
        budget: vec![BudgetLine {
            dimension: "model_usd".into(),
            spent: 5,
            reserved: 2,
            limit: Some(10),
        }],
        forgotten: false,
    };
    round_trip(view.clone());
    round_trip(RunsReply {
        runs: vec![
            view,
            RunView {
                run: "r2".into(),
                state: "cancelled".into(),
                cause: Some("cancelled".into()),
                reason: Some("by hand \u{202e}".into()),
                ..RunView::default()
            },
            RunView {
                run: "r3".into(),
                state: "completed".into(),
                cause: Some("closed".into()),
                stopped_at: Some(5),
                forgotten: true,
                ..RunView::default()
            },
        ],
        more: true,
        next: Some("r2".into()),
    });
    round_trip(PendingReply {
        pending: vec![
            PendingItem {
                approval: "ap-1".into(),
                run: "r1".into(),
                key: "k1".into(),
                tool: "refund".into(),
                args: Some(RawJson::new(r#"{"amount":10}"#.into())),
                digest: "ab".repeat(32),
                rule: Some("refunds".into()),
                quorum: 2,
                approvals: vec!["alice".into()],
                groups: vec!["finance".into(), "ops".into()],
                expires_at: 2,
                created_at: 1,
                compensates: None,
            },
            PendingItem {
                approval: "r1#2".into(),
                run: "r1".into(),
                key: "k2".into(),
                tool: "unrefund".into(),
                args: Some(RawJson::new(r#"{"refund":"re_1"}"#.into())),
                digest: "cd".repeat(32),
                rule: None,
                quorum: 2,
                approvals: vec![],
                groups: vec![],
                expires_at: 3,
                created_at: 1,
                compensates: Some("refund".into()),
            },
        ],
        more: true,
        next: Some(r#"[2,"r1","k1"]"#.into()),
    });
    round_trip(DecideReply {
        status: "held".into(),
        approvals: vec!["alice".into()],
        quorum: 2,
    });
    let mut fields = serde_json::Map::new();
    fields.insert("verdict".into(), json!("admitted"));
    fields.insert("tool".into(), json!("refund"));
    round_trip(LedgerReply {
        entries: vec![
            LedgerEntry {
                seq: 1,
                at: 10,
                kind: "admit".into(),
                run: Some("r1".into()),
                key: Some("k1".into()),
                fields,
            },
            LedgerEntry {
                seq: 2,
                at: 11,
                kind: "token".into(),
                run: None,
                key: None,
                fields: serde_json::Map::new(),
            },
        ],
        next_after: Some(2),
    });
    let item = |key: &str, status: &str, rev: &str| ReportItem {
        key: key.into(),
        tool: "t".into(),
        status: status.into(),
        reversibility: rev.into(),
        compensate: None,
        late: false,
        reason: None,
        attempts: None,
        attempts_max: None,
        retry_at: None,
        note: None,
        by: None,
        lookup: Some("find_t".into()),
        lookups: Some(1),
        chosen: true,
        holder: Some("egress".into()),
        disputes: Some(2),
        args: Some(estop_protocol::RawJson::new(std::sync::Arc::from(
            r#"{"method":"GET","url":"http://h/x"}"#,
        ))),
        http_status: Some(200),
        bytes: Some(2),
        error: Some("sent, no answer: cut".into()),
    };
    round_trip(Report {
        run: "r0".into(),
        state: "cancelled".into(),
        cause: Some("cancelled".into()),
        stopped_at: Some(7),
        forgotten: true,
        ..Report::default()
    });
    round_trip(Report {
        run: "r1".into(),
        state: "cancelled".into(),
        cause: Some("cancelled".into()),
        reason: Some("enough\n\u{1b}[0m".into()),
        stopped_at: Some(7),
        forgotten: false,
        budget: vec![estop_protocol::server_line::BudgetLine {
            dimension: "model_usd".into(),
            spent: 5,
            reserved: 2,
            limit: Some(9),
        }],
        done: vec![
            ReportItem {
                compensate: Some("refund.undo".into()),
                ..item("a", "completed", "compensable")
            },
            ReportItem {
                compensate: Some("refund.undo".into()),
                attempts: Some(2),
                attempts_max: Some(5),
                retry_at: Some(9),
                note: Some("503".into()),
                by: Some("alice".into()),
                ..item("g", "compensation_failed", "compensable")
            },
        ],
        failed: vec![item("b", "failed", "undeclared")],
        refused: vec![ReportItem {
            reason: Some("cancelled".into()),
            ..item("c", "refused", "undeclared")
        }],
        in_flight: vec![item("d", "started", "irreversible")],
        unknown: vec![ReportItem {
            late: true,
            ..item("e", "unknown", "reversible")
        }],
        compensable: vec![item("a", "completed", "compensable")],
        irreversible: vec![item("d", "started", "irreversible")],
        undeclared: vec![item("b", "failed", "undeclared")],
        held: vec![item("f", "held", "undeclared")],
        saga_next: Some(estop_protocol::SagaNext {
            key: "g".into(),
            waits: "executor".into(),
            attempt: Some(3),
            at: Some(9),
            approval: None,
        }),
        more: false,
        next: None,
    });
    round_trip(TokenCreated {
        name: "bob".into(),
        role: "operator".into(),
        token: Secret::new("s3"),
        groups: vec!["ops".into()],
    });
}

#[test]
fn token_secret_is_on_the_wire_but_not_in_debug() {
    let created = TokenCreated {
        name: "bob".into(),
        role: "agent".into(),
        token: Secret::new("hunter2"),
        groups: vec![],
    };
    assert!(text(&ok_line(&Id::from_u64(1), &created)).contains("\"token\":\"hunter2\""));
    assert!(!format!("{created:?}").contains("hunter2"));
}

#[test]
fn events_have_no_id_and_decode_as_events() {
    let ev = Event {
        event: EventKind::Cancelled,
        run: "r1".into(),
        key: None,
        reason: Some("operator".into()),
        decision: None,
        outcome: None,
        attempt: None,
        tool: None,
        args: None,
        idempotency_key: None,
        at: 1_700_000_000_000,
    };
    let line = event_line(&ev);
    assert_eq!(
        text(&line),
        "{\"event\":\"cancelled\",\"run\":\"r1\",\"reason\":\"operator\",\"at\":1700000000000}\n"
    );
    assert_eq!(parse_server_line(&line).ok(), Some(ServerLine::Event(ev)));
    let decided = Event {
        event: EventKind::Decided,
        run: "r1".into(),
        key: Some("k1".into()),
        reason: None,
        decision: Some("approve".into()),
        outcome: None,
        attempt: None,
        tool: None,
        args: None,
        idempotency_key: None,
        at: 5,
    };
    assert_eq!(
        parse_server_line(&event_line(&decided)).ok(),
        Some(ServerLine::Event(decided))
    );
    // An executor's `compensate`: what to run, with the key to pass downstream.
    let compensate = br#"{"event":"compensate","run":"r1","key":"k1","attempt":2,"tool":"unrefund","args":{"charge":"ch_1"},"idempotency_key":"k1/undo","at":9}"#;
    let Ok(ServerLine::Event(ev)) = parse_server_line(compensate) else {
        panic!("a compensate event decodes as an event");
    };
    assert_eq!(
        (
            ev.event,
            ev.attempt,
            ev.tool.as_deref(),
            ev.idempotency_key.as_deref()
        ),
        (
            EventKind::Compensate,
            Some(2),
            Some("unrefund"),
            Some("k1/undo")
        )
    );
    assert_eq!(ev.args, Some(json!({"charge": "ch_1"})));
    assert_eq!(
        parse_server_line(&event_line(&ev)).ok(),
        Some(ServerLine::Event(ev))
    );
    // A kind from a newer server still decodes.
    let newer = parse_server_line(br#"{"event":"teleported","run":"r","at":1}"#);
    assert!(matches!(
        newer,
        Ok(ServerLine::Event(Event {
            event: EventKind::Other,
            ..
        }))
    ));
}

#[test]
fn every_event_kind_renders_its_name() {
    for (kind, name) in [
        (EventKind::Cancelled, "cancelled"),
        (EventKind::Paused, "paused"),
        (EventKind::Resumed, "resumed"),
        (EventKind::Decided, "decided"),
        (EventKind::Held, "held"),
        (EventKind::Completed, "completed"),
        (EventKind::Closed, "closed"),
        (EventKind::Finalizing, "finalizing"),
        (EventKind::Compensation, "compensation"),
        (EventKind::Compensate, "compensate"),
    ] {
        let ev = Event {
            event: kind,
            run: "r".into(),
            key: None,
            reason: None,
            decision: None,
            outcome: None,
            attempt: None,
            tool: None,
            args: None,
            idempotency_key: None,
            at: 0,
        };
        assert!(text(&event_line(&ev)).starts_with(&format!("{{\"event\":\"{name}\",")));
    }
}

#[test]
fn server_lines_that_are_not_json_are_errors() {
    assert!(parse_server_line(b"nope").is_err());
    assert!(
        parse_server_line(br#"{"id":1}"#).is_err(),
        "a reply needs ok"
    );
}
